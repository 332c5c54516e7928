"""A real Prometheus scrapes a real kvrc and sees what known traffic should produce.

kvrc runs as a subprocess started with the manifests' own flags (`--reuse off`,
the ConfigMap's profiles file, `--log-json`); rank parts are real processes of
the client library (tests/engine_part.py); Prometheus is Debian's binary on
127.0.0.1 with a 1 s scrape interval. The test then asks Prometheus's HTTP API,
not kvrc, for the values, runs every Grafana dashboard query against it, lints
kvrc's live exposition with `promtool check metrics`, checks that every label
value kvrc exports is one docs/metrics.md lists, and calls the gRPC health
service the way the manifests' probes do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import CoordinatorProcess, EnginePartProcess, start_coordinator, start_engine_part
from prometheus_client.parser import text_string_to_metric_families
from prometheus_env import (
    DOC_PATH,
    PrometheusServer,
    parse_metrics_doc,
    promtool_check_metrics,
    running_prometheus,
)
from waiting import wait_until_sync

from clients.inventory import InventoryPublisher, LookupClient, PublishingHandler
from clients.session import EngineProfile, EngineSession, RankPartRegistration
from kvrc import __version__
from kvrc.v1 import kvrc_pb2, kvrc_pb2_grpc
from kvrc.vocabulary import Tier

REPO = Path(__file__).resolve().parents[2]
STANDALONE = REPO / "deploy" / "kubernetes" / "standalone"
DASHBOARD = REPO / "deploy" / "grafana" / "kvrc-dashboard.json"
ALERTS = REPO / "deploy" / "kubernetes" / "monitoring" / "prometheusrule.yaml"
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$instance": ".*"}
STATUS_CALLS = 5

Result = list[dict[str, Any]]


def value_is(expected: float) -> Callable[[Result], bool]:
    return lambda result: len(result) == 1 and float(result[0]["value"][1]) == expected


def manifest_kvrc_container() -> dict[str, Any]:
    deployment = yaml.safe_load((STANDALONE / "deployment.yaml").read_text())
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["name"] == "kvrc"
    return container


def serve_args_from_manifest(profiles_file: Path) -> list[str]:
    """The Deployment's flags minus the listen/metrics addresses the harness chooses."""
    args: list[str] = list(manifest_kvrc_container()["args"])
    for flag in ("--listen", "--metrics-port"):
        at = args.index(flag)
        del args[at : at + 2]
    at = args.index("--profiles")
    args[at + 1] = str(profiles_file)
    return args


@pytest.fixture
def kvrc(tmp_path: Path) -> Iterator[CoordinatorProcess]:
    configmap = yaml.safe_load((STANDALONE / "configmap.yaml").read_text())
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(configmap["data"]["profiles.toml"])
    with start_coordinator(*serve_args_from_manifest(profiles)) as coordinator:
        yield coordinator


def part(kvrc: CoordinatorProcess, engine_id: str, tp_rank: int) -> EnginePartProcess:
    return start_engine_part(
        kvrc.grpc_target,
        "--no-reconnect",
        coordinator=kvrc,
        engine_id=engine_id,
        tp_rank=tp_rank,
        tp_size=2,
    )


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARS.items():
                expr = expr.replace(variable, value)
            exprs.append(expr)
    return exprs


