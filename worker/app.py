"""The Celery app: every Celery setting checkpointq relies on, chosen and explained here.

``celery -A checkpointq.worker.app worker`` finds the module-level ``app``, built on first access
from the ``CHECKPOINTQ_*`` environment. Programs that hold their own ``Settings`` (the CLI, tests,
benchmarks) call ``create_app(settings)`` instead.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery import Celery

from checkpointq.store.errors import CheckpointError
from checkpointq.store.factory import store_from_settings
from checkpointq.store.keys import KeySpace
from checkpointq.store.redis import RedisStore
from checkpointq.store.urls import is_redis_url, kombu_url, redact_url, redis_py_url
from checkpointq.tasks import checkpoints, runtime
from checkpointq.tasks.brokers import BrokerKind, broker_kind, transport_options
from checkpointq.tasks.dead_letters import DeadLetters
from checkpointq.tasks.policy import RetryPolicy
from checkpointq.tasks.producer.client import PUBLISH_RETRY_POLICY
from checkpointq.tasks.producer.pending import Settler
from checkpointq.tasks.runtime import Runtime
from checkpointq.worker import (
    backpressure,
    beat,
    coalesce,
    compressed_bodies,
    logs,
    lost_settles,
    oversize,
    remote_control,
    reserve,
)
from checkpointq.worker import signals as _signals  # noqa: F401  # importing it connects the hooks
from checkpointq.worker.hooks import celery as celery_hooks
from checkpointq.worker.hooks import kombu as kombu_hooks
from checkpointq.worker.ops import eviction, health, metrics
from checkpointq.worker.settings import Settings

logger = logging.getLogger(__name__)


class MissingBrokerUrl(CheckpointError, ValueError):
    """No broker URL: set CHECKPOINTQ_BROKER_URL or let `checkpointq up` provide one."""


def celery_config(settings: Settings) -> dict[str, Any]:
    """Map the settings onto Celery's configuration: the one place where that happens."""
    if not settings.broker_url:
        raise MissingBrokerUrl(
            "CHECKPOINTQ_BROKER_URL is not set (`checkpointq up` starts an embedded Redis "
            "and sets it for the worker and beat it runs)"
        )
    return {
        # kombu spells a unix socket redis+socket://; everyone else unix:// (store/urls.py).
        "broker_url": kombu_url(settings.broker_url),
        # JSON only, both ways: a pickle message would run arbitrary code in the worker.
        # Messages in any other format are refused and dead-lettered (worker/consumer.py).
        "accept_content": ["json"],
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "result_accept_content": ["json"],
        # Fire-and-forget: no result backend. Producers wait for durability on the store's
        # fence instead (CheckpointClient.wait_durable).
        "result_backend": None,
        # No results to expire: else beat schedules Celery's daily celery.backend_cleanup,
        # a builtin the worker refuses (worker/consumer.py).
        "result_expires": None,
        "task_ignore_result": True,
        "task_store_errors_even_if_ignored": False,
        # Acknowledge after the task ran, so a worker killed mid-task leaves the message to be
        # redelivered (our writes are fenced and idempotent, so a replay is harmless) ...
        "task_acks_late": True,
        # ... including when the child process itself dies (OOM killer, segfault).
        "task_reject_on_worker_lost": True,
        # How many messages each process reserves ahead: few, so that a crash redelivers few
        # and a busy worker does not hoard messages others could run.
        # Coalescing (worker/coalesce.py) needs a group's worth of messages per process.
        "worker_prefetch_multiplier": max(
            settings.prefetch_multiplier,
            settings.coalesce_max_items if settings.coalescing else 1,
        ),
        # Per broker kind (tasks/brokers.py): the visibility timeout and how often to look
        # for expired ones on Redis and Sentinel, the master's name on Sentinel, publisher
        # confirms on RabbitMQ. RabbitMQ queues stay classic and durable: quorum queues
        # replicate only across a 3+ node cluster, and Celery's countdown retries on them
        # need native delayed delivery over topic exchanges (docs/scaling.md).
        "broker_transport_options": transport_options(
            settings.broker_url,
            visibility_timeout=settings.visibility_timeout,
            sentinel_master=settings.sentinel_master,
            sentinel_password=settings.sentinel_password,
        )
        | _reserve_options(settings),
        # Producer side: retry a publish while the broker is briefly unreachable.
        "task_publish_retry": True,
        "task_publish_retry_policy": PUBLISH_RETRY_POLICY,
        # A worker started before Redis keeps trying to connect instead of exiting.
        "broker_connection_retry_on_startup": True,
        "broker_connection_retry": True,
        "broker_connection_max_retries": None,
        # On losing the broker, stop tasks whose message can no longer be acknowledged:
        # Redis will redeliver them, and running them twice at once gains nothing.
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        # Soft shutdown on SIGTERM (Celery >= 5.5): finish running tasks for up to this long,
        # then stop and requeue every unacknowledged message at once, rather than leaving
        # them to the visibility timeout. "On idle" makes it apply to retries waiting for
        # their countdown (ETA messages) even when no task is running.
        "worker_soft_shutdown_timeout": settings.shutdown_timeout_seconds,
        "worker_enable_soft_shutdown_on_idle": settings.shutdown_timeout_seconds > 0,
        # Remote control over the broker: read-only inspection always (celery inspect, status,
        # Flower's worker pages); commands that change the worker (shutdown, pool, rate limits,
        # revoke, events) only with CHECKPOINTQ_REMOTE_CONTROL=true (worker/remote_control.py).
        "worker_enable_remote_control": True,
        # Monitoring events (what Flower shows) only when asked for: nobody consumes them by
        # default, and they cost a publish per task state change.
        "worker_send_task_events": settings.task_events,
        "task_send_sent_event": settings.task_events,
        # Modules imported by every worker at start-up, before the pool forks (Celery's -I):
        # where users set up Sentry or OpenTelemetry and connect signal handlers.
        "include": list(settings.include),
        # Every task goes to our queue; producers in other languages push to the same list.
        "task_default_queue": settings.queue,
        "task_create_missing_queues": True,
        # Refused messages become dead letters instead of vanishing.
        "worker_consumer": "checkpointq.worker.consumer:DeadLetteringConsumer",
        "worker_pool": settings.pool,
        "worker_concurrency": settings.concurrency,
        # The store's connections are made per process (signals.py); Celery's own logging
        # is configured by the `celery worker -l` flag, our libraries' by signals.py.
        "worker_hijack_root_logger": True,
        "enable_utc": True,
        "timezone": "UTC",
    }


