"""Deployment profiles, the compatibility hash, declared profiles and the reuse gate.

Pure values and functions (no I/O, no protobuf). A `DeploymentProfile` is what an
engine declares about itself; its layout-relevant fields hash into the
compatibility hash, so that engines whose KV layouts differ never exchange KV.
Reuse is off unless the coordinator switch is on, the profile opts in and a
declared profile matches (I1-reuse-off). Decode handoffs never consult this gate.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from coordinator.core.errors import invalid


@dataclass(frozen=True, slots=True)
class DeploymentProfile:
    model: str
    block_size: int
    model_revision: str = ""
    kv_dtype: str = ""
    num_layers: int = 0
    num_kv_heads: int = 0
    head_size: int = 0
    attention_backend: str = ""
    kv_layout: str = ""
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dp_size: int = 1
    dcp_size: int = 1
    transfer_backends: tuple[str, ...] = ()
    gpu_kind: str = ""
    reuse_opt_in: bool = False
    lora_name: str = ""
    # The engine's own hash (e.g. NIXL's), compared verbatim, never interpreted.
    native_compatibility_hash: bytes = b""
    # Carried, not interpreted; sorted pairs so the value stays hashable.
    extra: tuple[tuple[str, str], ...] = ()


# The fields that decide whether two engines' KV blocks are interchangeable.
# dp_size is not among them: each DP rank holds its own, identically laid out KV.
LAYOUT_FIELDS: tuple[str, ...] = (
    "model",
    "model_revision",
    "kv_dtype",
    "block_size",
    "num_layers",
    "num_kv_heads",
    "head_size",
    "attention_backend",
    "kv_layout",
    "tp_size",
    "pp_size",
    "pcp_size",
    "lora_name",
)

# Fields a declared profile may pin: every scalar field of the profile.
PINNABLE_FIELDS: frozenset[str] = frozenset(
    f.name
    for f in fields(DeploymentProfile)
    if f.name not in ("transfer_backends", "native_compatibility_hash", "extra")
)

# Pinnable ints every engine registers as 1 or more (the rest: 0 is "not given").
_AT_LEAST_ONE = frozenset({"block_size", "tp_size", "pp_size", "pcp_size", "dp_size", "dcp_size"})

_COMPAT_HASH_VERSION = "kvrc-compat-v1"


def compatibility_hash(profile: DeploymentProfile) -> str:
    """Stable hex sha256 over a canonical JSON encoding of the layout fields.

    `dcp_size` above 1 is one of them (decode context parallelism splits each block's
    tokens over the ranks, so the blocks differ); at 1 it is left out, so the hash of
    every engine without it is what it was before it counted."""
    canonical: dict[str, object] = {name: getattr(profile, name) for name in LAYOUT_FIELDS}
    if profile.dcp_size != 1:
        canonical["dcp_size"] = profile.dcp_size
    encoded = json.dumps(
        [_COMPAT_HASH_VERSION, canonical], sort_keys=True, separators=(",", ":")
    ).encode()
    return hashlib.sha256(encoded).hexdigest()


@dataclass(frozen=True, slots=True)
class DeclaredProfile:
    """A deployment profile under which reuse may be activated.

    `pins` lists the fields it fixes (any subset); a profile matches when every
    pinned field is equal.
    """

    name: str
    pins: tuple[tuple[str, str | int | bool], ...]
    # Not a pin: the prefill rate of the engines it matches, the cost model's prior
    # for them until they report their own (I9-cost-gate). None: the coordinator's default.
    prefill_tokens_per_s: float | None = None

    def matches(self, profile: DeploymentProfile) -> bool:
        return all(getattr(profile, field) == value for field, value in self.pins)


# Keys of a declared profile that describe its engines instead of pinning a field.
COST_KEYS = frozenset({"prefill_tokens_per_s"})


def declared_profile(name: str, pinned: Mapping[str, object]) -> DeclaredProfile:
    """Build a declared profile from a mapping of field -> value; names bad fields.

    `prefill_tokens_per_s` (a number > 0) is the one key that is not a pin."""
    if not name:
        raise invalid("declared profile: name is empty")
    raw = pinned.get("prefill_tokens_per_s")
    pinned = {k: v for k, v in pinned.items() if k not in COST_KEYS}
    rate: float | None = None
    # bool is an int subclass: refuse `prefill_tokens_per_s = true` too.
    if type(raw) in (int, float) and isinstance(raw, int | float) and 0 < raw <= 1e9:
        rate = float(raw)
    if raw is not None and rate is None:
        raise invalid(
            f"declared profile {name!r}: prefill_tokens_per_s must be a number in (0, 1e9], "
            f"got {raw!r}"
        )
    if not pinned:
        raise invalid(f"declared profile {name!r}: pins no field (would match every engine)")
    defaults = DeploymentProfile(model="", block_size=0)
    pins: list[tuple[str, str | int | bool]] = []
    for field, value in pinned.items():
        if field not in PINNABLE_FIELDS:
            raise invalid(
                f"declared profile {name!r}: unknown field {field!r} "
                f"(known: {', '.join(sorted(PINNABLE_FIELDS))})"
            )
        expected_type = type(getattr(defaults, field))
        # bool is an int subclass: demand the exact type so `block_size = true` fails.
        if type(value) is not expected_type:
            raise invalid(
                f"declared profile {name!r}: field {field!r} must be "
                f"{expected_type.__name__}, got {type(value).__name__} {value!r}"
            )
        assert isinstance(value, str | int | bool)
        lowest = 1 if field in _AT_LEAST_ONE else 0
        if type(value) is int and value < lowest:
            # No engine registers it: the profile would match nothing, silently.
            raise invalid(
                f"declared profile {name!r}: field {field!r} must be >= {lowest}, got {value}"
            )
        pins.append((field, value))
    return DeclaredProfile(
        name=name,
        pins=tuple(sorted(pins)),
        prefill_tokens_per_s=rate,
    )


def declared_prefill_rate(
    profile: DeploymentProfile, declared_profiles: Sequence[DeclaredProfile]
) -> float | None:
    """The prefill rate the first matching declared profile names (the reuse gate's order)."""
    for declared in declared_profiles:
        if declared.matches(profile):
            return declared.prefill_tokens_per_s
    return None


class ReuseReason(enum.IntEnum):
    """Why reuse is or is not active. Values match `kvrc.v1.ReuseReason`."""

    ENABLED = 1
    DISABLED_BY_COORDINATOR = 2
    PROFILE_NOT_OPTED_IN = 3
    PROFILE_NOT_DECLARED = 4
    REQUESTER_UNKNOWN = 5
    REQUESTER_NOT_READY = 6
    WARMING = 7


@dataclass(frozen=True, slots=True)
class ReuseStatus:
    enabled: bool
    reason: ReuseReason
    detail: str


def reuse_status(
    coordinator_reuse_on: bool,
    profile: DeploymentProfile,
    declared_profiles: Sequence[DeclaredProfile] = (),
) -> ReuseStatus:
    """The reuse gate (I1-reuse-off): all three conditions, checked in this order."""
    if not coordinator_reuse_on:
        return ReuseStatus(
            False,
            ReuseReason.DISABLED_BY_COORDINATOR,
            "reuse is off on this coordinator (start it with --reuse on)",
        )
    if not profile.reuse_opt_in:
        return ReuseStatus(
            False,
            ReuseReason.PROFILE_NOT_OPTED_IN,
            "this engine's deployment profile does not opt into reuse (reuse_opt_in is false)",
        )
    for declared in declared_profiles:
        if declared.matches(profile):
            return ReuseStatus(
                True, ReuseReason.ENABLED, f"reuse enabled by declared profile {declared.name!r}"
            )
    return ReuseStatus(
        False,
        ReuseReason.PROFILE_NOT_DECLARED,
        f"no declared profile matches this engine (model {profile.model!r}, "
        f"kv_dtype {profile.kv_dtype!r}, block_size {profile.block_size}); "
        f"{len(declared_profiles)} declared",
    )
