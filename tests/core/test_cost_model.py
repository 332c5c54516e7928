"""The cost model on plain numbers (I9-cost-gate): fits, cold defaults, bounds, decisions."""

from __future__ import annotations

import dataclasses
import math
import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.cost_model import (
    MAX_BLOCK_BYTES,
    CostConfig,
    CostModel,
    DeclaredLink,
    LoadPlan,
    kv_bytes_per_block,
)
from kvrc.vocabulary import KvRegion, Tier

GPU = Tier.GPU


def probe(
    model: CostModel,
    holder: str = "h",
    requester: str = "r",
    tier: Tier = GPU,
    floor: int = 1,
    hinted: int = 20,
    per_block: int = 16 << 20,
    now_ms: int | None = None,
) -> int | None:
    """The blocks a load over the link may cover when it is a probe; None: not a probe."""
    plan = model.plan(
        holder,
        requester,
        tier,
        floor,
        hinted,
        block_tokens=128,
        bytes_per_block=per_block,
        now_ms=now_ms,
    )
    if not plan.probe:
        assert plan.ceiling == hinted  # not a probe: every hinted block
    return plan.ceiling if plan.probe else None


def feed(model: CostModel, latency_ms: float, bandwidth: float, sizes: list[int]) -> None:
    for size in sizes:
        duration_us = round((latency_ms + size * 1000 / bandwidth) * 1000)
        assert model.observe_transfer("h", "r", GPU, size, duration_us)


def test_a_cold_pair_predicts_from_the_defaults_and_the_declared_rate() -> None:
    config = CostConfig(
        default_bandwidth_bytes_per_s=2e9, default_latency_ms=0.5, default_prefill_tokens_per_s=8e3
    )
    model = CostModel(config, declared_prefill=lambda r: 4e3 if r == "declared" else None)
    p = model.predict("h", "r", GPU, num_tokens=8000, num_bytes=2_000_000_000)
    assert p.link.samples == 0
    assert p.load_ms == pytest.approx(0.5 + 1000)
    assert p.recompute_ms == pytest.approx(1000)
    assert p.prefill.source == "default" and not p.worth_loading
    declared = model.predict("h", "declared", GPU, num_tokens=8000, num_bytes=0)
    assert declared.prefill.source == "declared" and declared.recompute_ms == pytest.approx(2000)
    assert model.pair_count == 0  # predicting stores nothing


def test_a_declared_link_is_the_prior_of_the_pairs_it_matches_first_match_winning() -> None:
    across = DeclaredLink(("a-*",), ("b-*",), bandwidth_bytes_per_s=0.1e9, latency_ms=5.0)
    anything = DeclaredLink(("*",), ("*",), bandwidth_bytes_per_s=2e9, latency_ms=0.5)
    model = CostModel(declared_links=(across, anything))
    cold = model.link("a-0", "b-3", GPU)
    assert (cold.bandwidth_bytes_per_s, cold.latency_ms, cold.samples) == (0.1e9, 5.0, 0)
    within = model.link("a-0", "a-1", GPU)  # not across: the catch-all, listed second
    assert (within.bandwidth_bytes_per_s, within.latency_ms) == (2e9, 0.5)
    # Without declarations the same pair is the config's fast default: a cold slow link
    # would be granted its first load (the cold start the declaration avoids).
    default = CostModel().link("a-0", "b-3", GPU)
    assert default.bandwidth_bytes_per_s == CostConfig().default_bandwidth_bytes_per_s
    slow = model.predict("a-0", "b-3", GPU, num_tokens=192, num_bytes=192 * 131072)
    assert not slow.worth_loading
    assert CostModel().predict("a-0", "b-3", GPU, 192, 192 * 131072).worth_loading
    # Measurements then move the pair away from its declared prior.
    for _ in range(30):
        assert model.observe_transfer("a-0", "b-3", GPU, 64 << 20, 40_000)  # 1.7 GB/s
    assert model.link("a-0", "b-3", GPU).bandwidth_bytes_per_s > 1e9


@pytest.mark.parametrize(
    "change",
    [{"holders": ()}, {"bandwidth_bytes_per_s": 0.0}, {"latency_ms": -1.0}],
)
def test_bad_declared_links_are_refused(change: dict[str, object]) -> None:
    good: dict[str, object] = {
        "holders": ("a",),
        "requesters": ("b",),
        "bandwidth_bytes_per_s": 1e9,
        "latency_ms": 1.0,
    }
    with pytest.raises(ValueError, match="link"):
        DeclaredLink(**{**good, **change})  # type: ignore[arg-type]


def test_the_ewma_fit_separates_latency_from_bandwidth() -> None:
    model = CostModel()
    rng = random.Random(7)
    sizes = [rng.randrange(1 << 20, 64 << 20) for _ in range(60)]
    feed(model, latency_ms=5.0, bandwidth=0.1e9, sizes=sizes)
    link = model.link("h", "r", GPU)
    assert link.samples == 60
    assert link.latency_ms == pytest.approx(5.0, rel=0.02)
    assert link.bandwidth_bytes_per_s == pytest.approx(0.1e9, rel=0.02)
    # What the separation buys: a small load still pays the latency. Bytes over duration
    # alone (no intercept) would predict it ~9x too fast.
    small = model.predict("h", "r", GPU, 1, 64 << 10)
    assert small.load_ms == pytest.approx(5.0 + (64 << 10) / 0.1e6, rel=0.02)
    naive_bandwidth = sum(sizes) / sum(5.0 / 1000 + s / 0.1e9 for s in sizes)
    assert (64 << 10) * 1000 / naive_bandwidth < small.load_ms / 5


