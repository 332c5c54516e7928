"""clients/leases.py against a real coordinator process: typed errors, keep-alive, holder side."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from harness import (
    CoordinatorProcess,
    child_engine_status,
    free_port,
    get_status,
    metric_value,
    start_coordinator,
    wait_until,
)
from lease_parts import Parts, store_blocks

from clients import leases as client_leases
from clients.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)
from clients.hashing import hash_block_chain
from clients.leases import (
    HandoffGrant,
    LeaseClient,
    LeaseSessionHandler,
    Miss,
    PinAnswer,
    PinRequestInfo,
    PrefixLoadGrant,
    publish_rounds,
)
from clients.session import EngineProfile, EngineSession, RankPartRegistration
from kvrc.v1 import kvrc_pb2 as pb


def _coordinator(
    tmp_path_factory: pytest.TempPathFactory, heartbeat_timeout_ms: int
) -> Iterator[CoordinatorProcess]:
    profiles = Path(tmp_path_factory.mktemp("p")) / "profiles.toml"
    profiles.write_text('[[profile]]\nname = "t"\nmodel = "m"\n')
    timeout = str(heartbeat_timeout_ms)
    with start_coordinator(
        "--reuse", "on", "--profiles", str(profiles), "--handoff-heartbeat-timeout-ms", timeout
    ) as coordinator:
        yield coordinator


@pytest.fixture(scope="module")
def kvrc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    yield from _coordinator(tmp_path_factory, 900)


@pytest.fixture
async def parts(kvrc: CoordinatorProcess) -> AsyncIterator[Parts]:
    async with Parts.open(kvrc.grpc_target) as p:
        yield p


@pytest.fixture(scope="module")
def kvrc_3s(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    """A 3 s heartbeat timeout: room for missed extensions on a loaded two-core host
    (900 ms left 400 ms, and a CI run beside other tests once used it up)."""
    yield from _coordinator(tmp_path_factory, 3000)


def descriptor(block_ids: list[int]) -> pb.RankPartDescriptor:
    return pb.RankPartDescriptor(
        rank=pb.RankCoordinates(),
        endpoint=pb.TransferEndpoint(backend="mooncake", session_name="127.0.0.1:15000"),
        block_ids=block_ids,
    )


def hashes_of(name: str, n: int) -> list[bytes]:
    return hash_block_chain([ord(name[0])] * 16 * n, 16, seed=len(name))


async def lease_state(kvrc: CoordinatorProcess, lease_id: str) -> str | None:
    for lease in (await get_status(kvrc.grpc_target)).leases:
        if lease.lease_id == lease_id:
            return str(pb.LeaseState.Name(lease.state))
    return None


async def test_failing_pin_callback_is_a_miss_and_the_session_lives_on(
    kvrc: CoordinatorProcess, parts: Parts
) -> None:
    calls: list[PinRequestInfo] = []

    def pin(info: PinRequestInfo) -> PinAnswer:
        calls.append(info)
        raise RuntimeError("cache is being rebuilt")

    holder, _ = await parts.part("c-hold", LeaseSessionHandler(pin=pin))
    _, requester = await parts.part("c-req")
    chain = hashes_of("pin", 3)
    await store_blocks(holder, chain)
    answer = await requester.request_prefix_load("p1", chain, pin_timeout_ms=2000)
    assert isinstance(answer, Miss) and answer.reason == "short_pin"
    assert [c.block_hashes for c in calls] == [tuple(chain)]
    assert calls[0].requester_child_engine_id == "c-req"
    assert holder.connected  # the engine's bug did not end its session


async def test_abort_is_acknowledged_only_after_the_engine_stopped(
    kvrc: CoordinatorProcess, parts: Parts
) -> None:
    released: list[str] = []
    stopped = asyncio.Event()
    aborts: list[str] = []

    async def abort(lease_id: str, reason: str) -> None:
        aborts.append(lease_id)
        await stopped.wait()

    def on_release(lease_id: str, reason: str) -> None:
        released.append(lease_id)

    _, pre_client = await parts.part("c-pre", LeaseSessionHandler(on_release=on_release))
    _, decode = await parts.part("c-dec", LeaseSessionHandler(abort=abort))
    published = await pre_client.publish_handoff(
        "h1", descriptor=descriptor([1]), kv_transfer_params={"a": (1, [2])}, num_blocks=1
    )
    grant = await decode.begin_handoff("h1", "c-pre")
    assert isinstance(grant, HandoffGrant) and grant.kv_transfer_params == {"a": (1, [2])}
    # The prefill learns the lease id at publish time: its ReleaseRequest names it.
    assert published.lease_id == grant.lease_id
    # No keep-alive: the lease expires, the decode is asked to abort.
    await wait_until(lambda: bool(aborts), timeout_s=5)
    # Kept sleep: the abort stays unacknowledged for 0.3 s, and no release may come meanwhile.
    await asyncio.sleep(0.3)
    assert await lease_state(kvrc, grant.lease_id) == "LEASE_STATE_ABORTING"
    assert released == []
    stopped.set()
    await wait_until(lambda: bool(released), timeout_s=5)
    assert released == [grant.lease_id]


class FlakySession:
    """The part of an EngineSession the handler acks aborts with; `up` says if connected."""

    def __init__(self) -> None:
        self.up = False
        self.acks: list[str] = []

    async def send_abort_ack(self, lease_id: str) -> None:
        if not self.up:
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "the session is not connected")
        self.acks.append(lease_id)


async def test_an_abort_ack_that_finds_the_session_down_is_sent_after_it_reconnects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(client_leases, "MAX_UNSENT_ABORT_ACKS", 2)
    handler = LeaseSessionHandler()
    session = FlakySession()
    handler.attach(session)  # type: ignore[arg-type]
    for lease_id in ("L1", "L2", "L3"):  # the stream broke while the reads were stopping
        await handler.on_abort_request(pb.AbortRequest(lease_id=lease_id, reason="deadline"))
    await wait_until(lambda: len(handler.unsent_abort_acks()) == 2, timeout_s=5)
    assert handler.unsent_abort_acks() == ["L2", "L3"]  # bounded: the oldest went
    session.up = True
    await handler.on_registered(None)  # reconnected: the kept acks go now
    await wait_until(lambda: session.acks == ["L2", "L3"], timeout_s=5)
    assert handler.unsent_abort_acks() == []
    await handler.aclose()


async def completed_handoff(
    parts: Parts, name: str, handler: LeaseSessionHandler | None = None
) -> tuple[EngineSession, LeaseClient, pb.TransferReport]:
    """Prefill `name`-pre (with `handler`) publishes a handoff that `name`-dec reads and
    reports done, quiescent: the release goes to the prefill. The prefill's session, the
    decode's client and its report (the lease id is `report.lease_id`)."""
    pre, pre_client = await parts.part(f"{name}-pre", handler or LeaseSessionHandler())
    _, decode = await parts.part(f"{name}-dec", LeaseSessionHandler())
    await pre_client.publish_handoff(
        f"h-{name}", descriptor=descriptor([1]), kv_transfer_params={}, num_blocks=1
    )
    grant = await decode.begin_handoff(f"h-{name}", f"{name}-pre")
    assert isinstance(grant, HandoffGrant)
    report = pb.TransferReport(
        lease_id=grant.lease_id,
        reporter_child_engine_id=f"{name}-dec",
        rank=pb.RankCoordinates(),
        outcome=pb.TRANSFER_OUTCOME_SUCCEEDED,
    )
    assert (await decode.complete_handoff(report)).quiescent
    return pre, decode, report


