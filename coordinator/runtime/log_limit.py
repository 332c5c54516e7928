"""At most one log line per key per interval, for lines any peer can trigger at will.

A client sending garbage in a loop must not fill the coordinator's log (or its
disk): the first line of a key is logged, the next ones within `interval_ms`
are only counted, and the next line logged says how many were left out.
Keys must be few (a method name, never a peer): each one is remembered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

# What kvrc's own limiters use: one line per key per 10 s.
DEFAULT_INTERVAL_MS = 10_000
# Appended to the next line logged, with the count of those left out before it.
LEFT_OUT = " (%d more like it since the last such line, not logged)"


class RateLimitedLog:
    """`now_ms`: a monotonic clock in ms (`Clock.monotonic_ms`, or the caller's own)."""

    def __init__(
        self,
        logger: logging.Logger,
        now_ms: Callable[[], int],
        interval_ms: int = DEFAULT_INTERVAL_MS,
    ) -> None:
        self._logger = logger
        self._now_ms = now_ms
        self._interval_ms = interval_ms
        self._last_logged_ms: dict[str, int] = {}
        self._left_out: dict[str, int] = {}

    def warning(self, key: str, message: str, *args: object) -> None:
        """Logs `message % args` as one line unless `key` logged one within the interval."""
        self._log(logging.WARNING, key, message, args)

    def info(self, key: str, message: str, *args: object) -> None:
        """`warning`, at INFO."""
        self._log(logging.INFO, key, message, args)

    def admit(self, key: str) -> int | None:
        """Whether a line of `key` may be logged now: None if one was within the interval
        (this one is counted), else how many were left out since the last."""
        now = self._now_ms()
        last = self._last_logged_ms.get(key)
        if last is not None and now - last < self._interval_ms:
            self._left_out[key] = self._left_out.get(key, 0) + 1
            return None
        self._last_logged_ms[key] = now
        return self._left_out.pop(key, 0)

    def _log(self, level: int, key: str, message: str, args: tuple[object, ...]) -> None:
        if not self._logger.isEnabledFor(level):
            return
        left_out = self.admit(key)
        if left_out is None:
            return
        if left_out:
            message += LEFT_OUT
            args = (*args, left_out)
        self._logger.log(level, message, *args)


# A lifecycle budget's burst: a 64-engine, tp=8 cluster restarting whole (its parts
# leaving and registering again, every engine not READY, left, READY) writes ~1,300.
LIFECYCLE_BURST = 2_000
# Its sustained rate once the burst is spent: ~86,000 lines (~12 MB) a day at most.
LIFECYCLE_LINES_PER_S = 1.0
# A budget says it ran out at most this often.
BUDGET_WARNING_INTERVAL_MS = 60_000


class LogBudget:
    """Lines that peers trigger in the normal course of their lives (a rank part
    registers or leaves, a child engine turns READY or goes, a lease is aborted): each
    is worth a line, so a burst is logged whole, but a client that registers and closes
    (or opens and abandons leases) in a loop must not fill the log (I8-bad-input). A
    token bucket shared by every line of one kind (`what`): `burst` lines at once, then
    `lines_per_s`. The first line left out in a row says so (at most once a minute);
    the next line logged carries the count of those left out."""

    def __init__(
        self,
        now_ms: Callable[[], int],
        what: str = "engine lifecycle",
        burst: int = LIFECYCLE_BURST,
        lines_per_s: float = LIFECYCLE_LINES_PER_S,
    ) -> None:
        self._now_ms = now_ms
        self._what = what
        self._burst = float(burst)
        self._per_ms = lines_per_s / 1000.0
        self._tokens = float(burst)
        self._filled_ms: int | None = None
        self._left_out = 0
        self._warned_ms: int | None = None

    def info(self, logger: logging.Logger, message: str, *args: object) -> None:
        """Logs `message % args` at INFO on `logger` if the budget has a line left."""
        self._log(logger, logging.INFO, message, args)

    def warning(self, logger: logging.Logger, message: str, *args: object) -> None:
        """`info`, at WARNING (from the same budget)."""
        self._log(logger, logging.WARNING, message, args)

    def _log(
        self, logger: logging.Logger, level: int, message: str, args: tuple[object, ...]
    ) -> None:
        if not logger.isEnabledFor(level):
            return
        now = self._now_ms()
        if self._filled_ms is not None:
            self._tokens = min(self._burst, self._tokens + (now - self._filled_ms) * self._per_ms)
        self._filled_ms = now
        if self._tokens < 1.0:
            # Once per minute at most: under a steady loop the budget admits a line now
            # and then, and a warning after each would double what it lets through.
            if not self._left_out and (
                self._warned_ms is None or now - self._warned_ms >= BUDGET_WARNING_INTERVAL_MS
            ):
                self._warned_ms = now
                logger.warning(
                    "%s lines are over their budget (%d at once, then %g a second): "
                    "counting them instead until there is room",
                    self._what,
                    int(self._burst),
                    self._per_ms * 1000.0,
                )
            self._left_out += 1
            return
        self._tokens -= 1.0
        if self._left_out:
            message += f" (%d {self._what} line(s) left out before this one)"
            args = (*args, self._left_out)
            self._left_out = 0
        logger.log(level, message, *args)
