"""Rank parts and lease messages across replicas: a holder on one, a requester on another.

With a shared store (coordinator/runtime/redis_store.py) every replica keeps every
rank part in its registry: its own (a local session) and the other replicas'
(*remote* parts, known from the log). A prefix load opened on the requester's
replica (the lease's *owner*) may then name a holder whose session is on another
replica: the lease lives in the owner's lease table only, and its session
messages travel through the same ordered log as the inventory:

- `OP_PART` / `OP_PART_LEFT`: a part registered here / its session closed here.
  Every other replica registers it as a remote part / removes it (and, after its
  own `session_grace_ms`, may prove the engine gone, I6-quiescence). The session
  id is the part's fencing token: a message names it, and a replica delivers a
  message only to that very session. A part that moved to another replica has a
  new session id, so a message meant for its old session is dropped, never
  delivered to the wrong owner.
- `OP_SEND`: a pin, release, abort, quarantine or drain message for a remote part,
  addressed to the replica that holds its session. Deadlines travel as the time
  left (monotonic clocks differ between hosts).
- `OP_REPLY`: the holder's PinResult or AbortAck for a lease owned elsewhere,
  addressed to the owner, which applies it as if the holder's session were its
  own. Each lease id names its owner (`pl-<random>@<owner>`,
  coordinator/core/leases.py `owner_of_lease_id`), so the holder's replica, or the
  one it moved to, routes its answers without asking anybody. A holder that
  re-announces a lease whose owner is alive leaves it to the owner; one whose
  owner fell silent is rebuilt here, QUARANTINED, as after a restart.
- `OP_HELLO`: a replica that starts (or reloads a snapshot) asks the others to
  announce their parts again (parts are not in the inventory snapshot).

One order: every replica applies these ops in log order, so remote registrations
and removals reach every replica in the same order, and a replica's messages to a
part follow that part's registration. A local session is first hand: a remote
op for a part this replica holds locally is ignored. What stays per replica:
each lease's table entry (its owner's), the cost estimates, handoffs (both sides
on one replica) and drains (docs/operations.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from coordinator.core.grants import DrainNotice, LeaseOutbound
from coordinator.core.leases import (
    Flow,
    SendAbort,
    SendPin,
    SendQuarantine,
    SendRelease,
    owner_of_lease_id,
)
from coordinator.core.registry import PartRef, RankPartRegistration

log = logging.getLogger("kvrc.peers")

OP_PART = "P"
OP_PART_LEFT = "L"
OP_SEND = "M"
OP_REPLY = "Y"
OP_HELLO = "W"
PEER_TAGS = frozenset((OP_PART, OP_PART_LEFT, OP_SEND, OP_REPLY, OP_HELLO))

# Replies of the holder's session that the owner needs (ReleaseAck is only logged).
REPLY_PIN = "pin"
REPLY_ABORT_ACK = "abort_ack"

Op = list[Any]


@dataclass(frozen=True, slots=True)
class PartCodec:
    """A registration as bytes and back (the wire's own Register message, edges/grpc_wire.py).

    `decode` checks what it reads as a registering engine's message is checked, so a
    skewed replica's op is refused field by field, never trusted.
    """

    encode: Callable[[RankPartRegistration], bytes]
    decode: Callable[[bytes], RankPartRegistration]


class PeerHost(Protocol):
    """What the coordinator does for the ops of other replicas."""

    def register_remote_part(
        self, origin: str, session_id: str, registration: RankPartRegistration
    ) -> bool:
        """Registers another replica's part; False when it is not taken (a local one wins)."""

    def remove_remote_part(self, ref: PartRef, reason: str) -> bool:
        """Removes a remote part if `ref.session_id` still holds it."""

    def deliver(self, ref: PartRef, message: LeaseOutbound) -> bool:
        """Queues a message on a local session, if `ref.session_id` is still it."""

    def remote_pin_result(
        self,
        ref: PartRef,
        lease_id: str,
        pinned_blocks: int,
        descriptor: bytes | None,
        error_message: str,
    ) -> None: ...

    def remote_abort_ack(self, ref: PartRef, lease_id: str) -> None: ...

    def local_parts(self) -> list[tuple[str, RankPartRegistration]]:
        """(session id, registration) of every part whose session is here."""


def encode_message(message: LeaseOutbound, now_ms: int) -> list[Any]:
    """A lease message as msgpack-ready data; a deadline becomes the time left (>= 1)."""
    if isinstance(message, SendPin):
        return [
            "pin",
            message.lease_id,
            list(message.block_hashes),
            message.requester_child_engine_id,
            max(message.deadline_ms - now_ms, 1),
            message.group_idx,
        ]
    if isinstance(message, DrainNotice):
        return ["drain", max(message.deadline_ms - now_ms, 1)]
    kind = {SendRelease: "release", SendAbort: "abort", SendQuarantine: "quarantine"}
    return [kind[type(message)], message.lease_id, message.flow.value, message.reason]


def decode_message(raw: list[Any], ref: PartRef, now_ms: int) -> LeaseOutbound:
    """The receiver's side of `encode_message`, addressed to `ref`'s part."""
    kind = raw[0]
    cid, rank = ref.child_engine_id, ref.rank
    if kind == "pin":
        _, lease_id, hashes, requester, left, group = raw
        return SendPin(
            cid,
            rank,
            str(lease_id),
            tuple(bytes(h) for h in hashes),
            str(requester),
            now_ms + int(left),
            int(group),
        )
    if kind == "drain":
        return DrainNotice(cid, rank, now_ms + int(raw[1]))
    _, lease_id, flow, reason = raw
    args = (cid, rank, str(lease_id), Flow(flow), str(reason))
    if kind == "release":
        return SendRelease(*args)
    if kind == "abort":
        return SendAbort(*args)
    if kind == "quarantine":
        return SendQuarantine(*args)
    raise ValueError(f"unknown lease message kind {kind!r}")


def _ref(cid: Any, rank: Any, session_id: Any) -> PartRef:
    tp, pp, pcp = rank
    return PartRef(str(cid), (int(tp), int(pp), int(pcp)), str(session_id))


class PeerLink:
    """This replica's side of the cross-replica part and lease ops (module doc)."""

    def __init__(
        self,
        origin: str,
        record: Callable[[Op], None],
        codec: PartCodec,
        clock_ms: Callable[[], int],
        is_alive: Callable[[str], bool],
    ) -> None:
        self.origin = origin
        self._record = record
        self._codec = codec
        self._clock_ms = clock_ms
        self._host: PeerHost | None = None
        # Remote parts registered here: session id -> (origin, ref).
        self._remote: dict[str, tuple[str, PartRef]] = {}
        self._is_alive = is_alive  # an origin heard from lately (replication.py)
        self.sent = 0  # ops this replica wrote for its peers (tests, bench-cluster)

    def attach(self, host: PeerHost) -> None:
        self._host = host

    # --- this replica's own changes and messages --------------------------------------

    def part_registered(self, session_id: str, registration: RankPartRegistration) -> None:
        self._write([OP_PART, session_id, self._codec.encode(registration)])

    def part_left(self, ref: PartRef) -> None:
        self._write([OP_PART_LEFT, ref.child_engine_id, list(ref.rank), ref.session_id])

    def hello(self) -> None:
        self._write([OP_HELLO])

    def announce_local(self) -> None:
        """Announces every local part again (a hello, or a store that came back empty)."""
        if self._host is not None:
            for session_id, registration in self._host.local_parts():
                self.part_registered(session_id, registration)

    def origin_of(self, session_id: str) -> str | None:
        """The replica that holds a remote part's session (None: not a remote part)."""
        entry = self._remote.get(session_id)
        return entry[0] if entry is not None else None

    def send(self, session_id: str, message: LeaseOutbound) -> bool:
        """Addresses a lease message to the replica of a remote part's session."""
        entry = self._remote.get(session_id)
        if entry is None:
            return False
        origin, ref = entry
        encoded = encode_message(message, self._clock_ms())
        self._write([OP_SEND, origin, ref.child_engine_id, list(ref.rank), ref.session_id, encoded])
        return True

    def owner_of(self, lease_id: str) -> str | None:
        """The live replica that owns a lease, when it is not this one (else None)."""
        owner = owner_of_lease_id(lease_id)
        if not owner or owner == self.origin or not self._is_alive(owner):
            return None
        return owner

    def reply_pin_result(
        self,
        owner: str,
        ref: PartRef,
        lease_id: str,
        pinned_blocks: int,
        descriptor: bytes | None,
        error_message: str,
    ) -> None:
        self._write(
            [
                OP_REPLY,
                owner,
                REPLY_PIN,
                ref.child_engine_id,
                list(ref.rank),
                ref.session_id,
                lease_id,
                pinned_blocks,
                descriptor,
                error_message,
            ]
        )

    def reply_abort_ack(self, owner: str, ref: PartRef, lease_id: str) -> None:
        self._write(
            [
                OP_REPLY,
                owner,
                REPLY_ABORT_ACK,
                ref.child_engine_id,
                list(ref.rank),
                ref.session_id,
                lease_id,
            ]
        )

    def _write(self, op: Op) -> None:
        self.sent += 1
        self._record(op)

    # --- the other replicas' ops (ReplicatedInventory hands them over in log order) -----

    def apply(self, origin: str, op: Op) -> bool:
        host = self._host
        if host is None:
            return False
        tag = op[0]
        if tag == OP_PART:
            session_id = str(op[1])
            if session_id in self._remote:
                return False  # an announcement again (after a hello)
            registration = self._codec.decode(bytes(op[2]))
            ref = PartRef(registration.child_engine_id, registration.rank, session_id)
            if not host.register_remote_part(origin, session_id, registration):
                return False
            self._remote[session_id] = (origin, ref)
            return True
        if tag == OP_PART_LEFT:
            ref = _ref(op[1], op[2], op[3])
            if self._remote.get(ref.session_id, ("", None))[0] != origin:
                return False
            del self._remote[ref.session_id]
            return host.remove_remote_part(ref, f"its session on replica {origin} closed")
        if tag == OP_HELLO:
            self.announce_local()
            return True
        if op[1] != self.origin:
            return False  # addressed to another replica
        if tag == OP_SEND:
            ref = _ref(op[2], op[3], op[4])
            message = decode_message(op[5], ref, self._clock_ms())
            if not host.deliver(ref, message):
                log.info(
                    "%s for %s rank %s from replica %s dropped: session %s is not here any more",
                    type(message).__name__,
                    ref.child_engine_id,
                    ref.rank,
                    origin,
                    ref.session_id,
                )
            return True
        if tag == OP_REPLY:
            ref = _ref(op[3], op[4], op[5])
            lease_id = str(op[6])
            if op[2] == REPLY_PIN:
                descriptor = None if op[8] is None else bytes(op[8])
                host.remote_pin_result(ref, lease_id, int(op[7]), descriptor, str(op[9]))
            elif op[2] == REPLY_ABORT_ACK:
                host.remote_abort_ack(ref, lease_id)
            else:
                raise ValueError(f"unknown reply kind {op[2]!r}")
            return True
        raise ValueError(f"unknown peer op tag {tag!r}")

    def origin_gone(self, origin: str, reason: str) -> int:
        """An origin reset (restarted) or fell silent: its parts leave. Returns them."""
        host = self._host
        left = [(sid, ref) for sid, (o, ref) in self._remote.items() if o == origin]
        for session_id, ref in left:
            del self._remote[session_id]
            if host is not None:
                host.remove_remote_part(ref, reason)
        return len(left)

    def forget_all(self, reason: str) -> int:
        """A store loss: every remote part leaves (their replicas announce them again)."""
        origins = {o for o, _ in self._remote.values()}
        return sum(self.origin_gone(o, reason) for o in origins)

    def forget_session(self, session_id: str) -> None:
        """A local registration replaced this remote part (the engine moved here)."""
        self._remote.pop(session_id, None)

    @property
    def remote_parts(self) -> int:
        return len(self._remote)
