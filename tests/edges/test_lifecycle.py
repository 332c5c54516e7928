"""`kvrc serve` lifecycle: health, reflection, metrics, graceful SIGTERM/SIGINT, config errors."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from harness import REPO, child_engine_status, get_status, start_coordinator, wait_until

from clients.errors import UnavailableError
from clients.session import EngineProfile, EngineSession, RankPartRegistration

GRACE_S = 2.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _registration(engine_id: str, reuse_opt_in: bool = False) -> RankPartRegistration:
    return RankPartRegistration(
        engine_id=engine_id,
        profile=EngineProfile(
            model="m", block_size=16, kv_dtype="bfloat16", reuse_opt_in=reuse_opt_in
        ),
    )


async def test_health_serving_then_not_serving_and_sigterm_exits_zero_within_grace() -> None:
    with start_coordinator("--shutdown-grace-s", str(GRACE_S)) as kvrc:
        async with grpc.aio.insecure_channel(kvrc.grpc_target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "kvrc.v1.EngineService", "kvrc.v1.AdminService"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == SERVING
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
            first = await watch.read()
            assert first.status == SERVING

            sent = time.monotonic()
            kvrc.process.send_signal(signal.SIGTERM)
            second = await asyncio.wait_for(watch.read(), timeout=10)
            assert second.status == NOT_SERVING
            watch.cancel()
        rc = await asyncio.to_thread(kvrc.process.wait, 30)
        took = time.monotonic() - sent
    assert rc == 0
    # The open Watch stream is an in-flight RPC: it may hold shutdown for the grace
    # period, never longer (slack for process exit on a loaded machine).
    assert took < GRACE_S + 5
    assert "Traceback" not in kvrc.stderr_text()


async def test_sigterm_with_open_session_ends_it_unavailable_and_exits_zero() -> None:
    with start_coordinator("--shutdown-grace-s", str(GRACE_S)) as kvrc:
        session = EngineSession(kvrc.grpc_target, _registration("shut"), reconnect=False)
        await session.start()
        try:
            kvrc.process.send_signal(signal.SIGTERM)
            rc = await asyncio.to_thread(kvrc.process.wait, 30)
            await wait_until(lambda: not session.connected, timeout_s=10)
            assert isinstance(session.last_error, UnavailableError)
            assert "shutting down" in session.last_error.message
        finally:
            await session.close()
    assert rc == 0
    text = kvrc.stderr_text()
    assert "Traceback" not in text and "rank part removed (shutdown)" in text


def test_sigint_exits_zero() -> None:
    with start_coordinator() as kvrc:
        assert kvrc.stop(signal.SIGINT) == 0
    assert "stopped" in kvrc.stderr_text()


async def test_reflection_lists_kvrc_and_health_services() -> None:
    with start_coordinator() as kvrc:
        async with grpc.aio.insecure_channel(kvrc.grpc_target) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo()
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            reply = await call.read()
            await call.done_writing()
            names = {s.name for s in reply.list_services_response.service}
    assert {"kvrc.v1.EngineService", "kvrc.v1.AdminService", "grpc.health.v1.Health"} <= names


async def test_metrics_endpoint_counts_rpcs_and_parts() -> None:
    with start_coordinator() as kvrc:
        session = EngineSession(kvrc.grpc_target, _registration("metrics"), reconnect=False)
        await session.start()
        await get_status(kvrc.grpc_target)
        body = await asyncio.to_thread(_fetch, kvrc.metrics_url)
        await session.close()
    assert 'kvrc_rpc_requests_total{code="OK",method="GetStatus"} 1.0' in body
    assert "kvrc_rank_parts 1.0" in body
    assert 'kvrc_child_engines{state="ready"} 1.0' in body
    assert 'kvrc_registrations_total{result="ok"} 1.0' in body
    assert 'kvrc_rpc_duration_seconds_count{method="GetStatus"} 1.0' in body


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        text: str = response.read().decode()
        return text


async def test_reuse_flag_and_declared_profiles_reach_the_register_ack(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles.toml"
    profiles.write_text('[[profile]]\nname = "m-bf16"\nmodel = "m"\nkv_dtype = "bfloat16"\n')
    with start_coordinator("--reuse", "on", "--profiles", str(profiles)) as kvrc:
        on = EngineSession(kvrc.grpc_target, _registration("opted", True), reconnect=False)
        off = EngineSession(kvrc.grpc_target, _registration("not-opted"), reconnect=False)
        ack_on, ack_off = await on.start(), await off.start()
        status = await child_engine_status(kvrc.grpc_target, "opted")
        await on.close()
        await off.close()
    assert (ack_on.reuse.enabled, ack_on.reuse.reason) == (True, "ENABLED")
    assert "m-bf16" in ack_on.reuse.detail
    assert (ack_off.reuse.enabled, ack_off.reuse.reason) == (False, "PROFILE_NOT_OPTED_IN")
    assert status is not None and status.state.reuse.enabled


async def test_reuse_is_off_by_default() -> None:
    with start_coordinator() as kvrc:
        session = EngineSession(kvrc.grpc_target, _registration("dflt", True), reconnect=False)
        ack = await session.start()
        status = await get_status(kvrc.grpc_target)
        await session.close()
    assert (ack.reuse.enabled, ack.reuse.reason) == (False, "DISABLED_BY_COORDINATOR")
    assert not status.reuse_enabled


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator", "serve", "--metrics-port", "0", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("[[profile]]\nname = 'x'\nmodle = 'y'\n", "unknown field 'modle'"),
        ("[[profile]\n", "invalid TOML"),
        (None, "cannot read"),
    ],
)
def test_config_errors_exit_nonzero_with_one_line(
    tmp_path: Path, content: str | None, needle: str
) -> None:
    path = tmp_path / "profiles.toml"
    if content is not None:
        path.write_text(content)
    out = _serve("--listen", "127.0.0.1:0", "--profiles", str(path))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvrc: error: ") and needle in lines[0]


def test_busy_port_and_bad_flags_exit_nonzero_with_one_line() -> None:
    with start_coordinator() as kvrc:
        out = _serve("--listen", kvrc.grpc_target)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"kvrc: error: --listen {kvrc.grpc_target}: cannot bind (Address already in use)"
    ]
    out = _serve("--listen", "127.0.0.1:0", "--heartbeat-timeout-ms", "10")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "heartbeat timeout" in out.stderr


async def test_shutdown_lets_tasks_still_unwinding_finish_and_does_not_wait_forever() -> None:
    """grpc.aio can return from stop() while a cancelled RPC's task is still unwinding;
    the loop's teardown would cancel it again and grpc would log a traceback (a fresh CI
    host once caught a health Watch so). kvrc's exit waits for such tasks, bounded."""
    from coordinator.edges.server import _let_stragglers_finish

    steps: list[int] = []

    async def unwinding() -> None:
        for step in range(5):
            await asyncio.sleep(0)
            steps.append(step)

    task = asyncio.create_task(unwinding())
    await _let_stragglers_finish(30.0)
    assert task.done() and steps == [0, 1, 2, 3, 4]
    # A task that never ends is left to the loop's teardown: the wait is bounded.
    forever = asyncio.create_task(asyncio.Event().wait())
    await _let_stragglers_finish(0.05)
    assert not forever.done()
    forever.cancel()


def test_serve_lifts_its_open_files_soft_limit_to_the_hard_one() -> None:
    """Sessions, KV-event subscriptions and store connections each hold descriptors; a
    soft limit of 1,024 (a common default) ran a real kvrc out of them first."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 512
    assert hard == resource.RLIM_INFINITY or hard > low, "this host's hard limit is too low"
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        # More subscriptions allowed than even the hard limit has descriptors for: said.
        with start_coordinator("--max-kv-event-streams", "10000000") as kvrc:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))  # this process's back
            limits = Path(f"/proc/{kvrc.process.pid}/limits").read_text()
            warned = "can take (about 8 per subscription" in kvrc.stderr_text()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    (line,) = [x for x in limits.splitlines() if x.startswith("Max open files")]
    expected = str(1 << 20) if hard == resource.RLIM_INFINITY else str(hard)
    assert line.split()[3] == expected, line  # Max open files SOFT HARD files
    assert warned or hard == resource.RLIM_INFINITY
