"""PNG plots for the report, drawn with matplotlib's file-only backend."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit, safe in CI and workers

import matplotlib.pyplot as plt

from bench.harness import Summary


def grouped_bars(
    path: Path,
    title: str,
    groups: Sequence[str],
    series: Mapping[str, Sequence[Summary]],
    ylabel: str,
    *,
    log: bool = False,
) -> None:
    """One group of bars per ``groups`` entry, one bar per series: medians with min-max."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(series))
    for n, (name, values) in enumerate(series.items()):
        xs = [g + (n - (len(series) - 1) / 2) * width for g in range(len(groups))]
        medians = [v.median for v in values]
        errors = [[v.median - v.low for v in values], [v.high - v.median for v in values]]
        ax.bar(xs, medians, width, yerr=errors, capsize=3, label=name)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def lines(
    path: Path,
    title: str,
    xs: Sequence[float],
    series: Mapping[str, Sequence[Summary]],
    xlabel: str,
    ylabel: str,
) -> None:
    """Medians against ``xs`` on log-log axes, one line per series, min-max as error bars."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, values in series.items():
        medians = [v.median for v in values]
        errors = [[v.median - v.low for v in values], [v.high - v.median for v in values]]
        ax.errorbar(list(xs), medians, yerr=errors, marker="o", capsize=3, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cdf(path: Path, title: str, samples: Mapping[str, Sequence[float]], xlabel: str) -> None:
    """Empirical CDFs of latency samples, one line per series, log x axis."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, values in samples.items():
        ordered = sorted(values)
        n = len(ordered)
        ax.plot(ordered, [(i + 1) / n for i in range(n)], label=name)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
