"""Settles and reservations that a dropped broker connection cut short, done again.

An ack, reject or requeue whose connection is cut (or whose write the broker refuses)
leaves its message in the broker's ``unacked`` hash, and so does a reserve script whose
reply is never read (``worker/reserve.py``). kombu restores such entries only after the
visibility timeout (300 s by default): it cannot tell a lost ack from a worker still busy
with the message. The worker that lost it can, since it no longer holds the message. So
this process remembers what it lost: each settle's tag (done again as meant), the tags it
held when its consumer restarted (kombu restores them as it closes the channel, unless the
broker refuses that too), and the score of each reservation sent and not read (its entries,
never delivered, go back to the front of their queue). A consumer bootstep retries them
every ``RETRY_SECONDS`` on the consumer's timer until the broker takes them.

Doing one twice is harmless: the ack's removal and kombu's ``restore_by_tag`` do nothing for
a tag no longer in ``unacked``, and a message handed back while some process still runs it
runs twice, which fenced writes make harmless.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, bootsteps
from redis import exceptions as redis_errors

from checkpointq.tasks.producer.pending import settle_source
from checkpointq.worker import reserve
from checkpointq.worker.hooks import kombu as kombu_hooks

logger = logging.getLogger(__name__)

_SETTLE_SOURCE = settle_source()

#: Seconds between two attempts while anything lost is remembered.
RETRY_SECONDS = 1.0
#: Tags (or reservations) remembered at most per kind; past it the oldest are left to the
#: visibility timeout, which recovers them anyway.
MAX_REMEMBERED = 10_000


class LostSettles:
    """What this process failed to tell the broker, to be told again."""

    def __init__(self) -> None:
        #: Tags whose ack (or reject without requeue) did not reach the broker.
        self.acks: dict[str, None] = {}
        #: Tags whose requeue did not reach the broker.
        self.requeues: dict[str, None] = {}
        #: Tags held when the consumer restarted, whose restore may not have reached it.
        self.restores: dict[str, None] = {}
        #: The QoS of each channel closed by a consumer restart, not looked at yet.
        self._closed: list[Any] = []
        #: Scores (the worker's ``time()``) of reservations sent whose reply was not read.
        self.reservations: dict[str, None] = {}
        #: settle.lua calls (KEYS, ARGV) that rode acks the broker did not take: the pending
        #: records and staged values of requests applied meanwhile. Settled again with the
        #: acks; else a staged value would wait out its lifetime once the acks went through.
        self.records: list[tuple[list[str], list[Any]]] = []

    def __bool__(self) -> bool:
        return bool(
            self.acks
            or self.requeues
            or self.restores
            or self.reservations
            or self._closed
            or self.records
        )

    def lost_settle(self, tag: Any, *, requeue: bool) -> None:
        _remember(self.requeues if requeue else self.acks, str(tag))

    def lost_records(self, keys: list[str], args: list[Any]) -> None:
        """settle.lua's call for requests whose acks were lost with it."""
        self.records.append((keys, args))
        del self.records[:-MAX_REMEMBERED]

    def restarting(self, qos: Any) -> None:
        """The consumer restarts: kombu restores what ``qos`` holds as it closes the channel,
        which the broker may refuse or the connection cut short; what it still holds at the
        next attempt is restored then."""
        self._closed.append(qos)

    def reserving(self, score: str) -> None:
        """A reserve script call was sent: lost unless its reply is read (``reserved``)."""
        _remember(self.reservations, score)

    def reserved(self, score: str) -> None:
        """Its reply was read: what it took was delivered, or it took nothing."""
        self.reservations.pop(score, None)

    def retry(self, channel: Any) -> None:
        """Do again, on ``channel``'s broker, what was lost; keep what fails again."""
        for qos in self._closed:  # (a restore that went through left nothing held)
            for tag in kombu_hooks.held_tags(qos):
                _remember(self.restores, tag)
        self._closed.clear()
        if not self or not reserve.usable(channel):
            return
        try:
            with channel.conn_or_acquire() as client:
                self._ack_again(channel, client)
                self._settle_records_again(client)
                self._requeue_again(channel, client)
                self._restore_again(channel, client)
                self._hand_back(channel, client)
        except redis_errors.RedisError as exc:
            logger.debug("lost settles not done yet (%s): again in %.0fs", exc, RETRY_SECONDS)

    def _ack_again(self, channel: Any, client: Any) -> None:
        if not self.acks:
            return
        tags = list(self.acks)
        pipe = client.pipeline()
        for tag in tags:
            pipe.zrem(channel.unacked_index_key, tag).hdel(channel.unacked_key, tag)
        pipe.execute()
        for tag in tags:
            del self.acks[tag]
        logger.info("%d lost acks settled again after the broker took writes again", len(tags))

    def _settle_records_again(self, client: Any) -> None:
        while self.records:
            keys, args = self.records[0]
            client.eval(_SETTLE_SOURCE, len(keys), *keys, *args)
            del self.records[0]

    def _requeue_again(self, channel: Any, client: Any) -> None:
        for tag in list(self.requeues):
            channel.qos.restore_by_tag(tag, client, leftmost=True)
            del self.requeues[tag]
            logger.info("lost requeue of %s settled again after the broker took writes", tag)

    def _restore_again(self, channel: Any, client: Any) -> None:
        if not self.restores:
            return
        tags = list(self.restores)
        for tag in tags:
            channel.qos.restore_by_tag(tag, client)  # nothing left to do if kombu's was done
            del self.restores[tag]
        logger.debug("restores of %d messages held at a consumer restart done again", len(tags))

    def _hand_back(self, channel: Any, client: Any) -> None:
        reading = kombu_hooks.pending_reservation(channel)
        held = kombu_hooks.held_tags(channel.qos)
        for score in [s for s in self.reservations if s != reading]:
            tags = client.zrange(channel.unacked_index_key, score, score, byscore=True)
            lost = [t.decode() if isinstance(t, bytes) else t for t in tags]
            lost = [tag for tag in lost if tag not in held]
            for tag in lost:
                channel.qos.restore_by_tag(tag, client)
            del self.reservations[score]
            if lost:
                logger.info("%d messages of a lost reservation handed back", len(lost))


