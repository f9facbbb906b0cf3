"""``AppContext``: the collaborators every handler gets through ``initialize`` (one per app)."""
from __future__ import annotations

from dataclasses import dataclass

from backends.base import Backend
from backends.settings import LoraSettings
from service.admission import Admission
from service.config import ServerSettings
from service.connections import ConnectionTracker
from service.metrics import ServiceMetrics
from service.state import ServerState
from service.validation import Schemas


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the served model/server can take, for the request checks that depend on it."""

    media_types: frozenset[str] = frozenset()  # part types besides text the model accepts
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
    lora: LoraSettings = LoraSettings()  # the runtime adapter routes' switch and root
