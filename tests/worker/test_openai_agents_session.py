"""The OpenAI Agents SDK's ``Session`` on checkpoints: the SDK's own ``Runner`` on a scripted
model (no network), two API replicas taking a session's turns in turn, and a real worker
applying them (tests/worker/conftest.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from agents import Agent, Runner, set_tracing_disabled
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import ResponseOutputMessage, ResponseOutputText

from checkpointq import AsyncCheckpointClient, RedisStore
from checkpointq.integrations.openai_agents import CheckpointSession
from tests.worker.conftest import Deployment

pytestmark = pytest.mark.integration


class ScriptedModel(Model):
    """Answers ``reply <n>`` to the n-th call, and keeps what each call was given."""

    def __init__(self) -> None:
        self.inputs: list[list[Any]] = []

    async def get_response(self, system_instructions: Any, input: Any, *args: Any,
                           **kwargs: Any) -> ModelResponse:  # fmt: skip
        self.inputs.append(list(input) if isinstance(input, list) else [input])
        text = ResponseOutputText(type="output_text", text=f"reply {len(self.inputs)}",
                                  annotations=[])  # fmt: skip
        message = ResponseOutputMessage(
            id=f"msg_{len(self.inputs)}", type="message", role="assistant",
            status="completed", content=[text],
        )  # fmt: skip
        return ModelResponse(output=[message], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("not streamed here")


def _texts(items: list[Any]) -> list[str]:
    """Each item's text, whatever its shape."""
    out = []
    for item in items:
        content = item.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content)
        out.append(str(content))
    return out


def test_two_replicas_take_turns_with_the_runner_and_each_reads_the_other(
    deployment: Deployment,
) -> None:
    # Given two API replicas, each with its own client, model and agent, and one session id,
    # When the SDK's Runner takes six turns alternating between the replicas,
    # Then each turn's model saw every earlier turn (whichever replica took it), get_items
    # returns the items exactly and in order, pop_item and limit are exact, and the worker
    # stores the history; clear_session deletes the session.
    set_tracing_disabled(True)
    models = [ScriptedModel(), ScriptedModel()]

    async def main() -> tuple[list[Any], list[Any], Any, list[Any]]:
        clients = [AsyncCheckpointClient.from_settings(deployment.settings) for _ in range(2)]
        try:
            sessions = [CheckpointSession("agents-1", c) for c in clients]
            agents = [Agent(name="helper", model=m) for m in models]
            for turn in range(6):
                r = turn % 2
                result = await Runner.run(agents[r], f"question {turn}", session=sessions[r])
                assert result.final_output == f"reply {turn // 2 + 1}"
            everything = await sessions[0].get_items()
            last_two = await sessions[1].get_items(limit=2)
            popped = await sessions[1].pop_item()
            after_pop = await sessions[0].get_items()
            return everything, last_two, popped, after_pop
        finally:
            for c in clients:
                await c.close()

    everything, last_two, popped, after_pop = asyncio.run(main())
    expected = [t for n in range(6) for t in (f"question {n}", f"reply {n // 2 + 1}")]
    assert _texts(everything) == expected
    assert everything[1]["role"] == "assistant" and everything[1]["type"] == "message"
    assert last_two == everything[-2:]
    assert popped == everything[-1]
    assert after_pop == everything[:-1]
    # the 6th turn's model (replica 1's third call) was given all five turns before it
    assert _texts(models[1].inputs[2]) == [*expected[:10], "question 5"]

    deployment.wait_drained()
    store = RedisStore.from_settings(deployment.settings)
    try:
        stored = store.load("agents-1")
        assert stored is not None and len(stored.conversation_history) == 11
        assert [m.content for m in stored.conversation_history] == expected[:-1]
    finally:
        store.close()

    async def clear() -> list[Any]:
        async with AsyncCheckpointClient.from_settings(deployment.settings) as client:
            session = CheckpointSession("agents-1", client, durable=True)
            await session.clear_session()
            return await session.get_items()

    assert asyncio.run(clear()) == []
