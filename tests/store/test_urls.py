"""The URL rules (store/urls.py): one spelling of a unix socket for everyone, passwords hidden."""

from __future__ import annotations

import pytest

from checkpointq.store.urls import (
    cluster_seeds,
    is_redis_url,
    kombu_url,
    parse_sentinel_url,
    redact_url,
    redact_urls,
    redis_py_url,
    scheme_of,
)


@pytest.mark.parametrize(
    ("url", "redis_py", "kombu"),
    [
        ("unix:///run/r.sock", "unix:///run/r.sock", "redis+socket:///run/r.sock"),
        ("redis+socket:///run/r.sock", "unix:///run/r.sock", "redis+socket:///run/r.sock"),
        ("socket:///run/r.sock", "unix:///run/r.sock", "socket:///run/r.sock"),
        ("redis://h:6379/0", "redis://h:6379/0", "redis://h:6379/0"),
        ("amqp://guest@h//", "amqp://guest@h//", "amqp://guest@h//"),
    ],
)
def test_a_unix_socket_is_spelled_for_each_library_and_other_urls_pass_through(
    url: str, redis_py: str, kombu: str
) -> None:
    assert redis_py_url(url) == redis_py
    assert kombu_url(url) == kombu


def test_schemes_are_read_from_the_first_of_several_urls() -> None:
    assert scheme_of("Sentinel://a:26379;sentinel://b:26379") == "sentinel"
    assert is_redis_url("unix:///run/r.sock")
    assert is_redis_url("rediss://h:6380")
    assert not is_redis_url("sentinel://a:26379")
    assert not is_redis_url("http://h")


def test_every_url_in_a_text_loses_its_password() -> None:
    text = "broker redis://:s3cret@h:6379/0 failed; retry amqp://u:pw@mq// and unix:///r.sock"
    shown = redact_urls(text)
    assert "s3cret" not in shown and ":pw@" not in shown
    assert "redis://:***@h:6379/0" in shown
    assert "amqp://u:***@mq//" in shown
    assert "unix:///r.sock" in shown
    assert redact_url("redis://h:6379/0?password=x") == "redis://h:6379/0?password=***"


def test_a_sentinel_url_gives_every_sentinel_and_the_masters_credentials() -> None:
    parsed = parse_sentinel_url("sentinels://:p%40ss@h1:26380/2;sentinel://h2")

    assert parsed.sentinels == [("h1", 26380), ("h2", 26379)]
    assert parsed.password == "p@ss" and parsed.username is None
    assert parsed.db == 2 and parsed.ssl


def test_a_cluster_url_gives_the_first_seeds_plain_url_and_every_seed() -> None:
    plain, seeds = cluster_seeds("rediss+cluster://:pw@h1:7000,[::1]:7001/0?ssl_cert_reqs=none")

    assert plain == "rediss://:pw@h1:7000/0?ssl_cert_reqs=none"
    assert seeds == [("h1", 7000), ("::1", 7001)]
    with pytest.raises(ValueError, match="host:port"):
        cluster_seeds("redis+cluster://h1")
