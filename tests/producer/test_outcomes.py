"""What ``wait_durable`` answers for a request, from the fence and its deadline alone
(``tasks/producer/outcomes.py``): the order of requests decides, not arrival."""

from __future__ import annotations

import pytest

from checkpointq.store.base import Fence
from checkpointq.tasks.messages import DELETE, SAVE
from checkpointq.tasks.producer.outcomes import APPLIED, EXPIRED, SUPERSEDED, decide

SEQ = 1_800_000_000_000_000


@pytest.mark.parametrize(
    ("task", "fence", "lapsed", "expected"),
    [
        (SAVE, Fence(SEQ, False, "m"), False, APPLIED),
        (SAVE, Fence(SEQ, False, "m", lapsed=True), False, EXPIRED),
        (SAVE, Fence(SEQ + 1, False, "a"), False, SUPERSEDED),
        (SAVE, Fence(SEQ, True, "a"), False, SUPERSEDED),  # a delete stamped alike
        (SAVE, Fence(SEQ, False, "z"), False, SUPERSEDED),  # ordered after by its id
        (SAVE, Fence(SEQ, False, "a"), False, None),  # ordered before: may still apply
        (DELETE, Fence(SEQ, False, "z"), False, None),  # a delete wins over a save alike
        (DELETE, Fence(SEQ, True, "z"), False, SUPERSEDED),
        # the request id alone is not the request (issue 44): a reuse of it by another
        # request, ordered after (superseded) or before (still on its way), or of another kind
        (SAVE, Fence(SEQ + 1, False, "m"), False, SUPERSEDED),
        (SAVE, Fence(SEQ - 1, False, "m"), False, None),
        (SAVE, Fence(SEQ, True, "m"), False, SUPERSEDED),
        (DELETE, Fence(SEQ, False, "m"), False, None),
        (DELETE, Fence(SEQ, True, "m"), False, APPLIED),
        (SAVE, None, False, None),
        (SAVE, None, True, EXPIRED),
        (SAVE, Fence(SEQ - 1, False, "a"), True, EXPIRED),
        # a delete applies at any age: past its deadline it is still on its way
        (DELETE, None, True, None),
        (DELETE, Fence(SEQ - 1, False, "a"), True, None),
    ],
)
def test_decide(task: str, fence: Fence | None, lapsed: bool, expected: str | None) -> None:
    outcome = decide(task, "m", SEQ, fence, lapsed)
    assert (outcome.outcome if outcome else None) == expected
