"""`kvrc demo`: kvrc with reuse on, two prefill engines and one decode engine.

Everything is real and on loopback: a `kvrc serve --reuse on` process and six
reference-engine processes (`kvrc engine`, tp=2 each), KV moved by Mooncake
between them. The driver replays a multi-turn chat workload (conversations
sharing system prompts); turns of a conversation alternate between the two
prefill engines, so each turn's prefix is retained elsewhere (by the decode
engine that served the previous turn, or the other prefill engine) and kvrc
grants a prefix load. Every loaded or handed-off block is compared with a
recomputation: `mismatches` must be 0.

Counts (table and `demo-result.json`): `requests` = chat turns (each a prefill
plus a decode handoff); `blocks_loaded` = prompt blocks pulled from another
engine under a kvrc lease; `blocks_local` = prompt blocks the prefill engine
still had; `blocks_recomputed` = blocks computed (prefill remainder, plus any
handoff that fell back to recompute); `hit_ratio` = (loaded + local) / prompt
blocks; `bytes_moved` = bytes every rank part pulled (loads and handoffs);
`native_reads` = Mooncake batch reads (one per rank part per load or
handoff), `read_s` = their summed durations (each timed from its submission
to the executor to its return), and `transfer_gbps` = bytes_moved / read_s /
1e9: GB/s inside the native batch reads, not over the wall time of requests
(which includes lookups, pins, compute and waits). The demo's reads are small
(a few hundred KiB per rank part) and latency-bound: `read_mean_kib` and
`read_mean_ms` say so; Mooncake's ~2 GB/s on loopback needs reads of MiBs.

Processes: each child runs in its own process group with a parent-death
signal; they are stopped on exit, on Ctrl-C / SIGTERM and at interpreter exit.
The cluster helpers (`Cluster`, `EngineGroup`) are reused by the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clients.errors import KvrcClientError

REPO = Path(__file__).resolve().parents[2]
MODEL = "kvrc/reference"
BLOCK_SIZE = 16
DEFAULT_MOONCAKE_PORTS = "25000-25999"
RESULT_KEYS = (
    "requests",
    "blocks_loaded",
    "blocks_recomputed",
    "handoffs",
    "bytes_moved",
    "mismatches",
    "transfer_gbps",
)
PROFILES_TOML = f"""# Declared profile of the demo's reference engines: reuse may be activated.
[[profile]]
name = "reference-demo"
model = "{MODEL}"
block_size = {BLOCK_SIZE}
kv_dtype = "bfloat16"
"""


def _with_parent_death_signal(argv: Sequence[str]) -> list[str]:
    """The child gets SIGKILL if the demo dies (even by SIGKILL): util-linux's setpriv
    sets PR_SET_PDEATHSIG and execs. Not a preexec_fn: forking a process whose gRPC
    threads are running (the soak restarts engines mid-load) crashed children."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else list(argv)


