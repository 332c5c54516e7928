"""Protobuf <-> domain conversion and input validation for the gRPC edge.

Every `*_from_proto` function validates what a client sent and raises
`KvrcError(INVALID_ARGUMENT)` naming the field: empty or oversized ids, zero
sizes, unknown enum values (proto3 keeps unknown ints, so they are checked
here), oversized opaque fields. Semantic checks that need no protobuf (ranks
inside sizes, child-engine naming, consistency between parts) live in the core
(`registry.py`). Opaque bytes are copied verbatim in both directions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import Message

from coordinator.core import events as ev
from coordinator.core import inventory as inv
from coordinator.core.auth import AuthDenied, DenyReason
from coordinator.core.cost_model import Prediction
from coordinator.core.errors import KvrcError, failed_precondition, invalid
from coordinator.core.grants import (
    BeginHandoffRequest,
    DrainNotice,
    DrainResult,
    PrefixLoadAnswer,
    PrefixLoadRequest,
    PublishHandoffRequest,
    TransferReport,
)
from coordinator.core.leases import (
    HandoffGrant,
    LeaseState,
    LeaseView,
    Outcome,
    SendAbort,
    SendPin,
    SendQuarantine,
    SendRelease,
    SourcePart,
    flow_of_lease_id,
)
from coordinator.core.profiles import DeploymentProfile, ReuseReason, ReuseStatus
from coordinator.core.registry import ChildEngineView, HeldLease, RankPartRegistration
from coordinator.core.score import (
    MAX_SCORE_BLOCKS,
    MAX_SCORE_CANDIDATES,
    MAX_SCORE_TOKENS,
    ScoreAnswer,
    ScoreQuery,
)
from coordinator.core.vllm_hashing import MAX_MM_FEATURES, MmFeature
from coordinator.edges.host_patterns import host_allowed
from coordinator.edges.zmq_ingest import (
    ZmqStreamConfig,
    endpoint_host,
    publisher_host,
    subscriber_endpoint,
)
from coordinator.runtime.clock import Clock, from_unix_ms, to_unix_ms
from coordinator.runtime.config import FieldBounds
from coordinator.runtime.coordinator import (
    DEFAULT_STATUS_LEASES,
    MAX_STATUS_LEASES,
    ChildEngineStatus,
    CompleteOutcome,
    CostStatus,
    EncodedReply,
    HeartbeatReply,
    Outbound,
    PublishOutcome,
    RegisterReply,
    StateUpdate,
    StatusSnapshot,
)
from coordinator.runtime.inventory_flow import LookupQuery, LookupResult, LookupVerdict, ResyncOrder
from coordinator.runtime.peers import PartCodec
from kvrc import __version__
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.vocabulary import (
    MAX_BLOCK_HASH_BYTES,
    MAX_BLOCKS_PER_BATCH,
    MAX_CHAIN_BLOCKS,
    MAX_EVENTS_PER_BATCH,
    MAX_GROUP_IDX,
    PROTOCOL_VERSION,
    PublishMode,
    TransferEndpoint,
    protocol_mismatch,
)

# Times: the core and the runtime keep monotonic ms; the protocol carries unix ms.
# Each conversion reads both clocks at encoding time (coordinator/runtime/clock.py).


# The latest expiry kept (some 146 million years): an engine's larger one (up to
# 2**64 - 1) overflowed uint64 once converted back for a Lookup answer after the wall
# clock moved, which failed every requester's Lookup naming that holder (I8-bad-input).
MAX_EXPIRY_UNIX_MS = 1 << 62


def _expiry_from_unix(clock: Clock, expiry_unix_ms: int) -> int:
    """An engine's expiry (unix ms, 0 = none) on the monotonic clock (at least 1: not none)."""
    if not expiry_unix_ms:
        return 0
    return max(from_unix_ms(clock, min(expiry_unix_ms, MAX_EXPIRY_UNIX_MS)), 1)


# --- request bytes ------------------------------------------------------------

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class MalformedRequest:
    """Request bytes that do not parse as their method's message type.

    grpc hands this to the servicer layer in place of a message: a deserializer
    that raised would answer UNKNOWN and log a traceback for every such call.
    """

    method_path: str  # /kvrc.v1.EngineService/Lookup
    type_name: str  # kvrc.v1.LookupRequest
    size: int
    error: str

    @property
    def message(self) -> str:
        """What the caller hears: enough to find the client that sent it."""
        return (
            f"request to {self.method_path} is not a valid {self.type_name} protobuf "
            f"({self.size} bytes): {self.error}"
        )


def request_parser(cls: type[M], method_path: str) -> Callable[[bytes], M | MalformedRequest]:
    """A grpc request deserializer for `cls` that never raises."""
    type_name = cls.DESCRIPTOR.full_name

    def parse(data: bytes) -> M | MalformedRequest:
        try:
            return cls.FromString(data)
        except Exception as e:  # any parser failure on hostile bytes: not a valid message
            return MalformedRequest(method_path, type_name, len(data), str(e) or type(e).__name__)

    return parse


# --- validation helpers ------------------------------------------------------


def check_id(field: str, value: str, bounds: FieldBounds) -> str:
    if not value:
        raise invalid(f"{field} is empty")
    if len(value) > bounds.max_id_chars:
        raise invalid(
            f"{field} is {len(value)} characters long; the limit is {bounds.max_id_chars}"
        )
    if not (value.isascii() and value.isprintable()):
        raise invalid(f"{field} must be printable ASCII, got {value!r:.80}")
    return value


def check_text(field: str, value: str, bounds: FieldBounds) -> str:
    if len(value) > bounds.max_string_chars:
        raise invalid(
            f"{field} is {len(value)} characters long; the limit is {bounds.max_string_chars}"
        )
    return value


def check_size(field: str, value: int, bounds: FieldBounds) -> int:
    if not 1 <= value <= bounds.max_parallel_size:
        raise invalid(f"{field} must be in [1, {bounds.max_parallel_size}], got {value}")
    return value


def check_count(field: str, count: int, limit: int) -> None:
    if count > limit:
        raise invalid(f"{field} has {count} entries; the limit is {limit}")


MAX_RELEASE_ACKS = 4096  # lease ids in one ReleaseAck (revision 4 batches them)


def release_ack_from_proto(msg: pb.ReleaseAck, bounds: FieldBounds) -> tuple[str, ...]:
    """The acknowledged lease ids: `lease_id` and `lease_ids`, at least one, each an id."""
    check_count("release_ack.lease_ids", len(msg.lease_ids), MAX_RELEASE_ACKS)
    ids = [check_id(f"release_ack.lease_ids[{i}]", v, bounds) for i, v in enumerate(msg.lease_ids)]
    if not msg.lease_id and not ids:
        raise invalid("release_ack names no lease: set lease_id or lease_ids")
    if msg.lease_id:
        ids.append(check_id("release_ack.lease_id", msg.lease_id, bounds))
    return tuple(ids)


