"""Rank parts and lease messages across replicas: a holder on one, a requester on another.

With a shared store (coordinator/runtime/redis_store.py) every replica keeps every
rank part in its registry: its own (a local session) and the other replicas'
(*remote* parts, known from the log). A prefix load opened on the requester's
replica (the lease's *owner*) may then name a holder whose session is on another
replica: the lease lives in the owner's lease table only, and its session
messages travel through the same ordered log as the inventory:

- `OP_PART` / `OP_PART_LEFT`: a part registered here / its session closed here.
  Every other replica registers it as a remote part / removes it (and, after its
  own `session_grace_ms`, may prove the engine gone, I6-quiescence). A replica that
  owns a lease the part owes an abort ack for asks it again, as for a part that
  registers there (I6-quiescence).
- **Fencing.** Each registration takes a fencing token from the store (one
  counter, `INCR` in a Lua script that checks the store's epoch), and its
  `OP_PART` carries it, with a tag of the store it came from (a digest of its
  epoch). Tokens of two stores are not compared: after a store loss, a replica
  that has not noticed it yet may write its parts with the old store's tokens into
  the new log, and a replica that has noticed does not take those (nor the other
  way round): such a session is unaccounted for (below) until its replica, once it
  notices (within a store heartbeat), resets and announces it with a new token. A
  session's tokens only grow within a store, so its own lower token is a new
  store's (an older replica's ops carry no tag). For one rank part the highest
  token wins on every replica: a replica that holds a session of the part with a
  lower token (a zombie: the engine re-registered elsewhere, this stream has not
  timed out yet) closes it, and an `OP_PART` with a lower token than one already
  seen is ignored. A local session whose own claim is still out is not closed by an
  `OP_PART` read meanwhile (it may be an older re-announcement): its claim's token
  decides, and if it loses, the winner is registered in its place at once. So one
  session owns a rank part at a time. A message names the session
  id it is for, and a replica delivers it only to that very session: one meant
  for a session that moved or was fenced out is dropped, never delivered to the
  wrong owner; but a release (its lease has ended) goes on to the part's session
  now, or waits for its next registration (`LeaseFlow.release_again`).
- `OP_SEND`: a pin, release, abort, quarantine or drain message for a remote part,
  addressed to the replica that holds its session. Deadlines travel as the time
  left (monotonic clocks differ between hosts). One that a replica sends again because
  the part registered (a lease owner's aborts owed and quarantines, the releases a
  replica kept) is marked, and the part's replica queues it as it queues a local
  registration's answers: past the session queue's cap (each is one lease's, so they
  are bounded), else a part with more of them than the queue holds would be closed
  RESOURCE_EXHAUSTED on every return. (An older replica's resends are not marked.)
- `OP_REPLY`: the holder's PinResult or AbortAck for a lease owned elsewhere,
  addressed to the owner, which applies it as if the holder's session were its
  own. Each lease id names its owner (`pl-<random>@<owner>`,
  coordinator/core/leases.py `owner_of_lease_id`), so the holder's replica, or the
  one it moved to, routes its answers without asking anybody. A holder that
  re-announces a lease whose owner is alive leaves it to the owner; one whose
  owner fell silent is rebuilt here, QUARANTINED, as after a restart, and so is a
  prefix load left to an owner that falls silent later without having released it
  (`PeerHost.owner_silent`).
- `OP_HELLO`: a replica that starts (or reloads a snapshot) asks the others to
  announce their parts again (parts are not in the inventory snapshot). With a
  replica's name (`[OP_HELLO, origin]`), only that one, which this replica had
  called silent and hears again: it announces its engines and parts and asks its
  engines for full dumps (replication.py `ReplicatedInventory.apply_remote`).
- `OP_ANNOUNCING` / `OP_ANNOUNCED`: the bounds of an announcement round; every part
  the replica holds at its start is announced between them (the end waits for those
  parts' pending tokens).
  A replica that lost track of the log (a snapshot reload, a store loss) keeps the
  others' parts *unaccounted for* (`forget_all`), and so does one that reads another's
  `OP_RESET` with that one's parts (`origin_reset`): not READY, but not proven gone
  either, since they did not leave. A round begun after the loss settles them: a
  part it announces is back, one it lacks left and its grace period starts
  (I6-quiescence: before, a reader on a replica slower to announce than
  `session_grace_ms` was proven gone while it read).
- `OP_CALL` / `OP_RESULT`: a request that only another replica can decide, and its
  answer (or its refusal, code and message). A prefill part's PublishHandoff naming
  a decode engine whose session is on another replica goes to that replica, which
  owns the handoff; so do that decode engine's BeginHandoff (which waits there: the
  owner answers when it grants, `PeerHost.run_call` returning an awaitable) and,
  by the owner their lease id names (for a prefix load rebuilt after that owner
  fell silent: the owner the lease ledger names), ExtendHandoff and both flows'
  transfer reports. So an engine whose unary calls reach another replica than its session
  (a plain channel to the replica list picks its own) is answered as by its own.
  An owner that does not answer in time makes the call UNAVAILABLE (the client may
  send it again; a repeated report changes nothing). A caller that leaves (cancelled,
  timed out, or shutting down) writes `CALL_CANCEL` for its call: a begin still
  waiting on the owner stops there at once (`PeerHost.calls_cancelled`), so no
  handoff is granted to nobody. The calls of a replica called silent stop the same way.

One order: every replica applies these ops in log order, so remote registrations
and removals reach every replica in the same order, and a replica's messages to a
part follow that part's registration; the fencing token, not the log position,
decides which registration of a part wins. What stays per replica: each lease's
table entry (its owner's), the cost estimates and drains (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.grants import (
    BeginHandoffRequest,
    DrainNotice,
    LeaseOutbound,
    PublishHandoffRequest,
    TransferReport,
)
from coordinator.core.leases import (
    Flow,
    HandoffGrant,
    Outcome,
    SendAbort,
    SendPin,
    SendQuarantine,
    SendRelease,
    SourcePart,
    owner_of_lease_id,
)
from coordinator.core.registry import PartRef, RankPartRegistration
from kvrc.vocabulary import RankKey

log = logging.getLogger("kvrc.peers")

OP_PART = "P"
OP_PART_LEFT = "L"
OP_SEND = "M"
OP_REPLY = "Y"
OP_HELLO = "W"
# A hello's third element when a zombie's fence sent it (`[OP_HELLO, origin, ...]`): its
# sender had ignored the last announcement (the engine was its own then), so one that
# falls in the asked replica's re-announce window is served at the window's end, not
# dropped. An older replica ignores the element.
HELLO_AFTER_FENCE = "fence"
OP_CALL = "K"  # not "C": that is replication.OP_CLEAR (one tag space, one log)
OP_RESULT = "Q"
# An announcement round's bounds: `[OP_ANNOUNCING, origin]`, then every local part,
# then `[OP_ANNOUNCED, origin]` once every part held at its start has its token (module
# doc). The origin in op[1] makes an older replica, which knows neither tag, ignore
# them quietly.
OP_ANNOUNCING = "G"
OP_ANNOUNCED = "N"
# An announcement round's third element when its replica lost track of the log (a
# trimmed read position, a store loss: `forget_all`): the lease messages addressed to
# its parts in what it skipped are lost, so each owner sends its parts' owed aborts,
# quarantines and kept releases again, as to a part registering anew (I6-quiescence).
# An older replica ignores the element.
ANNOUNCING_AFTER_LOSS = "lost"
PEER_TAGS = frozenset(
    (
        OP_PART,
        OP_PART_LEFT,
        OP_SEND,
        OP_REPLY,
        OP_HELLO,
        OP_CALL,
        OP_RESULT,
        OP_ANNOUNCING,
        OP_ANNOUNCED,
    )
)
# Lease messages and call answers: what an outbox reset must not drop (replication.py,
# `ReplicatedInventory.reannounce`). A release lost there leaves a live holder pinned.
# Not OP_CALL: its caller gives up after DEFAULT_CALL_TIMEOUT_S and asks again.
MESSAGE_TAGS = frozenset((OP_SEND, OP_REPLY, OP_RESULT))
CALL_PUBLISH_HANDOFF = "publish_handoff"
# A target's report that reached another replica than the lease's owner (its channel
# went elsewhere than the grant's): the owner decides it (I5-complete-parts).
CALL_COMPLETE_PREFIX_LOAD = "complete_prefix_load"
CALL_COMPLETE_HANDOFF = "complete_handoff"
# The decode side of a handoff that reached another replica than the decode engine's:
# its replica owns the handoff. A begin waits there (run_call answers it later).
CALL_BEGIN_HANDOFF = "begin_handoff"
CALL_EXTEND_HANDOFF = "extend_handoff"
# The caller of a call left (cancelled, timed out): a call still waiting there stops
# (a begin is never granted to nobody). Its payload is the call id; it gets no answer.
CALL_CANCEL = "cancel"
DEFAULT_CALL_TIMEOUT_S = 5.0
# Abort senders remembered for their acks (a lease id and a replica name each): enough for
# every lease the lease table holds open at once (LeaseConfig.max_open_leases), bounded.
MAX_ABORT_SENDERS = 65_536
# Pin requests delivered to local sessions for other replicas' leases, kept until their
# PinResult relays the answer (the same bound): a PinResult nobody asked for is not
# written into the shared log.
MAX_PIN_ASKS = 65_536

# Replies of the holder's session that the owner needs. A ReleaseAck stays on the
# holder's replica: the session it reaches keeps the release until acked.
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


# claim(part key, session id, on_token) -> cancel: asks the store for a fencing token.
Claim = Callable[[str, str, Callable[[int], None]], Callable[[], None]]


def survives_reset(op: Op) -> bool:
    """What an outbox reset (an overflow, a store loss) keeps and sends after the
    re-announcement: lease messages and call answers (MESSAGE_TAGS); hellos (nothing
    asks again: the parts they ask for would stay missing from this view); and call
    cancels (a begin left waiting on the owner could be granted to nobody)."""
    tag = op[0]
    return (
        tag in MESSAGE_TAGS
        or tag == OP_HELLO
        or (tag == OP_CALL and len(op) > 3 and op[3] == CALL_CANCEL)
    )


_K = TypeVar("_K")


def _remember(sent_by: OrderedDict[_K, str], key: _K, origin: str, bound: int) -> None:
    """`sent_by[key] = origin`, newest last, the oldest dropped past `bound`."""
    sent_by[key] = origin
    sent_by.move_to_end(key)
    if len(sent_by) > bound:
        sent_by.popitem(last=False)


def counter_claim() -> Claim:
    """Tokens from a counter in this process (one replica, or tests without a store)."""
    tokens = itertools.count(1)

    def claim(
        part_key: str, session_id: str, on_token: Callable[[int], None]
    ) -> Callable[[], None]:
        on_token(next(tokens))
        return lambda: None

    return claim


def part_key(child_engine_id: str, rank: RankKey) -> str:
    return f"{child_engine_id}|{rank[0]}.{rank[1]}.{rank[2]}"


@dataclass(slots=True)
class _LocalPart:
    key: str
    registration: RankPartRegistration
    token: int | None = None  # None until the store answered the claim
    token_store: bytes = b""  # the epoch tag of the store the token came from
    cancel: Callable[[], None] = lambda: None
    claims: int = 0  # claims asked so far: only the last one's answer counts
    # It replaced another replica's session of the part here: if it does not keep the
    # part, that session may live on and is heard of again.
    displaced: bool = False
    # The other replica's session that takes its place here at once if it does not keep
    # the part: a registration read while its claim was out (the claim decides), or the
    # session it displaced, while nothing proves that one gone.
    outranked_by: Other | None = None


@dataclass(frozen=True, slots=True)
class Other:
    """Another replica's session of a rank part, as this replica last knew it."""

    origin: str
    session_id: str
    registration: RankPartRegistration
    token: int | None  # its fencing token, when known