def _remember(kind: dict[str, None], key: str) -> None:
    kind[key] = None
    while len(kind) > MAX_REMEMBERED:
        del kind[next(iter(kind))]


#: This process's record (acks and reservations happen in the worker's main process).
lost = LostSettles()


def install(app: Celery) -> None:
    """Retry ``lost`` on the consumer's timer, on its task channel."""

    class LostSettlesStep(bootsteps.StartStopStep):  # type: ignore[misc]  # no celery hints
        """Lost settles retried on the consumer's timer, from when the task consumer exists."""

        requires = ("celery.worker.consumer.tasks:Tasks",)

        def __init__(self, consumer: Any, **kwargs: Any) -> None:
            self._tref: Any = None

        def start(self, consumer: Any) -> None:
            def retry() -> None:
                lost.retry(consumer.task_consumer.channel)

            retry()
            self._tref = consumer.timer.call_repeatedly(RETRY_SECONDS, retry)

        def stop(self, consumer: Any) -> None:
            task_consumer = getattr(consumer, "task_consumer", None)
            # (kombu's virtual channels hold a QoS of delivered messages; py-amqp's, on
            # RabbitMQ, do not: the broker keeps them)
            qos = getattr(getattr(task_consumer, "channel", None), "qos", None)
            if qos is not None:
                lost.restarting(qos)
            if self._tref is not None:
                consumer.timer.cancel(self._tref)
                self._tref = None

        shutdown = stop

    app.steps["consumer"].add(LostSettlesStep)
