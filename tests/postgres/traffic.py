"""Steady producer traffic against a PostgreSQL deployment, and the check every fault row
ends with (tests/postgres/test_faults.py, test_pgbouncer.py, test_held_rows.py, ...): every
session's final state is the last request accepted for it, loaded through the client and
straight from the store; nothing dead-lettered; the worker never restarted."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from checkpointq.tasks.producer.client import CheckpointClient, Handle
from checkpointq.worker.settings import Settings
from tests.faults.harness import DELETE, SAVE, Request, judge, winners
from tests.postgres.conftest import PgDeployment
from tests.postgres.proxy import Proxy
from tests.support.celery_processes import CeleryProcess, checkpointq_env
from tests.support.checkpoints import make_checkpoint
from tests.support.postgres import PostgresServer
from tests.support.servers import RedisServer, wait_until
from tests.support.workers import TEST_WORKER_SETTINGS

#: What the worker logs when it stops taking messages, and when it takes them again.
PAUSED = "store refusing writes"
RESUMED = "taking messages from"

#: A retry budget of well under a second (at most 0.1 + 0.2 + 0.4 s of backoff): each
#: outage below lasts several times longer.
RETRIES: dict[str, object] = {
    "retry_max": 3,
    "retry_backoff_seconds": 0.1,
    "retry_backoff_max_seconds": 0.4,
}
BUDGET = 0.1 + 0.2 + 0.4
#: How long each fault is held: several retry budgets and probe intervals.
OUTAGE = 4.0


@dataclass
class Traffic:
    """Saves through ``CheckpointClient`` from a thread, at a steady rate; every accepted
    request (its handle's seq) is kept."""

    client: CheckpointClient
    sessions: int = 40
    rate: float = 150.0
    prefix: str = "s"
    content_size: int = 16
    #: Every this many requests, a delete of the session instead of a save (0: none).
    delete_every: int = 0
    sent: list[Request] = field(default_factory=list)
    #: Each accepted request's handle, in the order of ``sent``.
    handles: list[Handle] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    _thread: threading.Thread | None = None

    def start(self) -> Traffic:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        i, next_at = 0, time.monotonic()
        try:
            while not self.stop.wait(max(0.0, next_at - time.monotonic())):
                sid = f"{self.prefix}-{i % self.sessions:04d}"
                if self.delete_every and i % self.delete_every == self.delete_every - 1:
                    handle = self.client.delete(sid)
                    assert handle.seq is not None
                    self.sent.append(Request(DELETE, sid, handle.seq))
                else:
                    cp = make_checkpoint(sid, version=i + 1, content_size=self.content_size)
                    handle = self.client.save(cp)
                    assert handle.seq is not None
                    self.sent.append(Request(SAVE, sid, handle.seq, version=i + 1))
                self.handles.append(handle)
                i += 1
                next_at += 1.0 / self.rate
        except BaseException as exc:  # reported by finish(): a producer must never fail here
            self.error = exc

    def more(self, count: int, timeout: float = 30.0) -> None:
        """Until ``count`` more requests were accepted (traffic goes on after a fault)."""
        target = len(self.sent) + count
        wait_until(lambda: len(self.sent) >= target, timeout=timeout, message="more traffic")

    def finish(self) -> list[Request]:
        self.stop.set()
        assert self._thread is not None
        self._thread.join(timeout=30)
        assert self.error is None, f"the producer failed: {self.error!r}"
        assert self.sent, "nothing was published"
        return list(self.sent)


@dataclass
class Run:
    """One test's deployment, its producer, and what the worker was when it began."""

    deployment: PgDeployment
    client: CheckpointClient
    traffic: Traffic
    pid: int
    mark: int

    def log(self) -> str:
        """The worker's log lines since the test began."""
        return self.deployment.worker.log()[self.mark :]

    def wait_logged(self, text: str, timeout: float = 30.0, after: int = 0) -> int:
        """Until the worker logs ``text`` (after offset ``after`` of ``log()``); its offset."""
        wait_until(lambda: text in self.log()[after:], timeout=timeout, message=repr(text))
        return self.log().index(text, after)


@contextmanager
def running(deployment: PgDeployment) -> Iterator[Run]:
    """A ``Run`` of ``deployment`` from now on (its traffic not started yet)."""
    process = deployment.worker.process
    assert process is not None
    client = deployment.checkpoint_client()
    traffic = Traffic(client)
    try:
        yield Run(deployment, client, traffic, process.pid, len(deployment.worker.log()))
    finally:
        traffic.stop.set()
        client.close()


@dataclass
class Failover:
    """A ``Run`` whose worker reaches its primary through ``proxy`` (the address that moves
    in a failover), with a streaming ``standby`` of ``primary`` beside it."""

    run: Run
    primary: PostgresServer
    standby: PostgresServer
    proxy: Proxy


@contextmanager
def failover_deployment(
    settings: dict[str, object],
    *,
    standby_slot: str | None = None,
    traffic: Callable[[CheckpointClient], Traffic] = Traffic,
) -> Iterator[Failover]:
    """A private broker, primary, proxy, standby and worker (``settings`` beside the tests'
    quick retries), stopped and removed at the end whatever happened. With
    ``standby_slot`` the standby streams through that replication slot and is made before
    the worker starts (a lagging standby's tests), else after it (so it copies the schema
    the worker made)."""
    broker = RedisServer().start()
    primary = PostgresServer().start()
    proxy = Proxy(primary.port)
    standby: PostgresServer | None = None
    worker: CeleryProcess | None = None
    run: Run | None = None
    try:
        if standby_slot is not None:
            standby = PostgresServer(standby_of=primary, slot=standby_slot).start()
        values = {
            **TEST_WORKER_SETTINGS,
            **RETRIES,
            "broker_url": broker.url,
            "store_url": proxy.url(),
            "pg_schema": "failover",
            **settings,
        }
        worker = CeleryProcess("worker", checkpointq_env(**values)).start()
        deployment = PgDeployment(broker, primary, worker, Settings(**values))  # type: ignore[arg-type]
        if standby is None:
            standby = PostgresServer(standby_of=primary).start()
        client = deployment.checkpoint_client()
        assert worker.process is not None
        run = Run(deployment, client, traffic(client), worker.process.pid, len(worker.log()))
        yield Failover(run, primary, standby, proxy)
    finally:
        if run is not None:
            run.traffic.stop.set()
            run.client.close()
        if worker is not None:
            code = worker.stop()
            print(f"--- worker log (exit {code}) ---\n{worker.log()}")
        proxy.close()
        for server in (standby, primary):
            if server is not None:
                server.cleanup()
        broker.cleanup()


def settle(run: Run, timeout: float = 60.0) -> list[Request]:
    """Stop the traffic; check that every accepted request took effect, nothing was
    dead-lettered and the same worker process did it all."""
    sent = run.traffic.finish()
    deployment = run.deployment
    store = deployment.store()
    try:
        wait_until(
            lambda: judge(store, sent).exact, timeout=timeout, message="every request applied"
        )
        deployment.wait_drained(timeout)
        verdict = judge(store, sent)
        assert verdict.exact, verdict
        final = winners(sent)
        for sid, win in final.items():
            through_client, direct = run.client.load(sid), store.load(sid)
            if win.kind == DELETE:
                assert through_client is None and direct is None, sid
                continue
            assert through_client is not None and through_client.version == win.version, sid
            assert direct is not None and direct.version == win.version, sid
    finally:
        store.close()
    assert deployment.dead_letters().count() == 0, deployment.dead_letters().list()
    process = deployment.worker.process
    assert process is not None and process.poll() is None, "the worker exited"
    assert process.pid == run.pid, "the worker was restarted"
    assert "ready." not in run.log(), "the worker started again"
    return sent
