"""``CHECKPOINTQ_BROKER_DURABILITY=replicated``: a save or delete returns once broker replicas
have it, not only the broker's primary.

Between ``save()`` returning and a worker applying it, a request lives only on the broker.
``local`` (the default) returns once the primary took it: a machine crash inside its fsync
window, or a failover to a replica that had not received it, loses it (detected, counted and
republished from the producer's recovery window: docs/reliability.md). ``replicated`` sends
``WAIT <replicas> <timeout>`` right behind the publish script, in the same write on the same
connection (so it costs no extra round trip, only the replicas' acknowledgement), and
returns only when that many replicas acknowledged every write made on that connection so
far: the message and the request's pending record alike (one script, replicated whole).

When fewer acknowledge within the timeout, the publish raises ``ReplicationTimeout``: the
primary has the request (queued, its record written, kept in the recovery window), so it may
still apply; retrying is harmless because every request is fenced. Refreshes and sweeps are
not waited for (losing one delays a TTL extension or a sweep, nothing more).

``WAIT`` makes no write survive a failover to a replica that did not get it: the ones it
acknowledged are on that many replicas (docs/reliability.md has each mode's window). The
sync and asyncio clients call this module; the Go client does the same (``Config``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis import exceptions as redis_errors

from checkpointq.store.errors import InvalidInput
from checkpointq.tasks.errors import ReplicationTimeout

#: The modes (``CHECKPOINTQ_BROKER_DURABILITY``).
LOCAL, REPLICATED = "local", "replicated"
MODES = (LOCAL, REPLICATED)
#: The defaults of ``CHECKPOINTQ_BROKER_REPLICAS`` and
#: ``CHECKPOINTQ_BROKER_REPLICATION_TIMEOUT_MS``: one replica, a second (a replica on the
#: same network acknowledges within a millisecond or two; a second means it is not there).
DEFAULT_REPLICAS = 1
DEFAULT_TIMEOUT_MS = 1000


@dataclass(frozen=True, slots=True)
class BrokerDurability:
    """When a publish counts as accepted: ``local``, at the primary; ``replicated``, once
    ``replicas`` replicas acknowledged it, waiting at most ``timeout_ms``."""

    mode: str = LOCAL
    replicas: int = DEFAULT_REPLICAS
    timeout_ms: int = DEFAULT_TIMEOUT_MS

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidInput(f"must be 'local' or 'replicated', not {self.mode!r}", field="mode")
        if self.replicas < 1:
            raise InvalidInput(f"must be at least 1, not {self.replicas}", field="replicas")
        if self.timeout_ms < 1:
            raise InvalidInput(f"must be at least 1 ms, not {self.timeout_ms}", field="timeout_ms")

    @classmethod
    def replicated(
        cls, replicas: int = DEFAULT_REPLICAS, timeout_ms: int = DEFAULT_TIMEOUT_MS
    ) -> BrokerDurability:
        return cls(REPLICATED, replicas, timeout_ms)

    @classmethod
    def from_settings(cls, settings: Any) -> BrokerDurability:
        """The durability ``settings`` name (``worker.settings.Settings``' three fields)."""
        return cls(
            settings.broker_durability,
            settings.broker_replicas,
            settings.broker_replication_timeout_ms,
        )

    @property
    def is_replicated(self) -> bool:
        return self.mode == REPLICATED

    @property
    def wait_seconds(self) -> float:
        """How much longer than at ``local`` one publish attempt may take: the WAIT's
        timeout (added to the publish's socket timeout and to its whole budget)."""
        return self.timeout_ms / 1000 if self.is_replicated else 0.0

    def describe(self) -> str:
        """One line for logs and ``health``."""
        if not self.is_replicated:
            return "local (a save returns once the broker's primary has it)"
        return (
            f"replicated (a save returns once {self.replicas} replica(s) acknowledged it, "
            f"within {self.timeout_ms} ms)"
        )

    def with_wait(
        self, commands: list[tuple[Any, ...]], wait: bool = True
    ) -> list[tuple[Any, ...]]:
        """``commands`` followed by the WAIT when replicated and ``wait``: sent in the same
        write, on the same connection, so that it covers them."""
        if not (wait and self.is_replicated):
            return commands
        return [*commands, ("WAIT", self.replicas, self.timeout_ms)]

    def split(self, replies: Sequence[Any], wait: bool = True) -> tuple[list[Any], Any]:
        """The replies of ``with_wait``'s commands: those of ``commands``, and the WAIT's
        (None when none was sent)."""
        if not (wait and self.is_replicated):
            return list(replies), None
        *replies_, acked = replies
        return replies_, acked

    def check(self, acked: Any, what: str, display_url: str) -> None:
        """Raise unless the WAIT's reply ``acked`` counts enough replicas (None: none was
        sent, nothing to check).

        Raises:
            ReplicationTimeout: fewer replicas acknowledged ``what`` within the timeout.
            redis.RedisError: the broker refused the WAIT itself (as it replied).
        """
        if acked is None:
            return
        if isinstance(acked, redis_errors.RedisError):
            raise acked
        count = int(acked)
        if count >= self.replicas:
            return
        raise ReplicationTimeout(
            f"{what} was accepted by the broker's primary ({display_url}), but only {count} "
            f"of {self.replicas} replica(s) acknowledged it within {self.timeout_ms} ms "
            "(CHECKPOINTQ_BROKER_DURABILITY=replicated): it is queued and may still apply, but "
            "a failover now could lose it. Retrying is safe (requests are fenced): save again, "
            "or wait_durable(exc.handle) for its outcome",
            acked=count,
            replicas=self.replicas,
            timeout_ms=self.timeout_ms,
        )


#: The default: today's behaviour.
LOCAL_DURABILITY = BrokerDurability()
