"""A hypothesis state machine over three replicas' part registrations and lease messages.

Three real `Coordinator`s, each with its `ReplicatedInventory` and `PeerLink`
(coordinator/runtime/peers.py) and the wire's own registration codec, share one
log held here in a list: what the Redis Stream is in production. The machine
interleaves, at random, what production interleaves: a rank part registering on
any replica (again, elsewhere, while an older session of it still lives: a
zombie), sessions closing, fencing-token claims answered late and out of order
(Redis INCR, here a counter), appends of each replica's outbox, each replica
reading the log at its own pace, a replica losing track of the log (a snapshot
reload past a trim: the entries between are never read), a replica's outbox reset
(an overflow), the store lost (a new, empty log and a new fencing counter; each
replica notices in its own time, or when a claim is refused for the old epoch, and
until then appends to and reads the new log), and lease messages sent to whatever
session a replica's registry names. A new store's tokens outrank the old one's.

Time passes on each replica's own clock (`advance`). At every step, the session of a
part with the highest token issued, while it lives, is never proven gone on a replica
that had it registered (I6-quiescence), whatever that replica lost track of. What
must hold, once every claim is answered and every replica has read the whole log
(`settle`): one rank part has at most one live session in the cluster (the one
with the highest fencing token); every replica's registry names exactly that
session for it, or nothing when it has none; no replica still has a part it lost
track of unaccounted for (each was announced again, or its grace started); and a
lease message was only ever queued on the session it was addressed to (fencing on
delivery).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.leases import Flow, SendAbort, SendPin
from coordinator.core.profiles import DeploymentProfile
from coordinator.core.registry import PartRef, RankPartRegistration
from coordinator.edges.grpc_wire import part_codec
from coordinator.runtime.clock import ManualClock
from coordinator.runtime.config import CoordinatorConfig
from coordinator.runtime.coordinator import Coordinator, Session
from coordinator.runtime.peers import (
    CALL_EXTEND_HANDOFF,
    OP_REPLY,
    PEER_TAGS,
    REPLY_ABORT_ACK,
    PeerLink,
    part_key,
)
from coordinator.runtime.replication import INVENTORY_TAGS, ReplicatedInventory

REPLICAS = ("r0", "r1", "r2")
PARTS = ("e0", "e1")  # child engines of one rank part each
CONFIG = CoordinatorConfig()
# A fencing-token claim out: (session id, its answer, cancelled?, the asking replica).
ClaimEntry = tuple[str, Callable[[int], None], list[bool], str]


def _registration(engine: str) -> RankPartRegistration:
    return RankPartRegistration(
        engine_id=engine,
        dp_rank=0,
        child_engine_id=engine,
        rank=(0, 0, 0),
        profile=DeploymentProfile(model="m", block_size=16),
    )


class _Replica:
    def __init__(self, origin: str, claims: list[ClaimEntry]):
        self.origin = origin
        self.clock = ManualClock()
        self.inventory = ReplicatedInventory(
            origin, max_entries_total=1000, max_entries_per_engine=1000
        )
        self.coordinator = Coordinator(
            CONFIG, clock=self.clock, inventory=self.inventory, lease_id_owner=origin
        )

        def claim(key: str, session_id: str, on_token: Callable[[int], None]) -> Callable[[], None]:
            cancelled = [False]
            claims.append((session_id, on_token, cancelled, origin))
            return lambda: cancelled.__setitem__(0, True)

        self.peers = PeerLink(
            origin,
            self.inventory.record,
            part_codec(CONFIG.bounds),
            self.clock.monotonic_ms,
            self.inventory.origin_alive,
            claim=claim,
            epoch_tag=lambda: str(self.epoch).encode(),
        )
        self.inventory.peers = self.peers
        self.coordinator.attach_peers(self.peers)
        self.read = 0  # log entries this replica has read
        self.sessions: dict[str, Session] = {}  # every session ever opened here
        self.epoch = 0  # the store this replica knows (a store loss starts another)
        self.reset_reader = False  # it noticed a store loss: its reader starts again

    def live_session(self, engine: str) -> Session | None:
        for session in self.sessions.values():
            if session.ref.child_engine_id == engine and not session.ended:
                return session
        return None


class PeersMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.claims: list[ClaimEntry] = []
        self.replicas = [_Replica(origin, self.claims) for origin in REPLICAS]
        self.log: list[tuple[str, list[object]]] = []
        self.epoch = 0  # the store's: a store loss starts a new one, log and counter
        self.tokens = itertools.count(1)
        self.addressed: dict[str, str] = {}  # lease id of a sent pin -> session id
        self.leases = itertools.count()
        # session id -> (epoch, token) its claim got last: a new store's tokens outrank
        # the old one's (its parts claim again when their replica notices the loss).
        self.token_of: dict[str, tuple[int, int]] = {}
        self.had: dict[str, set[str]] = {r.origin: set() for r in self.replicas}

    # --- what production interleaves ----------------------------------------------------

    @rule(replica=st.integers(0, 2), engine=st.sampled_from(PARTS))
    def register(self, replica: int, engine: str) -> None:
        r = self.replicas[replica]
        if r.live_session(engine) is not None:
            return  # one stream per part per replica (the registry refuses a second)
        session = r.coordinator.open_session(_registration(engine))
        r.sessions[session.session_id] = session

    @rule(replica=st.integers(0, 2), engine=st.sampled_from(PARTS))
    def close(self, replica: int, engine: str) -> None:
        r = self.replicas[replica]
        session = r.live_session(engine)
        if session is not None:
            r.coordinator.close_session(session, "closed")

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def answer_claim(self, data: st.DataObject) -> None:
        """Redis answers one pending claim (any of them: replies race)."""
        index = data.draw(st.integers(0, len(self.claims) - 1))
        self._answer(index)

    @rule(replica=st.integers(0, 2))
    def append(self, replica: int) -> None:
        r = self.replicas[replica]
        while r.inventory.outbox:
            self.log.append((r.origin, r.inventory.outbox.popleft()))

    @rule(replica=st.integers(0, 2), entries=st.integers(1, 8))
    def read(self, replica: int, entries: int) -> None:
        self._read(self.replicas[replica], entries)

    @rule(replica=st.integers(0, 2), skipped=st.integers(0, 8))
    def lose_track(self, replica: int, skipped: int) -> None:
        """The replica's read position was trimmed away: it reloads a snapshot (no
        parts in it) and reads on past the entries it skipped."""
        r = self.replicas[replica]
        r.inventory.drop_all_remote("a snapshot was loaded")
        r.read = min(len(self.log), r.read + skipped)

    @rule(replica=st.integers(0, 2))
    def reset(self, replica: int) -> None:
        """The replica's outbox overflowed: what it queued is lost (lease messages and
        call answers excepted), it writes a reset and announces its engines and parts."""
        self.replicas[replica].inventory.reannounce()

    @rule()
    def lose_store(self) -> None:
        """Redis came back empty: a new log (the old one's entries are gone, read or not)
        and a new fencing counter. Each replica notices on its own (`notice_store_loss`,
        or a claim refused for the old epoch); until then it appends to the new log and
        reads it, as a replica does whose read position is older than the new ids."""
        self.epoch += 1
        self.log = []
        self.tokens = itertools.count(1)
        for r in self.replicas:
            r.read = 0

    @rule(replica=st.integers(0, 2))
    def notice_store_loss(self, replica: int) -> None:
        self._notice(self.replicas[replica])

    @rule(replica=st.integers(0, 2), ms=st.integers(0, 3 * CONFIG.session_grace_ms))
    def advance(self, replica: int, ms: int) -> None:
        """Time passes on one replica: grace periods (and heartbeat timeouts) run out."""
        self.replicas[replica].clock.advance(ms)

    @rule(replica=st.integers(0, 2), engine=st.sampled_from(PARTS))
    def send_pin(self, replica: int, engine: str) -> None:
        r = self.replicas[replica]
        session_id = r.coordinator.registry.session_of(engine, (0, 0, 0))
        if session_id is None:
            return
        lease_id = f"pl-{next(self.leases)}@{r.origin}"
        self.addressed[lease_id] = session_id
        message = SendPin(engine, (0, 0, 0), lease_id, (b"h",), "req", r.clock.monotonic_ms(), 0)
        assert r.coordinator.send_to_part(engine, (0, 0, 0), message)

    @rule()
    def settle(self) -> None:
        self._settle()
        self._check_settled()

    def teardown(self) -> None:
        self._settle()
        self._check_settled()

    # --- what must hold ------------------------------------------------------------------

    @invariant()
    def messages_reach_only_their_session(self) -> None:
        for r in self.replicas:
            for session_id, session in r.sessions.items():
                for item in list(session._queue._queue):  # type: ignore[attr-defined]
                    if isinstance(item, SendPin):
                        assert self.addressed[item.lease_id] == session_id

    @invariant()
    def a_live_part_is_never_proven_gone_where_it_was_known(self) -> None:
        """I6-quiescence: the session of a part with the highest token issued, while it
        lives, is never proven gone on a replica that had it registered, however long
        that replica waits, whatever it lost track of: a lease there may name it."""
        sessions = {sid: s for r in self.replicas for sid, s in r.sessions.items()}
        for r in self.replicas:
            for engine in PARTS:
                held = r.coordinator.registry.session_of(engine, (0, 0, 0))
                if held is not None:
                    self.had[r.origin].add(held)
        for engine in PARTS:
            tokens = {
                sid: t
                for sid, t in self.token_of.items()
                if sessions[sid].ref.child_engine_id == engine
            }
            if not tokens:
                continue
            newest = max(tokens, key=tokens.__getitem__)
            if sessions[newest].ended:
                continue
            for r in self.replicas:
                if newest in self.had[r.origin]:
                    assert not r.coordinator.proven_gone(engine), (r.origin, engine, newest)

    @invariant()
    def the_unaccounted_parts_index_matches_them(self) -> None:
        for r in self.replicas:
            by_part: dict[str, set[str]] = {}
            for parts in r.peers._unaccounted.values():
                for ref in parts.values():
                    key = part_key(ref.child_engine_id, ref.rank)
                    by_part.setdefault(key, set()).add(ref.session_id)
            index = {k: set(v) for k, v in r.peers._unaccounted_by_part.items()}
            assert index == by_part, r.origin

    def _check_settled(self) -> None:
        for engine in PARTS:
            live = [
                (r.origin, s.session_id)
                for r in self.replicas
                if (s := r.live_session(engine)) is not None
            ]
            assert len(live) <= 1, f"{engine} has {len(live)} live sessions: {live}"
            named = {
                r.origin: r.coordinator.registry.session_of(engine, (0, 0, 0))
                for r in self.replicas
            }
            expected = live[0][1] if live else None
            assert set(named.values()) == {expected}, (engine, live, named)
        for r in self.replicas:
            assert not r.peers._unaccounted, (r.origin, r.peers._unaccounted)
            # A token is kept only for a part with a live session (bounded memory).
            held = set(r.peers._local) | set(r.peers._remote)
            stale = {k: v for k, v in r.peers._best.items() if v[1] not in held}
            assert not stale, (r.origin, stale)

    # --- helpers -------------------------------------------------------------------------

    def _notice(self, r: _Replica) -> None:
        """What `RedisStore._store_lost` does: a reset with new claims now, and the reader
        drops every remote part before it reads the new log from its start."""
        if r.epoch == self.epoch:
            return
        r.epoch = self.epoch
        r.inventory.reannounce(reclaim=True)
        r.reset_reader = True

    def _read(self, r: _Replica, entries: int) -> None:
        if r.reset_reader:
            r.reset_reader = False
            r.inventory.drop_all_remote("the shared store was lost", store_lost=True)
            r.read = 0
        now = r.clock.monotonic_ms()
        for origin, op in self.log[r.read : r.read + entries]:
            r.inventory.apply_remote(origin, [op], now)
        r.read = min(len(self.log), r.read + entries)

    def _answer(self, index: int) -> None:
        session_id, on_token, cancelled, origin = self.claims.pop(index)
        r = next(r for r in self.replicas if r.origin == origin)
        if r.epoch != self.epoch:
            # The claim script refuses another epoch's claim: the replica notices the
            # loss, which asks every claim of its parts again (this one is cancelled).
            self._notice(r)
            return
        token = next(self.tokens)  # the INCR ran now: tokens follow the answer order
        if not cancelled[0]:
            self.token_of[session_id] = (self.epoch, token)
            on_token(token)

    def _settle(self) -> None:
        for r in self.replicas:
            self._notice(r)  # its epoch check runs every heartbeat
        for _ in range(50):
            while self.claims:
                self._answer(0)
            for index in range(len(self.replicas)):
                self.append(index)
            for r in self.replicas:
                self._read(r, len(self.log))
            if (
                not self.claims
                and all(not r.inventory.outbox for r in self.replicas)
                and all(not r.reset_reader for r in self.replicas)
            ):
                return
        raise AssertionError("the replicas did not settle")


def test_peer_ops_and_inventory_ops_share_the_log_without_sharing_a_tag() -> None:
    assert not PEER_TAGS & INVENTORY_TAGS
    assert len(INVENTORY_TAGS) == 10 and len(PEER_TAGS) == 9


TestPeers = PeersMachine.TestCase
TestPeers.settings = settings(
    max_examples=600,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _lost_track_of_e0(r0: _Replica, claims: list[ClaimEntry]) -> _Replica:
    """e0 registers on r0; r1 reads it, then loses track of the log (a snapshot reload).
    Returns r1."""
    r1 = _Replica("r1", claims)
    session = r0.coordinator.open_session(_registration("e0"))
    r0.sessions[session.session_id] = session
    claims.pop()[1](1)  # the token
    for origin, op in _drain(r0):
        r1.inventory.apply_remote(origin, [op], r1.clock.monotonic_ms())
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) is not None
    r1.inventory.drop_all_remote("a snapshot was loaded")
    return r1


def _drain(r: _Replica) -> list[tuple[str, list[object]]]:
    ops = [(r.origin, op) for op in r.inventory.outbox]
    r.inventory.outbox.clear()
    return ops


def test_a_part_lost_track_of_is_not_proven_gone_until_its_silent_replica_is() -> None:
    """r0 is not heard again (dead, or older and never closes a round): e0 is not proven
    gone on r1 however long it waits (I6-quiescence: a lease's reader may live there),
    until r0 is called silent; then its grace period runs as for any silent replica."""
    claims: list[ClaimEntry] = []
    r1 = _lost_track_of_e0(_Replica("r0", claims), claims)
    r1.clock.advance(100 * CONFIG.session_grace_ms)
    assert not r1.coordinator.proven_gone("e0")
    now = r1.clock.monotonic_ms()
    assert r1.inventory.expire_silent_origins(now, 1_000, following_since_ms=now - 2_000) == 0
    assert not r1.coordinator.proven_gone("e0")  # its grace period has just begun
    r1.clock.advance(CONFIG.session_grace_ms + 1)
    assert r1.coordinator.proven_gone("e0")


def test_a_round_begun_before_the_loss_does_not_account_for_a_part() -> None:
    """r1 read r0's OP_ANNOUNCING, then lost track: the OP_PARTs after it were trimmed,
    only the OP_ANNOUNCED is left to read. That round proves nothing here: e0 stays
    unaccounted for, and r1's own hello gets a whole round, which brings it back."""
    claims: list[ClaimEntry] = []
    r0, r1 = _Replica("r0", claims), _Replica("r1", claims)
    r0.coordinator.open_session(_registration("e0"))
    claims.pop()[1](1)
    for origin, op in _drain(r0):
        r1.inventory.apply_remote(origin, [op], r1.clock.monotonic_ms())
    r0.peers.announce_local()  # a round, for somebody's hello
    announcing, part, announced = _drain(r0)
    assert (announcing[1][0], part[1][0], announced[1][0]) == ("G", "P", "N")
    now = r1.clock.monotonic_ms()
    r1.inventory.apply_remote("r0", [announcing[1]], now)
    r1.inventory.drop_all_remote("a snapshot was loaded")  # `part` was trimmed away
    r1.inventory.apply_remote("r0", [announced[1]], now)
    r1.clock.advance(100 * CONFIG.session_grace_ms)
    assert not r1.coordinator.proven_gone("e0")
    # r1's hello (written when it lost track) reaches r0, which answers with a round.
    for origin, op in _drain(r1):
        r0.inventory.apply_remote(origin, [op], r0.clock.monotonic_ms())
    for origin, op in _drain(r0):
        r1.inventory.apply_remote(origin, [op], r1.clock.monotonic_ms())
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) is not None
    assert not r1.peers._unaccounted


def test_a_part_lost_track_of_that_a_whole_round_lacks_is_proven_gone() -> None:
    """e0 left r0 in entries r1 never read (trimmed): r0's answer to r1's hello lacks
    it, so its grace period starts at the round's end and its engine is then gone."""
    claims: list[ClaimEntry] = []
    r0 = _Replica("r0", claims)
    r1 = _lost_track_of_e0(r0, claims)
    session = r0.live_session("e0")
    assert session is not None
    r0.coordinator.close_session(session, "closed")
    _drain(r0)  # its departure: trimmed away before r1 read it
    for origin, op in _drain(r1):  # r1's hello
        r0.inventory.apply_remote(origin, [op], r0.clock.monotonic_ms())
    for origin, op in _drain(r0):  # r0's round, without e0
        r1.inventory.apply_remote(origin, [op], r1.clock.monotonic_ms())
    assert not r1.peers._unaccounted
    assert not r1.peers._best  # its token is not kept once it left (bounded memory)
    assert not r1.coordinator.proven_gone("e0")  # inside its grace period
    r1.clock.advance(CONFIG.session_grace_ms + 1)
    assert r1.coordinator.proven_gone("e0")


def test_a_refused_registration_puts_back_the_remote_copy_it_would_have_replaced() -> None:
    """e0 (tp=2) lives on r0. Its rank 0 registers on r1 with another block size: that
    would replace the remote copy, but the registry refuses it (inconsistent with rank
    1). The copy is put back as it was, at once, and r1 asks nobody to announce: a
    hello here made every replica announce all its parts once per refused retry."""
    claims: list[ClaimEntry] = []
    r0, r1 = _Replica("r0", claims), _Replica("r1", claims)
    profile = DeploymentProfile(model="m", block_size=16, tp_size=2)
    for tp in (0, 1):
        r0.coordinator.open_session(RankPartRegistration("e0", 0, "e0", (tp, 0, 0), profile))
        claims.pop()[1](tp + 1)
    for origin, op in _drain(r0):
        r1.inventory.apply_remote(origin, [op], r1.clock.monotonic_ms())
    held = r1.coordinator.registry.session_of("e0", (0, 0, 0))
    assert held is not None and r1.coordinator.registry.is_ready("e0")
    other = DeploymentProfile(model="m", block_size=32, tp_size=2)
    with pytest.raises(KvrcError) as refused:
        r1.coordinator.open_session(RankPartRegistration("e0", 0, "e0", (0, 0, 0), other))
    assert refused.value.code is ErrorCode.FAILED_PRECONDITION  # block_size mismatch
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) == held
    assert r1.coordinator.registry.is_ready("e0")
    assert r1.peers.origin_of(held) == "r0"
    assert [op for op in r1.inventory.outbox if op[0] == "W"] == [], "a hello was written"
    # Its messages still reach the copy on r0, and a later move of it is still fenced.
    assert r1.coordinator.send_to_part(
        "e0", (0, 0, 0), SendPin("e0", (0, 0, 0), "pl-1@r1", (b"h",), "req", 0, 0)
    )


