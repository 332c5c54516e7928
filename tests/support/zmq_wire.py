"""vLLM's ZMQ KV-event wire, spoken by a test publisher, and a recording sink.

`WirePublisher` speaks vLLM 0.33.0's wire format (PUB frames, ROUTER replay with a
bounded buffer and the end marker); it can lose frames on purpose, stop
answering replays, restart its numbering and send garbage.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from coordinator.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from coordinator.core.vllm_events import END_SEQ
from coordinator.runtime.metrics import Metrics

ENGINE = "engine-a"


# --- a recording sink: the inventory that the handed-over batches describe -------------


@dataclass
class RecordingSink:
    blocks: dict[str, set[tuple[int, bytes]]] = field(default_factory=dict)
    batches: list[tuple[str, int, int]] = field(default_factory=list)  # child, incarnation, seq
    calls: list[tuple[str, str]] = field(default_factory=list)  # (what, child)
    reasons: list[str] = field(default_factory=list)

    def apply(self, child_engine_id: str, batch: EventBatch) -> None:
        held = self.blocks.setdefault(child_engine_id, set())
        self.batches.append((child_engine_id, batch.incarnation, batch.sequence))
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                held.update((ev.group_idx, h) for h in ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                held.difference_update((ev.group_idx, h) for h in ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                held.clear()

    def drop_engine_inventory(self, child_engine_id: str) -> None:
        self.calls.append(("drop", child_engine_id))
        self.blocks.pop(child_engine_id, None)

    def mark_stale(self, child_engine_id: str, reason: str) -> None:
        self.calls.append(("stale", child_engine_id))
        self.reasons.append(reason)

    def mark_degraded(self, child_engine_id: str, reason: str) -> None:
        self.calls.append(("degraded", child_engine_id))
        self.reasons.append(reason)

    def mark_live(self, child_engine_id: str) -> None:
        self.calls.append(("live", child_engine_id))

    def held(self, child: str = ENGINE) -> set[int]:
        return {int.from_bytes(h, "big") for _, h in self.blocks.get(child, set())}

    def seqs(self) -> list[int]:
        return [seq for _, _, seq in self.batches]


# --- a publisher speaking vLLM's wire format -----------------------------------------


def stored(*hashes: int, block_size: int = 16, lora_name: str | None = None) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": None,
        "token_ids": [0] * (block_size * len(hashes)),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": lora_name,
        "extra_keys": None,
        "group_idx": 0,
    }


def removed(*hashes: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU", "group_idx": 0}


CLEARED = {"type": "AllBlocksCleared"}


class WirePublisher:
    """vLLM 0.33.0's ZmqEventPublisher, as seen on the wire, with failure knobs."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        buffer_steps: int = 1000,
        answer_replays: bool = True,
        dp_rank: int = 0,
        connect_to: str | None = None,
    ) -> None:
        self.ctx = ctx
        self.pub = ctx.socket(zmq.XPUB)  # a PUB that also reports subscriptions
        self.pub.setsockopt(zmq.LINGER, 0)
        if connect_to is None:
            self.pub.bind("tcp://127.0.0.1:0")
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.pub.connect(connect_to)
            self.endpoint = connect_to
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:0")
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.buffer_steps = buffer_steps
        self.answer_replays = answer_replays
        self.replay_requests: list[int] = []
        # A slow publisher: set to an unset Event, replays answer what the buffer held
        # when asked, but only once the event is set.
        self.replay_gate: asyncio.Event | None = None
        # Sequences left out of replay answers, and how many more times: what vLLM's
        # ROUTER does to frames past its send queue (it drops them, silently).
        self.replay_drops: dict[int, int] = {}
        # Answers cut after this many frames, the end marker too, this many more times.
        self.replay_cut_after: tuple[int, int] | None = None
        # A trickling answer: this long before each frame of it.
        self.replay_frame_delay_s = 0.0
        self.dp_rank = dp_rank
        self.next_seq = 0
        self._task = asyncio.create_task(self._serve_replays())

    async def wait_subscribed(self) -> None:
        message = await asyncio.wait_for(self.pub.recv(), 5)
        assert message[:1] == b"\x01"

    async def publish(
        self, *events: dict[str, Any], send: bool = True, dp_rank: int | None = None
    ) -> int:
        """Publish one batch; `send=False` buffers it for replay but loses it on PUB."""
        seq = self.next_seq
        self.next_seq += 1
        rank = self.dp_rank if dp_rank is None else dp_rank
        payload = msgpack.packb([time.time(), list(events), rank])
        self.buffer = [*self.buffer, (seq, payload)][-self.buffer_steps :]
        if send:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def restart_process(self) -> None:
        """A restarted vLLM: new sockets on the same ports, numbering from 0."""
        self.pub.close(0)
        self.router.close(0)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.pub = await _bind_again(self.ctx.socket(zmq.XPUB), self.endpoint)
        self.router = await _bind_again(self.ctx.socket(zmq.ROUTER), self.replay_endpoint)
        self.restart_numbering()
        self._task = asyncio.create_task(self._serve_replays())

    def restart_numbering(self) -> None:
        """What a restarted vLLM looks like: sequence 0 again, an empty buffer."""
        self.next_seq = 0
        self.buffer = []

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            if not self.answer_replays:
                continue
            held = [(seq, payload) for seq, payload in self.buffer if seq >= start_seq]
            if self.replay_gate is not None:
                await self.replay_gate.wait()
            cut = self.replay_cut_after
            if cut is not None and cut[1] > 0:
                held = held[: cut[0]]
                self.replay_cut_after = (cut[0], cut[1] - 1)
            for seq, payload in held:
                if self.replay_drops.get(seq, 0) > 0:
                    self.replay_drops[seq] -= 1
                    continue
                if self.replay_frame_delay_s:
                    await asyncio.sleep(self.replay_frame_delay_s)
                await self.router.send_multipart(
                    [client, b"", b"", seq.to_bytes(8, "big"), payload]
                )
            if cut is None or cut[1] == 0:
                await self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(0)
        self.router.close(0)


async def _bind_again(sock: zmq.asyncio.Socket, endpoint: str) -> zmq.asyncio.Socket:
    """Bind a port just released (ZMQ's I/O thread lets go of it shortly after close)."""
    sock.setsockopt(zmq.LINGER, 0)
    for _ in range(300):
        try:
            sock.bind(endpoint)
            return sock
        except zmq.ZMQError:
            await asyncio.sleep(0.01)
    sock.close(0)
    raise AssertionError(f"{endpoint} still bound")


# --- fixtures and helpers ----------------------------------------------------------


def value(metrics: Metrics, name: str, **labels: str) -> float:
    got = metrics.registry.get_sample_value(name, labels)
    return 0.0 if got is None else got
