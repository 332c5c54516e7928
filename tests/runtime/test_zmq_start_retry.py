"""A KV-event subscription that failed to start is tried again at the engine's next part
registration (coordinator/runtime/inventory_flow.py).

Real ZMQ sockets on loopback: kvrc binds the endpoint (no '*': vLLM connects), and
the port is first held by another socket, as just after the engine's previous
stream closed. The rig's clock is manual; the sockets are not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import zmq
import zmq.asyncio
from manual_rig import CHAIN, PROFILE, manual_coordinator, settle
from waiting import wait_until

from coordinator.core.events import BlockStored, EventBatch
from coordinator.core.registry import RankPartRegistration
from coordinator.edges.zmq_ingest import VllmEventStreams
from kvrc.vocabulary import TransferEndpoint

TP2 = dataclasses.replace(PROFILE, tp_size=2)


def _tp2_part(
    rank: tuple[int, int, int], session_name: str, kv_events_endpoint: str
) -> RankPartRegistration:
    """A rank part of tp=2 engine "e" whose transfer session is `session_name`."""
    endpoint = TransferEndpoint(backend="mooncake", session_name=session_name)
    return RankPartRegistration(
        "e", 0, "e", rank, TP2, endpoint, kv_events_endpoint=kv_events_endpoint
    )


async def test_a_subscription_that_failed_to_start_is_tried_again() -> None:
    context = zmq.asyncio.Context()
    blocker = context.socket(zmq.PULL)
    blocker.bind("tcp://127.0.0.1:0")
    endpoint = blocker.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        async with manual_coordinator() as rig:
            c = rig.coordinator
            c.inventory.event_streams = VllmEventStreams(c.metrics)
            first = RankPartRegistration(
                "e",
                0,
                "e",
                (0, 0, 0),
                TP2,
                TransferEndpoint(backend="mooncake", session_name="127.0.0.1:1"),
                kv_events_endpoint=endpoint,
            )
            rank0 = c.open_session(first)
            c.open_session(dataclasses.replace(first, rank=(1, 0, 0)))  # stays registered
            meta = c.inventory._meta["e"]
            # The port is taken: the start fails, and nothing is subscribed.
            await wait_until(lambda: meta.zmq is None, 5, what="the failed start forgotten")
            blocker.close(0)
            await asyncio.sleep(0.1)  # the port is free now
            c.close_session(rank0, "closed")
            await settle()
            c.open_session(first)  # rank 0 comes back: the subscription is tried again
            await settle()
            stream = meta.zmq
            assert stream is not None
            await asyncio.sleep(0.3)
            assert meta.zmq is stream  # started this time: kept
    finally:
        blocker.close(0)
        context.destroy(linger=0)


async def test_the_subscription_goes_to_rank_0s_host_whoever_registers_first() -> None:
    """vLLM binds `tcp://*:PORT` in its EngineCore, on rank 0's node. With multi-node TP
    the first part to register may be on another node: kvrc subscribed to that node."""
    async with manual_coordinator() as rig:
        c = rig.coordinator
        c.inventory.event_streams = VllmEventStreams(c.metrics)

        def part(rank: tuple[int, int, int], host: str) -> RankPartRegistration:
            return _tp2_part(rank, f"{host}:1", "tcp://*:5557")

        c.open_session(part((1, 0, 0), "10.9.9.9"))  # the second node's part, first
        await settle()
        meta = c.inventory._meta["e"]
        assert meta.zmq is None  # rank 0's host is not known yet
        c.open_session(part((0, 0, 0), "127.0.0.2"))
        await settle()
        assert meta.zmq is not None
        assert meta.zmq.config.endpoint == "tcp://127.0.0.2:5557"  # type: ignore[attr-defined]


async def test_a_head_part_that_publishes_elsewhere_is_subscribed_anew() -> None:
    """Rank 0 comes back from a new EngineCore, whose publisher binds another port, while
    rank 1 stays: kvrc stayed subscribed to the old endpoint (nothing ever arrived from
    the new one). The old subscription, and what its publisher said, go; what the old
    stream still delivers while it closes is dropped."""
    async with manual_coordinator() as rig:
        c = rig.coordinator
        c.inventory.event_streams = VllmEventStreams(c.metrics)

        def part(rank: tuple[int, int, int], events: str, port: int) -> RankPartRegistration:
            return _tp2_part(rank, f"127.0.0.2:{port}", events)

        rank0 = c.open_session(part((0, 0, 0), "tcp://*:5557", 1))
        c.open_session(part((1, 0, 0), "", 2))  # stays registered throughout
        await settle()
        meta = c.inventory._meta["e"]
        old_stream, old_sink = meta.zmq, meta.zmq_sink
        assert old_stream is not None and old_sink is not None
        old_sink.apply("e", EventBatch(0, 0, (BlockStored(CHAIN[:4], None, 64),)))
        assert c.inventory.inventory.engine_entries("e") == 4

        # Negative control: the same part back from the same process keeps its stream.
        c.close_session(rank0, "closed")
        await settle()
        rank0 = c.open_session(part((0, 0, 0), "tcp://*:5557", 1))
        await settle()
        assert meta.zmq is old_stream and c.inventory.inventory.engine_entries("e") == 4

        c.close_session(rank0, "closed")
        await settle()
        c.open_session(part((0, 0, 0), "tcp://*:5600", 3))  # a new EngineCore
        await settle()
        assert meta.zmq is not None and meta.zmq is not old_stream
        assert meta.zmq.config.endpoint == "tcp://127.0.0.2:5600"  # type: ignore[attr-defined]
        assert c.inventory.inventory.engine_entries("e") == 0  # the old publisher's blocks
        old_sink.apply("e", EventBatch(0, 1, (BlockStored(CHAIN[4:8], CHAIN[3], 64),)))
        assert c.inventory.inventory.engine_entries("e") == 0  # the closing stream: dropped
        assert meta.zmq_sink is not None
        meta.zmq_sink.apply("e", EventBatch(0, 0, (BlockStored(CHAIN[:2], None, 32),)))
        assert c.inventory.inventory.engine_entries("e") == 2  # the new one's are applied


async def test_a_head_part_back_on_the_same_bound_endpoint_is_subscribed_anew() -> None:
    """kvrc binds the endpoint (no '*': vLLM connects). Rank 0 comes back from a new
    EngineCore with the same endpoint: the new subscription bound it while the old one
    was still closing ("Address already in use"), and the engine had no inventory until
    one of its parts registered again. It binds once the old one has closed now."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    endpoint = f"tcp://127.0.0.1:{port}"
    async with manual_coordinator() as rig:
        c = rig.coordinator
        c.inventory.event_streams = VllmEventStreams(c.metrics)

        def part(rank: tuple[int, int, int], session: int) -> RankPartRegistration:
            return _tp2_part(rank, f"127.0.0.1:{session}", endpoint)

        rank0 = c.open_session(part((0, 0, 0), 1))
        c.open_session(part((1, 0, 0), 2))
        meta = c.inventory._meta["e"]
        await wait_until(lambda: meta.zmq is not None and meta.zmq.bound_endpoint, 5)  # type: ignore[attr-defined]
        old = meta.zmq
        c.close_session(rank0, "closed")
        c.open_session(part((0, 0, 0), 3))  # a new EngineCore, the same endpoint
        await wait_until(
            lambda: meta.zmq is not None and meta.zmq is not old and meta.zmq.bound_endpoint,  # type: ignore[attr-defined]
            5,
            what="the new subscription bound",
        )


