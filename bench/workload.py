"""Realistic checkpoints for benchmarks: agent conversations that compress like real ones.

A run of ``"x"`` compresses ~1000:1 and would flatter zstd and the network alike. Real
sessions are prose, code and tool traces: here, words drawn from a Zipf-like distribution
over an English and programming vocabulary, with numbers, identifiers and JSON tool traces
mixed in, from a seeded RNG so every run stores the same bytes.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import orjson

from checkpointq.store import (
    Checkpoint,
    CheckpointMetadata,
    ConversationMessage,
    serialize_checkpoint,
)

_VOCABULARY = """
the of and to a in is it you that he was for on are with as I his they be at one have this
from or had by hot word but what some we can out other were all there when up use your how
said an each she which do their time if will way about many then them write would like so
these her long make thing see him two has look more day could go come did number sound no
most people my over know water than call first who may down side been now find any new work
part take get place made live where after back little only round man year came show every
good me give our under name very through just form sentence great think say help low line
differ turn cause much mean before move right boy old too same tell does set three want air
well also play small end put home read hand port large spell add even land here must big
high such follow act why ask men change went light kind off need house picture try us again
animal point mother world near build self earth father function return value error request
response session checkpoint agent model token prompt context message user assistant tool
call result query database index cache queue worker retry timeout latency throughput redis
python celery deploy config environment variable parameter argument string integer list
dict object class method module package import export test assert exception trace stack
frame buffer stream socket client server handler router endpoint payload schema version
field record table column row join filter sort group count sum average minimum maximum
"""
_WORDS = _VOCABULARY.split()

_WEIGHTS = [1.0 / (rank + 1) ** 0.9 for rank in range(len(_WORDS))]

_TOOLS = ("search_docs", "run_sql", "read_file", "http_get", "python_exec", "summarize")


def _sentence(rng: random.Random) -> str:
    words = rng.choices(_WORDS, _WEIGHTS, k=rng.randint(6, 22))
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 99_999)))
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}()")
    return " ".join(words).capitalize() + rng.choice(".?!.")


def _text(rng: random.Random, approx_chars: int) -> str:
    parts: list[str] = []
    size = 0
    while size < approx_chars:
        sentence = _sentence(rng)
        parts.append(sentence)
        size += len(sentence) + 1
    return " ".join(parts)


def _trace(rng: random.Random) -> str:
    # Tool traces are JSON-in-a-string in the Go original: ids, timings, short outputs.
    steps = [
        {
            "tool": rng.choice(_TOOLS),
            "id": f"call_{rng.getrandbits(64):016x}",
            "ms": rng.randint(3, 4000),
            "ok": rng.random() < 0.7,
            "out": _sentence(rng),
        }
        for _ in range(rng.randint(1, 3))
    ]
    return orjson.dumps(steps).decode()


def make_checkpoint(session_id: str, approx_json_bytes: int, seed: int = 0) -> Checkpoint:
    """A conversation whose Go-compatible JSON is about ``approx_json_bytes`` long.

    Messages grow with the target (about 1 KB each for small sessions, up to ~3.5 KB for
    200 KB ones, at most 60 of them) so the history cap of 100 never trims it.
    """
    rng = random.Random(f"{seed}:{session_id}:{approx_json_bytes}")
    messages = max(2, min(60, approx_json_bytes // 1000))
    per_message = max(40, approx_json_bytes // messages - 60)
    history: list[ConversationMessage] = []
    for i in range(messages):
        if i % 2 == 0:
            # Users write less than assistants answer.
            history.append(ConversationMessage(role="user", content=_text(rng, per_message // 3)))
        else:
            trace = _trace(rng) if rng.random() < 0.5 else ""
            body = _text(rng, max(20, per_message * 5 // 3 - len(trace)))
            history.append(ConversationMessage(role="assistant", content=body, trace_entries=trace))
    start = datetime(2026, 12, 2, 8, 30, tzinfo=UTC)
    checkpoint = Checkpoint(
        session_id=session_id,
        version=len(history) // 2,
        conversation_history=history,
        metadata=CheckpointMetadata(
            total_messages=len(history),
            total_tokens=approx_json_bytes // 4,
            total_cost_usd=f"{approx_json_bytes / 4 * 0.000002:.6f}",
            start_time=start,
            last_message_time=start + timedelta(minutes=len(history)),
        ),
        last_run_ref=f"run_{rng.getrandbits(48):012x}",
    )
    return checkpoint


def json_size(checkpoint: Checkpoint) -> int:
    """Bytes of the checkpoint's Go-compatible JSON (before compression)."""
    return len(serialize_checkpoint(checkpoint))
