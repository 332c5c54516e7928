"""Rank parts and child engines: registration checks and readiness (I5-complete-parts).

Pure and synchronous: no asyncio, no protobuf; time comes in as `now_ms`.
A child engine is READY only when every rank part of its tp x pp x pcp grid has
registered consistently (same engine id, sizes, profile and compatibility
hash). Every check runs before any change, so a rejected registration leaves
the registry exactly as it was.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace

from coordinator.core.cost_model import kv_bytes_per_block
from coordinator.core.errors import already_exists, failed_precondition, invalid, resource_exhausted
from coordinator.core.profiles import LAYOUT_FIELDS, DeploymentProfile, compatibility_hash
from kvrc.ids import MAX_GRID_PARTS, child_engine_id, format_rank, rank_grid
from kvrc.vocabulary import PublishMode, RankKey, TransferEndpoint


@dataclass(frozen=True, slots=True)
class HeldLease:
    """A lease a registering part still holds pins for (restart recovery), and the
    requester its holder knows ("" = unknown: an unreserved handoff)."""

    lease_id: str
    requester_child_engine_id: str = ""


@dataclass(frozen=True, slots=True)
class RankPartRegistration:
    engine_id: str
    dp_rank: int
    child_engine_id: str
    rank: RankKey  # (tp_rank, pp_rank, pcp_rank)
    profile: DeploymentProfile
    endpoint: TransferEndpoint = field(default_factory=TransferEndpoint)
    publish_mode: PublishMode = PublishMode.PER_CHILD_ENGINE
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    held_leases: tuple[HeldLease, ...] = ()


@dataclass(frozen=True, slots=True)
class RegisteredPart:
    registration: RankPartRegistration
    session_id: str
    incarnation: int
    registered_ms: int
    last_heartbeat_ms: int


@dataclass(frozen=True, slots=True)
class ChildEngineView:
    """A snapshot of one child engine, safe to hand to the edges."""

    child_engine_id: str
    engine_id: str
    dp_rank: int
    profile: DeploymentProfile
    compatibility_hash: str
    parts: tuple[RegisteredPart, ...]  # sorted by rank
    parts_expected: int
    ready: bool
    not_ready_reason: str

    @property
    def parts_present(self) -> int:
        return len(self.parts)

    def kv_bytes_per_block(self) -> int:
        """What a load of one of its blocks moves from all its parts (0: unknown)."""
        p = self.profile
        return kv_bytes_per_block(
            [part.registration.endpoint.regions for part in self.parts],
            block_size=p.block_size,
            num_layers=p.num_layers,
            num_kv_heads=p.num_kv_heads,
            head_size=p.head_size,
            kv_dtype=p.kv_dtype,
        )


@dataclass(frozen=True, slots=True)
class PartRef:
    """Names one registered rank part and the session that holds it."""

    child_engine_id: str
    rank: RankKey
    session_id: str


@dataclass(frozen=True, slots=True)
class RegistrationResult:
    part: RegisteredPart
    view: ChildEngineView
    readiness_changed: bool


@dataclass(frozen=True, slots=True)
class RemovalResult:
    part: RegisteredPart
    view: ChildEngineView  # the child engine after removal (no parts: it is gone)
    readiness_changed: bool


def grid_size(profile: DeploymentProfile) -> int:
    return profile.tp_size * profile.pp_size * profile.pcp_size


def grid_ranks(profile: DeploymentProfile) -> Iterator[RankKey]:
    """Every rank part of the child engine's tp x pp x pcp grid, tp outermost."""
    return rank_grid(profile.tp_size, profile.pp_size, profile.pcp_size)


def check_registration_shape(reg: RankPartRegistration) -> None:
    """Checks one registration on its own: ranks inside sizes, ids derived correctly."""
    p = reg.profile
    for name, size in (("tp_size", p.tp_size), ("pp_size", p.pp_size), ("pcp_size", p.pcp_size)):
        if size < 1:
            raise invalid(f"profile.parallel.{name} must be >= 1, got {size}")
    if grid_size(p) > MAX_GRID_PARTS:
        raise invalid(
            f"profile.parallel: tp_size x pp_size x pcp_size = {grid_size(p)} rank parts "
            f"exceeds the limit of {MAX_GRID_PARTS}"
        )
    if p.dp_size < 1:
        raise invalid(f"profile.parallel.dp_size must be >= 1, got {p.dp_size}")
    for name, value, size in (
        ("rank.tp_rank", reg.rank[0], p.tp_size),
        ("rank.pp_rank", reg.rank[1], p.pp_size),
        ("rank.pcp_rank", reg.rank[2], p.pcp_size),
        ("dp_rank", reg.dp_rank, p.dp_size),
    ):
        if not 0 <= value < size:
            raise invalid(f"{name} must be in [0, {size}), got {value}")
    expected = child_engine_id(reg.engine_id, reg.dp_rank, p.dp_size)
    if reg.child_engine_id != expected:
        raise invalid(
            f"child_engine_id mismatch: got {reg.child_engine_id!r}, expected {expected!r} "
            f"(engine_id {reg.engine_id!r}, dp_rank {reg.dp_rank}, dp_size {p.dp_size})"
        )


