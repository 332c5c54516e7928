"""Both lease state machines under random orders of everything (tests/support/lease_machine.py)."""

from __future__ import annotations

from hypothesis import settings
from lease_machine import LeaseMachine

LeaseMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=80, deadline=None)
TestLeaseMachine = LeaseMachine.TestCase
