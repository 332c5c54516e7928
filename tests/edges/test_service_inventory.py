"""The advisory inventory through the real service.

Issue 3; I1-reuse-off, I4-advisory, I5-complete-parts, I7-ordered-streams, I8-bad-input.

A real `kvrc serve` subprocess on loopback; engines are real `EngineSession`s
over gRPC publishing with `clients.inventory.InventoryPublisher` (or raw
`EventBatch`es where a test needs a malformed or out-of-order one); lookups go
through `clients.inventory.LookupClient`. Events travel on the session stream
and lookups on another channel, so a test that expects something *not* to be
visible first waits for a later marker batch of the same stream: the
coordinator handles one stream's messages in order.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import (
    PYTHON,
    REPO,
    CoordinatorProcess,
    child_engine_status,
    get_status,
    metric_value,
    start_coordinator,
    wait_until,
)

from clients.errors import FailedPreconditionError, InvalidArgumentError, KvrcClientError
from clients.inventory import (
    Candidate,
    InventoryPublisher,
    LookupClient,
    LookupOutcome,
    LookupQuery,
    LookupResult,
    PublishingHandler,
    StoredBlocks,
)
from clients.refengine.demo import child_process_env
from clients.session import EngineProfile, EngineSession, NullHandler, RankPartRegistration
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.vocabulary import PublishMode, Tier

PROFILES = """
[[profile]]
name = "test"
model = "test-model"

