"""How far ahead of the worker's clock a producer's ``seq`` may be.

A ``seq`` is the producer's clock in microseconds, and a session's fence keeps the highest
one applied. One producer whose clock runs an hour ahead would therefore win every fence for
that hour: each correct save and delete after it would be refused as stale, and a ``seq``
near 2**53 would freeze its session for the fence's whole lifetime. So the worker refuses a
``seq`` more than a tolerance ahead of its own clock, as invalid input: the request is
dead-lettered with the reason, to be replayed once the producer's clock is fixed.
"""

from __future__ import annotations

from checkpointq.store.base import validate_seq
from checkpointq.store.errors import InvalidInput
from checkpointq.tasks import runtime


def accepted_seq(value: object) -> int | None:
    """``value`` as a fence ``seq`` (``None``: stamped on apply), checked against the clock.

    Raises:
        InvalidInput: not an integer in ``[0, 2**53-1]``, or further ahead of this worker's
            clock than ``Runtime.max_seq_ahead_us``.
    """
    if value is None:
        return None
    seq = validate_seq(value)
    rt = runtime.current()
    ahead = seq - int(rt.store.clock() * 1_000_000)
    limit = rt.max_seq_ahead_us
    if ahead > limit:
        raise InvalidInput(
            f"{seq} is {ahead / 1e6:,.0f} s ahead of this worker's clock (at most "
            f"{limit / 1e6:,.0f} s allowed): a producer clock running ahead would make every "
            "later request for this session stale",
            field="seq",
        )
    return seq
