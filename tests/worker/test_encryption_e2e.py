"""End to end with encryption at rest: a producer seals each checkpoint before it reaches the
broker, a real worker applies the ciphertext, and no byte of the conversation is in Redis:
not in the queue, the staged values, the pending records, the store or a dead letter. A
worker without the key holds what it cannot read until a worker with the key applies it.
Given / When / Then.
"""

from __future__ import annotations

import base64
import subprocess
import sys

import orjson
import pytest

from checkpointq.store.encryption import (
    MissingEncryptionKey,
    generate_key,
    is_sealed,
    sealed_key_id,
)
from checkpointq.store.redis import RedisStore
from checkpointq.tasks.dead_letters import Reason
from checkpointq.tasks.errors import RequestRefused
from checkpointq.tasks.messages import SAVE_STAGED
from checkpointq.tasks.producer.client import CheckpointClient
from checkpointq.tasks.producer.clock import SeqClock, wall_clock_us
from checkpointq.tasks.producer.outcomes import APPLIED
from checkpointq.worker.settings import Settings
from tests.support.celery_processes import CeleryProcess, checkpointq_env
from tests.support.checkpoints import secret_checkpoint
from tests.support.redis_contents import everything_in
from tests.support.servers import wait_until
from tests.support.workers import TEST_WORKER_SETTINGS
from tests.worker.conftest import Deployment

pytestmark = pytest.mark.integration

SECRET = "the-patient-asked-about-lisinopril"
KEYS = f"new:{generate_key()},old:{generate_key()}"


@pytest.fixture(scope="module")
def deployment_settings() -> dict[str, object]:
    return {"encryption_keys": KEYS}


def test_no_byte_of_the_conversation_reaches_the_broker_or_the_store(live: Deployment) -> None:
    held = CheckpointClient.from_settings(live.settings.model_copy(update={"queue": "held-enc"}))
    with live.checkpoint_client() as client, held:
        assert client.encrypted and client.stage_saves
        # Given a save queued where no worker consumes it: staged value, record, message
        held.save(secret_checkpoint("enc-queued", SECRET))
        assert SECRET.encode() not in everything_in(live.broker_client())
        # (a load merges it, decrypted, from the pending record; a producer without the
        # keys fails naming the key id it lacks, rather than serve anything)
        assert client.load("enc-queued") == secret_checkpoint("enc-queued", SECRET)
        assert live.settings.broker_url is not None and live.settings.store_url is not None
        keyless = CheckpointClient(
            live.settings.broker_url, RedisStore.from_url(live.settings.store_url), queue="held-enc"
        )
        with keyless, pytest.raises(MissingEncryptionKey, match="key id 'new'"):
            keyless.load("enc-queued")
        # When saves are applied by the worker
        handles = [
            client.save(secret_checkpoint(f"enc-{n}", SECRET, version=n)) for n in range(1, 6)
        ]
        for handle in handles:
            assert client.wait_durable(handle, timeout=20).outcome == APPLIED
        # Then each loads back as sent, and the store holds it sealed under the first key
        for n in range(1, 6):
            assert client.load(f"enc-{n}") == secret_checkpoint(f"enc-{n}", SECRET, version=n)
        raw = live.store_client().get(client.store.keys.data("enc-3"))  # type: ignore[attr-defined]
        assert isinstance(raw, bytes) and is_sealed(raw) and sealed_key_id(raw) == "new"
    # And nothing of the conversation is anywhere in the broker or the store
    live.broker_client().delete("held-enc")
    assert SECRET.encode() not in everything_in(live.broker_client())
    assert SECRET.encode() not in everything_in(live.store_client())