def test_the_fit_follows_a_link_that_degrades() -> None:
    model = CostModel()
    rng = random.Random(3)
    feed(model, 0.5, 2e9, [rng.randrange(1 << 20, 64 << 20) for _ in range(40)])
    assert model.link("h", "r", GPU).bandwidth_bytes_per_s == pytest.approx(2e9, rel=0.02)
    feed(model, 5.0, 0.1e9, [rng.randrange(1 << 20, 64 << 20) for _ in range(40)])
    link = model.link("h", "r", GPU)
    assert link.bandwidth_bytes_per_s == pytest.approx(0.1e9, rel=0.05)
    assert link.latency_ms == pytest.approx(5.0, rel=0.1)


def test_same_sized_transfers_predict_what_was_measured_at_that_size() -> None:
    model = CostModel()
    feed(model, 3.0, 0.5e9, [8 << 20] * 30)
    p = model.predict("h", "r", GPU, 1, 8 << 20)
    assert p.load_ms == pytest.approx(3.0 + (8 << 20) * 1000 / 0.5e9, rel=0.01)


def test_unmeasured_reports_change_nothing() -> None:
    model = CostModel()
    assert not model.observe_transfer("h", "r", GPU, 0, 100)
    assert not model.observe_transfer("h", "r", GPU, 100, 0)
    assert not model.observe_prefill("r", 0, 100)
    assert model.pair_count == 0 and model.requester_count == 0


def test_measured_prefill_rates_replace_the_declared_one() -> None:
    model = CostModel(declared_prefill=lambda _r: 1000.0)
    for _ in range(40):
        model.observe_prefill("r", 8000, 1_000_000)  # 8000 tokens/s
    estimate = model.prefill("r")
    assert estimate.source == "measured" and estimate.samples == 40
    assert estimate.tokens_per_s == pytest.approx(8000, rel=0.01)


def test_a_measured_prefill_rate_expires_and_the_declared_one_applies_again() -> None:
    """A measured rate never expired and outranked the declared one: an engine whose
    speed changed (a new GPU, a restart) kept its old rate for ever."""
    model = CostModel(CostConfig(measurement_ttl_s=60.0), declared_prefill=lambda _r: 1000.0)
    for t in range(40):
        model.observe_prefill("r", 100_000, 1_000_000, now_ms=t)  # 100,000 tokens/s
    assert model.prefill("r", 60_038).source == "measured"
    expired = model.prefill("r", 60_039)  # 60 s after its last sample
    assert (expired.source, expired.samples, expired.tokens_per_s) == ("declared", 0, 1000.0)
    assert model.recompute_ms("r", 1000, 60_039) == pytest.approx(1000.0)
    assert model.predict("h", "r", GPU, 1000, 1, now_ms=60_039).prefill.source == "declared"
    assert model.prefill_rates(60_039) == (("r", expired),)  # `kvrc status`: not "measured"
    # The grant's decision too: a 50 ms link loses to the measured rate, and pays again
    # against the declared one once the measurement expired.
    link = DeclaredLink(("h",), ("r",), bandwidth_bytes_per_s=1e10, latency_ms=50.0)
    gated = CostModel(
        CostConfig(measurement_ttl_s=60.0),
        declared_prefill=lambda _r: 1000.0,
        declared_links=[link],
    )
    for t in range(40):
        gated.observe_prefill("r", 100_000, 1_000_000, now_ms=t)

    def fewest(now_ms: int) -> int | None:
        return gated.grantable(
            "h", "r", GPU, 1, 8, block_tokens=128, bytes_per_block=1 << 20, now_ms=now_ms
        )[1]

    assert fewest(1_000) is None and fewest(60_039) is not None
    # The next sample starts a new estimate from the declared rate: the old samples
    # are forgotten (as an expired fit's are), so one sample moves it by alpha.
    model.observe_prefill("r", 2000, 1_000_000, now_ms=60_039)  # 2000 tokens/s
    relearnt = model.prefill("r", 60_040)
    assert (relearnt.source, relearnt.samples) == ("measured", 1)
    assert relearnt.tokens_per_s == pytest.approx(1000.0 / (0.8 * 1.0 + 0.2 * 0.5))
    # Nothing declared: the default applies; without a clock (or a TTL of 0) nothing
    # expires (the negative controls).
    bare = CostModel(CostConfig(measurement_ttl_s=60.0, default_prefill_tokens_per_s=500.0))
    bare.observe_prefill("r", 8000, 1_000_000, now_ms=0)
    assert bare.prefill("r", 60_000).source == "default"
    assert bare.prefill("r").source == "measured"
    never = CostModel(CostConfig(measurement_ttl_s=0.0))
    never.observe_prefill("r", 8000, 1_000_000, now_ms=0)
    assert never.prefill("r", 10**9).source == "measured"


def test_one_absurd_prefill_sample_moves_the_rate_a_bounded_step() -> None:
    """One report of 1 token in an hour set a requester's rate to 0.0014 tokens/s on its
    own (every load then looked worth it) and took 74 honest samples to undo; one of
    2^32 tokens in a microsecond counted too."""
    model = CostModel(CostConfig(default_prefill_tokens_per_s=20_000.0))
    assert not model.observe_prefill("r", 2**32 - 1, 1)  # 4e15 tokens/s: not a prefill
    assert model.requester_count == 0
    assert model.observe_prefill("r", 1, 3_600_000_000)
    slowed = model.prefill("r").tokens_per_s
    assert 20_000 / 5 < slowed < 20_000 / 3  # at most 16x the rate it had, at alpha 0.2
    for _ in range(5):
        model.observe_prefill("r", 20_000, 1_000_000)
    assert model.prefill("r").tokens_per_s > 20_000 / 2
    # A rate that truly differs is still learnt: 64x slower than the default, in steps.
    slow = CostModel(CostConfig(default_prefill_tokens_per_s=64_000.0))
    for _ in range(40):
        slow.observe_prefill("r", 1_000, 1_000_000)
    assert slow.prefill("r").tokens_per_s == pytest.approx(1_000, rel=0.01)


