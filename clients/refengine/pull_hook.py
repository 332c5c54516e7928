"""The seam around one rank part's pull: what runs between a grant and its read.

A `RankPart` calls its `PullHook` once per pull, after the read is planned and
before it is submitted, with the plan it is about to read; it reads the plan
the hook returns. Production engines pass none (`NO_PULL_HOOK` returns the plan
unchanged). Tests pass a hook at start (`run_from_args(args, pull_hook=...)`)
that provokes real failures on purpose: tests/support/refengine_faults.py.

A hook may wait: the pull is tracked while it runs, so an AbortRequest for the
lease waits for it too, and a lease aborted meanwhile never starts its read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from clients.transfer import TransferPlan


@dataclass(frozen=True, slots=True)
class PullContext:
    """Which pull is about to read: the driver's request, its lease, this rank part."""

    flow: str  # "prefix_load" or "handoff"
    request_id: str
    lease_id: str
    tp_rank: int


class PullHook(Protocol):
    async def before_pull(self, context: PullContext, plan: TransferPlan) -> TransferPlan:
        """The plan this rank part reads (`plan` itself unless the hook changes it)."""
        ...


class NoPullHook:
    """Production: reads what was planned, at once."""

    async def before_pull(self, context: PullContext, plan: TransferPlan) -> TransferPlan:
        return plan


NO_PULL_HOOK: PullHook = NoPullHook()
