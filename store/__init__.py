"""checkpointq's checkpoint store: the model, its Go-compatible encoding, and the stores.

This package knows nothing of Celery; the worker and the producer client build on it.
"""

from checkpointq.store.base import (
    BatchOp,
    BatchResult,
    CheckpointStore,
    DeleteOp,
    Fence,
    Page,
    SaveOp,
    SaveResult,
    SessionCounts,
    StoreOptions,
)
from checkpointq.store.errors import (
    CheckpointError,
    CheckpointTooLarge,
    CorruptCheckpoint,
    InvalidCheckpoint,
    InvalidInput,
    InvalidSessionId,
    StoreUnavailable,
)
from checkpointq.store.keys import DEFAULT_PREFIX, KeySpace
from checkpointq.store.memory import InMemoryStore
from checkpointq.store.model import (
    Checkpoint,
    CheckpointMetadata,
    ConversationMessage,
    validate_session_id,
)
from checkpointq.store.redis import RedisStore
from checkpointq.store.serde import (
    checkpoint_from_wire,
    deserialize_checkpoint,
    serialize_checkpoint,
)

__all__ = [
    "DEFAULT_PREFIX",
    "BatchOp",
    "BatchResult",
    "Checkpoint",
    "CheckpointError",
    "CheckpointMetadata",
    "CheckpointStore",
    "CheckpointTooLarge",
    "ConversationMessage",
    "CorruptCheckpoint",
    "DeleteOp",
    "Fence",
    "InMemoryStore",
    "InvalidCheckpoint",
    "InvalidInput",
    "InvalidSessionId",
    "KeySpace",
    "Page",
    "RedisStore",
    "SaveOp",
    "SaveResult",
    "SessionCounts",
    "StoreOptions",
    "StoreUnavailable",
    "checkpoint_from_wire",
    "deserialize_checkpoint",
    "serialize_checkpoint",
    "validate_session_id",
]
