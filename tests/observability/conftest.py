"""Shared by the tests where Celery's own tools watch a real default worker."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.servers import RedisServer
from tests.support.workers import TEST_WORKER_SETTINGS

#: ``checkpointq`` as installed beside this Python (what users run).
CHECKPOINTQ = str(Path(sys.executable).with_name("checkpointq"))


@pytest.fixture(scope="module")
def worker_values(broker_server: RedisServer, store_server: RedisServer) -> dict[str, object]:
    """The test worker's settings on this module's broker and store."""
    return {**TEST_WORKER_SETTINGS, "broker_url": broker_server.url, "store_url": store_server.url}
