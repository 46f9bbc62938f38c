"""Publish Celery protocol 2 messages to a Redis broker ourselves: one LPUSH (or one
publish.lua call that also writes the requests' pending records), no kombu.

Celery's ``send_task`` costs an API server more than writing the checkpoint synchronously
would (bench/, producer section). This module writes exactly the envelope kombu's Redis
transport writes (``Channel._put``), so the *stock* worker consumes it unchanged
(``tests/worker/test_fast_publish_e2e.py``): the headers and properties ``send_task`` sets,
every part that does not change between messages encoded once per task name, and
``before_task_publish``/``after_task_publish`` around the push when a receiver is connected
(``publish_hooks``). Only for plain Redis brokers; any other goes through Celery
(``CheckpointClient`` decides). A publish takes at most ``PUBLISH_TIMEOUT`` seconds in all,
even against a broker that never answers. docs/design.md has the envelope in detail.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson
import redis
from pybase64 import b64encode  # SIMD: the standard library's bytes, ~25x faster at 20 KB
from redis import exceptions as redis_errors
from redis.backoff import NoBackoff
from redis.retry import Retry

from checkpointq.store.urls import is_redis_url, redact_url, redis_py_url
from checkpointq.tasks.errors import BrokerUnavailable
from checkpointq.tasks.producer import compressed_body, publish_hooks

if TYPE_CHECKING:
    from checkpointq.tasks.producer.pending import PendingRecords, RecordWrite

_RETRYABLE = (redis_errors.ConnectionError, redis_errors.TimeoutError)

#: Seconds one publish may take in all: its attempts, their socket waits, the pauses.
PUBLISH_TIMEOUT = 5.0
#: Seconds one attempt waits to connect, and then for each answer. A Redis that has not
#: answered an LPUSH within a second is stalled; the retry (harmless: fenced) goes on.
ATTEMPT_TIMEOUT = 1.0


def new_id() -> str:
    """A random (version 4) UUID as text, as ``str(uuid.uuid4())`` makes it, in 0.8 us
    instead of 2: a publish makes two, its task id and its delivery tag."""
    h = os.urandom(16).hex()
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{'89ab'[int(h[16], 16) & 3]}{h[17:20]}-{h[20:]}"


def supports(broker_url: str) -> bool:
    """Whether ``broker_url`` names a plain Redis broker this module can publish to."""
    return is_redis_url(broker_url)


class _Template:
    """The constant byte strings of one task's envelope, between its per-message parts."""

    __slots__ = ("parts",)

    def __init__(
        self, task: str, queue: str, origin: str, reply_to: str, compression: str | None
    ) -> None:
        # Keys in the order send_task's message has them; JSON order does not matter to the
        # worker, but identical messages are easier to compare in tests and by eye.
        compressed = b'"compression":' + orjson.dumps(compression) + b"," if compression else b""
        head = (
            b'{"body":"',
            b'","content-encoding":"utf-8","content-type":"application/json","headers":{'
            + compressed
            + b'"lang":"py","task":'
            + orjson.dumps(task)
            + b',"id":"',
            b'","shadow":null,"eta":null,"expires":null,"group":null,"group_index":null,'
            b'"retries":0,"timelimit":[null,null],"root_id":"',
            b'","parent_id":null,"argsrepr":',
            b',"kwargsrepr":',
            b',"origin":' + orjson.dumps(origin) + b',"ignore_result":null,'
            b'"replaced_task_nesting":0,"stamped_headers":null,"stamps":{}},'
            b'"properties":{"correlation_id":"',
            b'","reply_to":"' + reply_to.encode() + b'","delivery_mode":2,"delivery_info":'
            b'{"exchange":"","routing_key":' + orjson.dumps(queue) + b'},"priority":0,'
            b'"body_encoding":"base64","delivery_tag":"',
            b'"}}',
        )
        self.parts = head

    def render(
        self, body_b64: bytes, task_id: bytes, argsrepr: bytes, kwargsrepr: bytes, tag: bytes
    ) -> bytes:
        p = self.parts
        return b"".join(
            (
                p[0], body_b64, p[1], task_id, p[2], task_id, p[3], argsrepr,
                p[4], kwargsrepr, p[5], task_id, p[6], tag, p[7],
            )
        )  # fmt: skip