def test_an_older_announcement_read_while_a_local_claim_is_out_does_not_fence_it() -> None:
    """e0 moves from r0 to r1. Before r1 has its token, it reads r0's announcement of
    the old session, written (in a round) before r0 wrote its departure. The claim
    decides, not the order of reading: r1's token is higher, so r1 keeps e0. Before,
    r1 fenced its own new session at once (seen in CI: a replica's start hello made
    the others announce again while an engine moved)."""
    claims: list[ClaimEntry] = []
    r0, r1 = _Replica("r0", claims), _Replica("r1", claims)
    old = r0.coordinator.open_session(_registration("e0"))
    claims.pop()[1](1)
    for origin, op in _drain(r0):
        r1.inventory.apply_remote(origin, [op], r1.clock.monotonic_ms())
    r0.peers.announce_local()  # a round, for some replica's hello
    r0.coordinator.close_session(old, "closed")  # then e0's stream on r0 breaks
    moved = r1.coordinator.open_session(_registration("e0"))  # its claim is out
    for origin, op in _drain(r0):  # the round's OP_PART (token 1), then the departure
        r1.inventory.apply_remote(origin, [op], r1.clock.monotonic_ms())
    assert not moved.ended, "fenced by an announcement older than its claim"
    claims.pop()[1](2)
    assert not moved.ended
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) == moved.session_id
    assert next(op[:2] for op in r1.inventory.outbox if op[0] == "P") == ["P", moved.session_id]
    assert [op for op in r1.inventory.outbox if op[0] == "W"] == []