def releases_to(got: list[str]) -> LeaseSessionHandler:
    return LeaseSessionHandler(on_release=lambda lease_id, _: got.append(lease_id))


async def test_a_release_whose_ack_was_lost_with_the_stream_reaches_the_next_session(
    kvrc: CoordinatorProcess, parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill freed its pins, and its session ended before the ReleaseAck went
    (held back here): its next session gets the release again, and acknowledges it;
    a third session then gets nothing (revision 4; before, the release was lost with
    the stream and the pins waited for the holder's safety net)."""
    monkeypatch.setattr(client_leases, "RELEASE_ACK_DELAY_S", 60.0)
    first: list[str] = []
    handler = releases_to(first)
    pre, _, report = await completed_handoff(parts, "ack", handler)
    lease_id = report.lease_id
    await wait_until(lambda: first == [lease_id], timeout_s=5)
    assert handler.release_acks_due() == [lease_id]
    await pre.close()  # ends before the ack went
    await handler.aclose()  # the ack finds the session closed: not sent
    monkeypatch.setattr(client_leases, "RELEASE_ACK_DELAY_S", 0.0)
    second: list[str] = []
    again = releases_to(second)
    pre, _ = await parts.part("ack-pre", again)
    await wait_until(lambda: second == [lease_id], timeout_s=5)
    await wait_until(lambda: again.release_acks_due() == [], timeout_s=5)
    # The due list empties before the ack is written: wait for its task's write too.
    await wait_until(lambda: not again._tasks, timeout_s=5)
    await pre.close()  # after the ack, on the same stream: kvrc read it first
    third: list[str] = []
    pre, _ = await parts.part("ack-pre", releases_to(third))
    # An ack of a lease with no release waiting (a repeat, or unknown) changes nothing.
    await pre.send_release_acks([lease_id, "pl-unknown"])
    # Kept sleep: a release sent again would arrive within it.
    await asyncio.sleep(1.0)
    assert third == []
    assert pre.connected


class AckRecorder:
    """The part of an EngineSession the handler acknowledges releases with."""

    def __init__(self) -> None:
        self.messages: list[list[str]] = []

    async def send_release_acks(self, lease_ids: list[str]) -> None:
        self.messages.append(list(lease_ids))


async def test_release_acks_are_batched_one_message_for_a_burst(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst of releases costs one ReleaseAck, not one each (the load stream's
    messages per load stay as revision 3 had them), and a burst past the message's
    bound is cut at it."""
    monkeypatch.setattr(client_leases, "MAX_RELEASE_ACKS_PER_MESSAGE", 64)
    handler = LeaseSessionHandler()
    session = AckRecorder()
    handler.attach(session)  # type: ignore[arg-type]
    released = [f"pl-{i}" for i in range(100)]
    for lease_id in released:
        await handler.on_release_request(pb.ReleaseRequest(lease_id=lease_id, reason="done"))
    assert session.messages == [released[:64]]  # the bound: sent at once
    await wait_until(lambda: len(session.messages) == 2, timeout_s=5)
    assert session.messages[1] == released[64:]
    assert handler.release_acks_due() == []
    await handler.aclose()
    assert len(session.messages) == 2


async def test_only_reports_of_leases_still_open_are_kept_for_a_replay(
    kvrc: CoordinatorProcess, parts: Parts
) -> None:
    # A report answered quiescent ended its lease (the release went out with the answer):
    # replaying it after a re-registration would only load a restarting coordinator.
    _, decode, report = await completed_handoff(parts, "r")
    assert await decode.replay_recent_reports() == 0
    # The control: the same report, remembered, is taken again (a repeat changes nothing).
    decode._remember("CompleteHandoff", report)
    assert await decode.replay_recent_reports() == 1


async def test_keep_alive_extends_and_reports_a_refused_extension(
    kvrc: CoordinatorProcess, parts: Parts
) -> None:
    _, pre = await parts.part("k-pre")
    _, dec = await parts.part("k-dec")
    await pre.publish_handoff(
        "h", descriptor=descriptor([3]), kv_transfer_params=b"raw", num_blocks=1
    )
    grant = await dec.begin_handoff("h", "k-pre")
    assert grant.kv_transfer_params_bytes == b"raw" and grant.kv_transfer_params == {}
    assert grant.heartbeat_interval_ms == 300
    async with dec.keep_alive(grant) as keep:
        # The scenario is outliving the 900 ms heartbeat timeout on keep-alives: five
        # extensions 300 ms apart span 1.2 s at least, however slow the host.
        await wait_until(lambda: keep.extensions >= 5 or keep.error is not None, timeout_s=30)
        assert keep.extensions >= 5 and keep.error is None
        assert await lease_state(kvrc, grant.lease_id) == "LEASE_STATE_ACTIVE"
        # An extension's deadline is unix ms, as the grant's: within the 900 ms heartbeat
        # timeout of now (it was the coordinator's monotonic ms, decades in the past).
        now_ms = time.time() * 1000
        assert now_ms - 5_000 < keep.deadline_unix_ms < now_ms + 5_000
        assert abs(keep.deadline_unix_ms - grant.deadline_unix_ms) < 60_000
        report = pb.TransferReport(
            lease_id=grant.lease_id,
            reporter_child_engine_id="k-dec",
            outcome=pb.TRANSFER_OUTCOME_SUCCEEDED,
        )
        done = await dec.complete_handoff(report)
        assert (done.state, done.quiescent) == ("COMPLETED", True)
        await wait_until(lambda: keep.error is not None, timeout_s=3)
    assert isinstance(keep.error, FailedPreconditionError)


async def test_keep_alive_goes_on_after_an_extension_without_an_answer(
    kvrc_3s: CoordinatorProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One UNAVAILABLE (here injected, as a replica failing over would answer) stopped
    the keep-alive for good: kvrc then aborted the healthy transfer at its heartbeat
    timeout. Now it tries again a third of an interval later, and the lease stays ACTIVE."""
    async with Parts.open(kvrc_3s.grpc_target) as parts:
        await _keep_alive_through_two_misses(kvrc_3s, parts, monkeypatch)


async def _keep_alive_through_two_misses(
    kvrc: CoordinatorProcess, parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, pre = await parts.part("u-pre")
    _, dec = await parts.part("u-dec")
    await pre.publish_handoff(
        "h", descriptor=descriptor([3]), kv_transfer_params=b"raw", num_blocks=1
    )
    grant = await dec.begin_handoff("h", "u-pre")
    real_extend = dec.extend_handoff
    calls = 0

    async def failing_over(lease_id: str) -> int:
        nonlocal calls
        calls += 1
        if calls in (2, 3):
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "the replica is failing over")
        return await real_extend(lease_id)

    monkeypatch.setattr(dec, "extend_handoff", failing_over)
    async with dec.keep_alive(grant) as keep:
        # Past the 3 s heartbeat timeout, two missed extensions included.
        await wait_until(lambda: keep.extensions >= 5 or keep.error is not None, timeout_s=30)
        assert keep.error is None and keep.missed == 2 and keep.extensions >= 5
        assert await lease_state(kvrc, grant.lease_id) == "LEASE_STATE_ACTIVE"


async def test_typed_errors(kvrc: CoordinatorProcess, parts: Parts) -> None:
    _, pre = await parts.part("e-pre")
    _, dec = await parts.part("e-dec")
    with pytest.raises(DeadlineExceededError):
        await dec.begin_handoff("never", "e-pre", wait_timeout_ms=200)
    with pytest.raises(NotFoundError):
        await dec.extend_handoff("no-such-lease")
    await pre.publish_handoff("t", descriptor=descriptor([1]), kv_transfer_params={}, num_blocks=1)
    grant = await dec.begin_handoff("t", "e-pre")
    with pytest.raises(PermissionDeniedError):
        await pre.extend_handoff(grant.lease_id)  # only the decode engine holds it
    ghost = LeaseClient(kvrc.grpc_target, "ghost")
    try:
        with pytest.raises(FailedPreconditionError):
            await ghost.request_prefix_load("r", [b"\x01" * 8])
    finally:
        await ghost.close()
    answer = await dec.request_prefix_load("r", hashes_of("none", 2))
    assert isinstance(answer, Miss) and not isinstance(answer, PrefixLoadGrant)
    assert answer.reason == "no_candidate" and answer.reuse.enabled


async def test_foreign_and_malformed_pin_results_change_nothing(
    kvrc: CoordinatorProcess, parts: Parts
) -> None:
    asked: asyncio.Queue[PinRequestInfo] = asyncio.Queue()
    answer = asyncio.Event()

    async def pin(info: PinRequestInfo) -> PinAnswer:
        await asked.put(info)
        await answer.wait()
        return PinAnswer(2, descriptor([4, 5]))

    holder, _ = await parts.part("f-hold", LeaseSessionHandler(pin=pin))
    _, requester = await parts.part("f-req")
    intruder, _ = await parts.part("f-intruder")
    chain = hashes_of("foreign", 2)
    await store_blocks(holder, chain)
    load = asyncio.ensure_future(requester.request_prefix_load("f1", chain, pin_timeout_ms=5000))
    lease_id = (await asyncio.wait_for(asked.get(), 5)).lease_id
    # Another engine answering for the holder is ignored (counted as denied); its session goes
    # on (had it ended, its last error below would not be the malformed answer's).
    denied = metric_value(kvrc, "kvrc_auth_denied_total", reason="foreign_lease")
    await intruder.send_pin_result(
        pb.PinResult(lease_id=lease_id, pinned_blocks=2, descriptor=descriptor([9, 9]))
    )
    await wait_until(
        lambda: metric_value(kvrc, "kvrc_auth_denied_total", reason="foreign_lease") > denied,
        5,
        what="the foreign answer denied",
    )
    assert intruder.connected
    assert await lease_state(kvrc, lease_id) == "LEASE_STATE_PINNING"
    # A malformed answer (blocks but no descriptor) ends that session with INVALID_ARGUMENT.
    await intruder.send_pin_result(pb.PinResult(lease_id=lease_id, pinned_blocks=2))
    await wait_until(lambda: not intruder.connected, timeout_s=5)
    assert intruder.last_error is not None and intruder.last_error.code.name == "INVALID_ARGUMENT"
    assert await lease_state(kvrc, lease_id) == "LEASE_STATE_PINNING"
    answer.set()
    grant = await load
    assert isinstance(grant, PrefixLoadGrant) and grant.matched_blocks == 2
    assert [list(p.block_ids) for p in grant.source_parts] == [[4, 5]]


async def test_a_pin_result_that_finds_the_session_gone_is_logged_once_and_kept_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pinned = asyncio.Event()
    answer = asyncio.Event()

    async def pin(info: PinRequestInfo) -> PinAnswer:
        pinned.set()
        await answer.wait()  # the engine pins while kvrc goes away
        return PinAnswer(1, descriptor=descriptor([3]))

    handler = LeaseSessionHandler(pin=pin)
    with start_coordinator() as own:
        session = EngineSession(
            own.grpc_target,
            RankPartRegistration(engine_id="pin-gone", profile=EngineProfile("m", 16)),
            handler,
            reconnect=False,
        )
        handler.attach(session)
        await session.start()
        request = pb.PinRequest(
            lease_id="pl-gone", block_hashes=[b"x" * 32], requester_child_engine_id="req-0"
        )
        pinning = asyncio.create_task(handler.on_pin_request(request))
        await asyncio.wait_for(pinned.wait(), 5)
        own.stop()  # a kvrc restart: the session ends while the engine pins
    await wait_until(lambda: not session.connected, 5, what="the session ended")
    caplog.set_level(logging.INFO, logger="kvrc.client")
    caplog.clear()
    answer.set()
    await asyncio.wait_for(pinning, 5)  # before: UnavailableError (an ERROR with a traceback)
    said = [r for r in caplog.records if "pl-gone" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO], said
    assert said[0].exc_info is None
    # Re-announced on re-registration, with the requester only it may report for.
    assert handler.held_leases() == {"pl-gone": "req-0"}
    register = session.registration.to_proto(handler.held_leases())
    held = [(h.lease_id, h.requester_child_engine_id) for h in register.held_leases]
    assert held == [("pl-gone", "req-0")]
    assert list(register.held_lease_ids) == ["pl-gone"]  # for coordinators before held_leases
    await session.close()
    await handler.aclose()


async def test_a_begin_is_made_again_while_its_own_engine_is_registering(
    kvrc: CoordinatorProcess, parts: Parts
) -> None:
    """A decode engine whose part is (re-)registering is not registered for a moment:
    its begin is made again within its wait, and takes the handoff once the part is
    back (before, in LeaseClient: FAILED_PRECONDITION at once; the vLLM scheduler had a
    loop of its own). Any other refusal still comes back at once."""
    _, pre = await parts.part("w-pre")
    dec = LeaseClient(kvrc.grpc_target, "w-dec", timeout_s=10)
    try:
        begin = asyncio.create_task(dec.begin_handoff("h", "w-pre", wait_timeout_ms=30_000))
        await asyncio.sleep(0.3)
        assert not begin.done(), "the refusal naming the decode engine itself came back"
        await parts.part("w-dec")  # its part registers now
        published = await pre.publish_handoff(
            "h", descriptor=descriptor([1]), kv_transfer_params={}, num_blocks=1
        )
        grant = await asyncio.wait_for(begin, 20)
        assert grant.lease_id == published.lease_id
        report = pb.TransferReport(
            lease_id=grant.lease_id,
            reporter_child_engine_id="w-dec",
            outcome=pb.TRANSFER_OUTCOME_SUCCEEDED,
        )
        assert (await dec.complete_handoff(report)).state == "COMPLETED"
        # Not READY any more (COMPLETED): refused at once, however long the wait.
        with pytest.raises(FailedPreconditionError, match="is not READY: it is COMPLETED"):
            await asyncio.wait_for(dec.begin_handoff("h", "w-pre", wait_timeout_ms=60_000), 20)
    finally:
        await dec.close()


async def test_a_begin_outlives_a_coordinator_restart_within_its_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvrc is killed (kill -9) while a decode engine's begin waits for the publish, and
    comes back on the same address: the begin is made again (UNAVAILABLE, then the
    engine's own parts re-registering) and takes the handoff the prefill publishes to
    the new kvrc. Before: UnavailableError at the kill, and the decode recomputed. (The
    UNAVAILABLE budget is raised here: how long a restart takes on a loaded host is not
    what this checks; the next test checks the budget.)"""
    monkeypatch.setattr(client_leases, "BEGIN_UNAVAILABLE_RETRY_S", 60.0)
    profiles = tmp_path / "profiles.toml"
    profiles.write_text('[[profile]]\nname = "t"\nmodel = "m"\n')
    flags = ("--reuse", "on", "--profiles", str(profiles))
    listen = f"127.0.0.1:{free_port()}"
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(start_coordinator(*flags, listen=listen, check_exit=False))
        target = first.grpc_target
        sessions = []
        for engine_id in ("x-pre", "x-dec"):
            registration = RankPartRegistration(
                engine_id=engine_id, profile=EngineProfile(model="m", block_size=16)
            )
            session = EngineSession(target, registration, LeaseSessionHandler(), reconnect=True)
            await session.start()
            await session.wait_ready(5)
            sessions.append(session)
        dec = LeaseClient(target, "x-dec", timeout_s=10)
        try:
            begin = asyncio.create_task(dec.begin_handoff("h", "x-pre", wait_timeout_ms=60_000))
            await asyncio.sleep(0.5)
            assert not begin.done()
            first.stop(signal.SIGKILL)
            stack.enter_context(start_coordinator(*flags, listen=listen))

            async def both_back() -> bool:
                states = [await child_engine_status(target, e) for e in ("x-pre", "x-dec")]
                return all(s is not None and s.state.ready for s in states)

            await wait_until(both_back, 30, what="both engines registered with the new kvrc")
            async with LeaseClient(target, "x-pre", timeout_s=10) as pre:
                published = await pre.publish_handoff(
                    "h",
                    descriptor=descriptor([1, 2]),
                    kv_transfer_params={},
                    num_blocks=2,
                    decode_child_engine_id="x-dec",
                )
            grant = await asyncio.wait_for(begin, 30)
            assert grant.lease_id == published.lease_id and grant.num_blocks == 2
        finally:
            await dec.close()
            for session in sessions:
                await session.close()


async def test_a_begin_gives_up_on_an_unreachable_kvrc_long_before_its_wait_ends() -> None:
    """Nothing listens: UNAVAILABLE is retried for BEGIN_UNAVAILABLE_RETRY_S (5 s), not
    the 60 s wait, so a decode engine recomputes instead of waiting out an outage."""
    dec = LeaseClient(f"127.0.0.1:{free_port()}", "u-dec", timeout_s=10)
    try:
        begin = dec.begin_handoff("h", "u-pre", wait_timeout_ms=60_000)
        with pytest.raises(UnavailableError):
            await asyncio.wait_for(begin, 30)
    finally:
        await dec.close()


async def test_a_begin_waiting_when_kvrc_stops_gets_a_fresh_budget_for_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A begin that had waited longer than its UNAVAILABLE budget when kvrc stopped
    (SIGTERM: the waiting begin is answered UNAVAILABLE, "shutting down") gave the
    handoff up at once. It now retries the next coordinator for the whole budget,
    counted from the shutdown (here nothing comes back: it gives up after it)."""
    monkeypatch.setattr(client_leases, "BEGIN_UNAVAILABLE_RETRY_S", 2.0)
    profiles = tmp_path / "profiles.toml"
    profiles.write_text('[[profile]]\nname = "t"\nmodel = "m"\n')
    with start_coordinator("--reuse", "on", "--profiles", str(profiles), check_exit=False) as kvrc:
        registration = RankPartRegistration(
            engine_id="s-dec", profile=EngineProfile(model="m", block_size=16)
        )
        session = EngineSession(kvrc.grpc_target, registration, LeaseSessionHandler())
        await session.start()
        await session.wait_ready(5)
        dec = LeaseClient(kvrc.grpc_target, "s-dec", timeout_s=10)
        try:
            begin = asyncio.create_task(dec.begin_handoff("h", "s-pre", wait_timeout_ms=60_000))
            await asyncio.sleep(3.0)  # past the 2 s budget, still waiting
            assert not begin.done()
            loop = asyncio.get_running_loop()
            stopped_at = loop.time()
            kvrc.stop(signal.SIGTERM)
            with pytest.raises(UnavailableError):
                await asyncio.wait_for(begin, 30)
            assert loop.time() - stopped_at >= 1.5  # retried, not given up at the stop
        finally:
            await dec.close()
            await session.close()


async def test_a_publish_round_sends_only_the_parts_without_an_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both engines publish a handoff's parts this way (clients.leases.publish_rounds):
    a part answered is not sent again, a part without an answer is, also after another
    part's answer named the lease; no repeat once the blocks are no longer held."""
    monkeypatch.setattr("clients.leases.PUBLISH_RETRY_DELAYS_S", (0.0, 0.0, 0.0))
    lost = DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer")
    sent: list[int] = []

    async def publish_part(rank: int) -> str:
        sent.append(rank)
        if rank == 2 and sent.count(2) < 3:
            raise lost
        return f"answer {rank}"

    hold_ends = asyncio.get_running_loop().time() + 60.0
    rounds = [r async for r in publish_rounds(publish_part, 3, hold_ends, lambda: True)]
    assert sent == [0, 1, 2, 2, 2]
    assert [attempt for attempt, _ in rounds] == [0, 1, 2]
    assert rounds[0][1] == ["answer 0", "answer 1", lost]
    assert rounds[-1][1] == ["answer 0", "answer 1", "answer 2"]

    # The blocks are freed after the first round: nothing is published again.
    sent.clear()
    held = [True]

    async def freed_after(rank: int) -> str:
        held[0] = False
        return await publish_part(rank)

    rounds = [r async for r in publish_rounds(freed_after, 3, hold_ends, lambda: held[0])]
    assert sent == [0, 1, 2] and len(rounds) == 1
    # The hold's end bounds the repeats too (no time left for a repeat).
    sent.clear()
    soon = asyncio.get_running_loop().time() + 0.0
    rounds = [r async for r in publish_rounds(publish_part, 3, soon, lambda: True)]
    assert sent == [0, 1, 2] and len(rounds) == 1
