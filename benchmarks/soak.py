"""`make soak`: kvrc and reference engines under mixed load and a seeded fault schedule.

    python -m benchmarks.soak [--minutes 10] [--store both|memory|redis] [--seed N]
                              [--check] [--out benchmarks/results/soak.json]

Everything is real and on loopback: `kvrc serve` processes (one on the memory
store, two replicas on a real `redis-server` with the Redis store), three
reference engines with tp=2 (two prefill, one decode: six rank-part
processes, KV moved by Mooncake), a vLLM-style ZMQ event stream (a PUB socket
here, registered like a vLLM engine's `kv_events_endpoint`), and this driver.

`--minutes` is the soak's whole load time, split evenly over the stores it runs
(`--store both`: half each). Each store's run: a fault-free phase (the first
quarter), then the faulted phase, then a drain. The load, all the time:
multi-turn chat requests (prefill with a prefix load where kvrc grants one,
decode handoff, every loaded or handed-off block compared with a
recomputation), Lookup RPCs, and the event stream. The fault schedule (seeded,
every kind at least once per run, then again in seeded order while time
lasts):

- `engine_part_kill`: kill -9 of one rank part, then the rest of its engine (the
  engine's supervisor), and a restart of the engine;
- `holder_stall`: SIGSTOP of a prefill engine (a holder) under load, SIGCONT later;
- `kvrc_restart`: SIGTERM of a kvrc process and a restart on its port;
- `replica_kill`, `redis_kill` (Redis store): kill -9 and restart (Redis empty);
- `wall_clock_step`: the kvrc processes' wall clock steps by an hour
  (libfaketime's timestamp file; the monotonic clock is left alone);
- `malformed_grpc`, `malformed_metrics`, `malformed_zmq`: random bytes to every
  unary RPC and the Session stream, raw bytes to the gRPC and /metrics ports,
  malformed frames on the event stream;
- `slow_consumer`: a session that reads its stream slowly and heartbeats fast;
- `vanishing_sessions`: sessions that register and drop the connection;
- `burst`: ten times the request rate for a few seconds.

What is checked (`--check` exits 1 when a bound fails; the RSS bound only
without `--check`'s short runs, see `RSS_BOUND_MIN_MINUTES`): `mismatches` 0;
`early_releases` 0, from the engines' own records (`clients/refengine/ledger.py`:
a holder's release stamped before a requester's read of that lease went quiet);
`leaked_leases_after_drain` 0; every quarantined lease resolved or expired: kvrc
ends one itself once its target proves its reads quiet (docs/operations.md); after
the drain the soak acts as the operator of the runbook and resolves those it can
prove quiet from the engines' own ledgers (`quarantined_operator_resolved`), the
rest count as `quarantined_unresolved`;
`status_codes` (kvrc's own per-code RPC counts, every process) without INTERNAL
or UNKNOWN, and no traceback in a kvrc log; per kvrc process RSS growth ≤ 10 %
after warm-up and fds_end ≤ fds_start + 16 (+ 4 per client connection it gained:
engines moved over from a killed replica), both for the processes that ran
through the drain (a process killed or restarted mid-load was last sampled under
load, holding the sessions it took over).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import msgpack
import zmq
import zmq.asyncio

from benchmarks.common import RESULTS_DIR, machine_info
from clients.hashing import hash_block_chain
from clients.refengine.channel import Channel
from clients.refengine.demo import BLOCK_SIZE, Child, Cluster, EngineGroup
from clients.session import EngineProfile, EngineSession, RankPartRegistration
from coordinator.edges.cli import STATUS_MAX_RECEIVE_BYTES
from coordinator.runtime.coordinator import MAX_STATUS_LEASES
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc

DEFAULT_OUT = RESULTS_DIR / "soak.json"
# Debian's faketime package, any architecture.
LIBFAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))), None)
FAULT_FREE_SHARE = 0.25
# Shorter than the defaults so a drain ends in seconds; the drain waits for all of them.
KVRC_FLAGS = (
    "--session-grace-ms", "2000",
    "--abort-timeout-ms", "3000",
    "--handoff-heartbeat-timeout-ms", "3000",
    "--handoff-publish-timeout-ms", "5000",
    "--handoff-ready-max-wait-ms", "5000",
    "--session-queue-size", "256",
)  # fmt: skip
QUIESCENCE_S = 20.0  # the longest of those timeouts plus a lease TTL, with room
TRANSFER_TIMEOUT_MS = 3000
CONCURRENCY = 2
LOOKUP_INTERVAL_S = 0.05
EVENT_INTERVAL_S = 0.02
POLL_INTERVAL_S = 2.0
RECOVERY_WAIT_S = 60.0  # a fault after which no request completes this long: never recovered
INSTANCE_WARMUP_S = 10.0  # a restarted kvrc's RSS and fds baseline is taken after this
RSS_BOUND_MIN_MINUTES = 6.0  # a shorter run has no steady state to bound
RSS_GROWTH_MAX = 0.10
FDS_SLACK = 16
# fds a client engine part brings to the replica it moves to: its session's connection
# and its KV-event subscription (a ZMQ socket: its connection and the socket's own fds).
FDS_PER_CLIENT = 4
OPEN_STATES = (
    pb.LEASE_STATE_PINNING,
    pb.LEASE_STATE_WAITING_READY,
    pb.LEASE_STATE_READY,
    pb.LEASE_STATE_ACTIVE,
    pb.LEASE_STATE_ABORTING,
)
FAULT_KINDS = (
    "engine_part_kill",
    "holder_stall",
    "kvrc_restart",
    "replica_kill",
    "redis_kill",
    "wall_clock_step",
    "malformed_grpc",
    "malformed_metrics",
    "malformed_zmq",
    "slow_consumer",
    "vanishing_sessions",
    "burst",
)
REDIS_ONLY = frozenset(("replica_kill", "redis_kill"))


def say(text: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _as_is(data: bytes) -> bytes:
    return data


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _percentiles(samples: Sequence[float]) -> dict[str, float]:
    if not samples:
        return {"n": 0, "p50_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"n": len(ordered), "p50_ms": round(pick(0.5), 3), "p99_ms": round(pick(0.99), 3)}


def _proc_rss_mb(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def _proc_fds_and_clients(pid: int, port: int) -> tuple[int | None, int | None]:
    """Open fds of `pid`, and its established TCP connections on its `port`: its
    clients' sessions (one listing of /proc/PID/fd for both).

    A replica that took over a killed one's engines holds their connections at the
    end; they are the clients', not a leak, so the fd bound counts fds net of them.
    """
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None, None
    inodes: set[str] = set()
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                cols = row.split()  # sl local remote st ... inode (column 9)
                local_port = int(cols[1].rsplit(":", 1)[1], 16)
                if local_port == port and cols[3] == "01" and cols[9] in inodes:
                    count += 1
    return len(fds), count


# ---------------------------------------------------------------------------
# Processes the soak owns besides the cluster's: Redis
# ---------------------------------------------------------------------------


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed: make sysdeps")
        self.binary = binary
        self.workdir = workdir
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        # No persistence: a restart is an empty Redis (a store loss kvrc must detect).
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.workdir), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2) as s,
            ):
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
            if self.process.poll() is None:
                self.process.kill()


# ---------------------------------------------------------------------------
# One store's run
# ---------------------------------------------------------------------------


@dataclass
class KvrcInstance:
    """One kvrc process (a restart is a new instance on the same port)."""

    name: str
    child: Child
    grpc_port: int
    metrics_port: int
    started_s: float
    rss_mb_start: float | None = None
    fds_start: int | None = None
    rss_mb_end: float | None = None
    fds_end: int | None = None
    clients_start: int | None = None  # _proc_fds_and_clients at each sample
    clients_end: int | None = None
    codes: dict[str, float] = field(default_factory=dict)  # last scrape, by code
    ended: str = ""

    @property
    def pid(self) -> int:
        return self.child.process.pid


@dataclass
class Replica:
    """One replica's port and launch arguments; its instances over time."""

    index: int
    grpc_port: int
    instances: list[KvrcInstance] = field(default_factory=list)

    @property
    def current(self) -> KvrcInstance:
        return self.instances[-1]

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


