"""`kvrc status` against a running coordinator: the JSON document and the table."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from harness import REPO, CoordinatorProcess, free_port, start_coordinator

from clients.session import EngineProfile, EngineSession, RankPartRegistration


def _kvrc_status(*args: str) -> subprocess.CompletedProcess[str]:
    # The installed console script when there is one, else `python -m coordinator`.
    script = shutil.which("kvrc", path=str(REPO / ".venv" / "bin"))
    argv = [script] if script else [sys.executable, "-m", "coordinator"]
    return subprocess.run(
        [*argv, "status", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
async def cluster() -> AsyncIterator[CoordinatorProcess]:
    """A coordinator with one READY child engine (tp=2) and one half-registered one."""
    with start_coordinator() as kvrc:
        profile = EngineProfile(model="m", block_size=16)
        sessions = [
            EngineSession(
                kvrc.grpc_target,
                RankPartRegistration(engine_id=engine_id, profile=profile, tp_rank=r, tp_size=2),
                reconnect=False,
            )
            for engine_id, r in (("full", 0), ("full", 1), ("half", 1))
        ]
        for session in sessions:
            await session.start()
        yield kvrc
        for session in sessions:
            await session.close()


async def test_status_json_has_the_documented_keys(cluster: CoordinatorProcess) -> None:
    out = await asyncio.to_thread(_kvrc_status, "--target", cluster.grpc_target, "--json")
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    assert doc["version"] == "0.1.0" and doc["reuse_enabled"] is False
    by_id = {c["child_engine_id"]: c for c in doc["child_engines"]}
    assert set(by_id) == {"full", "half"}
    for child in by_id.values():
        assert {
            "child_engine_id",
            "ready",
            "parts_present",
            "parts_expected",
            "not_ready_reason",
        } <= set(child)
    full, half = by_id["full"], by_id["half"]
    assert (full["ready"], full["parts_present"], full["parts_expected"]) == (True, 2, 2)
    assert full["not_ready_reason"] == ""
    assert (half["ready"], half["parts_present"], half["parts_expected"]) == (False, 1, 2)
    assert "missing (tp=0, pp=0, pcp=0)" in half["not_ready_reason"]
    assert [(p["tp_rank"], p["pp_rank"]) for p in full["parts"]] == [(0, 0), (1, 0)]
    assert full["reuse"]["reason"] == "REUSE_REASON_DISABLED_BY_COORDINATOR"


async def test_status_table_shows_readiness_and_why(cluster: CoordinatorProcess) -> None:
    out = await asyncio.to_thread(_kvrc_status, "--target", cluster.grpc_target)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "reuse off, 2 child engine(s)" in lines[0]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert rows["full"].split()[2:4] == ["yes", "2/2"]
    assert rows["half"].split()[2:4] == ["no", "1/2"]
    assert "waiting for 1 of 2 rank parts" in rows["half"]


def test_status_of_unreachable_target_is_one_line_exit_1() -> None:
    target = f"127.0.0.1:{free_port()}"
    out = _kvrc_status("--target", target, "--timeout-s", "3")
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvrc status: cannot get status from {target}")
    assert "UNAVAILABLE" in lines[0]
    assert out.stdout == ""
