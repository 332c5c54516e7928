"""Transfers through real Mooncake (tcp, loopback) from real peer processes.

Every peer is `tests/transfer_peer.py` in its own process; the local side is a
real `MooncakeTransferEngine` in this process. Nothing is faked.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transfer_peer import block_pattern
from waiting import wait_until

from clients import mooncake_engine
from clients.kv_cache import (
    IncompatibleLayoutError,
    KvCacheLayout,
    KvEndpointDescription,
    KvRegionDescription,
    PagedKvCache,
)
from clients.mooncake_engine import (
    MooncakeConfig,
    MooncakeTransferEngine,
    ReadPace,
    TransferEngineUnavailable,
)
from clients.session import EngineProfile, RankPartRegistration
from clients.transfer import (
    InFlightReads,
    NativeRead,
    PeerSlots,
    TransferOutcome,
    TransferPlan,
    TransferResult,
    combine_outcomes,
    endpoint_from_proto,
    endpoint_to_proto,
    endpoint_to_session,
    plan_rank_part_pull,
    pull,
    rank_part_descriptor,
)
from kvrc.v1 import kvrc_pb2

PEER_SCRIPT = Path(__file__).resolve().parents[1] / "support" / "transfer_peer.py"
# Peers listen here (Mooncake accepts ranges below 32768 only).
PORT_MIN, PORT_MAX = 23000, 23999
PEER_SEED = 5
LAYOUT = KvCacheLayout(
    num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16"
)
# The local pool is sized differently on purpose: block counts may differ.
LOCAL_LAYOUT = replace(LAYOUT, num_blocks=48)
NEVER_HANG_S = 10.0  # far below Mooncake's own 30-60 s hang on a frozen peer


def _stopped(stat: Path) -> bool:
    """A /proc task stopped by a signal (state T), or gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "T"
    except FileNotFoundError:
        return True


class Peer:
    """A transfer_peer.py process; always reaped by `close`."""

    def __init__(self, layout: KvCacheLayout, log_path: Path) -> None:
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(PEER_SCRIPT),
                json.dumps(layout.to_dict()),
                str(PEER_SEED),
                str(PORT_MIN),
                str(PORT_MAX),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        self.endpoint = KvEndpointDescription.from_json(self._first_line(timeout_s=60))

    def _first_line(self, timeout_s: float) -> bytes:
        lines: list[bytes] = []
        assert self.process.stdout is not None
        stdout = self.process.stdout
        reader = threading.Thread(target=lambda: lines.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not lines or not lines[0]:
            self.close()
            raise RuntimeError(
                f"peer did not describe itself (exit {self.process.returncode}); "
                f"see {self._log.name}"
            )
        return lines[0]

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)
        if signum == signal.SIGSTOP:
            # kill() returns before the stop takes effect; a read issued in between is
            # served (a loaded host once saw the "frozen" peer answer in 1.8 ms).
            # Every thread of it: Mooncake serves reads from its own threads.
            tasks = Path(f"/proc/{self.process.pid}/task")
            deadline = time.monotonic() + 10
            while not all(_stopped(t / "stat") for t in tasks.iterdir()):
                assert time.monotonic() < deadline, "the peer did not stop"
                time.sleep(0.005)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(b"exit\n")
                self.process.stdin.flush()
                self.process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(timeout=10)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()
        self._log.close()


@pytest.fixture(scope="module")
def engine() -> MooncakeTransferEngine:
    # Mooncake fixes its port range per process at first import; this process keeps
    # whatever it has (15000-17000 by default), the peers show the configured range.
    return MooncakeTransferEngine(MooncakeConfig())


@pytest.fixture(scope="module")
def executor() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="mooncake")
    yield pool
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def local_cache(engine: MooncakeTransferEngine) -> Iterator[PagedKvCache]:
    cache = PagedKvCache(LOCAL_LAYOUT, device="cpu")
    cache.register(engine)
    yield cache
    cache.unregister()


@pytest.fixture
def local(local_cache: PagedKvCache) -> PagedKvCache:
    for layer in local_cache.layers:
        layer.zero_()
    return local_cache


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Peer]:
    started = Peer(LAYOUT, tmp_path_factory.mktemp("peer") / "peer.log")
    yield started
    started.close()


@pytest.fixture
def fresh_peer(tmp_path: Path) -> Iterator[Peer]:
    """A peer of this test alone (to kill or freeze)."""
    started = Peer(LAYOUT, tmp_path / "peer.log")
    yield started
    started.close()


def assert_blocks_hold_pattern(cache: PagedKvCache, pairs: list[tuple[int, int]]) -> None:
    for layer in range(cache.layout.num_layers):
        for local_id, remote_id in pairs:
            expected = block_pattern(cache.layout, PEER_SEED, layer, remote_id)
            assert torch.equal(cache.block_bytes_view(layer, local_id), expected), (
                f"layer {layer} local block {local_id} != remote block {remote_id}"
            )


def assert_blocks_zero(cache: PagedKvCache, block_ids: list[int]) -> None:
    for layer in range(cache.layout.num_layers):
        for block_id in block_ids:
            assert int(cache.block_bytes_view(layer, block_id).count_nonzero()) == 0


# --- the engine wrapper ------------------------------------------------------------


def test_peer_listens_in_the_configured_port_range(peer: Peer) -> None:
    host, port = peer.endpoint.session_name.rsplit(":", 1)
    assert host == "127.0.0.1"
    assert PORT_MIN <= int(port) <= PORT_MAX


def test_a_second_port_range_in_one_process_is_refused(engine: MooncakeTransferEngine) -> None:
    low, high = engine.port_range
    assert low <= engine.rpc_port <= high
    other = (PORT_MIN, PORT_MAX) if (low, high) != (PORT_MIN, PORT_MAX) else (24000, 24999)
    with pytest.raises(ValueError, match="once, at first import"):
        MooncakeTransferEngine(MooncakeConfig(rpc_port_min=other[0], rpc_port_max=other[1]))


def test_missing_mooncake_gives_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(TransferEngineUnavailable, match="mooncake-transfer-engine-non-cuda"):
        MooncakeTransferEngine(MooncakeConfig())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"protocol": "smoke-signals"},
        {"rpc_port_min": 20000},
        {"rpc_port_min": 30000, "rpc_port_max": 20000},
        {"rpc_port_min": 41000, "rpc_port_max": 41999},  # Mooncake would ignore it
        {"local_hostname": ""},
    ],
)
def test_bad_engine_configuration_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        MooncakeConfig(**kwargs)  # type: ignore[arg-type]


