"""A save whose history the store trims says so, and why: in its handle, in what
``wait_durable`` returns, and in ``checkpointq show`` (which never blames the history cap
for what the stored-size budget did). A real worker whose budget is the smallest allowed
(1 KiB compressed) applies the saves. Given / When / Then."""

from __future__ import annotations

import base64
import os

import pytest
from click.testing import CliRunner

from checkpointq.store.model import Checkpoint, CheckpointMetadata, ConversationMessage
from checkpointq.tasks.producer.outcomes import APPLIED, Trimmed
from checkpointq.worker.cli import cli
from tests.worker.conftest import Deployment

pytestmark = pytest.mark.integration

#: The smallest stored-size budget settings allow: two of the messages below never fit it.
BUDGET = 1024


@pytest.fixture(scope="module")
def deployment_settings() -> dict[str, object]:
    return {"max_value_bytes": BUDGET}


def _incompressible(session_id: str, messages: int) -> Checkpoint:
    """``messages`` messages of 600 random characters each: one fits the budget, two do not."""
    history = [
        ConversationMessage(role="user", content=base64.b64encode(os.urandom(450)).decode())
        for _ in range(messages)
    ]
    metadata = CheckpointMetadata(total_messages=messages)
    return Checkpoint(
        session_id=session_id, version=1, conversation_history=history, metadata=metadata
    )


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "in-the-message"])
def test_a_save_trimmed_to_fit_the_budget_says_so_in_its_handle_and_outcome(
    live: Deployment, staged: bool
) -> None:
    # Given a checkpoint of four messages, of which the budget holds only the newest
    checkpoint = _incompressible(f"trim-{staged}", 4)
    settings = live.settings.model_copy(update={"stage_saves": staged})

    # When it is saved and waited for
    with type(live.checkpoint_client()).from_settings(settings) as client:
        handle = client.save(checkpoint)
        outcome = client.wait_durable(handle, timeout=20)
        stored = client.load(checkpoint.session_id)

    # Then the handle and the outcome say how many were kept, and that the budget trimmed it
    expected = Trimmed(sent=4, kept=1, cause="max_value_bytes")
    assert handle.trimmed == expected
    assert outcome.outcome == APPLIED and outcome.trimmed == expected
    assert stored is not None
    assert stored.conversation_history == checkpoint.conversation_history[-1:]


def test_show_of_a_history_trimmed_to_fit_the_budget_names_the_budget(live: Deployment) -> None:
    # Given a save the budget trimmed to one of its four messages, applied
    checkpoint = _incompressible("trim-show", 4)
    with live.checkpoint_client() as client:
        client.wait_durable(client.save(checkpoint), timeout=20)

    # When it is shown
    env = {
        "CHECKPOINTQ_BROKER_URL": live.broker.url,
        "CHECKPOINTQ_STORE_URL": live.store.url,
        "CHECKPOINTQ_QUEUE": live.settings.queue,
        "CHECKPOINTQ_MAX_VALUE_BYTES": str(BUDGET),
    }
    shown = CliRunner().invoke(cli, ["show", "trim-show"], env=env, catch_exceptions=False)

    # Then its messages line names the budget, and does not blame the history cap
    assert shown.exit_code == 0, shown.output
    (line,) = [line for line in shown.stdout.splitlines() if line.startswith("messages")]
    assert line.startswith("messages  1 stored (the newest), of 4 in the conversation"), line
    assert "fewer than CHECKPOINTQ_HISTORY_CAP (100)" in line
    assert f"CHECKPOINTQ_MAX_VALUE_BYTES ({BUDGET} bytes compressed)" in line
