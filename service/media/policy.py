"""What a deployment allows media to be: the local root, the remote whitelist, the size caps, the fetch
timeouts. Built once at start-up from ``ServerSettings`` and the environment's ``ALLOWED_MEDIA_DOMAINS_ENV``;
tests build their own (small timeouts, a test resolver, the loopback allowance that no config key or
environment variable can turn on)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import tornado.netutil

from service.config import ServerSettings

DOMAINS_ENV = "ALLOWED_MEDIA_DOMAINS_ENV"
MB = 1024 * 1024
VIDEO_CAP_BYTES = 512 * MB
REQUEST_CAP_BYTES = 1000 * MB  # all media of one request
MAX_IMAGE_PIXELS = 7680 * 4320  # an 8K UHD frame; a larger image is refused before it is decoded
CONNECT_TIMEOUT = 5.0
READ_IDLE_TIMEOUT = 30.0
FETCH_TIMEOUT = 60.0


def allowed_domains(environ: Mapping[str, str]) -> frozenset[str]:
    """``ALLOWED_MEDIA_DOMAINS_ENV``: comma-separated host names, trimmed and lower-cased (exact matches,
    no wildcards). Unset or empty: no host, i.e. remote media refused."""
    return frozenset(host.strip().lower() for host in environ.get(DOMAINS_ENV, "").split(",") if host.strip())


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    root: Path = Path("/data/multimodal_inputs")
    domains: frozenset[str] = frozenset()  # hosts remote media may come from; empty: none
    image_cap: int = 40 * MB  # bytes of one image, and of one audio file (maxRequestLength)
    video_cap: int = VIDEO_CAP_BYTES
    request_cap: int = REQUEST_CAP_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS
    connect_timeout: float = CONNECT_TIMEOUT
    read_idle_timeout: float = READ_IDLE_TIMEOUT  # no body byte for this long ends the fetch
    fetch_timeout: float = FETCH_TIMEOUT  # one whole fetch, from the DNS lookup to the last byte
    max_loads: int = 8  # requests loading media at once (ServerConfig.maxMediaLoads)
    max_held_bytes: int = 2048 * MB  # media bytes requests may hold at once (ServerConfig.maxMediaBufferMB)
    resolver: tornado.netutil.Resolver | None = field(default=None, compare=False)  # None: the system's
    # Tests only: let loopback addresses (a test HTTP server on 127.0.0.1) pass the address check. Never
    # set from configuration.
    allow_loopback_for_tests: bool = False

    def cap(self, kind: str) -> int:
        """Bytes one part of ``kind`` may have."""
        return self.video_cap if kind == "video" else self.image_cap

    @classmethod
    def from_settings(cls, settings: ServerSettings, environ: Mapping[str, str] | None = None) -> MediaPolicy:
        """The deployment's policy: ``ServerConfig`` keys, and the whitelist from ``environ`` (none without)."""
        return cls(root=Path(settings.media_root), domains=allowed_domains(environ or {}),
                   image_cap=settings.max_request_bytes, max_loads=settings.max_media_loads,
                   max_held_bytes=settings.max_media_buffer_bytes)
