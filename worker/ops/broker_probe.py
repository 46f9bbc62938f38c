"""Looking at the broker from outside: does it answer, and what waits in the queue.

``checkpointq health``, ``top``/``stats`` and the worker's scrape-time gauges ask every kind
of broker the same two questions, without consuming anything:

* **Redis**, and **Sentinel** once the sentinels name the master (as kombu asks them): the
  queue is the list kombu LPUSHes and BRPOPs, so LLEN is the depth and LINDEX -1 the oldest
  request, whose ``seq`` says when it was made.
* **RabbitMQ**: a *passive* ``queue_declare``, whose reply counts the ready messages. AMQP
  cannot show a message without taking it (a ``basic_get`` and requeue would mark it
  redelivered and may reorder the queue), so the oldest request's age is unknown there.

In both, messages held unacknowledged by workers are not counted. Every probe is bounded:
sockets time out after ``timeout`` seconds, shared among several sentinels or AMQP URLs, and
nothing retries with a pause (redis-py's Sentinel and kombu's ``ensure_connection`` back off
by default), so a health check answers within a Kubernetes probe's few seconds. Failures are
``BrokerUnavailable`` naming the broker by its redacted URL.
"""

from __future__ import annotations

import abc
import json
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import redis
from kombu.connection import Connection
from kombu.exceptions import KombuError
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel

from checkpointq.store import probe
from checkpointq.store.urls import parse_sentinel_url, redact_url, redis_py_url
from checkpointq.tasks import messages
from checkpointq.tasks.brokers import BrokerKind, broker_kind
from checkpointq.tasks.errors import BrokerUnavailable
from checkpointq.worker.settings import Settings

#: Seconds a probe may take to connect and to get each answer.
PROBE_TIMEOUT = 3.0
#: AMQP reply code of a passive declare of a queue that does not exist.
NOT_FOUND = 404


@dataclass(frozen=True, slots=True)
class QueueState:
    """What waits in one queue, as the broker tells it."""

    #: Messages waiting for a worker (not those a worker holds unacknowledged).
    depth: int
    #: The oldest waiting request's ``seq`` (microseconds since the epoch); None when the
    #: queue is empty, the request has no seq, it was not asked for, or it is unknown.
    oldest_seq: int | None = None
    #: False when the broker cannot show the oldest request without consuming it.
    oldest_known: bool = True


class BrokerProbe(abc.ABC):
    """One broker, probed; reusable across calls (the metrics gauges keep one open)."""

    def __init__(self, url: str) -> None:
        #: The broker's URL as it may be shown: password redacted.
        self.where = redact_url(url)

    @abc.abstractmethod
    def ping(self) -> None:
        """Return once the broker answered.

        Raises:
            BrokerUnavailable: it did not, within the timeout.
        """

    @abc.abstractmethod
    def queue(self, name: str, *, oldest: bool = False) -> QueueState:
        """The depth of queue ``name`` (and, with ``oldest``, its oldest request's seq).

        A queue the broker does not know yet (no worker has declared it) is empty.

        Raises:
            BrokerUnavailable: the broker could not be read within the timeout.
        """

    def write_refusal(self, key: str) -> str | None:
        """Why the broker refuses a write to ``key`` (out of memory, read-only, ...), or
        None when it accepts one or has no such refusal to report (RabbitMQ)."""
        return None

    @property
    def redis_client(self) -> redis.Redis | None:
        """A client of the broker's Redis (Sentinel's current master), for questions the
        probe does not ask itself (``eviction``); None on RabbitMQ."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Release the connection (a later call opens a new one)."""

    def __enter__(self) -> BrokerProbe:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def _unavailable(self, exc: BaseException) -> BrokerUnavailable:
        return BrokerUnavailable(f"{self.where} unreachable ({_reason(exc)})")


