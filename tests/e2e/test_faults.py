"""Fault injection (issue 9, item 4): real processes on loopback, real signals.

kill -9 of a holder (prefix-load holder / handoff prefill), of a requester
(prefix-load requester / handoff decode) and of kvrc itself, at each step of
both flows (pinning or waiting-ready, granted, reporting); a stall of an
engine (SIGSTOP/SIGCONT); an engine that stops reading its session stream.

After each fault the checks are the same:
- no pin released before quiescence: every ReleaseRequest a holder received is
  stamped (tests/fault_engine.py prints `t`) and is no earlier than the event
  that proved the lease quiet (the target's last report, the target's proven
  death = kill + session grace, or the operator's resolution);
- no lease left open after its deadline plus grace: the lease is terminal, or
  QUARANTINED (accounted for, fail closed) where nothing proves it quiet;
- inventory consistent with the engines': a dead holder's blocks are gone, a
  live holder's are all there.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fault_engine import GRACE_MS, FaultEngine, fault_coordinator
from harness import (
    CoordinatorProcess,
    find_lease,
    free_port,
    get_status,
    metric_value,
    resolve_quarantine,
)
from waiting import wait_until

from coordinator.core.recovery import decode_state
from kvrc.v1 import kvrc_pb2 as pb

GRACE_S = GRACE_MS / 1000  # fault_coordinator's --session-grace-ms
FLAGS = ("--abort-timeout-ms", "1000", "--handoff-heartbeat-timeout-ms", "3000")
TTL_MS = 3000  # prefix-load transfer TTL in these tests
OPEN = (
    pb.LEASE_STATE_PINNING,
    pb.LEASE_STATE_WAITING_READY,
    pb.LEASE_STATE_READY,
    pb.LEASE_STATE_ACTIVE,
    pb.LEASE_STATE_ABORTING,
)


@contextmanager
def _coordinator(
    tmp: Path, *extra: str, listen: str = "127.0.0.1:0", check_exit: bool = True
) -> Iterator[CoordinatorProcess]:
    with fault_coordinator(tmp, *FLAGS, *extra, listen=listen, check_exit=check_exit) as kvrc:
        yield kvrc


@pytest.fixture(scope="module")
def kvrc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    """One coordinator for the engine-kill cases (each uses its own engine ids)."""
    with _coordinator(tmp_path_factory.mktemp("faults")) as coordinator:
        yield coordinator


def _spawn(target: str, specs: list[tuple[str, dict[str, Any]]]) -> list[FaultEngine]:
    """Starts the engine processes in parallel (each start costs about a second)."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(FaultEngine, target, eid, **opts) for eid, opts in specs]
        return [f.result() for f in futures]


def _stop_all(engines: list[FaultEngine]) -> None:
    for engine in engines:
        engine.stop()


async def _status(target: str) -> Any:
    return await get_status(target)


async def _settled(target: str, lease_id: str, timeout_s: float) -> Any | None:
    """Waits until the lease is no longer in flight: None (ended) or its QUARANTINED status."""
    seen: list[Any] = []

    async def settled() -> bool:
        seen[:] = [find_lease(await _status(target), lease_id)]
        return seen[0] is None or seen[0].state not in OPEN

    await wait_until(settled, timeout_s, interval_s=0.05, what=f"lease {lease_id} settled")
    return seen[0]


async def _wait_hit(requester: FaultEngine, holder: str, n: int) -> None:
    async def visible() -> bool:
        got = await asyncio.to_thread(requester.command, "lookup", n=n)
        return bool(got.get("candidates") == [[holder, n]])

    await wait_until(visible, 10, interval_s=0.05, what=f"holder {holder} visible")


def _releases_not_before(holder: FaultEngine, lease_id: str, proof_t: float) -> None:
    for release in holder.events("release", lease_id):
        assert release["t"] >= proof_t - 0.005, (
            f"release of {lease_id} at {release['t']:.3f} before its proof at {proof_t:.3f}"
        )


async def _inventory_of(target: str, child_engine_id: str) -> int | None:
    status = await _status(target)
    for child in status.child_engines:
        if child.state.child_engine_id == child_engine_id:
            return int(child.inventory_entries)
    return None


