"""The operations artefacts agree with the code: compose health checks are real CLI
invocations, docs/operations.md and the Grafana dashboard name only metrics the worker exports,
and docs/configuration.md lists exactly the settings."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from checkpointq.worker.cli import cli
from checkpointq.worker.ops.metrics import RedisGauges, WorkerMetrics
from checkpointq.worker.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
_SUFFIXES = ("_bucket", "_sum", "_count", "_created")


def exported() -> set[str]:
    """Every metric name the worker serves (counters with their ``_total``)."""
    registry = CollectorRegistry()
    WorkerMetrics(registry)
    names = set(RedisGauges.NAMES)
    for family in registry.collect():
        names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def _base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(loaded, dict)
    return loaded


@pytest.mark.parametrize(("service", "option"), [("worker", "--local"), ("beat", "--beat")])
def test_compose_health_checks_run_checkpointq_health(
    compose: dict[str, Any], service: str, option: str
) -> None:
    test = compose["services"][service]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "checkpointq", "health"] and option in test
    # and click accepts the invocation as written
    cli.commands["health"].make_context("health", list(test[3:]))


def test_the_metrics_port_is_exposed_and_flower_is_a_profile(compose: dict[str, Any]) -> None:
    services = compose["services"]
    worker = services["worker"]
    assert worker["environment"]["CHECKPOINTQ_METRICS_PORT"] in worker["expose"]
    flower = services["flower"]
    assert flower["profiles"] == ["flower"]
    # Flower reads the workers' broker (the same URL, up to how a missing password is reported)
    # and never starts without basic auth.
    assert _unchecked(flower["environment"]["FLOWER_BROKER_URL"]) == _unchecked(
        worker["environment"]["CHECKPOINTQ_BROKER_URL"]
    )
    command = " ".join(flower["entrypoint"])
    assert '--broker="$$FLOWER_BROKER_URL"' in command
    assert '--basic-auth="$$FLOWER_USER:$$FLOWER_PASSWORD"' in command
    assert 'test -n "$$FLOWER_PASSWORD"' in command


def _unchecked(value: str) -> str:
    """``${VAR:?message}`` and ``${VAR:-default}`` as plain ``${VAR}``."""
    return re.sub(r"\$\{(\w+):[?-][^}]*\}", r"${\1}", value)


def test_the_operations_page_lists_exactly_the_exported_metrics() -> None:
    page = (ROOT / "docs" / "operations.md").read_text()
    listed = set(re.findall(r"^\| `(checkpointq_[a-z_]+)` \|", page, re.MULTILINE))
    assert listed == exported()


def test_the_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {_base(name) for expr in exprs for name in re.findall(r"checkpointq_[a-z_]+", expr)}
    known = {_base(name) for name in exported()}
    assert used and used <= known
    # and every exported metric appears somewhere on the dashboard
    assert known <= used


def test_the_configuration_page_documents_every_setting() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `(CHECKPOINTQ_[A-Z_]+)` \|", page, re.MULTILINE))
    expected = {f"CHECKPOINTQ_{name.upper()}" for name in Settings.model_fields}
    assert documented == expected


def _same_default(literal: str, default: object) -> bool:
    """Whether a default as the configuration page writes it is the code's default."""
    if isinstance(default, bool):
        return literal == str(default).lower()
    if isinstance(default, int | float):
        return float(literal) == float(default)
    if isinstance(default, Path):
        return Path(literal) == default
    return literal == default


def test_the_configuration_page_states_each_default_the_code_has() -> None:
    # Given the settings table, When a row's default is a literal (`300`, `false`, ...),
    # Then it is the field's default in worker/settings.py (prose defaults are not read).
    page = (ROOT / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `CHECKPOINTQ_([A-Z_]+)` \| `([^`]+)`", page, re.MULTILINE)
    assert len(rows) > 30
    for name, literal in rows:
        field = Settings.model_fields[name.lower()]
        default = field.default if field.default_factory is None else None
        assert _same_default(literal, default), f"{name}: page {literal}, code {default}"
