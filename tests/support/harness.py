"""Real processes for tests: a kvrc coordinator and engine rank parts.

    from harness import start_coordinator, start_engine_part

    with start_coordinator("--heartbeat-timeout-ms", "800") as kvrc:   # a sync context manager
        part = start_engine_part(kvrc.grpc_target, engine_id="e1", tp_rank=0, tp_size=2)
        ...

`start_coordinator` launches `python -m coordinator serve` on 127.0.0.1 with an
ephemeral gRPC port and metrics port (unless `listen=` names one), waits for
its port file, and on exit stops it with SIGTERM and asserts that it exited 0
without a traceback on stderr. It is synchronous on purpose (it is usable from
async tests too: it blocks only for process start and stop). Engine parts are
stopped (SIGKILL) when their coordinator context exits.

Also here: `metric_value` (one sample of /metrics), `get_status`, `find_lease`,
`resolve_quarantine`, `wait_until` (re-exported from tests/support/waiting.py), and the
two halves of a command process (`serve_commands` in the engine script, `CommandProcess`
in the test) that tests/lease_engine.py and tests/fault_engine.py are built on.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from waiting import wait_until as wait_until  # re-exported: tests import it from here

from clients.refengine.demo import child_process_env

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
ENGINE_PART_SCRIPT = REPO / "tests" / "support" / "engine_part.py"


# Every port free_port handed out in this test process: two callers that bind later
# (a vLLM engine's two ZMQ endpoints, two engines started together) never get the same.
_HANDED_OUT: set[int] = set()
_RNG = random.Random()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for bind(0) and outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free on every interface a moment ago (for servers started later, and tests
    that restart on one port), never one this process handed out before.

    Taken below the kernel's ephemeral range: a port from bind(0) was in that range,
    and an engine that binds it 20 s later (vLLM's start-up) found it taken by some
    outgoing connection meanwhile ("Address already in use")."""
    high = _ephemeral_low()
    low = max(1024, high - 12_000)
    while True:
        port = _RNG.randrange(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port


@dataclass
class CoordinatorProcess:
    process: subprocess.Popen[bytes]
    grpc_port: int
    metrics_port: int
    stderr_path: Path
    parts: list[EnginePartProcess] = field(default_factory=list)
    final_stderr: str | None = None  # set once the process has exited and been checked

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def stderr_text(self) -> str:
        if self.final_stderr is not None:
            return self.final_stderr
        return self.stderr_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        """Sends `sig` (once) and waits; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout_s)


def option_flags(options: Mapping[str, object]) -> list[str]:
    """Keyword options as flags: tp_rank=1 -> --tp-rank 1, True -> --flag, False/None -> none."""
    argv: list[str] = []
    for key, value in options.items():
        flag = f"--{key.replace('_', '-')}"
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return argv


def _wait_for_port_file(
    path: Path, process: subprocess.Popen[bytes], stderr_path: Path, timeout_s: float
) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            ports: dict[str, int] = json.loads(path.read_text())
            return ports
        if process.poll() is not None:
            raise RuntimeError(
                f"coordinator exited with {process.returncode} before serving:\n"
                + stderr_path.read_text(errors="replace")
            )
        time.sleep(0.02)
    process.kill()
    raise TimeoutError(f"coordinator did not serve within {timeout_s} s")


def serve_command(python: str, listen: str, port_file: Path, *args: str) -> list[str]:
    """`kvrc serve` on `listen`, metrics on a free port, both ports written to `port_file`."""
    return [
        python,
        "-m",
        "coordinator",
        "serve",
        "--listen",
        listen,
        "--metrics-port",
        "0",
        "--port-file",
        str(port_file),
        *args,
    ]


@contextlib.contextmanager
def start_coordinator(
    *extra_args: str,
    listen: str = "127.0.0.1:0",
    start_timeout_s: float = 30.0,
    check_exit: bool = True,
) -> Iterator[CoordinatorProcess]:
    """A real `kvrc serve` subprocess; see the module docstring."""
    with tempfile.TemporaryDirectory(prefix="kvrc-test-") as tmp:
        port_file = Path(tmp) / "ports.json"
        stderr_path = Path(tmp) / "stderr.log"
        with open(stderr_path, "wb") as stderr:
            process = subprocess.Popen(
                serve_command(PYTHON, listen, port_file, *extra_args),
                cwd=REPO,
                env=child_process_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        kvrc: CoordinatorProcess | None = None
        try:
            ports = _wait_for_port_file(port_file, process, stderr_path, start_timeout_s)
            kvrc = CoordinatorProcess(
                process, ports["grpc_port"], ports["metrics_port"], stderr_path
            )
            yield kvrc
        finally:
            if kvrc is not None:
                for part in kvrc.parts:
                    part.kill()
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            text = stderr_path.read_text(errors="replace")
            if kvrc is not None:
                kvrc.final_stderr = text
        if check_exit:
            assert "Traceback" not in text, f"coordinator stderr has a traceback:\n{text}"
            assert process.returncode == 0, f"coordinator exited {process.returncode}:\n{text}"


@contextlib.asynccontextmanager
async def coordinator_off_loop(
    *extra_args: str, **options: Any
) -> AsyncIterator[CoordinatorProcess]:
    """`start_coordinator`, started and stopped in a thread: for an async test that
    starts (or stops) a coordinator while its engine sessions heartbeat on its loop. A
    start on a loaded host can outlast kvrc's heartbeat timeout (5 s); run on the loop
    it would stall those heartbeats, and their coordinator would drop the engines."""
    import asyncio

    manager = start_coordinator(*extra_args, **options)
    kvrc = await asyncio.to_thread(manager.__enter__)
    try:
        yield kvrc
    except BaseException as e:
        if not await asyncio.to_thread(manager.__exit__, type(e), e, e.__traceback__):
            raise
    else:
        await asyncio.to_thread(manager.__exit__, None, None, None)


def metric_value(kvrc: CoordinatorProcess, name: str, **labels: str) -> float:
    """One sample of kvrc's /metrics: `name` with exactly these labels; 0.0 when absent."""
    import urllib.request

    with urllib.request.urlopen(kvrc.metrics_url, timeout=10) as response:
        body = response.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in body.splitlines():
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        if m and m.group(1) == name:
            got = ",".join(sorted(m.group(2).split(","))) if m.group(2) else ""
            if got == want:
                return float(m.group(3))
    return 0.0


@dataclass
class EnginePartProcess:
    """A real rank-part process (tests/engine_part.py)."""

    process: subprocess.Popen[str]
    first_line: dict[str, Any]
    _stdout: IO[str]

    @property
    def registered(self) -> bool:
        return bool(self.first_line.get("registered"))

    def next_line(self, timeout_s: float = 10.0) -> dict[str, Any]:
        return _read_json_line(self.process, self._stdout, timeout_s)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.process.wait(timeout=10)

    def terminate(self, timeout_s: float = 10.0) -> int:
        """SIGTERM: the part closes its session cleanly; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout_s)


def _read_json_line(
    process: subprocess.Popen[str], stdout: IO[str], timeout_s: float
) -> dict[str, Any]:
    # The part prints whole lines and flushes: a blocking readline with a watchdog.
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not result or not result[0]:
        process.kill()
        raise TimeoutError(f"engine part printed no line within {timeout_s} s")
    line: dict[str, Any] = json.loads(result[0])
    return line


def start_engine_part(
    target: str,
    *args: str,
    coordinator: CoordinatorProcess | None = None,
    timeout_s: float = 20.0,
    **options: str | int,
) -> EnginePartProcess:
    """Starts tests/engine_part.py; options become flags (tp_rank=1 -> --tp-rank 1).

    Returns once the part printed its first JSON line (registered or refused).
    Pass `coordinator=` to have the part killed when that coordinator stops.
    """
    argv = [PYTHON, str(ENGINE_PART_SCRIPT), "--target", target, *args, *option_flags(options)]
    process = subprocess.Popen(
        argv,
        cwd=REPO,
        env=child_process_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=None,  # pytest captures it and shows it when a test fails
        text=True,
    )
    assert process.stdout is not None
    part = EnginePartProcess(process, {}, process.stdout)
    if coordinator is not None:
        coordinator.parts.append(part)
    try:
        part.first_line = part.next_line(timeout_s)
    except BaseException:
        part.kill()
        raise
    return part


# --- async helpers for tests that talk gRPC in-process --------------------------------


def run_cli_detached(
    module: str, *args: str, timeout_s: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """`python -m <module> <args>`, output captured, with stdin closed and no controlling
    terminal: a prompt (an OpenSSL passphrase) reads EOF instead of blocking the test."""
    return subprocess.run(
        [PYTHON, "-m", module, *args],
        cwd=REPO,
        env=child_process_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        start_new_session=True,
    )


async def run_cli(
    module: str, *args: str, timeout_s: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """`python -m <module> <args>` (the `kvrc` or `coordinator` CLI), output captured.

    In a thread: an async test's engine sessions heartbeat on its event loop, and a CLI
    start on a loaded host outlasted kvrc's heartbeat timeout (the engine left the view)."""
    import asyncio

    return await asyncio.to_thread(
        subprocess.run,
        [PYTHON, "-m", module, *args],
        cwd=REPO,
        env=child_process_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


async def get_status(target: str, timeout_s: float = 5.0) -> Any:
    """AdminService.GetStatus over a fresh channel (a kvrc.v1 StatusResponse)."""
    import grpc

    from kvrc.v1 import kvrc_pb2, kvrc_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = kvrc_pb2_grpc.AdminServiceStub(channel)
        return await stub.GetStatus(kvrc_pb2.StatusRequest(), timeout=timeout_s)


async def child_engine_status(target: str, child_engine_id: str) -> Any | None:
    """The ChildEngineStatus of one child engine, or None when it is not registered."""
    status = await get_status(target)
    for child in status.child_engines:
        if child.state.child_engine_id == child_engine_id:
            return child
    return None


def without_heartbeat_times(status: Any) -> Any:
    """`status` (a StatusResponse or ChildEngineStatus) with its parts' heartbeat times
    zeroed: they move with every heartbeat, so a check that a refused call changed
    nothing compares everything else."""
    children = status.child_engines if hasattr(status, "child_engines") else [status]
    for child in children:
        for rank_part in child.parts:
            rank_part.last_heartbeat_unix_ms = 0
    return status


def find_lease(status: Any, lease_id: str) -> Any | None:
    """The LeaseStatus of `lease_id` in a StatusResponse, or None when it is not listed."""
    return next((lease for lease in status.leases if lease.lease_id == lease_id), None)


async def resolve_quarantine(target: str, lease_id: str) -> int:
    """AdminService.ResolveQuarantine (release), as an operator who proved it quiet: its state."""
    import grpc

    from kvrc.v1 import kvrc_pb2, kvrc_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        reply = await kvrc_pb2_grpc.AdminServiceStub(channel).ResolveQuarantine(
            kvrc_pb2.ResolveQuarantineRequest(
                lease_id=lease_id,
                resolution=kvrc_pb2.QUARANTINE_RESOLUTION_RELEASE,
                operator_note="test: proven quiet",
            ),
            timeout=5,
        )
        state: int = reply.state
        return state


# --- command processes: tests/lease_engine.py and tests/fault_engine.py -------------------


async def serve_commands(
    run: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],
    emit: Callable[[dict[str, Any]], None],
) -> None:
    """The process side: runs one JSON command per stdin line until SIGTERM or end of stdin.

    Commands run concurrently (some wait, e.g. BeginHandoff) and each gets one line
    `{"op", "tag", "ok": true, **result}`, or `"ok": false` with the client error's code.
    Commands still running at the end are cancelled.
    """
    import asyncio

    from clients.errors import KvrcClientError

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    lines: asyncio.Queue[str] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=read_stdin, daemon=True).start()

    async def serve(cmd: dict[str, Any]) -> None:
        try:
            result = await run(cmd)
            emit({"op": cmd["op"], "tag": cmd.get("tag"), "ok": True, **result})
        except KvrcClientError as e:
            emit(
                {
                    "op": cmd["op"],
                    "tag": cmd.get("tag"),
                    "ok": False,
                    "code": e.code.name,
                    "message": e.message,
                }
            )

    tasks: set[asyncio.Task[None]] = set()
    getter = asyncio.ensure_future(lines.get())
    stopper = asyncio.ensure_future(stop.wait())
    while True:
        done, _ = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if stopper in done:
            break
        cmd = json.loads(getter.result())
        getter = asyncio.ensure_future(lines.get())
        task = asyncio.create_task(serve(cmd))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    getter.cancel()
    for task in list(tasks):
        task.cancel()


