"""Every setting of checkpointq, in one typed place (environment prefix ``CHECKPOINTQ_``).

Each field's comment gives its unit and why the default is what it is. ``worker/app.py``
maps these onto Celery's configuration; ``store_options()`` onto the store's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from checkpointq.store.base import StoreOptions
from checkpointq.store.keys import DEFAULT_PREFIX, check_prefix
from checkpointq.store.postgres_schema import DEFAULT_SCHEMA, check_schema_name
from checkpointq.store.urls import (
    SUPPORTED_BROKER_SCHEMES,
    check_url,
    is_cluster_url,
    is_postgres_url,
    redact_url,
    scheme_of,
)
from checkpointq.tasks.brokers import BrokerKind, broker_kind, is_known_transport
from checkpointq.worker.embedded import EmbeddedRedis

DAY = 24 * 60 * 60


class Settings(BaseSettings):
    """Configuration read from ``CHECKPOINTQ_*`` environment variables (or a ``.env`` file)."""

    model_config = SettingsConfigDict(env_prefix="CHECKPOINTQ_", env_file=".env", extra="ignore")

    # -- where things live ------------------------------------------------------------
    #: Celery broker URL (redis://, rediss://, unix:///path/redis.sock). Unset: `checkpointq
    #: up` starts an embedded Redis under ``data_dir``, and ``Settings()`` anywhere (every
    #: command, a Python producer) finds it there while it runs.
    broker_url: str | None = None
    #: Store URL: a Redis (``redis://``, ``rediss://``, ``unix://``), a Redis Cluster
    #: (``redis+cluster://host:port[,host:port...]`` or ``...?cluster=true``), or PostgreSQL
    #: (``postgresql://user:password@host:5432/db``: needs ``checkpointq[postgres]`` and a
    #: plain Redis broker, which then keeps the dead letters and events). Unset: the
    #: broker's, which only works for a plain Redis broker; required with RabbitMQ or
    #: Sentinel (``docs/scaling.md``).
    store_url: str | None = None
    #: PostgreSQL store only: the schema (namespace) its tables live in.
    pg_schema: str = DEFAULT_SCHEMA
    #: PostgreSQL store only: create or upgrade the schema on first use (under a lock, once
    #: per version). Off: a missing or older schema is an error until `checkpointq db
    #: upgrade` runs it.
    pg_auto_upgrade: bool = True
    #: Sentinel brokers (``sentinel://host:port;sentinel://host:port``): the master's name
    #: as the sentinels know it (``sentinel monitor <name> ...``).
    sentinel_master: str | None = None
    #: Password of the sentinels themselves, if they require one (the master's goes in the
    #: broker URL).
    sentinel_password: str | None = None
    #: Where beat keeps its schedule and lock (celery-redbeat): a plain Redis URL. Unset:
    #: the store's, or the broker's when the store is a cluster (RedBeat cannot use one) and
    #: the broker is a plain Redis.
    beat_url: str | None = None
    #: Directory of the embedded Redis (socket, AOF files, pid). Default ``./.checkpointq``.
    data_dir: Path = Path(".checkpointq")
    #: Prefix of every store key; the Go store's default, so both sides share data. No ``:``
    #: and no ``.cq`` at the end, so that deployments sharing a Redis never reach each
    #: other's keys (``store/keys.py: check_prefix``).
    key_prefix: str = DEFAULT_PREFIX
    #: Celery queue (a Redis list of that name) that producers push to.
    queue: str = "checkpoints"

    # -- store policy -----------------------------------------------------------------
    #: Session lifetime after its last save or refresh, seconds (Go: 30 days).
    ttl_seconds: float = Field(default=30 * DAY, gt=0)
    #: How long deletes are remembered, seconds. Must outlive any redelivery: the visibility
    #: timeout plus the whole retry schedule, with a wide margin (default 24 h).
    tombstone_ttl_seconds: float = Field(default=1 * DAY, gt=0)
    #: Most recent messages kept per checkpoint (Go: 100).
    history_cap: int = Field(default=100, ge=1)
    #: Largest stored value after compression, bytes; older messages are dropped to fit.
    max_value_bytes: int = Field(default=1024 * 1024, ge=1024)
    #: Largest task message accepted, bytes (JSON body); larger ones are dead-lettered. On a
    #: Redis broker a queue item too large to hold such a body (4/3 of it in base64, plus
    #: 64 KiB of headers) is refused before the worker reads it whole: set aside on the
    #: broker as it arrived (docs/reliability.md, "Oversize messages").
    max_message_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    #: Oversize queue items kept whole on the broker for ``checkpointq dlq replay``; past
    #: this many the oldest are deleted (their dead letters keep a 64 KiB sample).
    oversize_kept: int = Field(default=16, ge=0)
    #: Whether our Python producers send a save's body zstd-compressed, under kombu's
    #: standard ``compression`` header (default True; docs/protocol.md). Every Celery
    #: consumer decodes it whose kombu has a zstd codec (kombu 5.5/5.6 with zstandard, 5.7
    #: with backports.zstd or Python 3.14; the worker extra brings it). False: plain JSON.
    compress_messages: bool = True
    #: Whether our Python producers send a save as ``checkpoint.save_staged`` on a Redis
    #: broker: the stored value goes to the broker once, under the request's id, beside a
    #: message that names it (default True; docs/protocol.md, "Staged saves"). Workers must
    #: know the task: upgrade them first. False: the checkpoint travels in the message.
    stage_saves: bool = True
    #: How far a request's ``seq`` (the producer's clock, µs) may be ahead of the worker's
    #: clock; further ahead, it is dead-lettered, since it would make every later request
    #: for its session stale until the clocks meet (tasks/seq.py).
    max_seq_ahead_seconds: float = Field(default=300.0, gt=0)

    # -- delivery ---------------------------------------------------------------------
    #: Seconds before Redis redelivers a message a worker fetched but never acknowledged
    #: (worker killed). Longer than any task run plus retry countdown, so a healthy worker's
    #: message is not handed out twice; duplicates would be harmless anyway (fenced writes).
    visibility_timeout: int = Field(default=300, ge=10)
    #: Messages each worker process reserves ahead; 1 keeps crash redelivery small. While
    #: coalescing, each process reserves at least ``coalesce_max_items``.
    prefetch_multiplier: int = Field(default=1, ge=1)
    #: Retries of a request whose store is unavailable, before it is dead-lettered.
    retry_max: int = Field(default=8, ge=0)
    #: First retry delay, seconds; doubles each retry, with full jitter.
    retry_backoff_seconds: float = Field(default=1.0, gt=0)
    #: Ceiling of one retry delay, seconds. Kept well below ``visibility_timeout``.
    retry_backoff_max_seconds: float = Field(default=60.0, gt=0)
    #: Seconds between a worker's write probes of the store. While the store refuses writes
    #: (down, out of memory, read-only) the worker takes no messages, so they wait in the
    #: broker however long the outage lasts; the first accepted probe resumes consuming.
    store_probe_seconds: float = Field(default=1.0, gt=0)
    #: Worker pool and processes (or threads) per worker.
    pool: Literal["prefork", "solo", "threads"] = "prefork"
    concurrency: int = Field(default=2, ge=1)
    #: The worker's node name (Celery's ``-n``: ``%h`` is the host name), shown by `health`,
    #: `top` and Flower. Unset: Celery's ``celery@<host>``. Two workers on one host need two.
    hostname: str | None = None
    #: Single saves and deletes applied together, at most this many per store round trip
    #: (worker/coalesce.py); each message is still acknowledged only once its own item is
    #: durable. Each pool process then reserves this many messages ahead. 0 or 1: off. The
    #: threads pool never coalesces.
    coalesce_max_items: int = Field(default=32, ge=0, le=1000)
    #: Milliseconds a group may wait for more requests after its first arrived while another
    #: group is in the pool and a pool process is idle (default 2). With nothing in the pool
    #: a group goes at the end of the event loop's turn that delivered it; while every pool
    #: process is busy it fills and goes the moment one is free. 0: never wait while a
    #: process is idle (more, smaller groups under load). A message waits in the main
    #: process at most this long, or until a pool process is free or its group is full.
    coalesce_window_ms: float = Field(default=2.0, ge=0, le=1000)
    #: Bytes of message bodies a worker's main process holds reserved at most (default 4 MiB;
    #: 0: bounded by the message count alone). The prefetch window counts messages: with
    #: 200 KB checkpoints its 64 messages held ~50 MB in the main process and a group's worth
    #: in each pool process. Past this budget the worker reads no more until some is
    #: acknowledged; one message is read whatever its size. Redis brokers only. It also
    #: bounds the staged values a coalesced group reads (a larger one is read alone).
    prefetch_max_bytes: int = Field(default=4 * 1024 * 1024, ge=0)

    @property
    def coalescing(self) -> bool:
        """Whether this worker groups single saves and deletes (see ``coalesce_max_items``)."""
        return self.coalesce_max_items >= 2 and self.pool in ("prefork", "solo")

    #: On SIGTERM, seconds a worker keeps running its current tasks before it stops and
    #: requeues every message it still holds (retries waiting for their countdown included).
    shutdown_timeout_seconds: float = Field(default=10.0, ge=0)
    #: Allow Celery's whole remote control (shutdown, pool and rate-limit changes, revoke,
    #: enabling events over the broker). Off: workers answer read-only inspection only
    #: (``celery inspect ping|stats|active|registered``, ``celery status``), so nobody with
    #: broker access can stop or reconfigure them by pushing a control message.
    remote_control: bool = False
    #: Send Celery task events (what Flower shows). Off: each event is one more publish per
    #: task, and nobody consumes them unless Flower (or `celery events`) runs.
    task_events: bool = False
    #: Modules every worker process imports at start-up (Celery's ``-I``/``include``),
    #: comma-separated in the variable: e.g. the one that sets up Sentry or OpenTelemetry,
    #: or connects task signal handlers. Empty by default.
    include: Annotated[list[str], NoDecode] = Field(default_factory=list)

    @field_validator("include", mode="before")
    @classmethod
    def _split_modules(cls, value: object) -> object:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    # -- housekeeping -----------------------------------------------------------------
    #: Seconds between beat's sweeps of expired sessions.
    sweep_interval_seconds: float = Field(default=60.0, gt=0)
    #: Most sessions one sweep expires (the next sweep carries on).
    sweep_limit: int = Field(default=10_000, ge=1)
    #: Redis Cluster only: seconds between sweeps that read every slot's deadline index; the
    #: sweeps between read only the slots the sweep hint names (docs/scaling.md). A session
    #: whose deadline the hint missed (clock skew, a lowered TTL) is expired at most this late.
    sweep_full_pass_seconds: float = Field(default=300.0, gt=0)
    #: Seconds between beat's reconciliation slices (store/reconcile.py): each adopts keys
    #: other writers (a Go RedisStore) saved alone and drops entries of values they deleted.
    reconcile_interval_seconds: float = Field(default=10.0, gt=0)
    #: Keys and index entries one reconciliation slice looks at (the next carries on). A full
    #: pass takes about (keys in the store's database + sessions) / budget slices.
    reconcile_budget: int = Field(default=50_000, ge=1)
    #: Entries kept in the dead-letter stream (oldest trimmed first).
    dead_letter_maxlen: int = Field(default=100_000, ge=100)
    #: Entries kept in the events stream (expired sessions, and sessions reconciliation
    #: dropped after another writer deleted them: docs/protocol.md, "Events").
    events_maxlen: int = Field(default=100_000, ge=100)

    # -- logging ----------------------------------------------------------------------
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    #: ``text``: one human line per event; ``json``: one JSON object per line, with
    #: ``session_id``, ``seq``, ``outcome`` and ``task_id`` as fields where they apply.
    log_format: Literal["text", "json"] = "text"

    # -- operations -------------------------------------------------------------------
    #: Port of the worker's Prometheus endpoint (``/metrics``, served by the worker's main
    #: process). Unset: no endpoint (the worker still counts, for `checkpointq top`).
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    #: Address the metrics endpoint listens on; all interfaces, so a scraper in another
    #: container or pod can reach it.
    metrics_address: str = "0.0.0.0"  # noqa: S104
    #: Seconds between a worker's heartbeats (health checks and `checkpointq top` read them);
    #: a heartbeat lives three times this long.
    heartbeat_seconds: float = Field(default=5.0, gt=0)

    _embedded: bool = PrivateAttr(default=False)

    @model_validator(mode="after")
    def _find_embedded(self) -> Settings:
        # Defined first, so the checks below see the URL found.
        if self.broker_url is None:
            endpoint = EmbeddedRedis(self.data_dir).running()
            if endpoint is not None:
                self.broker_url = endpoint.url
                self._embedded = True
        return self

    @property
    def found_embedded(self) -> bool:
        """Whether ``broker_url`` is that of a running ``checkpointq up``'s embedded Redis
        (none was configured)."""
        return self._embedded

    @field_validator("broker_url", "store_url", "beat_url")
    @classmethod
    def _url_is_readable(cls, url: str | None) -> str | None:
        # Empty counts as unset (compose's ${VAR:-} of a variable left empty).
        return check_url(url) if url else None

    @field_validator("pg_schema")
    @classmethod
    def _schema_is_identifier(cls, schema: str) -> str:
        return check_schema_name(schema)

    @field_validator("key_prefix")
    @classmethod
    def _prefix_cannot_nest(cls, prefix: str) -> str:
        return check_prefix(prefix)

    @model_validator(mode="after")
    def _delivery_fits(self) -> Settings:
        if self.retry_backoff_max_seconds >= self.visibility_timeout:
            raise ValueError(
                "retry_backoff_max_seconds must be below visibility_timeout, or a retried "
                "message would be redelivered while it waits"
            )
        if self.tombstone_ttl_seconds <= self.visibility_timeout:
            raise ValueError("tombstone_ttl_seconds must exceed visibility_timeout")
        return self

    @model_validator(mode="after")
    def _brokers_fit(self) -> Settings:
        if self.broker_url and not is_known_transport(self.broker_url):
            accepted = ", ".join(f"{scheme}://" for scheme in SUPPORTED_BROKER_SCHEMES)
            raise ValueError(
                f"unsupported broker URL scheme {scheme_of(self.broker_url)!r}: "
                f"use one of {accepted}"
            )
        kind = broker_kind(self.broker_url) if self.broker_url else BrokerKind.REDIS
        if kind is not BrokerKind.REDIS and not self.store_url:
            # Only a plain Redis broker can double as the store: an amqp:// or sentinel://
            # URL handed to RedisStore would fail on the first request, not at start-up.
            raise ValueError(
                f"store_url is required with a {kind.value} broker (the store needs a Redis "
                "URL of its own)"
            )
        if self.store_is_postgres and kind is not BrokerKind.REDIS:
            raise ValueError(
                "a PostgreSQL store needs a plain Redis broker (redis://, rediss://, unix://): "
                "it keeps the pending records, dead letters and events beside the queue"
            )
        if kind is BrokerKind.SENTINEL and not self.sentinel_master:
            raise ValueError("sentinel_master is required with a sentinel:// broker")
        if self.broker_url and self.resolved_beat_url is None:
            raise ValueError(
                "beat_url is required: beat's schedule needs a plain Redis, and neither the "
                "store (a cluster) nor the broker (not a plain Redis) is one"
            )
        return self

    @property
    def resolved_store_url(self) -> str | None:
        """The store's URL: its own, else the broker's when that is a plain Redis."""
        if self.store_url:
            return self.store_url
        if self.broker_url and broker_kind(self.broker_url) is BrokerKind.REDIS:
            return self.broker_url
        return None

    @property
    def store_is_postgres(self) -> bool:
        """Whether the store is a PostgreSQL database (``store/postgres.py``)."""
        return is_postgres_url(self.resolved_store_url)

    @property
    def resolved_redis_url(self) -> str | None:
        """The Redis that keeps what lives beside the checkpoints: dead letters and
        refusals, events, the sweep lock, worker heartbeats. The store's when the store is a
        Redis; the broker's when the store is PostgreSQL."""
        if self.store_is_postgres:
            return self.broker_url
        return self.resolved_store_url

    @property
    def resolved_beat_url(self) -> str | None:
        """Where RedBeat keeps the schedule: a plain Redis (RedBeat cannot use a cluster)."""
        if self.beat_url:
            return self.beat_url
        store = self.resolved_redis_url
        if store and not is_cluster_url(store):
            return store
        if self.broker_url and broker_kind(self.broker_url) is BrokerKind.REDIS:
            return self.broker_url
        return None

    def store_options(self) -> StoreOptions:
        return StoreOptions(
            ttl_seconds=self.ttl_seconds,
            tombstone_ttl_seconds=self.tombstone_ttl_seconds,
            history_cap=self.history_cap,
            max_value_bytes=self.max_value_bytes,
            sweep_full_pass_seconds=self.sweep_full_pass_seconds,
        )

    def describe(self) -> dict[str, object]:
        """The settings as they may be printed or logged: URLs redacted."""
        shown = self.model_dump(mode="json")
        shown["sentinel_password"] = "****" if self.sentinel_password else None
        for name in ("broker_url", "store_url", "beat_url"):
            if shown[name]:
                shown[name] = redact_url(shown[name])
        return shown
