"""Deployments sharing one store Redis under different key prefixes never reach each other."""

from __future__ import annotations

import pytest
import redis
from hypothesis import assume, given
from hypothesis import strategies as st

from checkpointq.store.keys import ClusterKeySpace, KeySpace, check_prefix
from checkpointq.store.redis import RedisStore
from checkpointq.worker.settings import InvalidSettings, Settings
from tests.support.checkpoints import make_checkpoint
from tests.support.servers import RedisServer

#: Accepted prefixes, built from the characters that come closest to nesting (``.cq``).
prefixes = st.text(alphabet="ab.cq-", min_size=1, max_size=8).filter(
    lambda p: not p.endswith(".cq")
)


def _families(keys: KeySpace) -> list[str]:
    """What every key of a deployment starts with: data, then bookkeeping."""
    return [keys.data(""), keys.dead_letters().rsplit(":", 1)[0] + ":"]


@pytest.mark.parametrize("nested", ["agentorca-session:b", "agentorca-session.cq", "a:b.cq"])
def test_a_prefix_that_could_nest_is_refused_at_start_up(nested: str) -> None:
    with pytest.raises(ValueError, match=r"may not contain ':' nor end in '\.cq'"):
        KeySpace(nested)
    with pytest.raises(ValueError, match="may not contain"):
        ClusterKeySpace(nested)
    with pytest.raises(InvalidSettings, match="may not contain"):
        Settings(key_prefix=nested)


@given(prefixes, prefixes)
def test_no_key_family_of_one_valid_prefix_starts_another(a: str, b: str) -> None:
    # Given two different prefixes that the worker accepts
    assume(a != b)
    check_prefix(a), check_prefix(b)
    # Then no key of one (whatever session id it carries) can be a key of the other: none of
    # A's key families is a prefix of B's, nor the other way round
    for mine in _families(KeySpace(a)):
        for theirs in _families(KeySpace(b)):
            assert not mine.startswith(theirs) and not theirs.startswith(mine), (mine, theirs)


def test_hostile_session_ids_of_one_deployment_leave_anothers_keys_alone(
    real_redis: redis.Redis, redis_server: RedisServer
) -> None:
    # Given deployment B (prefix agentorca-session-b) with two sessions, sharing a Redis
    # with deployment A (the Go default prefix)
    url = redis_server.url
    a = RedisStore.from_url(url)
    b = RedisStore.from_url(url, prefix="agentorca-session-b")
    b.save(make_checkpoint("s0", version=1), seq=10)
    b.save(make_checkpoint("s2", version=2), seq=20)
    before = {key: real_redis.dump(key) for key in real_redis.keys("agentorca-session-b*")}
    # When A saves and deletes sessions whose ids spell B's keys in every way nesting would
    hostile = [
        "-b:s0",
        "-b.cq:fence:s0",
        "-b.cq:deadlines",
        "-b.cq:dead-letters",
        "b.cq:fence:s0",
        "b:s2",
    ]
    for i, sid in enumerate(hostile):
        a.save(make_checkpoint(sid, version=i), seq=100 + i)
        a.delete(sid, seq=200 + i)
        a.save(make_checkpoint(sid, version=i), seq=300 + i)
    # Then every key of B is byte for byte as it was, B still lists and loads its sessions,
    # and A sees only its own
    after = {key: real_redis.dump(key) for key in real_redis.keys("agentorca-session-b*")}
    assert after == before
    assert sorted(b.list()) == ["s0", "s2"]
    loaded = b.load("s2")
    assert loaded is not None and loaded.version == 2
    assert sorted(a.list()) == sorted(hostile)
    theirs_or_mine = a.load("b:s2")
    assert theirs_or_mine is not None and theirs_or_mine.version == hostile.index("b:s2")
    a.close()
    b.close()