def test_a_learnt_block_size_expires_so_one_absurd_load_does_not_refuse_a_holder_for_good() -> None:
    """A report that claimed 1 GiB a block from a holder of unknown size refused every
    later load from it (no load came to correct the size), for every requester, for ever."""
    model = CostModel(CostConfig(measurement_ttl_s=300.0))
    model.observe_block_bytes("h", 12 << 30, 12, now_ms=1_000)

    def worthwhile(now_ms: int) -> int | None:
        per_block = model.block_bytes("h", 0, now_ms)
        return model.grantable(
            "h", "r", GPU, 1, 12, block_tokens=16, bytes_per_block=per_block, now_ms=now_ms
        )[1]

    assert model.block_bytes("h", 0, 300_999) == MAX_BLOCK_BYTES
    assert worthwhile(300_999) is None
    assert model.block_bytes("h", 0, 301_000) == 0  # 300 s on: unknown again
    assert worthwhile(301_000) is not None  # priced as the first load was, and relearnt
    assert model.block_bytes("h", 0) == MAX_BLOCK_BYTES  # without a clock: never expires


def test_links_and_prefill_rates_are_bounded_by_count_least_recently_observed_first() -> None:
    model = CostModel(CostConfig(max_pairs=8, max_requesters=4))
    for i in range(100):
        model.observe_transfer(f"h{i}", "r", GPU, 1 << 20, 1000)
        model.observe_prefill(f"r{i}", 100, 1000)
    assert model.pair_count == 8 and model.requester_count == 4
    kept = [key[0] for key, _, _ in model.links()]
    assert kept == [f"h{i}" for i in range(92, 100)]
    assert model.link("h0", "r", GPU).samples == 0  # evicted: back to the defaults
    # Observing an old pair again makes it the most recent; predicting does not.
    model.observe_transfer("h92", "r", GPU, 1 << 20, 1000)
    model.predict("h93", "r", GPU, 1, 1)
    model.observe_transfer("new", "r", GPU, 1 << 20, 1000)
    assert [key[0] for key, _, _ in model.links()][-2:] == ["h92", "new"]
    assert "h93" not in {key[0] for key, _, _ in model.links()}


def test_the_decision_boundary_is_strict_and_scaled_by_the_margin() -> None:
    # A 10 ms link with no bytes, 1000 tokens/s: recompute of n tokens is n ms.
    config = CostConfig(default_latency_ms=10.0, default_prefill_tokens_per_s=1000.0)
    for margin, first_worth in ((1.0, 11), (1.5, 16), (3.0, 31)):
        model = CostModel(dataclasses.replace(config, safety_margin=margin))
        assert not model.predict("h", "r", GPU, first_worth - 1, 0).worth_loading
        assert model.predict("h", "r", GPU, first_worth, 0).worth_loading


@settings(max_examples=200, deadline=None)
@given(
    latency=st.floats(0, 100),
    gbps=st.floats(0.01, 100),
    rate=st.floats(100, 100_000),
    margin=st.floats(0.5, 4),
    block_tokens=st.integers(1, 64),
    block_bytes=st.integers(0, 8 << 20),
    blocks=st.integers(1, 512),
)
def test_predictions_are_the_model_and_worth_grows_with_the_prefix(
    latency: float,
    gbps: float,
    rate: float,
    margin: float,
    block_tokens: int,
    block_bytes: int,
    blocks: int,
) -> None:
    model = CostModel(
        CostConfig(
            safety_margin=margin,
            default_latency_ms=latency,
            default_bandwidth_bytes_per_s=gbps * 1e9,
            default_prefill_tokens_per_s=rate,
        )
    )

    def at(n: int) -> tuple[float, float, bool]:
        p = model.predict("h", "r", GPU, n * block_tokens, n * block_bytes)
        return p.load_ms, p.recompute_ms, p.worth_loading

    load, recompute, worth = at(blocks)
    assert load == pytest.approx(latency + blocks * block_bytes / (gbps * 1e6))
    assert recompute == pytest.approx(blocks * block_tokens * 1000 / rate)
    assert worth == (load * margin < recompute)
    if worth:  # the gate's binary search relies on this: longer prefixes stay worth it
        assert at(blocks + 1)[2]


def test_bytes_per_block_come_from_regions_then_from_the_layout() -> None:
    regions = [[KvRegion(0, 65536, 64), KvRegion(1, 65536, 64)], [KvRegion(2, 65536, 64)]]
    assert kv_bytes_per_block(regions, block_size=16) == 3 * 65536
    assert (
        kv_bytes_per_block(
            [[]], block_size=16, num_layers=32, num_kv_heads=8, head_size=128, kv_dtype="bfloat16"
        )
        == 2 * 32 * 8 * 128 * 16 * 2
    )
    assert kv_bytes_per_block([[]], block_size=16) == 0  # unknown: latency only
    # However a holder sizes them, a block weighs at most MAX_BLOCK_BYTES: regions at the
    # wire's bound on every part (1 GiB each) would make a prediction pass uint64.
    huge = [[KvRegion(0, 1 << 30, 64)] * 4096] * 8
    assert kv_bytes_per_block(huge, block_size=16) == MAX_BLOCK_BYTES
    assert (
        kv_bytes_per_block(
            [[]], block_size=1 << 20, num_layers=1 << 10, num_kv_heads=1 << 10, head_size=1 << 10
        )
        == MAX_BLOCK_BYTES
    )


