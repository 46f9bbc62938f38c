"""Fixtures of the fault suite: a fresh broker and store Redis, and a deployment, per test.

``pytest tests/faults --long`` (or ``CHECKPOINTQ_FAULTS_LONG=1 pytest tests/faults``) runs
the larger loads and longer outages; the default is the quick mode run by ``./scripts/test``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.faults.harness import Deployment, Scale, current_scale
from tests.support.servers import RedisServer


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="fault suite: larger loads and longer outages (same as CHECKPOINTQ_FAULTS_LONG=1)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--long", default=False):
        os.environ["CHECKPOINTQ_FAULTS_LONG"] = "1"


@pytest.fixture
def scale() -> Scale:
    return current_scale()


@pytest.fixture
def broker() -> Iterator[RedisServer]:
    """The broker Redis, AOF on with fsync always (the production recommendation)."""
    server = RedisServer(appendonly=True).start()
    yield server
    server.cleanup()


@pytest.fixture
def store_server() -> Iterator[RedisServer]:
    """The store Redis, apart from the broker so that each can fail on its own; AOF on so
    that a restart keeps the data."""
    server = RedisServer(appendonly=True).start()
    yield server
    server.cleanup()


@pytest.fixture
def deployment(broker: RedisServer, store_server: RedisServer) -> Iterator[Deployment]:
    """No process yet: each scenario starts the workers and beats it needs."""
    dep = Deployment(broker, store_server)
    yield dep
    dep.cleanup()
