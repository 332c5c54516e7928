"""Prefix loads and their reports on the session stream (SessionCall, protocol revision 3).

Against a real coordinator process. The requester's unary target is a dead address
in the tests that must not use it, so a grant or report that went as a unary RPC
would fail there. The stream path must answer what the unary RPC answers, refuse
what it refuses with the same status (the session going on), and keep what a
client sends bounded (I8-bad-input).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc.aio import EOF  # type: ignore[attr-defined]  # missing from grpc-stubs
from harness import CoordinatorProcess, get_status, metric_value, start_coordinator, wait_until
from lease_parts import Parts, store_blocks
from test_bad_input import good_register

from clients.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KvrcClientError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
    UnimplementedError,
)
from clients.hashing import hash_block_chain
from clients.leases import (
    LeaseClient,
    LeaseSessionHandler,
    Miss,
    PinAnswer,
    PinRequestInfo,
    PrefixLoadGrant,
)
from clients.session import EngineProfile, EngineSession, RankPartRegistration
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc

DEAD_TARGET = "127.0.0.1:1"  # nothing listens: a unary call there fails UNAVAILABLE


@pytest.fixture(scope="module")
def kvrc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    profiles = Path(tmp_path_factory.mktemp("p")) / "profiles.toml"
    profiles.write_text('[[profile]]\nname = "t"\nmodel = "m"\n')
    with start_coordinator("--reuse", "on", "--profiles", str(profiles)) as coordinator:
        yield coordinator


@pytest.fixture
async def parts(kvrc: CoordinatorProcess) -> AsyncIterator[Parts]:
    async with Parts.open(kvrc.grpc_target) as p:
        yield p


def pin_all(info: PinRequestInfo) -> PinAnswer:
    return PinAnswer(
        pinned_blocks=len(info.block_hashes),
        descriptor=pb.RankPartDescriptor(
            rank=pb.RankCoordinates(),
            endpoint=pb.TransferEndpoint(backend="mooncake", session_name="127.0.0.1:15000"),
            block_ids=list(range(len(info.block_hashes))),
        ),
    )


def chain_of(name: str, blocks: int) -> list[bytes]:
    return hash_block_chain([sum(map(ord, name)) % 1000] * 16 * blocks, 16, seed=len(name))


async def holder_and_requester(
    kvrc: CoordinatorProcess, parts: Parts, name: str, blocks: int = 4
) -> tuple[list[bytes], list[str], EngineSession, EngineSession]:
    released: list[str] = []

    def on_release(lease_id: str, reason: str) -> None:
        released.append(lease_id)

    holder, _ = await parts.part(
        f"{name}-hold", LeaseSessionHandler(pin=pin_all, on_release=on_release)
    )
    requester, _ = await parts.part(f"{name}-req")
    chain = chain_of(name, blocks)
    await store_blocks(holder, chain)
    return chain, released, holder, requester


def report(lease_id: str, child: str, outcome: int = pb.TRANSFER_OUTCOME_SUCCEEDED) -> Any:
    return pb.TransferReport(
        lease_id=lease_id,
        reporter_child_engine_id=child,
        rank=pb.RankCoordinates(),
        outcome=outcome,  # type: ignore[arg-type]
        bytes_moved=4096,
        duration_us=1000,
    )


async def test_a_load_granted_and_reported_on_the_stream_makes_no_unary_call(
    kvrc: CoordinatorProcess, parts: Parts
) -> None:
    chain, released, _, requester = await holder_and_requester(kvrc, parts, "s-ok")
    counted = metric_value(kvrc, "kvrc_rpc_requests_total", method="RequestPrefixLoad", code="OK")
    # The unary target is dead: only the session can have carried these.
    async with LeaseClient(DEAD_TARGET, "s-ok-req", timeout_s=5, session=requester) as leases:
        grant = await leases.request_prefix_load("r1", chain, pin_timeout_ms=2000)
        assert isinstance(grant, PrefixLoadGrant), grant
        assert grant.source_child_engine_id == "s-ok-hold" and grant.matched_blocks == 4
        assert [list(p.block_ids) for p in grant.source_parts] == [[0, 1, 2, 3]]
        done = await leases.complete_prefix_load(report(grant.lease_id, "s-ok-req"))
    assert (done.state, done.quiescent) == ("COMPLETED", True)
    await wait_until(lambda: released == [grant.lease_id], 5, what="the holder's release")
    after = metric_value(kvrc, "kvrc_rpc_requests_total", method="RequestPrefixLoad", code="OK")
    assert after == counted + 1  # counted as the RPC it stands for
    # Negative control: the same client without its session does go to the dead target.
    async with LeaseClient(DEAD_TARGET, "s-ok-req", timeout_s=1) as unary:
        with pytest.raises(UnavailableError):
            await unary.request_prefix_load("r2", chain, pin_timeout_ms=500)


async def test_a_miss_on_the_stream_is_the_unary_miss(
    kvrc: CoordinatorProcess, parts: Parts
) -> None:
    requester, _ = await parts.part("s-miss-req")
    chain = chain_of("nobody-holds-this", 3)
    async with LeaseClient(kvrc.grpc_target, "s-miss-req", timeout_s=5) as unary:
        expected = await unary.request_prefix_load("m1", chain)
    async with LeaseClient(DEAD_TARGET, "s-miss-req", timeout_s=5, session=requester) as leases:
        got = await leases.request_prefix_load("m2", chain)
    assert isinstance(got, Miss) and isinstance(expected, Miss)
    assert (got.reason, got.detail, got.lease_id) == (expected.reason, expected.detail, "")
    assert got.reason == "no_candidate"


async def test_refused_calls_get_the_unary_status_and_the_session_goes_on(
    kvrc: CoordinatorProcess, parts: Parts
) -> None:
    chain, _, _, requester = await holder_and_requester(kvrc, parts, "s-bad")
    before = await get_status(kvrc.grpc_target)  # this module's other tests end their leases

    async def both(request: pb.PrefixLoadRequest) -> tuple[KvrcClientError, KvrcClientError]:
        """The unary RPC's error and the stream call's, for the same request."""
        async with grpc.aio.insecure_channel(kvrc.grpc_target) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await stub.RequestPrefixLoad(request, timeout=5)
        with pytest.raises(KvrcClientError) as streamed:
            await requester.call(pb.SessionCall(prefix_load=request), 5)
        assert requester.connected  # a refused call does not end the session
        return (
            KvrcClientError(unary.value.code(), unary.value.details() or ""),
            streamed.value,
        )

    cases = [
        pb.PrefixLoadRequest(request_id="b1", requester_child_engine_id="s-bad-req"),
        pb.PrefixLoadRequest(
            request_id="b2",
            requester_child_engine_id="s-bad-req",
            block_hashes=chain,
            min_blocks=len(chain) + 1,
        ),
        pb.PrefixLoadRequest(
            request_id="", requester_child_engine_id="s-bad-req", block_hashes=chain
        ),
        pb.PrefixLoadRequest(
            request_id="b4",
            requester_child_engine_id="s-bad-req",
            block_hashes=chain,
            pin_timeout_ms=600_000,
        ),
    ]
    for request in cases:
        unary, streamed = await both(request)
        assert isinstance(streamed, InvalidArgumentError), streamed
        assert (streamed.code, streamed.message) == (unary.code, unary.message)
    # A session acts for its own child engine only (an identity refusal, so counted).
    denied = metric_value(kvrc, "kvrc_auth_denied_total", reason="foreign_engine")
    foreign_lease = metric_value(kvrc, "kvrc_auth_denied_total", reason="foreign_lease")
    other = pb.PrefixLoadRequest(
        request_id="b5", requester_child_engine_id="s-bad-hold", block_hashes=chain
    )
    with pytest.raises(PermissionDeniedError, match="not this session's child engine"):
        await requester.call(pb.SessionCall(prefix_load=other), 5)
    foreign = report("pl-nonexistent", "s-bad-hold")
    with pytest.raises(PermissionDeniedError, match="reporter_child_engine_id"):
        await requester.call(pb.SessionCall(prefix_load_report=foreign), 5)
    assert metric_value(kvrc, "kvrc_auth_denied_total", reason="foreign_engine") == denied + 2
    assert metric_value(kvrc, "kvrc_auth_denied_total", reason="foreign_lease") == foreign_lease
    # A call with nothing set is answered, not a broken session.
    with pytest.raises(InvalidArgumentError, match="no known call set"):
        await requester.call(pb.SessionCall(), 5)
    # A kind this coordinator does not know (a newer client's field 99) is UNIMPLEMENTED.
    newer = pb.SessionCall.FromString(b"\x9a\x06\x01\x00")
    with pytest.raises(UnimplementedError, match="a call kind this coordinator does not know"):
        await requester.call(newer, 5)
    after = await get_status(kvrc.grpc_target)
    mine = [x for x in after.leases if "s-bad" in x.target_child_engine_id]
    assert mine == []  # nothing changed
    assert len(after.leases) == len(before.leases)
    # Negative control: the good request on the same session is granted.
    good = pb.PrefixLoadRequest(
        request_id="b6", requester_child_engine_id="s-bad-req", block_hashes=chain
    )
    answer = await requester.call(pb.SessionCall(prefix_load=good), 5)
    assert answer.prefix_load.outcome == pb.GRANT_OUTCOME_GRANTED


async def test_reuse_off_is_refused_on_the_stream_as_on_the_unary_rpc(
    tmp_path: Path,
) -> None:
    with start_coordinator() as off:  # reuse is off by default (I1-reuse-off)
        async with Parts.open(off.grpc_target) as parts:
            requester, _ = await parts.part("s-off-req")
            async with LeaseClient(
                DEAD_TARGET, "s-off-req", timeout_s=5, session=requester
            ) as leases:
                with pytest.raises(FailedPreconditionError, match="reuse"):
                    await leases.request_prefix_load("o1", chain_of("off", 2))
            assert requester.connected


async def test_a_call_without_an_id_breaks_the_protocol_and_ends_the_session(
    kvrc: CoordinatorProcess,
) -> None:
    async with grpc.aio.insecure_channel(kvrc.grpc_target) as channel:
        call: Any = pb_grpc.EngineServiceStub(channel).Session()  # type: ignore[call-arg]
        await call.write(pb.EngineMessage(register=good_register("s-noid", 0)))
        ack = await call.read()
        assert ack.WhichOneof("message") == "register_ack"
        request = pb.PrefixLoadRequest(request_id="x", requester_child_engine_id="s-noid")
        await call.write(pb.EngineMessage(call=pb.SessionCall(prefix_load=request)))
        replies = []
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while (reply := await call.read()) is not EOF:
                replies.append(reply)
    assert ended.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "call_id must not be 0" in (ended.value.details() or "")
    assert replies[-1].WhichOneof("message") == "session_error"


async def test_calls_awaiting_a_grant_are_bounded_per_session(
    kvrc: CoordinatorProcess, parts: Parts
) -> None:
    """A holder that never answers its pins: the 257th waiting call is refused at once."""
    never = asyncio.Event()

    async def pin_never(info: PinRequestInfo) -> PinAnswer:
        await never.wait()  # set at the end: the holder then answers the leftovers
        return PinAnswer(0)

    holder, _ = await parts.part("s-many-hold", LeaseSessionHandler(pin=pin_never))
    requester, _ = await parts.part("s-many-req")
    chain = chain_of("s-many", 2)
    await store_blocks(holder, chain)

    def request(i: int) -> pb.SessionCall:
        return pb.SessionCall(
            prefix_load=pb.PrefixLoadRequest(
                request_id=f"w{i}",
                requester_child_engine_id="s-many-req",
                block_hashes=chain,
                pin_timeout_ms=60_000,  # the longest: none may end while the test runs
            )
        )

    waiting = [asyncio.create_task(requester.call(request(i), 30)) for i in range(256)]

    async def all_pending() -> bool:
        status = await get_status(kvrc.grpc_target)
        return sum(1 for x in status.leases if x.target_child_engine_id == "s-many-req") == 256

    try:
        await wait_until(all_pending, 30, what="256 leases waiting for their pins")
        with pytest.raises(ResourceExhaustedError, match="256 prefix loads of this session"):
            await requester.call(request(256), 5)
        assert requester.connected and not any(t.done() for t in waiting)
    finally:
        # The session's end answers every waiting call UNAVAILABLE on the client.
        await requester.close(timeout_s=5)
        never.set()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, UnavailableError) for r in results), results[:3]


async def test_a_handoff_lease_reported_as_a_prefix_load_on_the_stream_is_not_found(
    kvrc: CoordinatorProcess, parts: Parts
) -> None:
    """I2-flows-separate: the stream carries prefix-load reports; a handoff's is refused."""
    _, prefill = await parts.part("s-ho-pre")
    decode_session, decode = await parts.part("s-ho-dec")
    part = pb.RankPartDescriptor(
        rank=pb.RankCoordinates(),
        endpoint=pb.TransferEndpoint(backend="mooncake", session_name="127.0.0.1:15000"),
        block_ids=[5],
    )
    await prefill.publish_handoff("h-s", descriptor=part, kv_transfer_params={}, num_blocks=1)
    grant = await decode.begin_handoff("h-s", "s-ho-pre")
    on_stream = LeaseClient(DEAD_TARGET, "s-ho-dec", timeout_s=2, session=decode_session)
    with pytest.raises(NotFoundError):
        await on_stream.complete_prefix_load(report(grant.lease_id, "s-ho-dec"))
    # Negative control: the handoff's own report ends it.
    done = await decode.complete_handoff(report(grant.lease_id, "s-ho-dec"))
    assert (done.state, done.quiescent) == ("COMPLETED", True)


