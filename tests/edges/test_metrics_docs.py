"""docs/metrics.md and runtime/metrics.py agree, and the names follow Prometheus conventions.

Both directions: an exported metric missing from the doc fails, a documented metric
kvrc does not export fails, and so does any difference in type or label names.
`promtool check metrics` (the real linter, Debian's `prometheus` package) must
accept kvrc's exposition with every metric populated.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_env import (
    DOC_PATH,
    DocumentedMetric,
    MetricFamily,
    exercise_all_metrics,
    metric_catalog,
    parse_metrics_doc,
    promtool,
    promtool_check_metrics,
    registry_family_names,
)

from coordinator.core import event_streams, events, grants, leases
from coordinator.core.errors import ErrorCode
from coordinator.edges import grpc_servicers, zmq_ingest
from coordinator.runtime import coordinator as service
from coordinator.runtime import inventory_flow as inventory_service
from coordinator.runtime import lease_flow as lease_service
from coordinator.runtime.metrics import Metrics
from kvrc.v1 import kvrc_pb2

# Labels that would carry one value per request, lease, block or engine.
FORBIDDEN_LABELS = frozenset(
    {"request_id", "lease_id", "block_hash", "child_engine_id", "engine_id", "id", "hash"}
)
# Units Prometheus wants converted to base units.
NON_BASE_UNITS = (
    "_ms",
    "_milliseconds",
    "_us",
    "_microseconds",
    "_minutes",
    "_hours",
    "_kb",
    "_mb",
    "_gb",
    "_kilobytes",
    "_megabytes",
    "_percent",
)


@pytest.fixture(scope="module")
def documented() -> dict[str, DocumentedMetric]:
    return parse_metrics_doc(DOC_PATH.read_text())


@pytest.fixture(scope="module")
def catalog() -> dict[str, MetricFamily]:
    return metric_catalog(Metrics())


def test_every_exported_metric_is_documented(
    documented: dict[str, DocumentedMetric], catalog: dict[str, MetricFamily]
) -> None:
    missing = sorted(set(catalog) - set(documented))
    assert not missing, f"exported but not in docs/metrics.md: {missing}"


def test_every_documented_metric_is_exported(
    documented: dict[str, DocumentedMetric], catalog: dict[str, MetricFamily]
) -> None:
    extra = sorted(set(documented) - set(catalog))
    assert not extra, f"in docs/metrics.md but not exported by kvrc: {extra}"


def test_catalog_covers_the_whole_registry() -> None:
    # The catalogue reads Metrics' attributes; a collector registered some other
    # way would escape the doc check, so compare with what the registry collects.
    metrics = Metrics()
    assert set(metric_catalog(metrics)) == registry_family_names(metrics.registry)


def test_documented_types_and_label_names_match(
    documented: dict[str, DocumentedMetric], catalog: dict[str, MetricFamily]
) -> None:
    for name in sorted(set(documented) & set(catalog)):
        doc, family = documented[name], catalog[name]
        assert doc.metric_type == family.metric_type, (
            f"{name}: documented as {doc.metric_type}, exported as {family.metric_type}"
        )
        assert sorted(doc.labels) == sorted(family.label_names), (
            f"{name}: documented labels {sorted(doc.labels)}, exported {sorted(family.label_names)}"
        )


def test_every_label_but_version_lists_its_values(documented: dict[str, DocumentedMetric]) -> None:
    for doc in documented.values():
        for label, values in doc.labels.items():
            if label != "version":
                assert values, f"{doc.name}: label {label!r} does not list its allowed values"


def test_rpc_labels_list_every_method_and_status_code(
    documented: dict[str, DocumentedMetric],
) -> None:
    methods = {
        method.name
        for service in kvrc_pb2.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    requests = documented["kvrc_rpc_requests_total"]
    assert requests.labels["method"] == methods
    assert requests.labels["code"] == {code.name for code in grpc.StatusCode}
    # A refused registration is counted under the core's ErrorCode name.
    registrations = documented["kvrc_registrations_total"].labels["result"]
    assert registrations == {"ok"} | {c.value for c in ErrorCode}
    # Malformed requests: the methods served, and one value for anything else.
    malformed = documented["kvrc_rpc_malformed_total"].labels["method"]
    assert malformed == methods | {grpc_servicers.UNKNOWN_METHOD}
    # Unary timings: every method but the long-lived Session stream.
    assert documented["kvrc_rpc_duration_seconds"].labels["method"] == methods - {"Session"}


def _enum_label_values(enum: Any, prefix: str) -> set[str]:
    # Label values are the proto enum names, lower-cased, without their prefix.
    names = {value.name for value in enum.DESCRIPTOR.values}
    return {n.removeprefix(prefix).lower() for n in names} - {"unspecified"}


def test_tier_and_lease_state_values_follow_the_protocol(
    documented: dict[str, DocumentedMetric],
) -> None:
    tiers = _enum_label_values(kvrc_pb2.Tier, "TIER_")
    assert documented["kvrc_inventory_entries"].labels["tier"] == tiers
    states = _enum_label_values(kvrc_pb2.LeaseState, "LEASE_STATE_")
    live = documented["kvrc_leases"].labels["state"]
    ended = documented["kvrc_leases_ended_total"].labels["state"]
    assert live | ended == states
    assert not live & ended, f"a state is both live and terminal: {live & ended}"
    outcomes = _enum_label_values(kvrc_pb2.TransferOutcome, "TRANSFER_OUTCOME_")
    assert documented["kvrc_transfer_reports_total"].labels["outcome"] == outcomes


@pytest.mark.parametrize(
    "family", metric_catalog(Metrics()).values(), ids=lambda f: f.exported_name
)
def test_naming_conventions(family: MetricFamily) -> None:
    name = family.exported_name
    assert re.fullmatch(r"kvrc_[a-z][a-z0-9_]*[a-z0-9]", name), f"{name}: not kvrc_snake_case"
    assert family.help_text.strip(), f"{name}: no help text"
    if family.metric_type == "counter":
        assert name.endswith("_total"), f"counter {name} must end in _total"
    else:
        assert not name.endswith("_total"), f"{family.metric_type} {name} must not end in _total"
    for suffix in ("_bucket", "_sum", "_count", "_created"):
        assert not name.endswith(suffix), f"{name}: {suffix} is reserved for generated series"
    for unit in NON_BASE_UNITS:
        assert unit + "_" not in name + "_", f"{name}: use base units, not {unit}"
    timing = re.search(r"duration|latency|wait|time", name + " " + family.help_text.lower())
    if family.metric_type == "histogram" and timing:
        assert name.endswith("_seconds"), f"histogram of time {name} must end in _seconds"
    for label in family.label_names:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", label), f"{name}: label {label!r}"
        assert label not in FORBIDDEN_LABELS, f"{name}: label {label!r} is unbounded"
        assert not label.endswith(("_id", "_hash")), f"{name}: label {label!r} looks unbounded"
        assert label not in ("le", "quantile"), f"{name}: label {label!r} is reserved"


def test_parser_rejects_an_undocumented_or_retyped_metric(
    catalog: dict[str, MetricFamily],
) -> None:
    # The doc checks above are only as good as the parser: feed it a doc with
    # one row dropped and one type changed and make sure both show up.
    text = DOC_PATH.read_text()
    dropped = "\n".join(
        line for line in text.splitlines() if not line.startswith("| `kvrc_warming`")
    )
    assert "kvrc_warming" not in parse_metrics_doc(dropped)
    assert "kvrc_warming" in catalog
    retyped = text.replace("| `kvrc_rank_parts` | gauge |", "| `kvrc_rank_parts` | counter |")
    assert parse_metrics_doc(retyped)["kvrc_rank_parts"].metric_type == "counter"


def test_promtool_accepts_every_metric_populated() -> None:
    metrics = Metrics()
    exercise_all_metrics(metrics)
    exposition = generate_latest(metrics.registry)
    # Every family has a series now, so promtool sees all of them.
    for name in metric_catalog(metrics):
        series = re.compile(rb"^" + name.encode() + rb"(_bucket)?[{ ]", re.MULTILINE)
        assert series.search(exposition), f"{name} has no series after exercising"
    result = promtool_check_metrics(exposition)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()


def test_promtool_flags_a_badly_named_counter() -> None:
    # The linter itself must be able to fail, or the test above proves nothing.
    bad = (
        b"# HELP kvrc_bad_ms A counter in milliseconds.\n"
        b"# TYPE kvrc_bad_ms counter\n"
        b"kvrc_bad_ms 1\n"
    )
    result = promtool_check_metrics(bad)
    assert result.returncode != 0


def doc_queries(text: str) -> list[str]:
    """The PromQL column of the doc's `| question | PromQL |` table."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"^\|\s*question\s*\|", line))
    queries = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        # `\|` is a literal | inside a cell (a PromQL regex alternation).
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        queries.append(re.findall(r"`([^`]+)`", cells[1])[0].replace("\\|", "|"))
    return queries


