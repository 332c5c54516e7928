"""The ZMQ ingest edge over real sockets on 127.0.0.1.

`WirePublisher` speaks vLLM 0.33.0's wire format (PUB frames, ROUTER replay with a
bounded buffer and the end marker); it can lose frames on purpose, stop
answering replays, restart its numbering and send garbage. vLLM's own publisher
is exercised in test_vllm_real.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from waiting import wait_until
from zmq_wire import (
    CLEARED,
    ENGINE,
    RecordingSink,
    WirePublisher,
    removed,
    stored,
    value,
)

from coordinator.core.errors import ErrorCode, KvrcError, invalid
from coordinator.core.events import BlockStored, EventBatch
from coordinator.core.vllm_events import MalformedFrame, decode_payload, decode_sequence
from coordinator.edges.zmq_ingest import (
    StreamState,
    ZmqEventStream,
    ZmqStreamConfig,
    stream_config_from_vllm,
    subscriber_endpoint,
)
from coordinator.edges.zmq_zap import close_gate
from coordinator.runtime.metrics import Metrics


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    await close_gate(context)  # the ZAP gate's task, if a stream started one
    context.destroy(linger=0)  # never hang a test run on a socket a failed test left


@dataclass
class Rig:
    pub: WirePublisher
    stream: ZmqEventStream
    sink: RecordingSink
    metrics: Metrics


async def start_rig(
    ctx: zmq.asyncio.Context,
    *,
    replay: bool = True,
    publisher: dict[str, Any] | None = None,
    clock: Callable[[], float] = time.monotonic,
    **config: Any,
) -> Rig:
    pub = WirePublisher(ctx, **(publisher or {}))
    sink, metrics = RecordingSink(), Metrics()
    cfg = ZmqStreamConfig(
        engine_id=ENGINE,
        endpoint=pub.endpoint,
        replay_endpoint=pub.replay_endpoint if replay else None,
        **config,
    )
    stream = ZmqEventStream(cfg, sink, metrics, context=ctx, clock=clock)
    await stream.start()
    await pub.wait_subscribed()
    return Rig(pub, stream, sink, metrics)


@pytest.fixture
async def rigs(ctx: zmq.asyncio.Context) -> AsyncIterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for rig in made:
        await rig.stream.close()
        await rig.pub.close()


# --- in order ---------------------------------------------------------------------


async def test_in_order_batches_reach_the_sink_and_the_metrics(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    rigs.append(rig := await start_rig(ctx, block_size=16))
    await rig.pub.publish(stored(1, 2, 3))
    await rig.pub.publish(removed(2), stored(4))
    await wait_until(lambda: rig.sink.seqs() == [0, 1], 5)
    assert rig.sink.held() == {1, 3, 4}
    await rig.pub.publish(CLEARED, stored(9))
    await wait_until(lambda: rig.sink.seqs() == [0, 1, 2], 5)
    assert rig.sink.held() == {9}
    assert rig.sink.calls == []
    m = rig.metrics
    assert value(m, "kvrc_block_events_total", source="zmq", type="stored") == 5
    assert value(m, "kvrc_block_events_total", source="zmq", type="removed") == 1
    assert value(m, "kvrc_block_events_total", source="zmq", type="cleared") == 1
    assert value(m, "kvrc_event_batches_total", source="zmq", result="applied") == 3
    assert value(m, "kvrc_zmq_streams", state="live") == 1
    status = rig.stream.status()
    assert (status.state, status.last_sequence, status.incarnation) == (StreamState.LIVE, 2, 0)
    assert rig.pub.replay_requests == []


# --- gaps, replay, overrun, timeout ----------------------------------------------------


async def test_gap_is_filled_by_a_replay_from_the_first_missing_sequence(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    rigs.append(rig := await start_rig(ctx))
    await rig.pub.publish(stored(1))
    await rig.pub.publish(stored(2), send=False)  # lost on the wire
    await rig.pub.publish(removed(1), send=False)
    await rig.pub.publish(stored(3))
    await wait_until(lambda: rig.sink.seqs() == [0, 1, 2, 3], 5)
    assert rig.pub.replay_requests == [1]
    assert rig.sink.held() == {2, 3}
    await rig.pub.publish(stored(4))
    await wait_until(lambda: rig.sink.seqs() == [0, 1, 2, 3, 4], 5)
    assert rig.stream.status().state is StreamState.LIVE
    assert value(rig.metrics, "kvrc_zmq_replays_total", result="complete") == 1
    assert value(rig.metrics, "kvrc_event_batches_total", source="zmq", result="gap") == 1


@pytest.mark.parametrize("drops", [1, 1_000], ids=["dropped once", "always dropped"])
async def test_a_replay_answer_with_a_hole_is_asked_again_and_never_applied_across_it(
    ctx: zmq.asyncio.Context, rigs: list[Rig], drops: int
) -> None:
    """vLLM's replay ROUTER drops the frames past its send queue (1,000 by default), so a
    large answer can skip sequences. The answer was applied across the hole as complete:
    the removal in the hole was lost, its block held for good (a phantom), the stream
    LIVE. The replay is asked again from the hole now; one that keeps skipping is a
    loss (degraded)."""
    rigs.append(rig := await start_rig(ctx))
    await rig.pub.publish(stored(1))
    await rig.pub.publish(stored(2), send=False)  # lost on the wire
    await rig.pub.publish(removed(1), send=False)
    await rig.pub.publish(stored(3), send=False)
    rig.pub.replay_drops[2] = drops  # the removal, left out of the answer
    await rig.pub.publish(stored(4))
    if drops == 1:
        await wait_until(lambda: rig.sink.seqs() == [0, 1, 2, 3, 4], 5)
        assert rig.pub.replay_requests == [1, 2]  # asked again from the hole
        assert rig.sink.held() == {2, 3, 4}
        assert rig.stream.status().state is StreamState.LIVE
    else:
        await wait_until(lambda: rig.stream.status().state is StreamState.DEGRADED, 5)
        assert 2 not in rig.sink.seqs()  # nothing applied across the hole
        assert value(rig.metrics, "kvrc_zmq_replays_total", result="hole") >= 1


async def test_a_replay_answer_cut_short_is_asked_again_from_where_it_stopped(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    """vLLM's ROUTER drops the tail of a large answer, its end marker with it: the
    replay timed out and the stream degraded, whatever had arrived. It is asked again
    from the first batch that did not arrive now."""
    rigs.append(rig := await start_rig(ctx, replay_timeout_s=0.3))
    await rig.pub.publish(stored(1))
    for block in range(2, 6):
        await rig.pub.publish(stored(block), send=False)
    rig.pub.replay_cut_after = (2, 1)  # the first answer: two batches, then nothing
    await rig.pub.publish(stored(6))
    await wait_until(lambda: rig.sink.seqs() == [0, 1, 2, 3, 4, 5], 5)
    assert rig.pub.replay_requests == [1, 3]
    assert rig.stream.status().state is StreamState.LIVE
    assert rig.sink.held() == {1, 2, 3, 4, 5, 6}


async def test_a_trickling_replay_ends_at_its_deadline_and_the_live_stream_goes_on(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    """Each frame of the answer comes inside `replay_timeout_s`, so only a deadline on
    the whole replay ends it: without one, a publisher sending one frame per timeout held
    the live stream (parked behind the replay) for as long as its buffer lasted."""
    rigs.append(rig := await start_rig(ctx, replay_timeout_s=1.0, max_replay_s=1.0))
    await rig.pub.publish(stored(1))
    await wait_until(lambda: rig.sink.seqs() == [0], 5)
    for block in range(2, 12):
        await rig.pub.publish(stored(block), send=False)
    rig.pub.replay_frame_delay_s = 0.4  # ten frames: four seconds
    await rig.pub.publish(stored(12))
    await rig.pub.publish(stored(13))  # parked behind the replay
    await wait_until(lambda: rig.stream.status().state is StreamState.DEGRADED, 3)
    status = rig.stream.status()
    assert "not done in 1.0s" in status.reason, status.reason
    assert value(rig.metrics, "kvrc_zmq_replays_total", result="timeout") == 1
    assert value(rig.metrics, "kvrc_zmq_replays_total", result="hole") == 0
    # What the replay brought in time stays; then the live frames, parked behind it.
    await wait_until(lambda: rig.sink.seqs()[-2:] == [11, 12], 3)
    assert rig.sink.seqs()[:2] == [0, 1] and len(rig.sink.seqs()) < 12
    assert rig.pub.replay_requests == [1]  # not asked again past the deadline


async def test_a_replay_that_overran_and_had_a_hole_is_still_a_loss(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    """The buffer no longer held the first missing batch (an overrun: the removal of
    block 1 is lost), and the answer had a hole too: its retry from the hole came back
    whole and the replay counted as complete, the stream LIVE with block 1 a phantom."""
    rigs.append(rig := await start_rig(ctx, publisher={"buffer_steps": 5}))
    await rig.pub.publish(stored(1))
    await rig.pub.publish(removed(1), send=False)  # gone from the buffer by the replay
    for block in range(2, 7):
        await rig.pub.publish(stored(block), send=False)
    rig.pub.replay_drops[5] = 1  # left out of the first answer only
    await rig.pub.publish(stored(7))
    await wait_until(lambda: rig.stream.status().state is StreamState.DEGRADED, 5)
    assert rig.pub.replay_requests == [1, 5]  # asked again from the hole
    assert "overran" in rig.stream.status().reason


async def test_a_late_copy_of_an_applied_batch_is_a_duplicate_not_a_restart(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    """After a reconnect the SUB socket drains what the dropped connection had queued
    among the new connection's frames, so sequences step back. Each step back counted
    as a publisher restart: the engine's inventory dropped (the reviewer saw 28 in one
    reconnect). A frame whose bytes are those of a batch applied at that sequence is a
    late copy now; other bytes at an old sequence are still a restart (the control)."""
    rigs.append(rig := await start_rig(ctx))
    for block in range(4):
        await rig.pub.publish(stored(block))
    await wait_until(lambda: rig.sink.seqs() == [0, 1, 2, 3], 5)
    seq1 = dict(rig.pub.buffer)[1]
    await rig.pub.send_raw([b"", (1).to_bytes(8, "big"), seq1])  # the same batch, late
    await rig.pub.publish(stored(9))
    await wait_until(lambda: rig.sink.seqs() == [0, 1, 2, 3, 4], 5)
    status = rig.stream.status()
    assert (status.incarnation, status.duplicate_frames) == (0, 1)
    assert rig.sink.held() == {0, 1, 2, 3, 9}
    # Control: other bytes at an old sequence are a restarted publisher's. (This stand-in
    # publisher's buffer still holds its old batch 1, so the new incarnation's replay
    # finds another batch there and counts a second restart.)
    await rig.pub.send_raw([b"", (1).to_bytes(8, "big"), msgpack.packb([0.0, [stored(7)], 0])])
    await wait_until(lambda: rig.stream.status().incarnation >= 1, 5)


async def test_batches_applied_from_another_numbering_do_not_swallow_the_live_stream(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    """A replay endpoint that answered with a batch far ahead (another publisher's
    numbering) left the stream's applied sequence there: every later live batch was
    dropped as a duplicate, silently, until the engine re-registered. A live batch
    further behind than any copy can lag is a new numbering now: a new incarnation."""
    rigs.append(rig := await start_rig(ctx, max_replay_frames=1_000, degraded_grace_s=60))
    await rig.pub.publish(stored(0))
    await wait_until(lambda: rig.sink.seqs() == [0], 5)
    stranger = msgpack.packb([0.0, [stored(77)], 0])
    rig.pub.buffer = [(5_000, stranger)]  # what the replay endpoint will answer
    rig.pub.next_seq = 2  # batch 1 is lost on the way: batch 2 shows the gap
    await rig.pub.publish(stored(2))
    await wait_until(lambda: 1 in rig.pub.replay_requests, 5)
    await wait_until(lambda: rig.stream.status().last_sequence == 5_000, 5)
    rig.pub.buffer = [b for b in rig.pub.buffer if b[0] != 5_000]  # the stranger is gone
    await rig.pub.publish(stored(3))
    await rig.pub.publish(stored(4))
    await wait_until(lambda: 4 in rig.sink.held(), 10)
    status = rig.stream.status()
    assert status.incarnation >= 1 and status.last_sequence == 4
    assert value(rig.metrics, "kvrc_zmq_publisher_restarts_total") >= 1


async def test_a_live_batch_applied_with_other_bytes_is_another_numbering_at_any_distance(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    """With the default bound (100,000), a replay endpoint a few batches ahead of the
    live stream: the live batch at a sequence applied from it with other bytes is not a
    copy of it, so a new incarnation, not a duplicate."""
    rigs.append(rig := await start_rig(ctx, degraded_grace_s=60))
    await rig.pub.publish(stored(0))
    await wait_until(lambda: rig.sink.seqs() == [0], 5)
    # The replay endpoint answers its own batches 1..5 (other bytes than ours).
    rig.pub.buffer = [(n, msgpack.packb([0.0, [stored(70 + n)], 0])) for n in range(1, 6)]
    rig.pub.next_seq = 2  # our batch 1 is lost: batch 2 shows the gap
    await rig.pub.publish(stored(2), send=False)
    await rig.pub.send_raw([b"", (2).to_bytes(8, "big"), msgpack.packb([0.0, [stored(2)], 0])])
    await wait_until(lambda: rig.stream.status().last_sequence == 5, 5)
    restarts = value(rig.metrics, "kvrc_zmq_publisher_restarts_total")
    rig.pub.buffer = []  # the stranger is gone
    rig.pub.next_seq = 3
    await rig.pub.publish(stored(3))  # ours, at a sequence applied from the stranger
    await wait_until(lambda: value(rig.metrics, "kvrc_zmq_publisher_restarts_total") > restarts, 5)
    await rig.pub.publish(stored(4))
    await wait_until(lambda: 4 in rig.sink.held(), 10)


def _stream_of(
    ctx: zmq.asyncio.Context, pub: WirePublisher, **config: Any
) -> tuple[ZmqEventStream, RecordingSink, Metrics]:
    """A stream of `pub` (with its replay endpoint), not started."""
    sink, metrics = RecordingSink(), Metrics()
    cfg = ZmqStreamConfig(
        engine_id=ENGINE, endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, **config
    )
    return ZmqEventStream(cfg, sink, metrics, context=ctx), sink, metrics


@pytest.mark.parametrize("catch_up", [True, False])
async def test_a_stream_that_starts_catches_up_without_waiting_for_a_live_batch(
    ctx: zmq.asyncio.Context, catch_up: bool
) -> None:
    # An engine that published while kvrc was not subscribed (between a session blip's
    # removal and its registration again) and then went idle: nothing live shows a gap.
    pub = WirePublisher(ctx)
    for h in range(3):
        await pub.publish(stored(h), send=False)
    await pub.publish(removed(0), send=False)
    stream, sink, metrics = _stream_of(ctx, pub, catch_up_on_start=catch_up)
    try:
        await stream.start()
        await pub.wait_subscribed()
        if catch_up:
            await wait_until(lambda: sink.seqs() == [0, 1, 2, 3], 5)
            assert sink.held() == {1, 2} and pub.replay_requests == [0]
            # Counted once the replay's END frame is read, after its last batch applied.
            await wait_until(
                lambda: value(metrics, "kvrc_zmq_replays_total", result="complete") == 1, 5
            )
            # Live batches go on from there.
            await pub.publish(stored(7))
            await wait_until(lambda: sink.seqs() == [0, 1, 2, 3, 4], 5)
            assert stream.status().state is StreamState.LIVE
        else:
            # The control: kept sleep, the scenario is an idle publisher.
            await asyncio.sleep(0.5)
            assert sink.seqs() == [] and pub.replay_requests == []
    finally:
        await stream.close()
        await pub.close()


async def test_a_start_replay_of_an_empty_buffer_is_complete(ctx: zmq.asyncio.Context) -> None:
    pub = WirePublisher(ctx)
    stream, sink, metrics = _stream_of(ctx, pub, catch_up_on_start=True)
    try:
        await stream.start()
        await wait_until(lambda: pub.replay_requests == [0], 5)
        await wait_until(
            lambda: value(metrics, "kvrc_zmq_replays_total", result="complete") == 1, 5
        )
        assert value(metrics, "kvrc_zmq_replays_total", result="overrun") == 0
        await pub.wait_subscribed()
        await pub.publish(stored(1))
        await wait_until(lambda: sink.seqs() == [0], 5)
    finally:
        await stream.close()
        await pub.close()


async def test_late_subscription_replays_from_zero(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    rigs.append(rig := await start_rig(ctx))
    for h in range(5):  # published before kvrc subscribed
        await rig.pub.publish(stored(h), send=False)
    await rig.pub.publish(removed(0))
    await wait_until(lambda: rig.sink.seqs() == [0, 1, 2, 3, 4, 5], 5)
    assert rig.pub.replay_requests == [0]
    assert rig.sink.held() == {1, 2, 3, 4}
    assert rig.stream.status().state is StreamState.LIVE


async def test_overrun_degrades_keeps_hints_for_the_grace_then_drops_them(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    rigs.append(rig := await start_rig(ctx, publisher={"buffer_steps": 2}, degraded_grace_s=0.5))
    await rig.pub.publish(stored(1, 2))
    await wait_until(lambda: rig.sink.seqs() == [0], 5)
    await rig.pub.publish(removed(1), send=False)  # lost, and out of the buffer
    await rig.pub.publish(stored(5), send=False)  # lost, and out of the buffer
    await rig.pub.publish(stored(6), send=False)  # lost, still in the buffer
    await rig.pub.publish(stored(7))
    await wait_until(lambda: rig.stream.status().state is StreamState.DEGRADED, 5)
    # What survived in the buffer (3, 4) is applied; the pre-gap entry 1 may be a
    # phantom (it was removed in the lost batches) but stays as a hint for now.
    await wait_until(lambda: rig.sink.seqs() == [0, 3, 4], 5)
    assert rig.sink.held() == {1, 2, 6, 7}
    assert ("degraded", ENGINE) in rig.sink.calls
    assert "overran" in rig.sink.reasons[-1]
    m = rig.metrics
    assert value(m, "kvrc_zmq_replays_total", result="overrun") == 1
    assert value(m, "kvrc_zmq_streams", state="degraded") == 1
    assert value(m, "kvrc_zmq_streams", state="live") == 0
    # The grace ends: every hint from before is dropped, a new incarnation begins.
    await wait_until(lambda: rig.stream.status().state is StreamState.LIVE, 5)
    assert rig.sink.calls[-2:] == [("drop", ENGINE), ("live", ENGINE)]
    assert rig.sink.held() == set()
    assert rig.stream.status().incarnation == 1
    await rig.pub.publish(stored(8))
    await wait_until(lambda: rig.sink.held() == {8}, 5)
    assert rig.sink.batches[-1] == (ENGINE, 1, 5)
    assert value(m, "kvrc_zmq_streams", state="live") == 1


async def test_overrun_on_a_fresh_stream_is_a_partial_view_not_degraded(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    rigs.append(rig := await start_rig(ctx, publisher={"buffer_steps": 2}))
    for h in range(4):
        await rig.pub.publish(stored(h), send=False)
    await rig.pub.publish(stored(10))
    await wait_until(lambda: rig.sink.seqs() == [3, 4], 5)
    assert rig.sink.held() == {3, 10}
    # Counted once the replay returns, after its last batch was applied.
    await wait_until(lambda: value(rig.metrics, "kvrc_zmq_replays_total", result="overrun") == 1, 5)
    assert rig.stream.status().state is StreamState.LIVE
    assert ("degraded", ENGINE) not in rig.sink.calls


async def test_unanswered_replay_degrades_and_a_clear_makes_the_view_exact_again(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    rigs.append(
        rig := await start_rig(
            ctx, publisher={"answer_replays": False}, replay_timeout_s=0.3, degraded_grace_s=60
        )
    )
    await rig.pub.publish(stored(1))
    await wait_until(lambda: rig.sink.seqs() == [0], 5)
    await rig.pub.publish(removed(1), send=False)
    await rig.pub.publish(stored(2))
    await wait_until(lambda: rig.sink.seqs() == [0, 2], 5)
    status = rig.stream.status()
    assert status.state is StreamState.DEGRADED
    assert "unanswered" in status.reason
    assert status.degraded_until_s is not None
    assert rig.sink.held() == {1, 2}  # 1 is a possible phantom, kept as a hint
    assert value(rig.metrics, "kvrc_zmq_replays_total", result="timeout") == 1
    await rig.pub.publish(CLEARED, stored(3))
    await wait_until(lambda: rig.stream.status().state is StreamState.LIVE, 5)
    assert rig.sink.held() == {3}
    assert ("drop", ENGINE) not in rig.sink.calls
    assert rig.sink.calls[-1] == ("live", ENGINE)


async def test_gap_without_a_replay_endpoint_degrades(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    rigs.append(rig := await start_rig(ctx, replay=False, degraded_grace_s=60))
    await rig.pub.publish(stored(1))
    await wait_until(lambda: rig.sink.seqs() == [0], 5)
    await rig.pub.publish(stored(2), send=False)
    await rig.pub.publish(stored(3))
    await wait_until(lambda: rig.sink.seqs() == [0, 2], 5)
    assert rig.stream.status().state is StreamState.DEGRADED
    assert "no replay endpoint" in rig.sink.reasons[-1]
    # A second loss while degraded does not extend the bound on a hint's age.
    until = rig.stream.status().degraded_until_s
    await rig.pub.publish(stored(4), send=False)
    await rig.pub.publish(stored(5))
    await wait_until(lambda: rig.sink.seqs() == [0, 2, 4], 5)
    assert rig.stream.status().degraded_until_s == until


async def test_losses_a_publisher_repeats_are_one_warning_per_kind_not_one_per_frame(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    rigs.append(rig := await start_rig(ctx, replay=False, degraded_grace_s=60))
    warnings = _Warnings()
    logger = logging.getLogger("coordinator.edges.zmq_ingest")
    logger.addHandler(warnings)
    try:
        await rig.pub.publish(stored(1))
        await wait_until(lambda: rig.sink.seqs() == [0], 5)
        # 30 gaps, no replay endpoint: the first degrades the stream (one line), each
        # later one is a loss while degraded: one more line, then only counted.
        for k in range(30):
            await rig.pub.publish(stored(100 + 2 * k), send=False)
            await rig.pub.publish(stored(101 + 2 * k))
        await wait_until(lambda: len(rig.sink.seqs()) == 31, 5)
        assert rig.stream.status().state is StreamState.DEGRADED
        assert warnings.lines == 2, warnings.lines
    finally:
        logger.removeHandler(warnings)


async def test_a_slow_replay_runs_off_the_live_path_and_keeps_the_order(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    rigs.append(rig := await start_rig(ctx, replay_timeout_s=60))
    await rig.pub.publish(stored(0))
    await wait_until(lambda: rig.sink.seqs() == [0], 5)
    rig.pub.replay_gate = gate = asyncio.Event()  # replays wait for the gate
    await rig.pub.publish(stored(1), send=False)  # lost on the wire
    await rig.pub.publish(stored(2))  # shows the gap: a replay from 1 is asked for
    await wait_until(lambda: rig.pub.replay_requests == [1], 5)
    for h in range(3, 23):
        await rig.pub.publish(stored(h))
    # The replay is unanswered, yet the SUB loop read every live frame and parked it.
    await wait_until(lambda: rig.stream.status().pending_frames == 20, 5)
    status = rig.stream.status()
    assert status.received_frames == 22 and rig.sink.seqs() == [0]
    gate.set()
    # Replayed (1, 2) first, then the parked ones in order; none applied twice.
    await wait_until(lambda: rig.sink.seqs() == list(range(23)), 5)
    status = rig.stream.status()
    assert (status.state, status.pending_frames, status.duplicate_frames) == (
        StreamState.LIVE,
        0,
        0,
    )
    assert rig.sink.held() == set(range(23))
    assert value(rig.metrics, "kvrc_zmq_replays_total", result="complete") == 1


def _frame_bytes(*events: dict[str, Any]) -> int:
    """The bytes of one live frame as WirePublisher sends it: [b"", seq, payload]."""
    return 8 + len(msgpack.packb([time.time(), list(events), 0]))


@pytest.mark.parametrize("bound", ["frames", "bytes"])
async def test_frames_past_the_parking_buffer_are_lost_and_replayed_like_a_gap(
    ctx: zmq.asyncio.Context, rigs: list[Rig], bound: str
) -> None:
    """The buffer holds four frames, bounded by their count or (frames of up to 4 MiB
    each) by their bytes: a thousand large frames must not park 4 GB."""
    frame = _frame_bytes(stored(3))
    limit: dict[str, Any] = (
        {"max_pending_frames": 4}
        if bound == "frames"
        else {"max_pending_bytes": 4 * frame + frame // 2, "max_frame_bytes": 2 * frame}
    )
    rigs.append(rig := await start_rig(ctx, replay_timeout_s=60, **limit))
    await rig.pub.publish(stored(0))
    await wait_until(lambda: rig.sink.seqs() == [0], 5)
    rig.pub.replay_gate = gate = asyncio.Event()
    await rig.pub.publish(stored(1), send=False)
    await rig.pub.publish(stored(2))
    await wait_until(lambda: rig.pub.replay_requests == [1], 5)
    for h in range(3, 13):  # 3..6 are parked, 7..12 find the buffer full
        await rig.pub.publish(stored(h))
    await wait_until(lambda: rig.stream.status().overflowed_frames == 6, 5)
    assert rig.stream.status().pending_frames == 4
    assert rig.stream.status().pending_bytes == 4 * frame
    gate.set()
    await wait_until(lambda: rig.sink.seqs() == list(range(7)), 5)
    # The next frame taken shows the dropped ones as a gap and replays them.
    await rig.pub.publish(stored(13))
    await wait_until(lambda: rig.sink.seqs() == list(range(14)), 5)
    assert rig.pub.replay_requests == [1, 7]
    assert rig.sink.held() == set(range(14))
    assert rig.stream.status().state is StreamState.LIVE
    assert value(rig.metrics, "kvrc_event_batches_total", source="zmq", result="overflow") == 6


# --- restarts --------------------------------------------------------------------------


async def test_publisher_restart_is_a_new_incarnation(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    rigs.append(rig := await start_rig(ctx))
    for h in (1, 2, 3):
        await rig.pub.publish(stored(h))
    await wait_until(lambda: rig.sink.seqs() == [0, 1, 2], 5)
    rig.pub.restart_numbering()
    await rig.pub.publish(stored(20))
    await wait_until(lambda: rig.sink.batches[-1] == (ENGINE, 1, 0), 5)
    assert rig.sink.held() == {20}  # the old incarnation's blocks are gone
    assert ("drop", ENGINE) in rig.sink.calls
    assert value(rig.metrics, "kvrc_zmq_publisher_restarts_total") == 1
    assert rig.stream.status().incarnation == 1


@pytest.mark.parametrize("new_batches", [1, 2])
async def test_a_replay_answered_by_a_restarted_publisher_is_a_new_incarnation(
    ctx: zmq.asyncio.Context, rigs: list[Rig], new_batches: int
) -> None:
    """The gap's replay reached the publisher after it restarted: the answer, the new
    publisher's batches, ended before the live batch 1 that asked for it (one new batch)
    or had another batch 1 (two). The old code took the answer as the gap's fill and
    kept the old batch 1 on top (block 7 held for good by an idle engine). Hypothesis
    found both (test_any_loss_and_restart_pattern_...; the second by a helper's audit
    with more examples)."""
    rigs.append(rig := await start_rig(ctx))
    await rig.pub.publish(stored(1), send=False)  # old 0, lost on the wire
    old_1 = msgpack.packb([time.time(), [stored(7)], 0])
    rig.pub.restart_numbering()
    new_blocks = [99, 98][:new_batches]
    for block in new_blocks:  # buffered by the new publisher, not yet seen
        await rig.pub.publish(stored(block), send=False)
    await rig.pub.send_raw([b"", (1).to_bytes(8, "big"), old_1])  # old 1 arrives late
    await wait_until(lambda: value(rig.metrics, "kvrc_zmq_publisher_restarts_total") == 1, 5)
    await wait_until(lambda: rig.sink.held() == set(new_blocks), 5)
    status = rig.stream.status()
    assert (status.state, status.incarnation, status.last_sequence) == (
        StreamState.LIVE,
        1,
        new_batches - 1,
    )
    # The gap's; (one new batch) from 1 with the old batch's bytes, not there; the new
    # publisher's whole buffer.
    assert rig.pub.replay_requests == ([0, 1, 0] if new_batches == 1 else [0, 0])
    await rig.pub.publish(stored(100))  # the new publisher goes on
    await wait_until(lambda: rig.sink.held() == {*new_blocks, 100}, 5)


async def test_a_gaps_fill_and_its_check_share_one_deadline(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    """The fill's answer lost its tail (the live batch 2) and took 0.6 s; the check from
    2 had a max_replay_s of its own, so the live stream could wait twice that. They share
    one now: the check gets the 0.4 s left, its frame takes 0.6 s, and the gap is a loss
    (degraded) instead of a second full wait."""
    rigs.append(rig := await start_rig(ctx, replay_timeout_s=1.0, max_replay_s=1.0))
    await rig.pub.publish(stored(1))
    await wait_until(lambda: rig.sink.seqs() == [0], 5)
    await rig.pub.publish(stored(2), send=False)
    rig.pub.replay_drops[2] = 1  # the fill's answer ends at 1
    rig.pub.replay_frame_delay_s = 0.6
    await rig.pub.publish(stored(3))
    await wait_until(lambda: rig.stream.status().state is StreamState.DEGRADED, 3)
    assert "not done in 1.0s" in rig.stream.status().reason
    assert rig.pub.replay_requests == [1, 2]
    await wait_until(lambda: rig.sink.seqs() == [0, 1, 2], 3)  # the live batch, as for a loss


async def test_the_rebuild_after_a_restart_has_a_deadline_of_its_own(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    """The restart shows at 0.8 s of the gap's 1.0 s: a rebuild left the 0.2 s would end
    partial, the new publisher's earlier stores missing for good (a review found it in
    the first version of the shared deadline)."""
    rigs.append(rig := await start_rig(ctx, replay_timeout_s=1.0, max_replay_s=1.0))
    await rig.pub.publish(stored(1), send=False)  # old 0, lost on the wire
    old_1 = msgpack.packb([time.time(), [stored(7)], 0])
    rig.pub.restart_numbering()
    for block in (99, 98):
        await rig.pub.publish(stored(block), send=False)
    rig.pub.replay_frame_delay_s = 0.4  # the other batch 1 shows at 0.8 s
    await rig.pub.send_raw([b"", (1).to_bytes(8, "big"), old_1])
    await wait_until(lambda: value(rig.metrics, "kvrc_zmq_publisher_restarts_total") == 1, 5)
    await wait_until(lambda: rig.sink.held() == {99, 98}, 5)
    assert value(rig.metrics, "kvrc_zmq_replays_total", result="timeout") == 0
    assert rig.stream.status().incarnation == 1


async def test_an_answer_that_lost_its_tail_is_not_taken_for_a_restart(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    """vLLM's ROUTER dropped the answer's last batch (the live one that asked for it)
    and still sent the end marker: the answer ended before that batch, as a restarted
    publisher's does. A replay from it with its bytes shows the same publisher: no new
    incarnation, nothing dropped (a review found the restart rule taking it for one)."""
    rigs.append(rig := await start_rig(ctx))
    await rig.pub.publish(stored(1))
    await wait_until(lambda: rig.sink.seqs() == [0], 5)
    await rig.pub.publish(stored(2), send=False)
    rig.pub.replay_drops[2] = 1  # the first answer ends at 1
    await rig.pub.publish(stored(3))
    await wait_until(lambda: rig.sink.seqs() == [0, 1, 2], 5)
    assert rig.pub.replay_requests == [1, 2]  # the gap, then the check from 2
    status = rig.stream.status()
    assert (status.state, status.incarnation) == (StreamState.LIVE, 0)
    assert value(rig.metrics, "kvrc_zmq_publisher_restarts_total") == 0
    assert rig.sink.held() == {1, 2, 3} and ("drop", ENGINE) not in rig.sink.calls


async def test_restart_seen_late_drops_the_old_and_replays_the_new_from_zero(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    rigs.append(rig := await start_rig(ctx))
    for h in (1, 2, 3, 4):
        await rig.pub.publish(stored(h))
    await wait_until(lambda: rig.sink.seqs() == [0, 1, 2, 3], 5)
    rig.pub.restart_numbering()
    await rig.pub.publish(stored(30), send=False)  # lost while reconnecting
    await rig.pub.publish(stored(31))
    await wait_until(lambda: rig.sink.batches[-2:] == [(ENGINE, 1, 0), (ENGINE, 1, 1)], 5)
    assert rig.sink.held() == {30, 31}
    assert rig.pub.replay_requests == [0]


async def test_restarted_publisher_that_numbered_past_us_is_caught_on_reconnect(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    """The sequence alone cannot tell: the reconnection makes kvrc check the history."""
    rigs.append(rig := await start_rig(ctx))
    await rig.pub.publish(stored(1))
    await rig.pub.publish(stored(2))
    await wait_until(lambda: rig.sink.seqs() == [0, 1], 5)
    await rig.pub.restart_process()
    for h in (40, 41, 42):  # published before kvrc reconnected: lost
        await rig.pub.publish(stored(h), send=False)
    await rig.pub.wait_subscribed()
    await rig.pub.publish(stored(43))
    await wait_until(lambda: rig.sink.held() == {40, 41, 42, 43}, 5)
    assert rig.pub.replay_requests == [1, 0]  # the check, then the new history
    assert [seq for _, inc, seq in rig.sink.batches if inc == 1] == [0, 1, 2, 3]
    assert ("drop", ENGINE) in rig.sink.calls
    assert value(rig.metrics, "kvrc_zmq_publisher_restarts_total") == 1


async def test_reconnection_to_the_same_publisher_keeps_the_incarnation(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    rigs.append(rig := await start_rig(ctx))
    await rig.pub.publish(stored(1))
    await rig.pub.publish(stored(2))
    await wait_until(lambda: rig.sink.seqs() == [0, 1], 5)
    # Same publisher and buffer, new connection (a network blip).
    buffer, next_seq = rig.pub.buffer, rig.pub.next_seq
    await rig.pub.restart_process()
    rig.pub.buffer, rig.pub.next_seq = buffer, next_seq
    await rig.pub.publish(stored(3), send=False)  # lost during the blip
    await rig.pub.wait_subscribed()
    await rig.pub.publish(stored(4))
    await wait_until(lambda: rig.sink.seqs() == [0, 1, 2, 3], 5)
    assert rig.sink.held() == {1, 2, 3, 4}
    assert rig.pub.replay_requests == [1]  # the check also brought 2 and 3
    assert rig.stream.status().incarnation == 0
    assert ("drop", ENGINE) not in rig.sink.calls


async def test_a_restart_whose_buffer_no_longer_holds_our_last_batch_is_a_new_incarnation(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    """The restarted publisher numbered past us and its buffer starts after our last
    sequence: the check cannot compare bytes. Taken as the same publisher, the dead
    process's blocks stayed held under its batches for as long as the engine ran."""
    rigs.append(rig := await start_rig(ctx, publisher={"buffer_steps": 3}))
    for h in (1, 2, 3, 4, 5):
        await rig.pub.publish(stored(h))
    await wait_until(lambda: rig.sink.seqs() == [0, 1, 2, 3, 4], 5)
    await rig.pub.restart_process()
    for h in range(40, 50):  # seqs 0..9 while kvrc reconnects; the buffer keeps 7..9
        await rig.pub.publish(stored(h), send=False)
    await rig.pub.wait_subscribed()
    await rig.pub.publish(stored(50))
    await wait_until(lambda: 50 in rig.sink.held(), 5)
    assert not {1, 2, 3, 4, 5} & rig.sink.held()
    assert ("drop", ENGINE) in rig.sink.calls
    assert rig.stream.status().incarnation == 1


