"""The dead-letter store: requests the worker could not apply, kept for people to inspect.

A capped Redis stream on the *store* Redis (``KeySpace.dead_letters()``), trimmed to about
``maxlen`` entries oldest first. Each entry records what arrived (task name and id, arguments
when they could be decoded, the raw body), why it was refused, and when. Nothing the worker
refuses is dropped without an entry, or, when even the store Redis is down, an ERROR log line
carrying the same fields.

Public API, used by the CLI (``checkpointq dlq ...``)::

    letters = DeadLetters(redis_client, KeySpace(prefix), maxlen=100_000)
    page = letters.list(count=50)            # oldest first; page.cursor for the next page
    letter = letters.get(entry_id)            # or None
    new_task_id = letters.replay(entry_id, client)   # client: CheckpointClient
    removed = letters.purge()
"""

from __future__ import annotations

import base64
import enum
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from redis import exceptions as redis_errors

from checkpointq.store.base import Refusal
from checkpointq.store.errors import InvalidCheckpoint
from checkpointq.store.keys import KeySpace
from checkpointq.store.serde import checkpoint_from_wire
from checkpointq.tasks.errors import NotFound, NotReplayable, redis_unavailable
from checkpointq.tasks.messages import SAVE, SAVE_STAGED, SEALED_KWARG

logger = logging.getLogger(__name__)

#: Bytes of an oversize body kept in its dead letter: enough to identify the request.
OVERSIZE_SAMPLE_BYTES = 64 * 1024

#: How long a refusal record (``KeySpace.refusals``) tells a waiting producer that its request
#: was dead-lettered: as long as a tombstone lasts by default, far longer than anyone waits.
REFUSAL_TTL_SECONDS = 24 * 60 * 60


class Reason(enum.StrEnum):
    """Why a request was dead-lettered (the ``kind`` field of an entry)."""

    INVALID_INPUT = "invalid_input"  # the store refused the payload (never retried)
    BAD_ARGUMENTS = "bad_arguments"  # wrong argument count or names for the task
    OVERSIZE = "oversize"  # body larger than max_message_bytes
    UNKNOWN_TASK = "unknown_task"  # no task of that name is registered
    UNDECODABLE = "undecodable"  # not JSON, a refused serializer (pickle), or no task header
    RETRIES_EXHAUSTED = "retries_exhausted"  # kept failing while the store accepted writes
    FAILED = "failed"  # an unexpected error (a bug, or corrupt stored data)
    EXPIRED = "expired"  # its ``expires`` header had passed when the worker received it
    LOST = "lost"  # its message was gone while its pending record stayed (tasks/orphans.py)


class RefusedRequest(NamedTuple):
    """A request a dead letter refuses: its session, its id and its ``seq`` (if any)."""

    session_id: str
    request_id: str
    seq: int | None = None


