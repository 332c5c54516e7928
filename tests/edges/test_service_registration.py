"""Registration and readiness through the real service (I3-identity, I5-complete-parts).

A real `kvrc serve` subprocess on loopback; rank parts are real processes
(tests/engine_part.py) or real in-process `EngineSession`s over gRPC.
"""

from __future__ import annotations

import dataclasses
import json
import signal
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from harness import (
    CoordinatorProcess,
    child_engine_status,
    free_port,
    run_cli,
    start_coordinator,
    start_engine_part,
    wait_until,
    without_heartbeat_times,
)

from clients.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    KvrcClientError,
)
from clients.session import EngineProfile, EngineSession, RankPartRegistration
from kvrc.vocabulary import TransferEndpoint

# Short enough for the frozen-part test to wait it out, long enough that a part process
# stalled on a loaded CI host keeps its session: at 1 s a fresh-clone run once dropped
# (and re-registered) the grid test's first part before the fourth one came.
HEARTBEAT_TIMEOUT_MS = 3000

PROFILE = EngineProfile(model="test-model", block_size=16, kv_dtype="bfloat16")


@pytest.fixture(scope="module")
def shared() -> Iterator[CoordinatorProcess]:
    """One coordinator for the tests that each use their own engine ids."""
    with start_coordinator(
        "--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", str(HEARTBEAT_TIMEOUT_MS)
    ) as coordinator:
        yield coordinator


def part(engine_id: str, **kw: Any) -> RankPartRegistration:
    return RankPartRegistration(engine_id=engine_id, profile=PROFILE, **kw)


async def readiness_is(target: str, child_engine_id: str, ready: bool) -> bool:
    """The child engine is registered and its readiness is `ready`."""
    status = await child_engine_status(target, child_engine_id)
    return status is not None and status.state.ready == ready


async def open_session(
    sessions: list[EngineSession], target: str, registration: RankPartRegistration
) -> EngineSession:
    session = EngineSession(target, registration, reconnect=False)
    await session.start()
    sessions.append(session)
    return session


async def test_tp2_pp2_child_engine_ready_only_after_fourth_part_process(
    shared: CoordinatorProcess,
) -> None:
    target = shared.grpc_target
    grid = [(0, 0), (0, 1), (1, 0)]
    first = None
    for tp, pp in grid:
        proc = start_engine_part(
            target, coordinator=shared, engine_id="grid", tp_rank=tp, tp_size=2, pp_rank=pp,
            pp_size=2,
        )  # fmt: skip
        assert proc.registered and not proc.first_line["ready"]
        first = first or proc
    status = await child_engine_status(target, "grid")
    assert status is not None
    assert (status.state.ready, status.state.parts_present, status.state.parts_expected) == (
        False,
        3,
        4,
    )
    assert "missing (tp=1, pp=1, pcp=0)" in status.state.not_ready_reason

    last = start_engine_part(
        target, coordinator=shared, engine_id="grid", tp_rank=1, tp_size=2, pp_rank=1, pp_size=2
    )
    assert last.first_line["ready"] and last.first_line["parts_present"] == 4
    status = await child_engine_status(target, "grid")
    assert status is not None and status.state.ready and status.state.not_ready_reason == ""
    # The earlier parts are told that their child engine became READY.
    assert first is not None
    assert first.next_line() == {
        "event": "state",
        "ready": True,
        "parts_present": 4,
        "parts_expected": 4,
    }
    for proc in shared.parts:
        proc.kill()


async def test_duplicate_rank_part_gets_already_exists(
    shared: CoordinatorProcess, sessions: list[EngineSession]
) -> None:
    target = shared.grpc_target
    await open_session(sessions, target, part("dup", tp_size=2, tp_rank=1))
    before = await child_engine_status(target, "dup")
    with pytest.raises(AlreadyExistsError) as e:
        await open_session(sessions, target, part("dup", tp_size=2, tp_rank=1))
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert "(tp=1, pp=0, pcp=0)" in e.value.message and "'dup'" in e.value.message
    after = await child_engine_status(target, "dup")
    # The first part's heartbeats (every 200 ms) move its heartbeat time meanwhile.
    assert without_heartbeat_times(after) == without_heartbeat_times(before)