# --- kill -9 of an engine at each step of the prefix-load flow ---------------------------


@dataclass(frozen=True)
class Case:
    step: str
    victim: str


PREFIX_CASES = [
    Case(s, v) for s in ("pinning", "granted", "reporting") for v in ("holder", "requester")
]


@pytest.mark.parametrize("case", PREFIX_CASES, ids=lambda c: f"{c.step}-kill-{c.victim}")
async def test_prefix_load_survives_engine_kill(kvrc: CoordinatorProcess, case: Case) -> None:
    target = kvrc.grpc_target
    tag = f"pl-{case.step}-{case.victim}"
    holder_id, req_id = f"{tag}-h", f"{tag}-r"
    reporting = case.step == "reporting"
    pin = "delay:1200" if case.step == "pinning" else "all"
    # Holder and requester share a layout (same tp size): else they never exchange KV.
    parts = 2 if reporting else 1
    specs: list[tuple[str, dict[str, Any]]] = [
        (holder_id, {"retain": 8, "reuse_opt_in": True, "pin": pin, "tp_rank": r, "tp_size": parts})
        for r in range(parts)
    ]
    specs += [
        (req_id, {"reuse_opt_in": True, "tp_rank": r, "tp_size": parts}) for r in range(parts)
    ]
    engines = await asyncio.to_thread(_spawn, target, specs)
    holders, requesters = engines[:parts], engines[parts:]
    holder = holders[0]
    try:
        await _wait_hit(requesters[0], holder_id, 8)
        load = requesters[0].start_command(
            "request_load", n=8, pin_timeout_ms=3000, transfer_timeout_ms=TTL_MS
        )
        if case.step == "pinning":
            lease_id = (await asyncio.to_thread(holder.event, "pin_request"))["lease_id"]
        else:
            grant = await asyncio.to_thread(requesters[0].result, load)
            assert grant["granted"], grant
            lease_id = grant["lease_id"]
        proof_t = float("inf")  # when the lease became provably quiet (None yet)
        if reporting:
            done = await asyncio.to_thread(
                requesters[0].command, "complete_load", lease_id=lease_id, outcome="SUCCEEDED"
            )
            assert done["state"] == "ACTIVE"  # the other part has not reported
        if case.victim == "holder":
            for h in holders:
                h.kill()
        elif reporting:
            requesters[1].kill()  # one target part dies; the other is alive: not proven gone
        else:
            proof_t = requesters[0].kill() + GRACE_S  # the target is proven gone after grace

        lease = await _settled(target, lease_id, timeout_s=TTL_MS / 1000 + 4)
        if case.victim == "holder":
            # The holder's pins died with it; a living target is told to stop reading.
            assert lease is None
            assert all(h.events("release") == [] for h in holders)
            if case.step == "pinning":
                miss = await asyncio.to_thread(requesters[0].result, load)
                assert miss["granted"] is False and miss["reason"] == "holder_gone"
            else:
                survivor = requesters[-1]
                await asyncio.to_thread(survivor.event, "abort", lease_id)
            assert await _inventory_of(target, holder_id) is None  # its inventory went with it
            assert (await asyncio.to_thread(requesters[0].command, "lookup", n=8))[
                "candidates"
            ] == []
        elif reporting:
            # One target part is dead but not proven gone, its abort is never acknowledged:
            # fail closed, the holder keeps its pins.
            assert lease is not None and lease.state == pb.LEASE_STATE_QUARANTINED
            for h in holders:
                await asyncio.to_thread(h.event, "quarantine", lease_id)
                assert h.events("release", lease_id) == []
            assert await _inventory_of(target, holder_id) == 8
        else:
            assert lease is None
            release = await asyncio.to_thread(holder.event, "release", lease_id)
            _releases_not_before(holder, lease_id, proof_t)
            assert release["t"] >= proof_t - 0.005
            assert await _inventory_of(target, holder_id) == 8
    finally:
        await asyncio.to_thread(_stop_all, engines)


# --- kill -9 of an engine at each step of the decode handoff ----------------------------

HANDOFF_CASES = [
    Case(s, v) for s in ("waiting_ready", "granted", "reporting") for v in ("prefill", "decode")
]


