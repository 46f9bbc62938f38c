"""Redis-specific behaviour: connection URLs, unavailability, index hygiene, atomicity."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from checkpointq.store import RedisStore, StoreOptions, StoreUnavailable
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer, free_port, wait_until


def test_password_url_connects_and_is_never_shown() -> None:
    server = RedisServer(password="hunter2-secret").start()
    try:
        store = RedisStore.from_url(server.url)
        store.save(make_checkpoint("s1"), seq=1)
        assert store.load("s1") is not None
        assert "hunter2-secret" not in repr(store)
        assert "***" in repr(store)
    finally:
        server.cleanup()


def test_unix_socket_url_connects(tmp_path: Path) -> None:
    sock = f"{tmp_path}/redis.sock"
    server = RedisServer(extra_args=["--unixsocket", sock, "--unixsocketperm", "700"]).start()
    try:
        store = RedisStore.from_url(f"unix://{sock}?db=0")
        store.save(make_checkpoint("s1"), seq=1)
        assert store.list() == ["s1"]
    finally:
        server.cleanup()


def test_unreachable_redis_raises_store_unavailable_without_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    store = RedisStore.from_url(f"redis://:pa55word@127.0.0.1:{free_port()}/0", socket_timeout=1)
    calls: list[Callable[[], object]] = [
        lambda: store.save(make_checkpoint("s1"), seq=1),
        lambda: store.load("s1"),
        lambda: store.delete("s1", seq=1),
        lambda: store.refresh("s1"),
        lambda: store.list(),
        lambda: store.expire_stale(),
        lambda: store.fence("s1"),
    ]
    for call in calls:
        with pytest.raises(StoreUnavailable) as caught:
            call()
        assert "pa55word" not in str(caught.value)
    assert "pa55word" not in caplog.text


def test_store_recovers_when_redis_comes_back() -> None:
    server = RedisServer(appendonly=True).start()
    try:
        store = RedisStore.from_url(server.url, socket_timeout=1)
        store.save(make_checkpoint("s1", version=1), seq=1)
        server.stop()
        with pytest.raises(StoreUnavailable):
            store.save(make_checkpoint("s1", version=2), seq=2)
        server.start()
        wait_until(
            lambda: store.save(make_checkpoint("s1", version=3), seq=3).applied,
            timeout=10,
            message="save after restart",
        )
        loaded = store.load("s1")
        assert loaded is not None and loaded.version == 3
    finally:
        server.cleanup()


def test_index_keeps_no_entry_for_sessions_that_expired_on_their_own(
    real_redis: redis.Redis,
) -> None:
    store = RedisStore(real_redis, options=StoreOptions(ttl_seconds=0.5))
    for i in range(3):
        store.save(make_checkpoint(f"s{i}"), seq=1)
    values = [store.keys.data(f"s{i}") for i in range(3)]
    wait_until(
        lambda: real_redis.exists(*values) == 0, timeout=5, message="Redis to expire the values"
    )
    assert store.list() == []
    assert real_redis.zcard(store.keys.index()) == 3
    # (each deadline passes with its own value's expiry, a few ms apart: sweep until all have)
    expired: list[str] = []

    def swept_all() -> bool:
        expired.extend(store.expire_stale())
        return len(expired) >= 3

    wait_until(swept_all, timeout=5, message="the sweep to expire all three")
    assert sorted(expired) == ["s0", "s1", "s2"]
    assert real_redis.zcard(store.keys.index()) == 0
    assert store.refresh("s0") is False


def test_fence_outlives_the_value_by_the_tombstone_ttl(real_redis: redis.Redis) -> None:
    store = RedisStore(real_redis, options=StoreOptions(ttl_seconds=100, tombstone_ttl_seconds=50))
    store.save(make_checkpoint("s1"), seq=1)
    value_ttl = real_redis.pttl(store.keys.data("s1"))
    fence_ttl = real_redis.pttl(store.keys.fence("s1"))
    assert 99_000 < value_ttl <= 100_000
    assert 149_000 < fence_ttl <= 150_000
    store.delete("s1", seq=2)
    assert 49_000 < real_redis.pttl(store.keys.fence("s1")) <= 50_000


def test_refresh_moves_value_ttl_and_index_deadline_together(real_redis: redis.Redis) -> None:
    short = RedisStore(real_redis, options=StoreOptions(ttl_seconds=100))
    long = RedisStore(real_redis, options=StoreOptions(ttl_seconds=1000))
    short.save(make_checkpoint("s1"), seq=1)
    assert long.refresh("s1")
    assert 999_000 < real_redis.pttl(long.keys.data("s1")) <= 1_000_000
    deadline = real_redis.zscore(long.keys.index(), "s1")
    assert deadline is not None
    assert deadline > short.clock() * 1000 + 999_000


def test_tls_url_connects_and_verifies_the_server(tmp_path: Path) -> None:
    # Given a redis-server speaking TLS only, with a certificate made for this test
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    port = free_port()
    tls = ["--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
           "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]  # fmt: skip
    process = subprocess.Popen(
        ["redis-server", "--port", "0", "--save", "", "--dir", str(tmp_path), *tls],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # When the store connects with a rediss:// URL that trusts that certificate
        store = RedisStore.from_url(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}")
        wait_until(lambda: store.save(make_checkpoint("s1"), seq=1).applied, timeout=10,
                   message="a save over TLS")  # fmt: skip
        # Then it reads and writes as over plain TCP ...
        assert store.load("s1") is not None
        # ... and a client that does not trust the certificate is refused
        untrusting = RedisStore.from_url(f"rediss://127.0.0.1:{port}/0", socket_timeout=2)
        with pytest.raises(StoreUnavailable):
            untrusting.load("s1")
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_the_layout_of_a_url_is_the_one_its_store_uses(redis_server: RedisServer) -> None:
    from checkpointq.store.keys import ClusterKeySpace
    from checkpointq.store.redis import layout

    store = RedisStore.from_url(redis_server.url, prefix="lay")
    try:
        assert layout(redis_server.url, "lay") == store.keys
    finally:
        store.close()
    assert layout("redis+cluster://127.0.0.1:1", "lay") == ClusterKeySpace("lay")
    assert layout("redis://127.0.0.1:1/0?cluster=true", "lay") == ClusterKeySpace("lay")
