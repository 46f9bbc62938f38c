"""The fault suite's harness: load, expected state, verdicts, and the processes under test.

A *load* is a list of save and delete requests over many sessions, each with a distinct
``seq``. The expected final state follows from the store's contract alone: for each session
the request with the highest ``seq`` wins, so the session holds that save's checkpoint, or is
absent when that request was a delete. Every save carries a ``version`` unique in the load,
so a stored checkpoint names the request that wrote it, and the verdict can tell a *lost*
request (the winner never applied) from a *regression* (an older save overwrote a newer one).

Requests are pushed as raw Celery envelopes with ``LPUSH`` (what a producer in any language
does), so the suite can duplicate, shuffle and corrupt them at will. Workers run with
``-l DEBUG``: every request logs its outcome (``OutcomeLog`` in ``tasks/checkpoints.py``), which
is how duplicate applications are counted.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from checkpointq.store.base import CheckpointStore
from checkpointq.store.keys import DEFAULT_PREFIX, KeySpace
from checkpointq.store.redis import RedisStore
from checkpointq.store.serde import checkpoint_to_wire
from checkpointq.tasks.dead_letters import DeadLetters
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer, wait_until

REPO = Path(__file__).resolve().parents[2]
QUEUE = "checkpoints"
SAVE = "checkpoint.save"
DELETE = "checkpoint.delete"
RESULTS = Path(__file__).resolve().parent / "results"


# -- scale ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scale:
    """How big a scenario's load is, and how long its faults last."""

    name: str
    sessions: int
    requests: int
    #: Seconds the store Redis stays down in the outage scenario.
    store_outage: float
    #: Seconds the broker stays down while a producer publishes.
    broker_outage: float
    #: Seconds of the long store faults (down, out of memory): longer than a request's whole
    #: retry budget under ``retry_settings``.
    long_fault: float = 120.0
    #: Retry settings of the long store faults: production's in the long mode; scaled down
    #: tenfold (and the visibility timeout with them) in the quick mode.
    retry_settings: tuple[tuple[str, object], ...] = ()


#: Production's retry and delivery defaults (worker/settings.py): the budget is at most
#: 1+2+4+8+16+32+60+60 s (full jitter: half that on average).
PRODUCTION_RETRIES: tuple[tuple[str, object], ...] = (
    ("retry_backoff_seconds", 1.0),
    ("retry_backoff_max_seconds", 60.0),
    ("visibility_timeout", 300),
)
QUICK = Scale(
    "quick",
    sessions=150,
    requests=1500,
    store_outage=4.0,
    broker_outage=3.0,
    long_fault=12.0,
    # budget at most 0.1+0.2+0.4+0.8+1+1+1+1 = 5.5 s with the default 8 retries
    retry_settings=(
        ("retry_backoff_seconds", 0.1),
        ("retry_backoff_max_seconds", 1.0),
        ("visibility_timeout", 30),
    ),
)
LONG = Scale(
    "long",
    sessions=1000,
    requests=10000,
    store_outage=10.0,
    broker_outage=5.0,
    long_fault=120.0,
    retry_settings=PRODUCTION_RETRIES,
)


def current_scale() -> Scale:
    """``--long`` (tests/faults/conftest.py) sets CHECKPOINTQ_FAULTS_LONG=1."""
    return LONG if os.environ.get("CHECKPOINTQ_FAULTS_LONG") == "1" else QUICK


# -- load and envelopes ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """One save or delete. ``version`` is unique per save in a load (0 for deletes)."""

    kind: str  # SAVE or DELETE
    session_id: str
    seq: int
    version: int = 0
    task_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    #: Messages in the saved checkpoint's history, and characters per message.
    messages: int = 2
    content_size: int = 48

    def args(self) -> tuple[list[Any], dict[str, Any]]:
        if self.kind == SAVE:
            size = self.content_size
            cp = make_checkpoint(self.session_id, self.version, self.messages, size)
            return [checkpoint_to_wire(cp)], {"seq": self.seq}
        return [self.session_id], {"seq": self.seq}

    def envelope(self) -> bytes:
        args, kwargs = self.args()
        return envelope(self.kind, args, kwargs, task_id=self.task_id)