async def test_a_blip_past_the_publishers_buffer_leaves_no_phantom(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    """Same publisher, but its buffer overran during the blip: the removal lost with it
    left a phantom, and the stream stayed LIVE (no grace bounding its age)."""
    rigs.append(rig := await start_rig(ctx, publisher={"buffer_steps": 3}))
    for h in (1, 2, 3):
        await rig.pub.publish(stored(h))
    await wait_until(lambda: rig.sink.seqs() == [0, 1, 2], 5)
    buffer, next_seq = rig.pub.buffer, rig.pub.next_seq
    await rig.pub.restart_process()
    rig.pub.buffer, rig.pub.next_seq = buffer, next_seq  # only the connection dropped
    await rig.pub.publish(removed(1), send=False)  # lost during the blip
    for h in (10, 11, 12, 13):  # the buffer keeps the last 3 only
        await rig.pub.publish(stored(h), send=False)
    await rig.pub.wait_subscribed()
    await rig.pub.publish(stored(14))
    await wait_until(lambda: 14 in rig.sink.held(), 5)
    assert 1 not in rig.sink.held()
    assert {12, 13, 14} <= rig.sink.held()  # what the buffer still had


# Scenario steps: ("sent", hashes to store, hashes to remove), ("lost", ...), ("restart",).
step = st.one_of(
    st.tuples(
        st.sampled_from(["sent", "lost"]),
        st.lists(st.integers(0, 30), max_size=3),
        st.lists(st.integers(0, 30), max_size=3),
    ),
    st.just(("restart",)),
)


def _scenario(steps: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Make it observable: a restart's first batch and the last batch are sent."""
    fixed: list[tuple[Any, ...]] = []
    for item in steps:
        if fixed and fixed[-1][0] == "restart" and item[0] == "lost":
            item = ("sent", *item[1:])
        fixed.append(item)
    fixed.append(("sent", [99], []))
    return fixed


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step, max_size=12))
def test_any_loss_and_restart_pattern_ends_in_the_publishers_exact_inventory(
    steps: list[tuple[Any, ...]],
) -> None:
    """With a replay buffer that holds everything, what kvrc applied is exactly what
    the current publisher incarnation published, in order, whatever was lost."""

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        rig = await start_rig(ctx)
        model: set[int] = set()
        try:
            for item in _scenario(steps):
                if item[0] == "restart":
                    rig.pub.restart_numbering()
                    model.clear()
                    continue
                kind, store, remove = item
                events = [stored(*store)] if store else []
                events += [removed(h) for h in remove]
                await rig.pub.publish(*events, send=kind == "sent")
                model.update(store)
                model.difference_update(remove)
            last = rig.pub.next_seq - 1
            await wait_until(lambda: bool(rig.sink.batches) and rig.sink.batches[-1][2] == last, 5)
            assert rig.sink.held() == model
            incarnation = rig.stream.status().incarnation
            current = [seq for _, inc, seq in rig.sink.batches if inc == incarnation]
            assert current == list(range(last + 1))
            assert rig.stream.status().state is StreamState.LIVE
        finally:
            await rig.stream.close()
            await rig.pub.close()
            ctx.destroy(linger=0)

    asyncio.run(run())