def _reserve_options(settings: Settings) -> dict[str, Any]:
    """The worker's own transport options for a Redis broker: the bytes its main process
    holds reserved at most and how long an idle one lets requests gather before reserving
    them (``worker/reserve.py``), and the largest item it reads
    (``worker/oversize.py``). RabbitMQ's client takes no such option."""
    if settings.broker_url is None or broker_kind(settings.broker_url) is BrokerKind.AMQP:
        return {}
    linger = settings.wake_linger_ms if settings.coalescing else 0.0
    return {
        reserve.MAX_HELD_BYTES_OPTION: settings.prefetch_max_bytes,
        reserve.WAKE_LINGER_OPTION: linger,
    } | oversize.transport_options(
        settings.key_prefix, settings.max_message_bytes, settings.oversize_kept
    )


def build_runtime(settings: Settings) -> Runtime:
    """The store, dead letters and policy the tasks run against (connects lazily)."""
    store = store_from_settings(settings)
    if isinstance(store, RedisStore):
        # The store's own layout: on a cluster, keys carry hash tags and the index is sharded.
        keys, side = store.keys, store.client
    else:
        # Dead letters, events and the sweep lock live on the broker beside a database.
        keys = KeySpace(settings.key_prefix)
        side = redis.Redis.from_url(
            redis_py_url(settings.resolved_redis_url or ""),
            socket_timeout=5,
            socket_connect_timeout=5,
        )
    logger.info("store %s", store)
    keyring = settings.keyring
    if keyring is not None:  # ids only: a key is never logged
        logger.info(
            "encryption at rest: values sealed under key id %r; key ids held: %s",
            keyring.primary,
            ", ".join(keyring.key_ids),
        )
    return Runtime(
        store=store,
        redis=side,
        keys=keys,
        dead_letters=DeadLetters(side, keys, maxlen=settings.dead_letter_maxlen),
        retry=RetryPolicy(
            max_retries=settings.retry_max,
            base_seconds=settings.retry_backoff_seconds,
            max_seconds=settings.retry_backoff_max_seconds,
        ),
        max_message_bytes=settings.max_message_bytes,
        group_value_bytes=settings.prefetch_max_bytes,
        max_eta_ahead_seconds=settings.visibility_timeout,
        max_seq_ahead_us=round(settings.max_seq_ahead_seconds * 1_000_000),
        sweep_limit=settings.sweep_limit,
        reconcile_budget=settings.reconcile_budget,
        events_maxlen=settings.events_maxlen,
        pending=_settler(settings),
        queue=settings.queue,
        orphan_grace_seconds=settings.orphan_grace_seconds,
    )


