"""The one error taxonomy of the service: each exception carries its HTTP status and wire ``error_type``.

Handlers raise these (or let backend errors be mapped by ``from_backend_error``); the base handler
renders any of them with ``error_body``. No Tornado here.
"""
from __future__ import annotations

import enum
from typing import ClassVar

from backends import errors as backend_errors


class ErrorType(str, enum.Enum):
    """The ``error_type`` strings on the wire (the reference server's status-code table)."""

    BAD_REQUEST = "Bad Request"
    UNAUTHORIZED = "Unauthorized"
    NOT_FOUND = "NotFoundError"
    METHOD_NOT_ALLOWED = "Method Not Allowed"
    REQUEST_TIMEOUT = "Request Timeout"
    PAYLOAD_TOO_LARGE = "Payload Too Large"
    UNSUPPORTED_MEDIA_TYPE = "Unsupported Media Type"
    VALIDATION = "Input Validation Error"
    GENERATION = "Generation Error"
    TOO_MANY_REQUESTS = "Too Many Requests"
    HEADER_TOO_LARGE = "Request Header Fields Too Large"
    INCOMPLETE = "Incomplete Generation"
    UNAVAILABLE = "Service Unavailable"


class ServiceError(Exception):
    """Base class: ``str(exc)`` is the client-facing message."""

    status: ClassVar[int] = 500
    error_type: ClassVar[ErrorType] = ErrorType.INCOMPLETE

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(ServiceError):
    status = 400
    error_type = ErrorType.BAD_REQUEST


class Unauthorized(ServiceError):
    """No API key, or not the server's (``ServerConfig.apiKey``); OpenAI's ``code`` for it."""

    status = 401
    error_type = ErrorType.UNAUTHORIZED
    code = "invalid_api_key"


class NotFound(ServiceError):
    status = 404
    error_type = ErrorType.NOT_FOUND


class MethodNotAllowed(ServiceError):
    status = 405
    error_type = ErrorType.METHOD_NOT_ALLOWED


class RequestTimeout(ServiceError):
    """The client did not send its request head or body in time (headerTimeout, bodyTimeout)."""

    status = 408
    error_type = ErrorType.REQUEST_TIMEOUT


class PayloadTooLarge(ServiceError):
    status = 413
    error_type = ErrorType.PAYLOAD_TOO_LARGE


class UnsupportedMediaType(ServiceError):
    """A body declared as something other than JSON (TGI answers 415 too)."""

    status = 415
    error_type = ErrorType.UNSUPPORTED_MEDIA_TYPE


class ValidationError(ServiceError):
    status = 422
    error_type = ErrorType.VALIDATION


class FailedDependency(ServiceError):
    """The backend failed while generating (``backends.errors.GenerationFailed``): HTTP 424, as TGI answers."""

    status = 424
    error_type = ErrorType.GENERATION


class TooManyRequests(ServiceError):
    status = 429
    error_type = ErrorType.TOO_MANY_REQUESTS


class HeaderTooLarge(ServiceError):
    """A request head over maxHeaderBytes."""

    status = 431
    error_type = ErrorType.HEADER_TOO_LARGE


class IncompleteGeneration(ServiceError):
    status = 500
    error_type = ErrorType.INCOMPLETE


class ServiceUnavailable(ServiceError):
    status = 503
    error_type = ErrorType.UNAVAILABLE


_BY_STATUS: dict[int, type[ServiceError]] = {
    cls.status: cls
    for cls in (BadRequest, Unauthorized, NotFound, MethodNotAllowed, RequestTimeout, PayloadTooLarge,
                UnsupportedMediaType, ValidationError, FailedDependency, TooManyRequests, HeaderTooLarge,
                IncompleteGeneration, ServiceUnavailable)
}

# Most specific first: subclasses before BackendError itself.
_BACKEND_MAP: tuple[tuple[type[Exception], type[ServiceError]], ...] = (
    (backend_errors.InputRejected, ValidationError),
    (backend_errors.EngineOverloaded, TooManyRequests),
    (backend_errors.EngineUnavailable, ServiceUnavailable),
    (backend_errors.GenerationFailed, FailedDependency),
    (backend_errors.BackendError, IncompleteGeneration),
)

INTERNAL_ERROR_MESSAGE = "Internal server error"


def for_status(status: int, message: str) -> ServiceError:
    """The taxonomy's exception for an HTTP status (e.g. Tornado's own 404/405); unknown → 500."""
    return _BY_STATUS.get(status, IncompleteGeneration)(message)


def from_backend_error(exc: Exception) -> ServiceError:
    """Map a backend's domain error to the service taxonomy (unknown exceptions → 500)."""
    if isinstance(exc, ServiceError):
        return exc
    for backend_cls, service_cls in _BACKEND_MAP:
        if isinstance(exc, backend_cls):
            return service_cls(str(exc) or service_cls.error_type.value)
    return IncompleteGeneration(INTERNAL_ERROR_MESSAGE)


def error_body(exc: BaseException) -> dict[str, str]:
    """The JSON error body ``{"error", "error_type"}``; non-service exceptions never leak details."""
    if not isinstance(exc, ServiceError):
        is_error = isinstance(exc, Exception)
        exc = from_backend_error(exc) if is_error else IncompleteGeneration(INTERNAL_ERROR_MESSAGE)
    return {"error": exc.message, "error_type": exc.error_type.value}
