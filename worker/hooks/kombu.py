"""Every use of kombu's private names, in one place: the guarded Redis reader and the
bookkeeping accessors the worker's reserve, coalescing, ack and health code go through.

Nothing else in checkpointq reaches past kombu's public API; when kombu changes, this module
is the one to re-read. ``install()`` puts the hooks in only on a kombu line they are proven on
(``PROVEN``: the sha256 of every kombu function they copy or whose attributes they read, per
line; ``scripts/test-matrix`` runs the worker, coalescing and fault tests on the lowest and
highest) and when a self-test of those attributes passes. Anywhere else the worker keeps
kombu's stock reader and per-message acks (coalescing still groups what that reader
delivers) and logs one line saying why.

The reader replaces kombu's Redis ``Channel._brpop_read`` (every Redis spelling, Sentinel
included, goes through it) because that is where an item is decoded, before any Celery hook:
an item that would not decode is dead-lettered there instead of stopping the worker, and one
over the size limit is set aside unread (``worker/oversize.py``). It also fills the prefetch
window in one round trip (``worker/reserve.py``), builds each message once, and decodes
strict base64 bodies with ``pybase64``. docs/design.md says why this hook and no smaller
one; docs/performance.md what it saves.
"""

from __future__ import annotations

import binascii
import hashlib
import inspect
import logging
from dataclasses import dataclass
from functools import cache
from queue import Empty
from time import monotonic
from typing import Any, NoReturn

import kombu
from celery import bootsteps
from kombu import message as kombu_message
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import loads as kombu_loads
from pybase64 import b64decode as strict_b64decode
from redis.exceptions import NoScriptError, OutOfMemoryError, ResponseError

from checkpointq.store import probe, redis_hooks
from checkpointq.store.errors import StoreUnavailable
from checkpointq.tasks.dead_letters import Reason
from checkpointq.tasks.refusals import refuse
from checkpointq.worker import backpressure, lost_settles, oversize, reserve

logger = logging.getLogger(__name__)

#: kombu's own reader, kept to tell whether ours is installed.
_KOMBU_BRPOP_READ = kombu_redis.Channel._brpop_read
#: kombu's own BRPOP sender, used while the worker is idle.
_KOMBU_BRPOP_START: Any = kombu_redis.Channel._brpop_start
#: kombu's consume (ours wraps it) and the virtual one whose delivery callback ours mirrors.
_KOMBU_BASIC_CONSUME: Any = kombu_redis.Channel.basic_consume
_KOMBU_VIRTUAL_BASIC_CONSUME: Any = virtual.Channel.basic_consume
#: The local half of kombu's Redis ``QoS.append`` (its ``super().append``).
_VIRTUAL_QOS_APPEND: Any = virtual.QoS.append


class _Base64(virtual.base.Base64):
    """kombu's base64 codec, decoding strict base64 with pybase64's SIMD decoder.

    Where pybase64 accepts a text (alphabet and padding only), the standard library decodes
    it to the same bytes; the rest goes to kombu's decoder as before.
    """

    def decode(self, s: bytes | str) -> bytes:
        try:
            return strict_b64decode(s, validate=True)
        except (binascii.Error, ValueError, TypeError):
            return super().decode(s)  # type: ignore[no-untyped-call,no-any-return]


#: The channels' codecs, ours for base64 (``install()``).
_CODECS = {**kombu_redis.Channel.codecs, "base64": _Base64()}