# --- paced reads: sleep first, then Mooncake's spinning wait -----------------------------


class BindingSpy:
    """The native engine with every call recorded (and, where set, an answer forced)."""

    def __init__(self, inner: object, calls: list[str]) -> None:
        self._inner, self._calls = inner, calls
        self.forced: dict[str, int] = {}

    def __getattr__(self, name: str) -> object:
        method = getattr(self._inner, name)

        def call(*args: object) -> object:
            self._calls.append(name)
            return self.forced[name] if name in self.forced else method(*args)

        return call


@pytest.fixture
def paced(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[MooncakeTransferEngine, PagedKvCache, list[str], BindingSpy]]:
    """An engine whose sleeps and native calls are recorded (sleeps are not slept), reading
    with pacing whatever MC_LOG_LEVEL this process started with."""
    monkeypatch.setattr(mooncake_engine, "_quiet_batch_wait", True)
    calls: list[str] = []
    engine = MooncakeTransferEngine(
        MooncakeConfig(),
        pace=ReadPace(min_sleep_s=0.0),
        sleep=lambda seconds: calls.append(f"sleep {seconds:.9f}"),
    )
    spy = BindingSpy(engine._engine, calls)
    monkeypatch.setattr(engine, "_engine", spy)
    cache = PagedKvCache(LOCAL_LAYOUT, device="cpu")
    cache.register(engine)
    calls.clear()
    yield engine, cache, calls, spy
    cache.unregister()


async def test_a_paced_read_sleeps_its_share_between_submission_and_wait(
    paced: tuple[MooncakeTransferEngine, PagedKvCache, list[str], BindingSpy],
    executor: concurrent.futures.Executor,
    peer: Peer,
) -> None:
    engine, cache, calls, _ = paced
    session = peer.endpoint.session_name
    pairs = [(i, 30 + i) for i in range(12)]
    plan = TransferPlan.build(cache.describe(), peer.endpoint, pairs, coalesce=False)

    async def read() -> None:
        for layer in cache.layers:
            layer.zero_()
        calls.clear()
        result = await pull(engine, plan, deadline_s=NEVER_HANG_S, executor=executor)
        assert result.outcome is TransferOutcome.SUCCEEDED, result.error
        assert_blocks_hold_pattern(cache, pairs)

    await read()  # the peer's first read (connection set-up) teaches nothing
    assert engine.pace.seconds_per_byte(session) is None
    assert calls == ["batch_transfer_async_read", "get_batch_transfer_status"]
    await read()
    learnt = engine.pace.seconds_per_byte(session)
    assert learnt is not None and learnt > 0
    assert calls == ["batch_transfer_async_read", "get_batch_transfer_status"]
    await read()
    expected = engine.pace.share * learnt * plan.total_bytes
    assert calls == [
        "batch_transfer_async_read",
        f"sleep {expected:.9f}",
        "get_batch_transfer_status",
    ]


async def test_a_failed_paced_read_teaches_the_pace_nothing(
    paced: tuple[MooncakeTransferEngine, PagedKvCache, list[str], BindingSpy],
    executor: concurrent.futures.Executor,
    peer: Peer,
) -> None:
    engine, cache, calls, spy = paced
    session = peer.endpoint.session_name
    good = TransferPlan.build(cache.describe(), peer.endpoint, [(0, 1), (1, 2)])
    for _ in range(2):
        result = await pull(engine, good, deadline_s=NEVER_HANG_S, executor=executor)
        assert result.outcome is TransferOutcome.SUCCEEDED
    learnt = engine.pace.seconds_per_byte(session)
    assert learnt is not None
    region = peer.endpoint.regions[-1]
    beyond = region.base_addr + region.num_blocks * region.block_len + (1 << 30)
    bad = replace(good, remote_addresses=(beyond,) * good.num_entries)
    failed = await pull(engine, bad, deadline_s=NEVER_HANG_S, executor=executor, settle_s=0.2)
    assert failed.outcome is TransferOutcome.FAILED
    assert engine.pace.seconds_per_byte(session) == learnt
    # A refused submission (0, or -1 as uint64) is a failure: no sleep, no wait.
    for refused in (0, 2**64 - 1):
        spy.forced["batch_transfer_async_read"] = refused
        calls.clear()
        code = engine.read_batch(session, good.local_addresses, good.remote_addresses, good.lengths)
        assert code == -1
        assert calls == ["batch_transfer_async_read"]


_QUIET_LOG_SCRIPT = """
import json, sys
import numpy as np
from clients import mooncake_engine as me
source = me.MooncakeTransferEngine(me.MooncakeConfig())
reader = me.MooncakeTransferEngine(me.MooncakeConfig(), sleep=lambda s: None)
if sys.argv[1] == "force":
    me._quiet_batch_wait = True  # the negative control: pace whatever the log level
src = np.arange(1 << 20, dtype=np.uint8)
dst = np.zeros(1 << 20, dtype=np.uint8)
source.register(src.ctypes.data, src.nbytes)
reader.register(dst.ctypes.data, dst.nbytes)
block = 1 << 16
local = [dst.ctypes.data + i * block for i in range(16)]
remote = [src.ctypes.data + i * block for i in range(16)]
codes = [reader.read_batch(source.session_name, local, remote, [block] * 16) for _ in range(5)]
assert codes == [0] * 5 and bytes(dst) == bytes(src), codes
paced = reader.pace.seconds_per_byte(source.session_name) is not None
print(json.dumps({"quiet": me._quiet_batch_wait, "paced": paced}))
"""


