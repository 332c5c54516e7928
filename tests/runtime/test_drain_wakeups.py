"""A lease change wakes only the waiters of that lease, never every waiter.

Prefix-load and handoff waits are futures keyed by lease and token; a waiting Drain
is keyed by the child engines it drains. A Drain's wake-ups are counted as the
re-checks it makes (`Grants.leases_remaining`), on a manual clock that never moves,
so no poll can wake anyone.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from manual_rig import CHAIN, PROFILE, drain_outbound, manual_coordinator, settle

from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.grants import (
    BeginHandoffRequest,
    PrefixLoadRequest,
    PublishHandoffRequest,
    TransferReport,
)
from coordinator.core.leases import HandoffGrant, LeaseState, Outcome, SendPin
from coordinator.core.registry import RankPartRegistration
from coordinator.runtime.lease_flow import LeaseFlow

PREFILLS = [f"pre{i}" for i in range(8)]


async def test_a_settled_prefix_load_answers_only_its_own_waiters() -> None:
    async with manual_coordinator() as rig:
        flow = rig.coordinator.leases
        holder = rig.register("holder")
        rig.register("req")
        rig.store(holder)
        drain_outbound(holder)

        def ask(request_id: str) -> asyncio.Future[object]:
            request = PrefixLoadRequest(request_id, "req", CHAIN, "", 1, 0, 2_000, 10_000)
            return asyncio.ensure_future(flow.request_prefix_load(request))

        waiting = {f"r{i}": ask(f"r{i}") for i in range(8)}
        again = ask("r3")  # a repeat of an open request waits on the same lease
        await settle()
        pins = {m.lease_id: m for m in drain_outbound(holder) if isinstance(m, SendPin)}
        assert len(pins) == 8 and not any(w.done() for w in [*waiting.values(), again])
        lease = flow.table.find_prefix_load("req", "r3")
        assert lease is not None

        flow.on_pin_result("holder", (0, 0, 0), lease.lease_id, 8, b"d", "")
        await settle()
        # Exactly the two waiters of that lease were answered; the other seven still wait.
        assert again.done() and waiting.pop("r3").done()
        assert not any(w.done() for w in waiting.values())
        for w in waiting.values():
            w.cancel()
        await settle()


async def test_a_lease_end_wakes_only_the_drain_of_its_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with manual_coordinator() as rig:
        flow = rig.coordinator.leases
        rig.register("dec")
        lease_ids = {}
        for prefill in PREFILLS:
            rig.register(prefill)
            publish = PublishHandoffRequest("h", prefill, (0, 0, 0), b"d", b"p", None, 4)
            flow.publish_handoff(publish)
            grant = await flow.begin_handoff(BeginHandoffRequest("h", prefill, "dec", 5_000))
            lease_ids[prefill] = grant.lease_id

        checks: list[tuple[str, ...]] = []
        leases_remaining = flow.core.leases_remaining

        def counted(children: tuple[str, ...]) -> int:
            checks.append(tuple(children))
            return leases_remaining(children)

        monkeypatch.setattr(flow.core, "leases_remaining", counted)
        drains = {p: asyncio.ensure_future(flow.drain(p, 60_000, wait=True)) for p in PREFILLS}
        await settle()
        assert sorted(checks) == [(p,) for p in PREFILLS]  # one check each, then all wait
        assert not any(d.done() for d in drains.values())

        checks.clear()
        report = TransferReport(lease_ids["pre3"], "dec", (0, 0, 0), Outcome.SUCCEEDED, 1, 1, "")
        flow.complete_handoff(report)
        await settle()
        # pre3's drain woke once (its loop's check, then the result's count); no other did.
        assert checks == [("pre3",), ("pre3",)]
        result = drains.pop("pre3").result()
        assert result.safe_to_stop and result.leases_remaining == 0
        assert not any(d.done() for d in drains.values())

        # Waiters that leave take their entries with them: memory follows the waiters.
        for drain in drains.values():
            drain.cancel()
        await settle()
        assert flow._drain_waiters == {}


async def test_a_drain_asked_again_with_a_shorter_timeout_ends_by_it_and_is_counted() -> None:
    """`kvrc drain --wait --timeout-ms` run again with a shorter timeout waited out the
    first drain's deadline, past its own gRPC deadline (DEADLINE_EXCEEDED); and the
    `kvrc_child_engines{state="draining"}` series the docs list was never set."""

    def draining() -> float | None:
        return rig.coordinator.metrics.registry.get_sample_value(
            "kvrc_child_engines", {"state": "draining"}
        )

    async with manual_coordinator() as rig:
        flow = rig.coordinator.leases
        rig.register("dec")
        pre = rig.register("pre")
        assert draining() == 0
        flow.publish_handoff(PublishHandoffRequest("h", "pre", (0, 0, 0), b"d", b"p", None, 4))
        await flow.begin_handoff(BeginHandoffRequest("h", "pre", "dec", 5_000))
        first = await flow.drain("pre", 600_000, wait=False)
        assert not first.safe_to_stop and draining() == 1
        long_deadline = flow.core.drain_deadline_ms(["pre"])
        again = asyncio.ensure_future(flow.drain("pre", 1_000, wait=True))
        await settle()
        assert flow.core.drain_deadline_ms(["pre"]) < long_deadline  # the shorter one stands
        # Control: a longer timeout asked later does not extend it.
        await flow.drain("pre", 900_000, wait=False)
        assert flow.core.drain_deadline_ms(["pre"]) < long_deadline
        await rig.advance(4_000, pre)  # its deadline and the acks' grace: the wait answers
        assert again.done() and not again.result().safe_to_stop
        assert draining() == 1


@pytest.mark.parametrize("swept", [True, False])
async def test_a_begin_cancelled_in_the_same_step_as_its_publish_is_never_granted(
    swept: bool,
) -> None:
    """A forwarded BeginHandoff whose caller left is cancelled when its CALL_CANCEL is
    applied; the publish may follow in the same log entry, before the cancelled task runs
    its `cancel_begin`. `calls_cancelled` (what PeerLink calls) forgets it at once; the
    control without it shows the handoff granted to nobody."""
    async with manual_coordinator() as rig:
        flow = rig.coordinator.leases
        rig.register("dec")
        rig.register("pre")
        begin = asyncio.ensure_future(
            flow.begin_handoff(BeginHandoffRequest("h", "pre", "dec", 10_000))
        )
        await settle()  # it waits for the publish
        begin.cancel()
        if swept:
            rig.coordinator.calls_cancelled()
        flow.publish_handoff(PublishHandoffRequest("h", "pre", (0, 0, 0), b"d", b"p", "dec", 4))
        view = flow.table.find_handoff("pre", "h")
        assert view is not None
        assert (view.state is LeaseState.ACTIVE) is not swept, view.state
        await settle()
        assert begin.cancelled()


async def test_cancelled_begins_do_not_pile_up_behind_a_long_wait_and_waits_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cancelled BeginHandoff left its deadline in the heap until it came up; behind
    one long wait, 1,000 begin-and-cancel calls left 1,000 entries (about 1 KB each, for
    up to 10 minutes), and nothing bounded the begins waiting at once."""
    import coordinator.core.grants as grants

    async with manual_coordinator() as rig:
        flow = rig.coordinator.leases
        rig.register("dec")
        core = flow.core
        anchor = asyncio.ensure_future(
            flow.begin_handoff(BeginHandoffRequest("anchor", "pre", "dec", 590_000))
        )
        await settle()
        for i in range(1_000):
            begin = asyncio.ensure_future(
                flow.begin_handoff(BeginHandoffRequest(f"h{i}", "pre", "dec", 600_000))
            )
            await settle()
            begin.cancel()
            await settle()
        assert len(core._begin_keys) == 1 and not anchor.done()
        assert len(core._begin_deadlines) <= 2 * 1 + 64  # was 1,001
        # At most MAX_WAITING_BEGINS wait at once; the next is told, and nothing waits.
        monkeypatch.setattr(grants, "MAX_WAITING_BEGINS", 3)
        waits, refused = await _waits_then_refused(flow, "dec", 2)
        assert "3 BeginHandoff calls are waiting" in refused.message
        assert len(core._begin_keys) == 3
        for w in [anchor, *waits]:
            w.cancel()
        await settle()
        assert not core._begin_keys


