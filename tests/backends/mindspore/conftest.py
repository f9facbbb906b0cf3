"""Fixtures shared by the engine tests of this directory."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def logits_log(monkeypatch):
    """The logits each request's chooser was given, position by position: {request id: [V] arrays}."""
    from backends.mindspore.engine.sequence import SeqState

    seen: dict[str, list[np.ndarray]] = {}
    plain = SeqState.advance

    def advance(self, logits):
        seen.setdefault(self.handle.request_id, []).append(np.array(logits, copy=True))
        return plain(self, logits)

    monkeypatch.setattr(SeqState, "advance", advance)
    return seen
