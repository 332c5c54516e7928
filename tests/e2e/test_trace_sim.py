"""The pure trace simulator: trace parsing, LRU caches with pins, cost model, modes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import bench_trace, trace_sim
from benchmarks.trace_sim import (
    BlockId,
    Candidate,
    CostModel,
    EngineCache,
    EngineIndex,
    HolderSide,
    LoadGate,
    LoadGrant,
    LocalReferenceProvider,
    Mode,
    TraceRequest,
    TraceSimulation,
    best_possible_hit_ratio,
    load_trace,
    parse_trace,
    simulate,
)

# The Mooncake FAST'25 synthetic trace ships in the repository (benchmarks/data/README.md).
REPO = Path(__file__).resolve().parents[2]
SHIPPED_TRACE = REPO / "benchmarks" / "data" / "synthetic_trace.jsonl"


def _req(
    index: int, arrival_ms: int, blocks: Sequence[int], tokens: int | None = None
) -> TraceRequest:
    return TraceRequest(
        request_index=index,
        arrival_ms=arrival_ms,
        input_tokens=tokens if tokens is not None else 512 * len(blocks),
        output_tokens=1,
        block_ids=tuple(blocks),
    )


@pytest.fixture(scope="module")
def shipped() -> list[TraceRequest]:
    return load_trace(SHIPPED_TRACE)


def test_the_benchmarks_default_to_the_shipped_trace() -> None:
    assert bench_trace.parse_args([]).trace == SHIPPED_TRACE
    assert trace_sim.DEFAULT_TRACE == SHIPPED_TRACE
    assert bench_trace.trace_label(SHIPPED_TRACE) == "benchmarks/data/synthetic_trace.jsonl"


# --- trace -----------------------------------------------------------------


def test_upper_bound_hit_ratio_is_the_traces_best_possible(shipped: list[TraceRequest]) -> None:
    # Independent of trace_sim: read the JSON lines and count contiguous known blocks.
    seen: set[int] = set()
    hit = total = 0
    with SHIPPED_TRACE.open() as fh:
        for line in fh:
            ids = json.loads(line)["hash_ids"]
            n = 0
            while n < len(ids) and ids[n] in seen:
                n += 1
            hit += n
            total += len(ids)
            seen.update(ids)
    assert round(hit / total, 3) == 0.640
    result = simulate(shipped, Mode.UPPER_BOUND)
    assert result.blocks_local_hit + result.blocks_loaded == hit
    assert result.blocks_total == total
    assert round(result.hit_ratio, 3) == 0.640
    assert best_possible_hit_ratio(shipped) == hit / total


def test_parse_trace_sorts_by_timestamp_keeping_file_order_on_ties() -> None:
    lines = [
        '{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}',
        "",
        '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [7]}',
        '{"timestamp": 5, "input_length": 20, "output_length": 3, "hash_ids": [9]}',
    ]
    reqs = parse_trace(lines)
    assert [(r.arrival_ms, r.block_ids) for r in reqs] == [(0, (7,)), (5, (1, 2)), (5, (9,))]
    assert [r.request_index for r in reqs] == [0, 1, 2]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"timestamp": -1, "input_length": 5, "hash_ids": [1]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "hash_ids": [1]}', "input_length"),
        ('{"timestamp": 0, "input_length": 5, "hash_ids": []}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 5, "hash_ids": ["a"]}', "hash_ids"),
        ('{"timestamp": true, "input_length": 5, "hash_ids": [1]}', "timestamp"),
    ],
)
def test_parse_trace_names_the_bad_line(line: str, needle: str) -> None:
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    with pytest.raises(ValueError, match=rf"t\.jsonl:2: .*{needle}"):
        parse_trace([good, line], source="t.jsonl")


def test_empty_trace_is_refused() -> None:
    with pytest.raises(ValueError, match="no requests"):
        parse_trace(["", "  "])


# --- LRU cache ---------------------------------------------------------------

_chains = st.lists(st.integers(0, 15), min_size=1, max_size=5, unique=True)


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(1, 6),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("admit"), st.tuples(_chains, st.integers(0, 3))),
            st.tuples(st.just("pin"), _chains),
            st.tuples(st.just("unpin"), st.integers(0, 5)),
        ),
        max_size=40,
    ),
)
def test_lru_cache_respects_capacity_pins_and_recency(
    capacity: int, ops: list[tuple[str, object]]
) -> None:
    cache = EngineCache(capacity)
    leases: dict[int, set[int]] = {}  # lease -> the resident blocks it pinned
    next_lease = 0
    for op, arg in ops:
        if op == "pin":
            assert isinstance(arg, list)
            resident = {b for b in arg if b in cache}
            cache.pin(next_lease, arg)
            leases[next_lease] = resident
            next_lease += 1
        elif op == "unpin":
            assert isinstance(arg, int)
            cache.unpin(arg)
            leases.pop(arg, None)
        else:
            assert isinstance(arg, tuple)
            chain, cold_count = arg
            before = cache.lru_order()
            # A loaded prefix: what the cache lacks among the chain's first blocks.
            cold = [b for b in chain[:cold_count] if b not in before]
            pinned = set().union(*leases.values()) if leases else set()
            retained, evicted = cache.admit(chain, cold=cold)
            after = cache.lru_order()
            assert len(after) <= capacity
            assert not pinned & set(evicted), "a pinned block was evicted"
            assert not set(chain) & set(evicted)
            assert set(after) == (set(before) - set(evicted)) | set(retained)
            # LRU: every evicted block was older than every evictable survivor.
            survivors = [b for b in before if b in after and b not in pinned and b not in chain]
            if evicted and survivors:
                assert max(before.index(b) for b in evicted) < min(
                    before.index(b) for b in survivors
                )
            # What did not fit was dropped only because nothing else could go.
            missing = [b for b in chain if b not in before]
            if len(retained) < len(missing):
                assert all(b in pinned or b in chain for b in after)
                assert retained == missing[: len(retained)]  # head blocks kept first
            # The chain's resident blocks are the most recent, its head last of all;
            # newly loaded copies are the least recent, their tail first.
            cold_new = [b for b in reversed(cold) if b in retained]
            assert after[: len(cold_new)] == cold_new
            resident_chain = [b for b in reversed(chain) if b in after and b not in cold_new]
            assert after[len(after) - len(resident_chain) :] == resident_chain
    for key in list(leases):
        cache.unpin(key)
    assert not any(cache.is_pinned(b) for b in cache.lru_order())


# --- cost model --------------------------------------------------------------


def _ttfts(sim: TraceSimulation) -> list[float]:
    return [round(o.ttft_ms, 6) for o in sim.outcomes]


TINY = [
    _req(0, 0, [1, 2]),  # rr -> e0: 1024 tokens = 102.4 ms
    _req(1, 0, [3]),  # rr -> e1: 51.2 ms
    _req(2, 50, [1, 2, 4]),  # rr -> e0: waits 52.4, local hit 2, prefills 512 -> 103.6
    _req(3, 200, [1, 2, 4, 5], tokens=1800),  # rr -> e1: e0 published [1, 2, 4] at 153.6
]


def test_cost_model_arithmetic_round_robin_local() -> None:
    sim = TraceSimulation(TINY, Mode.LOCAL_RR, engines=2, capacity_tokens=512 * 100)
    result = sim.run()
    assert [o.engine for o in sim.outcomes] == [0, 1, 0, 1]
    assert _ttfts(sim) == [102.4, 51.2, 103.6, 180.0]  # r3 recomputes all 1800 tokens
    assert (result.blocks_local_hit, result.blocks_loaded, result.blocks_recomputed) == (2, 0, 8)


def test_cost_model_arithmetic_round_robin_with_loading() -> None:
    sim = TraceSimulation(
        TINY, Mode.KVRC_RR, engines=2, capacity_tokens=512 * 100, provider=LocalReferenceProvider()
    )
    result = sim.run()
    # r3 loads 3 blocks from e0 (24 ms) and prefills 1800 - 3 * 512 = 264 tokens (26.4 ms).
    assert _ttfts(sim) == [102.4, 51.2, 103.6, 50.4]
    assert [(ld.requester, ld.source_engine, ld.blocks) for ld in sim.loads] == [(1, 0, (1, 2, 4))]
    assert (result.blocks_local_hit, result.blocks_loaded, result.blocks_recomputed) == (2, 3, 5)
    assert result.hit_ratio == 5 / 10


def test_cost_model_is_configurable() -> None:
    cost = CostModel(prefill_tokens_per_s=1000.0, load_ms_per_block=100.0)
    sim = TraceSimulation(
        TINY,
        Mode.KVRC_RR,
        engines=2,
        capacity_tokens=512 * 100,
        cost=cost,
        provider=LocalReferenceProvider(),
    )
    sim.run()
    # r0 1024 ms; r1 512 ms; r2 waits 974 and prefills 512 ms; r3: e0 has computed nothing yet,
    # so e1 recomputes 1800 tokens after waiting 312 ms for r1.
    assert _ttfts(sim) == [1024.0, 512.0, 1486.0, 2112.0]
    assert sim.loads == []


def test_cost_aware_routing_weighs_queueing_against_work() -> None:
    reqs = [
        _req(0, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),  # e0 (ties: lowest index), busy until 512 ms
        _req(1, 10, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]),  # e0: wait 502 + 51.2 < 563.2 on e1
        _req(2, 20, [20]),  # e1 is idle: 51.2
        _req(3, 30, [1, 2, 30]),  # e1 (idle): 153.6 < e0's queue of 533.2 + 51.2
    ]
    sim = TraceSimulation(reqs, Mode.LOCAL_KV, engines=2, capacity_tokens=512 * 100)
    sim.run()
    assert [o.engine for o in sim.outcomes] == [0, 0, 1, 1]
    assert _ttfts(sim) == [512.0, 553.2, 51.2, 194.8]  # r3 waits 41.2 for r2


def test_a_load_runs_behind_the_queue_and_the_inbound_link_takes_one_at_a_time() -> None:
    """The connector loads asynchronously: a load overlaps the requests queued ahead of
    it, and an engine's inbound link carries one load at a time."""
    reqs = [
        _req(0, 0, [1, 2, 3, 4]),  # rr -> e0: 204.8 ms, published at 204.8
        _req(1, 1, range(10, 20)),  # rr -> e1: 512 ms, e1 busy until 513
        _req(2, 250, [30]),  # rr -> e0: 250 .. 301.2
        _req(3, 300, [1, 2, 5]),  # rr -> e1: loads [1, 2] over 300 .. 316, prefills at 513
        _req(4, 301, [31]),  # rr -> e0: 301.2 .. 352.4
        _req(5, 302, [1, 2, 3, 4, 6]),  # rr -> e1: [1, 2] local, [3, 4] after r3's load
    ]
    sim = TraceSimulation(
        reqs, Mode.KVRC_RR, engines=2, capacity_tokens=512 * 100, provider=LocalReferenceProvider()
    )
    sim.run()
    loads = [
        (ld.requester, ld.source_engine, ld.blocks, ld.begin_ms, ld.end_ms) for ld in sim.loads
    ]
    assert loads == [(1, 0, (1, 2), 300.0, 316.0), (1, 0, (3, 4), 316.0, 332.0)]
    # r3: 513 + 51.2 - 300 (a load that held the engine would add its 16 ms: 280.2).
    assert _ttfts(sim) == [204.8, 512.0, 51.2, 264.2, 51.4, 313.4]


