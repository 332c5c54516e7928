"""The holder's safety net (clients/holds.py): frees what kvrc forgot, never a quarantine."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from clients.holds import MAX_PIN_TTL_S, PIN_SAFETY_GRACE_S, HoldDeadlines, pin_hold_s

NOW_UNIX_S = 1_800_000_000.0


def test_an_unreleased_pin_is_freed_after_its_deadline_and_the_grace() -> None:
    nets = HoldDeadlines()
    nets.hold("pl-a", pin_hold_s(int((NOW_UNIX_S + 5) * 1000), now_unix_s=NOW_UNIX_S), now=100.0)
    assert nets.overdue(now=100.0 + 5 + PIN_SAFETY_GRACE_S - 0.01) == []
    assert nets.overdue(now=100.0 + 5 + PIN_SAFETY_GRACE_S) == ["pl-a"]
    assert "pl-a" not in nets and nets.overdue(now=math.inf) == []


def test_a_quarantined_lease_is_never_freed_by_the_net() -> None:
    nets = HoldDeadlines()
    nets.hold("pl-q", 1.0, now=0.0)
    nets.hold("pl-n", 1.0, now=0.0)  # the control: not quarantined
    nets.quarantine("pl-q")
    assert nets.overdue(now=1e12) == ["pl-n"]
    assert nets.is_quarantined("pl-q") and "pl-q" in nets
    assert nets.discard("pl-q") and not nets.is_quarantined("pl-q")  # kvrc's release ends it


def test_a_quarantine_that_comes_before_the_hold_still_counts() -> None:
    nets = HoldDeadlines()
    nets.quarantine("ho-early")
    assert nets.is_quarantined("ho-early")
    nets.hold("ho-early", 1.0, now=0.0)
    assert nets.overdue(now=1e12) == []


def test_a_second_hold_does_not_move_the_first_deadline() -> None:
    nets = HoldDeadlines()
    nets.hold("pl-a", 1.0, now=0.0)
    nets.hold("pl-a", 1000.0, now=0.5)  # another rank part of the engine asked too
    assert nets.overdue(now=1.0) == ["pl-a"]


@given(
    step_s=st.floats(min_value=-7200, max_value=7200), ttl_s=st.floats(min_value=0, max_value=900)
)
def test_the_hold_is_bounded_whatever_the_coordinators_wall_clock_says(
    step_s: float, ttl_s: float
) -> None:
    # The deadline comes from kvrc's wall clock, which may have stepped by `step_s`.
    deadline_ms = int((NOW_UNIX_S + step_s + ttl_s) * 1000)
    hold_s = pin_hold_s(deadline_ms, now_unix_s=NOW_UNIX_S)
    assert PIN_SAFETY_GRACE_S <= hold_s <= MAX_PIN_TTL_S + PIN_SAFETY_GRACE_S
    # Never shorter than the grace: a step back cannot make the net fire at once.
    nets = HoldDeadlines()
    nets.hold("pl-a", hold_s, now=0.0)
    assert nets.overdue(now=PIN_SAFETY_GRACE_S - 0.001) == []