class OwedAborts(Protocol):
    def on_part_registered(self, child_engine_id: str, rank_key: RankKey) -> None:
        """A rank part (re-)registered: the aborts it owes an ack for go again, and the
        quarantines and releases that found it between sessions."""


class PeerHost(Protocol):
    """What the coordinator does for the ops of other replicas."""

    @property
    def leases(self) -> OwedAborts:
        """This replica's lease flow (coordinator/runtime/lease_flow.py)."""

    def register_remote_part(
        self, origin: str, session_id: str, registration: RankPartRegistration
    ) -> bool:
        """Registers another replica's part; False when it is not taken (a local one wins)."""

    def remove_remote_part(self, ref: PartRef, reason: str, unaccounted: bool = False) -> bool:
        """Removes a remote part if `ref.session_id` still holds it. `unaccounted`: this
        replica lost track of it (it did not leave): it is not READY, and nothing proves
        its engine gone until `unaccounted_part_gone` (I6-quiescence)."""

    def unaccounted_part_gone(self, ref: PartRef) -> None:
        """A part this replica had lost track of was not announced again by its live
        replica (or that replica fell silent): it left, and its grace period starts."""

    def part_unaccounted(self, ref: PartRef) -> None:
        """Another replica's session of a part, announced but not taken yet (its token is
        another store's): a grace period running for the part holds until that session
        is accounted for (`unaccounted_part_gone`, or its registration)."""

    def deliver(self, ref: PartRef, message: LeaseOutbound, registering: bool = False) -> bool:
        """Queues a message on a local session, if `ref.session_id` is still it (False:
        dropped); a release that finds it gone goes on to the part's session now, or waits
        for its next registration. `registering`: one of the answers to its registration
        (sent again from elsewhere), which go past the queue's cap as the local ones do."""

    def remote_pin_result(
        self,
        ref: PartRef,
        lease_id: str,
        pinned_blocks: int,
        descriptor: bytes | None,
        error_message: str,
    ) -> None: ...

    def remote_abort_ack(self, ref: PartRef, lease_id: str) -> None: ...

    def fence_local(self, session_id: str, reason: str) -> None:
        """Ends a local session that a registration with a higher token replaced."""

    def run_call(self, kind: str, payload: Any) -> Any:
        """Decides a request another replica forwarded (KvrcError: refused, as it would be);
        an awaitable for one that waits (its result, or its KvrcError, is the answer)."""

    def calls_cancelled(self) -> None:
        """Waiting calls were just cancelled: what they wait for must not be granted
        before their tasks run again (a publish may come in the same log entry)."""

    def owner_silent(self, origin: str) -> None:
        """`origin` fell silent: leases it owned that local holders left to it are
        rebuilt here."""

    def owners_left_to(self) -> set[str]:
        """The replicas that own leases local holders left to them."""


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


