"""`kvrc demo` as a user runs it: a real subprocess tree, its output, its cleanup.

Each run gets its own Mooncake port range; the range appears on every engine's
command line, so "no process left behind" is checked by scanning /proc for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from redis_env import start_redis
from waiting import wait_until_sync

from clients.refengine.demo import RESULT_KEYS, child_process_env

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # a whole demo cluster each


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line contains `marker` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def assert_all_gone(marker: str, timeout_s: float = 15.0) -> None:
    with contextlib.suppress(TimeoutError):
        wait_until_sync(lambda: not processes_with(marker), timeout_s, interval_s=0.1)
    assert processes_with(marker) == [], f"processes left with {marker!r} in their command line"


def demo_argv(ports: str, json_path: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "clients.cli", "demo",
        "--mooncake-ports", ports,
        "--json", str(json_path),
        *extra,
    ]  # fmt: skip


def run_demo(
    argv: list[str], cwd: Path, timeout_s: float = 200
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, env=child_process_env(), capture_output=True, text=True, timeout=timeout_s
    )


def test_demo_runs_end_to_end_with_no_mismatch_and_leaves_no_process(tmp_path: Path) -> None:
    ports = "28000-28499"
    json_path = tmp_path / "demo-result.json"
    run = run_demo(demo_argv(ports, json_path, "--conversations", "3", "--turns", "2"), tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    # Progress while it runs, then the table.
    assert sum(line.startswith("[") for line in lines) == 6
    table = {line.rsplit(None, 1)[0].strip(): line.rsplit(None, 1)[1] for line in lines[-14:-1]}
    assert "requests" in table  # the whole table, one value per row
    assert table["mismatches"] == "0", run.stdout
    assert float(table["hit ratio"]) > 0
    assert int(table["prefix blocks loaded"]) > 0
    doc = json.loads(json_path.read_text())
    assert set(RESULT_KEYS) <= set(doc)
    assert doc["requests"] == 6
    assert doc["mismatches"] == 0
    assert doc["handoffs"] == 6
    assert doc["blocks_loaded"] > 0 and doc["bytes_moved"] > 0 and doc["transfer_gbps"] > 0
    # transfer_gbps is GB/s inside the native reads: bytes over their summed durations.
    assert doc["native_reads"] >= 2 * 6  # every handoff: one read per rank part (tp 2)
    gbps = doc["bytes_moved"] / doc["read_s"] / 1e9
    assert doc["transfer_gbps"] == pytest.approx(gbps, rel=0.05, abs=1e-4)
    assert float(table["GB/s inside native reads"]) == pytest.approx(gbps, abs=2e-3)
    assert int(table["native reads"]) == doc["native_reads"]
    assert doc["read_mean_kib"] == pytest.approx(
        doc["bytes_moved"] / doc["native_reads"] / 1024, abs=0.1
    )
    assert doc["hit_ratio"] > 0
    assert_all_gone(ports, 5.0)


def test_sigint_stops_every_process_of_the_demo(tmp_path: Path) -> None:
    ports = "28500-28999"
    out = (tmp_path / "stdout").open("w")
    demo = subprocess.Popen(
        demo_argv(
            ports,
            tmp_path / "r.json",
            *("--conversations", "50", "--turns", "4", "--keep-logs", str(tmp_path / "logs")),
        ),
        cwd=tmp_path,
        env=child_process_env(),
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # Interrupt mid-workload: engines up, requests running.
        def second_request_running() -> bool:
            assert demo.poll() is None, (tmp_path / "stdout").read_text()
            return "[  2/" in (tmp_path / "stdout").read_text()

        wait_until_sync(second_request_running, 150, interval_s=0.1, what="the demo's progress")
        engines = [pid for pid in processes_with(ports) if pid != demo.pid]
        assert len(engines) == 6  # 3 engines x tp=2
        coordinator = processes_with(str(tmp_path / "logs" / "profiles.toml"))
        assert len(coordinator) == 1  # kvrc serve --profiles <logs>/profiles.toml
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=60) == 130
        assert_all_gone(ports)
        assert_all_gone(str(tmp_path / "logs"))
        assert "interrupted" in (tmp_path / "stdout").read_text()
        assert not (tmp_path / "r.json").exists()
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for pid in processes_with(ports) + processes_with(str(tmp_path / "logs")):
            os.kill(pid, signal.SIGKILL)


def test_demo_over_two_replicas_and_redis_has_no_mismatch(tmp_path: Path) -> None:
    """prefill-1 registers with the second replica: its prefix loads from decode-0 and
    its handoffs to it cross replicas (through the shared log), bytes bit for bit."""
    json_path = tmp_path / "demo-result.json"
    with start_redis() as redis_server:
        run = run_demo(
            demo_argv(
                "28500-28999",
                json_path,
                *("--conversations", "3", "--turns", "2", "--tp", "1", "--quiet"),
                *("--replicas", "2", "--store", redis_server.url),
            ),
            tmp_path,
        )
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads(json_path.read_text())
    assert doc["replicas"] == 2
    assert doc["requests"] == 6 and doc["handoffs"] == 6, doc
    assert doc["mismatches"] == 0
    assert doc["blocks_loaded"] > 0, doc
    assert doc["handoff_failures"] == 0 and doc["load_failures"] == 0, doc


def test_demo_refuses_replicas_without_a_shared_store(tmp_path: Path) -> None:
    run = run_demo(demo_argv("28500-28999", tmp_path / "x.json", "--replicas", "2"), tmp_path, 60)
    assert run.returncode == 2
    assert "needs a shared store" in run.stderr and "Traceback" not in run.stderr
