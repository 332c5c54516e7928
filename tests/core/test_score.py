"""Score on plain data (coordinator/core/score.py, Inventory.match): docs/score.md.

A hypothesis model checks every answer against a brute-force longest prefix over
the same facts; the other tests pin the bounds, the reuse-off answer, token ids through vLLM's
hashing and its refusals, and that the work per request does not grow with engines
that are not asked about.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.cost_model import CostConfig, CostModel, LinkEstimate, LoadPlan
from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.events import BlockRemoved, BlockStored
from coordinator.core.inventory import MAX_CANDIDATES, Inventory, Scope
from coordinator.core.profiles import DeploymentProfile, ReuseReason, ReuseStatus
from coordinator.core.score import (
    HOLDERS_PRICED,
    MAX_SCORE_ANSWER_ENGINES,
    MAX_SCORE_BLOCKS,
    MAX_SCORE_CANDIDATES,
    MAX_SCORE_HASH_CONFIGS,
    MAX_SCORE_TOKENS,
    ScoreAnswer,
    ScoreEngine,
    ScoreQuery,
    hash_config,
    score,
    vllm_block_keys,
)
from coordinator.core.vllm_hashing import MAX_MM_FEATURES, HashConfig, MmFeature, block_keys
from kvrc.vocabulary import (
    PROFILE_EXTRA_HASH_ALGO,
    PROFILE_EXTRA_HASH_SEED,
    PROFILE_HASH_SEED_UNSET,
    Tier,
)

COMPAT = "compat-a"
ON = ReuseStatus(True, ReuseReason.ENABLED, "on")
OFF = ReuseStatus(False, ReuseReason.DISABLED_BY_COORDINATOR, "reuse is off")


@dataclass(frozen=True)
class Guess:
    load_ms: float
    recompute_ms: float

    @property
    def worth_loading(self) -> bool:
        return self.load_ms < self.recompute_ms


@dataclass(frozen=True)
class NoLinks:
    """Recompute at 1 token per ms (savings read as token counts); loads never pay
    (`load_ms_per_token`: at that rate, except from `slow` holders)."""

    load_ms_per_token: float = math.inf
    slow: frozenset[str] = frozenset()

    def predict(
        self,
        holder: str,
        requester: str,
        tier: Tier,
        num_tokens: int,
        num_bytes: int,
        now_ms: int | None = None,
        *,
        link: LinkEstimate | None = None,
    ) -> Guess:
        rate = math.inf if holder in self.slow else self.load_ms_per_token
        return Guess(num_tokens * rate, float(num_tokens))

    def recompute_ms(self, requester: str, num_tokens: int, now_ms: int | None = None) -> float:
        return float(num_tokens)

    def block_bytes(self, holder: str, known: int, now_ms: int | None = None) -> int:
        return known

    def plan(
        self,
        holder: str,
        requester: str,
        tier: Tier,
        floor: int,
        hinted: int,
        *,
        block_tokens: int,
        bytes_per_block: int,
        have: int = 0,
        now_ms: int | None = None,
    ) -> LoadPlan:
        return LoadPlan(LinkEstimate(1e9, 0.0, 1), hinted, False)  # every link measured


RATE = NoLinks()
PROFILE = DeploymentProfile(
    model="m",
    block_size=4,
    extra=((PROFILE_EXTRA_HASH_ALGO, "sha256_cbor"), (PROFILE_EXTRA_HASH_SEED, "0")),
)


def chain(n: int, tag: int = 0) -> tuple[bytes, ...]:
    return tuple(bytes([tag, i % 256, i // 256]) * 3 for i in range(n))


CHAIN = chain(12)


def store(inv: Inventory, cid: str, hashes: Sequence[bytes], tier: Tier = Tier.GPU) -> None:
    inv.apply(cid, [BlockStored(tuple(hashes), None, 4 * len(hashes), tier)])


def add(inv: Inventory, cid: str, *, visible: bool = True, serving: bool = True) -> None:
    inv.add_engine(cid, COMPAT)
    inv.set_ready(cid, visible)
    inv.set_serving(cid, serving)


def engine(cid: str, reuse: ReuseStatus = ON, **kw: object) -> ScoreEngine:
    return ScoreEngine(cid, replace(PROFILE, **kw), COMPAT, True, reuse)  # type: ignore[arg-type]


def run(
    inv: Inventory,
    engines: Sequence[ScoreEngine],
    hashes: tuple[bytes, ...] = CHAIN,
    *,
    reuse: ReuseStatus = ON,
    predictor: object = RATE,
    now_ms: int = 0,
    **kw: object,
) -> ScoreAnswer:
    query = ScoreQuery(model="m", block_hashes=hashes, **kw)  # type: ignore[arg-type]
    return score(
        inv,
        query,
        engines,
        now_ms=now_ms,
        reuse=reuse,
        predictor=predictor,  # type: ignore[arg-type]
        prediction_basis="test",
    )


def by_id(answer: ScoreAnswer) -> dict[str, tuple[int, int, str]]:
    return {
        e.child_engine_id: (e.local_matched_blocks, e.loadable_blocks, e.holder_child_engine_id)
        for e in answer.engines
    }


# --- the model ------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    holdings: dict[str, dict[int, frozenset[Tier]]]  # engine -> block index -> tiers
    visible: dict[str, bool]  # may lend (reuse gate open)
    serving: dict[str, bool]
    stale: dict[str, bool]
    asked: tuple[str, ...]
    gates: dict[str, bool]  # the asked engine may load


NAMES = ("e0", "e1", "e2", "e3", "e4")
TIERS = st.sampled_from([Tier.GPU, Tier.GPU, Tier.CPU, Tier.DISK])


@st.composite
def worlds(draw: st.DrawFn) -> World:
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=5, unique=True))
    holdings: dict[str, dict[int, frozenset[Tier]]] = {}
    for name in names:
        # Mostly prefixes with holes, so matches stop at different places.
        blocks = draw(st.lists(st.integers(0, 11), max_size=12, unique=True))
        holdings[name] = {
            b: frozenset(draw(st.lists(TIERS, min_size=1, max_size=2))) for b in blocks
        }
        if draw(st.booleans()):
            holdings[name].update(
                {b: frozenset({Tier.GPU}) for b in range(draw(st.integers(0, 12)))}
            )
    flags = {n: draw(st.tuples(st.booleans(), st.booleans(), st.booleans())) for n in names}
    asked = tuple(draw(st.lists(st.sampled_from(names), min_size=1, unique=True)))
    return World(
        holdings,
        {n: f[0] for n, f in flags.items()},
        {n: f[0] or f[1] for n, f in flags.items()},  # the flow sets visible only when serving
        {n: f[2] and draw(st.booleans()) for n, f in flags.items()},
        asked,
        {n: draw(st.booleans()) for n in asked},
    )


def build(world: World) -> Inventory:
    inv = Inventory()
    for name, blocks in world.holdings.items():
        add(inv, name, visible=world.visible[name], serving=world.serving[name])
        for b, tiers in blocks.items():
            for t in tiers:
                store(inv, name, [CHAIN[b]], t)
        if world.stale[name]:
            inv.mark_stale(name)
    return inv


def brute_prefix(blocks: dict[int, frozenset[Tier]]) -> int:
    n = 0
    while n in blocks:
        n += 1
    return n


def brute_tiers(blocks: dict[int, frozenset[Tier]], n: int) -> tuple[tuple[Tier, int], ...]:
    counts: dict[Tier, int] = {}
    for b in range(n):
        t = min(blocks[b])
        counts[t] = counts.get(t, 0) + 1
    return tuple(sorted(counts.items()))


@settings(max_examples=150, deadline=None)
@given(worlds(), st.booleans())
def test_score_matches_a_brute_force_longest_prefix(world: World, reuse_on: bool) -> None:
    inv = build(world)
    engines = [engine(n, ON if world.gates[n] else OFF) for n in world.asked]
    answer = run(inv, engines, reuse=ON if reuse_on else OFF)
    got = {e.child_engine_id: e for e in answer.engines}
    assert set(got) == set(world.asked)
    fresh = {n for n in world.holdings if not world.stale[n]}
    lenders = [n for n in fresh if world.visible[n]]
    for name in world.asked:
        e = got[name]
        if name not in fresh or not (world.serving[name] or world.visible[name]):
            assert not e.scored and e.local_matched_blocks == 0, e
            continue
        blocks = world.holdings[name]
        local = brute_prefix(blocks)
        assert e.scored and e.local_matched_blocks == local, (e, blocks)
        assert e.local_by_tier == brute_tiers(blocks, local)
        assert e.predicted_saving_ms == pytest.approx(local * 4)  # loads never credited
        others = [(brute_prefix(world.holdings[n]), n) for n in lenders if n != name]
        best = max((m for m, _ in others), default=0)
        if reuse_on and world.gates[name] and best > local:
            assert e.loadable_blocks == best - local
            assert (best, e.holder_child_engine_id) in others
        else:
            assert (e.loadable_blocks, e.holder_child_engine_id) == (0, ""), e
    keys = [(not e.scored, -e.predicted_saving_ms, e.child_engine_id) for e in answer.engines]
    assert [k[0] for k in keys] == sorted(k[0] for k in keys)


# --- answers ------------------------------------------------------------------------


def test_local_by_tier_loadable_and_the_holder_is_never_the_engine_itself() -> None:
    inv = Inventory()
    for cid in ("a", "b", "c"):
        add(inv, cid)
    store(inv, "a", CHAIN[:3])
    store(inv, "a", CHAIN[3:5], Tier.CPU)
    store(inv, "b", CHAIN[:10])
    store(inv, "c", CHAIN[:8])
    answer = run(inv, [engine("a"), engine("b")])
    a, b = (next(e for e in answer.engines if e.child_engine_id == x) for x in "ab")
    assert a.local_by_tier == ((Tier.GPU, 3), (Tier.CPU, 2))
    assert (a.local_matched_blocks, a.loadable_blocks, a.holder_child_engine_id) == (5, 5, "b")
    assert a.holder_tier is Tier.GPU
    # b holds the longest prefix itself: nothing to load.
    assert (b.local_matched_blocks, b.loadable_blocks, b.holder_child_engine_id) == (10, 0, "")
    assert [e.child_engine_id for e in answer.engines] == ["b", "a"]
    assert answer.reuse_enabled and a.prompt_blocks == len(CHAIN)


def slow_from(*holders: str) -> NoLinks:
    """Loads pay (half a recompute) except from `holders` (never)."""
    return NoLinks(0.5, slow=frozenset(holders))


def test_score_names_the_holder_a_grant_would_take_past_those_it_may_not_ask() -> None:
    inv = Inventory()
    for cid in ("a", "h1", "h2", "h3"):
        add(inv, cid)
    store(inv, "h1", CHAIN[:10])
    store(inv, "h2", CHAIN[:9])
    store(inv, "h3", CHAIN[:8])
    fast = slow_from()

    def scored(**kw: object) -> tuple[int, str, float]:
        query = ScoreQuery(model="m", block_hashes=CHAIN)
        answer = score(
            inv,
            query,
            [engine("a")],
            now_ms=0,
            reuse=ON,
            predictor=fast,
            prediction_basis="",
            **kw,  # type: ignore[arg-type]
        )
        a = answer.engines[0]
        return a.loadable_blocks, a.holder_child_engine_id, a.predicted_saving_ms

    # Control: every holder may be asked, the longest is named.
    assert scored() == (10, "h1", 20.0)
    # h1 draining or not READY (Grants.may_lend says no): the next one, as a grant does.
    assert scored(may_lend=lambda holder, compat: holder != "h1") == (9, "h2", 18.0)
    # The check is asked with the requester's compatibility.
    assert scored(may_lend=lambda holder, compat: compat != COMPAT) == (0, "", 0.0)


def test_a_holder_the_cost_gate_refuses_is_passed_for_the_next_that_pays() -> None:
    inv = Inventory()
    for cid in ("a", "h1", "h2"):
        add(inv, cid)
    store(inv, "h1", CHAIN[:10])
    store(inv, "h2", CHAIN[:9])
    a = run(inv, [engine("a")], predictor=slow_from("h1")).engines[0]
    # The grant skips h1's slow link for h2 (Grants._choose_holder); so does Score.
    assert (a.loadable_blocks, a.holder_child_engine_id, a.predicted_saving_ms) == (9, "h2", 18.0)
    # When no holder pays, the first is named with no saving (the old answer).
    a = run(inv, [engine("a")], predictor=slow_from("h1", "h2")).engines[0]
    assert (a.loadable_blocks, a.holder_child_engine_id, a.predicted_saving_ms) == (10, "h1", 0.0)


def test_a_draining_engine_is_not_scored() -> None:
    inv = Inventory()
    add(inv, "a")
    store(inv, "a", CHAIN[:4])
    draining = replace(engine("a"), draining=True)
    (a,) = run(inv, [draining]).engines
    assert not a.scored and "draining" in a.detail and a.local_matched_blocks == 0
    # Control: the same engine not draining is scored with its match.
    (a,) = run(inv, [engine("a")]).engines
    assert a.scored and a.local_matched_blocks == 4


@dataclass
class CountingHasher:
    """vLLM's hashing (`vllm_block_keys`), recording each call's configuration and
    how many token ids it hashed."""

    calls: list[tuple[HashConfig, int]] = field(default_factory=list)

    def __call__(
        self,
        token_ids: Sequence[int],
        config: HashConfig,
        *,
        lora_name: str | None,
        lora_path: str | None,
        cache_salt: str | None,
        mm_features: Sequence[MmFeature],
    ) -> Sequence[bytes]:
        self.calls.append((config, len(token_ids)))
        return vllm_block_keys(
            token_ids,
            config,
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=cache_salt,
            mm_features=mm_features,
        )


def test_a_prompt_past_the_scored_blocks_is_hashed_only_that_far() -> None:
    counting = CountingHasher()
    inv = Inventory()
    add(inv, "a")
    query = ScoreQuery(model="m", token_ids=tuple(range(MAX_SCORE_TOKENS)))
    answer = score(
        inv,
        query,
        [engine("a", block_size=1)],
        now_ms=0,
        reuse=ON,
        predictor=RATE,
        prediction_basis="",
        hasher=counting,
    )
    # 65,536 tokens at block size 1 are 65,536 blocks; 4,096 are scored, and hashed.
    assert [n for _, n in counting.calls] == [MAX_SCORE_BLOCKS]
    assert answer.engines[0].prompt_blocks == MAX_SCORE_BLOCKS
    # Control: at block size 16 the whole prompt is within the bound and hashed.
    counting.calls.clear()
    score(
        inv,
        query,
        [engine("a", block_size=16)],
        now_ms=0,
        reuse=ON,
        predictor=RATE,
        prediction_basis="",
        hasher=counting,
    )
    assert [n for _, n in counting.calls] == [MAX_SCORE_TOKENS]


def test_reuse_off_counts_local_matches_only_and_says_so() -> None:
    inv = Inventory()
    # The flow's gate keeps every engine out of lookups while reuse is off (visible
    # False); Score still counts what each one holds itself.
    add(inv, "a", visible=False)
    add(inv, "b", visible=False)
    store(inv, "a", CHAIN[:2])
    store(inv, "b", CHAIN[:9])
    answer = run(inv, [engine("a", OFF), engine("b", OFF)], reuse=OFF)
    assert not answer.reuse_enabled and answer.reuse_detail == "reuse is off"
    assert by_id(answer) == {"a": (2, 0, ""), "b": (9, 0, "")}
    assert answer.engines[0].child_engine_id == "b"
    # Negative control: the same inventory with reuse on lends b's blocks to a.
    for cid in ("a", "b"):
        inv.set_ready(cid, True)
    assert by_id(run(inv, [engine("a"), engine("b")]))["a"] == (2, 7, "b")


def test_unscorable_engines_say_why_and_do_not_break_the_answer() -> None:
    inv = Inventory()
    add(inv, "a")
    add(inv, "stale")
    store(inv, "a", CHAIN[:4])
    inv.mark_stale("stale")
    engines = [
        engine("a"),
        ScoreEngine("ghost", None),
        engine("other", model="n"),
        replace(engine("half"), ready=False),
        engine("stale"),
    ]
    answer = run(inv, engines)
    details = {e.child_engine_id: e.detail for e in answer.engines if not e.scored}
    assert details == {
        "ghost": "not a registered child engine",
        "other": "serves model 'n', not 'm'",
        "half": "not READY (a rank part of its grid is missing)",
        "stale": "its inventory is stale (a full dump is awaited): its matches are unknown",
    }
    assert answer.engines[0].child_engine_id == "a" and answer.engines[0].scored


def test_expired_blocks_are_misses() -> None:
    inv = Inventory()
    add(inv, "a")
    inv.apply("a", [BlockStored(CHAIN[:6], None, 24, Tier.GPU, 0, expiry_ms=100)])
    query = ScoreQuery(model="m", block_hashes=CHAIN)
    before = score(
        inv, query, [engine("a")], now_ms=50, reuse=ON, predictor=RATE, prediction_basis=""
    )
    after = score(
        inv, query, [engine("a")], now_ms=100, reuse=ON, predictor=RATE, prediction_basis=""
    )
    assert before.engines[0].local_matched_blocks == 6
    assert after.engines[0].local_matched_blocks == 0


def a_holds_2_b_holds_10() -> Inventory:
    """Engine a holds the chain's first 2 blocks, b its first 10: a may load 8 more from b."""
    inv = Inventory()
    add(inv, "a")
    add(inv, "b")
    store(inv, "a", CHAIN[:2])
    store(inv, "b", CHAIN[:10])
    return inv


