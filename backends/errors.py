"""Domain errors raised by backends; ``service/`` maps each to one HTTP status in one place."""
from __future__ import annotations


class BackendError(Exception):
    """Base class: the message is shown to the client."""


class InputRejected(BackendError):
    """The request is well-formed but this model/configuration cannot take it (e.g. too many tokens)."""


class EngineOverloaded(BackendError):
    """No room to queue the request."""


class EngineUnavailable(BackendError):
    """Not loaded yet, or shutting down."""


class GenerationFailed(BackendError):
    """The engine failed while running this request."""