@pytest.mark.parametrize("case", HANDOFF_CASES, ids=lambda c: f"{c.step}-kill-{c.victim}")
async def test_handoff_survives_engine_kill(kvrc: CoordinatorProcess, case: Case) -> None:
    target = kvrc.grpc_target
    tag = f"ho-{case.step}-{case.victim}"
    pre_id, dec_id = f"{tag}-p", f"{tag}-d"
    pre_parts = 2 if case.step == "waiting_ready" else 1
    dec_parts = 2 if case.step == "reporting" else 1
    specs: list[tuple[str, dict[str, Any]]] = [
        (pre_id, {"tp_rank": r, "tp_size": pre_parts}) for r in range(pre_parts)
    ]
    specs += [(dec_id, {"tp_rank": r, "tp_size": dec_parts}) for r in range(dec_parts)]
    engines = await asyncio.to_thread(_spawn, target, specs)
    prefills, decodes = engines[:pre_parts], engines[pre_parts:]
    try:
        published = await asyncio.to_thread(
            prefills[0].command, "publish", request_id="q1", num_blocks=4, decode=dec_id
        )
        assert published["ok"], published
        proof_t = float("inf")
        if case.step == "waiting_ready":
            assert published["state"] == "WAITING_READY"
            lease_id = _only_lease(await _status(target), pre_id)
        else:
            grant = await asyncio.to_thread(
                decodes[0].command, "begin", request_id="q1", prefill=pre_id, wait_ms=2000
            )
            assert grant["ok"], grant
            lease_id = grant["lease_id"]
        if case.step == "reporting":
            done = await asyncio.to_thread(
                decodes[0].command, "complete_handoff", lease_id=lease_id, outcome="SUCCEEDED"
            )
            assert done["state"] == "ACTIVE"
        if case.victim == "prefill":
            for p in prefills:
                p.kill()
        elif case.step == "reporting":
            decodes[1].kill()
        else:
            proof_t = decodes[0].kill() + GRACE_S

        lease = await _settled(target, lease_id, timeout_s=3 + 1 + 4)
        if case.victim == "prefill":
            assert lease is None
            assert all(p.events("release") == [] for p in prefills)
            if case.step != "waiting_ready":
                await asyncio.to_thread(decodes[-1].event, "abort", lease_id)
        elif case.step == "reporting":
            assert lease is not None and lease.state == pb.LEASE_STATE_QUARANTINED
            await asyncio.to_thread(prefills[0].event, "quarantine", lease_id)
            assert prefills[0].events("release", lease_id) == []
        else:
            assert lease is None
            await asyncio.to_thread(prefills[0].event, "release", lease_id)
            _releases_not_before(prefills[0], lease_id, proof_t)
            if case.step == "waiting_ready":
                assert prefills[1].events("release", lease_id) == []  # it never published
    finally:
        await asyncio.to_thread(_stop_all, engines)


def _only_lease(status: Any, source: str) -> str:
    ids = [x.lease_id for x in status.leases if x.source_child_engine_id == source]
    assert len(ids) == 1, ids
    lease_id: str = ids[0]
    return lease_id


# --- kill -9 of kvrc itself at each step of both flows --------------------------------


async def _wait_registrations(engines: list[FaultEngine], n: int) -> None:
    await wait_until(
        lambda: all(e.registrations() >= n for e in engines), 15, what="engines re-registered"
    )


def _state_lists(state: Path, engines: list[FaultEngine]) -> bool:
    """The state file names every one of these engines (it is written just after changes)."""
    if not state.exists():
        return False
    known = {e.child_engine_id for e in decode_state(state.read_bytes())}
    return known >= {e.child_engine_id for e in engines}


KVRC_CASES = [
    ("prefix_load", "pinning"),
    ("prefix_load", "granted"),
    ("prefix_load", "reporting"),
    ("handoff", "waiting_ready"),
    ("handoff", "granted"),
    ("handoff", "reporting"),
]