@pytest.mark.parametrize(
    ("level", "mode", "quiet", "lines"),
    [
        (None, "plain", True, 0),  # kvrc sets WARNING, and reads are paced
        ("ERROR", "plain", True, 0),
        ("INFO", "plain", False, 0),  # the operator's INFO: the sync read, no line per read
        ("FATAL", "plain", False, 0),  # not a level Mooncake knows: it logs INFO
        ("INFO", "force", True, 5),  # negative control: paced under INFO logs every read
    ],
)
def test_paced_reads_write_no_log_line_per_read(
    level: str | None, mode: str, quiet: bool, lines: int
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MC_LOG_LEVEL"}
    if level is not None:
        env["MC_LOG_LEVEL"] = level
    done = subprocess.run(
        [sys.executable, "-c", _QUIET_LOG_SCRIPT, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result == {"quiet": quiet, "paced": quiet}
    assert done.stderr.count("Batch Transfer completed") == lines


# --- pulls from a live peer ----------------------------------------------------------


async def test_pull_is_bit_exact(
    engine: MooncakeTransferEngine,
    executor: concurrent.futures.Executor,
    local: PagedKvCache,
    peer: Peer,
) -> None:
    # A contiguous run, a reversed run and scattered blocks.
    pairs = [(i, 20 + i) for i in range(8)] + [(10 + i, 50 - i) for i in range(5)] + [(40, 63)]
    plan = TransferPlan.build(local.describe(), peer.endpoint, pairs)
    result = await pull(engine, plan, deadline_s=NEVER_HANG_S, executor=executor)
    assert result.outcome is TransferOutcome.SUCCEEDED, result.error
    assert result.bytes_moved == len(pairs) * LAYOUT.num_layers * LAYOUT.block_bytes
    assert result.tainted_block_ids == () and result.is_quiet()
    assert_blocks_hold_pattern(local, pairs)
    untouched = sorted(set(range(LOCAL_LAYOUT.num_blocks)) - {local_id for local_id, _ in pairs})
    assert_blocks_zero(local, untouched)


async def test_coalesced_plan_has_fewer_entries_and_moves_the_same_bytes(
    engine: MooncakeTransferEngine,
    executor: concurrent.futures.Executor,
    local: PagedKvCache,
    peer: Peer,
) -> None:
    pairs = [(i, 10 + i) for i in range(16)] + [(30 + i, 40 + i) for i in range(8)]
    coalesced = TransferPlan.build(local.describe(), peer.endpoint, pairs)
    per_block = TransferPlan.build(local.describe(), peer.endpoint, pairs, coalesce=False)
    assert coalesced.num_entries == 2 * LAYOUT.num_layers
    assert per_block.num_entries == len(pairs) * LAYOUT.num_layers
    assert coalesced.total_bytes == per_block.total_bytes

    first = await pull(engine, coalesced, deadline_s=NEVER_HANG_S, executor=executor)
    assert first.outcome is TransferOutcome.SUCCEEDED, first.error
    coalesced_bytes = [layer.clone() for layer in local.layers]
    for layer in local.layers:
        layer.zero_()
    second = await pull(engine, per_block, deadline_s=NEVER_HANG_S, executor=executor)
    assert second.outcome is TransferOutcome.SUCCEEDED, second.error
    assert first.bytes_moved == second.bytes_moved
    for before, after in zip(coalesced_bytes, local.layers, strict=True):
        assert torch.equal(before.view(torch.uint8), after.view(torch.uint8))
    assert_blocks_hold_pattern(local, pairs)


async def test_heterogeneous_layout_is_refused_before_any_byte_moves(
    local: PagedKvCache, tmp_path: Path
) -> None:
    # float16 vs bfloat16: the same block bytes, a different meaning. Must be refused.
    other = Peer(replace(LAYOUT, dtype="float16"), tmp_path / "peer.log")
    try:
        assert other.endpoint.layout.block_bytes == LAYOUT.block_bytes
        with pytest.raises(IncompatibleLayoutError, match="dtype"):
            TransferPlan.build(local.describe(), other.endpoint, [(0, 0), (1, 1)])
        assert_blocks_zero(local, list(range(LOCAL_LAYOUT.num_blocks)))
    finally:
        other.close()


async def test_dead_peer_fails_fast_and_taints_until_quiet(
    engine: MooncakeTransferEngine,
    executor: concurrent.futures.Executor,
    local: PagedKvCache,
    fresh_peer: Peer,
) -> None:
    fresh_peer.signal(signal.SIGKILL)
    fresh_peer.process.wait(timeout=10)
    pairs = [(i, i) for i in range(4)]
    plan = TransferPlan.build(local.describe(), fresh_peer.endpoint, pairs)
    in_flight = InFlightReads()
    started = time.monotonic()
    result = await pull(
        engine,
        plan,
        deadline_s=NEVER_HANG_S,
        executor=executor,
        wait_settle=False,
        in_flight=in_flight,
        settle_s=0.5,
    )
    assert time.monotonic() - started < NEVER_HANG_S  # failed, not timed out
    assert result.outcome is TransferOutcome.FAILED
    assert result.bytes_moved == 0 and "returned -" in result.error
    # Entries of a failed batch may still land for a while: tainted until quiet.
    assert result.tainted_block_ids == (0, 1, 2, 3)
    assert not result.is_quiet()
    assert in_flight.tainted_block_ids() == frozenset({0, 1, 2, 3})
    # FAILED means "proven quiet" on the wire: no report before that.
    with pytest.raises(RuntimeError, match="wait_quiet"):
        result.to_report(lease_id="l", reporter_child_engine_id="d", tp_rank=0)
    assert await result.wait_quiet(timeout_s=NEVER_HANG_S)
    assert result.is_quiet() and len(in_flight) == 0
    report = result.to_report(lease_id="l", reporter_child_engine_id="d", tp_rank=0)
    assert report.outcome == kvrc_pb2.TRANSFER_OUTCOME_FAILED

    # The default waits the settle delay itself: a FAILED result is already quiet.
    settled = await pull(engine, plan, deadline_s=NEVER_HANG_S, executor=executor, settle_s=0.2)
    assert settled.outcome is TransferOutcome.FAILED
    assert settled.is_quiet() and settled.tainted_block_ids == ()


async def test_frozen_peer_gives_unknown_within_the_deadline_and_bytes_land_later(
    engine: MooncakeTransferEngine,
    executor: concurrent.futures.Executor,
    local: PagedKvCache,
    fresh_peer: Peer,
) -> None:
    pairs = [(i, 30 + i) for i in range(6)]
    plan = TransferPlan.build(local.describe(), fresh_peer.endpoint, pairs)
    in_flight = InFlightReads()
    fresh_peer.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        result = await pull(
            engine, plan, deadline_s=0.5, executor=executor, in_flight=in_flight, settle_s=0.2
        )
        elapsed = time.monotonic() - started
        assert result.outcome is TransferOutcome.UNKNOWN
        assert 0.5 <= elapsed < NEVER_HANG_S
        assert "may still land" in result.error
        assert result.tainted_block_ids == tuple(range(6))
        assert in_flight.tainted_block_ids() == frozenset(range(6))
        assert not await result.wait_quiet(timeout_s=0.3)  # still blocked inside Mooncake
        # Nothing may be pulled into blocks that a running read may still write.
        overlapping = TransferPlan.build(local.describe(), fresh_peer.endpoint, [(5, 0)])
        with pytest.raises(ValueError, match=r"blocks \[5\] are tainted"):
            await pull(engine, overlapping, deadline_s=1.0, executor=executor, in_flight=in_flight)
    finally:
        fresh_peer.signal(signal.SIGCONT)
    # The peer wakes up and the "timed out" read lands anyway: why UNKNOWN taints.
    assert await in_flight.wait_all_quiet(timeout_s=90)
    assert len(in_flight) == 0 and result.is_quiet()
    assert_blocks_hold_pattern(local, pairs)


async def test_address_outside_peer_memory_fails_without_harming_the_peer(
    engine: MooncakeTransferEngine,
    executor: concurrent.futures.Executor,
    local: PagedKvCache,
    peer: Peer,
) -> None:
    good = TransferPlan.build(local.describe(), peer.endpoint, [(0, 1), (1, 2)])
    region = peer.endpoint.regions[-1]
    beyond = region.base_addr + region.num_blocks * region.block_len + (1 << 30)
    bad = replace(good, remote_addresses=(beyond,) * good.num_entries)
    result = await pull(engine, bad, deadline_s=NEVER_HANG_S, executor=executor, settle_s=0.2)
    assert result.outcome is TransferOutcome.FAILED and result.bytes_moved == 0
    assert_blocks_zero(local, [0, 1])
    assert peer.process.poll() is None
    # Four rejections in a row make Mooncake hold the peer off for ~1 s; we caused at
    # most two, and a valid read afterwards succeeds.
    retry = await pull(engine, good, deadline_s=NEVER_HANG_S, executor=executor)
    assert retry.outcome is TransferOutcome.SUCCEEDED, retry.error
    assert_blocks_hold_pattern(local, [(0, 1), (1, 2)])


async def test_empty_plan_succeeds_without_touching_mooncake(
    executor: concurrent.futures.Executor, local: PagedKvCache, peer: Peer
) -> None:
    plan = TransferPlan.build(local.describe(), peer.endpoint, [])

    class Unreachable:
        def read_batch(self, *args: object) -> int:
            raise AssertionError("an empty plan must not reach the engine")

    result = await pull(Unreachable(), plan, deadline_s=1.0, executor=executor)
    assert result.outcome is TransferOutcome.SUCCEEDED and result.bytes_moved == 0


async def test_a_raising_binding_is_a_failed_outcome_not_a_crash(
    executor: concurrent.futures.Executor, local: PagedKvCache, peer: Peer
) -> None:
    plan = TransferPlan.build(local.describe(), peer.endpoint, [(0, 0)])

    class Broken:
        def read_batch(self, *args: object) -> int:
            raise TypeError("incompatible function arguments")

    result = await pull(Broken(), plan, deadline_s=1.0, executor=executor, settle_s=0.0)
    assert result.outcome is TransferOutcome.FAILED
    assert "incompatible function arguments" in result.error


async def test_bad_pull_arguments_are_refused(
    engine: MooncakeTransferEngine,
    executor: concurrent.futures.Executor,
    local: PagedKvCache,
    peer: Peer,
) -> None:
    plan = TransferPlan.build(local.describe(), peer.endpoint, [(0, 0)])
    with pytest.raises(ValueError, match="deadline_s"):
        await pull(engine, plan, deadline_s=0, executor=executor)
    with pytest.raises(ValueError, match="settle_s"):
        await pull(engine, plan, deadline_s=1, executor=executor, settle_s=-1)


# --- rank parts of one load ---------------------------------------------------------


def descriptor(
    tp_rank: int, endpoint: KvEndpointDescription, block_ids: list[int]
) -> kvrc_pb2.RankPartDescriptor:
    return rank_part_descriptor(endpoint, block_ids, tp_rank=tp_rank)


async def test_a_rank_part_failing_its_slice_fails_the_whole_load(
    engine: MooncakeTransferEngine,
    executor: concurrent.futures.Executor,
    local: PagedKvCache,
    peer: Peer,
    fresh_peer: Peer,
) -> None:
    # A tp=2 source: rank 0 is alive, rank 1 dies before the pull.
    source_ids = [3, 4, 5, 9]
    parts = [
        descriptor(0, peer.endpoint, source_ids),
        descriptor(1, fresh_peer.endpoint, source_ids),
    ]
    fresh_peer.signal(signal.SIGKILL)
    fresh_peer.process.wait(timeout=10)
    # Both local rank parts live in this process here; in an engine each is its own.
    rank1_cache = PagedKvCache(LOCAL_LAYOUT)
    rank1_cache.register(engine)
    try:
        local_ids = [0, 1, 2, 3]
        plans = [
            plan_rank_part_pull(cache.describe(), local_ids, parts, tp_rank=rank, tp_size=2)
            for rank, cache in ((0, local), (1, rank1_cache))
        ]
        assert plans[0].session_name == peer.endpoint.session_name
        assert plans[1].session_name == fresh_peer.endpoint.session_name
        results = await asyncio.gather(
            *(
                pull(engine, plan, deadline_s=NEVER_HANG_S, executor=executor, settle_s=0.2)
                for plan in plans
            )
        )
        assert [r.outcome for r in results] == [TransferOutcome.SUCCEEDED, TransferOutcome.FAILED]
        assert combine_outcomes([r.outcome for r in results]) is TransferOutcome.FAILED
        # Rank 0's slice landed, but the request is not loaded: it recomputes.
        assert_blocks_hold_pattern(local, list(zip(local_ids, source_ids, strict=True)))
        report = results[1].to_report(
            lease_id="lease-1", reporter_child_engine_id="prefill-1", tp_rank=1
        )
        assert report.outcome == kvrc_pb2.TRANSFER_OUTCOME_FAILED
        assert report.rank.tp_rank == 1 and report.bytes_moved == 0 and report.error_message
    finally:
        rank1_cache.unregister()


async def test_tp_mismatch_is_refused_before_any_byte_moves(
    local: PagedKvCache, peer: Peer
) -> None:
    parts = [descriptor(0, peer.endpoint, [1, 2]), descriptor(1, peer.endpoint, [1, 2])]
    with pytest.raises(IncompatibleLayoutError, match="2 rank parts, this engine 1"):
        plan_rank_part_pull(local.describe(), [0, 1], parts, tp_rank=0, tp_size=1)
    with pytest.raises(IncompatibleLayoutError, match="1 rank parts, this engine 4"):
        plan_rank_part_pull(local.describe(), [0, 1], parts[:1], tp_rank=0, tp_size=4)
    duplicate = [descriptor(0, peer.endpoint, [1, 2])] * 2
    with pytest.raises(IncompatibleLayoutError, match="duplicate or out-of-range"):
        plan_rank_part_pull(local.describe(), [0, 1], duplicate, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="block id 64"):
        rank_part_descriptor(peer.endpoint, [63, 64], tp_rank=0)
    with pytest.raises(ValueError, match="lists 2 blocks, 3 requested"):
        plan_rank_part_pull(local.describe(), [0, 1, 2], parts, tp_rank=0, tp_size=2)
    assert_blocks_zero(local, list(range(LOCAL_LAYOUT.num_blocks)))


def test_combine_outcomes_and_reports() -> None:
    ok, failed, unknown = TransferOutcome.SUCCEEDED, TransferOutcome.FAILED, TransferOutcome.UNKNOWN
    assert combine_outcomes([ok, ok]) is ok
    assert combine_outcomes([ok, failed]) is failed
    assert combine_outcomes([failed, unknown, ok]) is unknown
    with pytest.raises(ValueError):
        combine_outcomes([])
    done = TransferResult(ok, 4096, 0.0025, "", ())
    report = done.to_report(lease_id="l", reporter_child_engine_id="d", tp_rank=1)
    assert report.outcome == kvrc_pb2.TRANSFER_OUTCOME_SUCCEEDED
    assert (report.bytes_moved, report.duration_us) == (4096, 2500)
    # No prefill sample unless the engine measured one (the cost model then keeps its prior).
    assert not report.HasField("prefill")
    sampled = done.to_report(
        lease_id="l", reporter_child_engine_id="d", tp_rank=1, prefill=(512, 0.064)
    )
    assert (sampled.prefill.tokens, sampled.prefill.duration_us) == (512, 64_000)
    with pytest.raises(ValueError, match="prefill sample"):
        done.to_report(lease_id="l", reporter_child_engine_id="d", tp_rank=1, prefill=(0, 1.0))


# --- tainting, driven step by step ---------------------------------------------------


class ScriptedReader:
    """Stands in for the native call only to control *when* it returns (threads are real)."""

    def __init__(self, return_code: int) -> None:
        self.return_code = return_code
        self.release = threading.Event()

    def read_batch(self, *args: object) -> int:
        self.release.wait(timeout=30)
        return self.return_code


async def test_taint_lasts_until_the_call_returns_and_then_settles(
    executor: concurrent.futures.Executor, local: PagedKvCache, peer: Peer
) -> None:
    in_flight = InFlightReads()
    first_plan = TransferPlan.build(local.describe(), peer.endpoint, [(0, 0), (1, 1)])
    second_plan = TransferPlan.build(local.describe(), peer.endpoint, [(7, 7)])
    failing, succeeding = ScriptedReader(-1), ScriptedReader(0)
    first = await pull(
        failing, first_plan, deadline_s=0.1, executor=executor, in_flight=in_flight, settle_s=0.4
    )
    second = await pull(
        succeeding, second_plan, deadline_s=0.1, executor=executor, in_flight=in_flight
    )
    assert first.outcome is second.outcome is TransferOutcome.UNKNOWN
    assert in_flight.tainted_block_ids() == frozenset({0, 1, 7}) and len(in_flight) == 2

    succeeding.release.set()  # returns 0: its blocks are quiet as soon as it returns
    assert await second.wait_quiet(timeout_s=NEVER_HANG_S)
    assert in_flight.tainted_block_ids() == frozenset({0, 1})

    failing.release.set()  # returns -1: other entries may land for settle_s more
    assert await first.wait_quiet(timeout_s=0.0) is False

    def returned() -> bool:
        return first.native_read is not None and first.native_read.returned

    await wait_until(returned, NEVER_HANG_S, what="the native read returned")
    assert not first.is_quiet() and in_flight.tainted_block_ids() == frozenset({0, 1})
    assert await in_flight.wait_all_quiet(timeout_s=NEVER_HANG_S)
    assert first.is_quiet() and len(in_flight) == 0 and in_flight.tainted_block_ids() == set()


async def test_a_read_no_thread_took_before_its_deadline_is_cancelled_failed_and_quiet(
    local: PagedKvCache, peer: Peer
) -> None:
    """Every pull thread inside a read from a frozen peer (one thread here): a read queued
    behind them timed out UNKNOWN and stayed "not quiet" until a thread took it and it ran,
    up to a minute later, holding its request and its lease's abort ack that long."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="one")
    try:
        in_flight = InFlightReads()
        frozen = ScriptedReader(0)
        first = await pull(
            frozen,
            TransferPlan.build(local.describe(), peer.endpoint, [(0, 0)]),
            deadline_s=0.05,
            executor=pool,
            in_flight=in_flight,
        )
        assert first.outcome is TransferOutcome.UNKNOWN
        calls: list[object] = []

        class Counting:
            def read_batch(self, *args: object) -> int:
                calls.append(args)
                return 0

        waiters: list[asyncio.Future[bool]] = []
        second = await pull(
            Counting(),
            TransferPlan.build(local.describe(), peer.endpoint, [(1, 1)]),
            deadline_s=0.1,
            executor=pool,
            in_flight=in_flight,
            on_submit=lambda read: waiters.append(
                asyncio.ensure_future(read.wait_quiet(NEVER_HANG_S))
            ),
        )
        assert second.outcome is TransferOutcome.FAILED and "did not start" in second.error
        assert second.tainted_block_ids == () and second.is_quiet()
        assert await waiters[0] is True  # a waiter from before the cancel: quiet, not raised
        assert in_flight.tainted_block_ids() == frozenset({0})  # the frozen read's only
        report = second.to_report(lease_id="pl-1", reporter_child_engine_id="r", tp_rank=0)
        assert report.outcome == kvrc_pb2.TRANSFER_OUTCOME_FAILED
        assert report.duration_us == 0  # its wait in the queue says nothing of the link
        frozen.release.set()
        assert await first.wait_quiet(NEVER_HANG_S)
        await asyncio.sleep(0.05)  # the thread is free: a cancelled read still never runs
        assert calls == [] and in_flight.tainted_block_ids() == frozenset()
    finally:
        pool.shutdown(wait=True)


async def test_a_waiter_that_swallowed_an_earlier_cancel_still_sees_a_cancelled_read_quiet(
    local: PagedKvCache, peer: Peer
) -> None:
    """Python 3.11 keeps `Task.cancelling()` above 0 after a cancellation the task caught
    without `uncancel()`: only a cancellation during the wait may propagate."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="one")
    frozen = ScriptedReader(0)
    try:
        await pull(
            frozen,
            TransferPlan.build(local.describe(), peer.endpoint, [(0, 0)]),
            deadline_s=0.05,
            executor=pool,
        )
        reads: list[NativeRead] = []
        queued = asyncio.ensure_future(
            pull(
                ScriptedReader(0),
                TransferPlan.build(local.describe(), peer.endpoint, [(1, 1)]),
                deadline_s=0.3,
                executor=pool,
                on_submit=reads.append,
            )
        )
        await asyncio.sleep(0.05)

        async def waiter() -> bool:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(10)  # cancelled below, and swallowed
            return await reads[0].wait_quiet(NEVER_HANG_S)

        task = asyncio.ensure_future(waiter())
        await asyncio.sleep(0.01)
        task.cancel()
        assert (await queued).outcome is TransferOutcome.FAILED
        assert await task is True
    finally:
        frozen.release.set()
        pool.shutdown(wait=True)


class FrozenPeers:
    """Reads from the sessions in `frozen` block until released; others return."""

    def __init__(self, *frozen: str) -> None:
        self.frozen = set(frozen)
        self.release = threading.Event()
        self.sessions: list[str] = []

    def read_batch(self, session_name: str, *args: object) -> int:
        self.sessions.append(session_name)
        if session_name in self.frozen:
            self.release.wait(timeout=30)
        return 0


@pytest.mark.parametrize("capped", [True, False], ids=["peer-slots", "no-slots"])
async def test_a_frozen_peer_holds_no_more_pull_threads_than_its_slots(
    local: PagedKvCache, peer: Peer, capped: bool
) -> None:
    """Two pull threads, one slot per peer: peer A freezes. A's second read waits for
    A's slot and fails at its deadline without a thread, and a read from healthy B runs
    in the other thread. Without slots (the control) A's reads hold both threads and B's
    read never starts: every load from any peer fails until A's reads return."""
    base = TransferPlan.build(local.describe(), peer.endpoint, [(0, 0)])
    from_a, from_b = replace(base, session_name="peer-a"), replace(base, session_name="peer-b")
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="two")
    slots = PeerSlots(1) if capped else None
    reader = FrozenPeers("peer-a")
    try:
        first = await pull(reader, from_a, deadline_s=0.05, executor=pool, peer_slots=slots)
        second = await pull(reader, from_a, deadline_s=0.1, executor=pool, peer_slots=slots)
        healthy = await pull(reader, from_b, deadline_s=1.0, executor=pool, peer_slots=slots)
        assert first.outcome is TransferOutcome.UNKNOWN
        if capped:
            assert second.outcome is TransferOutcome.FAILED and "already running" in second.error
            assert second.duration_s == 0.0 and second.is_quiet()
            assert healthy.outcome is TransferOutcome.SUCCEEDED
            assert reader.sessions == ["peer-a", "peer-b"] and slots is not None
            assert slots.held("peer-a") == 1
        else:
            assert second.outcome is TransferOutcome.UNKNOWN
            assert healthy.outcome is TransferOutcome.FAILED and "did not start" in healthy.error
        reader.release.set()
        assert await first.wait_quiet(NEVER_HANG_S)
        if slots is not None:
            await wait_until(lambda: slots.held("peer-a") == 0, NEVER_HANG_S, what="A's slot")
    finally:
        reader.release.set()
        pool.shutdown(wait=True)


@pytest.mark.parametrize("spare", [2, 0], ids=["spare-threads", "no-spare"])
async def test_two_frozen_peers_leave_the_running_places_to_healthy_peers(
    local: PagedKvCache, peer: Peer, spare: int
) -> None:
    """Two running places, one slot per peer, two frozen peers (a partitioned rack): each
    frozen read passes its deadline (UNKNOWN) and moves to a spare thread, so a read from
    healthy C runs. Without spare threads (the control) the two frozen reads keep both
    running places and C's read never starts until they return."""
    base = TransferPlan.build(local.describe(), peer.endpoint, [(0, 0)])
    plans = {name: replace(base, session_name=name) for name in ("peer-a", "peer-b", "peer-c")}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2 + spare)
    slots = PeerSlots(1, threads=2, spare=spare)
    reader = FrozenPeers("peer-a", "peer-b")
    try:
        frozen = [
            await pull(reader, plans[name], deadline_s=0.05, executor=pool, peer_slots=slots)
            for name in ("peer-a", "peer-b")
        ]
        assert [r.outcome for r in frozen] == [TransferOutcome.UNKNOWN] * 2
        # A frozen peer's next read still waits for that peer's slot, spare threads or not.
        again = await pull(
            reader, plans["peer-a"], deadline_s=0.05, executor=pool, peer_slots=slots
        )
        assert again.outcome is TransferOutcome.FAILED and "already running" in again.error
        healthy = await pull(
            reader, plans["peer-c"], deadline_s=1.0, executor=pool, peer_slots=slots
        )
        if spare:
            assert healthy.outcome is TransferOutcome.SUCCEEDED
            assert slots.overdue == 2 and slots.running == 0
        else:
            assert healthy.outcome is TransferOutcome.FAILED and "2 in all" in healthy.error
            assert slots.overdue == 0 and slots.running == 2
        assert reader.sessions == ["peer-a", "peer-b"] + (["peer-c"] if spare else [])
        reader.release.set()
        for result in frozen:
            assert await result.wait_quiet(NEVER_HANG_S)
        await wait_until(
            lambda: (slots.running, slots.overdue, slots.held("peer-a")) == (0, 0, 0),
            NEVER_HANG_S,
            what="every slot back",
        )
    finally:
        reader.release.set()
        pool.shutdown(wait=True)


async def test_overdue_reads_past_the_spare_keep_their_running_place() -> None:
    """At most `spare` reads give their running place back: more frozen peers than that
    cannot make the slots start more reads than running places plus spare threads."""
    slots = PeerSlots(1, threads=1, spare=1)
    reads = [concurrent.futures.Future[Any]() for _ in range(3)]
    for i in range(2):
        assert await slots.acquire(f"p{i}", 1.0)
        slots.release_when_done(f"p{i}", reads[i])
        slots.mark_overdue(reads[i])
    assert (slots.running, slots.overdue) == (1, 1)  # the second kept its place
    assert await slots.acquire("p2", 0.05) is False  # no thread left for a third
    reads[0].set_result(None)  # the first frozen read returns: the spare is free again
    await wait_until(lambda: slots.overdue == 0, NEVER_HANG_S, what="the spare back")
    assert slots.running == 1 and await slots.acquire("p2", 0.05) is False
    slots.mark_overdue(reads[1])  # now the second may move to the spare thread
    assert await slots.acquire("p2", 1.0) is True
    with pytest.raises(ValueError, match="threads"):
        PeerSlots(1, threads=0)


async def test_a_peer_slot_passes_to_the_next_waiter_and_a_late_one_gives_up() -> None:
    slots = PeerSlots(1)
    assert await slots.acquire("a", 1.0) and slots.held("a") == 1
    waiter = asyncio.ensure_future(slots.acquire("a", NEVER_HANG_S))
    late = asyncio.ensure_future(slots.acquire("a", 0.05))
    await asyncio.sleep(0.2)
    assert late.done() and late.result() is False and not waiter.done()
    slots.release("a")  # to the waiter, not freed
    assert await waiter is True and slots.held("a") == 1
    assert await slots.acquire("b", 0.01) is True  # another peer: its own slots
    slots.release("a")
    slots.release("b")
    assert slots.held("a") == slots.held("b") == 0
    with pytest.raises(ValueError, match="per_peer"):
        PeerSlots(0)


async def test_a_slot_handed_over_as_its_waiter_times_out_is_passed_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Python 3.12's wait_for cannot cancel a future already done: a waiter handed the
    slot in the same loop turn as its timeout raised TimeoutError holding it, and the
    slot was never handed back. Python 3.12's wait_for, run here on 3.11."""

    async def wait_for_312(fut: Any, seconds: float | None) -> Any:
        async with asyncio.timeout(seconds):
            return await fut

    monkeypatch.setattr(asyncio, "wait_for", wait_for_312)
    slots = PeerSlots(1)
    assert await slots.acquire("a", 1.0)
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, time.sleep, 0.1)  # a busy loop: the release and the timeout
    loop.call_later(0.04, slots.release, "a")  # fall due in one turn, the release first
    got = await slots.acquire("a", 0.05)
    assert slots.held("a") == (1 if got else 0), got


