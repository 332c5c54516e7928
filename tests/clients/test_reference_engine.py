"""The reference engine's parts on their own: compute, block pool, control channel.

The pool is checked with a hypothesis state machine against a plain model: every
block is in exactly one state, the prefix table matches what was published
(stored minus removed), and nothing referenced, pinned or tainted is ever
handed out again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from refengine_faults import FaultHook, PullFaults, parse_faults
from waiting import wait_until

from clients.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    KvrcClientError,
    NotFoundError,
    outcome_unknown,
)
from clients.hashing import hash_block_chain
from clients.kv_cache import (
    KvCacheLayout,
    KvEndpointDescription,
    KvRegionDescription,
    PagedKvCache,
)
from clients.leases import LeaseSessionHandler, publish_rounds
from clients.refengine.blocks import BlockPool, PoolExhaustedError
from clients.refengine.channel import Channel, ChannelError
from clients.refengine.compute import expected_blocks, kv_values, write_positions
from clients.refengine.engine import Leader, RankPart, _pull_reply
from clients.refengine.options import EngineOptions, add_engine_arguments, options_from_args
from clients.refengine.pull_hook import NO_PULL_HOOK, PullContext
from clients.refengine.tasks import BackgroundTasks
from clients.transfer import TransferPlan
from kvrc.credentials import ChannelOptions, CredentialsError, split_targets

LAYOUT = KvCacheLayout(
    num_layers=2, num_blocks=16, block_size=4, num_kv_heads=2, head_size=8, dtype="bfloat16"
)

# --- deterministic compute ----------------------------------------------------------


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@settings(max_examples=25, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50_000), min_size=1, max_size=30),
    split=st.integers(0, 30),
    tp_rank=st.integers(0, 3),
)
def test_written_blocks_equal_expected_whatever_the_split(
    kv_layout: str, tokens: list[int], split: int, tp_rank: int
) -> None:
    """Computing a request in two steps (prefill, then decode) gives the same bytes."""
    layout = KvCacheLayout(**{**LAYOUT.to_dict(), "kv_layout": kv_layout})
    n_blocks = -(-len(tokens) // layout.block_size)
    block_ids = list(range(n_blocks))[::-1]  # any placement in the cache
    cache = PagedKvCache(layout)
    cache.layers[0].fill_(7)  # stale contents must not leak into a block
    split = min(split, len(tokens))
    first = tokens[:split]
    if first:
        write_positions(
            cache, first, block_ids[: -(-split // layout.block_size)], 0, tp_rank=tp_rank
        )
    write_positions(cache, tokens, block_ids, split, tp_rank=tp_rank)
    expected = expected_blocks(layout, tokens, list(range(n_blocks)), tp_rank=tp_rank)
    for index, block_id in enumerate(block_ids):
        for layer in range(layout.num_layers):
            assert torch.equal(cache.block_bytes_view(layer, block_id), expected[index, layer])


def test_values_depend_on_prefix_position_layer_and_rank() -> None:
    base = kv_values(LAYOUT, [5, 6, 7], range(0, 3), tp_rank=0)
    assert torch.equal(base, kv_values(LAYOUT, [5, 6, 7], range(0, 3), tp_rank=0))
    assert not torch.equal(base, kv_values(LAYOUT, [5, 6, 7], range(0, 3), tp_rank=1))
    # Position 2 sees the whole prefix: changing token 0 changes it; a suffix does not.
    other_prefix = kv_values(LAYOUT, [9, 6, 7], range(0, 3), tp_rank=0)
    assert not torch.equal(base[:, 2], other_prefix[:, 2])
    longer = kv_values(LAYOUT, [5, 6, 7, 8], range(0, 3), tp_rank=0)
    assert torch.equal(base, longer)
    assert not torch.equal(base[0], base[1])  # layers differ
    assert not torch.isnan(base.float()).any()


def test_partial_block_tail_is_zero_and_one_byte_off_is_a_mismatch() -> None:
    cache = PagedKvCache(LAYOUT)
    cache.layers[1].fill_(3)
    tokens = [1, 2, 3, 4, 5, 6]  # one full block and a half
    write_positions(cache, tokens, [4, 9], 0, tp_rank=0)
    expected = expected_blocks(LAYOUT, tokens, [0, 1], tp_rank=0)
    tail = cache.block(1, 9)[:, 2:]  # NHD: slots 2..3 of the partial block
    assert bool((tail == 0).all())
    assert torch.equal(cache.block_bytes_view(1, 9), expected[1, 1])
    cache.block_bytes_view(1, 9)[17] ^= 1
    assert not torch.equal(cache.block_bytes_view(1, 9), expected[1, 1])


def test_write_positions_refuses_wrong_block_count() -> None:
    with pytest.raises(ValueError, match="blocks for"):
        write_positions(PagedKvCache(LAYOUT), [1, 2, 3, 4, 5], [0], 0, tp_rank=0)


# --- block pool ---------------------------------------------------------------------


def chain(seed: int, blocks: int) -> list[bytes]:
    tokens = [seed * 1000 + i for i in range(blocks * 4)]
    return hash_block_chain(tokens, 4, seed=0)


def test_lru_evicts_oldest_unreferenced_and_reports_removed_hashes() -> None:
    pool = BlockPool(4)
    a, b = chain(1, 2), chain(2, 2)
    ids_a, _ = pool.allocate(2, 0)
    assert [s.block_hash for s in pool.commit(ids_a, a, b"")] == a
    pool.release(ids_a, 0)
    ids_b, _ = pool.allocate(2, 0)
    pool.commit(ids_b, b, b"")
    pool.release(ids_b, 0)
    pool.acquire(pool.match_prefix(a, 0))  # a is used again: b is now the oldest
    pool.release(pool.match_prefix(a, 0), 0)
    _, removed = pool.allocate(2, 0)
    assert removed == b
    assert pool.match_prefix(a, 0) == ids_a


def test_pinned_blocks_are_never_evicted_and_unpin_is_idempotent() -> None:
    pool = BlockPool(2)
    a = chain(1, 2)
    ids, _ = pool.allocate(2, 0)
    pool.commit(ids, a, b"")
    pool.release(ids, 0)
    assert pool.pin("lease-1", a + chain(9, 1), 0) == tuple(ids)
    assert pool.pin("lease-1", a, 0) == tuple(ids)  # the same lease: the same pin
    with pytest.raises(PoolExhaustedError):
        pool.allocate(1, 0)
    assert pool.num_free == 0 and pool.refs(ids[0]) == 1  # a refusal changes nothing
    pool.unpin("lease-1", 0)
    pool.unpin("lease-1", 0)
    assert pool.allocate(2, 0)[1] == a


def test_retention_expiry_removes_blocks_and_extends_only() -> None:
    pool = BlockPool(4)
    a = chain(1, 2)
    ids, _ = pool.allocate(2, 0)
    pool.commit(ids, a, b"", expiry_ms=1000)
    pool.release(ids, 0)
    again = pool.match_prefix(a, 500)
    pool.acquire(again)
    assert [s.expiry_ms for s in pool.commit(again, a, b"", expiry_ms=2000)] == [2000, 2000]
    assert pool.commit(again, a, b"", expiry_ms=1500) == []  # never shortened
    pool.release(again, 600)
    assert pool.expire(1999) == []
    assert pool.match_prefix(a, 2000) == []  # an expired entry is a miss
    assert pool.expire(2000) == a
    assert pool.num_free == 4


def test_tainted_blocks_stay_out_until_untainted() -> None:
    pool = BlockPool(3)
    ids, _ = pool.allocate(2, 0)
    pool.taint(ids)
    other, _ = pool.allocate(1, 0)
    assert set(other).isdisjoint(ids)
    with pytest.raises(PoolExhaustedError):
        pool.allocate(1, 0)
    pool.untaint(ids)
    assert set(pool.allocate(2, 0)[0]) == set(ids)


class PoolMachine(RuleBasedStateMachine):
    """Random requests, pins, releases, taints and time against a plain model."""

    SIZE = 8

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.SIZE)
        self.now = 0
        self.held: list[list[int]] = []  # block lists held by running "requests"
        self.published: dict[bytes, int] = {}  # hash -> expiry, from stored/removed
        self.pins: set[str] = set()
        self.tainted: list[list[int]] = []

    def _removed(self, hashes: list[bytes]) -> None:
        for h in hashes:
            assert h in self.published, "removed a hash never published"
            del self.published[h]

    @rule(seed=st.integers(0, 5), length=st.integers(1, 4), expiry=st.sampled_from([0, 0, 50]))
    def request(self, seed: int, length: int, expiry: int) -> None:
        hashes = chain(seed, length)
        local = self.pool.match_prefix(hashes, self.now)
        self.pool.acquire(local)
        try:
            fresh, removed = self.pool.allocate(length - len(local), self.now)
        except PoolExhaustedError:
            self._removed(self.pool.release(local, self.now))
            return
        self._removed(removed)
        blocks = local + fresh
        busy = {b for held in self.held for b in held} | {b for t in self.tainted for b in t}
        assert busy.isdisjoint(fresh), "handed out a block still in use"
        for entry in self.pool.commit(
            blocks, hashes, b"", expiry_ms=self.now + expiry if expiry else 0
        ):
            self.published[entry.block_hash] = entry.expiry_ms
        self.held.append(blocks)

    @precondition(lambda self: bool(self.held))
    @rule(index=st.integers(0, 10))
    def finish(self, index: int) -> None:
        blocks = self.held.pop(index % len(self.held))
        self._removed(self.pool.release(blocks, self.now))

    @rule()
    def failed_transfer(self) -> None:
        try:
            fresh, removed = self.pool.allocate(1, self.now)
        except PoolExhaustedError:
            return
        self._removed(removed)
        self.pool.taint(fresh)
        self.tainted.append(fresh)

    @precondition(lambda self: bool(self.tainted))
    @rule()
    def quiet(self) -> None:
        self.pool.untaint(self.tainted.pop(0))

    @rule(seed=st.integers(0, 5), lease=st.integers(0, 3))
    def pin(self, seed: int, lease: int) -> None:
        self.pool.pin(f"lease-{lease}", chain(seed, 4), self.now)
        self.pins.add(f"lease-{lease}")

    @rule(lease=st.integers(0, 3))
    def release(self, lease: int) -> None:
        self._removed(self.pool.unpin(f"lease-{lease}", self.now))
        self.pins.discard(f"lease-{lease}")

    @rule(step=st.integers(1, 40))
    def tick(self, step: int) -> None:
        self.now += step
        self._removed(self.pool.expire(self.now))

    @invariant()
    def states_partition_the_pool(self) -> None:
        pool = self.pool
        free = set(pool._free)
        cached = set(pool._lru)
        tainted = pool.tainted
        referenced = {b for b in range(self.SIZE) if pool.refs(b) > 0}
        assert len(pool._free) == len(free)  # no block twice in the free list
        assert free | cached | tainted | referenced == set(range(self.SIZE))
        assert not free & cached and not free & tainted and not free & referenced
        assert not cached & referenced and not tainted & referenced
        assert tainted == {b for t in self.tainted for b in t}
        assert pool.pinned_leases == self.pins

    @invariant()
    def table_equals_what_was_published(self) -> None:
        table = {e.block_hash: e.expiry_ms for e in self.pool.table()}
        assert table == self.published


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# --- control channel ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def channel_pair(
    handler_a: Any = None, handler_b: Any = None
) -> AsyncIterator[tuple[Channel, Channel]]:
    accepted: asyncio.Queue[Channel] = asyncio.Queue()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server_side = Channel(reader, writer, handler_b, name="b")
        server_side.start()
        await accepted.put(server_side)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    a = await Channel.connect("127.0.0.1", port, handler_a, name="a")
    b = await accepted.get()
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()
        server.close()


async def test_channel_calls_both_ways_and_carries_bytes_and_int_keys() -> None:
    async def echo(op: str, args: dict[str, Any]) -> Any:
        if op == "fail":
            raise ValueError("no such block")
        return {"op": op, **args}

    async with channel_pair(echo, echo) as (a, b):
        reply = await a.call("pull", timeout_s=5, data=b"\x00\xff", faults={1: "x"})
        assert reply == {"op": "pull", "data": b"\x00\xff", "faults": {1: "x"}}
        assert (await b.call("pin", timeout_s=5, n=3))["n"] == 3
        with pytest.raises(ChannelError, match="ValueError: no such block"):
            await a.call("fail", timeout_s=5)
        # Concurrent calls are matched by id.
        replies = await asyncio.gather(*(a.call("op", timeout_s=5, i=i) for i in range(20)))
        assert [r["i"] for r in replies] == list(range(20))


@pytest.mark.parametrize(
    ("raised", "unknown"),
    [(DeadlineExceededError, True), (NotFoundError, False), (FailedPreconditionError, False)],
)
async def test_channel_carries_kvrcs_status_of_a_remote_failure(
    raised: type[KvrcClientError], unknown: bool
) -> None:
    """A follower's failed kvrc call reaches the leader with its status: whether that
    call may still have taken effect decides what the leader keeps."""
    code = {
        DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
        NotFoundError: grpc.StatusCode.NOT_FOUND,
        FailedPreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    }[raised]

    async def fail(op: str, args: dict[str, Any]) -> Any:
        raise raised(code, "no handoff 'h'")

    async with channel_pair(None, fail) as (a, _):
        with pytest.raises(raised) as e:
            await a.call("publish_handoff", timeout_s=5)
    assert e.value.code == code and e.value.message == "no handoff 'h'"
    assert outcome_unknown(e.value) is unknown


async def test_channel_peer_going_away_fails_pending_calls_at_once() -> None:
    gate, arrived = asyncio.Event(), asyncio.Event()

    async def slow(op: str, args: dict[str, Any]) -> Any:
        arrived.set()
        await gate.wait()
        return None

    async with channel_pair(None, slow) as (a, b):
        pending = asyncio.create_task(a.call("wait", timeout_s=30))
        await wait_until(arrived.is_set, 5, what="the call pending at the peer")
        await b.close()
        with pytest.raises(ChannelError, match="went away"):
            await asyncio.wait_for(pending, 5)


async def test_channel_malformed_frame_closes_instead_of_hanging() -> None:
    async with channel_pair() as (a, b):
        pending = asyncio.create_task(b.call("x", timeout_s=30))
        # Not a msgpack map: the reader closes the connection, both sides see it.
        a._writer.write(b"\x00\x00\x00\x01\xc1")
        await asyncio.wait_for(a.wait_closed(), 5)
        with pytest.raises(ChannelError):
            await asyncio.wait_for(pending, 5)


def test_test_faults_are_validated_before_anything_runs(tmp_path: Path) -> None:
    assert parse_faults({1: "bad-remote-address"}, 2) == {1: "bad-remote-address"}
    assert parse_faults({0: "delay-before-pull=1.5"}, 2)[0].endswith("1.5")
    faults = PullFaults(tmp_path)
    for bad in ({2: "bad-remote-address"}, {0: "explode"}, {0: "delay-before-pull=999"}):
        with pytest.raises(ValueError):
            parse_faults(bad, 2)
        with pytest.raises(ValueError):
            faults.arm("r", bad, tp_size=2)
    assert list(tmp_path.iterdir()) == []  # nothing armed


_PLAN = TransferPlan("peer", (0, 64), (1 << 30, (1 << 30) + 64), (64, 64), (3,), 128)


def _context(request_id: str, tp_rank: int) -> PullContext:
    return PullContext("prefix_load", request_id, f"lease-{request_id}", tp_rank)


async def test_production_pull_hook_reads_the_plan_unchanged() -> None:
    assert await NO_PULL_HOOK.before_pull(_context("r", 0), _PLAN) is _PLAN


async def test_armed_faults_apply_to_their_request_and_rank_part_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    faults = PullFaults(tmp_path / "faults")
    faults.arm("a/1", {1: "bad-remote-address"}, tp_size=2)
    faults.arm("b", {0: "delay-before-pull=0.05"}, tp_size=2)
    hook = FaultHook(faults.directory)
    far = await hook.before_pull(_context("a/1", 1), _PLAN)
    assert far.remote_addresses == tuple(a + (1 << 46) for a in _PLAN.remote_addresses)
    assert far.local_addresses == _PLAN.local_addresses and far.lengths == _PLAN.lengths
    assert await hook.before_pull(_context("a/1", 0), _PLAN) is _PLAN  # rank 0: no fault
    assert await hook.before_pull(_context("other", 1), _PLAN) is _PLAN  # not armed
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await hook.before_pull(_context("b", 0), _PLAN) is _PLAN
    assert loop.time() - started >= 0.05
    assert '"event": "pull_delayed", "lease_id": "lease-b"' in capsys.readouterr().out


async def test_background_tasks_log_failures_and_end_with_their_owner(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tasks = BackgroundTasks(logging.getLogger("test.tasks"))
    release = asyncio.Event()
    ended: list[str] = []

    async def fails() -> None:
        raise RuntimeError("boom")

    async def waits() -> None:
        try:
            await release.wait()
        finally:
            ended.append("waits")

    tasks.spawn(fails(), name="fails")
    tasks.spawn(waits(), name="waits")
    await wait_until(lambda: len(tasks) == 1, 5, what="the failing task done")
    # A failure is logged with its name, and cancels nothing else.
    assert [r.getMessage() for r in caplog.records] == ["fails failed"]
    assert caplog.records[0].exc_info is not None
    assert len(tasks) == 1 and not ended
    await tasks.aclose()  # cancels and waits: nothing outlives the owner
    assert ended == ["waits"] and len(tasks) == 0
    work = waits()
    assert tasks.spawn(work, name="late") is None  # closed: the work never starts
    assert ended == ["waits"]


# --- transfer accounting and coalescing -------------------------------------------------


def test_allocation_is_ascending_so_reused_runs_coalesce() -> None:
    """Freed blocks come back in reverse order; allocate hands them out ascending, so a
    plan between two such runs is one entry per layer, not one per block per layer."""
    pool = BlockPool(8)
    first, _ = pool.allocate(4, 0)
    pool.release(first, 0)  # unhashed: straight back to the free list
    again, _ = pool.allocate(6, 0)
    assert again == sorted(again)
    assert again[:4] == first
    endpoint = KvEndpointDescription.from_parts(
        backend="mooncake",
        session_name="127.0.0.1:1",
        layout=LAYOUT,
        regions=[
            KvRegionDescription(layer, (1 + layer) << 30, LAYOUT.block_bytes, LAYOUT.num_blocks)
            for layer in range(LAYOUT.num_layers)
        ],
    )
    plan = TransferPlan.build(endpoint, endpoint, list(zip(again, range(8, 14), strict=True)))
    assert plan.num_entries == LAYOUT.num_layers


def test_pull_replies_fold_into_wall_time_and_native_read_time() -> None:
    results = [
        _pull_reply("SUCCEEDED", nbytes=1000, seconds=0.1, entries=4),
        _pull_reply("SUCCEEDED", nbytes=3000, seconds=0.3, entries=8),
    ]
    info: dict[str, Any] = {}
    assert Leader._combine(results, info)
    assert info["bytes"] == 4000
    assert info["transfer_s"] == pytest.approx(0.3)  # the parts ran in parallel
    assert info["read_s"] == pytest.approx(0.4)  # time inside the native reads, summed
    assert (info["reads"], info["read_entries"]) == (2, 12)
    # A part refused before any read adds no read time.
    refused = [results[0], _pull_reply("FAILED", error="refused: tp", refused=True)]
    info = {}
    assert not Leader._combine(refused, info)
    assert (info["reads"], info["read_s"]) == (1, pytest.approx(0.1))


def test_demo_gbps_is_bytes_over_native_read_time() -> None:
    from clients.refengine.demo import Totals

    totals = Totals(bytes_moved=3_000_000_000, native_reads=6, read_s=2.0)
    assert totals.transfer_gbps == pytest.approx(1.5)
    doc = totals.document(elapsed_s=100.0)  # the wall time of the run does not enter it
    assert doc["transfer_gbps"] == 1.5
    assert doc["read_mean_ms"] == pytest.approx(333.333, abs=1e-3)
    assert Totals().transfer_gbps == 0.0


class _Parts:
    """Stands in for the leader's rank parts (`Leader._on_all`): records the commands."""

    def __init__(self, pull_outcomes: list[str], mismatches: list[int]) -> None:
        self.ops: list[str] = []
        self._pull = pull_outcomes
        self._mismatches = mismatches

    async def _on_all(self, op: str, **args: Any) -> list[Any]:
        self.ops.append(op)
        if op == "pull":
            return [_pull_reply(o, nbytes=8, seconds=0.01, entries=4) for o in self._pull]
        assert op == "verify" and args["block_ids"] == [5, 6] and args["first_index"] == 2
        return list(self._mismatches)