def encode_publish(req: PublishHandoffRequest) -> list[Any]:
    return [
        req.request_id,
        req.prefill_child_engine_id,
        list(req.rank_key),
        req.descriptor,
        req.kv_transfer_params,
        req.decode_child_engine_id,
        req.num_blocks,
    ]


def decode_publish(raw: list[Any]) -> PublishHandoffRequest:
    request_id, prefill, rank, descriptor, params, decode, num_blocks = raw
    tp, pp, pcp = rank
    return PublishHandoffRequest(
        str(request_id),
        str(prefill),
        (int(tp), int(pp), int(pcp)),
        bytes(descriptor),
        bytes(params),
        None if decode is None else str(decode),
        int(num_blocks),
    )


def encode_report(report: TransferReport) -> list[Any]:
    return [
        report.lease_id,
        report.reporter_child_engine_id,
        list(report.rank_key),
        int(report.outcome),
        report.bytes_moved,
        report.duration_us,
        report.error_message,
        report.prefill_tokens,
        report.prefill_duration_us,
    ]


def decode_report(raw: list[Any]) -> TransferReport:
    lease_id, reporter, rank, outcome, moved, duration, error, tokens, prefill_us = raw
    tp, pp, pcp = rank
    return TransferReport(
        str(lease_id),
        str(reporter),
        (int(tp), int(pp), int(pcp)),
        Outcome(int(outcome)),
        int(moved),
        int(duration),
        str(error),
        int(tokens),
        int(prefill_us),
    )


def encode_begin(req: BeginHandoffRequest) -> list[Any]:
    return [
        req.request_id,
        req.prefill_child_engine_id,
        req.decode_child_engine_id,
        req.wait_timeout_ms,
    ]


def decode_begin(raw: list[Any]) -> BeginHandoffRequest:
    request_id, prefill, decode, wait_timeout_ms = raw
    return BeginHandoffRequest(str(request_id), str(prefill), str(decode), int(wait_timeout_ms))


def encode_grant(grant: HandoffGrant, now_ms: int, waited_ms: int) -> list[Any]:
    """The deadline as the time left, and how long the owner waited for the grant since
    the call reached it (monotonic clocks differ between hosts)."""
    return [
        grant.lease_id,
        grant.prefill_child_engine_id,
        grant.decode_child_engine_id,
        [[list(p.rank_key), p.descriptor, p.pinned_blocks] for p in grant.source_parts],
        grant.kv_transfer_params,
        grant.num_blocks,
        grant.deadline_ms - now_ms,
        waited_ms,
    ]