async def test_a_waiter_that_gave_up_does_not_hold_back_the_next_one() -> None:
    """A waiter whose wait ended (timed out: wait_for cancelled its future) is still
    queued until its task runs again. A read asking for the peer's slot in that turn
    queued behind it, and nothing woke it when the entry went: it waited out its
    deadline with the slot free."""
    slots = PeerSlots(1)
    assert await slots.acquire("a", 1.0)
    gave_up = asyncio.ensure_future(slots.acquire("a", NEVER_HANG_S))
    await asyncio.sleep(0)
    [(_, granted)] = slots._waiting
    granted.cancel()  # what wait_for's timeout does, before the waiter's task resumes
    slots.release("a")  # the slot is free; the waiter that gave up gets nothing
    assert await slots.acquire("a", 0.5) is True
    with pytest.raises(asyncio.CancelledError):
        await gave_up  # its future was cancelled under it, as a timeout cancels it
    assert slots.held("a") == 1 and slots.running == 1


async def test_a_slot_handed_over_as_the_slots_close_starts_no_read() -> None:
    slots = PeerSlots(1)
    assert await slots.acquire("a", 1.0)
    waiter = asyncio.ensure_future(slots.acquire("a", NEVER_HANG_S))
    await asyncio.sleep(0)
    slots.release("a")  # handed to the waiter, whose task has not run yet
    slots.close()  # a shutdown, in the same turn
    assert await waiter is False and slots.held("a") == 0 and slots.running == 0