def test_the_router_charges_a_load_for_the_copy_it_adds() -> None:
    """A holder with a short queue keeps its prefix's requests: a load of 32 ms plus the
    replication charge (16 ms) loses to a 40 ms queue, and wins against a 90 ms one."""
    reqs = [
        _req(0, 0, [1, 2, 3, 4]),  # e0 (tie: lowest index), published at 204.8
        _req(1, 210, [1, 2, 3, 4, 40]),  # e0: local, 210 .. 261.2
        _req(2, 221, [1, 2, 3, 4, 41]),  # e0: 40.2 + 51.2 < 32 + 16 + 51.2 on e1
        _req(3, 222, [1, 2, 3, 4, 42]),  # e1: 32 + 16 + 51.2 < 90.4 + 51.2 on e0
    ]
    sim = TraceSimulation(
        reqs, Mode.KVRC_KV, engines=2, capacity_tokens=512 * 100, provider=LocalReferenceProvider()
    )
    sim.run()
    assert [o.engine for o in sim.outcomes] == [0, 0, 0, 1]
    assert [(ld.requester, ld.source_engine, ld.blocks) for ld in sim.loads] == [
        (1, 0, (1, 2, 3, 4))
    ]


def test_the_router_counts_a_load_behind_the_queue_not_after_it() -> None:
    """e1 has 39.6 ms of queue and would load 32 ms: max(39.6, 32) + 16 (charge) = 55.6 ms
    before its prefill, which beats the holder's 70 ms queue; counted the old way,
    39.6 + 32 + 16 = 87.6 ms, it would lose."""
    reqs = [
        _req(0, 0, [1, 2, 3, 4]),  # e0 (tie: lowest index), published at 204.8
        _req(1, 186, [20, 21, 22]),  # e1 (e0 busy): 186 .. 339.6
        _req(2, 210, [1, 2, 3, 4, 5], tokens=4 * 512 + 1600),  # e0, local: 210 .. 370
        _req(3, 300, [1, 2, 3, 4, 9]),  # e0: 70 + 51.2; e1: 56 + 51.2
    ]
    sim = TraceSimulation(
        reqs, Mode.KVRC_KV, engines=2, capacity_tokens=512 * 100, provider=LocalReferenceProvider()
    )
    sim.run()
    assert [o.engine for o in sim.outcomes] == [0, 1, 0, 1]
    assert [(ld.requester, ld.source_engine, ld.begin_ms, ld.end_ms) for ld in sim.loads] == [
        (1, 0, 300.0, 332.0)
    ]
    assert _ttfts(sim)[3] == pytest.approx(339.6 + 51.2 - 300)


