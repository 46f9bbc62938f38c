"""A world to run histories in: API server replicas with clocks of their own, workers that
take, apply, settle, acknowledge and crash one step at a time, a broker and a store, and a
time that jumps forward on demand.

Everything that decides the protocol is the real code on real redis-servers: the producers
are ``CheckpointClient``s (publish.lua, read_pending.lua), the workers apply through the
coalesced path (``tasks.coalesced.apply_requests``) or the task path (the registered
``CheckpointTask``s, called in-process), settle with settle.lua and run the store's own
scripts. What the world plays itself is what kombu and the operating system do: taking a
message into ``unacked``, restoring it after the visibility timeout, a worker dying, a broker
losing its data, and time passing (``clock.SharedClock``, which the servers follow).

The store is a second redis-server, the broker's own (a one-Redis world), or a
``PostgresStore`` on a private PostgreSQL whose clock follows the same ``SharedClock``
(a PostgreSQL world: the broker stays Redis, with the pending records and, as beside a
database in a deployment, the dead letters).

A history is a list of actions (``Action``: a name and small integers, resolved against the
world's state when run, so that any sub-list of a history still runs). ``World.run`` plays
one, records what each producer saw (``History``), and ends by letting the workers drain
everything, so that ``checker.check`` can hold the record against the invariants of
docs/semantics.md.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis
from celery import Celery, states

from checkpointq.store.base import CheckpointStore, Fence, StoreOptions
from checkpointq.store.encryption import Keyring, MissingEncryptionKey
from checkpointq.store.errors import StoreUnavailable
from checkpointq.store.keys import KeySpace
from checkpointq.store.ordering import deadline_ms
from checkpointq.store.postgres import PostgresStore
from checkpointq.store.redis import RedisStore
from checkpointq.store.rekey import rekey
from checkpointq.tasks import checkpoints, coalesced, messages, orphans, runtime
from checkpointq.tasks.dead_letters import DeadLetters
from checkpointq.tasks.errors import PendingRecordMissing, RequestRefused, SeqRefused
from checkpointq.tasks.policy import RetryPolicy
from checkpointq.tasks.producer.client import CheckpointClient, Handle
from checkpointq.tasks.producer.clock import SeqClock
from checkpointq.tasks.producer.pending import Settlement, Settler
from checkpointq.tasks.runtime import Runtime
from tests.history.clock import SharedClock
from tests.postgres.proxy import Proxy
from tests.support.checkpoints import make_checkpoint
from tests.support.envelopes import protocol2
from tests.support.postgres import PostgresServer
from tests.support.servers import RedisServer

QUEUE = "checkpoints"
PREFIX = "hist"
#: The PostgreSQL worlds' schema.
SCHEMA = "history"

#: The protocol's constants, scaled down so that histories cross every one of them.
TTL_S = 30.0
MARGIN_S = 5.0
LIMIT_S = 10.0
VISIBILITY_S = 15.0

#: Two sessions; the second id is one that could reach other keys if ids were patterns.
SESSIONS = ("s1", "s:2{*}")

#: The replicas, by name: how far their clocks run ahead of the servers' (s). The last
#: two are faulty beyond the limits: one ahead by more than half the limit (its publishes
#: are refused), one behind by more than the TTL (its own stamps are refused, as past
#: their deadlines, until a load gives it a fence to stamp after).
PRODUCERS = (("a", 0.0), ("b", -3.0), ("c", 4.0), ("fast", 8.0), ("slow", -45.0))
HEALTHY = frozenset({"a", "b", "c"})

#: Seconds a write waits for the standby's flush (``replicated``, the default durability):
#: short, so that a history with the standby cut off moves on.
REPLICATION_TIMEOUT_S = 0.2

#: Milliseconds a group waits on a held row (1,000 in a deployment): short, for the same.
LOCK_TIMEOUT_MS = 100

#: ``apply_group``'s and ``apply_each``'s arguments (store/sql/v2.sql), to move them.
_GROUP_ARGS = (
    "integer, bigint, bigint, text[], bytea[], bigint[], bytea[], bytea[], bigint[], "
    "text[], jsonb[]"
)

#: Encrypted worlds (issue 41): the workers and the even producers seal under "new", the odd
#: ones under "old" (a rotation under way); every one holds both keys.
_OLD, _NEW = ("old", bytes(range(32))), ("new", bytes(range(32, 64)))
NEW_FIRST, OLD_FIRST, NEW_ONLY = Keyring([_NEW, _OLD]), Keyring([_OLD, _NEW]), Keyring([_NEW])

#: Workers: the first applies groups (the coalesced path), the second runs each request as
#: the single task it is.
WORKERS = 2


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a history: a name and small integers (see ``World.step``)."""

    name: str
    args: tuple[int, ...] = ()

    def as_json(self) -> list[Any]:
        return [self.name, *self.args]

    @classmethod
    def from_json(cls, data: Sequence[Any]) -> Action:
        return cls(str(data[0]), tuple(int(a) for a in data[1:]))

    def __str__(self) -> str:
        return f"{self.name}({', '.join(map(str, self.args))})"