def _text(value: bytes | str) -> str:
    """kombu's ``bytes_to_str``: UTF-8 with replacement characters."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


#: A task name or id longer than this, read from a malformed envelope, is not trusted.
_MAX_NAME = 256


def _named(payload: Any) -> tuple[str | None, str | None]:
    """The task name and id an envelope's headers give, when the envelope itself decoded.

    An envelope whose body is bad (not base64, say) still names its request, and a
    producer may be waiting on that id: with it, the dead letter gets a refusal record and
    ``wait_durable`` is told at once instead of timing out. Anything not a short string is
    ignored: the raw item is recorded whole either way.
    """
    headers = payload.get("headers") if isinstance(payload, dict) else None
    if not isinstance(headers, dict):
        return None, None
    task, task_id = headers.get("task"), headers.get("id")
    return (
        task if isinstance(task, str) and 0 < len(task) <= _MAX_NAME else None,
        task_id if isinstance(task_id, str) and 0 < len(task_id) <= _MAX_NAME else None,
    )


def _refuse(
    channel: Any,
    key: bytes | str,
    item: bytes,
    queue: str,
    exc: BaseException,
    payload: Any = None,
    tag: str | None = None,
) -> None:
    """Record an undecodable item; if the store is down, put the item back in the queue.

    ``payload`` is the item's JSON when it parsed (None otherwise). ``tag``: the item was
    recorded in ``unacked`` by the reserve script, and leaves it here.
    """
    reason = f"queue item is not a Celery message ({type(exc).__name__}: {exc})"
    task, task_id = _named(payload)
    try:
        refuse(
            Reason.UNDECODABLE,
            reason,
            task=task,
            task_id=task_id,
            raw=item,
            headers={"queue": queue},
        )
    except StoreUnavailable as down:
        # Back at the far end of the list it goes, and the worker stops consuming until the
        # store takes writes (it comes round again then). Should the broker refuse that too,
        # DeadLetters.add has logged the whole item.
        logger.error("could not dead-letter a malformed item from %s; put it back", queue)
        if tag is not None:
            reserve.forget(channel, tag, requeue=(_bytes(key), item))
        else:
            with channel.conn_or_acquire() as client:  # as kombu's own _put: not the BRPOP one
                client.lpush(key, item)
        backpressure.trip(str(down))
    else:
        if tag is not None:
            reserve.forget(channel, tag)


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


@dataclass(frozen=True, slots=True)
class _Consumer:
    """What kombu's ``basic_consume`` registered for a queue: its delivery callback (which
    builds the message, records it and calls the consumer), and the parts it closes over."""

    registered: Any
    callback: Any
    no_ack: bool


_CONSUME_SIGNATURE = inspect.signature(_KOMBU_VIRTUAL_BASIC_CONSUME)


def _basic_consume(self: Any, queue: str, *args: Any, **kwargs: Any) -> Any:
    """kombu's ``basic_consume``, remembering the consumer's callback for ``_deliver``."""
    result = _KOMBU_BASIC_CONSUME(self, queue, *args, **kwargs)
    bound = _CONSUME_SIGNATURE.bind(self, queue, *args, **kwargs)
    consumers = self.__dict__.setdefault("_checkpointq_consumers", {})
    consumers[queue] = _Consumer(
        self.connection._callbacks.get(queue),
        bound.arguments["callback"],
        bool(bound.arguments["no_ack"]),
    )
    return result


def _deliver(self: Any, key: bytes | str, item: bytes, dest: str, tag: str | None) -> None:
    """Decode ``item`` once, refuse it if it does not decode, else hand it to its consumer.

    Mirrors kombu's delivery callback (``virtual.Channel.basic_consume``: build the message,
    record it in the QoS, call the consumer) with the message built once, not twice, and,
    for a message the reserve script recorded (``tag``), only the local bookkeeping of
    ``QoS.append``: its broker half is done. Anything unusual (no consumer, or another one
    than we saw registered) takes kombu's own delivery, which records it (again) itself.
    """
    self._queue_cycle.rotate(dest)
    payload: Any = None
    try:
        payload = kombu_loads(_text(item))  # type: ignore[no-untyped-call]
        # Build the message as the consumer callback will (envelope fields, base64 body),
        # so that whatever would raise there raises here, where it can be refused.
        message = self.Message(payload, channel=self)
    except Exception as exc:  # any decoding failure means "not a Celery message"
        _refuse(self, key, item, dest, exc, payload, tag)
        return
    consumer: _Consumer | None = self.__dict__.get("_checkpointq_consumers", {}).get(dest)
    if consumer is None or self.connection._callbacks.get(dest) is not consumer.registered:
        self.connection._deliver(payload, dest)
        return
    if not consumer.no_ack:
        if tag is not None and tag == message.delivery_tag:
            _VIRTUAL_QOS_APPEND(self.qos, message, tag)
        else:
            self.qos.append(message, message.delivery_tag)
    consumer.callback(message)


def _reading(self: Any) -> reserve.Reading:
    reading: reserve.Reading | None = self.__dict__.get("_checkpointq_reading")
    if reading is None:
        reading = self.__dict__["_checkpointq_reading"] = reserve.Reading()
    return reading


def _reserving(self: Any) -> bool:
    """Whether the script may take this channel's messages: kombu's Redis bookkeeping, and
    no consumer reading without acknowledgements (their messages must not be recorded)."""
    consumers = self.__dict__.get("_checkpointq_consumers", {}).values()
    return reserve.usable(self) and not any(c.no_ack for c in consumers)


def _brpop_start(self: Any, timeout: Any = None) -> None:
    """kombu's ``Channel._brpop_start``, where every message is taken by the reserve script
    (the room left in the prefetch window): an idle channel waits for one without taking it
    (``reserve.wait_command``), then reserves. kombu's BRPOP only where the script cannot
    record, or for one read the broker refused the script or the wait."""
    reading = _reading(self)
    reading.pending, reading.waiting = None, False
    byte_room = reserve.byte_room(self)
    if byte_room is not None and byte_room <= 0:
        return  # the main process holds its byte budget: next turn, after an ack frees some
    idle_without_wait = not reading.busy and reading.no_wait is not None
    if reading.brpop_next or idle_without_wait or not _reserving(self):
        reading.brpop_next = False
        # kombu 5.5 defaults to a 1 s BRPOP, 5.6 on to the channel's brpop_timeout
        _KOMBU_BRPOP_START(self) if timeout is None else _KOMBU_BRPOP_START(self, timeout)
        return
    lingering: list[Any] | None = None
    if reading.linger:
        reading.linger = False
        linger = reserve.wake_linger_ms(self)
        if linger > 0:  # woken: the requests arriving meanwhile share this reserve
            lingering = reserve.linger_command(linger)
    queues = self._queue_cycle.consume(len(self.active_queues))
    if not queues:
        return
    if not reading.busy:
        # Wakes on the first queue's unprioritised list, which holds what producers send;
        # other lists are read by the script after each wait, every brpop_timeout at most.
        if timeout is None:
            timeout = getattr(self, "brpop_timeout", 1)
        key = queue_key(self, queues[0], self.priority_steps[0])
        command = reserve.wait_command(key, timeout or 0)
        reading.waking = not reading.full
        if reading.full:
            reading.full = False
            command = reserve.sleep_command(timeout or 0)
        reading.waiting = True
        self._in_poll = self.client.connection
        self._brpop_sent_at = monotonic()
        _send(self.client.connection, command)
        return
    room = self.qos.can_consume_max_estimate()
    budget = reserve.BYTE_BUDGET if byte_room is None else min(reserve.BYTE_BUDGET, byte_room)
    sent, command = reserve.request(
        self, queues, reserve.BATCH_LIMIT if room is None else room, budget, oversize.guard_of(self)
    )
    reading.pending = sent
    # Until its reply is read, what it takes is this process's to hand back should the
    # reply never be (worker/lost_settles.py).
    lost_settles.lost.reserving(sent.score)
    # As kombu's BRPOP: sent on the polled connection, read by _guarded_brpop_read.
    connection = self.client.connection
    self._in_poll = connection
    self._brpop_sent_at = monotonic()
    if lingering is None:
        _send(connection, command)
        return
    # The linger and the script in one write: the broker runs the script once the linger's
    # sleep is over (a connection's commands run in order), and both replies come back
    # together, so the event loop turns once for them, not once for each.
    reading.lingered = True
    _send(connection, lingering, command)


def _send(connection: Any, *commands: list[Any]) -> None:
    """``commands`` down ``connection`` in one write, as its ``send_command`` would send each,
    packed by hiredis (``redis_hooks.packed``: redis-py's packer encodes each argument in
    Python first, a few per cent of the main process at a fraction of capacity)."""
    connection.send_packed_command([redis_hooks.packed(connection, [tuple(c) for c in commands])])


def _read_wait(self: Any, **options: Any) -> NoReturn:
    """The reply to a wait: a message is queued (it stays where it was) or the wait timed
    out. Either way the script reads next; the item in the reply is not needed, and a large
    one is dropped from the socket unread (on a plain socket; TLS replies are parsed)."""
    reading = _reading(self)
    woke, reading.waking = reading.waking, False
    connection = self.client.connection
    try:
        peeked = redis_hooks.peek_bulk_reply(connection)
        if peeked is not None and peeked[1] > reserve.WAKE_READ_BYTES:
            header, size = peeked
            redis_hooks.discard(connection, header + size + 2)
        elif self.client.parse_response(connection, "BLMOVE", **options) is None:
            woke = False  # timed out: nothing is queued to gather for
    except self.connection_errors:
        connection.disconnect()  # as kombu: the next iteration reconnects
        raise
    except ResponseError as exc:
        code = str(exc).split(" ", 1)[0].upper()
        if isinstance(exc, OutOfMemoryError) or code == "OOM":
            # A full broker refuses BLMOVE, not the script: read next, sleep if nothing came.
            reading.full = reading.busy = True
            raise Empty() from None
        if probe.refused(exc) is not None:
            raise  # read-only, unblocked by a failover...: as a BRPOP would have been
        reading.no_wait = str(exc)
        logger.warning(
            "broker refused BLMOVE (%s; Redis >= 6.2 has it): an idle worker takes its next "
            "message with BRPOP, which loses it should the worker die before recording it",
            exc,
        )
        raise Empty() from None
    reading.busy = True
    if woke:
        now = monotonic()
        reading.linger = now - reading.woke_at < reserve.LINGER_HORIZON
        reading.woke_at = now
    raise Empty()


def _read_reserved(self: Any, sent: reserve.Request, **options: Any) -> bool:
    """Deliver what the reserve script took, in the order it took them.

    Should a delivery raise, the messages not yet delivered go back to the front of their
    lists before it propagates (else the recorded ones would wait for the visibility
    timeout).
    """
    reading = _reading(self)
    lingered, reading.lingered = reading.lingered, False
    try:
        try:
            if lingered:  # the linger's reply (nothing) comes first
                _read_linger(self, **options)
            reply = self.client.parse_response(self.client.connection, "EVALSHA", **options)
        except self.connection_errors:
            # As kombu: disconnect so that the next iteration reconnects. What the script
            # took is in unacked, delivered to nobody: handed back once the broker answers.
            self.client.connection.disconnect()
            raise
        except NoScriptError:
            lost_settles.lost.reserved(sent.score)
            reserve.load(self)  # the broker restarted or was flushed: again next time
            raise Empty() from None
        except ResponseError as exc:  # scripts refused (a replica, disabled): BRPOP it is
            lost_settles.lost.reserved(sent.score)
            if not reading.warned:
                logger.warning("broker refused the reserve script (%s): one BRPOP each", exc)
                reading.warned = True
            reading.brpop_next = True
            raise Empty() from None
    finally:
        self._in_poll = None
        _flush_reauth(self)
    batch = sent.parse(reply)
    # A batch cut short by the byte budget leaves messages queued: read again at once (a
    # wait would wake at once, and linger as if they had just arrived).
    reading.busy = sent.took_all_it_could(batch)
    if not batch:
        lost_settles.lost.reserved(sent.score)
        raise Empty()
    # The reservation stays this process's to hand back until every message it took was
    # delivered or put back: a put-back cut short leaves the rest in unacked.
    for done, reserved in enumerate(batch):
        try:
            if reserved.size is not None:  # the script set it aside unread: its last
                _refuse_aside(self, sent, reserved)
            else:
                _deliver(self, reserved.key, reserved.item, reserved.queue, reserved.tag)
        except BaseException:
            rest = batch[done + 1 :]
            reserve.put_back(self, [r for r in rest if r.size is None])
            for aside in (r for r in rest if r.size is not None):
                _requeue_aside(self, sent, aside)
            lost_settles.lost.reserved(sent.score)
            raise
    lost_settles.lost.reserved(sent.score)
    return True


def _read_linger(self: Any, **options: Any) -> None:
    """Read the reply to a linger sent ahead of a script call: nothing, after its sleep. An
    error (a failover unblocking it, say) only made the wait shorter: the script's reply
    follows either way, and says what the broker made of the script."""
    try:
        self.client.parse_response(self.client.connection, "XREAD", **options)
    except ResponseError as exc:
        logger.debug("the linger ended early: %s", exc)


def _refuse_aside(self: Any, sent: reserve.Request, reserved: reserve.Reserved) -> None:
    guard = oversize.guard_of(self)
    if guard is None or reserved.size is None:  # the script sets aside only with a guard
        raise RuntimeError("an item was set aside without a guard")
    oversize.record(
        self,
        guard,
        reserved.queue,
        reserved.key,
        sent.aside,
        reserved.item,
        reserved.size,
        oversize.BY_SCRIPT,
    )


def _requeue_aside(self: Any, sent: reserve.Request, reserved: reserve.Reserved) -> None:
    """Put an item set aside back in its queue: its delivery never came."""
    guard = oversize.guard_of(self)
    if guard is not None:
        with self.conn_or_acquire() as client:
            oversize.requeue(client, guard.keys, sent.aside, reserved.key)


def _guarded_brpop_read(self: Any, **options: Any) -> bool:
    """kombu's ``Channel._brpop_read`` with the decoding of the item guarded; or the
    reserve script's or a wait's reply, when that was sent instead (``_brpop_start``)."""
    reading = _reading(self)
    sent, reading.pending = reading.pending, None
    if sent is not None:
        return _read_reserved(self, sent, **options)
    try:
        if reading.waiting:
            reading.waiting = False
            _read_wait(self, **options)
        guard = oversize.guard_of(self)
        if guard is not None and oversize.take_reply(self, self.client.connection, guard):
            reading.busy = True  # an oversize item, set aside unread: more may be queued
            return True
        try:
            dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
        except self.connection_errors:
            # As kombu: disconnect so that the next iteration reconnects.
            self.client.connection.disconnect()
            raise
        if not dest__item:
            raise Empty()
        key, item = dest__item
        dest = _text(key).rsplit(self.sep, 1)[0]
        # More may be queued: the next read takes what the prefetch window has room for.
        reading.busy = True
        _deliver(self, key, item, dest, None)
        return True
    finally:
        self._in_poll = None
        _flush_reauth(self)


def install() -> bool:
    """Use the guarded reader in this process's Redis channels, where proven (idempotent).

    Returns False, having logged why once per process, on a kombu the hooks are not proven
    on: its stock reader then stays in place.
    """
    why = refusal()
    if why is not None:
        _announce_stock_path(why)
        return False
    kombu_redis.Channel._brpop_read = _guarded_brpop_read  # type: ignore[method-assign]
    kombu_redis.Channel._brpop_start = _brpop_start  # type: ignore[method-assign]
    kombu_redis.Channel.basic_consume = _basic_consume  # type: ignore[method-assign]
    kombu_redis.Channel.codecs = _CODECS
    return True


def installed() -> bool:
    return kombu_redis.Channel._brpop_read is _guarded_brpop_read


# -- bookkeeping of kombu's virtual QoS (Redis) ---------------------------------------------


def held_messages(qos: Any) -> int | None:
    """Messages the QoS delivered and that are not yet settled; None: not a virtual QoS."""
    delivered = getattr(qos, "_delivered", None)
    if delivered is None:
        return None
    return max(0, len(delivered) - len(getattr(qos, "_dirty", ())))


def held_tags(qos: Any) -> set[str]:
    """Tags of the messages the QoS delivered and that are not yet settled (none when it
    keeps no such bookkeeping)."""
    delivered = getattr(qos, "_delivered", None) or {}
    dirty = getattr(qos, "_dirty", ())
    return {str(tag) for tag in delivered if tag not in dirty}


def pending_reservation(channel: Any) -> str | None:
    """The score of the reserve script call whose reply ``channel`` waits for, if any."""
    reading: reserve.Reading | None = getattr(channel, "__dict__", {}).get("_checkpointq_reading")
    return reading.pending.score if reading is not None and reading.pending else None


def held_body_bytes(qos: Any) -> int:
    """Bytes of the bodies of the messages the QoS delivered and that are not yet settled."""
    dirty = qos._dirty
    return sum(len(m.body or b"") for tag, m in qos._delivered.items() if tag not in dirty)


def queue_key(channel: Any, queue: str, priority: int) -> str:
    """The Redis list kombu keeps ``queue``'s messages of ``priority`` in."""
    key: str = channel._q_for_pri(queue, priority)
    return key