# Compared between rank parts of one child engine, in this order: the first
# difference names the field. Sizes first (the most common operator error),
# then the layout (what the compatibility hash covers), then the rest.
_SIZE_FIELDS = ("tp_size", "pp_size", "pcp_size", "dp_size", "dcp_size")
_OTHER_PROFILE_FIELDS = tuple(
    f.name
    for f in fields(DeploymentProfile)
    if f.name not in _SIZE_FIELDS and f.name not in LAYOUT_FIELDS and f.name != "extra"
)


def _mismatch(field: str, child_engine_id: str, registered: object, sent: object) -> Exception:
    return failed_precondition(
        f"{field} mismatch for child engine {child_engine_id!r}: registered rank parts have "
        f"{registered!r}, this rank part sent {sent!r}"
    )


def check_consistent(reg: RankPartRegistration, existing: RankPartRegistration) -> None:
    """A new part must agree with the child engine's registered parts field for field."""
    cid = reg.child_engine_id
    if reg.engine_id != existing.engine_id:
        raise _mismatch("engine_id", cid, existing.engine_id, reg.engine_id)
    if reg.dp_rank != existing.dp_rank:
        raise _mismatch("dp_rank", cid, existing.dp_rank, reg.dp_rank)
    for name in _SIZE_FIELDS:
        have, sent = getattr(existing.profile, name), getattr(reg.profile, name)
        if have != sent:
            raise _mismatch(f"profile.parallel.{name}", cid, have, sent)
    for name in LAYOUT_FIELDS:
        if name in _SIZE_FIELDS:
            continue
        have, sent = getattr(existing.profile, name), getattr(reg.profile, name)
        if have != sent:
            raise _mismatch(f"profile.{name}", cid, have, sent)
    # Equal LAYOUT_FIELDS are an equal compatibility hash: nothing more to compare there.
    for name in _OTHER_PROFILE_FIELDS:
        have, sent = getattr(existing.profile, name), getattr(reg.profile, name)
        if have != sent:
            raise _mismatch(f"profile.{name}", cid, have, sent)
    if reg.publish_mode != existing.publish_mode:
        raise _mismatch("publish_mode", cid, existing.publish_mode.name, reg.publish_mode.name)


class _ChildEngine:
    """Mutable record of one child engine; never leaves this module."""

    __slots__ = ("compatibility_hash", "parts", "reference")

    def __init__(self, reference: RankPartRegistration) -> None:
        # The registration every later part is compared with (all present parts agree).
        self.reference = reference
        # Fixed for the child's life: every part agrees on the layout fields it covers.
        self.compatibility_hash = compatibility_hash(reference.profile)
        self.parts: dict[RankKey, RegisteredPart] = {}


# What one KvRegion costs the registry beyond its wire bytes: a slotted object of five
# ints (a 64-bit base address among them), ~120 bytes in CPython.
REGION_HELD_BYTES = 128
DEFAULT_MAX_RANK_PARTS = 65536
DEFAULT_MAX_ENDPOINT_BYTES = 1 << 30


def endpoint_held_bytes(endpoint: TransferEndpoint) -> int:
    """What a part's endpoint costs the registry for its life: the opaque metadata
    (agent_metadata and extra, kept byte for byte) and its regions."""
    extra = sum(len(key) + len(value) for key, value in endpoint.extra)
    return len(endpoint.agent_metadata) + extra + REGION_HELD_BYTES * len(endpoint.regions)