def test_the_predictor_seam_credits_loads_only_when_they_beat_the_recompute() -> None:
    inv = a_holds_2_b_holds_10()
    no_links = by_saving(run(inv, [engine("a")]))
    cheap = by_saving(run(inv, [engine("a")], predictor=NoLinks(0.5)))
    assert no_links["a"] == pytest.approx(2 * 4)  # local tokens at 1 token/ms, no load
    assert cheap["a"] == pytest.approx(2 * 4 + 8 * 4 / 2)


def test_with_the_cost_model_a_load_counts_exactly_when_a_grant_would_be_made() -> None:
    # 1000 tokens/s, 1 ms + 1 MB/s: 8 loadable blocks of 4 tokens and 1000 bytes each
    # recompute in 32 ms and load in 9 ms; the margin decides (I9-cost-gate).
    inv = a_holds_2_b_holds_10()
    a = replace(engine("a"), bytes_per_block=1000)
    for margin, credited in ((3.0, True), (4.0, False)):
        model = CostModel(
            CostConfig(
                safety_margin=margin,
                default_prefill_tokens_per_s=1000.0,
                default_bandwidth_bytes_per_s=1e6,
                default_latency_ms=1.0,
            )
        )
        assert model.predict("b", "a", Tier.GPU, 32, 8000).worth_loading is credited
        saving = by_saving(run(inv, [a], predictor=model))["a"]
        assert saving == pytest.approx(8 + (32 - 9 if credited else 0)), margin


