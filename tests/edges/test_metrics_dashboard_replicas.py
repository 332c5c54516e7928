"""The dashboard's inventory panels over replicas that share one store (`--store redis://`).

Each replica's `kvrc_inventory_entries` counts the whole shared inventory
(docs/metrics.md), so a panel that sums it over replicas shows N times the truth.
Two real replicas over a real Redis, one engine registered on one of them: both
replicas' /metrics are scraped, and promtool evaluates the dashboard's own panel
queries over those samples (labelled by instance, as Prometheus labels them). They
must count the engine's entries once. A static check keeps every gauge the doc calls
a replica's view of the whole shared state out of a `sum` over instances.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from harness import REPO, CoordinatorProcess, get_status, metric_value, start_coordinator
from prometheus_env import DOC_PATH, parse_metrics_doc, promtool
from redis_env import start_redis
from waiting import wait_until

from clients.session import EngineProfile, EngineSession, RankPartRegistration
from kvrc.v1 import kvrc_pb2 as pb

DASHBOARD = REPO / "deploy" / "grafana" / "kvrc-dashboard.json"
GPU_BLOCKS, CPU_BLOCKS = 3, 2
# A phrase docs/metrics.md uses for a gauge every replica reports for the whole store.
SHARED_VIEW = "view of the whole shared"


def _panel_expr(title: str) -> str:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p.get("title") == title]
    assert len(panels) == 1, title
    expr: str = panels[0]["targets"][0]["expr"]
    return expr.replace("$instance", ".*")


def _inventory_samples(kvrc: CoordinatorProcess) -> dict[str, float]:
    with urllib.request.urlopen(kvrc.metrics_url, timeout=10) as response:
        text = response.read().decode()
    found = re.findall(r'^kvrc_inventory_entries\{tier="(\w+)"\} (\S+)$', text, re.M)
    return {tier: float(value) for tier, value in found}


def _stored(hashes: list[bytes], tier: pb.Tier.ValueType) -> pb.InventoryEvent:
    return pb.InventoryEvent(
        stored=pb.BlockStored(block_hashes=hashes, num_tokens=16 * len(hashes), tier=tier)
    )


def _promtool_test(
    tmp_path: Path, replicas: dict[str, dict[str, float]], checks: list[dict[str, Any]]
) -> subprocess.CompletedProcess[str]:
    series = [
        {
            "series": f'kvrc_inventory_entries{{job="kvrc", instance="{instance}", tier="{tier}"}}',
            "values": f"{value:g}x5",
        }
        for instance, samples in replicas.items()
        for tier, value in samples.items()
    ]
    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": checks}],
    }
    path = tmp_path / "dashboard.test.yaml"
    path.write_text(yaml.safe_dump(tests))
    return subprocess.run(
        [str(promtool()), "test", "rules", path.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_inventory_panels_count_shared_entries_once_over_replicas(tmp_path: Path) -> None:
    with start_redis() as redis:
        flags = ("--store", redis.url)
        with start_coordinator(*flags) as a, start_coordinator(*flags) as b:
            registration = RankPartRegistration(
                engine_id="e", profile=EngineProfile(model="m", block_size=16)
            )
            session = EngineSession(a.grpc_target, registration, reconnect=False)
            ack = await session.start()
            try:
                gpu = [bytes([1, i]) * 4 for i in range(GPU_BLOCKS)]
                cpu = [bytes([2, i]) * 4 for i in range(CPU_BLOCKS)]
                events = [_stored(gpu, pb.TIER_GPU), _stored(cpu, pb.TIER_CPU)]
                batch = pb.EventBatch(incarnation=ack.incarnation, sequence=0, events=events)
                await session.send_event_batch(batch)

                def replicated() -> bool:
                    return all(
                        metric_value(r, "kvrc_inventory_entries", tier="gpu") == GPU_BLOCKS
                        and metric_value(r, "kvrc_inventory_entries", tier="cpu") == CPU_BLOCKS
                        for r in (a, b)
                    )

                await wait_until(replicated, 15, what="both replicas count the engine's blocks")
                truth = (await get_status(a.grpc_target)).inventory_entries
                assert truth == GPU_BLOCKS + CPU_BLOCKS
                replicas = {f"127.0.0.1:{r.metrics_port}": _inventory_samples(r) for r in (a, b)}
            finally:
                await session.close()
    # What each replica exported: the whole inventory, on both (the doc's claim).
    for samples in replicas.values():
        assert samples["gpu"] == GPU_BLOCKS and samples["cpu"] == CPU_BLOCKS
    by_tier = [
        {"labels": f'{{tier="{tier}"}}', "value": value}
        for tier, value in next(iter(replicas.values())).items()
    ]
    checks = [
        {
            "expr": _panel_expr("Inventory entries"),
            "eval_time": "2m",
            "exp_samples": [{"labels": "{}", "value": truth}],
        },
        {
            "expr": _panel_expr("Inventory entries by tier"),
            "eval_time": "2m",
            "exp_samples": by_tier,
        },
    ]
    done = _promtool_test(tmp_path, replicas, checks)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_panel_sums_a_shared_view_gauge_over_instances() -> None:
    documented = parse_metrics_doc(DOC_PATH.read_text())
    rows = {
        line.split("`")[1]: line
        for line in DOC_PATH.read_text().splitlines()
        if line.startswith("| `kvrc_")
    }
    shared = sorted(name for name in documented if SHARED_VIEW in rows[name])
    assert "kvrc_inventory_entries" in shared
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for name in shared:
        using = [e for e in exprs if name in e]
        assert using, f"no panel shows {name}"
        for expr in using:
            # sum(...) or sum by (labels) (...) directly over the gauge, unless per instance.
            for by in re.findall(r"\bsum\s*(?:by\s*\(([^)]*)\))?\s*\(\s*" + name, expr):
                assert "instance" in by, f"{expr!r} sums {name} over replicas"