async def test_parts_verify_only_after_every_read_returned() -> None:
    args: dict[str, Any] = {"tokens": [1] * 64, "local_block_ids": [5, 6], "first_index": 2}
    parts = _Parts(["SUCCEEDED", "SUCCEEDED"], [0, 3])
    results = await Leader._pull_all(parts, flow="handoff", **args)  # type: ignore[arg-type]
    assert parts.ops == ["pull", "verify"]  # the check never overlaps a sibling's read
    assert [r["mismatches"] for r in results] == [0, 3]
    info: dict[str, Any] = {}
    assert not Leader._combine(results, info)  # a mismatch fails the transfer
    assert info["mismatches"] == 3
    # A failed slice: nothing to verify, the whole load is recomputed anyway.
    parts = _Parts(["SUCCEEDED", "FAILED"], [])
    results = await Leader._pull_all(parts, flow="handoff", **args)  # type: ignore[arg-type]
    assert parts.ops == ["pull"]
    assert [r["mismatches"] for r in results] == [0, 0]


def test_engine_target_takes_several_replicas_and_refuses_a_bad_list() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    base = ["--role", "prefill", "--engine-id", "p"]
    options = options_from_args(parser.parse_args([*base, "--target", "a:1, b:2"]))
    assert [o.target for o in split_targets(options.coordinator)] == ["a:1", "b:2"]
    target_help = next(a.help for a in parser._actions if "--target" in a.option_strings)
    assert target_help is not None and "comma-separated" in target_help
    with pytest.raises(ValueError, match="'a:1' is listed twice"):
        options_from_args(parser.parse_args([*base, "--target", "a:1,a:1"]))