def test_a_holder_of_unknown_block_size_is_priced_as_its_loads_showed() -> None:
    # Nothing sizes the blocks (no regions, no layout): the grant prices b's blocks by
    # what b's completed loads moved a block, and Score does the same. 1000 tokens/s,
    # 1 ms + 1 MB/s: 8 loadable blocks of 4 tokens recompute in 32 ms.
    inv = a_holds_2_b_holds_10()
    config = CostConfig(
        default_prefill_tokens_per_s=1000.0,
        default_bandwidth_bytes_per_s=1e6,
        default_latency_ms=1.0,
    )
    model = CostModel(config)
    unsized = engine("a")  # bytes_per_block 0
    before = by_saving(run(inv, [unsized], predictor=model))["a"]
    assert before == pytest.approx(8 + (32 - 1))  # the latency alone: the load pays
    model.observe_block_bytes("b", 8 * 100_000, 8)  # 100 kB a block: 800 ms more
    after = by_saving(run(inv, [unsized], predictor=model))["a"]
    assert after == pytest.approx(8)  # the local hit only: the load no longer pays
    sized = by_saving(run(inv, [replace(unsized, bytes_per_block=1000)], predictor=model))
    assert sized["a"] == pytest.approx(8 + (32 - 9))  # a declared size wins


