"""Score: how much of a prompt each child engine holds, for routers (docs/score.md).

Pure and synchronous (no I/O, no clock: `now_ms` is an argument). `score` is the
one core call of a `Score` RPC: it hashes token ids (through the `TokenHasher`
seam) once per distinct hash configuration, walks the inventory once per
compatibility scope for the engines' own prefixes (`Inventory.match`), asks the
same ranking a prefix load uses for the holders (`Inventory.lookup`), takes the
first one a grant would take (`may_lend`: READY, not draining; then the cost
gate), and prices each engine's match through the `SavingPredictor` seam. Work
per request is O(prompt blocks x distinct scopes + engines scored), counted in
`ScoreAnswer.work`, never O(blocks x engines).

Two seams:

- `TokenHasher`: vLLM's block hashing, `vllm_block_keys` over
  coordinator/core/vllm_hashing.py (tests plug in their own). The hash
  configuration is each engine's declared one (`hash_config`): a router cannot
  know it, and an engine that declares none is unscored, its detail saying why.
- `SavingPredictor`: the per-pair cost model (coordinator/core/cost_model.py's
  `CostModel`, the same one prefix-load grants ask), so a Score credits a load
  exactly when a grant would be made for it (I9-cost-gate) and never promises a
  saving the coordinator would not grant (I4-advisory).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from coordinator.core.cost_model import LinkEstimate, LoadPlan
from coordinator.core.errors import KvrcError, failed_precondition, invalid
from coordinator.core.inventory import MAX_CANDIDATES, Inventory, Scope
from coordinator.core.profiles import DeploymentProfile, ReuseStatus
from coordinator.core.vllm_hashing import MAX_MM_FEATURES, HashConfig, MmFeature, Seed, block_keys
from kvrc.vocabulary import (
    MAX_CHAIN_BLOCKS,
    PROFILE_EXTRA_HASH_ALGO,
    PROFILE_EXTRA_HASH_SEED,
    PROFILE_EXTRA_INT_HASHES,
    PROFILE_HASH_SEED_UNSET,
    BlockHash,
    Tier,
)

MAX_SCORE_TOKENS = 65_536  # token ids in one request (256 KiB packed)
MAX_SCORE_BLOCKS = MAX_CHAIN_BLOCKS  # block hashes in one request; token ids: scored blocks
MAX_SCORE_CANDIDATES = MAX_CANDIDATES  # candidate child engines in one request
# Hash configurations one token-id request is hashed under (tens of ms each for a long
# prompt, on the event loop): engines past the 4th distinct one are unscored, saying so.
MAX_SCORE_HASH_CONFIGS = 4
# Engines listed in one answer that named no candidates (every engine of the model):
# the best ones; the rest are counted (`engines_left_out`), so a small request over a
# large cluster cannot ask for an answer of megabytes.
MAX_SCORE_ANSWER_ENGINES = 256

_NO_LEASES: Mapping[str, int] = {}
# (holder, compatibility hash) -> may a prefix load be asked of it (Grants.may_lend).
MayLend = Callable[[str, str], bool]
# Holders priced per engine at most: a grant walks every candidate, but Score prices
# up to 64 engines, so it stops early. Past these it names no saving, which a grant
# may still make: an understatement, never a promise (I4-advisory).
HOLDERS_PRICED = 4


def _any_holder(holder_child_engine_id: str, compatibility_hash: str) -> bool:
    return True


def hash_config(child_engine_id: str, profile: DeploymentProfile) -> HashConfig:
    """The engine's declared hash configuration; FAILED_PRECONDITION, naming the engine
    and what is missing, when kvrc cannot reproduce its hashes (never silent misses)."""
    extra = dict(profile.extra)
    algo = extra.get(PROFILE_EXTRA_HASH_ALGO, "")
    raw_seed = extra.get(PROFILE_EXTRA_HASH_SEED)
    int_hashes = extra.get(PROFILE_EXTRA_INT_HASHES, "1")
    missing = [
        k
        for k, bad in (
            (PROFILE_EXTRA_HASH_ALGO, not algo),
            (PROFILE_EXTRA_HASH_SEED, raw_seed is None),
        )
        if bad
    ]
    where = f"token-id Score: child engine {child_engine_id!r}"
    if missing:
        raise failed_precondition(
            f"{where} does not declare how it hashes its blocks (its deployment profile's "
            f"extra lacks {', '.join(missing)}): send block_hashes, or have the engine "
            "declare them (docs/score.md)"
        )
    if int_hashes not in ("0", "1"):
        raise failed_precondition(
            f"{where} declares {PROFILE_EXTRA_INT_HASHES}={int_hashes!r}; expected '0' or '1'"
        )
    seed: str | Seed = Seed.UNSET if raw_seed == PROFILE_HASH_SEED_UNSET else str(raw_seed)
    try:
        return HashConfig(algo, profile.block_size, seed, int_hashes=int_hashes == "1")
    except KvrcError as e:
        # The engine's declaration is what cannot be used, not the router's request.
        raise failed_precondition(f"{where}: {e.message}") from None


class TokenHasher(Protocol):
    """Token ids -> the inventory's key form of each full block, first block first."""

    def __call__(
        self,
        token_ids: Sequence[int],
        config: HashConfig,
        *,
        lora_name: str | None,
        lora_path: str | None,
        cache_salt: str | None,
        mm_features: Sequence[MmFeature],
    ) -> Sequence[BlockHash]: ...