def test_a_local_claim_outranked_while_out_fences_its_session_and_hears_the_winner() -> None:
    """The other way round: e0 registers on r1, and before r1's claim is answered it
    reads e0's registration on r0 with a higher token (the engine moved on). r1's token
    is lower: its session is the zombie and is fenced, and r0's session, not registered
    here while r1's own held the part, is registered at once (no hello: a hello's round
    trip could outlast the grace period and prove the engine gone while it lives)."""
    claims: list[ClaimEntry] = []
    r0, r1 = _Replica("r0", claims), _Replica("r1", claims)
    zombie = r1.coordinator.open_session(_registration("e0"))
    r1_claim = claims.pop()[1]
    live = r0.coordinator.open_session(_registration("e0"))
    claims.pop()[1](5)
    for origin, op in _drain(r0):
        r1.inventory.apply_remote(origin, [op], r1.clock.monotonic_ms())
    assert not zombie.ended  # its claim decides
    r1_claim(3)
    assert zombie.ended
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) == live.session_id
    assert [op for op in r1.inventory.outbox if op[0] == "W"] == []


def _registered(r: _Replica, engine: str, token: int, claims: list[Any]) -> Session:
    session = r.coordinator.open_session(_registration(engine))
    r.sessions[session.session_id] = session
    claims.pop()[1](token)
    return session