# --- bad input -------------------------------------------------------------------------


async def test_malformed_frames_are_counted_skipped_and_the_stream_continues(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    rigs.append(rig := await start_rig(ctx, degraded_grace_s=60))
    await rig.pub.publish(stored(1))
    await rig.pub.send_raw([b"", b"\x00" * 8])  # two frames
    await rig.pub.send_raw([b"", b"\x01", b"x"])  # a 1-byte sequence
    await rig.pub.send_raw([b"", (1).to_bytes(8, "big"), b"\xc1garbage"])  # seq 1, bad payload
    rig.pub.next_seq = 2
    await rig.pub.publish(stored(2))
    await wait_until(lambda: rig.sink.seqs() == [0, 2], 5)
    assert rig.sink.held() == {1, 2}
    assert value(rig.metrics, "kvrc_event_batches_total", source="zmq", result="malformed") == 3
    # DEGRADED is set once the replay returns, after its batch 2 was applied.
    await wait_until(lambda: rig.stream.status().state is StreamState.DEGRADED, 5)
    status = rig.stream.status()
    assert status.malformed_frames == 3
    # The bad frame changed nothing; batch 2 showed the gap, and the publisher
    # never had a batch 1 to replay: earlier entries are hints now.
    assert rig.pub.replay_requests == [1]
    assert status.state is StreamState.DEGRADED
    assert "overran" in status.reason


def _decodes(frames: list[bytes]) -> bool:
    if len(frames) != 3:
        return False
    try:
        decode_payload(frames[0], decode_sequence(frames[1]), frames[2])
    except MalformedFrame:
        return False
    return True


_shapes = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)  # what msgpack can pack
    | st.floats()
    | st.text(max_size=8)
    | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
