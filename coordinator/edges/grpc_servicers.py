"""gRPC servicers: translate protobuf <-> the `Coordinator` facade, nothing more.

`KvrcError.code` maps onto a gRPC status in one place (`status_code`); every
RPC is counted in `kvrc_rpc_requests_total{method,code}` and unary RPCs are
timed in `kvrc_rpc_duration_seconds`, also in one place (`_Observed`). Request
bytes that are not valid protobuf are refused before any servicer runs
(`add_services`): INVALID_ARGUMENT, `kvrc_rpc_malformed_total{method}`, one
rate-limited log line; with --auth-tokens the caller's credentials are checked
first, so an unauthenticated caller hears UNAUTHENTICATED and is neither counted
as malformed nor logged. A session that ends with INVALID_ARGUMENT (such bytes, or a
message that breaks the protocol) hears it first as a `SessionError` message,
the stream's last, then the status (`session_error`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

import grpc
from google.protobuf import message_factory, unknown_fields
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message

from coordinator.core.auth import AuthDenied, AuthPolicy, DenyReason, Principal, Role
from coordinator.core.errors import ErrorCode, KvrcError, invalid
from coordinator.core.grants import TransferReport
from coordinator.core.leases import Flow
from coordinator.edges import grpc_wire as wire
from coordinator.edges.tls import caller_credentials
from coordinator.runtime.clock import to_unix_ms
from coordinator.runtime.coordinator import (
    REASON_CLOSED,
    REASON_ERROR,
    CompleteOutcome,
    Coordinator,
    SessionEnd,
)
from coordinator.runtime.coordinator import Session as CoordinatorSession
from coordinator.runtime.log_limit import RateLimitedLog
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc

log = logging.getLogger("kvrc.servicer")

Context = grpc.aio.ServicerContext[Any, Any]
R = TypeVar("R")
SessionMessageHandler = Callable[[CoordinatorSession, pb.EngineMessage], None]
# Prefix loads one session may have waiting for their grant (SessionCall, revision 3).
MAX_CALLS_IN_FLIGHT = 256
# Session streams admitted and not yet registered (an engine sends Register first, so
# only a flood or a stuck client has many); beyond it a stream is refused UNAVAILABLE
# (read first like any refused stream, see `_admit`).
MAX_SESSIONS_OPENING = 1024
# How long a refused stream is read before its status is sent, and how many at once.
REFUSED_READ_S = 1.0
MAX_SESSIONS_REFUSING = 256


def status_code(code: ErrorCode) -> grpc.StatusCode:
    """ErrorCode names are gRPC status names."""
    return grpc.StatusCode[code.value]


def session_error(code: grpc.StatusCode, message: str) -> pb.CoordinatorMessage:
    """The last message of a session the engine's input ended (`SessionError`)."""
    number: int = code.value[0]
    return pb.CoordinatorMessage(session_error=pb.SessionError(code=number, message=message))


async def _abort(context: Context, code: grpc.StatusCode, message: str) -> None:
    """End a session stream with `code`. When grpc can no longer send a status (the
    server is stopping or the peer already went away) the call is over anyway: the
    stream just ends, without a second abort or an error in the log."""
    try:
        await context.abort(code, message)
    except grpc.aio.AbortError:
        raise  # the normal way out: grpc unwinds the handler with it
    except Exception as e:  # cygrpc's ExecuteBatchError: the call is already finished
        log.debug("session status %s not sent, the call is over: %r", code.name, e)


def _own_child_engine(session: CoordinatorSession, child_engine_id: str, field: str) -> None:
    """A session's calls act for its own child engine (its Register was authorized for it)."""
    own = session.ref.child_engine_id
    if child_engine_id != own:
        raise AuthDenied(
            DenyReason.FOREIGN_ENGINE,
            f"{field} {child_engine_id!r} is not this session's child engine {own!r}: a session "
            "calls for its own child engine only (use the unary RPC for another)",
        )


class _Failure:
    """The status a session ends with when its reader fails (set once)."""

    __slots__ = ("code", "message")

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.message = ""

    def set(self, code: grpc.StatusCode, message: str) -> None:
        if self.code is None:
            self.code, self.message = code, message