def test_a_local_hit_is_priced_at_the_prefill_rate_in_force_at_the_call() -> None:
    # A measured rate expires after the measurement TTL (the declared one applies again):
    # Score prices at the call's time, as the grant does, not at the last rate seen.
    inv = Inventory()
    add(inv, "a")
    store(inv, "a", CHAIN[:2])  # 8 tokens
    model = CostModel(CostConfig(measurement_ttl_s=60.0), declared_prefill=lambda _r: 1000.0)
    for t in range(40):
        model.observe_prefill("a", 100_000, 1_000_000, now_ms=t)  # 100,000 tokens/s
    fresh = by_saving(run(inv, [engine("a")], predictor=model, now_ms=1_000))["a"]
    expired = by_saving(run(inv, [engine("a")], predictor=model, now_ms=60_039))["a"]
    assert fresh < 0.1 and expired == pytest.approx(8.0)  # 8 tokens at ~100,000 and 1,000/s


def test_over_a_cold_undeclared_link_only_a_probe_is_loadable_until_it_is_measured() -> None:
    # Score credits what a grant would load (I9-cost-gate): over a link neither measured
    # nor declared, a probe of probe_bytes (5 blocks of 1000 bytes past the engine's
    # own 2, which it does not move), not the holder's 8 more.
    inv = a_holds_2_b_holds_10()
    a = replace(engine("a"), bytes_per_block=1000)
    model = CostModel(CostConfig(default_prefill_tokens_per_s=1000.0, probe_bytes=5000))
    (probed,) = run(inv, [a], predictor=model).engines
    assert (probed.loadable_blocks, probed.holder_child_engine_id) == (5, "b")
    model.observe_transfer("b", "a", Tier.GPU, 5000, 1000)
    (measured,) = run(inv, [a], predictor=model).engines
    assert measured.loadable_blocks == 8
    assert measured.predicted_saving_ms > probed.predicted_saving_ms
    # Measured the other way only (a -> b), b -> a is credited in full: its reverse is its
    # prior (--cost-reverse-prior); with that off, a probe again.
    for reverse_prior, loadable in ((True, 8), (False, 5)):
        config = CostConfig(
            default_prefill_tokens_per_s=1000.0, probe_bytes=5000, reverse_prior=reverse_prior
        )
        model = CostModel(config)
        model.observe_transfer("a", "b", Tier.GPU, 5000, 1000)
        (one_way,) = run(inv, [a], predictor=model).engines
        assert one_way.loadable_blocks == loadable, reverse_prior
    # Measured slow the other way: the reverse does not forbid b -> a, it is credited a
    # probe (as the grant would make), not nothing.
    model = CostModel(CostConfig(default_prefill_tokens_per_s=1000.0, probe_bytes=5000))
    model.observe_transfer("a", "b", Tier.GPU, 5000, 10_000_000)  # 10 s for 5 blocks
    assert model.link("b", "a", Tier.GPU).prior == "reverse"
    (slow_back,) = run(inv, [a], predictor=model).engines
    assert (slow_back.loadable_blocks, slow_back.holder_child_engine_id) == (5, "b")
    assert slow_back.predicted_saving_ms > model.recompute_ms("a", 2 * 4)  # > the local hit