def _ship(source: _Replica, *targets: _Replica) -> list[tuple[str, list[object]]]:
    ops = _drain(source)
    for target in targets:
        for origin, op in ops:
            target.inventory.apply_remote(origin, [op], target.clock.monotonic_ms())
    return ops


def test_a_reload_keeps_the_tokens_seen_so_an_older_announcement_fences_nothing() -> None:
    """e0 moved from r0 (token 5) to r1 (token 9). r1 reloads a snapshot, then reads
    r0's announcement of the old session (a round written before r0 heard of token 9).
    Before, a reload cleared every token seen, and r1 fenced its own live session."""
    claims: list[Any] = []
    r0, r1 = _Replica("r0", claims), _Replica("r1", claims)
    old = _registered(r0, "e0", 5, claims)
    _ship(r0, r1)
    r0.peers.announce_local()  # the round, still naming the old session
    stale = _drain(r0)
    r0.coordinator.close_session(old, "closed")
    _drain(r0)  # its departure: read before r1's reload
    live = _registered(r1, "e0", 9, claims)
    r1.inventory.drop_all_remote("a snapshot was loaded")
    for origin, op in stale:
        r1.inventory.apply_remote(origin, [op], r1.clock.monotonic_ms())
    assert not live.ended, "fenced by an older announcement after a reload"
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) == live.session_id


def test_a_replica_that_resets_has_its_parts_unaccounted_for_not_gone() -> None:
    """r0's outbox overflowed: it writes a reset, then announces again. Its parts did not
    leave: on r1 they are not proven gone however long the round takes, and the round
    brings them back. Before, a reset started their grace periods."""
    claims: list[Any] = []
    r0, r1 = _Replica("r0", claims), _Replica("r1", claims)
    _registered(r0, "e0", 1, claims)
    _ship(r0, r1)
    r0.inventory.reannounce()  # the reset, then its round
    ops = _drain(r0)
    r1.inventory.apply_remote("r0", [ops[0][1]], r1.clock.monotonic_ms())  # the reset
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) is None
    r1.clock.advance(100 * CONFIG.session_grace_ms)
    assert not r1.coordinator.proven_gone("e0")
    for origin, op in ops[1:]:
        r1.inventory.apply_remote(origin, [op], r1.clock.monotonic_ms())
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) is not None


def test_a_stale_session_that_comes_and_goes_leaves_the_unaccounted_one_standing() -> None:
    """After a store loss r1 has lost track of e0's live session (on r0). It then reads a
    stale session of e0 announced by r2, which r2 fences and removes soon after. That
    departure proves nothing about the live session: e0 is not proven gone while that
    one is unaccounted for. Before, the stale session took its place and its departure
    started a real grace period."""
    claims: list[Any] = []
    r0, r1, r2 = (_Replica(o, claims) for o in ("r0", "r1", "r2"))
    _registered(r0, "e0", 10, claims)
    _ship(r0, r1)
    r1.inventory.drop_all_remote("the shared store was lost", store_lost=True)
    stale = _registered(r2, "e0", 3, claims)
    _ship(r2, r1)
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) == stale.session_id
    r2.coordinator.close_session(stale, "fenced")
    _ship(r2, r1)
    r1.clock.advance(100 * CONFIG.session_grace_ms)
    assert not r1.coordinator.proven_gone("e0")


