"""Model-based test: the inventory core against a slow, obviously-correct model.

The model is a list of facts `(child_engine_id, rank_key, group_idx, block, tier)`
plus an expiry per `(child_engine_id, rank_key, group_idx, block)`. Expired facts
are deleted the moment time passes them; lookups are answered by brute force over
every engine. Hypothesis drives random interleavings of stores, removes, clears,
time, gaps, dumps, new incarnations, departures, readiness flips, per-rank-part
engines and two scopes; every lookup answer must equal the model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from coordinator.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    InventoryEvent,
    RankKey,
    Tier,
)
from coordinator.core.inventory import (
    Candidate,
    Inventory,
    LookupAnswer,
    LookupOutcome,
    Scope,
)
from kvrc.vocabulary import PublishMode

ENGINE_IDS = ("e0", "e1", "e2", "e3", "e4")
COMPATS = ("compat-a", "compat-b")
GROUPS = (0, 1)
PARTS: tuple[RankKey, ...] = ((0, 0, 0), (1, 0, 0))
HASHES = tuple(bytes([i]) * 8 for i in range(16))
# Chains share prefixes, as prompts of one conversation or system prompt do.
BASE_CHAINS = (HASHES[0:8], HASHES[0:3] + HASHES[8:13], HASHES[13:16] + HASHES[4:8])
TIERS = (Tier.GPU, Tier.CPU, Tier.DISK, Tier.EXTERNAL)

Fact = tuple[str, RankKey | None, int, bytes, Tier]
ExpiryKey = tuple[str, RankKey | None, int, bytes]


@dataclass
class ModelEngine:
    compat: str
    mode: PublishMode
    parts: tuple[RankKey, ...]
    ready: bool = False
    stale: set[RankKey | None] = field(default_factory=set)
    dumping: set[RankKey | None] = field(default_factory=set)


class Model:
    def __init__(self, cap_total: int, cap_engine: int) -> None:
        self.cap_total = cap_total
        self.cap_engine = cap_engine
        self.engines: dict[str, ModelEngine] = {}
        self.facts: list[Fact] = []
        self.expiry: dict[ExpiryKey, int] = {}
        self.now = 1_000

    def _drop_key(self, key: ExpiryKey) -> None:
        self.facts = [f for f in self.facts if f[:4] != key]
        self.expiry.pop(key, None)

    def advance(self, dt: int) -> None:
        self.now += dt
        for key, exp in list(self.expiry.items()):
            if exp <= self.now:
                self._drop_key(key)

    def store(self, eid: str, part: RankKey | None, ev: BlockStored) -> None:
        for h in ev.block_hashes:
            key = (eid, part, ev.group_idx, h)
            fact = (*key, ev.tier)
            if fact not in self.facts:
                if sum(1 for f in self.facts if f[0] == eid) >= self.cap_engine:
                    continue
                if len(self.facts) >= self.cap_total:
                    continue
                self.facts.append(fact)
            if ev.expiry_ms:
                self.expiry[key] = ev.expiry_ms
            else:
                self.expiry.pop(key, None)

    def remove(self, eid: str, part: RankKey | None, ev: BlockRemoved) -> None:
        for h in ev.block_hashes:
            key = (eid, part, ev.group_idx, h)
            fact = (*key, ev.tier)
            if fact in self.facts:
                self.facts.remove(fact)
            if not any(f[:4] == key for f in self.facts):
                self.expiry.pop(key, None)

    def clear(self, eid: str, part: RankKey | None) -> None:
        self.facts = [f for f in self.facts if not (f[0] == eid and f[1] == part)]
        self.expiry = {k: v for k, v in self.expiry.items() if not (k[0] == eid and k[1] == part)}

    def remove_engine(self, eid: str) -> None:
        self.facts = [f for f in self.facts if f[0] != eid]
        self.expiry = {k: v for k, v in self.expiry.items() if k[0] != eid}
        del self.engines[eid]

    def holding(self, eid: str, group: int, h: bytes) -> tuple[set[Tier], int]:
        """Tiers in which the engine (every part of it) holds the block, and its expiry."""
        eng = self.engines[eid]
        keys: tuple[RankKey | None, ...] = (
            eng.parts if eng.mode is PublishMode.PER_RANK_PART else (None,)
        )
        tiers: set[Tier] | None = None
        expiry = 0
        for part in keys:
            part_tiers = {f[4] for f in self.facts if f[:4] == (eid, part, group, h)}
            tiers = part_tiers if tiers is None else tiers & part_tiers
            exp = self.expiry.get((eid, part, group, h), 0)
            if exp and (not expiry or exp < expiry):
                expiry = exp
        assert tiers is not None
        if expiry and expiry <= self.now:
            return set(), 0
        return tiers, expiry

    def visible(self, eid: str) -> bool:
        eng = self.engines[eid]
        return eng.ready and not eng.stale

    def lookup(
        self,
        scope: Scope,
        chain: tuple[bytes, ...],
        min_blocks: int,
        exclude: str | None,
        max_candidates: int,
        leases: dict[str, int],
    ) -> LookupAnswer:
        rows = []
        best = 0
        for eid, eng in self.engines.items():
            if eng.compat != scope.compatibility_hash or not self.visible(eid) or eid == exclude:
                continue
            matched = 0
            slowest = Tier.GPU
            earliest = 0
            for h in chain:
                tiers, exp = self.holding(eid, scope.group_idx, h)
                if not tiers:
                    break
                matched += 1
                slowest = max(slowest, min(tiers))
                if exp and (not earliest or exp < earliest):
                    earliest = exp
            best = max(best, matched)
            if matched >= max(1, min_blocks):
                rows.append((-matched, slowest, leases.get(eid, 0), eid, earliest))
        if best == 0:
            return LookupAnswer(LookupOutcome.MISS, (), 0)
        if best < min_blocks:
            return LookupAnswer(LookupOutcome.BELOW_MIN_BLOCKS, (), best)
        rows.sort()
        return LookupAnswer(
            LookupOutcome.HIT,
            tuple(Candidate(e, -m, t, x, n) for m, t, n, e, x in rows[:max_candidates]),
            best,
        )


hash_lists = st.lists(st.sampled_from(HASHES), min_size=1, max_size=6)


class InventoryMachine(RuleBasedStateMachine):
    cap_total = 10**9
    cap_engine = 10**9
    with_expiry = True

    @initialize()
    def setup(self) -> None:
        self.inv = Inventory(
            max_entries_total=self.cap_total, max_entries_per_engine=self.cap_engine
        )
        self.model = Model(self.cap_total, self.cap_engine)
        # Start with engines of both modes so that short programs reach lookups that hit.
        for eid, compat, per_part in (
            ("e0", COMPATS[0], False),
            ("e1", COMPATS[0], True),
            ("e2", COMPATS[0], False),
        ):
            self.add_engine(eid, compat, per_part, True)

    def _part(self, eid: str, data: st.DataObject) -> RankKey | None:
        eng = self.model.engines[eid]
        if eng.mode is PublishMode.PER_RANK_PART:
            return data.draw(st.sampled_from(eng.parts))
        return None

    def _known(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.model.engines)))

    @rule(
        eid=st.sampled_from(ENGINE_IDS),
        compat=st.sampled_from(COMPATS),
        per_part=st.booleans(),
        ready=st.sampled_from((True, True, True, False)),
    )
    def add_engine(self, eid: str, compat: str, per_part: bool, ready: bool) -> None:
        if eid in self.model.engines:
            return
        mode = PublishMode.PER_RANK_PART if per_part else PublishMode.PER_CHILD_ENGINE
        parts = PARTS if per_part else ()
        self.inv.add_engine(eid, compat, publish_mode=mode, rank_keys=parts)
        self.model.engines[eid] = ModelEngine(compat, mode, parts)
        if ready:
            self.inv.set_ready(eid, True)
            self.model.engines[eid].ready = True

    @precondition(lambda self: self.model.engines)
    @rule(data=st.data())
    def remove_engine(self, data: st.DataObject) -> None:
        eid = self._known(data)
        self.inv.remove_engine(eid)
        self.model.remove_engine(eid)

    @precondition(lambda self: self.model.engines)
    @rule(data=st.data(), ready=st.booleans())
    def set_ready(self, data: st.DataObject, ready: bool) -> None:
        eid = self._known(data)
        self.inv.set_ready(eid, ready)
        self.model.engines[eid].ready = ready

    @precondition(lambda self: self.model.engines)
    @rule(data=st.data())
    def apply_batch(self, data: st.DataObject) -> None:
        eid = self._known(data)
        part = self._part(eid, data)
        events: list[InventoryEvent] = []
        for _ in range(data.draw(st.integers(1, 4))):
            kind = data.draw(st.sampled_from(("store", "store", "store", "remove", "clear")))
            group = data.draw(st.sampled_from(GROUPS))
            tier = data.draw(st.sampled_from((Tier.GPU, *TIERS)))
            if kind == "store":
                if data.draw(st.integers(0, 3)):
                    base = data.draw(st.sampled_from(BASE_CHAINS))
                    hashes = tuple(base[: data.draw(st.integers(1, len(base)))])
                else:
                    hashes = tuple(data.draw(hash_lists))
                expiry = 0
                if self.with_expiry and data.draw(st.booleans()):
                    expiry = self.model.now + data.draw(st.integers(1, 50))
                events.append(BlockStored(hashes, None, 16 * len(hashes), tier, group, expiry))
            elif kind == "remove":
                events.append(BlockRemoved(tuple(data.draw(hash_lists)), tier, group))
            else:
                events.append(AllBlocksCleared())
        self.inv.apply(eid, events, rank_key=part, now_ms=self.model.now)
        for ev in events:
            if isinstance(ev, BlockStored):
                self.model.store(eid, part, ev)
            elif isinstance(ev, BlockRemoved):
                self.model.remove(eid, part, ev)
            else:
                self.model.clear(eid, part)

    @precondition(lambda self: self.model.engines)
    @rule(
        data=st.data(),
        base=st.sampled_from(BASE_CHAINS),
        group=st.sampled_from(GROUPS),
    )
    def store_chain_everywhere(
        self, data: st.DataObject, base: tuple[bytes, ...], group: int
    ) -> None:
        """Store chain prefixes through every stream (all rank parts) of several engines."""
        chosen = data.draw(st.sets(st.sampled_from(sorted(self.model.engines)), min_size=1))
        for eid in sorted(chosen):
            length = data.draw(st.integers(1, len(base)))
            tier = data.draw(st.sampled_from((Tier.GPU, Tier.GPU, Tier.CPU, Tier.DISK)))
            expiry = 0
            if self.with_expiry and data.draw(st.booleans()):
                expiry = self.model.now + data.draw(st.integers(1, 50))
            ev = BlockStored(base[:length], None, 16 * length, tier, group, expiry)
            eng = self.model.engines[eid]
            parts: tuple[RankKey | None, ...] = (
                eng.parts if eng.mode is PublishMode.PER_RANK_PART else (None,)
            )
            for part in parts:
                self.inv.apply(eid, [ev], rank_key=part, now_ms=self.model.now)
                self.model.store(eid, part, ev)

    @precondition(lambda self: self.model.engines)
    @rule(data=st.data(), kind=st.sampled_from(("gap", "begin_dump", "end_dump", "incarnation")))
    def stream_state(self, data: st.DataObject, kind: str) -> None:
        eid = self._known(data)
        part = self._part(eid, data)
        eng = self.model.engines[eid]
        if kind == "gap":
            self.inv.mark_stale(eid, part)
            eng.stale.add(part)
            eng.dumping.discard(part)
        elif kind == "begin_dump":
            self.inv.begin_dump(eid, part)
            self.model.clear(eid, part)
            eng.stale.add(part)
            eng.dumping.add(part)
        elif kind == "end_dump":
            self.inv.end_dump(eid, part)
            if part in eng.dumping:
                eng.dumping.discard(part)
                eng.stale.discard(part)
        else:  # a new incarnation of the stream
            self.inv.clear_stream(eid, part)
            self.model.clear(eid, part)
            eng.stale.discard(part)
            eng.dumping.discard(part)

    @precondition(lambda self: self.with_expiry)
    @rule(dt=st.integers(1, 30))
    def advance_time(self, dt: int) -> None:
        self.model.advance(dt)

    @rule(budget=st.integers(1, 8))
    def sweep(self, budget: int) -> None:
        self.inv.sweep_expired(self.model.now, budget)

    @rule(
        data=st.data(),
        min_blocks=st.integers(0, 5),
        max_candidates=st.integers(1, 5),
        random_chain=st.lists(st.sampled_from(HASHES), max_size=8),
    )
    def lookup(
        self, data: st.DataObject, min_blocks: int, max_candidates: int, random_chain: list[bytes]
    ) -> None:
        exclude = data.draw(st.sampled_from((None, *ENGINE_IDS)))
        leases = data.draw(st.dictionaries(st.sampled_from(ENGINE_IDS), st.integers(0, 3)))
        for compat in COMPATS:
            for group in GROUPS:
                scope = Scope(compat, group)
                for chain in (*BASE_CHAINS, tuple(random_chain)):
                    got = self.inv.lookup(
                        scope,
                        chain,
                        now_ms=self.model.now,
                        min_blocks=min_blocks,
                        exclude_child_engine_id=exclude,
                        max_candidates=max_candidates,
                        leases_in_flight=leases,
                    )
                    want = self.model.lookup(
                        scope, chain, min_blocks, exclude, max_candidates, leases
                    )
                    assert got == want, (scope, chain)

    @invariant()
    def engine_states_match(self) -> None:
        if not hasattr(self, "inv"):
            return
        stats = self.inv.stats()
        engines = self.model.engines.values()
        assert stats.engines_resyncing == sum(1 for e in engines if e.dumping)
        assert stats.engines_stale == sum(1 for e in engines if e.stale and not e.dumping)
        assert stats.engines_not_ready == sum(1 for e in engines if not e.stale and not e.ready)
        assert stats.engines_ready == sum(1 for e in engines if not e.stale and e.ready)
        for eid in self.model.engines:
            assert self.inv.is_visible(eid) == self.model.visible(eid)

    @invariant()
    def the_expiry_heap_counts_its_keys(self) -> None:
        if not hasattr(self, "inv"):
            return
        heap = self.inv._expiry_heap
        assert self.inv._heap_keys == sum(len(item[4]) for item in heap)
        assert self.inv._heap_keys <= 4 * self.inv._expiring_entries + 1024 + 4096

    @invariant()
    def entry_counts_match(self) -> None:
        # Expired entries are purged lazily, so counts are exact only without expiry.
        if not hasattr(self, "inv") or self.with_expiry:
            return
        stats = self.inv.stats()
        assert stats.entries_total == len(self.model.facts)
        for eid in self.model.engines:
            assert self.inv.engine_entries(eid) == sum(1 for f in self.model.facts if f[0] == eid)
        index_total = 0
        for eid in self.model.engines:
            keys = {(f[2], f[3]) for f in self.model.facts if f[0] == eid}
            index_total += sum(len(self.model.holding(eid, g, h)[0]) for g, h in keys)
        assert sum(stats.index_entries_by_tier.values()) == index_total


class CappedInventoryMachine(InventoryMachine):
    """Small caps, no expiry: dropped stores must match the model exactly."""

    cap_total = 14
    cap_engine = 6
    with_expiry = False


_SETTINGS = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestInventoryModel = InventoryMachine.TestCase
TestInventoryModel.settings = _SETTINGS
TestCappedInventoryModel = CappedInventoryMachine.TestCase
TestCappedInventoryModel.settings = _SETTINGS
