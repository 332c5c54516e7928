"""Typed exceptions of the client library, each carrying the gRPC status."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvrc.v1 import kvrc_pb2 as pb


class KvrcClientError(Exception):
    """The coordinator answered with a non-OK status (or could not be reached)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidArgumentError(KvrcClientError):
    pass


class NotFoundError(KvrcClientError):
    pass


class AlreadyExistsError(KvrcClientError):
    pass


class FailedPreconditionError(KvrcClientError):
    pass


class PermissionDeniedError(KvrcClientError):
    pass


class ResourceExhaustedError(KvrcClientError):
    pass


class DeadlineExceededError(KvrcClientError):
    pass


class UnavailableError(KvrcClientError):
    pass


class CallInterruptedError(UnavailableError):
    """A call made on the session stream lost its stream before the answer: the
    coordinator may have taken it (`EngineSession.call`)."""


class UnauthenticatedError(KvrcClientError):
    pass


class UnimplementedError(KvrcClientError):
    pass


_BY_CODE: dict[grpc.StatusCode, type[KvrcClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
}


def error_from_status(code: grpc.StatusCode, message: str) -> KvrcClientError:
    return _BY_CODE.get(code, KvrcClientError)(code, message)


_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def error_from_number(code: int, message: str) -> KvrcClientError:
    """The typed exception for a status sent as its number (in band, on the session)."""
    return error_from_status(_BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN), message)


def from_session_error(error: pb.SessionError) -> KvrcClientError:
    """The typed exception for the coordinator's `SessionError`: why it ends the session."""
    return error_from_number(error.code, error.message)


def from_rpc_error(error: grpc.aio.AioRpcError) -> KvrcClientError:
    """The typed exception for a failed call."""
    return error_from_status(error.code(), error.details() or "")


# A call that failed with one of these may still have taken effect at the coordinator:
# the answer was lost, not necessarily the request.
_OUTCOME_UNKNOWN = frozenset(
    {
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    }
)


def outcome_unknown(error: BaseException) -> bool:
    """Whether a failed call may have been taken anyway (anything but a kvrc refusal):
    what it was to protect, a handoff's blocks for one, is then kept as if it had."""
    return not isinstance(error, KvrcClientError) or error.code in _OUTCOME_UNKNOWN


def refuses_the_engine(error: BaseException) -> bool:
    """kvrc refused the call for a reason that stands for the engine, not for this one
    call (its credentials, its registration or state, a full table): the next call like
    it would be refused too, so a caller backs off as from an outage instead of asking
    (and logging) once per request."""
    return isinstance(
        error,
        FailedPreconditionError
        | NotFoundError
        | PermissionDeniedError
        | UnauthenticatedError
        | ResourceExhaustedError,
    )


def first_refusal(failures: Sequence[BaseException]) -> BaseException | None:
    """The first of `failures` kvrc refused outright (its call was not taken); None when
    every outcome is unknown. Of a handoff's first publish, a refused part proves the
    handoff can never be READY; of a repeat, it proves nothing (the first may have been
    recorded), so callers act on it only for the first publish (I6-quiescence)."""
    return next((e for e in failures if not outcome_unknown(e)), None)
