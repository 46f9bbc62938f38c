"""Encryption at rest in the stores (store/encryption.py): values sealed per session, bound
to their session and key id, clear values still read, rotation by a new first key.

Run on the in-memory store, a real redis-server and a private PostgreSQL server.
"""

from __future__ import annotations

import base64
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from checkpointq.store import CheckpointStore, StoreOptions
from checkpointq.store.base import EncodedCheckpoint, SaveOp
from checkpointq.store.codec import ZSTD_MAGIC
from checkpointq.store.encryption import (
    MAGIC,
    EncryptionError,
    Keyring,
    MissingEncryptionKey,
    is_sealed,
    sealed_key_id,
)
from checkpointq.store.errors import CorruptCheckpoint
from checkpointq.store.postgres import PostgresStore
from checkpointq.store.redis import RedisStore
from checkpointq.store.rekey import rekey
from checkpointq.store.serde import serialize_checkpoint
from checkpointq.worker.connections import InvalidSettings, load_settings
from checkpointq.worker.settings import Settings
from tests.store.conftest import StoreEnv
from tests.support.celery_processes import checkpointq_env
from tests.support.checkpoints import make_checkpoint, secret_checkpoint
from tests.support.servers import RedisServer

SECRET = "the-patient-asked-about-lisinopril"
#: Fixed test keys (parametrized test ids hold them: the same in every xdist worker).
KEY_A = base64.urlsafe_b64encode(bytes(range(32))).decode()
KEY_B = base64.urlsafe_b64encode(bytes(range(100, 132))).decode()


def keyring(spec: str = f"a:{KEY_A}") -> Keyring:
    return Keyring.parse(spec)


def raw_value(env: StoreEnv, store: CheckpointStore, session_id: str) -> bytes:
    if isinstance(store, PostgresStore):
        row = env.raw.execute(
            f"SELECT value FROM {store.schema}.sessions WHERE session_id = %s",
            (session_id.encode(),),
        ).fetchone()
        return bytes(row[0])
    if isinstance(store, RedisStore):
        value = store.client.get(store.keys.data(session_id))
        assert value is not None
        return bytes(value)
    return bytes(store._entries[session_id].value)  # type: ignore[attr-defined]


# -- the keyring -------------------------------------------------------------------------


def test_a_sealed_value_opens_for_its_session_only_and_not_when_altered() -> None:
    ring = keyring(f"a:{KEY_A},b:{KEY_B}")
    sealed = ring.seal("s1", b"zstd bytes")
    assert is_sealed(sealed) and sealed.startswith(MAGIC) and sealed_key_id(sealed) == "a"
    assert ring.open("s1", sealed) == b"zstd bytes"
    # a fresh nonce each time: the same value never seals to the same bytes
    assert ring.seal("s1", b"zstd bytes") != sealed
    with pytest.raises(ValueError, match="another session"):
        ring.open("s2", sealed)
    flipped = sealed[:-1] + bytes([sealed[-1] ^ 1])
    with pytest.raises(ValueError, match="does not authenticate"):
        ring.open("s1", flipped)
    # the key id is authenticated too: relabelled under another key of the ring, it fails
    relabelled = sealed.replace(b"\x01a", b"\x01b", 1)
    with pytest.raises(ValueError, match="does not authenticate"):
        ring.open("s1", relabelled)
    # survives pickling (pool processes get the store's options), repr shows ids only
    assert pickle.loads(pickle.dumps(ring)).open("s1", sealed) == b"zstd bytes"
    assert KEY_A not in repr(ring) and repr(ring) == "Keyring(primary='a', ids=['a', 'b'])"


def test_a_value_under_a_key_not_held_names_the_key_id() -> None:
    sealed = keyring(f"old:{KEY_A}").seal("s1", b"x")
    with pytest.raises(MissingEncryptionKey, match="key id 'old'"):
        keyring(f"new:{KEY_B}").open("s1", sealed)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("a", "pair 1 is not of the form id:key"),
        ("a:not*base64", "key 'a' is not URL-safe base64"),
        ("a:" + KEY_A[:20], "key 'a' is 15 bytes"),
        (f"a:{KEY_A},a:{KEY_B}", "key id 'a' is given twice"),
        (f"bad/id:{KEY_A}", "key id 'bad/id' must be 1-32 letters"),
        ("", "no keys given"),
    ],
)
def test_a_malformed_keyring_is_refused_without_showing_a_key(spec: str, words: str) -> None:
    with pytest.raises(EncryptionError, match="^" + re.escape(words)) as refused:
        Keyring.parse(spec)
    for key in (KEY_A, KEY_B, KEY_A[:20]):
        assert key not in str(refused.value)


