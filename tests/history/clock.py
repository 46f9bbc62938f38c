"""The simulation's time, shared with the Redis servers under test.

Time is the machine's wall clock plus an offset that only grows. The offset lives in an
8-byte file that ``timeshift.c`` (LD_PRELOADed into each redis-server) maps and adds to every
clock reading of the server, so advancing it moves the servers' ``TIME``, their key expiry
and the simulation's producers and workers together, at once, without waiting.
"""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path

_SOURCE = Path(__file__).with_name("timeshift.c")


@cache
def timeshift_library() -> Path:
    """``timeshift.c`` built as a shared library (once per run, in a temporary directory).

    Raises:
        RuntimeError: no C compiler (scripts/setup-env's machine has gcc).
    """
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler to build tests/history/timeshift.c (gcc)")
    target = Path(tempfile.mkdtemp(prefix="cq-timeshift-")) / "timeshift.so"
    # Readable by every user: PostgreSQL runs as ``postgres`` when the tests run as root,
    # and ld.so skips (with a line on stderr only) a preload it cannot open.
    target.parent.chmod(0o755)
    subprocess.run(
        [compiler, "-O2", "-shared", "-fPIC", "-o", str(target), str(_SOURCE)],
        check=True,
        capture_output=True,
    )
    return target


class SharedClock:
    """Wall time plus an offset (µs) that ``advance`` grows, shared through ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_bytes(struct.pack("<q", 0))
        # Readable by a server running as another user (``postgres``): timeshift.c reads an
        # offset it cannot open as 0, silently, so its directory must let it through too.
        path.chmod(0o644)
        self._file = path.open("r+b")
        self._map = mmap.mmap(self._file.fileno(), 8)

    @property
    def offset_us(self) -> int:
        value: int = struct.unpack("<q", self._map[:8])[0]
        return value

    def advance(self, microseconds: int) -> None:
        if microseconds < 0:
            raise ValueError("time only moves forward")
        self._map[:8] = struct.pack("<q", self.offset_us + microseconds)

    def now_us(self) -> int:
        return time.time_ns() // 1000 + self.offset_us

    def now(self) -> float:
        """Seconds since the epoch, as ``time.time`` (a store's clock)."""
        return self.now_us() / 1_000_000

    def server_env(self) -> dict[str, str]:
        """What a redis-server needs in its environment to follow this clock."""
        return {"LD_PRELOAD": str(timeshift_library()), "CQ_TIME_OFFSET_FILE": str(self.path)}

    def close(self) -> None:
        self._map.close()
        self._file.close()
        os.unlink(self.path)