async def _waits_then_refused(
    flow: LeaseFlow, decode: str, waiting: int
) -> tuple[list[asyncio.Task[HandoffGrant]], KvrcError]:
    """`waiting` begins of `decode` wait; the next one is refused RESOURCE_EXHAUSTED."""
    waits = [
        asyncio.ensure_future(
            flow.begin_handoff(BeginHandoffRequest(f"w{i}", "pre", decode, 600_000))
        )
        for i in range(waiting)
    ]
    await settle()
    with pytest.raises(KvrcError) as refused:
        await flow.begin_handoff(BeginHandoffRequest("over", "pre", decode, 600_000))
    assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED
    return waits, refused.value


async def test_one_decode_engine_cannot_take_every_waiting_begin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Waiting BeginHandoff calls are bounded per decode engine too: one engine at its
    share is refused, and another still waits."""
    import coordinator.core.grants as grants

    monkeypatch.setattr(grants, "MAX_WAITING_BEGINS_PER_ENGINE", 2)
    async with manual_coordinator() as rig:
        flow = rig.coordinator.leases
        rig.register("dec")
        rig.register("dec2")
        core = flow.core
        waits, refused = await _waits_then_refused(flow, "dec", 2)
        assert "decode engine 'dec' has 2 BeginHandoff calls waiting" in refused.message
        assert len(core._begin_keys) == 2
        other = asyncio.ensure_future(
            flow.begin_handoff(BeginHandoffRequest("w3", "pre", "dec2", 600_000))
        )
        await settle()
        assert len(core._begin_keys) == 3 and not other.done()
        # A settled wait gives its engine's place back.
        waits[0].cancel()
        await settle()
        again = asyncio.ensure_future(
            flow.begin_handoff(BeginHandoffRequest("w4", "pre", "dec", 600_000))
        )
        await settle()
        assert len(core._begin_keys) == 3 and not again.done()
        for w in [waits[1], other, again]:
            w.cancel()
        await settle()
        assert not core._begin_keys and not core._waiting_by_decode


async def test_waiting_begins_are_retried_by_what_changed_not_scanned_per_tick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every timer tick and every part leaving scanned all waiting BeginHandoff calls (a
    review: 3.6 ms a tick with 16,384 waiting, and a register/close of any engine 67x
    dearer). Now a tick retries the begins of handoffs that ended, and a part leaving
    retries its own engine's; both are counted here, never timed."""
    async with manual_coordinator() as rig:
        flow = rig.coordinator.leases
        core = flow.core
        live = [rig.register("dec")]
        two_parts = dataclasses.replace(PROFILE, tp_size=2)
        for tp in range(2):
            live.append(
                rig.coordinator.open_session(
                    RankPartRegistration(PREFILLS[0], 0, PREFILLS[0], (tp, 0, 0), two_parts)
                )
            )
        waits = [
            asyncio.ensure_future(
                flow.begin_handoff(BeginHandoffRequest(f"w{i}", "pre", "dec", 600_000))
            )
            for i in range(200)
        ]
        # One handoff published by one of its two parts only: its begin waits too.
        flow.publish_handoff(
            PublishHandoffRequest("late", PREFILLS[0], (0, 0, 0), b"d", b"p", None, 1)
        )
        doomed = asyncio.ensure_future(
            flow.begin_handoff(BeginHandoffRequest("late", PREFILLS[0], "dec", 600_000))
        )
        await settle()
        assert len(core._begin_keys) == 201
        retried: list[tuple[str, str]] = []
        looked_up = 0
        retry, find = core._retry_begins, core.table.find_handoff

        def counting_retry(key: tuple[str, str], *args: object) -> None:
            retried.append(key)
            retry(key, *args)  # type: ignore[arg-type]

        def counting_find(*args: str) -> object:
            nonlocal looked_up
            looked_up += 1
            return find(*args)

        monkeypatch.setattr(core, "_retry_begins", counting_retry)
        monkeypatch.setattr(core.table, "find_handoff", counting_find)
        for _ in range(5):
            core.tick(rig.clock.monotonic_ms())
        assert retried == [] and looked_up == 0  # was: 201 look-ups a tick
        other = rig.register("unrelated")
        rig.coordinator.close_session(other, "closed")
        await settle()
        assert retried == []  # was: every waiting begin's key looked at
        # The handoff fails (its publish timeout): its own begin is told at once.
        await rig.advance(61_000, *live, step_ms=1_000)
        assert retried == [(PREFILLS[0], "late")]
        with pytest.raises(KvrcError) as failed:
            await doomed
        assert failed.value.code is ErrorCode.FAILED_PRECONDITION
        for w in waits:
            w.cancel()
        await settle()


async def test_the_payload_gauge_follows_what_the_lease_table_keeps() -> None:
    async with manual_coordinator() as rig:
        flow = rig.coordinator.leases
        registry = rig.coordinator.metrics.registry
        rig.register("dec")
        rig.register("pre")
        assert registry.get_sample_value("kvrc_lease_payload_bytes") == 0
        flow.publish_handoff(
            PublishHandoffRequest("h", "pre", (0, 0, 0), b"d" * 100, b"p", "dec", 4)
        )
        kept = flow.table.payload_bytes
        assert kept == 101  # the descriptor and the parameters
        assert registry.get_sample_value("kvrc_lease_payload_bytes") == kept