def test_a_claim_answered_after_it_was_asked_again_is_ignored() -> None:
    """A store loss asks e0's token again, and a hello right after asks once more (the
    first claim cancelled). If the first one's answer still comes, after the second's,
    its lower token must not fence e0's own session (seen under load: Redis had run the
    first INCR before its cancel; the session was fenced by its own claim)."""
    claims: list[Any] = []
    r1 = _Replica("r1", claims)
    live = _registered(r1, "e0", 7, claims)
    r1.peers.announce_local(reclaim=True)  # the store loss: a new token
    _, first, _, _ = claims.pop()
    r1.peers.announce_local()  # a hello while that claim is out: asked again
    _, second, _, _ = claims.pop()
    second(4)
    first(3)  # late, whatever its cancel
    assert not live.ended, "fenced by its own superseded claim"
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) == live.session_id


def test_a_winner_that_left_while_a_local_claim_was_out_is_not_registered() -> None:
    """e0's registration on r0 (token 5) reaches r1 while r1's own claim for e0 is out;
    then it leaves r0. r1's session ends before its claim answers: the one that
    outranked it is gone, so it must not be registered in its place (nothing would
    ever remove that ghost: its departure was already read)."""
    claims: list[Any] = []
    r0, r1 = _Replica("r0", claims), _Replica("r1", claims)
    mine = r1.coordinator.open_session(_registration("e0"))
    _, my_claim, _, _ = claims.pop()
    winner = _registered(r0, "e0", 5, claims)
    r0.coordinator.close_session(winner, "closed")
    _ship(r0, r1)  # its registration, then its departure
    r1.coordinator.close_session(mine, "closed")
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) is None, "a ghost"
    my_claim(3)  # late: changes nothing
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) is None


def test_a_round_waits_for_the_parts_held_at_its_start_and_for_no_others() -> None:
    """A round closes (OP_ANNOUNCED) once every part held when it began is in the log
    after its OP_ANNOUNCING with its token: not before e1's claim, out at its start,
    is answered; and e2, registered during the round (a new session, which no replica
    can have lost track of), does not hold it open."""
    claims: list[Any] = []
    r0 = _Replica("r0", claims)
    _registered(r0, "e0", 1, claims)
    e1 = r0.coordinator.open_session(_registration("e1"))
    _drain(r0)
    r0.peers.announce_local()  # e1's claim is asked again: the round waits for it
    assert [op[0] for _, op in _drain(r0)] == ["G", "P"]
    r0.coordinator.open_session(_registration("e2"))
    e1_claim = next(c for c in claims if c[0] == e1.session_id and not c[2][0])
    e1_claim[1](2)
    ops = [op for _, op in _drain(r0) if op[0] in PEER_TAGS]  # not e2's engine ops
    assert [op[0] for op in ops] == ["P", "N"], "the round waited for e2 as well"
    assert ops[0][1] == e1.session_id


def test_settling_one_of_two_unaccounted_sessions_keeps_the_others_hold() -> None:
    """r1 lost track of e0 twice: of session A (on r0), then, after it read e0's later
    registration on r2 (B), of B. r2's round proves B gone; A may still be the live one,
    so e0 is not proven gone however long r0's round takes. Once that round lacks A
    too, e0's grace period runs."""
    claims: list[Any] = []
    r0, r1, r2 = (_Replica(o, claims) for o in ("r0", "r1", "r2"))
    a = _registered(r0, "e0", 1, claims)
    _ship(r0, r1)
    r1.inventory.drop_all_remote("a snapshot was loaded")
    _drain(r1)  # its hello and round: trimmed away
    b = _registered(r2, "e0", 2, claims)
    _ship(r2, r1)
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) == b.session_id
    r1.inventory.drop_all_remote("a snapshot was loaded")
    r2.coordinator.close_session(b, "closed")
    _drain(r2)  # B's departure: trimmed away before r1 read it
    hello = _drain(r1)
    for origin, op in hello:
        r2.inventory.apply_remote(origin, [op], r2.clock.monotonic_ms())
    _ship(r2, r1)  # r2's round, without B
    r1.clock.advance(100 * CONFIG.session_grace_ms)
    assert not r1.coordinator.proven_gone("e0"), "B's grace ran while A was unaccounted for"
    r0.coordinator.close_session(a, "closed")
    _drain(r0)  # A's departure: trimmed away too
    for origin, op in hello:
        r0.inventory.apply_remote(origin, [op], r0.clock.monotonic_ms())
    _ship(r0, r1)  # r0's round, without A
    assert not r1.peers._unaccounted
    assert not r1.coordinator.proven_gone("e0")  # inside its grace period
    r1.clock.advance(CONFIG.session_grace_ms + 1)
    assert r1.coordinator.proven_gone("e0")


def test_a_part_announced_with_a_token_this_replica_refuses_stays_unaccounted_for() -> None:
    """r1 lost track of e0 (token 10 on r0). r0 then noticed a store loss that r1 has not
    noticed yet: its round announces e0 with the new store's token 1, which r1 does not
    take (another store's). That round does not prove e0 gone: it is still announced,
    so it stays unaccounted for (until r1 notices the loss and takes it), not in a
    grace period."""
    claims: list[Any] = []
    r0, r1 = _Replica("r0", claims), _Replica("r1", claims)
    _registered(r0, "e0", 10, claims)
    _ship(r0, r1)
    r1.inventory.drop_all_remote("a snapshot was loaded")
    hello = _drain(r1)
    r0.epoch = 1
    r0.peers.announce_local(reclaim=True)  # the store loss, seen by r0 only
    claims.pop()[1](1)
    for origin, op in hello:
        r0.inventory.apply_remote(origin, [op], r0.clock.monotonic_ms())
    _ship(r0, r1)
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) is None
    r1.clock.advance(100 * CONFIG.session_grace_ms)
    assert not r1.coordinator.proven_gone("e0"), "a live part's grace ran out"
    r1.epoch = 1
    r1.inventory.drop_all_remote("the shared store was lost", store_lost=True)
    r0.peers.announce_local()  # its answer to r1's hello after the loss
    _ship(r0, r1)
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) is not None