# --- registration --------------------------------------------------------------


def publish_mode_from_proto(value: int) -> PublishMode:
    if value == pb.PUBLISH_MODE_UNSPECIFIED:
        return PublishMode.PER_CHILD_ENGINE  # the vLLM default
    try:
        return PublishMode(value)
    except ValueError:
        raise invalid(f"publish_mode: unknown enum value {value}") from None


def profile_from_proto(msg: pb.DeploymentProfile, bounds: FieldBounds) -> DeploymentProfile:
    model = check_text("profile.model", msg.model, bounds)
    if not model:
        raise invalid("profile.model is empty")
    if msg.block_size < 1:
        raise invalid("profile.block_size must be >= 1, got 0")
    check_count("profile.transfer_backends", len(msg.transfer_backends), bounds.max_extra_entries)
    check_count("profile.extra", len(msg.extra), bounds.max_extra_entries)
    for name, value in (
        ("profile.model_revision", msg.model_revision),
        ("profile.kv_dtype", msg.kv_dtype),
        ("profile.attention_backend", msg.attention_backend),
        ("profile.kv_layout", msg.kv_layout),
        ("profile.gpu_kind", msg.gpu_kind),
        ("profile.lora_name", msg.lora_name),
    ):
        check_text(name, value, bounds)
    for backend in msg.transfer_backends:
        check_id("profile.transfer_backends[]", backend, bounds)
    for key, value in msg.extra.items():
        check_id("profile.extra key", key, bounds)
        check_text(f"profile.extra[{key!r}]", value, bounds)
    if len(msg.native_compatibility_hash) > bounds.max_id_chars:
        raise invalid(
            f"profile.native_compatibility_hash is {len(msg.native_compatibility_hash)} bytes; "
            f"the limit is {bounds.max_id_chars}"
        )
    par = msg.parallel
    return DeploymentProfile(
        model=model,
        block_size=msg.block_size,
        model_revision=msg.model_revision,
        kv_dtype=msg.kv_dtype,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_size=msg.head_size,
        attention_backend=msg.attention_backend,
        kv_layout=msg.kv_layout,
        tp_size=check_size("profile.parallel.tp_size", par.tp_size, bounds),
        pp_size=check_size("profile.parallel.pp_size", par.pp_size, bounds),
        pcp_size=check_size("profile.parallel.pcp_size", par.pcp_size, bounds),
        dp_size=check_size("profile.parallel.dp_size", par.dp_size, bounds),
        dcp_size=check_size("profile.parallel.dcp_size", par.dcp_size, bounds),
        transfer_backends=tuple(msg.transfer_backends),
        gpu_kind=msg.gpu_kind,
        reuse_opt_in=msg.reuse_opt_in,
        lora_name=msg.lora_name,
        native_compatibility_hash=bytes(msg.native_compatibility_hash),
        extra=tuple(sorted(msg.extra.items())),
    )


def profile_to_proto(profile: DeploymentProfile) -> pb.DeploymentProfile:
    return pb.DeploymentProfile(
        model=profile.model,
        model_revision=profile.model_revision,
        kv_dtype=profile.kv_dtype,
        block_size=profile.block_size,
        num_layers=profile.num_layers,
        num_kv_heads=profile.num_kv_heads,
        head_size=profile.head_size,
        attention_backend=profile.attention_backend,
        kv_layout=profile.kv_layout,
        parallel=pb.ParallelSizes(
            tp_size=profile.tp_size,
            pp_size=profile.pp_size,
            pcp_size=profile.pcp_size,
            dp_size=profile.dp_size,
            dcp_size=profile.dcp_size,
        ),
        transfer_backends=list(profile.transfer_backends),
        gpu_kind=profile.gpu_kind,
        reuse_opt_in=profile.reuse_opt_in,
        lora_name=profile.lora_name,
        native_compatibility_hash=profile.native_compatibility_hash,
        extra=dict(profile.extra),
    )


def _check_endpoint(msg: pb.TransferEndpoint, bounds: FieldBounds) -> None:
    """Sizes of an opaque endpoint, without building it."""
    check_text("endpoint.backend", msg.backend, bounds)
    check_text("endpoint.session_name", msg.session_name, bounds)
    check_count("endpoint.regions", len(msg.regions), bounds.max_regions)
    for i, region in enumerate(msg.regions):
        if region.block_len > bounds.max_block_len:
            raise invalid(
                f"endpoint.regions[{i}].block_len is {region.block_len} bytes; "
                f"the limit is {bounds.max_block_len}"
            )
    check_count("endpoint.extra", len(msg.extra), bounds.max_extra_entries)
    opaque_bytes = len(msg.agent_metadata) + sum(len(k) + len(v) for k, v in msg.extra.items())
    if opaque_bytes > bounds.max_metadata_bytes:
        raise invalid(
            f"endpoint metadata (agent_metadata + extra) is {opaque_bytes} bytes; "
            f"the limit is {bounds.max_metadata_bytes}"
        )
    for key in msg.extra:
        check_id("endpoint.extra key", key, bounds)


def endpoint_from_proto(msg: pb.TransferEndpoint, bounds: FieldBounds) -> TransferEndpoint:
    _check_endpoint(msg, bounds)
    return TransferEndpoint.from_proto(msg)


def registration_ids_from_proto(msg: pb.Register, bounds: FieldBounds) -> tuple[str, str]:
    """(engine_id, child_engine_id): what authorization needs, checked before the rest of
    the message is, so that a credential learns nothing of what it may not register
    (the --kv-events-hosts list, say)."""
    # First: an older client's message means something else field by field.
    mismatch = protocol_mismatch(msg.protocol_version)
    if mismatch is not None:
        raise failed_precondition(mismatch)
    return (
        check_id("engine_id", msg.engine_id, bounds),
        check_id("child_engine_id", msg.child_engine_id, bounds),
    )


def registration_from_proto(msg: pb.Register, bounds: FieldBounds) -> RankPartRegistration:
    engine_id, child_engine_id = registration_ids_from_proto(msg, bounds)
    if not msg.HasField("profile"):
        raise invalid("profile is missing")
    profile = profile_from_proto(msg.profile, bounds)
    check_text("kv_events_endpoint", msg.kv_events_endpoint, bounds)
    check_text("kv_events_replay_endpoint", msg.kv_events_replay_endpoint, bounds)
    held = _held_leases_from_proto(msg, bounds)
    endpoint = endpoint_from_proto(msg.endpoint, bounds)
    for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        _check_kv_events_endpoint(name, getattr(msg, name), engine_id, msg, endpoint, bounds)
    return RankPartRegistration(
        engine_id=engine_id,
        dp_rank=msg.dp_rank,
        child_engine_id=child_engine_id,
        rank=(msg.rank.tp_rank, msg.rank.pp_rank, msg.rank.pcp_rank),
        profile=profile,
        endpoint=endpoint,
        publish_mode=publish_mode_from_proto(msg.publish_mode),
        kv_events_endpoint=msg.kv_events_endpoint,
        kv_events_replay_endpoint=msg.kv_events_replay_endpoint,
        held_leases=held,
    )