# --- kvrc modes ----------------------------------------------------------------


class StaleCheckingProvider:
    """The reference provider that forgets removals for a while (stale hints), and checks
    every load against the holders' real caches at grant and at load end."""

    def __init__(self, sim_ref: list[TraceSimulation], removal_lag: int) -> None:
        self.inner = LocalReferenceProvider()
        self.sim_ref = sim_ref
        self.removal_lag = removal_lag
        self.pending_removals: list[tuple[EngineIndex, Sequence[BlockId]]] = []
        self.short_pins = 0
        self.checked_loads = 0
        self.granted_chain: dict[object, tuple[BlockId, ...]] = {}

    def bind(self, holders: HolderSide, num_engines: int) -> None:
        self.inner.bind(holders, num_engines)

    def lookup(
        self, requester: EngineIndex, chain: Sequence[BlockId], include_self: bool, now_ms: float
    ) -> list[Candidate]:
        return self.inner.lookup(requester, chain, include_self, now_ms)

    def acquire(
        self,
        requester: EngineIndex,
        chain: Sequence[BlockId],
        min_blocks: int,
        now_ms: float,
        local_blocks: int = 0,
    ) -> LoadGrant | None:
        hinted = self.inner.lookup(requester, chain, False, now_ms)
        grant = self.inner.acquire(requester, chain, min_blocks, now_ms, local_blocks)
        if grant is not None:
            if hinted and grant.matched_blocks < hinted[0].matched_blocks:
                self.short_pins += 1
            self._check_held(grant, chain[: grant.matched_blocks])
            self.granted_chain[grant.lease_key] = tuple(chain[: grant.matched_blocks])
        return grant

    def _check_held(self, grant: LoadGrant, blocks: Sequence[BlockId]) -> None:
        source = self.sim_ref[0].engines[grant.source_engine].cache
        for b in blocks:
            assert b in source, f"granted block {b} the source does not hold"
            assert b in source.published, f"granted block {b} the source has not computed"

    def complete(self, grant: LoadGrant, loaded_blocks: int, now_ms: float) -> None:
        # At load end the source must still hold every block it pinned.
        self._check_held(grant, self.granted_chain.pop(grant.lease_key))
        if loaded_blocks:
            self.checked_loads += 1

    def blocks_stored(
        self, engine: EngineIndex, blocks: Sequence[BlockId], parent: BlockId | None, now_ms: float
    ) -> None:
        self.inner.blocks_stored(engine, blocks, parent, now_ms)

    def blocks_removed(self, engine: EngineIndex, blocks: Sequence[BlockId], now_ms: float) -> None:
        self.pending_removals.append((engine, blocks))
        if len(self.pending_removals) > self.removal_lag:
            old_engine, old_blocks = self.pending_removals.pop(0)
            self.inner.blocks_removed(old_engine, old_blocks, now_ms)


