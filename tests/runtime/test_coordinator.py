"""The coordinator runtime in process, on a manual clock: sessions, listeners, warm-up.

No server and no sleeps: time moves only through `ManualClock.advance`.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from manual_rig import CHAIN

from coordinator.core.leases import Flow
from coordinator.core.profiles import ReuseReason
from coordinator.core.recovery import decode_state_file
from coordinator.runtime.clock import ManualClock
from coordinator.runtime.config import CoordinatorConfig
from coordinator.runtime.coordinator import Coordinator


def _domain_registration(tp_rank: int = 0, tp_size: int = 2) -> Any:
    from coordinator.core.profiles import DeploymentProfile
    from coordinator.core.registry import RankPartRegistration as DomainRegistration

    return DomainRegistration(
        engine_id="facade",
        dp_rank=0,
        child_engine_id="facade",
        rank=(tp_rank, 0, 0),
        profile=DeploymentProfile(model="m", block_size=16, tp_size=tp_size),
    )


async def test_session_that_does_not_read_is_closed_resource_exhausted() -> None:
    from coordinator.core.errors import ErrorCode
    from coordinator.runtime.config import CoordinatorConfig
    from coordinator.runtime.coordinator import Coordinator, RegisterReply, SessionEnd

    coordinator = Coordinator(CoordinatorConfig(session_queue_size=4), clock=ManualClock())
    session = coordinator.open_session(_domain_registration())
    for _ in range(10):  # heartbeat acks pile up: nobody reads them
        coordinator.heartbeat(session)
    assert session.ended
    end = await session.next_outbound()
    assert isinstance(end, SessionEnd) and end.code == ErrorCode.RESOURCE_EXHAUSTED
    assert "not reading" in end.message
    assert coordinator.registry.num_parts == 0
    assert (
        coordinator.metrics.registry.get_sample_value(
            "kvrc_sessions_closed_total", {"reason": "error"}
        )
        == 1.0
    )
    # A well-behaved session gets its RegisterReply first.
    other = coordinator.open_session(_domain_registration())
    assert isinstance(await other.next_outbound(), RegisterReply)
    await coordinator.shutdown()


async def test_part_listeners_hear_removal_at_once_and_gone_after_grace() -> None:
    from coordinator.core.events import RankKey
    from coordinator.runtime.config import CoordinatorConfig
    from coordinator.runtime.coordinator import Coordinator

    heard: list[tuple[str, str, RankKey, str]] = []

    class Listener:
        def on_part_removed(self, child_engine_id: str, rank: RankKey, reason: str) -> None:
            heard.append(("removed", child_engine_id, rank, reason))

        def on_part_gone(self, child_engine_id: str, rank: RankKey, session_id: str) -> None:
            heard.append(("gone", child_engine_id, rank, session_id))

    clock = ManualClock()
    coordinator = Coordinator(CoordinatorConfig(session_grace_ms=100), clock=clock)
    coordinator.add_part_listener(Listener())
    first = coordinator.open_session(_domain_registration(0))
    back = coordinator.open_session(_domain_registration(1))
    coordinator.close_session(first, "closed")
    coordinator.close_session(back, "closed")
    assert heard == [
        ("removed", "facade", (0, 0, 0), "closed"),
        ("removed", "facade", (1, 0, 0), "closed"),
    ]
    coordinator.open_session(_domain_registration(1))  # rank 1 returns within the grace
    clock.advance(99)
    assert len(heard) == 2  # both still inside the grace
    # Rank 0's grace ends; rank 1's, had its return not cancelled it, was due at the same time.
    clock.advance(1)
    assert heard[2:] == [("gone", "facade", (0, 0, 0), first.session_id)]
    await coordinator.shutdown()


async def test_facade_ranks_fewer_leases_first_and_best_holder() -> None:
    from coordinator.core.events import BlockStored, EventBatch
    from coordinator.core.profiles import DeploymentProfile, declared_profile
    from coordinator.core.registry import RankPartRegistration as CoreRegistration
    from coordinator.runtime.config import CoordinatorConfig
    from coordinator.runtime.coordinator import Coordinator

    config = CoordinatorConfig(
        reuse=True,
        declared_profiles=(declared_profile("t", {"model": "m"}),),
        metrics_port=-1,
    )
    coordinator = Coordinator(config, clock=ManualClock())
    await coordinator.start()
    try:
        profile = DeploymentProfile(model="m", block_size=16, reuse_opt_in=True)
        sessions = {
            cid: coordinator.open_session(CoreRegistration(cid, 0, cid, (0, 0, 0), profile))
            for cid in ("req", "busy", "idle")
        }
        facade = coordinator.inventory
        for cid in ("busy", "idle"):
            s = sessions[cid]
            facade.ingest(
                cid,
                (0, 0, 0),
                s.session_id,
                s.incarnation,
                EventBatch(s.incarnation, 0, (BlockStored(CHAIN[:4], None, 64),)),
            )
        leases = {"busy": 3}
        best, result = facade.best_holder("req", CHAIN, leases_in_flight=leases)
        assert best is not None and best.child_engine_id == "idle"
        assert [(c.child_engine_id, c.leases_in_flight) for c in result.candidates] == [
            ("idle", 0),
            ("busy", 3),
        ]
        facade.set_lease_side(lambda: {"idle": 5}, lambda h, c: True, lambda c: False)
        best, _ = facade.best_holder("req", CHAIN)
        assert best is not None and best.child_engine_id == "busy"
        # Below the recompute threshold: no holder.
        best, result = facade.best_holder("req", CHAIN, min_blocks=5)
        assert best is None and result.best_matched_blocks == 4
    finally:
        await coordinator.shutdown()


async def test_warm_up_without_a_state_file_lasts_exactly_the_given_time() -> None:
    clock = ManualClock()
    coordinator = Coordinator(
        CoordinatorConfig(metrics_port=-1, reuse=True, warmup_ms=500), clock=clock
    )
    assert coordinator.status().warming
    assert coordinator.metrics.registry.get_sample_value("kvrc_warming") == 1
    gate = coordinator.inventory.reuse_gate("anyone")
    assert not gate.enabled and gate.reason is ReuseReason.WARMING
    clock.advance(499)
    assert coordinator.status().warming
    clock.advance(1)
    assert not coordinator.status().warming
    assert coordinator.metrics.registry.get_sample_value("kvrc_warming") == 0
    assert coordinator.inventory.reuse_gate("anyone").reason is not ReuseReason.WARMING


def test_the_lease_id_key_is_kept_in_a_private_state_file_and_read_back(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    leftover = tmp_path / "state.json.tmp"  # an older kvrc's, world-readable
    leftover.write_bytes(b"")
    leftover.chmod(0o644)
    first = Coordinator(CoordinatorConfig(metrics_port=-1, state_file=state), clock=ManualClock())
    first.clock.advance(1_000)  # type: ignore[attr-defined]  # the write runs ~0.2 s later
    key = decode_state_file(state.read_bytes()).lease_id_key
    assert key is not None and stat.S_IMODE(state.stat().st_mode) == 0o600
    again = Coordinator(CoordinatorConfig(metrics_port=-1, state_file=state), clock=ManualClock())
    assert again._lease_id_key == key  # the same key after a restart: old ids still check


def test_an_unreadable_state_file_is_not_replaced_before_an_engine_changes(
    tmp_path: Path,
) -> None:
    # Replaced at once by a file that listed no engines, it would let a second restart
    # skip the fail-safe warm-up (the engines the unreadable file named are unknown).
    state = tmp_path / "state.json"
    state.write_bytes(b"not json")
    config = CoordinatorConfig(metrics_port=-1, state_file=state, warmup_ms=10_000)
    first = Coordinator(config, clock=ManualClock())
    assert first.warmup.warming
    first.clock.advance(1_000)  # type: ignore[attr-defined]
    assert state.read_bytes() == b"not json"
    assert Coordinator(config, clock=ManualClock()).warmup.warming


def test_reuse_off_says_so_even_while_warming() -> None:
    coordinator = Coordinator(
        CoordinatorConfig(metrics_port=-1, reuse=False, warmup_ms=5_000), clock=ManualClock()
    )
    assert coordinator.status().warming
    gate = coordinator.inventory.reuse_gate("anyone")
    assert gate.reason is ReuseReason.DISABLED_BY_COORDINATOR  # I1-reuse-off first


class _Calls:
    """Counts calls of the registry's O(grid) reads (parts lists and views)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.count = 0
        registry = coordinator.registry
        for name in ("parts_of", "get", "_view"):
            original = getattr(registry, name)

            def counted(*args: Any, _original: Any = original) -> Any:
                self.count += 1
                return _original(*args)

            setattr(registry, name, counted)