def seq_base() -> int:
    """A realistic seq origin (µs since the epoch), leaving room for millions of requests."""
    return time.time_ns() // 1000


def generate_load(
    sessions: int,
    requests: int,
    rng: random.Random,
    *,
    delete_ratio: float = 0.15,
    prefix: str = "fault",
    first_seq: int | None = None,
    messages: int = 2,
    content_size: int = 48,
) -> list[Request]:
    """``requests`` saves and deletes over ``sessions`` sessions, in seq order."""
    base = seq_base() if first_seq is None else first_seq
    ids = [f"{prefix}-{i:05d}" for i in range(sessions)]
    load: list[Request] = []
    for i in range(requests):
        sid = ids[i] if i < sessions else rng.choice(ids)  # every session gets a save first
        if i >= sessions and rng.random() < delete_ratio:
            load.append(Request(DELETE, sid, base + i))
        else:
            load.append(
                Request(SAVE, sid, base + i, i + 1, messages=messages, content_size=content_size)
            )
    return load


def envelope(
    task: str,
    args: Any,
    kwargs: Any,
    *,
    task_id: str | None = None,
    body: bytes | None = None,
    content_type: str = "application/json",
    content_encoding: str = "utf-8",
    headers: dict[str, Any] | None = None,
    queue: str = QUEUE,
) -> bytes:
    """A Celery protocol 2 message as kombu's Redis transport stores it in the list.

    ``body`` replaces the JSON-encoded ``[args, kwargs, embed]`` (for garbage tests).
    """
    task_id = task_id or str(uuid.uuid4())
    if body is None:
        embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
        body = json.dumps([args, kwargs, embed]).encode()
    message = {
        "body": base64.b64encode(body).decode(),
        "content-encoding": content_encoding,
        "content-type": content_type,
        "headers": {
            "lang": "py",
            "task": task,
            "id": task_id,
            "root_id": task_id,
            "parent_id": None,
            "group": None,
            "retries": 0,
            "eta": None,
            "expires": None,
            "timelimit": [None, None],
            "argsrepr": "",
            "kwargsrepr": "",
            "origin": "faults@test",
            **(headers or {}),
        },
        "properties": {
            "correlation_id": task_id,
            "reply_to": "",
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    return json.dumps(message).encode()


def push(client: redis.Redis, envelopes: Iterable[bytes], queue: str = QUEUE) -> int:
    """LPUSH the envelopes in order (kombu pops from the right: first pushed, first run)."""
    count = 0
    pipe = client.pipeline(transaction=False)
    for raw in envelopes:
        pipe.lpush(queue, raw)
        count += 1
        if count % 500 == 0:
            pipe.execute()
    pipe.execute()
    return count


# -- expected state and verdict --------------------------------------------------------------


def winners(load: Iterable[Request]) -> dict[str, Request]:
    """For each session, the request with the highest seq (the one the final state shows)."""
    best: dict[str, Request] = {}
    for req in load:
        if req.session_id not in best or req.seq > best[req.session_id].seq:
            best[req.session_id] = req
    return best


@dataclass
class Verdict:
    """How the final store differs from the expected state, counted per session."""

    lost: list[str] = field(default_factory=list)
    resurrected: list[str] = field(default_factory=list)
    regressed: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not (self.lost or self.resurrected or self.regressed)


def judge(store: CheckpointStore, load: Sequence[Request]) -> Verdict:
    """Compare the store with the expected state of ``load``.

    * lost: the winning request never took effect (fence older than it, or a save missing);
    * resurrected: the winning delete took effect, yet the session is live again;
    * regressed: the winner took effect but an older save's checkpoint is what is stored.
    """
    by_version = {r.version: r for r in load if r.kind == SAVE}
    verdict = Verdict()
    for sid, win in winners(load).items():
        fence = store.fence(sid)
        cp = store.load(sid)
        applied = fence is not None and fence.seq >= win.seq
        if win.kind == DELETE:
            if not applied:
                verdict.lost.append(sid)
            elif cp is not None:
                verdict.resurrected.append(sid)
        elif cp is None or not applied:
            verdict.lost.append(sid)
        elif cp.version != win.version:
            writer = by_version.get(cp.version)
            if writer is not None and writer.seq < win.seq:
                verdict.regressed.append(sid)
            else:
                verdict.lost.append(sid)
    return verdict


_OUTCOME = re.compile(r"(checkpoint\.(?:save|delete)) -> (\{.*\})\s*$")


def applications(logs: Iterable[str]) -> Counter[tuple[str, str, int]]:
    """How many times each (task, session, seq) was applied, from the workers' DEBUG logs."""
    counts: Counter[tuple[str, str, int]] = Counter()
    for text in logs:
        for line in text.splitlines():
            match = _OUTCOME.search(line)
            if match is None:
                continue
            try:
                outcome = ast.literal_eval(match.group(2))
            except (ValueError, SyntaxError):
                continue  # a line cut short by a kill -9
            if outcome.get("outcome") in ("applied", "deleted") and outcome.get("seq") is not None:
                counts[(match.group(1), str(outcome["session_id"]), int(outcome["seq"]))] += 1
    return counts


def duplicates_applied(logs: Iterable[str]) -> int:
    """Extra applications of a request already applied (harmless: writes are fenced)."""
    return sum(n - 1 for n in applications(logs).values() if n > 1)


# -- results ---------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of docs/reliability.md, written by a scenario as JSON."""

    scenario: str
    title: str
    load: str
    faults: str
    lost: int
    resurrected: int
    regressed: int
    dead_lettered: int
    duplicates_applied: int
    result: str
    notes: str = ""
    #: Worker RSS (main process and pool), MB: before the load, and the peak during it.
    rss_idle_mb: float | None = None
    rss_peak_mb: float | None = None
    #: Seconds from the end of the fault until the store showed the expected state.
    converged_s: float | None = None


def record(row: Row, scale: Scale | None = None) -> Path:
    """Write the row to tests/faults/results/<scale>/<scenario>.json."""
    scale = scale or current_scale()
    target = RESULTS / scale.name / f"{row.scenario}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(asdict(row), indent=2) + "\n")
    return target


# -- processes -------------------------------------------------------------------------------


def checkpointq_env(**settings: object) -> dict[str, str]:
    """This environment without inherited CHECKPOINTQ_*, plus the given settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTQ_")}
    env.update({f"CHECKPOINTQ_{k.upper()}": str(v) for k, v in settings.items()})
    env["PYTHONPATH"] = str(REPO)
    return env


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants, bytes (0 once gone)."""
    total = 0
    for p in [pid, *_descendants(pid)]:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    for child in children(pid):
        found += [child, *_descendants(child)]
    return found


@dataclass
class Celery:
    """A ``celery worker`` or ``celery beat`` in its own process group, log to a file."""

    role: str
    env: dict[str, str]
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cq-fault-")))
    name: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    process: subprocess.Popen[bytes] | None = None
    #: Log text of earlier runs of this object (it may be restarted).
    previous_logs: list[str] = field(default_factory=list)
    #: Address space the process (and its pool) may take, bytes (``prlimit --as``).
    address_space: int | None = None

    @property
    def logfile(self) -> Path:
        return self.workdir / f"{self.role}-{self.name}.log"

    def log(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    def logs(self) -> list[str]:
        return [*self.previous_logs, self.log()]

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.role} is not running"
        return self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 60.0) -> Celery:
        args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "checkpointq.worker.app",
            self.role,
            "-l",
            "DEBUG",
        ]
        if self.role == "worker":
            args += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
            args += ["-n", f"fault-{self.name}@%h"]
        else:
            args += ["--schedule", str(self.workdir / "beat-schedule")]
        if self.address_space is not None:
            args = ["prlimit", f"--as={self.address_space}", "--", *args]
        if self.logfile.exists():
            self.previous_logs.append(self.log())
            self.logfile.unlink()
        with self.logfile.open("ab") as out:
            self.process = subprocess.Popen(
                args,
                cwd=self.workdir,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: kill -9 reaches the pool children
            )
        marker = "ready." if self.role == "worker" else "beat: Starting..."
        wait_until(
            lambda: marker in self.log() or not self.running(),
            timeout=timeout,
            message=f"celery {self.role} to start",
        )
        if not self.running():
            raise RuntimeError(f"celery {self.role} exited at start:\n{self.log()}")
        if self.role == "worker":
            wait_until(lambda: len(children(self.pid)) > 0, message="the worker's pool")
        return self

    def kill(self) -> None:
        """``kill -9`` the main process, then its whole group (a container dying)."""
        process = self.process
        if process is None:
            return
        pids = [process.pid, *_descendants(process.pid)]
        os.kill(process.pid, signal.SIGKILL)
        self._kill_group(process)
        for pid in pids[1:]:
            _kill_quietly(pid)
        process.wait(timeout=10)
        self.process = None

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (warm, soft shutdown) and wait for the exit; SIGKILL after ``timeout``."""
        process = self.process
        assert process is not None
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_group(process)
            code = process.wait(timeout=10)
        self._kill_group(process)  # no orphaned pool child may outlive the test
        self.process = None
        return code

    @staticmethod
    def _kill_group(process: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):  # the group is already gone
            os.killpg(process.pid, signal.SIGKILL)

    def cleanup(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.terminate(timeout=15)
            else:
                self._kill_group(self.process)
                self.process = None
        shutil.rmtree(self.workdir, ignore_errors=True)


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already exited
        os.kill(pid, signal.SIGKILL)


#: Worker settings shared by the scenarios: quick retries, short visibility timeout.
BASE_SETTINGS: dict[str, object] = {
    "queue": QUEUE,
    "pool": "prefork",
    "concurrency": 2,
    "visibility_timeout": 10,
    "retry_max": 60,
    "retry_backoff_seconds": 0.1,
    "retry_backoff_max_seconds": 1.0,
    "shutdown_timeout_seconds": 5,
    "tombstone_ttl_seconds": 3600,
}


@dataclass
class Deployment:
    """A broker Redis, a store Redis, and the workers and beats of one scenario."""

    broker: RedisServer
    store_server: RedisServer
    settings: dict[str, object] = field(default_factory=dict)
    processes: list[Celery] = field(default_factory=list)
    _clients: list[Any] = field(default_factory=list)
    _broker_client: redis.Redis | None = None

    @property
    def all_settings(self) -> dict[str, object]:
        return {
            **BASE_SETTINGS,
            "broker_url": self.broker.url,
            "store_url": self.store_server.url,
            **self.settings,
        }

    @property
    def keys(self) -> KeySpace:
        return KeySpace(str(self.settings.get("key_prefix", DEFAULT_PREFIX)))

    def env(self) -> dict[str, str]:
        return checkpointq_env(**self.all_settings)

    def worker(
        self, address_space: int | None = None, extra_env: dict[str, str] | None = None
    ) -> Celery:
        """A worker; with ``address_space`` (bytes) under that memory limit, and
        ``extra_env`` in its environment."""
        proc = Celery("worker", {**self.env(), **(extra_env or {})}, address_space=address_space)
        self.processes.append(proc)
        return proc.start()

    def beat(self) -> Celery:
        proc = Celery("beat", self.env())
        self.processes.append(proc)
        return proc.start()

    def broker_client(self) -> redis.Redis:
        """One client of the broker, kept (it reconnects by itself after a restart)."""
        if self._broker_client is None:
            self._broker_client = self.broker.client()
            self._clients.append(self._broker_client)
        return self._broker_client

    def store_client(self) -> redis.Redis:
        client = self.store_server.client()
        self._clients.append(client)
        return client

    def store(self) -> RedisStore:
        opened = RedisStore.from_url(self.store_server.url, prefix=self.keys.prefix)
        self._clients.append(opened)
        return opened

    def dead_letters(self) -> DeadLetters:
        return DeadLetters(self.store_client(), self.keys)

    def logs(self) -> list[str]:
        return [text for proc in self.processes for text in proc.logs()]

    def wait_dead_letters(self, count: int, timeout: float = 60.0) -> DeadLetters:
        """Wait until exactly ``count`` dead letters are recorded; return the stream."""
        letters = self.dead_letters()
        wait_until(
            lambda: letters.count() == count, timeout=timeout, message=f"{count} dead letters"
        )
        return letters

    def backlog(self) -> int:
        """Messages waiting in the queue plus messages fetched but not yet acknowledged."""
        client = self.broker_client()
        return int(client.llen(QUEUE)) + int(client.hlen("unacked"))

    def kill_pool_children_until(
        self,
        worker: Celery,
        load: list[Request],
        scale: Scale,
        *,
        marker: str,
        times: int,
        seed: int,
        max_kills: int = 40,
    ) -> int:
        """kill -9 ``worker``'s pool children in turn until its log shows ``marker`` ``times``.

        If the load drains before a kill lands where it must (a busy machine makes each child
        replacement slow), more of the same is pushed, on sessions of its own so that every
        expected state stays unambiguous, and appended to ``load``. The worker replaces each
        child before the next kill. Returns the number of kills.
        """
        kills = 0
        while worker.log().count(marker) < times and kills < max_kills:
            if not self.backlog():
                more = generate_load(
                    scale.sessions,
                    scale.requests,
                    random.Random(seed + kills),
                    prefix=f"more{kills}",
                    messages=20,
                    content_size=2000,
                    first_seq=load[-1].seq + 1,
                )
                load.extend(more)
                push(self.broker_client(), (r.envelope() for r in more))
            pool = children(worker.pid)
            victim = pool[kills % len(pool)]
            os.kill(victim, signal.SIGKILL)
            kills += 1
            wait_until(
                lambda v=victim: v not in children(worker.pid) and len(children(worker.pid)) == 2,
                message="a replacement pool child",
            )
        return kills

    def wait_progress(self, total: int, fraction: float) -> None:
        """Until at most ``1 - fraction`` of a load of ``total`` requests is still queued or
        held: the moment a scenario injects its fault into a busy worker."""
        wait_until(
            lambda: self.backlog() <= total * (1 - fraction),
            timeout=180,
            message=f"{fraction:.0%} of the load to be done",
        )

    def busy_worker(self, load: Sequence[Request], fraction: float = 0.3) -> Celery:
        """Start a worker, push ``load``, and return once ``fraction`` of it is done."""
        worker = self.worker()
        push(self.broker_client(), (r.envelope() for r in load))
        self.wait_progress(len(load), fraction)
        return worker

    def settle(self, load: Sequence[Request], timeout: float, *, require: bool = True) -> Verdict:
        """Wait until the queue is drained and the store shows the expected state.

        With ``require=False`` a timeout is not an error: the verdict then counts what is
        missing (scenarios that measure a loss rather than forbid it).
        """
        store = self.store()
        verdicts: list[Verdict] = []

        def done() -> bool:
            if self.backlog():
                return False
            verdicts.append(judge(store, load))
            return verdicts[-1].exact

        try:
            wait_until(done, timeout=timeout, interval=0.25, message="the expected state")
        except AssertionError as exc:
            if require:
                # What was still wrong, so a failure says more than that time ran out.
                verdict = judge(store, load)
                raise AssertionError(
                    f"{exc}: backlog {self.backlog()}, "
                    f"lost {verdict.lost[:10]} ({len(verdict.lost)}), "
                    f"resurrected {verdict.resurrected[:10]}, regressed {verdict.regressed[:10]}"
                ) from exc
        return judge(store, load)

    def cleanup(self) -> None:
        for proc in self.processes:
            proc.cleanup()
        for client in self._clients:
            client.close()


class SteadyTraffic:
    """Pushes a load at a steady rate from a thread, as producers keep doing in an outage."""

    def __init__(
        self,
        client: redis.Redis,
        load: Sequence[Request],
        per_second: float,
        *,
        patient: bool = False,
    ) -> None:
        self.client = client
        self.load = load
        self.per_second = per_second
        #: Retry a push the broker refuses (out of memory, read-only), as a producer that
        #: keeps its requests would; without it a refusal ends the traffic with an error.
        self.patient = patient
        #: Pushes the broker refused and were sent again.
        self.refused = 0
        self.pushed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> SteadyTraffic:
        self._thread.start()
        return self

    def _run(self) -> None:
        started = time.monotonic()
        batch = max(1, int(self.per_second / 10))
        while self.pushed < len(self.load) and not self._stop.is_set():
            due = started + self.pushed / self.per_second
            # pacing a producer, not synchronising with the system under test
            self._stop.wait(max(0.0, due - time.monotonic()))
            chunk = self.load[self.pushed : self.pushed + batch]
            while True:
                try:
                    push(self.client, (r.envelope() for r in chunk))
                    break
                except redis.ResponseError:
                    if not self.patient:
                        raise
                    self.refused += 1
                    self._stop.wait(0.05)  # a producer's own backoff
            self.pushed += len(chunk)

    def finish(self, timeout: float = 600.0) -> None:
        """Wait until every request was pushed."""
        self._thread.join(timeout=timeout)
        assert self.pushed == len(self.load), f"pushed {self.pushed} of {len(self.load)}"


class RssSampler:
    """Samples a worker's resident memory (main process and pool) from a thread."""

    def __init__(self, pid: int, every: float = 0.5) -> None:
        self.pid = pid
        self.every = every
        self.idle = rss_bytes(pid)
        self.peak = self.idle
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, rss_bytes(self.pid))

    @property
    def idle_mb(self) -> float:
        return round(self.idle / 2**20, 1)

    @property
    def peak_mb(self) -> float:
        return round(self.peak / 2**20, 1)