def _churn_trace(n: int = 400) -> list[TraceRequest]:
    """Shared prefixes of 5 documents with unique tails, every 50 ms: heavy eviction."""
    reqs = []
    for i in range(n):
        doc = (i * 7) % 5
        shared = [doc * 1000 + k for k in range(2 + i % 4)]
        tail = [100_000 + i * 10 + k for k in range(1 + i % 3)]
        reqs.append(_req(i, i * 50, shared + tail))
    return reqs


@pytest.mark.parametrize("mode", [Mode.KVRC_RR, Mode.KVRC_KV])
def test_kvrc_modes_never_load_a_block_the_source_no_longer_holds(mode: Mode) -> None:
    sim_ref: list[TraceSimulation] = []
    provider = StaleCheckingProvider(sim_ref, removal_lag=30)
    sim = TraceSimulation(
        _churn_trace(), mode, engines=4, capacity_tokens=512 * 6, provider=provider
    )
    sim_ref.append(sim)
    result = sim.run()
    assert provider.checked_loads == result.load_grants and result.load_grants > 20
    assert provider.short_pins > 0, "the stale view should have produced shorter pins"
    assert result.load_misses > 0
    for load in sim.loads:
        assert load.source_engine != load.requester
    assert sim.max_cache_blocks_seen <= 6


