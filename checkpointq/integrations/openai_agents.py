"""The OpenAI Agents SDK's ``Session``, kept as checkpoints (``pip install
'checkpointq[openai-agents]'``).

``CheckpointSession`` implements the SDK's session protocol (``get_items``, ``add_items``,
``pop_item``, ``clear_session``) on an ``AsyncCheckpointClient``: a session's items are its
checkpoint's conversation history, one message per item. Each message keeps the item's role
and text for any reader (the Go apiserver, ``checkpointq show``) and the item itself, as
JSON, in ``traceEntries``, so ``get_items`` returns exactly what ``add_items`` was given.
Every replica reads every accepted write (the pending records), so two API servers can take
a session's turns in turn. docs/api.md ("The OpenAI Agents SDK") has the limits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from checkpointq.store.model import Checkpoint, ConversationMessage
from checkpointq.tasks.producer.aio import AsyncCheckpointClient

if TYPE_CHECKING:
    from agents.memory.session_settings import SessionSettings

#: Roles a message item carries itself; any other item is named by its type.
_MESSAGE_ROLES = ("user", "assistant", "system", "developer")


def _plain(item: Any) -> dict[str, Any]:
    """The item as plain JSON data (the SDK passes dicts; a model is dumped as the SDK
    would send it)."""
    if isinstance(item, dict):
        return item
    dump = getattr(item, "model_dump", None)
    if dump is None:
        raise TypeError(f"not a session item: {type(item).__name__}")
    data: dict[str, Any] = dump(exclude_unset=True, mode="json")
    return data


def _text(item: dict[str, Any]) -> str:
    """The item's readable text: a message's content, its text parts joined; else ''."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(item.get("output", "")) if item.get("type") == "function_call_output" else ""


def to_message(item: Any) -> ConversationMessage:
    """One history message for ``item``: its role (or type), text and exact JSON."""
    data = _plain(item)
    role = data.get("role")
    role = role if role in _MESSAGE_ROLES else str(data.get("type", "item"))
    return ConversationMessage(
        role=role, content=_text(data), trace_entries=orjson.dumps(data).decode()
    )


def to_item(message: ConversationMessage) -> dict[str, Any]:
    """The item a history message holds: its JSON, or for a message written by another
    producer (no JSON), a plain message of its role and text."""
    if message.trace_entries:
        try:
            item = orjson.loads(message.trace_entries)
        except orjson.JSONDecodeError:
            item = None
        if isinstance(item, dict):
            return item
    return {"role": message.role, "content": message.content}


class CheckpointSession:
    """The SDK's ``Session`` for one session id, on ``client`` (shared by every session of
    the event loop; the session does not close it)."""

    session_settings: SessionSettings | None = None

    def __init__(
        self, session_id: str, client: AsyncCheckpointClient, *, durable: bool = False
    ) -> None:
        """``durable``: each change waits until a worker applied it (``wait_durable``);
        otherwise it returns once the broker holds it, which every replica's next read sees
        already."""
        self.session_id = session_id
        self.client = client
        self.durable = durable

    def __repr__(self) -> str:
        return f"CheckpointSession({self.session_id!r})"

    async def get_items(self, limit: int | None = None) -> list[Any]:
        """The session's items, oldest first; with ``limit``, the newest ``limit`` of them."""
        checkpoint = await self.client.load(self.session_id)
        if checkpoint is None:
            return []
        items = [to_item(m) for m in checkpoint.conversation_history]
        if limit is not None:
            items = items[-limit:] if limit > 0 else []
        return items

    async def add_items(self, items: list[Any]) -> None:
        """Append ``items``: a load, then a save ordered after it (one turn's items at once)."""
        if not items:
            return
        checkpoint = await self.client.load(self.session_id)
        if checkpoint is None:
            checkpoint = Checkpoint(session_id=self.session_id)
        checkpoint.conversation_history.extend(to_message(item) for item in items)
        checkpoint.metadata.total_messages += len(items)
        await self._save(checkpoint)

    async def pop_item(self) -> Any | None:
        """Remove the newest item and return it (None when the session has none)."""
        checkpoint = await self.client.load(self.session_id)
        if checkpoint is None or not checkpoint.conversation_history:
            return None
        message = checkpoint.conversation_history.pop()
        await self._save(checkpoint)
        return to_item(message)

    async def clear_session(self) -> None:
        """Delete the session (a tombstone: no late save brings it back)."""
        handle = await self.client.delete(self.session_id)
        if self.durable:
            await self.client.wait_durable(handle)

    async def _save(self, checkpoint: Checkpoint) -> None:
        checkpoint.version += 1
        handle = await self.client.save(checkpoint)
        if self.durable:
            await self.client.wait_durable(handle)
