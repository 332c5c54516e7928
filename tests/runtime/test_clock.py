"""The manual clock itself: timers fire in deadline order inside advance(), waits time out."""

from __future__ import annotations

import asyncio

import pytest
from manual_rig import settle

from coordinator.runtime.clock import ManualClock, SystemClock, from_unix_ms, to_unix_ms


def test_timers_fire_in_deadline_order_at_their_instant() -> None:
    clock = ManualClock(monotonic_ms=0, wall_ms=1_000)
    seen: list[tuple[str, int]] = []
    clock.call_later(30, lambda: seen.append(("c", clock.monotonic_ms())))
    clock.call_later(10, lambda: seen.append(("a", clock.monotonic_ms())))
    cancelled = clock.call_later(20, lambda: seen.append(("x", clock.monotonic_ms())))
    clock.call_later(10, lambda: seen.append(("b", clock.monotonic_ms())))
    cancelled.cancel()
    assert clock.advance(9) == 0 and seen == []
    assert clock.advance(100) == 3
    assert seen == [("a", 10), ("b", 10), ("c", 30)]
    assert clock.monotonic_ms() == 109 and clock.wall_ms() == 1_109
    with pytest.raises(ValueError, match="never goes back"):
        clock.advance(-1)


def test_a_wall_step_moves_the_wire_conversion_but_no_deadline() -> None:
    clock = ManualClock(monotonic_ms=5_000, wall_ms=1_000_000)
    fired: list[int] = []
    clock.call_later(1_000, lambda: fired.append(clock.monotonic_ms()))
    assert to_unix_ms(clock, 6_000) == 1_001_000
    clock.step_wall(3_600_000)
    assert to_unix_ms(clock, 6_000) == 4_601_000  # the wire tells the new wall time
    assert from_unix_ms(clock, 4_601_000) == 6_000
    assert clock.advance(999) == 0 and fired == []
    clock.step_wall(-7_200_000)
    assert clock.advance(1) == 1 and fired == [6_000]


async def test_wait_returns_on_the_event_or_at_the_timeout() -> None:
    clock = ManualClock()
    event = asyncio.Event()
    waiter = asyncio.ensure_future(clock.wait(event, 100))
    await settle()
    clock.advance(99)
    await settle()
    assert not waiter.done()
    event.set()
    assert await waiter is True
    timed = asyncio.ensure_future(clock.wait(asyncio.Event(), 100))
    await settle()
    clock.advance(100)
    assert await timed is False
    assert clock.pending_timers == 0


def test_the_system_clock_reads_both_clocks() -> None:
    clock = SystemClock()
    # Equal within the instants between the reads (the two clocks have different bases).
    assert abs(from_unix_ms(clock, to_unix_ms(clock, 1_000)) - 1_000) <= 2


def test_the_system_clock_encodes_one_instant_to_one_unix_ms() -> None:
    # Status answers compared byte for byte must not jitter by a rounding millisecond.
    clock = SystemClock()
    assert len({to_unix_ms(clock, 5_000) for _ in range(10_000)}) == 1