_trace_strategy = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 5), st.integers(0, 2), st.integers(0, 40)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=40, deadline=None)
@given(spec=_trace_strategy, capacity=st.integers(1, 8), engines=st.integers(1, 4))
def test_every_mode_stays_within_its_bounds(
    spec: list[tuple[int, int, int, int]], capacity: int, engines: int
) -> None:
    reqs = []
    t = 0
    for i, (doc, shared, tail, gap) in enumerate(spec):
        t += gap
        blocks = [doc * 100 + k for k in range(shared)] + [10_000 + i * 10 + k for k in range(tail)]
        reqs.append(_req(i, t, blocks))
    best = best_possible_hit_ratio(reqs)
    for mode in Mode:
        # kvrc_cost grants through a gate, which the router and the provider share.
        gate = LoadGate(CostModel()) if mode is Mode.KVRC_COST else None
        sim = TraceSimulation(
            reqs,
            mode,
            engines=engines,
            capacity_tokens=512 * capacity,
            provider=LocalReferenceProvider(gate) if mode.uses_kvrc else None,
            gate=gate,
        )
        r = sim.run()
        assert r.requests == len(reqs)
        assert r.blocks_local_hit + r.blocks_loaded + r.blocks_recomputed == r.blocks_total
        assert 0.0 <= r.hit_ratio <= best + 1e-12
        assert sim.max_cache_blocks_seen <= capacity
        assert all(o.ttft_ms >= 0 for o in sim.outcomes)
        if mode is Mode.UPPER_BOUND:
            assert r.hit_ratio == best
        # Every pin is released by the end of the replay.
        for eng in sim.engines:
            assert not any(eng.cache.is_pinned(b) for b in eng.cache.lru_order())


