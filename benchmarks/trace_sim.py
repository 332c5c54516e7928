"""Virtual-time replay of a Mooncake-format trace over N simulated prefill engines.

Pure and deterministic: no asyncio, no gRPC, no wall clock. `benchmarks.bench_trace`
drives the same simulator with a reuse provider backed by the real kvrc service.

Trace format (Mooncake FAST'25 release): one JSON object per line with
`timestamp` (ms from start), `input_length`, `output_length` (tokens) and
`hash_ids` (prefix-chained block ids; equal ids are reusable blocks). Requests
are replayed in timestamp order (file order among equal timestamps).

Cost model (`CostModel`, defaults from the Mooncake paper's setting):
- an engine prefills `prefill_tokens_per_s` (10,000) uncached tokens per second,
  one request at a time, in arrival order (FIFO);
- loading a block from another engine costs `load_ms_per_block` (8 ms: 512 tokens
  x 320 KB per token at 20 GB/s) whatever the pair; with `pairs` (`PairLinks`:
  engines in groups, one link within a group and one across) a load of n blocks
  from h to r costs latency(h, r) + n x block bytes / bandwidth(h, r), the block's
  bytes being `block_tokens` x `kv_bytes_per_token`. The source is not slowed;
- uncached tokens = max(0, input_length - reused_blocks * 512);
- a load runs on the link while the engine works through the requests queued
  before it, as kvrc's vLLM connector loads (asynchronously: the request waits
  in WAITING_FOR_REMOTE_KVS and the engine goes on); an engine's inbound link
  carries one load at a time. The request's prefill starts once both its load
  has ended and the engine is free. Prefill stays in arrival order, so a request
  whose load outlasts the queue ahead holds the requests behind it (vLLM would
  run them meanwhile): this penalises the kvrc modes, by at most 0.01 of
  local_kv's mean TTFT where measured (docs/benchmarks.md, Model);
- TTFT = max(queueing, link wait + loading) + prefill.

Cache model:
- each engine has an LRU cache of `capacity_tokens // 512` blocks;
- cache state changes when a request is dispatched (its arrival): its local
  prefix hits are touched, loaded and recomputed blocks enter the requester's
  cache, and LRU blocks are evicted to make room. The chain is touched tail
  first, so a request's tail blocks are evicted before its head (as vLLM frees
  blocks in reverse order);
- a request's blocks are pinned on its engine until it finishes (a queued or
  running request's KV is in use); a load pins the source's prefix until the
  load ends. Pinned blocks are never evicted; when everything is pinned the
  overflow is simply not retained, so a cache never exceeds its capacity;
- the engine itself may reuse any block in its own cache (FIFO guarantees an
  earlier request computed it first); other engines see a block only once it
  has been computed: the engine publishes BlockStored when the request
  finishes and BlockRemoved when it evicts a published block. A source can
  pin, and a requester load, only blocks the source has published and still
  holds at load time (the holder answers the pin from its own cache, so a
  stale hint yields a shorter load, never a phantom one).

Modes (all on the same trace):
- `local_rr`: round-robin routing, each engine reuses only its own cache;
- `kvrc_rr`: round-robin; an engine loads a longer prefix from whichever engine
  holds one, found through the reuse provider (kvrc);
- `local_kv`: cost-aware routing: the engine with the lowest queueing + work,
  where work is the prefill of what that engine would recompute; the
  strongest router without reuse;
- `kvrc_kv`: cost-aware routing that counts what the engine would recompute and
  what it would load through kvrc (holders of at least `min_blocks`, the static
  threshold): the predicted TTFT, max(queueing, loading) + prefill, plus
  `REPLICATION_CHARGE` x the load's time, the price of the copy a load adds
  (it takes cache room from blocks that may be the cluster's only copy);
- `kvrc_cost`: `kvrc_kv` where a load is granted only when kvrc's cost gate
  (`LoadGate`: `coordinator.core.cost_model.CostModel` itself, fed with every
  simulated load's bytes and duration) predicts it beats recomputing; routing
  counts a holder only where the gate would grant its load;
- `upper_bound`: one unbounded cache shared by every engine, reads are free and
  blocks are visible from dispatch; its hit ratio is the trace's best possible.

`hit_ratio` = reused prefix blocks (local hits + loaded) / all blocks. Ties in
cost-aware routing go to the engine idle the longest, then the lowest index.
"""

from __future__ import annotations

import enum
import heapq
import json
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from benchmarks.common import percentile
from coordinator.core.cost_model import CostConfig, DeclaredLink, LinkEstimate, LoadPlan
from coordinator.core.cost_model import CostModel as GateModel
from kvrc.vocabulary import Tier

BLOCK_TOKENS = 512
DEFAULT_CAPACITY_TOKENS = 3_000_000
DEFAULT_ENGINES = 10
# The Mooncake FAST'25 synthetic trace, shipped in the repository (benchmarks/data/README.md).
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "synthetic_trace.jsonl"

BlockId = int
EngineIndex = int
LeaseKey = Hashable