class Sender(Protocol):
    """What replay needs from a producer (``CheckpointClient``): publish a task by name,
    and stage a sealed value again beside a staged save naming it."""

    def send(self, task: str, args: list[Any], kwargs: dict[str, Any]) -> str: ...

    def send_sealed(self, session_id: str, seq: int, value: bytes) -> str: ...


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One refused request. ``args``/``kwargs`` are None when the body could not be decoded."""

    id: str
    kind: str
    reason: str
    task: str | None
    task_id: str | None
    args: list[Any] | None
    kwargs: dict[str, Any] | None
    #: The message body as it arrived (a sample of it when oversize).
    raw: bytes
    #: Size of the whole body in bytes.
    raw_bytes: int
    #: Seconds since the Unix epoch when the worker refused it.
    time: float
    headers: dict[str, Any] = field(default_factory=dict)
    retries: int = 0

    @property
    def replayable(self) -> bool:
        """Whether a replay could apply (``dlq show`` and ``dlq replay`` ask)."""
        return self.never_applies is None

    @property
    def never_applies(self) -> str | None:
        """Why a replay of this entry would be refused again whatever the store holds, or
        None. Only what is certain counts: a request refused for the time or the store's
        state may apply later, so it stays replayable."""
        if self.kind == Reason.LOST:
            return "its message was lost; raw holds a save's value as the store would hold it"
        if self.task is None or self.args is None:
            return "its task and arguments could not be decoded"
        if self.kind == Reason.OVERSIZE:
            return "it was oversize"
        if self.task == SAVE_STAGED and self.sealed_value is not None:
            return None
        if self.task == SAVE_STAGED:
            # The value waited on the broker under the refused request's id; a replay is a
            # request of its own, and would find none.
            return "a staged save's checkpoint is not in its entry"
        if self.task == SAVE and self.args:
            try:
                checkpoint_from_wire(self.args[0])
            except InvalidCheckpoint as exc:
                return f"its checkpoint is invalid ({exc})"
        return None

    @property
    def sealed_value(self) -> bytes | None:
        """An encrypted staged save's sealed value, which the entry keeps in place of its
        checkpoint (``messages.SEALED_KWARG``); None for any other entry."""
        sealed = (self.kwargs or {}).get(SEALED_KWARG)
        if self.task != SAVE_STAGED or not isinstance(sealed, str):
            return None
        try:
            return base64.b64decode(sealed, validate=True)
        except ValueError:
            return None

    def as_json(self) -> dict[str, Any]:
        """The entry as JSON-able data (raw body as text, undecodable bytes replaced)."""
        return {
            "id": self.id,
            "kind": self.kind,
            "reason": self.reason,
            "task": self.task,
            "task_id": self.task_id,
            "args": self.args,
            "kwargs": self.kwargs,
            "raw": self.raw.decode("utf-8", errors="replace"),
            "raw_bytes": self.raw_bytes,
            "time": self.time,
            "headers": self.headers,
            "retries": self.retries,
            "replayable": self.replayable,
        }


@dataclass(frozen=True, slots=True)
class DeadLetterPage:
    """Entries oldest first; pass ``cursor`` to ``list`` for the next page (None: done)."""

    entries: list[DeadLetter]
    cursor: str | None


class DeadLetters:
    """Record, list, replay and purge dead letters in one capped stream."""

    def __init__(self, client: Any, keys: KeySpace, *, maxlen: int = 100_000) -> None:
        """``client`` is a ``redis.Redis`` on the store Redis (any ``decode_responses``)."""
        self.client = client
        self.keys = keys
        self.key = keys.dead_letters()
        self.maxlen = maxlen

    def add(
        self,
        kind: Reason,
        reason: str,
        *,
        task: str | None,
        task_id: str | None,
        args: list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        raw: bytes | str | None = None,
        headers: dict[str, Any] | None = None,
        retries: int = 0,
        requests: Sequence[RefusedRequest] = (),
        raw_bytes: int | None = None,
    ) -> str:
        """Append an entry and return its id.

        ``raw_bytes``: the size of the whole body when ``raw`` is only a sample of it.

        Each of ``requests`` (session id, request id, seq) also gets a refusal record, so that
        a producer waiting on that request learns it was refused (and why) at once. A request
        whose session cannot be read (a body that does not decode) gets none: its producer's
        wait times out, and no message can make another session's request look refused.

        Raises:
            StoreUnavailable: the store Redis cannot be written; ``add`` has then logged the
                entry at ERROR so that it is not lost silently.
        """
        body = _as_bytes(raw if raw is not None else _json([args, kwargs]))
        size = len(body) if raw_bytes is None else raw_bytes
        if kind is Reason.OVERSIZE:
            body = body[:OVERSIZE_SAMPLE_BYTES]
        fields: dict[str, bytes | str | int] = {
            "kind": kind.value,
            "reason": reason,
            "task": task or "",
            "task_id": task_id or "",
            "args": _json(args) if args is not None else "",
            "kwargs": _json(kwargs) if kwargs is not None else "",
            "raw": body,
            "raw_bytes": size,
            "headers": _json(headers or {}),
            "time": repr(time.time()),
            "retries": retries,
        }
        try:
            with redis_unavailable("record dead letter"):
                entry_id = self.client.xadd(self.key, fields, maxlen=self.maxlen, approximate=True)
        except Exception:
            # Last resort: the log is then the only record of this request.
            logger.error(
                "could not record dead letter; request kept in this log line only: %s",
                _json(
                    {
                        k: v if not isinstance(v, bytes) else v.decode("utf-8", "replace")
                        for k, v in fields.items()
                    }
                ),
            )
            raise
        entry = _text(entry_id)
        logger.warning(
            "dead-lettered %s [%s] as %s: %s (entry %s)", task, task_id, kind.value, reason, entry
        )
        if requests:
            self._record_refusals(requests, kind, reason, entry)
        return entry

    def _record_refusals(
        self, requests: Sequence[RefusedRequest], kind: Reason, reason: str, entry: str
    ) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for session_id, request_id, seq in requests:
                key = self.keys.refusals(session_id)
                pipe.hset(key, request_id, Refusal(kind.value, reason, entry, seq).encode())
                pipe.expire(key, REFUSAL_TTL_SECONDS)
            pipe.execute()
        except (redis_errors.RedisError, redis_errors.RedisClusterException) as exc:
            # The dead letter itself is written: only the producer's early notice is lost
            # (its wait times out instead). Not worth a retry that would duplicate the entry.
            ids = [request.request_id for request in requests]
            logger.warning(
                "could not record the refusal of %s (dead letter %s): %s", ids, entry, exc
            )

    def list(self, count: int = 100, cursor: str | None = None) -> DeadLetterPage:
        """Up to ``count`` entries after ``cursor`` (exclusive), oldest first."""
        start = f"({cursor}" if cursor else "-"
        with redis_unavailable("list dead letters"):
            rows = self.client.xrange(self.key, min=start, max="+", count=count)
        entries = [_parse(entry_id, fields) for entry_id, fields in rows]
        next_cursor = entries[-1].id if len(entries) == count else None
        return DeadLetterPage(entries, next_cursor)

    def get(self, entry_id: str) -> DeadLetter | None:
        with redis_unavailable("read dead letter"):
            rows = self.client.xrange(self.key, min=entry_id, max=entry_id, count=1)
        return _parse(*rows[0]) if rows else None

    def count(self) -> int:
        with redis_unavailable("count dead letters"):
            return int(self.client.xlen(self.key))

    def remove(self, entry_id: str) -> bool:
        with redis_unavailable("remove dead letter"):
            return bool(self.client.xdel(self.key, entry_id))

    def replay(self, entry_id: str, sender: Sender) -> str:
        """Re-enqueue the original request by task name, then remove the entry.

        Enqueue first, remove second: a crash in between leaves a duplicate request, which
        the fenced store applies once, rather than losing one. Returns the new task id.

        Raises:
            NotFound: no such entry.
            NotReplayable: a replay could never apply (``DeadLetter.never_applies``).
        """
        letter = self.get(entry_id)
        if letter is None:
            raise NotFound(f"no dead letter {entry_id!r}")
        why = letter.never_applies
        if why is not None or letter.task is None or letter.args is None:
            raise NotReplayable(f"dead letter {entry_id} ({letter.kind}) cannot apply: {why}")
        sealed = letter.sealed_value
        if sealed is not None:
            seq = (letter.kwargs or {}).get("seq")
            if not isinstance(seq, int) or not letter.args or not isinstance(letter.args[0], str):
                raise NotReplayable(f"dead letter {entry_id}: its session id or seq is missing")
            task_id = sender.send_sealed(letter.args[0], seq, sealed)
        else:
            task_id = sender.send(letter.task, letter.args, letter.kwargs or {})
        self.remove(entry_id)
        logger.info("replayed dead letter %s as %s [%s]", entry_id, letter.task, task_id)
        return task_id

    def purge(self) -> int:
        """Remove every entry; return how many there were."""
        with redis_unavailable("purge dead letters"):
            pipe = self.client.pipeline(transaction=True)
            pipe.xlen(self.key)
            pipe.delete(self.key)
            removed, _ = pipe.execute()
        return int(removed)


def _json(value: Any) -> str:
    # ASCII: JSON arguments may hold lone surrogates ("\ud800" is valid JSON syntax), which
    # no UTF-8 encoder accepts; escaped, they survive the stream and decode back as sent.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True, default=repr)


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode("utf-8", errors="surrogateescape") if isinstance(value, str) else value


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def _parse(entry_id: bytes | str, fields: dict[Any, Any]) -> DeadLetter:
    get = {_text(k): v for k, v in fields.items()}

    def text(name: str) -> str:
        return _text(get.get(name, b""))

    def decoded(name: str) -> Any:
        value = text(name)
        return json.loads(value) if value else None

    raw = get.get("raw", b"")
    return DeadLetter(
        id=_text(entry_id),
        kind=text("kind"),
        reason=text("reason"),
        task=text("task") or None,
        task_id=text("task_id") or None,
        args=decoded("args"),
        kwargs=decoded("kwargs"),
        raw=_as_bytes(raw),
        raw_bytes=int(text("raw_bytes") or 0),
        time=float(text("time") or 0),
        headers=decoded("headers") or {},
        retries=int(text("retries") or 0),
    )
