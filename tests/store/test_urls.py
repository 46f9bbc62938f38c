"""The URL rules (store/urls.py): one spelling of a unix socket for everyone, passwords hidden."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from checkpointq.store.urls import (
    check_url,
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


#: What a password in a URL's authority can hold raw: anything but what ends the authority
#: (``/ ? #``) and line breaks (urlsplit and redis-py read ``p@ss w"rd`` as one password).
RAW_PASSWORDS = st.text(
    st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp"), blacklist_characters="/?#"),
    min_size=1,
)
#: What a query option holds raw: the same, less what ends an option or a word.
RAW_QUERY_PASSWORDS = st.text(
    st.characters(blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp"), blacklist_characters="/?#&"),
    min_size=1,
)


@given(password=RAW_PASSWORDS, encoded=st.booleans(), user=st.sampled_from(["", "app"]))
def test_redact_urls_hides_any_password_in_the_authority(
    password: str, encoded: bool, user: str
) -> None:
    written = quote(password, safe="") if encoded else password
    text = f"Error connecting to redis://{user}:{written}@cache:6379/0 (refused); retrying"

    shown = redact_urls(text)

    assert shown == f"Error connecting to redis://{user}:***@cache:6379/0 (refused); retrying"


@given(password=RAW_QUERY_PASSWORDS, encoded=st.booleans())
def test_redact_urls_hides_any_password_in_the_query(password: str, encoded: bool) -> None:
    written = quote(password, safe="") if encoded else password
    text = f"sentinel sentinel://s1:26379/0?sentinel_password={written} down"

    shown = redact_urls(text)

    assert shown == "sentinel sentinel://s1:26379/0?sentinel_password=*** down"


@given(password=RAW_PASSWORDS, second=st.booleans())
def test_redact_url_hides_any_password_of_one_url(password: str, second: bool) -> None:
    # A second URL after ";" (kombu's failover spelling) is redacted on its own
    url = f"redis://app:{password}@cache:6379/0" + (f";redis://:{password}@b" if second else "")

    shown = redact_url(url)

    assert shown == "redis://app:***@cache:6379/0" + (";redis://:***@b" if second else "")


def test_several_urls_on_a_line_each_lose_their_password_and_keep_their_host() -> None:
    text = "redis://:a;b c@h1:1 and sentinel://:p@ss'<@h2:2;sentinel://:c@h3:3 end"

    assert redact_urls(text) == (
        "redis://:***@h1:1 and sentinel://:***@h2:2;sentinel://:***@h3:3 end"
    )


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("redis://h:abc/0", "port 'abc'"),
        ("redis://:pw@h:70000/0", "port '70000'"),
        ("rediss://h:6379/db1", "database 'db1'"),
        ("redis://h:6379/0?health_check_interval=often", "'health_check_interval'"),
        ("unix:///run/r.sock?db=one", "'db'"),
        ("redis://[::1/0", "IPv6"),
        ("sentinel://h1:26379;sentinel://h2:x", "port 'x'"),
        ("sentinel://h1:26379/x", "database 'x'"),
        ("redis+cluster://h1:7000,h2:seven", "cluster seed 'h2:seven'"),
        ("amqps://u:pw@mq:ssl//", "port 'ssl'"),
    ],
)
def test_a_malformed_url_is_one_line_naming_what_is_wrong(url: str, named: str) -> None:
    with pytest.raises(ValueError, match="is malformed") as raised:
        check_url(url)

    message = str(raised.value)
    assert named in message and "\n" not in message
    assert ":pw@" not in message


@pytest.mark.parametrize(
    "url",
    [
        "redis://:p%40ss@h:6379/0?socket_timeout=5",
        "rediss://h",
        "unix:///run/r.sock?db=2",
        "redis+socket:///run/r.sock",
        "sentinel://:pw@h1:26379/1;sentinel://h2",
        "redis+cluster://h1:7000,[::1]:7001/0",
        "redis://h:6379/0?cluster=true",
        "amqp://guest:guest@mq:5672//",
    ],
)
def test_a_wellformed_url_passes_the_check_unchanged(url: str) -> None:
    assert check_url(url) == url