def test_score_reaches_as_far_as_the_grant_would_over_a_high_latency_reverse() -> None:
    # b -> a stands on a -> b: 24 ms of latency, bandwidth to spare. a holds 2 blocks and
    # would move 8 (32 ms of recompute at 1 token/ms): 24 x 1.5 = 36 > 32, so the reverse
    # does not spare the probe, of 5 blocks past a's own. A grant for a request that
    # names a's 2 blocks (local_blocks) plans exactly so, and Score reports its reach.
    inv = a_holds_2_b_holds_10()
    a = replace(engine("a"), bytes_per_block=1000)
    model = CostModel(CostConfig(default_prefill_tokens_per_s=1000.0, probe_bytes=5000))
    for _ in range(20):
        model.observe_transfer("a", "b", Tier.GPU, 1000, 24_001)
        model.observe_transfer("a", "b", Tier.GPU, 100_000, 24_100)
    grant = model.plan("b", "a", Tier.GPU, 3, 10, block_tokens=4, bytes_per_block=1000, have=2)
    assert grant.probe and grant.ceiling == 7 and grant.link.prior == "default"
    (scored,) = run(inv, [a], predictor=model).engines
    assert (scored.loadable_blocks, scored.holder_child_engine_id) == (5, "b")
    # The control: priced over the whole chain (a client that does not name its own
    # blocks), the 10 blocks' 40 ms would let the reverse's word load them whole.
    whole = model.plan("b", "a", Tier.GPU, 3, 10, block_tokens=4, bytes_per_block=1000)
    assert not whole.probe and whole.ceiling == 10