def test_settings_refuse_a_malformed_key_in_one_line_and_never_show_keys(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CHECKPOINTQ_ENCRYPTION_KEYS", f"a:{KEY_A[:-4]}")
    with pytest.raises(InvalidSettings) as refused:
        load_settings()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("invalid settings: CHECKPOINTQ_ENCRYPTION_KEYS: key 'a' is 30 bytes")
    assert KEY_A[:-4] not in message
    # And the settings' own error, as `celery -A checkpointq.worker.app` prints it, shows
    # no input either (Settings() raises InvalidSettings itself since issue 40, without
    # pydantic's error chained: its traceback cannot show the input)
    with pytest.raises(InvalidSettings) as raw:
        Settings()
    assert KEY_A[:-4] not in str(raw.value)
    assert raw.value.__cause__ is None and raw.value.__suppress_context__
    # pydantic's own error, behind it, hides the input too (hide_input_in_errors)
    with pytest.raises(ValidationError) as pydantic_raw:
        Settings.model_validate({"encryption_keys": f"a:{KEY_A[:-4]}"})
    assert KEY_A[:-4] not in str(pydantic_raw.value)
    # A good one: the store options carry the keyring, describe() shows the ids alone
    monkeypatch.setenv("CHECKPOINTQ_ENCRYPTION_KEYS", f"new:{KEY_B},old:{KEY_A}")
    settings = load_settings()
    ring = settings.store_options().encryption
    assert ring is not None and ring.key_ids == ["new", "old"]
    shown = repr(settings.describe()) + repr(settings)
    assert KEY_A not in shown and KEY_B not in shown and "'new', 'old'" in shown
    # From a file, one pair a line; both at once is refused
    path = tmp_path / "keys"
    path.write_text(f"f1:{KEY_A}\nf0:{KEY_B}\n")
    monkeypatch.setenv("CHECKPOINTQ_ENCRYPTION_KEYS_FILE", str(path))
    with pytest.raises(InvalidSettings, match="not both"):
        load_settings()
    monkeypatch.delenv("CHECKPOINTQ_ENCRYPTION_KEYS")
    keys = load_settings().store_options().encryption
    assert keys is not None and keys.key_ids == ["f1", "f0"]


def test_keygen_prints_a_pair_the_settings_accept(monkeypatch: pytest.MonkeyPatch) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "checkpointq.worker.cli", "keygen", "--id", "k1"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out.startswith("k1:") and len(out.splitlines()) == 1
    monkeypatch.setenv("CHECKPOINTQ_ENCRYPTION_KEYS", out)
    keys = load_settings().store_options().encryption
    assert keys is not None and keys.primary == "k1"


# -- the stores ----------------------------------------------------------------------------

STORES = ["memory", "redis", "postgres"]
#: Backends whose stores, made one after another, share their data.
SHARED = ["redis", "postgres"]


@pytest.mark.parametrize("store_env", STORES, indirect=True)
def test_an_encrypted_store_holds_no_byte_of_the_conversation(store_env: StoreEnv) -> None:
    store = store_env.store(encryption=keyring())
    cp = secret_checkpoint("enc-1", SECRET)
    result = store.save(cp)
    value = raw_value(store_env, store, "enc-1")
    assert is_sealed(value) and result.stored_bytes == len(value)
    assert SECRET.encode() not in value
    assert store.load("enc-1") == cp
    if isinstance(store, PostgresStore):
        # and the row's queryable copies hold nothing of it: the version alone stays
        row = store_env.raw.execute(
            f"SELECT version, last_run_ref, metadata FROM {store.schema}.sessions "
            "WHERE session_id = %s",
            (b"enc-1",),
        ).fetchone()
        assert row == (1, None, None)


@pytest.mark.parametrize("store_env", STORES, indirect=True)
def test_a_value_moved_to_another_session_or_altered_is_corrupt(store_env: StoreEnv) -> None:
    store = store_env.store(encryption=keyring())
    store.save(secret_checkpoint("victim", SECRET))
    store.save(secret_checkpoint("other", SECRET))
    sealed = raw_value(store_env, store, "victim")
    store_env.corrupt(store, "other", sealed)
    with pytest.raises(CorruptCheckpoint, match="another session"):
        store.load("other")
    store_env.corrupt(store, "victim", sealed[:-3] + b"abc")
    with pytest.raises(CorruptCheckpoint, match="does not authenticate"):
        store.load("victim")


@pytest.mark.parametrize("store_env", SHARED, indirect=True)
def test_clear_values_still_load_once_encryption_is_on_and_rotation_keeps_old_keys(
    store_env: StoreEnv,
) -> None:
    # Given a value written in clear, one under key a
    store_env.store().save(secret_checkpoint("clear", SECRET))
    store_env.store(encryption=keyring(f"a:{KEY_A}")).save(secret_checkpoint("under-a", SECRET))
    # When b becomes the first key, a staying
    rotated = store_env.store(encryption=keyring(f"b:{KEY_B},a:{KEY_A}"))
    # Then both still load, and a new write is sealed under b
    assert rotated.load("clear") == secret_checkpoint("clear", SECRET)
    assert rotated.load("under-a") == secret_checkpoint("under-a", SECRET)
    rotated.save(secret_checkpoint("under-b", SECRET))
    assert sealed_key_id(raw_value(store_env, rotated, "under-b")) == "b"
    # And a store without keys, or without the key, fails naming the key id it lacks
    with pytest.raises(MissingEncryptionKey, match="key id 'b'"):
        store_env.store().load("under-b")
    with pytest.raises(MissingEncryptionKey, match="key id 'a'"):
        store_env.store(encryption=keyring(f"b:{KEY_B}")).load("under-a")


def test_the_byte_budget_applies_to_the_sealed_value() -> None:
    from checkpointq.store.memory import InMemoryStore

    ring = keyring()
    store = InMemoryStore(StoreOptions(max_value_bytes=1024, encryption=ring))
    cp = make_checkpoint("big", messages=60)
    history = [
        m.model_copy(update={"content": os.urandom(60).hex()}) for m in cp.conversation_history
    ]
    cp = cp.model_copy(update={"conversation_history": history})
    result = store.save(cp)
    assert result.trimmed > 0 and result.stored_bytes <= 1024
    loaded = store.load("big")
    assert loaded is not None and len(loaded.conversation_history) == 60 - result.trimmed


# -- rekey ---------------------------------------------------------------------------------


def _rekey_all(store: CheckpointStore, cursor: str | None = None, page_size: int = 2) -> int:
    return sum(page.rewritten for page in rekey(store, cursor, page_size))


@pytest.mark.parametrize("store_env", SHARED, indirect=True)
def test_after_rekey_the_old_key_can_go_and_nothing_is_lost(store_env: StoreEnv) -> None:
    # Given clear values, values under the old key, under the new one, and a deleted session
    clear, old = store_env.store(), store_env.store(encryption=keyring(f"old:{KEY_A}"))
    for n in range(3):
        clear.save(secret_checkpoint(f"clear-{n}", SECRET))
        old.save(secret_checkpoint(f"old-{n}", SECRET, version=n + 1), seq=1000 + n)
    old.delete("old-2", seq=2000)
    both = store_env.store(encryption=keyring(f"new:{KEY_B},old:{KEY_A}"))
    both.save(secret_checkpoint("new-0", SECRET))
    # When the values are rekeyed with the new key first (two sessions a page)
    assert _rekey_all(both) == 6
    # Then a store holding the new key alone loads every live session as it was
    new_only = store_env.store(encryption=keyring(f"new:{KEY_B}"))
    expected = {f"clear-{n}": secret_checkpoint(f"clear-{n}", SECRET) for n in range(3)}
    expected |= {f"old-{n}": secret_checkpoint(f"old-{n}", SECRET, version=n + 1) for n in (0, 1)}
    expected["new-0"] = secret_checkpoint("new-0", SECRET)
    assert sorted(new_only.list()) == sorted(expected)
    for session_id, checkpoint in expected.items():
        assert new_only.load(session_id) == checkpoint
        assert sealed_key_id(raw_value(store_env, new_only, session_id)) == "new"
    # And each rewrite kept its session's fence: a save ordered before it is still stale
    assert not new_only.save(secret_checkpoint("old-0", SECRET, version=9), seq=999).applied
    assert new_only.load("old-2") is None
    # And running it again is harmless
    assert _rekey_all(new_only) == 6


@pytest.mark.parametrize("store_env", SHARED, indirect=True)
def test_a_save_applied_during_rekey_wins(
    store_env: StoreEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    store_env.store(encryption=keyring(f"old:{KEY_A}")).save(
        secret_checkpoint("raced", SECRET), seq=1000
    )
    both = store_env.store(encryption=keyring(f"new:{KEY_B},old:{KEY_A}"))
    other = store_env.store(encryption=keyring(f"new:{KEY_B},old:{KEY_A}"))
    read = both.load_with_fence

    def read_then_a_save_lands(session_id: str):  # type: ignore[no-untyped-def]
        found = read(session_id)
        other.save(secret_checkpoint("raced", SECRET, version=2), seq=1001)
        return found

    # When a newer save lands between rekey's read and its rewrite
    monkeypatch.setattr(both, "load_with_fence", read_then_a_save_lands)
    pages = list(rekey(both))
    # Then the rewrite is refused and the newer save stays
    assert [(p.rewritten, p.superseded) for p in pages] == [(0, 1)]
    loaded = store_env.store(encryption=keyring(f"new:{KEY_B}")).load("raced")
    assert loaded is not None and loaded.version == 2


@pytest.mark.parametrize("store_env", SHARED, indirect=True)
def test_rekey_resumes_from_its_cursor(store_env: StoreEnv) -> None:
    # (past 128 entries Redis' index is a skiplist, which ZSCAN pages by its COUNT)
    old = store_env.store(encryption=keyring(f"old:{KEY_A}"))
    old.apply_batch([SaveOp(secret_checkpoint(f"s{n}", SECRET)) for n in range(200)])
    both = store_env.store(encryption=keyring(f"new:{KEY_B},old:{KEY_A}"))
    # When a rekey stops after its first page
    first = next(rekey(both, None, 50))
    assert 0 < first.rewritten < 200 and first.cursor is not None
    # Then resuming from its cursor rewrites the rest
    _rekey_all(both, first.cursor, 50)
    new_only = store_env.store(encryption=keyring(f"new:{KEY_B}"))
    assert all(new_only.load(f"s{n}") is not None for n in range(200))


def test_rekey_command_reports_progress_and_never_shows_a_key(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    client = redis_server.client()
    client.flushall()
    old = RedisStore(client, options=StoreOptions(encryption=keyring(f"old:{KEY_A}")))
    old.apply_batch([SaveOp(secret_checkpoint(f"cli-{n}", SECRET)) for n in range(200)])
    env = checkpointq_env(broker_url=redis_server.url, encryption_keys=f"new:{KEY_B},old:{KEY_A}")
    done = subprocess.run(
        [sys.executable, "-m", "checkpointq.worker.cli", "rekey", "--page-size", "50"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "rewrote 200 session(s) under key 'new'" in done.stdout
    assert "resume with: checkpointq rekey --cursor" in done.stderr
    assert KEY_A not in done.stdout + done.stderr and KEY_B not in done.stdout + done.stderr
    new_only = RedisStore(client, options=StoreOptions(encryption=keyring(f"new:{KEY_B}")))
    assert new_only.load("cli-2") == secret_checkpoint("cli-2", SECRET)
    client.close()


@pytest.mark.parametrize("session_id", ["s", "session-\u00e9\u4e2d", "x" * 300, "\udc80lone"])
def test_the_session_key_is_hkdf_sha256_of_the_master_key(session_id: str) -> None:
    # The copied-context derivation must give RFC 5869's bytes, or Go and stored values break
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    from checkpointq.store.encryption import HKDF_LABEL

    master = bytes(range(32))
    info = HKDF_LABEL + session_id.encode("utf-8", "surrogatepass")
    expected = HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(master)
    ring = keyring()
    assert ring.derive_key("a", session_id) == expected
    assert ring.derive_key("a", session_id) == expected  # the shared context is not consumed


def test_the_session_key_cache_is_bounded_and_keeps_the_recently_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from checkpointq.store import encryption

    monkeypatch.setattr(encryption, "CACHED_SESSION_KEYS", 3)
    ring = keyring()
    sealed = {sid: ring.seal(sid, sid.encode()) for sid in ("s1", "s2", "s3")}
    ring.open("s1", sealed["s1"])  # s1 used again: s2 is now the least recently used
    ring.seal("s4", b"four")
    cached = list(ring._derived)
    assert len(cached) == 3 and ("a", "s2") not in cached and ("a", "s1") in cached
    for sid in ("s2", "s5", "s6", "s7"):  # evicted keys derive again, still opening
        ring.seal(sid, b"x")
    assert len(ring._derived) == 3
    assert ring.open("s2", sealed["s2"]) == b"s2"
    assert pickle.loads(pickle.dumps(ring))._derived == {}  # the cache never travels


def test_a_new_keyring_under_a_reused_key_id_never_serves_a_cached_key() -> None:
    old = keyring(f"a:{KEY_A}")
    value = old.seal("s", b"under the old key a")
    replaced = keyring(f"a:{KEY_B}")  # the same id, another key (a rotated secret)
    replaced.seal("s", b"warms its own cache")
    with pytest.raises(ValueError, match="does not authenticate"):
        replaced.open("s", value)
    assert old.open("s", value) == b"under the old key a"
    assert replaced.derive_key("a", "s") != old.derive_key("a", "s")


def test_a_sealed_value_is_stored_as_sent_only_when_it_holds_zstd() -> None:
    from checkpointq.store.memory import InMemoryStore

    ring = keyring()
    store = InMemoryStore(StoreOptions(encryption=ring))
    cp = secret_checkpoint("given", SECRET)
    # A producer's sealed zstd value (the Go client's, or a trimmed one) is kept as it came
    zstd = store.encode(cp)
    assert store.encode_op(SaveOp(cp, encoded=zstd)) is zstd
    # Its sealed JSON (a staged save that fits) is compressed and sealed again by the store
    sealed_json = EncodedCheckpoint(ring.seal("given", serialize_checkpoint(cp)), 0)
    stored = store.encode_op(SaveOp(cp, encoded=sealed_json))
    assert stored is not sealed_json and ring.open("given", stored.value).startswith(ZSTD_MAGIC)
    # And one under an older key is sealed again under the first
    older = Keyring.parse(f"b:{KEY_B}")
    rotated = InMemoryStore(StoreOptions(encryption=Keyring.parse(f"a:{KEY_A},b:{KEY_B}")))
    under_b = EncodedCheckpoint(
        older.seal("given", store.codec.encode(serialize_checkpoint(cp))), 0
    )
    assert sealed_key_id(rotated.encode_op(SaveOp(cp, encoded=under_b)).value) == "a"


def test_a_staged_value_is_opened_once_and_offered_as_stored_only_in_the_store_format(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from checkpointq.store.memory import InMemoryStore
    from checkpointq.tasks.staged import StagedSave, save_op

    ring = Keyring.parse(f"a:{KEY_A},b:{KEY_B}")
    store = InMemoryStore(StoreOptions(encryption=ring))
    clear_store = InMemoryStore(StoreOptions())
    cp = secret_checkpoint("given", SECRET)
    document = serialize_checkpoint(cp)
    zstd = store.codec.encode(document)
    opens: list[str] = []
    real_open = Keyring.open

    def counting_open(self: Keyring, session_id: str, sealed: bytes) -> bytes:
        opens.append(session_id)
        return real_open(self, session_id, sealed)

    monkeypatch.setattr(Keyring, "open", counting_open)
    request = StagedSave("given", 1, "req-1", 0)
    cases = [
        (store, ring.seal("given", document), False),  # sealed JSON: the store encodes it
        (store, ring.seal("given", zstd), True),  # sealed zstd under the first key: kept
        (store, ring.seal("given", zstd, key_id="b"), False),  # an older key: sealed again
        (store, zstd, False),  # clear, with keys: sealed on store
        (clear_store, zstd, True),
        (clear_store, document, False),
    ]
    for target, value, kept in cases:
        opens.clear()
        decoded = target.decode_staged("given", value)
        assert decoded.checkpoint == cp and decoded.own_format is kept
        assert len(opens) == (1 if is_sealed(value) else 0)
        op = save_op(target, request, value, 1 << 20)
        assert (op.encoded is not None) is kept
        assert target._is_own_format("given", value) is kept  # what encode_op decides


# -- producers that would carry checkpoints in clear ------------------------------------


def test_producers_whose_messages_would_carry_the_checkpoint_are_refused_with_keys(
    redis_server: RedisServer,
) -> None:
    from checkpointq import BatchingClient, CheckpointClient, EncryptionError, InMemoryStore

    store = InMemoryStore(StoreOptions(encryption=keyring()))
    with pytest.raises(EncryptionError, match="needs a Redis broker"):
        CheckpointClient("amqp://guest:guest@127.0.0.1:5672//", store)
    client = CheckpointClient(redis_server.url, store, stage_saves=False)
    assert client.stage_saves  # every save staged, sealed, whatever was asked
    with pytest.raises(EncryptionError, match="BatchingClient"):
        BatchingClient(client)
    client.close()


def test_the_envelope_counts_against_the_message_limit_at_the_producer(
    redis_server: RedisServer,
) -> None:
    from checkpointq import CheckpointClient, InMemoryStore, InvalidInput

    cp = make_checkpoint("near-limit", content_size=2000)
    size = len(serialize_checkpoint(cp))
    for keys, refused in ((None, False), (keyring(), True)):
        store = InMemoryStore(StoreOptions(encryption=keys))
        client = CheckpointClient(redis_server.url, store, max_message_bytes=size + 10)
        # A JSON within 10 bytes of the limit: sealed, it would be over it at the worker
        if refused:
            with pytest.raises(InvalidInput, match="the limit is"):
                client.staged_value(cp)
        else:
            assert client.staged_value(cp)[1] == serialize_checkpoint(cp)
        client.close()
