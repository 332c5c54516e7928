"""deploy/ is valid: Kubernetes schemas, wiring between objects, the Dockerfile, the dashboard.

Every manifest validates offline against the Kubernetes API schemas
(`kubernetes-validate`, strict: unknown fields fail) for the oldest and newest
versions we support; the ServiceMonitor (a CRD) against the subset schema under
deploy/schemas/. Beyond schemas: probes hit the gRPC port kvrc listens on, the
flags are ones `kvrc serve` accepts, selectors select, the profiles file loads,
and the Grafana dashboard only queries metrics kvrc exports (and covers them all).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from prometheus_env import metric_catalog, promtool

from coordinator.edges.cli import build_parser, config_from_args
from coordinator.edges.server import SERVICE_NAMES
from coordinator.runtime.config import ConfigError, parse_profiles
from coordinator.runtime.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
MANIFEST_DIR = DEPLOY / "kubernetes"
SHAPES = ("standalone", "sidecar", "replicated")
# The objects each shape ships (kinds, with repeats).
SHAPE_KINDS = {
    "standalone": [
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Service",
        "ServiceMonitor",
    ],
    "replicated": [
        *["ConfigMap", "ConfigMap"],  # kvrc's profiles, redis.conf
        *["StatefulSet", "StatefulSet"],  # kvrc replicas, Redis
        *["Service", "Service"],  # headless kvrc, kvrc-redis
        *["NetworkPolicy", "NetworkPolicy"],
        *["PodDisruptionBudget", "PodDisruptionBudget"],
        "ServiceMonitor",
    ],
}
SHAPE_KINDS["sidecar"] = SHAPE_KINDS["standalone"]
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
DASHBOARD = DEPLOY / "grafana" / "kvrc-dashboard.json"
# Custom resources of the Prometheus operator: validated against subset schemas.
CRD_SCHEMAS = {
    "ServiceMonitor": DEPLOY / "schemas" / "servicemonitor-monitoring.coreos.com-v1.json",
    "PrometheusRule": DEPLOY / "schemas" / "prometheusrule-monitoring.coreos.com-v1.json",
}
ALERTS = MANIFEST_DIR / "monitoring" / "prometheusrule.yaml"
ALERT_TESTS = DEPLOY / "prometheus" / "kvrc-alerts.test.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
# 1.29: native sidecars (restartPolicy: Always on an init container) are on by default.
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
GRPC_PORT = 50051
METRICS_PORT = 9400

Doc = dict[str, Any]


def manifest_files() -> list[Path]:
    return sorted(MANIFEST_DIR.glob("*/*.yaml"))


def load_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def shape_docs(shape: str) -> list[Doc]:
    return [d for p in sorted((MANIFEST_DIR / shape).glob("*.yaml")) for d in load_docs(p)]


def one(docs: list[Doc], kind: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def all_containers(spec: Doc) -> list[Doc]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def workloads(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def kvrc_workload(docs: list[Doc]) -> Doc:
    """The Deployment or StatefulSet whose pods run the container named kvrc."""
    found = [
        w
        for w in workloads(docs)
        if any(c["name"] == "kvrc" for c in all_containers(w["spec"]["template"]["spec"]))
    ]
    assert len(found) == 1, f"expected one workload running kvrc, found {len(found)}"
    return found[0]


def pod_spec(docs: list[Doc]) -> Doc:
    spec: Doc = kvrc_workload(docs)["spec"]["template"]["spec"]
    return spec


def pod_labels(workload: Doc) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def service_of(docs: list[Doc], workload: Doc) -> Doc:
    """The one Service that routes to `workload`'s pods."""
    found = [
        d
        for d in docs
        if d["kind"] == "Service" and selects(d["spec"].get("selector", {}), pod_labels(workload))
    ]
    assert len(found) == 1, f"expected one Service for {workload['metadata']['name']}: {found}"
    return found[0]