@pytest.mark.slow  # waits on Prometheus's scrapes and rule evaluations
def test_prometheus_scrapes_kvrc_and_sees_known_traffic(kvrc: CoordinatorProcess) -> None:
    # Traffic: 5 status calls; engine "ready-engine" complete (2 of 2 parts),
    # "half-engine" incomplete (1 of 2), one duplicate rank part refused.
    with grpc.insecure_channel(kvrc.grpc_target) as channel:
        admin = kvrc_pb2_grpc.AdminServiceStub(channel)
        for _ in range(STATUS_CALLS):
            admin.GetStatus(kvrc_pb2.StatusRequest(), timeout=10)
        # What the manifests' probes ask (kubelet: grpc.health.v1.Health/Check).
        health = health_pb2_grpc.HealthStub(channel)
        container = manifest_kvrc_container()
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            service = container[probe]["grpc"].get("service", "")
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, (probe, service)

    ready_0 = part(kvrc, "ready-engine", 0)
    ready_1 = part(kvrc, "ready-engine", 1)
    half = part(kvrc, "half-engine", 0)
    duplicate = part(kvrc, "half-engine", 0)
    assert ready_0.registered and ready_1.registered and half.registered
    assert not duplicate.registered and duplicate.first_line["code"] == "ALREADY_EXISTS"

    alert_groups = yaml.safe_load(ALERTS.read_text())["spec"]["groups"]
    with running_prometheus([f"127.0.0.1:{kvrc.metrics_port}"], alert_groups) as prom:
        prom.wait_for('up{job="kvrc"}', value_is(1))
        prom.wait_for(
            'kvrc_rpc_requests_total{method="GetStatus",code="OK"}', value_is(STATUS_CALLS)
        )
        prom.wait_for(f'kvrc_build_info{{version="{__version__}"}}', value_is(1))
        prom.wait_for("kvrc_rank_parts", value_is(3))
        prom.wait_for('kvrc_child_engines{state="ready"}', value_is(1))
        prom.wait_for('kvrc_child_engines{state="not_ready"}', value_is(1))
        prom.wait_for('kvrc_registrations_total{result="ok"}', value_is(3))
        prom.wait_for('kvrc_registrations_total{result="ALREADY_EXISTS"}', value_is(1))
        prom.wait_for(
            'kvrc_rpc_requests_total{method="Session",code="ALREADY_EXISTS"}', value_is(1)
        )
        prom.wait_for("kvrc_warming", value_is(0))

        # A state change shows up too: one part of the ready engine leaves cleanly.
        assert ready_1.terminate() == 0
        prom.wait_for("kvrc_rank_parts", value_is(2))
        prom.wait_for('kvrc_child_engines{state="ready"}', value_is(0))
        prom.wait_for('kvrc_child_engines{state="not_ready"}', value_is(2))
        prom.wait_for('kvrc_sessions_closed_total{reason="closed"}', value_is(1))

        check_dashboard_queries(prom)
        check_alert_rules_evaluate(prom, len([r for g in alert_groups for r in g["rules"]]))


def check_dashboard_queries(prom: PrometheusServer) -> None:
    # Every panel's query is valid PromQL Prometheus evaluates without error...
    results = {expr: prom.query(expr) for expr in dashboard_exprs()}
    # ...and the ones fed by the traffic above have data (rates need 2 scrapes).
    prom.wait_for(
        'sum by (method) (rate(kvrc_rpc_requests_total{instance=~".*"}[1m]))',
        lambda r: "GetStatus" in {s["metric"].get("method") for s in r},
    )
    states = results['sum by (state) (kvrc_child_engines{instance=~".*"})']
    assert {s["metric"]["state"] for s in states} >= {"ready", "not_ready"}
    assert results['sum(kvrc_rank_parts{instance=~".*"})']


def check_alert_rules_evaluate(prom: PrometheusServer, expected_rules: int) -> None:
    # The deploy/ alerts load and evaluate without error on real kvrc series;
    # KvrcEnginesNotReady has seen the two not-ready engines (pending: for 10m).
    def evaluated() -> list[dict[str, Any]]:
        groups = prom.api("rules")["groups"]
        return [r for g in groups for r in g["rules"]]

    rules: list[dict[str, Any]] = []

    def all_evaluated() -> bool:
        rules[:] = evaluated()
        return len(rules) == expected_rules and all(
            r.get("lastEvaluation", "").startswith("20") and r["health"] != "unknown" for r in rules
        )

    with contextlib.suppress(TimeoutError):  # the asserts below say what is missing
        wait_until_sync(all_evaluated, 30, interval_s=0.25, what="every rule evaluated")
    assert len(rules) == expected_rules
    for rule in rules:
        assert rule["health"] == "ok", rule
    pending = prom.wait_for('ALERTS{alertname="KvrcEnginesNotReady"}', lambda r: len(r) == 1)
    assert pending[0]["metric"]["alertstate"] == "pending"
    assert pending[0]["metric"]["state"] == "not_ready"