def _held_leases_from_proto(msg: pb.Register, bounds: FieldBounds) -> tuple[HeldLease, ...]:
    """`held_leases` (with requesters) and the older `held_lease_ids` (clients send both, for
    coordinators that predate `held_leases`): a lease named twice keeps its first mention,
    the one with its requester; each field and their union are bounded."""
    check_count("held_leases", len(msg.held_leases), bounds.max_held_leases)
    check_count("held_lease_ids", len(msg.held_lease_ids), bounds.max_held_leases)
    held: dict[str, HeldLease] = {}
    for entry in msg.held_leases:
        lease_id = check_id("held_leases[].lease_id", entry.lease_id, bounds)
        requester = entry.requester_child_engine_id
        if requester:
            check_id("held_leases[].requester_child_engine_id", requester, bounds)
        held.setdefault(lease_id, HeldLease(lease_id, requester))
    for lease_id in msg.held_lease_ids:
        held.setdefault(lease_id, HeldLease(check_id("held_lease_ids[]", lease_id, bounds)))
    if len(held) > bounds.max_held_leases:
        raise invalid(
            f"held_leases and held_lease_ids name {len(held)} distinct leases; the limit "
            f"is {bounds.max_held_leases}"
        )
    return tuple(held.values())


def registration_to_proto(reg: RankPartRegistration) -> pb.Register:
    """The inverse of `registration_from_proto` (held lease ids stay with the part's replica)."""
    tp, pp, pcp = reg.rank
    return pb.Register(
        engine_id=reg.engine_id,
        dp_rank=reg.dp_rank,
        child_engine_id=reg.child_engine_id,
        rank=pb.RankCoordinates(tp_rank=tp, pp_rank=pp, pcp_rank=pcp),
        profile=profile_to_proto(reg.profile),
        endpoint=reg.endpoint.to_proto(),
        publish_mode=int(reg.publish_mode),  # type: ignore[arg-type]
        kv_events_endpoint=reg.kv_events_endpoint,
        kv_events_replay_endpoint=reg.kv_events_replay_endpoint,
        protocol_version=PROTOCOL_VERSION,
    )


def part_codec(bounds: FieldBounds) -> PartCodec:
    """Registrations between replicas as the wire's Register message, checked on the way in."""
    return PartCodec(
        encode=lambda reg: registration_to_proto(reg).SerializeToString(),
        decode=lambda data: registration_from_proto(pb.Register.FromString(data), bounds),
    )


def _check_kv_events_endpoint(
    field: str,
    value: str,
    engine_id: str,
    msg: pb.Register,
    endpoint: TransferEndpoint,
    bounds: FieldBounds,
) -> None:
    """Refuses what the ZMQ edge would refuse later (its own validators, same inputs),
    and a host outside `--kv-events-hosts` (PERMISSION_DENIED: an engine must not point
    kvrc's sockets at other services)."""
    if not value:
        return
    try:
        host = publisher_host(endpoint.session_name)
        subscribed, binds = subscriber_endpoint(value, host, msg.dp_rank)
        ZmqStreamConfig(engine_id=engine_id, endpoint=subscribed)
    except KvrcError as e:
        raise invalid(f"{field}: {e.message}") from None
    if not host_allowed(endpoint_host(subscribed), bounds.kv_events_hosts):
        raise AuthDenied(
            DenyReason.KV_EVENTS_HOST,
            f"{field}: kvrc would {'bind' if binds else 'connect to'} {subscribed}, a host "
            f"outside --kv-events-hosts ({', '.join(bounds.kv_events_hosts)})",
        )


# --- coordinator -> engine -----------------------------------------------------


def reuse_status_to_proto(status: ReuseStatus) -> pb.ReuseStatus:
    return pb.ReuseStatus(
        enabled=status.enabled, reason=_REUSE_REASONS[status.reason], detail=status.detail
    )


_REUSE_REASONS: dict[ReuseReason, pb.ReuseReason.ValueType] = {
    ReuseReason.ENABLED: pb.REUSE_REASON_ENABLED,
    ReuseReason.DISABLED_BY_COORDINATOR: pb.REUSE_REASON_DISABLED_BY_COORDINATOR,
    ReuseReason.PROFILE_NOT_OPTED_IN: pb.REUSE_REASON_PROFILE_NOT_OPTED_IN,
    ReuseReason.PROFILE_NOT_DECLARED: pb.REUSE_REASON_PROFILE_NOT_DECLARED,
    ReuseReason.REQUESTER_UNKNOWN: pb.REUSE_REASON_REQUESTER_UNKNOWN,
    ReuseReason.REQUESTER_NOT_READY: pb.REUSE_REASON_REQUESTER_NOT_READY,
    ReuseReason.WARMING: pb.REUSE_REASON_WARMING,
}


def child_engine_state_to_proto(
    view: ChildEngineView, reuse: ReuseStatus, *, stale: bool = False, draining: bool = False
) -> pb.ChildEngineState:
    return pb.ChildEngineState(
        child_engine_id=view.child_engine_id,
        engine_id=view.engine_id,
        ready=view.ready,
        parts_present=view.parts_present,
        parts_expected=view.parts_expected,
        not_ready_reason=view.not_ready_reason,
        compatibility_hash=view.compatibility_hash,
        reuse=reuse_status_to_proto(reuse),
        stale=stale,
        draining=draining,
    )


def coordinator_message(out: Outbound, clock: Clock) -> pb.CoordinatorMessage:
    """Encodes one outbound session message."""
    if isinstance(out, EncodedReply):
        assert isinstance(out.message, pb.CoordinatorMessage)
        return out.message
    if isinstance(out, RegisterReply):
        return pb.CoordinatorMessage(
            register_ack=pb.RegisterAck(
                session_id=out.session_id,
                incarnation=out.incarnation,
                compatibility_hash=out.view.compatibility_hash,
                heartbeat_interval_ms=out.heartbeat_interval_ms,
                heartbeat_timeout_ms=out.heartbeat_timeout_ms,
                reuse=reuse_status_to_proto(out.reuse),
                state=child_engine_state_to_proto(out.view, out.reuse),
            )
        )
    if isinstance(out, HeartbeatReply):
        return pb.CoordinatorMessage(
            heartbeat_ack=pb.HeartbeatAck(server_time_unix_ms=to_unix_ms(clock, out.server_time_ms))
        )
    if isinstance(out, StateUpdate):
        state = child_engine_state_to_proto(
            out.view, out.reuse, stale=out.stale, draining=out.draining
        )
        return pb.CoordinatorMessage(state=state)
    if isinstance(out, ResyncOrder):
        return pb.CoordinatorMessage(
            resync_request=pb.ResyncRequest(
                reason=out.reason, expected_sequence=out.expected_sequence
            )
        )
    lease_message = _lease_message(out, clock)
    if lease_message is not None:
        return lease_message
    raise TypeError(f"no encoding for outbound message {type(out).__name__}")


