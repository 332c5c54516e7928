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
from coordinator.edges.cli import _cost_lines, cost_model_document
from kvrc.v1 import kvrc_pb2 as pb


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


def test_a_links_age_shows_and_an_expired_fit_says_so() -> None:
    # The rendering alone (the live age is tested in test_service_cost): one link fresh,
    # one past the TTL, one whose age the coordinator does not know.
    def link(holder: str, age_ms: int) -> pb.LinkCost:
        return pb.LinkCost(
            holder_child_engine_id=holder,
            requester_child_engine_id="r",
            bandwidth_bytes_per_s=1e9,
            latency_ms=1.0,
            samples=3,
            age_ms=age_ms,
        )

    cost = pb.CostModelStatus(
        gate=True,
        safety_margin=1.5,
        max_pairs=8,
        links=[link("fresh", 5_000), link("old", 301_000), link("unknown", -1)],
        measurement_ttl_s=300.0,
    )
    lines = _cost_lines(cost)
    assert "a fit is re-learnt 300 s after its last sample" in lines[0]
    fresh, old, unknown = lines[1:4]
    assert "last 5 s ago" in fresh and "expired" not in fresh
    assert "last 301 s ago (expired: re-learnt from its next sample)" in old
    assert "ago" not in unknown
    doc = cost_model_document(cost)
    assert [(x["age_ms"], x["expired"]) for x in doc["links"]] == [
        (5_000, False),
        (301_000, True),
        (None, False),
    ]
    # TTL 0: fits never expire, however old.
    cost.measurement_ttl_s = 0.0
    assert "fits never expire" in _cost_lines(cost)[0]
    assert "expired" not in _cost_lines(cost)[2]