def forget_locally(channel: Any, tag: Any) -> None:
    """Drop a delivered message from the QoS's local bookkeeping (its prefetch slot), telling
    the broker nothing; nothing happens on transports without that bookkeeping."""
    quick_ack = getattr(getattr(channel, "qos", None), "_quick_ack", None)
    if quick_ack is not None:
        quick_ack(tag)


def ack_pool(channel: Any) -> Any | None:
    """The connection pool ``channel``'s own clients take their connections from (what
    ``QoS.pipe_or_acquire`` acknowledges through), when commands may be hand-sent on it
    (``redis_hooks.transaction``): not with a global key prefix (kombu's client rewrites
    the key names itself), nor where redis-py's hand-sent path is not proven."""
    if getattr(channel, "global_keyprefix", None) or redis_hooks.refusal() is not None:
        return None
    return getattr(channel, "pool", None)


def detached(channel: Any) -> bool:
    """Whether ``channel``'s connection was closed under it: closing a kombu ``Connection``
    sets its transport's ``client`` to None (``pyamqp``'s connection's too), after which a
    settle on the channel fails with AttributeError (``conninfo.hostname``), not with a
    connection error. Unknown shapes count as attached: kombu's own errors then apply."""
    transport = getattr(channel, "connection", None)
    return transport is not None and getattr(transport, "client", False) is None