class Registry:
    """All registered rank parts, grouped by child engine.

    Bounded (I8-bad-input): `max_rank_parts` parts and `max_endpoint_bytes` of endpoints
    over all of them, and one engine (its DP ranks together) at most a quarter of each,
    so one misconfigured or runaway engine cannot lock the others out.
    """

    def __init__(
        self,
        max_rank_parts: int = DEFAULT_MAX_RANK_PARTS,
        max_endpoint_bytes: int = DEFAULT_MAX_ENDPOINT_BYTES,
    ) -> None:
        self._max_rank_parts = max_rank_parts
        self._max_endpoint_bytes = max_endpoint_bytes
        self._children: dict[str, _ChildEngine] = {}
        self._num_parts = 0
        self._endpoint_bytes = 0
        # Per engine_id: (parts, endpoint bytes) of its child engines together.
        self._per_engine: dict[str, tuple[int, int]] = {}

    @property
    def num_parts(self) -> int:
        return self._num_parts

    def register(
        self, reg: RankPartRegistration, session_id: str, incarnation: int, now_ms: int
    ) -> RegistrationResult:
        check_registration_shape(reg)
        child = self._children.get(reg.child_engine_id)
        if child is not None:
            held = child.parts.get(reg.rank)
            if held is not None:
                raise already_exists(
                    f"rank part {format_rank(reg.rank)} of child engine "
                    f"{reg.child_engine_id!r} is already registered (session {held.session_id})"
                )
            check_consistent(reg, child.reference)
        endpoint_bytes = endpoint_held_bytes(reg.endpoint)
        self._check_room(reg, endpoint_bytes)
        # All checks passed: mutate.
        was_ready = child is not None and self._is_ready(child)
        if child is None:
            child = _ChildEngine(reg)
            self._children[reg.child_engine_id] = child
        part = RegisteredPart(reg, session_id, incarnation, now_ms, now_ms)
        child.parts[reg.rank] = part
        self._count(reg.engine_id, 1, endpoint_bytes)
        view = self._view(child)
        return RegistrationResult(part, view, readiness_changed=view.ready != was_ready)

    def remove(self, ref: PartRef) -> RemovalResult | None:
        """Removes a part if `ref.session_id` still holds it (a newer session is kept)."""
        child = self._children.get(ref.child_engine_id)
        if child is None:
            return None
        part = child.parts.get(ref.rank)
        if part is None or part.session_id != ref.session_id:
            return None
        was_ready = self._is_ready(child)
        del child.parts[ref.rank]
        self._count(
            part.registration.engine_id, -1, -endpoint_held_bytes(part.registration.endpoint)
        )
        view = self._view(child)
        if not child.parts:
            del self._children[ref.child_engine_id]
        elif child.reference.rank == ref.rank:
            child.reference = next(iter(child.parts.values())).registration
        return RemovalResult(part, view, readiness_changed=was_ready != view.ready)

    def _check_room(self, reg: RankPartRegistration, held: int) -> None:
        """RESOURCE_EXHAUSTED unless the coordinator, and the part's engine within its
        quarter, have room for one more part of `held` endpoint bytes."""
        engine_parts, engine_bytes = self._per_engine.get(reg.engine_id, (0, 0))
        if self._num_parts >= self._max_rank_parts:
            raise resource_exhausted(
                f"rank part {format_rank(reg.rank)} of {reg.child_engine_id!r}: the "
                f"coordinator holds its maximum of {self._max_rank_parts} rank parts "
                f"(--max-rank-parts), {engine_parts} of them engine {reg.engine_id!r}'s"
            )
        if self._endpoint_bytes + held > self._max_endpoint_bytes:
            raise resource_exhausted(
                f"rank part {format_rank(reg.rank)} of {reg.child_engine_id!r}: its endpoint "
                f"holds {held} bytes (metadata, extra, regions) and the coordinator's rank "
                f"parts {self._endpoint_bytes} of their {self._max_endpoint_bytes} "
                f"(--max-endpoint-bytes), {engine_bytes} of them engine {reg.engine_id!r}'s"
            )
        share_parts = max(1, self._max_rank_parts // 4)
        if engine_parts >= share_parts:
            raise resource_exhausted(
                f"engine {reg.engine_id!r} holds {engine_parts} rank parts, its share of at "
                f"most a quarter of the coordinator's {self._max_rank_parts} (--max-rank-parts)"
            )
        share_bytes = self._max_endpoint_bytes // 4
        if engine_bytes + held > share_bytes:
            raise resource_exhausted(
                f"rank part {format_rank(reg.rank)} of {reg.child_engine_id!r}: its endpoint "
                f"holds {held} bytes and engine {reg.engine_id!r}'s parts {engine_bytes}, past "
                f"its share of at most a quarter of the coordinator's "
                f"{self._max_endpoint_bytes} (--max-endpoint-bytes)"
            )

    def _count(self, engine_id: str, parts: int, held: int) -> None:
        self._num_parts += parts
        self._endpoint_bytes += held
        engine_parts, engine_bytes = self._per_engine.get(engine_id, (0, 0))
        engine_parts += parts
        if engine_parts:
            self._per_engine[engine_id] = (engine_parts, engine_bytes + held)
        else:
            del self._per_engine[engine_id]

    @property
    def endpoint_bytes(self) -> int:
        """Endpoint bytes the registered parts hold (`endpoint_held_bytes`, summed)."""
        return self._endpoint_bytes

    def heartbeat(self, ref: PartRef, now_ms: int) -> bool:
        """Records liveness; False when `ref` no longer holds the part."""
        child = self._children.get(ref.child_engine_id)
        part = child.parts.get(ref.rank) if child is not None else None
        if child is None or part is None or part.session_id != ref.session_id:
            return False
        child.parts[ref.rank] = replace(part, last_heartbeat_ms=max(now_ms, part.last_heartbeat_ms))
        return True

    def expired(self, now_ms: int, timeout_ms: int) -> list[PartRef]:
        """Parts silent for longer than `timeout_ms`."""
        return [
            PartRef(cid, rank, part.session_id)
            for cid, child in self._children.items()
            for rank, part in child.parts.items()
            if now_ms - part.last_heartbeat_ms > timeout_ms
        ]

    def get(self, child_engine_id: str) -> ChildEngineView | None:
        child = self._children.get(child_engine_id)
        return self._view(child) if child is not None else None

    def is_ready(self, child_engine_id: str) -> bool:
        child = self._children.get(child_engine_id)
        return child is not None and self._is_ready(child)

    def readiness_counts(self) -> tuple[int, int]:
        """(ready, not ready) child engines, without building views."""
        ready = sum(1 for child in self._children.values() if self._is_ready(child))
        return ready, len(self._children) - ready

    def session_of(self, child_engine_id: str, rank: RankKey) -> str | None:
        """The session holding one rank part (O(1): sends to a part run per lease step)."""
        child = self._children.get(child_engine_id)
        part = child.parts.get(rank) if child is not None else None
        return part.session_id if part is not None else None

    def is_registered(self, child_engine_id: str) -> bool:
        """Some part of the child engine is registered (O(1), no view built)."""
        return child_engine_id in self._children

    def parts_of(self, child_engine_id: str) -> list[PartRef]:
        child = self._children.get(child_engine_id)
        if child is None:
            return []
        return [PartRef(child_engine_id, rank, p.session_id) for rank, p in child.parts.items()]

    def views(self) -> Iterator[ChildEngineView]:
        for cid in sorted(self._children):
            yield self._view(self._children[cid])

    @staticmethod
    def _is_ready(child: _ChildEngine) -> bool:
        return len(child.parts) == grid_size(child.reference.profile)

    @staticmethod
    def _view(child: _ChildEngine) -> ChildEngineView:
        ref = child.reference
        expected = grid_size(ref.profile)
        ready = len(child.parts) == expected  # expected >= 1
        reason = "" if ready else _not_ready_reason(child, expected)
        return ChildEngineView(
            child_engine_id=ref.child_engine_id,
            engine_id=ref.engine_id,
            dp_rank=ref.dp_rank,
            profile=ref.profile,
            compatibility_hash=child.compatibility_hash,
            parts=tuple(child.parts[rank] for rank in sorted(child.parts)),
            parts_expected=expected,
            ready=ready,
            not_ready_reason=reason,
        )


_MAX_LISTED_MISSING = 8


def _not_ready_reason(child: _ChildEngine, expected: int) -> str:
    if not child.parts:
        return "no rank part is registered"
    p = child.reference.profile
    num_missing = expected - len(child.parts)
    # Lazily: the grid may be large, only the first few missing ranks are named.
    missing = itertools.islice(
        (r for r in grid_ranks(p) if r not in child.parts),
        _MAX_LISTED_MISSING,
    )
    listed = ", ".join(format_rank(r) for r in missing)
    more = (
        f" and {num_missing - _MAX_LISTED_MISSING} more"
        if num_missing > _MAX_LISTED_MISSING
        else ""
    )
    return (
        f"waiting for {num_missing} of {expected} rank parts "
        f"(tp={p.tp_size} x pp={p.pp_size} x pcp={p.pcp_size}): missing {listed}{more}"
    )
