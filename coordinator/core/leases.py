"""The two lease state machines: prefix load and decode handoff.

Pure and synchronous: no I/O, no asyncio, no protobuf; time comes in as
`now_ms`. Every mutating method returns the actions the facade must execute
(send a pin / release / abort / quarantine notice, wake a waiter, count a
metric); the core never sends anything itself. A method that raises
`KvrcError` has changed nothing.

I2-flows-separate (docs/invariants.md): prefix loads and handoffs are separate
record types, created and driven by separate methods; a lease id of one flow is
NOT_FOUND to the other.

I6-quiescence, the rules this module keeps:
- the *source* (prefix-load holder / handoff prefill) gets `SendRelease` only
  when every *target* part (requester / decode) reported a terminal outcome,
  acknowledged an abort, or the target engine is proven gone;
- a deadline passing while the target is alive leads to `SendAbort` and a wait
  for every acknowledgement, never to a release; an abort that is never
  acknowledged, or any UNKNOWN outcome, ends in QUARANTINED (fail closed): the
  source is told to keep the blocks out of use. A live target's parts that owe
  a proof (an UNKNOWN outcome, an abort not acknowledged) are sent an abort;
  once each acknowledges it (its reads are quiet) the quarantine ends FAILED
  with a release. Otherwise only an operator resolves it. Never on a timer;
- a source declared gone may be alive (its session was down past the grace):
  its release is still decided, at once if nothing was read, else once every
  target part still reading proved its reads quiet, so that a source that comes
  back and re-announces the lease gets it (`recover_held`);
- a target part that re-registers is asked again for every abort ack it owes
  (`resend_owed_aborts`): an abort or its ack may have been lost with its stream;
- a release is sent at most once per source rank part.

Prefix-load pins: a holder part that never answered its PinRequest by the pin
timeout still gets a `SendRelease` (it may have pinned and its answer be in
flight; the release follows the PinRequest on the same ordered session stream,
so it cannot arrive first). Holder parts that answered 0 blocks hold nothing
and get no release.

Handoff publications: a prefill part that publishes after its handoff ended
receives the terminal state (nothing changes); it must then free its blocks
itself, since no release will follow for a lease it was never part of.

Idempotency: (flow, requester or prefill child engine, request id) names one
lease; repeating it returns that lease, also after it ended, for as long as the
ended lease is retained (`LeaseConfig.terminal_retention_ms` / count bound).
"""

from __future__ import annotations

import enum
import heapq
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TypeVar

from coordinator.core.errors import (
    ErrorCode,
    KvrcError,
    failed_precondition,
    invalid,
    not_found,
    permission_denied,
    resource_exhausted,
)
from coordinator.core.events import BlockHash, RankKey
from coordinator.core.lease_ids import IdCheck, LeaseIdSigner
from kvrc.ids import MAX_GRID_PARTS, parse_child_engine_id

__all__ = [
    "DEADLINE_PASSED",
    "TERMINAL_STATES",
    "Action",
    "Flow",
    "HandoffGrant",
    "HandoffPublished",
    "HandoffReady",
    "LeaseAborting",
    "LeaseConfig",
    "LeaseEnded",
    "LeaseGranted",
    "LeaseMissed",
    "LeaseQuarantined",
    "LeaseState",
    "LeaseStep",
    "LeaseTable",
    "LeaseView",
    "MissReason",
    "Outcome",
    "PrefixLoadGrant",
    "SendAbort",
    "SendPin",
    "SendQuarantine",
    "SendRelease",
    "SourcePart",
    "flow_of_lease_id",
]


class Flow(enum.Enum):
    """Values are the `flow` metric label and `LeaseStatus.flow`."""

    PREFIX_LOAD = "prefix_load"
    HANDOFF = "handoff"

    # Members are singletons compared by identity: hash them in C. Enum's own
    # __hash__ is Python code, and (flow, state) keys are hashed on every lease step.
    __hash__ = object.__hash__


class LeaseState(enum.IntEnum):
    """Values match `kvrc.v1.LeaseState`. No lease is ever RELEASING here (a release
    is sent and the lease is terminal in the same step); a handoff publish answers
    RELEASING for a FAILED handoff whose release awaits the decode's proof of quiet."""

    PINNING = 1
    WAITING_READY = 2
    READY = 3
    ACTIVE = 4
    ABORTING = 5
    RELEASING = 6
    COMPLETED = 7
    FAILED = 8
    QUARANTINED = 9
    RESOLVED = 10
    MISSED = 11


TERMINAL_STATES = frozenset(
    {LeaseState.COMPLETED, LeaseState.FAILED, LeaseState.RESOLVED, LeaseState.MISSED}
)
# Open states in which target parts in `abort_pending` owe the ack of an abort.
_AWAITING_ACKS = frozenset({LeaseState.ABORTING, LeaseState.QUARANTINED})


class Outcome(enum.IntEnum):
    """A target rank part's terminal report; values match `kvrc.v1.TransferOutcome`."""

    SUCCEEDED = 1
    FAILED = 2
    UNKNOWN = 3


class MissReason(enum.Enum):
    """Values are the `reason` label of `kvrc_prefix_load_misses_total`."""

    SHORT_PIN = "short_pin"  # a holder part pinned nothing
    BELOW_MIN_BLOCKS = "below_min_blocks"  # pinned, but fewer than min_blocks
    PIN_TIMEOUT = "pin_timeout"
    HOLDER_GONE = "holder_gone"
    DRAINING = "draining"  # holder or requester drained while pinning
    # I9-cost-gate: the pinned prefix is too short for a load to beat recomputing it.
    RECOMPUTE_CHEAPER = "recompute_cheaper"
    # The shared store did not record the lease (unreachable, lost, or the id taken):
    # its pins were never asked for (coordinator/runtime/lease_ledger.py).
    STORE_REFUSED = "store_refused"
    # The holder parts' descriptors together are more than one grant may carry.
    GRANT_TOO_LARGE = "grant_too_large"


# The longest abort timeout: a holder's safety net trusts a pin deadline (pin timeout +
# TTL + abort timeout, at most 60 + 600 + 1,800 s) up to an hour (clients/holds.py,
# MAX_PIN_TTL_S), so a longer one could let the net free a pin kvrc may still
# quarantine (I6-quiescence).
MAX_ABORT_TIMEOUT_MS = 1_800_000


@dataclass(frozen=True, slots=True)
class LeaseConfig:
    max_open_leases: int = 65_536  # non-terminal (incl. quarantined), both flows
    max_open_leases_per_engine: int = 4_096  # per child engine, as source or target
    # An engine's DP ranks' child engines together: a quarter of max_open_leases, so one
    # engine of many DP ranks cannot take the whole table (I8-bad-input).
    max_open_leases_per_dp_engine: int = 16_384
    # Rebuilt from re-announced held ids (`recover_held`), open at once: a quarter of
    # max_open_leases, so ids an engine re-announces (after a restart, or made up) can
    # never take the table from live grants (I8-bad-input).
    max_recovered_leases: int = 16_384
    # Of those, rebuilt from ids the lease-id key cannot check (untagged, another key's:
    # issued before the key changed, or made up): a quarter, so that made-up ids never
    # keep a holder's verified ids from being rebuilt (I8-bad-input).
    max_unverified_recovered_leases: int = 4_096
    # Of those, one holder engine's, its DP ranks' child engines together: a quarter, so
    # one engine re-announcing made-up ids cannot keep the others' real ones
    # (unverifiable too after a restart without a state file) from being rebuilt
    # (I8-bad-input).
    max_unverified_recovered_leases_per_engine: int = 1_024
    max_chain_blocks: int = 65_536
    max_kv_transfer_params_bytes: int = 1 << 20
    max_pin_timeout_ms: int = 60_000
    max_transfer_ttl_ms: int = 600_000
    # A frozen Mooncake peer blocks a call 30-60 s; give the target that long.
    abort_timeout_ms: int = 60_000
    handoff_heartbeat_timeout_ms: int = 10_000
    # An ACTIVE handoff heartbeats at most this long after its begin, then aborts like a
    # silent one: a decode whose keepalive outlives a stuck read must not pin the
    # prefill's blocks for ever (a P->D read takes seconds).
    handoff_max_lifetime_ms: int = 600_000
    handoff_publish_timeout_ms: int = 60_000  # WAITING_READY this long -> FAILED
    handoff_ready_max_wait_ms: int = 120_000  # READY, never begun -> FAILED
    terminal_retention_ms: int = 600_000
    max_terminal_leases: int = 65_536
    # Bytes of what engines sent that leases keep (kv_transfer_params, descriptors,
    # chains), open and ended together (I8-bad-input): ended leases are dropped first,
    # oldest first; past that a new publish or prefix load is RESOURCE_EXHAUSTED.
    max_payload_bytes: int = 1 << 30
    # Of those, what one engine's open leases keep of what it sent (a requester's chains,
    # a prefill's kv_transfer_params and descriptors): a quarter, so one engine cannot
    # take the shared bound from the others (I8-bad-input). Ended leases do not count:
    # they are dropped before anything is refused.
    max_payload_bytes_per_engine: int = 1 << 28
    # What one grant carries of what engines sent (every source part's descriptor, and a
    # handoff's kv_transfer_params): under the 4 MiB a gRPC client receives by default
    # (kvrc's own clients set no other limit). Past it the grant could not be received,
    # and its blocks would stay pinned for nobody; a prefix load is then a miss, a
    # handoff's publish RESOURCE_EXHAUSTED (I8-bad-input).
    max_grant_payload_bytes: int = 3 << 20

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.handoff_max_lifetime_ms < self.handoff_heartbeat_timeout_ms:
            raise ValueError(
                f"handoff_max_lifetime_ms must be at least handoff_heartbeat_timeout_ms "
                f"({self.handoff_heartbeat_timeout_ms}), got {self.handoff_max_lifetime_ms}"
            )
        if self.abort_timeout_ms > MAX_ABORT_TIMEOUT_MS:
            raise ValueError(
                f"abort_timeout_ms must be at most {MAX_ABORT_TIMEOUT_MS} ms (30 min; a "
                f"holder trusts a pin's deadline up to an hour), got {self.abort_timeout_ms}"
            )


# ---------------------------------------------------------------------------
# Values handed to the facade
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SourcePart:
    """One source rank part's transfer descriptor, passed through untouched."""

    rank_key: RankKey
    descriptor: object
    pinned_blocks: int  # handoff: the handoff's num_blocks


@dataclass(frozen=True, slots=True)
class PrefixLoadGrant:
    lease_id: str
    source_child_engine_id: str
    matched_blocks: int
    source_parts: tuple[SourcePart, ...]  # sorted by rank key
    deadline_ms: int


@dataclass(frozen=True, slots=True)
class HandoffGrant:
    lease_id: str
    prefill_child_engine_id: str
    decode_child_engine_id: str
    source_parts: tuple[SourcePart, ...]  # sorted by rank key
    kv_transfer_params: bytes  # byte for byte as published
    num_blocks: int
    deadline_ms: int  # as of the grant; extend_handoff moves it


@dataclass(frozen=True, slots=True)
class LeaseView:
    """A snapshot of one lease, for RPC answers and `kvrc status`."""

    lease_id: str
    flow: Flow
    state: LeaseState
    request_id: str
    source_child_engine_id: str  # holder / prefill
    target_child_engine_id: str | None  # requester / decode (None: handoff not begun)
    created_ms: int
    deadline_ms: int | None  # of the current state's timer, if any
    reason: str
    parts_reported: int  # prefix load: holder parts answered; handoff: prefill parts
    parts_expected: int
    prefix_load_grant: PrefixLoadGrant | None = None
    handoff_grant: HandoffGrant | None = None
    miss_reason: MissReason | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def quiescent(self) -> bool:
        """True once no native operation can touch the leased blocks any more."""
        return self.state in TERMINAL_STATES


