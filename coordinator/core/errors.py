"""Domain errors of the coordinator core.

The core is pure (no gRPC); it raises `KvrcError` with an `ErrorCode` that the
gRPC edge maps one-to-one onto a status code. Messages are written for people:
they name the field and both values where a mismatch is the cause.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNAVAILABLE = "UNAVAILABLE"
    UNAUTHENTICATED = "UNAUTHENTICATED"


class KvrcError(Exception):
    """A request the core refuses. State is unchanged when this is raised."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"KvrcError({self.code.value}, {self.message!r})"


def invalid(message: str) -> KvrcError:
    return KvrcError(ErrorCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> KvrcError:
    return KvrcError(ErrorCode.NOT_FOUND, message)


def already_exists(message: str) -> KvrcError:
    return KvrcError(ErrorCode.ALREADY_EXISTS, message)


def failed_precondition(message: str) -> KvrcError:
    return KvrcError(ErrorCode.FAILED_PRECONDITION, message)


def permission_denied(message: str) -> KvrcError:
    return KvrcError(ErrorCode.PERMISSION_DENIED, message)


def resource_exhausted(message: str) -> KvrcError:
    return KvrcError(ErrorCode.RESOURCE_EXHAUSTED, message)
