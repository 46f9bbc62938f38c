"""How a producer notices a broker that went back in time, and what it keeps to recover
(``EpochWatch``, ``RecentPublishes`` in tasks/producer/pending.py; issue 44)."""

from __future__ import annotations

from checkpointq.tasks.producer.pending import (
    EpochWatch,
    RecentPublishes,
    RecordWrite,
    Seen,
    ring_token,
)


def test_a_mark_below_one_seen_before_is_one_loss_reported_with_the_next_publish() -> None:
    watch = EpochWatch()
    assert not watch.observe(b"e1", 5, below=1)
    assert not watch.observe(b"e1", 9, below=watch.floor().mark + 1)
    # A reply sent before the mark reached 9 may come back after it: not a loss
    assert not watch.observe(b"e1", 7, below=5)
    # A read sent once 9 was seen, answered with 4: the broker went back
    assert watch.observe(b"e1", 4, below=watch.floor().mark)
    assert watch.changes == 1
    # Reads that follow judge by the new mark; the next publish reports what was seen
    assert not watch.observe(b"e1", 4, below=watch.floor().mark)
    assert watch.seen() == ("e1", 9, "")
    # The publish that reports it turns the epoch: the same loss, not counted again
    assert not watch.observe(b"e2", 5, below=watch.floor().mark + 1, found=True)
    assert watch.changes == 1 and watch.seen() == ("e2", 5, "")


def test_an_epoch_turned_by_another_producer_is_a_loss() -> None:
    watch = EpochWatch()
    watch.observe(b"e1", 3, below=1)
    assert watch.observe(b"e2", 2, below=4)
    assert watch.changes == 1 and watch.seen() == ("e2", 2, "")
    assert watch.observe(None)  # and a broker that lost everything
    assert watch.changes == 2


def test_a_mark_seen_held_by_another_publish_is_one_loss_reported_with_its_token() -> None:
    # Finding 7: the broker lost mark 9 (token "a9"), and unaware publishes brought the
    # counter back above it; the mark alone says nothing, the token does.
    watch = EpochWatch()
    watch.observe(b"e1", 9, below=1, token="a9")
    seen = watch.floor()
    assert seen == Seen(9, "a9")
    assert watch.observe(b"e1", 12, below=seen.mark, token="c12", forked=seen)
    assert watch.changes == 1
    # A concurrent read sent before it, answered after: the same loss, not counted again
    assert not watch.observe(b"e1", 12, below=seen.mark, forked=seen)
    # The next publish sends the lost mark and token, for the script to turn the epoch
    assert watch.seen() == ("e1", 9, "a9")
    assert not watch.observe(b"e2", 13, below=13, found=True, token="d13")
    assert watch.changes == 1 and watch.seen() == ("e2", 13, "d13")


def test_a_mark_is_kept_with_its_token_and_a_token_learnt_late_completes_it() -> None:
    watch = EpochWatch()
    watch.observe(b"e1", 5, below=1)
    assert watch.floor() == Seen(5, "")
    watch.observe(b"e1", 5, below=5, token="f5")  # a load told the same mark's token
    assert watch.floor() == Seen(5, "f5")
    watch.observe(b"e1", 4, below=3, token="e4")  # an older reply: neither mark nor token
    assert watch.floor() == Seen(5, "f5")


def test_a_ring_slot_tells_the_token_of_its_own_mark_only() -> None:
    assert ring_token(b"7:ab12", 7) == "ab12"
    assert ring_token(b"65543:ab12", 7) == ""  # overwritten 65536 publishes later
    assert ring_token(None, 7) == ""  # never written (an older producer's publish)


def test_the_window_is_bounded_by_age_count_and_bytes() -> None:
    now = [0.0]
    recent = RecentPublishes(seconds=10, requests=3, max_bytes=100, clock=lambda: now[0])
    record = RecordWrite("s", 1, "save", "r", b"v" * 10)
    for n in range(5):
        recent.add("q", b"m%d" % n, [record])
    assert [p.message for p in recent.take()] == [b"m2", b"m3", b"m4"]  # by count
    recent.add("q", b"x" * 80, [record])
    assert [p.message for p in recent.take()] == [b"x" * 80]  # by bytes (90 of 100)
    assert recent.bytes == 90
    now[0] = 11.0
    assert recent.take() == [] and recent.bytes == 0  # by age
    RecentPublishes(seconds=0).add("q", b"m", [record])  # off: keeps nothing
