"""`EngineSession`: one engine rank part's session with the coordinator.

    registration = RankPartRegistration(
        engine_id="prefill-0", tp_rank=rank, tp_size=2,
        profile=EngineProfile(model="meta-llama/Llama-3.1-8B", block_size=16),
        endpoint=TransferEndpoint(backend="mooncake", session_name="10.0.0.5:15002"),
    )
    session = EngineSession("127.0.0.1:50051", registration, handler=MyHandler())
    ack = await session.start()          # raises AlreadyExistsError, ... when refused
    await session.wait_ready(timeout_s=30)
    ...
    await session.close()

`start()` registers and returns the `RegisterAck`; the session then sends
heartbeats at the interval the coordinator asked for. When the stream breaks
(coordinator restart, heartbeat timeout) it reconnects with exponential
backoff and jitter and registers again. A coordinator that goes silent (frozen,
partitioned: nothing heard for the RegisterAck's heartbeat timeout) or a write
that does not complete within the write timeout breaks the stream the same way.
Given several targets (kvrc replicas sharing one `--store`: a list, or
"a:50051,b:50051"), `start()` tries each in turn; a broken session reconnects to the
same replica first and moves to the next one, round robin, only when that replica
cannot be reached (UNAVAILABLE, no RegisterAck in time), so that the rank parts of
one child engine, given the same list, stay on one replica. Every registration
re-announces in full (held leases; `InventoryPublisher` then sends its dump), so the
replica it lands on learns the engine's state. `SessionChannels(session)` gives
lease and lookup clients channels that follow the session to its replica. (A DNS
name with several addresses, "dns:///kvrc.internal:50051", is one target: grpc's
pick_first chooses for each channel on its own, so a list is the form whose channels
agree.)
Coordinator requests (pin, release, abort, resync, quarantine, drain) and
readiness changes go to the handler. `call(...)` makes a request on the stream
itself (revision 3: a prefix load and its report, `LeaseClient(..., session=...)`),
which costs the coordinator fewer messages than the unary RPCs.
Engines never touch protobuf for registration; later flows pass protobuf
messages through for now.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from grpc.aio import EOF  # type: ignore[attr-defined]  # missing from grpc-stubs

from clients.errors import (
    CallInterruptedError,
    DeadlineExceededError,
    KvrcClientError,
    UnavailableError,
    error_from_number,
    error_from_status,
    from_rpc_error,
    from_session_error,
)
from kvrc.credentials import (
    SESSION_KEEPALIVE,
    ChannelOptions,
    CredentialsError,
    connect,
    reconnect_backoff_options,
    split_targets,
)
from kvrc.ids import child_engine_id
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc
from kvrc.vocabulary import PROTOCOL_VERSION, PublishMode, TransferEndpoint

log = logging.getLogger("kvrc.client")


# --- what an engine declares ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """The deployment profile (parallel sizes live on `RankPartRegistration`)."""

    model: str
    block_size: int
    model_revision: str = ""
    kv_dtype: str = ""
    num_layers: int = 0
    num_kv_heads: int = 0
    head_size: int = 0
    attention_backend: str = ""
    kv_layout: str = ""
    transfer_backends: tuple[str, ...] = ("mooncake",)
    gpu_kind: str = ""
    reuse_opt_in: bool = False
    lora_name: str = ""
    native_compatibility_hash: bytes = b""
    extra: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class RankPartRegistration:
    engine_id: str
    profile: EngineProfile
    endpoint: TransferEndpoint = field(default_factory=TransferEndpoint)
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    pcp_rank: int = 0
    pcp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    dcp_size: int = 1
    publish_mode: PublishMode = PublishMode.PER_CHILD_ENGINE
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    # Empty: derived the vLLM way (`<engine_id>_dp<dp_rank>`, or engine_id).
    child_engine_id: str = ""

    @property
    def resolved_child_engine_id(self) -> str:
        return self.child_engine_id or child_engine_id(self.engine_id, self.dp_rank, self.dp_size)

    def to_proto(self, held_leases: Mapping[str, str] | None = None) -> pb.Register:
        """`held_leases`: lease id -> its requester ("" = unknown), for restart recovery."""
        p = self.profile
        return pb.Register(
            engine_id=self.engine_id,
            dp_rank=self.dp_rank,
            child_engine_id=self.resolved_child_engine_id,
            rank=pb.RankCoordinates(
                tp_rank=self.tp_rank, pp_rank=self.pp_rank, pcp_rank=self.pcp_rank
            ),
            profile=pb.DeploymentProfile(
                model=p.model,
                model_revision=p.model_revision,
                kv_dtype=p.kv_dtype,
                block_size=p.block_size,
                num_layers=p.num_layers,
                num_kv_heads=p.num_kv_heads,
                head_size=p.head_size,
                attention_backend=p.attention_backend,
                kv_layout=p.kv_layout,
                parallel=pb.ParallelSizes(
                    tp_size=self.tp_size,
                    pp_size=self.pp_size,
                    pcp_size=self.pcp_size,
                    dp_size=self.dp_size,
                    dcp_size=self.dcp_size,
                ),
                transfer_backends=list(p.transfer_backends),
                gpu_kind=p.gpu_kind,
                reuse_opt_in=p.reuse_opt_in,
                lora_name=p.lora_name,
                native_compatibility_hash=p.native_compatibility_hash,
                extra=dict(p.extra),
            ),
            endpoint=self.endpoint.to_proto(),
            publish_mode=pb.PublishMode.ValueType(self.publish_mode),
            kv_events_endpoint=self.kv_events_endpoint,
            kv_events_replay_endpoint=self.kv_events_replay_endpoint,
            held_leases=[
                pb.HeldLease(lease_id=lease_id, requester_child_engine_id=requester)
                for lease_id, requester in (held_leases or {}).items()
            ],
            # Also as bare ids: a coordinator that predates held_leases ignores that field,
            # and would rebuild nothing (the holder's safety net would then free pins a
            # requester may still read).
            held_lease_ids=list(held_leases or ()),
            protocol_version=PROTOCOL_VERSION,
        )


# --- what the coordinator answers -------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReuseInfo:
    enabled: bool
    reason: str  # e.g. "DISABLED_BY_COORDINATOR"
    detail: str

    @classmethod
    def from_proto(cls, msg: pb.ReuseStatus) -> ReuseInfo:
        known = msg.reason in pb.ReuseReason.values()
        name = pb.ReuseReason.Name(msg.reason) if known else "UNKNOWN"
        return cls(msg.enabled, name.removeprefix("REUSE_REASON_"), msg.detail)


@dataclass(frozen=True, slots=True)
class ChildEngineState:
    child_engine_id: str
    engine_id: str
    ready: bool
    parts_present: int
    parts_expected: int
    not_ready_reason: str
    stale: bool
    draining: bool
    compatibility_hash: str
    reuse: ReuseInfo

    @classmethod
    def from_proto(cls, msg: pb.ChildEngineState) -> ChildEngineState:
        return cls(
            child_engine_id=msg.child_engine_id,
            engine_id=msg.engine_id,
            ready=msg.ready,
            parts_present=msg.parts_present,
            parts_expected=msg.parts_expected,
            not_ready_reason=msg.not_ready_reason,
            stale=msg.stale,
            draining=msg.draining,
            compatibility_hash=msg.compatibility_hash,
            reuse=ReuseInfo.from_proto(msg.reuse),
        )


@dataclass(frozen=True, slots=True)
class RegisterAck:
    session_id: str
    incarnation: int
    compatibility_hash: str
    heartbeat_interval_ms: int
    heartbeat_timeout_ms: int
    reuse: ReuseInfo
    state: ChildEngineState

    @classmethod
    def from_proto(cls, msg: pb.RegisterAck) -> RegisterAck:
        return cls(
            session_id=msg.session_id,
            incarnation=msg.incarnation,
            compatibility_hash=msg.compatibility_hash,
            heartbeat_interval_ms=msg.heartbeat_interval_ms,
            heartbeat_timeout_ms=msg.heartbeat_timeout_ms,
            reuse=ReuseInfo.from_proto(msg.reuse),
            state=ChildEngineState.from_proto(msg.state),
        )


class SessionHandler(Protocol):
    """Receives what the coordinator sends. Subclass it: every method defaults to a no-op.

    Methods run one at a time on the session's reader; keep them short (hand
    long work to a task).
    """

    async def on_registered(self, ack: RegisterAck) -> None:
        """After every (re-)registration."""
        return None

    async def on_state(self, state: ChildEngineState) -> None:
        """The child engine's readiness changed."""
        return None

    async def on_pin_request(self, request: pb.PinRequest) -> None:
        return None

    async def on_release_request(self, request: pb.ReleaseRequest) -> None:
        """Free the lease's pins, then acknowledge (`EngineSession.send_release_acks`,
        required since revision 4; `LeaseSessionHandler` does both). Unacknowledged, the
        release comes again on the next session, then is given up."""
        return None

    async def on_abort_request(self, request: pb.AbortRequest) -> None:
        return None

    async def on_resync_request(self, request: pb.ResyncRequest) -> None:
        return None

    async def on_quarantine_notice(self, notice: pb.QuarantineNotice) -> None:
        return None

    async def on_drain_notice(self, notice: pb.DrainNotice) -> None:
        return None

    def held_leases(self) -> Mapping[str, str]:
        """Leases this rank part still holds pins for, each with its requester ("" =
        unknown), re-announced on every registration so that a restarted coordinator
        rebuilds them (restart recovery)."""
        return {}


