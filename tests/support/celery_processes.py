"""Real ``celery worker`` and ``celery beat`` subprocesses for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.servers import wait_until

REPO = Path(__file__).resolve().parents[2]


def checkpointq_env(**settings: object) -> dict[str, str]:
    """The current environment plus ``CHECKPOINTQ_<NAME>`` for each setting given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTQ_")}
    env.update({f"CHECKPOINTQ_{k.upper()}": str(v) for k, v in settings.items()})
    env["PYTHONPATH"] = str(REPO)
    return env


@dataclass
class CeleryProcess:
    """``python -m celery -A <app> worker|beat`` with its log captured to a file."""

    role: str  # "worker" or "beat"
    env: dict[str, str]
    app: str = "checkpointq.worker.app"
    extra_args: list[str] = field(default_factory=list)
    #: Run this instead of ``python -m celery -A <app> <role>`` (``checkpointq worker``, as
    #: deployed), followed by ``extra_args``.
    command: list[str] | None = None
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cq-celery-")))
    process: subprocess.Popen[bytes] | None = None

    @property
    def logfile(self) -> Path:
        return self.workdir / f"{self.role}.log"

    def log(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    def start(self, ready: str | None = None, timeout: float = 30.0) -> CeleryProcess:
        args = [sys.executable, "-m", "celery", "-A", self.app, self.role, "-l", "INFO"]
        if self.command is not None:
            args = list(self.command)
        elif self.role == "worker":
            args += [
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-n",
                f"test-{uuid.uuid4().hex[:8]}@%h",
            ]
        args += self.extra_args
        with self.logfile.open("ab") as out:
            self.process = subprocess.Popen(
                args, cwd=self.workdir, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        marker = ready or ("ready." if self.role == "worker" else "beat: Starting...")
        try:
            wait_until(
                lambda: marker in self.log() or self.process.poll() is not None,
                timeout=timeout,
                message=f"celery {self.role} to start",
            )
        finally:
            if self.process.poll() is not None:
                raise RuntimeError(f"celery {self.role} exited:\n{self.log()}")
        return self

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (warm, soft shutdown), then SIGKILL if it does not exit in ``timeout``."""
        if self.process is None:
            return None
        process, self.process = self.process, None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                return process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
        return process.wait(timeout=10)