async def test_closed_peer_slots_start_no_read_and_end_the_waits() -> None:
    slots = PeerSlots(1)
    assert await slots.acquire("a", 1.0)
    waiter = asyncio.ensure_future(slots.acquire("a", NEVER_HANG_S))
    await asyncio.sleep(0.01)
    slots.close()  # a shutdown
    assert await waiter is False and await slots.acquire("b", 1.0) is False
    slots.release("a")  # the read that held it returned
    assert slots.held("a") == 0


async def test_a_pull_cancelled_mid_read_has_already_filed_its_read(
    executor: concurrent.futures.Executor, local: PagedKvCache, peer: Peer
) -> None:
    """A rank part files each read under its lease through `on_submit`, before `pull`
    awaits it: a pull cancelled mid-read (a follower's leader channel closing) must not
    take the read with it, or an abort is acknowledged while bytes can still land
    (I6-quiescence)."""
    plan = TransferPlan.build(local.describe(), peer.endpoint, [(3, 3), (4, 4)])
    reader = ScriptedReader(0)  # a read from a frozen peer: returns only when released
    filed: list[NativeRead] = []
    task = asyncio.create_task(
        pull(reader, plan, deadline_s=30, executor=executor, on_submit=filed.append)
    )
    await wait_until(lambda: bool(filed), NEVER_HANG_S, what="the read submitted")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The caller is gone; the read it filed is still running, and not quiet until it returns.
    [read] = filed
    assert not read.is_quiet() and read.local_block_ids == (3, 4)
    reader.release.set()
    assert await read.wait_quiet(timeout_s=NEVER_HANG_S)


