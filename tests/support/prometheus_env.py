"""Prometheus for the tests: the real binaries, a real server, and kvrc's metric catalogue.

`promtool()` / `prometheus()` find Debian's `prometheus` package binaries, installing
the package (`apt-get install --no-install-recommends prometheus`) when it is
missing and this process may do so (root with apt-get). `.ci/run` installs it too.

`running_prometheus()` starts a real Prometheus on 127.0.0.1 (ephemeral port,
temporary storage) that scrapes the given targets every second, and stops it.

`metric_catalog()` lists what a `Metrics` registry exports, read from the
collector objects so that unlabelled families still show their label names.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from harness import free_port
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.metrics import MetricWrapperBase

from coordinator.runtime.metrics import Metrics

_APT_PACKAGE = "prometheus"
_INSTALL_TIMEOUT_S = 600


class PrometheusUnavailable(RuntimeError):
    """The Prometheus binaries are missing and cannot be installed here; says why."""


def _find_or_install(binary: str) -> Path:
    found = shutil.which(binary)
    if found:
        return Path(found)
    apt_get = shutil.which("apt-get")
    if os.geteuid() != 0 or apt_get is None:
        raise PrometheusUnavailable(
            f"{binary} not found; install Debian's package: "
            f"sudo apt-get install -y --no-install-recommends {_APT_PACKAGE}"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [apt_get, "install", "-y", "-qq", "--no-install-recommends", _APT_PACKAGE]
    result = subprocess.run(install, env=env, capture_output=True, timeout=_INSTALL_TIMEOUT_S)
    if result.returncode != 0:
        # The package lists may be missing on a fresh machine.
        subprocess.run(
            [apt_get, "update", "-qq"], env=env, capture_output=True, timeout=_INSTALL_TIMEOUT_S
        )
        result = subprocess.run(install, env=env, capture_output=True, timeout=_INSTALL_TIMEOUT_S)
    found = shutil.which(binary)
    if found is None:
        raise PrometheusUnavailable(
            f"apt-get install {_APT_PACKAGE} did not provide {binary}: "
            f"{result.stderr.decode(errors='replace')[-2000:]}"
        )
    return Path(found)


def promtool() -> Path:
    return _find_or_install("promtool")


def prometheus() -> Path:
    return _find_or_install("prometheus")


def promtool_check_metrics(exposition: bytes) -> subprocess.CompletedProcess[bytes]:
    """Runs `promtool check metrics` (the exposition linter) over the text format."""
    return subprocess.run(
        [str(promtool()), "check", "metrics"], input=exposition, capture_output=True, timeout=60
    )


# --- kvrc's metric catalogue ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class MetricFamily:
    """One metric family as Prometheus stores it."""

    exported_name: str  # counters with `_total`, info with `_info`
    metric_type: str  # counter, gauge, histogram, info
    label_names: tuple[str, ...]
    help_text: str

    def sample_names(self) -> frozenset[str]:
        """Series names a query may use (histograms: `_bucket`, `_sum`, `_count`)."""
        if self.metric_type == "histogram":
            return frozenset(self.exported_name + s for s in ("_bucket", "_sum", "_count"))
        return frozenset({self.exported_name})


def _collectors(metrics: Metrics) -> list[MetricWrapperBase]:
    return [v for v in vars(metrics).values() if isinstance(v, MetricWrapperBase)]


def metric_catalog(metrics: Metrics) -> dict[str, MetricFamily]:
    """Exported name -> family, for every collector attribute of `metrics`."""
    catalog: dict[str, MetricFamily] = {}
    for collector in _collectors(metrics):
        # prometheus-client keeps these only as private attributes; a fresh
        # registry has no samples for labelled families, so samples cannot tell.
        name: str = collector._name
        metric_type: str = collector._type or "untyped"
        label_names: tuple[str, ...] = tuple(collector._labelnames)
        if metric_type == "counter":
            name += "_total"
        elif metric_type == "info":
            name += "_info"
            label_names = tuple(
                sorted({k for f in collector.collect() for s in f.samples for k in s.labels})
            )
        catalog[name] = MetricFamily(name, metric_type, label_names, collector._documentation)
    return catalog


def samples_per_series(metrics: Metrics) -> dict[str, int]:
    """Exported name -> lines one series writes: a histogram's buckets (+Inf too),
    `_sum` and `_count`; 1 for the others (no `_created`: coordinator/runtime/metrics.py)."""
    return {
        name: len(collector._upper_bounds) + 2 if isinstance(collector, Histogram) else 1
        for collector, name in zip(_collectors(metrics), metric_catalog(metrics), strict=True)
    }


def registry_family_names(registry: CollectorRegistry) -> frozenset[str]:
    """Exported family names as the registry itself reports them (collectors included)."""
    names = set()
    for family in registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "info":
            names.add(family.name + "_info")
        else:
            names.add(family.name)
    return frozenset(names)


def exercise_all_metrics(metrics: Metrics) -> None:
    """Gives every metric at least one series, with label values of the documented shape."""
    for collector in _collectors(metrics):
        label_names = tuple(collector._labelnames)
        target: Any = (
            collector.labels(*(f"sample_{n}" for n in label_names)) if label_names else collector
        )
        if collector._type == "counter":
            target.inc(3)
        elif collector._type == "gauge":
            target.set(2)
        elif collector._type == "histogram":
            target.observe(0.002)
            target.observe(7)


# --- docs/metrics.md ------------------------------------------------------------

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
_HEADER = re.compile(r"^\|\s*metric\s*\|\s*type\s*\|\s*labels\s*\|\s*meaning\s*\|\s*$")
_BACKTICKED = re.compile(r"`([^`]+)`")


@dataclass(frozen=True, slots=True)
class DocumentedMetric:
    name: str
    metric_type: str
    # label name -> its allowed values (empty: not an enumerated label)
    labels: dict[str, frozenset[str]]


def parse_metrics_doc(text: str) -> dict[str, DocumentedMetric]:
    """The `| metric | type | labels | meaning |` table of docs/metrics.md."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _HEADER.match(line)), None)
    if start is None:
        raise AssertionError("docs/metrics.md has no '| metric | type | labels | meaning |' table")
    documented: dict[str, DocumentedMetric] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4:
            raise AssertionError(f"metrics table row has {len(cells)} cells, not 4: {line}")
        names = _BACKTICKED.findall(cells[0])
        if len(names) != 1:
            raise AssertionError(f"metrics table row must name one metric: {line}")
        name = names[0]
        if name in documented:
            raise AssertionError(f"{name} is documented twice")
        labels: dict[str, frozenset[str]] = {}
        for part in filter(None, (p.strip() for p in cells[2].split("<br>"))):
            tokens = _BACKTICKED.findall(part)
            if not tokens:
                raise AssertionError(f"{name}: label cell part without a `label`: {part!r}")
            labels[tokens[0]] = frozenset(tokens[1:])
        documented[name] = DocumentedMetric(name, cells[1], labels)
    return documented