@pytest.mark.parametrize(("flow", "step"), KVRC_CASES, ids=[f"{f}-{s}" for f, s in KVRC_CASES])
async def test_kvrc_kill_at_each_step(tmp_path: Path, flow: str, step: str) -> None:
    port, state = free_port(), tmp_path / "state.json"
    listen = f"127.0.0.1:{port}"
    extra = ("--state-file", str(state), "--warmup-ms", "3000")
    with ExitStack() as stack:
        first = stack.enter_context(_coordinator(tmp_path, *extra, listen=listen, check_exit=False))
        target = first.grpc_target
        two = step == "reporting"
        if flow == "prefix_load":
            pin = "delay:1200" if step == "pinning" else "all"
            specs: list[tuple[str, dict[str, Any]]] = [
                (
                    "h",
                    {
                        "retain": 8,
                        "reuse_opt_in": True,
                        "pin": pin,
                        "tp_rank": i,
                        "tp_size": 2 if two else 1,
                    },
                )
                for i in range(2 if two else 1)
            ]
            specs += [
                ("r", {"reuse_opt_in": True, "tp_rank": i, "tp_size": 2 if two else 1})
                for i in range(2 if two else 1)
            ]
        else:
            n_pre = 2 if step == "waiting_ready" else 1
            specs = [("p", {"tp_rank": i, "tp_size": n_pre}) for i in range(n_pre)]
            specs += [
                ("d", {"tp_rank": i, "tp_size": 2 if two else 1}) for i in range(2 if two else 1)
            ]
        engines = await asyncio.to_thread(_spawn, target, specs)
        stack.callback(_stop_all, engines)
        n_src = 2 if (two and flow == "prefix_load") or step == "waiting_ready" else 1
        holder, targets = engines[0], engines[n_src:]
        lease_id = ""
        if flow == "prefix_load":
            await _wait_hit(targets[0], "h", 8)
            load = targets[0].start_command("request_load", n=8, transfer_timeout_ms=30_000)
            if step == "pinning":
                lease_id = (await asyncio.to_thread(holder.event, "pin_request"))["lease_id"]
            else:
                lease_id = (await asyncio.to_thread(targets[0].result, load))["lease_id"]
            report_op = "complete_load"
        else:
            await asyncio.to_thread(
                holder.command, "publish", request_id="q", num_blocks=2, decode="d"
            )
            if step != "waiting_ready":
                grant = await asyncio.to_thread(
                    targets[0].command, "begin", request_id="q", prefill="p", wait_ms=2000
                )
                lease_id = grant["lease_id"]
                # The prefill learns the lease id (as clients/refengine binds it) and holds.
                await asyncio.to_thread(holder.command, "track_held", lease_id=lease_id)
            report_op = "complete_handoff"
        if two:
            done = await asyncio.to_thread(
                targets[0].command, report_op, lease_id=lease_id, outcome="SUCCEEDED"
            )
            assert done["state"] == "ACTIVE"
        await wait_until(lambda: _state_lists(state, engines), 5, what="the state file")

        first.stop(signal.SIGKILL)
        second = stack.enter_context(
            _coordinator(tmp_path, *extra, listen=listen, check_exit=False)
        )
        await _wait_registrations(engines, 2)
        status = await _status(second.grpc_target)

        if flow == "handoff" and step == "waiting_ready":
            # The prefill never learned a lease id: nothing to re-announce, nothing released;
            # the prefill parts publish again to the new coordinator.
            assert status.leases == []
            for p in engines[:2]:
                again = await asyncio.to_thread(
                    p.command, "publish", request_id="q", num_blocks=2, decode="d"
                )
                assert again["ok"], again
            assert again["state"] == "READY"
            assert all(p.events("release") == [] for p in engines[:2])
            return

        await asyncio.to_thread(holder.event, "quarantine", lease_id)
        lease = find_lease(await _status(second.grpc_target), lease_id)
        assert lease is not None and lease.state == pb.LEASE_STATE_QUARANTINED
        assert holder.events("release", lease_id) == []
        if step == "granted":
            # The target finishes and reports to the new coordinator: quiet, released.
            report_t = time.time()
            done = await asyncio.to_thread(
                targets[0].command, report_op, lease_id=lease_id, outcome="SUCCEEDED"
            )
            assert done["ok"] and done["state"] == "COMPLETED", done
            await asyncio.to_thread(holder.event, "release", lease_id)
            _releases_not_before(holder, lease_id, report_t)
        elif step == "reporting":
            # The part that reported to the dead coordinator sent its report again after
            # re-registering (LeaseClient.replay_recent_reports): alone it proves only its
            # own reads quiet, so the lease waits; the other part's report completes it.
            async def replayed() -> bool:  # its first report names the recovered lease's target
                lease = find_lease(await _status(second.grpc_target), lease_id)
                return lease is not None and lease.target_child_engine_id != ""

            await wait_until(replayed, 15, what="the replayed report of the part that reported")
            await asyncio.sleep(0.5)  # kept: no release may come with half the proof
            lease = find_lease(await _status(second.grpc_target), lease_id)
            assert lease is not None and lease.state == pb.LEASE_STATE_QUARANTINED
            assert holder.events("release", lease_id) == []
            report_t = time.time()
            done = await asyncio.to_thread(
                targets[1].command, report_op, lease_id=lease_id, outcome="SUCCEEDED"
            )
            assert done["ok"] and done["state"] == "COMPLETED", done
            await asyncio.to_thread(holder.event, "release", lease_id)
            _releases_not_before(holder, lease_id, report_t)
        else:
            # Kept sleep: 0.5 s in which a (wrong) release would arrive.
            await asyncio.sleep(0.5)
            lease = find_lease(await _status(second.grpc_target), lease_id)
            assert lease is not None and lease.state == pb.LEASE_STATE_QUARANTINED
            assert holder.events("release", lease_id) == []
            resolved_t = time.time()
            assert await resolve_quarantine(second.grpc_target, lease_id) == pb.LEASE_STATE_RESOLVED
            await asyncio.to_thread(holder.event, "release", lease_id)
            _releases_not_before(holder, lease_id, resolved_t)
        if flow == "prefix_load":
            assert await _inventory_of(second.grpc_target, "h") == 8  # the dump came back


