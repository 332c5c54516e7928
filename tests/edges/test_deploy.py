"""deploy/ is valid: Kubernetes schemas, wiring between objects, the Dockerfile, the dashboard.

Every manifest validates offline against the Kubernetes API schemas
(`kubernetes-validate`, strict: unknown fields fail) for the oldest and newest
versions we support; the ServiceMonitor (a CRD) against the subset schema under
deploy/schemas/. Beyond schemas: probes hit the gRPC port kvrc listens on, the
flags are ones `kvrc serve` accepts, selectors select, the profiles file loads,
and the Grafana dashboard only queries metrics kvrc exports (and covers them all).
The shapes over Redis (replicated: N kvrc replicas; sidecar-shared: a kvrc
sidecar per engine pod, both with deploy/kubernetes/redis) also get checks of
their own, each shown to fail on a broken copy of the manifests: the store URL
names the Redis Service, the password and the hash seed come only from the
Secret, only kvrc-bearing pods reach Redis, replicas >= 2 with a PDB of one
(replicated), engines reach each other's transfer ports (sidecar-shared), and
Redis takes requirepass from the Secret (run against a real redis-server). The
sidecar shapes are checked to run kvrc as a native sidecar that their engines
reach on loopback only.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import re
import socket
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import redis as redis_lib
import yaml
from harness import CoordinatorProcess, free_port, metric_value, start_coordinator
from prometheus_env import metric_catalog, promtool
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis_env import require_redis_server
from waiting import wait_until_sync

from coordinator.edges.cli import build_parser, config_from_args
from coordinator.edges.server import SERVICE_NAMES
from coordinator.runtime.config import ConfigError, parse_profiles, parse_store
from coordinator.runtime.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
MANIFEST_DIR = DEPLOY / "kubernetes"
SHAPES = ("standalone", "sidecar", "replicated", "sidecar-shared")
# Shapes whose kvrc runs with --store redis://, over deploy/kubernetes/redis.
STORE_SHAPES = ("replicated", "sidecar-shared")
SIDECAR_SHAPES = ("sidecar", "sidecar-shared")
# Directories a shape is applied with, besides its own (one Redis manifest for both).
SHARED_DIRS = {shape: ("redis",) for shape in STORE_SHAPES}
# The objects each shape ships, its shared directories' included (kinds, with repeats).
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
SHAPE_KINDS["sidecar-shared"] = [
    *SHAPE_KINDS["sidecar"],
    # deploy/kubernetes/redis: redis.conf, Redis, kvrc-redis, its policy and PDB.
    *["ConfigMap", "StatefulSet", "Service", "NetworkPolicy", "PodDisruptionBudget"],
]
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
    """What `kubectl apply -f` of the shape's directory and its shared ones creates."""
    dirs = (shape, *SHARED_DIRS.get(shape, ()))
    return [
        d for s in dirs for p in sorted((MANIFEST_DIR / s).glob("*.yaml")) for d in load_docs(p)
    ]


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
    shared = {"monitoring", *(d for dirs in SHARED_DIRS.values() for d in dirs)}
    assert set(SHAPE_KINDS) == set(SHAPES) == {p.name for p in MANIFEST_DIR.iterdir()} - shared
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


def test_standalone_runs_one_coordinator_at_a_time() -> None:
    deployment = one(shape_docs("standalone"), "Deployment")
    # Two coordinators would split the engines between two in-memory views.
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"


@pytest.mark.parametrize("shape", SHAPES)
def test_termination_grace_outlasts_kvrc_shutdown(shape: str) -> None:
    # SIGTERM -> kvrc's --shutdown-grace-s for in-flight RPCs (+ 1 s for queued store
    # appends): the kubelet's SIGKILL must come well after (twice that, at least).
    spec = pod_spec(shape_docs(shape))
    args = build_parser().parse_args(["serve", *kvrc_container(spec)["args"]])
    assert spec["terminationGracePeriodSeconds"] >= 2 * (args.shutdown_grace_s + 1), shape


@pytest.mark.parametrize("shape", SHAPES)
def test_a_restarted_coordinator_warms_up_before_it_lends(shape: str) -> None:
    # deploy/README.md promises reuse off while kvrc_warming is 1 after a restart; with
    # neither --state-file nor --warmup-ms kvrc never warms (docs/operations.md).
    spec = pod_spec(shape_docs(shape))
    args = build_parser().parse_args(["serve", *kvrc_container(spec)["args"]])
    assert args.warmup_ms is not None and args.warmup_ms >= 5_000, shape


# --- shape checks: the sidecars, and the shapes over one Redis -------------------------
#
# Each check is a function of the shape's documents, so that
# test_shape_checks_fail_on_broken_manifests can show it failing on a broken copy.

REDIS_PORT = 6379
STORE_SECRET = "kvrc-store"
# The label that admits a pod to Redis (deploy/kubernetes/redis's NetworkPolicy).
STORE_CLIENT = {"kvrc.io/store-client": "true"}


def replicated() -> list[Doc]:
    return shape_docs("replicated")


