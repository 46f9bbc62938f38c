"""docker-compose.yml and the Dockerfile, checked without a Docker engine.

The file must stay exactly in line with the code: every CHECKPOINTQ_ variable it sets is a
real settings field with a valid value, and every command it runs is a CLI command.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from checkpointq.worker.cli import cli
from checkpointq.worker.settings import Settings
from checkpointq.worker.supervisor import CHILD_GRACE_SECONDS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(loaded, dict)
    return loaded


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            pairs.append((instruction.upper(), rest.strip()))
    return pairs


def _seconds(duration: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smh])", duration))


def test_redis_keeps_an_aof_refuses_eviction_and_reports_health(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    command = redis["command"]
    args = command if isinstance(command, list) else shlex.split(command)

    assert redis["image"].startswith("redis:7")
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert "redis-cli" in redis["healthcheck"]["test"] and "ping" in redis["healthcheck"]["test"]
    volume = redis["volumes"][0].split(":")
    assert volume[1] == "/data" and volume[0] in compose["volumes"]
    assert redis["restart"] in ("always", "unless-stopped")


@pytest.mark.parametrize("name", ["worker", "beat"])
def test_worker_and_beat_are_built_here_and_wait_for_a_healthy_redis(
    compose: dict[str, Any], name: str
) -> None:
    service = compose["services"][name]

    assert service["build"] in (".", {"context": "."})
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert service["restart"] in ("always", "unless-stopped")
    assert service["command"] == [name]
    assert service["command"][0] in cli.commands


def test_the_worker_gets_longer_to_stop_than_its_warm_shutdown_needs(
    compose: dict[str, Any],
) -> None:
    grace = _seconds(compose["services"]["worker"]["stop_grace_period"])
    assert grace > CHILD_GRACE_SECONDS


@pytest.mark.parametrize("name", ["worker", "beat"])
def test_every_variable_set_is_a_settings_field_with_a_valid_value(
    compose: dict[str, Any], name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    environment = compose["services"][name]["environment"]
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    fields = {f"CHECKPOINTQ_{field.upper()}" for field in Settings.model_fields}

    unknown = {var for var in environment if var.startswith("CHECKPOINTQ_")} - fields
    assert not unknown, f"not settings fields: {sorted(unknown)}"
    assert environment["CHECKPOINTQ_BROKER_URL"] == "redis://redis:6379/0"

    # And the settings accept every value as written
    monkeypatch.chdir(tmp_path)
    for var, value in environment.items():
        monkeypatch.setenv(var, str(value))
    settings = Settings()
    assert settings.broker_url == "redis://redis:6379/0"


def test_the_image_runs_checkpointq_as_a_non_root_user(
    dockerfile: list[tuple[str, str]],
) -> None:
    instructions = dict(dockerfile)  # the last of each instruction wins, as in Docker

    assert dockerfile[0] == ("FROM", "python:3.11-slim")
    assert any(op == "RUN" and "pip install ." in args for op, args in dockerfile)
    assert instructions["USER"] not in ("root", "0")
    entrypoint = yaml.safe_load(instructions["ENTRYPOINT"])
    assert entrypoint == ["checkpointq"]
    command = yaml.safe_load(instructions["CMD"])
    assert command[0] in cli.commands


def test_the_console_script_the_image_runs_is_declared(
    dockerfile: list[tuple[str, str]],
) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["checkpointq"] == "checkpointq.worker.cli:main"


def test_the_build_context_keeps_local_state_out(dockerfile: list[tuple[str, str]]) -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".checkpointq", ".git", ".env"} <= ignored
    copied = [args.split()[0] for op, args in dockerfile if op == "COPY"]
    assert not any(path.startswith((".venv", ".checkpointq")) for path in copied)