def test_live_exposition_passes_promtool_and_uses_documented_label_values(
    kvrc: CoordinatorProcess,
) -> None:
    part(kvrc, "lint-engine", 0)
    with grpc.insecure_channel(kvrc.grpc_target) as channel:
        kvrc_pb2_grpc.AdminServiceStub(channel).GetStatus(kvrc_pb2.StatusRequest(), timeout=10)
    with urllib.request.urlopen(kvrc.metrics_url, timeout=10) as response:
        exposition = response.read()
    result = promtool_check_metrics(exposition)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()

    documented = parse_metrics_doc(DOC_PATH.read_text())
    seen = 0
    for family in text_string_to_metric_families(exposition.decode()):
        if not family.name.startswith("kvrc_"):
            continue
        name = {"counter": family.name + "_total", "info": family.name + "_info"}.get(
            family.type, family.name
        )
        assert name in documented, f"kvrc exports {name}, docs/metrics.md does not list it"
        for sample in family.samples:
            for label, value in sample.labels.items():
                allowed = documented[name].labels.get(label)
                if label == "le" or not allowed:
                    continue
                seen += 1
                assert value in allowed, f"{sample.name}{{{label}={value!r}}} not in docs"
    assert seen, "no enumerated label value was checked"


# --- inventory, lookups and a decode handoff ---------------------------------------

HOLDER_GPU_BLOCKS = 8
HOLDER_CPU_BLOCKS = 4
HANDOFF_BLOCKS = 3
HANDOFF_BYTES = HANDOFF_BLOCKS * 65536


def manifest_profile() -> EngineProfile:
    """An engine profile the ConfigMap's declared profile matches (reuse may activate)."""
    configmap = yaml.safe_load((STANDALONE / "configmap.yaml").read_text())
    declared = tomllib.loads(configmap["data"]["profiles.toml"])["profile"][0]
    return EngineProfile(
        model=declared["model"],
        block_size=declared["block_size"],
        kv_dtype=declared["kv_dtype"],
        reuse_opt_in=True,
    )


async def open_engine(target: str, engine_id: str) -> tuple[EngineSession, InventoryPublisher]:
    session = EngineSession(
        target, RankPartRegistration(engine_id, manifest_profile()), reconnect=False
    )
    publisher = InventoryPublisher(session)
    session.handler = PublishingHandler(publisher)
    await session.start()
    await session.wait_ready(10)
    return session, publisher


def chain(prefix: bytes, n: int) -> list[bytes]:
    return [prefix + i.to_bytes(4, "big") for i in range(n)]


@pytest.mark.slow  # waits on Prometheus's scrapes
async def test_inventory_lookups_and_a_handoff_reach_prometheus(tmp_path: Path) -> None:
    configmap = yaml.safe_load((STANDALONE / "configmap.yaml").read_text())
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(configmap["data"]["profiles.toml"])
    # The README's way to turn reuse on: `--reuse on` with the ConfigMap's profiles.
    args = [a if a != "off" else "on" for a in serve_args_from_manifest(profiles)]
    with start_coordinator(*args) as kvrc, contextlib.ExitStack() as stack:
        target = kvrc.grpc_target
        holder, holder_events = await open_engine(target, "holder")
        requester, _ = await open_engine(target, "requester")
        prefill, _ = await open_engine(target, "prefill")
        decode, _ = await open_engine(target, "decode")
        sessions = (holder, requester, prefill, decode)
        try:
            assert requester.ack is not None and requester.ack.reuse.enabled, requester.ack
            # Prometheus is blocking I/O: keep it off the loop the sessions heartbeat on.
            prom = await asyncio.to_thread(
                stack.enter_context, running_prometheus([f"127.0.0.1:{kvrc.metrics_port}"])
            )

            async def expect(expr: str, value: float) -> None:
                await asyncio.to_thread(prom.wait_for, expr, value_is(value))

            gpu_chain = chain(b"gpu", HOLDER_GPU_BLOCKS)
            await holder_events.stored(gpu_chain, num_tokens=16 * HOLDER_GPU_BLOCKS)
            await holder_events.stored(
                chain(b"cpu", HOLDER_CPU_BLOCKS), num_tokens=16 * HOLDER_CPU_BLOCKS, tier=Tier.CPU
            )
            await expect('kvrc_inventory_entries{tier="gpu"}', HOLDER_GPU_BLOCKS)
            await expect('kvrc_inventory_entries{tier="cpu"}', HOLDER_CPU_BLOCKS)
            # Counted per block, not per event.
            await expect(
                'kvrc_block_events_total{source="grpc",type="stored"}',
                HOLDER_GPU_BLOCKS + HOLDER_CPU_BLOCKS,
            )
            await expect('kvrc_event_batches_total{source="grpc",result="applied"}', 2)
            # The manifest's --warmup-ms: reuse opens once the restart warm-up is over.
            await expect("kvrc_warming", 0)

            # Three lookups: a 5-block hit, a miss, and the same 5 blocks below min_blocks=6.
            prompt = [*gpu_chain[:5], b"not-retained"]
            async with LookupClient(target) as client:
                hit = await client.lookup("requester", prompt)
                miss = await client.lookup("requester", chain(b"nobody", 4))
                short = await client.lookup("requester", prompt, min_blocks=6)
            assert hit.candidates[0].matched_blocks == 5
            assert (hit.outcome.value, miss.outcome.value, short.outcome.value) == (
                "hit",
                "miss",
                "below_min_blocks",
            )
            for outcome in ("hit", "miss", "below_min_blocks"):
                await expect(f'kvrc_lookups_total{{outcome="{outcome}"}}', 1)
            await expect("kvrc_lookup_matched_blocks_count", 3)
            await expect('kvrc_lookup_matched_blocks_bucket{le="4.0"}', 1)  # the miss
            await expect('kvrc_lookup_matched_blocks_bucket{le="8.0"}', 3)

            # One decode handoff: published, begun, reported, quiescent.
            lease_id = await run_handoff(target)
            assert lease_id
            await expect('kvrc_leases_ended_total{flow="handoff",state="completed"}', 1)
            await expect('kvrc_transfer_bytes_total{flow="handoff"}', HANDOFF_BYTES)
            await expect('kvrc_transfer_reports_total{flow="handoff",outcome="succeeded"}', 1)
            await expect('kvrc_lease_grant_duration_seconds_count{flow="handoff"}', 1)
            await expect('kvrc_lease_quiescence_duration_seconds_count{flow="handoff"}', 1)
            await expect('sum(kvrc_leases{flow="handoff"})', 0)
            await expect('kvrc_rpc_requests_total{method="CompleteHandoff",code="OK"}', 1)
            await asyncio.to_thread(check_flow_panels, prom)
        finally:
            for session in sessions:
                await session.close()


