"""The worker's main process loads only what it runs: no Celery CLI, zstd or RedBeat.

Each of them costs the main process of every prefork worker memory (about 6 MB, 0.3 MB
and 1 MB) for code only pool children (zstd; the main process imports it on the first
compressed body, ``worker/compressed_bodies.py``), ``checkpointq health`` (RedBeat) or other
Celery commands need. Checked in a fresh interpreter, whose modules nothing else loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import kombu

from tests.support.celery_processes import checkpointq_env

#: Modules the main process must not load (``celery.bin.celery`` brings click-repl and
#: prompt_toolkit; ``app.worker_main`` loads it). kombu before 5.7 imports zstandard itself
#: whenever it is installed (``kombu/compression.py``), in every process: not ours to avoid.
NOT_IN_MAIN = (
    "celery.bin.celery",
    "click_repl",
    "prompt_toolkit",
    *(("zstandard",) if tuple(kombu.VERSION[:2]) >= (5, 7) else ()),
    "redbeat",
)

_PROGRAM = f"""
import json, sys
from checkpointq.worker.app import create_app
from checkpointq.worker.cli import _run_celery_worker
from checkpointq.worker.settings import Settings

app = create_app(Settings())
# Celery's own worker command parses its options: --help stops it before it starts.
_run_celery_worker(app, ["worker", "--pool", "prefork", "--concurrency", "2", "--help"])
print(json.dumps(sorted(name for name in {NOT_IN_MAIN!r} if name in sys.modules)))
"""


def test_the_worker_command_parses_options_without_loading_what_only_others_need() -> None:
    env = checkpointq_env(broker_url="redis://127.0.0.1:1/0")
    result = subprocess.run(
        [sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    # Then the help of Celery's worker command came out, and none of the modules was loaded
    assert "--concurrency" in result.stdout
    assert json.loads(result.stdout.splitlines()[-1]) == []