def redis_workload(docs: list[Doc]) -> Doc:
    found = [
        w
        for w in workloads(docs)
        if any(c["name"] == "redis" for c in w["spec"]["template"]["spec"]["containers"])
    ]
    assert len(found) == 1, f"expected one workload running redis, found {len(found)}"
    return found[0]


def container(workload: Doc, name: str) -> Doc:
    found = [c for c in all_containers(workload["spec"]["template"]["spec"]) if c["name"] == name]
    assert len(found) == 1, name
    return found[0]


def redis_conf(docs: list[Doc]) -> str:
    """redis.conf from the ConfigMap Redis's pods mount."""
    spec = redis_workload(docs)["spec"]["template"]["spec"]
    names = [v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v]
    assert len(names) == 1, names
    text: str = named(docs, "ConfigMap", names[0])["data"]["redis.conf"]
    return text


def conf_value(conf: str, key: str) -> str | None:
    values = [
        line.split(None, 1)[1].strip() if len(line.split()) > 1 else ""
        for line in conf.splitlines()
        if line.split() and line.split()[0].lower() == key
    ]
    return values[-1] if values else None


def secret_mounts(workload: Doc, name: str) -> dict[Path, str]:
    """Mount path -> secret name, for the container `name`'s secret volumes."""
    spec = workload["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    return {
        Path(m["mountPath"]): secrets[m["name"]]
        for m in container(workload, name).get("volumeMounts", [])
        if m["name"] in secrets
    }


def is_secret_file(workload: Doc, name: str, path: str) -> bool:
    """`path` is a file of the STORE_SECRET volume mounted in container `name`."""
    spec = workload["spec"]["template"]["spec"]
    for mount_path, secret in secret_mounts(workload, name).items():
        if secret == STORE_SECRET and Path(path).parent == mount_path:
            volume = next(
                v
                for v in spec["volumes"]
                if "secret" in v
                and any(
                    m["name"] == v["name"] and Path(m["mountPath"]) == mount_path
                    for m in container(workload, name)["volumeMounts"]
                )
            )
            items = volume["secret"].get("items")
            return items is None or Path(path).name in {i["path"] for i in items}
    return False


