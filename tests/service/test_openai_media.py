"""OpenAI chat image_url parts: parsed into media references naming messages[i].content[j] (a text-only model
refuses them by type), each a private-use mark in the rendered prompt until ``place_media`` turns the marks into
the loaded parts' positions."""
from __future__ import annotations

import pytest

from backends.errors import InputRejected
from backends.types import MediaInput
from service.dialects.openai import MEDIA_MARK, InvalidRequest, parse_openai_request
from service.media.errors import MediaRefused
from service.validation import default_schemas

SCHEMAS = default_schemas()
MODEL = "m"
IMAGE = {"type": "image_url", "image_url": {"url": "cat.png", "detail": "low"}}


def chat(messages: list[dict], media_types=frozenset({"image_url", "video_url"})):
    return parse_openai_request("chat", {"model": MODEL, "messages": messages}, SCHEMAS, MODEL, (), media_types)


def test_image_parts_become_marks_and_references():
    req = chat([{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Look: "}, IMAGE,
                                             {"type": "image_url", "image_url": "data:image/png;base64,iVBORw0KGgo="},
                                             {"type": "text", "text": " and say."}]}])
    assert req.messages[1]["content"] == f"Look: {MEDIA_MARK}{MEDIA_MARK} and say."
    assert [(r.field, r.url[:12]) for r in req.media] == [("messages[1].content[1]", "cat.png"),
                                                          ("messages[1].content[2]", "data:image/p")]


def test_a_text_only_model_refuses_an_image_part_by_its_type():
    with pytest.raises(InvalidRequest) as info:
        chat([{"role": "user", "content": [{"type": "text", "text": "a"}, IMAGE]}], frozenset())
    assert info.value.param == "messages[0].content[1].type"
    assert str(info.value) == ('messages[0].content[1] has type "image_url", which this model does not accept '
                               "(accepted part types: text)")


def test_a_bad_url_is_refused_naming_the_part():
    with pytest.raises(MediaRefused, match=r"^messages\[0\]\.content\[0\] "):
        chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}]}])


def test_the_reserved_mark_in_a_request_with_images_is_refused():
    with pytest.raises(InvalidRequest, match=r"U\+E000") as info:
        chat([{"role": "user", "content": [{"type": "text", "text": f"x{MEDIA_MARK}"}, IMAGE]}])
    assert info.value.param == "messages[0].content"
    assert chat([{"role": "user", "content": f"no images {MEDIA_MARK}"}]).messages[0]["content"].endswith(MEDIA_MARK)


def test_at_most_twenty_media_parts():
    with pytest.raises(InvalidRequest, match="at most 20 media parts; this is media part 21") as info:
        chat([{"role": "user", "content": [IMAGE] * 21}])
    assert info.value.param == "messages[0].content[20]"


def _loaded(n: int) -> tuple[MediaInput, ...]:
    return tuple(MediaInput("image", b"png", "image/png", f"{i}.png") for i in range(n))


def test_place_media_removes_the_marks_and_places_each_part():
    req = chat([{"role": "user", "content": [{"type": "text", "text": "ab"}, IMAGE, {"type": "text", "text": "c"},
                                             IMAGE]}])
    rendered = f"<u>ab{MEDIA_MARK}c{MEDIA_MARK}</u>"
    prompt, media = req.place_media(rendered, _loaded(2))
    assert prompt == "<u>abc</u>" and [m.position for m in media] == [5, 6]
    assert [m.source for m in media] == ["0.png", "1.png"]
    with pytest.raises(InputRejected, match="kept 1 of the 2 image parts"):
        req.place_media(f"ab{MEDIA_MARK}", _loaded(2))
    assert req.place_media("plain", ()) == ("plain", ())