@pytest.mark.parametrize(
    ("flags", "refused"),
    [
        (["--target", "10.0.0.5:50051"], True),
        (["--target", "kvrc.llm.svc:50051"], True),
        (["--target", "127.0.0.1:1,10.0.0.5:2"], True),  # one off-host replica is enough
        (["--target", "127.0.0.1:50051"], False),
        (["--target", "localhost:1,[::1]:2"], False),
        (["--target", "10.0.0.5:50051", "--tls-ca", "/ca.pem"], False),
    ],
)
def test_engine_options_refuse_a_token_in_plaintext_off_the_host_when_read(
    flags: list[str], refused: bool
) -> None:
    """When the options are read (before the KV is made), not at the first
    channel: connect()'s own check and one-line message (kvrc/credentials.py)."""
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--role", "decode", "--engine-id", "d", "--token-file", "/t", *flags])
    if not refused:
        assert options_from_args(args).coordinator.token_file == Path("/t")
        return
    with pytest.raises(CredentialsError) as caught:
        options_from_args(args)
    with pytest.raises(CredentialsError) as same:
        ChannelOptions(args.target, token_file=Path("/t")).check_token_transport()
    assert str(caught.value) == str(same.value)
    assert args.target in str(caught.value) and "TLS" in str(caught.value)
    assert "\n" not in str(caught.value)