def child_process_env() -> dict[str, str]:
    """This environment for a child Python process: the repository first on
    PYTHONPATH (it runs from a checkout too) and unbuffered output (progress lines)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.stdout_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                doc = json.loads(line)
                if isinstance(doc, dict):
                    out.append(doc)
        return out

    def wait_event(self, event: str, timeout_s: float, **where: Any) -> dict[str, Any]:
        """The first `event` line whose fields include `where`."""
        deadline = time.monotonic() + timeout_s
        while True:
            for doc in self.events():
                if doc.get("event") == event and all(doc.get(k) == v for k, v in where.items()):
                    return doc
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode}:\n{self.stderr_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no {event!r} within {timeout_s} s")
            time.sleep(0.05)

    def stderr_tail(self, chars: int = 3000) -> str:
        return self.stderr_path.read_text(errors="replace")[-chars:]


@dataclass
class EngineGroup:
    """The rank-part processes of one engine; tp rank 0 leads."""

    engine_id: str
    role: str
    tp_size: int
    parts: list[Child] = field(default_factory=list)
    control_port: int = 0

    @property
    def leader(self) -> Child:
        return self.parts[0]


class Cluster:
    """Owns every child process of a demo or test; `stop()` leaves none behind."""

    def __init__(
        self,
        workdir: Path,
        python: str = sys.executable,
        engine_command: Sequence[str] = (),
    ) -> None:
        """`engine_command`: the argv before an engine's flags (default `kvrc engine`
        through clients/cli.py; tests run tests/support/refengine_faults.py)."""
        self.workdir = workdir
        self.python = python
        self.engine_command = list(engine_command) or [python, "-m", "clients.cli", "engine"]
        self.children: list[Child] = []
        self.coordinator: Child | None = None  # the one started last
        self.coordinators: list[Child] = []  # every kvrc started (replicas)
        self.coordinator_args: tuple[str, ...] = ()
        self.grpc_port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Child:
        """`env`: variables set on top of `child_process_env()` for this child."""
        stdout_path = self.workdir / f"{name}.out"
        stderr_path = self.workdir / f"{name}.err"
        with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
            process = subprocess.Popen(
                _with_parent_death_signal(argv),
                cwd=REPO,
                env={**child_process_env(), **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,  # its own process group: stopped as a whole
            )
        child = Child(name, process, stdout_path, stderr_path)
        self.children.append(child)
        return child

    def start_coordinator(
        self,
        *extra: str,
        port: int = 0,
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> dict[str, int]:
        """Start one kvrc; its bound ports (`grpc_port`, `metrics_port`)."""
        profiles = self.workdir / "profiles.toml"
        profiles.write_text(PROFILES_TOML)
        port_file = self.workdir / "ports.json"
        port_file.unlink(missing_ok=True)
        self.coordinator_args = extra
        self.coordinator = coordinator = self.spawn(
            f"kvrc-{len(self.children)}",
            [
                self.python, "-m", "coordinator", "serve",
                "--listen", f"127.0.0.1:{port}",
                "--metrics-port", "0",
                "--reuse", "on",
                "--profiles", str(profiles),
                "--port-file", str(port_file),
                "--log-level", "WARNING",
                *extra,
            ],
            env,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if self.coordinator.process.poll() is not None:
                raise RuntimeError(f"kvrc exited:\n{self.coordinator.stderr_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError("kvrc did not start")
            time.sleep(0.05)
        time.sleep(0.05)  # the file is written at once; let the writer finish
        ports = {k: int(v) for k, v in json.loads(port_file.read_text()).items()}
        self.grpc_port = ports["grpc_port"]
        self.coordinators.append(coordinator)
        return ports

    def restart_coordinator(self, timeout_s: float = 20.0) -> int:
        """Stop kvrc (SIGTERM) and start a new one on the same port; the old exit status."""
        assert self.coordinator is not None
        old = self.coordinator
        old.process.send_signal(signal.SIGTERM)
        status = old.process.wait(timeout_s)
        self.start_coordinator(*self.coordinator_args, port=self.grpc_port)
        return status

    def engine_argv(self, group: EngineGroup, tp_rank: int, extra: Sequence[str]) -> list[str]:
        argv = [
            *self.engine_command,
            "--role", group.role,
            "--engine-id", group.engine_id,
            "--tp-rank", str(tp_rank),
            "--tp-size", str(group.tp_size),
            "--target", self.target,
            "--model", MODEL,
            "--block-size", str(BLOCK_SIZE),
            *extra,
        ]  # fmt: skip
        if tp_rank > 0:
            argv += ["--leader", f"127.0.0.1:{group.control_port}"]
        return argv

    def start_engines(
        self,
        specs: Sequence[tuple[str, str, int, Sequence[str]]],
        timeout_s: float = 90.0,
        rank_extra: dict[tuple[str, int], Sequence[str]] | None = None,
    ) -> list[EngineGroup]:
        """Start engines (engine_id, role, tp_size, extra args): leaders first, then followers."""
        rank_extra = rank_extra or {}
        groups = []
        for engine_id, role, tp_size, extra in specs:
            group = EngineGroup(engine_id, role, tp_size)
            argv = self.engine_argv(group, 0, [*extra, *rank_extra.get((engine_id, 0), ())])
            group.parts.append(self.spawn(f"{engine_id}-tp0", argv))
            groups.append(group)
        for group, (_, _, _, extra) in zip(groups, specs, strict=True):
            group.control_port = int(
                group.leader.wait_event("listening", timeout_s)["control_port"]
            )
            for rank in range(1, group.tp_size):
                more = rank_extra.get((group.engine_id, rank), ())
                argv = self.engine_argv(group, rank, [*extra, *more])
                group.parts.append(self.spawn(f"{group.engine_id}-tp{rank}", argv))
        return groups

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every engine group, then kvrc; SIGKILL what is left. Idempotent."""
        kvrcs = [c for c in self.children if c in self.coordinators or c is self.coordinator]
        engines = [c for c in self.children if c not in kvrcs]
        ordered = engines + kvrcs
        for batch in (engines, ordered):
            for child in batch:
                if child.process.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(child.process.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for child in batch:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.process.wait(max(0.0, deadline - time.monotonic()))
        for child in ordered:
            # Whatever ignored SIGTERM (or its own children) goes now.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(5.0)


# ---------------------------------------------------------------------------
# The workload and the driver
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    conversation: int
    turn: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]