def named(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def kvrc_container(spec: Doc) -> Doc:
    found = [c for c in all_containers(spec) if c["name"] == "kvrc"]
    assert len(found) == 1, "expected one container named kvrc"
    return found[0]


def flag_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


# --- schema validation ---------------------------------------------------------


def validate_resource(doc: Doc, version: str) -> None:
    """Raises when `doc` does not validate; CRDs against our vendored schemas."""
    if doc["kind"] in CRD_SCHEMAS:
        schema = json.loads(CRD_SCHEMAS[doc["kind"]].read_text())
        jsonschema.Draft202012Validator(schema).validate(doc)
        return
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(MANIFEST_DIR)))
def test_manifest_validates_against_kubernetes_schemas(path: Path, version: str) -> None:
    docs = load_docs(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        validate_resource(doc, version)


def test_every_shape_has_the_objects_the_issue_asks_for() -> None:
    assert (
        set(SHAPE_KINDS) == set(SHAPES) == {p.name for p in MANIFEST_DIR.iterdir()} - {"monitoring"}
    )
    for shape in SHAPES:
        kinds = sorted(d["kind"] for d in shape_docs(shape))
        assert kinds == sorted(SHAPE_KINDS[shape]), f"{shape}: {kinds}"


@pytest.mark.parametrize(
    ("kind", "mutate"),
    [
        # A typo the API server would reject (strict: unknown field).
        ("Deployment", lambda d: d["spec"].__setitem__("replica", 1)),
        ("StatefulSet", lambda d: d["spec"].__setitem__("replica", 3)),
        ("StatefulSet", lambda d: d["spec"]["volumeClaimTemplates"][0].__setitem__("spec", 1)),
        # A wrong type.
        ("Service", lambda d: d["spec"]["ports"][0].__setitem__("port", "fifty")),
        # CRD subset: an unknown scheme and an unknown field.
        ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].__setitem__("scheme", "grpc")),
        ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].__setitem__("intervall", "5s")),
        ("PrometheusRule", lambda d: d["spec"]["groups"][0]["rules"][0].__setitem__("for", "2x")),
        ("PrometheusRule", lambda d: d["spec"]["groups"][0]["rules"][0].pop("expr")),
    ],
)
def test_validation_rejects_broken_manifests(kind: str, mutate: Any) -> None:
    # The schema checks above mean something only if they can fail.
    docs = [*shape_docs("standalone"), *shape_docs("replicated"), *load_docs(ALERTS)]
    # The first of its kind; of the StatefulSets, Redis's (the one with a PVC template).
    of_kind = [d for d in docs if d["kind"] == kind]
    doc = copy.deepcopy(min(of_kind, key=lambda d: "volumeClaimTemplates" not in d["spec"]))
    validate_resource(doc, KUBERNETES_VERSIONS[-1])
    mutate(doc)
    with pytest.raises(jsonschema.ValidationError):
        validate_resource(doc, KUBERNETES_VERSIONS[-1])


# --- wiring --------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_probes_use_grpc_health_on_the_port_kvrc_listens_on(shape: str) -> None:
    kvrc = kvrc_container(pod_spec(shape_docs(shape)))
    listen = flag_value(kvrc["args"], "--listen")
    host, _, port = listen.rpartition(":")
    assert int(port) == GRPC_PORT
    # The kubelet's gRPC probes dial the pod IP: a loopback-only kvrc fails them.
    assert host == "0.0.0.0", f"{shape}: kubelet probes cannot reach {listen}"
    grpc_ports = [p["containerPort"] for p in kvrc["ports"] if p["name"].endswith("grpc")]
    assert grpc_ports == [GRPC_PORT]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in kvrc, f"{shape}: kvrc has no {probe}"
        check = kvrc[probe]["grpc"]
        assert check["port"] == GRPC_PORT, f"{shape} {probe}: port {check['port']}"
        # Only names kvrc's health servicer knows ("" = the whole server).
        assert check.get("service", "") in ("", *SERVICE_NAMES), f"{shape} {probe}: {check}"


