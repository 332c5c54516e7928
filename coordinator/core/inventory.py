"""Advisory inventory: who retains which KV blocks, and longest-prefix lookup.

Pure and synchronous (no I/O, no asyncio, no protobuf); time is an argument.

Vocabulary
----------
- A *scope* is `(compatibility_hash, group_idx)`. Blocks of one scope are never
  returned to a query of another.
- An *entry* (membership) is `(scope, block hash, child engine, tier)`. An engine
  may hold the same block in several tiers; each is one entry.
- Expiry belongs to `(scope, block, child engine)`: every BlockStored sets it
  (0 clears it). An entry with `0 < expiry_ms <= now_ms` is a miss, and is
  treated as absent by every later event (a re-store starts from nothing).

Layout (why it is compact)
--------------------------
Each compatibility hash gives its child engines small integer *slots*; an engine
is the bit `1 << slot`. Per scope and tier one `dict[int, int]` maps a block key
to the bitmask of slots that hold it, so a lookup walks the chain with one
`dict.get` and one `&` per block; one more dict marks blocks held below GPU by
someone, so tiers cost nothing to scopes that only use GPU. A block held by one
engine stores that engine's shared bit object (no new int). The block key is
`hash(block_hash) & _KEY_MASK`: Python's per-process keyed SipHash cut to its low 60
bits, a 32-byte int instead of a 72-byte `bytes` (a mask, not a shift: CPython
allocates a shifted int at its operand's 3 digits, 48 bytes in pymalloc); two
different hashes share a key with probability ~2**-60, and since the inventory is
advisory (I4-advisory) such a false match costs a shorter pin at worst, never wrong
data. The reverse index of a child engine is a plain list of the keys it added per
scope (8 bytes an entry); removals leave the key in place and the list is compacted
when more than half of it is dead, so `remove_engine` is O(that engine's entries),
never O(all blocks). Expiries live in side tables that exist only for entries that
have one. A lookup's Candidates are values handed out again, not built per answer
(see `Inventory.lookup`).

Publish modes
-------------
- `PER_CHILD_ENGINE`: one stream per child engine; events go straight to the
  index (`rank_key=None`).
- `PER_RANK_PART`: one stream per rank part. Each part keeps its own facts; a
  `(block, tier)` is in the engine's index only while *every* part holds it, with
  the earliest of the parts' expiries. Part facts cost more memory than the fast
  per-child path (a tuple-keyed dict entry each); they count against the same
  caps. A part's expired fact is purged with the engine's entry, or when that
  part touches the block again; until then it counts against the cap.

Readiness and staleness
-----------------------
Events for a child engine that is not READY are *held*: stored, counted and
bounded like any other, but never returned by a lookup until `set_ready(True)`.
A stream marked stale (gap, see `event_streams.py`) hides the whole child engine
until that stream's full dump ends. A full dump drops the stream's state at
`begin_dump` and keeps the engine hidden until `end_dump`, so from a lookup's
point of view the swap is atomic. `clear_stream` (a new incarnation) drops the
stream's state and its staleness.

Bounds
------
`max_entries_per_engine` and `max_entries_total` cap the entries (for a
per-rank-part engine: the sum of its parts' facts). When a BlockStored would add
an entry past a cap, that entry is *dropped* and counted in `ApplyResult`
(`dropped_engine_cap`, `dropped_total_cap`); the rest of the batch (removals,
clears, re-stores, later stores that fit after removals) still applies. Only ever
forgetting a store keeps the inventory truthful (a forgotten block is a miss,
i.e. a recompute, never a wrong hint), needs no resync that would hit the same
cap again, and bounds memory. Sizes of batches and chains are checked at the
wire, with the limits below; the core rejects longer chains itself.

Expiry purging
--------------
Expired entries are purged when a lookup or an event touches them, and by
`sweep_expired(now_ms, budget)`, which the facade calls periodically: a heap of
(expiry, block) visits at most `budget` items per call, so expired entries
cannot pile up; the heap is rebuilt when stale items outnumber live expiries
4 to 1. Its top also tells a lookup when nothing can have expired yet, which
spares the per-engine expiry checks.

Cost: `apply` O(block hashes in the batch); `lookup` O(chain length + holders
of the best matches); `match` O(chain length + engines named + their entries
below GPU on the chain); `remove_engine`/`clear_stream` O(that engine's entries);
`stats` O(1).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from coordinator.core.errors import already_exists, invalid, not_found
from coordinator.core.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    InventoryEvent,
    RankKey,
    Tier,
)
from kvrc.vocabulary import MAX_CHAIN_BLOCKS, MAX_GROUP_IDX, PublishMode

# Wire-level limits (kvrc/vocabulary.py) are checked by coordinator/edges/grpc_wire.py;
# the core checks chains.
MAX_QUERIES_PER_LOOKUP = 64
MAX_CANDIDATES = 64
DEFAULT_MAX_CANDIDATES = 4

DEFAULT_MAX_ENTRIES_TOTAL = 50_000_000
DEFAULT_MAX_ENTRIES_PER_ENGINE = 5_000_000

_TIERS: tuple[Tier, ...] = (Tier.GPU, Tier.CPU, Tier.DISK, Tier.EXTERNAL)
_SLOWER_TIERS: tuple[Tier, ...] = (Tier.CPU, Tier.DISK, Tier.EXTERNAL)
_ANY_SLOWER = 0  # by_tier[0]: block key -> bits holding it in some tier slower than GPU

# Index key of a block hash: Python's keyed SipHash of the bytes, cut to 60 bits so
# the int takes 32 bytes instead of the 72 of a 32-byte `bytes`. Two distinct hashes
# share a key with probability ~2**-60; the inventory is advisory (I4-advisory), so
# such a false match costs at worst a shorter pin, never wrong data. Inlined as
# `hash(h) & 0xFFFFFFFFFFFFFFF` in hot loops (a constant, no global). A mask, not `>>
# 4`: CPython allocates the result of a right shift with its operand's digit count (3
# for a 64-bit hash: 36 bytes, the 48-byte pymalloc class) while `&` with a 2-digit
# positive mask allocates exactly 2 digits (32 bytes): 16 bytes less per indexed
# block.
_Key = int
_KEY_MASK = (1 << 60) - 1


def _key(block_hash: BlockHash) -> _Key:
    return hash(block_hash) & _KEY_MASK


_NO_LEASES: Mapping[str, int] = MappingProxyType({})
_CANDIDATE_CACHE = 4096  # Candidate values kept for reuse, per inventory
_ENGINE_CANDIDATES = 256  # per engine: its GPU, no-expiry, no-lease Candidate by matched
_GROUP_CACHE = 1024  # per compatibility: tied groups' Candidates (_CompatSlots.groups)


def _first_in_id_order(
    by_id: list[_Engine], bits: int, count: int, held: int
) -> list[_Engine | None]:
    """The first `count` of the `held` engines of `bits`, in id order."""
    if count >= held:
        return [e for e in by_id if e.bit & bits]  # all of them: no early stop to make
    members: list[_Engine | None] = []
    for eng in by_id:
        if eng.bit & bits:
            members.append(eng)
            if len(members) == count:
                break
    return members


def _engine_id(engine: _Engine | None) -> str:
    assert engine is not None
    return engine.child_engine_id


_TIER_OF: dict[int, Tier] = {int(t): t for t in Tier}


class LookupOutcome(enum.Enum):
    HIT = "hit"
    MISS = "miss"  # no eligible engine holds the first block
    BELOW_MIN_BLOCKS = "below_min_blocks"  # best match shorter than min_blocks


@dataclass(frozen=True, slots=True)
class Scope:
    compatibility_hash: str
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class Candidate:
    child_engine_id: str
    matched_blocks: int  # contiguous from the start of the chain
    tier: Tier  # slowest tier among the matched blocks
    expiry_ms: int  # earliest expiry among the matched blocks; 0 = none
    leases_in_flight: int


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    outcome: LookupOutcome
    candidates: tuple[Candidate, ...]
    best_matched_blocks: int  # also set for BELOW_MIN_BLOCKS (no candidates then)


@dataclass(frozen=True, slots=True)
class LocalMatch:
    """One engine's own prefix of a chain (Inventory.match)."""

    child_engine_id: str
    matched_blocks: int  # contiguous from the start of the chain
    # (tier, blocks): each matched block under the fastest tier the engine holds it
    # in, GPU first, tiers with no block left out; the counts add up to matched_blocks.
    by_tier: tuple[tuple[Tier, int], ...]