def by_saving(answer: ScoreAnswer) -> dict[str, float]:
    return {e.child_engine_id: e.predicted_saving_ms for e in answer.engines}


# --- token ids: vLLM's hashing --------------------------------------------------------

TOKENS = tuple(range(1000, 1000 + 4 * 7 + 2))  # 7 full blocks of 4, and 2 tokens over


def token_query(**kw: object) -> ScoreQuery:
    return ScoreQuery(model="m", token_ids=TOKENS, **kw)  # type: ignore[arg-type]


def score_tokens(inv: Inventory, engines: Sequence[ScoreEngine], **kw: object) -> ScoreAnswer:
    return score(
        inv, token_query(**kw), engines, now_ms=0, reuse=ON, predictor=RATE, prediction_basis=""
    )


def test_token_ids_are_hashed_with_the_engines_declared_configuration() -> None:
    config = hash_config("a", PROFILE)
    assert config == HashConfig("sha256_cbor", 4, "0")
    inv = Inventory()
    add(inv, "a")
    add(inv, "b")
    store(inv, "a", block_keys(TOKENS, config)[:5])
    salted = block_keys(TOKENS, config, cache_salt="s")
    store(inv, "b", salted[:6])
    plain = score_tokens(inv, [engine("a"), engine("b")])
    assert by_id(plain)["a"][0] == 5 and by_id(plain)["b"][0] == 0
    assert plain.engines[0].prompt_blocks == 7
    assert by_id(score_tokens(inv, [engine("a"), engine("b")], cache_salt="s"))["b"][0] == 6
    # Negative control: an engine that declares another seed hashes other blocks.
    other_seed = engine(
        "a", extra=((PROFILE_EXTRA_HASH_ALGO, "sha256_cbor"), (PROFILE_EXTRA_HASH_SEED, "1"))
    )
    assert by_id(score_tokens(inv, [other_seed]))["a"][0] == 0


def test_multimodal_items_are_hashed_into_the_blocks_they_cover() -> None:
    """An engine that cached an image prompt matches only a Score naming that image at
    that place: another image, or the same one elsewhere, changes the blocks it covers
    (and every later one); the blocks before it still match."""
    config = hash_config("a", PROFILE)
    image = (MmFeature("img-sha-1", 9, 6),)  # covers blocks 2 and 3 (block size 4)
    inv = Inventory()
    add(inv, "a")
    store(inv, "a", block_keys(TOKENS, config, mm_features=image))
    assert by_id(score_tokens(inv, [engine("a")], mm_features=image))["a"][0] == 7
    other_image = (MmFeature("img-sha-2", 9, 6),)
    assert by_id(score_tokens(inv, [engine("a")], mm_features=other_image))["a"][0] == 2
    moved = (MmFeature("img-sha-1", 10, 6),)  # same block, another offset in it
    assert by_id(score_tokens(inv, [engine("a")], mm_features=moved))["a"][0] == 2
    # Negative control: without the image the prompt is text, and matches 2 blocks.
    assert by_id(score_tokens(inv, [engine("a")]))["a"][0] == 2


