"""Pure tests of the registry: registration checks and readiness (I5-complete-parts)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.leases import LeaseConfig, LeaseState, LeaseTable
from coordinator.core.profiles import DeploymentProfile
from coordinator.core.registry import (
    REGION_HELD_BYTES,
    PartRef,
    RankPartRegistration,
    Registry,
    endpoint_held_bytes,
    grid_ranks,
)
from kvrc.ids import MAX_GRID_PARTS
from kvrc.ids import child_engine_id as vllm_child_engine_id
from kvrc.vocabulary import KvRegion, TransferEndpoint

PROFILE = DeploymentProfile(model="m", block_size=16, kv_dtype="bfloat16", tp_size=2, pp_size=2)


def reg(
    tp: int = 0,
    pp: int = 0,
    pcp: int = 0,
    *,
    engine_id: str = "e1",
    dp_rank: int = 0,
    child_engine_id: str | None = None,
    profile: DeploymentProfile = PROFILE,
    metadata: bytes = b"",
) -> RankPartRegistration:
    cid = (
        child_engine_id
        if child_engine_id is not None
        else vllm_child_engine_id(engine_id, dp_rank, profile.dp_size)
    )
    return RankPartRegistration(
        engine_id=engine_id,
        dp_rank=dp_rank,
        child_engine_id=cid,
        rank=(tp, pp, pcp),
        profile=profile,
        endpoint=TransferEndpoint(backend="mooncake", agent_metadata=metadata),
    )


def snapshot(registry: Registry) -> object:
    return (registry.num_parts, list(registry.views()))


def test_grid_is_ready_only_after_the_last_part() -> None:
    r = Registry()
    ranks = [(0, 0), (0, 1), (1, 0), (1, 1)]
    for i, (tp, pp) in enumerate(ranks):
        result = r.register(reg(tp, pp), f"s{i}", i, now_ms=1000)
        assert result.view.parts_present == i + 1
        assert result.view.ready == (i == 3)
        assert result.readiness_changed == (i == 3)
        assert r.is_ready("e1") == (i == 3)
    view = r.get("e1")
    assert view is not None and view.not_ready_reason == ""


def test_not_ready_reason_names_missing_ranks() -> None:
    r = Registry()
    r.register(reg(0, 0), "s0", 0, 0)
    r.register(reg(1, 1), "s1", 1, 0)
    view = r.get("e1")
    assert view is not None and not view.ready
    assert "waiting for 2 of 4" in view.not_ready_reason
    assert "(tp=0, pp=1, pcp=0)" in view.not_ready_reason
    assert "(tp=1, pp=0, pcp=0)" in view.not_ready_reason


def test_duplicate_rank_part_is_already_exists_and_changes_nothing() -> None:
    r = Registry()
    r.register(reg(0, 0), "s0", 0, 0)
    before = snapshot(r)
    with pytest.raises(KvrcError) as e:
        r.register(reg(0, 0), "s1", 1, 5)
    assert e.value.code == ErrorCode.ALREADY_EXISTS
    assert "(tp=0, pp=0, pcp=0)" in e.value.message and "s0" in e.value.message
    assert snapshot(r) == before


@pytest.mark.parametrize(
    ("change", "field", "old", "new"),
    [
        ({"tp_size": 4}, "profile.parallel.tp_size", "2", "4"),
        ({"pp_size": 1}, "profile.parallel.pp_size", "2", "1"),
        ({"model": "other"}, "profile.model", "'m'", "'other'"),
        ({"kv_dtype": "fp8"}, "profile.kv_dtype", "'bfloat16'", "'fp8'"),
        ({"block_size": 32}, "profile.block_size", "16", "32"),
        ({"native_compatibility_hash": b"\x01"}, "profile.native_compatibility_hash", "b''", "1"),
        ({"reuse_opt_in": True}, "profile.reuse_opt_in", "False", "True"),
    ],
)
def test_mismatching_part_is_failed_precondition_naming_field_and_values(
    change: dict[str, Any], field: str, old: str, new: str
) -> None:
    r = Registry()
    r.register(reg(0, 0), "s0", 0, 0)
    before = snapshot(r)
    with pytest.raises(KvrcError) as e:
        r.register(reg(1, 0, profile=dataclasses.replace(PROFILE, **change)), "s1", 1, 0)
    assert e.value.code == ErrorCode.FAILED_PRECONDITION
    assert e.value.message.startswith(field + " mismatch")
    assert old in e.value.message and new in e.value.message
    assert snapshot(r) == before


def test_engine_id_mismatch_within_one_child_engine() -> None:
    # "a_dp1" is both engine "a_dp1" (one DP rank) and DP rank 1 of engine "a".
    r = Registry()
    dense = dataclasses.replace(PROFILE, dp_size=1)
    r.register(reg(0, 0, engine_id="a_dp1", profile=dense), "s0", 0, 0)
    before = snapshot(r)
    dp2 = dataclasses.replace(PROFILE, dp_size=2)
    with pytest.raises(KvrcError) as e:
        r.register(reg(1, 0, engine_id="a", dp_rank=1, profile=dp2), "s1", 1, 0)
    assert e.value.code == ErrorCode.FAILED_PRECONDITION
    assert e.value.message.startswith("engine_id mismatch for child engine 'a_dp1'")
    assert "'a_dp1'" in e.value.message and "'a'" in e.value.message
    assert snapshot(r) == before


@pytest.mark.parametrize(
    ("engine_id", "dp_rank", "dp_size", "child", "ok"),
    [
        ("e", 0, 1, "e", True),
        ("e", 0, 1, "e_dp0", False),
        ("e", 1, 2, "e_dp1", True),
        ("e", 1, 2, "e", False),
        ("e", 1, 2, "e_dp0", False),
    ],
)
def test_child_engine_id_follows_vllm_naming(
    engine_id: str, dp_rank: int, dp_size: int, child: str, ok: bool
) -> None:
    r = Registry()
    profile = dataclasses.replace(PROFILE, dp_size=dp_size)
    registration = reg(engine_id=engine_id, dp_rank=dp_rank, child_engine_id=child, profile=profile)
    if ok:
        assert r.register(registration, "s", 0, 0).view.child_engine_id == child
    else:
        with pytest.raises(KvrcError) as e:
            r.register(registration, "s", 0, 0)
        assert e.value.code == ErrorCode.INVALID_ARGUMENT
        assert f"got {child!r}" in e.value.message
        assert r.num_parts == 0


@pytest.mark.parametrize(
    ("tp", "pp", "pcp", "dp_rank", "field"),
    [
        (2, 0, 0, 0, "rank.tp_rank"),
        (0, 2, 0, 0, "rank.pp_rank"),
        (0, 0, 1, 0, "rank.pcp_rank"),
        (0, 0, 0, 1, "dp_rank"),
    ],
)
def test_rank_outside_its_size_is_invalid(
    tp: int, pp: int, pcp: int, dp_rank: int, field: str
) -> None:
    r = Registry()
    registration = dataclasses.replace(reg(tp, pp, pcp), dp_rank=dp_rank)
    with pytest.raises(KvrcError) as e:
        r.register(registration, "s", 0, 0)
    assert e.value.code == ErrorCode.INVALID_ARGUMENT and e.value.message.startswith(field)
    assert r.num_parts == 0


def test_grid_size_and_part_count_are_bounded() -> None:
    r = Registry(max_rank_parts=2)
    huge = dataclasses.replace(PROFILE, tp_size=64, pp_size=64, pcp_size=2)
    with pytest.raises(KvrcError) as e:
        r.register(reg(profile=huge), "s", 0, 0)
    assert e.value.code == ErrorCode.INVALID_ARGUMENT
    assert e.value.message.startswith("profile.parallel")
    assert f"8192 rank parts exceeds the limit of {MAX_GRID_PARTS}" in e.value.message
    r.register(reg(0, 0), "s0", 0, 0)
    r.register(reg(0, 0, engine_id="e2"), "s1", 0, 0)
    before = snapshot(r)
    with pytest.raises(KvrcError) as e:
        r.register(reg(0, 0, engine_id="e3"), "s2", 0, 0)
    assert e.value.code == ErrorCode.RESOURCE_EXHAUSTED
    assert "maximum of 2 rank parts (--max-rank-parts), 0 of them engine 'e3''s" in (
        e.value.message
    )
    assert snapshot(r) == before


def test_one_engine_holds_at_most_a_quarter_of_the_parts_and_of_the_endpoint_bytes() -> None:
    """A runaway engine (its DP ranks together) cannot lock the others out; every
    refusal changes nothing, and a part that leaves gives its room back."""
    dp4 = dataclasses.replace(PROFILE, dp_size=4)
    r = Registry(max_rank_parts=16, max_endpoint_bytes=16_000)
    # Two child engines of e1, two parts each: its share, 16 // 4 parts.
    parts = [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]  # (dp_rank, tp, pp)
    for i, (dp_rank, tp, pp) in enumerate(parts):
        r.register(reg(tp, pp, engine_id="e1", dp_rank=dp_rank, profile=dp4), f"s{i}", 0, 0)
    before = snapshot(r)
    with pytest.raises(KvrcError) as e:
        r.register(reg(1, 0, engine_id="e1", dp_rank=1, profile=dp4), "s9", 0, 0)
    assert e.value.code == ErrorCode.RESOURCE_EXHAUSTED
    assert "engine 'e1' holds 4 rank parts" in e.value.message
    assert "quarter of the coordinator's 16 (--max-rank-parts)" in e.value.message
    assert snapshot(r) == before
    r.register(reg(0, 0, engine_id="e2"), "t0", 0, 0)  # another engine has room
    assert r.remove(PartRef("e1_dp0", (0, 0, 0), "s0")) is not None
    r.register(reg(1, 0, engine_id="e1", dp_rank=1, profile=dp4), "s9", 0, 0)  # room again

    # Endpoint bytes: 4,000 a engine (a quarter of 16,000), 16,000 in all.
    r = Registry(max_endpoint_bytes=16_000)
    r.register(reg(0, 0, engine_id="a", metadata=b"x" * 3_000), "a0", 0, 0)
    assert r.endpoint_bytes == 3_000
    before = snapshot(r)
    with pytest.raises(KvrcError) as e:
        r.register(reg(0, 1, engine_id="a", metadata=b"x" * 1_001), "a1", 0, 0)
    assert e.value.code == ErrorCode.RESOURCE_EXHAUSTED
    assert "its endpoint holds 1001 bytes and engine 'a''s parts 3000" in e.value.message
    assert snapshot(r) == before and r.endpoint_bytes == 3_000
    r.register(reg(0, 1, engine_id="a", metadata=b"x" * 1_000), "a1", 0, 0)  # exactly its share
    for name in ("b", "c", "d"):
        r.register(reg(0, 0, engine_id=name, metadata=b"x" * 4_000), name, 0, 0)
    assert r.endpoint_bytes == 16_000
    with pytest.raises(KvrcError) as e:
        r.register(reg(0, 0, engine_id="e", metadata=b"x"), "e", 0, 0)
    assert "the coordinator's rank parts 16000 of their 16000 (--max-endpoint-bytes)" in (
        e.value.message
    )
    assert r.remove(PartRef("d", (0, 0, 0), "d")) is not None
    assert r.endpoint_bytes == 12_000
    r.register(reg(0, 0, engine_id="e", metadata=b"x"), "e", 0, 0)


def test_an_endpoints_held_bytes_count_its_metadata_extra_and_regions() -> None:
    endpoint = TransferEndpoint(
        backend="nixl",
        agent_metadata=b"m" * 100,
        regions=(KvRegion(base_addr=1 << 40, block_len=4096, num_blocks=8),) * 3,
        extra=(("k1", b"v" * 10), ("k22", b"")),
    )
    assert endpoint_held_bytes(endpoint) == 100 + (2 + 10) + 3 + 3 * REGION_HELD_BYTES


def test_removal_needs_the_holding_session_and_unreadies() -> None:
    r = Registry()
    for i, (tp, pp) in enumerate(itertools.product(range(2), range(2))):
        r.register(reg(tp, pp), f"s{i}", i, 0)
    assert r.remove(PartRef("e1", (0, 0, 0), "not-the-holder")) is None
    assert r.is_ready("e1")
    removed = r.remove(PartRef("e1", (0, 0, 0), "s0"))
    assert removed is not None and removed.readiness_changed and not removed.view.ready
    assert r.remove(PartRef("e1", (0, 0, 0), "s0")) is None  # idempotent
    # The rank can be taken again by a new session.
    assert r.register(reg(0, 0), "s9", 9, 0).view.ready


def test_last_part_removal_forgets_the_child_engine_and_its_profile() -> None:
    r = Registry()
    r.register(reg(0, 0), "s0", 0, 0)
    r.remove(PartRef("e1", (0, 0, 0), "s0"))
    assert r.get("e1") is None and r.num_parts == 0
    # A new incarnation of the engine may come back with another profile.
    other = dataclasses.replace(PROFILE, tp_size=1, pp_size=1, model="new")
    assert r.register(reg(profile=other), "s1", 1, 0).view.ready


def test_heartbeats_and_expiry() -> None:
    r = Registry()
    r.register(reg(0, 0), "s0", 0, now_ms=1000)
    r.register(reg(0, 1), "s1", 1, now_ms=1000)
    assert r.heartbeat(PartRef("e1", (0, 0, 0), "s0"), now_ms=4000)
    assert not r.heartbeat(PartRef("e1", (0, 0, 0), "stale-session"), now_ms=4000)
    assert r.expired(now_ms=5000, timeout_ms=3000) == [PartRef("e1", (0, 1, 0), "s1")]
    assert r.expired(now_ms=4000, timeout_ms=3000) == []


def test_metadata_bytes_are_kept_exactly() -> None:
    r = Registry()
    blob = bytes(range(256)) * 3
    r.register(reg(0, 0, metadata=blob), "s0", 0, 0)
    view = r.get("e1")
    assert view is not None
    assert view.parts[0].registration.endpoint.agent_metadata == blob


# A grid and any order of registrations/removals: READY iff all parts present.
@settings(max_examples=150, deadline=None)
@given(
    sizes=st.tuples(st.integers(1, 3), st.integers(1, 2), st.integers(1, 2)),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 11)), max_size=40),
)
def test_ready_iff_every_part_present(
    sizes: tuple[int, int, int], ops: list[tuple[bool, int]]
) -> None:
    tp_size, pp_size, pcp_size = sizes
    profile = dataclasses.replace(PROFILE, tp_size=tp_size, pp_size=pp_size, pcp_size=pcp_size)
    grid = list(itertools.product(range(tp_size), range(pp_size), range(pcp_size)))
    r = Registry()
    present: dict[tuple[int, int, int], str] = {}
    was_ready = False
    for counter, (add, index) in enumerate(ops):
        rank = grid[index % len(grid)]
        if add:
            session = f"s{counter}"
            if rank in present:
                with pytest.raises(KvrcError) as e:
                    r.register(reg(*rank, profile=profile), session, counter, counter)
                assert e.value.code == ErrorCode.ALREADY_EXISTS
                changed = False
            else:
                result = r.register(reg(*rank, profile=profile), session, counter, counter)
                present[rank] = session
                changed = result.readiness_changed
        else:
            removed = r.remove(PartRef("e1", rank, present.get(rank, "none")))
            assert (removed is not None) == (rank in present)
            changed = removed.readiness_changed if removed is not None else False
            present.pop(rank, None)
        ready = len(present) == len(grid)
        assert r.is_ready("e1") == ready
        assert changed == (ready != was_ready)
        assert r.num_parts == len(present)
        view = r.get("e1")
        assert (view is None) == (not present)
        if view is not None:
            assert view.ready == ready and view.parts_present == len(present)
            assert view.parts_expected == len(grid)
        assert r.readiness_counts() == ((1, 0) if ready else (0, 1) if present else (0, 0))
        was_ready = ready


def test_an_engine_at_the_grid_limit_registers_and_holds_a_prefix_load_lease() -> None:
    """The registry and the lease table share one limit: a READY engine can hold a lease."""
    at_limit = dataclasses.replace(PROFILE, tp_size=64, pp_size=64, pcp_size=1)
    grid = tuple(grid_ranks(at_limit))
    assert len(grid) == MAX_GRID_PARTS
    r = Registry()
    for i, (tp, pp, _) in enumerate(grid):
        r.register(reg(tp, pp, engine_id="holder", profile=at_limit), f"s{i}", 0, 0)
    view = r.get("holder")
    assert view is not None and view.ready
    t = LeaseTable(LeaseConfig())
    step = t.open_prefix_load(
        request_id="r1",
        requester_child_engine_id="requester",
        requester_rank_keys=grid,
        holder_child_engine_id="holder",
        holder_rank_keys=tuple(part.registration.rank for part in view.parts),
        block_hashes=(b"\x01" * 8,),
        min_blocks=1,
        pin_timeout_ms=500,
        transfer_ttl_ms=5_000,
        now_ms=0,
    )
    lease_id = step.view.lease_id
    for key in grid:
        t.on_pin_result(lease_id, "holder", key, 1, {"rank": key}, 10)
    assert t.get(lease_id).state is LeaseState.ACTIVE