def test_shipped_trace_targets_with_the_reference_provider(shipped: list[TraceRequest]) -> None:
    results = {mode: simulate(shipped, mode) for mode in Mode}
    assert results[Mode.KVRC_RR].hit_ratio >= results[Mode.LOCAL_RR].hit_ratio
    assert results[Mode.KVRC_KV].hit_ratio >= results[Mode.LOCAL_KV].hit_ratio
    assert results[Mode.KVRC_KV].ttft_mean_s < results[Mode.LOCAL_KV].ttft_mean_s
    assert results[Mode.KVRC_KV].hit_ratio >= 0.9 * results[Mode.UPPER_BOUND].hit_ratio
    # Issue 25's target on every trace: the cost gate never loses to local-only routing.
    assert results[Mode.KVRC_COST].ttft_mean_s <= results[Mode.LOCAL_KV].ttft_mean_s
    assert results[Mode.LOCAL_RR].blocks_loaded == results[Mode.LOCAL_KV].blocks_loaded == 0
    # Deterministic: the same replay gives the same numbers.
    assert simulate(shipped, Mode.KVRC_RR) == results[Mode.KVRC_RR]


def test_kvrc_mode_needs_a_provider() -> None:
    with pytest.raises(ValueError, match="provider"):
        TraceSimulation(TINY, Mode.KVRC_KV)


# --- the report and the real path (benchmarks/bench_trace.py) ------------------