async def test_send_to_part_and_proven_gone_do_no_work_per_part_of_the_grid() -> None:
    from coordinator.core.leases import SendRelease
    from coordinator.runtime.coordinator import RegisterReply

    grid = 64
    clock = ManualClock()
    coordinator = Coordinator(CoordinatorConfig(session_grace_ms=100), clock=clock)
    sessions = [coordinator.open_session(_domain_registration(r, grid)) for r in range(grid)]
    for session in sessions:
        assert isinstance(await session.next_outbound(), RegisterReply)
    calls = _Calls(coordinator)
    for rank, session in enumerate(sessions):
        release = SendRelease("facade", (rank, 0, 0), "L1", Flow.PREFIX_LOAD, "done")
        assert coordinator.send_to_part("facade", (rank, 0, 0), release)
        while (out := await session.next_outbound()) is not release:
            assert not isinstance(out, SendRelease)  # readiness updates queued before it
    assert calls.count == 0  # one dict probe per send, no list of the 64 parts
    for session in sessions:
        coordinator.close_session(session, "closed")
    calls.count = 0
    assert not coordinator.proven_gone("facade")  # 64 parts inside their grace period
    assert calls.count == 0
    clock.advance(100)  # every grace period ends: the last one proves the engine gone
    assert coordinator.proven_gone("facade")
    assert calls.count == 0
    await coordinator.shutdown()