def _moving_to_r0(claims: list[Any]) -> tuple[_Replica, _Replica, Session, Session]:
    """e0 lives on r1 (token 1, read by r0); it registers on r0 too (the engine moving
    there), displacing r1's session in r0's view, and its claim is out. Returns r0, r1,
    the session on r1 and the one on r0."""
    r0, r1 = _Replica("r0", claims), _Replica("r1", claims)
    live = _registered(r1, "e0", 1, claims)
    _ship(r1, r0)
    moving = r0.coordinator.open_session(_registration("e0"))
    return r0, r1, live, moving


def test_a_local_part_gone_before_its_claim_puts_back_the_session_it_displaced() -> None:
    """e0 lives on r1 (token 1). It registers on r0 too (the engine moving there), which
    displaces r1's session in r0's view, and that registration closes before its claim
    is answered. Nothing proved r1's session gone: r0 registers it again at once, and
    e0 is never proven gone there. Before, r0 only asked to hear of it again (a hello),
    and e0 was proven gone once the grace period ran out first."""
    claims: list[Any] = []
    r0, _, live, moving = _moving_to_r0(claims)
    r0.coordinator.close_session(moving, "closed")  # its claim is still out
    assert r0.coordinator.registry.session_of("e0", (0, 0, 0)) == live.session_id
    r0.clock.advance(100 * CONFIG.session_grace_ms)
    assert not r0.coordinator.proven_gone("e0")


def test_a_displaced_session_is_unaccounted_for_after_a_loss_of_track() -> None:
    """As above, but r0 lost track of the log while its claim was out: r1's session may
    have left in what r0 did not read, or may live on. When r0's own session closes,
    e0 is not proven gone until r1's next round settles it: here the round announces
    it, and r0 registers it again."""
    claims: list[Any] = []
    r0, r1, live, moving = _moving_to_r0(claims)
    r0.inventory.drop_all_remote("a snapshot was loaded")
    r0.coordinator.close_session(moving, "closed")
    r0.clock.advance(100 * CONFIG.session_grace_ms)
    assert not r0.coordinator.proven_gone("e0"), "a live part proven gone"
    for origin, op in _drain(r0):  # r0's hello reaches r1, which announces again
        r1.inventory.apply_remote(origin, [op], r1.clock.monotonic_ms())
    _ship(r1, r0)
    assert r0.coordinator.registry.session_of("e0", (0, 0, 0)) == live.session_id
    assert not r0.peers._unaccounted


def _live_claim(claims: list[Any], session: Session) -> Any:
    """The session's claim still out (not cancelled), taken off the list."""
    claim = next(c for c in claims if c[0] == session.session_id and not c[2][0])
    claims.remove(claim)
    return claim[1]


def test_a_session_announced_while_a_local_claim_holds_the_part_is_not_gone_at_the_rounds_end() -> (
    None
):
    """The store is lost while e0's registration on r0 (displacing its session on r1)
    waits for its claim. r1's round announces its session with the new store's token 3;
    r0 cannot take it (its own claim holds the part). That round does not prove it gone:
    when r0's claim answers 2, r0's session is fenced and r1's is registered. Before,
    the round's end forgot token 3, r0's session won with 2, and two replicas each had
    a live session of e0."""
    claims: list[Any] = []
    r0, r1, live, moving = _moving_to_r0(claims)
    r0.peers.announce_local(reclaim=True)  # the store loss, on both replicas
    r0.inventory.drop_all_remote("the shared store was lost", store_lost=True)
    r1.peers.announce_local(reclaim=True)
    _live_claim(claims, live)(3)
    _ship(r1, r0)  # r1's round: its session, token 3
    _live_claim(claims, moving)(2)
    assert moving.ended, "two live sessions of e0"
    assert r0.coordinator.registry.session_of("e0", (0, 0, 0)) == live.session_id


def test_a_reset_clears_the_displaced_session_so_no_ghost_is_registered() -> None:
    """e0's registration on r0 displaced its session on r1 and waits for its claim.
    That session closes on r1, but its departure is lost with r1's outbox (a reset and
    a round without it). When r0's registration closes before its claim, r0 registers
    nothing: the round proved r1's session gone. Before, r0 registered it again, a
    ghost that nothing would remove."""
    claims: list[Any] = []
    r0, r1, live, moving = _moving_to_r0(claims)
    r1.coordinator.close_session(live, "closed")
    _drain(r1)  # its departure, dropped with the overflowing outbox
    r1.inventory.reannounce()  # the reset, then a round without it
    _ship(r1, r0)
    r0.coordinator.close_session(moving, "closed")
    assert r0.coordinator.registry.session_of("e0", (0, 0, 0)) is None, "a ghost"
    r0.clock.advance(CONFIG.session_grace_ms + 1)
    assert r0.coordinator.proven_gone("e0")


def _notice_the_store_loss(r: _Replica) -> None:
    """What `PeersMachine._notice` and the reader's reset after it do (the new store: 1)."""
    r.epoch = 1
    r.inventory.reannounce(reclaim=True)
    r.inventory.drop_all_remote("the shared store was lost", store_lost=True)


def _reclaim(r: _Replica, claims: list[Any], session: Session, token: int) -> None:
    """r notices the loss (the new store: 1) before its reader resets: a reset, a round,
    and the session's new claim, answered `token`."""
    r.epoch = 1
    r.inventory.reannounce(reclaim=True)
    _live_claim(claims, session)(token)


def _not_gone_until_it_is_reclaimed(
    r0: _Replica, r1: _Replica, claims: list[Any], live: Session
) -> None:
    """However long r0 takes to notice the loss, e0 is not proven gone on r1; then r0's
    reclaim registers e0's live session there."""
    r1.clock.advance(100 * CONFIG.session_grace_ms)
    assert not r1.coordinator.proven_gone("e0"), "a live part proven gone"
    _reclaim(r0, claims, live, 1)
    _ship(r0, r1)
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) == live.session_id
    assert not r1.peers._unaccounted