@dataclass(frozen=True, slots=True)
class SendPin:
    child_engine_id: str
    rank_key: RankKey
    lease_id: str
    block_hashes: tuple[BlockHash, ...]
    requester_child_engine_id: str
    # Latest the lease can stay open before it ends or is quarantined (pin timeout + TTL
    # + abort timeout): the holder's safety net waits past it (clients/holds.py, I6).
    deadline_ms: int
    group_idx: int


@dataclass(frozen=True, slots=True)
class SendRelease:
    child_engine_id: str
    rank_key: RankKey
    lease_id: str
    flow: Flow
    reason: str


@dataclass(frozen=True, slots=True)
class SendAbort:
    child_engine_id: str
    rank_key: RankKey
    lease_id: str
    flow: Flow
    reason: str


@dataclass(frozen=True, slots=True)
class SendQuarantine:
    child_engine_id: str
    rank_key: RankKey
    lease_id: str
    flow: Flow
    reason: str


@dataclass(frozen=True, slots=True)
class HandoffReady:
    """Every prefill part reported: wake decode engines waiting in BeginHandoff."""

    lease_id: str
    prefill_child_engine_id: str
    request_id: str


@dataclass(frozen=True, slots=True)
class LeaseGranted:
    lease_id: str
    flow: Flow
    grant_latency_ms: int  # from the lease's creation


@dataclass(frozen=True, slots=True)
class LeaseMissed:
    lease_id: str
    requester_child_engine_id: str
    request_id: str
    reason: MissReason


# Why a lease is aborted when its transfer deadline passes (`LeaseAborting.reason`).
DEADLINE_PASSED = "lease deadline passed"


@dataclass(frozen=True, slots=True)
class LeaseAborting:
    """Counted once per lease in `kvrc_lease_aborts_total` (its SendAborts follow)."""

    lease_id: str
    flow: Flow
    reason: str


@dataclass(frozen=True, slots=True)
class LeaseQuarantined:
    lease_id: str
    flow: Flow
    reason: str


@dataclass(frozen=True, slots=True)
class LeaseEnded:
    lease_id: str
    flow: Flow
    state: LeaseState
    quiescence_ms: int | None  # grant -> end; None if never granted
    lifetime_ms: int
    # Source then targets: whose open leases this one left (a drain of them may be done).
    child_engine_ids: tuple[str, ...]
    ended_ms: int
    request_id: str  # with the source, names a handoff's waiting begins (Grants)


Action = (
    SendPin
    | SendRelease
    | SendAbort
    | SendQuarantine
    | HandoffReady
    | LeaseGranted
    | LeaseMissed
    | LeaseAborting
    | LeaseQuarantined
    | LeaseEnded
)


@dataclass(frozen=True, slots=True)
class LeaseStep:
    view: LeaseView
    actions: tuple[Action, ...]


@dataclass(frozen=True, slots=True)
class HandoffPublished:
    view: LeaseView
    parts_reported: int
    parts_expected: int
    actions: tuple[Action, ...]


# ---------------------------------------------------------------------------
# Internal records (mutable; never leave this module)
# ---------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Lease:
    lease_id: str
    request_id: str
    state: LeaseState
    created_ms: int
    source_child_engine_id: str
    source_rank_keys: tuple[RankKey, ...]
    target_child_engine_id: str | None
    target_rank_keys: tuple[RankKey, ...]
    reason: str = ""
    granted_ms: int | None = None
    deadline_ms: int | None = None  # ACTIVE: transfer / heartbeat deadline
    abort_deadline_ms: int | None = None
    ended_ms: int | None = None
    outcomes: dict[RankKey, Outcome] = field(default_factory=dict)
    abort_pending: set[RankKey] = field(default_factory=set)  # aborted, not yet acked
    abort_acked: set[RankKey] = field(default_factory=set)
    released: set[RankKey] = field(default_factory=set)
    # Rebuilt from a holder's re-announcement after a coordinator restart (recover_held).
    recovered: bool = False
    # A recovered lease's requester as its holder named it ("" = unknown): only that
    # engine may report on it and become its target (_bind_recovered_target).
    named_target: str = ""
    # Ended because its source was declared gone while the target may still read: the
    # source may be alive (a blip past the grace) and come back pinning, so its release
    # is decided once every part in `abort_pending` proved its reads quiet (_source_gone).
    awaiting_quiet: bool = False
    # Bytes of engines' data this lease keeps (LeaseConfig.max_payload_bytes).
    payload_bytes: int = 0
    # Of those, what its requesting engine sent (`_requesting_engine`), counted against
    # that engine's share while the lease is open (max_payload_bytes_per_engine).
    requester_payload_bytes: int = 0
    # Recovered from an id the lease-id key could not check (max_unverified_recovered_leases).
    unverified: bool = False
    # It was QUARANTINED at some point: from then on only proofs (or an operator) end
    # its pins' hold, never a death (`on_engine_gone`).
    was_quarantined: bool = False
    # Its target was proven gone while ACTIVE with reads unsettled: "gone" is a session
    # closed past the grace, and a target alive without its session may still read until
    # the lease's deadline (past it the reader discards what it reads). Released at that
    # deadline, not at once (`_target_gone`); the target's return clears it. Read only
    # while ACTIVE (a report may settle the lease otherwise meanwhile).
    target_gone: bool = False

    @property
    def flow(self) -> Flow:
        raise NotImplementedError


@dataclass(slots=True, eq=False)
class _PrefixLoad(_Lease):
    block_hashes: tuple[BlockHash, ...] = ()
    min_blocks: int = 1
    worthwhile_blocks: int = 1  # the cost gate's floor (I9-cost-gate); >= min_blocks
    pin_blocks: int = 0  # > 0: a probe, the holder pins at most this many chain blocks
    group_idx: int = 0
    pin_deadline_ms: int = 0
    transfer_ttl_ms: int = 0
    pins: dict[RankKey, tuple[int, object]] = field(default_factory=dict)
    matched_blocks: int = 0
    miss_reason: MissReason | None = None

    @property
    def flow(self) -> Flow:
        return Flow.PREFIX_LOAD


@dataclass(slots=True, eq=False)
class _Handoff(_Lease):
    kv_transfer_params: bytes = b""
    num_blocks: int = 0
    decode_restriction: str | None = None  # only this decode engine may begin
    published: dict[RankKey, object] = field(default_factory=dict)
    ready_ms: int | None = None

    @property
    def flow(self) -> Flow:
        return Flow.HANDOFF


_TARGET_WORD = {Flow.PREFIX_LOAD: "requester", Flow.HANDOFF: "decode"}
_SOURCE_WORD = {Flow.PREFIX_LOAD: "holder", Flow.HANDOFF: "prefill"}


_L = TypeVar("_L", bound=_Lease)


def _requesting_engine(lease: _Lease) -> str | None:
    """The engine whose request opened the lease: a prefix load's requester, a
    handoff's prefill (it indexes the lease by request id)."""
    if isinstance(lease, _PrefixLoad):
        return lease.target_child_engine_id
    return lease.source_child_engine_id


def _engine_of(child_engine_id: str) -> str:
    """The engine a child engine is a DP rank of (vLLM's `<engine_id>_dp<rank>`)."""
    return parse_child_engine_id(child_engine_id)[0]


def _dp_engine_of(child_engine_id: str) -> str | None:
    """`_engine_of`, for a child engine named as one of several DP ranks (else None)."""
    engine_id, dp_rank = parse_child_engine_id(child_engine_id)
    return engine_id if dp_rank is not None else None


def _add(counts: dict[str, int], key: str, change: int) -> None:
    """`counts[key] += change`, the key gone at 0: per-engine tallies that lookups and
    bounds read hold only engines with something open."""
    left = counts.get(key, 0) + change
    if left:
        counts[key] = left
    else:
        del counts[key]


def _payload_size(descriptor: object) -> int:
    """What a descriptor weighs (the edges hand them over serialized: bytes)."""
    return len(descriptor) if isinstance(descriptor, bytes | bytearray) else 0


def _grant_bytes(lease: _PrefixLoad | _Handoff) -> int:
    """What the lease's grant carries of what engines sent (LeaseConfig's bound)."""
    if isinstance(lease, _Handoff):
        parts = sum(_payload_size(d) for d in lease.published.values())
        return parts + len(lease.kv_transfer_params)
    return sum(_payload_size(d) for _, d in lease.pins.values())


def _default_ids() -> str:
    return uuid.uuid4().hex


# Default lease ids carry their flow, so a lease a holder re-announces after a
# coordinator restart (`Register.held_leases`) is rebuilt in the right flow.
_FLOW_ID_PREFIX = {Flow.PREFIX_LOAD: "pl-", Flow.HANDOFF: "ho-"}

RECOVERED_REASON = (
    "re-announced by its holder after a coordinator restart: outcome unknown, kept pinned "
    "until every target part reports or an operator resolves it"
)


def flow_of_lease_id(lease_id: str) -> Flow | None:
    """The flow a default lease id names (None: not an id this table issued by default)."""
    for flow, prefix in _FLOW_ID_PREFIX.items():
        if lease_id.startswith(prefix) and len(lease_id) > len(prefix):
            return flow
    return None


LEASE_OWNER_SEPARATOR = "@"


def owner_of_lease_id(lease_id: str) -> str:
    """The replica a lease id names as its owner ("" for an id without one)."""
    _, sep, owner = lease_id.rpartition(LEASE_OWNER_SEPARATOR)
    return owner if sep else ""