# --- plans (pure) ---------------------------------------------------------------


def synthetic_endpoint(
    layout: KvCacheLayout, base: int, session: str = "127.0.0.1:1"
) -> KvEndpointDescription:
    layer_stride = layout.layer_bytes + 4096
    return KvEndpointDescription.from_parts(
        backend="mooncake",
        session_name=session,
        layout=layout,
        regions=[
            KvRegionDescription(
                layer=layer,
                base_addr=base + layer * layer_stride,
                block_len=layout.block_bytes,
                num_blocks=layout.num_blocks,
            )
            for layer in range(layout.num_layers)
        ],
    )


SMALL = KvCacheLayout(
    num_layers=3, num_blocks=32, block_size=4, num_kv_heads=1, head_size=8, dtype="float16"
)


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    local_ids=st.lists(st.integers(0, 31), unique=True, max_size=32),
    coalesce=st.booleans(),
)
def test_plan_maps_every_local_block_byte_to_its_remote_block(
    data: st.DataObject, local_ids: list[int], coalesce: bool
) -> None:
    remote_ids = data.draw(
        st.lists(st.integers(0, 31), min_size=len(local_ids), max_size=len(local_ids))
    )
    pairs = list(zip(local_ids, remote_ids, strict=True))
    local = synthetic_endpoint(SMALL, 1 << 20)
    remote = synthetic_endpoint(SMALL, 1 << 30, "127.0.0.1:2")
    plan = TransferPlan.build(local, remote, pairs, coalesce=coalesce)
    block = SMALL.block_bytes
    # Expand the entries back to block granularity: exactly the requested copies.
    copies = set()
    for local_addr, remote_addr, length in zip(
        plan.local_addresses, plan.remote_addresses, plan.lengths, strict=True
    ):
        assert length > 0 and length % block == 0
        for offset in range(0, length, block):
            copies.add((local_addr + offset, remote_addr + offset))
    expected = {
        (local.regions[layer].block_address(l_id), remote.regions[layer].block_address(r_id))
        for layer in range(SMALL.num_layers)
        for l_id, r_id in pairs
    }
    assert copies == expected
    assert plan.total_bytes == len(pairs) * SMALL.num_layers * block
    assert plan.local_block_ids == tuple(sorted(local_ids))
    if coalesce:  # maximal runs: a new entry exactly where either side skips a block
        ordered = sorted(pairs)
        runs = 1 + sum(
            1 for (l0, r0), (l1, r1) in itertools.pairwise(ordered) if (l1, r1) != (l0 + 1, r0 + 1)
        )
        assert plan.num_entries == (runs if pairs else 0) * SMALL.num_layers
    else:
        assert plan.num_entries == len(pairs) * SMALL.num_layers


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        ([(32, 0)], "local block id 32"),
        ([(-1, 0)], "local block id -1"),
        ([(0, 32)], "remote block id 32"),
        ([(0, 1), (0, 2)], "written twice"),
    ],
)
def test_plan_refuses_bad_block_ids(pairs: list[tuple[int, int]], message: str) -> None:
    local = synthetic_endpoint(SMALL, 1 << 20)
    with pytest.raises(ValueError, match=message):
        TransferPlan.build(local, synthetic_endpoint(SMALL, 1 << 30), pairs)