@dataclass(frozen=True, slots=True)
class EngineSpec:
    engine_id: str
    role: str
    replica: int  # the replica it connects to first


ENGINES = (
    EngineSpec("prefill-0", "prefill", 0),
    EngineSpec("prefill-1", "prefill", 1),
    EngineSpec("decode-0", "decode", 0),
)


class StoreRun:
    def __init__(self, store: str, seconds: float, seed: int, workdir: Path, tp: int) -> None:
        self.pub: zmq.asyncio.Socket | None = None
        self.request_done = asyncio.Event()
        self.faults_done = False
        self.store = store
        self.seconds = seconds
        self.seed = seed
        self.rng = random.Random(f"{seed}-{store}")
        self.workdir = workdir
        self.tp = tp
        self.cluster = Cluster(workdir)
        self.redis = RedisServer(workdir) if store == "redis" else None
        self.replicas: list[Replica] = []
        self.groups: dict[str, EngineGroup] = {}
        self.channels: dict[str, Channel] = {}
        self.down: set[str] = set()
        self.faketime_file = workdir / "faketime"
        self.wall_offset_s = 0
        self.t0 = 0.0
        self.phase = "fault_free"
        self.stopping = False
        self.burst = False
        self.bursts = 0  # bursts so far: their workers get numbers of their own
        self.latency: dict[tuple[str, str], list[float]] = {}
        self.requests = 0
        self.failed_requests: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.mismatches = 0
        self.blocks_loaded = 0
        self.handoffs = 0
        self.client_codes: Counter[str] = Counter()
        self.faults: list[dict[str, Any]] = []
        self.released_at: dict[str, float] = {}
        self.quiet_at: dict[tuple[str, int, str], float | None] = {}
        self.quarantined: dict[str, dict[str, Any]] = {}
        self.recent_prompts: list[tuple[int, ...]] = []
        self.event_seq = -1
        self.events_published = 0
        self.mooncake_ports = {"memory": "25000-25499", "redis": "25500-25999"}[store]

    # --- setup ---------------------------------------------------------------

    def _kvrc_env(self) -> dict[str, str]:
        # The kvrc processes' wall clock follows this file (monotonic untouched).
        return {
            "LD_PRELOAD": str(LIBFAKETIME),
            "FAKETIME_TIMESTAMP_FILE": str(self.faketime_file),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }

    def _kvrc_args(self, index: int) -> list[str]:
        args = ["--store", self.redis.url if self.redis else "memory", *KVRC_FLAGS]
        if self.redis is None:
            args += ["--state-file", str(self.workdir / f"state-{index}.json")]
        return args

    def _start_kvrc(self, index: int, port: int = 0) -> KvrcInstance:
        ports = self.cluster.start_coordinator(
            *self._kvrc_args(index), port=port, env=self._kvrc_env()
        )
        child = self.cluster.coordinator
        assert child is not None
        return KvrcInstance(
            name=f"kvrc-{index}",
            child=child,
            grpc_port=ports["grpc_port"],
            metrics_port=ports["metrics_port"],
            started_s=self.elapsed(),
        )

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def setup(self) -> None:
        if LIBFAKETIME is None:
            raise SystemExit(
                "libfaketime is missing: make sysdeps (Debian: apt-get install faketime)"
            )
        self.t0 = time.monotonic()
        self.faketime_file.write_text("+0\n")
        if self.redis is not None:
            self.redis.start()
        for index in range(2 if self.redis else 1):
            instance = self._start_kvrc(index)
            replica = Replica(index, instance.grpc_port, [instance])
            self.replicas.append(replica)
        say(f"{self.store}: kvrc on {', '.join(r.target for r in self.replicas)}")
        for spec in ENGINES:
            self._start_group(spec)
        self.events_port = _free_port()

    def _targets_for(self, spec: EngineSpec) -> str:
        first = spec.replica % len(self.replicas)
        order = self.replicas[first:] + self.replicas[:first]
        return ",".join(r.target for r in order)

    def _start_group(self, spec: EngineSpec) -> EngineGroup:
        extra = [
            "--mooncake-ports", self.mooncake_ports,
            "--target", self._targets_for(spec),
            "--transfer-timeout-ms", str(TRANSFER_TIMEOUT_MS),
        ]  # fmt: skip
        (group,) = self.cluster.start_engines([(spec.engine_id, spec.role, self.tp, extra)])
        self.groups[spec.engine_id] = group
        return group

    async def _connect(self, engine_id: str) -> None:
        group = self.groups[engine_id]
        channel = await Channel.connect("127.0.0.1", group.control_port, name=engine_id)
        await channel.call("ready", timeout_s=120.0, wait_s=100.0)
        old = self.channels.get(engine_id)
        self.channels[engine_id] = channel
        if old is not None:
            await old.close()

    # --- load ----------------------------------------------------------------

    def _record(self, op: str, started: float) -> None:
        self.latency.setdefault((self.phase, op), []).append((time.monotonic() - started) * 1000)

    def _live(self, role: str) -> list[str]:
        return [s.engine_id for s in ENGINES if s.role == role and s.engine_id not in self.down]

    async def _turn(self, prompt: tuple[int, ...], output: tuple[int, ...], rid: str) -> None:
        prefills = self._live("prefill")
        decodes = self._live("decode")
        if not prefills or not decodes:
            await asyncio.sleep(0.2)
            self.failed_requests["no_engine"] += 1
            return
        prefill = self.rng.choice(prefills)
        decode = decodes[0]
        try:
            started = time.monotonic()
            pre = await self.channels[prefill].call(
                "prefill", timeout_s=60.0, request_id=rid, tokens=list(prompt), decode=decode
            )
            self._record("prefill", started)
            started = time.monotonic()
            dec = await self.channels[decode].call(
                "decode",
                timeout_s=60.0,
                request_id=rid,
                prefill=prefill,
                prompt=list(prompt),
                output=list(output),
            )
            self._record("decode", started)
            if dec.get("lease_id"):
                await self.channels[prefill].call(
                    "bind_handoff", timeout_s=30.0, request_id=rid, lease_id=dec["lease_id"]
                )
        except Exception as e:  # an engine killed or stopped under the request
            self.failed_requests[type(e).__name__] += 1
            await asyncio.sleep(0.1)
            return
        self.requests += 1
        self.request_done.set()
        self.mismatches += int(pre["mismatches"]) + int(dec["mismatches"])
        self.blocks_loaded += int(pre["blocks_loaded"])
        self.outcomes[f"load:{pre['load'].split(':')[0]}"] += 1
        self.outcomes[f"handoff:{dec['handoff']}"] += 1
        self.handoffs += dec["handoff"] == "pulled"
        self.recent_prompts.append(prompt)
        del self.recent_prompts[:-64]

    async def _conversations(self, worker: int, until: Callable[[], bool]) -> None:
        rng = random.Random(f"{self.seed}-{self.store}-w{worker}")
        systems = [
            [rng.randrange(1, 32000) for _ in range(4 * BLOCK_SIZE + rng.randrange(BLOCK_SIZE))]
            for _ in range(3)
        ]
        conversation = 0
        while not until():
            history = list(rng.choice(systems))
            for turn in range(3):
                if until():
                    return
                user = [rng.randrange(1, 32000) for _ in range(rng.randrange(20, 48))]
                output = tuple(rng.randrange(1, 32000) for _ in range(rng.randrange(10, 40)))
                prompt = tuple(history + user)
                await self._turn(prompt, output, f"w{worker}-c{conversation}-t{turn}")
                history = list(prompt) + list(output)
            conversation += 1

    async def _lookups(self) -> None:
        stubs: dict[int, pb_grpc.EngineServiceAsyncStub] = {}
        channels: dict[int, grpc.aio.Channel] = {}
        try:
            while not self.stopping:
                await asyncio.sleep(LOOKUP_INTERVAL_S / (10 if self.burst else 1))
                if not self.recent_prompts:
                    continue
                replica = self.rng.choice(self.replicas)
                if replica.index not in stubs:
                    channels[replica.index] = grpc.aio.insecure_channel(replica.target)
                    stubs[replica.index] = pb_grpc.EngineServiceStub(channels[replica.index])
                prompt = self.rng.choice(self.recent_prompts)
                query = pb.LookupQuery(
                    block_hashes=hash_block_chain(prompt, BLOCK_SIZE, seed=0), min_blocks=1
                )
                started = time.monotonic()
                try:
                    await stubs[replica.index].Lookup(
                        pb.LookupRequest(requester_child_engine_id="decode-0", queries=[query]),
                        timeout=5.0,
                    )
                    self.client_codes["OK"] += 1
                    self._record("lookup", started)
                except grpc.aio.AioRpcError as e:
                    self.client_codes[e.code().name] += 1
        finally:
            for channel in channels.values():
                await channel.close(None)

    async def _event_stream(self) -> None:
        """A vLLM-shaped KV event stream: a PUB socket and a registered engine naming it."""
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        # A host, not `*`: vLLM's publisher connects and kvrc binds (kvrc's restarts too).
        pub.connect(f"tcp://127.0.0.1:{self.events_port}")
        self.pub = pub
        session = EngineSession(
            [r.target for r in self.replicas],
            RankPartRegistration(
                engine_id="soak-events",
                profile=EngineProfile(model="soak/events", block_size=BLOCK_SIZE),
                kv_events_endpoint=f"tcp://127.0.0.1:{self.events_port}",
            ),
        )
        rng = random.Random(f"{self.seed}-{self.store}-events")
        resident: list[int] = []
        try:
            await session.start()
            while not self.stopping:
                await asyncio.sleep(EVENT_INTERVAL_S)
                hashes = [rng.getrandbits(63) for _ in range(16)]
                events: list[dict[str, Any]] = [
                    {
                        "type": "BlockStored",
                        "block_hashes": hashes,
                        "parent_block_hash": resident[-1] if resident else None,
                        "token_ids": [rng.randrange(1, 32000) for _ in range(16 * BLOCK_SIZE)],
                        "block_size": BLOCK_SIZE,
                        "lora_id": None,
                        "medium": "GPU",
                        "lora_name": None,
                        "extra_keys": [None] * 16,
                        "group_idx": 0,
                    }
                ]
                resident += hashes
                if len(resident) > 4096:
                    gone, resident = resident[:16], resident[16:]
                    events.append(
                        {"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU",
                         "group_idx": 0}
                    )  # fmt: skip
                self.event_seq += 1
                payload = msgpack.packb([time.time(), events, 0])
                await pub.send_multipart([b"", self.event_seq.to_bytes(8, "big"), payload])
                self.events_published += len(hashes)
        finally:
            with contextlib.suppress(Exception):
                await session.close()
            pub.close(0)
            ctx.term()

    # --- observation ---------------------------------------------------------

    def _scrape(self, instance: KvrcInstance) -> None:
        url = f"http://127.0.0.1:{instance.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                text = response.read().decode()
        except OSError:
            return
        codes: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("kvrc_rpc_requests_total{"):
                labels, value = line.rsplit(" ", 1)
                code = labels.split('code="', 1)[1].split('"', 1)[0]
                codes[code] = codes.get(code, 0.0) + float(value)
        instance.codes = codes

    def _sample(self, instance: KvrcInstance, *, start: bool) -> None:
        rss = _proc_rss_mb(instance.pid)
        fds, clients = _proc_fds_and_clients(instance.pid, instance.grpc_port)
        if start:
            instance.rss_mb_start, instance.fds_start = rss, fds
            instance.clients_start = clients
        elif rss is not None:
            instance.rss_mb_end, instance.fds_end = rss, fds
            instance.clients_end = clients

    async def _collect_ledgers(self, only: str | None = None) -> None:
        """Every live engine's ledger (`only`: that engine's)."""
        for engine_id, channel in list(self.channels.items()):
            if engine_id in self.down or (only is not None and engine_id != only):
                continue
            try:
                doc = await channel.call("ledger", timeout_s=10.0)
            except Exception:
                continue
            if engine_id in self.down:
                continue  # killed while answering: its last ledger is already settled
            for lease_id, t in doc["released_at"].items():
                self.released_at.setdefault(lease_id, t)
            for rank, quiet in enumerate(doc["quiet_at"]):
                for lease_id, t in quiet.items():
                    self.quiet_at[(engine_id, rank, lease_id)] = t

    async def _status(self, replica: Replica) -> pb.StatusResponse | None:
        # Every open lease, not the default 1,000 (the counts below read the list).
        options = [("grpc.max_receive_message_length", STATUS_MAX_RECEIVE_BYTES)]
        async with grpc.aio.insecure_channel(replica.target, options=options) as channel:
            try:
                status = await pb_grpc.AdminServiceStub(channel).GetStatus(
                    pb.StatusRequest(max_leases=MAX_STATUS_LEASES), timeout=5.0
                )
            except grpc.aio.AioRpcError:
                return None
        if status.leases_total > len(status.leases):
            raise RuntimeError(
                f"{replica.target}: {status.leases_total} open leases, more than status lists"
            )
        return status

    async def _note_quarantine(self) -> dict[str, int]:
        """Quarantined leases seen on any replica; open leases per replica."""
        open_by_replica = {}
        for replica in self.replicas:
            status = await self._status(replica)
            if status is None:
                continue
            open_by_replica[replica.target] = 0
            for lease in status.leases:
                if lease.state == pb.LEASE_STATE_QUARANTINED:
                    self.quarantined.setdefault(
                        lease.lease_id,
                        {"lease_id": lease.lease_id, "seen_s": round(self.elapsed(), 1)},
                    )
                if lease.state in OPEN_STATES:
                    open_by_replica[replica.target] += 1
        return open_by_replica

    async def _observe(self) -> None:
        while not self.stopping:
            await asyncio.sleep(POLL_INTERVAL_S)
            for replica in self.replicas:
                instance = replica.current
                self._scrape(instance)
                warm = self.elapsed() - instance.started_s >= INSTANCE_WARMUP_S
                if instance.rss_mb_start is None and self.phase != "fault_free" and warm:
                    self._sample(instance, start=True)  # a restarted process's baseline
                self._sample(instance, start=False)
            await self._collect_ledgers()
            with contextlib.suppress(Exception):
                await self._note_quarantine()

    # --- faults --------------------------------------------------------------

    async def _restart_group(self, engine_id: str) -> None:
        spec = next(s for s in ENGINES if s.engine_id == engine_id)
        await asyncio.to_thread(self._start_group, spec)
        await self._connect(engine_id)
        self.down.discard(engine_id)

    async def fault_engine_part_kill(self) -> str:
        engine_id = self.rng.choice([s.engine_id for s in ENGINES])
        group = self.groups[engine_id]
        rank = self.rng.randrange(len(group.parts))
        # Its ledger as of now, and only its own. A read still in flight then ends at
        # some moment between this scrape and the process's death, which its lost ledger
        # cannot tell: it is taken as quiet from the scrape on, so only a release before
        # the scrape (while the read was provably in flight) counts as early. Stamped at
        # the kill instead, a read that went quiet just after the scrape, and was
        # reported and released before the kill, counted as an early release (seeds
        # 1065848252, 1270037072, 739565844).
        scraped = time.monotonic()  # the ledger is read after this (same monotonic clock)
        await self._collect_ledgers(only=engine_id)
        self.down.add(engine_id)
        os.kill(group.parts[rank].process.pid, signal.SIGKILL)
        await asyncio.sleep(0.3)
        for part in group.parts:  # the engine's supervisor takes the rest down
            with contextlib.suppress(ProcessLookupError):
                os.kill(part.process.pid, signal.SIGKILL)
        for part in group.parts:
            await asyncio.to_thread(part.process.wait, 10)
        for key, quiet in self.quiet_at.items():
            if key[0] == engine_id and quiet is None:
                self.quiet_at[key] = scraped
        await self._restart_group(engine_id)
        return f"{engine_id} tp{rank}"

    async def fault_holder_stall(self) -> str:
        engine_id = self.rng.choice(self._live("prefill") or ["prefill-0"])
        stall_s = self.rng.choice((1.0, 1.5, 7.0))  # under and over the heartbeat timeout
        parts = self.groups[engine_id].parts
        for part in parts:
            os.kill(part.process.pid, signal.SIGSTOP)
        await asyncio.sleep(stall_s)
        for part in parts:
            os.kill(part.process.pid, signal.SIGCONT)
        return f"{engine_id} {stall_s} s"

    async def _replace_kvrc(self, replica: Replica, sig: int) -> int:
        old = replica.current
        self._scrape(old)
        self._sample(old, start=False)
        old.child.process.send_signal(sig)
        status = await asyncio.to_thread(old.child.process.wait, 30)
        old.ended = "killed" if sig == signal.SIGKILL else "restarted"
        if sig == signal.SIGKILL:
            await asyncio.sleep(1.0)
        instance = await asyncio.to_thread(self._start_kvrc, replica.index, replica.grpc_port)
        replica.instances.append(instance)
        return int(status)

    async def fault_kvrc_restart(self) -> str:
        replica = self.rng.choice(self.replicas)
        status = await self._replace_kvrc(replica, signal.SIGTERM)
        return f"{replica.current.name} exit {status}"

    async def fault_replica_kill(self) -> str:
        replica = self.rng.choice(self.replicas)
        await self._replace_kvrc(replica, signal.SIGKILL)
        return replica.current.name

    async def fault_redis_kill(self) -> str:
        assert self.redis is not None
        await asyncio.to_thread(self.redis.kill)
        await asyncio.sleep(1.0)
        await asyncio.to_thread(self.redis.start)
        return "restarted empty"

    async def fault_wall_clock_step(self) -> str:
        self.wall_offset_s = 3600 if self.wall_offset_s == 0 else 0
        self.faketime_file.write_text(f"{self.wall_offset_s:+d}\n")
        return f"wall clock {'+1 h' if self.wall_offset_s else '-1 h'}"

    async def fault_malformed_grpc(self) -> str:
        rng = random.Random(self.rng.getrandbits(32))
        sent = 0
        for replica in self.replicas:
            async with grpc.aio.insecure_channel(replica.target) as channel:
                for service in pb.DESCRIPTOR.services_by_name.values():
                    for method in service.methods:
                        path = f"/{service.full_name}/{method.name}"
                        junk = rng.randbytes(rng.randrange(1, 512))
                        try:
                            if method.client_streaming:
                                call = channel.stream_stream(path, _as_is, _as_is)
                                async for _ in call(iter([junk]), timeout=5.0):
                                    pass
                            else:
                                await channel.unary_unary(path, _as_is, _as_is)(junk, timeout=5.0)
                            self.client_codes["malformed:OK"] += 1
                        except grpc.aio.AioRpcError as e:
                            if e.code() is grpc.StatusCode.UNAVAILABLE:
                                # Not answered by kvrc's handlers: the replica was down or
                                # stopping (a restart fault ran just before). Kept apart.
                                self.client_codes["malformed_unreached"] += 1
                            else:
                                self.client_codes[f"malformed:{e.code().name}"] += 1
                        sent += 1
            # Not HTTP/2 at all.
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", replica.grpc_port)
                writer.write(rng.randbytes(4096))
                await writer.drain()
                writer.close()
        return f"{sent} calls"

    async def fault_malformed_metrics(self) -> str:
        rng = random.Random(self.rng.getrandbits(32))
        for replica in self.replicas:
            port = replica.current.metrics_port
            for junk in (rng.randbytes(4096), b"GET /" + b"a" * 65536 + b" HTTP/1.1\r\n\r\n"):
                with contextlib.suppress(OSError):
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.write(junk)
                    await writer.drain()
                    writer.close()
        return "junk and a 64 KiB path to each /metrics"

    async def fault_malformed_zmq(self) -> str:
        pub = self.pub
        if pub is None:
            return "no event stream yet"
        seq = max(self.event_seq, 0).to_bytes(8, "big")  # a sequence kvrc has seen
        frames = [
            [b"only-one-frame"],
            [b"", b"short", b"payload"],
            [b"", seq, b"\xc1 not msgpack"],
            [b"", seq, msgpack.packb({"not": "a batch"})],
            [b"", seq, msgpack.packb([time.time(), [{"type": "BlockStored"}], 0])],
        ]
        for parts in frames:
            await pub.send_multipart(parts)
        return f"{len(frames)} frames"

    def _raw_registration(self, name: str) -> pb.EngineMessage:
        registration = RankPartRegistration(
            engine_id=name, profile=EngineProfile(model="soak/raw", block_size=BLOCK_SIZE)
        )
        return pb.EngineMessage(register=registration.to_proto())

    async def fault_slow_consumer(self) -> str:
        replica = self.rng.choice(self.replicas)
        name = f"soak-slow-{len(self.faults)}"
        queue: asyncio.Queue[pb.EngineMessage | None] = asyncio.Queue()
        await queue.put(self._raw_registration(name))

        async def outbound() -> Any:
            while (message := await queue.get()) is not None:
                yield message

        read = 0
        async with grpc.aio.insecure_channel(replica.target) as channel:
            call = pb_grpc.EngineServiceStub(channel).Session(outbound())
            until = time.monotonic() + 6.0
            with contextlib.suppress(grpc.aio.AioRpcError, StopAsyncIteration):
                while time.monotonic() < until:
                    for _ in range(20):
                        await queue.put(pb.EngineMessage(heartbeat=pb.Heartbeat()))
                    await asyncio.sleep(0.5)
                    await asyncio.wait_for(call.read(), 5.0)
                    read += 1
            await queue.put(None)
            call.cancel()
        return f"{name} read {read} messages in 6 s"

    async def fault_vanishing_sessions(self) -> str:
        replica = self.rng.choice(self.replicas)
        acked = 0
        for n in range(10):
            channel = grpc.aio.insecure_channel(replica.target)
            first = self._raw_registration(f"soak-vanish-{len(self.faults)}-{n}")

            async def once(message: pb.EngineMessage = first) -> Any:
                yield message
                await asyncio.sleep(3600)

            call = pb_grpc.EngineServiceStub(channel).Session(once())
            with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                await asyncio.wait_for(call.read(), 5.0)
                acked += 1
            await channel.close(grace=None)  # no goodbye: the connection just goes
        return f"10 sessions ({acked} acked) dropped on {replica.target}"

    async def fault_burst(self) -> str:
        self.burst = True
        self.bursts += 1
        until = time.monotonic() + 5.0
        # Worker numbers unique over the run: they name the requests (a request id
        # reused after its lease ended is refused, I6-quiescence).
        extra = [
            asyncio.create_task(
                self._conversations(100 * self.bursts + n, lambda: time.monotonic() > until)
            )
            for n in range(9 * CONCURRENCY)
        ]
        await asyncio.gather(*extra)
        self.burst = False
        return f"{9 * CONCURRENCY} extra request loops for 5 s"

    def schedule(self) -> list[str]:
        kinds = [k for k in FAULT_KINDS if self.redis is not None or k not in REDIS_ONLY]
        self.rng.shuffle(kinds)
        return kinds

    async def _faults(self, fault_free_s: float, until_s: float) -> None:
        await asyncio.sleep(max(0.0, fault_free_s - self.elapsed()))
        for replica in self.replicas:  # after warm-up: the baseline of each process
            self._sample(replica.current, start=True)
        self.phase = "faulted"
        kinds = self.schedule()
        first_round = True
        while first_round or self.elapsed() < until_s:
            for kind in kinds:
                if not first_round and self.elapsed() >= until_s:
                    break
                started = self.elapsed()
                say(f"{self.store}: fault {kind} at {started:.0f} s")
                failed_before = sum(self.failed_requests.values())
                unavailable_before = self.client_codes["UNAVAILABLE"]
                try:
                    detail = await getattr(self, f"fault_{kind}")()
                except Exception as e:
                    detail = f"injection failed: {type(e).__name__}: {e}"
                    say(f"{self.store}: {kind}: {detail}")
                took_s = self.elapsed() - started
                recovered_s = await self._next_request_done(started)
                self.faults.append(
                    {
                        "kind": kind,
                        "at_s": round(started, 1),
                        "detail": detail,
                        "took_s": round(took_s, 1),
                        # From the injection to the first request completed after it ended.
                        "recovered_s": None if recovered_s is None else round(recovered_s, 1),
                        "requests_failed": sum(self.failed_requests.values()) - failed_before,
                        "lookups_unavailable": self.client_codes["UNAVAILABLE"]
                        - unavailable_before,
                    }
                )
                await asyncio.sleep(self.rng.uniform(1.0, 3.0))
            first_round = False
            self.rng.shuffle(kinds)

    async def _next_request_done(self, started: float) -> float | None:
        self.request_done.clear()
        try:
            await asyncio.wait_for(self.request_done.wait(), RECOVERY_WAIT_S)
        except TimeoutError:
            return None
        return self.elapsed() - started

    def effects_by_kind(self) -> dict[str, dict[str, Any]]:
        """Per fault kind, what the load saw (docs/operations.md is written from this)."""
        effects: dict[str, dict[str, Any]] = {}
        for fault in self.faults:
            e = effects.setdefault(
                fault["kind"],
                {"count": 0, "recovered_s_max": 0.0, "never_recovered": 0,
                 "requests_failed": 0, "lookups_unavailable": 0},
            )  # fmt: skip
            e["count"] += 1
            if fault["recovered_s"] is None:
                e["never_recovered"] += 1
            else:
                e["recovered_s_max"] = max(e["recovered_s_max"], fault["recovered_s"])
            e["requests_failed"] += fault["requests_failed"]
            e["lookups_unavailable"] += fault["lookups_unavailable"]
        return dict(sorted(effects.items()))

    # --- the run -------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        for engine_id in self.groups:
            await self._connect(engine_id)
        say(f"{self.store}: engines ready; load for {self.seconds:.0f} s")
        load_start = self.elapsed()
        until_s = load_start + self.seconds
        fault_free_s = load_start + FAULT_FREE_SHARE * self.seconds

        def load_done() -> bool:
            return self.faults_done and self.elapsed() >= until_s

        background = [
            asyncio.create_task(self._lookups()),
            asyncio.create_task(self._event_stream()),
            asyncio.create_task(self._observe()),
        ]
        workers = [
            asyncio.create_task(self._conversations(n, load_done)) for n in range(CONCURRENCY)
        ]
        self.faults_done = False
        await self._faults(fault_free_s, until_s)
        self.faults_done = True
        await asyncio.gather(*workers)
        say(f"{self.store}: load stopped after {self.elapsed() - load_start:.0f} s; draining")
        self.phase = "drain"
        drain = await self._drain()
        self.stopping = True
        await asyncio.gather(*background, return_exceptions=True)
        for channel in self.channels.values():
            await channel.close()
        return self.document(drain)

    async def _drain(self) -> dict[str, Any]:
        """Every lease ends (or is quarantined) within the quiescence timeout."""
        deadline = time.monotonic() + QUIESCENCE_S
        open_by_replica: dict[str, int] = {}
        while time.monotonic() < deadline:
            open_by_replica = await self._note_quarantine()
            if len(open_by_replica) == len(self.replicas) and not any(open_by_replica.values()):
                break
            await asyncio.sleep(0.5)
        await self._collect_ledgers()
        await self._operator_resolves()
        final: dict[str, int] = {}
        for replica in self.replicas:
            status = await self._status(replica)
            states = {x.lease_id: x.state for x in status.leases} if status else {}
            for lease_id, entry in self.quarantined.items():
                if lease_id in states:
                    entry["final_state"] = pb.LeaseState.Name(states[lease_id])
            final[replica.target] = sum(s in OPEN_STATES for s in states.values())
        for replica in self.replicas:
            self._scrape(replica.current)
            self._sample(replica.current, start=False)
        return {"open_by_replica": final}

    def proven_quiet(self, lease_id: str) -> bool:
        """An operator's proof that no read of `lease_id` can still land (the runbook in
        docs/operations.md): every engine is up and answered its ledger, and no rank part
        has a read of the lease that is not quiet. A part's ledger holds every read since
        its process started; a killed process's reads died with it."""
        if self.down:
            return False
        return all(
            quiet is not None
            for (_, _, read_lease), quiet in self.quiet_at.items()
            if read_lease == lease_id
        )

    async def _operator_resolves(self) -> None:
        """What an operator does after the drain: resolve each lease still quarantined
        whose blocks are proven quiet; the rest stay, and count as unresolved."""
        for replica in self.replicas:
            status = await self._status(replica)
            if status is None:
                continue
            for lease in status.leases:
                if lease.state != pb.LEASE_STATE_QUARANTINED:
                    continue
                entry = self.quarantined.setdefault(
                    lease.lease_id,
                    {"lease_id": lease.lease_id, "seen_s": round(self.elapsed(), 1)},
                )
                entry["reason"] = lease.reason
                if not self.proven_quiet(lease.lease_id):
                    entry["operator"] = "not proven quiet: left quarantined"
                    continue
                note = "soak operator: no live rank part has a read of it in flight (ledgers)"
                async with grpc.aio.insecure_channel(replica.target) as channel:
                    try:
                        await pb_grpc.AdminServiceStub(channel).ResolveQuarantine(
                            pb.ResolveQuarantineRequest(
                                lease_id=lease.lease_id,
                                resolution=pb.QUARANTINE_RESOLUTION_RELEASE,
                                operator_note=note,
                            ),
                            timeout=5.0,
                        )
                        entry["operator"] = "resolved: proven quiet from the engines' ledgers"
                    except grpc.aio.AioRpcError as e:
                        entry["operator"] = f"resolve failed: {e.code().name} {e.details()}"
        await self._collect_ledgers()  # the releases it caused, for the early-release check

    def early_releases(self) -> list[dict[str, Any]]:
        early = []
        for (engine_id, rank, lease_id), quiet in self.quiet_at.items():
            released = self.released_at.get(lease_id)
            if released is None:
                continue
            if quiet is None or released < quiet:
                early.append(
                    {"lease_id": lease_id, "requester": f"{engine_id} tp{rank}",
                     "released_before_quiet_ms": None if quiet is None
                     else round((quiet - released) * 1000, 3)}
                )  # fmt: skip
        return early

    def document(self, drain: dict[str, Any]) -> dict[str, Any]:
        tracebacks = 0
        processes = []
        codes: Counter[str] = Counter()
        for replica in self.replicas:
            for instance in replica.instances:
                text = instance.child.stderr_path.read_text(errors="replace")
                tracebacks += text.count("Traceback (most recent call last)")
                codes.update({k: int(v) for k, v in instance.codes.items()})
                processes.append(
                    {
                        "name": instance.name,
                        "pid": instance.pid,
                        "started_s": round(instance.started_s, 1),
                        "ended": instance.ended or None,  # None: ran to the end
                        "rss_mb_start": instance.rss_mb_start,
                        "rss_mb_end": instance.rss_mb_end,
                        "fds_start": instance.fds_start,
                        "fds_end": instance.fds_end,
                        "clients_start": instance.clients_start,
                        "clients_end": instance.clients_end,
                    }
                )
        latency = {
            phase: {
                op: _percentiles(s) for (p, op), s in sorted(self.latency.items()) if p == phase
            }
            for phase in ("fault_free", "faulted")
        }
        early = self.early_releases()
        unresolved = [
            q
            for q in self.quarantined.values()
            if q.get("final_state") == "LEASE_STATE_QUARANTINED"
        ]
        return {
            "seed": self.seed,
            "store": self.store,
            "minutes": round(self.seconds / 60, 2),
            "replicas": len(self.replicas),
            "tp": self.tp,
            "requests": self.requests,
            "failed_requests": dict(self.failed_requests),
            "outcomes": dict(self.outcomes),
            "blocks_loaded": self.blocks_loaded,
            "handoffs": self.handoffs,
            "events_published": self.events_published,
            "faults_by_kind": dict(Counter(f["kind"] for f in self.faults)),
            "faults": self.faults,
            "effects_by_kind": self.effects_by_kind(),
            "mismatches": self.mismatches,
            "early_releases": len(early),
            "early_release_leases": early[:20],
            "leases_checked_for_early_release": len(
                {lease for (_, _, lease) in self.quiet_at} & set(self.released_at)
            ),
            "leaked_leases_after_drain": sum(drain["open_by_replica"].values()),
            "quarantined": sorted(self.quarantined.values(), key=lambda q: q["lease_id"]),
            "quarantined_unresolved": len(unresolved),
            # Of those quarantined, ended by the operator step (the rest ended by kvrc's
            # own proof of quiet reads, or stayed: quarantined_unresolved).
            "quarantined_operator_resolved": sum(
                str(q.get("operator", "")).startswith("resolved") for q in self.quarantined.values()
            ),
            "status_codes": dict(sorted(codes.items())),
            "client_status_codes": dict(sorted(self.client_codes.items())),
            "kvrc_tracebacks": tracebacks,
            "kvrc_processes": processes,
            "latency": latency,
        }

    def stop(self) -> None:
        self.cluster.stop()
        if self.redis is not None:
            self.redis.stop()