class _Gate:
    """Who calls and what they may act for (core/auth.py); open without --auth-tokens."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._policy: AuthPolicy | None = coordinator.config.auth
        self._registry = coordinator.registry

    def authenticate(self, context: Context) -> Principal | None:
        """Before anything of the request is read: anonymous callers learn nothing."""
        if self._policy is None:
            return None
        token, cert = caller_credentials(context)
        return self._policy.authenticate(token, cert)

    def session(self, principal: Principal | None) -> None:
        if principal is not None:
            AuthPolicy.check_session(principal)

    def engine(self, principal: Principal | None, engine_id: str) -> None:
        if principal is not None:
            AuthPolicy.check_engine(principal, engine_id)

    def child_engine(self, principal: Principal | None, child_engine_id: str, field: str) -> None:
        if principal is not None:
            AuthPolicy.check_child_engine(principal, child_engine_id, self._engine_of, field)

    def admin(self, principal: Principal | None, method: str) -> None:
        if principal is not None:
            AuthPolicy.check_admin(principal, method)

    def read(self, principal: Principal | None, method: str) -> None:
        if principal is not None:
            AuthPolicy.check_read(principal, method)

    def router(self, principal: Principal | None, method: str) -> None:
        if principal is not None:
            AuthPolicy.check_router(principal, method)

    def lookup(self, principal: Principal | None, requester: str) -> None:
        if principal is not None:
            AuthPolicy.check_lookup(principal, requester, self._engine_of)

    def _engine_of(self, child_engine_id: str) -> str | None:
        view = self._registry.get(child_engine_id)
        return view.engine_id if view is not None else None


class _Observed:
    """Counts and times RPCs; converts exceptions into statuses."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._metrics = coordinator.metrics
        # Label children cached (methods x codes is finite): labels() costs µs per call.
        self._counters: dict[tuple[str, grpc.StatusCode], Any] = {}
        self._timers: dict[str, Any] = {}

    def count(self, method: str, code: grpc.StatusCode) -> None:
        counter = self._counters.get((method, code))
        if counter is None:
            counter = self._metrics.rpc_requests.labels(method=method, code=code.name)
            self._counters[method, code] = counter
        counter.inc()

    def count_denied(self, error: KvrcError) -> None:
        """Identity refusals; the core's PERMISSION_DENIED is acting on another's lease."""
        if isinstance(error, AuthDenied):
            reason = error.reason
        elif error.code is ErrorCode.PERMISSION_DENIED:
            reason = DenyReason.FOREIGN_LEASE
        else:
            return
        self._metrics.auth_denied.labels(reason=reason.value).inc()

    async def unary(self, method: str, context: Context, call: Callable[[], Awaitable[R]]) -> R:
        # Counted before the answer leaves: a client that saw the status finds it counted.
        started = time.perf_counter()
        try:
            result = await call()
        except asyncio.CancelledError:
            self.observe(method, started, grpc.StatusCode.CANCELLED)
            raise
        except Exception as e:
            await context.abort(*self.failed(method, started, e))
        self.observe(method, started, grpc.StatusCode.OK)
        return result

    def failed(self, method: str, started: float, error: Exception) -> tuple[grpc.StatusCode, str]:
        """The status a failed call answers with, counted: a refusal's own, or INTERNAL
        (logged) for anything else. For unary RPCs and calls on the session stream alike."""
        if isinstance(error, KvrcError):
            code, message = status_code(error.code), error.message
            self.count_denied(error)
        else:
            log.error("%s failed", method, exc_info=error)
            code = grpc.StatusCode.INTERNAL
            message = f"{method}: internal error (see the coordinator log)"
        self.observe(method, started, code)
        return code, message

    def observe(self, method: str, started: float, code: grpc.StatusCode) -> None:
        """Times and counts one call (a unary RPC or a call on the session stream)."""
        timer = self._timers.get(method)
        if timer is None:
            timer = self._timers[method] = self._metrics.rpc_duration.labels(method=method)
        timer.observe(time.perf_counter() - started)
        self.count(method, code)