def chat_workload(
    conversations: int, turns: int, system_prompts: int = 2, seed: int = 7
) -> list[list[Turn]]:
    """Per conversation, its turns: prompt = system + history + new user message."""
    rng = random.Random(seed)
    systems = [
        [rng.randrange(1, 32000) for _ in range(4 * BLOCK_SIZE + rng.randrange(BLOCK_SIZE))]
        for _ in range(system_prompts)
    ]
    workload = []
    for c in range(conversations):
        history = list(systems[c % system_prompts])
        turns_of_c = []
        for t in range(turns):
            user = [rng.randrange(1, 32000) for _ in range(rng.randrange(20, 48))]
            output = [rng.randrange(1, 32000) for _ in range(rng.randrange(10, 40))]
            prompt = history + user
            turns_of_c.append(Turn(c, t, tuple(prompt), tuple(output)))
            history = prompt + output
        workload.append(turns_of_c)
    return workload


@dataclass
class Totals:
    requests: int = 0
    prompt_blocks: int = 0
    blocks_local: int = 0
    blocks_loaded: int = 0
    blocks_recomputed: int = 0
    handoffs: int = 0
    handoff_failures: int = 0
    load_failures: int = 0
    bytes_moved: int = 0
    native_reads: int = 0
    read_entries: int = 0
    read_s: float = 0.0  # summed durations of the native batch reads
    mismatches: int = 0

    @property
    def hit_ratio(self) -> float:
        if not self.prompt_blocks:
            return 0.0
        return (self.blocks_loaded + self.blocks_local) / self.prompt_blocks

    @property
    def transfer_gbps(self) -> float:
        """GB/s inside the native batch reads (bytes over their summed durations)."""
        return self.bytes_moved / self.read_s / 1e9 if self.read_s > 0 else 0.0

    def document(self, elapsed_s: float) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "blocks_loaded": self.blocks_loaded,
            "blocks_recomputed": self.blocks_recomputed,
            "blocks_local": self.blocks_local,
            "handoffs": self.handoffs,
            "bytes_moved": self.bytes_moved,
            "mismatches": self.mismatches,
            "transfer_gbps": round(self.transfer_gbps, 4),
            "native_reads": self.native_reads,
            "read_s": round(self.read_s, 4),
            "read_mean_kib": round(self.bytes_moved / self.native_reads / 1024, 1)
            if self.native_reads
            else 0.0,
            "read_mean_ms": round(1000 * self.read_s / self.native_reads, 3)
            if self.native_reads
            else 0.0,
            "read_mean_entries": round(self.read_entries / self.native_reads, 1)
            if self.native_reads
            else 0.0,
            "hit_ratio": round(self.hit_ratio, 4),
            "load_failures": self.load_failures,
            "handoff_failures": self.handoff_failures,
            "elapsed_s": round(elapsed_s, 2),
        }