def test_documented_queries_parse_and_use_exported_metrics(tmp_path: Path) -> None:
    queries = doc_queries(DOC_PATH.read_text())
    assert queries
    exported = {n for f in metric_catalog(Metrics()).values() for n in f.sample_names()}
    for query in queries:
        used = set(re.findall(r"\bkvrc_[a-z0-9_]+", query))
        assert used and used <= exported, f"{query}: unknown {sorted(used - exported)}"
    rules = tmp_path / "rules.yml"
    rules.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "docs",
                        "rules": [
                            {"record": f"kvrc_docs:q{i}", "expr": q} for i, q in enumerate(queries)
                        ],
                    }
                ]
            }
        )
    )
    result = subprocess.run(
        [str(promtool()), "check", "rules", str(rules)], capture_output=True, timeout=60
    )
    assert result.returncode == 0, (result.stdout + result.stderr).decode()


def test_label_values_defined_in_code_match_the_doc(
    documented: dict[str, DocumentedMetric],
) -> None:
    # Where the code names its label values in one place, the doc must list exactly those.
    streams = documented["kvrc_zmq_streams"].labels["state"]
    assert streams == {s.value for s in zmq_ingest.StreamState}
    replays = documented["kvrc_zmq_replays_total"].labels["result"]
    assert replays == {r.value for r in zmq_ingest._ReplayResult}
    reasons = {v for k, v in vars(service).items() if k.startswith("REASON_")}
    assert documented["kvrc_sessions_closed_total"].labels["reason"] == reasons