def status_request_from_proto(msg: pb.StatusRequest) -> int:
    """How many leases to list (0 asks for the default)."""
    if msg.max_leases > MAX_STATUS_LEASES:
        raise invalid(
            f"max_leases is {msg.max_leases}; the limit is {MAX_STATUS_LEASES:,} (0 = the "
            f"default, {DEFAULT_STATUS_LEASES:,}): ask for fewer; leases_total counts them all"
        )
    return msg.max_leases or DEFAULT_STATUS_LEASES


# Shares of a status answer, under the server's 16 MiB send limit: long ids and reasons
# make a lease up to ~1.8 KB (10,000 of them ~17 MiB), and a rank part's endpoint
# metadata may be 1 MiB (NIXL's is tens of KB), so a large cluster's engines alone
# could pass it.
STATUS_LEASE_BYTES = 8 << 20
STATUS_CHILD_ENGINE_BYTES = 6 << 20


def _within_bytes(messages: Iterable[M], budget: int) -> list[M]:
    """The leading `messages` whose encodings fit in `budget` bytes (each with its field
    tag and length); the rest are left out, and counted by the caller's total."""
    kept: list[M] = []
    used = 0
    for message in messages:
        used += message.ByteSize() + 4
        if used > budget:
            break
        kept.append(message)
    return kept


def status_to_proto(
    snapshot: StatusSnapshot, clock: Clock, *, full_lease_ids: bool
) -> pb.StatusResponse:
    """`full_lease_ids` False: each id shortened (`shortened_lease_id`), for non-admins."""
    decisions = dict(snapshot.cost.decisions) if snapshot.cost is not None else {}

    def lease_status(view: LeaseView) -> pb.LeaseStatus:
        lease = lease_status_to_proto(view, clock)
        if not full_lease_ids:
            lease.lease_id = shortened_lease_id(view.lease_id)
        prediction = decisions.get(view.lease_id)
        if prediction is not None:
            lease.prediction.CopyFrom(prediction_to_proto(prediction))
        return lease

    # Generators: nothing past a budget is encoded. Leases come most urgent first.
    leases = _within_bytes(map(lease_status, snapshot.leases), STATUS_LEASE_BYTES)
    children = _within_bytes(
        (_child_engine_status(c, clock) for c in snapshot.child_engines),
        STATUS_CHILD_ENGINE_BYTES,
    )
    return pb.StatusResponse(
        version=__version__,
        reuse_enabled=snapshot.reuse_enabled,
        warming=snapshot.warming,
        child_engines=children,
        child_engines_total=len(snapshot.child_engines),
        inventory_entries=snapshot.inventory_entries,
        leases=leases,
        leases_total=snapshot.leases_total,
        store=snapshot.store,
        store_unavailable_reason=snapshot.store_unavailable_reason,
        remote_child_engines=snapshot.remote_child_engines,
        cost_model=_cost_status(snapshot.cost) if snapshot.cost is not None else None,
    )


def _cost_status(cost: CostStatus) -> pb.CostModelStatus:
    cfg = cost.config
    return pb.CostModelStatus(
        gate=cfg.gate,
        safety_margin=cfg.safety_margin,
        max_pairs=cfg.max_pairs,
        links=[
            pb.LinkCost(
                holder_child_engine_id=holder,
                requester_child_engine_id=requester,
                tier=pb.Tier.ValueType(tier.value),
                bandwidth_bytes_per_s=estimate.bandwidth_bytes_per_s,
                latency_ms=estimate.latency_ms,
                samples=estimate.samples,
                age_ms=-1 if age_ms is None else age_ms,
            )
            for (holder, requester, tier), estimate, age_ms in cost.links
        ],
        prefill_rates=[
            pb.PrefillRate(
                child_engine_id=child,
                tokens_per_s=estimate.tokens_per_s,
                samples=estimate.samples,
                source=estimate.source,
            )
            for child, estimate in cost.prefill_rates
        ],
        default_bandwidth_bytes_per_s=cfg.default_bandwidth_bytes_per_s,
        default_latency_ms=cfg.default_latency_ms,
        default_prefill_tokens_per_s=cfg.default_prefill_tokens_per_s,
        probe_bytes=cfg.probe_bytes,
        reverse_prior=cfg.reverse_prior,
        measurement_ttl_s=cfg.measurement_ttl_s,
    )


def _child_engine_status(status: ChildEngineStatus, clock: Clock) -> pb.ChildEngineStatus:
    view = status.view
    return pb.ChildEngineStatus(
        state=child_engine_state_to_proto(
            view, status.reuse, stale=status.stale, draining=status.draining
        ),
        inventory_entries=status.inventory_entries,
        profile=profile_to_proto(view.profile),
        parts=[
            pb.RankPartStatus(
                rank=pb.RankCoordinates(
                    tp_rank=part.registration.rank[0],
                    pp_rank=part.registration.rank[1],
                    pcp_rank=part.registration.rank[2],
                ),
                session_id=part.session_id,
                incarnation=part.incarnation,
                last_heartbeat_unix_ms=to_unix_ms(clock, part.last_heartbeat_ms),
                endpoint=part.registration.endpoint.to_proto(),
            )
            for part in view.parts
        ],
    )


# --- inventory: event batches and lookups ------------------------------------------

_TIERS = {t.value: t for t in ev.Tier}


def _tier(field: str, value: int) -> ev.Tier:
    tier = _TIERS.get(value)
    if tier is None:
        raise invalid(f"{field}: tier must be one of GPU, CPU, DISK, EXTERNAL (1..4), got {value}")
    return tier


def _group(field: str, value: int) -> int:
    if value > MAX_GROUP_IDX:
        raise invalid(f"{field}: group_idx {value} exceeds {MAX_GROUP_IDX}")
    return value