async def drive(
    groups: Sequence[EngineGroup],
    workload: Sequence[Sequence[Turn]],
    *,
    concurrency: int,
    progress: bool,
) -> Totals:
    from clients.refengine.channel import Channel  # torch-free

    prefills = [g for g in groups if g.role == "prefill"]
    decode = next(g for g in groups if g.role == "decode")
    channels = {
        g.engine_id: await Channel.connect("127.0.0.1", g.control_port, name=g.engine_id)
        for g in groups
    }
    try:
        for g in groups:
            ready = await channels[g.engine_id].call("ready", timeout_s=120.0, wait_s=100.0)
            if g.role == "prefill" and not ready["reuse_enabled"]:
                raise RuntimeError(f"{g.engine_id}: reuse not enabled ({ready['reuse_reason']})")
        totals = Totals()
        total_turns = sum(len(c) for c in workload)
        done = 0
        gate = asyncio.Semaphore(concurrency)

        async def conversation(turns: Sequence[Turn]) -> None:
            nonlocal done
            for turn in turns:
                prefill = prefills[(turn.conversation + turn.turn) % len(prefills)]
                request_id = f"c{turn.conversation}-t{turn.turn}"
                async with gate:
                    pre = await channels[prefill.engine_id].call(
                        "prefill",
                        timeout_s=120.0,
                        request_id=request_id,
                        tokens=list(turn.prompt),
                        decode=decode.engine_id,
                    )
                    dec = await channels[decode.engine_id].call(
                        "decode",
                        timeout_s=120.0,
                        request_id=request_id,
                        prefill=prefill.engine_id,
                        prompt=list(turn.prompt),
                        output=list(turn.output),
                    )
                    await channels[prefill.engine_id].call(
                        "bind_handoff",
                        timeout_s=30.0,
                        request_id=request_id,
                        lease_id=dec["lease_id"],
                    )
                totals.requests += 1
                totals.prompt_blocks += -(-len(turn.prompt) // BLOCK_SIZE)
                totals.blocks_local += int(pre["blocks_local"])
                totals.blocks_loaded += int(pre["blocks_loaded"])
                totals.blocks_recomputed += int(pre["blocks_recomputed"])
                totals.blocks_recomputed += int(dec["blocks_recomputed"])
                totals.bytes_moved += int(pre["bytes"]) + int(dec["bytes"])
                totals.native_reads += int(pre["reads"]) + int(dec["reads"])
                totals.read_s += float(pre["read_s"]) + float(dec["read_s"])
                totals.read_entries += int(pre["read_entries"]) + int(dec["read_entries"])
                totals.mismatches += int(pre["mismatches"]) + int(dec["mismatches"])
                if pre["load"].startswith("failed"):
                    totals.load_failures += 1
                if dec["handoff"] == "pulled":
                    totals.handoffs += 1
                else:
                    totals.handoff_failures += 1
                done += 1
                if progress:
                    source = f" from {pre['source']}" if pre.get("blocks_loaded") else ""
                    print(
                        f"[{done:3d}/{total_turns}] {request_id:8s} {prefill.engine_id}: "
                        f"{pre['blocks_local']} local, {pre['blocks_loaded']} loaded{source}, "
                        f"{pre['blocks_recomputed']} computed; handoff -> "
                        f"{decode.engine_id}: {dec['handoff']}",
                        flush=True,
                    )

        await asyncio.gather(*(conversation(turns) for turns in workload))
        return totals
    finally:
        for channel in channels.values():
            await channel.close()


def format_table(doc: dict[str, Any]) -> str:
    rows = [
        ("requests", doc["requests"]),
        ("prefix blocks loaded", doc["blocks_loaded"]),
        ("prefix blocks local", doc["blocks_local"]),
        ("blocks recomputed", doc["blocks_recomputed"]),
        ("hit ratio", f"{doc['hit_ratio']:.3f}"),
        ("handoffs", doc["handoffs"]),
        ("bytes moved", doc["bytes_moved"]),
        ("native reads", doc["native_reads"]),
        ("mean read KiB", doc["read_mean_kib"]),
        ("mean read entries", doc["read_mean_entries"]),
        ("mean read ms", doc["read_mean_ms"]),
        ("GB/s inside native reads", f"{doc['transfer_gbps']:.3f}"),
        ("mismatches", doc["mismatches"]),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


# ---------------------------------------------------------------------------
# Command
# ---------------------------------------------------------------------------


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2, help="conversations in flight")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size of each engine")
    parser.add_argument("--json", type=Path, default=Path("demo-result.json"), dest="json_path")
    parser.add_argument("--mooncake-ports", default=DEFAULT_MOONCAKE_PORTS)
    parser.add_argument("--keep-logs", type=Path, help="write process logs here (kept)")
    parser.add_argument("--quiet", action="store_true", help="no per-request progress lines")
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="kvrc replicas (> 1 needs --store redis://...): prefill-1 on the second, "
        "so its prefix loads and handoffs cross replicas",
    )
    parser.add_argument("--store", default="memory", help="kvrc's --store (memory | redis://)")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    workdir_handle = None
    if args.keep_logs is not None:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
        workdir = args.keep_logs
    else:
        workdir_handle = tempfile.TemporaryDirectory(prefix="kvrc-demo-")
        workdir = Path(workdir_handle.name)
    cluster = Cluster(workdir)
    atexit.register(cluster.stop)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)

    def say(text: str) -> None:
        if not args.quiet:
            print(text, flush=True)

    if args.replicas < 1 or (args.replicas > 1 and args.store == "memory"):
        print(
            "kvrc demo: --replicas above 1 needs a shared store (--store redis://HOST:PORT/DB)",
            file=sys.stderr,
        )
        return 2
    try:
        say("starting kvrc (reuse on) ...")
        targets = []
        for _ in range(args.replicas):
            cluster.start_coordinator("--store", args.store)
            targets.append(cluster.target)
        say(f"kvrc serving on {', '.join(targets)}; starting 3 engines x tp={args.tp} ...")
        engine_extra = ["--mooncake-ports", args.mooncake_ports]

        def on_replica(index: int) -> list[str]:
            # Its own replica first, then the others to fail over to.
            order = targets[index % len(targets) :] + targets[: index % len(targets)]
            return [*engine_extra, "--target", ",".join(order)]

        groups = cluster.start_engines(
            [
                ("prefill-0", "prefill", args.tp, on_replica(0)),
                ("prefill-1", "prefill", args.tp, on_replica(1)),
                ("decode-0", "decode", args.tp, on_replica(0)),
            ]
        )
        workload = chat_workload(args.conversations, args.turns)
        say(
            f"driving {args.conversations} conversations x {args.turns} turns "
            f"({args.concurrency} in flight) ..."
        )
        totals = asyncio.run(
            drive(groups, workload, concurrency=args.concurrency, progress=not args.quiet)
        )
        doc = totals.document(time.monotonic() - started)
        doc["replicas"] = args.replicas
        print(format_table(doc), flush=True)
        args.json_path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        say(f"wrote {args.json_path} in {doc['elapsed_s']} s")
        return 0 if doc["mismatches"] == 0 else 1
    except KeyboardInterrupt:
        print("kvrc demo: interrupted; stopping every process", file=sys.stderr, flush=True)
        return 130
    except (RuntimeError, TimeoutError, OSError, KvrcClientError) as e:
        print(f"kvrc demo: failed: {e}", file=sys.stderr, flush=True)
        for child in cluster.children:
            if child.process.poll() not in (None, 0):
                print(f"--- {child.name} stderr ---\n{child.stderr_tail(1500)}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        # A second Ctrl-C during the stop must not leave processes: ignore it.
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            cluster.stop()
        finally:
            signal.signal(signal.SIGINT, old_int)
            atexit.unregister(cluster.stop)
            if workdir_handle is not None:
                workdir_handle.cleanup()