class LeaseTable:
    """The in-memory lease store and both state machines.

    With a shared store, the runtime also records every prefix load and its pin counts
    in Redis from the actions this table returns (coordinator/runtime/lease_ledger.py).
    """

    def __init__(
        self,
        config: LeaseConfig | None = None,
        id_factory: Callable[[], str] | None = None,
        id_owner: str = "",
    ) -> None:
        self._config = config if config is not None else LeaseConfig()
        self._new_id = id_factory if id_factory is not None else _default_ids
        # Default ids name their holder under this key (coordinator/core/lease_ids.py).
        self._signer: LeaseIdSigner | None = None
        # With replicas, each id names the replica that owns it (`owner_of_lease_id`).
        self._id_suffix = f"{LEASE_OWNER_SEPARATOR}{id_owner}" if id_owner else ""
        self._flow_ids = id_factory is None  # prefix ids with their flow (see flow_of_lease_id)
        self._leases: dict[str, _Lease] = {}
        self._by_request: dict[tuple[Flow, str, str], str] = {}
        self._by_engine: dict[str, set[str]] = {}  # open leases, as source or target
        # len(_by_engine[e]) per engine, kept per change: lookups read it, never rebuild it.
        self._open_by_engine: dict[str, int] = {}
        self._open_by_engine_view: Mapping[str, int] = MappingProxyType(self._open_by_engine)
        # Per decode engine: open handoffs reserved for it and not begun (`_check_capacity`).
        self._reserved: dict[str, int] = {}
        # Engine id -> its DP ranks' child engines with open leases (`_check_capacity`).
        self._dp_children: dict[str, set[str]] = {}
        self._open_ids: dict[str, None] = {}  # open leases, oldest first
        self._open_counts: Counter[tuple[Flow, LeaseState]] = Counter()
        # (flow, state) counts changed since `take_changed_counts` (the gauge reads only those).
        self._counts_changed: set[tuple[Flow, LeaseState]] = set()
        self._terminal: OrderedDict[str, int] = OrderedDict()  # lease id -> ended_ms
        # Ended leases the purge found still awaiting their target's proof of quiet: kept
        # (a repeated handoff publish must go on hearing RELEASING, not open a new
        # lease), at most a quarter of max_terminal_leases; back to `_terminal` once
        # their release is decided (`_stop_awaiting`).
        self._kept_awaiting: dict[str, None] = {}
        self._payload_bytes = 0  # LeaseConfig.max_payload_bytes
        # Open leases' requester_payload_bytes by requesting engine (absent: none).
        self._open_payload_by_engine: dict[str, int] = {}
        self._recovered_open = 0  # open leases rebuilt by `recover_held`
        self._unverified_open = 0  # of those, from ids the key could not check
        self._unverified_by_holder: dict[str, int] = {}  # and per holder engine (DP ranks')
        # Ended leases awaiting their target's proofs before a release (`awaiting_quiet`),
        # by target engine: its re-registration re-asks, its proven death settles them.
        self._awaiting: dict[str, set[str]] = {}
        self._timers: list[tuple[int, int, str]] = []  # (due_ms, seq, lease id), lazy
        self._timer_seq = 0

    @property
    def config(self) -> LeaseConfig:
        return self._config

    # ------------------------------------------------------------------ reads

    def get(self, lease_id: str) -> LeaseView:
        return self._view(self._lookup(lease_id))

    def knows(self, lease_id: str) -> bool:
        """The table holds the lease (open, or ended and not yet purged)."""
        return lease_id in self._leases

    def find_prefix_load(self, requester_child_engine_id: str, request_id: str) -> LeaseView | None:
        lease_id = self._by_request.get((Flow.PREFIX_LOAD, requester_child_engine_id, request_id))
        return None if lease_id is None else self._view(self._leases[lease_id])

    def find_handoff(self, prefill_child_engine_id: str, request_id: str) -> LeaseView | None:
        lease_id = self._by_request.get((Flow.HANDOFF, prefill_child_engine_id, request_id))
        return None if lease_id is None else self._view(self._leases[lease_id])

    def leases_of(self, child_engine_id: str) -> list[LeaseView]:
        """Open (non-terminal, incl. quarantined) leases with this engine on either side."""
        ids = sorted(self._by_engine.get(child_engine_id, ()))
        return [self._view(self._leases[i]) for i in ids]

    def list_leases(self, *, include_terminal: bool = False) -> list[LeaseView]:
        """Open leases (in flight and quarantined), oldest first; or every retained one."""
        if include_terminal:
            return [self._view(lease) for lease in self._leases.values()]
        return [self._view(self._leases[lease_id]) for lease_id in self._open_ids]

    def open_counts_by_engine(self) -> Mapping[str, int]:
        """Open leases per child engine, as source or target (for lookup ranking).

        A live read-only view, O(1) per call: engines with no open lease are absent.
        """
        return self._open_by_engine_view

    def counts(self) -> dict[tuple[Flow, LeaseState], int]:
        """Open leases by flow and state."""
        return {key: n for key, n in self._open_counts.items() if n > 0}

    def take_changed_counts(self) -> list[tuple[tuple[Flow, LeaseState], int]]:
        """(flow, state) and its open count, for each count changed since the last call
        (the `kvrc_leases` gauge: O(changes), not O(flows x states) per step)."""
        changed = [(key, self._open_counts[key]) for key in self._counts_changed]
        self._counts_changed.clear()
        return changed

    def open_lease_count(self) -> int:
        return sum(self._open_counts.values())

    def retained_lease_count(self) -> int:
        return len(self._leases)

    def pending_timer_count(self) -> int:
        """Timer entries held, live or superseded (bounded; for tests and debugging)."""
        return len(self._timers)

    def next_deadline_ms(self) -> int | None:
        """When `tick` next has work (may be early: stale timers are skipped)."""
        while self._timers and not self._timer_live(self._timers[0]):
            heapq.heappop(self._timers)
        due = self._timers[0][0] if self._timers else None
        if self._terminal:
            purge_at = next(iter(self._terminal.values())) + self._config.terminal_retention_ms
            due = purge_at if due is None else min(due, purge_at)
        return due

    # ------------------------------------------------------------ prefix load

    def open_prefix_load(
        self,
        *,
        request_id: str,
        requester_child_engine_id: str,
        requester_rank_keys: Sequence[RankKey],
        holder_child_engine_id: str,
        holder_rank_keys: Sequence[RankKey],
        block_hashes: Sequence[BlockHash],
        min_blocks: int,
        pin_timeout_ms: int,
        transfer_ttl_ms: int,
        now_ms: int,
        group_idx: int = 0,
        worthwhile_blocks: int = 1,
        pin_blocks: int = 0,
    ) -> LeaseStep:
        """Open a prefix-load lease and ask every holder part to pin.

        Repeating a request id of this requester returns its lease unchanged
        (the holder arguments are then ignored: the first choice stands).
        `worthwhile_blocks` is the cost gate's floor (I9-cost-gate): a pin at or above
        `min_blocks` but below it misses as RECOMPUTE_CHEAPER. `pin_blocks` (0: the
        whole chain) asks the holder for the chain's first blocks only: a probe of a
        cold link (I9-cost-gate).
        """
        cfg = self._config
        _check_id("request_id", request_id)
        _check_id("requester_child_engine_id", requester_child_engine_id)
        chain = tuple(block_hashes)
        if not chain:
            raise invalid("block_hashes is empty: a prefix load needs at least one block")
        if len(chain) > cfg.max_chain_blocks:
            raise invalid(
                f"block_hashes has {len(chain)} blocks, more than the limit {cfg.max_chain_blocks}"
            )
        if type(min_blocks) is not int or not 0 <= min_blocks <= len(chain):
            raise invalid(f"min_blocks must be between 0 and {len(chain)}, got {min_blocks!r}")
        key = (Flow.PREFIX_LOAD, requester_child_engine_id, request_id)
        existing_id = self._by_request.get(key)
        if existing_id is not None:
            existing = self._leases[existing_id]
            assert isinstance(existing, _PrefixLoad)
            if existing.block_hashes != chain or existing.min_blocks != max(min_blocks, 1):
                raise KvrcError(
                    ErrorCode.ALREADY_EXISTS,
                    f"request_id {request_id!r} of {requester_child_engine_id!r} already names "
                    f"prefix-load lease {existing_id} with a different block chain or min_blocks",
                )
            return LeaseStep(self._view(existing), ())
        _check_id("holder_child_engine_id", holder_child_engine_id)
        if holder_child_engine_id == requester_child_engine_id:
            raise invalid(
                f"requester and holder are the same child engine {holder_child_engine_id!r}"
            )
        requester_grid = self._check_grid("requester_rank_keys", requester_rank_keys)
        holder_grid = self._check_grid("holder_rank_keys", holder_rank_keys)
        _check_duration("pin_timeout_ms", pin_timeout_ms, cfg.max_pin_timeout_ms)
        _check_duration("transfer_ttl_ms", transfer_ttl_ms, cfg.max_transfer_ttl_ms)
        if type(group_idx) is not int or group_idx < 0:
            raise invalid(f"group_idx must be an int >= 0, got {group_idx!r}")
        if type(pin_blocks) is not int or (
            pin_blocks and not max(min_blocks, 1) <= pin_blocks <= len(chain)
        ):
            raise invalid(
                f"pin_blocks must be 0 (the whole chain) or between min_blocks ({min_blocks}) "
                f"and {len(chain)}, got {pin_blocks!r}"
            )
        self._check_capacity((requester_child_engine_id, holder_child_engine_id))
        chain_bytes = sum(map(len, chain))
        self._check_payload(chain_bytes, now_ms, requester_child_engine_id)
        lease_id = self._fresh_id(Flow.PREFIX_LOAD, holder_child_engine_id)

        lease = _PrefixLoad(
            lease_id=lease_id,
            request_id=request_id,
            state=LeaseState.PINNING,
            created_ms=now_ms,
            source_child_engine_id=holder_child_engine_id,
            source_rank_keys=holder_grid,
            target_child_engine_id=requester_child_engine_id,
            target_rank_keys=requester_grid,
            reason="waiting for the holder's pins",
            block_hashes=chain,
            min_blocks=max(min_blocks, 1),  # zero blocks is always a miss
            worthwhile_blocks=max(worthwhile_blocks, min_blocks, 1),
            pin_blocks=pin_blocks,
            group_idx=group_idx,
            pin_deadline_ms=now_ms + pin_timeout_ms,
            transfer_ttl_ms=transfer_ttl_ms,
        )
        self._admit(lease, key)
        self._keep_payload(lease, chain_bytes, by_requester=True)
        actions: list[Action] = [
            SendPin(
                child_engine_id=holder_child_engine_id,
                rank_key=rank_key,
                lease_id=lease_id,
                block_hashes=chain[: pin_blocks or len(chain)],
                requester_child_engine_id=requester_child_engine_id,
                deadline_ms=lease.pin_deadline_ms + transfer_ttl_ms + cfg.abort_timeout_ms,
                group_idx=group_idx,
            )
            for rank_key in holder_grid
        ]
        return LeaseStep(self._view(lease), tuple(actions))

    def on_pin_result(
        self,
        lease_id: str,
        holder_child_engine_id: str,
        rank_key: RankKey,
        pinned_blocks: int,
        descriptor: object,
        now_ms: int,
    ) -> LeaseStep:
        """A holder part's answer: how many chain blocks it pinned (0 = a miss)."""
        lease = self._lookup_flow(lease_id, _PrefixLoad)
        self._check_part(lease, holder_child_engine_id, rank_key, source=True)
        asked = lease.pin_blocks or len(lease.block_hashes)
        if type(pinned_blocks) is not int or not 0 <= pinned_blocks <= asked:
            raise invalid(
                f"pinned_blocks must be between 0 and the {asked} blocks the pin asked for, "
                f"got {pinned_blocks!r}"
            )
        previous = lease.pins.get(rank_key)
        if previous is not None:
            if previous != (pinned_blocks, descriptor):
                raise failed_precondition(
                    f"holder part {rank_key} already answered lease {lease_id} with "
                    f"{previous[0]} pinned blocks and a descriptor; answers cannot change"
                )
            return LeaseStep(self._view(lease), ())
        if lease.state is not LeaseState.PINNING:
            # Late answer (timed out, missed, holder drained): its release was already sent.
            return LeaseStep(self._view(lease), ())
        # The holder's answer to a pin it was asked for: not counted against its share
        # (a requester's asks must not exhaust its holders), but within the table's bound.
        # Past it the answer is refused and the pin timeout releases the part.
        self._check_payload(_payload_size(descriptor), now_ms, None)
        actions: list[Action] = []
        lease.pins[rank_key] = (pinned_blocks, descriptor)
        self._keep_payload(lease, _payload_size(descriptor), by_requester=False)
        if _grant_bytes(lease) > self._config.max_grant_payload_bytes:
            self._miss(lease, MissReason.GRANT_TOO_LARGE, now_ms, actions)
        elif pinned_blocks < lease.min_blocks:
            # One short part caps the whole match: miss now, don't wait for the rest.
            reason = MissReason.SHORT_PIN if pinned_blocks == 0 else MissReason.BELOW_MIN_BLOCKS
            self._miss(lease, reason, now_ms, actions)
        elif pinned_blocks < lease.worthwhile_blocks:
            # I9-cost-gate: what is pinned is too short for a load to pay off.
            self._miss(lease, MissReason.RECOMPUTE_CHEAPER, now_ms, actions)
        elif len(lease.pins) == len(lease.source_rank_keys):
            self._grant_prefix_load(lease, now_ms, actions)
        return LeaseStep(self._view(lease), tuple(actions))

    def refuse_by_store(self, lease_id: str, now_ms: int) -> LeaseStep:
        """The shared store did not record a PINNING lease before its pins went out.

        The runtime holds a lease's pin requests until the store has recorded it; refused,
        the lease misses (`store_refused`) with no release, since no holder part was
        asked to pin. A lease past PINNING is left alone (nothing changes)."""
        lease = self._lookup_flow(lease_id, _PrefixLoad)
        actions: list[Action] = []
        if lease.state is LeaseState.PINNING and not lease.pins:
            self._miss(lease, MissReason.STORE_REFUSED, now_ms, actions, release=False)
        return LeaseStep(self._view(lease), tuple(actions))

    def complete_prefix_load(
        self,
        lease_id: str,
        reporter_child_engine_id: str,
        rank_key: RankKey,
        outcome: Outcome,
        now_ms: int,
        reporter_rank_keys: Sequence[RankKey] = (),
    ) -> LeaseStep:
        """A requester part's terminal outcome (`reporter_rank_keys`: see `recover_held`)."""
        lease = self._lookup_flow(lease_id, _PrefixLoad)
        return self._report(
            lease, reporter_child_engine_id, rank_key, outcome, now_ms, reporter_rank_keys
        )

    # ---------------------------------------------------------------- handoff

    def publish_handoff(
        self,
        *,
        request_id: str,
        prefill_child_engine_id: str,
        prefill_rank_keys: Sequence[RankKey],
        rank_key: RankKey,
        descriptor: object,
        kv_transfer_params: bytes,
        decode_child_engine_id: str | None,
        num_blocks: int,
        now_ms: int,
    ) -> HandoffPublished:
        """One prefill part reports its part of a request's KV (READY when all did)."""
        cfg = self._config
        _check_id("request_id", request_id)
        _check_id("prefill_child_engine_id", prefill_child_engine_id)
        if decode_child_engine_id is not None:
            _check_id("decode_child_engine_id", decode_child_engine_id)
            if decode_child_engine_id == prefill_child_engine_id:
                raise invalid(
                    f"decode and prefill are the same child engine {decode_child_engine_id!r}"
                )
        grid = self._check_grid("prefill_rank_keys", prefill_rank_keys)
        if rank_key not in grid:
            # A bad rank, not a foreign caller: INVALID_ARGUMENT (no auth denial counted).
            raise invalid(
                f"rank part {rank_key} is not part of prefill child engine "
                f"{prefill_child_engine_id!r}'s grid of {len(grid)} rank part(s)"
            )
        if type(kv_transfer_params) is not bytes:
            raise invalid("kv_transfer_params must be bytes (encode them with kvrc.kv_params)")
        if len(kv_transfer_params) > cfg.max_kv_transfer_params_bytes:
            raise invalid(
                f"kv_transfer_params are {len(kv_transfer_params)} bytes, more than the limit "
                f"{cfg.max_kv_transfer_params_bytes}"
            )
        if type(num_blocks) is not int or not 0 <= num_blocks <= cfg.max_chain_blocks:
            raise invalid(
                f"num_blocks must be between 0 and {cfg.max_chain_blocks}, got {num_blocks!r}"
            )
        key = (Flow.HANDOFF, prefill_child_engine_id, request_id)
        existing_id = self._by_request.get(key)
        actions: list[Action] = []
        if existing_id is None:
            self._check_grant_size(None, descriptor, len(kv_transfer_params))
            # The decode's share is checked when it begins: a reservation alone must not
            # let one prefill fill another engine's share.
            self._check_capacity((prefill_child_engine_id,))
            self._check_payload(
                len(kv_transfer_params) + _payload_size(descriptor),
                now_ms,
                prefill_child_engine_id,
            )
            lease = _Handoff(
                lease_id=self._fresh_id(Flow.HANDOFF, prefill_child_engine_id),
                request_id=request_id,
                state=LeaseState.WAITING_READY,
                created_ms=now_ms,
                source_child_engine_id=prefill_child_engine_id,
                source_rank_keys=grid,
                target_child_engine_id=None,
                target_rank_keys=(),
                reason="waiting for every prefill part to publish",
                kv_transfer_params=kv_transfer_params,
                num_blocks=num_blocks,
                decode_restriction=decode_child_engine_id,
            )
            self._admit(lease, key)
            self._keep_payload(lease, len(kv_transfer_params), by_requester=True)
        else:
            found = self._leases[existing_id]
            assert isinstance(found, _Handoff)
            lease = found
            _agree(lease, "prefill_rank_keys", lease.source_rank_keys, grid)
            _agree(lease, "kv_transfer_params", lease.kv_transfer_params, kv_transfer_params)
            _agree(lease, "num_blocks", lease.num_blocks, num_blocks)
            _agree(
                lease, "decode_child_engine_id", lease.decode_restriction, decode_child_engine_id
            )
            if rank_key in lease.published:
                if lease.published[rank_key] != descriptor:
                    raise failed_precondition(
                        f"prefill part {rank_key} already published handoff {lease.lease_id} "
                        "with a different descriptor; publications cannot change"
                    )
                return self._published(lease, ())
            if lease.state is not LeaseState.WAITING_READY:
                # Ended before this part arrived: the caller sees the state and frees.
                return self._published(lease, ())
            self._check_grant_size(lease, descriptor)
            self._check_payload(_payload_size(descriptor), now_ms, prefill_child_engine_id)
        lease.published[rank_key] = descriptor
        self._keep_payload(lease, _payload_size(descriptor), by_requester=True)
        if len(lease.published) == len(lease.source_rank_keys):
            lease.ready_ms = now_ms
            lease.reason = "every prefill part published; waiting for the decode engine"
            self._set_state(lease, LeaseState.READY)
            actions.append(HandoffReady(lease.lease_id, prefill_child_engine_id, request_id))
        return self._published(lease, tuple(actions))

    def repeated_publish(
        self,
        *,
        request_id: str,
        prefill_child_engine_id: str,
        rank_key: RankKey,
        descriptor: object,
        kv_transfer_params: bytes,
        decode_child_engine_id: str | None,
        num_blocks: int,
    ) -> HandoffPublished | None:
        """A part's publish that this table already recorded, word for word: its answer
        (state and lease id), changing nothing; None for anything else.

        Answered whatever the prefill's readiness: a part publishes again when its first
        answer was lost, often while a sibling part reconnects, and only an answer that
        names the lease lets kvrc's release reach the held blocks (I6-quiescence)."""
        lease_id = self._by_request.get((Flow.HANDOFF, prefill_child_engine_id, request_id))
        if lease_id is None:
            return None
        lease = self._leases[lease_id]
        assert isinstance(lease, _Handoff)
        if (
            lease.published.get(rank_key) != descriptor
            or lease.kv_transfer_params != kv_transfer_params
            or lease.num_blocks != num_blocks
            or lease.decode_restriction != decode_child_engine_id
        ):
            return None
        return self._published(lease, ())

    def begin_handoff(
        self,
        *,
        request_id: str,
        prefill_child_engine_id: str,
        decode_child_engine_id: str,
        decode_rank_keys: Sequence[RankKey],
        now_ms: int,
    ) -> LeaseStep:
        """The decode engine takes a READY handoff (the facade does the waiting).

        NOT_FOUND: nothing published yet; FAILED_PRECONDITION: not READY (or ended);
        PERMISSION_DENIED: reserved for / already taken by another decode engine.
        The same decode engine asking again gets the same grant.
        """
        _check_id("decode_child_engine_id", decode_child_engine_id)
        lease_id = self._by_request.get((Flow.HANDOFF, prefill_child_engine_id, request_id))
        if lease_id is None:
            raise not_found(
                f"no handoff for request {request_id!r} of prefill child engine "
                f"{prefill_child_engine_id!r} has been published"
            )
        lease = self._leases[lease_id]
        assert isinstance(lease, _Handoff)
        # Named by its request, never its lease id: the id is what a party acts on the
        # lease with (and reports on it after a restart), and this caller may be none.
        handoff = f"the handoff of request {request_id!r}"
        if lease.decode_restriction not in (None, decode_child_engine_id):
            raise permission_denied(
                f"{handoff} is reserved for decode child engine "
                f"{lease.decode_restriction!r}, not {decode_child_engine_id!r}"
            )
        if lease.target_child_engine_id not in (None, decode_child_engine_id):
            raise permission_denied(
                f"{handoff} was already begun by decode child engine "
                f"{lease.target_child_engine_id!r}"
            )
        if lease.state is LeaseState.ACTIVE:
            return LeaseStep(self._view(lease), ())
        if lease.state is not LeaseState.READY:
            detail = (
                f"{len(lease.published)} of {len(lease.source_rank_keys)} prefill parts reported"
                if lease.state is LeaseState.WAITING_READY
                else f"it is {lease.state.name}"
            )
            raise failed_precondition(f"{handoff} is not READY: {detail}")
        if decode_child_engine_id == lease.source_child_engine_id:
            raise invalid(
                f"decode and prefill are the same child engine {decode_child_engine_id!r}"
            )
        grid = self._check_grid("decode_rank_keys", decode_rank_keys)
        # The lease is open already (the total holds it): only the decode's share counts.
        self._check_capacity((decode_child_engine_id,), total=False)
        if lease.decode_restriction is not None:
            _add(self._reserved, lease.decode_restriction, -1)
        lease.target_child_engine_id = decode_child_engine_id
        lease.target_rank_keys = grid
        self._index_engine(decode_child_engine_id, lease.lease_id)
        lease.granted_ms = now_ms
        lease.deadline_ms = now_ms + self._config.handoff_heartbeat_timeout_ms
        lease.reason = "granted; kept alive by heartbeats"
        self._set_state(lease, LeaseState.ACTIVE)
        granted = LeaseGranted(lease.lease_id, Flow.HANDOFF, now_ms - lease.created_ms)
        return LeaseStep(self._view(lease), (granted,))

    def extend_handoff(self, lease_id: str, decode_child_engine_id: str, now_ms: int) -> int:
        """Heartbeat of an ACTIVE handoff lease; returns the new deadline."""
        lease = self._lookup_flow(lease_id, _Handoff)
        if lease.target_child_engine_id is None:
            raise failed_precondition(
                f"handoff lease {lease_id} is {lease.state.name}: it was never begun"
            )
        if lease.target_child_engine_id != decode_child_engine_id:
            raise permission_denied(
                f"handoff lease {lease_id} is not held by decode child engine "
                f"{decode_child_engine_id!r}"
            )
        if lease.state is not LeaseState.ACTIVE:
            raise failed_precondition(
                f"handoff lease {lease_id} is {lease.state.name}; only ACTIVE leases extend"
            )
        assert lease.granted_ms is not None
        cfg = self._config
        last_ms = lease.granted_ms + cfg.handoff_max_lifetime_ms
        if now_ms >= last_ms:
            raise failed_precondition(
                f"handoff lease {lease_id} has been ACTIVE for {now_ms - lease.granted_ms} ms, "
                f"its maximum of {cfg.handoff_max_lifetime_ms} ms "
                "(--handoff-max-lifetime-ms): it is aborted at its deadline"
            )
        assert lease.deadline_ms is not None
        if now_ms >= lease.deadline_ms:
            raise failed_precondition(
                f"handoff lease {lease_id} expired {now_ms - lease.deadline_ms} ms before this "
                f"heartbeat (heartbeat within {cfg.handoff_heartbeat_timeout_ms} ms of "
                "the last)"
            )
        new_deadline = max(
            lease.deadline_ms, min(now_ms + cfg.handoff_heartbeat_timeout_ms, last_ms)
        )
        if new_deadline != lease.deadline_ms:
            lease.deadline_ms = new_deadline
            self._arm(lease)
        return new_deadline

    def complete_handoff(
        self,
        lease_id: str,
        reporter_child_engine_id: str,
        rank_key: RankKey,
        outcome: Outcome,
        now_ms: int,
        reporter_rank_keys: Sequence[RankKey] = (),
    ) -> LeaseStep:
        """A decode part's terminal outcome (`reporter_rank_keys`: see `recover_held`)."""
        lease = self._lookup_flow(lease_id, _Handoff)
        return self._report(
            lease, reporter_child_engine_id, rank_key, outcome, now_ms, reporter_rank_keys
        )

    # ------------------------------------------------------------ both flows

    def on_abort_ack(
        self, lease_id: str, child_engine_id: str, rank_key: RankKey, now_ms: int
    ) -> LeaseStep:
        """A target part confirms it stopped every native operation of the lease."""
        lease = self._lookup(lease_id)
        self._check_part(lease, child_engine_id, rank_key, source=False)
        actions: list[Action] = []
        if lease.state is LeaseState.ABORTING and rank_key in lease.abort_pending:
            lease.abort_pending.discard(rank_key)
            lease.abort_acked.add(rank_key)
            self._settle_if_quiescent(lease, now_ms, actions)
        elif lease.state is LeaseState.QUARANTINED and rank_key in lease.abort_pending:
            # The part's reads are quiet (I6-quiescence): the last proof owed ends it.
            lease.abort_pending.discard(rank_key)
            lease.abort_acked.add(rank_key)
            self._end_quarantine_if_proven(lease, now_ms, actions)
        elif lease.awaiting_quiet and rank_key in lease.abort_pending:
            # Ended with its source gone: the last proof decides the source's release.
            lease.abort_pending.discard(rank_key)
            lease.abort_acked.add(rank_key)
            self._release_once_quiet(lease, actions)
        return LeaseStep(self._view(lease), tuple(actions))

    def resend_owed_aborts(self, child_engine_id: str, rank_key: RankKey) -> list[Action]:
        """A target part (re-)registered: ask it again for every proof it still owes.

        An AbortRequest sent while it was between sessions was dropped, and its ack may
        have been lost with the old stream: without this a live target's quarantine (or
        a gone source's release) would wait for an operator (I6-quiescence)."""
        ids = set(self._by_engine.get(child_engine_id, ())) | self._awaiting.get(
            child_engine_id, set()
        )
        actions: list[Action] = []
        for lease_id in sorted(ids):
            lease = self._leases[lease_id]
            if lease.target_child_engine_id == child_engine_id and lease.target_gone:
                # Back: not gone after all. Its deadline aborts and awaits proofs again.
                lease.target_gone = False
            if (
                lease.target_child_engine_id == child_engine_id
                and rank_key in lease.abort_pending
                and (lease.awaiting_quiet or lease.state in _AWAITING_ACKS)
            ):
                reason = f"asked again after re-registering: {lease.reason}"
                actions.append(SendAbort(child_engine_id, rank_key, lease_id, lease.flow, reason))
        return actions

    def resend_quarantines(
        self, child_engine_id: str, rank_key: RankKey, announced: Collection[str] = ()
    ) -> list[Action]:
        """A source part (re-)registered: tell it again of every quarantined lease it may
        hold. A QuarantineNotice sent while it was between sessions was dropped, and a
        holder that never heard it frees the pins at its own safety-net deadline, with
        reads not proven quiet (I6-quiescence). Not those it just `announced`:
        `recover_held` told it of them."""
        actions: list[Action] = []
        for lease_id in sorted(self._by_engine.get(child_engine_id, ())):
            lease = self._leases[lease_id]
            if (
                lease_id not in announced
                and lease.state is LeaseState.QUARANTINED
                and lease.source_child_engine_id == child_engine_id
                and rank_key in self._pinned_parts(lease)
            ):
                reason = f"told again after re-registering: {lease.reason}"
                actions.append(
                    SendQuarantine(child_engine_id, rank_key, lease_id, lease.flow, reason)
                )
        return actions

    def _end_quarantine_if_proven(self, lease: _Lease, now_ms: int, actions: list[Action]) -> None:
        if lease.abort_pending:
            return
        # A recovered lease also needs every target part's report (the first names it).
        if lease.recovered and len(lease.outcomes) < len(lease.target_rank_keys):
            return
        text = "quarantine ended: every target part proved its reads quiet"
        self._release_and_end(lease, LeaseState.FAILED, text, now_ms, actions)

    def resolve_quarantine(self, lease_id: str, now_ms: int) -> LeaseStep:
        """An operator proved the quarantined blocks quiet: release them."""
        lease = self._lookup(lease_id)
        if lease.state is not LeaseState.QUARANTINED:
            raise failed_precondition(
                f"lease {lease_id} is {lease.state.name}, not QUARANTINED; nothing to resolve"
            )
        actions: list[Action] = []
        reason = "quarantine resolved by an operator"
        self._release_and_end(lease, LeaseState.RESOLVED, reason, now_ms, actions)
        return LeaseStep(self._view(lease), tuple(actions))

    def recover_held(
        self,
        *,
        lease_id: str,
        holder_child_engine_id: str,
        holder_rank_keys: Sequence[RankKey],
        rank_key: RankKey,
        now_ms: int,
        requester_child_engine_id: str = "",
    ) -> LeaseStep:
        """A source part (re-)registers saying it still holds pins for `lease_id`, read by
        `requester_child_engine_id` as far as the holder knows ("" = unknown).

        After a coordinator restart the lease's record is gone and its outcome is
        unknown: it is rebuilt QUARANTINED (fail closed) with this engine as its
        source, and the part is told so. It is released only when every part of
        the target engine reports SUCCEEDED or FAILED for it (the target proves
        quiescence; the first report names the target), or when an operator
        resolves it. Never released on a timer. A requester the holder names is the
        only engine whose reports count (an unnamed one: the first to report), so no
        other engine can end a rebuilt lease while the real requester may still read.

        A lease this table still knows (the session broke, kvrc did not restart)
        changes nothing, except that a part whose release was already decided
        gets it again (the first may have been lost with the old stream). That
        includes a source declared gone that was alive all along: its release is
        decided at once if nothing was read, else once the target proved its reads
        quiet (`_source_gone`).
        """
        _check_id("held lease id", lease_id)
        _check_id("holder_child_engine_id", holder_child_engine_id)
        if requester_child_engine_id:
            _check_id("requester_child_engine_id", requester_child_engine_id)
            if requester_child_engine_id == holder_child_engine_id:
                raise invalid(
                    f"held lease {lease_id}: {holder_child_engine_id!r} names itself as the "
                    "requester; a lease's holder never reads its own blocks"
                )
        grid = self._check_grid("holder_rank_keys", holder_rank_keys)
        if rank_key not in grid:
            raise permission_denied(
                f"rank part {rank_key} is not part of {holder_child_engine_id!r}'s grid"
            )
        existing = self._leases.get(lease_id)
        if existing is not None:
            if existing.source_child_engine_id != holder_child_engine_id:
                raise permission_denied(
                    f"lease {lease_id} is not held by {holder_child_engine_id!r}: it cannot "
                    "re-announce another engine's lease"
                )
            actions: list[Action] = []
            if existing.state in TERMINAL_STATES:
                if rank_key in existing.released:
                    actions.append(
                        SendRelease(
                            holder_child_engine_id,
                            rank_key,
                            lease_id,
                            existing.flow,
                            f"already settled: {existing.reason}",
                        )
                    )
                # Else (its release waits for the target's proofs, or none will come)
                # nothing: the part keeps its pins until the release or its own net,
                # which fires a grace after the latest moment kvrc could quarantine the
                # lease. Telling it to keep them for good (a QuarantineNotice) would strand
                # them where no proof comes: an ended lease is not one an operator can
                # resolve, and it is purged after its retention.
            elif existing.state is LeaseState.QUARANTINED:
                if (
                    existing.recovered
                    and existing.target_child_engine_id is None
                    and not existing.named_target
                ):
                    # Another part of the holder named no requester (an older client).
                    existing.named_target = requester_child_engine_id
                actions.append(
                    SendQuarantine(
                        holder_child_engine_id, rank_key, lease_id, existing.flow, existing.reason
                    )
                )
            return LeaseStep(self._view(existing), tuple(actions))
        flow = flow_of_lease_id(lease_id)
        if flow is None:
            raise invalid(
                f"held lease id {lease_id!r} is not one kvrc issues (no 'pl-' or 'ho-' prefix)"
            )
        signer = self._signer
        check = IdCheck.UNVERIFIABLE
        if signer is not None:
            body = lease_id.rpartition(LEASE_OWNER_SEPARATOR)[0] or lease_id
            check = signer.check(body, holder_child_engine_id)
            if check is IdCheck.FORGED:
                raise permission_denied(
                    f"held lease {lease_id} was not issued to {holder_child_engine_id!r}: "
                    "only its holder may re-announce it"
                )
        cfg = self._config
        if self._recovered_open >= cfg.max_recovered_leases:
            raise resource_exhausted(
                f"{cfg.max_recovered_leases} recovered leases are open, the limit: "
                f"held lease {lease_id} is not rebuilt (resolve the quarantined ones)"
            )
        unverified = check is not IdCheck.ISSUED
        if unverified and self._unverified_open >= cfg.max_unverified_recovered_leases:
            raise resource_exhausted(
                f"{cfg.max_unverified_recovered_leases} leases rebuilt from ids this "
                f"coordinator's key cannot check are open, the limit: held lease {lease_id} "
                "is not rebuilt (resolve the quarantined ones)"
            )
        holder_engine = _engine_of(holder_child_engine_id)
        held = self._unverified_by_holder.get(holder_engine, 0)
        if unverified and held >= cfg.max_unverified_recovered_leases_per_engine:
            raise resource_exhausted(
                f"{held} leases rebuilt from ids of engine {holder_engine!r} (its DP ranks "
                "together) that this coordinator's key cannot check are open, the per-engine "
                f"limit: held lease {lease_id} is not rebuilt (resolve the quarantined ones)"
            )
        self._check_capacity((holder_child_engine_id,))
        kind: type[_Lease] = _PrefixLoad if flow is Flow.PREFIX_LOAD else _Handoff
        lease = kind(
            lease_id=lease_id,
            request_id="",
            state=LeaseState.QUARANTINED,
            created_ms=now_ms,
            source_child_engine_id=holder_child_engine_id,
            source_rank_keys=grid,
            target_child_engine_id=None,
            target_rank_keys=(),
            reason=RECOVERED_REASON,
            recovered=True,
            named_target=requester_child_engine_id,
            unverified=unverified,
        )
        self._admit(lease, None)  # no request id: never indexed by request
        quarantined = LeaseQuarantined(lease_id, flow, RECOVERED_REASON)
        notice = SendQuarantine(holder_child_engine_id, rank_key, lease_id, flow, RECOVERED_REASON)
        return LeaseStep(self._view(lease), (quarantined, notice))

    def tick(self, now_ms: int) -> list[Action]:
        """Fire every timer due at `now_ms` and purge expired ended leases."""
        actions: list[Action] = []
        while self._timers and self._timers[0][0] <= now_ms:
            entry = heapq.heappop(self._timers)
            if self._timer_live(entry):
                self._expire(self._leases[entry[2]], now_ms, actions)
        self._purge(now_ms)
        return actions

    def on_engine_gone(self, child_engine_id: str, now_ms: int) -> list[Action]:
        """The engine is PROVEN gone (sessions closed past grace, not re-registered)."""
        actions: list[Action] = []
        for lease_id in sorted(self._by_engine.get(child_engine_id, ())):
            lease = self._leases[lease_id]
            if lease.source_child_engine_id == child_engine_id:
                self._source_gone(lease, now_ms, actions)
            else:
                self._target_gone(lease, now_ms, actions)
        for lease_id in sorted(self._awaiting.get(child_engine_id, ())):
            # Ended with its source gone, and now its target too: nothing reads any more,
            # unless a part's UNKNOWN outcome stands unproven (fail closed, as in
            # `_settle_if_quiescent`), or it was a quarantine still owed proofs (an abort
            # never acknowledged: a hung read; as `_target_gone` leaves a quarantine to
            # the operator): then no release is decided.
            lease = self._leases[lease_id]
            unproven = any(
                lease.outcomes.get(k) is Outcome.UNKNOWN and k not in lease.abort_acked
                for k in lease.target_rank_keys
            ) or (lease.was_quarantined and bool(lease.abort_pending))
            lease.abort_pending.clear()
            if unproven:
                self._stop_awaiting(lease)
            else:
                self._release_once_quiet(lease, actions)
        return actions

    def abort_engine(self, child_engine_id: str, now_ms: int) -> list[Action]:
        """Drain deadline passed: stop this engine's leases (aborts, never early releases)."""
        actions: list[Action] = []
        reason = f"child engine {child_engine_id!r} is draining"
        for lease_id in sorted(self._by_engine.get(child_engine_id, ())):
            lease = self._leases[lease_id]
            if lease.state is LeaseState.PINNING:
                assert isinstance(lease, _PrefixLoad)
                self._miss(lease, MissReason.DRAINING, now_ms, actions)
            elif lease.state in (LeaseState.WAITING_READY, LeaseState.READY):
                self._release_and_end(lease, LeaseState.FAILED, reason, now_ms, actions)
            elif lease.state is LeaseState.ACTIVE and not lease.target_gone:
                # (One whose target was proven gone ends at its deadline: nobody to ask.)
                self._abort(lease, reason, now_ms, actions)
        return actions

    # ------------------------------------------------------------ transitions

    def _grant_prefix_load(self, lease: _PrefixLoad, now_ms: int, actions: list[Action]) -> None:
        lease.matched_blocks = min(pinned for pinned, _ in lease.pins.values())
        lease.granted_ms = now_ms
        lease.deadline_ms = now_ms + lease.transfer_ttl_ms
        lease.reason = f"granted {lease.matched_blocks} blocks"
        if lease.pin_blocks:
            # I9-cost-gate: the rest is recomputed; this load's outcome measures the link.
            lease.reason += (
                f" (a probe: {lease.pin_blocks} of the chain's {len(lease.block_hashes)} "
                "blocks asked for, the link has no fresh fit, no declaration, and no stand-in "
                "that says the whole load pays)"
            )
        self._set_state(lease, LeaseState.ACTIVE)
        actions.append(LeaseGranted(lease.lease_id, Flow.PREFIX_LOAD, now_ms - lease.created_ms))

    def _miss(
        self,
        lease: _PrefixLoad,
        reason: MissReason,
        now_ms: int,
        actions: list[Action],
        *,
        release: bool = True,
    ) -> None:
        lease.miss_reason = reason
        text = f"miss: {reason.value}"
        if release:
            # Parts that answered 0 hold nothing; all others may hold a pin.
            self._release(lease, text, actions)
        assert lease.target_child_engine_id is not None
        actions.append(
            LeaseMissed(lease.lease_id, lease.target_child_engine_id, lease.request_id, reason)
        )
        self._end(lease, LeaseState.MISSED, text, now_ms, actions)

    def _report(
        self,
        lease: _Lease,
        reporter_child_engine_id: str,
        rank_key: RankKey,
        outcome: Outcome,
        now_ms: int,
        reporter_rank_keys: Sequence[RankKey] = (),
    ) -> LeaseStep:
        if not isinstance(outcome, Outcome):
            raise invalid(f"outcome must be SUCCEEDED, FAILED or UNKNOWN, got {outcome!r}")
        if lease.recovered and lease.target_child_engine_id is None:
            if lease.state in TERMINAL_STATES:
                # Ended before any target reported (resolved, or its holder gone): a
                # late report binds nothing, or the ended lease would stay indexed
                # under the reporter after its purge.
                return LeaseStep(self._view(lease), ())
            self._bind_recovered_target(
                lease, reporter_child_engine_id, reporter_rank_keys, rank_key
            )
        if (
            reporter_child_engine_id == lease.target_child_engine_id
            and rank_key not in lease.target_rank_keys
        ):
            # A bad rank, not a foreign caller: INVALID_ARGUMENT (no auth denial counted).
            raise invalid(
                f"rank part {rank_key} is not one of the {len(lease.target_rank_keys)} "
                f"{_TARGET_WORD[lease.flow]} part(s) of lease {lease.lease_id}"
            )
        self._check_part(lease, reporter_child_engine_id, rank_key, source=False)
        if lease.recovered and lease.state is LeaseState.QUARANTINED:
            return self._report_recovered(lease, rank_key, outcome, now_ms)
        if _earlier_outcome(lease, rank_key, outcome) is not None:
            return LeaseStep(self._view(lease), ())  # a repeat
        if rank_key in lease.abort_acked:
            return LeaseStep(self._view(lease), ())  # its abort ack already settled it
        actions: list[Action] = []
        owing = rank_key in lease.abort_pending
        if owing and (lease.awaiting_quiet or lease.state is LeaseState.QUARANTINED):
            # A part asked for a proof reports instead: SUCCEEDED or FAILED is one (its
            # reads ended), UNKNOWN is not (it still owes the abort's ack).
            lease.outcomes[rank_key] = outcome
            if outcome is not Outcome.UNKNOWN:
                lease.abort_pending.discard(rank_key)
                if lease.awaiting_quiet:
                    self._release_once_quiet(lease, actions)
                else:
                    self._end_quarantine_if_proven(lease, now_ms, actions)
            return LeaseStep(self._view(lease), tuple(actions))
        if lease.state in (LeaseState.PINNING, LeaseState.WAITING_READY, LeaseState.READY):
            raise failed_precondition(
                f"lease {lease.lease_id} is {lease.state.name}: nothing was granted to report on"
            )
        if lease.state in (LeaseState.ACTIVE, LeaseState.ABORTING):
            lease.outcomes[rank_key] = outcome
            lease.abort_pending.discard(rank_key)
            self._settle_if_quiescent(lease, now_ms, actions)
        # QUARANTINED or ended: a late report changes nothing (fail closed).
        return LeaseStep(self._view(lease), tuple(actions))

    def _bind_recovered_target(
        self, lease: _Lease, reporter: str, reporter_rank_keys: Sequence[RankKey], rank_key: RankKey
    ) -> None:
        # The first report on a recovered lease names its target; checks first, then binds.
        _check_id("reporter_child_engine_id", reporter)
        if reporter == lease.source_child_engine_id:
            raise permission_denied(
                f"{reporter!r} holds lease {lease.lease_id}; only its target may report on it"
            )
        if lease.named_target and reporter != lease.named_target:
            raise permission_denied(
                f"{reporter!r} is not the requester of recovered lease {lease.lease_id}: its "
                f"holder names {lease.named_target!r}"
            )
        if not reporter_rank_keys:
            raise failed_precondition(
                f"{reporter!r} is not registered: register before reporting on "
                f"recovered lease {lease.lease_id}"
            )
        grid = self._check_grid("reporter_rank_keys", reporter_rank_keys)
        if rank_key not in grid:
            raise permission_denied(f"rank part {rank_key} is not part of {reporter!r}'s grid")
        lease.target_child_engine_id = reporter
        lease.target_rank_keys = grid
        self._index_engine(reporter, lease.lease_id)

    def _report_recovered(
        self, lease: _Lease, rank_key: RankKey, outcome: Outcome, now_ms: int
    ) -> LeaseStep:
        if _earlier_outcome(lease, rank_key, outcome) is not None:
            return LeaseStep(self._view(lease), ())  # a repeat
        lease.outcomes[rank_key] = outcome
        actions: list[Action] = []
        outcomes = lease.outcomes.values()
        if outcome is Outcome.UNKNOWN:
            # Its ack, once its reads are quiet, is the proof this part owes.
            lease.reason = "recovered after a restart; a target part reported UNKNOWN"
            lease.abort_pending.add(rank_key)
            self._send_aborts(lease, [rank_key], lease.reason, actions)
        elif len(lease.outcomes) == len(lease.target_rank_keys) and Outcome.UNKNOWN not in outcomes:
            # The target proved quiescence for every part: the holder may unpin.
            self._settle_if_quiescent(lease, now_ms, actions)
        else:
            self._end_quarantine_if_proven(lease, now_ms, actions)
        return LeaseStep(self._view(lease), tuple(actions))

    def _settle_if_quiescent(
        self, lease: _Lease, now_ms: int, actions: list[Action], *, target_gone: bool = False
    ) -> None:
        if not target_gone:
            settled = len(lease.outcomes) + len(lease.abort_acked)
            if settled < len(lease.target_rank_keys):
                return
        outcomes = lease.outcomes.values()
        if Outcome.UNKNOWN in outcomes:
            text = "a transfer part reported an UNKNOWN outcome"
            self._quarantine(lease, text, actions, await_proofs=not target_gone)
        elif (
            not target_gone
            and all(o is Outcome.SUCCEEDED for o in outcomes)
            and not (lease.abort_acked)
        ):
            self._release(lease, "quiescent: every part succeeded", actions)
            self._end(lease, LeaseState.COMPLETED, "every part succeeded", now_ms, actions)
        else:
            text = (
                f"{_TARGET_WORD[lease.flow]} engine gone"
                if target_gone
                else "quiescent: a part failed or was aborted"
            )
            self._release_and_end(lease, LeaseState.FAILED, text, now_ms, actions)

    def _abort(self, lease: _Lease, reason: str, now_ms: int, actions: list[Action]) -> None:
        pending = [k for k in lease.target_rank_keys if k not in lease.outcomes]
        lease.abort_pending = set(pending)
        lease.abort_deadline_ms = now_ms + self._config.abort_timeout_ms
        lease.reason = reason
        self._set_state(lease, LeaseState.ABORTING)
        self._send_aborts(lease, pending, reason, actions)

    @staticmethod
    def _send_aborts(
        lease: _Lease, pending: list[RankKey], reason: str, actions: list[Action]
    ) -> None:
        actions.append(LeaseAborting(lease.lease_id, lease.flow, reason))
        actions.extend(_abort_messages(lease, pending, reason))

    def _quarantine(
        self, lease: _Lease, reason: str, actions: list[Action], *, await_proofs: bool
    ) -> None:
        """Fail closed. With `await_proofs` (the target is alive), every target part that
        owes a proof of quiet reads (UNKNOWN outcome, or an abort still unacknowledged)
        gets an abort: its ack is that proof (`on_abort_ack`)."""
        lease.reason = reason
        lease.was_quarantined = True
        self._set_state(lease, LeaseState.QUARANTINED)
        actions.append(LeaseQuarantined(lease.lease_id, lease.flow, reason))
        actions.extend(
            SendQuarantine(lease.source_child_engine_id, k, lease.lease_id, lease.flow, reason)
            for k in self._pinned_parts(lease)
        )
        if not await_proofs:
            lease.abort_pending.clear()  # nobody left to prove anything: an operator's call
            return
        lease.abort_pending.update(
            k
            for k in lease.target_rank_keys
            if lease.outcomes.get(k) is Outcome.UNKNOWN and k not in lease.abort_acked
        )
        # Also the parts whose abort went unacknowledged: it (or its ack) may have been lost.
        owing = sorted(lease.abort_pending)
        if owing:
            self._send_aborts(lease, owing, f"quarantined: {reason}", actions)

    def _expire(self, lease: _Lease, now_ms: int, actions: list[Action]) -> None:
        state = lease.state
        if state is LeaseState.PINNING:
            assert isinstance(lease, _PrefixLoad)
            self._miss(lease, MissReason.PIN_TIMEOUT, now_ms, actions)
        elif state is LeaseState.WAITING_READY:
            text = "not every prefill part published in time"
            self._release_and_end(lease, LeaseState.FAILED, text, now_ms, actions)
        elif state is LeaseState.READY:
            text = "no decode engine began the handoff in time"
            self._release_and_end(lease, LeaseState.FAILED, text, now_ms, actions)
        elif state is LeaseState.ACTIVE:
            if lease.target_gone:
                # Proven gone, and now past the deadline its reads had: nothing can land.
                self._settle_if_quiescent(lease, now_ms, actions, target_gone=True)
            else:
                # The target is alive: abort, don't release.
                self._abort(lease, DEADLINE_PASSED, now_ms, actions)
        elif state is LeaseState.ABORTING:
            # A late ack still proves quiet: abort_pending stays awaited.
            self._quarantine(lease, "abort not acknowledged in time", actions, await_proofs=True)

    def _source_gone(self, lease: _Lease, now_ms: int, actions: list[Action]) -> None:
        # "Proven gone" is a session closed past the grace: the process may be alive (a
        # blip) and come back still pinning. Record its release as decided wherever that
        # is safe, so that `recover_held` re-sends it to a source that re-announces.
        text = f"{_SOURCE_WORD[lease.flow]} engine gone"
        state = lease.state
        if lease.target_gone and state is LeaseState.ACTIVE:
            # Its target is proven gone too: the deadline decides the release, as before
            # (kept for the source's next session if it comes back).
            return
        if state is LeaseState.PINNING:
            assert isinstance(lease, _PrefixLoad)
            # Nothing was granted, so nothing was read: the release is safe now.
            self._miss(lease, MissReason.HOLDER_GONE, now_ms, actions)
            return
        if state in (LeaseState.WAITING_READY, LeaseState.READY):
            # A handoff nobody began: nothing was read either.
            self._release_and_end(lease, LeaseState.FAILED, text, now_ms, actions)
            return
        awaiting_proofs = (
            state is LeaseState.QUARANTINED and bool(lease.abort_pending) and not lease.recovered
        )
        if state not in (LeaseState.ACTIVE, LeaseState.ABORTING) and not awaiting_proofs:
            # QUARANTINED with no proof to wait for (quarantined once its target was gone,
            # or a recovered lease): fail closed (operator's call).
            self._end(lease, LeaseState.FAILED, text, now_ms, actions)
            return
        # The target may still read (I6-quiescence): each part not yet proven quiet is
        # told to stop, and the release waits for its proof (`_release_once_quiet`). A
        # quarantine that awaits proofs ends the same way, so a source back from a blip
        # gets its release once they came (no operator can resolve an ended lease).
        owing = [
            k
            for k in lease.target_rank_keys
            if k not in lease.abort_acked and lease.outcomes.get(k) in (None, Outcome.UNKNOWN)
        ]
        untold = [k for k in owing if k not in lease.abort_pending]
        if untold:
            if state is LeaseState.ACTIVE:
                self._send_aborts(lease, untold, text, actions)
            else:  # ABORTING or QUARANTINED: already counted once
                actions.extend(_abort_messages(lease, untold, text))
        lease.abort_pending = set(owing)
        self._end(lease, LeaseState.FAILED, text, now_ms, actions)
        assert owing, "an ACTIVE or ABORTING lease has a part not yet settled"
        assert lease.target_child_engine_id is not None
        lease.awaiting_quiet = True
        self._awaiting.setdefault(lease.target_child_engine_id, set()).add(lease.lease_id)

    def _release_once_quiet(self, lease: _Lease, actions: list[Action]) -> None:
        """An ended lease whose source was declared gone: release once no read can land."""
        if lease.abort_pending:
            return
        self._stop_awaiting(lease)
        word = _TARGET_WORD[lease.flow]
        self._release(lease, f"ended ({lease.reason}); the {word} proved its reads quiet", actions)

    def _stop_awaiting(self, lease: _Lease) -> None:
        lease.awaiting_quiet = False
        if lease.lease_id in self._kept_awaiting:
            # Kept past the purge for its release: it ages out as any ended lease now.
            del self._kept_awaiting[lease.lease_id]
            assert lease.ended_ms is not None
            self._terminal[lease.lease_id] = lease.ended_ms
        target = lease.target_child_engine_id
        if target is not None and target in self._awaiting:
            waiting = self._awaiting[target]
            waiting.discard(lease.lease_id)
            if not waiting:
                del self._awaiting[target]

    def _target_gone(self, lease: _Lease, now_ms: int, actions: list[Action]) -> None:
        text = f"{_TARGET_WORD[lease.flow]} engine gone"
        if (
            lease.state is LeaseState.ACTIVE
            and Outcome.UNKNOWN not in lease.outcomes.values()
            and lease.deadline_ms is not None
            and lease.deadline_ms > now_ms
        ):
            # Its reads may still land until the deadline (I6-quiescence): released then.
            lease.target_gone = True
            lease.reason = f"{text}; released at the lease's deadline"
            return
        if lease.state in (LeaseState.ACTIVE, LeaseState.ABORTING):
            self._settle_if_quiescent(lease, now_ms, actions, target_gone=True)
        elif lease.state in (LeaseState.PINNING, LeaseState.WAITING_READY, LeaseState.READY):
            # Nothing was granted (or the handoff was reserved for this decode engine).
            self._release_and_end(lease, LeaseState.FAILED, text, now_ms, actions)
        # QUARANTINED stays for the operator (fail closed).

    # ------------------------------------------------------------ bookkeeping

    def _pinned_parts(self, lease: _Lease) -> list[RankKey]:
        """Source parts that may hold something for this lease."""
        if lease.recovered:
            return list(lease.source_rank_keys)  # any part may hold; each re-announces its own
        if isinstance(lease, _PrefixLoad):
            return [
                k
                for k in lease.source_rank_keys
                if k not in lease.pins or lease.pins[k][0] > 0  # unanswered may have pinned
            ]
        assert isinstance(lease, _Handoff)
        return [k for k in lease.source_rank_keys if k in lease.published]

    def _release(self, lease: _Lease, reason: str, actions: list[Action]) -> None:
        for rank_key in self._pinned_parts(lease):
            if rank_key not in lease.released:
                lease.released.add(rank_key)
                actions.append(
                    SendRelease(
                        lease.source_child_engine_id, rank_key, lease.lease_id, lease.flow, reason
                    )
                )

    def _release_and_end(
        self, lease: _Lease, state: LeaseState, reason: str, now_ms: int, actions: list[Action]
    ) -> None:
        """The source parts that may hold pins are released, then the lease ends."""
        self._release(lease, reason, actions)
        self._end(lease, state, reason, now_ms, actions)

    def _end(
        self, lease: _Lease, state: LeaseState, reason: str, now_ms: int, actions: list[Action]
    ) -> None:
        assert state in TERMINAL_STATES and lease.state not in TERMINAL_STATES
        lease.reason = reason
        lease.ended_ms = now_ms
        self._set_state(lease, state)
        engines = (lease.source_child_engine_id, *self._target_engines(lease))
        for engine in engines:
            ids = self._by_engine.get(engine)
            if ids is not None and lease.lease_id in ids:
                ids.discard(lease.lease_id)
                if ids:
                    self._open_by_engine[engine] = len(ids)
                else:
                    del self._by_engine[engine]
                    del self._open_by_engine[engine]
                    parent = _dp_engine_of(engine)
                    if parent is not None:
                        children = self._dp_children[parent]
                        children.discard(engine)
                        if not children:
                            del self._dp_children[parent]
        del self._open_ids[lease.lease_id]
        reserved_for = self._reserved_for(lease)
        if reserved_for is not None:
            _add(self._reserved, reserved_for, -1)
        self._free_requester_share(lease)
        if lease.recovered:
            self._recovered_open -= 1
        if lease.unverified:
            self._unverified_open -= 1
            _add(self._unverified_by_holder, _engine_of(lease.source_child_engine_id), -1)
        self._terminal[lease.lease_id] = now_ms
        quiescence = None if lease.granted_ms is None else now_ms - lease.granted_ms
        actions.append(
            LeaseEnded(
                lease.lease_id,
                lease.flow,
                state,
                quiescence,
                now_ms - lease.created_ms,
                engines,
                now_ms,
                lease.request_id,
            )
        )
        if len(self._terminal) > self._config.max_terminal_leases:
            self._purge(now_ms)

    def _set_state(self, lease: _Lease, state: LeaseState) -> None:
        if lease.state not in TERMINAL_STATES:
            key = (lease.flow, lease.state)
            self._open_counts[key] -= 1
            self._counts_changed.add(key)
        lease.state = state
        if state not in TERMINAL_STATES:
            key = (lease.flow, state)
            self._open_counts[key] += 1
            self._counts_changed.add(key)
        self._arm(lease)

    def _admit(self, lease: _Lease, key: tuple[Flow, str, str] | None) -> None:
        self._leases[lease.lease_id] = lease
        self._open_ids[lease.lease_id] = None
        if lease.recovered:
            self._recovered_open += 1
        if lease.unverified:
            self._unverified_open += 1
            _add(self._unverified_by_holder, _engine_of(lease.source_child_engine_id), 1)
        if key is not None:
            self._by_request[key] = lease.lease_id
        count_key = (lease.flow, lease.state)
        self._open_counts[count_key] += 1
        self._counts_changed.add(count_key)
        for engine in (lease.source_child_engine_id, *self._target_engines(lease)):
            self._index_engine(engine, lease.lease_id)
        reserved_for = self._reserved_for(lease)
        if reserved_for is not None:
            _add(self._reserved, reserved_for, 1)
        self._arm(lease)

    @staticmethod
    def _reserved_for(lease: _Lease) -> str | None:
        """The decode engine a handoff not yet begun is reserved for, if any."""
        if isinstance(lease, _Handoff) and lease.target_child_engine_id is None:
            return lease.decode_restriction
        return None

    def _index_engine(self, engine: str, lease_id: str) -> None:
        ids = self._by_engine.setdefault(engine, set())
        parent = _dp_engine_of(engine) if not ids else None
        if parent is not None:
            self._dp_children.setdefault(parent, set()).add(engine)
        ids.add(lease_id)
        self._open_by_engine[engine] = len(ids)

    @staticmethod
    def _target_engines(lease: _Lease) -> list[str]:
        engines = []
        if lease.target_child_engine_id is not None:
            engines.append(lease.target_child_engine_id)
        if isinstance(lease, _Handoff) and lease.decode_restriction not in (None, *engines):
            assert lease.decode_restriction is not None
            engines.append(lease.decode_restriction)
        return engines

    def _timer_due(self, lease: _Lease) -> int | None:
        state = lease.state
        if state is LeaseState.PINNING:
            assert isinstance(lease, _PrefixLoad)
            return lease.pin_deadline_ms
        if state is LeaseState.WAITING_READY:
            return lease.created_ms + self._config.handoff_publish_timeout_ms
        if state is LeaseState.READY:
            assert isinstance(lease, _Handoff) and lease.ready_ms is not None
            return lease.ready_ms + self._config.handoff_ready_max_wait_ms
        if state is LeaseState.ACTIVE:
            return lease.deadline_ms
        if state is LeaseState.ABORTING:
            return lease.abort_deadline_ms
        return None

    def _arm(self, lease: _Lease) -> None:
        due = self._timer_due(lease)
        if due is not None:
            self._timer_seq += 1
            heapq.heappush(self._timers, (due, self._timer_seq, lease.lease_id))
        # Superseded timers stay until due; a client extending in a tight loop must not
        # grow the heap without bound, so rebuild it from live entries when stale ones pile up.
        if len(self._timers) > 2 * len(self._leases) + 64:
            self._timers = [entry for entry in self._timers if self._timer_live(entry)]
            heapq.heapify(self._timers)

    def _timer_live(self, entry: tuple[int, int, str]) -> bool:
        lease = self._leases.get(entry[2])
        return lease is not None and self._timer_due(lease) == entry[0]

    def _purge(self, now_ms: int, room_bytes: int = 0) -> None:
        """Drops ended leases, oldest first, past their retention or count, or until
        `room_bytes` more payload fits under max_payload_bytes."""
        cfg = self._config
        while self._terminal:
            lease_id, ended_ms = next(iter(self._terminal.items()))
            if (
                len(self._terminal) <= cfg.max_terminal_leases
                and ended_ms + cfg.terminal_retention_ms > now_ms
                and self._payload_bytes + room_bytes <= cfg.max_payload_bytes
            ):
                break
            del self._terminal[lease_id]
            if (
                self._leases[lease_id].awaiting_quiet
                and len(self._kept_awaiting) < cfg.max_terminal_leases // 4
            ):
                self._kept_awaiting[lease_id] = None
                continue
            lease = self._leases.pop(lease_id)
            self._payload_bytes -= lease.payload_bytes
            if lease.awaiting_quiet:
                self._stop_awaiting(lease)  # a source still pinning re-announces it quarantined
            if lease.recovered:
                continue  # never indexed by request id
            owner = _requesting_engine(lease)
            assert owner is not None
            self._by_request.pop((lease.flow, owner, lease.request_id), None)

    def _check_grant_size(
        self, lease: _Handoff | None, descriptor: object, params_bytes: int = 0
    ) -> None:
        """A handoff part's publish that would make the grant larger than one message
        may carry is refused; nothing changes (LeaseConfig.max_grant_payload_bytes)."""
        carried = _grant_bytes(lease) if lease is not None else params_bytes
        total = carried + _payload_size(descriptor)
        limit = self._config.max_grant_payload_bytes
        if total > limit:
            raise resource_exhausted(
                f"the handoff's kv_transfer_params and descriptors would be {total} bytes, "
                f"more than one grant may carry ({limit}): publish smaller descriptors"
            )

    def _check_payload(self, more: int, now_ms: int, requester: str | None) -> None:
        """RESOURCE_EXHAUSTED if `more` bytes that `requester` sends do not fit in its
        share (None: counted in no share), or in the table even once the ended leases
        are dropped (nothing changes then but that)."""
        cfg = self._config
        own = 0 if requester is None else self._open_payload_by_engine.get(requester, 0)
        if requester is not None and own + more > cfg.max_payload_bytes_per_engine:
            raise resource_exhausted(
                f"child engine {requester!r}'s open leases keep {own} bytes of its chains, "
                f"kv_transfer_params and descriptors; {more} more would pass the "
                f"per-engine limit {cfg.max_payload_bytes_per_engine}: retry after some end"
            )
        if self._payload_bytes + more <= cfg.max_payload_bytes:
            return
        self._purge(now_ms, room_bytes=more)
        if self._payload_bytes + more > cfg.max_payload_bytes:
            raise resource_exhausted(
                f"open leases keep {self._payload_bytes} bytes of engines' descriptors, "
                f"parameters and chains; {more} more would pass the limit "
                f"{cfg.max_payload_bytes}: retry after some end"
            )

    def _keep_payload(self, lease: _Lease, size: int, *, by_requester: bool) -> None:
        lease.payload_bytes += size
        self._payload_bytes += size
        if by_requester and size:
            lease.requester_payload_bytes += size
            engine = _requesting_engine(lease)
            assert engine is not None
            _add(self._open_payload_by_engine, engine, size)

    def _free_requester_share(self, lease: _Lease) -> None:
        """An ended lease no longer counts against its requester's share."""
        if not lease.requester_payload_bytes:
            return
        engine = _requesting_engine(lease)
        assert engine is not None
        _add(self._open_payload_by_engine, engine, -lease.requester_payload_bytes)

    @property
    def payload_bytes(self) -> int:
        """Bytes of engines' data the table keeps (open and ended leases)."""
        return self._payload_bytes

    def _check_capacity(self, engines: Iterable[str], *, total: bool = True) -> None:
        cfg = self._config
        if total and self.open_lease_count() >= cfg.max_open_leases:
            raise resource_exhausted(
                f"{cfg.max_open_leases} leases are open, the limit; retry after some end"
            )
        adds: Counter[str] = Counter()  # per DP engine: the new lease counts once per child
        for engine in engines:
            if self._share(engine) >= cfg.max_open_leases_per_engine:
                raise resource_exhausted(
                    f"child engine {engine!r} has {cfg.max_open_leases_per_engine} open leases, "
                    "the per-engine limit"
                )
            parent = _dp_engine_of(engine)
            if parent is not None:  # else one child engine: its own share is the engine's
                adds[parent] += 1
        for parent, added in adds.items():
            # O(DP ranks): the engine's child engines with open leases.
            held = sum(self._share(child) for child in self._dp_children.get(parent, ()))
            if held + added > cfg.max_open_leases_per_dp_engine:
                raise resource_exhausted(
                    f"engine {parent!r} (its DP ranks together) has {held} open leases, "
                    f"the per-engine limit of {cfg.max_open_leases_per_dp_engine}"
                )

    def _share(self, engine: str) -> int:
        """What counts against a child engine's share: its open leases but the handoffs
        reserved for it and not begun (indexed under it, since its loss ends them, but
        counted against their prefill only)."""
        return len(self._by_engine.get(engine, ())) - self._reserved.get(engine, 0)

    def _check_grid(self, name: str, rank_keys: Sequence[RankKey]) -> tuple[RankKey, ...]:
        grid = tuple(rank_keys)
        if not grid:
            raise invalid(f"{name} is empty: a child engine has at least one rank part")
        if len(grid) > MAX_GRID_PARTS:
            raise invalid(
                f"{name} has {len(grid)} rank parts, more than the limit {MAX_GRID_PARTS}"
            )
        for key in grid:
            if (
                type(key) is not tuple
                or len(key) != 3
                or not all(type(x) is int and x >= 0 for x in key)
            ):
                raise invalid(f"{name} holds {key!r}; expected (tp_rank, pp_rank, pcp_rank) >= 0")
        if len(set(grid)) != len(grid):
            raise invalid(f"{name} lists a rank part twice")
        return tuple(sorted(grid))

    def set_id_key(self, key: bytes) -> None:
        """From now on, default ids carry a tag naming their holder under `key`, and a
        re-announced id that this key says was issued to another holder is refused."""
        self._signer = LeaseIdSigner(key)

    def _fresh_id(self, flow: Flow, holder_child_engine_id: str) -> str:
        body = self._new_id()
        if self._flow_ids:
            body = _FLOW_ID_PREFIX[flow] + body
            if self._signer is not None:
                body += self._signer.tag(body, holder_child_engine_id)
        lease_id = body + self._id_suffix
        if not lease_id or lease_id in self._leases:
            raise RuntimeError(f"lease id factory returned an empty or reused id {lease_id!r}")
        return lease_id

    def _lookup(self, lease_id: str) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise not_found(f"no lease {lease_id!r} (unknown, or ended and purged)")
        return lease

    def _lookup_flow(self, lease_id: str, kind: type[_L]) -> _L:
        lease = self._lookup(lease_id)
        if not isinstance(lease, kind):
            wanted = "prefix-load" if kind is _PrefixLoad else "handoff"
            raise not_found(f"lease {lease_id!r} is not a {wanted} lease")
        return lease

    def _check_part(
        self, lease: _Lease, child_engine_id: str, rank_key: RankKey, *, source: bool
    ) -> None:
        """The caller is a source (holder, prefill) or else a target (requester, decode) part."""
        owner: str | None
        if source:
            owner, keys, word = lease.source_child_engine_id, lease.source_rank_keys, _SOURCE_WORD
        else:
            owner, keys, word = lease.target_child_engine_id, lease.target_rank_keys, _TARGET_WORD
        if child_engine_id != owner or rank_key not in keys:
            raise permission_denied(
                f"{child_engine_id!r} rank part {rank_key} is not a "
                f"{word[lease.flow]} part of lease {lease.lease_id}"
            )

    def _published(self, lease: _Handoff, actions: tuple[Action, ...]) -> HandoffPublished:
        view = self._view(lease)
        if lease.awaiting_quiet:
            # Ended, but its release waits for the decode's proof that its reads are
            # quiet (I6-quiescence): a terminal state would tell the prefill to free
            # blocks a hung read may still land on. RELEASING is not terminal.
            view = replace(view, state=LeaseState.RELEASING)
        return HandoffPublished(view, len(lease.published), len(lease.source_rank_keys), actions)

    def _view(self, lease: _Lease) -> LeaseView:
        prefix_grant: PrefixLoadGrant | None = None
        handoff_grant: HandoffGrant | None = None
        miss_reason: MissReason | None = None
        granted = lease.granted_ms is not None
        if isinstance(lease, _PrefixLoad):
            reported = len(lease.pins)
            miss_reason = lease.miss_reason
            if granted:
                assert lease.target_child_engine_id is not None and lease.deadline_ms is not None
                prefix_grant = PrefixLoadGrant(
                    lease_id=lease.lease_id,
                    source_child_engine_id=lease.source_child_engine_id,
                    matched_blocks=lease.matched_blocks,
                    source_parts=tuple(
                        SourcePart(k, lease.pins[k][1], lease.pins[k][0])
                        for k in lease.source_rank_keys
                    ),
                    deadline_ms=lease.deadline_ms,
                )
        else:
            assert isinstance(lease, _Handoff)
            reported = len(lease.published)
            if granted:
                assert lease.target_child_engine_id is not None and lease.deadline_ms is not None
                handoff_grant = HandoffGrant(
                    lease_id=lease.lease_id,
                    prefill_child_engine_id=lease.source_child_engine_id,
                    decode_child_engine_id=lease.target_child_engine_id,
                    source_parts=tuple(
                        SourcePart(k, lease.published[k], lease.num_blocks)
                        for k in lease.source_rank_keys
                    ),
                    kv_transfer_params=lease.kv_transfer_params,
                    num_blocks=lease.num_blocks,
                    deadline_ms=lease.deadline_ms,
                )
        target = lease.target_child_engine_id
        if isinstance(lease, _Handoff) and target is None:
            target = lease.decode_restriction
        return LeaseView(
            lease_id=lease.lease_id,
            flow=lease.flow,
            state=lease.state,
            request_id=lease.request_id,
            source_child_engine_id=lease.source_child_engine_id,
            target_child_engine_id=target,
            created_ms=lease.created_ms,
            deadline_ms=self._timer_due(lease),
            reason=lease.reason,
            parts_reported=reported,
            parts_expected=len(lease.source_rank_keys),
            prefix_load_grant=prefix_grant,
            handoff_grant=handoff_grant,
            miss_reason=miss_reason,
        )


