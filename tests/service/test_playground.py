"""The playground's pure parts: which ``Accept`` headers ask for the page, the packaged files, and that the
page loads nothing from elsewhere and calls the server by relative URLs only."""
from __future__ import annotations

import re

import pytest

from service.package_data import STATIC_DIR
from service.playground import PAGE, load_assets, wants_html

BROWSERS = {  # the Accept header a top-level navigation sends
    "chromium": "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,image/apng,*/*;q=0.8,"
                "application/signed-exchange;v=b3;q=0.7",
    "firefox": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8",
    "safari": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8",
}


@pytest.mark.parametrize("accept", BROWSERS.values(), ids=BROWSERS)
def test_a_browser_navigation_asks_for_html(accept):
    assert wants_html(accept)


@pytest.mark.parametrize("accept, html", [
    (None, False),  # no header at all
    ("", False),
    ("*/*", False),  # curl, requests, the HF client
    ("application/json", False),
    ("text/*", False),  # not an explicit request for the page
    ("text/html", True),
    ("TEXT/HTML", True),
    ("application/xhtml+xml", True),
    ("text/html;q=0", False),  # refused explicitly
    ("text/html;q=0.5, application/json", False),  # JSON preferred
    ("application/json;q=0.4, text/html;q=0.5", True),
    ("application/json, text/html", False),  # a tie goes to the API's own answer
    ("text/html;q=abc", False),  # a broken q counts as 0
    ("text/html ; q=0.8 , */*;q=0.1", True),
])
def test_accept_table(accept, html):
    assert wants_html(accept) is html


def test_the_package_ships_the_page_and_its_files():
    assets = load_assets()
    assert {PAGE, "playground.css", "playground.js", "chat.js", "schema_form.js", "sse.js"} <= set(assets)
    assert assets[PAGE].content_type.startswith("text/html")
    assert assets["playground.js"].content_type.startswith("text/javascript")
    assert assets["playground.css"].content_type.startswith("text/css")


def test_a_missing_page_is_named(tmp_path):
    (tmp_path / "playground.css").write_text("")
    with pytest.raises(FileNotFoundError, match=PAGE):
        load_assets(tmp_path)


def _static_texts() -> dict[str, str]:
    return {entry.name: entry.read_text(encoding="utf-8") for entry in STATIC_DIR.iterdir()
            if entry.name.endswith((".html", ".css", ".js"))}


def test_nothing_is_loaded_from_elsewhere():
    """No CDN, no absolute URL: the page works offline, over HTTPS and behind a proxy's path prefix."""
    for name, text in _static_texts().items():
        code = re.sub(r"/\*.*?\*/|<!--.*?-->|(?m:(?:^|\s)// .*$)", "", text, flags=re.S)  # comments may say "//"
        assert not re.search(r"https?:|[\"'`(]//", code), name
        for url in re.findall(r"""(?:src|href)=["']([^"']+)""", text):
            assert url.startswith(("playground/", "data:")), (name, url)
        for url in re.findall(r"""(?:fetch|import)\(\s*["'`]([^"'`]+)""", text) + \
                re.findall(r"""from\s+["']([^"']+)""", text):
            assert not url.startswith("/") and ":" not in url, (name, url)


def test_the_page_calls_the_business_routes_only():
    """POST /, /v1/chat/completions, /openapi.json and /v1/models are on the business port; /info and /health
    may be elsewhere."""
    calls = set()
    for text in _static_texts().values():
        calls |= set(re.findall(r"""(?:fetch|postJson)\(\s*["'`]([^"'`]+)""", text))
    assert calls == {"./", "openapi.json", "v1/models", "v1/chat/completions"}