async def test_a_published_handoff_is_announced_with_its_reserved_decode_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a kvrc restart the rebuilt lease takes reports only from the engine its
    holder names: a handoff's is the decode engine it was reserved for."""
    from clients.leases import LeaseSessionHandler, PublishResult
    from clients.refengine.engine import RankPart

    async def publish_handoff(request_id: str, **kw: Any) -> PublishResult:
        return PublishResult("READY", 1, 1, f"ho-{request_id}")

    monkeypatch.setattr("clients.refengine.engine.rank_part_descriptor", lambda *a, **k: b"d")
    part = NS(
        leases=NS(publish_handoff=publish_handoff),
        handler=LeaseSessionHandler(),
        endpoint=None,
        options=NS(tp_rank=0),
    )
    for request_id, decode in (("r1", "dec-1"), ("r2", "")):
        await RankPart.publish_handoff(part, request_id, [1], decode, b"")  # type: ignore[arg-type]
    assert part.handler.held_leases() == {"ho-r1": "dec-1", "ho-r2": ""}


@pytest.mark.parametrize(
    ("state", "ended"),
    [("WAITING_READY", False), ("READY", False), ("ACTIVE", False)]
    + [(s, True) for s in ("COMPLETED", "FAILED", "RESOLVED", "MISSED")],
)
def test_a_publish_answered_with_an_ended_handoff_is_not_announced_as_held(
    state: str, ended: bool
) -> None:
    """A part that publishes after its handoff ended gets the lease id and no release
    will come: announced as held, a restarted kvrc would rebuild it as a quarantined
    lease that nobody ends (the reference engine and the vLLM worker ask `ended`)."""
    from clients.leases import LeaseSessionHandler, PublishResult

    published = PublishResult(state, 1, 2, "ho-1")
    assert published.ended is ended
    handler = LeaseSessionHandler()
    if published.lease_id and not published.ended:  # RankPart.publish_handoff's rule
        handler.track_held(published.lease_id)
    assert (list(handler.held_leases()) == []) is ended