def _abort_messages(lease: _Lease, parts: Sequence[RankKey], reason: str) -> list[SendAbort]:
    assert lease.target_child_engine_id is not None
    target = lease.target_child_engine_id
    return [SendAbort(target, k, lease.lease_id, lease.flow, reason) for k in parts]


def _check_id(name: str, value: str) -> None:
    if type(value) is not str or not value or len(value) > 256:
        raise invalid(f"{name} must be a string of 1..256 characters, got {value!r:.80}")


def _check_duration(name: str, value: int, limit: int) -> None:
    if type(value) is not int or not 1 <= value <= limit:
        raise invalid(f"{name} must be between 1 and {limit} ms, got {value!r}")


def _earlier_outcome(lease: _Lease, rank_key: RankKey, outcome: Outcome) -> Outcome | None:
    """The part's earlier report (None: its first); FAILED_PRECONDITION if it differs."""
    previous = lease.outcomes.get(rank_key)
    if previous is not None and previous is not outcome:
        raise failed_precondition(
            f"rank part {rank_key} already reported {previous.name} for lease "
            f"{lease.lease_id}; a terminal report cannot change to {outcome.name}"
        )
    return previous


def _agree(lease: _Handoff, name: str, recorded: object, given: object) -> None:
    if recorded != given:
        raise failed_precondition(
            f"prefill parts disagree on {name} for handoff {lease.lease_id} "
            f"(request {lease.request_id!r}): this part sent a different value than the first"
        )
