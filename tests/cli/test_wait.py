"""`save --wait` against a real `checkpointq up` (history capped at 2 messages): a refused
request fails at once, saying why; a trimmed history is reported."""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Iterator

import pytest

from tests.cli.conftest import Cli
from tests.cli.test_up import DEADLINE, running_up
from tests.support.servers import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    cli = Cli(tmp_path_factory.mktemp("wait"), {"CHECKPOINTQ_HISTORY_CAP": "2"})
    with running_up(cli):
        wait_until(
            lambda: cli.run("health").returncode == 0,
            timeout=DEADLINE,
            message="checkpointq up to serve",
        )
        yield cli


def test_save_wait_reports_a_history_the_store_trimmed(system: Cli) -> None:
    messages = [{"role": "user", "content": f"message {i}"} for i in range(5)]
    document = {"sessionId": "long", "version": 1, "conversationHistory": messages}

    saved = system.run("save", "-", "--wait", input=json.dumps(document).encode())
    as_json = system.run("save", "-", "--wait", "--json", input=json.dumps(document).encode())

    assert saved.returncode == 0, saved.stderr
    assert "save of session 'long' applied" in saved.stdout
    assert "the store kept the newest 2 of 5 messages (CHECKPOINTQ_HISTORY_CAP)" in saved.stdout
    assert json.loads(as_json.stdout)["messages"] == {"sent": 5, "kept": 2, "cause": "history_cap"}


def _too_big() -> bytes:
    """A checkpoint whose newest message alone is 3 MB of incompressible text: under the
    8 MiB message limit, over the 1 MiB stored-value limit."""
    content = base64.b64encode(os.urandom(3 * 1024 * 1024 * 3 // 4)).decode()
    document = {
        "sessionId": "too-big",
        "version": 1,
        "conversationHistory": [{"role": "user", "content": content}],
    }
    return json.dumps(document).encode()


def test_save_of_a_value_no_worker_could_store_is_refused_before_it_is_sent(
    system: Cli,
) -> None:
    # When a checkpoint over the stored-size budget is saved
    saved = system.run("save", "-", "--wait", "--timeout", "600", input=_too_big())

    # Then the save fails at once with one line naming the budget, and nothing is stored
    assert saved.returncode == 1
    assert len(saved.stderr.splitlines()) == 1, saved.stderr
    assert "does not fit the 1048576-byte stored-size budget" in saved.stderr
    assert "dead letter" not in saved.stderr
    shown = system.run("show", "too-big")
    assert shown.returncode == 1
    assert "no live session 'too-big'" in shown.stderr


def test_save_wait_of_a_request_the_worker_refuses_fails_with_the_reason_and_entry(
    system: Cli,
) -> None:
    # Given a producer configured with a larger stored-size budget than the workers' (the
    # one refusal a producer cannot make for them: it does not know their settings)
    producer = Cli(system.cwd, {**system.env, "CHECKPOINTQ_MAX_VALUE_BYTES": str(8 * 1024 * 1024)})

    # When it saves a value over the workers' budget and waits, with a timeout far longer
    # than the refusal takes
    saved = producer.run("save", "-", "--wait", "--timeout", "600", input=_too_big())

    # Then it fails with one line: the refusal's kind, its reason and the dead letter
    assert saved.returncode == 1
    assert len(saved.stderr.splitlines()) == 1, saved.stderr
    assert "was refused (invalid_input)" in saved.stderr
    assert "within" not in saved.stderr  # not a timeout
    entry = re.search(r"dead letter (\S+)", saved.stderr)
    assert entry is not None, saved.stderr

    # And that entry is the request, with the reason
    shown = system.run("dlq", "show", entry.group(1).rstrip(".;"), "--json")
    assert shown.returncode == 0, shown.stderr
    letter = json.loads(shown.stdout)
    assert letter["task"] == "checkpoint.save"
    assert letter["kind"] == "invalid_input"
    assert letter["reason"] in saved.stderr