# --- a handoff's publish that failed ------------------------------------------------------

_READY = {"state": "READY", "lease_id": "ho-1"}
_DEADLINE = DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer")
_REFUSED = NotFoundError(grpc.StatusCode.NOT_FOUND, "unknown decode engine")


def _leader_with_stand_in_parts(*rounds: list[Any]) -> tuple[Leader, list[tuple[str, int]]]:
    """A prefill Leader whose two rank parts are stood in (`_call`, `_on_all`): compute
    does nothing; a part's n-th publish is answered by `rounds[n]` at its rank (the last
    round repeats): a result or an exception. Also: the publishes made, (request, rank)."""
    options = EngineOptions(role="prefill", engine_id="p", tp_rank=0, tp_size=2, target="x:1")
    leader = Leader(NS(options=options, session=None, layout=NS(num_blocks=8)))  # type: ignore[arg-type]
    published: list[tuple[str, int]] = []

    async def call(rank: int, op: str, args: dict[str, Any]) -> Any:
        assert op == "publish_handoff"
        published.append((args["request_id"], rank))
        made = sum(1 for _, r in published if r == rank)
        answer = rounds[min(made, len(rounds)) - 1][rank]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def on_all(op: str, **args: Any) -> list[Any]:
        if op != "publish_handoff":
            return [None, None]
        return [await call(rank, op, args) for rank in (0, 1)]

    async def no_load(*args: Any) -> tuple[list[int], dict[str, Any]]:
        return [], {}

    async def no_events(*args: Any) -> None:
        return None

    leader._on_all = on_all  # type: ignore[method-assign]
    leader._call = call  # type: ignore[method-assign]
    leader._prefix_load = no_load  # type: ignore[method-assign,assignment]
    leader.publish = no_events  # type: ignore[method-assign,assignment]
    return leader, published


