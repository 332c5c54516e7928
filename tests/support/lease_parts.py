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

from clients.leases import LeaseClient, LeaseSessionHandler, PinCallback
from clients.session import EngineProfile, EngineSession, RankPartRegistration
from kvrc.vocabulary import TransferEndpoint


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