@dataclass
class Request:
    """A request a producer's publish returned for (accepted)."""

    request_id: str
    producer: str
    session: str
    deleted: bool
    seq: int
    #: A save's checkpoint version: unique in the history, so a loaded value names its save.
    version: int | None
    accepted_us: int
    handle: Handle

    @property
    def key(self) -> tuple[int, int, bytes]:
        return (self.seq, 1 if self.deleted else 0, self.request_id.encode())

    @property
    def deadline_us(self) -> int:
        deadline = deadline_ms(self.seq, int(TTL_S * 1000))
        assert deadline is not None, "our producers stamp times"
        return deadline * 1000


@dataclass
class Read:
    """What a load answered: the fence it came with and the version it loaded."""

    producer: str
    session: str
    start_us: int
    end_us: int
    fence: Fence | None
    version: int | None
    error: str | None = None
    #: The losses its producer had counted once it answered (``epoch_changes``).
    counted: int = 0


@dataclass
class Listing:
    producer: str
    start_us: int
    end_us: int
    sessions: list[str]


@dataclass
class OutcomeRead:
    producer: str
    request_id: str
    at_us: int
    outcome: str


@dataclass
class Loss:
    """The broker lost its data at ``at_us``; ``lost``: the requests still to land then."""

    at_us: int
    lost: set[str]
    #: A loss of the broker's data (all of it, or a suffix: a rewind), which producers must
    #: detect (invariant (e)): the losses each producer had counted by then, and the
    #: requests whose pending entry it took. None for a purge, which no epoch or mark shows.
    counted: dict[str, int] | None = None
    taken: set[str] = field(default_factory=set)


@dataclass
class Final:
    """A session once every worker drained the queue."""

    fence: Fence | None
    version: int | None
    loaded: int | None


@dataclass
class History:
    """What a run of actions did, as the producers saw it."""

    one_redis: bool
    actions: list[Action]
    #: The store was PostgreSQL (the broker Redis apart from it).
    postgres: bool = False
    requests: dict[str, Request] = field(default_factory=dict)
    refused_at_publish: list[tuple[str, str, str]] = field(default_factory=list)
    reads: list[Read] = field(default_factory=list)
    listings: list[Listing] = field(default_factory=list)
    outcomes: list[OutcomeRead] = field(default_factory=list)
    losses: list[Loss] = field(default_factory=list)
    hijacks: list[tuple[str, str]] = field(default_factory=list)
    #: (session, request id, seq) of each dead letter, read once the workers drained.
    dead_letters: list[tuple[str | None, str | None, int | None]] = field(default_factory=list)
    final: dict[str, Final] = field(default_factory=dict)
    #: Encrypted worlds: what a store holding the new key alone loads differently, once a
    #: last rekey ran after the drain (nothing, if rotation loses nothing).
    rekey_losses: list[str] = field(default_factory=list)
    end_us: int = 0
    #: An exception a step raised (itself a failure: no step may raise).
    crash: str | None = None


@dataclass
class _Held:
    """A message a worker took: where it stands between take and acknowledgement."""

    tag: str
    task: str
    task_id: str
    body: bytes
    headers: dict[str, Any]
    delivery_info: dict[str, Any]
    applied: bool = False
    settled: bool = False
    acked: bool = False
    settlement: Settlement | None = None