def _referenced(leader: Leader) -> int:
    return sum(1 for block in leader.pool._blocks if block.refs > 0)


@pytest.mark.parametrize(
    ("answers", "raised", "held"),
    [
        ([_READY, _READY], None, True),  # control: published, held until the release
        # kvrc may have recorded this part (an answer lost), or a follower died
        # after its publish: a decode may read the blocks (I6-quiescence)
        ([_DEADLINE, _READY], DeadlineExceededError, True),
        ([_READY, ChannelError("follower: the other side went away")], ChannelError, True),
        # refused: no release will come; freed once (not twice)
        ([_REFUSED, _REFUSED], NotFoundError, False),
        ([_READY, _REFUSED], NotFoundError, False),
        # one part refused at its first publish: never READY whatever the other's
        # outcome, so no decode reads (before: held for the safety net's 300 s)
        ([_DEADLINE, _REFUSED], NotFoundError, False),
    ],
)
async def test_a_handoff_whose_publish_may_have_been_taken_keeps_its_blocks(
    answers: list[Any], raised: type[Exception] | None, held: bool
) -> None:
    leader, _ = _leader_with_stand_in_parts(answers)
    tokens = list(range(3 * 16))
    if raised is None:
        await leader.prefill("r1", tokens, "d")
    else:
        with pytest.raises(raised):
            await leader.prefill("r1", tokens, "d")
    assert _referenced(leader) == (3 if held else 0)
    assert leader.counters.get("handoff_publish_outcome_unknown", 0) == int(
        held and raised is not None
    )
    if held:  # kvrc's release (or the safety net) frees them, once
        await leader._release("ho-1")
        assert _referenced(leader) == 0
        assert list(leader.release_ledger.document()) == ["ho-1"]
    await leader._tasks.aclose()


