"""``python -m bench``: run the benchmark sections and write ``REPORT.md`` with its plots.

Run from the repository root (the suite starts its redis-servers with the tests' helper)::

    python -m bench                    # every section, full sizes (minutes)
    python -m bench --quick            # tiny sizes, proves the suite runs (CI)
    python -m bench --sections store   # some sections only
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.harness import RunConfig, SectionReport

#: Section name -> module whose ``run(config)`` measures it, in report order.
SECTIONS = {
    "store": "bench.store_bench",
    "producer": "bench.producer_bench",
    "async": "bench.async_bench",
    "worker": "bench.worker_bench",
    "latency": "bench.latency_bench",
    "memory": "bench.memory_bench",
    "sweep": "bench.sweep_bench",
    "reconcile": "bench.reconcile_bench",
    "cluster": "bench.cluster_bench",
    "postgres": "bench.postgres_bench",
    "peers": "bench.peers_bench",
}

RESULTS = Path(__file__).parent / "results"


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: only check it runs")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated, from: {', '.join(SECTIONS)} (default: all)",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="repetitions per figure (default 5; quick 2)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output directory (default {RESULTS}, or its quick/ subdirectory with --quick)",
    )
    args = parser.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    try:
        import matplotlib  # noqa: F401 - only checking that the plots can be drawn
    except ImportError:
        print("the benchmark plots need matplotlib: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    from bench.report import machine_load, write_report

    out = args.out or (RESULTS / "quick" if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    config = RunConfig(
        quick=args.quick, repeats=args.repeats or (2 if args.quick else 5), out_dir=out
    )
    load_before = machine_load()
    started = time.monotonic()
    reports: list[SectionReport] = []
    for name in [s for s in SECTIONS if s in args.sections.split(",")]:
        print(f"== {name} (load {machine_load()})", flush=True)
        run: Callable[[RunConfig], SectionReport] = importlib.import_module(SECTIONS[name]).run
        reports.append(run(config))
    path = write_report(config, reports, argv, load_before, time.monotonic() - started)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
