"""Rewrite every stored value under the keyring's first key (``checkpointq rekey``).

After a rotation (docs/security.md) values sealed under an older key, or written in clear
before encryption was turned on, stay so until their session's next save. Rekeying rewrites
them now, so that the old key can be removed without losing a session.

Each rewrite is fenced like any write: the value is saved again as a repeat of the request
that set the session's fence (same ``seq``, same request id), which the store applies only
while that request is still the newest. A save applied in between wins, and its value is
already sealed under the newest key. A value no request of ours wrote (a Go ``RedisStore``'s)
has no fence: it is saved with ``seq`` 0, below every request a producer stamps.

Sessions are walked a page at a time; each page ends with a cursor from which a rekey
interrupted there resumes (``checkpointq rekey --cursor``). Running it again is harmless.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from checkpointq.store.base import CheckpointStore
from checkpointq.store.encryption import MissingEncryptionKey
from checkpointq.store.errors import CorruptCheckpoint

#: The request id a fence-less value is rewritten under.
REKEY_REQUEST = "checkpointq-rekey"


@dataclass(frozen=True, slots=True)
class RekeyPage:
    """What one page of a rekey did, and where the next one starts (None: done)."""

    rewritten: int
    #: Sessions a newer request wrote (or deleted) while the page ran: nothing to do.
    superseded: int
    #: Sessions whose value could not be read, with why (corrupt, or a key this process
    #: lacks): left as they are, for an operator.
    failed: list[tuple[str, str]]
    cursor: str | None


def rekey(
    store: CheckpointStore, cursor: str | None = None, page_size: int = 500
) -> Iterator[RekeyPage]:
    """Rewrite every live session's value as ``store`` writes now (sealed under its
    keyring's first key, or in clear without a keyring), a page at a time.

    Raises:
        StoreUnavailable: the store failed; resume from the last page's cursor.
    """
    while True:
        page = store.list_page(cursor, page_size)
        rewritten = superseded = 0
        failed: list[tuple[str, str]] = []
        for session_id in page.session_ids:
            try:
                checkpoint, fence = store.load_with_fence(session_id)
            except (CorruptCheckpoint, MissingEncryptionKey) as exc:
                failed.append((session_id, str(exc)))
                continue
            if checkpoint is None:
                superseded += 1  # deleted or expired since it was listed
                continue
            if fence is None:
                result = store.save(checkpoint, 0, REKEY_REQUEST)
            elif fence.deleted or fence.lapsed:
                superseded += 1
                continue
            else:
                result = store.save(checkpoint, fence.seq, fence.request_id)
            if result.applied:
                rewritten += 1
            else:
                superseded += 1
        cursor = page.cursor
        yield RekeyPage(rewritten, superseded, failed, cursor)
        if cursor is None:
            return
