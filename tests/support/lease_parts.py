"""In-process rank parts with a lease client each, against a real coordinator process.

    @pytest.fixture
    async def parts(kvrc) -> AsyncIterator[Parts]:
        async with Parts.open(kvrc.grpc_target) as p:
            yield p

    session, client = await parts.part("holder", handler=LeaseSessionHandler(pin=...))

`pin` and `endpoint` given to `open` are every part's defaults (a handler that pins
with `pin`, the KV regions it registers).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from harness import child_engine_status, wait_until

from clients.leases import LeaseClient, LeaseSessionHandler, PinCallback
from clients.session import EngineProfile, EngineSession, RankPartRegistration
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.vocabulary import TransferEndpoint


async def store_blocks(session: EngineSession, hashes: list[bytes]) -> None:
    """Publishes `hashes` as stored on the GPU tier; returns once kvrc's inventory has them."""
    assert session.ack is not None
    await session.send_event_batch(
        pb.EventBatch(
            incarnation=session.ack.incarnation,
            sequence=0,
            events=[
                pb.InventoryEvent(stored=pb.BlockStored(block_hashes=hashes, tier=pb.TIER_GPU))
            ],
        )
    )
    child = session.ack.state.child_engine_id

    async def visible() -> bool:
        state = await child_engine_status(session.target, child)
        return state is not None and state.inventory_entries >= len(hashes)

    await wait_until(visible, 5, what="the stored blocks in the coordinator's inventory")


class Parts:
    """In-process rank parts (one per child engine), closed at the end of a test."""

    def __init__(
        self,
        target: str,
        *,
        pin: PinCallback | None = None,
        endpoint: TransferEndpoint | None = None,
    ) -> None:
        self.target = target
        self.pin = pin
        self.endpoint = endpoint if endpoint is not None else TransferEndpoint()
        self.sessions: list[EngineSession] = []
        self.clients: list[LeaseClient] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        target: str,
        *,
        pin: PinCallback | None = None,
        endpoint: TransferEndpoint | None = None,
    ) -> AsyncIterator[Parts]:
        parts = cls(target, pin=pin, endpoint=endpoint)
        try:
            yield parts
        finally:
            for client in parts.clients:
                await client.close()
            for session in parts.sessions:
                await session.close()

    async def part(
        self, engine_id: str, handler: LeaseSessionHandler | None = None
    ) -> tuple[EngineSession, LeaseClient]:
        registration = RankPartRegistration(
            engine_id=engine_id,
            profile=EngineProfile(model="m", block_size=16, reuse_opt_in=True),
            endpoint=self.endpoint,
        )
        if handler is None:
            handler = LeaseSessionHandler(pin=self.pin) if self.pin else LeaseSessionHandler()
        session = EngineSession(self.target, registration, handler, reconnect=False)
        handler.attach(session)
        await session.start()
        await session.wait_ready(5)
        client = LeaseClient(self.target, engine_id, timeout_s=10)
        self.sessions.append(session)
        self.clients.append(client)
        return session, client
