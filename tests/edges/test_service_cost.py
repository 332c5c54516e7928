"""The cost gate through a real `kvrc serve` (I9-cost-gate), and the protocol version.

In-process rank parts speak gRPC to the coordinator process: a requester, a holder
whose loads it reports slow and one whose loads it reports fast. The slow pair ends
with `recompute_cheaper` misses (its holder no longer asked to pin) while the fast
pair keeps its grants; the grants carry their prediction, and `kvrc status` shows
the measured links. A client of the old protocol is refused, naming both versions.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from harness import (
    CoordinatorProcess,
    child_engine_status,
    get_status,
    metric_value,
    start_coordinator,
    wait_until,
)
from lease_parts import Parts, store_blocks

from clients.hashing import hash_block_chain
from clients.leases import (
    LeaseClient,
    Miss,
    PinAnswer,
    PinRequestInfo,
    PrefixLoadGrant,
)
from clients.session import EngineProfile, RankPartRegistration
from coordinator.edges.cli import _status_text, cost_model_document, prediction_document
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc
from kvrc.vocabulary import PROTOCOL_VERSION, KvRegion, TransferEndpoint

BLOCK_BYTES = 65536
ENDPOINT = TransferEndpoint(regions=(KvRegion(0x1000, BLOCK_BYTES, 64),))
BLOCKS = 8  # 128 tokens: 128 ms to recompute at the 1000 tokens/s declared below


@pytest.fixture(scope="module")
def kvrc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    profiles = Path(tmp_path_factory.mktemp("p")) / "profiles.toml"
    profiles.write_text('[[profile]]\nname = "t"\nmodel = "m"\nprefill_tokens_per_s = 1000\n')
    with start_coordinator("--reuse", "on", "--profiles", str(profiles)) as coordinator:
        yield coordinator


def pin_all(info: PinRequestInfo) -> PinAnswer:
    n = len(info.block_hashes)
    return PinAnswer(n, pb.RankPartDescriptor(rank=pb.RankCoordinates(), block_ids=list(range(n))))


@pytest.fixture
async def parts(kvrc: CoordinatorProcess) -> AsyncIterator[Parts]:
    async with Parts.open(kvrc.grpc_target, pin=pin_all, endpoint=ENDPOINT) as p:
        yield p


# How long each holder's loads take (reported by the requester): the pairs' speeds.
SPEED_US = {
    "cost-slow": 400_000,
    "cost-fast": 1_000,
    "pred-hold": 1_000,
    "rev-a": 1_000,
    "rev-b": 1_000,
}


async def load(
    requester: LeaseClient, request_id: str, chain: list[bytes]
) -> PrefixLoadGrant | Miss:
    """A prefix load; a grant is reported done, as long as its holder's speed."""
    answer = await requester.request_prefix_load(request_id, chain, pin_timeout_ms=2000)
    if isinstance(answer, PrefixLoadGrant):
        await report_done(requester, answer)
    return answer


async def report_done(requester: LeaseClient, grant: PrefixLoadGrant) -> None:
    """The grant's load completed, as long as its holder's speed (it takes that long:
    kvrc counts no more time than passed since the load was asked for)."""
    await asyncio.sleep(SPEED_US[grant.source_child_engine_id] / 1e6)
    await requester.complete_prefix_load(
        pb.TransferReport(
            lease_id=grant.lease_id,
            reporter_child_engine_id=requester.child_engine_id,
            rank=pb.RankCoordinates(),
            outcome=pb.TRANSFER_OUTCOME_SUCCEEDED,
            bytes_moved=BLOCK_BYTES * grant.matched_blocks,
            duration_us=SPEED_US[grant.source_child_engine_id],
        )
    )