# --- a real Prometheus server ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrometheusServer:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; returns `data`, raises on a non-success answer."""
        url = f"{self.base_url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector result."""
        data = self.api("query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result

    def wait_for(self, expr: str, predicate: Any, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Polls `expr` until `predicate(result)` holds; fails with the last result."""
        deadline = time.monotonic() + timeout_s
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(expr)
            if predicate(result):
                return result
            time.sleep(0.25)
        raise AssertionError(
            f"{expr!r} did not reach the expected value in {timeout_s}s; last: {result}\n"
            f"targets: {self.api('targets')}\nlog tail: {self.log_tail()}"
        )

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def _config(targets: Sequence[str], rule_groups: Sequence[Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "kvrc", "static_configs": [{"targets": list(targets)}]}],
    }
    if rule_groups:
        config["rule_files"] = ["rules.yml"]
    return config


@contextlib.contextmanager
def running_prometheus(
    targets: Sequence[str], rule_groups: Sequence[Any] = (), ready_timeout_s: float = 30.0
) -> Iterator[PrometheusServer]:
    """A real Prometheus on 127.0.0.1 scraping `targets` ("host:port") every second
    as job "kvrc", evaluating `rule_groups` (Prometheus rule groups) every second."""
    binary = prometheus()
    with tempfile.TemporaryDirectory(prefix="kvrc-prom-") as tmp:
        workdir = Path(tmp)
        config = workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(_config(targets, rule_groups)))
        (workdir / "rules.yml").write_text(yaml.safe_dump({"groups": list(rule_groups)}))
        log_path = workdir / "prometheus.log"
        port = free_port()
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [
                    str(binary),
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )
        server = PrometheusServer(f"http://127.0.0.1:{port}", process, log_path)
        try:
            _wait_ready(server, ready_timeout_s)
            yield server
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)


def _wait_ready(server: PrometheusServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(f"prometheus exited early: {server.log_tail()}")
        try:
            with urllib.request.urlopen(f"{server.base_url}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"prometheus not ready in {timeout_s}s: {server.log_tail()}")