class Envelopes:
    """The messages of one queue, as kombu's Redis transport stores them: no I/O, shared by
    the sync publisher and the asyncio one (``producer.aio``)."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self._reply_to = str(uuid.uuid4())
        self._templates: dict[tuple[str, str | None], _Template] = {}
        self._pid = os.getpid()

    def _template(self, task: str, compression: str | None) -> _Template:
        template = self._templates.get((task, compression))
        if template is None or self._pid != os.getpid():
            # ``origin`` names the producing process, as Celery's does: rebuild after a fork.
            if self._pid != os.getpid():
                self._templates, self._pid = {}, os.getpid()
            origin = f"gen{self._pid}@{socket.gethostname()}"
            template = _Template(task, self.queue, origin, self._reply_to, compression)
            self._templates[task, compression] = template
        return template

    def envelope(
        self,
        task: str,
        body: bytes,
        argsrepr: str,
        kwargsrepr: str,
        task_id: str,
        compression: str | None = None,
    ) -> bytes:
        """The message as the transport stores it (what ``LPUSH <queue>`` receives).

        ``compression``: the content type kombu's ``compression`` header gives ``body`` (its
        JSON compressed), or None for the JSON itself.
        """
        return self._template(task, compression).render(
            b64encode(body),
            task_id.encode(),
            orjson.dumps(argsrepr),
            orjson.dumps(kwargsrepr),
            new_id().encode(),
        )

    def message(
        self,
        task: str,
        body_json: bytes,
        argsrepr: str,
        kwargsrepr: str,
        task_id: str,
        zstd_body: bytes | None = None,
    ) -> tuple[bytes, publish_hooks.PublishHooks | None]:
        """The message to push (``zstd_body`` in place of ``body_json`` when given), through
        Celery's ``before_task_publish`` receivers when any are connected, and those hooks
        (call their ``after`` once the push is done)."""
        if zstd_body is None:
            message = self.envelope(task, body_json, argsrepr, kwargsrepr, task_id)
        else:
            message = self.envelope(
                task, zstd_body, argsrepr, kwargsrepr, task_id, compressed_body.CONTENT_TYPE
            )
        # Celery's publish signals (tracing headers), when a receiver is connected.
        hooks = publish_hooks.connected()
        if hooks is not None:
            message = hooks.before(task, body_json, message, self.queue)
        return message, hooks


class Attempts:
    """One publish's retry schedule, without I/O: kombu's retry policy keys (``max_retries``,
    ``interval_start``, ``interval_step``, ``interval_max``) within ``timeout`` seconds in
    all, shared by the sync and the asyncio publishers."""

    def __init__(
        self,
        what: str,
        policy: Mapping[str, float],
        timeout: float,
        attempt_worst: float,
        display_url: str,
    ) -> None:
        self.what = what
        self.display_url = display_url
        self.retries = int(policy.get("max_retries", 0))
        self.interval = float(policy.get("interval_start", 0.0))
        self.step = float(policy.get("interval_step", 0.5))
        self.ceiling = float(policy.get("interval_max", 1))
        self.attempt_worst = attempt_worst
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.attempt = 0

    def retry_after(self, exc: redis_errors.RedisError) -> float:
        """The pause before the next attempt after ``exc`` failed this one.

        Raises:
            BrokerUnavailable: no attempt is left, or none would end within the timeout, or
                ``exc`` is not a connection error or timeout (OOM, READONLY, ...: an
                operator's problem that a retry within seconds would not fix).
        """
        if not isinstance(exc, _RETRYABLE):
            raise BrokerUnavailable(
                f"could not publish {self.what} to {self.display_url}: {type(exc).__name__}: {exc}"
            ) from exc
        now = time.monotonic()
        if self.attempt == self.retries or now + self.interval + self.attempt_worst > self.deadline:
            raise BrokerUnavailable(
                f"could not publish {self.what} to {self.display_url}: {self.attempt + 1} "
                f"attempt(s) in {now - self.started:.1f} s, the last: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self.attempt += 1
        pause = self.interval
        self.interval = min(self.interval + self.step, self.ceiling)
        return pause


class RedisPublisher:
    """LPUSH protocol 2 messages onto a Redis broker's queue; safe to share between threads.

    The connection pool is redis-py's, which rebuilds itself in a forked child.
    """

    def __init__(
        self,
        broker_url: str,
        queue: str,
        retry_policy: Mapping[str, float],
        *,
        socket_timeout: float = ATTEMPT_TIMEOUT,
        timeout: float = PUBLISH_TIMEOUT,
    ) -> None:
        """Publish to ``queue`` on ``broker_url``; retry as ``retry_policy`` says (kombu's
        keys: ``max_retries``, ``interval_start``, ``interval_step``, ``interval_max``), for
        ``timeout`` seconds at most."""
        self.queue = queue
        self.retry_policy = dict(retry_policy)
        self.timeout = timeout
        # An attempt's worst case: the connect wait, then the wait for the answer.
        self._attempt_worst = 2 * socket_timeout
        self._display_url = redact_url(broker_url)
        # Our own retry loop decides how long a publish may take; redis-py must not retry
        # underneath it (its default would multiply the wait).
        self._client = redis.Redis.from_url(
            redis_py_url(broker_url),
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=30,
        )
        #: Written with each push that carries records (``attach``); None: plain LPUSH.
        self.pending: PendingRecords | None = None
        self.envelopes = Envelopes(queue)

    @property
    def client(self) -> redis.Redis:
        """The broker connection (pooled; every wait bounded as described above)."""
        return self._client

    @property
    def display_url(self) -> str:
        return self._display_url

    def __repr__(self) -> str:
        return f"RedisPublisher({self._display_url}, queue={self.queue!r})"

    def publish(
        self,
        task: str,
        body_json: bytes,
        argsrepr: str,
        kwargsrepr: str = "{}",
        task_id: str | None = None,
        records: Sequence[RecordWrite] = (),
        zstd_body: bytes | None = None,
    ) -> str:
        """Push one ``task`` message whose body is ``body_json``; return its task id.

        ``records``: the pending records of the requests it carries, written by the same
        script call as the push (``pending``) when this publisher has them.

        ``zstd_body``: ``body_json`` as one zstd frame (``compressed_body``), sent in its
        place under kombu's ``compression`` header.

        A publish that fails on a connection error or timeout is retried per the policy; a
        retried push may land twice, which fenced requests make harmless (Celery's retrying
        publish has the same property).

        Raises:
            BrokerUnavailable: the broker stayed unreachable through the retries.
        """
        task_id = task_id or new_id()
        message, hooks = self.envelopes.message(
            task, body_json, argsrepr, kwargsrepr, task_id, zstd_body
        )
        pending = self.pending
        if pending is not None and records:
            self._push(task, lambda: pending.push(self.queue, message, records))
        else:
            self._push(task, lambda: self._client.lpush(self.queue, message))
        if hooks is not None:
            hooks.after(task, body_json, message, self.queue)
        return task_id

    def attempts(self, what: str) -> Attempts:
        """A publish's retry schedule (``Attempts``), started now."""
        return Attempts(
            what, self.retry_policy, self.timeout, self._attempt_worst, self._display_url
        )

    def _push(self, what: str, push: Callable[[], object]) -> None:
        attempts = self.attempts(what)
        while True:
            try:
                push()
                return
            except redis_errors.RedisError as exc:
                time.sleep(attempts.retry_after(exc))

    def ping(self) -> Any:
        return self._client.ping()

    def close(self) -> None:
        self._client.close()
