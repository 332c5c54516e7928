"""clients/session.py against a real coordinator: a SessionError reaches the operator.

When the coordinator ends a session for what the engine sent (INVALID_ARGUMENT), it
says why in a `SessionError` message before the status. `EngineSession` raises (at
`start()`) or records and logs (later) exactly that text, typed by its code.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import grpc
import pytest
from harness import CoordinatorProcess, start_coordinator

from clients.errors import InvalidArgumentError
from clients.session import EngineProfile, EngineSession, RankPartRegistration, SessionHandler
from kvrc.v1 import kvrc_pb2 as pb


@pytest.fixture(scope="module")
def kvrc() -> Iterator[CoordinatorProcess]:
    with start_coordinator() as coordinator:
        yield coordinator


def registration(engine_id: str, block_size: int = 16) -> RankPartRegistration:
    return RankPartRegistration(
        engine_id=engine_id, profile=EngineProfile(model="m", block_size=block_size)
    )


async def test_a_refused_register_raises_the_coordinators_words(kvrc: CoordinatorProcess) -> None:
    session = EngineSession(kvrc.grpc_target, registration("bad-block", 0), reconnect=False)
    with pytest.raises(InvalidArgumentError) as raised:
        await session.start()
    assert raised.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "profile.block_size must be >= 1" in raised.value.message
    await session.close()


async def test_a_protocol_error_later_is_recorded_and_logged_with_its_text(
    kvrc: CoordinatorProcess, caplog: pytest.LogCaptureFixture
) -> None:
    session = EngineSession(kvrc.grpc_target, registration("violator"), reconnect=False)
    await session.start()
    caplog.set_level(logging.WARNING, logger="kvrc.client")
    try:
        # An empty EngineMessage breaks the protocol: the coordinator ends the session.
        await session._send(pb.EngineMessage())
        for _ in range(200):
            if session.last_error is not None and not session.connected:
                break
            await asyncio.sleep(0.025)
        error = session.last_error
        assert isinstance(error, InvalidArgumentError), error
        assert "empty or unknown EngineMessage" in error.message
        said = [r.getMessage() for r in caplog.records if "ended the session" in r.getMessage()]
        assert len(said) == 1, said
        assert "violator" in said[0] and "empty or unknown EngineMessage" in said[0]
        assert kvrc.grpc_target in said[0]
    finally:
        await session.close()


async def test_a_caller_cancelled_mid_write_does_not_end_the_session(
    kvrc: CoordinatorProcess,
) -> None:
    """grpc.aio cancels the whole call when the task awaiting a write is cancelled: an
    engine task cancelled while it sent a PinResult or a session call (its request went
    away) ended the session of every other caller, lost what they had in flight, and
    made the part register again."""
    session = EngineSession(kvrc.grpc_target, registration("canceller"), reconnect=False)
    await session.start()
    try:
        stream = session._call
        assert stream is not None
        for i in range(20):
            beat = pb.Heartbeat(client_time_unix_ms=i)
            writer = asyncio.ensure_future(session._send(pb.EngineMessage(heartbeat=beat)))
            await asyncio.sleep(0)  # the write has begun
            writer.cancel()
            with pytest.raises(asyncio.CancelledError):
                await writer
        await asyncio.sleep(0.2)
        assert session.connected and session._call is stream and not stream.done()
        assert session.last_error is None
        # The stream still carries what comes next.
        await session._send(pb.EngineMessage(heartbeat=pb.Heartbeat(client_time_unix_ms=99)))
        await asyncio.sleep(0.2)
        assert not stream.done()
    finally:
        await session.close()


async def test_a_handler_that_raises_cancelled_does_not_stop_the_handling() -> None:
    """A handler that awaited a future someone else cancelled raised CancelledError,
    which ended the handling task silently: the inbox filled, the reader blocked on it
    and the part never read its session again. Now it is logged, as a handler's error."""

    class Flaky(SessionHandler):
        def __init__(self) -> None:
            self.seen: list[str] = []

        async def on_drain_notice(self, notice: pb.DrainNotice) -> None:
            self.seen.append(notice.child_engine_id)
            if notice.child_engine_id == "first":
                cancelled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                cancelled.cancel()
                await cancelled  # raises CancelledError; this task was not cancelled

    handler = Flaky()
    session = EngineSession("127.0.0.1:1", registration("flaky"), handler, reconnect=False)
    inbox: asyncio.Queue[pb.CoordinatorMessage | None] = asyncio.Queue()
    for which in ("first", "second"):
        notice = pb.DrainNotice(child_engine_id=which)
        await inbox.put(pb.CoordinatorMessage(drain_notice=notice))
    await inbox.put(None)
    await asyncio.wait_for(session._handle(inbox), 5)
    assert handler.seen == ["first", "second"]
