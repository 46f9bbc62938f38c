"""A vhost of our own on the machine's RabbitMQ, for the scale tests and the scaling bench."""

from __future__ import annotations

import shutil
import socket
import subprocess
import uuid
from dataclasses import dataclass, field

from tests.support.workers import QUEUE

RABBIT_HOST, RABBIT_PORT = "127.0.0.1", 5672


@dataclass
class RabbitVhost:
    """A vhost of our own on the machine's RabbitMQ, managed with ``rabbitmqctl``."""

    name: str = field(default_factory=lambda: f"cq-test-{uuid.uuid4().hex[:10]}")

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@{RABBIT_HOST}:{RABBIT_PORT}/{self.name}"

    def create(self) -> RabbitVhost:
        _rabbitmqctl("add_vhost", self.name)
        _rabbitmqctl("set_permissions", "-p", self.name, "guest", ".*", ".*", ".*")
        return self

    def delete(self) -> None:
        _rabbitmqctl("delete_vhost", self.name)

    def pending(self) -> int:
        """Ready plus unacknowledged messages of our queue (0 before it exists)."""
        return sum(self.counts())

    def counts(self) -> tuple[int, int]:
        """Our queue's ready and unacknowledged (held by a consumer) messages."""
        out = _rabbitmqctl(
            "list_queues",
            "-p",
            self.name,
            "-q",
            "--no-table-headers",
            "name",
            "messages_ready",
            "messages_unacknowledged",
        )
        for line in out.splitlines():
            name, ready, held = line.strip().split("\t")
            if name == QUEUE:
                return int(ready), int(held)
        return 0, 0


def _rabbitmqctl(*args: str) -> str:
    done = subprocess.run(
        ["rabbitmqctl", *args], check=True, capture_output=True, text=True, timeout=60
    )
    return done.stdout


def rabbitmq_available() -> bool:
    if shutil.which("rabbitmqctl") is None:
        return False
    try:
        with socket.create_connection((RABBIT_HOST, RABBIT_PORT), timeout=1):
            return True
    except OSError:
        return False