def check_block_hashes(field: str, hashes: Sequence[bytes], limit: int) -> tuple[bytes, ...]:
    """1..limit hashes of 1..64 bytes each (C-level min/max: the lookup path is hot)."""
    n = len(hashes)
    if n > limit:
        raise invalid(f"{field} has {n} block hashes; the limit is {limit}")
    # One copy out of the protobuf container: each element access allocates.
    copied = tuple(hashes)
    if n:
        # The set of distinct lengths is tiny (usually one): cheaper than a list of n.
        distinct = {*map(len, copied)}
        if 0 in distinct:
            i = next(i for i, h in enumerate(copied) if not h)
            raise invalid(f"{field}[{i}] is empty (block hashes are 1..64 bytes)")
        if max(distinct) > MAX_BLOCK_HASH_BYTES:
            lengths = [len(h) for h in copied]
            i = next(i for i, n in enumerate(lengths) if n > MAX_BLOCK_HASH_BYTES)
            raise invalid(
                f"{field}[{i}] is {lengths[i]} bytes; block hashes are 1.."
                f"{MAX_BLOCK_HASH_BYTES} bytes"
            )
    return copied


def event_batch_from_proto(msg: pb.EventBatch, clock: Clock) -> ev.EventBatch:
    """Validates a whole batch before anything of it is applied (INVALID_ARGUMENT)."""
    check_count("events.events", len(msg.events), MAX_EVENTS_PER_BATCH)
    events: list[ev.InventoryEvent] = []
    blocks = 0
    for i, event in enumerate(msg.events):
        kind = event.WhichOneof("event")
        where = f"events.events[{i}]"
        if kind == "stored":
            st = event.stored
            hashes = check_block_hashes(
                f"{where}.stored.block_hashes", st.block_hashes, MAX_CHAIN_BLOCKS
            )
            if not hashes:
                raise invalid(f"{where}.stored.block_hashes is empty")
            parent = bytes(st.parent_block_hash)
            if len(parent) > MAX_BLOCK_HASH_BYTES:
                raise invalid(
                    f"{where}.stored.parent_block_hash is {len(parent)} bytes; the limit is "
                    f"{MAX_BLOCK_HASH_BYTES}"
                )
            blocks += len(hashes)
            events.append(
                ev.BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent or None,
                    num_tokens=st.num_tokens,
                    tier=_tier(f"{where}.stored.tier", st.tier),
                    group_idx=_group(f"{where}.stored", st.group_idx),
                    expiry_ms=_expiry_from_unix(clock, st.expiry_unix_ms),
                )
            )
        elif kind == "removed":
            rm = event.removed
            hashes = check_block_hashes(
                f"{where}.removed.block_hashes", rm.block_hashes, MAX_CHAIN_BLOCKS
            )
            blocks += len(hashes)
            events.append(
                ev.BlockRemoved(
                    block_hashes=hashes,
                    tier=_tier(f"{where}.removed.tier", rm.tier),
                    group_idx=_group(f"{where}.removed", rm.group_idx),
                )
            )
        elif kind == "cleared":
            events.append(ev.AllBlocksCleared())
        else:
            raise invalid(f"{where} has no event set (stored, removed or cleared)")
        if blocks > MAX_BLOCKS_PER_BATCH:
            raise invalid(
                f"events carry more than {MAX_BLOCKS_PER_BATCH} block hashes in one batch; split it"
            )
    return ev.EventBatch(
        incarnation=msg.incarnation,
        sequence=msg.sequence,
        events=tuple(events),
        dump_begin=msg.dump_begin,
        dump_end=msg.dump_end,
    )


def lookup_request_from_proto(
    msg: pb.LookupRequest, bounds: FieldBounds
) -> tuple[str, tuple[LookupQuery, ...]]:
    requester = check_id("requester_child_engine_id", msg.requester_child_engine_id, bounds)
    n = len(msg.queries)
    if n == 0:
        raise invalid("queries is empty: send at least one LookupQuery")
    check_count("queries", n, inv.MAX_QUERIES_PER_LOOKUP)
    queries = []
    for i, q in enumerate(msg.queries):
        hashes = check_block_hashes(f"queries[{i}].block_hashes", q.block_hashes, MAX_CHAIN_BLOCKS)
        if q.max_candidates > inv.MAX_CANDIDATES:
            raise invalid(
                f"queries[{i}].max_candidates {q.max_candidates} exceeds {inv.MAX_CANDIDATES}"
            )
        if q.min_blocks > MAX_CHAIN_BLOCKS:
            raise invalid(f"queries[{i}].min_blocks {q.min_blocks} exceeds {MAX_CHAIN_BLOCKS}")
        queries.append(
            LookupQuery(
                block_hashes=hashes,
                compatibility_hash=check_text(
                    f"queries[{i}].compatibility_hash", q.compatibility_hash, bounds
                ),
                min_blocks=q.min_blocks,
                include_self=q.include_self,
                max_candidates=q.max_candidates or inv.DEFAULT_MAX_CANDIDATES,
                group_idx=_group(f"queries[{i}]", q.group_idx),
            )
        )
    return requester, tuple(queries)


_OUTCOMES: dict[LookupVerdict, pb.LookupOutcome.ValueType] = {
    LookupVerdict.HIT: pb.LOOKUP_OUTCOME_HIT,
    LookupVerdict.MISS: pb.LOOKUP_OUTCOME_MISS,
    LookupVerdict.BELOW_MIN_BLOCKS: pb.LOOKUP_OUTCOME_BELOW_MIN_BLOCKS,
    LookupVerdict.REUSE_UNAVAILABLE: pb.LOOKUP_OUTCOME_REUSE_UNAVAILABLE,
}


# ReuseStatus values are few (one per engine and reason): their messages are built once.
_REUSE_PROTOS: dict[ReuseStatus, pb.ReuseStatus] = {}
_MAX_REUSE_PROTOS = 1024


def _reuse_proto(status: ReuseStatus) -> pb.ReuseStatus:
    msg = _REUSE_PROTOS.get(status)
    if msg is None:
        msg = reuse_status_to_proto(status)
        if len(_REUSE_PROTOS) >= _MAX_REUSE_PROTOS:
            _REUSE_PROTOS.clear()  # bounded whatever the details say
        _REUSE_PROTOS[status] = msg
    return msg


def lookup_response_to_proto(results: Sequence[LookupResult], clock: Clock) -> pb.LookupResponse:
    # Filled in place with add(): half the cost of nested keyword constructors (hot path).
    response = pb.LookupResponse()
    add_result = response.results.add
    unix_offset = clock.wall_offset_ms()
    for r in results:
        result = add_result(outcome=_OUTCOMES[r.outcome])
        add_candidate = result.candidates.add
        for c in r.candidates:
            add_candidate(
                child_engine_id=c.child_engine_id,
                matched_blocks=c.matched_blocks,
                tier=pb.Tier.ValueType(c.tier),
                expiry_unix_ms=c.expiry_ms + unix_offset if c.expiry_ms else 0,
                leases_in_flight=c.leases_in_flight,
            )
        result.reuse.CopyFrom(_reuse_proto(r.reuse))
    return response


# --- score (routers) ------------------------------------------------------------------


