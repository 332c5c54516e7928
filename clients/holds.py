"""When a holder may free blocks on its own: kvrc's release never came.

A holder frees a lease's blocks when kvrc's ReleaseRequest arrives
(docs/invariants.md, I6-quiescence). As a safety net against a lost release it
frees them itself a while after the lease should have ended. Two rules keep
that net from ever freeing blocks a read may still reach:

- the wait runs on this process's monotonic clock. A pin's deadline arrives as
  the coordinator's wall-clock time, the latest moment kvrc can still decide to
  quarantine the lease (its abort timeout included); its remaining part is read
  once, clamped to `MAX_PIN_TTL_S`, so a step of either wall clock later moves
  nothing, and the grace covers the notice's way and the clocks' skew;
- a quarantined lease is never freed here: its outcome is unknown, only kvrc's
  release (every target part reported, or an operator resolved it) ends it.

Shared by the reference engine's leader and the vLLM connector's scheduler.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict

# A pin never released by kvrc is freed this long after its deadline.
PIN_SAFETY_GRACE_S = 60.0
# The deadline assumed for a PinRequest that names none.
DEFAULT_PIN_TTL_S = 60.0
# The longest a pin's deadline is believed ahead, whatever a wrong wall clock says. A
# deadline is when kvrc has ended or quarantined the lease at the latest: its pin
# timeout (at most 60 s) + transfer TTL (at most 600 s) + abort timeout (60 s by
# default, at most 1,800 s: coordinator/core/leases.py, MAX_ABORT_TIMEOUT_MS), so at
# most 2,460 s ahead.
MAX_PIN_TTL_S = 3600.0
# Quarantine notices remembered for holds that are not known here yet (bounded).
MAX_EARLY_QUARANTINES = 4096


def pin_hold_s(deadline_unix_ms: int, *, now_unix_s: float | None = None) -> float:
    """How long to keep a pin whose release never comes, from now."""
    if not deadline_unix_ms:
        return DEFAULT_PIN_TTL_S + PIN_SAFETY_GRACE_S
    now = time.time() if now_unix_s is None else now_unix_s
    left_s = min(max(0.0, deadline_unix_ms / 1000 - now), MAX_PIN_TTL_S)
    return left_s + PIN_SAFETY_GRACE_S


class HoldDeadlines:
    """lease id -> the monotonic time its blocks may be freed without kvrc's release."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}
        self._early_quarantine: OrderedDict[str, None] = OrderedDict()

    def hold(self, lease_id: str, hold_s: float, *, now: float | None = None) -> None:
        """Start (or keep) the net for `lease_id`; a quarantine that came first stays."""
        if lease_id in self._until:
            return
        if lease_id in self._early_quarantine:
            del self._early_quarantine[lease_id]
            self._until[lease_id] = math.inf
            return
        self._until[lease_id] = (time.monotonic() if now is None else now) + hold_s

    def quarantine(self, lease_id: str) -> None:
        """kvrc quarantined the lease: never free its blocks here."""
        if lease_id in self._until:
            self._until[lease_id] = math.inf
            return
        self._early_quarantine[lease_id] = None
        while len(self._early_quarantine) > MAX_EARLY_QUARANTINES:
            self._early_quarantine.popitem(last=False)

    def discard(self, lease_id: str) -> bool:
        """kvrc released the lease (or the blocks were freed): forget it."""
        self._early_quarantine.pop(lease_id, None)
        return self._until.pop(lease_id, None) is not None

    def is_quarantined(self, lease_id: str) -> bool:
        return self._until.get(lease_id) == math.inf or lease_id in self._early_quarantine

    def overdue(self, *, now: float | None = None) -> list[str]:
        """Leases whose net fired; they are forgotten here (the caller frees the blocks)."""
        now = time.monotonic() if now is None else now
        late = [lease_id for lease_id, until in self._until.items() if until <= now]
        for lease_id in late:
            del self._until[lease_id]
        return late

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._until

    def __len__(self) -> int:
        return len(self._until)
