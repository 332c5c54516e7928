"""RateLimitedLog: one line per key per interval, on the injected clock, counting the rest.
LogBudget: engine lifecycle lines, a burst whole and then a sustained rate."""

from __future__ import annotations

import logging

import pytest

from coordinator.runtime.clock import ManualClock
from coordinator.runtime.log_limit import LogBudget, RateLimitedLog

LOGGER = "kvrc.test.log_limit"


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def _limited() -> tuple[ManualClock, RateLimitedLog]:
    clock = ManualClock(monotonic_ms=0)
    return clock, RateLimitedLog(logging.getLogger(LOGGER), clock.monotonic_ms, interval_ms=1_000)


def test_one_line_per_key_per_interval_then_the_count_of_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, limited = _limited()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in range(5):
            limited.warning("Lookup", "bad %d", i)
        limited.warning("Drain", "other key %d", 0)  # keys do not share an interval
        clock.advance(999)
        limited.warning("Lookup", "bad %d", 5)
        clock.advance(1)
        limited.warning("Lookup", "bad %d", 6)
        clock.advance(1_000)
        limited.warning("Lookup", "bad %d", 7)
    assert _lines(caplog) == [
        "bad 0",
        "other key 0",
        "bad 6 (5 more like it since the last such line, not logged)",
        "bad 7",
    ]
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in caplog.records)


def test_info_lines_are_limited_alike_and_nothing_is_counted_below_the_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, limited = _limited()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        limited.info("gap", "gap %d", 0)  # below the level: neither logged nor counted
    with caplog.at_level(logging.INFO, logger=LOGGER):
        limited.info("gap", "gap %d", 1)
        limited.info("gap", "gap %d", 2)
        clock.advance(1_000)
        limited.info("gap", "gap %d", 3)
    assert _lines(caplog) == [
        "gap 1",
        "gap 3 (1 more like it since the last such line, not logged)",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records)


def _budget() -> tuple[ManualClock, LogBudget, logging.Logger]:
    """A budget of 3 lines at once, then 2 a second, on a manual clock."""
    clock = ManualClock(monotonic_ms=0)
    return clock, LogBudget(clock.monotonic_ms, burst=3, lines_per_s=2.0), logging.getLogger(LOGGER)


def test_a_lifecycle_budget_logs_a_burst_whole_then_its_rate_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, budget, logger = _budget()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        budget.info(logger, "below %d", 0)  # below the level: neither logged nor spent
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for i in range(6):
            budget.info(logger, "part %d", i)
        clock.advance(499)  # not yet a whole line's refill (2 a second)
        budget.info(logger, "part %d", 6)
        clock.advance(1)
        budget.info(logger, "part %d", 7)
        budget.info(logger, "part %d", 8)
        clock.advance(60_000)  # a quiet minute refills the burst, never more
        for i in range(9, 13):
            budget.info(logger, "part %d", i)
    over = (
        "engine lifecycle lines are over their budget (3 at once, then 2 a second): "
        "counting them instead until there is room"
    )
    assert _lines(caplog) == [
        "part 0",
        "part 1",
        "part 2",
        over,
        "part 7 (4 engine lifecycle line(s) left out before this one)",
        # part 8: out again, but said at most once a minute (a steady loop would
        # otherwise get a warning after every admitted line: twice the rate)
        "part 9 (1 engine lifecycle line(s) left out before this one)",
        "part 10",
        "part 11",
        over,
    ]
    levels = [r.levelno for r in caplog.records if r.name == LOGGER]
    assert levels == [logging.WARNING if m == over else logging.INFO for m in _lines(caplog)]


def test_a_steady_loop_gets_the_budgets_rate_and_a_warning_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A review: the warning came after every admitted line, twice the stated rate."""
    clock, budget, logger = _budget()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(600 * 100):  # 100 lines a second for 10 minutes
            budget.info(logger, "cycle")
            clock.advance(10)
    levels = [r.levelno for r in caplog.records if r.name == LOGGER]
    assert levels.count(logging.WARNING) == 10  # one a minute
    assert levels.count(logging.INFO) <= 3 + 2 * 600