async def test_pins_the_safety_net_drops_are_no_longer_announced_as_held() -> None:
    """Every part tracks the leases it holds, to re-announce them at its next
    registration; a pin the leader's safety net dropped stayed tracked on every part:
    re-announced for ever (a restarted kvrc rebuilt each one QUARANTINED for blocks
    nobody pinned) and never forgotten."""
    leader, _ = _leader_with_stand_in_parts([_READY, _READY])
    sent: list[tuple[str, dict[str, Any]]] = []

    async def on_all(op: str, **args: Any) -> list[Any]:
        sent.append((op, args))
        return [None, None]  # both parts' answers

    leader._on_all_settled = on_all  # type: ignore[method-assign]
    leader._pin_deadlines.hold("pl-late", 0.0)  # its net has fired
    leader._pin_deadlines.hold("pl-kept", 3600.0)
    await leader._sweep_once()
    await asyncio.sleep(0)  # sent in the background: a stalled part holds up no sweep
    assert sent == [("untrack_held", {"lease_ids": ["pl-late"]})]
    sent.clear()
    await leader._sweep_once()
    await asyncio.sleep(0)
    assert sent == []  # nothing more dropped, nothing sent
    await leader._tasks.aclose()
    # Each part's command forgets them (the part itself stood in: only its handler).
    handler = LeaseSessionHandler()
    handler.track_held("pl-late", "r")
    handler.track_held("pl-kept", "r")
    await RankPart.handle(NS(handler=handler), "untrack_held", {"lease_ids": ["pl-late"]})  # type: ignore[arg-type]
    assert dict(handler.held_leases()) == {"pl-kept": "r"}


_ENDED = {"state": "COMPLETED", "lease_id": "ho-1"}