class EngineService(pb_grpc.EngineServiceServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator
        self._observed = _Observed(coordinator)
        self._gate = _Gate(coordinator)
        self._bounds = coordinator.config.bounds
        # Every EngineMessage kind after Register but the heartbeat.
        self._handlers: dict[str, SessionMessageHandler] = {
            "events": self._on_events,
            "pin_result": self._on_pin_result,
            "abort_ack": self._on_abort_ack,
            "release_ack": self._on_release_ack,
            "call": self._on_call,
        }
        # Per session id: its prefix loads waiting for their grant (SessionCall).
        self._calls: dict[str, set[asyncio.Task[None]]] = {}
        self._opening = 0  # streams waiting for their Register (MAX_SESSIONS_OPENING)
        self._refusing = 0  # refused streams read before their status (MAX_SESSIONS_REFUSING)

    # --- the session stream --------------------------------------------------------

    async def Session(
        self, request_iterator: AsyncIterator[pb.EngineMessage], context: Context
    ) -> AsyncIterator[pb.CoordinatorMessage]:
        code = grpc.StatusCode.OK
        counted = False
        session: CoordinatorSession | None = None
        reader: asyncio.Task[None] | None = None
        failure = _Failure()
        opening = False
        try:
            try:
                principal = await self._admit(request_iterator, context)
                opening = True
                first = await self._first_message(request_iterator)
                session = await self._register(first, principal)
                self._opening_changed(-1)
                opening = False
                reader = asyncio.create_task(self._read(request_iterator, session, failure))
                while True:
                    out = await session.next_outbound()
                    if isinstance(out, SessionEnd):
                        break
                    yield wire.coordinator_message(out, self._coordinator.clock)
                if failure.code is not None:
                    code, message = failure.code, failure.message
                elif out.code is not None:
                    code, message = status_code(out.code), out.message
                else:
                    return
            except KvrcError as e:
                code, message = status_code(e.code), e.message
                self._observed.count_denied(e)
            # The one way a session ends with an error: the engine's own mistake
            # (INVALID_ARGUMENT) is said in band first, then the status repeats it.
            if code is grpc.StatusCode.INVALID_ARGUMENT:
                yield session_error(code, message)
            # Counted before the status leaves, as unary RPCs are.
            self._observed.count("Session", code)
            counted = True
            await _abort(context, code, message)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except grpc.aio.AbortError:
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            log.exception("session stream failed")
            self._observed.count("Session", code)
            counted = True
            await _abort(context, code, "internal error (see the coordinator log)")
        finally:
            if opening:
                self._opening_changed(-1)
            if reader is not None:
                reader.cancel()
            if session is not None:
                self._coordinator.close_session(session, REASON_CLOSED)
                for task in self._calls.pop(session.session_id, ()):
                    task.cancel()  # nobody reads the answer; the lease runs out as unary's would
            if not counted:
                self._observed.count("Session", code)

    async def _admit(
        self, requests: AsyncIterator[pb.EngineMessage], context: Context
    ) -> Principal | None:
        """The session's caller, before anything of the stream is read, and its place
        among the streams waiting for their Register (MAX_SESSIONS_OPENING; only callers
        that may register take one, so anonymous ones cannot crowd engines out).

        A refusal is a refused registration too (counted). A refused stream is read for
        at most REFUSED_READ_S first: aborted while the client still writes its
        Register, it would reach the client as INTERNAL ("Internal error from Core"),
        not the status sent. At most MAX_SESSIONS_REFUSING are read so at once; past
        them a refusal is sent at once."""
        try:
            principal = self._gate.authenticate(context)
            self._gate.session(principal)
            if self._opening >= MAX_SESSIONS_OPENING:
                # UNAVAILABLE: a passing overload, which engines retry with backoff (a
                # RESOURCE_EXHAUSTED registration is refused for good).
                raise KvrcError(
                    ErrorCode.UNAVAILABLE,
                    f"{MAX_SESSIONS_OPENING} session streams are waiting for their "
                    "Register message already; retry with backoff",
                )
        except KvrcError as e:
            self._refuse_registration(e.code)
            if self._refusing < MAX_SESSIONS_REFUSING:
                self._refusing += 1
                try:
                    # What it sent, or whether it sent anything, changes nothing.
                    with contextlib.suppress(Exception, StopAsyncIteration):
                        await asyncio.wait_for(anext(requests), REFUSED_READ_S)
                finally:
                    self._refusing -= 1
            raise
        self._opening_changed(+1)
        return principal

    def _opening_changed(self, by: int) -> None:
        self._opening += by
        self._coordinator.metrics.sessions_opening.set(self._opening)

    def _refuse_registration(self, code: ErrorCode) -> None:
        self._coordinator.metrics.registrations.labels(result=code.value).inc()

    async def _first_message(self, requests: AsyncIterator[pb.EngineMessage]) -> pb.EngineMessage:
        # A stream that never registers would hold resources: bound the wait.
        timeout_s = self._coordinator.config.heartbeat_timeout_ms / 1000
        try:
            return await asyncio.wait_for(anext(requests), timeout_s)
        except StopAsyncIteration:
            raise invalid("the session stream ended before its Register message") from None
        except TimeoutError:
            raise invalid(f"no Register message within {timeout_s:g} s of opening") from None

    async def _register(
        self, first: pb.EngineMessage, principal: Principal | None
    ) -> CoordinatorSession:
        kind = first.WhichOneof("message")
        if kind != "register":
            raise invalid(f"the first session message must be register, got {kind or 'nothing'}")
        try:
            # A rank part joins only an engine its credential is bound to, checked before
            # the rest of the Register is read.
            engine_id, child_engine_id = wire.registration_ids_from_proto(
                first.register, self._bounds
            )
            self._gate.engine(principal, engine_id)
            self._gate.child_engine(principal, child_engine_id, "child_engine_id")
            registration = wire.registration_from_proto(first.register, self._bounds)
        except KvrcError as e:
            self._refuse_registration(e.code)
            raise
        return self._coordinator.open_session(registration)

    async def _read(
        self,
        requests: AsyncIterator[pb.EngineMessage],
        session: CoordinatorSession,
        failure: _Failure,
    ) -> None:
        reason = REASON_CLOSED
        try:
            async for message in requests:
                if session.ended:
                    return
                self._dispatch(session, message)
        except KvrcError as e:
            failure.set(status_code(e.code), e.message)
            reason = REASON_ERROR
        except (grpc.aio.BaseError, grpc.RpcError, asyncio.InvalidStateError):
            pass  # the peer went away; the stream is over
        except Exception:
            log.exception("session %s: reading failed", session.session_id)
            failure.set(grpc.StatusCode.INTERNAL, "internal error (see the coordinator log)")
            reason = REASON_ERROR
        # The engine ended its side (or failed): the rank part leaves now.
        self._coordinator.close_session(session, reason, SessionEnd(None, ""))

    def _dispatch(self, session: CoordinatorSession, message: pb.EngineMessage) -> None:
        kind = message.WhichOneof("message")
        if kind == "heartbeat":
            self._coordinator.heartbeat(session)
            return
        if kind == "register":
            raise invalid("register may only be the first message of a session")
        if kind is None:
            raise invalid("empty or unknown EngineMessage (no known oneof field set)")
        self._coordinator.touch(session)
        self._handlers[kind](session, message)

    def _on_events(self, session: CoordinatorSession, message: pb.EngineMessage) -> None:
        # A malformed batch raises INVALID_ARGUMENT: the session ends, nothing is applied.
        inventory = self._coordinator.inventory
        try:
            batch = wire.event_batch_from_proto(message.events, self._coordinator.clock)
        except KvrcError:
            inventory.count_malformed()
            raise
        ref = session.ref
        inventory.ingest(ref.child_engine_id, ref.rank, ref.session_id, session.incarnation, batch)

    async def Lookup(self, request: pb.LookupRequest, context: Context) -> pb.LookupResponse:
        async def call() -> pb.LookupResponse:
            principal = self._gate.authenticate(context)
            requester, queries = wire.lookup_request_from_proto(request, self._bounds)
            self._gate.lookup(principal, requester)
            results = self._coordinator.inventory.lookup_many(requester, queries)
            return wire.lookup_response_to_proto(results, self._coordinator.clock)

        return await self._observed.unary("Lookup", context, call)

    # --- leases: session messages ---------------------------------------------------

    def _on_pin_result(self, session: CoordinatorSession, message: pb.EngineMessage) -> None:
        ref = session.ref
        lease_id, pinned, descriptor, error = wire.pin_result_from_proto(
            message.pin_result, ref.rank, self._bounds
        )
        self._coordinator.on_pin_result(ref, lease_id, pinned, descriptor, error)

    def _on_abort_ack(self, session: CoordinatorSession, message: pb.EngineMessage) -> None:
        lease_id = wire.check_id("abort_ack.lease_id", message.abort_ack.lease_id, self._bounds)
        ref = session.ref
        self._coordinator.on_abort_ack(ref, lease_id)

    def _on_release_ack(self, session: CoordinatorSession, message: pb.EngineMessage) -> None:
        lease_ids = wire.release_ack_from_proto(message.release_ack, self._bounds)
        self._coordinator.on_release_acks(session, lease_ids)

    # --- leases: calls on the session stream (revision 3) --------------------------------

    def _on_call(self, session: CoordinatorSession, message: pb.EngineMessage) -> None:
        """A SessionCall: the unary RPC's checks and flow, answered in band by one CallAnswer.

        A refused call is answered with its status and the session goes on; only a call
        that cannot be answered (no call_id) breaks the protocol and ends the session.
        """
        call = message.call
        call_id = call.call_id
        if call_id == 0:
            raise invalid("call.call_id must not be 0: it names the call's CallAnswer")
        started = time.perf_counter()
        kind = call.WhichOneof("call")
        if kind == "prefix_load_report":
            self._report_call(session, call_id, call.prefix_load_report, started)
            return
        if kind != "prefix_load":
            # Counted as a Session message (no method of its own to time it under). A kind
            # set by a newer client parses as an unknown field: not implemented here.
            newer = len(unknown_fields.UnknownFieldSet(call)) > 0
            code = grpc.StatusCode.UNIMPLEMENTED if newer else grpc.StatusCode.INVALID_ARGUMENT
            self._observed.count("Session", code)
            what = "a call kind this coordinator does not know" if newer else "no known call set"
            why = f"call {call_id}: {what} (this coordinator takes prefix_load and "
            self._reply_status(session, call_id, code, why + "prefix_load_report)")
            return
        try:
            self._in_task(
                session,
                call_id,
                lambda: self._prefix_load_call(session, call_id, call.prefix_load, started),
                "prefix loads of this session await their grant",
            )
        except KvrcError as refused:
            self._call_failed(session, call_id, "RequestPrefixLoad", started, refused)

    def _in_task(
        self,
        session: CoordinatorSession,
        call_id: int,
        run: Callable[[], Coroutine[Any, Any, None]],
        waiting: str,
    ) -> None:
        """A call that waits runs in a task of the session's calls, at most
        MAX_CALLS_IN_FLIGHT of them (RESOURCE_EXHAUSTED past it, saying what `waiting`
        does: nothing started)."""
        pending = self._calls.setdefault(session.session_id, set())
        if len(pending) >= MAX_CALLS_IN_FLIGHT:
            raise KvrcError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"call {call_id}: {MAX_CALLS_IN_FLIGHT} {waiting} already; "
                "wait for an answer first",
            )
        task = asyncio.get_running_loop().create_task(run())
        pending.add(task)
        task.add_done_callback(pending.discard)

    async def _prefix_load_call(
        self,
        session: CoordinatorSession,
        call_id: int,
        request: pb.PrefixLoadRequest,
        started: float,
    ) -> None:
        method = "RequestPrefixLoad"
        try:
            req = wire.prefix_load_request_from_proto(request, self._bounds)
            _own_child_engine(
                session, req.requester_child_engine_id, "prefix_load.requester_child_engine_id"
            )
            answer = await self._coordinator.leases.request_prefix_load(req)
            grant = wire.prefix_load_answer_to_proto(answer, self._coordinator.clock)
        except asyncio.CancelledError:
            self._observed.observe(method, started, grpc.StatusCode.CANCELLED)
            raise
        except Exception as e:
            self._call_failed(session, call_id, method, started, e)
            return
        self._call_answered(
            session, method, started, pb.CallAnswer(call_id=call_id, prefix_load=grant)
        )

    def _report_call(
        self,
        session: CoordinatorSession,
        call_id: int,
        request: pb.TransferReport,
        started: float,
    ) -> None:
        """Decided in stream order here; a lease another replica may own (the session
        moved since its grant, or the lease was rebuilt elsewhere) is asked of it, in a
        task of the session's calls."""
        method = "CompletePrefixLoad"
        try:
            report = wire.transfer_report_from_proto(request, self._bounds)
            _own_child_engine(
                session,
                report.reporter_child_engine_id,
                "prefix_load_report.reporter_child_engine_id",
            )
            if not self._coordinator.decided_here(report.lease_id, Flow.PREFIX_LOAD):
                self._in_task(
                    session,
                    call_id,
                    lambda: self._forwarded_report(session, call_id, report, started),
                    "calls of this session await their answer",
                )
                return
            outcome = self._coordinator.complete_here(report, Flow.PREFIX_LOAD)
        except Exception as e:
            self._call_failed(session, call_id, method, started, e)
            return
        self._report_answered(session, call_id, started, outcome)

    async def _forwarded_report(
        self, session: CoordinatorSession, call_id: int, report: TransferReport, started: float
    ) -> None:
        try:
            outcome = await self._coordinator.complete(report, Flow.PREFIX_LOAD)
        except asyncio.CancelledError:
            self._observed.observe("CompletePrefixLoad", started, grpc.StatusCode.CANCELLED)
            raise
        except Exception as e:
            self._call_failed(session, call_id, "CompletePrefixLoad", started, e)
            return
        self._report_answered(session, call_id, started, outcome)

    def _report_answered(
        self, session: CoordinatorSession, call_id: int, started: float, outcome: CompleteOutcome
    ) -> None:
        response = wire.complete_response_to_proto(outcome)
        answer = pb.CallAnswer(call_id=call_id, prefix_load_report=response)
        self._call_answered(session, "CompletePrefixLoad", started, answer)

    def _call_answered(
        self, session: CoordinatorSession, method: str, started: float, answer: pb.CallAnswer
    ) -> None:
        self._observed.observe(method, started, grpc.StatusCode.OK)
        self._coordinator.reply(session, pb.CoordinatorMessage(call_answer=answer))

    def _call_failed(
        self,
        session: CoordinatorSession,
        call_id: int,
        method: str,
        started: float,
        error: Exception,
    ) -> None:
        """Answered with the status the unary RPC would end with; the session goes on."""
        code, message = self._observed.failed(method, started, error)
        self._reply_status(session, call_id, code, message)

    def _reply_status(
        self, session: CoordinatorSession, call_id: int, code: grpc.StatusCode, message: str
    ) -> None:
        number: int = code.value[0]
        refused = pb.CallAnswer(call_id=call_id, code=number, message=message)
        self._coordinator.reply(session, pb.CoordinatorMessage(call_answer=refused))

    # --- leases: unary RPCs -----------------------------------------------------------

    async def RequestPrefixLoad(
        self, request: pb.PrefixLoadRequest, context: Context
    ) -> pb.PrefixLoadGrant:
        async def call() -> pb.PrefixLoadGrant:
            principal = self._gate.authenticate(context)
            req = wire.prefix_load_request_from_proto(request, self._bounds)
            self._gate.child_engine(
                principal, req.requester_child_engine_id, "requester_child_engine_id"
            )
            answer = await self._coordinator.leases.request_prefix_load(req)
            return wire.prefix_load_answer_to_proto(answer, self._coordinator.clock)

        return await self._observed.unary("RequestPrefixLoad", context, call)

    async def CompletePrefixLoad(
        self, request: pb.TransferReport, context: Context
    ) -> pb.CompleteResponse:
        return await self._complete("CompletePrefixLoad", request, context, Flow.PREFIX_LOAD)

    async def PublishHandoff(
        self, request: pb.PublishHandoffRequest, context: Context
    ) -> pb.PublishHandoffResponse:
        async def call() -> pb.PublishHandoffResponse:
            principal = self._gate.authenticate(context)
            req = wire.publish_handoff_from_proto(request, self._bounds)
            self._gate.child_engine(
                principal, req.prefill_child_engine_id, "prefill_child_engine_id"
            )
            return wire.publish_response_to_proto(await self._coordinator.publish_handoff(req))

        return await self._observed.unary("PublishHandoff", context, call)

    async def BeginHandoff(
        self, request: pb.BeginHandoffRequest, context: Context
    ) -> pb.HandoffGrant:
        async def call() -> pb.HandoffGrant:
            principal = self._gate.authenticate(context)
            req = wire.begin_handoff_from_proto(request, self._bounds)
            self._gate.child_engine(principal, req.decode_child_engine_id, "decode_child_engine_id")
            grant = await self._coordinator.begin_handoff(req)
            return wire.handoff_grant_to_proto(
                grant, self._coordinator.leases.heartbeat_interval_ms, self._coordinator.clock
            )

        return await self._observed.unary("BeginHandoff", context, call)

    async def ExtendHandoff(
        self, request: pb.ExtendHandoffRequest, context: Context
    ) -> pb.ExtendHandoffResponse:
        async def call() -> pb.ExtendHandoffResponse:
            principal = self._gate.authenticate(context)
            lease_id = wire.check_id("lease_id", request.lease_id, self._bounds)
            decode = wire.check_id(
                "decode_child_engine_id", request.decode_child_engine_id, self._bounds
            )
            self._gate.child_engine(principal, decode, "decode_child_engine_id")
            deadline = await self._coordinator.extend_handoff(lease_id, decode)
            return pb.ExtendHandoffResponse(
                deadline_unix_ms=to_unix_ms(self._coordinator.clock, deadline)
            )

        return await self._observed.unary("ExtendHandoff", context, call)

    async def CompleteHandoff(
        self, request: pb.TransferReport, context: Context
    ) -> pb.CompleteResponse:
        return await self._complete("CompleteHandoff", request, context, Flow.HANDOFF)

    async def _complete(
        self, method: str, request: pb.TransferReport, context: Context, flow: Flow
    ) -> pb.CompleteResponse:
        """A target part's terminal report; both flows check and answer it the same way."""

        async def call() -> pb.CompleteResponse:
            principal = self._gate.authenticate(context)
            report = wire.transfer_report_from_proto(request, self._bounds)
            self._gate.child_engine(
                principal, report.reporter_child_engine_id, "reporter_child_engine_id"
            )
            return wire.complete_response_to_proto(await self._coordinator.complete(report, flow))

        return await self._observed.unary(method, context, call)