def open_probe(settings: Settings, *, timeout: float | None = None) -> BrokerProbe:
    """A probe of ``settings``' broker (resolved settings: the URL is known), its sockets
    timing out after ``timeout`` seconds (``PROBE_TIMEOUT``, read at each call). It connects
    on its first call, never here."""
    timeout = PROBE_TIMEOUT if timeout is None else timeout
    url = settings.broker_url
    if url is None:
        raise BrokerUnavailable("no broker configured (resolve the settings first)")
    kind = broker_kind(url)
    if kind is BrokerKind.AMQP:
        return AmqpProbe(url, timeout=timeout)
    if kind is BrokerKind.SENTINEL:
        if not settings.sentinel_master:  # settings refuse this; kept for direct callers
            raise BrokerUnavailable("a sentinel:// broker needs CHECKPOINTQ_SENTINEL_MASTER")
        client = sentinel_master_client(
            url,
            settings.sentinel_master,
            sentinel_password=settings.sentinel_password,
            timeout=timeout,
        )
        return RedisProbe(url, client)
    plain = redis.Redis.from_url(
        redis_py_url(url), socket_timeout=timeout, socket_connect_timeout=timeout
    )
    return RedisProbe(url, plain)


# -- Redis and Sentinel ---------------------------------------------------------------------


def _no_retries() -> Retry:
    return Retry(NoBackoff(), 0)


def sentinel_master_client(
    url: str, master: str, *, sentinel_password: str | None, timeout: float
) -> redis.Redis:
    """A ``redis.Redis`` on the master the sentinels of ``url`` name (kombu's spelling:
    ``sentinel://[:password@]host:port[/db]`` joined by ``;``; the password and database of
    the first are the master's). The master is looked up on each new connection, so the
    client follows a failover."""
    parsed = parse_sentinel_url(url)
    sentinels = parsed.sentinels
    # Asked in turn until one answers: a silent one must leave time for the others.
    each = timeout / len(sentinels)
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": each,
        "socket_connect_timeout": each,
        "retry": _no_retries(),
    }
    if sentinel_password:
        sentinel_kwargs["password"] = sentinel_password
    group = Sentinel(
        sentinels,
        sentinel_kwargs=sentinel_kwargs,
        username=parsed.username,
        password=parsed.password,
        db=parsed.db,
        ssl=parsed.ssl,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
    )
    # Without retry=, redis-py's master client retries a failed lookup with backoff for
    # several seconds.
    client: redis.Redis = group.master_for(master, retry=_no_retries())
    return client


class RedisProbe(BrokerProbe):
    """A Redis broker (plain, or the master a Sentinel group names): LLEN and LINDEX."""

    def __init__(self, url: str, client: redis.Redis) -> None:
        super().__init__(url)
        self._client = client

    @property
    def redis_client(self) -> redis.Redis:
        return self._client

    def ping(self) -> None:
        try:
            self._client.ping()
        except redis.RedisError as exc:
            raise self._unavailable(exc) from exc

    def write_refusal(self, key: str) -> str | None:
        # Only the broker's answer counts: a broker that does not answer is kombu's to
        # reconnect to, and a slow probe must not pause a worker.
        try:
            self._client.set(key, b"1", px=probe.PROBE_TTL_MS)
        except redis.RedisError as exc:
            return probe.refused(exc)
        return None

    def queue(self, name: str, *, oldest: bool = False) -> QueueState:
        try:
            if not oldest:
                return QueueState(int(self._client.llen(name)))
            pipe = self._client.pipeline(transaction=False)
            pipe.llen(name)
            pipe.lindex(name, -1)  # kombu LPUSHes and BRPOPs: -1 is delivered next
            depth, envelope = pipe.execute()
        except redis.RedisError as exc:
            raise self._unavailable(exc) from exc
        return QueueState(int(depth), seq_of(envelope))

    def close(self) -> None:
        self._client.close()


# -- RabbitMQ -------------------------------------------------------------------------------