def vllm_block_keys(
    token_ids: Sequence[int],
    config: HashConfig,
    *,
    lora_name: str | None,
    lora_path: str | None,
    cache_salt: str | None,
    mm_features: Sequence[MmFeature],
) -> Sequence[BlockHash]:
    """vLLM 0.32.0's hashing (coordinator/core/vllm_hashing.py)."""
    return block_keys(
        token_ids,
        config,
        lora_name=lora_name,
        lora_path=lora_path,
        cache_salt=cache_salt,
        mm_features=mm_features,
    )


class Prediction(Protocol):
    """What a predictor says about moving or recomputing some tokens."""

    @property
    def load_ms(self) -> float: ...

    @property
    def recompute_ms(self) -> float: ...

    @property
    def worth_loading(self) -> bool: ...


class SavingPredictor(Protocol):
    """The cost model's seam: the predicted load and recompute time of `num_tokens`."""

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
    ) -> Prediction:
        """`link`: priced on this estimate (a `LoadPlan`'s)."""
        ...

    def block_bytes(self, holder: str, known: int, now_ms: int | None = None) -> int:
        """The holder's bytes per block: `known` when it is (> 0), else as its loads
        showed, while that is fresh at `now_ms` (0: unknown)."""
        ...

    def recompute_ms(self, requester: str, num_tokens: int, now_ms: int | None = None) -> float:
        """`predict(...).recompute_ms` alone: a local hit needs no link (and is asked per
        engine, so it stays cheap)."""
        ...

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
        """How far a load may reach (all `hinted`, or a probe's worth) and its pricing;
        the requester holds the first `have` blocks, which are not priced."""
        ...


@dataclass(frozen=True, slots=True)
class ScoreQuery:
    """One Score request, validated at the wire (and its bounds again here)."""

    model: str
    token_ids: tuple[int, ...] | None = None
    block_hashes: tuple[BlockHash, ...] | None = None
    lora_name: str = ""
    lora_path: str = ""
    cache_salt: str = ""
    group_idx: int = 0
    candidates: tuple[str, ...] = ()  # empty: every engine registered with `model`
    # The prompt's multimodal items, sorted by offset (token ids only).
    mm_features: tuple[MmFeature, ...] = ()