def test_plan_from_id_arrays_refuses_arrays_that_do_not_pair_up() -> None:
    local = synthetic_endpoint(SMALL, 1 << 20)
    with pytest.raises(ValueError, match="3 local and 2 remote block ids"):
        TransferPlan.from_block_ids(local, synthetic_endpoint(SMALL, 1 << 30), [0, 1, 2], [0, 1])


def test_endpoint_round_trips_through_the_protocol() -> None:
    endpoint = synthetic_endpoint(SMALL, 1 << 40, "10.0.0.7:15123")
    message = endpoint_to_proto(endpoint)
    assert message.session_name == "10.0.0.7:15123" and message.backend == "mooncake"
    assert [region.base_addr for region in message.regions] == [
        region.base_addr for region in endpoint.regions
    ]
    assert endpoint_from_proto(message) == endpoint
    # What a peer cannot be trusted with is refused, not half-parsed.
    del message.extra["kvrc.kv_layout"]
    with pytest.raises(ValueError, match=r"kvrc\.kv_layout"):
        endpoint_from_proto(message)
    # The registration path (EngineSession) carries the same description.
    registration = RankPartRegistration(
        engine_id="prefill-0",
        profile=EngineProfile(model="m", block_size=SMALL.block_size),
        endpoint=endpoint_to_session(endpoint),
    )
    assert endpoint_from_proto(registration.to_proto().endpoint) == endpoint
    broken = endpoint_to_proto(endpoint)
    broken.regions[1].block_len += 1
    with pytest.raises(ValueError, match="block_len"):
        endpoint_from_proto(broken)


