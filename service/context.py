"""``AppContext``: the collaborators every handler gets through ``initialize`` (one per app)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from backends.base import Backend, accepted_media
from backends.settings import LoraSettings
from service.admission import Admission
from service.config import ServerSettings
from service.connections import ConnectionTracker
from service.grammar_check import GrammarCheck
from service.media.kinds import TEXT_PART, part_types
from service.media.loader import MediaLoader
from service.metrics import ServiceMetrics
from service.state import ServerState
from service.validation import Schemas

if TYPE_CHECKING:
    from service.models import ModelRegistry


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the served model/server can take, for the request checks that depend on it."""

    media_types: frozenset[str] | None = None  # part types besides text the model accepts; None: the backend's
    adapter_ids: frozenset[str] | None = None  # a fixed set of adapters to check against (tests); None = the
    # backend checks (adapters load and unload at run time)


@dataclass(frozen=True, slots=True)
class AppContext:
    """The apps of one process share ``state``, ``metrics``, ``admission`` and ``connections``."""

    backend: Backend
    settings: ServerSettings
    schemas: Schemas
    limits: RequestLimits
    state: ServerState
    metrics: ServiceMetrics
    admission: Admission
    connections: ConnectionTracker
    media: MediaLoader
    lora: LoraSettings = LoraSettings()  # the runtime adapter routes' switch and root
    grammars: GrammarCheck = field(default_factory=GrammarCheck)  # requests' grammars, checked before a slot
    models: ModelRegistry | None = None  # every served model (service/models.py); ``backend`` is the first's, or
    # in a generation request's own context the one its ``model`` chose

    def accepted_part_types(self) -> list[str]:
        """The part types ``inputs`` may have, text first: the limits', else what the backend accepts."""
        if self.limits.media_types is not None:
            return [TEXT_PART, *sorted(self.limits.media_types)]
        return part_types(accepted_media(self.backend))

    def request_limits(self) -> RequestLimits:
        """``limits`` with ``media_types`` filled in from the backend when not set."""
        if self.limits.media_types is not None:
            return self.limits
        return replace(self.limits, media_types=frozenset(self.accepted_part_types()[1:]))