async def test_a_slow_measured_pair_misses_recompute_cheaper_while_a_fast_pair_keeps_its_grants(
    kvrc: CoordinatorProcess, parts: Parts
) -> None:
    slow, _ = await parts.part("cost-slow")
    fast, _ = await parts.part("cost-fast")
    _, requester = await parts.part("cost-req")
    _, other = await parts.part("cost-req2")
    chain = hash_block_chain([7] * 16 * BLOCKS, 16, seed=11)
    await store_blocks(slow, chain)
    await store_blocks(fast, chain[:4])  # a shorter match: the slow holder is the first choice

    # Cold, the slow pair is granted (defaults lean towards loading); 400 ms per load
    # then makes it lose to a 128 ms recompute.
    answers = [await load(requester, f"s{i}", chain) for i in range(6)]
    sources = [a.source_child_engine_id if isinstance(a, PrefixLoadGrant) else a for a in answers]
    assert sources[0] == "cost-slow", sources
    # The fast holder's 4 blocks take over once the slow link is measured; fast loads.
    later = [
        a
        for a in answers[1:]
        if not (isinstance(a, PrefixLoadGrant) and a.source_child_engine_id == "cost-slow")
    ]
    assert later, sources
    assert all(
        isinstance(a, PrefixLoadGrant) and a.source_child_engine_id == "cost-fast" for a in later
    ), sources
    for i in range(3):
        answer = await load(requester, f"f{i}", chain)
        assert isinstance(answer, PrefixLoadGrant), answer
        assert answer.source_child_engine_id == "cost-fast"
    # Without the fast holder's blocks the slow pair alone is refused before any pin.
    await fast.send_event_batch(
        pb.EventBatch(
            incarnation=fast.ack.incarnation if fast.ack else 0,
            sequence=1,
            events=[pb.InventoryEvent(cleared=pb.AllBlocksCleared())],
        )
    )

    async def fast_gone() -> bool:
        state = await child_engine_status(kvrc.grpc_target, "cost-fast")
        return state is not None and state.inventory_entries == 0

    await wait_until(fast_gone, 5, what="the fast holder's blocks gone")
    miss = await load(requester, "s-after", chain)
    assert isinstance(miss, Miss) and miss.reason == "recompute_cheaper", miss
    assert miss.lease_id == ""  # decided before any pin
    assert miss.prediction is not None and not miss.prediction.worth_loading
    assert "cost-slow->cost-req" in miss.detail and "declared" in miss.detail
    # Another requester's pair with the same holder is its own, still cold: granted.
    fresh = await load(other, "o1", chain)
    assert isinstance(fresh, PrefixLoadGrant) and fresh.source_child_engine_id == "cost-slow"

    assert metric_value(kvrc, "kvrc_prefix_load_misses_total", reason="recompute_cheaper") >= 1
    assert metric_value(kvrc, "kvrc_cost_prediction_error_ratio_count", link="measured") >= 1
    status = await get_status(kvrc.grpc_target)
    links = {
        (link.holder_child_engine_id, link.requester_child_engine_id): link
        for link in status.cost_model.links
    }
    assert links[("cost-slow", "cost-req")].samples >= 2
    assert links[("cost-fast", "cost-req")].samples >= 3
    assert 0 <= links[("cost-slow", "cost-req")].age_ms < 300_000  # fresh (300 s TTL)
    assert status.cost_model.measurement_ttl_s == 300.0
    rates = {r.child_engine_id: r for r in status.cost_model.prefill_rates}
    assert rates["cost-req"].source == "declared" and rates["cost-req"].tokens_per_s == 1000
    assert status.cost_model.probe_bytes == 64 << 20  # the default: probes of 64 MiB
    text = _status_text(kvrc.grpc_target, status)
    assert "cost gate on" in text and "link cost-slow -> cost-req (gpu)" in text
    assert "probes of 64 MiB over links without a fresh fit or a declaration" in text
    assert "a fit is re-learnt 300 s after its last sample" in text
    assert status.cost_model.reverse_prior  # the default
    assert "an undeclared link stands on its measured reverse (which may spare a probe)" in text


async def test_the_grant_carries_its_prediction(kvrc: CoordinatorProcess, parts: Parts) -> None:
    holder, _ = await parts.part("pred-hold")
    _, requester = await parts.part("pred-req")
    chain = hash_block_chain([9] * 16 * BLOCKS, 16, seed=12)
    await store_blocks(holder, chain)
    raw = await requester._stub.RequestPrefixLoad(  # the wire answer itself
        pb.PrefixLoadRequest(
            request_id="p1",
            requester_child_engine_id="pred-req",
            block_hashes=chain,
            pin_timeout_ms=2000,
        ),
        timeout=10,
    )
    assert raw.outcome == pb.GRANT_OUTCOME_GRANTED
    p = raw.prediction
    assert p.worth_loading and p.num_tokens == 16 * BLOCKS and p.num_bytes == BLOCK_BYTES * BLOCKS
    assert p.recompute_ms == pytest.approx(128.0) and p.prefill_source == "declared"
    assert p.link_samples == 0 and p.holder_child_engine_id == "pred-hold"
    assert p.link_prior == "default" and "cold: defaults" in p.detail
    status = await get_status(kvrc.grpc_target)
    (lease,) = [x for x in status.leases if x.lease_id == raw.lease_id]
    assert lease.prediction.detail == p.detail


