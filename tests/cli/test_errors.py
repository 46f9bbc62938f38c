"""Expected failures are one line on stderr and exit code 1; passwords are never shown."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions

import click
import pytest

from checkpointq.worker.cli import cli
from checkpointq.worker.console import missing_worker_extra
from tests.cli.conftest import COMMAND_TIMEOUT, Cli
from tests.support.markdown import ROOT
from tests.support.servers import SilentListener, free_port

SECRET = "s3cr3t-hunter2"


@pytest.fixture
def dead_url_cli(cli_offline: Cli, monkeypatch: pytest.MonkeyPatch) -> Cli:
    """The CLI configured with a password URL on which nothing listens."""
    url = f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"
    monkeypatch.setenv("CHECKPOINTQ_BROKER_URL", url)
    cli_offline.env["CHECKPOINTQ_BROKER_URL"] = url
    return cli_offline


@pytest.mark.parametrize(
    "args",
    [["show", "s1"], ["ls"], ["stats"], ["sweep"], ["dlq", "ls"], ["dlq", "purge", "--yes"]],
)
def test_commands_on_a_dead_redis_fail_with_one_line_and_no_password(
    dead_url_cli: Cli, args: list[str]
) -> None:
    result = dead_url_cli(*args)

    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("checkpointq: error: ")
    assert SECRET not in result.output


@pytest.mark.parametrize("args", [["save", "-", "--wait"], ["show", "s1"], ["health"]])
def test_a_broker_that_accepts_and_never_answers_fails_each_command_in_one_line(
    cli_offline: Cli, args: list[str]
) -> None:
    # Given a broker (and store) that accepts connections and never answers
    with SilentListener() as silent:
        cli_offline.env["CHECKPOINTQ_BROKER_URL"] = silent.url

        # When a command uses it: the run's own timeout (60 s) would fail a hang; before,
        # `save` retried 5 s reads for 34 s
        completed = cli_offline.run(*args, input=b'{"sessionId": "s1", "version": 1}')

    # Then it gives up with one line naming the timeout
    assert completed.returncode == 1
    assert len(completed.stderr.splitlines()) == 1, completed.stderr
    assert "Timeout" in completed.stderr
    assert silent.accepted >= 1


def test_a_real_process_prints_no_traceback_and_no_password(dead_url_cli: Cli) -> None:
    completed = dead_url_cli.run("show", "s1")

    assert completed.returncode == 1
    assert completed.stdout == ""
    assert len(completed.stderr.splitlines()) == 1, completed.stderr
    assert "Traceback" not in completed.stderr
    assert SECRET not in completed.stderr


def test_a_command_missing_a_module_of_the_worker_extra_names_the_extra(cli_offline: Cli) -> None:
    # Given click and Celery importable but rich not, as beside an API server's own Celery
    # with checkpointq installed without the extra (tests/cli/test_wheel.py: no Celery at all)
    script = (
        "import sys; sys.modules['rich'] = None; import checkpointq.worker.console as c; c.main()"
    )

    # When a command that needs rich runs, through the console script's entry point
    completed = subprocess.run(
        [sys.executable, "-c", script, "top", "--once"],
        cwd=cli_offline.cwd,
        env=cli_offline.process_env(),
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
    )

    # Then it is the CLI's one-line error, naming the extra and the missing module, exit 2
    assert (completed.returncode, completed.stdout) == (2, ""), completed.stderr
    assert completed.stderr.splitlines() == [
        "checkpointq: error: this command needs the worker extra: "
        "pip install 'checkpointq[worker]' (rich is not installed)"
    ]


@pytest.mark.parametrize(
    ("missing", "named"),
    [
        ("click", "click"),
        ("kombu.transport.virtual", "kombu.transport.virtual"),
        ("backports", "backports.zstd"),  # the namespace package, absent altogether
        ("yaml", None),  # not the extra's: a bug, left to raise
        ("richer", None),
    ],
)
def test_only_a_module_of_the_worker_extra_is_blamed_on_it(missing: str, named: str | None) -> None:
    message = missing_worker_extra(ModuleNotFoundError(name=missing))

    if named is None:
        assert message is None
    else:
        assert message == (
            "this command needs the worker extra: pip install 'checkpointq[worker]' "
            f"({named} is not installed)"
        )


def test_every_distribution_of_the_worker_extra_is_named_when_its_module_is_missing() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {_distribution(r) for r in project["dependencies"]}
    extra = {_distribution(r) for r in project["optional-dependencies"]["worker"]} - base
    modules = {
        module: _distribution(name)
        for module, names in packages_distributions().items()
        for name in names
        if _distribution(name) in extra
    }

    assert set(modules.values()) == extra  # each is installed here, with its modules
    unnamed = [m for m in modules if missing_worker_extra(ModuleNotFoundError(name=m)) is None]
    assert unnamed == [], "add them to checkpointq.worker.console.WORKER_EXTRA_MODULES"


def _distribution(requirement: str) -> str:
    """A requirement's distribution name, normalised (PEP 503)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert name is not None, requirement
    return re.sub(r"[-_.]+", "-", name.group(0)).lower()


def test_without_url_or_embedded_redis_commands_say_how_to_configure(cli_offline: Cli) -> None:
    result = cli_offline("show", "s1")

    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1
    assert "CHECKPOINTQ_BROKER_URL" in result.stderr
    assert "checkpointq up" in result.stderr