_field = st.sampled_from(["type", "block_hashes", "block_size", "token_ids", "medium", "group_idx"])
_tag = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"])
# vLLM's [ts, events, dp_rank] with events of the right tags and wrong fields.
_near_batches = st.tuples(
    st.floats(allow_nan=False),
    st.lists(st.dictionaries(_field, _shapes | _tag, max_size=6), max_size=3),
    _shapes,
)
# Random parts, or the right parts with a random sequence and a payload of random
# bytes or of msgpack in the wrong shape.
_bad_frames = st.lists(st.binary(max_size=48), min_size=1, max_size=5) | st.tuples(
    st.binary(max_size=8),
    st.binary(min_size=8, max_size=8),
    st.binary(max_size=64)
    | (_shapes | _near_batches).map(lambda x: msgpack.packb(x, use_bin_type=True)),
).map(list)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += 1


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(garbage=st.lists(_bad_frames.filter(lambda f: not _decodes(f)), min_size=1, max_size=30))
def test_frames_that_do_not_decode_are_counted_logged_once_and_change_nothing(
    garbage: list[list[bytes]],
) -> None:
    async def run() -> None:
        ctx = zmq.asyncio.Context()
        rig = await start_rig(ctx)
        warnings = _Warnings()
        logging.getLogger("coordinator.edges.zmq_ingest").addHandler(warnings)
        try:
            await rig.pub.publish(stored(1))
            await wait_until(lambda: rig.sink.seqs() == [0], 5)
            before = rig.stream.status()
            for frames in garbage:
                await rig.pub.send_raw(frames)
            await wait_until(lambda: rig.stream.status().received_frames == 1 + len(garbage), 5)
            after = rig.stream.status()
            assert after.malformed_frames == len(garbage)
            bad = value(rig.metrics, "kvrc_event_batches_total", source="zmq", result="malformed")
            assert bad == len(garbage)
            assert warnings.lines == 1  # the first; then one per 10 s at most
            assert (after.state, after.incarnation, after.last_sequence, after.replays) == (
                before.state,
                before.incarnation,
                before.last_sequence,
                before.replays,
            )
            assert rig.sink.held() == {1} and rig.sink.calls == [] and rig.sink.seqs() == [0]
            assert rig.pub.replay_requests == []
            await rig.pub.publish(stored(2))  # a valid frame still applies
            await wait_until(lambda: rig.sink.seqs() == [0, 1], 5)
            assert rig.sink.held() == {1, 2}
        finally:
            logging.getLogger("coordinator.edges.zmq_ingest").removeHandler(warnings)
            await rig.stream.close()
            await rig.pub.close()
            ctx.destroy(linger=0)

    asyncio.run(run())