class CommandProcess:
    """The test side: starts a command-process script, sends tagged commands, reads its lines.

    Synchronous (usable via to_thread). Subclasses keep the printed lines their own way
    (`_keep` is called from the reader thread) and find them with `wait_for`.
    """

    command_timeout_s = 15.0
    event_timeout_s = 10.0
    process: subprocess.Popen[str]

    def _spawn(self, script: Path, argv: list[str], *, quiet: bool = False) -> None:
        self._tags = 0
        self.process = subprocess.Popen(
            [PYTHON, str(script), *argv],
            cwd=REPO,
            env=child_process_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if quiet else None,
            text=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue
            self._keep(doc)

    def _keep(self, doc: dict[str, Any]) -> None:
        raise NotImplementedError

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float
    ) -> dict[str, Any]:
        raise NotImplementedError

    def event(
        self, kind: str, lease_id: str | None = None, timeout_s: float | None = None
    ) -> dict[str, Any]:
        return self.wait_for(
            lambda d: (
                d.get("event") == kind and (lease_id is None or d.get("lease_id") == lease_id)
            ),
            self.event_timeout_s if timeout_s is None else timeout_s,
        )

    def start_command(self, op: str, **fields: Any) -> str:
        self._tags += 1
        tag = f"t{self._tags}"
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, "tag": tag, **fields}) + "\n")
        self.process.stdin.flush()
        return tag

    def result(self, tag: str, timeout_s: float | None = None) -> dict[str, Any]:
        return self.wait_for(
            lambda d: d.get("tag") == tag and "ok" in d,
            self.command_timeout_s if timeout_s is None else timeout_s,
        )

    def command(self, op: str, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        return self.result(self.start_command(op, **fields), timeout_s)

    def kill(self) -> float:
        """SIGKILL; returns the unix time just before the signal."""
        t = time.time()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        return t

    def stop(self) -> None:
        """SIGTERM (after SIGCONT, in case a test stopped it); SIGKILL if it does not exit."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