def test_an_invalid_setting_is_named_without_echoing_its_value(
    cli_offline: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHECKPOINTQ_BROKER_URL", f"redis://:{SECRET}@127.0.0.1:1/0")
    monkeypatch.setenv("CHECKPOINTQ_CONCURRENCY", f"not-a-number-{SECRET}")

    result = cli_offline("stats")

    assert result.exit_code == 1
    assert result.stderr.startswith("checkpointq: error: invalid CHECKPOINTQ_CONCURRENCY")
    assert SECRET not in result.output


def test_an_orphan_grace_within_the_recovery_window_is_refused(
    cli_offline: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A request the sweep settled as lost could be published again by its producer (it
    # finds a broker loss) and land after its dead letter said lost.
    monkeypatch.setenv("CHECKPOINTQ_BROKER_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("CHECKPOINTQ_ORPHAN_GRACE_SECONDS", "10")

    result = cli_offline("stats")

    assert result.exit_code == 1
    assert "orphan_grace_seconds must exceed republish_seconds" in result.stderr


def test_an_invalid_checkpoint_file_is_refused_before_anything_is_enqueued(
    cli_offline: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHECKPOINTQ_BROKER_URL", f"redis://127.0.0.1:{free_port()}/0")

    result = cli_offline("save", "-", input='{"sessionId": "", "version": 1}')

    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1
    assert "sessionId" in result.stderr


def test_an_unsupported_broker_scheme_is_named_with_the_accepted_ones(
    cli_offline: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHECKPOINTQ_BROKER_URL", f"http://user:{SECRET}@broker.example:80/")

    result = cli_offline("show", "s1")

    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1
    assert "unsupported broker URL scheme 'http'" in result.stderr
    assert "redis://" in result.stderr and "amqp://" in result.stderr
    assert "store_url is required" not in result.stderr
    assert SECRET not in result.output


@pytest.mark.parametrize(
    ("url", "named"),
    [
        (f"redis://:{SECRET}@127.0.0.1:abc/0", "port 'abc'"),
        (f"redis://:{SECRET}@127.0.0.1:99999/0", "port '99999'"),
        (f"redis://:{SECRET}@127.0.0.1:6379/zero", "database 'zero'"),
        (f"redis://:{SECRET}@127.0.0.1:6379/0?socket_timeout=soon", "'socket_timeout'"),
        (f"redis://:{SECRET}@[::1:6379/0", "IPv6"),
        (f"amqp://u:{SECRET}@mq:port//", "port 'port'"),
    ],
)
def test_a_malformed_broker_url_is_one_line_naming_what_is_wrong(
    cli_offline: Cli, url: str, named: str
) -> None:
    # Given a broker URL that cannot be read (a port that is not a number printed a
    # 48-line traceback from redis-py)
    cli_offline.env["CHECKPOINTQ_BROKER_URL"] = url
    cli_offline.env["CHECKPOINTQ_STORE_URL"] = "redis://127.0.0.1:1/0"

    # When a real process starts with it
    completed = cli_offline.run("stats")

    # Then it fails in one line that says what is wrong, without the password
    assert completed.returncode == 1
    assert len(completed.stderr.splitlines()) == 1, completed.stderr
    assert "CHECKPOINTQ_BROKER_URL" in completed.stderr and named in completed.stderr
    assert SECRET not in completed.stderr


def test_version_prints_the_installed_version(cli_offline: Cli) -> None:
    from importlib.metadata import version

    completed = cli_offline.run("--version")

    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == f"checkpointq, version {version('checkpointq')}"


@pytest.mark.parametrize("command", ["save", "delete"])
def test_wait_options_explain_themselves_and_refuse_a_timeout_that_is_not_positive(
    cli_offline: Cli, command: str
) -> None:
    help_text = " ".join(cli_offline(command, "--help").stdout.split())
    assert "--timeout SECONDS" in help_text
    assert "durable in the store" in help_text
    assert "the request stays queued" in help_text

    target = "-" if command == "save" else "s1"
    result = cli_offline(command, target, "--wait", "--timeout", "0", input="{}")

    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1
    assert "--timeout" in result.stderr


def _commands(group: click.Group, path: str = "") -> list[tuple[str, click.Command]]:
    found = []
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found += _commands(command, f"{path}{name} ")
        else:
            found.append((f"{path}{name}", command))
    return found


def test_every_command_takes_json_and_explains_each_option() -> None:
    for name, command in _commands(cli):
        options = [p for p in command.params if isinstance(p, click.Option)]
        assert any("--json" in o.opts for o in options), f"{name} has no --json"
        for option in options:
            assert option.help and len(option.help) > 20, f"{name} {option.opts}: no help"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["save"], "Missing argument 'FILE|-' (see `checkpointq save --help`)"),
        (["ls", "--bogus"], "No such option '--bogus' (see `checkpointq ls --help`)"),
        (["nosuch"], "No such command 'nosuch' (see `checkpointq --help`)"),
        (["dlq", "replay"], "give entry ids or --all (not both)"),
        (["worker", "-Q", "a,b"], "-Q takes one queue"),
    ],
)
def test_usage_errors_are_one_line_with_exit_1(
    cli_offline: Cli, args: list[str], expected: str
) -> None:
    result = cli_offline(*args)

    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("checkpointq: error: ")
    assert expected in result.stderr
