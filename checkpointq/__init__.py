"""checkpointq: persist AI-agent session checkpoints through a Celery queue, Go-compatibly.

The names below are the public API; ``__all__`` is the documented surface (README.md,
docs/). Each is imported on first use, from the module that defines it, so a producer that
imports ``CheckpointClient`` loads the producer and the store and never the worker (Celery's
worker, beat, metrics, the terminal view). The deep paths (``checkpointq.store``,
``checkpointq.tasks.producer.client``, ...) stay valid.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from checkpointq.store.base import StoreOptions
    from checkpointq.store.encryption import EncryptionError, Keyring, MissingEncryptionKey
    from checkpointq.store.errors import (
        CheckpointError,
        CheckpointTooLarge,
        CorruptCheckpoint,
        InvalidCheckpoint,
        InvalidInput,
        InvalidSessionId,
        StoreNotConfigured,
        StoreUnavailable,
    )
    from checkpointq.store.memory import InMemoryStore
    from checkpointq.store.model import Checkpoint, ConversationMessage
    from checkpointq.store.postgres import PostgresStore
    from checkpointq.store.redis import RedisStore
    from checkpointq.tasks.errors import (
        BrokerUnavailable,
        PendingRecordMissing,
        ReplicationTimeout,
        RequestRefused,
        SeqRefused,
        StoreMismatch,
    )
    from checkpointq.tasks.producer.aio import AsyncCheckpointClient
    from checkpointq.tasks.producer.aio_batching import AsyncBatchingClient
    from checkpointq.tasks.producer.batching import BatchingClient
    from checkpointq.tasks.producer.client import CheckpointClient
    from checkpointq.tasks.producer.outcomes import RequestOutcome
    from checkpointq.worker.settings import InvalidSettings, Settings

try:
    # The one version is pyproject.toml's, as installed (wheels and editable installs alike).
    __version__ = metadata.version("checkpointq")
except metadata.PackageNotFoundError:  # a checkout on sys.path without an install
    __version__ = "0+unknown"

#: Each public name and the module that defines it.
_HOMES = {
    "CheckpointClient": "checkpointq.tasks.producer.client",
    "AsyncCheckpointClient": "checkpointq.tasks.producer.aio",
    "AsyncBatchingClient": "checkpointq.tasks.producer.aio_batching",
    "ConversationMessage": "checkpointq.store.model",
    "BatchingClient": "checkpointq.tasks.producer.batching",
    "RequestOutcome": "checkpointq.tasks.producer.outcomes",
    "Settings": "checkpointq.worker.settings",
    "InvalidSettings": "checkpointq.worker.settings",
    "Checkpoint": "checkpointq.store.model",
    "RedisStore": "checkpointq.store.redis",
    "PostgresStore": "checkpointq.store.postgres",
    "InMemoryStore": "checkpointq.store.memory",
    "StoreOptions": "checkpointq.store.base",
    "Keyring": "checkpointq.store.encryption",
    "EncryptionError": "checkpointq.store.encryption",
    "MissingEncryptionKey": "checkpointq.store.encryption",
    "CheckpointError": "checkpointq.store.errors",
    "InvalidInput": "checkpointq.store.errors",
    "InvalidCheckpoint": "checkpointq.store.errors",
    "InvalidSessionId": "checkpointq.store.errors",
    "CheckpointTooLarge": "checkpointq.store.errors",
    "StoreNotConfigured": "checkpointq.store.errors",
    "StoreUnavailable": "checkpointq.store.errors",
    "CorruptCheckpoint": "checkpointq.store.errors",
    "BrokerUnavailable": "checkpointq.tasks.errors",
    "PendingRecordMissing": "checkpointq.tasks.errors",
    "ReplicationTimeout": "checkpointq.tasks.errors",
    "RequestRefused": "checkpointq.tasks.errors",
    "SeqRefused": "checkpointq.tasks.errors",
    "StoreMismatch": "checkpointq.tasks.errors",
}

__all__ = [
    "AsyncBatchingClient",
    "AsyncCheckpointClient",
    "BatchingClient",
    "BrokerUnavailable",
    "Checkpoint",
    "CheckpointClient",
    "CheckpointError",
    "CheckpointTooLarge",
    "ConversationMessage",
    "CorruptCheckpoint",
    "EncryptionError",
    "InMemoryStore",
    "InvalidCheckpoint",
    "InvalidInput",
    "InvalidSessionId",
    "InvalidSettings",
    "Keyring",
    "MissingEncryptionKey",
    "PendingRecordMissing",
    "PostgresStore",
    "RedisStore",
    "ReplicationTimeout",
    "RequestOutcome",
    "RequestRefused",
    "SeqRefused",
    "Settings",
    "StoreMismatch",
    "StoreNotConfigured",
    "StoreOptions",
    "StoreUnavailable",
    "__version__",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'checkpointq' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