@pytest.mark.parametrize("shape", SHAPES)
def test_metrics_port_is_declared_and_served(shape: str) -> None:
    docs = shape_docs(shape)
    kvrc = kvrc_container(pod_spec(docs))
    assert int(flag_value(kvrc["args"], "--metrics-port")) == METRICS_PORT
    metrics_ports = {p["name"]: p["containerPort"] for p in kvrc["ports"] if "metrics" in p["name"]}
    assert list(metrics_ports.values()) == [METRICS_PORT]
    # Service -> container port name -> ServiceMonitor endpoint, all the same port.
    service = service_of(docs, kvrc_workload(docs))
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    monitor = one(docs, "ServiceMonitor")
    for endpoint in monitor["spec"]["endpoints"]:
        port = by_name[endpoint["port"]]
        assert port["targetPort"] in metrics_ports, f"{shape}: {port} does not reach kvrc metrics"
        assert endpoint["path"] == "/metrics"


@pytest.mark.parametrize("shape", SHAPES)
def test_selectors_select(shape: str) -> None:
    docs = shape_docs(shape)
    kvrc = kvrc_workload(docs)
    service = service_of(docs, kvrc)
    # Every workload selects its own pods and no other workload's.
    for workload in workloads(docs):
        for other in workloads(docs):
            picks = selects(workload["spec"]["selector"]["matchLabels"], pod_labels(other))
            assert picks == (workload is other), f"{shape}: {workload['metadata']['name']}"
    # kvrc's pods are covered by a PDB and a NetworkPolicy; every one of those selects pods.
    for kind, key in (("PodDisruptionBudget", "selector"), ("NetworkPolicy", "podSelector")):
        selectors = [d["spec"][key]["matchLabels"] for d in docs if d["kind"] == kind]
        assert any(selects(s, pod_labels(kvrc)) for s in selectors), f"{shape}: {kind}"
        for selector in selectors:
            assert any(selects(selector, pod_labels(w)) for w in workloads(docs)), selector
    monitor = one(docs, "ServiceMonitor")
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    # Every Service port points at a named container port of the pods it selects.
    for workload in workloads(docs):
        spec = workload["spec"]["template"]["spec"]
        port_names = {p["name"] for c in all_containers(spec) for p in c.get("ports", [])}
        for port in service_of(docs, workload)["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"{shape}: {port}"


@pytest.mark.parametrize("shape", SHAPES)
def test_kvrc_container_is_locked_down_and_sized(shape: str) -> None:
    spec = pod_spec(shape_docs(shape))
    kvrc = kvrc_container(spec)
    security = {**spec.get("securityContext", {}), **kvrc.get("securityContext", {})}
    assert security.get("runAsNonRoot") is True
    assert security.get("runAsUser", 0) != 0
    assert kvrc["securityContext"].get("readOnlyRootFilesystem") is True
    assert kvrc["securityContext"].get("allowPrivilegeEscalation") is False
    assert kvrc["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert security.get("seccompProfile", {}).get("type") == "RuntimeDefault"
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(kvrc["resources"][kind]), f"{shape}: {kind}"
    # Every container states what it needs; the scheduler packs GPUs by it.
    for container in all_containers(spec):
        assert container["resources"]["requests"], f"{shape}/{container['name']}: no requests"


def test_sidecar_is_native_and_engines_use_loopback() -> None:
    spec = pod_spec(shape_docs("sidecar"))
    kvrc = kvrc_container(spec)
    assert kvrc in spec["initContainers"] and kvrc["restartPolicy"] == "Always"
    engines = spec["containers"]
    assert engines
    for engine in engines:
        env = {e["name"]: e.get("value") for e in engine["env"]}
        assert env["KVRC_TARGET"] == f"127.0.0.1:{GRPC_PORT}"
    # The sidecar's gRPC port is not published: only the pod's engines use it.
    service = one(shape_docs("sidecar"), "Service")
    assert GRPC_PORT not in {p["port"] for p in service["spec"]["ports"]}
    ingress_ports = {
        p["port"]
        for rule in one(shape_docs("sidecar"), "NetworkPolicy")["spec"]["ingress"]
        for p in rule["ports"]
    }
    assert GRPC_PORT not in ingress_ports


def test_standalone_runs_one_coordinator_at_a_time() -> None:
    deployment = one(shape_docs("standalone"), "Deployment")
    # Two coordinators would split the engines between two in-memory views.
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"


@pytest.mark.parametrize("shape", SHAPES)
def test_profiles_configmap_is_mounted_and_loads(shape: str) -> None:
    docs = shape_docs(shape)
    spec = pod_spec(docs)
    kvrc = kvrc_container(spec)
    args = kvrc["args"]
    # Reuse is experimental: the manifests ship it off (I1-reuse-off).
    assert flag_value(args, "--reuse") == "off"
    profiles_path = Path(flag_value(args, "--profiles"))
    mount = next(m for m in kvrc["volumeMounts"] if profiles_path.parent == Path(m["mountPath"]))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    configmap = named(docs, "ConfigMap", volume["configMap"]["name"])
    text = configmap["data"][profiles_path.name]
    profiles = parse_profiles(tomllib.loads(text), f"{shape} ConfigMap")
    assert profiles, f"{shape}: the ConfigMap declares no profile"


def test_profiles_loader_rejects_a_broken_configmap() -> None:
    # The check above goes through the real loader, which does refuse bad input.
    with pytest.raises(ConfigError):
        parse_profiles(tomllib.loads('[[profile]]\nmodel = "m"\n'), "no name")


# --- flags, against the real CLI -------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            out.append((instruction.upper(), rest.strip()))
    return out


def kvrc_args_everywhere() -> Iterator[tuple[str, list[str]]]:
    for shape in SHAPES:
        yield shape, kvrc_container(pod_spec(shape_docs(shape)))["args"]
    cmd = [rest for instruction, rest in dockerfile_instructions() if instruction == "CMD"]
    yield "Dockerfile CMD", json.loads(cmd[-1])


def test_flags_are_ones_kvrc_serve_accepts(tmp_path: Path) -> None:
    # The real parser and config builder: unknown flags and bad values both fail.
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(one(shape_docs("standalone"), "ConfigMap")["data"]["profiles.toml"])
    # The Secret's file, as the replicated shape mounts it (read when the config is built).
    password = tmp_path / "password"
    password.write_text("0123abcd\n")
    for where, args in kvrc_args_everywhere():
        if "--profiles" in args:
            args = [str(profiles) if a.endswith(".toml") else a for a in args]
        if "--store-password-file" in args:
            args = [*args]
            args[args.index("--store-password-file") + 1] = str(password)
        parsed = build_parser().parse_args(["serve", *args])
        config = config_from_args(parsed)
        assert config.listen == f"0.0.0.0:{GRPC_PORT}", where
        assert config.metrics_port == METRICS_PORT, where
        assert config.reuse is False, f"{where}: reuse must ship off"
        if where == "replicated":
            assert config.store.kind == "redis" and config.store.password == "0123abcd"
        else:
            assert config.store.kind == "memory", where


def test_parser_refuses_an_unknown_flag() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--listen", "0.0.0.0:1", "--metric-port", "9400"])


# --- Dockerfile ----------------------------------------------------------------


def test_dockerfile_is_slim_non_root_and_matches_the_manifests() -> None:
    instructions = dockerfile_instructions()
    stages = [rest for instruction, rest in instructions if instruction == "FROM"]
    assert stages and all(s.split()[0] == "python:3.11-slim" for s in stages)
    final = max(i for i, (instruction, _) in enumerate(instructions) if instruction == "FROM")
    final_stage = instructions[final:]
    users = [rest for instruction, rest in final_stage if instruction == "USER"]
    assert users, "the final stage sets no USER: it would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit(), f"USER {users[-1]}: numeric non-root"
    # Nothing after USER may need root again.
    last_user = max(i for i, (instruction, _) in enumerate(final_stage) if instruction == "USER")
    assert not [r for ins, r in final_stage[last_user:] if ins == "RUN"]
    exposed = {int(p) for ins, rest in final_stage if ins == "EXPOSE" for p in rest.split()}
    assert exposed == {GRPC_PORT, METRICS_PORT}
    manifest_ports = {
        p["containerPort"]
        for shape in SHAPES
        for p in kvrc_container(pod_spec(shape_docs(shape)))["ports"]
    }
    assert exposed == manifest_ports
    entrypoint = [rest for ins, rest in final_stage if ins == "ENTRYPOINT"]
    assert [json.loads(e) for e in entrypoint] == [["kvrc", "serve"]]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "kvrc" in pyproject["project"]["scripts"]
    # The coordinator image installs no extra (torch and Mooncake are for engines).
    assert "[engine" not in DOCKERFILE.read_text()
    for ins, rest in instructions:
        if ins == "COPY" and "--from" not in rest:
            for source in rest.split()[:-1]:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert ins != "ADD", "use COPY; ADD fetches URLs and unpacks archives"


def test_image_drops_created_series() -> None:
    # The Dockerfile's ENV must name the knob prometheus-client really reads.
    env = [rest for ins, rest in dockerfile_instructions() if ins == "ENV"]
    assert any("PROMETHEUS_DISABLE_CREATED_SERIES=True" in e.split() for e in env)
    script = (
        "from prometheus_client import generate_latest\n"
        "from coordinator.runtime.metrics import Metrics\n"
        "from prometheus_env import exercise_all_metrics\n"
        "m = Metrics(); exercise_all_metrics(m)\n"
        "print(generate_latest(m.registry).decode())\n"
    )
    for value, created in (("True", False), ("False", True)):
        out = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            env={
                **os.environ,
                "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests' / 'support'}",
                "PROMETHEUS_DISABLE_CREATED_SERIES": value,
            },
        )
        assert out.returncode == 0, out.stderr
        assert ("_created" in out.stdout) is created, value


# --- alerts ---------------------------------------------------------------------


def alert_rules() -> list[Doc]:
    return [
        r for g in one(load_docs(ALERTS), "PrometheusRule")["spec"]["groups"] for r in g["rules"]
    ]


def test_alerts_pass_their_promtool_unit_tests(tmp_path: Path) -> None:
    # promtool reads plain rule files: the PrometheusRule's groups, written out.
    groups = one(load_docs(ALERTS), "PrometheusRule")["spec"]["groups"]
    (tmp_path / "kvrc-alerts.rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    (tmp_path / ALERT_TESTS.name).write_text(ALERT_TESTS.read_text())
    for command in (
        ["check", "rules", "kvrc-alerts.rules.yaml"],
        ["test", "rules", ALERT_TESTS.name],
    ):
        result = subprocess.run(
            [str(promtool()), *command], capture_output=True, timeout=60, cwd=tmp_path
        )
        assert result.returncode == 0, (result.stdout + result.stderr).decode()


def test_every_alert_is_unit_tested_and_annotated() -> None:
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    tested = {c["alertname"] for t in tests["tests"] for c in t.get("alert_rule_test", [])}
    firing = {
        c["alertname"]
        for t in tests["tests"]
        for c in t.get("alert_rule_test", [])
        if c.get("exp_alerts")
    }
    for rule in alert_rules():
        name = rule["alert"]
        assert name in firing, f"{name}: no promtool test where it fires"
        assert name in tested
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        assert {"summary", "description"} <= set(rule["annotations"]), name


def test_alerts_query_only_metrics_kvrc_exports() -> None:
    exprs = [r["expr"] for r in alert_rules()]
    assert not unknown_metrics(exprs, Metrics())
    # Every ServiceMonitor puts kvrc's series under job="kvrc", which the alerts select.
    for shape in SHAPES:
        for endpoint in one(shape_docs(shape), "ServiceMonitor")["spec"]["endpoints"]:
            assert {"targetLabel": "job", "replacement": "kvrc"} in endpoint["relabelings"]
    for expr in exprs:
        assert 'job="kvrc"' in expr, expr


# --- Grafana dashboard ------------------------------------------------------------

_METRIC = re.compile(r"\bkvrc_[a-z0-9_]+")
# Grafana's variables, replaced by values Prometheus accepts.
_GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$instance": ".*"}


def dashboard_panels(dashboard: Doc) -> list[Doc]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def dashboard_exprs(dashboard: Doc) -> list[str]:
    return [t["expr"] for p in dashboard_panels(dashboard) for t in p.get("targets", [])]


def promql_for_prometheus(expr: str) -> str:
    for variable, value in _GRAFANA_VARS.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def unknown_metrics(exprs: list[str], metrics: Metrics) -> set[str]:
    """Series names the expressions query that kvrc does not export."""
    exported = {n for f in metric_catalog(metrics).values() for n in f.sample_names()}
    return {name for expr in exprs for name in _METRIC.findall(expr)} - exported


@pytest.fixture(scope="module")
def dashboard() -> Doc:
    loaded: Doc = json.loads(DASHBOARD.read_text())
    return loaded


def test_dashboard_queries_only_metrics_kvrc_exports(dashboard: Doc) -> None:
    exprs = dashboard_exprs(dashboard)
    assert exprs
    assert not unknown_metrics(exprs, Metrics())


def test_unknown_metric_check_catches_a_typo(dashboard: Doc) -> None:
    exprs = [*dashboard_exprs(dashboard), "sum(rate(kvrc_rpc_request_total[5m]))"]
    assert unknown_metrics(exprs, Metrics()) == {"kvrc_rpc_request_total"}
    # A histogram's base name is not a series; its _bucket is.
    assert unknown_metrics(["kvrc_handoff_wait_seconds"], Metrics()) == {
        "kvrc_handoff_wait_seconds"
    }
    assert not unknown_metrics(["kvrc_handoff_wait_seconds_bucket"], Metrics())


def test_dashboard_shows_every_exported_metric(dashboard: Doc) -> None:
    used = {name for expr in dashboard_exprs(dashboard) for name in _METRIC.findall(expr)}
    for family in metric_catalog(Metrics()).values():
        assert family.sample_names() & used, f"no dashboard panel shows {family.exported_name}"


def test_dashboard_is_well_formed(dashboard: Doc) -> None:
    panels = dashboard_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} queries nothing"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            # Every query is scoped to the chosen kvrc instances.
            for selector in re.findall(r"kvrc_[a-z0-9_]+(\{[^}]*\})?", target["expr"]):
                assert 'instance=~"$instance"' in selector, target["expr"]


def test_dashboard_promql_parses(dashboard: Doc, tmp_path: Path) -> None:
    # promtool parses each expression as a recording rule: a syntax error fails.
    rules = {
        "groups": [
            {
                "name": "kvrc-dashboard",
                "rules": [
                    {"record": f"kvrc_dashboard:query{i}", "expr": promql_for_prometheus(e)}
                    for i, e in enumerate(dashboard_exprs(dashboard))
                ],
            }
        ]
    }
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        [str(promtool()), "check", "rules", str(rules_file)], capture_output=True, timeout=60
    )
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
    broken = tmp_path / "broken.yml"
    broken.write_text(
        yaml.safe_dump(
            {"groups": [{"name": "g", "rules": [{"record": "r", "expr": "sum(rate(x[5m])"}]}]}
        )
    )
    result = subprocess.run(
        [str(promtool()), "check", "rules", str(broken)], capture_output=True, timeout=60
    )
    assert result.returncode != 0