# ---------------------------------------------------------------------------
# Bounds
# ---------------------------------------------------------------------------


def violations(doc: dict[str, Any], *, check_rss: bool) -> list[str]:
    bad = []
    for key in ("mismatches", "early_releases", "leaked_leases_after_drain",
                "quarantined_unresolved", "kvrc_tracebacks"):  # fmt: skip
        if doc[key]:
            bad.append(f"{key} = {doc[key]}")
    for code in ("INTERNAL", "UNKNOWN"):
        if doc["status_codes"].get(code) or doc["client_status_codes"].get(code):
            bad.append(f"status {code} answered")
    if doc["requests"] == 0:
        bad.append("no request completed")
    for p in doc["kvrc_processes"]:
        # "After the drain": only a process that lived through it has such a sample; one
        # killed or restarted mid-load was last sampled under load (sessions it took over).
        # A replica that took over a killed one's engines holds what they bring (their
        # sessions, their event subscriptions): no leak, so each gained client
        # connection allows FDS_PER_CLIENT more. A leak per request still shows (hundreds).
        fds_known = p["fds_start"] is not None and p["fds_end"] is not None
        gained = max(0, (p.get("clients_end") or 0) - (p.get("clients_start") or 0))
        allowed = FDS_SLACK + FDS_PER_CLIENT * gained
        if fds_known and p["ended"] is None and p["fds_end"] > p["fds_start"] + allowed:
            bad.append(
                f"{p['name']} pid {p['pid']}: fds {p['fds_start']} -> {p['fds_end']}"
                f" ({gained:+d} client connections)"
            )
        lived = check_rss and p["rss_mb_start"] and p["rss_mb_end"] and p["ended"] is None
        if lived and p["rss_mb_end"] > p["rss_mb_start"] * (1 + RSS_GROWTH_MAX):
            bad.append(
                f"{p['name']} pid {p['pid']}: RSS {p['rss_mb_start']:.1f} -> "
                f"{p['rss_mb_end']:.1f} MB"
            )
    return bad