@dataclass(frozen=True, slots=True)
class MatchAnswer:
    matches: Mapping[str, LocalMatch]  # the named engines that could be matched
    work: int  # blocks walked + engines named + drop points + below-GPU (engine, block) pairs


@dataclass(frozen=True, slots=True)
class ApplyResult:
    blocks_stored: int  # block hashes in BlockStored events
    blocks_removed: int  # block hashes in BlockRemoved events
    clears: int  # AllBlocksCleared events
    entries_added: int
    entries_removed: int
    dropped_engine_cap: int  # stores refused by max_entries_per_engine
    dropped_total_cap: int  # stores refused by max_entries_total


@dataclass(frozen=True, slots=True)
class InventoryStats:
    entries_total: int  # entries counted against the caps
    index_entries_by_tier: Mapping[Tier, int]  # (block, engine, tier) in the lookup index
    engines_ready: int  # READY and fresh: returned by lookups
    engines_not_ready: int
    engines_stale: int  # a stream lost events, no dump running
    engines_resyncing: int  # a full dump is running


@dataclass(frozen=True, slots=True)
class EngineImage:
    """One child engine's whole inventory state, as plain data (a replica's snapshot).

    Block keys are this process's 60-bit keys (`_key`), so an image is meaningful
    only to a process whose `key_probe()` is the same (the same PYTHONHASHSEED and
    Python build); the snapshot codec checks that. Expiries are absolute ms on the
    clock of the process that took the image.
    """

    child_engine_id: str
    compatibility_hash: str
    publish_mode: PublishMode
    rank_keys: tuple[RankKey, ...]
    ready: bool
    serving: bool
    stale: tuple[RankKey | None, ...]
    dumping: tuple[RankKey | None, ...]
    # (group_idx, tier, keys): the lookup index, tier by tier
    index: tuple[tuple[int, int, tuple[int, ...]], ...]
    # (group_idx, keys, expiries)
    expiry: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]
    # (rank key, group_idx, keys, tier bitmasks, expiries or 0): per-rank-part facts
    parts: tuple[tuple[RankKey, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]

    @property
    def memberships(self) -> int:
        return sum(len(keys) for _, _, keys in self.index)


def key_probe() -> int:
    """This process's key of a fixed hash: equal probes mean equal block keys."""
    return _key(b"kvrc-inventory-key-probe")


class _EngineState(enum.Enum):
    READY = 0
    NOT_READY = 1
    STALE = 2
    RESYNCING = 3


class _ScopeIndex:
    """Block hash -> slot bitmask, one dict per tier (index 0 unused)."""

    __slots__ = ("by_tier", "expiring", "group_idx")

    def __init__(self, group_idx: int) -> None:
        self.group_idx = group_idx
        self.by_tier: list[dict[_Key, int]] = [{} for _ in range(5)]
        # block -> bits of the slots that have an expiry on it
        self.expiring: dict[_Key, int] = {}


class _CompatSlots:
    __slots__ = ("by_id", "engines", "free_slots", "groups", "scopes", "serving", "visible")

    def __init__(self) -> None:
        self.engines: list[_Engine | None] = []
        self.by_id: list[_Engine] = []  # sorted by child_engine_id: ranks ties cheaply
        self.free_slots: list[int] = []
        self.visible = 0  # bits of READY, fresh engines
        self.serving = 0  # bits of serving, fresh engines: their own matches count (Score)
        self.scopes: dict[int, _ScopeIndex] = {}
        # (matched, bits, count) -> the Candidates of the first `count` engines of `bits`
        # in id order: a tie's answer, built once while the engines stay the same
        # (cleared whenever `by_id` changes, and when full).
        self.groups: dict[tuple[int, int, int], tuple[Candidate, ...]] = {}


class _EngineScope:
    """One child engine's view of one scope: reverse index and expiries."""

    __slots__ = ("expiry", "keys", "live")

    def __init__(self) -> None:
        self.keys: list[_Key] = []  # may hold dead keys and repeats
        self.live = 0  # entries of this engine in this scope
        self.expiry: dict[_Key, int] = {}


class _Part:
    """Facts of one rank part (per-rank-part mode)."""

    __slots__ = ("entries", "expiry", "tiers")

    def __init__(self) -> None:
        # (group_idx, block) -> bitmask of tiers (1 << tier)
        self.tiers: dict[tuple[int, _Key], int] = {}
        self.expiry: dict[tuple[int, _Key], int] = {}
        self.entries = 0


class _Engine:
    __slots__ = (
        "bit",
        "candidates",
        "child_engine_id",
        "compat",
        "compatibility_hash",
        "dumping",
        "entries",
        "index_entries",
        "mode",
        "parts",
        "ready",
        "removed",
        "scopes",
        "serving",
        "slot",
        "stale",
        "state",
    )

    def __init__(
        self,
        child_engine_id: str,
        compatibility_hash: str,
        compat: _CompatSlots,
        slot: int,
        mode: PublishMode,
        rank_keys: Sequence[RankKey],
    ) -> None:
        self.child_engine_id = child_engine_id
        self.compatibility_hash = compatibility_hash
        self.compat = compat
        self.slot = slot
        self.bit = 1 << slot
        self.mode = mode
        self.parts: dict[RankKey, _Part] = {k: _Part() for k in rank_keys}
        self.scopes: dict[int, _EngineScope] = {}
        self.ready = False
        self.serving = False  # READY in the registry, whatever its reuse gate says
        self.stale: set[RankKey | None] = set()  # streams awaiting (or running) a dump
        self.dumping: set[RankKey | None] = set()
        self.entries = 0  # counted against the caps
        self.index_entries = 0  # entries in the lookup index
        self.removed = False
        self.state = _EngineState.NOT_READY
        # matched blocks -> this engine's Candidate on GPU, no expiry, no leases
        self.candidates: dict[int, Candidate] = {}


class Inventory:
    """The advisory inventory of one coordinator. Not thread-safe (one event loop)."""

    def __init__(
        self,
        *,
        max_entries_total: int = DEFAULT_MAX_ENTRIES_TOTAL,
        max_entries_per_engine: int = DEFAULT_MAX_ENTRIES_PER_ENGINE,
    ) -> None:
        if max_entries_total < 0 or max_entries_per_engine < 0:
            raise invalid("inventory caps must be >= 0")
        self.max_entries_total = max_entries_total
        self.max_entries_per_engine = max_entries_per_engine
        self._engines: dict[str, _Engine] = {}
        self._compat: dict[str, _CompatSlots] = {}
        self._entries_total = 0
        self._index_by_tier = [0, 0, 0, 0, 0]
        self._state_counts = dict.fromkeys(_EngineState, 0)
        # (expiry_ms, tie-breaker, engine, group_idx, (block key,)): one item per expiry set
        self._expiry_heap: list[tuple[int, int, _Engine, int, tuple[_Key, ...]]] = []
        self._expiring_entries = 0  # (block, engine) pairs with an expiry, all engines
        # Keys the heap's items hold, stale ones included: an item holds one event's keys
        # (up to 4,096), so the heap's bound counts keys, not items (I8-bad-input).
        self._heap_keys = 0
        self._heap_seq = itertools.count()
        # (id, -matched, tier, expiry, leases) -> the Candidate: bounded, cleared when full
        self._candidates: dict[tuple[str, int, int, int, int], Candidate] = {}

    # ------------------------------------------------------------------ engines

    def add_engine(
        self,
        child_engine_id: str,
        compatibility_hash: str,
        *,
        publish_mode: PublishMode = PublishMode.PER_CHILD_ENGINE,
        rank_keys: Sequence[RankKey] = (),
    ) -> None:
        """Add a child engine (not READY). Per-rank-part mode needs its rank keys."""
        self._add_engine(child_engine_id, compatibility_hash, publish_mode, rank_keys)

    def _add_engine(
        self,
        child_engine_id: str,
        compatibility_hash: str,
        publish_mode: PublishMode,
        rank_keys: Sequence[RankKey],
    ) -> None:
        # Not overridable: a subclass that records add_engine (replication) restores
        # an image without recording it.
        if not child_engine_id:
            raise invalid("child_engine_id must not be empty")
        if child_engine_id in self._engines:
            raise already_exists(f"child engine {child_engine_id!r} is already in the inventory")
        if publish_mode is PublishMode.PER_RANK_PART:
            if not rank_keys:
                raise invalid("per-rank-part publishing needs at least one rank key")
            if len(set(rank_keys)) != len(rank_keys):
                raise invalid(f"duplicate rank keys for {child_engine_id!r}: {list(rank_keys)}")
        elif rank_keys:
            raise invalid("rank keys are only for per-rank-part publishing")
        compat = self._compat.get(compatibility_hash)
        if compat is None:
            compat = self._compat[compatibility_hash] = _CompatSlots()
        if compat.free_slots:
            slot = heapq.heappop(compat.free_slots)  # lowest first keeps masks small
        else:
            slot = len(compat.engines)
            compat.engines.append(None)
        engine = _Engine(child_engine_id, compatibility_hash, compat, slot, publish_mode, rank_keys)
        compat.engines[slot] = engine
        compat.by_id.append(engine)
        compat.by_id.sort(key=lambda e: e.child_engine_id)
        compat.groups.clear()
        self._engines[child_engine_id] = engine
        self._state_counts[_EngineState.NOT_READY] += 1

    def has_engine(self, child_engine_id: str) -> bool:
        return child_engine_id in self._engines

    def remove_engine(self, child_engine_id: str) -> int:
        """Drop a child engine and its entries in O(its entries). Returns entries dropped."""
        engine = self._engine(child_engine_id)
        dropped = engine.entries
        self._clear_index(engine)
        for part in engine.parts.values():
            self._reset_part(engine, part)
        engine.parts.clear()
        engine.removed = True
        compat = engine.compat
        compat.visible &= ~engine.bit
        compat.serving &= ~engine.bit
        compat.engines[engine.slot] = None
        compat.by_id.remove(engine)
        compat.groups.clear()
        heapq.heappush(compat.free_slots, engine.slot)
        self._state_counts[engine.state] -= 1
        del self._engines[child_engine_id]
        if not any(compat.engines):
            # Last engine of this compatibility hash: its scopes are empty now.
            del self._compat[engine.compatibility_hash]
        return dropped

    def set_ready(self, child_engine_id: str, ready: bool) -> None:
        engine = self._engine(child_engine_id)
        engine.ready = ready
        self._refresh_state(engine)

    def set_serving(self, child_engine_id: str, serving: bool) -> None:
        """The engine serves requests (READY in the registry), whether or not it may lend
        or load KV: a router's Score counts its own matches while its inventory is fresh."""
        engine = self._engine(child_engine_id)
        engine.serving = serving
        self._refresh_state(engine)

    def mark_stale(self, child_engine_id: str, rank_key: RankKey | None = None) -> None:
        """A stream lost events: hide the engine until that stream's dump ends."""
        engine = self._stream_engine(child_engine_id, rank_key)
        engine.stale.add(rank_key)
        engine.dumping.discard(rank_key)
        self._refresh_state(engine)

    def begin_dump(self, child_engine_id: str, rank_key: RankKey | None = None) -> None:
        """A full dump starts: drop the stream's state; the engine stays hidden."""
        engine = self._stream_engine(child_engine_id, rank_key)
        self._clear_stream(engine, rank_key)
        engine.stale.add(rank_key)
        engine.dumping.add(rank_key)
        self._refresh_state(engine)

    def end_dump(self, child_engine_id: str, rank_key: RankKey | None = None) -> None:
        """The dump is complete: the stream is fresh again."""
        engine = self._stream_engine(child_engine_id, rank_key)
        if rank_key in engine.dumping:
            engine.dumping.discard(rank_key)
            engine.stale.discard(rank_key)
            self._refresh_state(engine)

    def clear_stream(self, child_engine_id: str, rank_key: RankKey | None = None) -> int:
        """A new incarnation of the stream: drop its state and its staleness."""
        engine = self._stream_engine(child_engine_id, rank_key)
        before = engine.entries
        self._clear_stream(engine, rank_key)
        engine.stale.discard(rank_key)
        engine.dumping.discard(rank_key)
        self._refresh_state(engine)
        return before - engine.entries

    def is_visible(self, child_engine_id: str) -> bool:
        """READY and fresh: lookups may return it."""
        return self._engine(child_engine_id).state is _EngineState.READY

    def is_stale(self, child_engine_id: str) -> bool:
        return bool(self._engine(child_engine_id).stale)

    def engine_entries(self, child_engine_id: str) -> int:
        return self._engine(child_engine_id).entries

    def stats(self) -> InventoryStats:
        """O(1): counters kept on every change."""
        c = self._state_counts
        return InventoryStats(
            entries_total=self._entries_total,
            index_entries_by_tier=MappingProxyType({t: self._index_by_tier[t] for t in _TIERS}),
            engines_ready=c[_EngineState.READY],
            engines_not_ready=c[_EngineState.NOT_READY],
            engines_stale=c[_EngineState.STALE],
            engines_resyncing=c[_EngineState.RESYNCING],
        )

    def engine_ids(self) -> list[str]:
        return list(self._engines)

    def export_engine(self, child_engine_id: str, now_ms: int) -> EngineImage:
        """The engine's state as an `EngineImage`; expired entries are left out."""
        engine = self._engine(child_engine_id)
        index: list[tuple[int, int, tuple[int, ...]]] = []
        expiry: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        bit = engine.bit
        for group_idx, es in engine.scopes.items():
            scope = engine.compat.scopes[group_idx]
            live = [k for k in dict.fromkeys(es.keys) if not 0 < es.expiry.get(k, 0) <= now_ms]
            for t in _TIERS:
                d = scope.by_tier[t]
                if d:
                    keys = tuple(k for k in live if d.get(k, 0) & bit)
                    if keys:
                        index.append((group_idx, int(t), keys))
            exp = [(k, e) for k, e in es.expiry.items() if e > now_ms]
            if exp:
                expiry.append((group_idx, tuple(k for k, _ in exp), tuple(e for _, e in exp)))
        parts: list[tuple[RankKey, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []
        for rank_key, part in engine.parts.items():
            by_group: dict[int, list[tuple[int, int, int]]] = {}
            for (group_idx, k), tiers in part.tiers.items():
                e = part.expiry.get((group_idx, k), 0)
                if not 0 < e <= now_ms:
                    by_group.setdefault(group_idx, []).append((k, tiers, e))
            for group_idx, facts in by_group.items():
                parts.append(
                    (
                        rank_key,
                        group_idx,
                        tuple(f[0] for f in facts),
                        tuple(f[1] for f in facts),
                        tuple(f[2] for f in facts),
                    )
                )
        return EngineImage(
            engine.child_engine_id,
            engine.compatibility_hash,
            engine.mode,
            tuple(engine.parts),
            engine.ready,
            engine.serving,
            tuple(engine.stale),
            tuple(engine.dumping),
            tuple(index),
            tuple(expiry),
            tuple(parts),
        )

    def restore_engine(self, image: EngineImage) -> int:
        """Adds the engine of `image` with its state; returns entries dropped by the caps.

        The inverse of `export_engine` in a process with the same `key_probe()`.
        Raises INVALID_ARGUMENT, changing nothing, for an image naming an unknown tier
        or rank key.
        """
        for _, tier, _ in image.index:
            if tier not in _TIER_OF or tier not in _TIERS:
                raise invalid(f"tier {tier} is not a known tier")
        for rank_key, *_ in image.parts:
            if rank_key not in image.rank_keys:
                raise invalid(f"rank key {rank_key} is not one of the image's rank keys")
        self._add_engine(
            image.child_engine_id, image.compatibility_hash, image.publish_mode, image.rank_keys
        )
        engine = self._engines[image.child_engine_id]
        per_child = engine.mode is PublishMode.PER_CHILD_ENGINE
        acc = _Acc()
        for rank_key, group_idx, keys, tier_masks, expiries in image.parts:
            part = engine.parts[rank_key]
            for k, tiers, e in zip(keys, tier_masks, expiries, strict=True):
                n = tiers.bit_count()
                if engine.entries + n > self.max_entries_per_engine:
                    acc.dropped_engine += n
                    continue
                if self._entries_total + n > self.max_entries_total:
                    acc.dropped_total += n
                    continue
                part.tiers[(group_idx, k)] = tiers
                if e:
                    part.expiry[(group_idx, k)] = e
                part.entries += n
                engine.entries += n
                self._entries_total += n
        for group_idx, tier, keys in image.index:
            index, es = self._scope_pair(engine, group_idx)
            for k in keys:
                if index.by_tier[tier].get(k, 0) & engine.bit:
                    continue
                if per_child:
                    if not self._room(engine, acc):
                        continue
                    engine.entries += 1
                    self._entries_total += 1
                self._add_index_entry(engine, index, es, k, tier)
        for group_idx, keys, expiries in image.expiry:
            scope = engine.compat.scopes.get(group_idx)
            own = engine.scopes.get(group_idx)
            if scope is None or own is None:
                continue
            for k, e in zip(keys, expiries, strict=True):
                # Only an entry in the index has an expiry (as after events).
                if e > 0 and any(scope.by_tier[t].get(k, 0) & engine.bit for t in _TIERS):
                    self._set_expiry(engine, scope, own, k, e)
        engine.ready = image.ready
        engine.serving = image.serving
        engine.stale = set(image.stale)
        engine.dumping = set(image.dumping)
        self._refresh_state(engine)
        return acc.dropped_engine + acc.dropped_total

    # ------------------------------------------------------------------ events

    def apply(
        self,
        child_engine_id: str,
        events: Sequence[InventoryEvent],
        *,
        rank_key: RankKey | None = None,
        now_ms: int = 0,
    ) -> ApplyResult:
        """Apply one ordered batch of a stream (ordering is event_streams' job).

        Raises INVALID_ARGUMENT, changing nothing, for an unknown rank key or a
        malformed event; stores past a cap are dropped and counted (see module doc).
        """
        engine = self._stream_engine(child_engine_id, rank_key)
        for ev in events:
            if isinstance(ev, (BlockStored, BlockRemoved)):
                if not 0 <= ev.group_idx <= MAX_GROUP_IDX:
                    raise invalid(f"group_idx {ev.group_idx} is outside 0..{MAX_GROUP_IDX}")
                if ev.tier not in _TIERS:
                    raise invalid(f"tier {ev.tier!r} is not a known tier")
                if isinstance(ev, BlockStored) and ev.expiry_ms < 0:
                    raise invalid(f"expiry_ms {ev.expiry_ms} is negative")
            elif not isinstance(ev, AllBlocksCleared):
                raise invalid(f"unknown inventory event {type(ev).__name__}")
        acc = _Acc()
        if rank_key is None:
            for ev in events:
                if isinstance(ev, BlockStored):
                    self._store(engine, ev, now_ms, acc)
                elif isinstance(ev, BlockRemoved):
                    self._remove(engine, ev, now_ms, acc)
                else:
                    acc.clears += 1
                    acc.removed += self._clear_index(engine)
            for group_idx, es in engine.scopes.items():
                if len(es.keys) > 2 * es.live + 64:
                    self._compact(engine, group_idx, es)
        else:
            part = engine.parts[rank_key]
            for ev in events:
                self._part_event(engine, part, ev, now_ms, acc)
        return ApplyResult(
            blocks_stored=acc.stored,
            blocks_removed=acc.removed_hashes,
            clears=acc.clears,
            entries_added=acc.added,
            entries_removed=acc.removed,
            dropped_engine_cap=acc.dropped_engine,
            dropped_total_cap=acc.dropped_total,
        )

    # ------------------------------------------------------------------ lookup

    def lookup(
        self,
        scope: Scope,
        chain: Sequence[BlockHash],
        *,
        now_ms: int,
        min_blocks: int = 1,
        exclude_child_engine_id: str | None = None,
        max_candidates: int = DEFAULT_MAX_CANDIDATES,
        leases_in_flight: Mapping[str, int] = _NO_LEASES,
    ) -> LookupAnswer:
        """Ranked holders of the longest prefixes of `chain` in `scope`.

        Ranking: more matched blocks, then faster tier, then fewer leases in
        flight, then child_engine_id. A miss is an answer, never an error.
        Expired entries met on the way are purged.
        """
        if len(chain) > MAX_CHAIN_BLOCKS:
            raise invalid(f"chain has {len(chain)} blocks; at most {MAX_CHAIN_BLOCKS}")
        if min_blocks < 0:
            raise invalid(f"min_blocks {min_blocks} is negative")
        if not 1 <= max_candidates <= MAX_CANDIDATES:
            raise invalid(f"max_candidates {max_candidates} is outside 1..{MAX_CANDIDATES}")
        compat = self._compat.get(scope.compatibility_hash)
        if compat is None or not chain:
            return _MISS
        index = compat.scopes.get(scope.group_idx)
        if index is None:
            return _MISS
        cur = compat.visible
        if exclude_child_engine_id is not None:
            excluded = self._engines.get(exclude_child_engine_id)
            if excluded is not None and excluded.compat is compat:
                cur &= ~excluded.bit
        if not cur:
            return _MISS
        dropped, worst, exp_hits, _ = self._walk(compat, index, cur, chain, now_ms)
        if not dropped:
            return _MISS
        best = dropped[-1][0]
        if best < min_blocks:
            return LookupAnswer(LookupOutcome.BELOW_MIN_BLOCKS, (), best)
        floor = max(min_blocks, 1)
        engines = compat.engines
        by_id = compat.by_id
        rows: list[tuple[int, int, int, str, int]] = []
        # Without tiers or leases to reorder them, rows built group by group (longest
        # first) from members in id order are already ranked: no sort.
        simple = not worst and not leases_in_flight
        if simple and not exp_hits:
            return self._simple_answer(compat, dropped, floor, max_candidates, best)
        ranked = simple
        # Longest matches first; a shorter group can only matter while rows are missing.
        for matched, bits in reversed(dropped):
            need = max_candidates - len(rows)
            if matched < floor or need <= 0:
                break
            members: list[_Engine | None]
            n = bits.bit_count()
            if n == 1:
                members = [engines[bits.bit_length() - 1]]
            elif n > need or 4 * n >= len(by_id):
                # A big tie, or most of the engines: walk them in id order; when
                # neither tier nor leases can reorder them, the first `need` are it.
                members = _first_in_id_order(by_id, bits, need if simple else n, n)
            else:
                ranked = False
                members = []
                while bits:
                    low = bits & -bits
                    bits ^= low
                    members.append(engines[low.bit_length() - 1])
            for eng in members:
                assert eng is not None
                tier_no = 1
                if worst:
                    low = eng.bit
                    for slow_no in (4, 3, 2):
                        if worst.get(slow_no, 0) & low:
                            tier_no = slow_no
                            break
                eid = eng.child_engine_id
                rows.append((-matched, tier_no, leases_in_flight.get(eid, 0), eid, eng.slot))
        if not ranked:
            rows.sort()
        del rows[max_candidates:]
        candidates = []
        # Candidates are immutable values: the same one is handed out again (a
        # frozen dataclass costs ~1 us to build, most of an all-holders answer).
        cache = self._candidates
        for neg, tier_no, leases, eid, slot in rows:
            expiry = 0
            if exp_hits:
                # Expiry does not rank, so it is computed for the winners only.
                bit = 1 << slot
                eng = engines[slot]
                assert eng is not None
                own = eng.scopes[index.group_idx].expiry
                for k, em in exp_hits:
                    if em & bit:
                        exp = own[k]
                        if not expiry or exp < expiry:
                            expiry = exp
            key = (eid, neg, tier_no, expiry, leases)
            cand = cache.get(key)
            if cand is None:
                if len(cache) >= _CANDIDATE_CACHE:
                    cache.clear()
                cand = cache[key] = Candidate(eid, -neg, _TIER_OF[tier_no], expiry, leases)
            candidates.append(cand)
        return LookupAnswer(LookupOutcome.HIT, tuple(candidates), best)

    def match(
        self,
        scope: Scope,
        chain: Sequence[BlockHash],
        child_engine_ids: Sequence[str],
        *,
        now_ms: int,
    ) -> MatchAnswer:
        """Each named engine's own longest prefix of `chain` in `scope`, by tier (Score).

        The same walk as `lookup`, started from the named engines that serve with a
        fresh inventory in this scope's compatibility (reuse gate or not: a router
        counts an engine's own cache either way); others are left out of the answer.
        One walk for all of them: O(blocks walked + engines named + (engine, block)
        pairs held only below GPU), counted in `work`. Expired entries are misses.
        """
        if len(chain) > MAX_CHAIN_BLOCKS:
            raise invalid(f"chain has {len(chain)} blocks; at most {MAX_CHAIN_BLOCKS}")
        work = len(child_engine_ids)
        compat = self._compat.get(scope.compatibility_hash)
        if compat is None:
            return MatchAnswer({}, work)
        live = compat.serving | compat.visible
        asked = 0
        for cid in child_engine_ids:
            engine = self._engines.get(cid)
            if engine is not None and engine.compat is compat and engine.bit & live:
                asked |= engine.bit
        if not asked:
            return MatchAnswer({}, work)
        index = compat.scopes.get(scope.group_idx)
        counts: dict[int, dict[int, int]] = {}
        if index is None or not chain:
            dropped = [(0, asked)]
        else:
            dropped, _, _, visited = self._walk(compat, index, asked, chain, now_ms, counts)
            work += visited + sum(len(c) for c in counts.values())
            # The bits that never matched a block stopped at 0 (the walk skips them).
            matched_any = 0
            for _, bits in dropped:
                matched_any |= bits
            if asked & ~matched_any:
                dropped.append((0, asked & ~matched_any))
        engines = compat.engines
        matches: dict[str, LocalMatch] = {}
        for matched, bits in dropped:
            while bits:
                low = bits & -bits
                bits ^= low
                slot = low.bit_length() - 1
                eng = engines[slot]
                assert eng is not None
                slower = [(_TIER_OF[t], c[slot]) for t, c in sorted(counts.items()) if slot in c]
                on_gpu = matched - sum(n for _, n in slower)
                by_tier = ((Tier.GPU, on_gpu),) if on_gpu else ()
                matches[eng.child_engine_id] = LocalMatch(
                    eng.child_engine_id, matched, by_tier + tuple(slower)
                )
        return MatchAnswer(matches, work + len(dropped))

    def _walk(
        self,
        compat: _CompatSlots,
        index: _ScopeIndex,
        cur: int,
        chain: Sequence[BlockHash],
        now_ms: int,
        counts: dict[int, dict[int, int]] | None = None,
    ) -> tuple[list[tuple[int, int]], dict[int, int], list[tuple[_Key, int]], int]:
        """The longest-prefix walk of `chain` for the engines of `cur` (lookup and match).

        Returns (dropped, worst, exp_hits, visited): `dropped` lists (matched blocks,
        bits that stopped there) in chain order, `worst` maps a slower tier to the bits
        with a matched block at best in it, `exp_hits` the (block, matched bits with an
        expiry) met, `visited` the blocks looked at. With `counts`, every (engine,
        block) held only below GPU is counted under its fastest tier. Expired entries
        met on the way are purged.
        """
        by_tier = index.by_tier
        gpu_get = by_tier[Tier.GPU].get
        any_slower = by_tier[_ANY_SLOWER]
        expiring = index.expiring
        dropped: list[tuple[int, int]] = []  # (matched blocks, bits that stopped there)
        worst: dict[int, int] = {}  # tier -> bits with a matched block at best in that tier
        exp_hits: list[tuple[_Key, int]] = []  # (block, matched bits with an expiry on it)
        purge: list[tuple[int, _Key]] = []
        i = 0
        if not any_slower and not expiring:
            # Hot path: one hash, one dict.get and one & per block.
            for h in chain:
                nxt = cur & gpu_get(hash(h) & 0xFFFFFFFFFFFFFFF, 0)
                if nxt != cur:
                    if i:
                        dropped.append((i, cur ^ nxt))
                    cur = nxt
                    if not cur:
                        break
                i += 1
        else:
            engines = compat.engines
            group_idx = index.group_idx
            slower_get = any_slower.get
            expiring_get = expiring.get
            heap = self._expiry_heap
            # The heap's top bounds every live expiry from below: before it, nothing
            # has expired and no entry needs its own check during the walk.
            may_have_expired = bool(heap) and heap[0][0] <= now_ms
            for h in chain:
                k = hash(h) & 0xFFFFFFFFFFFFFFF  # _KEY_MASK, a constant in the loop
                g = gpu_get(k, 0)
                nxt = cur & (g | slower_get(k, 0))
                if expiring and nxt:
                    em = expiring_get(k, 0) & nxt
                    if em:
                        if may_have_expired:
                            bits = em
                            while bits:
                                low = bits & -bits
                                bits ^= low
                                slot = low.bit_length() - 1
                                eng = engines[slot]
                                assert eng is not None
                                if eng.scopes[group_idx].expiry[k] <= now_ms:
                                    nxt ^= low
                                    em ^= low
                                    purge.append((slot, k))
                        exp_hits.append((k, em))
                only_slower = nxt & ~g
                if only_slower:
                    # Engines holding this block only below GPU: find their fastest tier.
                    for t in _SLOWER_TIERS:
                        m = by_tier[t].get(k, 0) & only_slower
                        if m:
                            worst[t] = worst.get(t, 0) | m
                            if counts is not None:
                                # Score: one count per (engine, block) held only below GPU.
                                per_slot = counts.setdefault(t, {})
                                bits = m
                                while bits:
                                    low = bits & -bits
                                    bits ^= low
                                    slot = low.bit_length() - 1
                                    per_slot[slot] = per_slot.get(slot, 0) + 1
                            only_slower ^= m
                            if not only_slower:
                                break
                if nxt != cur:
                    if i:
                        dropped.append((i, cur ^ nxt))
                    cur = nxt
                    if not cur:
                        break
                i += 1
        if cur:
            dropped.append((i, cur))
        if purge:
            self._purge_expired(compat, index, purge, now_ms)
        visited = i if cur else min(i + 1, len(chain))
        return dropped, worst, exp_hits, visited

    @staticmethod
    def _simple_answer(
        compat: _CompatSlots,
        dropped: list[tuple[int, int]],
        floor: int,
        max_candidates: int,
        best: int,
    ) -> LookupAnswer:
        """The ranking when every matched block is on GPU, none expires and no leases
        count: by matched blocks, then id. Groups come longest first and members in id
        order, so the answer is built in rank order (no rows, no sort), and each
        engine hands out its Candidate for that many matched blocks again."""
        engines = compat.engines
        by_id = compat.by_id
        groups = compat.groups
        candidates: list[Candidate] = []
        for matched, bits in reversed(dropped):
            need = max_candidates - len(candidates)
            if matched < floor or need <= 0:
                break
            n = bits.bit_count()
            members: list[_Engine | None]
            group_key = None
            if n == 1:
                members = [engines[bits.bit_length() - 1]]
            else:
                group_key = (matched, bits, min(n, need))
                group = groups.get(group_key)
                if group is not None:
                    candidates.extend(group)
                    continue
                if n > need or 4 * n >= len(by_id):
                    # The first `need` of them in id order: stop once they are found (a
                    # top-4 answer from a tie of 31 engines looks at ~4, not all 32).
                    members = _first_in_id_order(by_id, bits, need, n)
                else:
                    members = []
                    while bits:
                        low = bits & -bits
                        bits ^= low
                        members.append(engines[low.bit_length() - 1])
                    members.sort(key=_engine_id)
            for eng in members:
                assert eng is not None
                cand = eng.candidates.get(matched)
                if cand is None:
                    if len(eng.candidates) >= _ENGINE_CANDIDATES:
                        eng.candidates.clear()
                    cand = eng.candidates[matched] = Candidate(
                        eng.child_engine_id, matched, Tier.GPU, 0, 0
                    )
                candidates.append(cand)
            if group_key is not None:
                if len(groups) >= _GROUP_CACHE:
                    groups.clear()
                groups[group_key] = tuple(candidates[-len(members) :])
        return LookupAnswer(LookupOutcome.HIT, tuple(candidates), best)

    # ------------------------------------------------------------------ expiry

    def sweep_expired(self, now_ms: int, budget: int = 4096) -> int:
        """Purge expired entries, visiting about `budget` stored hashes. Returns entries purged."""
        heap = self._expiry_heap
        purged = 0
        visited = 0
        while heap and heap[0][0] <= now_ms and visited < budget:
            exp, _, engine, group_idx, hashes = heapq.heappop(heap)
            visited += len(hashes)
            self._heap_keys -= len(hashes)
            if engine.removed:
                continue
            es = engine.scopes.get(group_idx)
            index = engine.compat.scopes.get(group_idx)
            if es is None or index is None:
                continue
            for h in hashes:
                if es.expiry.get(h) == exp:
                    purged += self._purge_block(engine, index, es, h, now_ms)
        return purged

    # ------------------------------------------------------------------ internals

    def _engine(self, child_engine_id: str) -> _Engine:
        engine = self._engines.get(child_engine_id)
        if engine is None:
            raise not_found(f"child engine {child_engine_id!r} is not in the inventory")
        return engine

    def _stream_engine(self, child_engine_id: str, rank_key: RankKey | None) -> _Engine:
        """The child engine of a stream; INVALID_ARGUMENT for a rank key of the wrong mode."""
        engine = self._engine(child_engine_id)
        if engine.mode is PublishMode.PER_CHILD_ENGINE:
            if rank_key is not None:
                raise invalid(
                    f"child engine {engine.child_engine_id!r} publishes per child engine; "
                    f"got events for rank part {rank_key}"
                )
        elif rank_key not in engine.parts:
            raise invalid(
                f"child engine {engine.child_engine_id!r} publishes per rank part; "
                f"{rank_key} is not one of its rank parts {sorted(engine.parts)}"
            )
        return engine

    def _refresh_state(self, engine: _Engine) -> None:
        if engine.dumping:
            state = _EngineState.RESYNCING
        elif engine.stale:
            state = _EngineState.STALE
        elif not engine.ready:
            state = _EngineState.NOT_READY
        else:
            state = _EngineState.READY
        if state is not engine.state:
            self._state_counts[engine.state] -= 1
            self._state_counts[state] += 1
            engine.state = state
        if state is _EngineState.READY:
            engine.compat.visible |= engine.bit
        else:
            engine.compat.visible &= ~engine.bit
        if engine.serving and not engine.stale and not engine.dumping:
            engine.compat.serving |= engine.bit
        else:
            engine.compat.serving &= ~engine.bit

    def _scope_pair(self, engine: _Engine, group_idx: int) -> tuple[_ScopeIndex, _EngineScope]:
        index = engine.compat.scopes.get(group_idx)
        if index is None:
            index = engine.compat.scopes[group_idx] = _ScopeIndex(group_idx)
        es = engine.scopes.get(group_idx)
        if es is None:
            es = engine.scopes[group_idx] = _EngineScope()
        return index, es

    def _room(self, engine: _Engine, acc: _Acc) -> bool:
        """May one more entry be added? Counts the refusal when not."""
        if engine.entries >= self.max_entries_per_engine:
            acc.dropped_engine += 1
            return False
        if self._entries_total >= self.max_entries_total:
            acc.dropped_total += 1
            return False
        return True

    def _store(self, engine: _Engine, ev: BlockStored, now_ms: int, acc: _Acc) -> None:
        hashes = ev.block_hashes
        n = len(hashes)
        acc.stored += n
        index, es = self._scope_pair(engine, ev.group_idx)
        tier = int(ev.tier)
        d = index.by_tier[tier]
        bit = engine.bit
        if (
            tier == Tier.GPU
            and not ev.expiry_ms
            and not es.expiry
            and engine.entries + n <= self.max_entries_per_engine
            and self._entries_total + n <= self.max_entries_total
        ):
            # Hot path: GPU tier, no expiries involved and no cap within reach.
            get = d.get
            append = es.keys.append
            added = 0
            for h in hashes:
                k = hash(h) & 0xFFFFFFFFFFFFFFF  # _KEY_MASK, a constant in the loop
                m = get(k, 0)
                if not m & bit:
                    d[k] = m | bit if m else bit
                    append(k)
                    added += 1
            es.live += added
            engine.entries += added
            engine.index_entries += added
            self._entries_total += added
            self._index_by_tier[tier] += added
        else:
            added = 0
            pending: list[_Key] = []  # keys whose expiry changed: one heap item for all
            for h in hashes:
                if self._add_entry(
                    engine, index, es, _key(h), tier, ev.expiry_ms, now_ms, acc, pending
                ):
                    added += 1
            if pending:
                self._push_expiry(ev.expiry_ms, engine, ev.group_idx, tuple(pending))
        acc.added += added

    def _add_entry(
        self,
        engine: _Engine,
        index: _ScopeIndex,
        es: _EngineScope,
        h: _Key,
        tier: int,
        expiry_ms: int,
        now_ms: int,
        acc: _Acc,
        pending: list[_Key],
    ) -> bool:
        """Slow path of one store. True when it added an entry."""
        old = es.expiry.get(h)
        if old is not None and old <= now_ms:
            # An expired entry is absent: start from nothing.
            acc.removed += self._purge_block(engine, index, es, h, now_ms)
        new = not index.by_tier[tier].get(h, 0) & engine.bit
        if new:
            if not self._room(engine, acc):
                return False
            self._add_index_entry(engine, index, es, h, tier)
            engine.entries += 1
            self._entries_total += 1
        self._set_expiry(engine, index, es, h, expiry_ms, pending)
        return new

    def _add_index_entry(
        self, engine: _Engine, index: _ScopeIndex, es: _EngineScope, h: _Key, tier: int
    ) -> None:
        """Add an entry known to be absent; the caller counts it against the caps."""
        bit = engine.bit
        d = index.by_tier[tier]
        m = d.get(h, 0)
        d[h] = m | bit if m else bit
        if tier != Tier.GPU:
            slower = index.by_tier[_ANY_SLOWER]
            m = slower.get(h, 0)
            slower[h] = m | bit if m else bit
        es.keys.append(h)
        es.live += 1
        engine.index_entries += 1
        self._index_by_tier[tier] += 1

    def _set_expiry(
        self,
        engine: _Engine,
        index: _ScopeIndex,
        es: _EngineScope,
        h: _Key,
        expiry_ms: int,
        pending: list[_Key] | None = None,
    ) -> None:
        """Set or clear an expiry; a new value gets a heap item now, or via `pending`."""
        old = es.expiry.get(h)
        if expiry_ms:
            if old is None:
                self._expiring_entries += 1
                index.expiring[h] = index.expiring.get(h, 0) | engine.bit
            if old != expiry_ms:
                es.expiry[h] = expiry_ms
                if pending is None:
                    self._push_expiry(expiry_ms, engine, index.group_idx, (h,))
                else:
                    pending.append(h)
        elif old is not None:
            self._drop_expiry(engine, index, es, h)

    def _push_expiry(
        self, expiry_ms: int, engine: _Engine, group_idx: int, hashes: tuple[_Key, ...]
    ) -> None:
        heap = self._expiry_heap
        heapq.heappush(heap, (expiry_ms, next(self._heap_seq), engine, group_idx, hashes))
        self._heap_keys += len(hashes)
        if self._heap_keys > 4 * self._expiring_entries + 1024:
            self._rebuild_expiry_heap()

    def _rebuild_expiry_heap(self) -> None:
        """Drop heap items that no longer match a live expiry (amortized O(1) a push)."""
        items: list[tuple[int, int, _Engine, int, tuple[_Key, ...]]] = []
        for engine in self._engines.values():
            for group_idx, es in engine.scopes.items():
                for h, exp in es.expiry.items():
                    items.append((exp, next(self._heap_seq), engine, group_idx, (h,)))
        heapq.heapify(items)
        self._expiry_heap = items
        self._heap_keys = len(items)

    def _drop_expiry(self, engine: _Engine, index: _ScopeIndex, es: _EngineScope, h: _Key) -> None:
        del es.expiry[h]
        self._expiring_entries -= 1
        m = index.expiring.get(h, 0) & ~engine.bit
        if m:
            index.expiring[h] = m
        else:
            index.expiring.pop(h, None)

    def _del_entry(
        self, engine: _Engine, index: _ScopeIndex, es: _EngineScope, h: _Key, tier: int
    ) -> bool:
        """Remove one index entry; keeps counters. Drops the expiry with the last tier."""
        d = index.by_tier[tier]
        m = d.get(h, 0)
        bit = engine.bit
        if not m & bit:
            return False
        m &= ~bit
        if m:
            d[h] = m
        else:
            del d[h]
        es.live -= 1
        engine.index_entries -= 1
        self._index_by_tier[tier] -= 1
        if tier != Tier.GPU and not any(
            index.by_tier[t].get(h, 0) & bit for t in _SLOWER_TIERS if index.by_tier[t]
        ):
            slower = index.by_tier[_ANY_SLOWER]
            m = slower.get(h, 0) & ~bit
            if m:
                slower[h] = m
            else:
                slower.pop(h, None)
        if engine.mode is PublishMode.PER_CHILD_ENGINE:
            engine.entries -= 1
            self._entries_total -= 1
        if h in es.expiry and not any(
            index.by_tier[t].get(h, 0) & bit for t in _TIERS if index.by_tier[t]
        ):
            self._drop_expiry(engine, index, es, h)
        return True

    def _remove(self, engine: _Engine, ev: BlockRemoved, now_ms: int, acc: _Acc) -> None:
        hashes = ev.block_hashes
        acc.removed_hashes += len(hashes)
        index = engine.compat.scopes.get(ev.group_idx)
        es = engine.scopes.get(ev.group_idx)
        if index is None or es is None:
            return
        tier = int(ev.tier)
        if tier == Tier.GPU and not es.expiry:
            # Hot path (vLLM evictions): `_del_entry` inlined for the GPU tier with no
            # expiry to check or drop; the counters move once per event.
            d = index.by_tier[tier]
            get = d.get
            bit = engine.bit
            keep = ~bit
            gone = 0
            for h in hashes:
                k = hash(h) & 0xFFFFFFFFFFFFFFF  # _KEY_MASK, a constant in the loop
                m = get(k, 0)
                if m & bit:
                    m &= keep
                    if m:
                        d[k] = m
                    else:
                        del d[k]
                    gone += 1
            if gone:
                es.live -= gone
                engine.index_entries -= gone
                self._index_by_tier[tier] -= gone
                if engine.mode is PublishMode.PER_CHILD_ENGINE:
                    engine.entries -= gone
                    self._entries_total -= gone
            acc.removed += gone
            return
        removed = 0
        for k in map(_key, hashes):
            exp = es.expiry.get(k) if es.expiry else None
            if exp is not None and exp <= now_ms:
                removed += self._purge_block(engine, index, es, k, now_ms)
            elif self._del_entry(engine, index, es, k, tier):
                removed += 1
        acc.removed += removed

    def _purge_block(
        self, engine: _Engine, index: _ScopeIndex, es: _EngineScope, h: _Key, now_ms: int
    ) -> int:
        """Drop every tier of an expired (block, engine); for parts, their expired facts too."""
        n = 0
        for t in _TIERS:
            if index.by_tier[t] and self._del_entry(engine, index, es, h, t):
                n += 1
        if h in es.expiry:
            self._drop_expiry(engine, index, es, h)
        if engine.mode is PublishMode.PER_RANK_PART:
            key = (index.group_idx, h)
            for part in engine.parts.values():
                exp = part.expiry.get(key)
                if exp is not None and exp <= now_ms:
                    self._drop_part_fact(engine, part, key)
        return n

    def _purge_expired(
        self,
        compat: _CompatSlots,
        index: _ScopeIndex,
        purge: list[tuple[int, _Key]],
        now_ms: int,
    ) -> None:
        for slot, h in purge:
            engine = compat.engines[slot]
            assert engine is not None
            es = engine.scopes[index.group_idx]
            self._purge_block(engine, index, es, h, now_ms)

    def _compact(self, engine: _Engine, group_idx: int, es: _EngineScope) -> None:
        """Rewrite the reverse index without dead keys and repeats."""
        index = engine.compat.scopes[group_idx]
        bit = engine.bit
        tiers = [index.by_tier[t] for t in _TIERS if index.by_tier[t]]
        if len(tiers) == 1:
            get = tiers[0].get  # one tier in use (the usual case): no generator per key
            es.keys = [h for h in dict.fromkeys(es.keys) if get(h, 0) & bit]
        else:
            es.keys = [h for h in dict.fromkeys(es.keys) if any(d.get(h, 0) & bit for d in tiers)]

    def _clear_index(self, engine: _Engine) -> int:
        """Drop all of an engine's index entries, in O(its reverse index)."""
        removed = 0
        bit = engine.bit
        keep = ~bit
        for group_idx, es in engine.scopes.items():
            index = engine.compat.scopes[group_idx]
            for t in (_ANY_SLOWER, *_TIERS):
                d = index.by_tier[t]
                if not d:
                    continue
                n = 0
                for h in es.keys:
                    m = d.get(h, 0)
                    if m & bit:
                        m &= keep
                        if m:
                            d[h] = m
                        else:
                            del d[h]
                        n += 1
                if t != _ANY_SLOWER:
                    self._index_by_tier[t] -= n
                    removed += n
            for h in es.expiry:
                m = index.expiring.get(h, 0) & keep
                if m:
                    index.expiring[h] = m
                else:
                    index.expiring.pop(h, None)
            self._expiring_entries -= len(es.expiry)
        engine.scopes.clear()
        engine.index_entries = 0
        if engine.mode is PublishMode.PER_CHILD_ENGINE:
            self._entries_total -= engine.entries
            engine.entries = 0
        return removed

    def _clear_stream(self, engine: _Engine, rank_key: RankKey | None) -> None:
        self._clear_index(engine)
        if rank_key is not None:
            self._reset_part(engine, engine.parts[rank_key])

    def _reset_part(self, engine: _Engine, part: _Part) -> None:
        engine.entries -= part.entries
        self._entries_total -= part.entries
        part.tiers.clear()
        part.expiry.clear()
        part.entries = 0

    # --------------------------------------------------------- per-rank-part path

    def _part_event(
        self, engine: _Engine, part: _Part, ev: InventoryEvent, now_ms: int, acc: _Acc
    ) -> None:
        if isinstance(ev, AllBlocksCleared):
            acc.clears += 1
            # A block is visible only while every part holds it: the index empties.
            acc.removed += self._clear_index(engine)
            self._reset_part(engine, part)
            return
        group_idx = ev.group_idx
        tier_bit = 1 << int(ev.tier)
        touched: list[tuple[int, _Key]] = []
        if isinstance(ev, BlockStored):
            acc.stored += len(ev.block_hashes)
            for h in ev.block_hashes:
                key = (group_idx, _key(h))
                exp = part.expiry.get(key)
                changed = exp is not None and exp <= now_ms
                if changed:
                    self._drop_part_fact(engine, part, key)
                    exp = None
                tiers = part.tiers.get(key, 0)
                if not tiers & tier_bit:
                    if not self._room(engine, acc):
                        continue
                    part.tiers[key] = tiers | tier_bit
                    part.entries += 1
                    engine.entries += 1
                    self._entries_total += 1
                    changed = True
                if ev.expiry_ms:
                    part.expiry[key] = ev.expiry_ms
                else:
                    part.expiry.pop(key, None)
                # Deriving walks every part: only for a fact that changed (a repeat of
                # what the part holds costs O(1), however big the grid).
                if changed or exp != (ev.expiry_ms or None):
                    touched.append(key)
        else:
            acc.removed_hashes += len(ev.block_hashes)
            for h in ev.block_hashes:
                key = (group_idx, _key(h))
                exp = part.expiry.get(key)
                expired = exp is not None and exp <= now_ms
                if expired:
                    self._drop_part_fact(engine, part, key)
                tiers = part.tiers.get(key, 0)
                if tiers & tier_bit:
                    tiers &= ~tier_bit
                    if tiers:
                        part.tiers[key] = tiers
                    else:
                        del part.tiers[key]
                        part.expiry.pop(key, None)
                    part.entries -= 1
                    engine.entries -= 1
                    self._entries_total -= 1
                    touched.append(key)
                elif expired:
                    touched.append(key)  # its expired fact was dropped
        for key in touched:
            a, r = self._derive(engine, key, now_ms)
            acc.added += a
            acc.removed += r

    def _drop_part_fact(self, engine: _Engine, part: _Part, key: tuple[int, _Key]) -> None:
        n = part.tiers.pop(key, 0).bit_count()
        part.expiry.pop(key, None)
        part.entries -= n
        engine.entries -= n
        self._entries_total -= n

    def _derive(self, engine: _Engine, key: tuple[int, _Key], now_ms: int) -> tuple[int, int]:
        """Set the index entry of (group, block) to what every part holds."""
        group_idx, h = key
        tiers = -1
        expiry = 0
        for part in engine.parts.values():
            tiers &= part.tiers.get(key, 0)
            if not tiers:
                break  # a part without it: no tier is held by all (the expiry is moot)
            exp = part.expiry.get(key, 0)
            if exp and (not expiry or exp < expiry):
                expiry = exp
        if tiers == -1:
            tiers = 0
        index, es = self._scope_pair(engine, group_idx)
        added = removed = 0
        bit = engine.bit
        for t in _TIERS:
            d = index.by_tier[t]
            m = d.get(h, 0)
            if tiers >> t & 1:
                if not m & bit:
                    self._add_index_entry(engine, index, es, h, t)
                    added += 1
            elif m & bit and self._del_entry(engine, index, es, h, t):
                removed += 1
        if tiers:
            self._set_expiry(engine, index, es, h, expiry)
        if len(es.keys) > 2 * es.live + 64:
            self._compact(engine, group_idx, es)
        return added, removed


class _Acc:
    """Counters of one apply() call."""

    __slots__ = (
        "added",
        "clears",
        "dropped_engine",
        "dropped_total",
        "removed",
        "removed_hashes",
        "stored",
    )

    def __init__(self) -> None:
        self.stored = 0
        self.removed_hashes = 0
        self.clears = 0
        self.added = 0
        self.removed = 0
        self.dropped_engine = 0
        self.dropped_total = 0


_MISS = LookupAnswer(LookupOutcome.MISS, (), 0)