@dataclass(frozen=True, slots=True)
class ScoreEngine:
    """What the runtime knows of one engine to score (from the registry)."""

    child_engine_id: str
    profile: DeploymentProfile | None  # None: not registered
    compatibility_hash: str = ""
    ready: bool = False
    reuse: ReuseStatus | None = None  # may it load prefixes (the reuse gate)
    draining: bool = False  # `kvrc drain`: no new requests, loads or handoffs
    # KV bytes of one block, the same at any holder of its compatibility hash (same
    # layout); 0: unknown, sized as each holder's loads showed (`block_bytes`).
    bytes_per_block: int = 0


@dataclass(frozen=True, slots=True)
class EngineScore:
    child_engine_id: str
    scored: bool
    detail: str
    prompt_blocks: int = 0
    local_matched_blocks: int = 0
    local_by_tier: tuple[tuple[Tier, int], ...] = ()
    loadable_blocks: int = 0
    holder_child_engine_id: str = ""
    holder_tier: Tier | None = None
    predicted_saving_ms: float = 0.0
    reuse: ReuseStatus | None = None


@dataclass(frozen=True, slots=True)
class ScoreAnswer:
    engines: tuple[EngineScore, ...]  # scored first, best first (rank_key)
    reuse_enabled: bool
    reuse_detail: str
    prediction_basis: str
    work: int  # tokens hashed + blocks walked + engines + drop points (see module doc)
    engines_left_out: int = 0  # ranked past MAX_SCORE_ANSWER_ENGINES, scored or not


def check_query(query: ScoreQuery) -> None:
    """INVALID_ARGUMENT naming the limit; the wire checks the same with field names."""
    if not query.model:
        raise invalid("scope.model is empty: name the model whose engines to score")
    if (query.token_ids is None) == (query.block_hashes is None):
        raise invalid("send exactly one of token_ids and block_hashes")
    if query.token_ids is not None and len(query.token_ids) > MAX_SCORE_TOKENS:
        raise invalid(
            f"token_ids has {len(query.token_ids)} tokens; the limit is {MAX_SCORE_TOKENS}"
        )
    if query.mm_features and query.token_ids is None:
        raise invalid("mm_features come with token_ids (vLLM hashes them into those blocks)")
    if len(query.mm_features) > MAX_MM_FEATURES:
        raise invalid(
            f"mm_features has {len(query.mm_features)} items; the limit is {MAX_MM_FEATURES}"
        )
    if query.block_hashes is not None and len(query.block_hashes) > MAX_SCORE_BLOCKS:
        raise invalid(
            f"block_hashes has {len(query.block_hashes)} hashes; the limit is {MAX_SCORE_BLOCKS}"
        )
    if len(query.candidates) > MAX_SCORE_CANDIDATES:
        raise invalid(
            f"candidate_child_engine_ids has {len(query.candidates)} entries; the limit is "
            f"{MAX_SCORE_CANDIDATES}"
        )
    seen: set[str] = set()
    for c in query.candidates:
        if c in seen:
            raise invalid(f"candidate_child_engine_ids names {c!r} twice")
        seen.add(c)


def rank_key(s: EngineScore) -> tuple[bool, float, int, int, str]:
    """Scored first; then predicted saving, local blocks, loadable blocks; then id."""
    return (
        not s.scored,
        -s.predicted_saving_ms,
        -s.local_matched_blocks,
        -s.loadable_blocks,
        s.child_engine_id,
    )


