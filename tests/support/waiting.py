"""The one way tests wait: poll a condition until it holds, or fail saying what never happened.

    from waiting import wait_until, wait_until_sync

    await wait_until(lambda: sink.seqs() == [0, 1], 5, what="both batches handed over")
    await wait_until(lease_ended, 10)            # an async predicate is awaited
    wait_until_sync(lambda: not processes_with(marker), 15)   # from a sync test

Tests outside tests/support never sleep for a fixed time to let something happen;
they wait for the observable condition that says it has happened. `harness`
re-exports `wait_until`.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


def _timed_out(timeout_s: float, what: str) -> TimeoutError:
    return TimeoutError(f"{what or 'condition'} not met within {timeout_s} s")


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]],
    timeout_s: float,
    *,
    interval_s: float = 0.02,
    what: str = "",
) -> float:
    """Polls `predicate` (sync, or returning an awaitable) until it is true.

    Returns the seconds it took; raises TimeoutError naming `what` once `timeout_s`
    has passed with the predicate still false. The predicate is always asked at
    least once, and once more after the deadline has passed.
    """
    started = time.monotonic()
    while True:
        expired = time.monotonic() - started > timeout_s
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return time.monotonic() - started
        if expired:
            raise _timed_out(timeout_s, what)
        await asyncio.sleep(interval_s)


def wait_until_sync(
    predicate: Callable[[], bool],
    timeout_s: float,
    *,
    interval_s: float = 0.02,
    what: str = "",
) -> float:
    """`wait_until` for synchronous tests: the same contract, blocking the calling thread."""
    started = time.monotonic()
    while True:
        expired = time.monotonic() - started > timeout_s
        if predicate():
            return time.monotonic() - started
        if expired:
            raise _timed_out(timeout_s, what)
        time.sleep(interval_s)