def unacked_indices(channel: Any) -> Any | None:
    """The channel's QoS when it keeps kombu's Redis ``unacked`` hash and index (what
    ``QoS._remove_from_indices`` removes a tag from), else None."""
    if not installed():
        return None  # not proven on this kombu: its own ack, one message at a time
    qos: Any = getattr(channel, "qos", None)
    return qos if getattr(qos, "_remove_from_indices", None) is not None else None


def settled_as_acked(qos: Any, message: Any, tag: Any) -> None:
    """Finish an acknowledgement whose broker half was written elsewhere, as ``Message.ack``
    would: the QoS forgets the tag and the message counts as acknowledged."""
    qos._quick_ack(tag)
    message._state = "ACK"


# -- kombu before 5.7: the sweep for abandoned messages, on the options' schedule ----------


def sweeps_on_schedule() -> bool:
    """Whether kombu sweeps ``unacked`` on the schedule its ``unacked_restore_interval`` and
    ``unacked_restore_throttle`` transport options set (5.7 on). Before, it ignores them and
    scans on every tenth call of a 10 s timer: a dead worker's messages came back up to
    100 s after the visibility timeout, not a tenth of it."""
    return hasattr(kombu_redis.Channel, "unacked_restore_throttle")


def install_restore_sweep(app: Any) -> None:
    """On a kombu that does not sweep on schedule, sweep every ``unacked_restore_interval``
    seconds of ``app``'s transport options from the consumer's timer, as kombu 5.7 does,
    through the Redis QoS's public ``restore_visible`` (which takes kombu's own mutex)."""
    interval = app.conf.broker_transport_options.get("unacked_restore_interval")
    if interval is None or sweeps_on_schedule():
        return

    class RestoreSweep(bootsteps.StartStopStep):  # type: ignore[misc]  # no celery hints
        requires = ("celery.worker.consumer.tasks:Tasks",)

        def __init__(self, consumer: Any, **kwargs: Any) -> None:
            self._tref: Any = None

        def start(self, consumer: Any) -> None:
            self._tref = consumer.timer.call_repeatedly(interval, _sweep, (consumer,))

        def stop(self, consumer: Any) -> None:
            if self._tref is not None:
                consumer.timer.cancel(self._tref)
                self._tref = None

        shutdown = stop

    app.steps["consumer"].add(RestoreSweep)


