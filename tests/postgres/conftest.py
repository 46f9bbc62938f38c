"""A real Celery worker on a private broker Redis, writing to a private PostgreSQL server.

The PostgreSQL server is the run's (``postgres_server``, tests/conftest.py) unless a test
module asks for one of its own (the fault tests stop, fill and promote theirs). Each module's
deployment writes to a schema of its own; ``live`` empties it before each test.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
import redis

from checkpointq.store.keys import KeySpace
from checkpointq.store.postgres import PostgresStore
from checkpointq.tasks.dead_letters import DeadLetters
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.worker.settings import Settings
from tests.support.celery_processes import CeleryProcess, checkpointq_env
from tests.support.postgres import PostgresServer
from tests.support.servers import RedisServer
from tests.support.workers import TEST_WORKER_SETTINGS, wait_redis_queue_drained

_schemas = itertools.count()


@dataclass
class PgDeployment:
    """The broker Redis, the PostgreSQL server, a running worker, and clients of each."""

    broker: RedisServer
    database: PostgresServer
    worker: CeleryProcess
    settings: Settings

    @property
    def schema(self) -> str:
        return self.settings.pg_schema

    def broker_client(self) -> redis.Redis:
        return self.broker.client()

    def sql(self) -> psycopg.Connection[tuple[object, ...]]:
        """A connection to the database (autocommit), to look behind the store."""
        return psycopg.connect(self.database.url, autocommit=True)

    def store(self) -> PostgresStore:
        return PostgresStore(self.database.url, schema=self.schema)

    def checkpoint_client(self) -> CheckpointClient:
        return CheckpointClient.from_settings(self.settings)

    def dead_letters(self) -> DeadLetters:
        return DeadLetters(self.broker_client(), KeySpace(self.settings.key_prefix))

    def wait_drained(self, timeout: float = 20.0) -> None:
        wait_redis_queue_drained(self.broker_client, timeout)


@pytest.fixture(scope="module")
def pg_settings() -> dict[str, object]:
    """Settings a test module gives its worker beside the defaults (override it)."""
    return {}


@pytest.fixture(scope="module")
def pg_database(postgres_server: PostgresServer) -> PostgresServer:
    """The server the module's deployment writes to (override for a private one)."""
    return postgres_server


@pytest.fixture(scope="module")
def pg_deployment(
    broker_server: RedisServer, pg_database: PostgresServer, pg_settings: dict[str, object]
) -> Iterator[PgDeployment]:
    values = {
        **TEST_WORKER_SETTINGS,
        "broker_url": broker_server.url,
        "store_url": pg_database.url,
        "pg_schema": f"pg{next(_schemas)}",
        **pg_settings,  # a store URL through a pooler, say
    }
    worker = CeleryProcess("worker", checkpointq_env(**values)).start()
    try:
        yield PgDeployment(broker_server, pg_database, worker, Settings(**values))  # type: ignore[arg-type]
    finally:
        code = worker.stop()
        print(f"--- worker log (exit {code}) ---\n{worker.log()}")


@pytest.fixture
def pg_live(pg_deployment: PgDeployment) -> Iterator[PgDeployment]:
    """The deployment with an empty store and no dead letters; the worker's log lines of the test
    are printed after it (pytest shows them when it fails)."""
    with pg_deployment.sql() as conn:
        conn.execute(f"TRUNCATE {pg_deployment.schema}.sessions")
    # The broker keeps the worker's heartbeat: only the streams tests read are emptied.
    keys = KeySpace(pg_deployment.settings.key_prefix)
    broker = pg_deployment.broker_client()
    broker.delete(keys.dead_letters(), keys.events())
    broker.close()
    mark = len(pg_deployment.worker.log())
    yield pg_deployment
    print(f"--- worker log during the test ---\n{pg_deployment.worker.log()[mark:]}")