# --- a stalled engine (SIGSTOP / SIGCONT) --------------------------------------------------


@asynccontextmanager
async def _granted_load_of_4(
    target: str, name: str
) -> AsyncIterator[tuple[FaultEngine, FaultEngine, str]]:
    """Holder `{name}-h` retaining 4 blocks, requester `{name}-r` and its granted load of them.

    Both processes are stopped on exit.
    """
    holder, requester = await asyncio.to_thread(
        _spawn,
        target,
        [(f"{name}-h", {"retain": 4, "reuse_opt_in": True}), (f"{name}-r", {"reuse_opt_in": True})],
    )
    try:
        await _wait_hit(requester, f"{name}-h", 4)
        grant = await asyncio.to_thread(
            requester.command, "request_load", n=4, transfer_timeout_ms=TTL_MS
        )
        yield holder, requester, grant["lease_id"]
    finally:
        await asyncio.to_thread(_stop_all, [holder, requester])


async def test_short_stall_keeps_the_session_and_delays_the_release(
    kvrc: CoordinatorProcess,
) -> None:
    target = kvrc.grpc_target
    async with _granted_load_of_4(target, "stall") as (holder, requester, lease_id):
        holder.signal(signal.SIGSTOP)  # shorter than the 1 s heartbeat timeout
        report_t = time.time()
        done = await asyncio.to_thread(
            requester.command, "complete_load", lease_id=lease_id, outcome="SUCCEEDED"
        )
        assert done["state"] == "COMPLETED"
        await asyncio.sleep(0.5)  # kept: the stall itself (0.5 s, under the heartbeat timeout)
        holder.signal(signal.SIGCONT)
        release = await asyncio.to_thread(holder.event, "release", lease_id)
        assert release["t"] >= report_t + 0.4  # delivered after the stall, not lost
        assert holder.registrations() == 1  # the session survived
        assert await _inventory_of(target, "stall-h") == 4