@pytest.mark.parametrize(
    "change",
    [
        {"safety_margin": 0.0},
        {"default_latency_ms": -1.0},
        {"default_bandwidth_bytes_per_s": float("inf")},
        {"max_pairs": 0},
        {"alpha": 0.0},
        {"probe_bytes": -1},
        {"probe_bytes": 1.5},
        {"reverse_prior": 1},
    ],
)
def test_bad_cost_settings_are_refused_naming_the_setting(change: dict[str, float]) -> None:
    (name,) = change
    with pytest.raises(ValueError, match=name):
        CostConfig(**change)  # type: ignore[arg-type]


def test_memory_is_a_few_hundred_bytes_per_link_and_churn_does_not_grow_it() -> None:
    # Counted in bytes allocated (tracemalloc), never timed. The ids are the caller's.
    names = [(f"holder-{i:05d}", f"req-{i:05d}") for i in range(11_000)]
    model = CostModel(CostConfig(max_pairs=1000))
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for holder, requester in names[:1000]:
            model.observe_transfer(holder, requester, GPU, 1 << 20, 1000)
        full = tracemalloc.get_traced_memory()[0] - start
        for holder, requester in names[1000:]:  # ten times the bound, through the LRU
            model.observe_transfer(holder, requester, GPU, 1 << 20, 1000)
        churned = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert model.pair_count == 1000
    assert full / 1000 < 600, f"{full / 1000:.0f} bytes per link"
    assert churned < 1.5 * full, (full, churned)


def test_an_unmeasured_links_open_load_bounds_its_bandwidth_once_it_outlasts_the_prior() -> None:
    # Prior: 10 GB/s after 1 ms. A 1 GB load predicts 101 ms.
    config = CostConfig(default_bandwidth_bytes_per_s=1e10, default_latency_ms=1.0)
    model = CostModel(config, declared_prefill=lambda _r: 1e4)
    model.load_started("lease-1", "h", "r", GPU, 1_000_000_000, now_ms=1000)
    assert model.open_first_loads == 1

    def bandwidth(now_ms: int | None) -> float:
        return model.link("h", "r", GPU, now_ms).bandwidth_bytes_per_s

    assert bandwidth(None) == 1e10  # without a clock: the prior
    assert bandwidth(1000 + 50) == 1e10  # open for less than predicted: nothing learnt
    # Open for 401 ms: 1 GB has not moved in 400 ms (after the latency): at most 2.5 GB/s.
    assert bandwidth(1000 + 401) == pytest.approx(2.5e9)
    later = model.predict("h", "r", GPU, num_tokens=1000, num_bytes=500_000_000, now_ms=3001)
    assert later.link.bandwidth_bytes_per_s == pytest.approx(5e8)  # 1 GB, 2 s: 0.5 GB/s
    assert later.load_ms == pytest.approx(1 + 1000) and not later.worth_loading
    assert model.worthwhile_blocks(
        "h", "r", GPU, 1, 4, block_tokens=250, bytes_per_block=125_000_000, now_ms=3001
    ) is None  # fmt: skip
    # Other links, and other tiers of the same pair, keep their prior.
    assert model.link("h", "other", GPU, 3001).bandwidth_bytes_per_s == 1e10
    assert model.link("h", "r", Tier.CPU, 3001).bandwidth_bytes_per_s == 1e10
    # The lease ends: the bound goes with it.
    model.load_ended("lease-1")
    model.load_ended("lease-1")  # twice, or a lease never kept: fine
    model.load_ended("never-kept")
    assert model.open_first_loads == 0 and bandwidth(3001) == 1e10


def test_open_loads_count_only_until_the_link_has_a_sample() -> None:
    model = CostModel(CostConfig(default_bandwidth_bytes_per_s=1e10, default_latency_ms=1.0))
    model.load_started("a", "h", "r", GPU, 1_000_000_000, now_ms=0)
    assert model.link("h", "r", GPU, 10_000).bandwidth_bytes_per_s < 1.01e8  # 1 GB, 10 s
    # The first report arrives (a fast link after all): the fit takes over.
    feed(model, 1.0, 1e10, [1_000_000_000])
    assert model.link("h", "r", GPU, 10_000) == model.link("h", "r", GPU)
    # A measured link keeps no open loads.
    model.load_started("b", "h", "r", GPU, 1_000_000_000, now_ms=0)
    model.load_ended("a")
    assert model.open_first_loads == 0


def test_a_declared_link_is_bounded_by_its_open_loads_too() -> None:
    declared = DeclaredLink(("h",), ("r*",), bandwidth_bytes_per_s=1e9, latency_ms=0.0)
    model = CostModel(declared_links=[declared])
    model.load_started("a", "h", "r1", GPU, 100_000_000, now_ms=0)
    assert model.link("h", "r1", GPU, 100).bandwidth_bytes_per_s == 1e9  # as declared: 100 ms
    assert model.link("h", "r1", GPU, 200).bandwidth_bytes_per_s == pytest.approx(5e8)


