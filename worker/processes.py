"""Child processes of ``checkpointq up``: started so that none can outlive it, stopped in order.

Each child runs in its own session, so a Ctrl-C in the terminal reaches ``up`` alone and
``up`` decides the order of shutdown (workers before the Redis they acknowledge to). On
Linux each child also asks the kernel for SIGTERM when ``up`` dies, even by SIGKILL, so an
embedded Redis is never left orphaned holding its data directory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking for SIGTERM when the parent exits (Linux only, else None)."""
    if not sys.platform.startswith("linux"):
        return None
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    libc = ctypes.CDLL(libc_name, use_errno=True)

    def preexec() -> None:
        # Runs in the child between fork and exec: keep it to one system call.
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return preexec


def spawn(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stdout: IO[bytes] | int | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``args`` in a new session, tied to this process's life where the OS allows."""
    return subprocess.Popen(  # noqa: S603 - args are built by checkpointq, never a shell
        list(args),
        env=dict(env) if env is not None else None,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout is not None else None,
        start_new_session=True,
        preexec_fn=_die_with_parent(),
    )


def stop(process: subprocess.Popen[bytes], name: str, grace_seconds: float) -> int:
    """SIGTERM, then SIGKILL after ``grace_seconds``; return the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    return await_exit(process, name, grace_seconds)


def await_exit(process: subprocess.Popen[bytes], name: str, grace_seconds: float) -> int:
    """Wait for a process already told to stop; SIGKILL it after ``grace_seconds``.

    (Signalling twice would not help: a second SIGTERM turns Celery's warm shutdown cold.)
    """
    try:
        return process.wait(timeout=grace_seconds)
    except subprocess.TimeoutExpired:
        logger.warning(
            "%s (pid %d) did not stop within %.0fs; killing it", name, process.pid, grace_seconds
        )
        process.kill()
    return process.wait()