def score(
    inventory: Inventory,
    query: ScoreQuery,
    engines: Sequence[ScoreEngine],
    *,
    now_ms: int,
    reuse: ReuseStatus,
    predictor: SavingPredictor,
    prediction_basis: str,
    hasher: TokenHasher = vllm_block_keys,
    leases_in_flight: Mapping[str, int] = _NO_LEASES,
    may_lend: MayLend = _any_holder,
) -> ScoreAnswer:
    """Scores `engines` for `query` (see the module doc). Raises, changing nothing:
    INVALID_ARGUMENT beyond the bounds. For token ids, an engine that has not declared
    its hashing (or one kvrc cannot reproduce) is unscored, its detail saying why
    (FAILED_PRECONDITION's text from `hash_config`). `reuse` is the coordinator's gate (switch,
    warm-up): closed, only local matches count (I1-reuse-off). `may_lend`: the
    grants' own holder check (Grants.may_lend), so Score names the holder a prefix
    load would be granted from."""
    check_query(query)
    work = len(engines)
    out: dict[str, EngineScore] = {}
    # Scorable engines grouped by what their chain depends on: compatibility (the
    # inventory scope) and, for token ids, how they hash.
    groups: dict[tuple[str, HashConfig | None], list[ScoreEngine]] = {}
    specs: dict[DeploymentProfile, HashConfig] = {}
    for e in engines:
        why = _unscorable(e, query.model)
        spec = None
        if not why and query.token_ids is not None:
            assert e.profile is not None  # engines of one profile hash alike: read it once
            spec = specs.get(e.profile)
            if spec is None:
                try:
                    spec = hash_config(e.child_engine_id, e.profile)
                except KvrcError as error:
                    # This engine alone is unscored (its detail names it); the rest are.
                    why = error.message
                else:
                    distinct = set(specs.values())
                    if spec not in distinct and len(distinct) >= MAX_SCORE_HASH_CONFIGS:
                        why = (
                            f"its hash configuration ({spec.algo}, block size "
                            f"{spec.block_size}, its seed) is past the "
                            f"{MAX_SCORE_HASH_CONFIGS} distinct ones a Score hashes the token "
                            "ids under: name fewer candidates, or send block hashes"
                        )
                        spec = None
                    else:
                        specs[e.profile] = spec
        if why:
            out[e.child_engine_id] = EngineScore(e.child_engine_id, False, why, reuse=e.reuse)
            continue
        groups.setdefault((e.compatibility_hash, spec), []).append(e)
    chains: dict[HashConfig, tuple[BlockHash, ...]] = {}
    for (compat, spec), members in groups.items():
        if spec is None:
            assert query.block_hashes is not None
            chain = query.block_hashes
        else:
            assert query.token_ids is not None
            hashed = chains.get(spec)
            if hashed is None:
                # Prompts past the chain bound are scored on their first blocks: only
                # those are hashed.
                tokens = query.token_ids[: MAX_SCORE_BLOCKS * spec.block_size]
                work += len(tokens)
                keys = hasher(
                    tokens,
                    spec,
                    lora_name=query.lora_name or None,
                    lora_path=query.lora_path or None,
                    cache_salt=query.cache_salt or None,
                    mm_features=query.mm_features,
                )
                hashed = chains[spec] = tuple(keys)
            chain = hashed
        scope = Scope(compat, query.group_idx)
        local = inventory.match(scope, chain, [e.child_engine_id for e in members], now_ms=now_ms)
        work += local.work
        holders: tuple[tuple[str, int, Tier], ...] = ()
        if reuse.enabled and any(e.reuse is not None and e.reuse.enabled for e in members):
            # In the grants' order (longest, faster tier, fewer leases, id), only those a
            # grant may ask (Grants.may_lend).
            answer = inventory.lookup(
                scope,
                chain,
                now_ms=now_ms,
                max_candidates=MAX_CANDIDATES,
                leases_in_flight=leases_in_flight,
            )
            work += len(chain) + len(answer.candidates)
            holders = tuple(
                (c.child_engine_id, c.matched_blocks, c.tier)
                for c in answer.candidates
                if may_lend(c.child_engine_id, compat)
            )
        for e in members:
            m = local.matches.get(e.child_engine_id)
            if m is None:
                out[e.child_engine_id] = EngineScore(
                    e.child_engine_id,
                    False,
                    "its inventory is stale (a full dump is awaited): its matches are unknown",
                    reuse=e.reuse,
                )
                continue
            priced, plans = _priced(
                e, len(chain), m.matched_blocks, m.by_tier, holders, predictor, now_ms
            )
            out[e.child_engine_id] = priced
            work += plans
    ranked = sorted(out.values(), key=rank_key)
    left_out = max(0, len(ranked) - MAX_SCORE_ANSWER_ENGINES)
    del ranked[MAX_SCORE_ANSWER_ENGINES:]
    return ScoreAnswer(tuple(ranked), reuse.enabled, reuse.detail, prediction_basis, work, left_out)


