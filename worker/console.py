"""The ``checkpointq`` console script: the CLI, or one line naming the extra it needs.

``pip install checkpointq`` brings the producer and the store only; the CLI's own library
(click) and what its commands run (Celery, kombu, redbeat, prometheus-client, rich) come with
``checkpointq[worker]``. So the script imports the CLI here, and a module of that extra
missing, at import or in a command, is the CLI's usual one-line error, never a traceback.
"""

from __future__ import annotations

import sys
from importlib import metadata

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
