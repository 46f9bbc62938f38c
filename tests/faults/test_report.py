"""docs/reliability.md is what ``python -m tests.faults.report`` renders: the long run's rows
and the hand-written part (tests/faults/report_settings.md). A fix to the page goes into
the template or a row, or the next run of the generator drops it."""

from __future__ import annotations

from tests.faults import report


def test_the_generator_reproduces_the_reliability_page() -> None:
    rendered = report.render("long")
    page = report.TARGET.read_text()
    assert rendered == page, (
        "docs/reliability.md differs from `python -m tests.faults.report`: edit "
        "tests/faults/report_settings.md (or the row's JSON under tests/faults/results/long), "
        "then run the generator"
    )
