"""The lease ledger's Lua scripts, driven by the lease state machine, in a real Redis.

The hypothesis lease machine (tests/support/lease_machine.py) runs the core's lease
table through random orders of everything; here every step it takes is also written
to the ledger of `coordinator/runtime/lease_ledger.py` (owner replica "A") in a real
`redis-server`, exactly as the lease flow writes it (`LeaseLedger.observe`, pins held
until the open is recorded). The scripts are the code under test. After every step,
Redis itself is read back and must say:

- the live prefix loads are exactly the table's open ones, each owned by "A", in the
  state the table has (pinning, granted, quarantined);
- each block's pin count on its holder equals the number of live leases naming it
  (every requested block while pinning, the granted prefix once granted);
- no lease id is recorded twice: a lease id another replica ("B") recorded first is
  refused, and that lease misses `store_refused` without a pin ever asked for;
- another replica cannot change or end "A"'s records (the owner fence);
- a Redis that came back empty (FLUSHALL and a new epoch) is written again whole.

A machine without redis-server fails here (it does not skip): CI installs it.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator, Sequence

import msgpack
import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from lease_machine import CHAIN, ENGINES, LeaseMachine
from redis_env import RedisServer, start_redis

from coordinator.core.leases import Action, Flow, LeaseState, MissReason, SendPin
from coordinator.runtime.lease_ledger import (
    END_SCRIPT,
    PUT_SCRIPT,
    LeaseLedger,
    lease_key,
    owned_key,
    pins_key,
)
from coordinator.runtime.metrics import Metrics
from coordinator.runtime.store_keys import EPOCH_KEY, LEASE_PREFIX, OWNERS_KEY

_SERVER: list[RedisServer] = []


@pytest.fixture(scope="module", autouse=True)
def redis_server() -> Iterator[RedisServer]:
    with start_redis() as server:
        _SERVER[:] = [server]
        yield server
        _SERVER.clear()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


STATE_WORD = {LeaseState.PINNING: "pinning", LeaseState.QUARANTINED: "quarantined"}


class LedgerMachine(LeaseMachine):
    def __init__(self) -> None:
        super().__init__()
        server = _SERVER[0]
        self.sync = redis.Redis(host="127.0.0.1", port=server.port)
        self.sync.flushall()
        self.epoch = b"epoch-1"
        self.sync.set(EPOCH_KEY, self.epoch)
        self.loop = asyncio.new_event_loop()
        self.conn = aioredis.Redis(host="127.0.0.1", port=server.port)
        self.ledger = LeaseLedger(self.conn, "A", lambda: self.epoch, Metrics())
        # Another replica's ledger, on the same Redis (ids it takes, writes it may not do).
        self.other = LeaseLedger(self.conn, "B", lambda: self.epoch, Metrics())
        self.loop.run_until_complete(self._start())
        self.refused: list[tuple[str, tuple[SendPin, ...]]] = []
        self.opened: set[str] = set()  # leases whose pins the ledger let go out

    async def _start(self) -> None:
        self.ledger.start()
        self.other.start()

    def teardown(self) -> None:
        async def close() -> None:
            await self.ledger.close()
            await self.other.close()
            await self.conn.aclose()

        self.loop.run_until_complete(close())
        self.loop.close()
        self.sync.close()

    def flush(self) -> None:
        async def both() -> None:
            await self.ledger.flushed()
            await self.other.flushed()

        self.loop.run_until_complete(asyncio.wait_for(both(), 10))

    # ------------------------------------------------------------- the lease flow's part

    def recorded(self, lease_id: str, pins: Sequence[SendPin], ok: bool, why: str) -> None:
        if ok:
            self.opened.add(lease_id)
        else:
            self.refused.append((lease_id, tuple(pins)))

    def apply(
        self, actions: Sequence[Action], *, resolving: str | None = None, gone: str | None = None
    ) -> None:
        super().apply(actions, resolving=resolving, gone=gone)
        self.ledger.observe(actions, self.table.get, self.recorded)
        self.flush()
        while self.refused:
            lease_id, pins = self.refused.pop()
            for pin in pins:  # never sent: the holder holds nothing
                self.zero_pins.add((lease_id, pin.rank_key))
            if self.view(lease_id).state is LeaseState.PINNING:
                step = self.table.refuse_by_store(lease_id, self.now)
                assert self.view(lease_id).state is LeaseState.MISSED
                assert self.view(lease_id).miss_reason is MissReason.STORE_REFUSED
                event("a lease id another replica had: store_refused")
                self.apply(step.actions)

    # ------------------------------------------------------------------------ rules

    @rule()
    def another_replica_takes_the_next_id(self) -> None:
        """B records the id the table gives next: A's open of it must be refused."""
        next_id = f"L{self.ids_issued}"
        done: list[tuple[bool, str]] = []
        self.other.open(next_id, "e0", "e1_dp0", CHAIN[:2], lambda ok, why: done.append((ok, why)))
        self.flush()
        assert done == [(True, "")]

    @rule(which=st.integers(0, 63), short=st.integers(1, 3))
    def every_holder_part_pins_a_shorter_prefix(self, which: int, short: int) -> None:
        """A grant of fewer blocks than asked for: the ledger's count must shrink with it."""
        pinning = [
            lid for lid in self.live_prefix_loads() if self.view(lid).state is LeaseState.PINNING
        ]
        if not pinning:
            return
        lid = pinning[which % len(pinning)]
        pinned = max(self.chain_len[lid] - short, 1)
        for rank in self.unsettled(self.holder_parts(lid), self.answered.get(lid, set()), False):
            if self.view(lid).state is LeaseState.PINNING:
                self.do_pin(lid, rank, pinned, 0)

    def holder_parts(self, lid: str) -> tuple[tuple[int, int, int], ...]:
        return ENGINES[self.source[lid]]

    @rule(which=st.integers(0, 63), trim=st.integers(0, 3))
    def another_replica_cannot_touch_a_live_lease(self, which: int, trim: int) -> None:
        live = self.live_prefix_loads()
        if not live:
            return
        lease_id = live[which % len(live)]
        source = self.view(lease_id).source_child_engine_id
        before = self.ledger_dump()
        keys = (lease_key(lease_id), pins_key(source), owned_key("B"), EPOCH_KEY, OWNERS_KEY)
        put = ("B", lease_id, source, "x", "granted")
        answers = [
            self.sync.eval(PUT_SCRIPT, 5, *keys, self.epoch, *put, "new", -1, CHAIN[0]),
            self.sync.eval(PUT_SCRIPT, 5, *keys, self.epoch, *put, "state", trim),
            self.sync.eval(PUT_SCRIPT, 5, *keys, self.epoch, *put, "set", -1, CHAIN[0]),
            self.sync.eval(END_SCRIPT, 4, *keys[:4], self.epoch, "B", lease_id),
            # An old epoch (a replica that has not seen a store loss yet): refused too.
            self.sync.eval(END_SCRIPT, 4, *keys[:4], b"epoch-0", "A", lease_id),
        ]
        assert answers == [0, -2, -2, -2, -1], answers
        assert self.ledger_dump() == before, "a refused write changed the ledger"
        event("B refused on A's lease")

    @rule()
    def store_comes_back_empty(self) -> None:
        self.sync.flushall()
        self.epoch = b"epoch-%d" % (int(self.epoch.rsplit(b"-", 1)[1]) + 1)
        self.sync.set(EPOCH_KEY, self.epoch)
        self.ledger.store_lost()
        self.other.store_lost()
        self.flush()
        event("store lost and re-synced")

    # ------------------------------------------------------------------- invariants

    def live_prefix_loads(self) -> list[str]:
        return sorted(lid for lid in self.leases(Flow.PREFIX_LOAD) if not self.view(lid).terminal)

    def ledger_dump(self) -> dict[bytes, object]:
        dump: dict[bytes, object] = {}
        for key in self.sync.scan_iter(match=b"{kvrc}:*"):
            kind = self.sync.type(key)
            if kind == b"hash":
                dump[key] = self.sync.hgetall(key)
            elif kind == b"set":
                dump[key] = self.sync.smembers(key)
        return dump

    @invariant()
    def redis_says_what_the_table_says(self) -> None:
        live = set(self.live_prefix_loads())
        # B's records are the ids it took; A's must be exactly the live ones.
        owned_a = {_text(m) for m in self.sync.smembers(owned_key("A"))}
        assert owned_a == live, owned_a ^ live
        expected_pins: dict[str, Counter[bytes]] = {}
        for key in self.sync.scan_iter(match=f"{LEASE_PREFIX}*".encode()):
            lease_id = _text(key)[len(LEASE_PREFIX) :]
            record = self.sync.hgetall(key)
            blocks = msgpack.unpackb(record[b"b"], raw=True)
            source = _text(record[b"s"])
            expected_pins.setdefault(source, Counter()).update(blocks)
            if record[b"o"] == b"B":
                assert lease_id not in live or lease_id not in self.opened
                continue
            assert record[b"o"] == b"A"
            view = self.view(lease_id)
            assert source == view.source_child_engine_id
            if view.state is LeaseState.QUARANTINED:
                assert record[b"st"] == b"quarantined"
            elif view.prefix_load_grant is not None:
                assert record[b"st"] == b"granted"
                assert blocks == list(CHAIN[: view.prefix_load_grant.matched_blocks])
            else:
                assert record[b"st"] == STATE_WORD[view.state].encode(), view.state
                assert blocks == list(CHAIN[: self.chain_len[lease_id]])
        for engine in {*expected_pins, *self.source.values()}:
            counts = {field: int(n) for field, n in self.sync.hgetall(pins_key(engine)).items()}
            assert counts == {b: n for b, n in expected_pins.get(engine, Counter()).items()}

    @invariant()
    def every_live_lease_was_recorded_before_its_pins_went_out(self) -> None:
        for lid in self.live_prefix_loads():
            assert lid in self.opened, f"{lid} is live but the ledger never recorded it"


LedgerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestLedgerMachine = LedgerMachine.TestCase
