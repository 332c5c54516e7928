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
