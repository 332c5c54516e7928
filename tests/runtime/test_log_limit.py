"""RateLimitedLog: one line per key per interval, on the injected clock, counting the rest."""

from __future__ import annotations

import logging

import pytest

from coordinator.runtime.clock import ManualClock
from coordinator.runtime.log_limit import RateLimitedLog

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
