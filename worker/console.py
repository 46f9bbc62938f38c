"""The ``checkpointq`` console script: the CLI, or one line naming the extra it needs.

``pip install checkpointq`` brings the producer and the store only; the CLI's own library
(click) and what its commands run (Celery, kombu, redbeat, prometheus-client, rich) come with
``checkpointq[worker]``. So the script imports the CLI here, and a module of that extra
missing, at import or in a command, is the CLI's usual one-line error, never a traceback.
"""

from __future__ import annotations

import sys
from importlib import metadata

#: Top-level modules of the worker extra (pyproject.toml) that the CLI and its commands import.
WORKER_EXTRA_MODULES = frozenset(
    {"celery", "kombu", "click", "redbeat", "prometheus_client", "rich"}
)


def missing_worker_extra(exc: ModuleNotFoundError) -> str | None:
    """The error line for ``exc`` if the module it misses comes with the worker extra."""
    module = (exc.name or "").partition(".")[0]
    if module not in WORKER_EXTRA_MODULES:
        return None
    return (
        "this command needs the worker extra: "
        f"pip install 'checkpointq[worker]' ({module} is not installed)"
    )


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
        print(f"checkpointq: error: {message}", file=sys.stderr)
        sys.exit(1)
    cli_main()