def _sweep(consumer: Any) -> None:
    """Hand out what the ``unacked`` index holds past the visibility timeout, now."""
    channel: Any = getattr(consumer.task_consumer, "channel", None)
    restore = getattr(getattr(channel, "qos", None), "restore_visible", None)
    if restore is None:  # not kombu's Redis transport
        return
    try:
        restore(num=channel.unacked_restore_limit, interval=1)
    except channel.connection_errors as exc:  # the consumer reconnects; next turn, again
        logger.debug("restore sweep skipped: %s", exc)


# -- the version check and self-test -----------------------------------------------------


def _flush_reauth(channel: Any) -> None:
    """kombu 5.7's flush of a pending streaming re-auth token; older lines have none."""
    flush = getattr(channel, "_flush_brpop_reauth", None)
    if flush is not None:
        flush()


#: The kombu functions the hooks copy (the reader, the delivery callback, the reserve
#: script's records, the grouped ack) or whose attributes they read.
_MIRRORED: dict[str, Any] = {
    "redis.Channel._brpop_read": _KOMBU_BRPOP_READ,
    "redis.Channel._brpop_start": _KOMBU_BRPOP_START,
    "redis.Channel.basic_consume": _KOMBU_BASIC_CONSUME,
    "redis.Channel._q_for_pri": kombu_redis.Channel._q_for_pri,
    "redis.QoS.append": kombu_redis.QoS.append,
    "redis.QoS._remove_from_indices": kombu_redis.QoS._remove_from_indices,
    "virtual.Channel.basic_consume": _KOMBU_VIRTUAL_BASIC_CONSUME,
    "virtual.QoS.__init__": virtual.QoS.__init__,
    "virtual.QoS.append": _VIRTUAL_QOS_APPEND,
    "virtual.Transport._deliver": virtual.Transport._deliver,
    "Message.ack": kombu_message.Message.ack,
}

