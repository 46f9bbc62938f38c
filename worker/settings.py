"""Every setting of checkpointq, in one typed place (environment prefix ``CHECKPOINTQ_``).

Each field's comment gives its unit and why the default is what it is. ``worker/app.py``
maps these onto Celery's configuration; ``store_options()`` onto the store's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from checkpointq.store.base import StoreOptions
from checkpointq.store.encryption import EncryptionError, Keyring
from checkpointq.store.errors import CheckpointError
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


class InvalidSettings(CheckpointError, ValueError):
    """A CHECKPOINTQ_ variable (or a keyword given to ``Settings``) holds a value the settings
    refuse: the first one and why, its value not echoed (it may be a URL with a password)."""


def _invalid(exc: ValidationError) -> InvalidSettings:
    first = exc.errors(include_url=False, include_input=False)[0]
    name = "_".join(str(part) for part in first["loc"]).upper()
    where = f"CHECKPOINTQ_{name}" if name else "settings"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    why = first["msg"].removeprefix("Value error, ")  # pydantic's words for a ValueError
    return InvalidSettings(f"invalid {where}: {why}{more}")


class Settings(BaseSettings):
    """Configuration read from ``CHECKPOINTQ_*`` environment variables (or a ``.env`` file).

    Raises:
        InvalidSettings: a value is refused (a ``CheckpointError`` and a ``ValueError``, as
            every error checkpointq raises on purpose).
    """

    # Inputs are never echoed in a validation error: they may hold keys or passwords.
    model_config = SettingsConfigDict(
        env_prefix="CHECKPOINTQ_", env_file=".env", extra="ignore", hide_input_in_errors=True
    )

    if not TYPE_CHECKING:  # (mypy keeps the fields' own signature, from pydantic's plugin)

        def __init__(self, **values: Any) -> None:
            try:
                super().__init__(**values)
            except ValidationError as exc:
                raise _invalid(exc) from None

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
    #: PostgreSQL store only: let psycopg prepare statements on the server (at a
    #: statement's fifth use). Off by default: behind PgBouncer in transaction mode before
    #: 1.21 (Debian 12 ships 1.18), or 1.21+ without ``max_prepared_statements``, the next
    #: call may reach another server connection where the statement does not exist. On only
    #: for a direct connection or a pooler that keeps them (docs/operations.md#postgresql).
    pg_prepared_statements: bool = False
    #: PostgreSQL store only: milliseconds a group's statement waits on a row lock another
    #: client holds (``SELECT ... FOR UPDATE`` in an analytics or erasure transaction) before
    #: the group runs item by item: every other session applies, and the held one retries on
    #: its own. 0: the server's ``lock_timeout``.
    pg_lock_timeout_ms: int = Field(default=1000, ge=0)
    #: PostgreSQL store only: when a write counts as durable (its request settled, its
    #: message acknowledged, ``wait_durable`` answered). ``replicated`` (default): once a
    #: standby has flushed it, if the primary has standbys (a physical replication slot or
    #: walsender); on a primary without any, at its commit. ``local``: at the primary's
    #: commit, even with standbys: an asynchronous standby promoted before it received the
    #: last commits loses them (docs/reliability.md, "PostgreSQL failover").
    pg_durability: Literal["local", "replicated"] = "replicated"
    #: PostgreSQL store only, ``replicated``: seconds a write waits for a standby to flush
    #: it; past that it is not settled (its message waits on the broker) and the worker
    #: pauses until a standby streams again.
    pg_replication_timeout_seconds: float = Field(default=10.0, gt=0)
    #: Plain Redis brokers: when our producers' saves and deletes count as accepted (their
    #: call returns). ``local`` (default): once the broker's primary has them (a machine
    #: crash inside its fsync window, or a failover to a replica that had not received them,
    #: loses them: detected and republished from the recovery window). ``replicated``: once
    #: ``broker_replicas`` replicas acknowledged them (Redis ``WAIT`` on the publishing
    #: connection, in the same write), else ``ReplicationTimeout`` after
    #: ``broker_replication_timeout_ms`` (the request is queued on the primary, and may still
    #: apply; docs/reliability.md, "The broker's durability").
    broker_durability: Literal["local", "replicated"] = "local"
    #: ``replicated``: how many broker replicas must acknowledge each save and delete.
    broker_replicas: int = Field(default=1, ge=1, le=100)
    #: ``replicated``: milliseconds a save or delete waits for them (default 1 s: a replica
    #: on the same network acknowledges within a millisecond or two) before it raises.
    broker_replication_timeout_ms: int = Field(default=1000, ge=1, le=60_000)
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
    #: Encryption at rest (docs/security.md): ``id:key,id:key,...``, each key 32 random
    #: bytes in URL-safe base64 (`checkpointq keygen` prints a pair). The first key seals
    #: every value written; all of them open values read. Unset: values are written in
    #: clear. Never shown by any command nor logged.
    encryption_keys: SecretStr | None = None
    #: A file holding the same text as ``encryption_keys`` (pairs separated by commas or
    #: new lines), e.g. a mounted secret; not both.
    encryption_keys_file: Path | None = None
    #: The recovery window of our Python producers on a Redis broker: the requests they
    #: published in the last this many seconds (at most ``republish_requests`` of them and
    #: ``republish_bytes`` of messages and values) are published again when a producer
    #: finds the broker lost accepted requests (a crash inside its fsync window, a failover
    #: to a lagging replica; docs/reliability.md). 0 keeps none.
    republish_seconds: float = Field(default=10.0, ge=0)
    republish_requests: int = Field(default=10_000, ge=0)
    republish_bytes: int = Field(default=64 * 1024 * 1024, ge=0)
    #: How old (by its seq) a pending request's entry must be before the sweep looks for its
    #: message; one whose message is gone (a purge) is settled as lost, dead-lettered, at
    #: the sweep after the one that found it (tasks/orphans.py).
    orphan_grace_seconds: float = Field(default=600.0, gt=0)

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
    #: Milliseconds a coalescing worker woken by a request lets more gather before it
    #: reserves them, when its last wake-up was under 100 ms ago (Redis brokers; default 5;
    #: 0: reserve at once). At a fraction of capacity each request otherwise wakes the
    #: worker and is reserved, grouped, applied (a store commit of its own) and acknowledged
    #: alone; the linger shares that cost among the requests arriving meanwhile, for up to
    #: as many ms more before each is durable (the producer's save returns as before; the
    #: first request after a quiet spell goes at once). Nothing leaves the queue meanwhile.
    #: Not used without coalescing.
    wake_linger_ms: float = Field(default=5.0, ge=0, le=100)
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
    _keyring: Keyring | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _keys_parse(self) -> Settings:
        # Parsed once, here, so that a malformed key is refused at start-up in one line
        # (the message names the pair's id, never its key).
        given = self.encryption_keys.get_secret_value() if self.encryption_keys else ""
        if given.strip() and self.encryption_keys_file is not None:
            raise ValueError(
                "set CHECKPOINTQ_ENCRYPTION_KEYS or CHECKPOINTQ_ENCRYPTION_KEYS_FILE, not both"
            )
        try:
            if self.encryption_keys_file is not None:
                self._keyring = Keyring.from_file(self.encryption_keys_file)
            elif given.strip():
                self._keyring = Keyring.parse(given)
        except EncryptionError as exc:
            which = "_FILE" if self.encryption_keys_file is not None else ""
            raise ValueError(f"CHECKPOINTQ_ENCRYPTION_KEYS{which}: {exc}") from None
        return self

    @property
    def keyring(self) -> Keyring | None:
        """The encryption keys (``encryption_keys``), or None: encryption is off."""
        return self._keyring

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
        if self.orphan_grace_seconds <= self.republish_seconds:
            raise ValueError(
                "orphan_grace_seconds must exceed republish_seconds, or a request the sweep "
                "settled as lost could be published again by its producer and land after it"
            )
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
        if self.broker_durability == "replicated" and kind is not BrokerKind.REDIS:
            raise ValueError(
                f"broker_durability=replicated needs a plain Redis broker (redis://, "
                f"rediss://, unix://), not a {kind.value} one: the WAIT goes on the "
                "connection our producers publish on"
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
            encryption=self._keyring,
        )

    def describe(self) -> dict[str, object]:
        """The settings as they may be printed or logged: URLs redacted."""
        shown = self.model_dump(mode="json")
        shown["sentinel_password"] = "****" if self.sentinel_password else None
        keyring = self._keyring
        shown["encryption_keys"] = None if keyring is None else {"key_ids": keyring.key_ids}
        for name in ("broker_url", "store_url", "beat_url"):
            if shown[name]:
                shown[name] = redact_url(shown[name])
        return shown