def walk(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) for every dict item and list element, depth first."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield f"{path}.{key}", item
            yield from walk(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield f"{path}[{i}]", item
            yield from walk(item, f"{path}[{i}]")


def check_store_url_names_the_redis_service(docs: list[Doc]) -> None:
    kvrc = kvrc_workload(docs)
    args = container(kvrc, "kvrc")["args"]
    store = parse_store(flag_value(args, "--store"))
    assert store.kind == "redis", f"--store {store.url}: the replicas would not share anything"
    # The host is the Redis Service's name (or its NAME.NAMESPACE.svc... form).
    redis = redis_workload(docs)
    service = service_of(docs, redis)
    name = service["metadata"]["name"]
    host = store.host.split(".")
    assert host[0] == name and (len(host) == 1 or host[2:3] in ([], ["svc"])), store.host
    port = next((p for p in service["spec"]["ports"] if p["port"] == store.port), None)
    assert port is not None, f"{store.url}: Service {name} has no port {store.port}"
    # ... whose target is the port Redis listens on.
    redis_ports = {p["name"]: p["containerPort"] for p in container(redis, "redis")["ports"]}
    target = port["targetPort"]
    listens = int(conf_value(redis_conf(docs), "port") or REDIS_PORT)
    assert redis_ports.get(target, target) == listens, f"{port} does not reach Redis's {listens}"


def check_password_only_from_the_secret(docs: list[Doc]) -> None:
    kvrc, redis = kvrc_workload(docs), redis_workload(docs)
    # kvrc reads the password from the Secret's file, never from argv (parse_store
    # refuses one in the URL) or an environment literal.
    password_file = flag_value(container(kvrc, "kvrc")["args"], "--store-password-file")
    assert is_secret_file(kvrc, "kvrc", password_file), f"{password_file}: not {STORE_SECRET}'s"
    # Redis gets requirepass, and redis-cli its password, from that file only.
    words = re.compile(
        r'(requirepass|masterauth|REDISCLI_AUTH=|--pass\b|-a\b)\s*("?\$\(cat [^)]*\)"?|\S*)', re.I
    )
    sources = []
    for where, value in walk(container(redis, "redis")):
        for _key, source in words.findall(value) if isinstance(value, str) else ():
            read = re.fullmatch(r'"?\$\(cat (/\S+)\)"?', source)
            assert read, f"redis{where}: a password not read from a file: {value!r}"
            assert is_secret_file(redis, "redis", read.group(1)), f"redis{where}: {read.group(1)}"
            sources.append(where)
    command = "\n".join(container(redis, "redis").get("command", []))
    assert re.search(r"^\s*requirepass \$\(cat /", command, re.M), "Redis runs without a password"
    assert len(sources) >= 2, "redis-cli in the probes must authenticate from the file too"
    # Nowhere else: no password in a ConfigMap, no env literal, no Secret with data shipped,
    # no reference to any other Secret.
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            for key, text in doc["data"].items():
                assert not re.search(r"^\s*(requirepass|masterauth)\b", text, re.I | re.M), key
        assert doc["kind"] != "Secret", "the Secret is created by hand, not shipped with a value"
        for where, value in walk(doc):
            if where.endswith(".env") and isinstance(value, list):
                for env in value:
                    looks = re.search(r"PASS|AUTH|SECRET|TOKEN", env["name"], re.I)
                    assert not (looks and "value" in env), f"{where}: {env['name']} is a literal"
            # Volumes (secretName), projected volumes (secret.name), env and envFrom.
            if where.endswith((".secretName", ".secretKeyRef", ".secretRef", ".secret")):
                name = value if isinstance(value, str) else value.get("name", STORE_SECRET)
                assert name == STORE_SECRET, f"{where}: Secret {name}"


def check_only_kvrc_reaches_redis(docs: list[Doc]) -> None:
    kvrc, redis = kvrc_workload(docs), redis_workload(docs)
    # Every policy whose podSelector picks Redis's pods ({} picks every pod) counts.
    labels = pod_labels(redis)
    policies = []
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        selector = policy["spec"]["podSelector"]
        assert "matchExpressions" not in selector, f"{policy['metadata']['name']}: unchecked"
        if all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
            policies.append(policy)
    assert policies, "no NetworkPolicy selects the Redis pods: every pod may reach Redis"
    assert any("Ingress" in p["spec"].get("policyTypes", ["Ingress"]) for p in policies), (
        "no policy restricts ingress to Redis"
    )
    for policy in policies:
        # Policies add up: each one selecting Redis may admit kvrc's pods only, by the
        # one label both store shapes give them.
        for rule in policy["spec"].get("ingress", []):
            assert rule.get("from"), f"{policy['metadata']['name']}: a rule without from admits all"
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, f"{peer}: not only this namespace's pods"
                assert peer["podSelector"] == {"matchLabels": STORE_CLIENT}, peer
            assert [p["port"] for p in rule.get("ports", [])] == [REDIS_PORT], rule
    assert selects(STORE_CLIENT, pod_labels(kvrc)), "kvrc's pods cannot reach Redis"
    check_store_label_only_on_kvrc_pods(docs)


def check_store_label_only_on_kvrc_pods(docs: list[Doc]) -> None:
    """Every workload whose pods carry STORE_CLIENT runs kvrc over a Redis store."""
    for workload in workloads(docs):
        if not selects(STORE_CLIENT, pod_labels(workload)):
            continue
        name = workload["metadata"]["name"]
        kvrc = [
            c for c in all_containers(workload["spec"]["template"]["spec"]) if c["name"] == "kvrc"
        ]
        assert kvrc, f"{name}: admitted to Redis without running kvrc"
        store = parse_store(flag_value(kvrc[0]["args"], "--store"))
        assert store.kind == "redis", f"{name}: admitted to Redis, kvrc on {store.url}"


# Required: a Secret without the key keeps the pods from starting, rather than starting
# replicas with random seeds whose snapshots the others refuse.
HASH_SEED_ENV = {
    "name": "PYTHONHASHSEED",
    "valueFrom": {"secretKeyRef": {"name": STORE_SECRET, "key": "hash-seed"}},
}


def check_hash_seed_from_the_secret(docs: list[Doc]) -> None:
    # One seed for every kvrc of the store: snapshots hold block keys of it.
    env = [e for e in container(kvrc_workload(docs), "kvrc").get("env", [])]
    seeds = [e for e in env if e["name"] == "PYTHONHASHSEED"]
    assert seeds == [HASH_SEED_ENV], f"PYTHONHASHSEED: {seeds}"


def check_secret_only_in_kvrc(docs: list[Doc]) -> None:
    # In a sidecar pod the engines share kvrc's network (the Redis policy admits
    # them too): the password, in kvrc's container alone, is what keeps them out.
    spec = pod_spec(docs)
    store_volumes = {
        v["name"] for v in spec["volumes"] if v.get("secret", {}).get("secretName") == STORE_SECRET
    }
    assert store_volumes, f"no volume of {STORE_SECRET}"
    for c in all_containers(spec):
        if c["name"] == "kvrc":
            continue
        mounted = {m["name"] for m in c.get("volumeMounts", [])} & store_volumes
        assert not mounted, f"{c['name']} mounts {mounted}"
        for where, value in walk({"env": c.get("env", []), "envFrom": c.get("envFrom", [])}):
            if where.endswith((".secretKeyRef", ".secretRef")):
                raise AssertionError(f"{c['name']}{where}: {value}")


def engine_containers(spec: Doc) -> list[Doc]:
    engines = [c for c in spec["containers"] if c["name"] != "kvrc"]
    assert engines, "no engine container"
    return engines


def check_sidecar_is_native(docs: list[Doc]) -> None:
    # Started, and its startup probe passed, before the engines; stopped after them.
    spec = pod_spec(docs)
    kvrc = kvrc_container(spec)
    assert kvrc in spec.get("initContainers", []), "kvrc is not an init container"
    assert kvrc.get("restartPolicy") == "Always", "a plain init container: the pod would hang"
    assert "startupProbe" in kvrc, "the engines would start before kvrc serves"


def check_engines_use_loopback(docs: list[Doc]) -> None:
    for engine in engine_containers(pod_spec(docs)):
        env = {e["name"]: e.get("value") for e in engine["env"]}
        target = env.get("KVRC_TARGET")
        assert target == f"127.0.0.1:{GRPC_PORT}", f"{engine['name']}: KVRC_TARGET {target}"


def ingress_port_ranges(rule: Doc) -> list[tuple[int, int]]:
    return [(p["port"], p.get("endPort", p["port"])) for p in rule["ports"]]


def engine_policies(docs: list[Doc]) -> list[Doc]:
    labels = pod_labels(kvrc_workload(docs))
    return [
        d
        for d in docs
        if d["kind"] == "NetworkPolicy" and selects(d["spec"]["podSelector"]["matchLabels"], labels)
    ]


def check_grpc_port_private(docs: list[Doc]) -> None:
    # Only the pod's engines use the sidecar's gRPC port: not published, no pod admitted.
    service = service_of(docs, kvrc_workload(docs))
    assert GRPC_PORT not in {p["port"] for p in service["spec"]["ports"]}, "published"
    grpc_names = {
        p["name"]
        for p in kvrc_container(pod_spec(docs))["ports"]
        if p["containerPort"] == GRPC_PORT
    }
    assert not grpc_names & {p["targetPort"] for p in service["spec"]["ports"]}, "published"
    policies = engine_policies(docs)
    assert policies, "no NetworkPolicy: every pod reaches kvrc's gRPC port"
    for policy in policies:
        for rule in policy["spec"]["ingress"]:
            assert rule.get("ports"), f"{rule}: a rule without ports admits gRPC too"
            for low, high in ingress_port_ranges(rule):
                assert not low <= GRPC_PORT <= high, f"{rule} admits {GRPC_PORT}"


def check_engines_reach_each_other(docs: list[Doc]) -> None:
    """The KV transfers between pods: advertised pod IPs, Mooncake ports admitted."""
    kvrc = kvrc_workload(docs)
    ranges = []
    for engine in engine_containers(kvrc["spec"]["template"]["spec"]):
        env = {e["name"]: e for e in engine["env"]}
        # Peers read this engine's KV at VLLM_HOST_IP: 127.0.0.1 reaches no other pod.
        host = env.get("VLLM_HOST_IP", {})
        assert host.get("valueFrom") == {"fieldRef": {"fieldPath": "status.podIP"}}, host
        ranges.append((int(env["MC_MIN_RPC_PORT"]["value"]), int(env["MC_MAX_RPC_PORT"]["value"])))
    ranges.sort()
    for (_, high), (low, _) in itertools.pairwise(ranges):
        assert high < low, f"engines of one pod share Mooncake ports: {ranges}"
    admitted = [
        (low, high)
        for policy in engine_policies(docs)
        for rule in policy["spec"]["ingress"]
        if any(
            set(peer) == {"podSelector"}
            and selects(peer["podSelector"].get("matchLabels", {}), pod_labels(kvrc))
            for peer in rule.get("from", [])
        )
        for low, high in ingress_port_ranges(rule)
    ]
    for low, high in ranges:
        assert any(a <= low and high <= b for a, b in admitted), f"{low}-{high} closed: {admitted}"


def check_replicas_spread_with_one_disruption(docs: list[Doc]) -> None:
    kvrc = kvrc_workload(docs)
    replicas = kvrc["spec"]["replicas"]
    assert replicas >= 2, f"replicas {replicas}: no failover"
    # One voluntary disruption at a time (and not zero: node drains must proceed).
    pdbs = [
        d
        for d in docs
        if d["kind"] == "PodDisruptionBudget"
        and selects(d["spec"]["selector"]["matchLabels"], pod_labels(kvrc))
    ]
    assert len(pdbs) == 1
    budget = pdbs[0]["spec"]
    unavailable = budget.get("maxUnavailable", replicas - budget.get("minAvailable", replicas))
    assert unavailable == 1, f"{budget}: allows {unavailable} replicas down at once"
    # One replica per node.
    anti = kvrc["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    terms = anti["requiredDuringSchedulingIgnoredDuringExecution"]
    assert any(
        t["topologyKey"] == "kubernetes.io/hostname"
        and selects(t["labelSelector"]["matchLabels"], pod_labels(kvrc))
        for t in terms
    ), terms
    # Stable per-pod names (kvrc-0.kvrc, ...): a StatefulSet governed by a headless Service.
    assert kvrc["kind"] == "StatefulSet"
    service = service_of(docs, kvrc)
    assert kvrc["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"].get("clusterIP") == "None", "a load-balanced Service splits engines"


# check -> (function, the shapes it applies to)
SHAPE_CHECKS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "store_url": (check_store_url_names_the_redis_service, STORE_SHAPES),
    "password": (check_password_only_from_the_secret, STORE_SHAPES),
    "hash_seed": (check_hash_seed_from_the_secret, STORE_SHAPES),
    "network_policy": (check_only_kvrc_reaches_redis, STORE_SHAPES),
    "replicas": (check_replicas_spread_with_one_disruption, ("replicated",)),
    "secret_in_kvrc_only": (check_secret_only_in_kvrc, ("sidecar-shared",)),
    "native_sidecar": (check_sidecar_is_native, SIDECAR_SHAPES),
    "loopback": (check_engines_use_loopback, SIDECAR_SHAPES),
    "grpc_private": (check_grpc_port_private, SIDECAR_SHAPES),
    "transfers": (check_engines_reach_each_other, ("sidecar-shared",)),
}


@pytest.mark.parametrize(
    ("check", "shape"), [(c, shape) for c, (_, shapes) in SHAPE_CHECKS.items() for shape in shapes]
)
def test_shape_checks(check: str, shape: str) -> None:
    SHAPE_CHECKS[check][0](shape_docs(shape))


def test_only_store_shapes_admit_their_pods_to_redis() -> None:
    # Across every manifest: a pod that carries the label runs kvrc over the store.
    docs = [d for p in manifest_files() for d in load_docs(p)]
    check_store_label_only_on_kvrc_pods(docs)
    labelled = {
        w["metadata"]["name"] for w in workloads(docs) if selects(STORE_CLIENT, pod_labels(w))
    }
    assert labelled == {kvrc_workload(shape_docs(s))["metadata"]["name"] for s in STORE_SHAPES}
    # ... and fails when a memory-store kvrc (the plain sidecar) carries it.
    sidecar = copy.deepcopy(shape_docs("sidecar"))
    pod_labels(kvrc_workload(sidecar)).update(STORE_CLIENT)
    with pytest.raises(AssertionError):
        check_store_label_only_on_kvrc_pods(sidecar)


def _kvrc_args(docs: list[Doc]) -> list[str]:
    args: list[str] = container(kvrc_workload(docs), "kvrc")["args"]
    return args


def _set_flag(flag: str, value: str) -> Any:
    return lambda docs: _kvrc_args(docs).__setitem__(_kvrc_args(docs).index(flag) + 1, value)


def _redis(docs: list[Doc]) -> Doc:
    return container(redis_workload(docs), "redis")


def _policy(docs: list[Doc]) -> Doc:
    spec: Doc = named(docs, "NetworkPolicy", "kvrc-redis")["spec"]
    return spec


def _kvrc_pdb(docs: list[Doc]) -> Doc:
    spec: Doc = named(docs, "PodDisruptionBudget", "kvrc")["spec"]
    return spec


def _min_available_one(docs: list[Doc]) -> None:
    _kvrc_pdb(docs).pop("maxUnavailable", None)
    _kvrc_pdb(docs)["minAvailable"] = 1


def _kvrc_volumes(docs: list[Doc]) -> list[Doc]:
    volumes: list[Doc] = kvrc_workload(docs)["spec"]["template"]["spec"]["volumes"]
    return volumes


def _kvrc_env(docs: list[Doc]) -> list[Doc]:
    env: list[Doc] = container(kvrc_workload(docs), "kvrc")["env"]
    return env


def _seed(docs: list[Doc]) -> Doc:
    return next(e for e in _kvrc_env(docs) if e["name"] == "PYTHONHASHSEED")


def _engine(docs: list[Doc]) -> Doc:
    return engine_containers(pod_spec(docs))[0]


def _set_engine_env(name: str, value: str) -> Any:
    def mutate(docs: list[Doc]) -> None:
        env = _engine(docs)["env"]
        env[:] = [e for e in env if e["name"] != name] + [{"name": name, "value": value}]

    return mutate


def _kvrc_to_containers(docs: list[Doc]) -> None:
    spec = pod_spec(docs)
    kvrc = kvrc_container(spec)
    spec["initContainers"].remove(kvrc)
    kvrc.pop("restartPolicy")
    spec["containers"].insert(0, kvrc)


def _engine_policy(docs: list[Doc]) -> Doc:
    spec: Doc = named(docs, "NetworkPolicy", "llm-engine")["spec"]
    return spec


BREAKAGES: list[tuple[str, str, Any]] = [
    ("store_url", "memory", _set_flag("--store", "memory")),
    ("store_url", "another host", _set_flag("--store", "redis://redis:6379/0")),
    ("store_url", "another port", _set_flag("--store", "redis://kvrc-redis:6380/0")),
    ("store_url", "another ns form", _set_flag("--store", "redis://kvrc-redis.x.cluster:6379/0")),
    (
        "store_url",
        "Service renamed",
        lambda d: named(d, "Service", "kvrc-redis")["metadata"].__setitem__("name", "redis"),
    ),
    (
        "store_url",
        "Redis on another port",
        lambda d: named(d, "ConfigMap", "kvrc-redis")["data"].__setitem__(
            "redis.conf", "port 6380\n"
        ),
    ),
    ("password", "file outside the Secret", _set_flag("--store-password-file", "/tmp/password")),
    (
        "password",
        "env literal",
        lambda d: container(kvrc_workload(d), "kvrc").__setitem__(
            "env", [{"name": "KVRC_STORE_PASSWORD", "value": "hunter2"}]
        ),
    ),
    (
        "password",
        "another Secret",
        lambda d: next(v for v in _kvrc_volumes(d) if "secret" in v)["secret"].__setitem__(
            "secretName", "other"
        ),
    ),
    (
        "password",
        "requirepass in argv",
        lambda d: _redis(d).__setitem__("command", ["redis-server", "--requirepass", "hunter2"]),
    ),
    (
        "password",
        "requirepass in the ConfigMap",
        lambda d: named(d, "ConfigMap", "kvrc-redis")["data"].__setitem__(
            "redis.conf", "requirepass hunter2\n"
        ),
    ),
    (
        "password",
        "probe with a literal",
        lambda d: _redis(d)["readinessProbe"]["exec"].__setitem__(
            "command", ["redis-cli", "-a", "hunter2", "ping"]
        ),
    ),
    (
        "password",
        "Redis without a password",
        lambda d: _redis(d).__setitem__("command", ["redis-server", "/etc/redis/redis.conf"]),
    ),
    (
        "password",
        "a Secret shipped",
        lambda d: d.append({"kind": "Secret", "metadata": {"name": STORE_SECRET}}),
    ),
    ("network_policy", "no policy", lambda d: d.remove(named(d, "NetworkPolicy", "kvrc-redis"))),
    (
        "network_policy",
        "selects other pods",
        lambda d: _policy(d)["podSelector"]["matchLabels"].__setitem__(
            "app.kubernetes.io/component", "x"
        ),
    ),
    ("network_policy", "admits all", lambda d: _policy(d)["ingress"][0].pop("from")),
    (
        "network_policy",
        "admits every pod",
        lambda d: _policy(d)["ingress"][0]["from"][0].__setitem__("podSelector", {}),
    ),
    (
        "network_policy",
        "admits engines",
        lambda d: _policy(d)["ingress"][0]["from"].append(
            {"podSelector": {"matchLabels": {"kvrc.io/client": "true"}}}
        ),
    ),
    (
        "network_policy",
        "admits a namespace",
        lambda d: _policy(d)["ingress"][0]["from"][0].__setitem__(
            "namespaceSelector", {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
        ),
    ),
    (
        "network_policy",
        "a second policy admitting all",
        lambda d: d.append(
            {
                "kind": "NetworkPolicy",
                "metadata": {"name": "open"},
                "spec": {"podSelector": {}, "ingress": [{}]},
            }
        ),
    ),
    ("network_policy", "egress only", lambda d: _policy(d).__setitem__("policyTypes", ["Egress"])),
    ("replicas", "one replica", lambda d: kvrc_workload(d)["spec"].__setitem__("replicas", 1)),
    ("replicas", "PDB allows two", lambda d: _kvrc_pdb(d).__setitem__("maxUnavailable", 2)),
    ("replicas", "PDB minAvailable 1 of 3", _min_available_one),
    ("replicas", "PDB blocks every drain", lambda d: _kvrc_pdb(d).__setitem__("maxUnavailable", 0)),
    (
        "replicas",
        "no anti-affinity",
        lambda d: kvrc_workload(d)["spec"]["template"]["spec"].pop("affinity"),
    ),
    (
        "replicas",
        "anti-affinity by zone only",
        lambda d: kvrc_workload(d)["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ][0].__setitem__("topologyKey", "topology.kubernetes.io/zone"),
    ),
    (
        "replicas",
        "load-balanced Service",
        lambda d: named(d, "Service", "kvrc")["spec"].pop("clusterIP"),
    ),
    ("replicas", "no governing Service", lambda d: kvrc_workload(d)["spec"].pop("serviceName")),
    (
        "network_policy",
        "kvrc's pods unlabelled",
        lambda d: pod_labels(kvrc_workload(d)).pop("kvrc.io/store-client"),
    ),
    (
        "network_policy",
        "Redis's pods labelled",
        lambda d: pod_labels(redis_workload(d)).update(STORE_CLIENT),
    ),
    ("hash_seed", "none", lambda d: _kvrc_env(d).remove(_seed(d))),
    ("hash_seed", "a literal", lambda d: _seed(d).update(value="42") or _seed(d).pop("valueFrom")),
    (
        "hash_seed",
        "another key",
        lambda d: _seed(d)["valueFrom"]["secretKeyRef"].update(key="seed"),
    ),
    (
        "hash_seed",
        "another Secret",
        lambda d: _seed(d)["valueFrom"]["secretKeyRef"].update(name="other"),
    ),
    ("hash_seed", "twice", lambda d: _kvrc_env(d).append(copy.deepcopy(_seed(d)))),
    (
        "secret_in_kvrc_only",
        "an engine mounts it",
        lambda d: (
            _engine(d)
            .setdefault("volumeMounts", [])
            .append({"name": "kvrc-store-password", "mountPath": "/etc/kvrc-store"})
        ),
    ),
    (
        "secret_in_kvrc_only",
        "an engine's env from it",
        lambda d: _engine(d)["env"].append(
            {
                "name": "KVRC_STORE_PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": STORE_SECRET, "key": "password"}},
            }
        ),
    ),
    (
        "secret_in_kvrc_only",
        "an engine's envFrom it",
        lambda d: _engine(d).__setitem__("envFrom", [{"secretRef": {"name": STORE_SECRET}}]),
    ),
    (
        "native_sidecar",
        "a plain init container",
        lambda d: kvrc_container(pod_spec(d)).pop("restartPolicy"),
    ),
    ("native_sidecar", "a regular container", _kvrc_to_containers),
    (
        "native_sidecar",
        "no startup probe",
        lambda d: kvrc_container(pod_spec(d)).pop("startupProbe"),
    ),
    ("loopback", "the Service's name", _set_engine_env("KVRC_TARGET", "kvrc:50051")),
    ("loopback", "another port", _set_engine_env("KVRC_TARGET", "127.0.0.1:50052")),
    ("loopback", "no target", lambda d: _engine(d).__setitem__("env", [])),
    (
        "grpc_private",
        "Service publishes it",
        lambda d: service_of(d, kvrc_workload(d))["spec"]["ports"].append(
            {"name": "kvrc-grpc", "port": 50051, "targetPort": "kvrc-grpc"}
        ),
    ),
    (
        "grpc_private",
        "Service targets it",
        lambda d: service_of(d, kvrc_workload(d))["spec"]["ports"].append(
            {"name": "x", "port": 80, "targetPort": "kvrc-grpc"}
        ),
    ),
    (
        "grpc_private",
        "policy admits it",
        lambda d: _engine_policy(d)["ingress"][0]["ports"].append({"port": GRPC_PORT}),
    ),
    (
        "grpc_private",
        "a range covers it",
        lambda d: _engine_policy(d)["ingress"][0]["ports"].append(
            {"port": 50000, "endPort": 50100}
        ),
    ),
    (
        "grpc_private",
        "a rule without ports",
        lambda d: _engine_policy(d)["ingress"][0].pop("ports"),
    ),
    ("grpc_private", "no policy", lambda d: d.remove(named(d, "NetworkPolicy", "llm-engine"))),
    ("transfers", "engines advertise loopback", _set_engine_env("VLLM_HOST_IP", "127.0.0.1")),
    ("transfers", "Mooncake ports closed", lambda d: _engine_policy(d)["ingress"].pop(1)),
    (
        "transfers",
        "range too short",
        lambda d: _engine_policy(d)["ingress"][1]["ports"][0].update(endPort=15499),
    ),
    (
        "transfers",
        "from other namespaces",
        lambda d: _engine_policy(d)["ingress"][1]["from"][0].update(namespaceSelector={}),
    ),
    (
        "transfers",
        "from other pods only",
        lambda d: _engine_policy(d)["ingress"][1]["from"][0].update(
            podSelector={"matchLabels": {"app.kubernetes.io/name": "other"}}
        ),
    ),
    ("transfers", "overlapping ranges", _set_engine_env("MC_MAX_RPC_PORT", "15500")),
]


def _breakage_cases() -> Iterator[Any]:
    for check, why, mutate in BREAKAGES:
        for shape in SHAPE_CHECKS[check][1]:
            yield pytest.param(check, shape, mutate, id=f"{check}-{shape}-{why}")


@pytest.mark.parametrize(("check", "shape", "mutate"), list(_breakage_cases()))
def test_shape_checks_fail_on_broken_manifests(check: str, shape: str, mutate: Any) -> None:
    docs = copy.deepcopy(shape_docs(shape))
    SHAPE_CHECKS[check][0](copy.deepcopy(docs))  # passes as shipped
    mutate(docs)
    with pytest.raises((AssertionError, KeyError, ConfigError)):
        SHAPE_CHECKS[check][0](docs)


def test_redis_is_durable_pinned_and_locked_down() -> None:
    docs = replicated()
    redis = redis_workload(docs)
    conf = redis_conf(docs)
    assert conf_value(conf, "appendonly") == "yes", "a restart without AOF is a store loss"
    # Never evict kvrc's keys (an evicted epoch is a store loss); a full Redis refuses writes.
    assert conf_value(conf, "maxmemory-policy") == "noeviction"
    # The append-only file lands on the PVC.
    claims = {t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]}
    mounts = {Path(m["mountPath"]): m["name"] for m in container(redis, "redis")["volumeMounts"]}
    assert mounts.get(Path(conf_value(conf, "dir") or "/data")) in claims
    assert redis["spec"]["replicas"] == 1, "kvrc supports one Redis primary"
    # Pinned like kvrc's image: a version tag (or a digest), never latest.
    for workload, name in ((redis, "redis"), (kvrc_workload(docs), "kvrc")):
        image = container(workload, name)["image"]
        assert re.search(r"(:\d+\.\d+\.\d+[\w.-]*|@sha256:[0-9a-f]{64})$", image), image
    spec = redis["spec"]["template"]["spec"]
    security = {**spec["securityContext"], **container(redis, "redis")["securityContext"]}
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security["seccompProfile"]["type"] == "RuntimeDefault"
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container(redis, "redis")["resources"][kind])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in container(redis, "redis"), probe