#: What every proven line shares.
_SHARED = {
    "redis.Channel.basic_consume": "34e0da85e689ff98",
    "redis.Channel._q_for_pri": "f3997660680dd00f",
    "redis.QoS.append": "35c655f6ecc62fe6",
    "redis.QoS._remove_from_indices": "980a109d54ad9136",
    "virtual.Channel.basic_consume": "0fec962694938b61",
    "virtual.QoS.__init__": "86388d33d7d6fb40",
    "virtual.QoS.append": "b388f0cd6485c28a",
    "virtual.Transport._deliver": "799e242f3ec53863",
    "Message.ack": "b923c3d730afbd0b",
}

#: The sha256 (first 16 hex digits) of each ``_MIRRORED`` function's source, per kombu line
#: the hooks are proven on (5.5 and 5.6: no re-auth flush; 5.6 and 5.7 changed
#: ``_brpop_start``'s timeout).
PROVEN: dict[tuple[int, int], dict[str, str]] = {
    (5, 5): {
        **_SHARED,
        "redis.Channel._brpop_read": "9a9f7f5a6ad96f48",
        "redis.Channel._brpop_start": "1d125c1e720ad5a6",
    },
    (5, 6): {
        **_SHARED,
        "redis.Channel._brpop_read": "9a9f7f5a6ad96f48",
        "redis.Channel._brpop_start": "f2f311d862e9db9b",
    },
    (5, 7): {
        **_SHARED,
        "redis.Channel._brpop_read": "c42518699709f2df",
        "redis.Channel._brpop_start": "06723d707ddf2240",
    },
}