def decode_grant(raw: list[Any], sent_ms: int) -> HandoffGrant:
    """The grant of a call sent at `sent_ms` (this host's clock)."""
    lease_id, prefill, decode, parts, params, num_blocks, left_ms, waited_ms = raw
    return HandoffGrant(
        str(lease_id),
        str(prefill),
        str(decode),
        tuple(
            SourcePart((int(r[0]), int(r[1]), int(r[2])), bytes(descriptor), int(pinned))
            for r, descriptor, pinned in parts
        ),
        bytes(params),
        int(num_blocks),
        sent_ms + int(waited_ms) + int(left_ms),
    )


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
        claim: Claim | None = None,
        was_silent: Callable[[str], bool] = lambda origin: False,
        liveness_known: bool = True,
        epoch_tag: Callable[[], bytes] = lambda: b"",
    ) -> None:
        self.origin = origin
        # The store this replica knows now, as a tag (b"": one store only, no loss).
        self._epoch_tag = epoch_tag
        self._record = record
        self._codec = codec
        self._clock_ms = clock_ms
        self._host: PeerHost | None = None
        # Remote parts registered here: session id -> (origin, ref).
        self._remote: dict[str, tuple[str, PartRef]] = {}
        self._is_alive = is_alive  # an origin heard from lately (replication.py)
        self._was_silent = was_silent  # called silent and not heard since (replication.py)
        self._claim = claim if claim is not None else counter_claim()
        self._local: dict[str, _LocalPart] = {}  # session id -> this replica's part
        # Per rank part, the highest fencing token seen anywhere, and its session id.
        self._best: dict[str, tuple[int, str]] = {}
        self.fenced = 0  # local sessions ended by a higher token (tests, status)
        self._calls: dict[str, asyncio.Future[Any]] = {}  # call id -> its answer
        self._call_owners: dict[str, str] = {}  # call id -> the replica asked
        self._call_ids = itertools.count()
        self._calls_closed: str | None = None  # why calls are refused (`fail_calls`)
        # Forwarded calls that wait here, by (caller replica, call id).
        self._answering: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.sent = 0  # ops this replica wrote for its peers (tests, bench-cluster)
        # lease id -> the replica whose SendAbort a local part got (`abort_sender`).
        self._abort_senders: OrderedDict[str, str] = OrderedDict()
        # (session id, lease id) -> the replica whose SendPin a local part got (`pin_asker`).
        self._pin_asks: OrderedDict[tuple[str, str], str] = OrderedDict()
        # True while answering a remote part's registration: its messages are marked so
        # that its replica queues them as a registration's answers (past the queue cap).
        self._answering_registration = False
        # Whether an announcement round is open, and the local parts it waits for: those
        # without a token when it began (a part registered later is a new session, which
        # no replica can have lost track of, and is announced after OP_ANNOUNCING anyway).
        self._round_open = False
        self._round_waits: set[str] = set()
        # Remote parts this replica lost track of (`forget_all`), by origin, until that
        # origin's next whole announcement round; and the origins whose round began
        # since (OP_ANNOUNCING read after the loss).
        self._unaccounted: dict[str, dict[str, PartRef]] = {}
        # The same sessions by rank part (part key -> session ids): a part's removal asks
        # for its own (`unaccounted_session`) without a scan of every part lost track of.
        self._unaccounted_by_part: dict[str, dict[str, None]] = {}
        self._round_begun: set[str] = set()
        # Origins in a round after they lost track of the log: their parts announced
        # again get their owed lease messages again (ANNOUNCING_AFTER_LOSS).
        self._lost_rounds: set[str] = set()
        self._highest_token = 0  # of every token seen, own and others' (`highest_token`)
        self._announced_again: set[str] = set()  # unaccounted, announced, not taken
        # False until this replica has read the log up to its end once (a replica that
        # just started, with a store: `caught_up`): until then a replica not heard yet
        # may well be alive.
        self._liveness_known = liveness_known

    def attach(self, host: PeerHost) -> None:
        self._host = host

    # --- this replica's own changes and messages --------------------------------------

    def part_registered(
        self,
        session_id: str,
        registration: RankPartRegistration,
        displaced: bool = False,
        other: Other | None = None,
    ) -> None:
        """A part registered here: claims its fencing token, then announces it. It may
        have displaced another replica's session of the part (the engine moved here):
        `other`, when known."""
        key = part_key(registration.child_engine_id, registration.rank)
        self._local[session_id] = part = _LocalPart(
            key, registration, displaced=displaced, outranked_by=other
        )
        self._ask_token(session_id, part)

    def part_left(self, ref: PartRef) -> None:
        part = self._local.pop(ref.session_id, None)
        if part is None:
            return
        self._claim_settled(ref.session_id)
        if part.token is None:
            part.cancel()  # never announced: nothing to take back
            self._hear_the_other(part)
            return
        if self._best.get(part.key, (0, ""))[1] == ref.session_id:
            del self._best[part.key]
        self._write([OP_PART_LEFT, ref.child_engine_id, list(ref.rank), ref.session_id])

    def hello(self) -> None:
        self._write([OP_HELLO])

    def announce_local(self, reclaim: bool = False, lost_messages: bool = False) -> None:
        """Announces every local part again: after a hello, or with new tokens after a
        store loss (`reclaim`: the counter started again with the new store). A round:
        OP_ANNOUNCING first, OP_ANNOUNCED once every local part has been announced with
        its token (module doc). `lost_messages`: this replica skipped part of the log,
        so the owners send its parts' lease messages again (ANNOUNCING_AFTER_LOSS)."""
        op: Op = [OP_ANNOUNCING, self.origin]
        if lost_messages:
            op.append(ANNOUNCING_AFTER_LOSS)
        self._write(op)
        self._round_open = False  # not closed by a token answered inside the loop
        self._round_waits |= {sid for sid, p in self._local.items() if reclaim or p.token is None}
        if reclaim:
            # The old tokens of these parts mean nothing in the new store: a new token,
            # lower than its own old one, must not fence the part it was claimed for.
            for key, (_, session_id) in list(self._best.items()):
                if session_id in self._local:
                    del self._best[key]
        for session_id, part in list(self._local.items()):
            if reclaim or part.token is None:
                part.cancel()
                part.token = None
                self._ask_token(session_id, part)
            else:
                self._announce(session_id, part)
        self._round_open = True
        self._end_round()

    def _claim_settled(self, session_id: str) -> None:
        self._round_waits.discard(session_id)
        self._end_round()

    def _end_round(self) -> None:
        """Closes an announcement round once the parts it waits for have their tokens (or
        left): every part this replica held when it began is then in the log after the
        round's OP_ANNOUNCING."""
        if self._round_open and not self._round_waits:
            self._round_open = False
            self._write([OP_ANNOUNCED, self.origin])

    def _hear_the_other(self, part: _LocalPart) -> None:
        """A local part that does not keep the part (fenced by a higher token, or gone
        before its claim answered): the other replica's session takes its place here."""
        other = part.outranked_by
        if other is not None and self._is_alive(other.origin):
            best = self._best.get(part.key)
            if best is None and other.token is not None:
                # The session it displaced, forgotten then (`forget_session`): no newer
                # one was read since, nor its departure (`_outranking_gone`).
                best = (other.token, other.session_id)
            if (
                best is not None
                and best[1] == other.session_id
                and self._register_remote(other.origin, other.session_id, other.registration)
            ):
                self._best.setdefault(part.key, best)
                return
        if part.displaced:
            self.hello()  # the session it replaced here may live on: hear of it again

    def _ask_token(self, session_id: str, part: _LocalPart) -> None:
        part.claims += 1
        claim = part.claims
        part.cancel = self._claim(
            part.key, session_id, lambda token: self._claimed(session_id, token, claim)
        )

    def _claimed(self, session_id: str, token: int, claim: int) -> None:
        part = self._local.get(session_id)
        if part is None:
            return  # the session left meanwhile
        if claim != part.claims:
            # A claim asked again since (a store loss, a hello) answered after all: its
            # cancel came too late. Its token is not this part's (a later one is).
            return
        part.token = token
        part.token_store = self._epoch_tag()
        self._highest_token = max(self._highest_token, token)
        if token < self._best.get(part.key, (0, ""))[0]:
            # Registered again elsewhere since this claim was made: this one is stale.
            self._fence(session_id, "registered again on another replica (a higher token)")
            self._hear_the_other(part)
            return
        self._best[part.key] = (token, session_id)
        part.outranked_by = None  # it keeps the part: the other never takes it back here
        self._announce(session_id, part)
        self._claim_settled(session_id)

    def _announce(self, session_id: str, part: _LocalPart) -> None:
        op: Op = [OP_PART, session_id, self._codec.encode(part.registration), part.token]
        if part.token_store:
            op.append(part.token_store)  # a 4-element op (an older replica's) has none
        self._write(op)

    def _fence(self, session_id: str, reason: str) -> None:
        """Ends a local zombie; its closing goes through `part_left` (the others hear it)."""
        self.fenced += 1
        if self._host is not None:
            self._host.fence_local(session_id, reason)
        self._local.pop(session_id, None)
        self._claim_settled(session_id)

    def highest_token(self) -> int:
        """The highest fencing token seen, this replica's and the others' (in the log):
        the store answers claims above it (redis_store.py `_CLAIM`)."""
        return self._highest_token

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
        op: Op = [OP_SEND, origin, ref.child_engine_id, list(ref.rank), ref.session_id, encoded]
        if self._answering_registration:
            op.append(True)  # a 6-element op (an older replica's) is not one
        self._write(op)
        return True

    def owner_of(self, lease_id: str) -> str | None:
        """The live replica that owns a lease, when it is not this one (else None)."""
        return self.live_other(owner_of_lease_id(lease_id))

    def pin_asker(self, session_id: str, lease_id: str) -> str | None:
        """The live other replica whose pin request for `lease_id` reached this session,
        once: its PinResult goes there. None for a result no other replica asked for (a
        made-up lease id must not reach the shared log)."""
        asker = self._pin_asks.pop((session_id, lease_id), None)
        return self.live_other(asker) if asker is not None else None

    def abort_sender(self, lease_id: str) -> str | None:
        """The live other replica that sent a local part this lease's abort: the one the
        ack proves quiet to. It may not be the owner the id names: a replica that rebuilt
        the lease of a silent one (its holder re-announced it there) owns it now."""
        sender = self._abort_senders.get(lease_id)
        return self.live_other(sender) if sender is not None else None

    def owner_unknown(self, lease_id: str) -> bool:
        """The lease's owner is another replica, not heard yet by this one, which has not
        read the log through once yet: alive or not, nobody here can tell."""
        owner = owner_of_lease_id(lease_id)
        return (
            not self._liveness_known
            and bool(owner)
            and owner != self.origin
            and not self._is_alive(owner)
        )

    def caught_up(self) -> set[str]:
        """This replica read the log up to its end (the first time since it started): who
        is alive is known from now on. Returns the owners of leases local holders left
        to them that it has not heard: the caller watches them as if heard just before
        it began following the log, so that one which stays silent for the silence
        timeout is called silent (its leases rebuilt here, `owner_silent`), while one
        that only had nothing to write yet is not taken for gone."""
        if self._liveness_known:
            return set()
        self._liveness_known = True
        if self._host is None:
            return set()
        return {o for o in self._host.owners_left_to() if not self._is_alive(o)}

    def live_other(self, replica: str | None) -> str | None:
        """`replica` when it is another replica heard from lately (else None)."""
        if not replica or replica == self.origin or not self._is_alive(replica):
            return None
        return replica

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

    async def call(
        self, owner: str, kind: str, payload: Any, timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    ) -> Any:
        """Asks `owner` to decide a request; its answer, or its refusal raised here."""
        if self._calls_closed is not None:
            # Shutting down: its answer could not be read here any more.
            raise KvrcError(ErrorCode.UNAVAILABLE, self._calls_closed)
        call_id = f"{self.origin}/{next(self._call_ids)}"
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = answer
        self._call_owners[call_id] = owner
        self._write([OP_CALL, owner, call_id, kind, payload])
        try:
            return await asyncio.wait_for(answer, timeout_s)
        except TimeoutError:
            self._write([OP_CALL, owner, f"{call_id}/cancel", CALL_CANCEL, call_id])
            raise KvrcError(
                ErrorCode.UNAVAILABLE,
                f"replica {owner} did not answer {kind} within {timeout_s:g} s: try again",
            ) from None
        except asyncio.CancelledError:
            self._write([OP_CALL, owner, f"{call_id}/cancel", CALL_CANCEL, call_id])
            raise
        finally:
            self._calls.pop(call_id, None)
            self._call_owners.pop(call_id, None)

    def fail_calls(self, reason: str) -> None:
        """Shutdown: every call waiting for another replica ends UNAVAILABLE (and is
        cancelled there), and so does every forwarded call still waiting here (its
        caller hears it, as from us). Later calls are refused at once, the same way."""
        self._calls_closed = reason
        for call_id, answer in self._calls.items():
            if not answer.done():
                answer.set_exception(KvrcError(ErrorCode.UNAVAILABLE, reason))
                owner = self._call_owners[call_id]
                self._write([OP_CALL, owner, f"{call_id}/cancel", CALL_CANCEL, call_id])
        for task in self._answering.values():
            task.cancel()
        if self._answering and self._host is not None:
            self._host.calls_cancelled()

    async def _answer_later(self, origin: str, call_id: str, pending: Awaitable[Any]) -> None:
        try:
            result: list[Any] = [True, await pending]
        except KvrcError as e:
            result = [False, [e.code.value, e.message]]
        except asyncio.CancelledError:
            if self._calls_closed is not None:
                # Shutting down: say so in the words a client retries elsewhere on.
                reason = f"{self._calls_closed}: retry at the next one (replica {self.origin})"
            else:
                reason = f"replica {self.origin} stopped the call (its caller left)"
            self._write([OP_RESULT, origin, call_id, False, [ErrorCode.UNAVAILABLE.value, reason]])
            raise
        except Exception as e:  # a defect: the caller hears of it now, not at its timeout
            result = [False, self._failed_call(origin, call_id, e)]
        self._write([OP_RESULT, origin, call_id, *result])

    def _failed_call(self, origin: str, call_id: str, error: Exception) -> list[Any]:
        """A forwarded call that failed on a defect here: logged, and UNAVAILABLE for its
        caller (the engine retries; its next try may reach another replica)."""
        log.error("forwarded call %s of replica %s failed", call_id, origin, exc_info=error)
        why = f"replica {self.origin} failed the call: {type(error).__name__}: try again"
        return [ErrorCode.UNAVAILABLE.value, why]

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
            session_id, token = str(op[1]), int(op[3])
            self._highest_token = max(self._highest_token, token)
            if session_id in self._remote:
                known_origin, known_ref = self._remote[session_id]
                if origin in self._lost_rounds and known_origin == origin:
                    # Its replica skipped what was sent to it: this replica's owed lease
                    # messages for the part go again (to the same session).
                    self._resend_owed(known_ref)
                return False  # an announcement again (after a hello)
            registration = self._codec.decode(bytes(op[2]))
            ref = PartRef(registration.child_engine_id, registration.rank, session_id)
            if self._other_store(op):
                # Its token is another store's (a store loss that one of the two has not
                # noticed yet): not comparable. Its replica announces it again with a
                # token of the new store once both know it (a reset, then a round);
                # until then it is unaccounted for, and its part not proven gone.
                self._unaccount(origin, ref)
                self._announced_again.add(session_id)
                host.part_unaccounted(ref)
                return False
            key = part_key(ref.child_engine_id, ref.rank)
            best_token, best_session = self._best.get(key, (0, ""))
            if session_id == best_session:
                # One session's tokens only grow within a store: a lower one is a new
                # store's (its replica reclaimed it after a loss this one may not have
                # noticed, or an older replica's untagged op): it is that session's now.
                best_token = token
            if token < best_token or (token == best_token and session_id != best_session):
                if session_id in self._unaccounted.get(origin, {}):
                    # Its replica still announces it: the round does not prove it left
                    # (a token from a store this replica has not noticed was lost yet).
                    self._announced_again.add(session_id)
                return False  # a stale registration: a newer one owns the part
            # (The best one itself, announced again, registers if it was not taken here.)
            for local_id, part in list(self._local.items()):
                if part.key != key:
                    continue
                if part.token is None:
                    # Its own claim decides (`_claimed`: the higher token wins); this op
                    # may be a re-announcement older than it.
                    part.outranked_by = Other(origin, session_id, registration, token)
                elif part.token > token:
                    return False  # older than the local session (whatever `_best` says)
                else:  # a zombie here: the engine registered on `origin` since
                    self._fence(local_id, f"registered again on replica {origin}")
                    # `origin` announced the engine while it was still local here (ignored:
                    # a local engine wins), and its later ops name an engine this view no
                    # longer has: it announces its engines again, with dumps (replication.py).
                    self._write([OP_HELLO, origin, HELLO_AFTER_FENCE])
            self._best[key] = (token, session_id)
            if self._register_remote(origin, session_id, registration):
                return True
            if session_id in self._unaccounted.get(origin, {}):
                # Announced, but a local claim holds the part here: not gone at the
                # round's end (the claim decides; losing, it registers this one).
                self._announced_again.add(session_id)
            return False
        if tag == OP_PART_LEFT:
            ref = _ref(op[1], op[2], op[3])
            # Whether registered here or not, it no longer owns the part anywhere.
            self._outranking_gone(lambda o: o[1] == ref.session_id)
            if self._remote.get(ref.session_id) is None:
                self._forget_best(ref)
            if self._unaccounted.get(origin, {}).get(ref.session_id) == ref:
                self._accounted_for(origin, ref.session_id)
                host.unaccounted_part_gone(ref)  # it left: its grace starts now
                return True
            if self._remote.get(ref.session_id, ("", None))[0] != origin:
                return False
            del self._remote[ref.session_id]
            self._forget_best(ref)
            return host.remove_remote_part(ref, f"its session on replica {origin} closed")
        if tag == OP_HELLO:
            if len(op) > 1 and op[1] != self.origin:
                return False  # asked of another replica (replication.py handles ours)
            self.announce_local()
            return True
        if tag == OP_ANNOUNCING:
            self._round_begun.add(origin)
            if len(op) > 2 and op[2] == ANNOUNCING_AFTER_LOSS:
                self._lost_rounds.add(origin)
            else:
                self._lost_rounds.discard(origin)
            # Only this round's announcements keep a part unaccounted for at its end.
            self._announced_again.difference_update(self._unaccounted.get(origin, {}))
            return True
        if tag == OP_ANNOUNCED:
            self._lost_rounds.discard(origin)
            if origin in self._round_begun:
                self._round_begun.discard(origin)
                self._account_gone(
                    origin, "was not announced again by replica " + origin, in_round=True
                )
            return True
        if op[1] != self.origin:
            return False  # addressed to another replica
        if tag == OP_CALL:
            _, _, call_id, kind, payload = op
            call_id = str(call_id)
            if kind == CALL_CANCEL:
                waiting = self._answering.get((origin, str(payload)))
                if waiting is not None:
                    waiting.cancel()
                    host.calls_cancelled()
                return True
            try:
                value = host.run_call(str(kind), payload)
            except KvrcError as e:
                self._write([OP_RESULT, origin, call_id, False, [e.code.value, e.message]])
                return True
            except Exception as e:  # a defect: the caller hears of it now, not at its timeout
                failed = self._failed_call(origin, call_id, e)
                self._write([OP_RESULT, origin, call_id, False, failed])
                return True
            if inspect.isawaitable(value):
                task = asyncio.get_running_loop().create_task(
                    self._answer_later(origin, call_id, value)
                )
                caller = (origin, call_id)
                self._answering[caller] = task
                task.add_done_callback(lambda _: self._answering.pop(caller, None))
            else:
                self._write([OP_RESULT, origin, call_id, True, value])
            return True
        if tag == OP_RESULT:
            _, _, call_id, ok, value = op
            answer = self._calls.get(str(call_id))
            if answer is not None and not answer.done():
                if ok:
                    answer.set_result(value)
                else:
                    answer.set_exception(KvrcError(ErrorCode(value[0]), str(value[1])))
            return True
        if tag == OP_SEND:
            ref = _ref(op[2], op[3], op[4])
            message = decode_message(op[5], ref, self._clock_ms())
            if isinstance(message, SendAbort):
                _remember(self._abort_senders, message.lease_id, origin, MAX_ABORT_SENDERS)
            elif isinstance(message, SendPin):
                asked = (ref.session_id, message.lease_id)
                _remember(self._pin_asks, asked, origin, MAX_PIN_ASKS)
            if not host.deliver(ref, message, registering=len(op) > 6 and bool(op[6])):
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

    def _other_store(self, op: Op) -> bool:
        """An OP_PART whose token came from another store than the one this replica knows."""
        if len(op) < 5:
            return False  # an older replica's: untagged, taken as before
        mine = self._epoch_tag()
        return bool(mine) and bytes(op[4]) != mine

    def _outranking_gone(self, gone: Callable[[tuple[str, str]], bool]) -> None:
        """The sessions `gone` names (origin, session id) left, or this replica cannot
        tell any more: a local claim they outranked no longer registers them if it
        loses; it asks to hear of the part again instead."""
        for part in self._local.values():
            other = part.outranked_by
            if other is not None and gone((other.origin, other.session_id)):
                part.outranked_by = None
                part.displaced = True

    def _register_remote(
        self, origin: str, session_id: str, registration: RankPartRegistration
    ) -> bool:
        """Registers another replica's part here (its token won: `_best` names it)."""
        host = self._host
        if host is None or not host.register_remote_part(origin, session_id, registration):
            return False
        ref = PartRef(registration.child_engine_id, registration.rank, session_id)
        self._remote[session_id] = (origin, ref)
        self._accounted_for(origin, session_id)
        # Aborts it owes this replica's leases, and quarantines and releases for it,
        # were dropped while it was between sessions (or acks lost with the old
        # stream): they go again, to its session on `origin`, as to a part
        # re-registering here (I6-quiescence).
        self._resend_owed(ref)
        return True

    def _resend_owed(self, ref: PartRef) -> None:
        """A remote part's owed aborts, and its quarantines and kept releases, again."""
        host = self._host
        assert host is not None
        answering, self._answering_registration = self._answering_registration, True
        try:
            host.leases.on_part_registered(ref.child_engine_id, ref.rank)
        finally:
            self._answering_registration = answering

    def origin_gone(self, origin: str, reason: str) -> int:
        """An origin reset (restarted) or fell silent: its parts leave. Returns them."""
        host = self._host
        self._cancel_answering({origin})
        self._outranking_gone(lambda o: o[0] == origin)
        left = [(sid, ref) for sid, (o, ref) in self._remote.items() if o == origin]
        for session_id, ref in left:
            del self._remote[session_id]
            self._forget_best(ref)
            if host is not None:
                host.remove_remote_part(ref, reason)
        return len(left)

    def _cancel_answering(self, origins: set[str]) -> None:
        """Their calls waiting here have no caller any more: stop them (never granted)."""
        orphans = [task for (o, _), task in self._answering.items() if o in origins]
        for task in orphans:
            task.cancel()
        if orphans and self._host is not None:
            self._host.calls_cancelled()

    def origin_silent(self, origin: str) -> None:
        """An origin fell silent (not a reset, not a store loss: its lease table may be
        lost with it): its leases that local holders left to it are rebuilt here, and
        its parts this replica had lost track of are gone with it."""
        self._round_begun.discard(origin)
        self._lost_rounds.discard(origin)
        self._account_gone(origin, f"replica {origin} fell silent")
        if self._host is not None:
            self._host.owner_silent(origin)

    def _accounted_for(self, origin: str, session_id: str) -> None:
        """A part this replica had lost track of is back, or was seen leaving."""
        self._announced_again.discard(session_id)
        parts = self._unaccounted.get(origin)
        ref = None if parts is None else parts.pop(session_id, None)
        if ref is None:
            return
        self._unindex(ref)
        if not parts:
            del self._unaccounted[origin]

    def _unaccount(self, origin: str, ref: PartRef) -> None:
        self._unaccounted.setdefault(origin, {})[ref.session_id] = ref
        key = part_key(ref.child_engine_id, ref.rank)
        self._unaccounted_by_part.setdefault(key, {})[ref.session_id] = None

    def _unindex(self, ref: PartRef) -> None:
        key = part_key(ref.child_engine_id, ref.rank)
        sessions = self._unaccounted_by_part.get(key)
        if sessions is not None:
            sessions.pop(ref.session_id, None)
            if not sessions:
                del self._unaccounted_by_part[key]

    def _account_gone(self, origin: str, why: str, in_round: bool = False) -> None:
        """`origin`'s parts still unaccounted for left: their grace periods start. At a
        round's end, not those it announced without this replica taking them."""
        parts = self._unaccounted.pop(origin, {})
        if in_round:
            kept = {sid: ref for sid, ref in parts.items() if sid in self._announced_again}
            if kept:
                self._unaccounted[origin] = kept
                parts = {sid: ref for sid, ref in parts.items() if sid not in kept}
        self._announced_again.difference_update(parts)
        if parts:
            log.info("%d rank part(s) lost track of: %s", len(parts), why)
        for ref in parts.values():
            self._unindex(ref)
            self._forget_best(ref)  # kept for the round (`forget_all`); it left
            if self._host is not None:
                self._host.unaccounted_part_gone(ref)

    def called_silent(self, origin: str) -> bool:
        """`origin` fell silent here lately and has not been heard since (replication.py
        remembers those, to ask them to announce again if they are heard)."""
        return self._was_silent(origin)

    def forget_all(self, reason: str, store_lost: bool = False) -> int:
        """This replica lost track of the log (a store loss, a snapshot reload): every
        remote part leaves this view, unaccounted for. Returns them.

        They did not leave their replicas, so nothing here proves their engines gone
        yet: a lease's target still reading there must not be taken for gone after
        `session_grace_ms` because a re-announcement took longer (I6-quiescence). Each
        stays unaccounted until its replica's next whole announcement round (OP_ANNOUNCING
        read after this, then OP_ANNOUNCED): one it announces is back; one it does not
        left, and its grace starts then, as it does when that replica falls silent. A
        replica older than the round ops never closes one: fail closed until it is
        silent.
        """
        self._cancel_answering({o for o, _ in self._remote.values()})
        left = self._lose_track(lambda origin: True, reason)
        if store_lost:
            # The others' tokens came from the old store's counter: the new one starts
            # again. This replica's own stay (`announce_local` reclaims them itself): an
            # older announcement of one of its parts must not win over its live session.
            self._best = {k: v for k, v in self._best.items() if v[1] in self._local}
        # Else every token stays: the counter only grows, so an older announcement read
        # from now on (a stale session's) loses to the newest one seen, as before.
        # A round counts if its OP_ANNOUNCING is read after this. Whatever this replica
        # reads from now on was written after all it had read: a trim shows only past the
        # last entry read, and a store loss starts a new log. So every part the round's
        # replica holds is announced after it, and read here before its OP_ANNOUNCED.
        self._round_begun.clear()
        self._lost_rounds.clear()
        self.hello()
        # The entries this replica never read may hold another's hello (answered here),
        # and lease messages for its parts (the owners send them again).
        self.announce_local(lost_messages=True)
        return left

    def origin_reset(self, origin: str, reason: str) -> int:
        """`origin` reset its state (its outbox overflowed, or the store was lost): its
        parts did not leave, and its reset is followed by a round that settles them. So
        they are unaccounted for here, as after a loss of this replica's own."""
        self._cancel_answering({origin})
        self._round_begun.discard(origin)
        self._lost_rounds.discard(origin)
        return self._lose_track(lambda o: o == origin, reason)

    def _lose_track(self, of: Callable[[str], bool], reason: str) -> int:
        """The remote parts of the origins `of` names leave this view, unaccounted for.

        So does another replica's session that a local claim displaced or was outranked
        by: it may have left in what was not read, or may live on (a local part that
        leaves then does not prove its engine gone either, nor registers it again)."""
        for part in self._local.values():
            other = part.outranked_by
            if other is not None and of(other.origin):
                ref = PartRef(
                    other.registration.child_engine_id, other.registration.rank, other.session_id
                )
                self._unaccount(other.origin, ref)
        self._outranking_gone(lambda o: of(o[0]))
        left = [(sid, entry) for sid, entry in self._remote.items() if of(entry[0])]
        for session_id, (origin, ref) in left:
            del self._remote[session_id]
            self._unaccount(origin, ref)
            if self._host is not None:
                self._host.remove_remote_part(ref, reason, unaccounted=True)
        return len(left)

    def unaccounted_session(self, child_engine_id: str, rank: RankKey) -> str | None:
        """A session of this rank part that this replica lost track of, if any."""
        sessions = self._unaccounted_by_part.get(part_key(child_engine_id, rank))
        return next(iter(sessions)) if sessions else None

    def remote(self, session_id: str, registration: RankPartRegistration) -> Other | None:
        """A remote part's session as this replica knows it (None: not a remote part)."""
        entry = self._remote.get(session_id)
        if entry is None:
            return None
        best = self._best.get(part_key(entry[1].child_engine_id, entry[1].rank))
        token = best[0] if best is not None and best[1] == session_id else None
        return Other(entry[0], session_id, registration, token)

    def forget_session(self, session_id: str) -> Callable[[], None]:
        """A local registration replaced this remote part (the engine moved here).
        Returns what undoes it, for a registration refused after all."""
        entry = self._remote.pop(session_id, None)
        if entry is None:
            return lambda: None
        key = part_key(entry[1].child_engine_id, entry[1].rank)
        best = self._best.get(key)
        self._forget_best(entry[1])

        def undo() -> None:
            self._remote[session_id] = entry
            if best is not None:
                self._best.setdefault(key, best)

        return undo

    def _forget_best(self, ref: PartRef) -> None:
        key = part_key(ref.child_engine_id, ref.rank)
        if self._best.get(key, (0, ""))[1] == ref.session_id:
            del self._best[key]

    @property
    def remote_parts(self) -> int:
        return len(self._remote)