class AdminService(pb_grpc.AdminServiceServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator
        self._observed = _Observed(coordinator)
        self._gate = _Gate(coordinator)

    async def GetStatus(self, request: pb.StatusRequest, context: Context) -> pb.StatusResponse:
        async def call() -> pb.StatusResponse:
            # Status shows endpoints and memory layout of every engine: read role.
            principal = self._gate.authenticate(context)
            self._gate.read(principal, "GetStatus")
            max_leases = wire.status_request_from_proto(request)
            # Lease ids let an engine act on a lease: whole only for admins (or auth off).
            full_ids = principal is None or Role.ADMIN in principal.roles
            return wire.status_to_proto(
                self._coordinator.status(max_leases),
                self._coordinator.clock,
                full_lease_ids=full_ids,
            )

        return await self._observed.unary("GetStatus", context, call)

    async def Drain(self, request: pb.DrainRequest, context: Context) -> pb.DrainResponse:
        async def call() -> pb.DrainResponse:
            self._gate.admin(self._gate.authenticate(context), "Drain")
            bounds = self._coordinator.config.bounds
            target, timeout_ms, wait = wire.drain_request_from_proto(request, bounds)
            result = await self._coordinator.leases.drain(target, timeout_ms, wait)
            return wire.drain_response_to_proto(result)

        return await self._observed.unary("Drain", context, call)

    async def ResolveQuarantine(
        self, request: pb.ResolveQuarantineRequest, context: Context
    ) -> pb.ResolveQuarantineResponse:
        async def call() -> pb.ResolveQuarantineResponse:
            self._gate.admin(self._gate.authenticate(context), "ResolveQuarantine")
            bounds = self._coordinator.config.bounds
            lease_id, note = wire.resolve_quarantine_from_proto(request, bounds)
            view = self._coordinator.leases.resolve_quarantine(lease_id, note)
            return pb.ResolveQuarantineResponse(state=pb.LeaseState.ValueType(view.state.value))

        return await self._observed.unary("ResolveQuarantine", context, call)


class RouterService(pb_grpc.RouterServiceServicer):
    """Score for routers: read only (docs/score.md)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator
        self._observed = _Observed(coordinator)
        self._gate = _Gate(coordinator)

    async def Score(self, request: pb.ScoreRequest, context: Context) -> pb.ScoreResponse:
        async def call() -> pb.ScoreResponse:
            self._gate.router(self._gate.authenticate(context), "Score")
            inventory = self._coordinator.inventory
            try:
                query = wire.score_request_from_proto(request, self._coordinator.config.bounds)
            except KvrcError:
                inventory.count_score_refused()
                raise
            return wire.score_response_to_proto(inventory.score(query))

        return await self._observed.unary("Score", context, call)


# --- serving: the method handlers ------------------------------------------------------

# The `method` label of a malformed request to a method this module does not serve.
UNKNOWN_METHOD = "unknown"
M = TypeVar("M", bound=Message)


class _MalformedRequests:
    """Requests that are not valid protobuf: counted, logged in one rate-limited line."""

    def __init__(self, coordinator: Coordinator, methods: Iterable[str]) -> None:
        counter = coordinator.metrics.rpc_malformed
        # Every series exists from the start at 0, and no other one can appear.
        self._counters = {m: counter.labels(method=m) for m in (*methods, UNKNOWN_METHOD)}
        self._log = RateLimitedLog(log, coordinator.clock.monotonic_ms)

    def refuse(self, method: str, request: wire.MalformedRequest, context: Context) -> KvrcError:
        """The INVALID_ARGUMENT the caller gets; nothing of the request reached the runtime."""
        self._counters.get(method, self._counters[UNKNOWN_METHOD]).inc()
        self._log.warning(method, "malformed request from %s: %s", context.peer(), request.message)
        return invalid(request.message)


class _CheckedRequests(AsyncIterator[M]):
    """A stream's inbound messages: a malformed one raises, like any protocol violation."""

    def __init__(
        self,
        requests: AsyncIterator[M | wire.MalformedRequest],
        refuse: Callable[[wire.MalformedRequest], KvrcError],
    ) -> None:
        self._requests = requests
        self._refuse = refuse

    async def __anext__(self) -> M:
        request = await anext(self._requests)
        if isinstance(request, wire.MalformedRequest):
            raise self._refuse(request)
        return request


def add_services(server: grpc.aio.Server, coordinator: Coordinator) -> None:
    """Serves the kvrc.v1 services on `server` with request deserializers that never raise.

    grpc's generated `add_*_to_server` parse with `FromString`, whose DecodeError
    grpc answers UNKNOWN with a traceback in the log; here a malformed request
    reaches `_MalformedRequests` instead and is answered INVALID_ARGUMENT.
    """
    servicers: tuple[Any, ...] = (
        EngineService(coordinator),
        AdminService(coordinator),
        RouterService(coordinator),
    )
    services = [pb.DESCRIPTOR.services_by_name[type(s).__name__] for s in servicers]
    malformed = _MalformedRequests(coordinator, (m.name for s in services for m in s.methods))
    observed = _Observed(coordinator)
    gate = _Gate(coordinator)
    for servicer, service in zip(servicers, services, strict=True):
        handlers = {
            method.name: _method_handler(
                getattr(servicer, method.name), method, service.full_name, observed, malformed, gate
            )
            for method in service.methods
        }
        _register(server, service.full_name, handlers)


def _register(
    server: grpc.aio.Server, service_name: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
) -> None:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
    server.add_registered_method_handlers(service_name, handlers)  # type: ignore[attr-defined]


def add_parsed_service(server: grpc.aio.Server, servicer: Any, service: ServiceDescriptor) -> None:
    """Serves a service kvrc does not own (gRPC Health, reflection) as grpc's generated
    `add_*_to_server` does, with deserializers that never raise: bytes that are not the
    method's request message are INVALID_ARGUMENT naming it (I8-bad-input), not UNKNOWN.
    Not counted in `kvrc_rpc_malformed_total`, which is kvrc's own methods'."""
    handlers = {
        method.name: _parsed_handler(getattr(servicer, method.name), method, service.full_name)
        for method in service.methods
    }
    _register(server, service.full_name, handlers)


def _parsed_handler(
    behavior: Callable[..., Any], method: MethodDescriptor, service_name: str
) -> grpc.RpcMethodHandler[Any, Any]:
    path = f"/{service_name}/{method.name}"
    parse = wire.request_parser(message_factory.GetMessageClass(method.input_type), path)
    serialize = message_factory.GetMessageClass(method.output_type).SerializeToString

    async def checked(request: Any, context: Context) -> Any:
        if isinstance(request, wire.MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return request

    async def requests(stream: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
        async for request in stream:
            yield await checked(request, context)

    if method.server_streaming:

        async def arguments(raw: Any, context: Context) -> Any:
            if method.client_streaming:
                return requests(raw, context)
            return await checked(raw, context)

        if inspect.isasyncgenfunction(behavior):

            async def yielding(raw: Any, context: Context) -> AsyncIterator[Any]:
                async for response in behavior(await arguments(raw, context), context):
                    yield response

            streaming: Callable[..., Any] = yielding
        else:  # writes with context.write (Health's Watch)

            async def writing(raw: Any, context: Context) -> None:
                await behavior(await arguments(raw, context), context)

            streaming = writing
        make = (
            grpc.stream_stream_rpc_method_handler
            if method.client_streaming
            else grpc.unary_stream_rpc_method_handler
        )
        return make(streaming, request_deserializer=parse, response_serializer=serialize)
    if method.client_streaming:
        raise AssertionError(f"{path}: no client-streaming method is served")

    async def unary(request: Any, context: Context) -> Any:
        response = behavior(await checked(request, context), context)
        # grpc's base servicers answer UNIMPLEMENTED from plain methods (Health's List).
        return await response if inspect.isawaitable(response) else response

    return grpc.unary_unary_rpc_method_handler(
        unary, request_deserializer=parse, response_serializer=serialize
    )


def _method_handler(
    behavior: Callable[..., Any],
    method: MethodDescriptor,
    service_name: str,
    observed: _Observed,
    malformed: _MalformedRequests,
    gate: _Gate,
) -> grpc.RpcMethodHandler[Any, Any]:
    name = method.name

    def refuse_malformed(request: wire.MalformedRequest, context: Context) -> KvrcError:
        # Credentials first (docs/security.md): an anonymous caller's garbage is
        # UNAUTHENTICATED, neither counted as malformed nor logged with its peer.
        gate.authenticate(context)
        return malformed.refuse(name, request, context)

    parse = wire.request_parser(getattr(pb, method.input_type.name), f"/{service_name}/{name}")
    serialize = getattr(pb, method.output_type.name).SerializeToString
    if method.client_streaming and method.server_streaming:
        # An async generator function: grpc.aio would run a plain function in a thread.
        async def stream(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            checked = _CheckedRequests(requests, lambda r: refuse_malformed(r, context))
            async for response in behavior(checked, context):
                yield response

        return grpc.stream_stream_rpc_method_handler(
            stream, request_deserializer=parse, response_serializer=serialize
        )
    if method.client_streaming or method.server_streaming:
        raise AssertionError(f"{name}: kvrc.v1 has unary and bidirectional methods only")

    async def unary(request: Any, context: Context) -> Any:
        if isinstance(request, wire.MalformedRequest):

            async def refuse() -> Any:
                raise refuse_malformed(request, context)

            return await observed.unary(name, context, refuse)
        return await behavior(request, context)

    return grpc.unary_unary_rpc_method_handler(
        unary, request_deserializer=parse, response_serializer=serialize
    )