def test_a_link_neither_measured_nor_declared_is_probed_with_a_short_load() -> None:
    mib = 1 << 20
    model = CostModel(CostConfig(probe_bytes=64 * mib))

    def ceiling(
        holder: str = "h", floor: int = 1, hinted: int = 20, per_block: int = 16 * mib
    ) -> int | None:
        return probe(model, holder, floor=floor, hinted=hinted, per_block=per_block)

    assert ceiling() == 4  # 64 MiB of 16 MiB blocks
    assert ceiling(per_block=100 * mib) == 1  # at least one block
    assert ceiling(per_block=0) is None  # size unknown: nothing to size a probe by
    assert ceiling(floor=6) == 6  # never below the request's min_blocks
    assert ceiling(hinted=3) == 3  # never above what the holder was hinted to hold
    # Its first outcome is the link's first sample: from then on the fit decides.
    feed(model, 1.0, 1e9, [64 * mib])
    assert ceiling() is None
    assert ceiling(holder="other") == 4  # a sample is per link
    # A declared link is trusted as declared; no probes with the gate off or probe_bytes 0.
    declared = DeclaredLink(("h",), ("r",), bandwidth_bytes_per_s=1e9, latency_ms=1.0)
    assert probe(CostModel(declared_links=[declared]), per_block=mib) is None
    for config in (CostConfig(gate=False), CostConfig(probe_bytes=0)):
        assert probe(CostModel(config), per_block=mib) is None


def test_an_undeclared_link_stands_on_its_measured_reverse() -> None:
    mib = 1 << 20
    # The defaults are fast (10 GB/s); r -> h is measured slow: 0.1 GB/s after 5 ms.
    model = CostModel(CostConfig(probe_bytes=64 * mib))
    for size in (16 * mib, 64 * mib, 256 * mib) * 10:
        assert model.observe_transfer("r", "h", GPU, size, round((5 + size / 1e5) * 1000))
    back = model.link("r", "h", GPU)
    forward = model.link("h", "r", GPU)
    assert (forward.samples, forward.prior) == (0, "reverse")
    assert forward.bandwidth_bytes_per_s == pytest.approx(back.bandwidth_bytes_per_s)
    assert forward.bandwidth_bytes_per_s == pytest.approx(1e8, rel=0.05)
    assert forward.latency_ms == pytest.approx(back.latency_ms)
    # So the reverse says a whole load over h -> r does not pay, where the defaults
    # alone would grant it.
    p = model.predict("h", "r", GPU, num_tokens=20 * 128, num_bytes=20 * 16 * mib)
    assert not p.worth_loading and "the reverse link's estimate" in p.describe()
    # Only the same pair, the same tier: another requester and the CPU tier stay cold.
    assert model.link("h", "other", GPU).prior == "default"
    assert model.link("h", "r", Tier.CPU).prior == "default"
    assert probe(model, tier=Tier.CPU) == 4
    # The negative control: with reverse_prior off, h -> r is cold and probed.
    off = CostModel(CostConfig(probe_bytes=64 * mib, reverse_prior=False))
    off.observe_transfer("r", "h", GPU, 64 * mib, 676_000)
    assert off.link("h", "r", GPU).prior == "default"
    assert (
        off.link("h", "r", GPU).bandwidth_bytes_per_s == CostConfig().default_bandwidth_bytes_per_s
    )
    assert probe(off) == 4


def test_a_declared_link_outranks_the_reverse() -> None:
    declared = DeclaredLink(("h",), ("r",), bandwidth_bytes_per_s=2e9, latency_ms=0.5)
    model = CostModel(declared_links=[declared])
    model.observe_transfer("r", "h", GPU, 64 << 20, 676_000)  # the reverse: slow
    link = model.link("h", "r", GPU)
    assert (link.prior, link.bandwidth_bytes_per_s, link.latency_ms) == ("declared", 2e9, 0.5)


# The slow-pairs cluster's units: 64 MiB blocks of 512 tokens, 8,000 tokens/s (64 ms a
# block to recompute); 2 GB/s moves a block in 34 ms, 0.1 GB/s in 671 ms.
BLOCK = 64 << 20
FAST_US, SLOW_US = 34_000, 676_000


def worthwhile(
    model: CostModel,
    holder: str,
    requester: str,
    now_ms: int | None = None,
    link: LoadPlan | None = None,
) -> int | None:
    """The fewest of 12 blocks worth loading (on `link`'s pricing and reach if given)."""
    return model.worthwhile_blocks(
        holder,
        requester,
        GPU,
        1,
        12 if link is None else link.ceiling,
        block_tokens=512,
        bytes_per_block=BLOCK,
        now_ms=now_ms,
        link=None if link is None else link.link,
    )


def plan_of(model: CostModel, holder: str, requester: str, now_ms: int | None = None) -> LoadPlan:
    return model.plan(
        holder, requester, GPU, 1, 12, block_tokens=512, bytes_per_block=BLOCK, now_ms=now_ms
    )