@pytest.mark.parametrize(
    ("again", "outcome"),
    [
        ([_READY, _READY], "bound"),  # kvrc had it: its release now reaches the hold
        ([_ENDED, _ENDED], "freed"),  # it ended meanwhile: no release will come
        ([_DEADLINE, _DEADLINE], "held"),  # still unknown: the safety net frees it
        # A repeat refused (the engine not ready while a part reconnects) proves nothing:
        # the first publish may have been recorded and a decode may read (before: freed).
        ([_REFUSED, _REFUSED], "held"),
    ],
)
async def test_a_publish_of_unknown_outcome_is_sent_again_until_its_lease_is_named(
    monkeypatch: pytest.MonkeyPatch, again: list[Any], outcome: str
) -> None:
    """With every part's answer lost, no lease id names the hold: kvrc's release (and
    a quarantine) could not reach it. A repeat publish is answered with the handoff's
    state and lease id."""
    monkeypatch.setattr("clients.leases.PUBLISH_RETRY_DELAYS_S", (0.0, 0.0))
    leader, published = _leader_with_stand_in_parts([_DEADLINE, _DEADLINE], again)
    with pytest.raises(DeadlineExceededError):
        await leader.prefill("r1", list(range(3 * 16)), "d")
    assert leader._holds == {} and _referenced(leader) == 3
    both = [("r1", 0), ("r1", 1)]
    if outcome == "bound":
        await wait_until(lambda: "ho-1" in leader._holds, 5, what="the hold named")
        await leader._release("ho-1")
        assert _referenced(leader) == 0 and published == both * 2
    elif outcome == "freed":
        await wait_until(lambda: _referenced(leader) == 0, 5, what="the ended handoff freed")
        assert published == both * 2
    else:
        await wait_until(lambda: len(published) == 6, 5, what="both repeats")
        await asyncio.sleep(0.05)
        assert leader._holds == {} and _referenced(leader) == 3 and published == both * 3
    await leader._tasks.aclose()


async def test_a_part_whose_publish_outcome_is_unknown_is_sent_again_after_the_lease_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0's answer named the lease, rank 1's was lost: the publish stopped there. Had
    kvrc not recorded rank 1, the handoff never went READY and the decode waited its
    whole wait, then recomputed. Now rank 1 alone goes again, until it is answered."""
    monkeypatch.setattr("clients.leases.PUBLISH_RETRY_DELAYS_S", (0.0, 0.0, 0.0))
    leader, published = _leader_with_stand_in_parts(
        [_READY, _DEADLINE], [_READY, _DEADLINE], [_READY, _READY]
    )
    with pytest.raises(DeadlineExceededError):
        await leader.prefill("r1", list(range(3 * 16)), "d")
    assert "ho-1" in leader._holds  # named by rank 0's answer: kvrc's release reaches it
    await wait_until(lambda: len(published) == 4, 5, what="rank 1's repeats")
    await asyncio.sleep(0.05)
    assert published == [("r1", 0), ("r1", 1), ("r1", 1), ("r1", 1)]  # answered: no more
    await leader._release("ho-1")
    assert _referenced(leader) == 0
    await leader._tasks.aclose()


async def test_a_handoff_that_cannot_be_published_gives_its_blocks_back() -> None:
    """Its kv_transfer_params over kvrc's limit: nothing to hold, nothing leaked."""
    leader, published = _leader_with_stand_in_parts([_READY, _READY])
    with pytest.raises(ValueError, match="kv_transfer_params"):
        await leader.prefill("r" * (1 << 20), list(range(3 * 16)), "d")
    assert _referenced(leader) == 0 and published == [] and leader._hold_by_request == {}


async def test_every_parts_publish_answer_is_waited_for_and_kept() -> None:
    """The leader's own part fails, its follower (over a real channel) publishes: both
    answers come back, so the follower's lease id can name the hold."""

    async def follower(op: str, args: dict[str, Any]) -> Any:
        await asyncio.sleep(0.05)  # answers after the leader's own part failed
        return {**_READY, "rank": 1}

    async def own_part(op: str, args: dict[str, Any]) -> Any:
        raise _DEADLINE

    options = EngineOptions(role="prefill", engine_id="p", tp_rank=0, tp_size=2, target="x:1")
    part = NS(options=options, session=None, layout=NS(num_blocks=8), handle=own_part)
    leader = Leader(part)  # type: ignore[arg-type]
    async with channel_pair(None, follower) as (to_follower, _):
        leader.followers[1] = to_follower
        rounds = publish_rounds(
            lambda rank: leader._call(rank, "publish_handoff", {"request_id": "r1"}),
            2,
            asyncio.get_running_loop().time() + 60.0,
            lambda: True,
        )
        attempt, answers = await anext(rounds)
        await rounds.aclose()
    assert attempt == 0 and answers[0] is _DEADLINE and answers[1] == {**_READY, "rank": 1}