def _unscorable(e: ScoreEngine, model: str) -> str:
    if e.profile is None:
        return "not a registered child engine"
    if e.profile.model != model:
        return f"serves model {e.profile.model!r}, not {model!r}"
    if not e.ready:
        return "not READY (a rank part of its grid is missing)"
    if e.draining:
        return "draining (kvrc drain): no new requests or prefix loads"
    return ""


def _priced(
    e: ScoreEngine,
    prompt_blocks: int,
    matched: int,
    by_tier: tuple[tuple[Tier, int], ...],
    holders: tuple[tuple[str, int, Tier], ...],
    predictor: SavingPredictor,
    now_ms: int,
) -> tuple[EngineScore, int]:
    """The engine's score, and how many holders were priced for it (work)."""
    assert e.profile is not None
    block_size = e.profile.block_size
    me = e.child_engine_id
    saving = 0.0
    if matched:
        # A local hit is prefill not run: its whole recompute time is saved.
        saving += predictor.recompute_ms(me, matched * block_size, now_ms)
    loadable = plans = 0
    holder = ""
    holder_tier: Tier | None = None
    if e.reuse is not None and e.reuse.enabled:
        # The holder a grant would take: the first, in the lookup's order, with more
        # than the engine's own match whose load the cost gate grants (I9-cost-gate);
        # when none pays, the first such holder, named with no saving. A link without a
        # fresh fit or a declaration is planned as a probe unless a stand-in says the
        # load pays: the grant's plan for a load asked for as an engine asks (at least
        # one block past its own, which it names as `local_blocks` and does not move).
        for cid, blocks, tier in holders:
            if cid == me:
                continue
            if blocks <= matched or plans == HOLDERS_PRICED:
                break  # longest first: only a longer prefix than its own is loadable
            plans += 1
            per_block = predictor.block_bytes(cid, e.bytes_per_block, now_ms)  # as a grant does
            plan = predictor.plan(
                cid,
                me,
                tier,
                matched + 1,
                blocks,
                block_tokens=block_size,
                bytes_per_block=per_block,
                have=matched,
                now_ms=now_ms,
            )
            moved = plan.ceiling - matched
            p = predictor.predict(
                cid,
                me,
                tier,
                moved * block_size,
                moved * per_block,
                now_ms,
                link=plan.link,
            )
            if not holder or p.worth_loading:
                holder, loadable, holder_tier = cid, moved, tier
            if p.worth_loading:
                # Credited exactly when a grant would be made for it (load x margin <
                # recompute); it then saves what it beats the recompute by.
                saving += p.recompute_ms - p.load_ms
                break
    priced = EngineScore(
        me,
        True,
        "",
        prompt_blocks=prompt_blocks,
        local_matched_blocks=matched,
        local_by_tier=by_tier,
        loadable_blocks=loadable,
        holder_child_engine_id=holder,
        holder_tier=holder_tier,
        predicted_saving_ms=saving,
        reuse=e.reuse,
    )
    return priced, plans


__all__ = [
    "HOLDERS_PRICED",
    "MAX_SCORE_BLOCKS",
    "MAX_SCORE_CANDIDATES",
    "MAX_SCORE_HASH_CONFIGS",
    "MAX_SCORE_TOKENS",
    "EngineScore",
    "MayLend",
    "Prediction",
    "SavingPredictor",
    "ScoreAnswer",
    "ScoreEngine",
    "ScoreQuery",
    "TokenHasher",
    "check_query",
    "hash_config",
    "score",
    "vllm_block_keys",
]
