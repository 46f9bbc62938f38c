"""What the sync and the asyncio producer clients set up alike, in one place: the request
builder (envelopes' bodies, seq stamps, records, outcomes: ``requests.Requests``), sealing
(encryption at rest stages every save), the pending records' key space and the store-identity
check. Each client adds its own I/O (``client.CheckpointClient``, ``aio.AsyncCheckpointClient``).
"""

from __future__ import annotations

from checkpointq.store.base import CheckpointStore
from checkpointq.store.keys import KeySpace
from checkpointq.store.urls import redact_url
from checkpointq.tasks.producer.clock import SeqClock, seq_clock
from checkpointq.tasks.producer.requests import Requests
from checkpointq.tasks.store_identity import StoreCheck


class ProducerCore:
    """The I/O-free state of a producer client (the options are ``CheckpointClient``'s)."""

    def __init__(
        self,
        broker_url: str,
        store: CheckpointStore,
        *,
        queue: str,
        max_message_bytes: int,
        clock: SeqClock | None,
        compress_messages: bool,
        stage_saves: bool,
    ) -> None:
        self.clock = clock or seq_clock
        self.store = store
        self.queue = queue
        self.max_message_bytes = max_message_bytes
        self.compress_messages = compress_messages
        #: Envelopes' bodies, seq stamps, records and outcomes.
        self.requests = Requests(
            store,
            self.clock,
            max_message_bytes=max_message_bytes,
            compress_messages=compress_messages,
        )
        #: Encryption at rest: saves are always staged, sealed by the store's keyring.
        self.encrypted = self.requests.encrypted
        self.stage_saves = stage_saves or self.encrypted
        self._display_url = redact_url(broker_url)
        #: This store against the one the broker's workers write to (``store_identity``).
        self.store_check = StoreCheck()

    def record_keys(self, key_prefix: str | None) -> KeySpace:
        """The pending records' key space: ``key_prefix``, else the store's prefix
        (``store.keys``), as every producer and worker of the deployment must agree."""
        prefix = key_prefix or getattr(getattr(self.store, "keys", None), "prefix", None)
        return KeySpace(prefix) if prefix else KeySpace()