def test_engines_of_other_block_sizes_are_scored_in_their_own_scope() -> None:
    # b has blocks of 8 tokens: its own compatibility hash, its own chain of the prompt.
    inv = Inventory()
    add(inv, "a")
    inv.add_engine("b", "compat-b")
    inv.set_serving("b", True)
    config_b = hash_config("b", replace(PROFILE, block_size=8))
    store(inv, "a", block_keys(TOKENS, hash_config("a", PROFILE))[:7])
    inv.apply("b", [BlockStored(tuple(block_keys(TOKENS, config_b)[:2]), None, 16)])
    b = ScoreEngine("b", replace(PROFILE, block_size=8), "compat-b", True, OFF)
    add(inv, "a2")
    counting = CountingHasher()
    answer = score(
        inv,
        token_query(),
        [engine("a"), b, engine("a2")],
        now_ms=0,
        reuse=ON,
        predictor=RATE,
        prediction_basis="",
        hasher=counting,
    )
    got = {e.child_engine_id: (e.prompt_blocks, e.local_matched_blocks) for e in answer.engines}
    assert got == {"a": (7, 7), "b": (3, 2), "a2": (7, 0)}
    # Hashed once per configuration, not once per engine.
    assert sorted(c.block_size for c, _ in counting.calls) == [4, 8]


def test_a_score_hashes_the_token_ids_under_at_most_four_configurations() -> None:
    """Each distinct configuration hashes the whole prompt (tens of ms for a long one, on
    the event loop): 64 candidates of 64 configurations cost seconds per request."""
    inv = Inventory()
    seeded = [
        engine(
            f"e{i}",
            extra=((PROFILE_EXTRA_HASH_ALGO, "sha256_cbor"), (PROFILE_EXTRA_HASH_SEED, str(i))),
        )
        for i in range(6)
    ]
    for cid in [e.child_engine_id for e in seeded] + ["same-as-e0"]:
        add(inv, cid)
    counting = CountingHasher()
    answer = score(
        inv,
        token_query(),
        [*seeded, engine("same-as-e0", extra=seeded[0].profile.extra)],  # type: ignore[union-attr]
        now_ms=0,
        reuse=ON,
        predictor=RATE,
        prediction_basis="",
        hasher=counting,
    )
    assert len(counting.calls) == MAX_SCORE_HASH_CONFIGS == 4
    scored = {e.child_engine_id: e for e in answer.engines}
    assert sorted(cid for cid, e in scored.items() if not e.scored) == ["e4", "e5"]
    assert "past the 4 distinct ones" in scored["e5"].detail
    assert scored["same-as-e0"].scored  # a configuration already hashed costs nothing more


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ((), "lacks vllm_prefix_caching_hash_algo, vllm_hash_seed"),
        (((PROFILE_EXTRA_HASH_ALGO, "sha256"),), "lacks vllm_hash_seed"),
        (
            (
                (PROFILE_EXTRA_HASH_ALGO, "xxhash"),
                (PROFILE_EXTRA_HASH_SEED, PROFILE_HASH_SEED_UNSET),
            ),
            "random bytes per process",
        ),
        (((PROFILE_EXTRA_HASH_ALGO, "md5"), (PROFILE_EXTRA_HASH_SEED, "0")), "unknown vLLM"),
    ],
)
def test_an_engine_whose_hashing_kvrc_cannot_reproduce_is_unscored_and_the_rest_scored(
    extra: tuple[tuple[str, str], ...], says: str
) -> None:
    """It made the whole token-id Score FAILED_PRECONDITION: one engine registered without
    the declaration blinded every router of its model (a review's finding). Now it alone
    is unscored, saying why; never silent misses."""
    config = hash_config("b", PROFILE)
    inv = Inventory()
    add(inv, "a")
    add(inv, "b")
    store(inv, "b", block_keys(TOKENS, config)[:4])
    answer = score_tokens(inv, [engine("a", extra=extra), engine("b"), engine("c", extra=extra)])
    found = {e.child_engine_id: e for e in answer.engines}
    unscored, scored = found["a"], found["b"]
    assert not unscored.scored and says in unscored.detail and "'a'" in unscored.detail
    assert scored.scored and scored.local_matched_blocks == 4
    # One profile, two engines: each detail names its own engine.
    assert not found["c"].scored and "'c'" in found["c"].detail and "'a'" not in found["c"].detail
    # The same engines answer block hashes.
    assert run(inv, [engine("a", extra=extra)]).engines[0].scored


def test_engines_without_a_seed_on_sha256_are_scored() -> None:
    unset = (
        (PROFILE_EXTRA_HASH_ALGO, "sha256"),
        (PROFILE_EXTRA_HASH_SEED, PROFILE_HASH_SEED_UNSET),
    )
    config = hash_config("a", replace(PROFILE, extra=unset))
    inv = Inventory()
    add(inv, "a")
    store(inv, "a", block_keys(TOKENS, config)[:3])
    assert by_id(score_tokens(inv, [engine("a", extra=unset)]))["a"][0] == 3


