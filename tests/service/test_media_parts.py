"""The part rules that need no I/O (service/media/parts.py): which source a reference names, its declared
type, the count and length caps, and where each part sits in the prompt."""
from __future__ import annotations

import base64

import pytest

from service.errors import ValidationError
from service.media.errors import MediaRefused
from service.media.kinds import BY_NAME
from service.media.parts import MAX_MEDIA_PARTS, MAX_URL_CHARS, Source, media_ref, media_refs

IMAGE, VIDEO, AUDIO = BY_NAME["image"], BY_NAME["video"], BY_NAME["audio"]
JPEG_B64 = base64.b64encode(b"\xff\xd8\xff\xe0" + b"\x00" * 60).decode()  # starts with "/9j/", like a path


@pytest.mark.parametrize("kind, url, source, mime, location", [
    (IMAGE, "/data/multimodal_inputs/cat.png", Source.LOCAL, "image/png", "/data/multimodal_inputs/cat.png"),
    (IMAGE, "cat.JPG", Source.LOCAL, "image/jpeg", "cat.JPG"),
    (IMAGE, "file:///data/multimodal_inputs/a%20b.jpeg", Source.LOCAL, "image/jpeg",
     "/data/multimodal_inputs/a b.jpeg"),
    (IMAGE, "file://localhost/m/c.png", Source.LOCAL, "image/png", "/m/c.png"),
    (IMAGE, "https://Media.Example/x/cat.png?size=2", Source.REMOTE, "image/png", "https://Media.Example/x/cat.png?size=2"),
    (VIDEO, "http://h/clip.MP4", Source.REMOTE, "video/mp4", "http://h/clip.MP4"),
    (AUDIO, "/m/a.flac", Source.LOCAL, "audio/flac", "/m/a.flac"),
    (IMAGE, "data:image/jpg;base64,QUJD", Source.DATA, "image/jpeg", "QUJD"),
    (IMAGE, "DATA:Image/PNG;base64,QU JD\n", Source.DATA, "image/png", "QUJD"),
    (AUDIO, "data:audio/x-wav;base64,QUJD", Source.DATA, "audio/wav", "QUJD"),
    (VIDEO, "data:video/x-msvideo;base64,QUJD", Source.DATA, "video/x-msvideo", "QUJD"),
    (IMAGE, JPEG_B64, Source.BASE64, "image/jpeg", JPEG_B64),
])
def test_sources_and_types(kind, url, source, mime, location):
    ref = media_ref(kind, url, "inputs[0]")
    assert (ref.source, ref.mime, ref.location, ref.url) == (source, mime, location, url)


@pytest.mark.parametrize("kind, url, fragment", [
    (IMAGE, "cat.gif", "image_url needs one of the image extensions .jpg, .jpeg, .png; got extension .gif"),
    (VIDEO, "/m/clip.mkv", "got extension .mkv"),
    (AUDIO, "/m/a.png", "audio extensions"),
    (IMAGE, "https://h/download?id=3", "got no extension"),
    (IMAGE, "../cat.png", "must not contain '..'"),
    (IMAGE, "/m/a/../../etc/x.png", "must not contain '..'"),
    (IMAGE, "file:///m/%2E%2E/x.png", "must not contain '..'"),
    (IMAGE, "/m/a\x00.png", "NUL"),
    (IMAGE, "file://evil/x.png", "not on host evil"),
    (IMAGE, "ftp://h/x.png", "scheme ftp: is not supported"),
    (IMAGE, "javascript:alert(1)", "scheme javascript: is not supported"),
    (VIDEO, JPEG_B64, "has no video extension"),  # bare base64 is for images only
    (IMAGE, "not base64!", "has no image extension"),
    (IMAGE, "http:///x.png", "needs a host"),
    (IMAGE, "http://h:99999/x.png", "is not a valid URL"),
    (IMAGE, "http://u:p@h/x.png", "must not carry credentials"),
    (IMAGE, "http://bücher.example/x.png", "must be ASCII"),
    (IMAGE, "data:image/png,abc", "must be base64"),
    (IMAGE, "data:text/html;base64,QUJD", "got text/html"),
    (AUDIO, "data:image/png;base64,QUJD", "audio media types"),
])
def test_refusals_name_the_part_and_the_rule(kind, url, fragment):
    with pytest.raises(MediaRefused) as caught:
        media_ref(kind, url, "inputs[3]")
    assert isinstance(caught.value, ValidationError)
    assert caught.value.message.startswith("inputs[3]") and fragment in caught.value.message


@pytest.mark.parametrize("url", [
    "https://h/" + "a" * (MAX_URL_CHARS - len("https://h/") - 4) + ".png",
    "/m/" + "a" * (MAX_URL_CHARS - 7) + ".png",
])
def test_url_length_cap(url):
    assert len(url) == MAX_URL_CHARS
    media_ref(IMAGE, url, "inputs[0]")
    with pytest.raises(MediaRefused, match=f"at most {MAX_URL_CHARS} characters, got {MAX_URL_CHARS + 1}"):
        media_ref(IMAGE, url[:5] + "b" + url[5:], "inputs[0]")


def test_inline_data_is_not_bound_by_the_url_length():
    url = "data:image/png;base64," + "QUJD" * 5000
    assert media_ref(IMAGE, url, "inputs[0]").source is Source.DATA


def test_a_data_url_is_shown_by_its_header_and_length_only():
    payload = base64.b64encode(b"secret content " * 10).decode()
    with pytest.raises(MediaRefused) as caught:
        media_ref(IMAGE, "data:image/gif;base64," + payload, "inputs[0]")
    assert payload[:20] not in caught.value.message and "characters)" in caught.value.message


def test_positions_count_the_text_before_each_part():
    refs = media_refs([("text", "ab"), ("image_url", "x.png"), ("text", "cde"), ("video_url", "v.mp4"),
                       ("image_url", "y.jpg")])
    assert [(r.field, r.kind.name, r.position) for r in refs] == [
        ("inputs[1]", "image", 2), ("inputs[3]", "video", 5), ("inputs[4]", "image", 5)]


def test_at_most_20_media_parts():
    parts = [("text", "t")] + [("image_url", "x.png")] * MAX_MEDIA_PARTS
    assert len(media_refs(parts)) == MAX_MEDIA_PARTS
    with pytest.raises(MediaRefused, match=r"^inputs\[21\]: a request may have at most 20 media parts"):
        media_refs(parts + [("audio_url", "a.wav")])