def test_flow_values_defined_in_code_match_the_doc(
    documented: dict[str, DocumentedMetric],
) -> None:
    # The enums the inventory and lease edges take their label values from.
    lookups = documented["kvrc_lookups_total"].labels["outcome"]
    assert lookups == {v.value for v in inventory_service.LookupVerdict}
    scores = documented["kvrc_score_requests_total"].labels["outcome"]
    assert scores == {o.value for o in inventory_service.ScoreOutcome}
    batches = documented["kvrc_event_batches_total"].labels["result"]
    # Plus the ZMQ edge's own: a frame that does not decode, one dropped behind a replay.
    assert batches == {a.value for a in event_streams.StreamAction} | {"malformed", "overflow"}
    tiers = documented["kvrc_inventory_entries"].labels["tier"]
    assert tiers == {t.name.lower() for t in events.Tier}
    flows = {f.value for f in leases.Flow}
    for name, family in documented.items():
        if "flow" in family.labels:
            assert family.labels["flow"] == flows, name
    live = documented["kvrc_leases"].labels["state"]
    assert live == {s.name.lower() for s in lease_service._NON_TERMINAL}
    ended = documented["kvrc_leases_ended_total"].labels["state"]
    assert ended == {s.name.lower() for s in leases.TERMINAL_STATES}
    misses = documented["kvrc_prefix_load_misses_total"].labels["reason"]
    # Misses come from the core (MissReason) and from choosing a holder.
    no_holder = set(grants._NO_HOLDER_DETAIL)
    assert misses == {r.value for r in leases.MissReason} | no_holder


def test_help_texts_list_every_documented_label_value(
    documented: dict[str, DocumentedMetric], catalog: dict[str, MetricFamily]
) -> None:
    # "by reason (a, b, c)" in a HELP string: what `curl /metrics` users read must name
    # the same values the doc lists, not a stale subset.
    checked = 0
    for name, family in catalog.items():
        for label, listed in re.findall(r"\b(\w+) \(([^()]*)\)", family.help_text):
            values = [v.strip() for v in listed.split(",")]
            if label not in family.label_names or not all(
                re.fullmatch(r"[a-z_]+", v) for v in values
            ):
                continue  # prose in parentheses, not a list of values
            checked += 1
            assert set(values) == documented[name].labels[label], (
                f"{name}: HELP lists {label} values {sorted(values)}, "
                f"docs/metrics.md {sorted(documented[name].labels[label])}"
            )
    assert checked >= 10  # the pattern still matches kvrc's HELP strings