@contextlib.contextmanager
def manifest_redis(tmp_path: Path, password: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """Redis run with the manifest's own command and redis.conf, on a free loopback port.

    Paths under /etc and /data are moved into tmp_path (`local_path`); the password
    file is the Secret's as the kubelet mounts it.
    """
    require_redis_server()
    docs = replicated()
    redis = container(redis_workload(docs), "redis")
    port = free_port()
    (tmp_path / "etc" / "redis").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    conf = re.sub(r"^port .*$", f"port {port}", redis_conf(docs), flags=re.M)
    (tmp_path / "etc" / "redis" / "redis.conf").write_text(
        local_path(tmp_path, conf).replace("* -::*", "127.0.0.1")
    )
    secret_dir = tmp_path / "etc" / "kvrc-store"
    secret_dir.mkdir()
    (secret_dir / "password").write_text(password)
    command = [local_path(tmp_path, a) for a in redis["command"]]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            assert time.monotonic() < deadline, "redis-server did not listen within 10 s"
            time.sleep(0.02)
        yield process, port
    finally:
        process.terminate()
        process.wait(10)


def local_path(tmp_path: Path, text: str) -> str:
    return text.replace("/etc/", f"{tmp_path}/etc/").replace("/data", f"{tmp_path}/data")


def test_redis_command_takes_requirepass_from_the_secret(tmp_path: Path) -> None:
    """The manifest's own command and probe, run against a real redis-server."""
    redis = container(redis_workload(replicated()), "redis")
    password = "c0ffee" * 8
    secret = tmp_path / "etc" / "kvrc-store" / "password"
    with manifest_redis(tmp_path, password) as (process, port):

        def client(password: str | None) -> redis_lib.Redis:
            # No retries: a refused password must fail at once, not after backoffs.
            return redis_lib.Redis(
                port=port, password=password, socket_timeout=2, retry=Retry(NoBackoff(), 0)
            )

        assert client(password).config_get("appendonly") == {"appendonly": "yes"}
        with pytest.raises(redis_lib.AuthenticationError):
            client(None).ping()
        with pytest.raises(redis_lib.AuthenticationError):
            client("wrong").ping()
        # `exec`: Redis is the container's process, and the password is in no argv or env.
        proc = Path(f"/proc/{process.pid}")
        assert "redis-server" in (proc / "cmdline").read_text()
        for name in ("cmdline", "environ"):
            assert password not in (proc / name).read_text(errors="replace"), name
        # The readiness probe's command authenticates from the same file.
        probe = [local_path(tmp_path, a) for a in redis["readinessProbe"]["exec"]["command"]]
        probe[-1] = probe[-1].replace("redis-cli", f"redis-cli -p {port}")
        assert subprocess.run(probe, timeout=10).returncode == 0
        secret.write_text("wrong")
        assert subprocess.run(probe, timeout=10).returncode != 0


def test_sidecar_shared_kvrc_joins_the_manifest_redis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sidecars with the manifest's flags reach the manifest's Redis with the Secret's file.

    Only the listen addresses and the store's host and port are local (the Service
    name is checked above); the password file, profiles and hash seed are the
    manifest's, moved into tmp_path.
    """
    docs = shape_docs("sidecar-shared")
    spec = pod_spec(docs)
    args = list(kvrc_container(spec)["args"])
    for flag in ("--listen", "--metrics-port"):  # the harness picks free ports
        del args[args.index(flag) : args.index(flag) + 2]
    profiles = Path(flag_value(args, "--profiles"))
    password = "5eed" * 16
    monkeypatch.setenv("PYTHONHASHSEED", "12345")  # the Secret's hash-seed
    with manifest_redis(tmp_path, password) as (_, port):
        args[args.index("--store") + 1] = f"redis://127.0.0.1:{port}/0"
        args = [local_path(tmp_path, a) for a in args]
        local_profiles = Path(local_path(tmp_path, str(profiles)))
        local_profiles.parent.mkdir(parents=True)
        local_profiles.write_text(named(docs, "ConfigMap", "kvrc-profiles")["data"][profiles.name])
        with start_coordinator(*args) as a, start_coordinator(*args) as b:
            for kvrc in (a, b):

                def store_up(kvrc: CoordinatorProcess = kvrc) -> bool:
                    return metric_value(kvrc, "kvrc_store_up") == 1

                wait_until_sync(store_up, 20)
                assert metric_value(kvrc, "kvrc_store_losses_total") == 0
                # The password is in no argv.
                assert password not in Path(f"/proc/{kvrc.process.pid}/cmdline").read_text()


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
        if where in STORE_SHAPES:
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