async def test_an_answer_is_not_held_behind_a_slow_pin_callback(
    kvrc: CoordinatorProcess, parts: Parts
) -> None:
    """The part's handler blocks in a pin; its own call on the stream is answered anyway."""
    pinning = asyncio.Event()
    go_on = asyncio.Event()

    async def pin_slowly(info: PinRequestInfo) -> PinAnswer:
        pinning.set()
        await go_on.wait()
        return pin_all(info)

    slow, _ = await parts.part("s-slow-hold", LeaseSessionHandler(pin=pin_slowly))
    other_session, _ = await parts.part("s-slow-req")
    chain = chain_of("s-slow", 2)
    await store_blocks(slow, chain)
    async with LeaseClient(DEAD_TARGET, "s-slow-req", timeout_s=20, session=other_session) as other:
        waiting = asyncio.create_task(other.request_prefix_load("q1", chain, pin_timeout_ms=20_000))
        await asyncio.wait_for(pinning.wait(), 10)  # the holder's handler is now blocked
        async with LeaseClient(DEAD_TARGET, "s-slow-hold", timeout_s=5, session=slow) as own:
            miss = await own.request_prefix_load("q2", chain_of("nobody", 2))
        assert isinstance(miss, Miss) and miss.reason == "no_candidate"
        assert not waiting.done()  # the pin really was still running
        go_on.set()
        grant = await asyncio.wait_for(waiting, 10)
    assert isinstance(grant, PrefixLoadGrant)