async def test_a_pairs_second_direction_starts_from_the_first(
    kvrc: CoordinatorProcess, parts: Parts
) -> None:
    # rev-b -> rev-a is measured first; rev-a -> rev-b then stands on it (the reverse
    # prior), as the prediction and kvrc status --json say.
    a, from_a = await parts.part("rev-a")
    b, from_b = await parts.part("rev-b")
    chain = hash_block_chain([5] * 16 * BLOCKS, 16, seed=13)
    await store_blocks(b, chain)
    first = await load(from_a, "rev-1", chain)
    assert isinstance(first, PrefixLoadGrant) and first.source_child_engine_id == "rev-b"
    assert first.prediction is not None and first.prediction.link_prior == "default"
    other = hash_block_chain([6] * 16 * BLOCKS, 16, seed=14)
    await store_blocks(a, other)
    back = await from_b.request_prefix_load("rev-2", other, pin_timeout_ms=2000)
    assert isinstance(back, PrefixLoadGrant) and back.source_child_engine_id == "rev-a"
    assert back.prediction is not None and back.prediction.link_samples == 0
    assert back.prediction.link_prior == "reverse"
    assert "cold: the reverse link's estimate" in back.prediction.detail
    status = await get_status(kvrc.grpc_target)
    (lease,) = [x for x in status.leases if x.lease_id == back.lease_id]
    assert prediction_document(lease.prediction)["link_prior"] == "reverse"
    assert cost_model_document(status.cost_model)["reverse_prior"] is True
    await report_done(from_b, back)
    await wait_until(
        lambda: metric_value(kvrc, "kvrc_cost_prediction_error_ratio_count", link="reverse") == 1,
        5,
        what="the load's prediction error counted under link=reverse",
    )


async def register_raw(target: str, register: pb.Register) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        call = stub.Session(iter([pb.EngineMessage(register=register)]), timeout=5)
        try:
            async for _ in call:
                break
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""


@pytest.mark.parametrize(
    ("version", "needle"),
    [
        (
            0,
            f"client speaks kvrc protocol v1, this coordinator speaks v{PROTOCOL_VERSION}; "
            "upgrade the kvrc client",
        ),
        (1, f"client speaks kvrc protocol v1, this coordinator speaks v{PROTOCOL_VERSION}"),
        # The revision before this one (v2: no calls on the session stream).
        (
            PROTOCOL_VERSION - 1,
            f"client speaks kvrc protocol v{PROTOCOL_VERSION - 1}, this coordinator speaks "
            f"v{PROTOCOL_VERSION}; upgrade the kvrc client library",
        ),
        (
            PROTOCOL_VERSION + 1,
            f"v{PROTOCOL_VERSION + 1}, this coordinator speaks v{PROTOCOL_VERSION}; upgrade this",
        ),
    ],
)
async def test_another_protocol_version_is_failed_precondition_naming_both_and_changes_nothing(
    kvrc: CoordinatorProcess, version: int, needle: str
) -> None:
    register = RankPartRegistration(
        engine_id="old-client", profile=EngineProfile(model="m", block_size=16)
    ).to_proto()
    register.protocol_version = version
    before = await get_status(kvrc.grpc_target)
    code, message = await register_raw(kvrc.grpc_target, register)
    assert code is grpc.StatusCode.FAILED_PRECONDITION and needle in message, message
    after = await get_status(kvrc.grpc_target)
    assert "old-client" not in {c.state.child_engine_id for c in after.child_engines}
    assert len(after.child_engines) == len(before.child_engines)
    # Negative control: the same Register with this library's version is admitted.
    register.protocol_version = PROTOCOL_VERSION
    session_code = await asyncio.wait_for(_admitted(kvrc.grpc_target, register), 10)
    assert session_code


async def _admitted(target: str, register: pb.Register) -> bool:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        call = stub.Session(iter([pb.EngineMessage(register=register)]), timeout=5)
        async for message in call:
            call.cancel()
            return message.HasField("register_ack")
    return False