def test_an_asymmetric_pair_through_the_gate() -> None:
    rate = CostConfig(default_prefill_tokens_per_s=8000.0)
    # The reverse is the fast one: the slow direction is granted whole on its word, its
    # open load bounds it while it runs, and its own first sample refuses it.
    model = CostModel(rate)
    model.observe_transfer("r", "h", GPU, BLOCK, FAST_US)
    assert worthwhile(model, "h", "r") is not None
    assert not _started(model, "a", "h", "r", now_ms=0).probe
    assert worthwhile(model, "h", "r", now_ms=60_000) is None  # 12 blocks, open for 60 s
    assert model.observe_transfer("h", "r", GPU, 12 * BLOCK, 12 * SLOW_US, lease_id="a")
    model.load_ended("a")
    assert worthwhile(model, "h", "r") is None
    # Its fit started from the reverse (a measurement): the sample alone decides, 0.1 GB/s
    # at once, not a blend with the reverse's 2 GB/s.
    assert model.link("h", "r", GPU).bandwidth_bytes_per_s < 0.101e9
    # The reverse is the slow one: its word would refuse the fast direction, so the fast
    # direction is probed as if it had no reverse (a stand-in may spare a probe, never
    # forbid one), and its probe measures it: from then on it loads whole.
    model = CostModel(rate)
    model.observe_transfer("r", "h", GPU, BLOCK, SLOW_US)
    assert worthwhile(model, "h", "r") is None  # the reverse's word alone: refused
    plan = _started(model, "p", "h", "r", now_ms=0)
    assert (plan.probe, plan.ceiling, plan.link.prior) == (True, 1, "default")
    assert worthwhile(model, "h", "r", link=plan) == 1
    model.observe_transfer("h", "r", GPU, BLOCK, FAST_US, lease_id="p")
    assert not plan_of(model, "h", "r").probe and worthwhile(model, "h", "r") is not None
    fast = model.link("h", "r", GPU)  # its sample alone: 2 GB/s, not the slow reverse's line
    assert fast.prior == "reverse" and fast.bandwidth_bytes_per_s > 1.9e9
    # The same with the reverse prior off: probed, never on the reverse's word.
    off = CostModel(dataclasses.replace(rate, reverse_prior=False))
    off.observe_transfer("r", "h", GPU, BLOCK, SLOW_US)
    assert probe(off, hinted=12, per_block=BLOCK) == 1
    assert worthwhile(off, "h", "r") is not None


def test_a_measured_link_keeps_its_own_prior_whatever_its_reverse_does() -> None:
    # h -> r's first load stood on r -> h (2 GB/s): that prior is copied into h -> r's fit,
    # which its own samples then decide.
    model = CostModel(CostConfig(max_pairs=2))
    model.observe_transfer("r", "h", GPU, BLOCK, FAST_US)
    assert model.link("h", "r", GPU).prior == "reverse"
    _started(model, "a", "h", "r", now_ms=0)
    model.observe_transfer("h", "r", GPU, BLOCK, FAST_US, lease_id="a")
    kept = model.link("h", "r", GPU)
    assert kept.prior == "reverse"
    for _ in range(10):  # the reverse turns slow: h -> r does not move
        model.observe_transfer("r", "h", GPU, BLOCK, SLOW_US)
    assert model.link("h", "r", GPU) == kept
    # Nor when the reverse leaves the LRU (h -> r observed again, so r -> h is oldest).
    model.observe_transfer("h", "r", GPU, BLOCK, FAST_US)
    kept = model.link("h", "r", GPU)
    model.observe_transfer("x", "y", GPU, BLOCK, FAST_US)
    assert [key[:2] for key, _, _ in model.links()] == [("h", "r"), ("x", "y")]
    assert model.link("h", "r", GPU) == kept


def test_reading_a_cold_link_through_its_reverse_leaves_the_lru_alone() -> None:
    model = CostModel(CostConfig(max_pairs=2))
    model.observe_transfer("r", "h", GPU, BLOCK, FAST_US)
    model.observe_transfer("x", "y", GPU, BLOCK, FAST_US)
    assert model.link("h", "r", GPU).prior == "reverse"
    model.predict("h", "r", GPU, 512, BLOCK)
    worthwhile(model, "h", "r")
    assert [key[:2] for key, _, _ in model.links()] == [("r", "h"), ("x", "y")]
    # So the next link evicts r -> h, and h -> r is cold again.
    model.observe_transfer("y", "z", GPU, BLOCK, FAST_US)
    assert model.link("h", "r", GPU).prior == "default"


def test_a_fit_expires_after_the_ttl_and_a_link_refused_as_slow_is_probed_again() -> None:
    rate = CostConfig(default_prefill_tokens_per_s=8000.0, measurement_ttl_s=300.0)
    model = CostModel(rate)
    ttl_ms = 300_000
    model.observe_transfer("h", "r", GPU, BLOCK, SLOW_US, now_ms=0)
    # Fresh: refused on its fit, no probe (a probe now would learn nothing new).
    plan = plan_of(model, "h", "r", now_ms=ttl_ms - 1)
    assert not plan.probe and worthwhile(model, "h", "r", link=plan) is None
    assert model.links(ttl_ms - 1)[0][2] == ttl_ms - 1  # its age, for `kvrc status`
    # Expired: its old fit stands in, says the load does not pay, so the link is probed
    # on the defaults (a refusal is never for good) ...
    plan = plan_of(model, "h", "r", now_ms=ttl_ms)
    assert (plan.probe, plan.ceiling, plan.link.prior) == (True, 1, "default")
    assert "its own expired measurement" in model.predict(
        "h", "r", GPU, 512, BLOCK, now_ms=ttl_ms
    ).describe()  # fmt: skip
    assert worthwhile(model, "h", "r", link=plan) == 1
    # ... and the probe is an open first load, which bounds the next ones.
    model.load_started("p", "h", "r", GPU, BLOCK, now_ms=ttl_ms, stand_in=plan.stand_in)
    assert model.open_first_loads == 1
    assert (
        worthwhile(model, "h", "r", ttl_ms + 60_000, plan_of(model, "h", "r", ttl_ms + 60_000))
        is None
    )
    # The link got faster: the probe's sample starts a new fit, and whole loads follow.
    model.observe_transfer("h", "r", GPU, BLOCK, FAST_US, now_ms=ttl_ms + 40, lease_id="p")
    model.load_ended("p")
    fresh = model.link("h", "r", GPU, ttl_ms + 41)
    assert (fresh.samples, fresh.prior) == (1, "stale") and fresh.bandwidth_bytes_per_s > 1.9e9
    assert not plan_of(model, "h", "r", ttl_ms + 41).probe
    assert worthwhile(model, "h", "r", ttl_ms + 41) is not None
    # The negative control: with fits that never expire, the slow link stays refused
    # and is never probed again.
    never = CostModel(dataclasses.replace(rate, measurement_ttl_s=0.0))
    never.observe_transfer("h", "r", GPU, BLOCK, SLOW_US, now_ms=0)
    plan = plan_of(never, "h", "r", now_ms=100 * ttl_ms)
    assert not plan.probe and worthwhile(never, "h", "r", link=plan) is None