@pytest.mark.parametrize(
    ("change", "field", "old", "new"),
    [
        ({"tp_size": 4, "tp_rank": 3}, "profile.parallel.tp_size", "2", "4"),
        ({"pp_size": 2}, "profile.parallel.pp_size", "1", "2"),
        (
            {"profile": dataclasses.replace(PROFILE, kv_dtype="fp8_e4m3")},
            "profile.kv_dtype",
            "'bfloat16'",
            "'fp8_e4m3'",
        ),
        (
            {"profile": dataclasses.replace(PROFILE, block_size=32)},
            "profile.block_size",
            "16",
            "32",
        ),
        (
            {"profile": dataclasses.replace(PROFILE, native_compatibility_hash=b"nixl-abc")},
            "profile.native_compatibility_hash",
            "b''",
            "b'nixl-abc'",
        ),
    ],
)
async def test_mismatching_part_gets_failed_precondition_naming_field(
    shared: CoordinatorProcess,
    sessions: list[EngineSession],
    change: dict[str, Any],
    field: str,
    old: str,
    new: str,
) -> None:
    target = shared.grpc_target
    engine_id = f"mm-{field.rsplit('.', 1)[-1]}"
    await open_session(sessions, target, part(engine_id, tp_size=2, tp_rank=0))
    before = await child_engine_status(target, engine_id)
    bad = dataclasses.replace(part(engine_id, tp_size=2, tp_rank=1), **change)
    with pytest.raises(FailedPreconditionError) as e:
        await open_session(sessions, target, bad)
    message = e.value.message
    assert message.startswith(f"{field} mismatch for child engine {engine_id!r}")
    assert f"have {old}" in message and f"sent {new}" in message
    after = await child_engine_status(target, engine_id)
    assert without_heartbeat_times(after) == without_heartbeat_times(before)


async def test_engine_id_and_dp_rank_that_disagree_are_refused(
    shared: CoordinatorProcess, sessions: list[EngineSession]
) -> None:
    target = shared.grpc_target
    # child_engine_id not derived from engine_id and dp_rank -> INVALID_ARGUMENT.
    with pytest.raises(InvalidArgumentError) as e:
        await open_session(
            sessions, target, part("dpx", dp_size=2, dp_rank=1, child_engine_id="dpx_dp0")
        )
    assert "child_engine_id" in e.value.message
    assert "'dpx_dp0'" in e.value.message and "'dpx_dp1'" in e.value.message
    with pytest.raises(InvalidArgumentError):
        await open_session(
            sessions, target, part("dpy", dp_size=2, dp_rank=0, child_engine_id="dpy")
        )
    assert await child_engine_status(target, "dpx_dp0") is None
    assert await child_engine_status(target, "dpy") is None
    # "a_dp1" the dense engine vs DP rank 1 of engine "a": same child id, other engine_id.
    await open_session(sessions, target, part("a_dp1", tp_size=2))
    with pytest.raises(FailedPreconditionError) as e2:
        await open_session(sessions, target, part("a", dp_size=2, dp_rank=1, tp_size=2, tp_rank=1))
    assert e2.value.message.startswith("engine_id mismatch")
    assert "'a_dp1'" in e2.value.message and "'a'" in e2.value.message


async def test_dp_ranks_are_separate_child_engines(
    shared: CoordinatorProcess, sessions: list[EngineSession]
) -> None:
    target = shared.grpc_target
    s0 = await open_session(sessions, target, part("dpe", dp_size=2, dp_rank=0))
    s1 = await open_session(sessions, target, part("dpe", dp_size=2, dp_rank=1))
    assert s0.ack is not None and s0.ack.state.child_engine_id == "dpe_dp0"
    assert s1.ack is not None and s1.ack.state.child_engine_id == "dpe_dp1"
    assert s0.ack.state.ready and s1.ack.state.ready