def score_request_from_proto(msg: pb.ScoreRequest, bounds: FieldBounds) -> ScoreQuery:
    """INVALID_ARGUMENT naming the field and the limit; sizes before any copy."""
    if not msg.HasField("scope"):
        raise invalid("scope is missing: name at least scope.model")
    scope = msg.scope
    model = check_text("scope.model", scope.model, bounds)
    if not model:
        raise invalid("scope.model is empty: name the model whose engines to score")
    lora = check_text("scope.lora_name", scope.lora_name, bounds)
    lora_path = check_text("scope.lora_path", scope.lora_path, bounds)
    salt = check_text("scope.cache_salt", scope.cache_salt, bounds)
    group_idx = _group("scope", scope.group_idx)
    n = len(msg.candidate_child_engine_ids)
    if n > MAX_SCORE_CANDIDATES:
        raise invalid(
            f"candidate_child_engine_ids has {n} entries; the limit is {MAX_SCORE_CANDIDATES}"
        )
    candidates = tuple(
        check_id(f"candidate_child_engine_ids[{i}]", c, bounds)
        for i, c in enumerate(msg.candidate_child_engine_ids)
    )
    kind = msg.WhichOneof("prompt")
    token_ids: tuple[int, ...] | None = None
    hashes: tuple[bytes, ...] | None = None
    mm_features: tuple[MmFeature, ...] = ()
    if kind == "token_ids":
        count = len(msg.token_ids.ids)
        if count > MAX_SCORE_TOKENS:
            raise invalid(f"token_ids has {count} tokens; the limit is {MAX_SCORE_TOKENS}")
        if not count:
            raise invalid("token_ids is empty: send the prompt's token ids")
        token_ids = tuple(msg.token_ids.ids)
        mm_features = _mm_features(msg.token_ids.mm_features, count, bounds)
    elif kind == "block_hashes":
        hashes = check_block_hashes("block_hashes", msg.block_hashes.hashes, MAX_SCORE_BLOCKS)
        if not hashes:
            raise invalid("block_hashes is empty: send the prompt's chain")
    else:
        raise invalid("no prompt: send token_ids or block_hashes")
    return ScoreQuery(
        model=model,
        token_ids=token_ids,
        block_hashes=hashes,
        lora_name=lora,
        lora_path=lora_path,
        cache_salt=salt,
        group_idx=group_idx,
        candidates=candidates,
        mm_features=mm_features,
    )


def _mm_features(
    items: Sequence[pb.MultimodalFeature], num_tokens: int, bounds: FieldBounds
) -> tuple[MmFeature, ...]:
    """Each item inside the prompt, sorted by offset, not overlapping (as vLLM holds them)."""
    if len(items) > MAX_MM_FEATURES:
        raise invalid(
            f"token_ids.mm_features has {len(items)} items; the limit is {MAX_MM_FEATURES}"
        )
    out: list[MmFeature] = []
    end = 0
    for i, item in enumerate(items):
        where = f"token_ids.mm_features[{i}]"
        identifier = check_text(f"{where}.identifier", item.identifier, bounds)
        if not identifier:
            raise invalid(f"{where}.identifier is empty: send the item's hash (vLLM's identifier)")
        if item.length < 1:
            raise invalid(f"{where}.length is 0: an item covers at least one placeholder token")
        if item.offset + item.length > num_tokens:
            raise invalid(
                f"{where} covers tokens {item.offset}..{item.offset + item.length - 1}, past "
                f"the prompt's {num_tokens} token ids"
            )
        if item.offset < end:
            raise invalid(
                f"{where} starts at {item.offset}, before the one before it ends ({end}): "
                "send the items sorted by offset, not overlapping"
            )
        end = item.offset + item.length
        out.append(MmFeature(identifier, item.offset, item.length))
    return tuple(out)


def score_response_to_proto(answer: ScoreAnswer) -> pb.ScoreResponse:
    response = pb.ScoreResponse(
        reuse_enabled=answer.reuse_enabled,
        reuse_detail=answer.reuse_detail,
        prediction_basis=answer.prediction_basis,
        engines_left_out=answer.engines_left_out,
    )
    for e in answer.engines:
        out = response.engines.add(
            child_engine_id=e.child_engine_id,
            scored=e.scored,
            detail=e.detail,
            prompt_blocks=e.prompt_blocks,
            local_matched_blocks=e.local_matched_blocks,
            loadable_blocks=e.loadable_blocks,
            holder_child_engine_id=e.holder_child_engine_id,
            holder_tier=pb.Tier.ValueType(e.holder_tier or 0),
            predicted_saving_ms=e.predicted_saving_ms,
        )
        for tier, blocks in e.local_by_tier:
            out.local_by_tier.add(tier=pb.Tier.ValueType(tier), blocks=blocks)
        if e.reuse is not None:
            out.reuse.CopyFrom(_reuse_proto(e.reuse))
    return response


# --- leases: prefix load, decode handoff, drain, quarantine ---------------------------

# Far above any real connector's params; the core checks its own (larger) bound too.
MAX_KV_TRANSFER_PARAMS_BYTES = 1 << 20
MAX_BLOCK_IDS = 1 << 16
MAX_DURATION_MS = 600_000  # pin / transfer / wait / drain timeouts on the wire


def _rank_key(msg: pb.RankCoordinates) -> tuple[int, int, int]:
    return (msg.tp_rank, msg.pp_rank, msg.pcp_rank)


def _duration(field: str, value: int, limit: int = MAX_DURATION_MS) -> int:
    if value > limit:
        raise invalid(f"{field} is {value} ms; the limit is {limit} ms")
    return value


def descriptor_from_proto(
    field: str, msg: pb.RankPartDescriptor, rank: tuple[int, int, int], bounds: FieldBounds
) -> bytes:
    """Validates a source part's descriptor; returns it serialized, to hand back byte for byte."""
    if _rank_key(msg.rank) != rank:
        raise invalid(f"{field}.rank {_rank_key(msg.rank)} is not the sending rank part {rank}")
    _check_endpoint(msg.endpoint, bounds)
    check_count(f"{field}.block_ids", len(msg.block_ids), MAX_BLOCK_IDS)
    if len(msg.opaque) > bounds.max_metadata_bytes:
        raise invalid(
            f"{field}.opaque is {len(msg.opaque)} bytes; the limit is {bounds.max_metadata_bytes}"
        )
    return msg.SerializeToString(deterministic=True)


def _descriptor_to_proto(part: SourcePart) -> pb.RankPartDescriptor:
    assert isinstance(part.descriptor, bytes)
    return pb.RankPartDescriptor.FromString(part.descriptor)


