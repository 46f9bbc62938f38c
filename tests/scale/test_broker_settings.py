"""Which settings each broker kind needs, and the Celery options they become."""

from __future__ import annotations

import pytest

from checkpointq.tasks.brokers import BrokerKind, broker_kind, transport_options
from checkpointq.tasks.producer.broker_durability import BrokerDurability
from checkpointq.tasks.producer.client import client_options
from checkpointq.worker import reserve
from checkpointq.worker.app import celery_config
from checkpointq.worker.settings import InvalidSettings, Settings

AMQP = "amqp://guest:guest@127.0.0.1:5672/cq"
SENTINELS = "sentinel://:pw@10.0.0.1:26379;sentinel://:pw@10.0.0.2:26379"
CLUSTER = "redis+cluster://10.0.0.1:7000,10.0.0.2:7000"


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("redis://h:6379/0", BrokerKind.REDIS),
        ("rediss://h:6380/0", BrokerKind.REDIS),
        ("unix:///run/redis.sock", BrokerKind.REDIS),
        ("redis+socket:///run/redis.sock", BrokerKind.REDIS),
        (SENTINELS, BrokerKind.SENTINEL),
        (AMQP, BrokerKind.AMQP),
        ("pyamqp://h//", BrokerKind.AMQP),
        ("sqs://", BrokerKind.OTHER),
    ],
)
def test_broker_kind_follows_the_scheme(url: str, kind: BrokerKind) -> None:
    assert broker_kind(url) is kind


def test_rabbitmq_gets_publisher_confirms_and_no_redis_options() -> None:
    config = celery_config(Settings(broker_url=AMQP, store_url="redis://h:6379/0"))
    assert config["broker_transport_options"] == {"confirm_publish": True}


def test_redis_keeps_its_visibility_timeout() -> None:
    options = celery_config(Settings(broker_url="redis://h:6379/0"))["broker_transport_options"]
    assert options["visibility_timeout"] == 300 and "confirm_publish" not in options


def test_redis_and_sentinel_workers_get_the_byte_budget_of_what_they_hold_reserved() -> None:
    plain = Settings(broker_url="redis://h:6379/0", prefetch_max_bytes=1_000_000)
    sentinel = Settings(broker_url=SENTINELS, store_url="redis://h:6379/0", sentinel_master="cq")
    for settings, budget in ((plain, 1_000_000), (sentinel, Settings().prefetch_max_bytes)):
        options = celery_config(settings)["broker_transport_options"]
        assert options[reserve.MAX_HELD_BYTES_OPTION] == budget


def test_a_coalescing_redis_worker_gets_its_wake_up_linger_and_one_that_does_not_none() -> None:
    def linger(**given: object) -> object:
        config = celery_config(Settings(broker_url="redis://h:6379/0", **given))  # type: ignore[arg-type]
        return config["broker_transport_options"][reserve.WAKE_LINGER_OPTION]

    assert linger() == 5.0 and linger(wake_linger_ms=12) == 12
    assert linger(wake_linger_ms=12, coalesce_max_items=0) == 0
    assert linger(wake_linger_ms=12, pool="threads") == 0


def test_sentinel_gets_master_name_password_and_visibility_timeout() -> None:
    settings = Settings(
        broker_url=SENTINELS,
        store_url="redis://h:6379/0",
        sentinel_master="cq",
        sentinel_password="s3cret",
    )
    options = celery_config(settings)["broker_transport_options"]
    assert options["master_name"] == "cq"
    assert options["sentinel_kwargs"] == {"password": "s3cret"}
    assert options["visibility_timeout"] == 300
    assert "s3cret" not in str(settings.describe()) and "pw@" not in str(settings.describe())


@pytest.mark.parametrize("broker", [AMQP, SENTINELS])
def test_a_broker_that_is_not_plain_redis_needs_a_store_url(broker: str) -> None:
    with pytest.raises(InvalidSettings, match="store_url is required"):
        Settings(broker_url=broker, sentinel_master="cq")


def test_a_sentinel_broker_needs_the_master_name() -> None:
    with pytest.raises(InvalidSettings, match="sentinel_master"):
        Settings(broker_url=SENTINELS, store_url="redis://h:6379/0")
    with pytest.raises(ValueError, match="master"):
        transport_options(SENTINELS)


def test_beat_schedule_lives_on_a_plain_redis() -> None:
    # the store when it is a single Redis
    plain = Settings(broker_url="redis://b:6379/0", store_url="redis://s:6379/0")
    assert plain.resolved_beat_url == "redis://s:6379/0"
    # the broker when the store is a cluster
    clustered = Settings(broker_url="redis://b:6379/0", store_url=CLUSTER)
    assert clustered.resolved_beat_url == "redis://b:6379/0"
    # and an explicit URL when neither is a plain Redis
    with pytest.raises(InvalidSettings, match="beat_url is required"):
        Settings(broker_url=AMQP, store_url=CLUSTER)
    explicit = Settings(broker_url=AMQP, store_url=CLUSTER, beat_url="redis://beat:6379/0")
    assert explicit.resolved_beat_url == "redis://beat:6379/0"


def test_broker_durability_is_local_or_replicated_and_needs_a_plain_redis(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CHECKPOINTQ_BROKER_DURABILITY", "replicate")
    with pytest.raises(InvalidSettings) as bad:
        Settings(broker_url="redis://h:6379/0")
    assert str(bad.value) == (
        "invalid CHECKPOINTQ_BROKER_DURABILITY: Input should be 'local' or 'replicated'"
    )
    monkeypatch.setenv("CHECKPOINTQ_BROKER_DURABILITY", "replicated")
    monkeypatch.setenv("CHECKPOINTQ_BROKER_REPLICATION_TIMEOUT_MS", "0")
    with pytest.raises(InvalidSettings, match="BROKER_REPLICATION_TIMEOUT_MS: Input should be"):
        Settings(broker_url="redis://h:6379/0")
    monkeypatch.delenv("CHECKPOINTQ_BROKER_REPLICATION_TIMEOUT_MS")
    with pytest.raises(InvalidSettings, match="replicated needs a plain Redis broker"):
        Settings(broker_url=AMQP, store_url="redis://h:6379/0")
    settings = Settings(broker_url="redis://h:6379/0", broker_replicas=2)
    durability = BrokerDurability.from_settings(settings)
    assert durability == BrokerDurability("replicated", 2, 1000)
    assert client_options(settings)[1]["durability"] == durability