def hold(seconds: float, *, while_: Callable[[], object] | None = None) -> None:
    """Keep a fault in place for ``seconds`` (fault injection, not synchronisation),
    calling ``while_`` repeatedly meanwhile if given."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if while_ is not None:
            while_()
        time.sleep(0.05)


def conclude(
    deployment: Deployment,
    verdict: Verdict,
    *,
    scenario: str,
    title: str,
    load: str,
    faults: str,
    notes: str = "",
    expect_dead: int = 0,
    passed: bool = True,
    loss_measured: bool = False,
    rss: RssSampler | None = None,
    converged_s: float | None = None,
) -> Row:
    """Count dead letters and duplicate applications, record the row and return it.

    The row's result is "pass" when the verdict is exact, the dead letters are as expected
    and ``passed`` (the scenario's own extra checks) holds. With ``loss_measured`` the
    scenario measures a loss instead of forbidding it (its own checks bound it).
    """
    dead = deployment.dead_letters().count()
    exact = verdict.exact or (loss_measured and not (verdict.resurrected or verdict.regressed))
    ok = exact and dead == expect_dead and passed
    row = Row(
        scenario,
        title,
        load,
        faults,
        len(verdict.lost),
        len(verdict.resurrected),
        len(verdict.regressed),
        dead,
        duplicates_applied(deployment.logs()),
        ("pass (loss measured)" if loss_measured else "pass") if ok else "FAIL",
        notes,
        rss.idle_mb if rss else None,
        rss.peak_mb if rss else None,
        None if converged_s is None else round(converged_s, 1),
    )
    record(row)
    return row


def finish(deployment: Deployment, verdict: Verdict, **row: Any) -> Row:
    """How every scenario ends: record its row (``conclude``), then fail unless the row
    passed (exact verdict, the dead letters expected, the scenario's own checks)."""
    recorded = conclude(deployment, verdict, **row)
    assert recorded.result.startswith("pass"), f"{recorded}\n{verdict}"
    return recorded


def describe(scale: Scale, requests: int | None = None, sessions: int | None = None) -> str:
    return f"{requests or scale.requests} requests / {sessions or scale.sessions} sessions"
