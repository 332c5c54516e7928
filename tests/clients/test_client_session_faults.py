"""clients/session.py against a coordinator that freezes, restarts or disappears.

SIGSTOP of a real `kvrc serve` is a frozen (or partitioned) coordinator: its TCP
connections stay open, nothing answers. The session must notice (silence past the
heartbeat timeout, or a write that cannot complete), break the stream and reconnect
or fail over; `close()` must keep its timeout; a kvrc that is back must be reached
within about the client's backoff, not grpc's (up to 120 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from harness import (
    CoordinatorProcess,
    coordinator_off_loop,
    free_port,
    start_coordinator,
    wait_until,
)

import clients.session as session_module
from clients.errors import UnavailableError
from clients.inventory import InventoryPublisher
from clients.refengine.engine import Leader, UnsentEventsLog
from clients.session import (
    EngineProfile,
    EngineSession,
    NullHandler,
    RankPartRegistration,
    RegisterAck,
)
from kvrc.credentials import ChannelOptions, connect
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.vocabulary import Tier

# Short heartbeats: a frozen coordinator is noticed within about a second.
FAST_HEARTBEATS = ("--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", "1000")


def registration(engine_id: str) -> RankPartRegistration:
    return RankPartRegistration(
        engine_id=engine_id, profile=EngineProfile(model="m", block_size=16)
    )


@contextlib.contextmanager
def frozen(kvrc: CoordinatorProcess) -> Iterator[None]:
    """SIGSTOP for the block; SIGCONT always (the harness then stops it cleanly)."""
    os.kill(kvrc.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(kvrc.process.pid, signal.SIGCONT)


# --- 1. a frozen coordinator is detected ------------------------------------------------


async def test_a_frozen_coordinator_breaks_the_session_and_it_comes_back_on_resume() -> None:
    with start_coordinator(*FAST_HEARTBEATS) as kvrc:
        session = EngineSession(kvrc.grpc_target, registration("frozen-1"), register_timeout_s=1)
        ack = await session.start()
        assert ack.heartbeat_timeout_ms == 1000
        try:
            with frozen(kvrc):
                # Before: `connected` stayed True for as long as the freeze lasted.
                await wait_until(lambda: not session.connected, 5, what="the session broke")
                error = session.last_error
                assert isinstance(error, UnavailableError), error
                assert "nothing heard from the coordinator" in error.message
            await wait_until(lambda: session.registrations == 2, 10, what="re-registered")
            assert session.connected and session.target == kvrc.grpc_target
        finally:
            await session.close()


async def test_a_frozen_replica_is_left_for_the_next_target() -> None:
    with start_coordinator(*FAST_HEARTBEATS) as a, start_coordinator(*FAST_HEARTBEATS) as b:
        session = EngineSession(
            [a.grpc_target, b.grpc_target], registration("frozen-2"), register_timeout_s=1
        )
        await session.start()
        assert session.target == a.grpc_target
        try:
            with frozen(a):
                # silence (1 s) + a Register unanswered (1 s), then the move.
                await wait_until(
                    lambda: session.target == b.grpc_target and session.connected,
                    10,
                    what="failed over to replica b",
                )
                assert session.registrations == 2
        finally:
            await session.close()


def test_the_session_channel_has_keepalive_and_a_short_reconnect_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[dict[str, Any]] = []

    def recording(target: Any, grpc_options: Sequence[tuple[str, Any]] = ()) -> Any:
        made.append(dict(grpc_options))
        return connect(target, grpc_options)

    monkeypatch.setattr(session_module, "connect", recording)

    async def make() -> None:
        session = EngineSession("127.0.0.1:1", registration("opts"), backoff_max_s=1.5)
        channel = session._new_channel()
        await channel.close(None)

    asyncio.run(make())
    (options,) = made
    assert options["grpc.keepalive_time_ms"] >= 5000  # kvrc refuses pings closer than 5 s
    assert 0 < options["grpc.keepalive_timeout_ms"] <= 10_000
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.http2.max_pings_without_data"] == 0
    assert options["grpc.max_reconnect_backoff_ms"] == 1500
    assert options["grpc.initial_reconnect_backoff_ms"] <= 1500


# --- 2. writes are bounded --------------------------------------------------------------


async def _publish_until_it_fails(publisher: InventoryPublisher) -> int:
    """Publishes 64 KiB batches until one fails; returns the batches sent."""
    sent = 0
    with pytest.raises(UnavailableError):
        while True:
            await publisher.stored([os.urandom(32) for _ in range(2000)])
            sent += 1
    return sent


async def test_a_write_stuck_on_a_frozen_coordinator_times_out_and_publishing_fails_fast() -> None:
    with start_coordinator() as kvrc:
        # Silence detection off (60 s): only the write timeout can break this stream.
        session = EngineSession(
            kvrc.grpc_target,
            registration("stuck-write"),
            silence_timeout_s=60,
            write_timeout_s=1,
            register_timeout_s=1,
        )
        await session.start()
        publisher = InventoryPublisher(session, dump=list)
        try:
            with frozen(kvrc):
                # Before: once flow control filled, a write (and every publish behind its
                # locks) waited for ever.
                sent = await asyncio.wait_for(_publish_until_it_fails(publisher), 30)
                assert sent > 0
                error = session.last_error
                assert isinstance(error, UnavailableError), error
                assert "did not complete in 1 s" in error.message
                assert not session.connected
                # Not connected: the next publish fails at once instead of queuing.
                began = time.monotonic()
                with pytest.raises(UnavailableError):
                    await publisher.stored([b"h" * 32])
                assert time.monotonic() - began < 0.5
            await wait_until(lambda: session.registrations == 2, 10, what="re-registered")
        finally:
            await session.close()


async def test_close_keeps_its_timeout_with_a_write_stuck() -> None:
    with start_coordinator() as kvrc:
        # No silence or write timeout in the way: close() alone must not hang.
        session = EngineSession(
            kvrc.grpc_target, registration("stuck-close"), silence_timeout_s=60, write_timeout_s=60
        )
        await session.start()
        publisher = InventoryPublisher(session, dump=list)
        with frozen(kvrc):
            publishing = asyncio.create_task(_publish_until_it_fails(publisher))
            # Stuck: flow control is full and the write waits (up to its 60 s).
            await wait_until(lambda: session._write_lock.locked(), 20, what="a write waiting")
            await asyncio.sleep(0.5)  # the write lock stays held: the write is stuck
            assert session._write_lock.locked() and not publishing.done()
            began = time.monotonic()
            # Before: close() waited for the write lock, for ever.
            await asyncio.wait_for(session.close(timeout_s=1), 10)
            assert time.monotonic() - began < 3
            # The stuck publish ends too (the call was cancelled), as UnavailableError.
            await asyncio.wait_for(publishing, 5)


# --- 3. a kvrc that is back is reached quickly ------------------------------------------


async def test_a_long_outage_is_followed_by_a_quick_reconnect() -> None:
    port = free_port()
    listen = f"127.0.0.1:{port}"
    async with coordinator_off_loop(listen=listen, check_exit=False) as kvrc:
        session = EngineSession(kvrc.grpc_target, registration("outage"), backoff_max_s=0.5)
        await session.start()
        kvrc.process.kill()
        await asyncio.to_thread(kvrc.process.wait)
    try:
        # The outage itself (the fault, not a wait for a condition): long enough that
        # grpc's default channel backoff (1 s, x1.6 per try) has grown past 6 s.
        await asyncio.sleep(12)
        async with coordinator_off_loop(listen=listen):
            back = time.monotonic()
            # Before: up to grpc's next try, about 5 s (tens of seconds after longer ones).
            await wait_until(lambda: session.registrations == 2, 20, what="re-registered")
            took = time.monotonic() - back
            # The client's own backoff (0.5 s here) plus a registration on a loaded host.
            assert took < 3.0, f"re-registered {took:.1f} s after kvrc was back"
    finally:
        await session.close()


# --- 4. a handler or credentials error on reconnect does not end the session ------------


class FailsOnSecondRegistration(NullHandler):
    def __init__(self) -> None:
        self.registered = 0

    async def on_registered(self, ack: RegisterAck) -> None:
        self.registered += 1
        if self.registered == 2:
            raise RuntimeError("an engine bug in on_registered")


async def test_an_on_registered_error_on_reconnect_is_logged_and_the_session_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with start_coordinator() as kvrc:
        handler = FailsOnSecondRegistration()
        session = EngineSession(kvrc.grpc_target, registration("onreg"), handler)
        await session.start()
        caplog.set_level(logging.ERROR, logger="kvrc.client")
        try:
            # An empty EngineMessage breaks the protocol: kvrc ends the session.
            await session._send(pb.EngineMessage())
            await wait_until(lambda: handler.registered >= 2, 10, what="re-registered")
            await session._send(pb.EngineMessage())  # and once more: the runner lives
            await wait_until(lambda: handler.registered >= 3, 10, what="registered again")
            assert session._runner is not None and not session._runner.done()
            failed = [r for r in caplog.records if "failed on registered" in r.getMessage()]
            assert len(failed) == 1 and failed[0].exc_info is not None
        finally:
            await session.close()  # before: re-raised the handler's RuntimeError


async def test_a_credentials_error_on_failover_is_logged_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    listen = f"127.0.0.1:{port}"
    # The second replica's token file is missing: its channel cannot be made.
    broken = ChannelOptions(f"127.0.0.1:{free_port()}", token_file=tmp_path / "missing")
    async with coordinator_off_loop(listen=listen, check_exit=False) as kvrc:
        session = EngineSession(
            [ChannelOptions(kvrc.grpc_target), broken],
            registration("creds"),
            backoff_max_s=0.2,
        )
        await session.start()
        caplog.set_level(logging.WARNING, logger="kvrc.client")
        kvrc.process.kill()
        await asyncio.to_thread(kvrc.process.wait)
    try:
        await wait_until(
            lambda: any("missing" in r.getMessage() for r in caplog.records),
            10,
            what="the credentials error logged",
        )
        async with coordinator_off_loop(listen=listen):
            await wait_until(lambda: session.registrations == 2, 15, what="re-registered")
            assert session._runner is not None and not session._runner.done()
    finally:
        await session.close()


# --- 6. the reference engine does not warn per request while kvrc is down ----------------


class DownPublisher:
    """An InventoryPublisher whose session is down until `up`."""

    def __init__(self) -> None:
        self.up = False
        self.batches = 0

    async def publish(self, events: Sequence[object]) -> int:
        if not self.up:
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "the session is not connected")
        self.batches += 1
        return 1


async def test_the_reference_engine_warns_once_per_outage_not_per_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    leader = Leader.__new__(Leader)  # only what publish() uses
    leader.part = SimpleNamespace(tier=Tier.GPU)  # type: ignore[assignment]
    publisher = DownPublisher()
    leader.publisher = publisher  # type: ignore[assignment]
    leader.unsent_events = UnsentEventsLog(every_s=3600)
    caplog.set_level(logging.INFO, logger="kvrc.refengine")
    for n in range(50):  # 50 requests while kvrc is down
        await leader.publish([], [bytes([n]) * 32])
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert "dump after re-registration" in warned[0].getMessage()
    publisher.up = True
    await leader.publish([], [b"z" * 32])
    back = [r.getMessage() for r in caplog.records if "sent again" in r.getMessage()]
    assert back == ["inventory events sent again; 50 batches were not sent"]
    assert publisher.batches == 1