async def test_endpoint_metadata_round_trips_byte_for_byte(
    shared: CoordinatorProcess, sessions: list[EngineSession]
) -> None:
    target = shared.grpc_target
    blob = bytes(range(256)) * 4 + b"\xff\xfe\x00not utf-8 \xc3\x28"
    extra = (("nixl", b"\x80\x81\x00"), ("empty", b""))
    endpoint = TransferEndpoint(
        backend="nixl", session_name="10.0.0.1:15002", agent_metadata=blob, extra=extra
    )
    await open_session(sessions, target, part("meta", endpoint=endpoint))
    status = await child_engine_status(target, "meta")
    assert status is not None
    got = status.parts[0].endpoint
    assert got.agent_metadata == blob
    assert dict(got.extra) == dict(extra)
    assert (got.backend, got.session_name) == ("nixl", "10.0.0.1:15002")

    # The same bytes through `kvrc status --json` (base64 there).
    import base64

    out = await run_cli("coordinator", "status", "--target", target, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    (meta,) = [c for c in doc["child_engines"] if c["child_engine_id"] == "meta"]
    endpoint_doc = meta["parts"][0]["endpoint"]
    assert base64.b64decode(endpoint_doc["agent_metadata_b64"]) == blob
    assert base64.b64decode(endpoint_doc["extra_b64"]["nixl"]) == b"\x80\x81\x00"


async def test_killed_part_process_unreadies_within_heartbeat_timeout(
    shared: CoordinatorProcess,
) -> None:
    target = shared.grpc_target
    procs = [
        start_engine_part(target, coordinator=shared, engine_id="kill", tp_rank=r, tp_size=2)
        for r in range(2)
    ]
    assert procs[1].first_line["ready"]
    procs[0].kill(signal.SIGKILL)
    await wait_until(
        lambda: readiness_is(target, "kill", False), timeout_s=HEARTBEAT_TIMEOUT_MS / 1000 + 2
    )
    status = await child_engine_status(target, "kill")
    assert status is not None and status.state.parts_present == 1
    assert "missing (tp=0, pp=0, pcp=0)" in status.state.not_ready_reason
    # The surviving part is told.
    assert procs[1].next_line() == {
        "event": "state",
        "ready": False,
        "parts_present": 1,
        "parts_expected": 2,
    }
    procs[1].kill()


async def test_frozen_part_is_removed_by_heartbeat_timeout_then_reconnects(
    shared: CoordinatorProcess,
) -> None:
    """SIGSTOP keeps the TCP stream open: only the heartbeat watchdog can notice."""
    target = shared.grpc_target
    procs = [
        start_engine_part(target, coordinator=shared, engine_id="frozen", tp_rank=r, tp_size=2)
        for r in range(2)
    ]
    frozen = procs[0]
    frozen.kill(signal.SIGSTOP)
    try:
        await wait_until(
            lambda: readiness_is(target, "frozen", False),
            timeout_s=HEARTBEAT_TIMEOUT_MS / 1000 + 2,
        )
    finally:
        frozen.kill(signal.SIGCONT)
    # Thawed, the part finds its stream closed, reconnects and registers again.
    lines = [frozen.next_line(timeout_s=15)]
    while lines[-1]["event"] != "registered":
        lines.append(frozen.next_line(timeout_s=15))
    await wait_until(lambda: readiness_is(target, "frozen", True), timeout_s=10)
    for proc in procs:
        proc.kill()


async def test_closed_stream_removes_the_part_at_once(
    shared: CoordinatorProcess, sessions: list[EngineSession]
) -> None:
    target = shared.grpc_target
    keep = await open_session(sessions, target, part("close", tp_size=2, tp_rank=0))
    leaving = EngineSession(target, part("close", tp_size=2, tp_rank=1), reconnect=False)
    await leaving.start()
    await keep.wait_ready(timeout_s=5)
    await leaving.close()
    status = await child_engine_status(target, "close")
    assert status is not None and not status.state.ready and status.state.parts_present == 1
    # The rank is free again for a new session.
    await open_session(sessions, target, part("close", tp_size=2, tp_rank=1))
    status = await child_engine_status(target, "close")
    assert status is not None and status.state.ready


async def test_session_reconnects_and_reregisters_after_coordinator_restart() -> None:
    listen = f"127.0.0.1:{free_port()}"
    with start_coordinator(listen=listen) as first:
        session = EngineSession(
            first.grpc_target, part("restart"), backoff_initial_s=0.05, backoff_max_s=0.3
        )
        ack = await session.start()
        assert ack.state.ready
    # The coordinator is gone: the session notices and keeps retrying.
    await wait_until(lambda: not session.connected, timeout_s=10)
    try:
        with start_coordinator(listen=listen) as second:
            await wait_until(lambda: session.registrations == 2, timeout_s=15)
            status = await child_engine_status(second.grpc_target, "restart")
            assert status is not None and status.state.ready
            assert session.ack is not None and session.ack.session_id != ack.session_id
            await session.wait_ready(timeout_s=5)
            await session.close()
            assert await child_engine_status(second.grpc_target, "restart") is None
    finally:
        await session.close()


async def test_unreachable_coordinator_raises_unavailable() -> None:
    session = EngineSession(f"127.0.0.1:{free_port()}", part("nobody"), register_timeout_s=5)
    with pytest.raises(KvrcClientError) as e:
        await session.start()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


# --- the async facade directly (no gRPC): bounded queues and part listeners ----------


async def test_handler_gets_state_changes_and_its_errors_do_not_end_the_session(
    shared: CoordinatorProcess, sessions: list[EngineSession]
) -> None:
    from clients.session import ChildEngineState, SessionHandler

    seen: list[tuple[bool, int]] = []

    class Flaky(SessionHandler):
        async def on_state(self, state: ChildEngineState) -> None:
            seen.append((state.ready, state.parts_present))
            raise RuntimeError("engine bug")

    target = shared.grpc_target
    first = EngineSession(target, part("hdl", tp_size=2, tp_rank=0), Flaky(), reconnect=False)
    await first.start()
    sessions.append(first)
    second = await open_session(sessions, target, part("hdl", tp_size=2, tp_rank=1))
    await first.wait_ready(timeout_s=10)
    await second.close()
    await wait_until(lambda: len(seen) == 2, timeout_s=10)
    assert seen == [(True, 2), (False, 1)]
    assert first.connected and first.state is not None and not first.state.ready