async def test_long_stall_removes_the_holder_and_it_comes_back_consistent(
    kvrc: CoordinatorProcess,
) -> None:
    target = kvrc.grpc_target
    async with _granted_load_of_4(target, "lstall") as (holder, requester, lease_id):
        holder.signal(signal.SIGSTOP)  # past the heartbeat timeout and the grace
        await asyncio.to_thread(requester.event, "abort", lease_id)  # told to stop reading
        assert await _inventory_of(target, "lstall-h") is None  # its inventory went with it
        assert find_lease(await _status(target), lease_id) is None  # accounted: ended
        holder.signal(signal.SIGCONT)
        await _wait_registrations([holder], 2)
        again = holder.events("registered")[1]
        assert again["held"] == [lease_id]  # still pinned: it says so
        await _wait_hit(requester, "lstall-h", 4)  # the dump rebuilt its inventory
        # "Gone" was a stall: the requester's abort ack proved its reads quiet, so the
        # release was decided, and the holder gets it on re-announcing the lease.
        release = await asyncio.to_thread(holder.event, "release", lease_id)
        assert "holder engine gone" in release["reason"]
        assert len(holder.events("release", lease_id)) == 1


# --- an engine that stops reading its session stream --------------------------------------


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_a_consumer_that_stops_reading_is_disconnected_with_bounded_memory(
    tmp_path: Path,
) -> None:
    # check_exit off: see the end of this test for what the coordinator's stderr may hold.
    with _coordinator(tmp_path, "--session-queue-size", "32", check_exit=False) as coordinator:
        target = coordinator.grpc_target
        # The holder's pin callback never returns: its session reader stops reading, while
        # its heartbeats (another task) keep it registered.
        holder, requester = await asyncio.to_thread(
            _spawn,
            target,
            [
                ("slow-h", {"retain": 8, "reuse_opt_in": True, "pin": "delay:600000"}),
                ("slow-r", {"reuse_opt_in": True}),
            ],
        )
        try:
            await _wait_hit(requester, "slow-h", 8)
            rss_before = _rss_mb(coordinator.process.pid)
            closed: Callable[[], float] = lambda: metric_value(  # noqa: E731
                coordinator, "kvrc_sessions_closed_total", reason="error"
            )
            assert closed() == 0

            def holder_closed() -> bool:
                # The holder's own session: on a loaded host the requester's can overflow
                # its queue of 32 too, which alone says nothing about the holder.
                return "rank part removed (error): slow-h " in coordinator.stderr_text()

            # First the holder's handler takes a PinRequest and never returns: from then on
            # it reads nothing. (Without this, a flood that overflowed the queue before any
            # PinRequest reached the handler ended a session the holder had read all of, and
            # the reconnecting holder registered again with its inventory: a flaky test.)
            first = await asyncio.to_thread(
                requester.command, "flood_loads", count=1, n=8, pin_timeout_ms=300
            )
            assert first["ok"], first
            await asyncio.to_thread(
                holder.wait_for, lambda d: d.get("event") == "pin_request", 15.0
            )
            # Each PinRequest names 2,000 blocks (about 40 KB): the stream's flow-control
            # window and socket buffers fill, then the bounded session queue does.
            for _ in range(6):
                flood = await asyncio.to_thread(
                    requester.command,
                    "flood_loads",
                    count=150,
                    n=2000,
                    pin_timeout_ms=300,
                    timeout_s=60,
                )
                assert flood["ok"], flood
                if holder_closed():
                    break
            assert holder_closed(), "the non-reading session was never disconnected"
            assert closed() >= 1
            assert await _inventory_of(target, "slow-h") is None  # removed, with its inventory
            assert holder.registrations() == 1  # its handler is stuck: it never came back
            rss_after = _rss_mb(coordinator.process.pid)
            assert rss_after - rss_before < 80, (rss_before, rss_after)
            # Everything the flood opened is accounted for.
            status = await _status(target)
            assert [x for x in status.leases if x.state in OPEN] == []
            # The coordinator still serves everyone else.
            other = await asyncio.to_thread(requester.command, "lookup", n=8)
            assert other["ok"] and other["candidates"] == []
        finally:
            await asyncio.to_thread(_stop_all, [holder, requester])
    assert coordinator.process.returncode == 0
    # grpc logs the failed write of the stream it could not finish (the engine never read
    # it) when that engine finally goes; any other traceback is a bug.
    blocks = coordinator.stderr_text().split("Traceback (most recent call last):")[1:]
    for block in blocks:
        exception_line = next(x for x in block.splitlines()[1:] if not x.startswith(" "))
        assert "ExecuteBatchError" in exception_line, block