def prefix_load_request_from_proto(
    msg: pb.PrefixLoadRequest, bounds: FieldBounds
) -> PrefixLoadRequest:
    chain = check_block_hashes("block_hashes", msg.block_hashes, MAX_CHAIN_BLOCKS)
    if not chain:
        raise invalid("block_hashes is empty: a prefix load needs at least one block")
    if msg.min_blocks > len(chain):
        raise invalid(f"min_blocks {msg.min_blocks} exceeds the chain's {len(chain)} blocks")
    if msg.local_blocks >= len(chain):
        raise invalid(
            f"local_blocks {msg.local_blocks} leaves nothing to load of the chain's "
            f"{len(chain)} blocks: send the blocks past the ones the requester holds"
        )
    if msg.compatibility_hash:
        check_id("compatibility_hash", msg.compatibility_hash, bounds)
    return PrefixLoadRequest(
        request_id=check_id("request_id", msg.request_id, bounds),
        requester_child_engine_id=check_id(
            "requester_child_engine_id", msg.requester_child_engine_id, bounds
        ),
        block_hashes=chain,
        compatibility_hash=msg.compatibility_hash,
        min_blocks=msg.min_blocks,
        group_idx=_group("group_idx", msg.group_idx),
        pin_timeout_ms=_duration("pin_timeout_ms", msg.pin_timeout_ms, 60_000),
        transfer_timeout_ms=_duration("transfer_timeout_ms", msg.transfer_timeout_ms),
        local_blocks=msg.local_blocks,
    )


_REPORT_OUTCOMES = {o.value: o for o in Outcome}
# A prefill rate sample is one prefill, not a sum over hours (I8-bad-input).
MAX_PREFILL_SAMPLE_US = 3_600_000_000
# A report's bytes: more than any load moves (a chain of MAX_CHAIN_BLOCKS blocks of
# 1 GiB each is 4 TiB), so that one report cannot wreck kvrc_transfer_bytes_total.
MAX_REPORT_BYTES = 1 << 50


def transfer_report_from_proto(msg: pb.TransferReport, bounds: FieldBounds) -> TransferReport:
    outcome = _REPORT_OUTCOMES.get(msg.outcome)
    if outcome is None:
        raise invalid(f"outcome must be SUCCEEDED, FAILED or UNKNOWN (1..3), got {msg.outcome}")
    prefill = msg.prefill
    if msg.HasField("prefill") and (prefill.tokens == 0 or prefill.duration_us == 0):
        raise invalid(
            f"prefill sample needs tokens >= 1 and duration_us >= 1, got {prefill.tokens} "
            f"tokens in {prefill.duration_us} us (leave prefill unset when not measured)"
        )
    if msg.bytes_moved > MAX_REPORT_BYTES:
        raise invalid(
            f"bytes_moved {msg.bytes_moved} exceeds {MAX_REPORT_BYTES} (1 PiB): report the "
            "bytes this rank part moved for this lease"
        )
    if prefill.duration_us > MAX_PREFILL_SAMPLE_US:
        raise invalid(
            f"prefill.duration_us {prefill.duration_us} exceeds {MAX_PREFILL_SAMPLE_US} "
            "(one hour): a rate sample is one prefill"
        )
    return TransferReport(
        lease_id=check_id("lease_id", msg.lease_id, bounds),
        reporter_child_engine_id=check_id(
            "reporter_child_engine_id", msg.reporter_child_engine_id, bounds
        ),
        rank_key=_rank_key(msg.rank),
        outcome=outcome,
        bytes_moved=msg.bytes_moved,
        duration_us=msg.duration_us,
        error_message=check_text("error_message", msg.error_message, bounds),
        prefill_tokens=prefill.tokens,
        prefill_duration_us=prefill.duration_us,
    )


def publish_handoff_from_proto(
    msg: pb.PublishHandoffRequest, bounds: FieldBounds
) -> PublishHandoffRequest:
    rank = _rank_key(msg.rank)
    if not msg.HasField("descriptor"):
        raise invalid("descriptor is missing: each prefill part publishes its own blocks")
    if len(msg.kv_transfer_params) > MAX_KV_TRANSFER_PARAMS_BYTES:
        raise invalid(
            f"kv_transfer_params are {len(msg.kv_transfer_params)} bytes; the limit is "
            f"{MAX_KV_TRANSFER_PARAMS_BYTES}"
        )
    if msg.num_blocks > MAX_CHAIN_BLOCKS * 16:
        raise invalid(f"num_blocks {msg.num_blocks} exceeds {MAX_CHAIN_BLOCKS * 16}")
    decode = msg.decode_child_engine_id
    return PublishHandoffRequest(
        request_id=check_id("request_id", msg.request_id, bounds),
        prefill_child_engine_id=check_id(
            "prefill_child_engine_id", msg.prefill_child_engine_id, bounds
        ),
        rank_key=rank,
        descriptor=descriptor_from_proto("descriptor", msg.descriptor, rank, bounds),
        kv_transfer_params=bytes(msg.kv_transfer_params),
        decode_child_engine_id=(
            check_id("decode_child_engine_id", decode, bounds) if decode else None
        ),
        num_blocks=msg.num_blocks,
    )


def begin_handoff_from_proto(
    msg: pb.BeginHandoffRequest, bounds: FieldBounds
) -> BeginHandoffRequest:
    return BeginHandoffRequest(
        request_id=check_id("request_id", msg.request_id, bounds),
        prefill_child_engine_id=check_id(
            "prefill_child_engine_id", msg.prefill_child_engine_id, bounds
        ),
        decode_child_engine_id=check_id(
            "decode_child_engine_id", msg.decode_child_engine_id, bounds
        ),
        wait_timeout_ms=_duration("wait_timeout_ms", msg.wait_timeout_ms),
    )


def pin_result_from_proto(
    msg: pb.PinResult, rank: tuple[int, int, int], bounds: FieldBounds
) -> tuple[str, int, bytes | None, str]:
    """(lease id, pinned blocks, descriptor or None for a miss, error message)."""
    lease_id = check_id("pin_result.lease_id", msg.lease_id, bounds)
    descriptor = None
    if msg.pinned_blocks > 0:
        if not msg.HasField("descriptor"):
            raise invalid("pin_result.descriptor is missing for a non-zero pin")
        descriptor = descriptor_from_proto("pin_result.descriptor", msg.descriptor, rank, bounds)
        if 0 < len(msg.descriptor.block_ids) < msg.pinned_blocks:
            raise invalid(
                f"pin_result.descriptor lists {len(msg.descriptor.block_ids)} block ids for "
                f"{msg.pinned_blocks} pinned blocks"
            )
    return (
        lease_id,
        msg.pinned_blocks,
        descriptor,
        check_text("pin_result.error_message", msg.error_message, bounds),
    )


def drain_request_from_proto(msg: pb.DrainRequest, bounds: FieldBounds) -> tuple[str, int, bool]:
    return (
        check_id("child_engine_id", msg.child_engine_id, bounds),
        _duration("timeout_ms", msg.timeout_ms, 3_600_000),
        msg.wait,
    )


