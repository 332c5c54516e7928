"""ZMQ ingest edge: subscribe to an unmodified vLLM engine's KV-event publisher.

One `ZmqEventStream` per publisher (one per DP rank of an engine). It owns a SUB
socket (connecting to a publisher that binds `tcp://*:PORT`, or binding for one
that connects) and a DEALER socket to the publisher's replay ROUTER. It decodes
frames with `coordinator.core.vllm_events`, puts them in sequence order and hands
`EventBatch` values to an `EventSink`: the same inventory core the gRPC session
stream feeds (one core, two edges).

Ordering (I7-ordered-streams in docs/invariants.md), per stream:

- a sequence at or below the last one seen on the SUB socket itself is a
  publisher restart (a PUB socket delivers in order): new incarnation, the
  sink drops the engine's inventory of the old one; unless its bytes are those
  of the batch applied at that sequence (one of the last 1,024): a late copy
  from a dropped connection's queue, drained among a new connection's frames;
- a sequence at or below the last applied one, but above the last seen on the
  SUB socket, is a batch already delivered by a replay: dropped as duplicate;
- a gap (or a first frame above 0: late subscription) asks the replay endpoint
  for everything from the first missing sequence;
- a replay answer whose batch at the live batch's sequence is another comes from a
  restarted publisher; one that ends before the live batch (vLLM buffers each
  batch as it sends it) is checked by a replay from that batch with its bytes: the
  same publisher (the answer lost its tail) goes on, one that no longer has that
  batch restarted. A restart: new incarnation, the parked frames dropped, its
  buffer read again from 0;
- a live frame that does not decode (parts, sequence or payload) is counted,
  logged at most once per 1000 and changes nothing: if it was a real batch, the
  next frame shows the gap. A replayed batch that does not decode is lost.

A replay runs off the live path, in a catch-up task: the SUB loop keeps reading
(so the socket's queue never fills and drops frames behind our back) and parks
the live frames that follow the gap, at most `max_pending_frames` and
`max_pending_bytes`, until the replayed batches are applied; then the parked
ones go through the rules above in arrival order. A frame that finds the buffer
full is dropped and counted (`result="overflow"`), as if lost on the wire: the
next frame taken shows the gap and replays it, or the stream degrades when the
publisher no longer has it.

An answer that skips a sequence or stops midway (vLLM's ROUTER drops what passes its
send queue, the end marker too) is asked again from the first batch missing, up to
REPLAY_HOLE_RETRIES times; nothing is applied across a hole.

Degraded: when a gap cannot be filled (no replay endpoint, the replay starts
after the sequence asked for because vLLM's buffer overran, no answer within
`replay_timeout_s`, a gap's replays, retries included, not done within
`max_replay_s`, an answer that keeps skipping, or a malformed frame), events
may have been lost. Lost
stores only cost hits; a lost removal leaves a phantom entry. Inventory is
advisory (a pin is checked by the holder, a miss means recompute), so kvrc
keeps the entries as hints but for at most `degraded_grace_s`: it calls
`sink.mark_degraded`, keeps applying the live stream, and when the grace ends
drops the engine's inventory and starts a new incarnation (what it learns from
then on is exact). An `AllBlocksCleared` or a publisher restart ends it sooner.
A stream that had applied nothing before the gap (a late subscriber) has no
entry that can be a phantom: it stays live with a partial view.
`ZmqEventStream.status()` and the `kvrc_zmq_streams{state}` gauge show it.

Out of scope: a stored block whose `lora_name` or `block_size` differs from the
registered profile (another adapter's request on a multi-LoRA engine, a partial
block) is skipped alone and counted (`kvrc_block_events_total{type="out_of_scope"}`);
it never pollutes the scope. Stale: a batch whose `data_parallel_rank` is not this
stream's is refused with one log line; the stream is marked stale
(`sink.mark_stale`) and applies nothing more until the publisher restarts.

A restarted publisher can number past the last sequence kvrc saw before any of
its frames arrive (its first batches lost while kvrc reconnects). So after a
publisher connection drops (a socket monitor reports it), the next frame first
replays from the last applied sequence and compares that batch's bytes: other
bytes, or no such batch, is a restart. Without a replay endpoint this check is
not possible and only the sequence rule applies.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import math
import re
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Protocol

import zmq
import zmq.asyncio

from coordinator.core.errors import ErrorCode, KvrcError, invalid
from coordinator.core.events import BlockStored, EventBatch, InventoryEvent
from coordinator.core.registry import RankPartRegistration
from coordinator.core.vllm_events import (
    END_SEQ,
    DecodedBatch,
    MalformedFrame,
    decode_payload,
    decode_sequence,
)
from coordinator.edges.zmq_zap import close_gate, gate_for, host_addresses, leave_gate, new_domain
from coordinator.runtime.log_limit import RateLimitedLog
from coordinator.runtime.metrics import Metrics
from kvrc.ids import child_engine_id

log = logging.getLogger(__name__)

SOURCE = "zmq"
# tcp://host:port; groups: host, port.
_TCP_ENDPOINT = re.compile(r"tcp://(\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})")
# Frames drained per wake-up before yielding to the event loop, and the bytes: a burst
# of large frames yields early, so sessions and RPCs are served between them.
_BURST = 256
_BURST_BYTES = 1 << 20


def _frames_bytes(frames: list[bytes]) -> int:
    return sum(len(frame) for frame in frames)


class EventSink(Protocol):
    """What the ZMQ edge feeds; the integrator wires it to the inventory core."""

    def apply(self, child_engine_id: str, batch: EventBatch) -> None:
        """Apply one in-order batch. Within an incarnation sequences increase."""

    def drop_engine_inventory(self, child_engine_id: str) -> None:
        """Forget everything the child engine's earlier incarnations reported."""

    def mark_stale(self, child_engine_id: str, reason: str) -> None:
        """The stream no longer matches the registered profile; serve nothing of it."""

    def mark_degraded(self, child_engine_id: str, reason: str) -> None:
        """Events were lost: entries are hints with a bounded age until `mark_live`."""

    def mark_live(self, child_engine_id: str) -> None:
        """The view is exact (or a subset of the truth) again."""