def test_bench_trace_writes_every_field_without_the_service(tmp_path: Path) -> None:
    trace = tmp_path / "tiny.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps(
                {
                    "timestamp": r.arrival_ms,
                    "input_length": r.input_tokens,
                    "output_length": 1,
                    "hash_ids": list(r.block_ids),
                }
            )
            for r in _churn_trace(60)
        )
    )
    argv = ["--trace", str(trace), "--engines", "3", "--capacity-tokens", "3072"]
    assert bench_trace.main([*argv, "--no-service", "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "trace-tiny.json").read_text())
    for mode in Mode:
        for key in ("hit_ratio", "blocks_loaded", "blocks_recomputed", "ttft_mean_s", "ttft_p90_s"):
            assert key in report[mode.value]
    assert report["upper_bound"]["hit_ratio"] == report["best_possible_hit_ratio"]
    assert report["kvrc_kv_vs_upper_bound"] == pytest.approx(
        report["kvrc_kv"]["hit_ratio"] / report["upper_bound"]["hit_ratio"]
    )
    for key in ("lookup_ms_p50", "lookup_ms_p99", "max_sustained_speedup"):
        assert key in report
    png = (tmp_path / "out" / "trace-tiny.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


def test_bench_trace_refuses_a_bad_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}\n{"timestamp": 1}\n')
    assert bench_trace.main(["--trace", str(bad), "--no-service", "--out", str(tmp_path)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert not list(tmp_path.glob("trace-*"))


@pytest.mark.parametrize("mode", [Mode.KVRC_RR, Mode.KVRC_KV])
def test_real_service_replay_keeps_the_coordinator_view_and_leases_exact(
    mode: Mode, tmp_path: Path
) -> None:
    reqs = _churn_trace(160)
    run = bench_trace.run_real(
        mode,
        reqs,
        engines=4,
        capacity_tokens=512 * 6,
        cost=CostModel(),
        speedup=20.0,
        workdir=tmp_path,
    )
    assert not run.events_lost, run.lost_detail
    assert run.lookups == len(reqs)  # one real Lookup per request
    assert run.stats.grants > 5 and run.result.blocks_loaded > 0
    assert run.counters.late_pins == 0
    assert run.counters.aborts == run.counters.quarantines == 0
    assert run.stats.missing_releases == 0  # every lease was released by the coordinator
    local = simulate(reqs, Mode.LOCAL_RR, engines=4, capacity_tokens=512 * 6)
    assert run.result.hit_ratio > local.hit_ratio
    assert run.lookup_ms_p99 > 0
    assert run.server_lookup_ms_p99_le is not None  # the coordinator timed them too


def _fake_step(speedup: float, ok_up_to: float, server_ok_up_to: float) -> bench_trace.RealRun:
    """A RealRun whose client p99 passes up to `ok_up_to` and whose coordinator
    p99 passes up to `server_ok_up_to` (for the search policy alone)."""
    result = simulate(TINY, Mode.LOCAL_RR, engines=2)
    fast = speedup <= ok_up_to
    return bench_trace.RealRun(
        mode=Mode.KVRC_KV,
        speedup=speedup,
        result=result,
        requests=4,
        wall_s=10.0 / speedup,
        lookup_ms_p50=0.5,
        lookup_ms_p99=2.0 if fast else 12.0,
        lookups=4,
        lag_p99_s=0.0,
        lag_max_s=0.0,
        scheduled_s=10.0 / speedup,
        server_lookup_ms_p99_le=0.5 if speedup <= server_ok_up_to else 25.0,
        coordinator_cpu_s=0.01,
        events_lost=False,
        lost_detail="",
        stats=bench_trace.RealRunStats(),
        counters=bench_trace.LinkCounters(),
    )


@pytest.mark.parametrize(
    ("first", "ok_up_to", "server_ok_up_to", "expected", "tried"),
    [
        # Two p99 failures in a row end the climb.
        (50.0, 400.0, 0.0, (400.0, 0.0), [50.0, 100.0, 200.0, 400.0, 800.0, 1600.0]),
        # Nothing above sustains: halve from the first step.
        (50.0, 10.0, 0.0, (6.25, 0.0), [50.0, 100.0, 25.0, 12.5, 6.25]),
        (2.0, 0.5, 0.0, (0.0, 0.0), [2.0, 4.0, 1.0]),
        # The coordinator's own p99 keeps the climb going past the client's.
        (
            50.0,
            10.0,
            1600.0,
            (6.25, 1600.0),
            [50.0, 100.0, 200.0, 400.0, 800.0, 1600.0, 3200.0, 6400.0, 25.0, 12.5, 6.25],
        ),
    ],
)
def test_max_speedup_search_doubles_until_a_step_fails(
    first: float,
    ok_up_to: float,
    server_ok_up_to: float,
    expected: tuple[float, float],
    tried: list[float],
) -> None:
    def run_at(speedup: float) -> bench_trace.RealRun:
        return _fake_step(speedup, ok_up_to, server_ok_up_to)

    *best, steps = bench_trace.search_max_speedup(run_at(first), run_at, 60.0, lambda _: None)
    assert tuple(best) == expected
    assert [s["speedup"] for s in steps] == tried
    failed = [s for s in steps if not s["sustained"]]
    assert all("lookup p99" in s["failed_because"] for s in failed)


def test_max_speedup_search_starts_no_step_beyond_its_budget() -> None:
    def run_at(speedup: float) -> bench_trace.RealRun:
        return _fake_step(speedup, 0.0, 0.0)

    # Halving from 2x: a 1x step would need a 10 s schedule; only 6 s are left.
    _, _, steps = bench_trace.search_max_speedup(run_at(2.0), run_at, 6.0, lambda _: None)
    assert [s["speedup"] for s in steps] == [2.0, 4.0]
