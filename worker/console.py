"""The ``checkpointq`` console script: the CLI, or one line naming the extra it needs.

``pip install checkpointq`` brings the producer and the store only; the CLI's own library
(click) and what its commands run (Celery, kombu, redbeat, prometheus-client, rich) come with
``checkpointq[worker]``. So the script imports the CLI here, and a module of that extra
missing, at import or in a command, is one line naming the extra and exit status 2 (apart
from the CLI's own failures, 1), never a traceback; ``--version`` and ``--help`` answer
without it. It also owns what the script does with a stdout nobody takes any more
(``quiet_stdout``).
"""

from __future__ import annotations

import os
import sys
from importlib import metadata

#: Exit status of a command whose dependencies are missing (the CLI's own failures are 1).
EXIT_MISSING_EXTRA = 2

#: ``checkpointq --help`` where the CLI cannot import (click's layout, which needs no click).
BARE_HELP = """\
Usage: checkpointq [OPTIONS] COMMAND [ARGS]...

  Persist AI-agent session checkpoints through Celery workers on Redis.

  This install has the Python producer and the store (from checkpointq import
  CheckpointClient). Its commands (beat, delete, dlq, health, ls, save, show, stats,
  sweep, top, up, worker) need the worker extra: pip install 'checkpointq[worker]'

Options:
  --version   Show the version and exit.
  -h, --help  Show this message and exit.
"""

#: Modules of the worker extra (pyproject.toml) that the CLI and its commands import.
WORKER_EXTRA_MODULES = (
    "click",
    "celery",
    "kombu",
    "redbeat",
    "prometheus_client",
    "rich",
    "backports.zstd",
)


def missing_worker_extra(exc: ModuleNotFoundError) -> str | None:
    """The error line for ``exc`` if the module it misses comes with the worker extra."""
    missing = exc.name or ""
    for module in WORKER_EXTRA_MODULES:
        if missing == module or missing.startswith(f"{module}."):
            named = missing
        elif module.startswith(f"{missing}."):  # a namespace (backports) absent altogether
            named = module
        else:
            continue
        return (
            "this command needs the worker extra: "
            f"pip install 'checkpointq[worker]' ({named} is not installed)"
        )
    return None


def quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush of what is left in
    its buffer cannot fail again (a closed pipe) or block (a terminal that takes no output)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main() -> None:
    """The console script's entry point: ``checkpointq.worker.cli.main`` once it imports."""
    try:
        from checkpointq.worker.cli import main as cli_main
    except ModuleNotFoundError as exc:
        message = missing_worker_extra(exc)
        if message is None:
            raise
        if sys.argv[1:] == ["--version"]:  # click's format, which needs no click
            print(f"checkpointq, version {metadata.version('checkpointq')}")
            return
        if sys.argv[1:] in (["--help"], ["-h"]):
            print(BARE_HELP, end="")
            return
        print(f"checkpointq: error: {message}", file=sys.stderr)
        sys.exit(EXIT_MISSING_EXTRA)
    cli_main()