@pytest.mark.parametrize(
    ("query", "says"),
    [
        (ScoreQuery(model="m", token_ids=(1,) * (MAX_SCORE_TOKENS + 1)), "limit is 65536"),
        (ScoreQuery(model="m", block_hashes=chain(4097)), "limit is 4096"),
        (
            ScoreQuery(
                model="m",
                block_hashes=CHAIN,
                candidates=tuple(f"e{i}" for i in range(MAX_SCORE_CANDIDATES + 1)),
            ),
            "limit is 64",
        ),
        (ScoreQuery(model="m", block_hashes=CHAIN, candidates=("a", "a")), "'a' twice"),
        (ScoreQuery(model="m"), "exactly one of"),
        (
            ScoreQuery(model="m", block_hashes=CHAIN, mm_features=(MmFeature("i", 0, 4),)),
            "mm_features come with token_ids",
        ),
        (
            ScoreQuery(
                model="m",
                token_ids=(1,) * 8,
                mm_features=tuple(MmFeature("i", k, 1) for k in range(MAX_MM_FEATURES + 1)),
            ),
            "limit is 4096",
        ),
        (ScoreQuery(model="", block_hashes=CHAIN), "scope.model is empty"),
    ],
)
def test_bounds_are_invalid_argument_naming_the_limit(query: ScoreQuery, says: str) -> None:
    inv = Inventory()
    with pytest.raises(KvrcError) as e:
        score(inv, query, [], now_ms=0, reuse=ON, predictor=RATE, prediction_basis="")
    assert e.value.code is ErrorCode.INVALID_ARGUMENT and says in e.value.message


# --- work -------------------------------------------------------------------------------


def work_with(total_engines: int, blocks: int = 400, asked: int = 2) -> int:
    inv = Inventory()
    hashes = chain(blocks, 7)
    for i in range(total_engines):
        add(inv, f"e{i:03}")
        store(inv, f"e{i:03}", hashes[: blocks - i])
        store(inv, f"e{i:03}", hashes[:2], Tier.CPU)  # a slower copy, still GPU-fastest
    return run(inv, [engine(f"e{i:03}") for i in range(asked)], hashes).work


def test_work_is_blocks_plus_candidates_not_blocks_times_engines() -> None:
    few, many = work_with(3), work_with(60)
    # Two walks (own prefixes, then the holders' ranking) over at most 400 blocks, plus
    # the engines asked, their drop points and the holders ranked (at most
    # MAX_CANDIDATES): the 57 more holders cost a step each, not a walk each.
    assert many - few == 57
    assert many <= 2 * 400 + 16 + MAX_CANDIDATES
    # 38 more engines asked cost a few steps each, not another walk each: with loads
    # that never pay, each prices at most HOLDERS_PRICED holders.
    assert work_with(60, asked=40) - many <= (4 + HOLDERS_PRICED) * 38
    # Negative control for the counter: a longer chain costs more.
    assert work_with(3, 800) > few


def test_an_answer_over_every_engine_lists_the_best_256_and_counts_the_rest() -> None:
    """No candidates: every engine of the model is scored. 300 were listed whole (a
    small request over a large cluster asked for an answer of megabytes); now the best
    256, and how many more were scored."""
    inv = Inventory()
    ids = [f"e{i:03}" for i in range(300)]
    for cid in ids:
        add(inv, cid)
    store(inv, "e299", CHAIN[:9])  # last by id: listed only because it ranks first
    store(inv, "e150", CHAIN[:5])
    answer = run(inv, [engine(cid, OFF) for cid in ids], reuse=OFF)  # local matches rank
    assert len(answer.engines) == MAX_SCORE_ANSWER_ENGINES == 256
    assert answer.engines_left_out == 44
    assert [e.child_engine_id for e in answer.engines[:2]] == ["e299", "e150"]
    # Negative control: at the bound, every engine is listed.
    whole = run(inv, [engine(cid, OFF) for cid in ids[:256]], reuse=OFF)
    assert (len(whole.engines), whole.engines_left_out) == (256, 0)


def test_removing_the_blocks_moves_the_best_engine() -> None:
    inv = Inventory()
    add(inv, "a")
    add(inv, "b")
    store(inv, "a", CHAIN[:3])
    store(inv, "b", CHAIN[:9])
    assert run(inv, [engine("a"), engine("b")]).engines[0].child_engine_id == "b"
    inv.apply("b", [BlockRemoved(CHAIN[:9], Tier.GPU)])
    assert run(inv, [engine("a"), engine("b")]).engines[0].child_engine_id == "a"
    assert Scope(COMPAT) == Scope(COMPAT, 0)
