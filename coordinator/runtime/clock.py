"""The runtime's one clock: monotonic time for every deadline, wall time for the wire only.

Every lease, pin, heartbeat and warm-up deadline runs on `monotonic_ms()`, so a
step of the host's wall clock (NTP, an operator, a VM resume) expires nothing
and extends nothing. Unix milliseconds exist only where the protocol carries
them: the gRPC edge converts with `to_unix_ms` / `from_unix_ms` at the moment of
encoding or decoding, and the state file stamps its write time.

`SystemClock` is the real one. `ManualClock` is for tests: time moves only
when the test calls `advance(ms)` (both clocks) or `step_wall(ms)` (the wall
clock alone), and due timers fire in deadline order inside `advance`.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Any, Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def monotonic_ms(self) -> int:
        """Milliseconds on a clock that never steps; the base of every deadline."""

    def wall_ms(self) -> int:
        """Unix milliseconds: for the wire and for persisted timestamps only."""

    def wall_offset_ms(self) -> int:
        """Unix ms minus monotonic ms now (moves when the wall clock steps)."""

    def call_later(self, delay_ms: int, callback: Callable[[], None]) -> Timer:
        """Runs `callback` once `delay_ms` of monotonic time has passed."""

    async def wait(self, event: asyncio.Event, timeout_ms: int) -> bool:
        """Waits for `event` at most `timeout_ms`; True when it was set."""


def to_unix_ms(clock: Clock, monotonic_ms: int) -> int:
    """A monotonic instant as the wire's unix ms (as of now: the offset is read each time)."""
    return monotonic_ms + clock.wall_offset_ms()


def from_unix_ms(clock: Clock, unix_ms: int) -> int:
    """A unix-ms instant from the wire on this process's monotonic clock."""
    return unix_ms - clock.wall_offset_ms()


class SystemClock:
    """The host's clocks and the running event loop's timers."""

    def __init__(self) -> None:
        self._offset_ms = self._read_offset_ms()

    @staticmethod
    def _read_offset_ms() -> int:
        # The wall read between two monotonic reads, the tightest of a few tries: a
        # preemption between the reads (a loaded host) would look like a wall step.
        best_gap_ns, offset_ns = -1, 0
        for _ in range(3):
            before = time.monotonic_ns()
            wall = time.time_ns()
            after = time.monotonic_ns()
            if best_gap_ns < 0 or after - before < best_gap_ns:
                best_gap_ns, offset_ns = after - before, wall - (before + after) // 2
            if best_gap_ns < 50_000:
                break
        return offset_ns // 1_000_000

    def wall_offset_ms(self) -> int:
        # Two reads a moment apart differ by a rounding ms now and then: keep the last
        # offset unless the wall clock really moved, so the same instant always encodes
        # to the same unix ms.
        now = self._read_offset_ms()
        if abs(now - self._offset_ms) > 1:
            self._offset_ms = now
        return self._offset_ms

    def monotonic_ms(self) -> int:
        return time.monotonic_ns() // 1_000_000

    def wall_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def call_later(self, delay_ms: int, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(max(delay_ms, 0) / 1000, callback)

    async def wait(self, event: asyncio.Event, timeout_ms: int) -> bool:
        if event.is_set():
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(timeout_ms, 0) / 1000)
            return True
        return False


class _ManualTimer:
    __slots__ = ("callback", "cancelled", "due_ms")

    def __init__(self, due_ms: int, callback: Callable[[], None]) -> None:
        self.due_ms = due_ms
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A clock that moves only when told to; timers fire inside `advance`."""

    def __init__(self, monotonic_ms: int = 1_000_000, wall_ms: int = 1_800_000_000_000) -> None:
        self._mono = monotonic_ms
        self._wall = wall_ms
        self._timers: list[tuple[int, int, _ManualTimer]] = []
        self._order = itertools.count()

    def monotonic_ms(self) -> int:
        return self._mono

    def wall_ms(self) -> int:
        return self._wall

    def wall_offset_ms(self) -> int:
        return self._wall - self._mono

    def call_later(self, delay_ms: int, callback: Callable[[], None]) -> Timer:
        timer = _ManualTimer(self._mono + max(delay_ms, 0), callback)
        heapq.heappush(self._timers, (timer.due_ms, next(self._order), timer))
        return timer

    async def wait(self, event: asyncio.Event, timeout_ms: int) -> bool:
        if event.is_set():
            return True
        timed_out: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = self.call_later(
            timeout_ms, lambda: None if timed_out.done() else timed_out.set_result(None)
        )
        waiter: asyncio.Future[Any] = asyncio.ensure_future(event.wait())
        both: set[asyncio.Future[Any]] = {waiter, timed_out}
        try:
            done, _ = await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
            return waiter in done
        finally:
            timer.cancel()
            waiter.cancel()
            timed_out.cancel()

    def advance(self, ms: int) -> int:
        """Moves both clocks by `ms`, firing due timers in order; returns how many fired."""
        if ms < 0:
            raise ValueError("monotonic time never goes back")
        until = self._mono + ms
        fired = 0
        while self._timers and self._timers[0][0] <= until:
            due, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._wall += due - self._mono
            self._mono = due
            timer.callback()
            fired += 1
        self._wall += until - self._mono
        self._mono = until
        return fired

    def step_wall(self, ms: int) -> None:
        """Steps the wall clock alone (either way), as NTP or an operator would."""
        self._wall += ms

    @property
    def pending_timers(self) -> int:
        return sum(1 for _, _, t in self._timers if not t.cancelled)