def resolve_quarantine_from_proto(
    msg: pb.ResolveQuarantineRequest, bounds: FieldBounds
) -> tuple[str, str]:
    if msg.resolution != pb.QUARANTINE_RESOLUTION_RELEASE:
        raise invalid(
            f"resolution must be RELEASE (1), got {msg.resolution}: the only way out of "
            "quarantine is an operator's proof that the blocks are quiet"
        )
    return (
        check_id("lease_id", msg.lease_id, bounds),
        check_text("operator_note", msg.operator_note, bounds),
    )


def _lease_state(state: LeaseState) -> pb.LeaseState.ValueType:
    return pb.LeaseState.ValueType(state.value)


_UINT64_MAX = (1 << 64) - 1
_UINT32_MAX = (1 << 32) - 1


def prediction_to_proto(prediction: Prediction) -> pb.CostPrediction:
    return pb.CostPrediction(
        load_ms=prediction.load_ms,
        recompute_ms=prediction.recompute_ms,
        safety_margin=prediction.safety_margin,
        worth_loading=prediction.worth_loading,
        # Bounded where they come from (block_len, block_size); clamped here as well, so
        # that no prediction can fail the answer it rides on.
        num_bytes=min(prediction.num_bytes, _UINT64_MAX),
        num_tokens=min(prediction.num_tokens, _UINT32_MAX),
        holder_child_engine_id=prediction.holder_child_engine_id,
        tier=pb.Tier.ValueType(prediction.tier.value),
        bandwidth_bytes_per_s=prediction.link.bandwidth_bytes_per_s,
        latency_ms=prediction.link.latency_ms,
        link_samples=prediction.link.samples,
        link_prior=prediction.link.prior,
        prefill_tokens_per_s=prediction.prefill.tokens_per_s,
        prefill_source=prediction.prefill.source,
        detail=prediction.describe(),
    )


def prefix_load_answer_to_proto(answer: PrefixLoadAnswer, clock: Clock) -> pb.PrefixLoadGrant:
    reuse = reuse_status_to_proto(answer.reuse)
    view = answer.view
    grant = view.prefix_load_grant if view is not None else None
    prediction = prediction_to_proto(answer.prediction) if answer.prediction is not None else None
    if grant is None:
        return pb.PrefixLoadGrant(
            outcome=pb.GRANT_OUTCOME_MISS,
            miss_reason=f"{answer.miss_reason}: {answer.miss_detail}",
            lease_id=view.lease_id if view is not None else "",
            reuse=reuse,
            prediction=prediction,
        )
    return pb.PrefixLoadGrant(
        outcome=pb.GRANT_OUTCOME_GRANTED,
        lease_id=grant.lease_id,
        source_child_engine_id=grant.source_child_engine_id,
        matched_blocks=grant.matched_blocks,
        source_parts=[_descriptor_to_proto(p) for p in grant.source_parts],
        deadline_unix_ms=to_unix_ms(clock, grant.deadline_ms),
        reuse=reuse,
        prediction=prediction,
    )


def handoff_grant_to_proto(
    grant: HandoffGrant, heartbeat_interval_ms: int, clock: Clock
) -> pb.HandoffGrant:
    return pb.HandoffGrant(
        lease_id=grant.lease_id,
        prefill_child_engine_id=grant.prefill_child_engine_id,
        source_parts=[_descriptor_to_proto(p) for p in grant.source_parts],
        kv_transfer_params=grant.kv_transfer_params,
        deadline_unix_ms=to_unix_ms(clock, grant.deadline_ms),
        heartbeat_interval_ms=heartbeat_interval_ms,
        num_blocks=grant.num_blocks,
    )


def complete_response_to_proto(outcome: CompleteOutcome) -> pb.CompleteResponse:
    return pb.CompleteResponse(state=_lease_state(outcome.state), quiescent=outcome.quiescent)


def publish_response_to_proto(outcome: PublishOutcome) -> pb.PublishHandoffResponse:
    return pb.PublishHandoffResponse(
        state=_lease_state(outcome.state),
        parts_reported=outcome.parts_reported,
        parts_expected=outcome.parts_expected,
        lease_id=outcome.lease_id,
    )


def drain_response_to_proto(result: DrainResult) -> pb.DrainResponse:
    return pb.DrainResponse(
        child_engine_ids=list(result.child_engine_ids),
        leases_remaining=result.leases_remaining,
        safe_to_stop=result.safe_to_stop,
    )


# A lease id is what an engine reports on a lease with (and, after a restart, the first
# reporter on a rebuilt lease may become its requester): a reader gets enough to find it
# in the logs, not enough to act on it.
SHOWN_LEASE_ID_CHARS = 8


def shortened_lease_id(lease_id: str) -> str:
    """A non-admin's view of a lease id: its kvrc prefix ("pl-" or "ho-", each ending at the
    id's first '-'), 8 characters and "..." ("pl-1a2b3c4d..."); another id: its first 8."""
    start = lease_id.index("-") + 1 if flow_of_lease_id(lease_id) is not None else 0
    return lease_id[: start + SHOWN_LEASE_ID_CHARS] + "..."


def lease_status_to_proto(view: LeaseView, clock: Clock) -> pb.LeaseStatus:
    return pb.LeaseStatus(
        lease_id=view.lease_id,
        flow=view.flow.value,
        state=_lease_state(view.state),
        source_child_engine_id=view.source_child_engine_id,
        target_child_engine_id=view.target_child_engine_id or "",
        deadline_unix_ms=to_unix_ms(clock, view.deadline_ms) if view.deadline_ms else 0,
        reason=view.reason,
    )


def _lease_message(out: object, clock: Clock) -> pb.CoordinatorMessage | None:
    if isinstance(out, SendPin):
        return pb.CoordinatorMessage(
            pin_request=pb.PinRequest(
                lease_id=out.lease_id,
                block_hashes=list(out.block_hashes),
                requester_child_engine_id=out.requester_child_engine_id,
                deadline_unix_ms=to_unix_ms(clock, out.deadline_ms),
                group_idx=out.group_idx,
            )
        )
    if isinstance(out, SendRelease):
        return pb.CoordinatorMessage(
            release_request=pb.ReleaseRequest(lease_id=out.lease_id, reason=out.reason)
        )
    if isinstance(out, SendAbort):
        return pb.CoordinatorMessage(
            abort_request=pb.AbortRequest(lease_id=out.lease_id, reason=out.reason)
        )
    if isinstance(out, SendQuarantine):
        return pb.CoordinatorMessage(
            quarantine_notice=pb.QuarantineNotice(lease_id=out.lease_id, reason=out.reason)
        )
    if isinstance(out, DrainNotice):
        return pb.CoordinatorMessage(
            drain_notice=pb.DrainNotice(
                child_engine_id=out.child_engine_id,
                deadline_unix_ms=to_unix_ms(clock, out.deadline_ms),
            )
        )
    return None
