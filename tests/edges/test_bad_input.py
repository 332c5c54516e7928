"""Malformed input is refused with INVALID_ARGUMENT and changes nothing (I8-bad-input).

Raw protobuf over a real session stream, so each case sends exactly what a
buggy or hostile client could send. After every case GetStatus must be
identical to the baseline, and the service must still accept good input. A
session that ends with INVALID_ARGUMENT hears it first in band: one SessionError,
the stream's last message, with the status's code and text (`run_session`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from grpc.aio import EOF  # type: ignore[attr-defined]  # missing from grpc-stubs
from harness import CoordinatorProcess, get_status, start_coordinator, without_heartbeat_times

from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc
from kvrc.vocabulary import PROTOCOL_VERSION

MiB = 1 << 20


def good_register(engine_id: str = "bad-input", tp_rank: int = 0) -> pb.Register:
    return pb.Register(
        engine_id=engine_id,
        dp_rank=0,
        child_engine_id=engine_id,
        rank=pb.RankCoordinates(tp_rank=tp_rank),
        profile=pb.DeploymentProfile(
            model="m",
            block_size=16,
            kv_dtype="bfloat16",
            parallel=pb.ParallelSizes(tp_size=2, pp_size=1, pcp_size=1, dp_size=1, dcp_size=1),
        ),
        endpoint=pb.TransferEndpoint(backend="mooncake", session_name="127.0.0.1:15000"),
        protocol_version=PROTOCOL_VERSION,
    )


def mutate(change: Callable[[pb.Register], None]) -> pb.Register:
    reg = good_register()
    change(reg)
    return reg


@pytest.fixture(scope="module")
def kvrc() -> Iterator[CoordinatorProcess]:
    with start_coordinator() as coordinator:
        yield coordinator


async def run_session(target: str, messages: list[pb.EngineMessage]) -> tuple[grpc.StatusCode, str]:
    """Sends `messages`, then reads until the coordinator ends the stream. An ending
    with INVALID_ARGUMENT must come after exactly one SessionError, the stream's last
    message, that says the same (the status alone can reach a client mangled)."""
    replies: list[pb.CoordinatorMessage] = []
    async with grpc.aio.insecure_channel(
        target,
        options=[("grpc.max_send_message_length", 64 * MiB)],
    ) as channel:
        call = _open(channel)
        try:
            for message in messages:
                await call.write(message)
            await call.done_writing()
            while True:
                reply: Any = await call.read()
                if reply is EOF:
                    break
                replies.append(reply)
            code, details = await call.code(), await call.details()
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details() or ""
    check_session_error(replies, code, details)
    return code, details


def check_session_error(
    replies: list[pb.CoordinatorMessage], code: grpc.StatusCode, details: str
) -> None:
    errors = [r.session_error for r in replies if r.WhichOneof("message") == "session_error"]
    if code is not grpc.StatusCode.INVALID_ARGUMENT:
        assert errors == [], (code, errors)
        return
    assert replies and replies[-1].WhichOneof("message") == "session_error", replies
    assert len(errors) == 1, errors
    assert errors[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert errors[0].message == details, (errors[0].message, details)


def _open(channel: grpc.aio.Channel) -> Any:
    return pb_grpc.EngineServiceStub(channel).Session()  # type: ignore[call-arg]


def _set(path: str, value: object) -> Callable[[pb.Register], None]:
    def change(reg: pb.Register) -> None:
        *parents, leaf = path.split(".")
        target: object = reg
        for name in parents:
            target = getattr(target, name)
        if isinstance(value, pb.ParallelSizes):
            getattr(target, leaf).CopyFrom(value)  # message fields are not assignable
        else:
            setattr(target, leaf, value)

    return change


def _held(*leases: pb.HeldLease, ids: int = 0) -> Callable[[pb.Register], None]:
    def change(reg: pb.Register) -> None:
        reg.held_leases.extend(leases)
        reg.held_lease_ids.extend(f"pl-{i}" for i in range(ids))

    return change


REGISTER_CASES: list[tuple[str, Callable[[pb.Register], None], str]] = [
    ("empty engine_id", _set("engine_id", ""), "engine_id is empty"),
    ("empty child_engine_id", _set("child_engine_id", ""), "child_engine_id is empty"),
    ("id too long", _set("engine_id", "e" * 300), "engine_id is 300 characters"),
    ("id not printable", _set("engine_id", "e\n1"), "engine_id must be printable ASCII"),
    ("id not ascii", _set("engine_id", "é"), "engine_id must be printable ASCII"),
    ("tp_rank >= tp_size", _set("rank.tp_rank", 2), "rank.tp_rank must be in [0, 2), got 2"),
    ("pp_rank >= pp_size", _set("rank.pp_rank", 1), "rank.pp_rank must be in [0, 1), got 1"),
    ("dp_rank >= dp_size", _set("dp_rank", 3), "dp_rank must be in [0, 1), got 3"),
    ("huge rank", _set("rank.pcp_rank", 2**32 - 1), "rank.pcp_rank must be in [0, 1)"),
    ("tp_size 0", _set("profile.parallel.tp_size", 0), "profile.parallel.tp_size must be in"),
    ("dp_size 0", _set("profile.parallel.dp_size", 0), "profile.parallel.dp_size must be in"),
    ("size too large", _set("profile.parallel.pp_size", 5000), "profile.parallel.pp_size"),
    (
        "grid too large",
        _set(
            "profile.parallel",
            pb.ParallelSizes(tp_size=2, pp_size=1024, pcp_size=8, dp_size=1, dcp_size=1),
        ),
        "tp_size x pp_size x pcp_size = 16384 rank parts exceeds the limit of 4096",
    ),
    ("empty model", _set("profile.model", ""), "profile.model is empty"),
    ("block_size 0", _set("profile.block_size", 0), "profile.block_size must be >= 1"),
    ("unknown publish_mode", _set("publish_mode", 99), "publish_mode: unknown enum value 99"),
    ("missing profile", lambda r: r.ClearField("profile"), "profile is missing"),
    (
        "oversized metadata",
        _set("endpoint.agent_metadata", b"\x00" * (2 * MiB)),
        "endpoint metadata (agent_metadata + extra) is 2097152 bytes; the limit is 1048576",
    ),
    (
        "too many regions",
        lambda r: r.endpoint.regions.extend(pb.KvRegion() for _ in range(5000)),
        "endpoint.regions has 5000 entries; the limit is 4096",
    ),
    (
        # Summed into a prediction's uint64 byte count, it broke other engines' prefix
        # loads and GetStatus (INTERNAL) once such a holder was picked.
        "a region's block_len past 1 GiB",
        lambda r: r.endpoint.regions.extend(
            [pb.KvRegion(block_len=64), pb.KvRegion(block_len=1 << 63)]
        ),
        "endpoint.regions[1].block_len is 9223372036854775808 bytes; the limit is 1073741824",
    ),
    (
        "oversized model name",
        _set("profile.model", "m" * 5000),
        "profile.model is 5000 characters",
    ),
    (
        "bad held lease requester",
        _held(pb.HeldLease(lease_id="pl-1", requester_child_engine_id="r\n")),
        "held_leases[].requester_child_engine_id must be printable ASCII",
    ),
    (
        "held lease without an id",
        _held(pb.HeldLease(requester_child_engine_id="req")),
        "held_leases[].lease_id is empty",
    ),
    (
        "too many held leases, in both fields together",
        _held(*(pb.HeldLease(lease_id=f"pl-h{i}") for i in range(1500)), ids=3000),
        "held_leases and held_lease_ids name 4500 distinct leases; the limit is 4096",
    ),
    (
        "too many held leases",
        _held(*(pb.HeldLease(lease_id=f"pl-h{i}") for i in range(4097))),
        "held_leases has 4097 entries; the limit is 4096",
    ),
    (
        "too many extra entries",
        lambda r: r.profile.extra.update({f"k{i}": "v" for i in range(100)}),
        "profile.extra has 100 entries",
    ),
]


@pytest.mark.parametrize(
    ("change", "needle"),
    [(c, n) for _, c, n in REGISTER_CASES],
    ids=[name for name, _, _ in REGISTER_CASES],
)
async def test_bad_registration_is_invalid_argument_and_changes_nothing(
    kvrc: CoordinatorProcess, change: Callable[[pb.Register], None], needle: str
) -> None:
    before = without_heartbeat_times(await get_status(kvrc.grpc_target))
    code, details = await run_session(kvrc.grpc_target, [pb.EngineMessage(register=mutate(change))])
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert needle in details
    assert without_heartbeat_times(await get_status(kvrc.grpc_target)) == before


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "the session stream ended before its Register message"),
        (
            [pb.EngineMessage(heartbeat=pb.Heartbeat())],
            "the first session message must be register, got heartbeat",
        ),
        ([pb.EngineMessage()], "the first session message must be register, got nothing"),
    ],
    ids=["no message", "heartbeat first", "empty message"],
)
async def test_session_must_start_with_register(
    kvrc: CoordinatorProcess, messages: list[pb.EngineMessage], needle: str
) -> None:
    before = without_heartbeat_times(await get_status(kvrc.grpc_target))
    code, details = await run_session(kvrc.grpc_target, messages)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in details
    assert without_heartbeat_times(await get_status(kvrc.grpc_target)) == before


@pytest.mark.parametrize(
    ("second", "needle"),
    [
        (
            pb.EngineMessage(register=good_register("later", tp_rank=1)),
            "register may only be the first message",
        ),
        (pb.EngineMessage(), "empty or unknown EngineMessage"),
        (
            pb.EngineMessage(release_ack=pb.ReleaseAck()),
            "release_ack names no lease: set lease_id or lease_ids",
        ),
        (
            pb.EngineMessage(release_ack=pb.ReleaseAck(lease_ids=["pl-x"] * 4097)),
            "release_ack.lease_ids has 4097 entries; the limit is 4096",
        ),
        (
            pb.EngineMessage(release_ack=pb.ReleaseAck(lease_ids=["pl-x", "bad\x01id"])),
            "release_ack.lease_ids[1] must be printable ASCII",
        ),
    ],
    ids=["second register", "empty message", "empty ack", "too many acks", "bad ack id"],
)
async def test_protocol_error_after_register_ends_only_that_session(
    kvrc: CoordinatorProcess, second: pb.EngineMessage, needle: str
) -> None:
    before = without_heartbeat_times(await get_status(kvrc.grpc_target))
    code, details = await run_session(
        kvrc.grpc_target,
        [pb.EngineMessage(register=good_register("proto-err")), second],
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in details
    # Its own part went with the session; nothing else changed.
    assert without_heartbeat_times(await get_status(kvrc.grpc_target)) == before


async def test_message_above_grpc_limit_is_resource_exhausted(kvrc: CoordinatorProcess) -> None:
    """Above the documented 16 MiB hard limit grpc refuses before our validation runs."""
    before = without_heartbeat_times(await get_status(kvrc.grpc_target))
    huge = _set("endpoint.agent_metadata", b"\x01" * (17 * MiB))
    code, _ = await run_session(kvrc.grpc_target, [pb.EngineMessage(register=mutate(huge))])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert without_heartbeat_times(await get_status(kvrc.grpc_target)) == before


async def test_service_still_accepts_good_input_and_state_holds(kvrc: CoordinatorProcess) -> None:
    # Bad input never touches another engine: register one part, send garbage, check.
    async with grpc.aio.insecure_channel(kvrc.grpc_target) as channel:
        call = _open(channel)
        await call.write(pb.EngineMessage(register=good_register("survivor")))
        ack: Any = await call.read()
        assert ack.register_ack.state.parts_present == 1
        before = without_heartbeat_times(await get_status(kvrc.grpc_target))
        for _, change, _ in REGISTER_CASES[:6]:
            await run_session(kvrc.grpc_target, [pb.EngineMessage(register=mutate(change))])
        after = await get_status(kvrc.grpc_target)
        await call.done_writing()
    assert without_heartbeat_times(after) == without_heartbeat_times(before)
    assert [c.state.child_engine_id for c in after.child_engines] == ["survivor"]


async def test_a_report_of_more_bytes_than_any_load_moves_is_refused(
    kvrc: CoordinatorProcess,
) -> None:
    """2^64 - 1 bytes in one report set kvrc_transfer_bytes_total to 1.8e19 for good."""
    report = pb.TransferReport(
        lease_id="pl-any",
        reporter_child_engine_id="anyone",
        outcome=pb.TRANSFER_OUTCOME_SUCCEEDED,
        bytes_moved=2**64 - 1,
        duration_us=1_000,
    )
    async with grpc.aio.insecure_channel(kvrc.grpc_target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pb_grpc.EngineServiceStub(channel).CompletePrefixLoad(report)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bytes_moved 18446744073709551615 exceeds" in (refused.value.details() or "")


async def test_an_engine_past_its_share_of_endpoint_bytes_is_refused_others_still_register() -> (
    None
):
    """`--max-endpoint-bytes` 400,000: one engine may hold 100,000 bytes of endpoints.
    Its second 60,000-byte part is RESOURCE_EXHAUSTED naming the flag, and changes
    nothing; another engine's part still registers."""
    from clients.session import EngineProfile, EngineSession, RankPartRegistration
    from kvrc.vocabulary import TransferEndpoint

    def part(engine_id: str, tp_rank: int) -> RankPartRegistration:
        return RankPartRegistration(
            engine_id=engine_id,
            tp_rank=tp_rank,
            tp_size=2,
            profile=EngineProfile(model="m", block_size=16, kv_dtype="bfloat16"),
            endpoint=TransferEndpoint(backend="mooncake", agent_metadata=b"m" * 60_000),
        )

    with start_coordinator("--max-endpoint-bytes", "400000") as kvrc:
        first = EngineSession(kvrc.grpc_target, part("big", 0), reconnect=False)
        await first.start()
        before = without_heartbeat_times(await get_status(kvrc.grpc_target))
        second = good_register("big", tp_rank=1)
        second.endpoint.agent_metadata = b"m" * 60_000
        second.profile.transfer_backends.append("mooncake")  # as EngineProfile's default
        code, details = await run_session(kvrc.grpc_target, [pb.EngineMessage(register=second)])
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert "engine 'big''s parts 60000, past its share" in details
        assert "(--max-endpoint-bytes)" in details
        assert without_heartbeat_times(await get_status(kvrc.grpc_target)) == before
        other = EngineSession(kvrc.grpc_target, part("other", 0), reconnect=False)
        await other.start()
        await other.close()
        await first.close()


