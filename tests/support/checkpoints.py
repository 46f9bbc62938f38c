"""Checkpoint builders shared by the store, worker and fault tests."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from checkpointq.store import Checkpoint, CheckpointMetadata, ConversationMessage


def make_checkpoint(
    session_id: str = "session-1",
    version: int = 1,
    messages: int = 2,
    content_size: int = 16,
    **fields: Any,
) -> Checkpoint:
    """A realistic checkpoint: alternating user/assistant messages and usage metadata."""
    history = [
        ConversationMessage(
            role="user" if i % 2 == 0 else "assistant",
            content=f"message {i} " + "x" * max(0, content_size - 12),
        )
        for i in range(messages)
    ]
    cp = Checkpoint(
        session_id=session_id,
        version=version,
        conversation_history=history,
        metadata=CheckpointMetadata(
            total_messages=messages,
            total_tokens=10 * messages,
            total_cost_usd="0.012300",
            start_time=datetime(2026, 12, 2, 8, 30, tzinfo=UTC),
        ),
    )
    return cp.model_copy(update=fields) if fields else cp


def checkpoint_of_size(session_id: str, approx_bytes: int, version: int = 1) -> Checkpoint:
    """A checkpoint whose JSON is about ``approx_bytes`` long (10 messages)."""
    per_message = max(16, approx_bytes // 10 - 40)
    return make_checkpoint(session_id, version, messages=10, content_size=per_message)


def secret_checkpoint(session_id: str, secret: str, version: int = 1) -> Checkpoint:
    """A checkpoint whose every message, run name and a metadata field hold ``secret``: the
    text encryption tests look for in the broker's, the store's and the database's bytes."""
    cp = make_checkpoint(session_id, version=version, last_run_ref=f"run-{secret}")
    history = [
        m.model_copy(update={"content": f"{secret} {i}"})
        for i, m in enumerate(cp.conversation_history)
    ]
    metadata = cp.metadata.model_copy(update={"model": secret})
    return cp.model_copy(update={"conversation_history": history, "metadata": metadata})