def test_a_refused_encrypted_save_leaves_no_clear_byte_in_its_dead_letter(
    live: Deployment,
) -> None:
    # Given a producer whose clock runs 6.5 minutes ahead (the worker allows 5)
    settings = live.settings
    assert settings.broker_url is not None
    ahead = SeqClock(lambda: wall_clock_us() + 390_000_000)
    store = live.checkpoint_client().store
    with CheckpointClient(
        settings.broker_url, store, queue=settings.queue, clock=ahead, max_seq_ahead_seconds=1200
    ) as client:
        handle = client.save(secret_checkpoint("enc-ahead", SECRET))
        # When the worker refuses it
        with pytest.raises(RequestRefused) as refused:
            client.wait_durable(handle, timeout=20)
    # Then its dead letter says why, and keeps the ciphertext, nothing of it in clear
    letter = live.dead_letters().get(refused.value.entry)
    assert letter is not None and "ahead" in letter.reason
    assert letter.task == SAVE_STAGED and letter.replayable
    assert letter.sealed_value is not None and sealed_key_id(letter.sealed_value) == "new"
    assert SECRET.encode() not in letter.raw
    assert SECRET not in orjson.dumps(letter.as_json()).decode()
    live.wait_drained()
    assert SECRET.encode() not in everything_in(live.broker_client())
    assert SECRET.encode() not in everything_in(live.store_client())
    # And `dlq show` opens it with the keys, and only with them
    env = checkpointq_env(broker_url=settings.broker_url, store_url=settings.store_url)
    show = [sys.executable, "-m", "checkpointq.worker.cli", "dlq", "show", letter.id]
    keyed = subprocess.run(
        show, env={**env, "CHECKPOINTQ_ENCRYPTION_KEYS": KEYS}, capture_output=True, text=True
    )
    assert keyed.returncode == 0 and f"{SECRET} 0" in keyed.stdout
    keyless = subprocess.run(show, env=env, capture_output=True, text=True)
    assert keyless.returncode == 0 and SECRET not in keyless.stdout
    assert "encrypted under key id 'new'" in keyless.stdout


def test_an_encrypted_dead_letter_replays_with_its_sealed_value(live: Deployment) -> None:
    # Given the dead letter of an encrypted staged save (as the worker records one)
    with live.checkpoint_client() as client:
        seq = client.clock.next("enc-replay", None)
        value = client.store.encode(secret_checkpoint("enc-replay", SECRET)).value
        letters = live.dead_letters()
        entry = letters.add(
            Reason.RETRIES_EXHAUSTED,
            "the store failed",
            task=SAVE_STAGED,
            task_id="refused-request",
            args=["enc-replay"],
            kwargs={"seq": seq, "sealed": base64.b64encode(value).decode()},
        )
        # When it is replayed
        letters.replay(entry, client)
        # Then the worker applies it, sealed, and the entry is gone
        wait_until(
            lambda: client.store.load("enc-replay") is not None,
            timeout=20,
            message="the replayed save to apply",
        )
        assert client.load("enc-replay") == secret_checkpoint("enc-replay", SECRET)
        assert letters.get(entry) is None


def test_a_worker_without_the_key_holds_the_request_for_one_that_has_it(
    live: Deployment,
) -> None:
    # Given a worker without keys on a queue of its own
    queue = "enc-keyless"
    base = {
        **TEST_WORKER_SETTINGS,
        "broker_url": live.settings.broker_url,
        "store_url": live.settings.store_url,
        "queue": queue,
    }
    keyless = CeleryProcess("worker", checkpointq_env(**base)).start()
    keyed: CeleryProcess | None = None
    settings = Settings(**{**base, "encryption_keys": KEYS})  # type: ignore[arg-type]
    try:
        with CheckpointClient.from_settings(settings) as client:
            # When an encrypted save reaches it
            handle = client.save(secret_checkpoint("enc-held", SECRET))
            # Then it fails with one clear error naming the key id it lacks, again and again
            wait_until(
                lambda: keyless.log().count("encrypted under key id 'new'") >= 3,
                timeout=20,
                message="the keyless worker to retry the request",
            )
            # And dead-letters nothing: the request waits
            assert live.dead_letters().list(count=10).entries == []
            assert client.store.load("enc-held") is None
            keyless.stop()
            # When a worker with the key takes the queue over, it applies the request
            keyed = CeleryProcess("worker", checkpointq_env(**base, encryption_keys=KEYS)).start()
            assert client.wait_durable(handle, timeout=30).outcome == APPLIED
            assert client.load("enc-held") == secret_checkpoint("enc-held", SECRET)
    finally:
        keyless.stop()
        if keyed is not None:
            keyed.stop()
    assert KEYS.split(",")[0].split(":")[1] not in keyless.log()
    # The keyed worker said which key it seals under, and never showed a key
    assert keyed is not None
    log = keyed.log()
    assert "values sealed under key id 'new'; key ids held: new, old" in log
    assert all(pair.split(":")[1] not in log for pair in KEYS.split(","))
