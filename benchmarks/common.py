"""Helpers shared by the benchmarks: result files, percentiles, processes, a live `kvrc serve`
and its RPC-duration histogram."""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from clients.refengine.demo import child_process_env

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on, without the host name."""
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(terse=True),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "processor": _cpu_model(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_result(name: str, result: Mapping[str, Any], *, results_dir: Path = RESULTS_DIR) -> Path:
    """Write `<results_dir>/<name>.json`: the result plus when and where it was measured."""
    payload = dict(result)
    payload["measured_at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    payload["machine"] = machine_info()
    payload["argv"] = sys.argv[1:]
    path = results_dir / f"{name}.json"
    write_json(path, payload)
    return path


def write_json(path: Path, document: Mapping[str, Any]) -> None:
    """Write `document` as sorted, indented JSON, atomically (a reader never sees half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    partial.replace(path)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def stop_process(process: subprocess.Popen[Any]) -> None:
    """SIGTERM (graceful stop), SIGKILL if it has not exited within 20 s."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def rpc_histogram(metrics_url: str, method: str) -> dict[float, float]:
    """kvrc's own `kvrc_rpc_duration_seconds` buckets of one RPC method: le -> count."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "kvrc_rpc_duration_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels.get("method") == method:
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return buckets


def histogram_percentile_ms(
    after: Mapping[float, float], q: float, before: Mapping[float, float] | None = None
) -> float | None:
    """The upper edge (ms) of the bucket holding the q-th percentile of what `after`
    counted since `before` (cumulative bucket counts); None without data."""
    delta = {b: after[b] - (before or {}).get(b, 0.0) for b in after}
    total = delta.get(float("inf"), 0.0)
    if total <= 0:
        return None
    wanted = total * q / 100.0
    return next((bound * 1000.0 for bound in sorted(delta) if delta[bound] >= wanted), None)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class KvrcServe:
    """A `kvrc serve` process started by `start_kvrc`."""

    process: subprocess.Popen[bytes]
    grpc_port: int
    metrics_port: int  # -1: no metrics endpoint
    log: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def cpu_seconds(self) -> float:
        """User + system CPU of the coordinator process so far."""
        return process_cpu_seconds(self.process.pid)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM (graceful stop), SIGKILL if it has not exited within 20 s."""
        stop_process(self.process)


def start_kvrc(
    workdir: Path,
    profiles_toml: str,
    *,
    metrics: bool = True,
    timeout_s: float = 30.0,
    extra_args: Sequence[str] = (),
) -> KvrcServe:
    """`kvrc serve` on ephemeral loopback ports with reuse on and these declared profiles,
    plus `extra_args` (e.g. `--store redis://...`).

    Its output (WARNING and up) goes to `workdir/kvrc.log`; RuntimeError with the log's
    tail when it exits or writes no port file within `timeout_s`.
    """
    profiles = workdir / "profiles.toml"
    profiles.write_text(profiles_toml, encoding="utf-8")
    port_file = workdir / "ports.json"
    port_file.unlink(missing_ok=True)
    log = workdir / "kvrc.log"
    argv = [
        sys.executable,
        "-m",
        "coordinator",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--metrics-port",
        "0" if metrics else "-1",
        "--reuse",
        "on",
        "--profiles",
        str(profiles),
        "--port-file",
        str(port_file),
        "--log-level",
        "WARNING",
        *extra_args,
    ]
    with log.open("ab") as out:
        process = subprocess.Popen(
            argv,
            cwd=REPO,
            env=child_process_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    serve = KvrcServe(process, 0, -1, log)
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if process.poll() is not None:
            raise RuntimeError(f"kvrc serve exited at start:\n{serve.log_tail()}")
        if time.monotonic() > deadline:
            serve.stop()
            raise RuntimeError(
                f"kvrc serve wrote no port file in {timeout_s} s:\n{serve.log_tail()}"
            )
        time.sleep(0.02)
    ports = json.loads(port_file.read_text())
    serve.grpc_port = int(ports["grpc_port"])
    serve.metrics_port = int(ports["metrics_port"]) if metrics else -1
    return serve


# A bare grpc.aio unary echo on uvloop, in its own process like kvrc: the ceiling of a
# unary RPC on this machine, and its server CPU per call the unit of coordinator cost.
# It answers `response_bytes` zero bytes (argv[1]) to whatever it is sent.
_ECHO_SERVER = """
import asyncio, signal, sys
import grpc, uvloop

RESPONSE = bytes(int(sys.argv[1]))

async def echo(request, context):
    return RESPONSE

async def main():
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)

uvloop.run(main())
"""
ECHO_METHOD = "/bench.Echo/Echo"


def start_echo_server(response_bytes: int) -> tuple[subprocess.Popen[str], int]:
    """The echo process and its port; stop it with `stop_process`."""
    process = subprocess.Popen(
        [sys.executable, "-c", _ECHO_SERVER, str(response_bytes)],
        cwd=REPO,
        env=child_process_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        stop_process(process)
        raise RuntimeError("the echo server exited before it listened")
    return process, int(line)


async def drive_unary(
    channel: Any,
    method: str,
    requests: Sequence[bytes],
    seconds: float,
    server_pid: int,
    concurrency: int,
) -> tuple[float, float]:
    """(calls per second, server CPU µs per call) with `concurrency` calls in flight."""
    call = channel.unary_unary(method)  # bytes in, bytes out: no client-side (de)serializing
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker(offset: int) -> None:
        nonlocal done
        i = offset
        n = len(requests)
        while time.perf_counter() < deadline:
            await call(requests[i % n])
            i += 1
            done += 1

    cpu_before = process_cpu_seconds(server_pid)
    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - started
    return done / elapsed, (process_cpu_seconds(server_pid) - cpu_before) / done * 1e6