async def test_a_flood_of_malformed_frames_logs_one_line_per_interval(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    """A publisher set the log's rate: one line per 1,000 bad frames, so tens of
    thousands of frames a second wrote tens of lines a second. Now one per 10 s (of
    the stream's clock, stopped here: a slow host takes no second line)."""
    rigs.append(rig := await start_rig(ctx, clock=lambda: 100.0))
    warnings = _Warnings()
    logging.getLogger("coordinator.edges.zmq_ingest").addHandler(warnings)
    try:
        await rig.pub.publish(stored(1))
        await wait_until(lambda: rig.sink.seqs() == [0], 5)
        for burst in range(5):
            for _ in range(500):
                await rig.pub.send_raw([b"", b"\x01", b"x"])  # a 1-byte sequence
            sent = 1 + 500 * (burst + 1)

            def all_read(sent: int = sent) -> bool:
                return rig.stream.status().received_frames == sent

            await wait_until(all_read, 10)
        assert rig.stream.status().malformed_frames == 2_500
        assert warnings.lines == 1
    finally:
        logging.getLogger("coordinator.edges.zmq_ingest").removeHandler(warnings)


async def test_stores_of_another_adapter_or_block_size_are_skipped_alone(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    """vLLM names each stored block's adapter (the request's: one engine serves many) and
    publishes partial blocks with their own block_size. Either made the whole stream
    stale, every block of the engine hidden until it restarted; only those stores are
    left out now, counted, and the stream stays live."""
    rigs.append(rig := await start_rig(ctx, block_size=16))
    await rig.pub.publish(stored(1))
    await rig.pub.publish(stored(5, lora_name="adapter-x"), stored(2), stored(6, block_size=7))
    await rig.pub.publish(stored(3))
    await wait_until(lambda: rig.sink.seqs() == [0, 1, 2], 5)
    assert rig.sink.held() == {1, 2, 3}
    assert rig.stream.status().state is StreamState.LIVE and rig.sink.calls == []
    m = rig.metrics
    assert value(m, "kvrc_block_events_total", source="zmq", type="out_of_scope") == 2
    assert value(m, "kvrc_block_events_total", source="zmq", type="stored") == 3


@pytest.mark.parametrize(
    ("config", "event", "dp_rank", "says"),
    [({"dp_rank": 1, "dp_size": 2}, stored(5), 0, "data_parallel_rank 0")],
)
async def test_profile_mismatch_marks_the_stream_stale_and_pollutes_nothing(
    ctx: zmq.asyncio.Context,
    rigs: list[Rig],
    config: dict[str, Any],
    event: dict[str, Any],
    dp_rank: int,
    says: str,
) -> None:
    rank = config.get("dp_rank", 0)
    rigs.append(rig := await start_rig(ctx, publisher={"dp_rank": rank}, **config))
    child = rig.stream.child_engine_id
    await rig.pub.publish(stored(1))
    await rig.pub.publish(event, dp_rank=dp_rank)
    await rig.pub.publish(stored(2))  # refused too: the stream is stale
    await wait_until(lambda: rig.stream.status().state is StreamState.STALE, 5)
    await wait_until(
        lambda: value(rig.metrics, "kvrc_event_batches_total", source="zmq", result="refused") == 2,
        5,
    )
    assert rig.sink.held(child) == {1}
    assert rig.sink.calls == [("stale", child)]
    assert says in rig.sink.reasons[0]
    assert value(rig.metrics, "kvrc_zmq_streams", state="stale") == 1
    # A restarted publisher with the right profile is a new, live incarnation.
    rig.pub.restart_numbering()
    await rig.pub.publish(stored(3))
    await wait_until(lambda: rig.sink.held(child) == {3}, 5)
    assert rig.stream.status().state is StreamState.LIVE


async def test_child_engine_id_carries_the_dp_rank(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    rigs.append(rig := await start_rig(ctx, publisher={"dp_rank": 3}, dp_rank=3, dp_size=4))
    await rig.pub.publish(stored(1))
    await wait_until(lambda: rig.sink.held("engine-a_dp3") == {1}, 5)


class RefusingSink(RecordingSink):
    """Refuses a batch as the inventory core refuses one (INVALID_ARGUMENT): here any
    with a block of group 7 (the decoder already refuses a group past the core's bound)."""

    def apply(self, child_engine_id: str, batch: EventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored) and ev.group_idx == 7:
                raise invalid("group_idx 7 is refused here")
        super().apply(child_engine_id, batch)


async def test_a_batch_the_core_refuses_is_counted_and_the_stream_continues(
    ctx: zmq.asyncio.Context, rigs: list[Rig]
) -> None:
    rigs.append(rig := await start_rig(ctx, degraded_grace_s=60))
    sink = RefusingSink()
    rig.stream._sink = sink  # the same stream, a sink that refuses like the core
    await rig.pub.publish(stored(1))
    await wait_until(lambda: sink.seqs() == [0], 5)
    await rig.pub.publish({**stored(2), "group_idx": 7})
    await rig.pub.publish(stored(3))
    await wait_until(lambda: sink.seqs() == [0, 2], 5)
    assert sink.held() == {1, 3}
    assert value(rig.metrics, "kvrc_event_batches_total", source="zmq", result="refused") == 1
    assert rig.stream.status().state is StreamState.DEGRADED
    assert "refused" in sink.reasons[-1]


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"engine_id": ""}, "engine_id"),
        ({"dp_rank": 2, "dp_size": 2}, "dp_rank 2"),
        ({"endpoint": "ipc:///tmp/kv"}, "endpoint must be tcp://host:port"),
        ({"replay_endpoint": "tcp://host"}, "replay_endpoint must be"),
        ({"block_size": 0}, "block_size"),
        ({"replay_timeout_s": 0}, "replay_timeout_s"),
        ({"max_replay_s": 0}, "max_replay_s"),
        ({"max_pending_bytes": 0}, "max_pending_bytes"),
        ({"max_pending_bytes": 1024, "max_frame_bytes": 2048}, "at least max_frame_bytes"),
        ({"rcv_hwm": 0}, "rcv_hwm"),
    ],
)
def test_bad_stream_config_is_refused_with_the_field_named(
    config: dict[str, Any], says: str
) -> None:
    fields: dict[str, Any] = {"engine_id": ENGINE, "endpoint": "tcp://127.0.0.1:5557", **config}
    with pytest.raises(KvrcError, match=says) as err:
        ZmqStreamConfig(**fields)
    assert err.value.code is ErrorCode.INVALID_ARGUMENT


