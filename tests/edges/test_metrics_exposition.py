"""What a real `kvrc serve` writes on /metrics: no `_created` series, and engines add none.

docs/metrics.md ("Cardinality") states the bounds; the numbers written there are
checked against its metric table and the histogram buckets in
coordinator/runtime/metrics.py, and a real coordinator is held to them.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import urllib.request

from harness import REPO, CoordinatorProcess, wait_until
from prometheus_client import generate_latest
from prometheus_env import DOC_PATH, exercise_all_metrics, parse_metrics_doc, samples_per_series

from clients.session import EngineProfile, EngineSession, RankPartRegistration
from coordinator.runtime.metrics import Metrics

_PER_ENGINE = re.compile(r"series per engine:\s+\*\*(\d+)\*\*")
_IN_ALL = re.compile(r"at most\s+\*\*([\d,]+) lines\*\*")
_ENGINES = 4  # registered after the first, whose label values appear once


def _documented(pattern: re.Pattern[str]) -> int:
    found = pattern.findall(DOC_PATH.read_text())
    assert len(found) == 1, f"docs/metrics.md must state {pattern.pattern!r} once"
    return int(found[0].replace(",", ""))


def _sample_lines(kvrc: CoordinatorProcess) -> list[str]:
    with urllib.request.urlopen(kvrc.metrics_url, timeout=10) as response:
        body: str = response.read().decode()
    return [line for line in body.splitlines() if line and not line.startswith("#")]


def lines_bound() -> int:
    """Most lines /metrics can write: every documented label value combination of every
    metric, times the lines one series writes (a label without a value set has one value)."""
    documented = parse_metrics_doc(DOC_PATH.read_text())
    per_series = samples_per_series(Metrics())
    return sum(
        math.prod(len(values) or 1 for values in doc.labels.values()) * per_series[name]
        for name, doc in documented.items()
    )


def test_the_documented_bound_is_the_one_the_table_gives() -> None:
    assert _documented(_IN_ALL) == lines_bound()


def test_no_created_series_whatever_the_environment_says() -> None:
    # prometheus-client reads this variable at import; kvrc's metrics module overrides it.
    script = (
        "from prometheus_client import generate_latest\n"
        "from coordinator.runtime.metrics import Metrics\n"
        "from prometheus_env import exercise_all_metrics\n"
        "m = Metrics(); exercise_all_metrics(m)\n"
        "print(generate_latest(m.registry).decode())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests' / 'support'}",
            "PROMETHEUS_DISABLE_CREATED_SERIES": "False",
        },
    )
    assert out.returncode == 0, out.stderr
    assert "kvrc_rpc_requests_total" in out.stdout
    assert "_created" not in out.stdout


def test_no_created_series_in_this_process() -> None:
    metrics = Metrics()
    exercise_all_metrics(metrics)
    assert b"_created" not in generate_latest(metrics.registry)


async def _register(kvrc: CoordinatorProcess, opened: list[EngineSession], engine_id: str) -> None:
    session = EngineSession(
        kvrc.grpc_target,
        RankPartRegistration(engine_id=engine_id, profile=EngineProfile(model="m", block_size=16)),
        reconnect=False,
    )
    await session.start()
    opened.append(session)


async def test_a_real_coordinator_writes_no_created_series_and_engines_add_none(
    kvrc: CoordinatorProcess, sessions: list[EngineSession]
) -> None:
    await _register(kvrc, sessions, "first")
    await wait_until(lambda: "kvrc_rank_parts 1.0" in _sample_lines(kvrc), timeout_s=10)
    one_engine = _sample_lines(kvrc)
    for i in range(_ENGINES):
        await _register(kvrc, sessions, f"more{i}")
    want = f"kvrc_rank_parts {1 + _ENGINES}.0"
    await wait_until(lambda: want in _sample_lines(kvrc), timeout_s=10)
    more_engines = _sample_lines(kvrc)

    assert not [line for line in more_engines if "_created" in line.split(" ")[0]]
    series = {line.rsplit(" ", 1)[0] for line in more_engines}
    grown = len(series) - len({line.rsplit(" ", 1)[0] for line in one_engine})
    assert grown <= _ENGINES * _documented(_PER_ENGINE), sorted(
        series - {line.rsplit(" ", 1)[0] for line in one_engine}
    )
    assert len(more_engines) <= _documented(_IN_ALL)
