"""A hypothesis state machine over three replicas' part registrations and lease messages.

Three real `Coordinator`s, each with its `ReplicatedInventory` and `PeerLink`
(coordinator/runtime/peers.py) and the wire's own registration codec, share one
log held here in a list: what the Redis Stream is in production. The machine
interleaves, at random, what production interleaves: a rank part registering on
any replica (again, elsewhere, while an older session of it still lives: a
zombie), sessions closing, fencing-token claims answered late and out of order
(Redis INCR, here a counter), appends of each replica's outbox, each replica
reading the log at its own pace, and lease messages sent to whatever session a
replica's registry names.

What must hold, once every claim is answered and every replica has read the whole
log (`settle`): one rank part has at most one live session in the cluster (the one
with the highest fencing token); every replica's registry names exactly that
session for it, or nothing when it has none; and a lease message was only ever
queued on the session it was addressed to (fencing on delivery).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from coordinator.core.leases import SendPin
from coordinator.core.profiles import DeploymentProfile
from coordinator.core.registry import RankPartRegistration
from coordinator.edges.grpc_wire import part_codec
from coordinator.runtime.clock import ManualClock
from coordinator.runtime.config import CoordinatorConfig
from coordinator.runtime.coordinator import Coordinator, Session
from coordinator.runtime.peers import PEER_TAGS, PeerLink
from coordinator.runtime.replication import INVENTORY_TAGS, ReplicatedInventory

REPLICAS = ("r0", "r1", "r2")
PARTS = ("e0", "e1")  # child engines of one rank part each
CONFIG = CoordinatorConfig()


def _registration(engine: str) -> RankPartRegistration:
    return RankPartRegistration(
        engine_id=engine,
        dp_rank=0,
        child_engine_id=engine,
        rank=(0, 0, 0),
        profile=DeploymentProfile(model="m", block_size=16),
    )


class _Replica:
    def __init__(self, origin: str, claims: list[tuple[str, Callable[[int], None], list[bool]]]):
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
            claims.append((session_id, on_token, cancelled))
            return lambda: cancelled.__setitem__(0, True)

        self.peers = PeerLink(
            origin,
            self.inventory.record,
            part_codec(CONFIG.bounds),
            self.clock.monotonic_ms,
            self.inventory.origin_alive,
            claim=claim,
        )
        self.inventory.peers = self.peers
        self.coordinator.attach_peers(self.peers)
        self.read = 0  # log entries this replica has read
        self.sessions: dict[str, Session] = {}  # every session ever opened here

    def live_session(self, engine: str) -> Session | None:
        for session in self.sessions.values():
            if session.ref.child_engine_id == engine and not session.ended:
                return session
        return None


class PeersMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.claims: list[tuple[str, Callable[[int], None], list[bool]]] = []
        self.replicas = [_Replica(origin, self.claims) for origin in REPLICAS]
        self.log: list[tuple[str, list[object]]] = []
        self.tokens = itertools.count(1)
        self.addressed: dict[str, str] = {}  # lease id of a sent pin -> session id
        self.leases = itertools.count()

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
        _, on_token, cancelled = self.claims.pop(index)
        token = next(self.tokens)  # the INCR ran now: tokens follow the answer order
        if not cancelled[0]:
            on_token(token)

    @rule(replica=st.integers(0, 2))
    def append(self, replica: int) -> None:
        r = self.replicas[replica]
        while r.inventory.outbox:
            self.log.append((r.origin, r.inventory.outbox.popleft()))

    @rule(replica=st.integers(0, 2), entries=st.integers(1, 8))
    def read(self, replica: int, entries: int) -> None:
        self._read(self.replicas[replica], entries)

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

    # --- helpers -------------------------------------------------------------------------

    def _read(self, r: _Replica, entries: int) -> None:
        now = r.clock.monotonic_ms()
        for origin, op in self.log[r.read : r.read + entries]:
            r.inventory.apply_remote(origin, [op], now)
        r.read = min(len(self.log), r.read + entries)

    def _settle(self) -> None:
        for _ in range(50):
            while self.claims:
                _, on_token, cancelled = self.claims.pop(0)
                token = next(self.tokens)
                if not cancelled[0]:
                    on_token(token)
            for index in range(len(self.replicas)):
                self.append(index)
            for r in self.replicas:
                self._read(r, len(self.log))
            if not self.claims and all(not r.inventory.outbox for r in self.replicas):
                return
        raise AssertionError("the replicas did not settle")


def test_peer_ops_and_inventory_ops_share_the_log_without_sharing_a_tag() -> None:
    assert not PEER_TAGS & INVENTORY_TAGS
    assert len(INVENTORY_TAGS) == 10 and len(PEER_TAGS) == 7


TestPeers = PeersMachine.TestCase
TestPeers.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