async def test_an_endpoint_that_cannot_be_bound_is_a_clear_error(
    ctx: zmq.asyncio.Context,
) -> None:
    taken = ctx.socket(zmq.SUB)
    taken.bind("tcp://127.0.0.1:0")
    try:
        endpoint = taken.getsockopt_string(zmq.LAST_ENDPOINT)
        metrics = Metrics()
        cfg = ZmqStreamConfig(engine_id=ENGINE, endpoint=endpoint, bind=True)
        stream = ZmqEventStream(cfg, RecordingSink(), metrics, context=ctx)
        with pytest.raises(KvrcError, match="cannot bind") as err:
            await stream.start()
        assert err.value.code is ErrorCode.FAILED_PRECONDITION
        await stream.close()  # a second close is harmless
        assert value(metrics, "kvrc_zmq_streams", state="live") == 0
    finally:
        taken.close(0)


# --- endpoints and lifecycle ----------------------------------------------------------


async def test_kvrc_binds_for_a_publisher_that_connects(ctx: zmq.asyncio.Context) -> None:
    sink, metrics = RecordingSink(), Metrics()
    cfg = ZmqStreamConfig(engine_id=ENGINE, endpoint="tcp://127.0.0.1:0", bind=True)
    stream = ZmqEventStream(cfg, sink, metrics, context=ctx)
    await stream.start()
    assert stream.bound_endpoint is not None
    pub = WirePublisher(ctx, connect_to=stream.bound_endpoint)
    try:
        await pub.wait_subscribed()
        await pub.publish(stored(1))
        await wait_until(lambda: sink.held() == {1}, 5)
    finally:
        await stream.close()
        await pub.close()
    assert value(metrics, "kvrc_zmq_streams", state="live") == 0
    # close() released the port (ZMQ's I/O thread lets go of it shortly after).
    endpoint = stream.bound_endpoint
    again = ctx.socket(zmq.SUB)

    def rebound() -> bool:
        try:
            again.bind(endpoint)
        except zmq.ZMQError:
            return False
        return True

    try:
        await wait_until(rebound, 2, interval_s=0.01, what=f"{endpoint} released after close()")
    finally:
        again.close(0)