async def test_a_kv_events_endpoint_outside_the_allowed_hosts_is_permission_denied() -> None:
    """With `--kv-events-hosts`, a registration whose KV events kvrc would subscribe to
    (or bind) on another host is PERMISSION_DENIED naming the endpoint, and changes
    nothing; one on an allowed host registers."""
    with start_coordinator("--kv-events-hosts", "10.0.0.0/8,*.kv.example") as kvrc:
        before = without_heartbeat_times(await get_status(kvrc.grpc_target))
        for endpoint, subscribed in (
            ("tcp://*:5557", "connect to tcp://127.0.0.1:5557"),  # vLLM binds: its host
            ("tcp://192.0.2.1:5557", "bind tcp://192.0.2.1:5557"),  # vLLM connects
        ):
            reg = good_register("outside")
            reg.kv_events_endpoint = endpoint
            code, details = await run_session(kvrc.grpc_target, [pb.EngineMessage(register=reg)])
            assert code == grpc.StatusCode.PERMISSION_DENIED, details
            assert f"kv_events_endpoint: kvrc would {subscribed}, a host outside" in details
            assert "--kv-events-hosts (10.0.0.0/8, *.kv.example)" in details
        assert without_heartbeat_times(await get_status(kvrc.grpc_target)) == before
        from clients.session import EngineProfile, EngineSession, RankPartRegistration
        from kvrc.vocabulary import TransferEndpoint

        inside = RankPartRegistration(
            engine_id="inside",
            profile=EngineProfile(model="m", block_size=16),
            endpoint=TransferEndpoint(backend="mooncake", session_name="10.0.0.5:15000"),
            kv_events_endpoint="tcp://*:5557",  # kvrc connects to 10.0.0.5:5557: allowed
        )
        session = EngineSession(kvrc.grpc_target, inside, reconnect=False)
        await session.start()
        status = await get_status(kvrc.grpc_target)
        assert [e.state.child_engine_id for e in status.child_engines] == ["inside"]
        await session.close()