async def test_a_prefix_load_interrupted_by_a_session_blip_is_asked_again_for_the_same_lease(
    kvrc: CoordinatorProcess, parts: Parts
) -> None:
    """The stream breaks while the grant waits for a slow pin: the client registers again
    and repeats the request id, and gets the lease the holder pinned, not a second one."""
    pinned: list[str] = []
    go_on = asyncio.Event()

    async def pin_slowly(info: PinRequestInfo) -> PinAnswer:
        pinned.append(info.lease_id)
        await go_on.wait()
        return pin_all(info)

    holder, _ = await parts.part("s-blip-hold", LeaseSessionHandler(pin=pin_slowly))
    chain = chain_of("s-blip", 2)
    await store_blocks(holder, chain)
    registration = RankPartRegistration(
        engine_id="s-blip-req", profile=EngineProfile(model="m", block_size=16, reuse_opt_in=True)
    )
    requester = EngineSession(kvrc.grpc_target, registration, backoff_initial_s=0.05)

    async def silent(call: Any, interval_ms: int) -> None:
        await asyncio.Event().wait()  # no heartbeats: kvrc ends this stream after 5 s

    requester._heartbeats = silent  # type: ignore[method-assign]
    await requester.start()
    try:
        async with LeaseClient(DEAD_TARGET, "s-blip-req", timeout_s=20, session=requester) as c:
            asking = asyncio.create_task(c.request_prefix_load("b1", chain, pin_timeout_ms=20_000))
            await wait_until(lambda: len(pinned) == 1, 10, what="the holder's pin")
            # The blip: kvrc ends the silent stream; the session registers again.
            await wait_until(lambda: requester.registrations == 2, 15, what="registering again")
            go_on.set()
            grant = await asyncio.wait_for(asking, 15)
        assert isinstance(grant, PrefixLoadGrant)
        assert grant.lease_id == pinned[0] and pinned == [grant.lease_id]  # one lease, not two
    finally:
        go_on.set()
        await requester.close()