async def test_only_the_engines_host_may_publish_to_a_socket_kvrc_binds(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """Where vLLM connects, kvrc binds, and anyone who reached the port could publish
    events for the engine (phantom blocks, removals). Only the registered engine's host
    may. Loopback addresses stand in for hosts here: 127.0.0.3 is the engine's, a
    publisher from 127.0.0.2 is another host's; a second stream in the same context
    (its own gate domain) admits only its own engine's host."""
    sink, other_sink, metrics = RecordingSink(), RecordingSink(), Metrics()
    cfg = ZmqStreamConfig(
        engine_id=ENGINE, endpoint="tcp://127.0.0.1:0", bind=True, publisher_host="127.0.0.3"
    )
    stream = ZmqEventStream(cfg, sink, metrics, context=ctx)
    other = ZmqEventStream(
        ZmqStreamConfig(
            engine_id="other", endpoint="tcp://127.0.0.1:0", bind=True, publisher_host="127.0.0.2"
        ),
        other_sink,
        metrics,
        context=ctx,
    )
    await stream.start()
    await other.start()
    assert stream.bound_endpoint is not None and other.bound_endpoint is not None
    port = stream.bound_endpoint.rpartition(":")[2]
    engine_pub = WirePublisher(ctx, connect_to=f"tcp://127.0.0.3:0;127.0.0.1:{port}")
    intruder = WirePublisher(ctx, connect_to=f"tcp://127.0.0.2:0;127.0.0.1:{port}")
    caplog.set_level(logging.WARNING, logger="coordinator.edges.zmq_ingest")
    try:
        await engine_pub.wait_subscribed()
        with pytest.raises(TimeoutError):  # never handed the subscription: no connection
            await asyncio.wait_for(intruder.pub.recv(), 1)
        await intruder.publish(stored(666))
        await engine_pub.publish(stored(1))
        await wait_until(lambda: sink.held() == {1}, 5)
        assert value(metrics, "kvrc_zmq_publishers_refused_total") >= 1
        assert "refused a KV-event publisher connecting from 127.0.0.2" in caplog.text
        # The same intruder is the other stream's engine: admitted there.
        other_port = other.bound_endpoint.rpartition(":")[2]
        its_pub = WirePublisher(ctx, connect_to=f"tcp://127.0.0.2:0;127.0.0.1:{other_port}")
        try:
            await its_pub.wait_subscribed()
            await its_pub.publish(stored(2))
            await wait_until(lambda: other_sink.held("other") == {2}, 5)
        finally:
            await its_pub.close()
    finally:
        await stream.close()
        await other.close()
        await engine_pub.close()
        await intruder.close()
    assert sink.held() == {1}


async def test_bound_streams_of_a_long_engine_id_start_and_start_again_at_once(
    ctx: zmq.asyncio.Context,
) -> None:
    """Each socket's ZAP domain named its engine: past 255 bytes (an id of ~238
    characters) libzmq refused it and the stream never started; and the gate closed with
    its last domain, so a stream started right after found ZAP's endpoint still bound
    (a review's findings). Domains are short now, and the gate lives with its context."""
    cfg = ZmqStreamConfig(
        engine_id="e" * 256, endpoint="tcp://127.0.0.1:0", bind=True, publisher_host="127.0.0.1"
    )
    stream = ZmqEventStream(cfg, RecordingSink(), Metrics(), context=ctx)
    await stream.start()
    assert stream.bound_endpoint is not None
    for _ in range(5):  # the engine registers again: its next stream starts as this closes
        again = ZmqEventStream(cfg, RecordingSink(), Metrics(), context=ctx)
        await asyncio.gather(stream.close(), again.start())
        assert again.bound_endpoint is not None
        stream = again
    await stream.close()


async def test_a_stream_retired_while_resolving_its_publisher_host_leaves_nothing_behind(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coordinator.edges import zmq_ingest, zmq_zap

    resolved = asyncio.Event()

    async def slow(host: str) -> frozenset[Any]:
        await resolved.wait()
        return frozenset()

    monkeypatch.setattr(zmq_ingest, "host_addresses", slow)
    cfg = ZmqStreamConfig(
        engine_id=ENGINE, endpoint="tcp://127.0.0.1:0", bind=True, publisher_host="slow.example"
    )
    stream = ZmqEventStream(cfg, RecordingSink(), Metrics(), context=ctx)
    starting = asyncio.create_task(stream.start())
    await asyncio.sleep(0.05)
    await stream.close()  # retired while its start waits for the name
    resolved.set()
    await starting  # no error: nothing to start any more
    gate = zmq_zap._GATES.get(ctx)
    assert gate is None or not gate._domains  # no domain (nor the stream) kept
    assert stream.bound_endpoint is None


async def test_a_publisher_host_that_does_not_resolve_fails_the_start_clearly(
    ctx: zmq.asyncio.Context,
) -> None:
    cfg = ZmqStreamConfig(
        engine_id=ENGINE, endpoint="tcp://127.0.0.1:0", bind=True, publisher_host="no-such.invalid"
    )
    stream = ZmqEventStream(cfg, RecordingSink(), Metrics(), context=ctx)
    with pytest.raises(KvrcError, match=r"cannot resolve the publisher's host 'no-such\.invalid'"):
        await stream.start()


def test_subscriber_endpoint_follows_vllm_bind_or_connect_rule() -> None:
    assert subscriber_endpoint("tcp://*:5557", "10.0.0.7") == ("tcp://10.0.0.7:5557", False)
    assert subscriber_endpoint("tcp://*:5557", "10.0.0.7", 2) == ("tcp://10.0.0.7:5559", False)
    assert subscriber_endpoint("tcp://kvrc.local:6000", "x", 1) == ("tcp://kvrc.local:6001", True)
    with pytest.raises(KvrcError, match="tcp://host:port"):
        subscriber_endpoint("ipc:///tmp/x", "h")
    with pytest.raises(KvrcError, match="fixed port"):
        subscriber_endpoint("tcp://*:0", "h")
    # vLLM does not add the DP rank to port 0 (it binds a port of its own choosing):
    # kvrc subscribed to port 1 on DP rank 1.
    with pytest.raises(KvrcError, match="fixed port"):
        subscriber_endpoint("tcp://*:0", "h", 1)


def test_stream_config_from_vllm_registration_values() -> None:
    cfg = stream_config_from_vllm(
        engine_id="engine-a",
        dp_rank=2,
        dp_size=4,
        kv_events_endpoint="tcp://*:5557",
        kv_events_replay_endpoint="tcp://*:5600",
        publisher_host="10.0.0.7",
        block_size=16,
    )
    assert (cfg.endpoint, cfg.bind, cfg.replay_endpoint) == (
        "tcp://10.0.0.7:5559",
        False,
        "tcp://10.0.0.7:5602",
    )
    assert cfg.child_engine_id == "engine-a_dp2" and cfg.block_size == 16
    connecting = stream_config_from_vllm(
        engine_id="engine-b",
        dp_rank=0,
        dp_size=1,
        kv_events_endpoint="tcp://kvrc.svc:7000",
        kv_events_replay_endpoint="",
        publisher_host="10.0.0.8",
        block_size=None,
    )
    assert (connecting.endpoint, connecting.bind, connecting.replay_endpoint) == (
        "tcp://kvrc.svc:7000",
        True,
        None,
    )
    assert connecting.child_engine_id == "engine-b"


async def test_a_publisher_flapping_between_losses_and_restarts_logs_a_few_short_lines(
    ctx: zmq.asyncio.Context, rigs: list[Rig], caplog: pytest.LogCaptureFixture
) -> None:
    """Each loss logged 'degraded' and each restart 'live again', with no limit: a
    publisher alternating a gap and a restart filled the log (I8-bad-input), and a line
    echoed every lora_name of the batch in full. A few short lines now."""
    caplog.set_level(logging.INFO, logger="coordinator.edges.zmq_ingest")
    rigs.append(rig := await start_rig(ctx, replay=False))
    for _ in range(40):
        rig.pub.restart_numbering()
        await rig.pub.publish(stored(1))
        rig.pub.next_seq = 2  # sequence 1 missed: degraded (no replay endpoint)
        await rig.pub.publish(stored(2))
    await wait_until(lambda: rig.stream.status().incarnation >= 39, 10)
    rig.pub.restart_numbering()
    await rig.pub.publish(stored(3, lora_name="x" * 100_000))  # another adapter's
    await wait_until(
        lambda: (
            value(rig.metrics, "kvrc_block_events_total", source="zmq", type="out_of_scope") == 1
        ),
        5,
    )
    lines = [r.getMessage() for r in caplog.records if r.name == "coordinator.edges.zmq_ingest"]
    assert 3 <= len(lines) <= 12, lines
    assert max(len(line) for line in lines) < 1_000