class StreamState(enum.Enum):
    LIVE = "live"
    DEGRADED = "degraded"
    STALE = "stale"


@dataclass(frozen=True, slots=True)
class ZmqStreamConfig:
    """One vLLM publisher (one DP rank of one engine), as registered or configured."""

    engine_id: str
    endpoint: str  # where kvrc connects (publisher binds) or binds (publisher connects)
    bind: bool = False
    # Where kvrc binds: the host a publisher may connect from (and loopback); "" = any.
    publisher_host: str = ""
    replay_endpoint: str | None = None  # the publisher's ROUTER; kvrc always connects
    dp_rank: int = 0
    dp_size: int = 1
    topic: str = ""
    # From the registered profile; None skips the check.
    block_size: int | None = None
    lora_name: str = ""
    replay_timeout_s: float = 2.0  # the longest wait for one frame of a replay's answer
    # The longest a gap's replays (retries after holes and the check of a short answer
    # included) may take in all, and as long again the rebuild after a restart: an answer
    # that trickles one frame per replay_timeout_s must not hold the live stream for hours.
    max_replay_s: float = 30.0
    degraded_grace_s: float = 30.0
    # Bounds what a publisher can make kvrc hold: at most rcv_hwm frames queued per
    # connected publisher, each at most max_frame_bytes (a vLLM step is ~10-100 KiB;
    # a larger frame drops that connection). A replay reads at most max_replay_frames.
    # Within a frame, vllm_events bounds the events and block hashes.
    max_frame_bytes: int = 4 << 20
    max_replay_frames: int = 100_000
    rcv_hwm: int = 1000
    # Live frames parked behind a running replay: the same count as the socket queue,
    # and at most max_pending_bytes in all (a vLLM step's frame is ~10-100 KiB).
    max_pending_frames: int = 1000
    max_pending_bytes: int = 64 << 20
    # Replay what the publisher still buffers as soon as the stream starts. Batches sent
    # while kvrc was not subscribed (before the engine registered again after a session
    # blip, or across a kvrc restart) otherwise wait for a later batch to show the gap,
    # and an engine that goes idle sends none. Needs `replay_endpoint`.
    catch_up_on_start: bool = False

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise invalid("engine_id must not be empty")
        if not 0 <= self.dp_rank < self.dp_size:
            raise invalid(
                f"dp_rank {self.dp_rank} is outside 0..dp_size-1 (dp_size {self.dp_size})"
            )
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not _TCP_ENDPOINT.fullmatch(value):
                raise invalid(f"{name} must be tcp://host:port, got {value!r}")
        if self.block_size is not None and self.block_size <= 0:
            raise invalid(f"block_size must be positive, got {self.block_size}")
        if not self.replay_timeout_s > 0 or not self.degraded_grace_s >= 0:
            raise invalid("replay_timeout_s must be > 0 and degraded_grace_s >= 0")
        if not self.max_replay_s > 0:
            raise invalid(f"max_replay_s must be > 0, got {self.max_replay_s}")
        bounds = (self.max_frame_bytes, self.max_replay_frames, self.rcv_hwm)
        if min(*bounds, self.max_pending_frames, self.max_pending_bytes) <= 0:
            raise invalid(
                "max_frame_bytes, max_replay_frames, rcv_hwm, max_pending_frames and "
                "max_pending_bytes must be positive"
            )
        if self.max_pending_bytes < self.max_frame_bytes:
            raise invalid(
                f"max_pending_bytes ({self.max_pending_bytes}) must be at least "
                f"max_frame_bytes ({self.max_frame_bytes}): a frame must fit behind a replay"
            )

    @property
    def child_engine_id(self) -> str:
        return child_engine_id(self.engine_id, self.dp_rank, self.dp_size)


def publisher_host(session_name: str) -> str:
    """The host a vLLM engine publishes on: vLLM binds `tcp://*:PORT` on its own
    host, which is the host of its transfer endpoint's session name."""
    return session_name.rpartition(":")[0] or "127.0.0.1"


def endpoint_host(endpoint: str) -> str:
    """The host of a `tcp://host:port` endpoint (already checked by `subscriber_endpoint`)."""
    return endpoint[len("tcp://") :].rpartition(":")[0]


def subscriber_endpoint(
    vllm_endpoint: str, publisher_host: str, dp_rank: int = 0
) -> tuple[str, bool]:
    """kvrc's side of a vLLM `kv_events_config.endpoint`: `(endpoint, bind)`.

    vLLM binds an endpoint with `*` (kvrc connects to `publisher_host`) and
    connects to one without (kvrc binds it); DP rank N adds N to the port.
    """
    binds = "*" in vllm_endpoint or "::" in vllm_endpoint
    match = _TCP_ENDPOINT.fullmatch(vllm_endpoint)
    if match is None:
        raise invalid(f"KV-event endpoint must be tcp://host:port, got {vllm_endpoint!r}")
    host, port = match.group(1), int(match.group(2))
    if not (port > 0 and port + dp_rank < 65536):
        raise invalid(
            f"KV-event endpoint {vllm_endpoint!r} needs a fixed port (1..65535) for dp_rank "
            f"{dp_rank}: kvrc cannot learn a port the publisher picked itself"
        )
    if binds:
        return f"tcp://{publisher_host}:{port + dp_rank}", False
    return f"tcp://{host}:{port + dp_rank}", True


