"""The soak's CI version (issue 24, item 6): 2 minutes over both stores, every bound.

`python -m benchmarks.soak --minutes 2 --check`: one minute on the memory store,
one on two replicas over a real `redis-server`, reference engines with tp=2 and
real Mooncake transfers, every fault kind of the schedule at least once. The
RSS growth bound needs a steady state and is checked by `make soak` (10 minutes)
only. The seed is printed (and is in the failure message) to replay a failure:
`python -m benchmarks.soak --minutes 2 --check --seed S`.

The early-release check itself is tested here on planted ledgers (it must flag a
release before a read went quiet, and a read still running), so a soak that
reports 0 cannot be a checker that never fires.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from benchmarks.soak import FAULT_KINDS, REDIS_ONLY, StoreRun, violations

REPO = Path(__file__).resolve().parents[2]


def test_two_minute_soak_over_both_stores_meets_every_bound(tmp_path: Path) -> None:
    seed = random.SystemRandom().randrange(1 << 31)
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--minutes", "2", "--check",
         "--seed", str(seed), "--out", str(out), "--keep-logs", str(tmp_path / "logs")],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=420,
    )  # fmt: skip
    replay = f"seed {seed}: replay with --seed {seed}\n{run.stderr[-6000:]}"
    assert run.returncode == 0, replay
    doc = json.loads(out.read_text())
    assert doc["seed"] == seed and doc["stores"] == ["memory", "redis"]
    assert doc["rss_bound_checked"] is False  # CI's short run: every bound but RSS
    for store_run in doc["runs"]:
        store = store_run["store"]
        kinds = {k for k in FAULT_KINDS if store == "redis" or k not in REDIS_ONLY}
        assert set(store_run["faults_by_kind"]) == kinds, replay
        failed = [f for f in store_run["faults"] if f["detail"].startswith("injection failed")]
        assert failed == [], replay
        assert store_run["requests"] > 0 and store_run["handoffs"] > 0, replay
        assert store_run["blocks_loaded"] > 0, replay  # prefix loads happened
        assert store_run["leases_checked_for_early_release"] > 0, replay
        assert store_run["mismatches"] == 0, replay
        assert store_run["early_releases"] == 0, replay
        assert store_run["leaked_leases_after_drain"] == 0, replay
        assert store_run["quarantined_unresolved"] == 0, replay
        assert store_run["kvrc_tracebacks"] == 0, replay
        codes = store_run["status_codes"]
        assert codes.get("OK", 0) > 0 and "INTERNAL" not in codes and "UNKNOWN" not in codes
        # The malformed calls were answered INVALID_ARGUMENT, never OK or UNKNOWN.
        probes = {k for k in store_run["client_status_codes"] if k.startswith("malformed:")}
        assert probes == {"malformed:INVALID_ARGUMENT"}, store_run["client_status_codes"]
        for process in store_run["kvrc_processes"]:
            assert process["fds_end"] is not None, process
            assert process["clients_end"] is not None, process  # the fd bound nets them out
        assert store_run["violations"] == []
    assert doc["runs"][1]["replicas"] == 2


def _planted(tmp_path: Path) -> StoreRun:
    return StoreRun("memory", 60.0, 1, tmp_path, 2)


def test_the_early_release_check_flags_a_release_before_the_read_went_quiet(
    tmp_path: Path,
) -> None:
    run = _planted(tmp_path)
    run.released_at = {"quiet-first": 10.0, "released-first": 10.0, "still-reading": 10.0}
    run.quiet_at = {
        ("prefill-0", 0, "quiet-first"): 9.5,
        ("prefill-0", 1, "quiet-first"): 9.9,
        ("decode-0", 1, "released-first"): 10.25,  # this rank's read landed after
        ("decode-0", 0, "still-reading"): None,
        ("decode-0", 0, "never-released"): 50.0,
    }
    early = {e["lease_id"]: e for e in run.early_releases()}
    assert set(early) == {"released-first", "still-reading"}
    assert early["released-first"]["released_before_quiet_ms"] == 250.0
    assert early["released-first"]["requester"] == "decode-0 tp1"
    assert early["still-reading"]["released_before_quiet_ms"] is None


def test_the_operator_resolves_only_a_quarantine_proven_quiet(tmp_path: Path) -> None:
    run = _planted(tmp_path)
    run.quiet_at = {
        ("decode-0", 0, "all-quiet"): 9.5,
        ("decode-0", 1, "all-quiet"): 9.9,
        ("decode-0", 0, "one-reading"): 9.0,
        ("decode-0", 1, "one-reading"): None,  # a read that may still land
    }
    assert run.proven_quiet("all-quiet")
    assert run.proven_quiet("never-read")  # no part ever read it
    assert not run.proven_quiet("one-reading")
    run.down.add("prefill-1")  # an engine whose ledger is not known now
    assert not run.proven_quiet("all-quiet")


def test_the_bounds_fail_on_each_kind_of_violation(tmp_path: Path) -> None:
    run = _planted(tmp_path)
    clean = run.document({"open_by_replica": {}})
    clean["requests"] = 1
    assert violations(clean, check_rss=True) == []
    process = {"name": "kvrc-0", "pid": 1, "ended": None, "fds_start": 30, "fds_end": 30,
               "rss_mb_start": 100.0, "rss_mb_end": 100.0}  # fmt: skip
    for change, expected in (
        ({"mismatches": 1}, "mismatches = 1"),
        ({"early_releases": 2}, "early_releases = 2"),
        ({"leaked_leases_after_drain": 1}, "leaked_leases_after_drain = 1"),
        ({"quarantined_unresolved": 1}, "quarantined_unresolved = 1"),
        ({"kvrc_tracebacks": 1}, "kvrc_tracebacks = 1"),
        ({"status_codes": {"UNKNOWN": 1}}, "status UNKNOWN answered"),
        ({"client_status_codes": {"INTERNAL": 1}}, "status INTERNAL answered"),
        ({"requests": 0}, "no request completed"),
        ({"kvrc_processes": [{**process, "fds_end": 47}]}, "fds 30 -> 47"),
        ({"kvrc_processes": [{**process, "rss_mb_end": 111.0}]}, "RSS 100.0 -> 111.0 MB"),
    ):
        bad = violations({**clean, **change}, check_rss=True)
        assert len(bad) == 1 and expected in bad[0], (change, bad)
    # Within the bounds, or a process that did not run to the end: no violation.
    # Engines moved in from a killed replica bring their fds (4 per client connection):
    # 24 more fds with 2 more client connections is within the bound, with 1 it is not.
    moved = {**process, "fds_end": 54, "clients_start": 2, "clients_end": 4}
    assert violations({**clean, "kvrc_processes": [moved]}, check_rss=True) == []
    short = violations({**clean, "kvrc_processes": [{**moved, "clients_end": 3}]}, check_rss=True)
    assert len(short) == 1 and "fds 30 -> 54 (+1 client connections)" in short[0], short
    fine = [{**process, "fds_end": 46, "rss_mb_end": 110.0},
            {**process, "ended": "killed", "rss_mb_end": 500.0, "fds_end": 90}]  # fmt: skip
    assert violations({**clean, "kvrc_processes": fine}, check_rss=True) == []
    grown = {**clean, "kvrc_processes": [{**process, "rss_mb_end": 111.0}]}
    assert violations(grown, check_rss=False) == []  # the CI version leaves RSS out