async def test_kv_event_subscriptions_share_one_context_and_are_capped() -> None:
    """Each subscription had a ZMQ context of its own (two threads, ~10 file descriptors)
    and nothing capped them: registering engines that name endpoints ran kvrc out of
    file descriptors (a review's finding: 3,000 engines, 4,005 threads). They share one
    context now, and past --max-kv-event-streams an engine registers unsubscribed."""
    async with manual_coordinator() as rig:
        c = rig.coordinator
        streams = VllmEventStreams(c.metrics, max_streams=2)
        c.inventory.event_streams = streams

        def engine(name: str) -> RankPartRegistration:
            endpoint = TransferEndpoint(backend="mooncake", session_name="127.0.0.2:1")
            return RankPartRegistration(
                name, 0, name, (0, 0, 0), PROFILE, endpoint, kv_events_endpoint="tcp://*:5557"
            )

        sessions = [c.open_session(engine(name)) for name in ("a", "b", "c")]
        await settle()
        subscribed = {cid for cid in "abc" if c.inventory._meta[cid].zmq is not None}
        assert subscribed == {"a", "b"}  # "c" is registered, without a subscription
        assert c.registry.get("c") is not None
        contexts = {c.inventory._meta[cid].zmq._ctx for cid in subscribed}  # type: ignore[union-attr]
        assert len(contexts) == 1
        c.close_session(sessions[0], "closed")  # "a" leaves: its subscription closes
        await settle()
        await wait_until(lambda: c.inventory._meta.get("a") is None, 5)
        c.open_session(engine("d"))
        await settle()
        assert c.inventory._meta["d"].zmq is not None  # room again
    await streams.close()