def _settler(settings: Settings) -> Settler | None:
    """Settles the pending records our producers write on a plain Redis broker (on other
    brokers they write none: docs/protocol.md, "Pending records")."""
    url = settings.broker_url
    if not url or not is_redis_url(url):
        return None
    broker = redis.Redis.from_url(redis_py_url(url), socket_timeout=5, socket_connect_timeout=5)
    return Settler(broker, KeySpace(settings.key_prefix))


def create_app(settings: Settings | None = None) -> Celery:
    """A Celery app configured from ``settings`` (default: the environment), tasks registered.

    Also points ``checkpointq.tasks.runtime`` at these settings; each worker process then builds its
    own store connections on first use (``signals.py`` resets them after every fork).

    Raises:
        MissingBrokerUrl: ``settings.broker_url`` is unset.
    """
    settings = settings or Settings()
    app = Celery("checkpointq", set_as_current=False)
    app.config_from_object(celery_config(settings))
    app.conf.update(beat.beat_config(settings))
    checkpoints.register(app)
    compressed_bodies.install(settings.max_message_bytes)
    if settings.coalescing:
        coalesce.install(
            app,
            max_items=settings.coalesce_max_items,
            window_ms=settings.coalesce_window_ms,
            key_prefix=settings.key_prefix,
        )
    runtime.configure(lambda: build_runtime(settings))
    remote_control.install(app, full=settings.remote_control)
    # Operations (worker/ops/metrics.py, worker/ops/health.py, worker/logs.py): the /metrics
    # endpoint, heartbeats for `checkpointq health` and `top`, the log format.
    metrics.install(app, settings)
    health.install(app, settings)
    # While the store refuses writes the worker takes no messages (worker/backpressure.py).
    backpressure.install(app, settings)
    # A broker or store that may evict our keys is named once at start-up.
    eviction.install(app, settings)
    lost_settles.install(app)
    # kombu before 5.7 ignores the restore schedule tasks/brokers.py sets: sweep ourselves.
    kombu_hooks.install_restore_sweep(app)
    # A warm shutdown reads the pool's results until its processes exit, not only while the
    # pool knows of a job: else one can block writing a result, and the worker with it.
    celery_hooks.drain_pool_at_shutdown()
    logs.install(settings.log_format)
    logger.debug("celery app for broker %s", redact_url(settings.broker_url or ""))
    return app


def __getattr__(name: str) -> Any:
    # `celery -A checkpointq.worker.app` reads its `app`; building it on first access (PEP 562)
    # lets the CLI import create_app without needing a broker URL in the environment.
    if name == "app":
        globals()["app"] = created = create_app()
        return created
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