class AmqpProbe(BrokerProbe):
    """A RabbitMQ broker through kombu: connect, and a passive ``queue_declare``.

    The connection is kept between calls (one per scrape would be one more RabbitMQ log
    line each time) and dropped after any failure, to be opened again on the next call. A
    lock serialises calls: a kombu connection is not thread-safe, and scrapes may overlap.
    """

    def __init__(self, url: str, *, timeout: float) -> None:
        super().__init__(url)
        self._url = url
        hosts = max(1, len([part for part in url.split(";") if part.strip()]))
        self._timeout = timeout / hosts  # failover URLs are tried in turn
        self._hosts = hosts
        self._lock = threading.Lock()
        self._connection: Connection | None = None
        self._channel: Any = None
        # What the transport (py-amqp) raises, as kombu lists it: no import of its own.
        model = self._new_connection()
        self._channel_errors: tuple[type[BaseException], ...] = tuple(model.channel_errors)
        self._errors = (
            KombuError,
            OSError,
            *model.connection_errors,
            *self._channel_errors,
        )

    def _new_connection(self) -> Connection:
        """A kombu connection, not yet connected."""
        return Connection(  # type: ignore[no-untyped-call]  # kombu: no hints
            self._url,
            connect_timeout=self._timeout,
            heartbeat=0,
            # Passed on to py-amqp: no read or write waits longer than the budget.
            transport_options={"read_timeout": self._timeout, "write_timeout": self._timeout},
        )

    def _connected(self) -> Any:
        """The open channel, connecting first if needed (lock held)."""
        if self._connection is None:
            connection = self._new_connection()
            self._connection = connection
            # Each failover URL once, with no pause between them (kombu's default waits
            # 2 s before each round): a probe answers now or reports the broker down.
            connection.ensure_connection(  # type: ignore[no-untyped-call]
                max_retries=self._hosts - 1, interval_start=0, interval_step=0
            )
        if self._channel is None:
            self._channel = self._connection.channel()  # type: ignore[no-untyped-call]
        return self._channel

    def _drop(self) -> None:
        """Forget a connection that failed, without waiting for it to close cleanly."""
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            connection.collect()  # type: ignore[no-untyped-call]

    def ping(self) -> None:
        with self._lock:
            try:
                self._connected()
            except self._errors as exc:
                self._drop()
                raise self._unavailable(exc) from exc

    def queue(self, name: str, *, oldest: bool = False) -> QueueState:
        with self._lock:
            try:
                channel = self._connected()
                try:
                    declared = channel.queue_declare(queue=name, passive=True)
                except self._channel_errors as exc:
                    if getattr(exc, "code", None) != NOT_FOUND:
                        raise
                    # No worker has declared it yet: nothing can be waiting in it. The
                    # broker closed the channel with this error; open another next time.
                    self._channel = None
                    return QueueState(0, None, oldest_known=False)
            except self._errors as exc:
                self._drop()
                raise self._unavailable(exc) from exc
        return QueueState(int(declared.message_count), None, oldest_known=False)

    def close(self) -> None:
        with self._lock:
            connection, self._connection, self._channel = self._connection, None, None
            if connection is not None:
                try:
                    connection.release()  # type: ignore[no-untyped-call]
                except self._errors:
                    connection.collect()  # type: ignore[no-untyped-call]


# -- helpers --------------------------------------------------------------------------------


def _reason(exc: BaseException) -> str:
    """The error's type and first line, short: enough to act on, no connection dumps."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, MasterNotFoundError):
        text = text.split(" : ", 1)[0]  # the rest is a repr of every sentinel client
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def seq_of(envelope: bytes | None) -> int | None:
    """The ``seq`` of a queued Celery message on Redis (protocol 2 or 1), if it has one."""
    if envelope is None:
        return None
    try:
        message = json.loads(envelope)
        body = json.loads(messages.envelope_body(message))
    except (ValueError, KeyError, TypeError):
        return None
    parsed = messages.arguments(body)
    return None if parsed is None else messages.requested_seq(*parsed)
