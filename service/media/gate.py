"""The process-wide bounds on media: requests loading media at once (``maxMediaLoads``) and media bytes
held by requests (``maxMediaBufferMB``), from the first byte reserved to the end of the request. Past
either, 429 at once. Used on the event loop only."""
from __future__ import annotations

from service.media.errors import MediaBusy


class MediaGate:
    def __init__(self, max_loads: int, max_bytes: int) -> None:
        self.max_loads, self.max_bytes = max_loads, max_bytes
        self.loading = 0  # requests between lease() and Lease.loaded()
        self.held = 0  # bytes reserved by leases

    def lease(self) -> Lease:
        """A request starts loading media; ``MediaBusy`` when ``max_loads`` already are."""
        if self.loading >= self.max_loads:
            raise MediaBusy(f"the server is loading media for {self.loading} requests, the most it loads at "
                            f"once (maxMediaLoads); retry later")
        self.loading += 1
        return Lease(self)


class Lease:
    """One request's share of the gate; ``release`` gives it all back (idempotent)."""

    def __init__(self, gate: MediaGate) -> None:
        self._gate = gate
        self.bytes = 0
        self._loading = True

    def reserve_upto(self, wanted: int, field: str) -> int:
        """Reserve up to ``wanted`` bytes (what is free); ``MediaBusy`` when nothing is."""
        granted = min(wanted, self._gate.max_bytes - self._gate.held)
        if granted <= 0 < wanted:
            raise MediaBusy(f"{field}: the server holds as much media as it may (maxMediaBufferMB, "
                            f"{self._gate.max_bytes} bytes); retry later")
        self._gate.held += granted
        self.bytes += granted
        return granted

    def settle(self, reserved: int, used: int) -> None:
        """Give back what a part reserved and did not use."""
        self._gate.held -= reserved - used
        self.bytes -= reserved - used

    def loaded(self) -> None:
        """The request's media are in (or failed): it no longer counts as loading."""
        if self._loading:
            self._loading = False
            self._gate.loading -= 1

    def release(self) -> None:
        self.loaded()
        self._gate.held -= self.bytes
        self.bytes = 0
