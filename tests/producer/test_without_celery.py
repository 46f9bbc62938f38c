"""The producer needs Celery only for brokers it does not write to itself, and says so."""

from __future__ import annotations

import sys

import pytest

from checkpointq.store.memory import InMemoryStore
from checkpointq.tasks.producer.client import CheckpointClient


def test_a_producer_on_another_broker_without_celery_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given no Celery importable (a base install) and a broker only Celery publishes to
    monkeypatch.setitem(sys.modules, "celery", None)
    # Then making the client says what to install
    with pytest.raises(ImportError, match=r"pip install 'checkpointq\[worker\]'"):
        CheckpointClient("amqp://guest@127.0.0.1:5672//", InMemoryStore())
