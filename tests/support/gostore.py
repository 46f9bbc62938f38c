"""The Go cross-check program, ``tests/go/gostore``: built once per run, it does what the Go
checkpoint package's ``RedisStore`` does (encoding/json + klauspost zstd + SET EX 30 d / GET /
DEL / SCAN), one request per run. ``build`` builds ``tests/go/publishcall`` too, which runs the
Go client itself (tests/go/test_publish_calls.py).

Go and its two libraries come from Debian's packages (scripts/setup-env installs them when
missing and run as root, as CI is); the build runs in GOPATH mode over /usr/share/gocode, so
no Go module proxy is needed. Without Go, ``build`` skips the test, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
GOCODE = Path("/usr/share/gocode/src/github.com")
LIBRARIES = {
    "golang-github-klauspost-compress-dev": GOCODE / "klauspost/compress/zstd",
    "golang-github-gomodule-redigo-dev": GOCODE / "gomodule/redigo/redis",
}


class GoStoreError(Exception):
    """The Go program's store call failed (e.g. its json.Unmarshal refused a document)."""


@dataclass(frozen=True)
class GoStore:
    """The Go ``RedisStore`` on one Redis and prefix, one program run per call."""

    binary: Path
    port: int
    prefix: str = "agentorca-session"

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        done = subprocess.run(
            [str(self.binary), "-addr", f"127.0.0.1:{self.port}", "-prefix", self.prefix],
            input=json.dumps(request).encode(),
            capture_output=True,
            timeout=30,
            check=True,
        )
        reply: dict[str, Any] = json.loads(done.stdout)
        if not reply["ok"]:
            raise GoStoreError(reply["error"])
        return reply

    def save(self, document: dict[str, Any]) -> None:
        self._call({"op": "save", "checkpoint": document})

    def load(self, session_id: str) -> dict[str, Any] | None:
        reply = self._call({"op": "load", "id": session_id})
        return reply["checkpoint"] if reply["found"] else None

    def delete(self, session_id: str) -> None:
        self._call({"op": "delete", "id": session_id})

    def list(self) -> list[str]:
        return sorted(self._call({"op": "list"}).get("ids", []))


def build(out: Path, gopath: Path, program: str = "gostore") -> Path:
    """Build ``tests/go/<program>`` to ``out`` (GOPATH mode; ``gopath`` a scratch directory,
    where ``src/checkpointq`` links to this repository so that a program can import the Go
    client, ``checkpointq/clients/go``) and return its path; skip the calling test when Go
    or a library is missing."""
    go = shutil.which("go")
    missing = [name for name, path in LIBRARIES.items() if not path.is_dir()]
    if go is None or missing:
        pytest.skip(
            "the Go cross-check needs Go and "
            + ", ".join(["golang-go", *LIBRARIES] if go is None else missing)
            + " (Debian packages; scripts/setup-env installs them when run as root)"
        )
    (gopath / "src").mkdir(parents=True, exist_ok=True)
    (gopath / "src" / "checkpointq").symlink_to(REPO, target_is_directory=True)
    env = {
        **os.environ,
        "GO111MODULE": "off",
        "GOFLAGS": "",
        "GOPATH": f"{gopath}:/usr/share/gocode",
        # The build cache persists in the repo's ignored .gopath/, so later runs build fast.
        "GOCACHE": os.environ.get("GOCACHE", str(REPO / ".gopath" / "cache")),
    }
    subprocess.run(
        [go, "build", "-o", str(out), f"./tests/go/{program}"],
        cwd=REPO,
        env=env,
        check=True,
        timeout=600,
    )
    return out