def run_store(store: str, seconds: float, seed: int, tp: int, keep: Path | None) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        if keep is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvrc-soak-")))
        else:
            workdir = keep / store
            workdir.mkdir(parents=True, exist_ok=True)
        run = StoreRun(store, seconds, seed, workdir, tp)
        try:
            run.setup()
            return asyncio.run(run.run())
        finally:
            run.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="load time, all stores (10)")
    parser.add_argument("--store", choices=("both", "memory", "redis"), default="both")
    parser.add_argument("--seed", type=int, default=None, help="fault schedule seed (random)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="exit 1 when a bound fails")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--keep-logs", type=Path, help="keep every process's logs here")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error("--minutes must be > 0")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    stores = ("memory", "redis") if args.store == "both" else (args.store,)
    seconds = args.minutes * 60 / len(stores)
    say(f"seed {seed} (replay: --seed {seed}); {args.minutes} min over {', '.join(stores)}")
    check_rss = args.minutes / len(stores) >= RSS_BOUND_MIN_MINUTES / 2
    runs = []
    failed: list[str] = []
    for store in stores:
        doc = run_store(store, seconds, seed, args.tp, args.keep_logs)
        bad = violations(doc, check_rss=check_rss)
        doc["violations"] = bad
        runs.append(doc)
        failed += [f"{store}: {b}" for b in bad]
        say(
            f"{store}: {doc['requests']} requests, faults {doc['faults_by_kind']}, "
            f"mismatches {doc['mismatches']}, early releases {doc['early_releases']} "
            f"(of {doc['leases_checked_for_early_release']} checked), leaked "
            f"{doc['leaked_leases_after_drain']}, codes {doc['status_codes']}"
        )
    result = {
        "seed": seed,
        "minutes": args.minutes,
        "stores": list(stores),
        "rss_bound_checked": check_rss,
        "runs": runs,
        "machine": machine_info(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    say(f"wrote {args.out}")
    if failed:
        say(f"bounds failed (seed {seed}):\n  " + "\n  ".join(failed))
        return 1 if args.check else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