def stream_config_from_vllm(
    *,
    engine_id: str,
    dp_rank: int,
    dp_size: int,
    kv_events_endpoint: str,
    kv_events_replay_endpoint: str,
    publisher_host: str,
    block_size: int | None,
    lora_name: str = "",
    topic: str = "",
) -> ZmqStreamConfig:
    """The stream of one DP rank whose engine registered vLLM's `kv_events_config`
    values unchanged (`endpoint`, `replay_endpoint`, as configured for rank 0).

    `publisher_host` is the engine's address, used where vLLM binds `*`. vLLM
    always binds its replay ROUTER, so kvrc connects to it ("" = no replay).
    """
    endpoint, bind = subscriber_endpoint(kv_events_endpoint, publisher_host, dp_rank)
    replay = None
    if kv_events_replay_endpoint:
        replay, _ = subscriber_endpoint(kv_events_replay_endpoint, publisher_host, dp_rank)
    return ZmqStreamConfig(
        engine_id=engine_id,
        endpoint=endpoint,
        bind=bind,
        publisher_host=publisher_host if bind else "",
        replay_endpoint=replay,
        dp_rank=dp_rank,
        dp_size=dp_size,
        topic=topic,
        block_size=block_size,
        lora_name=lora_name,
        catch_up_on_start=replay is not None,
    )


@dataclass(frozen=True, slots=True)
class ZmqStreamStatus:
    child_engine_id: str
    state: StreamState
    reason: str  # why degraded or stale; "" when live
    incarnation: int
    last_sequence: int | None  # last applied publisher sequence
    applied_batches: int
    malformed_frames: int
    duplicate_frames: int
    replays: int
    degraded_until_s: float | None  # monotonic time the degraded hints are dropped at
    received_frames: int  # read off the SUB socket, whatever became of them
    pending_frames: int  # parked behind a running replay
    pending_bytes: int  # their bytes
    overflowed_frames: int  # dropped: the parking buffer was full


class _ReplayResult(enum.Enum):
    COMPLETE = "complete"
    OVERRUN = "overrun"
    TIMEOUT = "timeout"
    HOLE = "hole"  # the answer skipped a sequence (vLLM's ROUTER drops past its queue)


# Applied batches whose hashes are kept (`ZmqEventStream._recent`): what one dropped
# connection's queue can still hold (the SUB's receive high-water mark).
_RECENT_DIGESTS = 1_024

# Replays asked again from the first missing sequence after a hole in the answer: vLLM
# sends its whole buffer at once and its ROUTER drops what passes its send queue (1,000
# frames by default), so a large buffer comes back in pieces.
REPLAY_HOLE_RETRIES = 8