def test_an_idle_fast_link_stands_on_its_expired_fit_and_is_not_probed() -> None:
    model = CostModel(CostConfig(default_prefill_tokens_per_s=8000.0, measurement_ttl_s=60.0))
    model.observe_transfer("h", "r", GPU, BLOCK, FAST_US, now_ms=0)
    later = 3_600_000
    plan = plan_of(model, "h", "r", now_ms=later)
    assert (plan.probe, plan.ceiling, plan.link.prior) == (False, 12, "stale")
    assert worthwhile(model, "h", "r", link=plan) is not None
    # A load over it is an open first load (its fit no longer bounds it) ...
    model.load_started("a", "h", "r", GPU, 12 * BLOCK, now_ms=later, stand_in=plan.stand_in)
    assert model.open_first_loads == 1
    # ... and its sample starts the fit again from the defaults: one sample, not two.
    model.observe_transfer(
        "h", "r", GPU, 12 * BLOCK, 12 * FAST_US, now_ms=later + 400, lease_id="a"
    )
    assert model.link("h", "r", GPU, later + 400).samples == 1
    # Without a clock nothing expires (what `kvrc status` reads the estimate as).
    assert model.link("h", "r", GPU).samples == 1


def test_an_expired_fit_is_not_a_reverse_and_a_reverse_never_outranks_a_stale_fit() -> None:
    model = CostModel(CostConfig(default_prefill_tokens_per_s=8000.0, measurement_ttl_s=60.0))
    model.observe_transfer("r", "h", GPU, BLOCK, SLOW_US, now_ms=0)
    assert model.link("h", "r", GPU, 59_999).prior == "reverse"
    assert model.link("h", "r", GPU, 60_000).prior == "default"  # the reverse expired
    # h -> r's own (stale) fit outranks r -> h's fresh one.
    model.observe_transfer("h", "r", GPU, BLOCK, FAST_US, now_ms=0)
    model.observe_transfer("r", "h", GPU, BLOCK, SLOW_US, now_ms=100_000)
    assert model.link("h", "r", GPU, 100_000).prior == "stale"


def test_the_ttl_is_checked() -> None:
    for bad in (-1.0, math.inf, math.nan, 8 * 86400.0):
        with pytest.raises(ValueError, match="measurement_ttl_s"):
            CostConfig(measurement_ttl_s=bad)


def test_a_link_still_slow_at_expiry_costs_one_probe_not_whole_loads() -> None:
    # 84 ms a block against 64 to recompute: too slow (with the 1.5 margin), but not by
    # so much that one sample blended with the fast defaults (0.2 of it) would refuse.
    # A re-learnt fit starts from its stale line, a measurement, so the probe's sample
    # alone decides: refused again at once, one probe per TTL and no whole load.
    mid_us = 84_000
    model = CostModel(CostConfig(default_prefill_tokens_per_s=8000.0, measurement_ttl_s=60.0))
    for t in range(3):
        model.observe_transfer("h", "r", GPU, BLOCK, mid_us, now_ms=t)
    assert worthwhile(model, "h", "r", 10) is None
    plan = _started(model, "p", "h", "r", 60_010)
    assert plan.probe and worthwhile(model, "h", "r", link=plan) == 1
    model.observe_transfer("h", "r", GPU, BLOCK, mid_us, now_ms=60_100, lease_id="p")
    after = plan_of(model, "h", "r", 60_101)
    assert not after.probe and worthwhile(model, "h", "r", link=after) is None
    # The control: a cold link (no stand-in) blends its first sample with the defaults,
    # and the same sample lets whole loads through (docs/cost_model.md, "Probes").
    cold = CostModel(CostConfig(default_prefill_tokens_per_s=8000.0))
    cold.observe_transfer("h", "r", GPU, BLOCK, mid_us, now_ms=0)
    assert worthwhile(cold, "h", "r", 1) is not None


def _started(model: CostModel, lease: str, holder: str, requester: str, now_ms: int) -> LoadPlan:
    """Plans a 12-block load over holder -> requester and opens it as the grant would."""
    plan = plan_of(model, holder, requester, now_ms)
    model.load_started(
        lease, holder, requester, GPU, plan.ceiling * BLOCK, now_ms, stand_in=plan.stand_in
    )
    return plan