def test_a_rank_parts_endpoint_is_put_in_protocol_form_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank part answers every pin and publish with its one endpoint: its protocol
    form is built once (0.2 ms a time at 80 layers), and each descriptor carries it
    whole. Another endpoint object gets its own."""
    import clients.transfer as transfer

    built: list[KvEndpointDescription] = []
    real = transfer.endpoint_to_proto

    def counting(endpoint: KvEndpointDescription) -> kvrc_pb2.TransferEndpoint:
        built.append(endpoint)
        return real(endpoint)

    monkeypatch.setattr(transfer, "endpoint_to_proto", counting)
    endpoint = synthetic_endpoint(SMALL, 1 << 40)
    answers = [rank_part_descriptor(endpoint, [i, i + 1], tp_rank=0) for i in range(10)]
    assert built == [endpoint]
    assert all(a.endpoint == real(endpoint) for a in answers)
    assert [list(a.block_ids) for a in answers[:2]] == [[0, 1], [1, 2]]
    other = synthetic_endpoint(SMALL, 1 << 41)
    assert rank_part_descriptor(other, [0], tp_rank=0).endpoint == real(other)
    assert built == [endpoint, other]


def test_a_block_two_reads_write_stays_tainted_until_both_are_quiet() -> None:
    """The taint is counted per block: one of two reads into block 2 going quiet leaves
    it tainted; the plan's check names only its own tainted blocks."""
    from clients.transfer import _NativeReturn

    in_flight = InFlightReads()
    first: concurrent.futures.Future[_NativeReturn] = concurrent.futures.Future()
    second: concurrent.futures.Future[_NativeReturn] = concurrent.futures.Future()
    in_flight.add(NativeRead(first, (1, 2), settle_s=0.0))
    in_flight.add(NativeRead(second, (2, 3), settle_s=0.0))
    assert in_flight.tainted_among([0, 2, 3, 9]) == {2, 3}
    first.set_result(_NativeReturn(0, time.monotonic(), ""))
    assert in_flight.tainted_block_ids() == frozenset({2, 3}) and len(in_flight) == 1
    assert in_flight.tainted_among([1, 2]) == {2}
    second.set_result(_NativeReturn(0, time.monotonic(), ""))
    assert in_flight.tainted_among([1, 2, 3]) == set() and len(in_flight) == 0
    assert in_flight.tainted_block_ids() == frozenset()