class ZmqEventStream:
    """Subscribe to one vLLM publisher and feed its batches, in order, to a sink."""

    def __init__(
        self,
        config: ZmqStreamConfig,
        sink: EventSink,
        metrics: Metrics,
        *,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.child_engine_id = config.child_engine_id
        self._sink = sink
        self._metrics = metrics
        self._clock = clock
        # Per stream, one line per kind of loss (refused batch, loss while degraded,
        # restart) per 10 s: a publisher sending garbage in a loop must not fill the log.
        self._losses = RateLimitedLog(log, lambda: int(clock() * 1000))
        self._own_context = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        # The replay in flight and the live frames that wait for it, in arrival order.
        self._catch_up: asyncio.Task[None] | None = None
        self._pending: collections.deque[list[bytes]] = collections.deque()
        self._pending_bytes = 0
        self.bound_endpoint: str | None = None  # the real address when kvrc binds
        self._zap_domain: str | None = None  # this stream's, in its context's ZapGate
        self._refused_publishers = 0
        self._closed = False
        self._monitor: zmq.asyncio.Socket | None = None
        self._reconnected = False  # a publisher connection dropped since the last frame
        self._last_digest: int | None = None  # hash of the last applied batch's bytes
        # The recent applied batches' hashes by sequence: a frame at or below the highest
        # sequence seen is a late copy of one of them (the queue of a connection that
        # dropped, drained after the new one's frames), not a restart, when its bytes match.
        self._recent: collections.OrderedDict[int, int] = collections.OrderedDict()

        self._state = StreamState.LIVE
        self._reason = ""
        self._incarnation = 0
        self._applied: int | None = None  # last applied publisher sequence
        self._live_high: int | None = None  # last sequence seen on the SUB socket
        self._has_state = False  # this incarnation handed the sink something
        self._degraded_deadline: float | None = None
        # Ends the grace on the event loop: a replay task can degrade the stream too.
        self._grace_timer: asyncio.TimerHandle | None = None
        self._applied_batches = 0
        self._malformed = 0
        self._duplicates = 0
        self._replays = 0
        self._received = 0
        self._overflowed = 0

        m = metrics
        self._m_stored = m.block_events.labels(source=SOURCE, type="stored")
        self._m_removed = m.block_events.labels(source=SOURCE, type="removed")
        self._m_cleared = m.block_events.labels(source=SOURCE, type="cleared")
        self._m_out_of_scope = m.block_events.labels(source=SOURCE, type="out_of_scope")
        self._m_applied = m.event_batches.labels(source=SOURCE, result="applied")
        self._m_duplicate = m.event_batches.labels(source=SOURCE, result="duplicate")
        self._m_gap = m.event_batches.labels(source=SOURCE, result="gap")
        self._m_refused = m.event_batches.labels(source=SOURCE, result="refused")
        self._m_malformed = m.event_batches.labels(source=SOURCE, result="malformed")
        self._m_overflow = m.event_batches.labels(source=SOURCE, result="overflow")
        m.zmq_streams.labels(state=StreamState.LIVE.value).inc()

    # --- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        if self._closed:
            return  # closed before it started (retired while the one before it closed)
        cfg = self.config
        try:
            sub = self._sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.MAXMSGSIZE, cfg.max_frame_bytes)
            sub.setsockopt(zmq.RCVHWM, cfg.rcv_hwm)
            sub.setsockopt(zmq.SUBSCRIBE, cfg.topic.encode())
            self._monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        except zmq.ZMQError as exc:  # out of file descriptors, typically
            await self.close()
            raise KvrcError(
                ErrorCode.RESOURCE_EXHAUSTED, f"cannot open a socket for {cfg.endpoint}: {exc}"
            ) from None
        try:
            if cfg.bind:
                if cfg.publisher_host:
                    await self._admit_only(sub, cfg.publisher_host)
                    if self._closed:
                        return  # retired while resolving the host: close() has run
                await _bind(sub, cfg.endpoint)
                self.bound_endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                sub.connect(cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._dealer = self._new_dealer()
        except KvrcError:
            await self.close()
            raise
        except zmq.ZMQError as exc:
            await self.close()
            verb = "bind" if cfg.bind else "connect to"
            raise KvrcError(
                ErrorCode.FAILED_PRECONDITION, f"cannot {verb} {cfg.endpoint}: {exc}"
            ) from None
        if cfg.catch_up_on_start and self._dealer is not None:
            # Live frames park behind it, as behind any replay (_receive).
            self._catch_up = asyncio.create_task(
                self._run_catch_up(self._replay_at_start()),
                name=f"zmq-replay-{self.child_engine_id}",
            )
        self._task = asyncio.create_task(self._run(), name=f"zmq-ingest-{self.child_engine_id}")

    async def _admit_only(self, sub: zmq.asyncio.Socket, host: str) -> None:
        """Only `host` (and loopback) may connect to the socket kvrc binds (zmq_zap)."""
        try:
            addresses = await host_addresses(host)
        except OSError as exc:  # socket.gaierror
            raise KvrcError(
                ErrorCode.FAILED_PRECONDITION,
                f"cannot resolve the publisher's host {host!r} (its transfer endpoint's), "
                f"which alone may connect to {self.config.endpoint}: {exc}",
            ) from None
        if self._closed:
            return  # retired meanwhile: its socket is closed, nothing to admit to
        domain = new_domain()
        gate_for(self._ctx).allow(domain, addresses, self._publisher_refused)
        self._zap_domain = domain
        sub.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no answer from a gate: refused
        sub.zap_domain = domain.encode()

    def _publisher_refused(self, peer: str) -> None:
        self._refused_publishers += 1
        self._metrics.zmq_publishers_refused.inc()
        self._losses.warning(
            "publisher_refused",
            "%s: refused a KV-event publisher connecting from %s to %s: only the engine's "
            "host (%s) or loopback may (%d refused so far)",
            self.child_engine_id,
            peer,
            self.bound_endpoint or self.config.endpoint,
            self.config.publisher_host,
            self._refused_publishers,
        )

    async def _replay_at_start(self) -> None:
        """Everything the publisher buffers, from sequence 0: a suffix of its log, so the
        view it builds holds no block the engine no longer has (only misses). An answer
        cut short after some of it was applied may have lost a removal: degraded."""
        result = await self._replay(0, at_start=True)
        if result is None or result is _ReplayResult.COMPLETE:
            return  # (None only answers a verification, which this is not)
        why = (
            self._timed_out() if result is _ReplayResult.TIMEOUT else f"cut short ({result.value})"
        )
        self._events_lost(f"the replay at start was {why}; live batches only", self._has_state)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in (self._task, self._catch_up):
            if task is not None:
                task.cancel()
                # A task that died of an error must not keep its sockets open.
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._catch_up = None
        self._drop_parked()
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        if self._sub is not None and self._monitor is not None:
            self._sub.disable_monitor()
        for sock in (self._monitor, self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = self._monitor = None
        if self._zap_domain is not None:
            leave_gate(self._ctx, self._zap_domain)
            self._zap_domain = None
        self._metrics.zmq_streams.labels(state=self._state.value).dec()
        if self._own_context:
            await close_gate(self._ctx)  # its socket, before term
            self._ctx.term()

    @property
    def closed(self) -> bool:
        return self._closed

    def status(self) -> ZmqStreamStatus:
        return ZmqStreamStatus(
            child_engine_id=self.child_engine_id,
            state=self._state,
            reason=self._reason,
            incarnation=self._incarnation,
            last_sequence=self._applied,
            applied_batches=self._applied_batches,
            malformed_frames=self._malformed,
            duplicate_frames=self._duplicates,
            replays=self._replays,
            degraded_until_s=self._degraded_deadline,
            received_frames=self._received,
            pending_frames=len(self._pending),
            pending_bytes=self._pending_bytes,
            overflowed_frames=self._overflowed,
        )

    # --- receive loop ------------------------------------------------------------

    async def _run(self) -> None:
        sub, monitor = self._sub, self._monitor
        assert sub is not None and monitor is not None
        poller = zmq.asyncio.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(sub, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            if monitor in ready:
                while True:
                    try:
                        await monitor.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                # A publisher connection dropped: the next frames may come from a
                # restarted publisher whose numbering has already passed ours.
                self._reconnected = self._applied is not None
            if sub in ready:
                # Drain a burst without going back to the loop for each frame.
                burst_bytes = 0
                for _ in range(_BURST):
                    try:
                        frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._receive(frames)
                    burst_bytes += _frames_bytes(frames)
                    if burst_bytes > _BURST_BYTES:
                        break

    def _receive(self, frames: list[bytes]) -> None:
        """One frame off the SUB socket: taken now, or parked behind a running replay."""
        self._received += 1
        if self._catch_up is None:
            self._take(frames)
            return
        size = _frames_bytes(frames)
        config = self.config
        if (
            len(self._pending) < config.max_pending_frames
            and self._pending_bytes + size <= config.max_pending_bytes
        ):
            self._park(frames, size)
            return
        # Lost as on the wire: the next frame taken shows the gap (module docstring).
        self._overflowed += 1
        self._m_overflow.inc()
        # One line per interval at most, however fast a publisher sends.
        self._losses.warning(
            "overflow",
            "zmq stream %s: %d live frame(s) dropped behind a slow replay "
            "(buffer of %d frames, %d bytes)",
            self.child_engine_id,
            self._overflowed,
            config.max_pending_frames,
            config.max_pending_bytes,
        )

    def _park(self, frames: list[bytes], size: int, *, first: bool = False) -> None:
        if first:
            self._pending.appendleft(frames)
        else:
            self._pending.append(frames)
        self._pending_bytes += size

    def _unpark(self) -> list[bytes]:
        frames = self._pending.popleft()
        self._pending_bytes -= _frames_bytes(frames)
        return frames

    def _drop_parked(self) -> None:
        self._pending.clear()
        self._pending_bytes = 0

    def _take(self, frames: list[bytes]) -> None:
        try:
            replay = self._on_live(frames)
        except Exception:  # never let one frame stop the stream
            log.exception("zmq stream %s: frame handling failed", self.child_engine_id)
            return
        if replay is not None:
            self._catch_up = asyncio.create_task(
                self._run_catch_up(replay), name=f"zmq-replay-{self.child_engine_id}"
            )

    async def _run_catch_up(self, replay: Coroutine[None, None, None] | None) -> None:
        """Runs replays, and the parked frames behind each, until none is parked."""
        try:
            while replay is not None:
                try:
                    await replay
                except Exception:
                    log.exception("zmq stream %s: replay failed", self.child_engine_id)
                replay = None
                # No await from here to the next replay: nothing is parked meanwhile.
                while replay is None and self._pending:
                    try:
                        replay = self._on_live(self._unpark())
                    except Exception:
                        log.exception("zmq stream %s: frame handling failed", self.child_engine_id)
        finally:
            self._catch_up = None

    def _on_live(self, frames: list[bytes]) -> Coroutine[None, None, None] | None:
        """Applies one live frame, or returns the replay that must run first."""
        if len(frames) != 3:
            self._count_malformed(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
            return None
        try:
            seq = decode_sequence(frames[1])
            # Before any sequence state moves: a frame that does not decode changes nothing.
            decoded = decode_payload(frames[0], seq, frames[2])
        except MalformedFrame as exc:
            self._count_malformed(str(exc))
            return None
        if self._live_high is not None and seq <= self._live_high:
            if self._recent.get(seq) == hash(frames[2]):
                self._duplicates += 1
                self._m_duplicate.inc()
                return None
            self._new_incarnation(
                f"publisher restarted (sequence {seq} after {self._live_high})", restart=True
            )
        elif self._reconnected:
            self._reconnected = False
            # Taken again, first in line, once the check has run (over the bounds at
            # most by this one frame, which was taken off the socket already).
            self._park(frames, _frames_bytes(frames), first=True)
            return self._check_same_publisher()
        self._reconnected = False
        self._live_high = seq
        applied = self._applied
        if applied is not None and seq <= applied:
            known = self._recent.get(seq)
            if applied - seq <= self.config.max_replay_frames and known in (None, hash(frames[2])):
                self._duplicates += 1
                self._m_duplicate.inc()
                return None
            # Not a copy of an applied batch: applied with other bytes at that sequence
            # (the last _RECENT_DIGESTS are known), or further behind than a replay reads.
            # What was applied came from another numbering, e.g. a replay endpoint that
            # is not this publisher's. Taken for duplicates, every later batch was dropped.
            self._new_incarnation(
                f"sequence {seq}, {applied - seq} behind the last one applied ({applied}), "
                "is not a copy of what was applied: those came from another numbering",
                restart=True,
            )
            self._live_high = seq
            applied = None
        expected = 0 if applied is None else applied + 1
        if seq != expected and self._state is not StreamState.STALE:
            self._m_gap.inc()
            if self._dealer is not None:
                return self._fill_gap(expected, seq, frames[2], decoded)
            self._events_lost(
                f"sequences {expected}..{seq - 1} missed, no replay endpoint", self._has_state
            )
        self._apply(seq, frames[2], decoded)
        return None

    async def _fill_gap(
        self, expected: int, seq: int, payload: bytes, decoded: DecodedBatch
    ) -> None:
        """Replays from `expected`, then applies live batch `seq` unless the replay did.

        The answer may come from a publisher that numbered from 0 again (a restart
        between the live batch and the replay), whose batches it applies: its batch at
        `seq` is not the live one, or it ends before `seq`, which the publisher sent
        before it was asked (vLLM buffers a batch as it sends it). An answer that ends
        before `seq` may also have lost its tail (vLLM's ROUTER drops past its send
        queue, however the end marker fared): a replay from `seq` with the live batch's
        bytes tells which. A restart is a new incarnation, its buffer read again whole
        (the parked frames cannot be told apart by incarnation).
        """
        had_state = self._has_state  # before the replay applies anything
        digest = hash(payload)
        # One deadline for the fill and its check (a rebuild after a restart has its own):
        # the live stream waits max_replay_s at most, or twice that after a restart.
        deadline = asyncio.get_running_loop().time() + self.config.max_replay_s
        result = await self._replay(expected, live=(seq, digest), deadline=deadline)
        if result is None:
            await self._restarted(f"its replay from {expected} has another batch {seq}")
            return
        before_seq = self._applied  # what the answer reached
        if result in (_ReplayResult.COMPLETE, _ReplayResult.OVERRUN) and (
            before_seq is None or before_seq < seq
        ):
            check = await self._replay(seq, verify_digest=digest, deadline=deadline)
            if check is None:
                await self._restarted(
                    f"its replay from {expected} ended before {seq}, a batch it had sent, "
                    "and it no longer has that batch"
                )
                return
            if result is _ReplayResult.COMPLETE:
                result = check  # the same publisher: the answer lost its tail
        # What was lost came before the replayed batches (an overrun), so only what was
        # held before can be a phantom; or after some of them: then anything held.
        lost, phantoms = "", self._has_state
        if result is _ReplayResult.OVERRUN:
            lost, phantoms = f"replay from {expected} overran vLLM's buffer", had_state
        elif result is _ReplayResult.TIMEOUT:
            lost = f"replay from {expected} {self._timed_out()}"
        elif result is _ReplayResult.HOLE:
            lost = f"replay from {expected} kept skipping sequences"
        elif before_seq is None or before_seq < seq - 1:
            lost = f"replay from {expected} ended before {seq}"
        if lost:
            self._events_lost(lost, phantoms)
        if self._applied is None or seq > self._applied:
            self._apply(seq, payload, decoded)

    async def _restarted(self, why: str) -> None:
        """The publisher numbered from 0 again, found by a replay: a new incarnation,
        its view read whole (a replay with a deadline of its own: a rebuild left the
        rest of the gap's could end partial, with lasting misses)."""
        self._new_incarnation(f"publisher restarted ({why})", restart=True)
        self._drop_parked()
        await self._replay_at_start()

    async def _check_same_publisher(self) -> None:
        """After a reconnection: is the publisher the one whose batches we applied?

        Replays from the last applied sequence and compares that batch's bytes:
        another publisher (a restart that already numbered past us) answers with
        other bytes, or nothing. Any later batches the replay brings are applied. A
        buffer that no longer holds that batch cannot tell: a new incarnation (the
        view is rebuilt from what the publisher replays), never phantoms.
        """
        if self._dealer is None or self._applied is None or self._last_digest is None:
            return  # cannot tell; the sequence rule still catches most restarts
        result = await self._replay(self._applied, verify_digest=self._last_digest)
        if result is None:
            self._new_incarnation(
                f"publisher reconnected without batch {self._applied} it had sent", restart=True
            )
        elif result is not _ReplayResult.COMPLETE:
            # Unverified, or what it sent while we were away is not all here.
            self._events_lost(f"replay after reconnecting: {result.value}", self._has_state)

    def _timed_out(self) -> str:
        cfg = self.config
        return (
            f"unanswered in time (no frame for {cfg.replay_timeout_s}s, "
            f"or not done in {cfg.max_replay_s}s)"
        )

    def _events_lost(self, why: str, had_state: bool) -> None:
        if had_state:
            self._degrade(why)
        else:
            # Nothing applied yet: no entry can be a phantom, only hits are missing.
            self._losses.info(
                "partial",
                "zmq stream %s: %s; starting with a partial view",
                self.child_engine_id,
                why,
            )

    async def _replay(
        self,
        start_seq: int,
        verify_digest: int | None = None,
        *,
        at_start: bool = False,
        live: tuple[int, int] | None = None,
        deadline: float | None = None,
    ) -> _ReplayResult | None:
        """Replay from `start_seq`; None when `verify_digest` shows another publisher, or
        the answer's batch at `live`'s sequence is not the live one (its hash).
        `at_start`: the stream's first look (`_replay_at_start`): a buffer that does not
        reach back to `start_seq` lost nothing this stream had, so it is complete. An
        answer with a hole is asked again from the hole (REPLAY_HOLE_RETRIES times), all
        within `max_replay_s` (or by `deadline`, loop time, shared with other replays)."""
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self.config.max_replay_s
        try:
            result, overran = await self._replay_once(
                start_seq, deadline, verify_digest, at_start=at_start, live=live
            )
            # Its first answer began past `start_seq`: lost before what it replayed.
            overran = overran and not at_start
            holed = result is _ReplayResult.HOLE
            for _ in range(REPLAY_HOLE_RETRIES):
                if result is not _ReplayResult.HOLE or self._applied is None:
                    break
                if asyncio.get_running_loop().time() >= deadline:
                    result = _ReplayResult.TIMEOUT  # not asked again past the deadline
                    break
                result, _ = await self._replay_once(self._applied + 1, deadline, live=live)
                holed = holed or result is _ReplayResult.HOLE
        except Exception:
            self._reset_dealer()  # the rest of the answer must not leak into the next one
            raise
        if result is _ReplayResult.COMPLETE and overran:
            return _ReplayResult.OVERRUN  # the hole was filled; what came before was not
        if result not in (_ReplayResult.COMPLETE, None) and holed:
            return _ReplayResult.HOLE  # lost after some of it was applied
        return result

    async def _replay_once(
        self,
        start_seq: int,
        deadline: float,
        verify_digest: int | None = None,
        *,
        at_start: bool = False,
        live: tuple[int, int] | None = None,
    ) -> tuple[_ReplayResult | None, bool]:
        """One replay request and its answer, by `deadline` (loop time): the result, and
        whether the answer began past `start_seq` (the buffer no longer held it)."""
        dealer = self._dealer
        assert dealer is not None
        loop = asyncio.get_running_loop()
        if loop.time() >= deadline:
            # Not asked: vLLM would stream its buffer to a dealer reset at once.
            self._metrics.zmq_replays.labels(result=_ReplayResult.TIMEOUT.value).inc()
            return _ReplayResult.TIMEOUT, False
        self._replays += 1
        await dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        first = True
        overran = False
        expect = start_seq  # the next sequence the answer must carry
        result = _ReplayResult.COMPLETE
        for _ in range(self.config.max_replay_frames + 1):
            left_s = deadline - loop.time()
            # The deadline, not the wait for a frame, bounds this wait: ends the replay.
            over = left_s <= self.config.replay_timeout_s
            wait_ms = math.ceil(min(self.config.replay_timeout_s, left_s) * 1000)
            if wait_ms <= 0 or not await dealer.poll(wait_ms):
                self._reset_dealer()  # late answers must not leak into the next replay
                # An answer that stopped midway lost its tail (vLLM's ROUTER drops past its
                # send queue, the end marker with it): a hole, asked again from there. Past
                # the deadline, nothing is asked again.
                cut = _ReplayResult.TIMEOUT if first or over else _ReplayResult.HOLE
                self._metrics.zmq_replays.labels(result=cut.value).inc()
                return cut, overran
            frames = await dealer.recv_multipart()
            # vLLM 0.33: [b"", topic, seq, payload], end [b"", b"", END, b""];
            # earlier: [b"", seq, payload], end [b"", END, b""].
            if len(frames) == 4:
                topic, seq_bytes, payload = frames[1], frames[2], frames[3]
            elif len(frames) == 3:
                topic, seq_bytes, payload = b"", frames[1], frames[2]
            else:
                self._count_malformed(f"replay answer has {len(frames)} frames")
                continue
            if seq_bytes == END_SEQ:
                break
            try:
                seq = decode_sequence(seq_bytes)
            except MalformedFrame as exc:
                self._count_malformed(f"replay: {exc}")
                continue
            if first:
                first = False
                if verify_digest is not None and (
                    seq != start_seq or hash(payload) != verify_digest
                ):
                    # Another publisher, or ours with the batch gone from its buffer:
                    # either way it cannot be verified, and applying the rest on top of
                    # what we hold could keep blocks it no longer has.
                    self._reset_dealer()  # the rest of this answer is not wanted
                    return None, overran
                if seq != start_seq:
                    result = _ReplayResult.OVERRUN
                    overran = True
            elif seq != expect:
                # Frames dropped on the way (or a malformed one): the rest is not applied
                # on top of the hole, and not left to leak into the next replay.
                self._reset_dealer()
                result = _ReplayResult.HOLE
                break
            expect = seq + 1
            if live is not None and seq == live[0] and hash(payload) != live[1]:
                # Not the batch it sent live at that sequence: it numbered from 0 again.
                self._reset_dealer()
                return None, overran
            if self._applied is not None and seq <= self._applied:
                continue
            self._consume(topic, seq, payload)
        else:
            self._reset_dealer()  # the rest of this answer is not wanted
            result = _ReplayResult.OVERRUN  # more than any vLLM buffer holds
        if first:
            if verify_digest is not None:
                return None, overran  # this publisher never got as far as we did
            result = _ReplayResult.OVERRUN  # nothing from start_seq on is buffered
        if at_start and result is _ReplayResult.OVERRUN:
            result = _ReplayResult.COMPLETE
        self._metrics.zmq_replays.labels(result=result.value).inc()
        return result, overran

    # --- applying ------------------------------------------------------------------

    def _consume(self, topic: bytes, seq: int, payload: bytes) -> None:
        """Decode and hand over replayed batch `seq`; it is consumed either way."""
        try:
            decoded = decode_payload(topic, seq, payload)
        except MalformedFrame as exc:
            self._consumed(seq, payload)
            self._count_malformed(f"sequence {seq}: {exc}")
            self._events_lost(
                f"malformed frame at sequence {seq}: its events are lost", self._has_state
            )
            return
        self._apply(seq, payload, decoded)

    def _consumed(self, seq: int, payload: bytes) -> None:
        self._applied = seq
        self._last_digest = hash(payload)
        self._recent[seq] = self._last_digest
        if len(self._recent) > _RECENT_DIGESTS:
            self._recent.popitem(last=False)

    def _apply(self, seq: int, payload: bytes, decoded: DecodedBatch) -> None:
        """Hand over the decoded batch with sequence `seq`; it is consumed either way."""
        self._consumed(seq, payload)
        if self._state is StreamState.STALE:
            self._m_refused.inc()
            return
        mismatch = self._rank_mismatch(decoded)
        if mismatch:
            self._m_refused.inc()
            self._set_state(StreamState.STALE, mismatch)
            self._losses.warning(
                "stale", "zmq stream %s is stale: %s", self.child_engine_id, mismatch
            )
            self._sink.mark_stale(self.child_engine_id, mismatch)
            return
        batch = EventBatch(
            incarnation=self._incarnation, sequence=seq, events=self._in_scope(decoded)
        )
        try:
            self._sink.apply(self.child_engine_id, batch)
        except KvrcError as exc:
            # The core refused the batch and changed nothing: its events are lost.
            self._m_refused.inc()
            self._losses.warning(
                "refused",
                "zmq stream %s: batch %d refused: %s",
                self.child_engine_id,
                seq,
                exc.message,
            )
            self._events_lost(f"batch {seq} refused: {exc.message}", self._has_state)
            return
        self._has_state = True
        self._applied_batches += 1
        self._m_applied.inc()
        stored = sum(len(e.block_hashes) for e in batch.events if type(e) is BlockStored)
        if stored:
            self._m_stored.inc(stored)
        if decoded.removed_blocks:
            self._m_removed.inc(decoded.removed_blocks)
        if decoded.cleared:
            self._m_cleared.inc(decoded.cleared)
            if self._state is StreamState.DEGRADED:
                # Everything before the clear is gone, so no phantom is left.
                self._set_live("the publisher cleared all blocks")

    def _rank_mismatch(self, decoded: DecodedBatch) -> str:
        cfg = self.config
        if decoded.dp_rank is not None and decoded.dp_rank != cfg.dp_rank:
            return (
                f"batch {decoded.sequence} says data_parallel_rank {decoded.dp_rank}, "
                f"this stream is rank {cfg.dp_rank}"
            )
        return ""

    def _in_scope(self, decoded: DecodedBatch) -> tuple[InventoryEvent, ...]:
        """The batch's events without the stores outside the registered profile: another
        LoRA adapter's blocks (vLLM names the request's adapter; one engine serves many)
        or a partial block (`block_size` short of the engine's). They are skipped alone,
        counted; removals of blocks never stored change nothing."""
        cfg = self.config
        skipped = {
            index
            for index, block_size, lora_name in decoded.stored_scopes
            if lora_name != cfg.lora_name
            or (cfg.block_size is not None and block_size != cfg.block_size)
        }
        if not skipped:
            return decoded.events
        events = decoded.events
        blocks = 0
        for index in skipped:
            stored = events[index]
            assert isinstance(stored, BlockStored)
            blocks += len(stored.block_hashes)
        self._m_out_of_scope.inc(blocks)
        self._losses.info(
            "out of scope",
            "zmq stream %s: %d stored block(s) of another LoRA adapter or block size "
            "skipped (the registered profile: lora %r, block_size %s)",
            self.child_engine_id,
            blocks,
            f"{cfg.lora_name:.60}",
            cfg.block_size,
        )
        return tuple(e for i, e in enumerate(events) if i not in skipped)

    # --- state changes -----------------------------------------------------------------

    def _new_incarnation(self, why: str, *, restart: bool) -> None:
        self._losses.warning(
            "incarnation", "zmq stream %s: %s; new incarnation", self.child_engine_id, why
        )
        if restart:
            self._metrics.zmq_publisher_restarts.inc()
        self._sink.drop_engine_inventory(self.child_engine_id)
        self._incarnation += 1
        self._applied = None
        self._live_high = None
        self._recent.clear()
        self._has_state = False
        if self._state is not StreamState.LIVE:
            self._set_live(why)

    def _degrade(self, why: str) -> None:
        grace = self.config.degraded_grace_s
        if self._state is StreamState.STALE:
            return
        if self._state is StreamState.DEGRADED:
            # Further losses do not extend the grace: the bound on a hint's age holds.
            self._losses.warning(
                "degraded-again", "zmq stream %s: %s (already degraded)", self.child_engine_id, why
            )
            return
        self._losses.warning(
            "degraded",
            "zmq stream %s degraded: %s; its entries stay hints for at most %.1fs",
            self.child_engine_id,
            why,
            grace,
        )
        self._set_state(StreamState.DEGRADED, why)
        self._degraded_deadline = self._clock() + grace
        self._sink.mark_degraded(self.child_engine_id, why)
        if grace <= 0:
            self._end_degraded_grace()
        else:
            self._arm_grace_timer()

    def _arm_grace_timer(self) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        assert self._degraded_deadline is not None
        delay = max(0.0, self._degraded_deadline - self._clock())
        self._grace_timer = asyncio.get_running_loop().call_later(delay, self._on_grace_timer)

    def _on_grace_timer(self) -> None:
        self._grace_timer = None
        if self._closed or self._degraded_deadline is None:
            return
        if self._clock() < self._degraded_deadline:
            self._arm_grace_timer()  # the injected clock runs behind the loop's
            return
        try:
            self._end_degraded_grace()
        except Exception:
            log.exception("zmq stream %s: ending the degraded grace failed", self.child_engine_id)

    def _end_degraded_grace(self) -> None:
        """Drop the hints that may be phantoms; what follows is exact."""
        keep_applied = self._applied
        keep_live_high = self._live_high
        keep_recent = self._recent.copy()
        self._new_incarnation("degraded grace ended, inventory dropped", restart=False)
        # Same publisher: keep its numbering, only the inventory starts over.
        self._applied = keep_applied
        self._live_high = keep_live_high
        self._recent = keep_recent

    def _set_live(self, why: str) -> None:
        self._losses.info("live", "zmq stream %s live again: %s", self.child_engine_id, why)
        self._set_state(StreamState.LIVE, "")
        self._sink.mark_live(self.child_engine_id)

    def _set_state(self, state: StreamState, reason: str) -> None:
        if state is not self._state:
            self._metrics.zmq_streams.labels(state=self._state.value).dec()
            self._metrics.zmq_streams.labels(state=state.value).inc()
        self._state = state
        self._reason = reason
        if state is not StreamState.DEGRADED:
            self._degraded_deadline = None
            if self._grace_timer is not None:
                self._grace_timer.cancel()
                self._grace_timer = None

    def _count_malformed(self, why: str) -> None:
        self._malformed += 1
        self._m_malformed.inc()
        # One line per interval at most, so a bad publisher cannot flood the log.
        self._losses.warning(
            "malformed",
            "zmq stream %s: malformed frame skipped (%d so far): %s",
            self.child_engine_id,
            self._malformed,
            why,
        )

    def _reset_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
        self._dealer = self._new_dealer()

    def _new_dealer(self) -> zmq.asyncio.Socket:
        assert self.config.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.config.max_frame_bytes)
        dealer.connect(self.config.replay_endpoint)
        return dealer


# A subscription just closed on the same endpoint frees its port in libzmq's I/O thread,
# shortly after close() returned: the bind is tried again this often, this far apart.
_BIND_ATTEMPTS = 100
_BIND_RETRY_S = 0.01


async def _bind(sub: zmq.asyncio.Socket, endpoint: str) -> None:
    for attempt in range(_BIND_ATTEMPTS):
        try:
            sub.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or attempt == _BIND_ATTEMPTS - 1:
                raise
        await asyncio.sleep(_BIND_RETRY_S)


class VllmEventStreams:
    """The runtime's `EventStreamFactory` for vLLM's ZMQ publisher (one per child engine).

    Every stream shares one ZMQ context (its own cost a stream two threads and several
    file descriptors), and at most `max_streams` are open at once: past it a
    registration stands without one (RESOURCE_EXHAUSTED, logged by the caller)."""

    def __init__(self, metrics: Metrics, *, max_streams: int = 1024) -> None:
        self._metrics = metrics
        self._max_streams = max_streams
        self._context = zmq.asyncio.Context()
        self._streams: list[ZmqEventStream] = []

    def __call__(self, registration: RankPartRegistration, sink: EventSink) -> ZmqEventStream:
        self._streams = [s for s in self._streams if not s.closed]  # at most max_streams
        if len(self._streams) >= self._max_streams:
            raise KvrcError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"{len(self._streams)} KV-event subscriptions are open "
                "(--max-kv-event-streams): this engine's events are not ingested",
            )
        p = registration.profile
        stream = ZmqEventStream(
            stream_config_from_vllm(
                engine_id=registration.engine_id,
                dp_rank=registration.dp_rank,
                dp_size=p.dp_size,
                kv_events_endpoint=registration.kv_events_endpoint,
                kv_events_replay_endpoint=registration.kv_events_replay_endpoint,
                publisher_host=publisher_host(registration.endpoint.session_name),
                block_size=p.block_size,
                lora_name=p.lora_name,
            ),
            sink,
            self._metrics,
            context=self._context,
        )
        self._streams.append(stream)
        return stream

    async def close(self) -> None:
        """After the streams closed (the coordinator's shutdown): frees the context."""
        await close_gate(self._context)
        self._context.destroy(linger=0)
