"""Engine-facing lease API: prefix loads, decode handoffs, and the holder side.

Requester / decode side (unary RPCs, no protobuf in the engine's code except the
transfer descriptors, which go straight into `clients.transfer.plan_rank_part_pull`):

    leases = LeaseClient("127.0.0.1:50051", child_engine_id="prefill-b")
    answer = await leases.request_prefix_load("req-1", block_hashes, min_blocks=4)
    if isinstance(answer, PrefixLoadGrant):
        ...pull answer.source_parts...
        await leases.complete_prefix_load(result.to_report(lease_id=answer.lease_id, ...))

    # decode:
    grant = await leases.begin_handoff("req-7", "prefill-a", wait_timeout_ms=5000)
    async with leases.keep_alive(grant):
        ...pull grant.source_parts, use grant.kv_transfer_params (the prefill's dict)...
    await leases.complete_handoff(report)

Holder / prefill side: `LeaseSessionHandler` is a `SessionHandler` for
`EngineSession`. It answers PinRequests from the engine's `pin` callback,
acknowledges an AbortRequest once the engine's `abort` callback says every
native operation of the lease stopped, and calls back on release, quarantine
and drain. Every coordinator error arrives as the typed `KvrcClientError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from clients.errors import (
    CallInterruptedError,
    DeadlineExceededError,
    FailedPreconditionError,
    KvrcClientError,
    UnavailableError,
    from_rpc_error,
)
from clients.session import (
    EngineSession,
    EngineStub,
    NullHandler,
    ReuseInfo,
    SessionChannels,
    SessionHandler,
)
from kvrc.credentials import ChannelOptions, connect
from kvrc.kv_params import decode_kv_transfer_params, encode_kv_transfer_params
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc
from kvrc.vocabulary import COORDINATOR_SHUTTING_DOWN

log = logging.getLogger("kvrc.client.leases")
_T = TypeVar("_T")

# The coordinator accepts this many held lease ids in one Register (FieldBounds).
MAX_HELD_ANNOUNCED = 4096
# Abort acks that found the session down, kept to send after it reconnects (oldest dropped).
MAX_UNSENT_ABORT_ACKS = 1024
# Release acks (revision 4) go in batches: a stream of loads costs the holder and the
# coordinator one ReleaseAck per RELEASE_ACK_DELAY_S, not one per load.
RELEASE_ACK_DELAY_S = 0.02
MAX_RELEASE_ACKS_PER_MESSAGE = 1024
# Reports, and begins within their wait, are retried while the coordinator is
# unreachable or warming after a restart (backing off from the first to the second).
_RETRY_INITIAL_S = 0.05
_RETRY_MAX_S = 1.0
# A begin is made again on UNAVAILABLE for at most this long (within its wait): a
# replica failing over, a restart. Past it the decode engine recomputes rather than wait
# out an outage. Its retries back off to _BEGIN_RETRY_MAX_S at most (a request waits on
# them; an engine's own parts re-register well within a second).
BEGIN_UNAVAILABLE_RETRY_S = 5.0
# A waiting BeginHandoff's answer may come this long after its wait ends.
BEGIN_ANSWER_MARGIN_S = 5.0
_BEGIN_RETRY_MAX_S = 0.2
# Terminal reports sent again after a re-registration (a restarted coordinator rebuilt
# the lease from its holder's re-announcement and waits for them): those whose lease
# had not ended when answered, of the last REPLAY_WINDOW_S, at most MAX_REPLAYED_REPORTS,
# REPLAY_CONCURRENCY at a time. The window spans the report, the coordinator's death and
# restart (a supervisor's restart, the state file, warm-up) and this engine's reconnect
# backoff: a minute, not the moments between one transfer's part reports (15 s lost
# reports on a loaded host). The count bounds the memory. A lease half-reported longer
# ago than that is left to its AbortRequests, or an operator.
MAX_REPLAYED_REPORTS = 64
REPLAY_WINDOW_S = 60.0
REPLAY_CONCURRENCY = 8
_QUIET_OUTCOMES = (pb.TRANSFER_OUTCOME_SUCCEEDED, pb.TRANSFER_OUTCOME_FAILED)

__all__ = [
    "HANDOFF_ENDED_STATES",
    "PUBLISH_RETRY_DELAYS_S",
    "CompleteResult",
    "HandoffGrant",
    "HandoffKeepAlive",
    "LeaseClient",
    "LeaseSessionHandler",
    "Miss",
    "PinAnswer",
    "PinRequestInfo",
    "PrefixLoadGrant",
    "PublishResult",
    "publish_attempts",
    "publish_rounds",
]


# --- values ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefixLoadGrant:
    lease_id: str
    source_child_engine_id: str
    matched_blocks: int  # may be fewer than the lookup hinted
    source_parts: tuple[pb.RankPartDescriptor, ...]  # byte for byte as the holder sent them
    deadline_unix_ms: int
    reuse: ReuseInfo
    # The cost model's prediction this grant was made on (docs/cost_model.md).
    prediction: pb.CostPrediction | None = None


@dataclass(frozen=True, slots=True)
class Miss:
    """Recompute: nothing (worth) loading. Never an error."""

    # no_candidate, short_pin, pin_timeout, holder_gone, below_min_blocks, draining,
    # recompute_cheaper (the cost model predicts recomputing to beat loading)
    reason: str
    detail: str
    lease_id: str  # "" when no holder was asked
    reuse: ReuseInfo
    prediction: pb.CostPrediction | None = None  # recompute_cheaper before any pin


@dataclass(frozen=True, slots=True)
class HandoffGrant:
    lease_id: str
    prefill_child_engine_id: str
    source_parts: tuple[pb.RankPartDescriptor, ...]
    kv_transfer_params: dict[Any, Any]  # the prefill's dict, field for field
    kv_transfer_params_bytes: bytes  # as published, byte for byte
    deadline_unix_ms: int
    heartbeat_interval_ms: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class PublishResult:
    state: str  # "WAITING_READY", "READY", ...
    parts_reported: int
    parts_expected: int
    lease_id: str  # names this handoff in the prefill's ReleaseRequest

    @property
    def ended(self) -> bool:
        """The handoff ended before this part published: no ReleaseRequest will come,
        so the part frees its blocks now and does not announce them as held."""
        return self.state in HANDOFF_ENDED_STATES


# Terminal lease states a PublishHandoff may answer with.
HANDOFF_ENDED_STATES = frozenset({"COMPLETED", "FAILED", "RESOLVED", "MISSED"})
# A handoff publish whose outcome is unknown (clients.errors.outcome_unknown) is sent
# again after these waits: kvrc answers a repeat with the handoff's state and lease id,
# which a release or a quarantine needs to reach the held blocks (I6-quiescence).
PUBLISH_RETRY_DELAYS_S = (1.0, 2.0, 5.0, 10.0, 30.0)


async def handoff_still_open(
    lease_id: str, publish_again: Callable[[], Awaitable[PublishResult]]
) -> bool:
    """At the end of a published handoff's hold: whether kvrc still governs its blocks.

    A repeat of the same publish changes nothing at kvrc and is answered with the
    handoff's state. True: the handoff is open (a decode may be reading it, or may
    still begin it): its release or quarantine will come, so the hold goes on
    (I6-quiescence). False: it ended, kvrc names another lease, or kvrc cannot be
    asked: the hold, the safety net for a kvrc that is gone, frees the blocks."""
    try:
        answer = await publish_again()
    except Exception as e:
        log.warning("handoff lease %s: kvrc not reachable at its hold's end: %s", lease_id, e)
        return False
    return answer.lease_id == lease_id and not answer.ended


async def publish_attempts(hold_ends: float) -> AsyncIterator[int]:
    """A handoff publish's attempts, numbered: the first at once, then one after each of
    `PUBLISH_RETRY_DELAYS_S` that starts before `hold_ends` (the event loop's time the
    blocks' hold ends). The caller stops once an answer settles the publish."""
    loop = asyncio.get_running_loop()
    yield 0
    for attempt, delay_s in enumerate(PUBLISH_RETRY_DELAYS_S, start=1):
        if loop.time() + delay_s >= hold_ends:
            return
        await asyncio.sleep(delay_s)
        yield attempt


async def publish_rounds(
    publish_part: Callable[[int], Awaitable[_T]],
    num_parts: int,
    hold_ends: float,
    held: Callable[[], bool],
) -> AsyncGenerator[tuple[int, list[_T | BaseException]], None]:
    """A handoff publish of rank parts 0..`num_parts`-1 in rounds, one per
    `publish_attempts`: the first sends every part, each later one only the parts
    without an answer yet, also once another part's answer named the lease (a repeat is
    idempotent; a part kvrc never recorded keeps the handoff from READY, and its decode
    waits, then recomputes). Yields the attempt and each part's latest answer or
    exception after every round. Ends once every part answered, at the hold's end, or
    when `held()` says the blocks are no longer held (a repeat must not publish freed
    blocks); the caller breaks out once an answer settles the publish."""
    answers: dict[int, _T | BaseException] = {}
    pending = list(range(num_parts))
    async for attempt in publish_attempts(hold_ends):
        if attempt and not held():
            return
        got = await asyncio.gather(*(publish_part(p) for p in pending), return_exceptions=True)
        answers.update(zip(pending, got, strict=True))
        yield attempt, [answers[p] for p in range(num_parts)]
        pending = [p for p in pending if isinstance(answers[p], BaseException)]
        if not pending:
            return


@dataclass(frozen=True, slots=True)
class CompleteResult:
    state: str  # "ACTIVE" (other parts still running), "COMPLETED", "FAILED", "QUARANTINED"
    quiescent: bool


def _state_name(value: int) -> str:
    if value in pb.LeaseState.values():
        return pb.LeaseState.Name(value).removeprefix("LEASE_STATE_")  # type: ignore[arg-type]
    return f"UNKNOWN({value})"


# --- requester / decode side --------------------------------------------------------------


class LeaseClient:
    """Lease RPCs of one child engine (any of its rank parts may use it).

    Given `SessionChannels`, each call goes to the replica the session is on at that
    moment (leases are per replica); the caller closes those. Given `session` (one of
    this child engine's rank parts), prefix loads and their reports travel on that
    session's stream instead (`EngineSession.call`, revision 3): the coordinator then
    handles a load as stream messages only, no unary call, and the calls follow the
    session to its replica. Handoffs stay unary RPCs on `target`."""

    def __init__(
        self,
        target: str | ChannelOptions | grpc.aio.Channel | SessionChannels,
        child_engine_id: str,
        *,
        timeout_s: float = 30.0,
        session: EngineSession | None = None,
    ) -> None:
        self.child_engine_id = child_engine_id
        self._session = session
        self._own_channel = isinstance(target, (str, ChannelOptions))
        if isinstance(target, SessionChannels):
            self._channel: grpc.aio.Channel | None = None
            self._stubs = EngineStub(target)
        else:
            self._channel = connect(target) if isinstance(target, (str, ChannelOptions)) else target
            self._stubs = EngineStub(self._channel)
        self._timeout_s = timeout_s
        # (lease id, rank) -> (monotonic time, RPC method, report): see replay_recent_reports.
        self._recent: OrderedDict[tuple[str, int, int, int], tuple[float, str, pb.TransferReport]]
        self._recent = OrderedDict()

    @property
    def _stub(self) -> pb_grpc.EngineServiceAsyncStub:
        return self._stubs.current()

    async def close(self) -> None:
        if self._own_channel and self._channel is not None:
            await self._channel.close(None)

    async def __aenter__(self) -> LeaseClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: Callable[..., Any], request: Any, timeout_s: float) -> Any:
        try:
            return await method(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None

    # prefix load

    async def request_prefix_load(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        *,
        min_blocks: int = 1,
        group_idx: int = 0,
        pin_timeout_ms: int = 0,
        transfer_timeout_ms: int = 0,
        compatibility_hash: str = "",
        local_blocks: int = 0,
    ) -> PrefixLoadGrant | Miss:
        """A grant, or a Miss (recompute). Raises FailedPreconditionError when reuse is off.

        `local_blocks`: this engine already holds the chain's first blocks and moves
        only the rest, so the coordinator's cost gate prices only the rest."""
        request = pb.PrefixLoadRequest(
            request_id=request_id,
            requester_child_engine_id=self.child_engine_id,
            block_hashes=list(block_hashes),
            compatibility_hash=compatibility_hash,
            min_blocks=min_blocks,
            group_idx=group_idx,
            pin_timeout_ms=pin_timeout_ms,
            transfer_timeout_ms=transfer_timeout_ms,
            local_blocks=local_blocks,
        )
        # The coordinator waits up to the pin timeout for the holder.
        timeout = self._timeout_s + (pin_timeout_ms or 2_000) / 1000
        reply: pb.PrefixLoadGrant
        if self._session is not None:
            reply = await self._prefix_load_on_session(self._session, request, timeout)
        else:
            reply = await self._call(self._stub.RequestPrefixLoad, request, timeout)
        if reply.outcome == pb.GRANT_OUTCOME_GRANTED:
            return PrefixLoadGrant(
                lease_id=reply.lease_id,
                source_child_engine_id=reply.source_child_engine_id,
                matched_blocks=reply.matched_blocks,
                source_parts=tuple(reply.source_parts),
                deadline_unix_ms=reply.deadline_unix_ms,
                reuse=ReuseInfo.from_proto(reply.reuse),
                prediction=reply.prediction if reply.HasField("prediction") else None,
            )
        reason, _, detail = reply.miss_reason.partition(": ")
        prediction = reply.prediction if reply.HasField("prediction") else None
        return Miss(reason, detail, reply.lease_id, ReuseInfo.from_proto(reply.reuse), prediction)

    @staticmethod
    async def _prefix_load_on_session(
        session: EngineSession, request: pb.PrefixLoadRequest, timeout_s: float
    ) -> pb.PrefixLoadGrant:
        """The request on the session stream. One whose stream broke after it went out is
        asked again, with the same request id, once the session is registered again: the
        coordinator answers a repeat of an open request with that lease, so a blip does
        not leave the holder's blocks pinned for a grant nobody reads. A session that is
        not connected when asked is UNAVAILABLE at once (recompute), as a unary call is."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                call = pb.SessionCall(prefix_load=request)
                answer = await session.call(call, max(deadline - loop.time(), 0.1))
                return answer.prefix_load
            except CallInterruptedError:
                left = deadline - loop.time()
                if left <= 0:
                    raise
                try:
                    await session.wait_ready(left)
                except TimeoutError:
                    raise UnavailableError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"the session stream broke during prefix load {request.request_id!r} "
                        "and did not come back in time",
                    ) from None

    async def complete_prefix_load(self, report: pb.TransferReport) -> CompleteResult:
        """One requester rank part's terminal outcome (`TransferResult.to_report(...)`).

        Retried on UNAVAILABLE (coordinator restarting or warming) for up to the client's
        timeout: a lost report would leave the holder's pins quarantined."""
        reply = await self._report("CompletePrefixLoad", report)
        return CompleteResult(_state_name(reply.state), reply.quiescent)

    async def _report(self, method: str, report: pb.TransferReport) -> Any:
        key = self._remember(method, report) if report.outcome in _QUIET_OUTCOMES else None
        reply = await self._send_report(method, report)
        if key is not None and reply.quiescent:
            # The lease ended with this report and its release went out with the answer:
            # nothing will wait for it again (kept only while other parts are awaited).
            self._recent.pop(key, None)
        return reply

    def _remember(self, method: str, report: pb.TransferReport) -> tuple[str, int, int, int]:
        rank = report.rank
        key = (report.lease_id, rank.tp_rank, rank.pp_rank, rank.pcp_rank)
        again = pb.TransferReport()
        again.CopyFrom(report)
        again.ClearField("prefill")  # one prefill sample is one sample
        self._recent.pop(key, None)
        self._recent[key] = (time.monotonic(), method, again)
        while len(self._recent) > MAX_REPLAYED_REPORTS:
            self._recent.popitem(last=False)
        return key

    async def replay_recent_reports(self) -> int:
        """Sends this engine's recent SUCCEEDED / FAILED reports again; how many were taken.

        After a coordinator restart a lease its holder re-announced is QUARANTINED until
        every target part reports (docs/operations.md); a part that reported to the old
        coordinator proves quiescence again this way. A report the coordinator no longer
        knows, or already has, changes nothing there. Both outcomes promise quiet reads,
        which stays true: replaying them can never release blocks early.
        """
        horizon = time.monotonic() - REPLAY_WINDOW_S
        while self._recent and next(iter(self._recent.values()))[0] < horizon:
            self._recent.popitem(last=False)
        reports = [(method, report) for _, method, report in self._recent.values()]
        self._recent.clear()  # sent once: a second re-registration does not repeat them
        gate = asyncio.Semaphore(REPLAY_CONCURRENCY)

        async def send(method: str, report: pb.TransferReport) -> bool:
            async with gate:
                try:
                    await self._send_report(method, report)
                    return True
                except KvrcClientError:
                    return False  # NOT_FOUND / FAILED_PRECONDITION: nothing waits for it

        taken = await asyncio.gather(*(send(m, r) for m, r in reports))
        return sum(taken)

    async def _send_report(self, method: str, report: pb.TransferReport) -> Any:
        async def attempt(left: float) -> Any:
            if self._session is not None and method == "CompletePrefixLoad":
                call = pb.SessionCall(prefix_load_report=report)
                answer = await self._session.call(call, max(left, 0.1))
                return answer.prefix_load_report
            # The stub on each try: after the session moved, a retry goes to the replica
            # the holder re-announced the lease to.
            return await self._call(getattr(self._stub, method), report, max(left, 0.1))

        return await _until_available(attempt, self._timeout_s)

    # decode handoff

    async def publish_handoff(
        self,
        request_id: str,
        *,
        descriptor: pb.RankPartDescriptor,
        kv_transfer_params: dict[Any, Any] | bytes,
        num_blocks: int,
        decode_child_engine_id: str = "",
    ) -> PublishResult:
        """One prefill rank part's part of a finished request (the descriptor names the rank)."""
        params = (
            kv_transfer_params
            if isinstance(kv_transfer_params, bytes)
            else encode_kv_transfer_params(kv_transfer_params)
        )
        request = pb.PublishHandoffRequest(
            request_id=request_id,
            prefill_child_engine_id=self.child_engine_id,
            rank=descriptor.rank,
            descriptor=descriptor,
            kv_transfer_params=params,
            decode_child_engine_id=decode_child_engine_id,
            num_blocks=num_blocks,
        )
        reply = await self._call(self._stub.PublishHandoff, request, self._timeout_s)
        return PublishResult(
            _state_name(reply.state), reply.parts_reported, reply.parts_expected, reply.lease_id
        )

    async def begin_handoff(
        self, request_id: str, prefill_child_engine_id: str, *, wait_timeout_ms: int = 0
    ) -> HandoffGrant:
        """Takes the handoff; waits up to `wait_timeout_ms` for READY (DeadlineExceededError).

        Within that wait the call is made again, with what is left of it, while this
        decode engine's own parts are re-registering (not registered or not READY for a
        moment: a session reconnecting), and on UNAVAILABLE for the first
        `BEGIN_UNAVAILABLE_RETRY_S` (kvrc restarting or warming, or the replica that
        carried the call lost, and its answer with it). The same decode engine asking
        again gets the same grant, so a grant whose answer was lost is not left to its
        heartbeat timeout."""
        own_parts_away = f"decode child engine {self.child_engine_id!r} is not "
        loop = asyncio.get_running_loop()
        unavailable_until = loop.time() + BEGIN_UNAVAILABLE_RETRY_S

        def transient(e: KvrcClientError) -> bool:
            nonlocal unavailable_until
            if isinstance(e, FailedPreconditionError):
                return own_parts_away in e.message
            if not isinstance(e, UnavailableError):
                return False
            if COORDINATOR_SHUTTING_DOWN in e.message:
                # The begin waited on a coordinator that is stopping (it says so): the
                # next one gets the whole budget, counted from now, however long the
                # wait had run (before: given up when it had waited over the budget).
                unavailable_until = loop.time() + BEGIN_UNAVAILABLE_RETRY_S
            return loop.time() < unavailable_until

        async def attempt(left_s: float) -> pb.HandoffGrant:
            left_ms = max(0, int(left_s * 1000))
            request = pb.BeginHandoffRequest(
                request_id=request_id,
                prefill_child_engine_id=prefill_child_engine_id,
                decode_child_engine_id=self.child_engine_id,
                wait_timeout_ms=left_ms,
            )
            # kvrc answers by the wait's end itself (DEADLINE_EXCEEDED): a short margin
            # past it, so a frozen kvrc costs the wait, not the wait and a whole RPC
            # timeout more.
            timeout = (
                left_ms / 1000 + min(self._timeout_s, BEGIN_ANSWER_MARGIN_S)
                if left_ms
                else self._timeout_s
            )
            reply: pb.HandoffGrant = await self._call(self._stub.BeginHandoff, request, timeout)
            return reply

        reply = await _until_available(
            attempt, wait_timeout_ms / 1000, transient, max_delay_s=_BEGIN_RETRY_MAX_S
        )
        try:
            params = decode_kv_transfer_params(reply.kv_transfer_params)
        except ValueError:
            params = {}  # not made by kvrc.kv_params: the bytes are still there
        return HandoffGrant(
            lease_id=reply.lease_id,
            prefill_child_engine_id=reply.prefill_child_engine_id,
            source_parts=tuple(reply.source_parts),
            kv_transfer_params=params,
            kv_transfer_params_bytes=bytes(reply.kv_transfer_params),
            deadline_unix_ms=reply.deadline_unix_ms,
            heartbeat_interval_ms=reply.heartbeat_interval_ms,
            num_blocks=reply.num_blocks,
        )

    async def extend_handoff(self, lease_id: str) -> int:
        """One heartbeat; returns the new deadline (unix ms)."""
        request = pb.ExtendHandoffRequest(
            lease_id=lease_id, decode_child_engine_id=self.child_engine_id
        )
        reply = await self._call(self._stub.ExtendHandoff, request, self._timeout_s)
        deadline: int = reply.deadline_unix_ms
        return deadline

    def keep_alive(self, grant: HandoffGrant) -> HandoffKeepAlive:
        """`async with client.keep_alive(grant):` extends the lease while the body runs."""
        return HandoffKeepAlive(self, grant.lease_id, grant.heartbeat_interval_ms)

    async def complete_handoff(self, report: pb.TransferReport) -> CompleteResult:
        """One decode rank part's terminal outcome (retried like complete_prefix_load)."""
        reply = await self._report("CompleteHandoff", report)
        return CompleteResult(_state_name(reply.state), reply.quiescent)


class HandoffKeepAlive:
    """Calls ExtendHandoff every heartbeat interval until stopped.

    A refused extension (the lease expired, was aborted or ended) stops the task
    and is kept in `error`: the engine must stop its transfer and report. One that
    did not reach an answer (UNAVAILABLE: a replica failing over, a coordinator
    restarting; DEADLINE_EXCEEDED) is tried again a third of an interval later,
    within the heartbeat timeout: giving up there let kvrc abort a healthy transfer.
    `missed` counts those.
    """

    def __init__(self, client: LeaseClient, lease_id: str, interval_ms: int) -> None:
        self._client = client
        self.lease_id = lease_id
        self._interval_s = max(interval_ms, 10) / 1000
        self._task: asyncio.Task[None] | None = None
        self.error: KvrcClientError | None = None
        self.extensions = 0
        self.missed = 0  # extensions that got no answer, tried again
        self.deadline_unix_ms = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kvrc-keepalive-{self.lease_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def __aenter__(self) -> HandoffKeepAlive:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        delay_s = self._interval_s
        while True:
            await asyncio.sleep(delay_s)
            delay_s = self._interval_s
            try:
                self.deadline_unix_ms = await self._client.extend_handoff(self.lease_id)
                self.extensions += 1
            except (UnavailableError, DeadlineExceededError) as e:
                self.missed += 1
                delay_s = self._interval_s / 3  # sooner: the timeout is ~3 intervals
                if self.missed == 1 or self.missed % 10 == 0:  # a few lines, not one a beat
                    log.warning(
                        "handoff lease %s: extension %d got no answer (%s); trying again",
                        self.lease_id,
                        self.missed,
                        e,
                    )
            except KvrcClientError as e:
                self.error = e
                log.warning("handoff lease %s not extended: %s", self.lease_id, e)
                return


# --- holder / prefill side (session stream) ----------------------------------------------


@dataclass(frozen=True, slots=True)
class PinRequestInfo:
    lease_id: str
    block_hashes: tuple[bytes, ...]
    requester_child_engine_id: str
    deadline_unix_ms: int
    group_idx: int


@dataclass(frozen=True, slots=True)
class PinAnswer:
    """How many chain blocks (from the start) this rank part pinned; 0 = a miss."""

    pinned_blocks: int
    descriptor: pb.RankPartDescriptor | None = None  # required when pinned_blocks > 0
    error_message: str = ""


PinCallback = Callable[[PinRequestInfo], Awaitable[PinAnswer] | PinAnswer]
# (lease id, reason) -> resolves once every native operation of the lease stopped.
AbortCallback = Callable[[str, str], Awaitable[None]]
LeaseCallback = Callable[[str, str], Awaitable[None] | None]


def _unavailable(e: KvrcClientError) -> bool:
    return isinstance(e, UnavailableError)


async def _until_available(
    attempt: Callable[[float], Awaitable[_T]],
    for_s: float,
    transient: Callable[[KvrcClientError], bool] = _unavailable,
    *,
    max_delay_s: float = _RETRY_MAX_S,
) -> _T:
    """`attempt(seconds left of for_s)`, made again after a `transient` error (by default
    UNAVAILABLE) while `for_s` lasts, backing off to `max_delay_s`."""
    loop = asyncio.get_running_loop()
    until = loop.time() + for_s
    delay = _RETRY_INITIAL_S
    while True:
        try:
            return await attempt(until - loop.time())
        except KvrcClientError as e:
            if not transient(e) or loop.time() + delay >= until:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay_s)


async def _maybe_await(value: Any) -> Any:
    if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
        return await value
    return value


class LeaseSessionHandler(SessionHandler):
    """Answers the coordinator's lease requests on an `EngineSession`.

        handler = LeaseSessionHandler(pin=my_pin, abort=my_abort, on_release=my_unpin)
        session = EngineSession(target, registration, handler)
        handler.attach(session)

    - PinRequest: `pin(info)` -> `PinAnswer`, sent back as PinResult (a failing
      callback answers 0 blocks with its error: a miss, never a pin left behind).
    - AbortRequest: `abort(lease_id, reason)` runs in a task; AbortAck is sent
      only after it returns (the engine's native operations stopped). Blocks
      stay pinned until the ReleaseRequest.
    - ReleaseRequest: `on_release(lease_id, reason)`, then a ReleaseAck (batched, within
      RELEASE_ACK_DELAY_S): until it arrives the coordinator sends the release again to
      the part's next session, so `on_release` must take a lease it no longer holds
      as done.
    - QuarantineNotice: `on_quarantine(lease_id, reason)`: keep the blocks out of
      use until a ReleaseRequest follows the operator's resolution.
    """

    def __init__(
        self,
        *,
        pin: PinCallback | None = None,
        abort: AbortCallback | None = None,
        on_release: LeaseCallback | None = None,
        on_quarantine: LeaseCallback | None = None,
        on_drain: Callable[[str, int], Awaitable[None] | None] | None = None,
        inner: SessionHandler | None = None,
    ) -> None:
        self._pin = pin
        self._abort = abort
        self._on_release = on_release
        self._on_quarantine = on_quarantine
        self._on_drain = on_drain
        # Readiness and registration callbacks go here too.
        self._inner: SessionHandler = inner if inner is not None else NullHandler()
        self._session: EngineSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Leases this part holds pins for until their ReleaseRequest (insertion order),
        # each with its requester as far as this part knows ("" = unknown).
        self._held: dict[str, str] = {}
        self._registrations = 0
        self._reports: LeaseClient | None = None
        # Acks whose send found the session down: the proof a quarantine waits for, so
        # they go after the next registration instead of being lost (insertion order).
        self._unsent_acks: OrderedDict[str, None] = OrderedDict()
        # Released leases whose ReleaseAck is not sent yet, and whether a send is due.
        self._release_acks_due: list[str] = []
        self._release_ack_scheduled = False

    def held_leases(self) -> Mapping[str, str]:
        """Re-announced at every (re-)registration, each with its requester: a restarted
        coordinator rebuilds these leases as quarantined instead of forgetting pins, and
        takes reports on each from its requester only (at most MAX_HELD_ANNOUNCED)."""
        if len(self._held) <= MAX_HELD_ANNOUNCED:
            return dict(self._held)
        log.warning("%d held leases; announcing the newest %d", len(self._held), MAX_HELD_ANNOUNCED)
        return dict(list(self._held.items())[-MAX_HELD_ANNOUNCED:])

    def track_held(self, lease_id: str, requester_child_engine_id: str = "") -> None:
        """An engine that holds blocks for a lease it learned elsewhere (a handoff: its
        reserved decode engine is the requester; "" when unreserved)."""
        self._held[lease_id] = requester_child_engine_id

    def untrack_held(self, lease_id: str) -> None:
        self._held.pop(lease_id, None)

    def attach(self, session: EngineSession) -> None:
        self._session = session

    def replay_reports_of(self, client: LeaseClient) -> None:
        """After each re-registration, `client`'s recent terminal reports are sent again
        (`LeaseClient.replay_recent_reports`): a restarted coordinator may wait for them."""
        self._reports = client

    def _require_session(self) -> EngineSession:
        if self._session is None:
            raise RuntimeError("LeaseSessionHandler.attach(session) was not called")
        return self._session

    async def on_registered(self, ack: Any) -> None:
        self._registrations += 1
        if self._registrations > 1 and self._reports is not None:
            self._spawn(self._replay(self._reports))
        if self._unsent_acks:
            self._spawn(self._send_kept_acks())
        await self._inner.on_registered(ack)

    def release_acks_due(self) -> Sequence[str]:
        """Lease ids released here whose ReleaseAck is not sent yet."""
        return list(self._release_acks_due)

    def unsent_abort_acks(self) -> Sequence[str]:
        """Lease ids whose AbortAck waits for the session to reconnect."""
        return list(self._unsent_acks)

    async def _send_kept_acks(self) -> None:
        kept, self._unsent_acks = list(self._unsent_acks), OrderedDict()
        for lease_id in kept:
            await self._send_abort_ack(lease_id)
        if kept:
            log.info("re-registered: %d kept abort ack(s) sent", len(kept))

    @staticmethod
    async def _replay(client: LeaseClient) -> None:
        taken = await client.replay_recent_reports()
        if taken:
            log.info("re-registered: %d recent transfer reports sent again", taken)

    async def on_state(self, state: Any) -> None:
        await self._inner.on_state(state)

    async def on_resync_request(self, request: pb.ResyncRequest) -> None:
        await self._inner.on_resync_request(request)

    async def on_pin_request(self, request: pb.PinRequest) -> None:
        session = self._require_session()
        info = PinRequestInfo(
            lease_id=request.lease_id,
            block_hashes=tuple(request.block_hashes),
            requester_child_engine_id=request.requester_child_engine_id,
            deadline_unix_ms=request.deadline_unix_ms,
            group_idx=request.group_idx,
        )
        if self._pin is None:
            answer = PinAnswer(0, error_message="this engine does not serve prefix loads")
        else:
            try:
                answer = await _maybe_await(self._pin(info))
            except Exception as e:  # the engine's bug: answer a miss, pin nothing
                log.exception("pin callback failed for lease %s", request.lease_id)
                answer = PinAnswer(0, error_message=f"pin failed: {e}"[:1024])
        result = pb.PinResult(
            lease_id=request.lease_id,
            pinned_blocks=answer.pinned_blocks,
            error_message=answer.error_message,
        )
        if answer.descriptor is not None:
            result.descriptor.CopyFrom(answer.descriptor)
        if answer.pinned_blocks > 0:
            # Until its ReleaseRequest.
            self._held[request.lease_id] = request.requester_child_engine_id
        try:
            await session.send_pin_result(result)
        except UnavailableError as e:
            # The session broke while the engine pinned (a kvrc restart, say): that grant
            # died with it; the lease stays held and is re-announced on re-registration.
            log.info(
                "pin result of lease %s not sent (the session is down): %s", request.lease_id, e
            )

    async def on_abort_request(self, request: pb.AbortRequest) -> None:
        self._spawn(self._abort_then_ack(request.lease_id, request.reason))

    async def _abort_then_ack(self, lease_id: str, reason: str) -> None:
        if self._abort is not None:
            await self._abort(lease_id, reason)  # no ack unless the engine proves it stopped
        await self._send_abort_ack(lease_id)

    async def _send_abort_ack(self, lease_id: str) -> None:
        try:
            await self._require_session().send_abort_ack(lease_id)
        except UnavailableError as e:
            # Between sessions: keep it for the next registration (a coordinator that
            # no longer waits for it logs and ignores it).
            self._unsent_acks[lease_id] = None
            self._unsent_acks.move_to_end(lease_id)
            while len(self._unsent_acks) > MAX_UNSENT_ABORT_ACKS:
                dropped, _ = self._unsent_acks.popitem(last=False)
                log.warning("abort ack of lease %s dropped: too many kept unsent", dropped)
            log.info("abort ack of lease %s kept until the session is back: %s", lease_id, e)

    async def on_release_request(self, request: pb.ReleaseRequest) -> None:
        if self._on_release is not None:
            await _maybe_await(self._on_release(request.lease_id, request.reason))
        self._held.pop(request.lease_id, None)
        # Acknowledged once the pins are free: a release lost with a broken stream before
        # this is sent comes again on the next session (I6-quiescence).
        self._release_acks_due.append(request.lease_id)
        if len(self._release_acks_due) >= MAX_RELEASE_ACKS_PER_MESSAGE:
            await self.flush_release_acks()
        elif not self._release_ack_scheduled:
            self._release_ack_scheduled = True
            self._spawn(self._send_release_acks_soon())

    async def _send_release_acks_soon(self) -> None:
        try:
            await asyncio.sleep(RELEASE_ACK_DELAY_S)
        finally:
            self._release_ack_scheduled = False
        await self.flush_release_acks()

    async def flush_release_acks(self) -> None:
        """Sends the acks that are due now (an engine about to close its session calls
        it first: what it sends after the stream ended is lost)."""
        due, self._release_acks_due = self._release_acks_due, []
        if not due:
            return
        try:
            await self._require_session().send_release_acks(due)
        except UnavailableError as e:
            # Not kept: the coordinator sends these releases again to the next session,
            # where they are taken as done and acknowledged.
            log.debug("%d release ack(s) not sent: %s", len(due), e)

    async def on_quarantine_notice(self, notice: pb.QuarantineNotice) -> None:
        if self._on_quarantine is not None:
            await _maybe_await(self._on_quarantine(notice.lease_id, notice.reason))

    async def on_drain_notice(self, notice: pb.DrainNotice) -> None:
        if self._on_drain is not None:
            await _maybe_await(self._on_drain(notice.child_engine_id, notice.deadline_unix_ms))

    def _spawn(self, work: Awaitable[None]) -> None:
        async def run() -> None:
            try:
                await work
            except Exception:
                log.exception("lease task failed")

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Sends the release acks that are due; cancels abort tasks still waiting (their
        acks are then never sent)."""
        with contextlib.suppress(Exception):  # closing: the coordinator resends releases
            await self.flush_release_acks()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
