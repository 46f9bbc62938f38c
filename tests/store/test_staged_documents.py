"""A staged save's JSON is stored as its producer serialised it once the worker validated it
(``CheckpointStore.decode_staged``, ``tasks/staged.save_op``): compressed (and sealed) as it
is, not serialised again, when it is canonical JSON; anything else is serialised afresh."""

from __future__ import annotations

import redis

from checkpointq.store import RedisStore
from checkpointq.store.base import SaveResult
from checkpointq.store.serde import checkpoint_to_wire, dumps_go, serialize_checkpoint
from checkpointq.tasks.staged import StagedSave, save_op
from tests.support.checkpoints import make_checkpoint


def _stored_json(store: RedisStore, client: redis.Redis, session_id: str) -> bytes:
    raw = client.get(store.keys.data(session_id))
    assert isinstance(raw, bytes)
    return store.codec.decode(store.unseal(session_id, raw))


def test_a_canonical_staged_document_is_stored_as_its_producer_wrote_it(
    real_redis: redis.Redis,
) -> None:
    # Given a store, and a producer's canonical JSON of a checkpoint with its keys in
    # another order than ours (valid: Go and we read keys in any order)
    store = RedisStore(real_redis, prefix="sd")
    checkpoint = make_checkpoint("sd-1", messages=3)
    document = dumps_go(dict(reversed(checkpoint_to_wire(checkpoint).items())))
    assert document != serialize_checkpoint(checkpoint)
    # When the worker applies it as a staged save
    op = save_op(store, StagedSave("sd-1", 10, "req-1"), document, 1 << 20)
    (result,) = store.apply_batch([op])
    # Then the store holds those very bytes, compressed, and they load as the checkpoint
    assert isinstance(result, SaveResult) and result.applied
    assert _stored_json(store, real_redis, "sd-1") == document
    assert store.load("sd-1") == checkpoint


def test_a_staged_document_that_is_not_canonical_is_serialised_afresh(
    real_redis: redis.Redis,
) -> None:
    # Given a producer's valid JSON with a space after each colon (not what Go writes)
    store = RedisStore(real_redis, prefix="sd")
    checkpoint = make_checkpoint("sd-2", messages=3)
    document = serialize_checkpoint(checkpoint).replace(b'":', b'": ')
    # When the worker applies it
    op = save_op(store, StagedSave("sd-2", 10, "req-2"), document, 1 << 20)
    (result,) = store.apply_batch([op])
    # Then the store holds the checkpoint as we serialise it
    assert isinstance(result, SaveResult) and result.applied
    assert _stored_json(store, real_redis, "sd-2") == serialize_checkpoint(checkpoint)
