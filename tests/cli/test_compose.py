"""docker-compose.yml and the Dockerfile, checked without a Docker engine.

The file must stay exactly in line with the code: every CHECKPOINTQ_ variable it sets is a
real settings field with a valid value, and every command it runs is a CLI command. It is
read as Compose reads it (variables interpolated from .env) and validated against the
Compose specification's JSON schema (the copy check-jsonschema vendors), since `docker
compose config` needs an engine.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import tomllib
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from checkpointq.worker.cli import cli
from checkpointq.worker.settings import Settings
from checkpointq.worker.supervisor import CHILD_GRACE_SECONDS

ROOT = Path(__file__).resolve().parents[2]


#: What an operator puts in .env (the secrets .env.example asks for).
DOT_ENV = {"REDIS_PASSWORD": "s3cret-hex", "FLOWER_PASSWORD": "flower-pw"}
_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


class MissingVariable(Exception):
    """A ${VAR:?message} whose variable is unset: Compose refuses the file."""


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: $$, ${VAR}, ${VAR:-default}, ${VAR:?error}."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        value, how, arg = env.get(name), match.group(2), match.group(3)
        if how in (":-", "-") and not value:
            return arg or ""
        if how in (":?", "?") and not value:
            raise MissingVariable(f"{name}: {arg}")
        return value or ""

    return _VARIABLE.sub(one, text)


def load_compose(env: dict[str, str]) -> dict[str, Any]:
    loaded = yaml.safe_load(interpolate((ROOT / "docker-compose.yml").read_text(), env))
    assert isinstance(loaded, dict)
    return loaded


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose(DOT_ENV)


@pytest.fixture(scope="module")
def compose_schema() -> dict[str, Any]:
    schema = files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    loaded = json.loads(schema.read_text())
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

    assert re.fullmatch(r"redis:7\.\d+\.\d+", redis["image"])  # pinned
    assert args[args.index("--appendonly") + 1] == "yes"
    # noeviction does nothing without a memory limit
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--maxmemory") + 1] == "1gb"
    assert args[args.index("--requirepass") + 1] == DOT_ENV["REDIS_PASSWORD"]
    assert redis["environment"]["REDISCLI_AUTH"] == DOT_ENV["REDIS_PASSWORD"]  # health check
    assert "redis-cli" in redis["healthcheck"]["test"] and "ping" in redis["healthcheck"]["test"]
    volume = redis["volumes"][0].split(":")
    assert volume[1] == "/data" and volume[0] in compose["volumes"]
    assert redis["restart"] in ("always", "unless-stopped")


def test_worker_and_beat_share_one_image_built_once(compose: dict[str, Any]) -> None:
    services = compose["services"]
    built = [name for name, service in services.items() if "build" in service]

    assert built == ["worker"]
    assert services["worker"]["build"] in (".", {"context": "."})
    assert services["beat"]["image"] == services["worker"]["image"]
    assert services["beat"]["pull_policy"] == "never"


def test_redis_is_reachable_from_outside_on_the_hosts_loopback_by_default(
    compose: dict[str, Any],
) -> None:
    (published,) = compose["services"]["redis"]["ports"]
    assert published == "127.0.0.1:6379:6379"
    served = load_compose({**DOT_ENV, "REDIS_BIND": "10.0.0.5", "REDIS_PORT": "6380"})
    assert served["services"]["redis"]["ports"] == ["10.0.0.5:6380:6379"]


def test_the_stack_refuses_to_start_without_a_redis_password() -> None:
    with pytest.raises(MissingVariable, match="REDIS_PASSWORD"):
        load_compose({})


def test_flower_requires_basic_auth_from_the_environment_and_listens_locally(
    compose: dict[str, Any],
) -> None:
    flower = compose["services"]["flower"]
    script = " ".join(flower["entrypoint"])

    assert re.fullmatch(r"mher/flower:\d+\.\d+\.\d+", flower["image"])
    assert 'test -n "$FLOWER_PASSWORD" ||' in script
    assert '--basic-auth="$FLOWER_USER:$FLOWER_PASSWORD"' in script
    assert flower["environment"]["FLOWER_PASSWORD"] == DOT_ENV["FLOWER_PASSWORD"]
    assert "redis://redis" not in script  # the broker URL comes from the environment
    assert flower["environment"]["FLOWER_BROKER_URL"].startswith("redis://:s3cret-hex@redis")
    assert flower["ports"] == ["127.0.0.1:5555:5555"]


def test_the_file_is_valid_compose_by_the_specifications_schema(
    compose: dict[str, Any], compose_schema: dict[str, Any]
) -> None:
    validator = jsonschema.validators.validator_for(compose_schema)(compose_schema)
    assert not list(validator.iter_errors(compose))

    # (and the schema is a real check: a misspelt key and an unknown condition are caught)
    broken = copy.deepcopy(compose)
    broken["services"]["worker"]["depends_on"]["redis"]["condition"] = "whenever"
    broken["services"]["beat"]["stop_grace"] = "30s"
    assert len(list(validator.iter_errors(broken))) >= 2


def test_every_variable_the_file_uses_is_in_env_example() -> None:
    used = set(re.findall(r"\$\{(\w+)", (ROOT / "docker-compose.yml").read_text()))
    example = (ROOT / ".env.example").read_text()
    listed = set(re.findall(r"^(\w+)=", example, flags=re.MULTILINE))
    assert used <= listed, sorted(used - listed)


@pytest.mark.parametrize("name", ["worker", "beat"])
def test_worker_and_beat_wait_for_a_healthy_redis(compose: dict[str, Any], name: str) -> None:
    service = compose["services"][name]

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
    assert environment["CHECKPOINTQ_BROKER_URL"] == "redis://:s3cret-hex@redis:6379/0"

    # And the settings accept every value as written
    monkeypatch.chdir(tmp_path)
    for var, value in environment.items():
        monkeypatch.setenv(var, str(value))
    settings = Settings()
    assert settings.broker_url == "redis://:s3cret-hex@redis:6379/0"


def test_the_image_runs_checkpointq_as_a_non_root_user(
    dockerfile: list[tuple[str, str]],
) -> None:
    instructions = dict(dockerfile)  # the last of each instruction wins, as in Docker

    assert dockerfile[0][0] == "FROM"
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", dockerfile[0][1])
    assert any(op == "RUN" and "pip install --no-deps ." in args for op, args in dockerfile)
    assert instructions["USER"] not in ("root", "0")
    entrypoint = yaml.safe_load(instructions["ENTRYPOINT"])
    assert entrypoint == ["checkpointq"]
    command = yaml.safe_load(instructions["CMD"])
    assert command[0] in cli.commands


def test_the_console_script_the_image_runs_is_declared(
    dockerfile: list[tuple[str, str]],
) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["checkpointq"] == "checkpointq.worker.console:main"


def test_the_build_context_keeps_local_state_out(dockerfile: list[tuple[str, str]]) -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".checkpointq", ".git", ".env"} <= ignored
    copied = [args.split()[0] for op, args in dockerfile if op == "COPY"]
    assert not any(path.startswith((".venv", ".checkpointq")) for path in copied)


def test_dependencies_are_installed_pinned_before_the_code_is_copied(
    dockerfile: list[tuple[str, str]],
) -> None:
    steps = [f"{op} {args}" for op, args in dockerfile]
    (deps,) = [i for i, step in enumerate(steps) if "-c constraints.txt" in step]
    (code,) = [i for i, step in enumerate(steps) if step.startswith("COPY store")]
    (install,) = [i for i, step in enumerate(steps) if "pip install --no-deps ." in step]
    copied_before = " ".join(steps[:deps])

    # Only what names the dependencies is copied before they are installed
    assert "COPY pyproject.toml constraints.txt" in copied_before
    assert not any(name in copied_before for name in ("store", "tasks", "worker"))
    assert deps < code < install
    # And scripts/setup-env installs from the same constraints
    assert "-c constraints.txt" in (ROOT / "scripts" / "setup-env").read_text()


def test_the_postgres_profile_runs_a_database_the_workers_wait_for(
    compose: dict[str, Any],
) -> None:
    database = compose["services"]["postgres"]
    # Only with --profile postgres, kept on a volume, checked before workers start
    assert database["profiles"] == ["postgres"]
    assert any(volume.startswith("postgres-data:") for volume in database["volumes"])
    assert "postgres-data" in compose["volumes"]
    assert database["healthcheck"]["test"][1] == "pg_isready"
    assert "ports" not in database  # reached on the compose network only
    for name in ("worker", "beat"):
        waits = compose["services"][name]["depends_on"]["postgres"]
        assert waits == {"condition": "service_healthy", "required": False}


def test_a_store_url_from_env_points_the_workers_at_the_database(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    url = "postgresql://checkpointq:pg-pw@postgres:5432/checkpointq"
    for dot_env, store in ((DOT_ENV, None), ({**DOT_ENV, "CHECKPOINTQ_STORE_URL": url}, url)):
        # Given .env without and then with the postgres profile's store URL
        environment = load_compose(dot_env)["services"]["worker"]["environment"]
        for var, value in environment.items():
            monkeypatch.setenv(var, str(value))
        settings = Settings()
        # Then empty, the broker's Redis is the store; set, the database is, and the
        # broker's Redis keeps what lives beside it
        assert settings.store_is_postgres == (store is not None)
        assert settings.resolved_store_url == (store or settings.broker_url)
        assert settings.resolved_redis_url == "redis://:s3cret-hex@redis:6379/0"