class NullHandler(SessionHandler):
    pass


_Call = grpc.aio.StreamStreamCall[pb.EngineMessage, pb.CoordinatorMessage]

Target = str | ChannelOptions
# Worth trying the next replica; a refusal (AlreadyExists, ...) is the same on every one.
_MOVE_ON = (UnavailableError, DeadlineExceededError)
# Coordinator messages read ahead of the session's handler; a full inbox holds the reader,
# so grpc's flow control, and then the coordinator's bounded queue, see a part that lags
# (small: a handler that stops must not let the coordinator send on unchecked).
INBOX_SIZE = 32
# Write timeout when the RegisterAck names no heartbeat timeout.
DEFAULT_WRITE_TIMEOUT_S = 10.0


class EngineSession:
    def __init__(
        self,
        target: Target | Sequence[Target],
        registration: RankPartRegistration,
        handler: SessionHandler | None = None,
        *,
        reconnect: bool = True,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 2.0,
        register_timeout_s: float = 10.0,
        silence_timeout_s: float | None = None,
        write_timeout_s: float | None = None,
    ) -> None:
        """`silence_timeout_s`: nothing heard from the coordinator for this long breaks the
        stream; `write_timeout_s`: a write (flow control full against a frozen coordinator)
        that takes longer breaks it. Both default to the RegisterAck's heartbeat timeout:
        by then the coordinator has dropped this part anyway."""
        # A bare "host:port" is plaintext; ChannelOptions add TLS and a token.
        self._plain = isinstance(target, str) or (
            not isinstance(target, ChannelOptions) and all(isinstance(t, str) for t in target)
        )
        self.targets: tuple[ChannelOptions, ...] = split_targets(target)
        self._index = 0  # the target in use
        self.registration = registration
        self.handler: SessionHandler = handler if handler is not None else NullHandler()
        self._reconnect = reconnect
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._register_timeout_s = register_timeout_s
        self._silence_timeout_s = silence_timeout_s
        self._write_timeout_s = write_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._call: _Call | None = None
        self._broken: _Call | None = None  # the call `_break` ended (said once)
        self._write_lock = asyncio.Lock()
        self._runner: asyncio.Task[None] | None = None
        self._closing = False
        self._ready = asyncio.Event()
        self.ack: RegisterAck | None = None
        self.state: ChildEngineState | None = None
        self.last_error: KvrcClientError | None = None
        self.registrations = 0  # 1 after start(), +1 per successful reconnect
        self.last_heartbeat_ack_ms = 0
        # Calls made on the stream (`call`), by call id, until answered.
        self._calls: dict[int, asyncio.Future[pb.CallAnswer]] = {}
        self._call_ids = itertools.count(1)

    @property
    def target(self) -> str:
        """The target in use ("host:port")."""
        return self.targets[self._index].target

    @property
    def channel_options(self) -> ChannelOptions | None:
        """The target in use as given: None for a bare "host:port"."""
        return None if self._plain else self.targets[self._index]

    @property
    def target_index(self) -> int:
        """Which of `targets` is in use (`SessionChannels` follows it)."""
        return self._index

    @property
    def connected(self) -> bool:
        return self._call is not None and not self._call.done()

    @property
    def silence_timeout_s(self) -> float | None:
        """Silence from the coordinator that breaks the stream (None: no limit)."""
        if self._silence_timeout_s is not None:
            return self._silence_timeout_s
        if self.ack is not None and self.ack.heartbeat_timeout_ms > 0:
            return self.ack.heartbeat_timeout_ms / 1000
        return None

    @property
    def write_timeout_s(self) -> float:
        """How long one write (with its wait for the write lock) may take."""
        if self._write_timeout_s is not None:
            return self._write_timeout_s
        if self.ack is not None and self.ack.heartbeat_timeout_ms > 0:
            return self.ack.heartbeat_timeout_ms / 1000
        return DEFAULT_WRITE_TIMEOUT_S

    # --- lifecycle ---------------------------------------------------------------

    async def start(self) -> RegisterAck:
        """Registers; raises the typed KvrcClientError when the coordinator refuses."""
        if self._runner is not None:
            raise RuntimeError("EngineSession.start() called twice")
        for tried in range(len(self.targets)):
            if tried:
                self._next_target()
            self._channel = self._new_channel()
            try:
                ack = await self._connect()
                break
            except _MOVE_ON as e:
                await self._drop_channel()
                if tried == len(self.targets) - 1:
                    raise
                self.last_error = e
                log.info("registering with %s failed (%s)", self.target, e.code.name)
            except BaseException:
                await self._drop_channel()
                raise
        self._runner = asyncio.create_task(self._run(), name="kvrc-session")
        return ack

    async def close(self, timeout_s: float = 5.0) -> None:
        """Ends the session cleanly: the coordinator removes this rank part at once.

        Within about `timeout_s`: a write stuck against a frozen coordinator is not
        waited for (the call is cancelled; the part then leaves at its heartbeat timeout)."""
        self._closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        call = self._call
        if call is not None and not call.done():
            try:
                async with asyncio.timeout_at(deadline):
                    async with self._write_lock:
                        await call.done_writing()
            except TimeoutError:
                call.cancel()
            except asyncio.CancelledError:
                if not _cancelled_locally():
                    raise
            except Exception:  # the stream broke meanwhile: nothing to end
                pass
        if self._runner is not None:
            try:
                await asyncio.wait_for(
                    asyncio.shield(self._runner), max(deadline - loop.time(), 0.0)
                )
            except TimeoutError:
                self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
        if self._call is not None:
            self._call.cancel()
        self._fail_calls("the session closed")
        if self._channel is not None:
            await self._channel.close(None)

    async def _drop_channel(self) -> None:
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None

    def _next_target(self) -> None:
        self._index = (self._index + 1) % len(self.targets)
        log.warning(
            "%s: moving to kvrc target %s (%d of %d)",
            self.registration.resolved_child_engine_id,
            self.target,
            self._index + 1,
            len(self.targets),
        )

    async def _move_on(self) -> None:
        """Next target, on a fresh channel (the old one may keep trying a dead replica);
        `_connect` makes the channel."""
        if len(self.targets) < 2:
            return  # one target: its channel reconnects by itself
        if self._call is not None:
            self._call.cancel()
            self._call = None
        await self._drop_channel()
        self._next_target()

    def _new_channel(self) -> grpc.aio.Channel:
        # Keepalive pings find a dead connection with no write waiting; the channel's own
        # reconnect backoff stays within the session's, so that a kvrc that is back is
        # reached within about backoff_max_s (grpc's default grows to 120 s).
        backoff = reconnect_backoff_options(round(self._backoff_max_s * 1000))
        return connect(self.targets[self._index], (*SESSION_KEEPALIVE, *backoff))

    async def wait_ready(self, timeout_s: float | None = None) -> ChildEngineState:
        """Waits until the child engine is READY (all rank parts registered)."""
        await asyncio.wait_for(self._ready.wait(), timeout_s)
        assert self.state is not None
        return self.state

    # --- outbound (later flows) ------------------------------------------------------

    async def send_event_batch(self, batch: pb.EventBatch) -> None:
        await self._send(pb.EngineMessage(events=batch))

    async def send_pin_result(self, result: pb.PinResult) -> None:
        await self._send(pb.EngineMessage(pin_result=result))

    async def send_abort_ack(self, lease_id: str) -> None:
        await self._send(pb.EngineMessage(abort_ack=pb.AbortAck(lease_id=lease_id)))

    async def send_release_acks(self, lease_ids: Sequence[str]) -> None:
        """One ReleaseAck for these leases, whose pins this part freed (revision 4)."""
        await self._send(pb.EngineMessage(release_ack=pb.ReleaseAck(lease_ids=lease_ids)))

    async def call(self, call: pb.SessionCall, timeout_s: float) -> pb.CallAnswer:
        """Makes `call` on the session stream and returns its answer (`code` 0).

        Raises the typed KvrcClientError of a refused call; UnavailableError when the
        session is not connected; CallInterruptedError (an UnavailableError) when its
        stream ends before the answer (the coordinator may or may not have taken the
        call: the caller decides whether to repeat it); DeadlineExceededError after
        `timeout_s`. Sets `call.call_id`."""
        call_id = next(self._call_ids)
        call.call_id = call_id
        answered: asyncio.Future[pb.CallAnswer] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = answered
        try:
            async with asyncio.timeout(timeout_s):
                await self._send(pb.EngineMessage(call=call))
                answer = await answered
        except TimeoutError:
            raise DeadlineExceededError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no answer to session call {call_id} within {timeout_s:g} s",
            ) from None
        finally:
            self._calls.pop(call_id, None)
            if not answered.done():
                answered.cancel()
            elif not answered.cancelled():
                answered.exception()  # retrieved: failed while the send failed too
        if answer.code:
            raise error_from_number(answer.code, answer.message)
        return answer

    def _answered(self, answer: pb.CallAnswer) -> None:
        waiting = self._calls.get(answer.call_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(answer)  # an answer after its call gave up is dropped

    def _fail_calls(self, why: str) -> None:
        calls, self._calls = self._calls, {}
        for answered in calls.values():
            if not answered.done():
                answered.set_exception(
                    CallInterruptedError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"{why} before the call was answered (the coordinator may have taken it)",
                    )
                )

    async def _send(self, message: pb.EngineMessage) -> None:
        call = self._call
        if call is None or call.done():
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "the session is not connected")
        await self._write(call, message)

    async def _write(self, call: _Call, message: pb.EngineMessage) -> None:
        """One write on `call`, bounded: a write that waits out the write timeout (flow
        control full against a frozen coordinator) breaks the stream, as a read error does,
        instead of holding the write lock, and every writer behind it, for ever.

        The write runs in its own task, shielded: grpc.aio cancels the whole call when
        the task awaiting a write is cancelled, so one caller that gave up (its task
        cancelled) would end the session of every other. Its message still goes out."""
        timeout_s = self.write_timeout_s
        write = asyncio.ensure_future(self._locked_write(call, message))
        write.add_done_callback(_retrieve)
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(write)
        except TimeoutError:
            self._break(call, f"a write to the coordinator did not complete in {timeout_s:g} s")
            raise UnavailableError(
                grpc.StatusCode.UNAVAILABLE,
                f"the session write timed out after {timeout_s:g} s (reconnecting)",
            ) from None
        except asyncio.CancelledError:
            if not _cancelled_locally():
                raise
            raise UnavailableError(
                grpc.StatusCode.UNAVAILABLE, "the session stream was cancelled"
            ) from None
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None
        except asyncio.InvalidStateError:
            raise UnavailableError(
                grpc.StatusCode.UNAVAILABLE, "the session stream ended"
            ) from None

    async def _locked_write(self, call: _Call, message: pb.EngineMessage) -> None:
        async with self._write_lock:
            await call.write(message)

    def _break(self, call: _Call, why: str) -> None:
        """Ends a stream that is alive to grpc but not to us; the runner reconnects.
        (A timed-out read or write may have cancelled the call already.)"""
        if self._broken is call:
            return  # several writers timed out on the same stuck stream
        self._broken = call
        if not self._closing:
            self.last_error = UnavailableError(grpc.StatusCode.UNAVAILABLE, why)
            log.warning(
                "%s: session with %s broken: %s; reconnecting",
                self.registration.resolved_child_engine_id,
                self.target,
                why,
            )
        call.cancel()

    # --- internals ---------------------------------------------------------------------

    async def _connect(self, reconnecting: bool = False) -> RegisterAck:
        if self._channel is None:  # after _move_on; CredentialsError when it cannot be made
            self._channel = self._new_channel()
        stub = pb_grpc.EngineServiceStub(self._channel)
        call: _Call = stub.Session()  # type: ignore[call-arg]  # grpc-stubs predate the optional iterator
        try:
            register = self.registration.to_proto(self.handler.held_leases())
            # The Register write too: it can wait on a frozen replica's flow control.
            async with asyncio.timeout(self._register_timeout_s):
                await call.write(pb.EngineMessage(register=register))
                first = await call.read()
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None
        except TimeoutError:
            call.cancel()
            raise error_from_status(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no RegisterAck within {self._register_timeout_s} s",
            ) from None
        if first is EOF or not isinstance(first, pb.CoordinatorMessage):
            code = await call.code()
            raise error_from_status(code, await call.details() or "stream ended")
        if first.WhichOneof("message") == "session_error":
            call.cancel()  # the status that follows repeats it
            raise from_session_error(first.session_error)
        if first.WhichOneof("message") != "register_ack":
            call.cancel()
            raise error_from_status(
                grpc.StatusCode.INTERNAL, "the coordinator's first message was not RegisterAck"
            )
        ack = RegisterAck.from_proto(first.register_ack)
        self._call = call
        self.ack = ack
        self.registrations += 1
        self._set_state(ack.state)
        log.info(
            "registered %s rank (tp=%d, pp=%d, pcp=%d): session %s, %d/%d parts",
            ack.state.child_engine_id,
            self.registration.tp_rank,
            self.registration.pp_rank,
            self.registration.pcp_rank,
            ack.session_id,
            ack.state.parts_present,
            ack.state.parts_expected,
        )
        try:
            await self.handler.on_registered(ack)
        except Exception:
            if not reconnecting:
                raise  # start(): the engine sees its own bug
            # Registered all the same: the engine's handler bug must not end the session.
            log.exception("session handler failed on registered")
        return ack

    def _set_state(self, state: ChildEngineState) -> None:
        self.state = state
        if state.ready:
            self._ready.set()
        else:
            self._ready.clear()

    async def _run(self) -> None:
        while True:
            call = self._call
            assert call is not None and self.ack is not None
            # The handler runs in its own task, message after message in stream order, so
            # that a call's answer is never read behind a slow pin or release callback.
            inbox: asyncio.Queue[pb.CoordinatorMessage | None] = asyncio.Queue(INBOX_SIZE)
            handling = asyncio.create_task(self._handle(inbox))
            beats = asyncio.create_task(self._heartbeats(call, self.ack.heartbeat_interval_ms))
            try:
                await self._read(call, inbox)
                await inbox.put(None)  # what was read is handled before registering again
                await handling
            finally:
                handling.cancel()
                self._ready.clear()  # first: a call failed below waits for the next registration
                self._fail_calls("the session stream ended")
                beats.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beats
            if self._closing or not self._reconnect:
                return
            if not await self._reconnect_with_backoff():
                return

    async def _reconnect_with_backoff(self) -> bool:
        # The same replica first: a stall or a blip must not split the rank parts of one
        # child engine over replicas (registrations are per replica). Only a replica that
        # cannot be reached sends this part to the next one.
        delay = self._backoff_initial_s
        while not self._closing:
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))
            if self._closing:
                break
            try:
                await self._connect(reconnecting=True)
                return True
            except KvrcClientError as e:
                self.last_error = e
                log.info("reconnect to %s failed (%s); retrying", self.target, e.code.name)
                if isinstance(e, _MOVE_ON):
                    await self._move_on()
            except CredentialsError as e:  # a token file being rotated, say: try again
                log.warning("reconnect to %s: %s; retrying", self.target, e)
                await self._move_on()  # another replica may be reachable meanwhile
            delay = min(delay * 2, self._backoff_max_s)
        return False

    async def _handle(self, inbox: asyncio.Queue[pb.CoordinatorMessage | None]) -> None:
        while (message := await inbox.get()) is not None:
            try:
                await self._dispatch(message)
            except asyncio.CancelledError:
                if not _cancelled_locally():
                    raise  # this task was cancelled: the session is going
                # A handler awaited something that someone else cancelled (a future, an
                # executor shut down): its bug, as below. Ending here silently would
                # leave the reader blocked on a full inbox for good.
                log.error(
                    "session handler was cancelled on %s; the session goes on",
                    message.WhichOneof("message"),
                )
            except Exception:  # the engine's handler bug must not end the session
                log.exception("session handler failed on %s", message.WhichOneof("message"))

    async def _read(self, call: _Call, inbox: asyncio.Queue[pb.CoordinatorMessage | None]) -> None:
        # The coordinator's SessionError, when it ends the session for what this part
        # sent: it says why even where the status that follows arrives mangled.
        said: KvrcClientError | None = None
        silence_s = self.silence_timeout_s
        try:
            while True:
                try:
                    # The coordinator answers every heartbeat: silence means it is frozen
                    # or cut off, which grpc alone may not notice for a long time.
                    async with asyncio.timeout(silence_s):
                        message = await call.read()
                except TimeoutError:
                    self._break(call, f"nothing heard from the coordinator for {silence_s:g} s")
                    return
                if message is EOF or not isinstance(message, pb.CoordinatorMessage):
                    code = await call.code()
                    if code != grpc.StatusCode.OK:
                        self.last_error = said or error_from_status(
                            code, await call.details() or ""
                        )
                    return
                if message.WhichOneof("message") == "session_error":
                    said = self.last_error = from_session_error(message.session_error)
                    log.warning(
                        "%s: the coordinator at %s ended the session: %s",
                        self.registration.resolved_child_engine_id,
                        self.target,
                        said,
                    )
                    continue
                if message.WhichOneof("message") == "call_answer":
                    self._answered(message.call_answer)
                else:
                    await inbox.put(message)  # a full inbox holds the reader: backpressure
        except grpc.aio.AioRpcError as e:
            self.last_error = said or from_rpc_error(e)
            if not self._closing and said is None:
                log.info("session with %s broke: %s", self.target, self.last_error)
        except asyncio.CancelledError:
            if not _cancelled_locally():
                raise
            # _break (a stuck write) or close() cancelled the call: the stream ended.

    async def _dispatch(self, message: pb.CoordinatorMessage) -> None:
        kind = message.WhichOneof("message")
        h = self.handler
        if kind == "heartbeat_ack":
            self.last_heartbeat_ack_ms = message.heartbeat_ack.server_time_unix_ms
        elif kind == "state":
            state = ChildEngineState.from_proto(message.state)
            self._set_state(state)
            await h.on_state(state)
        elif kind == "pin_request":
            await h.on_pin_request(message.pin_request)
        elif kind == "release_request":
            await h.on_release_request(message.release_request)
        elif kind == "abort_request":
            await h.on_abort_request(message.abort_request)
        elif kind == "resync_request":
            await h.on_resync_request(message.resync_request)
        elif kind == "quarantine_notice":
            await h.on_quarantine_notice(message.quarantine_notice)
        elif kind == "drain_notice":
            await h.on_drain_notice(message.drain_notice)
        else:
            log.debug("ignoring coordinator message %s", kind)

    async def _heartbeats(self, call: _Call, interval_ms: int) -> None:
        interval_s = max(interval_ms, 10) / 1000
        with contextlib.suppress(KvrcClientError):  # the stream ended (or was broken)
            while not call.done():
                await asyncio.sleep(interval_s)
                if self._closing:
                    return
                beat = pb.Heartbeat(client_time_unix_ms=time.time_ns() // 1_000_000)
                await self._write(call, pb.EngineMessage(heartbeat=beat))


def _retrieve(write: asyncio.Future[None]) -> None:
    """A shielded write's error is seen by its caller, unless the caller went away."""
    if not write.cancelled():
        write.exception()


def _cancelled_locally() -> bool:
    """grpc raises CancelledError from a read or write on a call cancelled here; that ends
    the stream, unlike a cancellation of the awaiting task itself. The call's
    `cancelled()` may still be False then (a write failing under the cancel ends it
    INTERNAL first), so the task decides: one nobody cancelled got it from the call."""
    task = asyncio.current_task()
    return task is None or task.cancelling() == 0


class SessionChannels:
    """Unary channels to the replica an `EngineSession` is on now, one per target, made on
    first use and closed by `close()` (not by the session's: reports may follow it).

        channels = SessionChannels(session)
        leases = LeaseClient(channels, child_engine_id)    # or LookupClient(channels)

    Registrations and leases are per replica: a replica forwards a report or a handoff
    call meant for another through the shared log (docs/operations.md), one trip more
    than calling the right one, which a plain channel to several targets cannot know.
    With one target this is one channel, as `connect(target)` makes."""

    def __init__(self, session: EngineSession) -> None:
        self.session = session  # a caller that replaces its session points this at the new one
        self._channels: dict[int, grpc.aio.Channel] = {}  # by index into session.targets
        self._closed = False

    def current(self) -> grpc.aio.Channel:
        if self._closed:
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "the channels are closed")
        index = self.session.target_index
        channel = self._channels.get(index)
        if channel is None:
            channel = self._channels[index] = connect(self.session.targets[index])
        return channel

    async def close(self) -> None:
        self._closed = True
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(None)


class EngineStub:
    """The `EngineService` stub of a fixed channel, or of the channel `SessionChannels`
    is on at this moment (a new stub once the session moved to another replica)."""

    def __init__(self, source: SessionChannels | grpc.aio.Channel) -> None:
        self._source = source
        self._made: tuple[grpc.aio.Channel, pb_grpc.EngineServiceAsyncStub] | None = None

    def current(self) -> pb_grpc.EngineServiceAsyncStub:
        source = self._source
        channel = source.current() if isinstance(source, SessionChannels) else source
        if self._made is None or self._made[0] is not channel:
            self._made = (channel, pb_grpc.EngineServiceStub(channel))
        return self._made[1]
