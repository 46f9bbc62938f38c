"""The embedded Redis: unix socket only, AOF, one owner per data dir, nothing left behind."""

from __future__ import annotations

import fcntl
import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis

from checkpointq.store import RedisStore
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.worker.app import celery_config
from checkpointq.worker.embedded import EmbeddedRedis, EmbeddedRedisError, pid_of
from checkpointq.worker.settings import Settings
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import wait_until


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def embedded(tmp_path: Path) -> EmbeddedRedis:
    return EmbeddedRedis(tmp_path / "data")


def test_it_serves_a_unix_socket_only_with_aof_and_noeviction(embedded: EmbeddedRedis) -> None:
    with embedded.serving() as endpoint:
        client = redis.Redis.from_url(endpoint.url, decode_responses=True)
        config = client.config_get("*")
        client.close()

    assert config["port"] == "0"
    assert config["appendonly"] == "yes"
    assert config["appendfsync"] == "everysec"
    assert config["maxmemory-policy"] == "noeviction"
    assert endpoint.url == f"unix://{embedded.socket}"


def test_stopping_removes_the_socket_and_the_data_survives_a_restart(
    embedded: EmbeddedRedis,
) -> None:
    # Given a key written to a running server
    with embedded.serving() as endpoint:
        server_pid = embedded.pid
        assert server_pid is not None
        client = redis.Redis.from_url(endpoint.url)
        client.set("kept", "yes")
        client.close()

    # Then stopping leaves no process and no socket behind
    assert not alive(server_pid)
    assert not embedded.socket.exists()

    # And the AOF brings the key back on the next start
    with embedded.serving() as endpoint:
        client = redis.Redis.from_url(endpoint.url)
        assert client.get("kept") == b"yes"
        client.close()


def test_other_processes_find_the_server_only_while_its_owner_runs(
    embedded: EmbeddedRedis,
) -> None:
    other = EmbeddedRedis(embedded.data_dir)
    assert other.running() is None
    with embedded.serving() as endpoint:
        assert other.running() == endpoint
    assert other.running() is None


def test_a_second_owner_of_the_same_data_dir_is_refused(embedded: EmbeddedRedis) -> None:
    with embedded.serving():
        with pytest.raises(EmbeddedRedisError, match="already running"):
            EmbeddedRedis(embedded.data_dir).start()
        # ... and its failed attempt did not disturb the owner's socket
        assert embedded.socket.exists()


def test_a_probe_asking_at_that_instant_does_not_refuse_the_owner(
    embedded: EmbeddedRedis,
) -> None:
    # Given a command run in the same directory (`stats` polling for `up` to serve) that
    # holds the lock shared while it asks running(), slowed down as a loaded machine does
    embedded.data_dir.mkdir(parents=True)
    probe = embedded.lockfile.open("ab")
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
    release = threading.Timer(0.3, probe.close)  # closing releases the flock
    release.start()
    try:
        # When `up` starts at that moment
        with embedded.serving() as endpoint:
            # Then it waits out the probe and serves; it is not "already running"
            assert EmbeddedRedis(embedded.data_dir).running() == endpoint
    finally:
        release.cancel()
        probe.close()


def test_a_stale_socket_and_pid_file_from_a_killed_run_are_cleared(
    embedded: EmbeddedRedis,
) -> None:
    # Given a socket file nobody listens on and a pid file, as a killed run leaves them
    embedded.data_dir.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(embedded.socket))
    stale.close()
    embedded.pidfile.write_text("999999\n")

    # When started, it serves anyway
    with embedded.serving() as endpoint:
        client = redis.Redis.from_url(endpoint.url)
        assert client.ping()
        client.close()
        assert pid_of(embedded.data_dir) == embedded.pid


def test_killing_the_owner_takes_its_redis_down(embedded: EmbeddedRedis) -> None:
    # Given an owner process holding a started server
    owner = subprocess.Popen(
        [
            sys.executable, "-c",
            "import signal, sys; from pathlib import Path; "
            "from checkpointq.worker.embedded import EmbeddedRedis; "
            f"e = EmbeddedRedis(Path({str(embedded.data_dir)!r})); e.start(); "
            "print(e.pid, flush=True); signal.pause()",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert owner.stdout is not None
    server_pid = int(owner.stdout.readline())

    # When the owner dies without any chance to clean up
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=10)
    owner.stdout.close()

    # Then its redis-server follows it, and the next owner starts cleanly
    wait_until(lambda: not alive(server_pid), timeout=15, message="orphaned redis-server exit")
    with embedded.serving():
        pass


def test_a_data_dir_too_deep_for_a_unix_socket_is_refused_with_advice(tmp_path: Path) -> None:
    deep = EmbeddedRedis(tmp_path / ("d" * 120))
    with pytest.raises(EmbeddedRedisError, match="CHECKPOINTQ_DATA_DIR"):
        deep.start()


def test_settings_find_a_running_embedded_redis_and_its_url_serves_store_and_broker(
    embedded: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given no broker URL configured, and the data dir of a running `up`
    monkeypatch.delenv("CHECKPOINTQ_BROKER_URL", raising=False)
    monkeypatch.setenv("CHECKPOINTQ_DATA_DIR", str(embedded.data_dir))
    assert Settings().broker_url is None

    with embedded.serving() as endpoint:
        # When settings are read, as a Python producer reads them
        settings = Settings()

        # Then they name the embedded server, in the one spelling every component takes
        assert settings.broker_url == f"unix://{embedded.socket}" == endpoint.url
        assert settings.found_embedded
        store = RedisStore.from_settings(settings)
        store.save(make_checkpoint("found"))
        assert store.load("found") is not None
        store.close()
        with CheckpointClient.from_settings(settings) as client:
            handle = client.save(make_checkpoint("queued"))
        assert handle.session_id == "queued"
        assert celery_config(settings)["broker_url"] == f"redis+socket://{embedded.socket}"

    # And once it stops, nothing is found again
    assert Settings().broker_url is None


def test_up_says_it_is_ready_as_one_json_object_with_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from checkpointq.worker.cli import _ready_block

    settings = Settings(broker_url=f"unix://{tmp_path}/redis.sock", data_dir=tmp_path)
    _ready_block(settings, embedded=True, as_json=True)

    (line,) = capsys.readouterr().err.splitlines()
    assert json.loads(line) == {
        "event": "ready",
        "data_dir": str(tmp_path.resolve()),
        "broker_url": f"unix://{tmp_path}/redis.sock",
        # (no store URL set: the broker's Redis is the store too, and says so)
        "store_url": f"unix://{tmp_path}/redis.sock",
        "queue": "checkpoints",
    }
