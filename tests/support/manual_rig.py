"""An in-process coordinator on a manual clock: the runtime with no server and no sleeps.

Time moves only through `clock.advance(ms)`; `settle()` lets the tasks the last step
woke run to their next await (it yields to the event loop; no time passes).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from coordinator.core.events import BlockStored, EventBatch
from coordinator.core.profiles import DeploymentProfile, declared_profile
from coordinator.core.registry import RankPartRegistration
from coordinator.runtime.clock import ManualClock
from coordinator.runtime.config import CoordinatorConfig
from coordinator.runtime.coordinator import Coordinator, Outbound, Session, SessionEnd

CHAIN = tuple(bytes([i]) * 16 for i in range(1, 9))
PROFILE = DeploymentProfile(model="m", block_size=16, reuse_opt_in=True)


async def settle() -> None:
    """Runs what is ready on the loop (a few rounds: woken tasks wake others)."""
    for _ in range(10):
        await asyncio.sleep(0)


@dataclass
class Rig:
    clock: ManualClock
    coordinator: Coordinator

    def register(self, child_engine_id: str) -> Session:
        reg = RankPartRegistration(child_engine_id, 0, child_engine_id, (0, 0, 0), PROFILE)
        return self.coordinator.open_session(reg)

    def store(self, session: Session, chain: tuple[bytes, ...] = CHAIN) -> None:
        self.coordinator.inventory.ingest(
            session.registration.child_engine_id,
            (0, 0, 0),
            session.session_id,
            session.incarnation,
            EventBatch(session.incarnation, 0, (BlockStored(chain, None, 16 * len(chain)),)),
        )

    def heartbeat_all(self, *sessions: Session) -> None:
        for session in sessions:
            self.coordinator.heartbeat(session)

    async def advance(self, ms: int, *beating: Session, step_ms: int = 500) -> None:
        """Moves time by `ms` in steps, heartbeating `beating` at each step."""
        left = ms
        while left > 0:
            step = min(step_ms, left)
            self.clock.advance(step)
            self.heartbeat_all(*beating)
            await settle()
            left -= step


def drain_outbound(session: Session) -> list[Outbound | SessionEnd]:
    """Everything queued on the session right now (the engine's side of the stream)."""
    out: list[Outbound | SessionEnd] = []
    queue = session._queue  # the stream the engine would read; a test looks at it directly
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


@asynccontextmanager
async def manual_coordinator(**config: object) -> AsyncIterator[Rig]:
    clock = ManualClock()
    settings: dict[str, object] = {
        "reuse": True,
        "declared_profiles": (declared_profile("t", {"model": "m"}),),
        "metrics_port": -1,
        **config,
    }
    coordinator = Coordinator(CoordinatorConfig(**settings), clock=clock)  # type: ignore[arg-type]
    await coordinator.start()
    try:
        yield Rig(clock, coordinator)
    finally:
        await coordinator.shutdown()