def test_a_token_of_the_old_store_read_from_the_new_log_is_not_compared() -> None:
    """After a store loss r1 notices first; r0, not yet, answers r1's hello with e0's old
    store's token 5 into the new log. r1 does not take it (and keeps e0 unaccounted
    for, not gone): once r0 notices and claims again, the new store's token 1 registers
    e0. Before, r1 took token 5 as e0's best and refused its own session's token 1 as
    stale: e0 stayed unregistered on r1 for as long as it lived."""
    claims: list[Any] = []
    r0, r1 = _Replica("r0", claims), _Replica("r1", claims)
    live = _registered(r0, "e0", 5, claims)
    _ship(r0, r1)
    _notice_the_store_loss(r1)
    _ship(r1, r0)  # its hello: r0 announces e0 with the old store's token
    _ship(r0, r1)
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) is None
    _not_gone_until_it_is_reclaimed(r0, r1, claims, live)


def test_a_part_announced_in_one_round_and_lacking_from_the_next_is_gone() -> None:
    """r1 lost track of e0; r0's round announces it with a token r1 does not take (r0
    saw a store loss first: another store's), which keeps it unaccounted for. Then e0
    leaves r0 and its departure is lost with r0's outbox (a reset, then a round without
    it). That round settles it: its grace period runs. Before, the earlier round's mark
    kept it unaccounted for until r0 fell silent, never proven gone."""
    claims: list[Any] = []
    r0, r1 = _Replica("r0", claims), _Replica("r1", claims)
    session = _registered(r0, "e0", 10, claims)
    _ship(r0, r1)
    r1.inventory.drop_all_remote("a snapshot was loaded")
    hello = _drain(r1)
    r0.epoch = 1
    r0.peers.announce_local(reclaim=True)
    claims.pop()[1](1)
    for origin, op in hello:
        r0.inventory.apply_remote(origin, [op], r0.clock.monotonic_ms())
    _ship(r0, r1)  # the round: e0 with token 1, not taken
    assert r1.peers._unaccounted
    r0.coordinator.close_session(session, "closed")
    _drain(r0)  # its departure, dropped with the overflowing outbox
    r0.inventory.reannounce()  # the reset, then a round without e0
    _ship(r0, r1)
    assert not r1.peers._unaccounted, "kept by the round before"
    r1.clock.advance(CONFIG.session_grace_ms + 1)
    assert r1.coordinator.proven_gone("e0")


class _NoScan(dict[str, dict[str, PartRef]]):
    def values(self) -> Any:
        raise AssertionError("scanned every part lost track of")

    def items(self) -> Any:
        raise AssertionError("scanned every part lost track of")


def test_a_parts_unaccounted_session_is_found_without_a_scan_of_the_others() -> None:
    """r1 lost track of 200 parts of r0. A removal asks for one part's unaccounted session
    (`Coordinator._grace`): found by its key, not by a scan of all 200 (a loss of track
    followed by many removals was quadratic)."""
    claims: list[Any] = []
    r0, r1 = _Replica("r0", claims), _Replica("r1", claims)
    sessions = [_registered(r0, f"e{i}", i + 1, claims) for i in range(200)]
    _ship(r0, r1)
    r1.inventory.drop_all_remote("a snapshot was loaded")
    unaccounted = r1.peers._unaccounted
    r1.peers._unaccounted = _NoScan(unaccounted)
    assert r1.peers.unaccounted_session("e7", (0, 0, 0)) == sessions[7].session_id
    assert r1.peers.unaccounted_session("e7", (1, 0, 0)) is None
    r1.peers._unaccounted = unaccounted
    r0.peers.announce_local()  # r0's round brings them back
    _ship(r0, r1)
    assert r1.peers.unaccounted_session("e7", (0, 0, 0)) is None
    assert not r1.peers._unaccounted_by_part


def test_a_won_claim_forgets_the_session_it_displaced() -> None:
    """e0's registration on r0 displaced its session on r1 and won its claim (token 2); r1
    fences its own. r0 then notices a store loss (new claims) and its session closes
    before the new claim answers, with r1's departure not read yet. r0 must not register
    r1's session again with its old store's token: it lost to r0's, a ghost. Before, the
    displaced session was kept after the won claim and came back here."""
    claims: list[Any] = []
    r0, r1, live, moving = _moving_to_r0(claims)
    _live_claim(claims, moving)(2)
    _ship(r0, r1)
    assert live.ended  # fenced on r1; its departure is not read on r0 yet
    r0.peers.announce_local(reclaim=True)  # the store loss, noticed by r0
    r0.coordinator.close_session(moving, "closed")
    assert r0.coordinator.registry.session_of("e0", (0, 0, 0)) is None, "a ghost"


def test_an_other_stores_announcement_holds_a_running_grace_period() -> None:
    """e0's session on r0 closes and e0 registers there again just before the store is
    lost; r1 read the departure (e0's grace runs) but not the new registration, which
    r0 writes into the new log with its old store's token before it notices the loss.
    r1, which noticed, cannot take that token, but the session is e0's live one: e0 is
    not proven gone however long r0 takes to notice, and r0's reclaim registers it."""
    claims: list[Any] = []
    r0, r1 = _Replica("r0", claims), _Replica("r1", claims)
    old = _registered(r0, "e0", 1, claims)
    _ship(r0, r1)
    r0.coordinator.close_session(old, "closed")
    _ship(r0, r1)  # its departure: e0's grace period starts on r1
    live = _registered(r0, "e0", 2, claims)  # its OP_PART is not read before the loss
    _notice_the_store_loss(r1)
    _ship(r0, r1)  # e0's registration with the old store's token
    _not_gone_until_it_is_reclaimed(r0, r1, claims, live)


def test_a_sessions_own_lower_token_is_a_new_stores() -> None:
    """A replica that cannot tell stores apart (its epoch not known yet, or an older
    replica's untagged ops) read e0's session with token 5; r0 then reset after a store
    loss and announces the same session with the new store's token 1. One session's
    tokens only grow within a store: r1 takes it. Before, it refused it as stale, and
    e0 stayed unregistered there for as long as it lived."""
    claims: list[Any] = []
    r0, r1 = _Replica("r0", claims), _Replica("r1", claims)
    r1.peers._epoch_tag = lambda: b""
    live = _registered(r0, "e0", 5, claims)
    _ship(r0, r1)
    _reclaim(r0, claims, live, 1)
    _ship(r0, r1)
    assert r1.coordinator.registry.session_of("e0", (0, 0, 0)) == live.session_id
    assert not r1.peers._unaccounted


