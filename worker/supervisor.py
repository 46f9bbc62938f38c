"""``checkpointq up``: embedded Redis if needed, a worker and beat, stopped in the right order.

Shutdown order matters: the worker must still reach Redis while it finishes (or requeues)
what it holds, so on Ctrl-C or SIGTERM the children are stopped first, all at once, and the
embedded Redis last; it then flushes its AOF before exiting.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from types import FrameType

import redis
from redis.exceptions import RedisClusterException

from checkpointq.store.errors import CheckpointError
from checkpointq.worker import connections
from checkpointq.worker.connections import with_embedded
from checkpointq.worker.embedded import EmbeddedRedis
from checkpointq.worker.processes import await_exit, spawn
from checkpointq.worker.settings import Settings

logger = logging.getLogger(__name__)

#: Seconds a child may take to stop after SIGTERM before it is killed. The worker's warm
#: shutdown finishes its running tasks (each a single store call) well within this; the
#: compose file's ``stop_grace_period`` is longer still.
CHILD_GRACE_SECONDS = 60.0
#: How often the supervisor checks that its children are alive, in seconds.
WATCH_INTERVAL = 0.2

ROLES = ("worker", "beat")


class ChildFailed(CheckpointError):
    """A worker or beat started by ``up`` exited on its own."""


@dataclass
class Supervisor:
    """Runs the whole system in the foreground until a signal or a child's death."""

    settings: Settings
    grace_seconds: float = CHILD_GRACE_SECONDS
    #: Called once, with the running system's settings, when the worker is consuming.
    on_ready: Callable[[Settings], None] | None = None
    #: CHECKPOINTQ_ variables for the children beyond this process's environment (the
    #: command-line options of `up`).
    child_env: dict[str, str] = field(default_factory=dict)

    def run(self) -> None:
        """Block until SIGINT/SIGTERM (clean stop) or a child exits (raises ChildFailed)."""
        stop_requested = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            logger.info("received %s: stopping", signal.Signals(signum).name)
            stop_requested.set()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            with ExitStack() as stack:
                settings = self.settings
                if settings.broker_url is None:
                    embedded = EmbeddedRedis(settings.data_dir)
                    stack.enter_context(embedded.serving())
                    settings = with_embedded(settings, embedded)
                    logger.info("embedded Redis pid %s on %s", embedded.pid, embedded.socket)
                if stop_requested.is_set():
                    return
                children = self._start_children(settings)
                stack.callback(self._stop_children, children)
                ready = _Readiness(settings, children["worker"].pid, self.on_ready)
                failed = _watch(children, stop_requested, ready.poll)
                if failed is not None:
                    role, code = failed
                    raise ChildFailed(f"{role} exited unexpectedly with code {code}; stopped")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start_children(self, settings: Settings) -> dict[str, subprocess.Popen[bytes]]:
        env = {**os.environ, **self.child_env}
        if settings.broker_url is not None:
            env["CHECKPOINTQ_BROKER_URL"] = settings.broker_url
        if settings.store_url is not None:
            env["CHECKPOINTQ_STORE_URL"] = settings.store_url
        children: dict[str, subprocess.Popen[bytes]] = {}
        for role in ROLES:
            # -P: the current directory is not put on the path, so a user's own `tasks.py` or
            # `checkpointq.py` beside them can never shadow our modules in the children.
            command = [sys.executable, "-P", "-m", "checkpointq.worker.cli", role]
            children[role] = spawn(command, env=env)
            logger.info("%s started (pid %d)", role, children[role].pid)
        return children

    def _stop_children(self, children: dict[str, subprocess.Popen[bytes]]) -> None:
        # Signal everyone first, then wait: the children stop in parallel.
        for process in children.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for role, process in children.items():
            code = await_exit(process, role, self.grace_seconds)
            logger.info("%s stopped (exit code %s)", role, code)


class _Readiness:
    """Tells ``on_ready`` once the worker is consuming: its heartbeat is in the store."""

    def __init__(
        self, settings: Settings, worker_pid: int, on_ready: Callable[[Settings], None] | None
    ) -> None:
        self.settings = settings
        self.worker_pid = worker_pid
        self.on_ready = on_ready

    def poll(self) -> None:
        if self.on_ready is None:
            return
        from checkpointq.worker.ops.health import live_workers  # Celery only when run

        client = connections.store_client(self.settings, timeout=1.0)
        try:
            beats = live_workers(client, connections.key_space(self.settings))
        except (redis.RedisError, RedisClusterException):
            return  # not yet: asked again on the next watch interval
        finally:
            client.close()
        if any(beat.get("pid") == self.worker_pid for beat in beats):
            on_ready, self.on_ready = self.on_ready, None
            on_ready(self.settings)


def _watch(
    children: dict[str, subprocess.Popen[bytes]],
    stop_requested: threading.Event,
    tick: Callable[[], None],
) -> tuple[str, int] | None:
    """Wait for a stop request (None) or the first child to exit (its role and code),
    calling ``tick`` every interval meanwhile."""
    while not stop_requested.wait(WATCH_INTERVAL):
        for role, process in children.items():
            code = process.poll()
            if code is not None:
                return role, code
        tick()
    return None
