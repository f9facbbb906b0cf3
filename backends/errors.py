"""Domain errors raised by backends; ``service/`` maps each to one HTTP status in one place."""
from __future__ import annotations


class BackendError(Exception):
    """Base class: the message is shown to the client."""


class InputRejected(BackendError):
    """The request is well-formed but this model/configuration cannot take it (e.g. too many tokens)."""


class ParameterRejected(InputRejected):
    """One request parameter cannot be used (a grammar that does not compile, a token id outside the
    vocabulary); ``param`` is the engine's name for it (``RequestParams`` field), which a dialect renames."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class EngineOverloaded(BackendError):
    """No room to queue the request."""


class EngineUnavailable(BackendError):
    """Not loaded yet, or shutting down."""


class GenerationFailed(BackendError):
    """The engine failed while running this request."""
