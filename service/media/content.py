"""What a media part's bytes must be: inline base64 that decodes; an image Pillow decodes in full (JPEG or
PNG, at most ``max_pixels``, so no decompression bomb is ever expanded); a video or audio file whose
header is one of its kind's containers. Blocking (Pillow): the loader runs it on its executor."""
from __future__ import annotations

import base64
import binascii
import io
import warnings

from PIL import Image, UnidentifiedImageError

from service.errors import ServiceError
from service.media.errors import OverLimit
from service.media.parts import MediaRef

IMAGE_FORMATS = {"JPEG": "image/jpeg", "PNG": "image/png"}
_PILLOW_FORMATS = tuple(IMAGE_FORMATS)
# (media type, byte offset, signature) of each container a kind accepts.
_SIGNATURES = {
    "video": (("video/mp4", 4, b"ftyp"), ("video/x-msvideo", 8, b"AVI "),
              ("video/x-ms-wmv", 0, bytes.fromhex("3026b2758e66cf11a6d900aa0062ce6c"))),
    "audio": (("audio/wav", 8, b"WAVE"), ("audio/flac", 0, b"fLaC"), ("audio/mpeg", 0, b"ID3")),
}
_RIFF = {"video/x-msvideo", "audio/wav"}  # RIFF containers: "RIFF" at 0, the form type at 8


def decode_inline(ref: MediaRef, limit: int) -> bytes:
    """The bytes of a data: URL or bare base64 part; ``OverLimit`` when they would pass ``limit``."""
    size = len(ref.location) // 4 * 3 - ref.location[-2:].count("=")
    if size > limit:
        raise OverLimit(size, declared=True)
    try:
        return base64.b64decode(ref.location, validate=True)
    except (binascii.Error, ValueError):
        raise ref.refused("is not valid base64") from None


def checked(ref: MediaRef, data: bytes, max_pixels: int) -> str:
    """The content's own media type; refuses content that is not what the part's kind accepts."""
    if ref.kind.name == "image":
        return _checked_image(ref, data, max_pixels)
    for mime, offset, signature in _SIGNATURES[ref.kind.name]:
        if data[offset:offset + len(signature)] == signature and (mime not in _RIFF or data[:4] == b"RIFF"):
            return mime
    if ref.kind.name == "audio" and len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0:
        return "audio/mpeg"  # an MPEG audio frame without an ID3 tag
    names = ", ".join(mime for mime, _, _ in _SIGNATURES[ref.kind.name])
    raise ref.refused(f"is not a {ref.kind.name} file this server reads ({names}): its header matches none")


def _checked_image(ref: MediaRef, data: bytes, max_pixels: int) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=_PILLOW_FORMATS) as image:  # no other format's parser runs
                fmt, (width, height) = image.format, image.size
                if width * height > max_pixels:
                    raise ref.refused(f"is {width}x{height} = {width * height} pixels; {_bomb(max_pixels)}")
                image.verify()
            with Image.open(io.BytesIO(data), formats=_PILLOW_FORMATS) as image:
                image.load()  # verify() checks the structure; decoding every pixel finds a truncated image
    except ServiceError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # Pillow's check, at open
        raise ref.refused(f"is too large to decode safely; {_bomb(max_pixels)}") from None
    except Exception as exc:  # noqa: BLE001 - whatever a crafted file makes Pillow raise is a bad image
        raise ref.refused(f"is not a valid image: {_reason(exc)}") from None
    return IMAGE_FORMATS[fmt]


def _bomb(max_pixels: int) -> str:
    return f"an image may have at most {max_pixels} pixels (a larger one could be a decompression bomb)"


def _reason(exc: Exception) -> str:
    if isinstance(exc, UnidentifiedImageError):
        return "not a JPEG or PNG image"
    return str(exc).split("\n", 1)[0][:200] or type(exc).__name__