class Servers:
    """The broker and the store: two redis-servers on the shared clock (one of them is both
    in one-Redis worlds), and with ``postgres`` a PostgreSQL server on that clock too."""

    def __init__(self, *, postgres: bool = False) -> None:
        directory = Path(tempfile.mkdtemp(prefix="cq-history-"))
        directory.chmod(0o755)  # PostgreSQL (user postgres) maps the offset file in it
        self.clock = SharedClock(directory / "offset")
        env = self.clock.server_env()
        self.broker = RedisServer(env=env).start()
        self.store = RedisServer(env=env).start()
        self.postgres: PostgresServer | None = None
        #: A streaming standby of ``postgres`` (with a replication slot), made again after
        #: each promotion; and the address the stores reach the primary by, which moves.
        self.standby: PostgresServer | None = None
        self.proxy: Proxy | None = None
        self._env = env
        if postgres:
            self.postgres = PostgresServer(env=env).start()
            self._check_postgres_follows_the_clock()
            self.proxy = Proxy(self.postgres.port)

    @property
    def store_url(self) -> str:
        """The PostgreSQL store's URL: the proxy in front of the current primary."""
        assert self.proxy is not None
        return self.proxy.url()

    def ensure_standby(self) -> PostgresServer:
        """The primary's streaming standby, made (``pg_basebackup``) if there is none."""
        assert self.postgres is not None
        if self.standby is None:
            self.standby = PostgresServer(
                env=self._env, standby_of=self.postgres, slot="history"
            ).start()
        return self.standby

    def fail_over(self) -> None:
        """The primary crashes; its standby, promoted with what it has, takes its address."""
        assert self.postgres is not None and self.standby is not None and self.proxy
        old, self.postgres, self.standby = self.postgres, self.standby, None
        old.cleanup()
        self.postgres.promote()
        self.proxy.retarget(self.postgres.port)
        self.proxy.drop_all()

    def _check_postgres_follows_the_clock(self) -> None:
        """An hour's jump must show in ``clock_timestamp()`` at once: a preload the server
        could not open or an offset it could not map would leave the database on the wall
        clock, and every deadline it judges would then be wrong without a word."""
        assert self.postgres is not None
        hour_us = 3_600_000_000
        with psycopg.connect(self.postgres.url, autocommit=True) as conn:
            self.clock.advance(hour_us)
            row = conn.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()
            assert row is not None
            lag_us = self.clock.now_us() - int(float(row[0]) * 1_000_000)
        if abs(lag_us) > hour_us // 2:
            raise RuntimeError(
                f"PostgreSQL's clock does not follow the history's ({lag_us} µs behind): "
                "is timeshift.so or its offset file unreadable to the server's user?"
            )

    def close(self) -> None:
        self.broker.cleanup()
        self.store.cleanup()
        if self.proxy is not None:
            self.proxy.close()
        for server in (self.standby, self.postgres):
            if server is not None:
                server.cleanup()
        self.clock.close()