async def test_a_call_to_another_replica_after_the_shutdown_began_is_refused_at_once() -> None:
    """Calls forwarded to another replica skipped the shutdown check: one arriving while
    this replica stopped was written to the log, its answer never read here, and its
    caller waited until the server cancelled it (a begin even granted there for nobody).
    Now, from `fail_calls` on, a call is UNAVAILABLE at once and writes nothing."""
    r = _Replica("r0", [])
    waiting = asyncio.ensure_future(r.peers.call("r1", CALL_EXTEND_HANDOFF, ["ho-1", "d"], 30))
    await asyncio.sleep(0)
    sent = r.peers.sent
    r.peers.fail_calls("the coordinator is shutting down")
    with pytest.raises(KvrcError) as first:
        await asyncio.wait_for(waiting, 1)  # waiting: failed, and cancelled on r1
    assert first.value.code is ErrorCode.UNAVAILABLE
    written = r.peers.sent - sent
    with pytest.raises(KvrcError) as later:
        await asyncio.wait_for(r.peers.call("r1", CALL_EXTEND_HANDOFF, ["ho-2", "d"], 30), 1)
    assert later.value.code is ErrorCode.UNAVAILABLE
    assert "shutting down" in later.value.message
    assert r.peers.sent - sent == written  # nothing more went to the log


async def test_a_call_answered_here_and_stopped_by_the_shutdown_says_shutting_down() -> None:
    """A call another replica forwarded here, still waiting when this one stopped, was
    answered "stopped the call": the caller's client did not read it as a shutdown and
    gave a begin up instead of retrying the next coordinator."""
    from coordinator.runtime.peers import OP_RESULT
    from kvrc.vocabulary import COORDINATOR_SHUTTING_DOWN

    r = _Replica("r0", [])
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(r.peers._answer_later("r1", "r1/7", never))
    r.peers._answering[("r1", "r1/7")] = task
    await asyncio.sleep(0)
    _drain(r)
    r.peers.fail_calls(COORDINATOR_SHUTTING_DOWN)
    with pytest.raises(asyncio.CancelledError):
        await task
    [result] = [op for _, op in _drain(r) if op[0] == OP_RESULT]
    assert result[1:4] == ["r1", "r1/7", False]
    refusal: Any = result[4]
    assert refusal[0] == ErrorCode.UNAVAILABLE.value
    assert str(refusal[1]).startswith(f"{COORDINATOR_SHUTTING_DOWN}: retry at the next one")


def test_an_abort_ack_goes_to_the_replica_that_sent_the_abort_when_the_ids_owner_is_silent() -> (
    None
):
    """The lease's owner (named in its id) fell silent; another replica rebuilt it from
    its holder's re-announcement and asked the requester, registered on a third, to
    abort. The ack went to the silent owner's table, that is, nowhere: the quarantine
    waited for an operator (I6-quiescence). It goes to the abort's sender now."""
    claims: list[ClaimEntry] = []
    rx, ro = _Replica("rx", claims), _Replica("ro", claims)
    requester = _registered(rx, "e0", 1, claims)
    _ship(rx, ro)
    lease_id = f"pl-{'a' * 32}@gone"  # owned by a replica neither has heard
    abort = SendAbort("e0", (0, 0, 0), lease_id, Flow.PREFIX_LOAD, "a part reported UNKNOWN")
    assert ro.peers.send(requester.session_id, abort)
    _ship(ro, rx)
    acked = [op for op in rx.inventory.outbox if op[0] == OP_REPLY]
    assert acked == []  # nothing yet: the abort is delivered to the requester's session
    rx.coordinator.on_abort_ack(requester.ref, lease_id)
    acked = [op for op in rx.inventory.outbox if op[0] == OP_REPLY]
    assert len(acked) == 1 and acked[0][1] == "ro" and acked[0][2] == REPLY_ABORT_ACK
    # Control: an ack of a lease whose abort no replica sent stays here, as before.
    rx.coordinator.on_abort_ack(requester.ref, f"pl-{'b' * 32}@gone")
    assert len([op for op in rx.inventory.outbox if op[0] == OP_REPLY]) == 1


@pytest.mark.parametrize("failure", ["unknown kind", "defect"])
async def test_a_forwarded_call_that_fails_here_is_answered_unavailable_at_once(
    failure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call of a kind this replica does not know (a newer replica's, in a rolling
    upgrade) was INVALID_ARGUMENT, which its engine cannot act on; one whose handler
    raised at once was only logged (the op skipped), and its caller waited out its
    whole timeout. Both are answered UNAVAILABLE now, at once."""
    from coordinator.runtime.peers import OP_RESULT

    caller, r = _Replica("r1", []), _Replica("r0", [])
    kind = "some-newer-call" if failure == "unknown kind" else CALL_EXTEND_HANDOFF
    if failure == "defect":

        def broken(kind: str, payload: Any) -> Any:
            raise RuntimeError("a bug in the handler")

        monkeypatch.setattr(r.coordinator, "run_call", broken)
    answer = asyncio.ensure_future(caller.peers.call("r0", kind, ["ho-1", "d"], 30))
    await asyncio.sleep(0)
    _ship(caller, r)
    [result] = [op for _, op in _ship(r, caller) if op[0] == OP_RESULT]
    refusal: Any = result[4]
    assert result[3] is False and refusal[0] == ErrorCode.UNAVAILABLE.value
    with pytest.raises(KvrcError) as refused:
        await asyncio.wait_for(answer, 1)
    assert refused.value.code is ErrorCode.UNAVAILABLE
    says = "older kvrc" if failure == "unknown kind" else "RuntimeError: try again"
    assert says in refused.value.message


def test_a_part_taken_back_from_a_replica_whose_ops_were_lost_is_heard_of_again() -> None:
    """The machine found it (a CI draw, also failing on the code of 10b33f0): e1 lives on
    r1; it registers on r0 too (r0 takes r1's session out of its view), closes there,
    and r0's outbox overflows before its ops are appended. Nobody learns of r0's session,
    so r1's lives on, but r0 never heard of it again: its registry named nobody. A reset
    now asks the others to announce their parts again."""
    m = PeersMachine()
    m.register(engine="e1", replica=1)
    m.settle()
    m.register(engine="e1", replica=0)
    m._answer(0)  # r0's claim
    m.close(engine="e1", replica=0)
    m.reset(replica=0)
    m.settle()  # every registry names r1's session