# ---------------------------------------------------------------------------
# Trace
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_index: int  # position in timestamp order
    arrival_ms: int
    input_tokens: int
    output_tokens: int
    block_ids: tuple[BlockId, ...]


def parse_trace(
    lines: Sequence[str] | Iterator[str], source: str = "<trace>"
) -> list[TraceRequest]:
    """Parse Mooncake-format JSON lines; ValueError names the bad line."""
    raw: list[tuple[int, int, int, int, tuple[int, ...]]] = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}:{line_no}: not JSON: {exc.msg}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{source}:{line_no}: expected a JSON object")
        timestamp = obj.get("timestamp")
        input_length = obj.get("input_length")
        output_length = obj.get("output_length", 0)
        hash_ids = obj.get("hash_ids")
        for name, value, minimum in (
            ("timestamp", timestamp, 0),
            ("input_length", input_length, 1),
            ("output_length", output_length, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{source}:{line_no}: {name} must be an integer >= {minimum}")
        if (
            not isinstance(hash_ids, list)
            or not hash_ids
            or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids)
        ):
            raise ValueError(
                f"{source}:{line_no}: hash_ids must be a non-empty list of non-negative integers"
            )
        assert isinstance(timestamp, int) and isinstance(input_length, int)
        assert isinstance(output_length, int)
        raw.append((timestamp, len(raw), input_length, output_length, tuple(hash_ids)))
    if not raw:
        raise ValueError(f"{source}: the trace has no requests")
    raw.sort(key=lambda r: (r[0], r[1]))  # stable: file order among equal timestamps
    return [
        TraceRequest(
            request_index=i,
            arrival_ms=ts,
            input_tokens=inp,
            output_tokens=out,
            block_ids=ids,
        )
        for i, (ts, _, inp, out, ids) in enumerate(raw)
    ]


def load_trace(path: str | Path) -> list[TraceRequest]:
    p = Path(path)
    with p.open(encoding="utf-8") as fh:
        return parse_trace(fh, source=str(p))


def prefix_length(chain: Sequence[BlockId], present: Container[BlockId]) -> int:
    """How many leading blocks of `chain` are in `present`."""
    n = 0
    while n < len(chain) and chain[n] in present:
        n += 1
    return n


def best_possible_hit_ratio(requests: Sequence[TraceRequest]) -> float:
    """Prefix hit ratio with one unbounded cache: contiguous known blocks / all blocks."""
    seen: set[BlockId] = set()
    hit = total = 0
    for req in requests:
        hit += prefix_length(req.block_ids, seen)
        total += len(req.block_ids)
        seen.update(req.block_ids)
    return hit / total


# ---------------------------------------------------------------------------
# Cost model and modes
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Link:
    bandwidth_bytes_per_s: float
    latency_ms: float  # fixed, per load


@dataclass(frozen=True, slots=True)
class PairLinks:
    """Per-pair links: each engine is in a group; one link within a group, one across."""

    groups: tuple[int, ...]  # engine index -> its group
    within: Link
    across: Link

    def __post_init__(self) -> None:
        for link in (self.within, self.across):
            if link.bandwidth_bytes_per_s <= 0 or link.latency_ms < 0:
                raise ValueError("a link needs a positive bandwidth and a latency >= 0")

    def link(self, source: EngineIndex, requester: EngineIndex) -> Link:
        same = self.groups[source] == self.groups[requester]
        return self.within if same else self.across

    def declared(self) -> tuple[DeclaredLink, ...]:
        """These links as an operator declares them to kvrc (profiles file `[[link]]`)."""
        members: dict[int, list[str]] = {}
        for engine, group in enumerate(self.groups):
            members.setdefault(group, []).append(engine_name(engine))
        return tuple(
            DeclaredLink(
                tuple(members[g]),
                tuple(members[h]),
                link.bandwidth_bytes_per_s,
                link.latency_ms,
                name=f"group {g} -> group {h}",
            )
            for g in sorted(members)
            for h in sorted(members)
            for link in (self.within if g == h else self.across,)
        )


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_tokens_per_s: float = 10_000.0
    # The routers' estimate of a load, one figure for every pair (a router does not
    # know the links); also what a load costs, unless `pairs` sets per-pair links.
    load_ms_per_block: float = 8.0
    block_tokens: int = BLOCK_TOKENS
    # What one token's KV weighs: the bytes a load moves (what kvrc's gate is told),
    # and with `pairs` what sets its time. 320 KB matches the 8 ms default at ~20 GB/s.
    kv_bytes_per_token: int = 320_000
    pairs: PairLinks | None = None

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.load_ms_per_block < 0 or self.block_tokens < 1:
            raise ValueError("cost model needs a positive prefill rate and block size")
        if self.kv_bytes_per_token < 1:
            raise ValueError("kv_bytes_per_token must be >= 1")

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.kv_bytes_per_token

    def prefill_ms(self, input_tokens: int, reused_blocks: int) -> float:
        uncached = max(0, input_tokens - reused_blocks * self.block_tokens)
        return uncached * 1000.0 / self.prefill_tokens_per_s

    def estimated_load_ms(self, blocks: int) -> float:
        """What the cost-aware routers count for a load of `blocks` (any pair)."""
        return blocks * self.load_ms_per_block

    def load_ms(self, blocks: int, source: EngineIndex, requester: EngineIndex) -> float:
        """What a load of `blocks` from `source` to `requester` takes."""
        if self.pairs is None:
            return self.estimated_load_ms(blocks)  # one uniform link, no fixed latency
        link = self.pairs.link(source, requester)
        return link.latency_ms + blocks * self.block_bytes * 1000.0 / link.bandwidth_bytes_per_s


def engine_name(engine: EngineIndex) -> str:
    """The child engine id of a simulated engine (the service runs use the same)."""
    return f"prefill-{engine}"


class LoadGate:
    """kvrc's load-or-recompute decision over the simulated cluster (I9-cost-gate).

    The coordinator's own `CostModel` (not a copy of its arithmetic): cold links
    start from `config`'s defaults, every engine's prefill rate is the declared one
    (the simulator's, as a deployment profile would name it), every completed
    load is observed with its bytes and simulated duration, as a report would carry,
    and every granted load is open from its grant to its end (an unmeasured link's
    open loads bound its predictions, as in the coordinator).
    Deterministic: the model reads no clock.
    """

    def __init__(
        self,
        cost: CostModel,
        config: CostConfig | None = None,
        declared_links: Sequence[DeclaredLink] = (),
    ) -> None:
        self.cost = cost
        declared = cost.prefill_tokens_per_s
        self.model = GateModel(
            config, declared_prefill=lambda _requester: declared, declared_links=declared_links
        )

    def plan(
        self,
        holder: EngineIndex,
        requester: EngineIndex,
        floor: int,
        hinted: int,
        now_ms: float,
        have: int = 0,
    ) -> tuple[int, LoadPlan] | None:
        """(the fewest blocks worth loading, the plan: the most a load may cover, all
        `hinted` or a probe's worth, and what it stood on), as the coordinator's grant
        decides them (I9-cost-gate); None: not worth loading."""
        plan, worthwhile = self.model.grantable(
            engine_name(holder),
            engine_name(requester),
            Tier.GPU,
            floor,
            hinted,
            block_tokens=self.cost.block_tokens,
            bytes_per_block=self.cost.block_bytes,
            have=have,
            now_ms=int(now_ms),
        )
        return None if worthwhile is None else (worthwhile, plan)

    def started(
        self,
        lease_key: LeaseKey,
        holder: EngineIndex,
        requester: EngineIndex,
        moves: int,
        now_ms: float,
        stand_in: LinkEstimate | None = None,
    ) -> None:
        """A load of `moves` blocks was granted (kept while it runs if its link has no
        fresh fit, with the stand-in its plan stood on)."""
        self.model.load_started(
            str(lease_key),
            engine_name(holder),
            engine_name(requester),
            Tier.GPU,
            moves * self.cost.block_bytes,
            int(now_ms),
            stand_in,
        )

    def ended(self, lease_key: LeaseKey) -> None:
        self.model.load_ended(str(lease_key))

    def observe(
        self,
        holder: EngineIndex,
        requester: EngineIndex,
        blocks: int,
        duration_ms: float,
        now_ms: float,
        lease_key: LeaseKey | None = None,
    ) -> None:
        """The load `lease_key`'s outcome, before it ends (`ended`)."""
        # Whole microseconds, as TransferReport.duration_us; at least 1 (0 means unmeasured).
        duration_us = max(1, round(duration_ms * 1000.0))
        self.model.observe_transfer(
            engine_name(holder),
            engine_name(requester),
            Tier.GPU,
            blocks * self.cost.block_bytes,
            duration_us,
            int(now_ms),
            None if lease_key is None else str(lease_key),
        )


class Mode(enum.StrEnum):
    LOCAL_RR = "local_rr"
    KVRC_RR = "kvrc_rr"
    LOCAL_KV = "local_kv"
    KVRC_KV = "kvrc_kv"
    KVRC_COST = "kvrc_cost"
    UPPER_BOUND = "upper_bound"

    @property
    def uses_kvrc(self) -> bool:
        return self in (Mode.KVRC_RR, Mode.KVRC_KV, Mode.KVRC_COST)

    @property
    def cost_aware(self) -> bool:
        return self in (Mode.LOCAL_KV, Mode.KVRC_KV, Mode.KVRC_COST, Mode.UPPER_BOUND)


# ---------------------------------------------------------------------------
# Reuse provider interface
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Candidate:
    engine: EngineIndex
    matched_blocks: int  # contiguous from the start of the chain


@dataclass(frozen=True, slots=True)
class LoadGrant:
    lease_key: LeaseKey
    source_engine: EngineIndex
    matched_blocks: int  # what the source pinned: may be fewer than hinted


class HolderSide(Protocol):
    """What a provider may ask of the holders: they answer from their own caches."""

    def pin_prefix(
        self, engine: EngineIndex, lease_key: LeaseKey, chain: Sequence[BlockId]
    ) -> int: ...

    def unpin(self, engine: EngineIndex, lease_key: LeaseKey) -> None:
        """For pins of a lease that was not granted (the holder was told to release)."""


class ReuseProvider(Protocol):
    def bind(self, holders: HolderSide, num_engines: int) -> None:
        """Called once before the replay."""

    def lookup(
        self, requester: EngineIndex, chain: Sequence[BlockId], include_self: bool, now_ms: float
    ) -> list[Candidate]:
        """Holders of a prefix of `chain`, longest first (at least the best two)."""

    def acquire(
        self,
        requester: EngineIndex,
        chain: Sequence[BlockId],
        min_blocks: int,
        now_ms: float,
        local_blocks: int = 0,
    ) -> LoadGrant | None:
        """Pick a holder of >= min_blocks, have it pin; None is a miss (recompute). The
        requester holds the chain's first `local_blocks` and loads only the rest."""

    def complete(self, grant: LoadGrant, loaded_blocks: int, now_ms: float) -> None:
        """The load ended; when this returns the holder may unpin."""

    def blocks_stored(
        self,
        engine: EngineIndex,
        blocks: Sequence[BlockId],
        parent: BlockId | None,
        now_ms: float,
    ) -> None: ...

    def blocks_removed(
        self, engine: EngineIndex, blocks: Sequence[BlockId], now_ms: float
    ) -> None: ...


class LocalReferenceProvider:
    """In-process view of every engine's published blocks, fed by the store/evict hooks.

    The reference the kvrc-backed provider is checked against; it picks the
    holder with the longest prefix (lowest index on ties). With a `gate` it grants
    as kvrc's cost gate does: a holder whose hinted prefix is not worth loading is
    skipped (the next one may be), and a pin shorter than the fewest blocks worth
    loading is a miss (its pins released).
    """

    def __init__(self, gate: LoadGate | None = None) -> None:
        self.gate = gate
        self._holders: dict[BlockId, set[EngineIndex]] = {}
        self._side: HolderSide | None = None
        self._next_lease = 0

    def bind(self, holders: HolderSide, num_engines: int) -> None:
        self._side = holders
        self._holders.clear()

    def lookup(
        self, requester: EngineIndex, chain: Sequence[BlockId], include_self: bool, now_ms: float
    ) -> list[Candidate]:
        if not chain:
            return []
        alive = set(self._holders.get(chain[0], ()))
        if not include_self:
            alive.discard(requester)
        matched: dict[EngineIndex, int] = {}
        depth = 0
        while alive:
            depth += 1
            if depth == len(chain):
                for engine in alive:
                    matched[engine] = depth
                break
            holders_next = self._holders.get(chain[depth], set())
            for engine in alive - holders_next:
                matched[engine] = depth
            alive &= holders_next
        return [Candidate(e, m) for e, m in sorted(matched.items(), key=lambda em: (-em[1], em[0]))]

    def acquire(
        self,
        requester: EngineIndex,
        chain: Sequence[BlockId],
        min_blocks: int,
        now_ms: float,
        local_blocks: int = 0,
    ) -> LoadGrant | None:
        assert self._side is not None, "bind() first"
        for cand in self.lookup(requester, chain, include_self=False, now_ms=now_ms):
            if cand.matched_blocks < min_blocks:
                break
            need = min_blocks
            reach = cand.matched_blocks
            if self.gate is not None:
                planned = self.gate.plan(
                    cand.engine, requester, min_blocks, reach, now_ms, local_blocks
                )
                if planned is None:
                    continue  # this holder's link is too slow; another may still pay off
                need, plan = planned
                reach = plan.ceiling
            self._next_lease += 1
            key = ("ref", self._next_lease)
            pinned = self._side.pin_prefix(cand.engine, key, chain[:reach])
            if self.gate is not None and pinned < need:
                self._side.unpin(cand.engine, key)  # recompute_cheaper: the pins are released
                return None
            if self.gate is not None:
                moves = max(reach - local_blocks, 0)
                self.gate.started(key, cand.engine, requester, moves, now_ms, plan.stand_in)
            return LoadGrant(key, cand.engine, pinned)
        return None

    def complete(self, grant: LoadGrant, loaded_blocks: int, now_ms: float) -> None:
        if self.gate is not None:
            self.gate.ended(grant.lease_key)  # the lease ends

    def blocks_stored(
        self,
        engine: EngineIndex,
        blocks: Sequence[BlockId],
        parent: BlockId | None,
        now_ms: float,
    ) -> None:
        for b in blocks:
            self._holders.setdefault(b, set()).add(engine)

    def blocks_removed(self, engine: EngineIndex, blocks: Sequence[BlockId], now_ms: float) -> None:
        for b in blocks:
            holders = self._holders.get(b)
            if holders is not None:
                holders.discard(engine)
                if not holders:
                    del self._holders[b]


# ---------------------------------------------------------------------------
# Engine cache
# ---------------------------------------------------------------------------


class EngineCache:
    """LRU block cache of one engine with pins and a published subset."""

    __slots__ = ("_entries", "_lease_blocks", "_pins", "capacity_blocks", "published")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("an engine cache needs at least one block")
        self.capacity_blocks = capacity_blocks
        self._entries: OrderedDict[BlockId, None] = OrderedDict()  # LRU first
        self._pins: dict[BlockId, int] = {}
        self._lease_blocks: dict[LeaseKey, tuple[BlockId, ...]] = {}
        self.published: set[BlockId] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block: object) -> bool:
        return block in self._entries

    def lru_order(self) -> list[BlockId]:
        """Resident blocks, least recently used first."""
        return list(self._entries)

    def local_prefix(self, chain: Sequence[BlockId]) -> int:
        return prefix_length(chain, self._entries)

    def published_prefix(self, chain: Sequence[BlockId]) -> int:
        return prefix_length(chain, self.published)

    def is_pinned(self, block: BlockId) -> bool:
        return block in self._pins

    def pin(self, lease_key: LeaseKey, blocks: Sequence[BlockId]) -> None:
        if lease_key in self._lease_blocks:
            raise ValueError(f"lease {lease_key!r} already pins blocks here")
        held = tuple(b for b in blocks if b in self._entries)
        self._lease_blocks[lease_key] = held
        for b in held:
            self._pins[b] = self._pins.get(b, 0) + 1

    def unpin(self, lease_key: LeaseKey) -> None:
        for b in self._lease_blocks.pop(lease_key, ()):
            count = self._pins[b] - 1
            if count:
                self._pins[b] = count
            else:
                del self._pins[b]

    def admit(
        self, chain: Sequence[BlockId], cold: Sequence[BlockId] = ()
    ) -> tuple[list[BlockId], list[BlockId]]:
        """Make `chain` resident; return (newly retained, evicted).

        The chain becomes most recent, except newly retained `cold` blocks
        (copies loaded from another engine), which go least recent.
        """
        in_use = set(chain)
        missing = [b for b in chain if b not in self._entries]
        room = self.capacity_blocks - len(self._entries)
        evicted: list[BlockId] = []
        if len(missing) > room:
            need = len(missing) - room
            for b in self._entries:  # LRU first
                if b not in self._pins and b not in in_use:
                    evicted.append(b)
                    if len(evicted) == need:
                        break
            for b in evicted:
                del self._entries[b]
                self.published.discard(b)
            room += len(evicted)
        retained = missing[: max(0, room)]  # head blocks first: a prefix is what reuse needs
        for b in retained:
            self._entries[b] = None
        for b in reversed(chain):  # tail first, so the head ends most recent
            if b in self._entries:
                self._entries.move_to_end(b)
        new = set(retained)
        for b in cold:  # head first to the front, so a copy's tail is evicted first
            if b in new:
                self._entries.move_to_end(b, last=False)
        return retained, evicted