[[profile]]
name = "other"
model = "other-model"
"""

CHAIN = tuple(bytes([0xA0, i]) * 4 for i in range(16))  # 8-byte hashes


def h(tag: int, i: int) -> bytes:
    return bytes([tag, i]) * 4


# --- fixtures and helpers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def profiles_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profiles") / "profiles.toml"
    path.write_text(PROFILES)
    return path


@pytest.fixture(scope="module")
def reuse_on(profiles_file: Path) -> Iterator[CoordinatorProcess]:
    with start_coordinator(
        "--reuse", "on", "--profiles", str(profiles_file), "--session-grace-ms", "200"
    ) as coordinator:
        yield coordinator


class Recorder(NullHandler):
    def __init__(self) -> None:
        self.resyncs: list[pb.ResyncRequest] = []

    async def on_resync_request(self, request: pb.ResyncRequest) -> None:
        self.resyncs.append(request)


@dataclass
class Engine:
    session: EngineSession
    publisher: InventoryPublisher
    recorder: Recorder
    retained: list[StoredBlocks] = field(default_factory=list)  # what dump() returns

    @property
    def child_engine_id(self) -> str:
        return self.session.registration.resolved_child_engine_id

    @property
    def incarnation(self) -> int:
        assert self.session.ack is not None
        return self.session.ack.incarnation


@pytest.fixture
async def engines() -> AsyncIterator[list[Engine]]:
    opened: list[Engine] = []
    yield opened
    for engine in opened:
        await engine.session.close()


async def open_engine(
    engines: list[Engine],
    target: str,
    engine_id: str,
    *,
    model: str = "test-model",
    opt_in: bool = True,
    with_dump: bool = True,
    wait_ready: bool = True,
    **kw: Any,
) -> Engine:
    registration = RankPartRegistration(
        engine_id=engine_id,
        profile=EngineProfile(model=model, block_size=16, kv_dtype="bfloat16", reuse_opt_in=opt_in),
        **kw,
    )
    recorder = Recorder()
    holder: list[Engine] = []
    session = EngineSession(target, registration, reconnect=False)
    publisher = InventoryPublisher(
        session, dump=(lambda: list(holder[0].retained)) if with_dump else None
    )
    session.handler = PublishingHandler(publisher, recorder)
    engine = Engine(session, publisher, recorder)
    holder.append(engine)
    await session.start()
    engines.append(engine)
    if wait_ready:
        await session.wait_ready(10)
    return engine


async def open_tp2(engines: list[Engine], target: str, engine_id: str) -> None:
    await open_engine(engines, target, engine_id, tp_size=2, tp_rank=0, wait_ready=False)
    await open_engine(engines, target, engine_id, tp_size=2, tp_rank=1)


async def lookup(
    target: str, requester: str, chain: tuple[bytes, ...] = CHAIN, **kw: Any
) -> LookupResult:
    async with LookupClient(target) as client:
        return await client.lookup(requester, chain, **kw)


async def eventually_holds(
    target: str, requester: str, holder: str, blocks: int, chain: tuple[bytes, ...] = CHAIN
) -> LookupResult:
    """Waits until `holder` is a candidate with `blocks` matched blocks."""
    box: list[LookupResult] = []

    async def check() -> bool:
        result = await lookup(target, requester, chain, max_candidates=64)
        box[:] = [result]
        return any(
            c.child_engine_id == holder and c.matched_blocks == blocks for c in result.candidates
        )

    try:
        await wait_until(check, 10)
    except TimeoutError:
        raise AssertionError(f"{holder} never held {blocks} blocks; last answer {box}") from None
    return box[0]


async def entries(target: str, child_engine_id: str) -> int:
    status = await child_engine_status(target, child_engine_id)
    assert status is not None, f"{child_engine_id} is not registered"
    return int(status.inventory_entries)


async def is_stale(target: str, child_engine_id: str) -> bool:
    status = await child_engine_status(target, child_engine_id)
    assert status is not None, f"{child_engine_id} is not registered"
    return bool(status.state.stale)


def holders(result: LookupResult) -> dict[str, int]:
    return {c.child_engine_id: c.matched_blocks for c in result.candidates}


def raw_batch(
    incarnation: int, sequence: int, *events: pb.InventoryEvent, **flags: bool
) -> pb.EventBatch:
    return pb.EventBatch(incarnation=incarnation, sequence=sequence, events=list(events), **flags)


def stored(
    *hashes: bytes, tier: pb.Tier.ValueType = pb.TIER_GPU, expiry: int = 0
) -> pb.InventoryEvent:
    return pb.InventoryEvent(
        stored=pb.BlockStored(block_hashes=list(hashes), tier=tier, expiry_unix_ms=expiry)
    )


# --- lookup and ranking ---------------------------------------------------------------


async def test_lookup_ranks_longest_match_then_faster_tier_and_skips_the_requester(
    reuse_on: CoordinatorProcess, engines: list[Engine]
) -> None:
    t = reuse_on.grpc_target
    req = await open_engine(engines, t, "rank-req")
    long_ = await open_engine(engines, t, "rank-long")
    gpu = await open_engine(engines, t, "rank-gpu")
    cpu = await open_engine(engines, t, "rank-cpu")
    await req.publisher.stored(CHAIN)  # the requester's own retention: not returned by default
    await long_.publisher.stored(CHAIN[:8])
    await cpu.publisher.stored(CHAIN[:4], tier=Tier.CPU)
    await gpu.publisher.stored(CHAIN[:4], tier=Tier.GPU)
    await eventually_holds(t, "rank-req", "rank-cpu", 4)
    await eventually_holds(t, "rank-req", "rank-gpu", 4)
    result = await eventually_holds(t, "rank-req", "rank-long", 8)

    assert result.outcome is LookupOutcome.HIT
    assert result.reuse.enabled and result.reuse.reason == "ENABLED"
    assert [c.child_engine_id for c in result.candidates] == ["rank-long", "rank-gpu", "rank-cpu"]
    assert result.candidates[0] == Candidate("rank-long", 8, Tier.GPU, 0, 0)
    assert result.candidates[2].tier is Tier.CPU

    with_self = await lookup(t, "rank-req", include_self=True)
    assert with_self.candidates[0] == Candidate("rank-req", 16, Tier.GPU, 0, 0)
    top1 = await lookup(t, "rank-req", max_candidates=1)
    assert [c.child_engine_id for c in top1.candidates] == ["rank-long"]
    # min_blocks: the recompute threshold.
    below = await lookup(t, "rank-req", min_blocks=9)
    assert below.outcome is LookupOutcome.BELOW_MIN_BLOCKS and below.candidates == ()
    only_long = await lookup(t, "rank-req", min_blocks=5, max_candidates=64)
    assert holders(only_long) == {"rank-long": 8}
    miss = await lookup(t, "rank-req", (h(0xEE, 0), *CHAIN))
    assert miss.outcome is LookupOutcome.MISS and miss.candidates == ()


async def test_several_queries_in_one_call_answer_in_order(
    reuse_on: CoordinatorProcess, engines: list[Engine]
) -> None:
    t = reuse_on.grpc_target
    await open_engine(engines, t, "multi-req")
    holder = await open_engine(engines, t, "multi-holder")
    other = tuple(h(0xB1, i) for i in range(4))
    await holder.publisher.stored(CHAIN[:3])
    await holder.publisher.stored(other)
    await eventually_holds(t, "multi-req", "multi-holder", 4, other)
    async with LookupClient(t) as client:
        results = await client.lookup_many(
            "multi-req",
            [LookupQuery(CHAIN), LookupQuery((h(0xEF, 1),)), LookupQuery(other, min_blocks=2)],
        )
    assert [r.outcome for r in results] == [
        LookupOutcome.HIT,
        LookupOutcome.MISS,
        LookupOutcome.HIT,
    ]
    assert holders(results[0]) == {"multi-holder": 3}
    assert holders(results[2]) == {"multi-holder": 4}


async def test_expired_entries_are_never_returned(
    reuse_on: CoordinatorProcess, engines: list[Engine]
) -> None:
    t = reuse_on.grpc_target
    await open_engine(engines, t, "exp-req")
    holder = await open_engine(engines, t, "exp-holder")
    expiry = time.time_ns() // 1_000_000 + 1500
    await holder.publisher.stored(CHAIN[:6], expiry_unix_ms=expiry)
    result = await eventually_holds(t, "exp-req", "exp-holder", 6)
    assert result.candidates[0].expiry_unix_ms == expiry

    async def missed() -> bool:
        return (await lookup(t, "exp-req")).outcome is LookupOutcome.MISS

    # Gone by its expiry (100 ms of slack), not some time later.
    await wait_until(missed, max(0.0, expiry / 1000 - time.time()) + 0.1, what="expired")


# --- reuse gating (I1-reuse-off) -----------------------------------------------------------


async def test_reuse_off_returns_no_candidates_with_the_reason(
    profiles_file: Path, engines: list[Engine]
) -> None:
    with start_coordinator("--profiles", str(profiles_file)) as kvrc:
        t = kvrc.grpc_target
        try:
            await open_engine(engines, t, "off-req")
            holder = await open_engine(engines, t, "off-holder")
            await holder.publisher.stored(CHAIN[:4])

            async def stored_4() -> bool:
                return await entries(t, "off-holder") == 4

            await wait_until(stored_4, 10)
            result = await lookup(t, "off-req")
            assert result.outcome is LookupOutcome.REUSE_UNAVAILABLE
            assert result.candidates == ()
            assert result.reuse.reason == "DISABLED_BY_COORDINATOR"
            assert "--reuse on" in result.reuse.detail
            assert metric_value(kvrc, "kvrc_lookups_total", outcome="reuse_unavailable") == 1
        finally:
            for engine in engines:
                await engine.session.close()
            engines.clear()


async def test_requester_gate_reasons_and_holders_that_do_not_opt_in(
    reuse_on: CoordinatorProcess, engines: list[Engine]
) -> None:
    t = reuse_on.grpc_target
    await open_engine(engines, t, "gate-req")
    await open_engine(engines, t, "gate-noopt", opt_in=False)
    await open_engine(engines, t, "gate-undeclared", model="undeclared-model")
    await open_engine(engines, t, "gate-half", tp_size=2, wait_ready=False)
    shy = await open_engine(engines, t, "gate-shy-holder", opt_in=False)
    visible = await open_engine(engines, t, "gate-holder")
    await shy.publisher.stored(CHAIN[:10])
    await visible.publisher.stored(CHAIN[:2])
    await eventually_holds(t, "gate-req", "gate-holder", 2)

    async def shy_stored() -> bool:
        return await entries(t, "gate-shy-holder") == 10

    await wait_until(shy_stored, 10)
    # A holder whose own gate is closed is never a source.
    assert holders(await lookup(t, "gate-req", max_candidates=64)) == {"gate-holder": 2}

    for requester, reason in (
        ("gate-noopt", "PROFILE_NOT_OPTED_IN"),
        ("gate-undeclared", "PROFILE_NOT_DECLARED"),
        ("gate-nobody", "REQUESTER_UNKNOWN"),
        ("gate-half", "REQUESTER_NOT_READY"),
    ):
        result = await lookup(t, requester)
        assert result.outcome is LookupOutcome.REUSE_UNAVAILABLE, requester
        assert result.candidates == (), requester
        assert result.reuse.reason == reason, requester
        assert not result.reuse.enabled


async def test_scopes_never_mix(reuse_on: CoordinatorProcess, engines: list[Engine]) -> None:
    t = reuse_on.grpc_target
    req = await open_engine(engines, t, "scope-req")
    other_req = await open_engine(engines, t, "scope-other-req", model="other-model")
    same = await open_engine(engines, t, "scope-same")
    other = await open_engine(engines, t, "scope-other", model="other-model")
    await same.publisher.stored(CHAIN[:3])
    await other.publisher.stored(CHAIN[:9])  # the same hashes, another compatibility hash
    await eventually_holds(t, "scope-req", "scope-same", 3)
    await eventually_holds(t, "scope-other-req", "scope-other", 9)
    assert holders(await lookup(t, "scope-req", max_candidates=64)) == {"scope-same": 3}
    assert holders(await lookup(t, "scope-other-req", max_candidates=64)) == {"scope-other": 9}
    # Naming the other scope explicitly is refused, not answered: FAILED_PRECONDITION
    # naming both hashes, as RequestPrefixLoad refuses it.
    assert other_req.session.ack is not None and req.session.ack is not None
    foreign = other_req.session.ack.compatibility_hash
    assert foreign != req.session.ack.compatibility_hash
    with pytest.raises(FailedPreconditionError, match="never exchange KV"):
        await lookup(t, "scope-req", compatibility_hash=foreign)
    own = await lookup(t, "scope-req", compatibility_hash=req.session.ack.compatibility_hash)
    assert holders(own) == {"scope-same": 3}


# --- ordered streams (I7-ordered-streams) ----------------------------------------------------


async def test_duplicate_batches_are_dropped(
    reuse_on: CoordinatorProcess, engines: list[Engine]
) -> None:
    t = reuse_on.grpc_target
    await open_engine(engines, t, "dup-req")
    holder = await open_engine(engines, t, "dup-holder")
    inc = holder.incarnation
    before = metric_value(reuse_on, "kvrc_event_batches_total", source="grpc", result="duplicate")
    await holder.session.send_event_batch(raw_batch(inc, 0, stored(*CHAIN[:2])))
    await holder.session.send_event_batch(raw_batch(inc, 0, stored(*CHAIN[2:5])))  # duplicate
    await holder.session.send_event_batch(raw_batch(inc, 1, stored(h(0xD0, 0))))  # marker
    await eventually_holds(t, "dup-req", "dup-holder", 1, (h(0xD0, 0),))
    assert holders(await lookup(t, "dup-req")) == {"dup-holder": 2}
    after = metric_value(reuse_on, "kvrc_event_batches_total", source="grpc", result="duplicate")
    assert after == before + 1


async def test_an_older_incarnation_is_fenced(
    reuse_on: CoordinatorProcess, engines: list[Engine]
) -> None:
    t = reuse_on.grpc_target
    await open_tp2(engines, t, "fence-req")  # tp_size is part of the compatibility hash
    # Per child engine, any part may publish: part 1 registered later (newer incarnation).
    part0 = await open_engine(engines, t, "fence-holder", tp_size=2, tp_rank=0, wait_ready=False)
    part1 = await open_engine(engines, t, "fence-holder", tp_size=2, tp_rank=1)
    assert part1.incarnation > part0.incarnation
    before = metric_value(reuse_on, "kvrc_event_batches_total", source="grpc", result="fenced")
    await part1.session.send_event_batch(raw_batch(part1.incarnation, 0, stored(*CHAIN[:2])))
    await eventually_holds(t, "fence-req", "fence-holder", 2)
    # The older incarnation's batch (on part 0's session) is fenced, as is a batch that
    # claims an incarnation older than its own session's.
    await part0.session.send_event_batch(raw_batch(part0.incarnation, 1, stored(*CHAIN[:8])))
    await part1.session.send_event_batch(raw_batch(part0.incarnation, 1, stored(*CHAIN[:8])))
    await part1.session.send_event_batch(raw_batch(part1.incarnation, 1, stored(h(0xF0, 0))))
    await eventually_holds(t, "fence-req", "fence-holder", 1, (h(0xF0, 0),))
    assert holders(await lookup(t, "fence-req")) == {"fence-holder": 2}
    after = metric_value(reuse_on, "kvrc_event_batches_total", source="grpc", result="fenced")
    assert after == before + 2


async def test_gap_makes_the_engine_stale_until_a_full_dump(
    reuse_on: CoordinatorProcess, engines: list[Engine]
) -> None:
    t = reuse_on.grpc_target
    await open_engine(engines, t, "gap-req")
    holder = await open_engine(engines, t, "gap-holder", with_dump=False)
    await holder.publisher.stored(CHAIN[:4])  # sequence 0
    await eventually_holds(t, "gap-req", "gap-holder", 4)
    resyncs_before = metric_value(reuse_on, "kvrc_resync_requests_total", source="grpc")

    # Sequence 1 is lost; sequence 2 arrives.
    await holder.session.send_event_batch(raw_batch(holder.incarnation, 2, stored(*CHAIN[4:8])))

    async def resync_asked() -> bool:
        return bool(holder.recorder.resyncs)

    await wait_until(resync_asked, 10)
    assert holder.recorder.resyncs[0].expected_sequence == 1
    assert await is_stale(t, "gap-holder")
    assert (await lookup(t, "gap-req")).outcome is LookupOutcome.MISS
    # Later live batches of a stale stream are refused; the request is resent only on
    # its retry timer while no dump begins (tests/edges/test_resync.py), never per batch.
    await holder.session.send_event_batch(raw_batch(holder.incarnation, 3, stored(*CHAIN)))
    assert metric_value(reuse_on, "kvrc_resync_requests_total", source="grpc") >= resyncs_before + 1

    # The engine answers with a full dump (sequence 4 onwards): its state is replaced.
    inc = holder.incarnation
    await holder.session.send_event_batch(raw_batch(inc, 4, stored(*CHAIN[:3]), dump_begin=True))
    await holder.session.send_event_batch(raw_batch(inc, 5, stored(h(0xC0, 0)), dump_end=True))
    result = await eventually_holds(t, "gap-req", "gap-holder", 3)
    assert not await is_stale(t, "gap-holder")
    assert result.outcome is LookupOutcome.HIT
    assert await entries(t, "gap-holder") == 4
    assert all(r.expected_sequence == 1 for r in holder.recorder.resyncs)


async def test_resync_request_is_answered_by_the_publisher_dump(
    reuse_on: CoordinatorProcess, engines: list[Engine]
) -> None:
    t = reuse_on.grpc_target
    await open_engine(engines, t, "auto-req")
    holder = await open_engine(engines, t, "auto-holder")
    holder.retained = [StoredBlocks(CHAIN[:5])]
    await holder.publisher.stored(CHAIN[:2])
    await eventually_holds(t, "auto-req", "auto-holder", 2)
    await holder.session.send_event_batch(raw_batch(holder.incarnation, 9, stored(*CHAIN)))
    # ResyncRequest -> PublishingHandler -> dump of `retained`, chunked, dump_begin..dump_end.
    await eventually_holds(t, "auto-req", "auto-holder", 5)
    # The coordinator may apply dump_end before the dump task resumes to count it.
    await holder.publisher.wait_dump()
    assert holder.publisher.dumps_sent == 1


async def test_per_rank_part_blocks_are_visible_only_while_every_part_holds_them(
    reuse_on: CoordinatorProcess, engines: list[Engine]
) -> None:
    t = reuse_on.grpc_target
    await open_tp2(engines, t, "prp-req")
    kw: dict[str, Any] = {"tp_size": 2, "publish_mode": PublishMode.PER_RANK_PART}
    p0 = await open_engine(engines, t, "prp-holder", tp_rank=0, wait_ready=False, **kw)
    p1 = await open_engine(engines, t, "prp-holder", tp_rank=1, **kw)
    await p0.publisher.stored(CHAIN[:6])
    await p1.publisher.stored(CHAIN[:3])
    await eventually_holds(t, "prp-req", "prp-holder", 3)
    await p1.publisher.stored(CHAIN[3:5])
    await eventually_holds(t, "prp-req", "prp-holder", 5)
    await p0.publisher.removed([CHAIN[1]])
    await eventually_holds(t, "prp-req", "prp-holder", 1)
    await p0.publisher.stored([CHAIN[1]])
    await eventually_holds(t, "prp-req", "prp-holder", 5)
    # One part leaving takes the engine out of lookups and its stream's inventory with it.
    await p1.session.close()
    engines.remove(p1)

    async def gone() -> bool:
        return (await lookup(t, "prp-req")).outcome is LookupOutcome.MISS

    await wait_until(gone, 10)


async def test_departure_removes_the_engine_inventory(
    reuse_on: CoordinatorProcess, engines: list[Engine]
) -> None:
    t = reuse_on.grpc_target
    await open_engine(engines, t, "dep-req")
    holder = await open_engine(engines, t, "dep-holder")
    await holder.publisher.stored(CHAIN[:7])
    await eventually_holds(t, "dep-req", "dep-holder", 7)
    total_before = (await get_status(t)).inventory_entries
    await holder.session.close()
    engines.remove(holder)

    async def left() -> bool:
        return await child_engine_status(t, "dep-holder") is None

    await wait_until(left, 10)
    assert (await get_status(t)).inventory_entries == total_before - 7
    assert (await lookup(t, "dep-req")).outcome is LookupOutcome.MISS
    # Coming back is a new incarnation: nothing of the old one, sequence 0 again.
    back = await open_engine(engines, t, "dep-holder")
    assert back.publisher.next_sequence == 0
    await back.publisher.stored(CHAIN[:1])
    await eventually_holds(t, "dep-req", "dep-holder", 1)
    assert await entries(t, "dep-holder") == 1


# --- bounds and bad input (I8-bad-input) --------------------------------------------------------


async def test_entry_caps_drop_stores_and_count_them(
    profiles_file: Path, engines: list[Engine]
) -> None:
    with start_coordinator(
        "--reuse",
        "on",
        "--profiles",
        str(profiles_file),
        "--inventory-max-entries",
        "15",
        "--inventory-max-entries-per-engine",
        "10",
    ) as kvrc:
        t = kvrc.grpc_target
        try:
            await open_engine(engines, t, "cap-req")
            a = await open_engine(engines, t, "cap-a")
            b = await open_engine(engines, t, "cap-b")
            await a.publisher.stored(CHAIN[:12])
            await eventually_holds(t, "cap-req", "cap-a", 10)
            await b.publisher.stored(CHAIN[:12])
            await eventually_holds(t, "cap-req", "cap-b", 5)
            assert (await get_status(t)).inventory_entries == 15
            assert metric_value(kvrc, "kvrc_inventory_bound_hits_total", bound="per_engine") == 2
            assert metric_value(kvrc, "kvrc_inventory_bound_hits_total", bound="total") == 7
            assert metric_value(kvrc, "kvrc_inventory_entries", tier="gpu") == 15
            # Removals make room again.
            await a.publisher.removed(CHAIN[5:10])
            await b.publisher.stored(CHAIN[5:8])
            await eventually_holds(t, "cap-req", "cap-b", 8)
            assert holders(await lookup(t, "cap-req", max_candidates=64)) == {
                "cap-b": 8,
                "cap-a": 5,
            }
        finally:
            for engine in engines:
                await engine.session.close()
            engines.clear()


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (
            raw_batch(0, 1, *[stored(h(1, i % 200)) for i in range(1025)]),
            "events.events has 1025 entries",
        ),
        (
            raw_batch(0, 1, stored(*[h(2, i % 250) + bytes([i // 250]) for i in range(4097)])),
            "4097",
        ),
        (raw_batch(0, 1, stored(b"x" * 65)), "65 bytes"),
        (raw_batch(0, 1, stored(b"")), "is empty"),
        (raw_batch(0, 1, stored(h(3, 0), tier=pb.TIER_UNSPECIFIED)), "tier must be one of"),
        (raw_batch(0, 1, stored(h(3, 0), tier=pb.Tier.ValueType(9))), "got 9"),
        (raw_batch(0, 1, pb.InventoryEvent()), "has no event set"),
        (
            raw_batch(
                0,
                1,
                pb.InventoryEvent(
                    stored=pb.BlockStored(block_hashes=[h(4, 0)], tier=pb.TIER_GPU, group_idx=5000)
                ),
            ),
            "group_idx 5000",
        ),
        (raw_batch(1 << 62, 1, stored(h(5, 0))), "newer than this session's"),
        # Both were applied or dropped silently: an unset incarnation was fenced as an
        # old one, and a sequence at 2**64 - 1 made every later batch a duplicate.
        (raw_batch(0, 1, stored(h(6, 0))), "incarnation is 0 (unset)"),
        (raw_batch(0, (1 << 64) - 1, stored(h(7, 0))), "past 2**63 - 1"),
        (raw_batch(0, (1 << 63) - 1, stored(h(7, 0))), "batches past the next one"),
    ],
    ids=[
        "events",
        "chain",
        "long-hash",
        "empty-hash",
        "no-tier",
        "bad-tier",
        "no-event",
        "group",
        "incarnation",
        "unset-incarnation",
        "huge-sequence",
        "sequence-jump",
    ],
)
async def test_a_malformed_batch_ends_the_session_and_changes_nothing(
    reuse_on: CoordinatorProcess, engines: list[Engine], batch: pb.EventBatch, message: str
) -> None:
    t = reuse_on.grpc_target
    await open_engine(engines, t, "bad-req")
    holder = await open_engine(engines, t, "bad-holder")
    await holder.publisher.stored(CHAIN[:3])
    await eventually_holds(t, "bad-req", "bad-holder", 3)
    if batch.incarnation == 0 and "(unset)" not in message:  # 0: the holder's own
        batch.incarnation = holder.incarnation
    if len(batch.events) < 1024:  # a valid store first: the batch is refused whole
        batch.events.insert(0, stored(h(0x99, 0)))
    malformed = metric_value(
        reuse_on, "kvrc_event_batches_total", source="grpc", result="malformed"
    )
    stored_blocks = metric_value(reuse_on, "kvrc_block_events_total", source="grpc", type="stored")
    await holder.session.send_event_batch(batch)

    async def ended() -> bool:
        # The call is done as soon as its status arrives; the session records the
        # error a moment later, after reading the status details.
        return not holder.session.connected and holder.session.last_error is not None

    await wait_until(ended, 10)
    error = holder.session.last_error
    assert isinstance(error, InvalidArgumentError), error
    assert message in error.message
    after = metric_value(reuse_on, "kvrc_event_batches_total", source="grpc", result="malformed")
    assert after == malformed + 1
    # Nothing of the bad batch reached the core (then the part left with its session).
    assert metric_value(reuse_on, "kvrc_block_events_total", source="grpc", type="stored") == (
        stored_blocks
    )
    assert (await lookup(t, "bad-req", (h(0x99, 0),))).candidates == ()


async def test_bad_lookups_get_invalid_argument(
    reuse_on: CoordinatorProcess, engines: list[Engine]
) -> None:
    t = reuse_on.grpc_target
    await open_engine(engines, t, "badl-req")
    async with LookupClient(t) as client:
        for call, message in (
            (client.lookup("badl-req", [h(1, 0)] * 4097), "4097 block hashes"),
            (client.lookup("badl-req", [b"y" * 65]), "65 bytes"),
            (client.lookup("badl-req", [b""]), "is empty"),
            (client.lookup("", CHAIN), "requester_child_engine_id is empty"),
            (client.lookup("badl-req", CHAIN, max_candidates=65), "max_candidates 65"),
            (client.lookup("badl-req", CHAIN, group_idx=4096), "group_idx 4096"),
            (client.lookup_many("badl-req", []), "queries is empty"),
        ):
            with pytest.raises(InvalidArgumentError) as e:
                await call
            assert message in e.value.message
        with pytest.raises(KvrcClientError, match="at most 64"):
            await client.lookup_many("badl-req", [LookupQuery(CHAIN)] * 65)
        # The raw RPC with 65 queries is refused by the service too.
        stub_request = pb.LookupRequest(
            requester_child_engine_id="badl-req",
            queries=[pb.LookupQuery(block_hashes=[h(1, 1)])] * 65,
        )
        async with grpc.aio.insecure_channel(t) as channel:
            from kvrc.v1 import kvrc_pb2_grpc

            with pytest.raises(grpc.aio.AioRpcError) as raw:
                await kvrc_pb2_grpc.EngineServiceStub(channel).Lookup(stub_request)
        assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "queries has 65 entries" in (raw.value.details() or "")
        # The service is fine afterwards.
        assert (await client.lookup("badl-req", CHAIN)).outcome is LookupOutcome.MISS


# --- status ---------------------------------------------------------------------------------


async def test_status_shows_inventory_entries_and_stale_engines(
    reuse_on: CoordinatorProcess, engines: list[Engine]
) -> None:
    t = reuse_on.grpc_target
    await open_engine(engines, t, "stat-req")
    fresh = await open_engine(engines, t, "stat-fresh")
    stale = await open_engine(engines, t, "stat-stale", with_dump=False)
    await fresh.publisher.stored(CHAIN[:6])
    await stale.publisher.stored(CHAIN[:2])
    await stale.session.send_event_batch(raw_batch(stale.incarnation, 5, stored(*CHAIN[:1])))

    async def stale_seen() -> bool:
        return bool(stale.recorder.resyncs)

    await wait_until(stale_seen, 10)
    await eventually_holds(t, "stat-req", "stat-fresh", 6)
    out = await asyncio.to_thread(
        subprocess.run,
        [PYTHON, "-m", "coordinator", "status", "--target", t, "--json"],
        cwd=REPO,
        env=child_process_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    by_id = {c["child_engine_id"]: c for c in doc["child_engines"]}
    assert by_id["stat-fresh"]["inventory_entries"] == 6
    assert by_id["stat-fresh"]["stale"] is False
    assert by_id["stat-stale"]["stale"] is True
    assert by_id["stat-stale"]["inventory_entries"] == 2
    assert doc["inventory_entries"] >= 8
    table = await asyncio.to_thread(
        subprocess.run,
        [PYTHON, "-m", "coordinator", "status", "--target", t],
        cwd=REPO,
        env=child_process_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert re.search(r"stat-stale .* 2 \(stale\)", table.stdout), table.stdout
    assert metric_value(reuse_on, "kvrc_child_engines", state="stale") >= 1


# --- the ZMQ edge: one core, two edges ----------------------------------------------------


async def test_a_registered_vllm_publisher_feeds_the_same_inventory(
    reuse_on: CoordinatorProcess, engines: list[Engine]
) -> None:
    import zmq
    import zmq.asyncio
    from zmq_wire import WirePublisher, removed
    from zmq_wire import stored as vllm_stored

    t = reuse_on.grpc_target
    await open_engine(engines, t, "zmq-req")
    ctx = zmq.asyncio.Context()
    publisher = WirePublisher(ctx)
    try:
        port = publisher.endpoint.rpartition(":")[2]
        replay_port = publisher.replay_endpoint.rpartition(":")[2]
        # As vLLM's kv_events_config names them: it binds on all interfaces.
        holder = await open_engine(
            engines,
            t,
            "zmq-holder",
            kv_events_endpoint=f"tcp://*:{port}",
            kv_events_replay_endpoint=f"tcp://*:{replay_port}",
        )
        await publisher.wait_subscribed()
        chain = tuple(i.to_bytes(8, "big") for i in (11, 12, 13, 14))
        await publisher.publish(vllm_stored(11, 12, 13, 14))
        await eventually_holds(t, "zmq-req", "zmq-holder", 4, chain)
        await publisher.publish(removed(13))
        await eventually_holds(t, "zmq-req", "zmq-holder", 2, chain)
        # The gRPC stream of the same child engine feeds the same core.
        await holder.publisher.stored([chain[2]])
        await eventually_holds(t, "zmq-req", "zmq-holder", 4, chain)
        # The engine leaves: its subscriber goes with it (the PUB side sees the unsubscribe).
        await holder.session.close()
        engines.remove(holder)
        message = await asyncio.wait_for(publisher.pub.recv(), 10)
        assert message[:1] == b"\x00"
        assert (await lookup(t, "zmq-req", chain)).outcome is LookupOutcome.MISS
    finally:
        await publisher.close()
        ctx.term()
