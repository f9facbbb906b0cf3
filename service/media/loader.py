"""One request's media, from ``MediaRef``s to ``MediaInput``s: the whitelist first for every part (no I/O
before a rule that needs none), then each part in order, all within the policy's ``fetch_timeout`` (and
the request's own deadline).
Remote files are fetched on the event loop; local files, base64 and Pillow run on a small executor of
their own, so neither the loop nor the default executor waits on them. The pipeline calls ``load`` before
the request takes a generation slot (docs/multimodal.md)."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from backends.types import MediaInput
from service.media import content, fetch, local
from service.media.errors import DownloadFailed, MediaBusy, MediaTooLarge, OverLimit
from service.media.gate import Lease, MediaGate
from service.media.parts import MediaRef, Source
from service.media.policy import MediaPolicy

WORKERS = 2  # threads reading files and decoding images, for the whole process
DNS_WORKERS = 4  # threads looking up remote hosts
_CAP_NAMES = {"image": "maxRequestLength", "audio": "maxRequestLength", "video": "the video cap"}


class MediaLoader:
    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy
        self.gate = MediaGate(policy.max_loads, policy.max_held_bytes)
        self._executor = ThreadPoolExecutor(WORKERS, thread_name_prefix="mindserve-media")
        self._dns = None if policy.resolver is not None else ThreadPoolExecutor(DNS_WORKERS, "mindserve-dns")
        self._resolver = policy.resolver or fetch.SystemResolver(executor=self._dns)

    def lease(self) -> Lease:
        return self.gate.lease()

    async def load(self, refs: tuple[MediaRef, ...], lease: Lease,
                   time_left: float | None = None) -> tuple[MediaInput, ...]:
        """The parts' checked bytes, in order, within ``fetch_timeout`` (and ``time_left``, the request's
        own deadline); raises the first part's refusal. The bytes stay reserved in ``lease`` until the
        caller releases it."""
        for ref in refs:
            if ref.source is Source.REMOTE:
                fetch.check_host(ref, self.policy)
        window = self.policy.fetch_timeout if time_left is None else min(self.policy.fetch_timeout, time_left)
        deadline = asyncio.get_running_loop().time() + window
        try:
            out, total = [], 0
            for ref in refs:
                item = await self._one(ref, lease, self.policy.request_cap - total, deadline)
                total += len(item.data)
                out.append(item)
            return tuple(out)
        finally:
            lease.loaded()

    async def _one(self, ref: MediaRef, lease: Lease, request_left: int, deadline: float) -> MediaInput:
        cap = self.policy.cap(ref.kind.name)
        wanted = min(cap, request_left)
        granted = lease.reserve_upto(wanted, ref.field) if wanted > 0 else 0
        try:
            data = await self._bytes(ref, granted, deadline)
        except OverLimit as exc:
            lease.settle(granted, 0)
            raise self._too_large(ref, exc, cap, request_left, granted) from None
        except BaseException:
            lease.settle(granted, 0)
            raise
        lease.settle(granted, len(data))
        mime = await self._run(content.checked, ref, data, self.policy.max_image_pixels)
        return MediaInput(ref.kind.name, data, mime, _source(ref), ref.position)

    async def _bytes(self, ref: MediaRef, limit: int, deadline: float) -> bytes:
        if ref.source is Source.REMOTE:
            if deadline <= asyncio.get_running_loop().time():
                raise DownloadFailed(ref.field, ref.url, fetch.host_of(ref), "no time was left of the request's "
                                     f"{self.policy.fetch_timeout:g} s for media")
            return await fetch.fetch(ref, self.policy, limit, deadline, self._resolver)
        if ref.source is Source.LOCAL:
            return await self._run(local.read_local, ref, self.policy.root, limit)
        return await self._run(content.decode_inline, ref, limit)

    async def _run(self, func, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, func, *args)

    def _too_large(self, ref: MediaRef, exc: OverLimit, cap: int, request_left: int,
                   granted: int) -> MediaTooLarge | MediaBusy:
        """The error of the bound that ``exc`` passed: the part's cap, the request's, or the gate's."""
        inline = ref.source is Source.BASE64
        size = f"is {exc.size} bytes" if exc.declared else f"passed {granted} bytes (the download was cut there)"
        if granted >= cap:
            return MediaTooLarge(ref.field, f"{size}; an {ref.kind.name} may have at most {cap} bytes "
                                            f"({_CAP_NAMES[ref.kind.name]})", ref.url, inline=inline)
        if granted >= request_left:
            return MediaTooLarge(ref.field, f"{size}; the media of one request may have at most "
                                            f"{self.policy.request_cap} bytes in all, and "
                                            f"{max(request_left, 0)} were left", ref.url, inline=inline)
        return MediaBusy(f"{ref.field}: the server holds as much media as it may (maxMediaBufferMB); retry later")

    def close(self) -> None:
        for executor in (self._executor, self._dns):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)


def _source(ref: MediaRef) -> str:
    if ref.source in (Source.LOCAL, Source.REMOTE):
        return ref.location
    return ref.source.value