# ---------------------------------------------------------------------------
# Simulation
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    request_index: int
    engine: EngineIndex
    total_blocks: int
    local_hit_blocks: int
    loaded_blocks: int
    source_engine: EngineIndex | None
    ttft_ms: float


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """One load, for checks: which blocks were read from whom, and when."""

    request_index: int
    requester: EngineIndex
    source_engine: EngineIndex
    blocks: tuple[BlockId, ...]
    begin_ms: float
    end_ms: float


@dataclass(frozen=True, slots=True)
class ModeResult:
    mode: Mode
    requests: int
    blocks_total: int
    blocks_local_hit: int
    blocks_loaded: int
    blocks_recomputed: int
    hit_ratio: float
    ttft_mean_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    load_grants: int
    load_misses: int  # acquire answered a miss, or a pin too short to help
    cumulative_hit_ratio: tuple[float, ...]  # after each request, for the plot

    def summary(self) -> dict[str, float | int]:
        return {
            "hit_ratio": self.hit_ratio,
            "blocks_loaded": self.blocks_loaded,
            "blocks_recomputed": self.blocks_recomputed,
            "blocks_local_hit": self.blocks_local_hit,
            "blocks_total": self.blocks_total,
            "ttft_mean_s": self.ttft_mean_s,
            "ttft_p90_s": self.ttft_p90_s,
            "ttft_p99_s": self.ttft_p99_s,
            "load_grants": self.load_grants,
            "load_misses": self.load_misses,
        }