def test_a_fit_of_one_size_on_a_stand_in_keeps_its_shape_and_stays_physical() -> None:
    # r -> h: 24 ms of latency and a fast wire (two sizes tell them apart). h -> r's first
    # load stands on it; its one sample, 64 MiB in 20 ms, is faster than that latency.
    model = CostModel(CostConfig(default_prefill_tokens_per_s=8000.0))
    for _ in range(20):
        model.observe_transfer("r", "h", GPU, 1 << 20, 24_100)
        model.observe_transfer("r", "h", GPU, 256 << 20, 50_000)
    plan = _started(model, "a", "h", "r", now_ms=0)
    assert plan.stand_in is not None and plan.stand_in.prior == "reverse" and not plan.probe
    assert model.observe_transfer("h", "r", GPU, BLOCK, 20_000, now_ms=20, lease_id="a")
    fit = model.link("h", "r", GPU, 21)
    # The reverse's line scaled to the sample: it passes through it, latency and
    # bandwidth both finite and positive (not 20 ms of latency and an infinite wire).
    assert model.predict("h", "r", GPU, 512, BLOCK, link=fit).load_ms == pytest.approx(20.0)
    assert 0 < fit.latency_ms < 20 and fit.bandwidth_bytes_per_s < 1e11
    big = model.predict("h", "r", GPU, 512 * 100, 100 * BLOCK, link=fit).load_ms
    assert big > 100  # 100 blocks are not predicted at the cost of one


def test_a_fit_starts_from_what_its_load_was_planned_on_not_what_stands_at_its_report() -> None:
    # Warm-up: a -> b and b -> a both probed cold (no stand-in at planning), each with
    # the same slow first sample (a connection set up). Whichever reports second finds
    # the other measured, but both blend with the defaults alike.
    model = CostModel(CostConfig(default_prefill_tokens_per_s=8000.0))
    for lease, (holder, requester) in (("ab", ("a", "b")), ("ba", ("b", "a"))):
        assert _started(model, lease, holder, requester, now_ms=0).stand_in is None
    model.observe_transfer("a", "b", GPU, BLOCK, 60_000, now_ms=60, lease_id="ab")
    model.observe_transfer("b", "a", GPU, BLOCK, 60_000, now_ms=61, lease_id="ba")
    ab, ba = model.link("a", "b", GPU), model.link("b", "a", GPU)
    assert (ab.prior, ba.prior) == ("default", "default")
    assert ab.bandwidth_bytes_per_s == pytest.approx(ba.bandwidth_bytes_per_s)
    # A whole load granted on a fast reverse's word whose reverse leaves the LRU before
    # the report: the fit still starts from the reverse, and its slow sample decides.
    model = CostModel(CostConfig(default_prefill_tokens_per_s=8000.0, max_pairs=2))
    model.observe_transfer("r", "h", GPU, BLOCK, FAST_US, now_ms=0)
    plan = _started(model, "w", "h", "r", now_ms=1)
    assert plan.stand_in is not None and not plan.probe
    model.observe_transfer("x", "y", GPU, BLOCK, FAST_US, now_ms=2)
    model.observe_transfer("y", "z", GPU, BLOCK, FAST_US, now_ms=3)  # r -> h evicted
    assert model.link("r", "h", GPU).samples == 0
    model.observe_transfer("h", "r", GPU, 12 * BLOCK, 12 * SLOW_US, now_ms=8_200, lease_id="w")
    assert model.link("h", "r", GPU).prior == "reverse"
    assert worthwhile(model, "h", "r", 8_201) is None  # refused after that one load


def test_the_requesters_own_blocks_are_neither_priced_nor_probed() -> None:
    # A declared link of 5 ms latency and a fast wire; 4 ms to recompute a block. Past
    # 9 blocks the requester holds, one block moves: 5 x 1.5 > 4, refused. Priced over
    # all 10 (what a request without local_blocks gets), the latency looked cheap.
    declared = DeclaredLink(("h",), ("r",), bandwidth_bytes_per_s=1e12, latency_ms=5.0)
    model = CostModel(CostConfig(default_prefill_tokens_per_s=1000.0), declared_links=[declared])

    def fewest(have: int) -> int | None:
        return model.worthwhile_blocks(
            "h", "r", GPU, 10, 10, block_tokens=4, bytes_per_block=1000, have=have
        )

    assert fewest(9) is None and fewest(0) == 10
    # A probe moves probe_bytes past what the requester holds (2 blocks here).
    cold = CostModel(CostConfig(probe_bytes=2000))
    plan = cold.plan("h", "r", GPU, 7, 10, block_tokens=4, bytes_per_block=1000, have=6)
    assert (plan.probe, plan.ceiling) == (True, 8)
    assert cold.plan("h", "r", GPU, 1, 10, block_tokens=4, bytes_per_block=1000).ceiling == 2


def test_learnt_block_sizes_are_bounded_and_a_known_size_wins() -> None:
    model = CostModel(CostConfig(max_requesters=2))
    assert not model.observe_block_bytes("h", 0, 4) and not model.observe_block_bytes("h", 4, 0)
    assert model.block_bytes("h", 0) == 0
    assert model.observe_block_bytes("h", 1000, 3)
    assert model.block_bytes("h", 0) == 334  # rounded up: never priced lighter
    assert model.block_bytes("h", 64) == 64  # regions or a layout say it exactly
    model.observe_block_bytes("h", 1 << 50, 1)
    assert model.block_bytes("h", 0) == MAX_BLOCK_BYTES  # a report's claim is capped
    model.observe_block_bytes("g", 10, 1)
    model.observe_block_bytes("f", 10, 1)  # past max_requesters: h, observed first, goes
    assert model.block_bytes("h", 0) == 0 and model.block_bytes("f", 0) == 10