class World:
    """One history's world on ``servers``: its state is reset by ``run``.

    ``postgres``: the store is a ``PostgresStore`` (``servers`` must run PostgreSQL), and
    ``store_client`` is the broker's Redis, where the dead letters go.

    ``encrypted``: values are sealed (``NEW_FIRST``, ``OLD_FIRST``), and ``rekey`` steps
    rewrite the store under the new key beside everything else.
    """

    def __init__(
        self,
        servers: Servers,
        *,
        one_redis: bool,
        settle_source: str | None = None,
        postgres: bool = False,
        encrypted: bool = False,
    ):
        self.servers = servers
        self.clock = servers.clock
        self.one_redis = one_redis and not postgres
        self.postgres = postgres
        self.keys = KeySpace(PREFIX)
        store_server = servers.broker if self.one_redis or postgres else servers.store
        self.broker_url, self.store_url = servers.broker.url, store_server.url
        self.broker: redis.Redis = servers.broker.client()
        self.store_client: redis.Redis = store_server.client()
        self.encrypted = encrypted
        self.options = StoreOptions(
            ttl_seconds=TTL_S,
            tombstone_ttl_seconds=MARGIN_S,
            encryption=NEW_FIRST if encrypted else None,
        )
        self.sql: psycopg.Connection[Any] | None = None
        if postgres:
            if servers.postgres is None:
                raise ValueError("a PostgreSQL world needs Servers(postgres=True)")
            self.store_url = servers.store_url
            schema_maker = PostgresStore(self.store_url, schema=SCHEMA)
            schema_maker.ping()  # creates the schema, as any store's first use would
            schema_maker.close()
        #: Another client's transaction holding session rows (``lock``), by session.
        self.holders: dict[str, psycopg.Connection[Any]] = {}
        self.app = Celery("history", set_as_current=False)
        checkpoints.register(self.app)
        #: A settle.lua of another rule (a broken variant, to show the checker finds it).
        self.settle_source = settle_source

    def close(self) -> None:
        """Close the world's own connections (a run's stores close at its end)."""
        if self.sql is not None:
            self.sql.close()
        self._unlock_all()

    # -- a run ------------------------------------------------------------------------------

    def run(self, actions: Sequence[Action]) -> History:
        """Play ``actions`` from a clean world, then drain; the history of what was seen."""
        self.broker.flushall()
        self.broker.script_flush()
        if self.postgres:
            self._reset_postgres()
        elif not self.one_redis:
            self.store_client.flushall()
        self.history = History(self.one_redis, list(actions), postgres=self.postgres)
        self.versions = 0
        self.clients = {
            name: self._client(skew, OLD_FIRST if i % 2 else NEW_FIRST)
            for i, (name, skew) in enumerate(PRODUCERS)
        }
        self.handles: list[Request] = []
        self.snapshot: tuple[int, dict[Any, tuple[bytes, int]]] | None = None
        self.held: list[list[_Held]] = [[] for _ in range(WORKERS)]
        store = self._new_store()
        settler = (
            Settler(self.broker, self.keys)
            if self.settle_source is None
            else VariantSettler(self.broker, self.keys, self.settle_source)
        )
        self.settler = settler
        runtime.install(
            Runtime(
                store=store,
                redis=self.store_client,
                keys=self.keys,
                dead_letters=DeadLetters(self.store_client, self.keys),
                retry=RetryPolicy(max_retries=0, base_seconds=0.001, max_seconds=0.001),
                max_seq_ahead_us=int(LIMIT_S * 1_000_000),
                pending=settler,
                queue=QUEUE,
            )
        )
        self.store = store
        try:
            for action in actions:
                self.step(action)
            self.drain()
            self.read_final()
        except Exception as exc:  # any step raising is a finding, with its traceback
            self.history.crash = "".join(traceback.format_exception(exc))
        finally:
            for client in self.clients.values():
                client.close()
            runtime.reset()
            store.close()
        self.history.end_us = self.clock.now_us()
        return self.history

    def _reset_postgres(self) -> None:
        """A clean database for the next history: the schema back, no lock held, a standby
        streaming (made again if the last history promoted it), no row."""
        self._unlock_all()
        self.servers.ensure_standby().reconnect()
        if self.sql is None or self.sql.closed or self.sql.broken:
            self.sql = psycopg.connect(self.store_url, autocommit=True)
        self.sql.execute(f"TRUNCATE {SCHEMA}.sessions")
        self._schema(0)

    def _new_store(self, keys: Keyring | None = None) -> CheckpointStore:
        """A store of this world's kind on its own connections, judging by its clock (in an
        encrypted world, sealing under ``keys``' first key: by default the workers')."""
        store: CheckpointStore
        options = self.options
        if self.encrypted and keys is not None:
            options = StoreOptions(
                ttl_seconds=TTL_S, tombstone_ttl_seconds=MARGIN_S, encryption=keys
            )
        if self.postgres:
            store = PostgresStore(
                self.store_url,
                schema=SCHEMA,
                options=options,
                replication_timeout=REPLICATION_TIMEOUT_S,
                lock_timeout_ms=LOCK_TIMEOUT_MS,
            )
        else:
            store = RedisStore.from_url(self.store_url, prefix=PREFIX, options=options)
        store.clock = self.clock.now
        return store

    def _client(self, skew_s: float, keys: Keyring) -> CheckpointClient:
        skew_us = int(skew_s * 1_000_000)
        store = self._new_store(keys)
        return CheckpointClient(
            self.broker_url,
            store,
            queue=QUEUE,
            key_prefix=PREFIX,
            clock=SeqClock(lambda: self.clock.now_us() + skew_us),
            max_seq_ahead_seconds=LIMIT_S,
        )

    def step(self, action: Action) -> None:
        getattr(self, f"_{action.name}")(*action.args)

    # -- producers ------------------------------------------------------------------------

    @staticmethod
    def _pick(items: Sequence[Any], index: int) -> Any:
        return items[index % len(items)]

    def _load(self, producer: int, session: int) -> bool:
        name, _ = self._pick(PRODUCERS, producer)
        sid = self._pick(SESSIONS, session)
        client = self.clients[name]
        start = self.clock.now_us()
        try:
            checkpoint, fence = client.load_with_fence(sid)
        except PendingRecordMissing:
            return False  # its record dropped (``_drop``): it refuses, and says why
        end = self.clock.now_us()
        version = None if checkpoint is None else checkpoint.version
        self.history.reads.append(
            Read(name, sid, start, end, fence, version, counted=client.epoch_changes)
        )
        return True

    def _save(self, producer: int, session: int, staged: int = 1, loaded: int = 1) -> None:
        self._publish(producer, session, deleted=False, staged=bool(staged), loaded=bool(loaded))

    def _delete(self, producer: int, session: int, loaded: int = 1) -> None:
        self._publish(producer, session, deleted=True, staged=False, loaded=bool(loaded))

    def _publish(
        self, producer: int, session: int, *, deleted: bool, staged: bool, loaded: bool
    ) -> None:
        if loaded and not self._load(producer, session):
            return  # the apiserver's turn: load, then save (or delete) after what it read
        name, _ = self._pick(PRODUCERS, producer)
        sid = self._pick(SESSIONS, session)
        client = self.clients[name]
        version = None
        try:
            if deleted:
                handle = client.delete(sid)
            else:
                self.versions += 1
                version = self.versions
                client.stage_saves = staged
                handle = client.save(make_checkpoint(sid, version=version))
        except SeqRefused as refused:
            self.history.refused_at_publish.append((name, sid, str(refused)))
            return
        assert handle.seq is not None
        request = Request(
            handle.request, name, sid, deleted, handle.seq, version, self.clock.now_us(), handle
        )
        self.history.requests[request.request_id] = request
        self.handles.append(request)

    def _race(self, first: int, second: int, session: int, ops: int = 0) -> None:
        """Two replicas take a turn on one session at once: both load, then both publish
        (``ops``: bit 0 a delete for the first, bit 1 for the second). Both stamp after the
        same fence, so when it runs ahead of their clocks they stamp alike."""
        self._load(first, session)
        self._load(second, session)
        for producer, bit in ((first, 1), (second, 2)):
            deleted = bool(ops & bit)
            self._publish(producer, session, deleted=deleted, staged=True, loaded=False)

    def _list(self, producer: int) -> None:
        name, _ = self._pick(PRODUCERS, producer)
        start = self.clock.now_us()
        try:
            listed = self.clients[name].list()
        except PendingRecordMissing:
            return  # records dropped (``_drop``): it refuses, and says why
        self.history.listings.append(Listing(name, start, self.clock.now_us(), listed))

    def _outcome(self, request: int) -> None:
        """The request's producer asks for its outcome once (``wait_durable`` without
        waiting), as its caller would."""
        if not self.handles:
            return
        target: Request = self._pick(self.handles, request)
        name = target.producer
        try:
            outcome = self.clients[name].wait_durable(target.handle, timeout=0).outcome
        except TimeoutError:
            outcome = "pending"
        except RequestRefused as refused:
            outcome = f"refused: {refused.kind}: {refused.reason}"
        self.history.outcomes.append(
            OutcomeRead(name, target.request_id, self.clock.now_us(), outcome)
        )

    def _hijack(self, request: int, session: int, same: int = 0) -> None:
        """A message carrying an accepted request's id, with no record (a faulty or hostile
        producer's raw LPUSH): a staged save of another session, or (``same``) a bad save of
        the request's own session, stamped one after it, which a worker refuses."""
        if not self.handles:
            return
        victim: Request = self._pick(self.handles, request)
        if same % 2:
            sid, task = victim.session, messages.SAVE
            bad = {"sessionId": sid, "version": "not a number"}
            body = json.dumps([[bad], {"seq": victim.seq + 1}, {}]).encode()
        else:
            sid = self._pick(SESSIONS, session)
            if sid == victim.session:
                sid = next(s for s in SESSIONS if s != victim.session)
            task = messages.SAVE_STAGED
            body = json.dumps([[sid], {"seq": self.clock.now_us()}, {}]).encode()
        envelope = protocol2(task, [], body=body, queue=QUEUE, task_id=victim.request_id)
        self.broker.lpush(QUEUE, envelope)
        self.history.hijacks.append((sid, victim.request_id))

    # -- workers --------------------------------------------------------------------------

    def _take(self, worker: int, count: int = 1) -> None:
        """Take messages as the reserve script does: each recorded in ``unacked``, scored
        with the worker's time, as it leaves the queue."""
        held = self.held[worker % WORKERS]
        for _ in range(max(1, count)):
            raw = self.broker.rpop(QUEUE)
            if not isinstance(raw, bytes):
                return
            envelope = json.loads(raw)
            tag = envelope["properties"]["delivery_tag"]
            self.broker.hset("unacked", tag, json.dumps([envelope, "", QUEUE]))
            self.broker.zadd("unacked_index", {tag: self.clock.now()})
            headers = envelope.get("headers") or {}
            held.append(
                _Held(
                    tag,
                    str(headers.get("task")),
                    str(headers.get("id")),
                    messages.envelope_body(envelope),
                    headers,
                    envelope["properties"].get("delivery_info", {}),
                )
            )

    def _apply(self, worker: int) -> None:
        """Apply what the worker holds and has not applied: worker 0 as a coalesced group
        (what the group cannot apply runs as single tasks, which settle themselves), worker 1
        as single tasks."""
        index = worker % WORKERS
        todo = [h for h in self.held[index] if not h.applied]
        if not todo:
            return
        if index == 0:
            requests = [(h.task, h.task_id, h.body, h.headers, h.delivery_info) for h in todo]
            try:
                done: list[Settlement | None] = coalesced.apply_requests(requests)
            except StoreUnavailable:
                done = [None] * len(todo)  # the group failed: each runs as its task
            for held, settled in zip(todo, done, strict=True):
                if settled is None:
                    self._run_as_task(index, held)
                else:
                    held.applied, held.settlement = True, settled
        else:
            for held in todo:
                self._run_as_task(index, held)

    def _run_as_task(self, worker: int, held: _Held) -> None:
        parsed = messages.parse_body(held.body)
        args, kwargs = parsed if parsed is not None else ([], {})
        session = messages.requested_session(held.task, args, kwargs)
        if session in self.holders:
            return  # its row is held: it retries on its own, later (SessionBusy)
        result = self.app.tasks[held.task].apply(args=args, kwargs=kwargs, task_id=held.task_id)
        if result.state == states.REJECTED:
            self._requeue(worker, held)  # the store refuses writes: back to the queue
            return
        if result.failed():
            raise RuntimeError(f"{held.task} [{held.task_id}] raised: {result.traceback}")
        held.applied = held.settled = True  # the task path settles before it returns

    def _requeue(self, worker: int, held: _Held) -> None:
        """kombu's reject with requeue: the message back in the queue, out of ``unacked``."""
        payload = self.broker.hget("unacked", held.tag)
        self.broker.hdel("unacked", held.tag)
        self.broker.zrem("unacked_index", held.tag)
        self.held[worker] = [h for h in self.held[worker] if h is not held]
        if payload is not None:
            self.broker.rpush(QUEUE, json.dumps(json.loads(payload)[0]))

    # -- the database (PostgreSQL worlds) ---------------------------------------------------

    def _lock(self, session: int) -> None:
        """Another client holds the session's row (``SELECT ... FOR UPDATE`` in a transaction
        left open) until ``unlock``: the workers apply every other session meanwhile."""
        sid = self._pick(SESSIONS, session)
        if not self.postgres or sid in self.holders:
            return
        holder = psycopg.connect(self.store_url, application_name="history-lock")
        holder.execute(
            f"SELECT 1 FROM {SCHEMA}.sessions"
            f" WHERE session_key = {SCHEMA}.session_key(%s) FOR UPDATE",
            (sid.encode(),),
        )
        self.holders[sid] = holder

    def _unlock(self) -> None:
        self._unlock_all()

    def _unlock_all(self) -> None:
        for holder in self.holders.values():
            if not holder.closed:
                holder.close()  # its transaction rolls back
        self.holders = {}

    def _schema(self, newer: int = 1) -> None:
        """A rolling upgrade moves the schema under the workers (a newer version whose
        ``apply_group`` takes other arguments), or (``newer`` 0) it comes back."""
        if not self.postgres or self.sql is None:
            return
        moved = bool(
            self.sql.execute(
                f"SELECT count(*) FROM {SCHEMA}.schema_version WHERE version = 3"
            ).fetchone()[0]  # type: ignore[index]
        )
        if bool(newer % 2) == moved:
            return
        suffix_from, suffix_to = ("", "_v3") if newer % 2 else ("_v3", "")
        version = (
            f"INSERT INTO {SCHEMA}.schema_version (version) VALUES (3)"
            if newer % 2
            else f"DELETE FROM {SCHEMA}.schema_version WHERE version = 3"
        )
        with self.sql.transaction():
            self.sql.execute(version)
            for name in ("apply_group", "apply_each"):
                self.sql.execute(
                    f"ALTER FUNCTION {SCHEMA}.{name}{suffix_from}({_GROUP_ARGS}) "
                    f"RENAME TO {name}{suffix_to}"
                )

    def _lag(self, on: int = 1) -> None:
        """The standby stops receiving WAL (``on``), or streams again."""
        if not self.postgres or self.servers.standby is None:
            return
        if on % 2:
            self.servers.standby.disconnect()
        else:
            self.servers.standby.reconnect()

    def _promote(self) -> None:
        """The primary crashes and its standby, promoted with what it had, takes its address
        (the workers' and producers' connections are cut; the next history gets a new
        standby)."""
        if not self.postgres or self.servers.standby is None:
            return
        self._unlock_all()
        if self.sql is not None:
            self.sql.close()
        self.servers.fail_over()
        self.sql = psycopg.connect(self.store_url, autocommit=True)

    def _settle(self, worker: int) -> None:
        """settle.lua for the group's applied requests (the coalesced path's, riding its
        acks; here a step of its own, so that a crash may fall before or after it)."""
        held = [h for h in self.held[worker % WORKERS] if h.applied and not h.settled]
        self.settler.settle([h.settlement for h in held if h.settlement is not None])
        for h in held:
            h.settled = True
        self._forget_done(worker)

    def _ack(self, worker: int) -> None:
        held = [h for h in self.held[worker % WORKERS] if h.applied and not h.acked]
        for h in held:
            self.broker.hdel("unacked", h.tag)
            self.broker.zrem("unacked_index", h.tag)
            h.acked = True
        self._forget_done(worker)

    def _forget_done(self, worker: int) -> None:
        index = worker % WORKERS
        self.held[index] = [h for h in self.held[index] if not (h.settled and h.acked)]

    def _crash(self, worker: int) -> None:
        """kill -9: what it held stays in ``unacked``, to be restored."""
        self.held[worker % WORKERS] = []

    def _restore(self, end: int = 0) -> None:
        """kombu's restore: messages unacknowledged for longer than the visibility timeout go
        back to the queue (whether or not a slow worker still holds them)."""
        cutoff = self.clock.now() - VISIBILITY_S
        for tag in list(self.broker.zrangebyscore("unacked_index", "-inf", cutoff)):
            assert isinstance(tag, bytes)
            payload = self.broker.hget("unacked", tag)
            self.broker.zrem("unacked_index", tag)
            if payload is None:
                continue
            self.broker.hdel("unacked", tag)
            envelope = json.dumps(json.loads(payload)[0])
            (self.broker.rpush if end % 2 else self.broker.lpush)(QUEUE, envelope)

    def _sweep(self) -> None:
        """The periodic sweep (the ``expire_stale`` task's body, under its lock): a
        PostgreSQL store clears due values and forgets spent fences in it, where Redis lets
        its keys expire on their own. A store that refuses writes (a schema moved) fails it:
        the task retries later, as beat's next tick would."""
        try:
            checkpoints.expire_stale()
        except StoreUnavailable:
            return

    def _rekey(self) -> None:
        """``checkpointq rekey``, one session a page, run to its end between two steps (an
        encrypted world's): each rewrite is fenced like any write. A store that refuses
        writes fails it, as the command would fail and be run again."""
        if not self.encrypted:
            return
        try:
            for _ in rekey(self.store, page_size=1):
                pass
        except StoreUnavailable:
            return

    def _advance(self, milliseconds: int) -> None:
        self.clock.advance(max(0, milliseconds) * 1000)

    def _loss(self) -> None:
        """The broker restarts without its data (two-Redis and PostgreSQL worlds only: in a
        one-Redis world that would be the store's loss too, which nothing survives). Beside
        PostgreSQL the dead letters live on the broker, and are lost with it."""
        if self.one_redis:
            return
        now = self.clock.now_us()
        self.history.losses.append(Loss(now, self._lost_now(), self._counted(), self._entries()))
        self.broker.flushall()
        self.broker.script_flush()

    def _counted(self) -> dict[str, int]:
        """The losses each producer has counted so far (``epoch_changes``)."""
        return {name: client.epoch_changes for name, client in self.clients.items()}

    def _entries(self) -> set[str]:
        """The accepted requests whose pending entry is on the broker now."""
        with self.broker.pipeline(transaction=False) as pipe:
            for request in self.handles:
                pipe.hexists(self.keys.pending_requests(request.session), request.request_id)
            held = pipe.execute()
        return {r.request_id for r, on in zip(self.handles, held, strict=True) if on}

    def _lost_now(self) -> set[str]:
        """The requests not applied yet: what a loss of the broker's data takes."""
        lost = set()
        for request in self.handles:
            fence = self.store.fence(request.session)
            if fence is None or fence.key < request.key:
                lost.add(request.request_id)
        return lost

    def _purge(self) -> None:
        """``celery purge``: the queue deleted, the records and ``unacked`` left. The queued
        requests are lost (those a worker holds still land); the sweep settles their
        records as lost (``tasks/orphans.py``, run at the end)."""
        queued = orphans.message_ids(bytes(m) for m in self.broker.lrange(QUEUE, 0, -1))  # type: ignore[arg-type]
        lost = {r for r in self._lost_now() if r.split(":")[0].encode() in queued}
        self.history.losses.append(Loss(self.clock.now_us(), lost))
        self.broker.delete(QUEUE)

    def _drop(self) -> None:
        """An operator's ``DEL`` of the pending-request hashes (or their eviction), the
        messages left queued: loads refuse until the workers settle them; nothing is lost."""
        keys = [self.keys.pending_requests(sid) for sid in SESSIONS]
        self.broker.delete(*keys)

    def _snapshot(self) -> None:
        """What a replica (or the AOF on disk) holds of the broker now."""
        if self.one_redis or self.postgres:
            return
        snapshot = {}
        for key in self.broker.scan_iter(count=1000):
            dumped = self.broker.dump(key)
            if dumped is not None:
                snapshot[key] = (dumped, int(self.broker.pexpiretime(key)))
        self.snapshot = (self.clock.now_us(), snapshot)

    def _rewind(self) -> None:
        """The broker goes back to the last snapshot: a crash inside its fsync window, a
        failover to a replica that lagged (two-Redis worlds: in a one-Redis world the store
        would go back too; beside PostgreSQL the dead letters live on the broker). What it
        accepted since and no worker applied is lost, unless its producer publishes it
        again (issue 44)."""
        if self.one_redis or self.postgres or self.snapshot is None:
            return
        loss = Loss(self.clock.now_us(), self._lost_now(), self._counted())
        before = self._entries()
        self.history.losses.append(loss)
        self.broker.flushall()
        now_ms = self.clock.now_us() // 1000
        for key, (dumped, expires) in self.snapshot[1].items():
            if expires == -1:
                self.broker.restore(key, 0, dumped, replace=True)
            elif expires > now_ms:
                self.broker.restore(key, expires, dumped, replace=True, absttl=True)
        loss.taken = before - self._entries()

    # -- the end --------------------------------------------------------------------------

    def drain(self, rounds: int = 40) -> None:
        """Let the workers finish everything: take, apply, settle, acknowledge; restore what
        crashed workers left once the visibility timeout passed. (The database's faults end
        first: rows released, the schema back, the standby streaming.)"""
        if self.postgres:
            self._unlock_all()
            self._schema(0)
            self._lag(0)
        self._producers_call_again()
        for _ in range(rounds):
            for worker in range(WORKERS):
                self._take(worker, 50)
                self._apply(worker)
                self._settle(worker)
                self._ack(worker)
            if self.broker.llen(QUEUE) == 0 and self.broker.hlen("unacked") == 0:
                self._reap()
                return
            self._advance(int(VISIBILITY_S * 1000) + 1000)
            self._restore()
        raise RuntimeError("the workers did not drain the queue")

    def _producers_call_again(self) -> None:
        """Each producer's next call: one that finds the broker lost accepted requests
        publishes again what it still holds (issue 44), for the workers to drain. A call
        that finds a suffix lost turns the epoch, which the producers that called before it
        find only on their next call (and publish their own again): they call until a
        whole round turns no epoch. (One round left a producer's republish to the final
        read, after the drain: seed 9749021.)"""
        epoch_key = self.keys.pending_epoch()
        for _ in range(len(self.clients) + 1):
            epoch = self.broker.get(epoch_key)
            for client in self.clients.values():
                with contextlib.suppress(PendingRecordMissing):  # records dropped: it refuses
                    client.load_with_fence(SESSIONS[0])
            if self.broker.get(epoch_key) == epoch:
                return
        raise RuntimeError("the producers kept finding the broker lost accepted requests")

    def _reap(self) -> None:
        """The sweeps after the grace: records whose message is gone (a purge) settled as
        lost, two passes as two sweeps would (tasks/orphans.py)."""
        rt = runtime.current()
        for _ in range(2):
            # (no grace: nothing is on its way any more; producer clocks run up to LIMIT_S ahead)
            orphans.reap(
                self.broker, self.keys, QUEUE, rt.store, rt.dead_letters, grace_seconds=-LIMIT_S
            )

    def read_final(self) -> None:
        reader = self.clients["a"]
        for sid in SESSIONS:
            fence = self.store.fence(sid)
            stored = self.store.load(sid)
            loaded = reader.load(sid)
            self.history.final[sid] = Final(
                fence,
                None if stored is None else stored.version,
                None if loaded is None else loaded.version,
            )
        if self.encrypted:
            self._rekey_and_drop_the_old_key()
        for letter in DeadLetters(self.store_client, self.keys).list(count=10_000).entries:
            args, kwargs = letter.args or [], letter.kwargs or {}
            session = messages.requested_session(letter.task, args, kwargs)
            seq = messages.requested_seq(args, kwargs)
            self.history.dead_letters.append((session, letter.task_id, seq))

    def _rekey_and_drop_the_old_key(self) -> None:
        """Rekey once more, then load every session with the new key alone: each must load
        as the workers' store does (rotation loses nothing)."""
        for _ in rekey(self.store):
            pass
        new_only = self._new_store(NEW_ONLY)
        try:
            for sid in SESSIONS:
                stored = self.store.load(sid)
                try:
                    alone = new_only.load(sid)
                except MissingEncryptionKey as exc:
                    self.history.rekey_losses.append(f"{sid}: {exc}")
                    continue
                if alone != stored:
                    self.history.rekey_losses.append(
                        f"{sid}: the new key alone loads {alone and alone.version}, the store "
                        f"holds {stored and stored.version}"
                    )
        finally:
            new_only.close()


class VariantSettler(Settler):
    """A Settler running another settle.lua: a broken variant the checker must catch."""

    def __init__(self, broker: Any, keys: KeySpace, source: str) -> None:
        super().__init__(broker, keys)
        self._script = broker.register_script(source)


@contextmanager
def servers(*, postgres: bool = False) -> Iterator[Servers]:
    running = Servers(postgres=postgres)
    try:
        yield running
    finally:
        running.close()