def check_flow_panels(prom: PrometheusServer) -> None:
    # The dashboard's inventory, lookup, lease and transfer panels show this traffic.
    exprs = dashboard_exprs()

    def panel(fragment: str) -> str:
        found = [e for e in exprs if fragment in e]
        assert len(found) == 1, (fragment, found)
        return found[0]

    def labels(name: str) -> Callable[[Result], set[str]]:
        return lambda result: {s["metric"].get(name, "") for s in result}

    expectations = [
        (panel("max by (tier) (kvrc_inventory_entries"), "tier", {"gpu", "cpu"}),
        (panel("sum by (outcome) (rate(kvrc_lookups_total"), "outcome", {"hit", "miss"}),
        (panel("sum by (flow, state) (rate(kvrc_leases_ended_total"), "flow", {"handoff"}),
        (panel("sum by (flow) (rate(kvrc_transfer_bytes_total"), "flow", {"handoff"}),
    ]
    for expr, label, wanted in expectations:
        prom.wait_for(expr, lambda r, label=label, wanted=wanted: wanted <= labels(label)(r))


async def run_handoff(target: str) -> str:
    rank = kvrc_pb2.RankCoordinates()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = kvrc_pb2_grpc.EngineServiceStub(channel)
        published = await stub.PublishHandoff(
            kvrc_pb2.PublishHandoffRequest(
                request_id="req-1",
                prefill_child_engine_id="prefill",
                rank=rank,
                descriptor=kvrc_pb2.RankPartDescriptor(
                    rank=rank, block_ids=list(range(HANDOFF_BLOCKS))
                ),
                kv_transfer_params=b'{"do_remote_decode": true}',
                num_blocks=HANDOFF_BLOCKS,
            ),
            timeout=10,
        )
        assert published.state == kvrc_pb2.LEASE_STATE_READY, published
        grant = await stub.BeginHandoff(
            kvrc_pb2.BeginHandoffRequest(
                request_id="req-1",
                prefill_child_engine_id="prefill",
                decode_child_engine_id="decode",
                wait_timeout_ms=5000,
            ),
            timeout=10,
        )
        done = await stub.CompleteHandoff(
            kvrc_pb2.TransferReport(
                lease_id=grant.lease_id,
                reporter_child_engine_id="decode",
                rank=rank,
                outcome=kvrc_pb2.TRANSFER_OUTCOME_SUCCEEDED,
                bytes_moved=HANDOFF_BYTES,
                duration_us=250,
            ),
            timeout=10,
        )
        assert done.quiescent and done.state == kvrc_pb2.LEASE_STATE_COMPLETED, done
        return grant.lease_id