def _digest(function: Any) -> str:
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


def _self_test() -> str | None:
    """Why the attributes the hooks read are not what they expect, or None."""
    qos = virtual.QoS(_ProbeChannel())  # type: ignore[no-untyped-call]
    try:
        for name in ("_delivered", "_dirty", "_quick_ack"):
            if not hasattr(qos, name):
                return f"kombu's virtual QoS has no {name}"
        qos._quick_ack("probe")
        if "probe" not in qos._dirty:
            return "kombu's QoS._quick_ack no longer marks a tag settled"
        return None
    finally:
        finalizer = getattr(qos, "_on_collect", None)  # its restore at exit: nothing to restore
        if finalizer is not None:
            finalizer.cancel()


class _ProbeChannel:
    """The least of a channel a ``QoS`` needs to be made (and finalized) in the self-test."""

    do_restore = False


@cache
def refusal() -> str | None:
    """Why the hooks must not go in on the installed kombu, or None: they are proven there."""
    line = (int(kombu.VERSION[0]), int(kombu.VERSION[1]))
    expected = PROVEN.get(line)
    if expected is None:
        proven = ", ".join(f"{major}.{minor}" for major, minor in PROVEN)
        return f"kombu {kombu.__version__} is not a line they are proven on ({proven})"
    try:
        changed = [name for name, f in _MIRRORED.items() if _digest(f) != expected[name]]
    except (OSError, TypeError) as exc:  # no source shipped (a frozen or zipped install)
        return f"kombu {kombu.__version__}'s source cannot be read ({exc})"
    if changed:
        return f"kombu {kombu.__version__} changed {', '.join(changed)}"
    return _self_test()


@cache
def _announce_stock_path(why: str) -> None:
    logger.warning(
        "kombu hooks off: %s; the worker reads with kombu's stock Redis reader (one message "
        "per BRPOP, one ack each, and an item that is not a Celery message stops it as it "
        "stops stock Celery)",
        why,
    )