async def test_a_register_close_loop_does_not_fill_the_log(caplog: Any) -> None:
    """A client that registers and closes in a loop (I8-bad-input): each cycle is five
    lifecycle lines (registered, READY, removed, not READY, left); after the budget's
    burst, one line a second of the manual clock, and one warning a minute says so."""
    import logging

    from coordinator.runtime.log_limit import LIFECYCLE_BURST

    clock = ManualClock()
    coordinator = Coordinator(CoordinatorConfig(session_grace_ms=0), clock=clock)
    cycles = LIFECYCLE_BURST  # five times the burst's lines
    with caplog.at_level(logging.INFO, logger="kvrc"):
        for _ in range(cycles):
            session = coordinator.open_session(_domain_registration(0, tp_size=1))
            coordinator.close_session(session, "closed")
        clock.advance(10_000)  # ten lines' worth of refill
        for _ in range(10):
            session = coordinator.open_session(_domain_registration(0, tp_size=1))
            coordinator.close_session(session, "closed")
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("kvrc")]
    over = [m for m in lines if "lifecycle lines are over their budget" in m]
    assert len(over) == 1  # the burst spent (the refill spent too: said once a minute)
    assert len(lines) == LIFECYCLE_BURST + 10 + len(over)
    assert lines[0].startswith("rank part registered: facade rank")
    assert "lifecycle line(s) left out before this one" in lines[LIFECYCLE_BURST + 1]
    assert coordinator.registry.num_parts == 0
    await coordinator.shutdown()


async def test_what_a_registration_names_shares_the_lifecycle_budget(caplog: Any) -> None:
    """A register/close loop naming a KV-event endpoint it does not use, or re-announcing
    a made-up held lease, wrote a WARNING per cycle outside the lifecycle budget (a
    review's finding); they share it now."""
    import dataclasses
    import logging

    from coordinator.core.registry import HeldLease
    from coordinator.runtime.log_limit import LIFECYCLE_BURST
    from kvrc.vocabulary import PublishMode

    clock = ManualClock()
    coordinator = Coordinator(CoordinatorConfig(session_grace_ms=0), clock=clock)
    base = dataclasses.replace(
        _domain_registration(0, tp_size=1),
        publish_mode=PublishMode.PER_RANK_PART,
        kv_events_endpoint="tcp://127.0.0.1:5557",
    )
    with caplog.at_level(logging.INFO, logger="kvrc"):
        for i in range(LIFECYCLE_BURST):
            made_up = (HeldLease(f"pl-made-up-{i}"),)
            session = coordinator.open_session(dataclasses.replace(base, held_leases=made_up))
            coordinator.close_session(session, "closed")
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("kvrc")]
    endpoint = [m for m in lines if "names a KV-event endpoint" in m]
    held = [m for m in lines if "held leases re-announced" in m]
    assert endpoint and held
    lifecycle = [m for m in lines if not m.startswith(("quarantine", "lease"))]
    assert len(lifecycle) <= LIFECYCLE_BURST + 1, len(lifecycle)  # + the "over" warning
    await coordinator.shutdown()


async def test_the_registry_gauges_show_what_its_bounds_count() -> None:
    """kvrc_rank_parts counts this replica's sessions; --max-rank-parts and
    --max-endpoint-bytes bound the registry (every replica's parts with --store), and
    these two gauges show it."""
    import dataclasses

    from kvrc.vocabulary import TransferEndpoint

    coordinator = Coordinator(CoordinatorConfig(), clock=ManualClock())
    registration = dataclasses.replace(
        _domain_registration(0), endpoint=TransferEndpoint(agent_metadata=b"m" * 1_000)
    )
    first = coordinator.open_session(registration)
    coordinator.open_session(_domain_registration(1))

    def sample(name: str) -> float | None:
        value = coordinator.metrics.registry.get_sample_value(name)
        return None if value is None else float(value)

    assert sample("kvrc_registry_rank_parts") == 2
    assert sample("kvrc_registry_endpoint_bytes") == 1_000
    coordinator.close_session(first, "closed")
    assert sample("kvrc_registry_rank_parts") == 1
    assert sample("kvrc_registry_endpoint_bytes") == 0
    await coordinator.shutdown()


async def test_an_operators_quarantine_note_is_logged_quoted(caplog: Any) -> None:
    """The note came into the log as sent: a newline in it forged a line of kvrc's own."""
    import dataclasses
    import logging

    from coordinator.core.registry import HeldLease

    coordinator = Coordinator(CoordinatorConfig(), clock=ManualClock())
    held = (HeldLease("pl-unknown-here"),)  # re-announced, unknown: rebuilt quarantined
    registration = dataclasses.replace(_domain_registration(0, tp_size=1), held_leases=held)
    coordinator.open_session(registration)
    forged = "INFO kvrc.server: kvrc serving on 0.0.0.0:1"
    with caplog.at_level(logging.WARNING, logger="kvrc"):
        coordinator.leases.resolve_quarantine("pl-unknown-here", f"checked\n{forged}")
    (line,) = [r.getMessage() for r in caplog.records if "resolved by an operator" in r.message]
    assert "\n" not in line and "\\n" + forged in line
    await coordinator.shutdown()