# The cost-aware routers with loads add this share of a load's time to its engine's
# predicted TTFT: the copy takes cache room from blocks that may be the cluster's only
# copy. Without it a router leaves a busy holder for any shorter queue (a load hides
# behind the queue), copies every popular prefix everywhere and, where the caches
# are full, thrashes them (docs/benchmarks.md, "The replication charge").
REPLICATION_CHARGE = 0.5

# Event kinds, in the order they run at equal virtual times: what finished by
# time t is visible to what arrives at t.
_LOAD_END = 0
_FINISH = 1
_ARRIVAL = 2


@dataclass(slots=True)
class _Engine:
    cache: EngineCache
    free_at_ms: float = 0.0  # the last queued request's prefill ends
    link_free_at_ms: float = 0.0  # the last inbound load ends


@dataclass(slots=True)
class _Counters:
    grants: int = 0
    misses: int = 0
    outcomes: list[RequestOutcome] = field(default_factory=list)


class TraceSimulation:
    """One replay of one mode. Use `run()`; `loads` and `engines` stay for checks."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        mode: Mode,
        *,
        engines: int = DEFAULT_ENGINES,
        capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
        cost: CostModel | None = None,
        provider: ReuseProvider | None = None,
        pace: Callable[[float], None] | None = None,
        min_blocks: int = 1,
        gate: LoadGate | None = None,
    ) -> None:
        if engines < 1:
            raise ValueError("engines must be >= 1")
        if min_blocks < 1:
            raise ValueError("min_blocks must be >= 1")
        self.cost = cost if cost is not None else CostModel()
        if self.cost.pairs is not None and len(self.cost.pairs.groups) != engines:
            raise ValueError("the pair links name a group for every engine")
        capacity_blocks = capacity_tokens // self.cost.block_tokens
        if capacity_blocks < 1:
            raise ValueError("capacity_tokens must hold at least one block")
        if mode.uses_kvrc and provider is None:
            raise ValueError(f"mode {mode} needs a reuse provider")
        if (mode is Mode.KVRC_COST) != (gate is not None):
            raise ValueError("a load gate is what mode kvrc_cost needs, and only it")
        self.requests = requests
        self.min_blocks = min_blocks
        # kvrc_cost: the same gate the provider grants with, asked by the router
        # (as a router asks kvrc's Score) and fed with every load's outcome.
        self.gate = gate
        self.mode = mode
        self.provider = provider if mode.uses_kvrc else None
        self._pace = pace
        self.engines = [_Engine(EngineCache(capacity_blocks)) for _ in range(engines)]
        self._shared: set[BlockId] = set()  # upper_bound's unbounded cache
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._rr_next = 0
        self._c = _Counters()
        self.loads: list[LoadRecord] = []
        self.max_cache_blocks_seen = 0

    @property
    def outcomes(self) -> list[RequestOutcome]:
        """Per request, in dispatch order."""
        return self._c.outcomes

    # --- HolderSide -------------------------------------------------------
    def pin_prefix(self, engine: EngineIndex, lease_key: LeaseKey, chain: Sequence[BlockId]) -> int:
        """A holder pins the published prefix of `chain` it still holds."""
        cache = self.engines[engine].cache
        n = cache.published_prefix(chain)
        cache.pin(lease_key, chain[:n])
        return n

    def unpin(self, engine: EngineIndex, lease_key: LeaseKey) -> None:
        self.engines[engine].cache.unpin(lease_key)

    # --- replay -----------------------------------------------------------
    def run(self) -> ModeResult:
        if self.provider is not None:
            self.provider.bind(self, len(self.engines))
        for req in self.requests:
            self._push(float(req.arrival_ms), _ARRIVAL, req)
        while self._events:
            now, kind, _, payload = heapq.heappop(self._events)
            if self._pace is not None:
                self._pace(now)
            if kind == _ARRIVAL:
                assert isinstance(payload, TraceRequest)
                self._dispatch(payload, now)
            elif kind == _FINISH:
                assert isinstance(payload, _Finish)
                self._finish(payload, now)
            else:
                assert isinstance(payload, _LoadEnd)
                self._load_end(payload, now)
        return self._result()

    def _push(self, at_ms: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at_ms, kind, self._seq, payload))

    def _route(self, req: TraceRequest, now: float) -> tuple[EngineIndex, int]:
        """Choose the engine; return it and the best remote match it would load from."""
        n = len(self.engines)
        if not self.mode.cost_aware:
            engine = self._rr_next
            self._rr_next = (self._rr_next + 1) % n
            remote = 0
            if self.provider is not None:
                cands = self.provider.lookup(engine, req.block_ids, include_self=False, now_ms=now)
                remote = cands[0].matched_blocks if cands else 0
            return engine, remote
        chain = req.block_ids
        holders: list[Candidate] = []
        if self.provider is not None:
            # One lookup for every engine. kvrc_kv: the best holder, and the runner-up for
            # the best; kvrc_cost: every holder, since a shorter one may be worth loading
            # where the longest is not.
            holders = self.provider.lookup(self._rr_next, chain, include_self=True, now_ms=now)
            if self.gate is None:
                holders = holders[:2]
            self._rr_next = (self._rr_next + 1) % n
        shared_hit = self._shared_prefix(chain) if self.mode is Mode.UPPER_BOUND else 0
        best: tuple[float, float, int] | None = None
        choice = (0, 0)
        for idx, eng in enumerate(self.engines):
            if self.mode is Mode.UPPER_BOUND:
                local, remote = shared_hit, 0
            else:
                local = eng.cache.local_prefix(chain)
                remote = self._loadable(idx, local, holders, now)
            loaded = max(0, remote - local)
            prefill = self.cost.prefill_ms(req.input_tokens, max(local, remote))
            ready = max(0.0, eng.free_at_ms - now)  # the queue ahead
            if loaded:
                load = self.cost.estimated_load_ms(loaded)
                link_ready = max(0.0, eng.link_free_at_ms - now) + load
                ready = max(ready, link_ready) + REPLICATION_CHARGE * load
            key = (ready + prefill, eng.free_at_ms, idx)
            if best is None or key < best:
                best = key
                choice = (idx, remote)
        return choice

    def _loadable(
        self, engine: EngineIndex, local: int, holders: Sequence[Candidate], now: float
    ) -> int:
        """The match of the holder `engine` would load from (0: none would be granted)."""
        floor = max(local + 1, self.min_blocks)
        for c in holders:
            if c.engine == engine:
                continue
            if self.gate is None:
                # kvrc_kv: the best other holder, if it reaches the static threshold.
                return c.matched_blocks if c.matched_blocks >= self.min_blocks else 0
            if c.matched_blocks < floor:
                break  # longest first: no later holder reaches the floor either
            planned = self.gate.plan(c.engine, engine, floor, c.matched_blocks, now, local)
            if planned is not None:
                return planned[1].ceiling  # the holder kvrc's gate would grant (a probe: its reach)
        return 0

    def _shared_prefix(self, chain: Sequence[BlockId]) -> int:
        return prefix_length(chain, self._shared)

    def _dispatch(self, req: TraceRequest, now: float) -> None:
        engine_idx, remote_hint = self._route(req, now)
        eng = self.engines[engine_idx]
        chain = req.block_ids
        start = max(now, eng.free_at_ms)
        if self.mode is Mode.UPPER_BOUND:
            local = self._shared_prefix(chain)
            self._shared.update(chain)
            end = start + self.cost.prefill_ms(req.input_tokens, local)
            eng.free_at_ms = end
            self._record(req, engine_idx, local, 0, None, end - now)
            return

        local = eng.cache.local_prefix(chain)
        grant: LoadGrant | None = None
        loaded = 0
        if self.provider is not None and remote_hint > local:
            grant = self.provider.acquire(
                engine_idx, chain, max(local + 1, self.min_blocks), now, local
            )
            if grant is None:
                self._c.misses += 1
            elif grant.matched_blocks <= local:
                # The holder no longer has more than we do: recompute.
                self._c.misses += 1
                self.provider.complete(grant, 0, now)
                self.engines[grant.source_engine].cache.unpin(grant.lease_key)
                grant = None
            else:
                self._c.grants += 1
                loaded = grant.matched_blocks - local
                self._check_source_holds(grant, chain)

        # Loaded copies go least recent: they are cheap to load again while the
        # source keeps its original, so the cluster keeps more distinct blocks.
        retained, evicted = eng.cache.admit(chain, cold=chain[local : local + loaded])
        self._publish_removed(engine_idx, evicted, now)
        run_key = ("run", req.request_index)
        eng.cache.pin(run_key, chain)
        self.max_cache_blocks_seen = max(self.max_cache_blocks_seen, len(eng.cache))

        load_start = load_end = now
        if grant is not None:
            load_start = max(now, eng.link_free_at_ms)
            load_end = load_start + self.cost.load_ms(loaded, grant.source_engine, engine_idx)
            eng.link_free_at_ms = load_end
            start = max(start, load_end)
        end = start + self.cost.prefill_ms(req.input_tokens, local + loaded)
        eng.free_at_ms = end
        if grant is not None:
            src = grant.source_engine
            self.loads.append(
                LoadRecord(
                    req.request_index,
                    engine_idx,
                    src,
                    tuple(chain[local : local + loaded]),
                    load_start,
                    load_end,
                )
            )
            duration = load_end - load_start
            self._push(load_end, _LOAD_END, _LoadEnd(grant, engine_idx, loaded, duration))
        self._push(end, _FINISH, _Finish(engine_idx, run_key, tuple(retained), chain))
        self._record(
            req, engine_idx, local, loaded, grant.source_engine if grant else None, end - now
        )

    def _check_source_holds(self, grant: LoadGrant, chain: Sequence[BlockId]) -> None:
        src = self.engines[grant.source_engine].cache
        for b in chain[: grant.matched_blocks]:
            if b not in src.published or not src.is_pinned(b):
                raise AssertionError(
                    f"engine {grant.source_engine} granted block {b} it does not hold pinned"
                )

    def _finish(self, fin: _Finish, now: float) -> None:
        cache = self.engines[fin.engine].cache
        # Publish the computed blocks that are still ours, as chain segments.
        new = set(fin.retained)
        segment: list[BlockId] = []
        parent: BlockId | None = None
        for i, b in enumerate(fin.chain):
            if b in new and b in cache and b not in cache.published:
                if not segment:
                    parent = fin.chain[i - 1] if i else None
                segment.append(b)
            elif segment:
                self._publish_stored(fin.engine, segment, parent, now)
                segment = []
        if segment:
            self._publish_stored(fin.engine, segment, parent, now)
        cache.unpin(fin.run_key)

    def _load_end(self, end: _LoadEnd, now: float) -> None:
        assert self.provider is not None
        if self.gate is not None:
            # The outcome report: what moved and how long it took, per (holder, requester).
            self.gate.observe(
                end.grant.source_engine,
                end.requester,
                end.loaded_blocks,
                end.duration_ms,
                now,
                end.grant.lease_key,
            )
        self.provider.complete(end.grant, end.loaded_blocks, now)
        self.engines[end.grant.source_engine].cache.unpin(end.grant.lease_key)

    def _publish_stored(
        self, engine: EngineIndex, blocks: list[BlockId], parent: BlockId | None, now: float
    ) -> None:
        self.engines[engine].cache.published.update(blocks)
        if self.provider is not None:
            self.provider.blocks_stored(engine, tuple(blocks), parent, now)

    def _publish_removed(self, engine: EngineIndex, evicted: list[BlockId], now: float) -> None:
        # admit() already dropped them from `published`; only computed ones were ever announced.
        if evicted and self.provider is not None:
            self.provider.blocks_removed(engine, tuple(evicted), now)

    def _record(
        self,
        req: TraceRequest,
        engine: EngineIndex,
        local: int,
        loaded: int,
        source: EngineIndex | None,
        ttft_ms: float,
    ) -> None:
        self._c.outcomes.append(
            RequestOutcome(
                req.request_index, engine, len(req.block_ids), local, loaded, source, ttft_ms
            )
        )

    def _result(self) -> ModeResult:
        c = self._c
        local_hit = loaded = total = 0
        cumulative: list[float] = []
        for o in c.outcomes:
            local_hit += o.local_hit_blocks
            loaded += o.loaded_blocks
            total += o.total_blocks
            cumulative.append((local_hit + loaded) / total)
        ttfts = [o.ttft_ms / 1000.0 for o in c.outcomes]
        return ModeResult(
            mode=self.mode,
            requests=len(c.outcomes),
            blocks_total=total,
            blocks_local_hit=local_hit,
            blocks_loaded=loaded,
            blocks_recomputed=total - local_hit - loaded,
            hit_ratio=(local_hit + loaded) / total if total else 0.0,
            ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else 0.0,
            ttft_p90_s=percentile(ttfts, 90) if ttfts else 0.0,
            ttft_p99_s=percentile(ttfts, 99) if ttfts else 0.0,
            load_grants=c.grants,
            load_misses=c.misses,
            cumulative_hit_ratio=tuple(cumulative),
        )


@dataclass(frozen=True, slots=True)
class _Finish:
    engine: EngineIndex
    run_key: LeaseKey
    retained: tuple[BlockId, ...]
    chain: tuple[BlockId, ...]


@dataclass(frozen=True, slots=True)
class _LoadEnd:
    grant: LoadGrant
    requester: EngineIndex
    loaded_blocks: int
    duration_ms: float


def simulate(
    requests: Sequence[TraceRequest],
    mode: Mode,
    *,
    engines: int = DEFAULT_ENGINES,
    capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
    cost: CostModel | None = None,
    provider: ReuseProvider | None = None,
    min_blocks: int = 1,
    gate_config: CostConfig | None = None,
    declared_links: Sequence[DeclaredLink] = (),
) -> ModeResult:
    """Replay `requests` in one mode; kvrc modes run on the local reference provider
    unless one is given, kvrc_cost with a fresh gate (`gate_config`: its defaults)."""
    gate: LoadGate | None = None
    if mode is Mode.KVRC_COST:
        if provider is not None:
            raise ValueError("kvrc_cost runs on the reference provider and its own gate")
        gate = LoadGate(cost if cost is not None else CostModel(), gate_config, declared_links)
    if mode.uses_kvrc and provider is None:
        provider = LocalReferenceProvider(gate)
    sim = TraceSimulation(
        requests,
        mode,
        engines=engines,
        capacity_tokens=capacity_tokens,
        cost=cost,
        provider=provider,
        min_blocks=min_blocks,
        gate=gate,
    )
    return sim.run()


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m benchmarks.trace_sim --trace PATH`: every mode with the reference provider."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--engines", type=int, default=DEFAULT_ENGINES)
    parser.add_argument("--capacity-tokens", type=int, default=DEFAULT_CAPACITY_TOKENS)
    args = parser.parse_args(argv)
    requests = load_trace(args.trace)
    print(f"best possible hit ratio {best_possible_hit_ratio(requests):.4f}")
    for mode in Mode:
        r = simulate(requests, mode, engines=args.engines, capacity_tokens=args.capacity_tokens)
        print(f"{mode:12s} {json.dumps(r.summary())}")


if __name__ == "__main__":
    main()
