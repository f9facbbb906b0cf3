"""Media ingress under attack, through real sockets: every case is one POST / with a hostile media part,
answered with its 4xx JSON error naming the part, the rule and the value; after each the servers are
healthy, no request holds a slot or media bytes, and the fake backend runs nothing.

Servers (one fake backend that takes images and video): ``strict`` is the deployment default (no
loopback) with a whitelist of test names mapped by a test resolver to hostile addresses; ``loopback``
adds the test-only loopback allowance, small caps and short timeouts, to reach the media HTTP server on
127.0.0.1; ``closed`` has no whitelist; ``text`` serves a text-only backend.
"""
from __future__ import annotations

import base64
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from service.media.loader import MediaLoader
from service.media.policy import MediaPolicy
from tests.support.fake_backend import FakeBackend, Pace
from tests.support.http import TIMEOUT, error_json, ok_json, post, until
from tests.support.media import MappedResolver, MediaSite, bomb_png, jpeg, mp4_header, png, start_media_site

CAP = 256 * 1024  # bytes of one image on these servers
NAMES = {  # what the test resolver answers for each whitelisted name
    "media.test": ["127.0.0.1"], "localhost": ["127.0.0.1"], "private.test": ["10.0.0.7"],
    "metadata.test": ["169.254.169.254"], "mapped.test": ["::ffff:127.0.0.1"], "six.test": ["::1"],
    "mixed.test": ["93.184.216.34", "192.168.0.9"], "multicast.test": ["224.0.0.251"],
    "zero.test": ["0.0.0.0"], "linklocal6.test": ["fe80::1"], "cgnat.test": ["100.64.0.1"],
    "127.0.0.1.nip.io": ["127.0.0.1"],
}
STRICT_HOSTS = frozenset({*NAMES, "127.0.0.1", "169.254.169.254", "192.168.1.10", "::1", "nowhere.test"})


@dataclass
class Server:
    url: str
    backend: FakeBackend
    loader: MediaLoader


@pytest.fixture(scope="module")
def media_root(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("media")
    root, outside = base / "root", base / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.png").write_bytes(png())
    (root / "ok.png").write_bytes(png(5, 4))
    (root / "photo.jpg").write_bytes(jpeg())
    (root / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 50)
    (root / "truncated.jpg").write_bytes(jpeg(64, 64)[:300])
    (root / "bomb.png").write_bytes(bomb_png())
    (root / "bomb-small.png").write_bytes(bomb_png(6000, 6000))
    (root / "big.png").write_bytes(png() + b"\x00" * CAP)
    (root / "fake.mp4").write_bytes(png())
    (root / "real.mp4").write_bytes(mp4_header())
    (root / "dir.png").mkdir()
    (root / "sub").mkdir()
    (root / "sub" / "inner.png").write_bytes(png(3, 3))
    (root / "inside-link.png").symlink_to(root / "sub" / "inner.png")
    (root / "out.png").symlink_to(outside / "secret.png")
    (root / "zero.png").symlink_to("/dev/zero")
    (root / "outdir").symlink_to(outside)
    os.mkfifo(root / "fifo.png")
    (root / "loop-a.png").symlink_to(root / "loop-b.png")
    (root / "loop-b.png").symlink_to(root / "loop-a.png")
    try:
        os.mknod(root / "zero-device.png", stat.S_IFCHR | 0o600, os.makedev(1, 5))  # a copy of /dev/zero
    except (PermissionError, OSError):
        pass
    return root


@pytest.fixture(scope="module")
def site(live_servers) -> tuple[MediaSite, int]:
    """The media HTTP server on 127.0.0.1, served by the live servers' loop."""
    return start_media_site(live_servers)


def _start(live_servers, policy: MediaPolicy, kinds=frozenset({"image", "video"})) -> Server:
    backend, loader = FakeBackend(Pace(tokens=2), media_kinds=kinds), MediaLoader(policy)
    return Server(live_servers.start(backend, media=loader), backend, loader)


@pytest.fixture(scope="module")
def servers(live_servers, media_root, site) -> dict[str, Server]:
    resolver = MappedResolver(table=NAMES)
    strict = MediaPolicy(root=media_root, domains=STRICT_HOSTS, image_cap=CAP, resolver=resolver)
    loopback = MediaPolicy(root=media_root, domains=frozenset({"media.test", "private.test"}), image_cap=CAP,
                           resolver=resolver,
                           connect_timeout=2.0, read_idle_timeout=0.5, fetch_timeout=2.0,
                           allow_loopback_for_tests=True)
    return {
        "strict": _start(live_servers, strict),
        "loopback": _start(live_servers, loopback),
        "closed": _start(live_servers, MediaPolicy(root=media_root)),
        "text": _start(live_servers, MediaPolicy(root=media_root), kinds=frozenset()),
    }


@pytest.fixture(autouse=True)
def stays_healthy(servers):
    """After each case: /health 200 everywhere, no slot in use, no media loading or held, nothing running."""
    yield
    for name, server in servers.items():
        assert requests.get(server.url + "/health", timeout=TIMEOUT).status_code == 200, name

        def idle(server: Server = server) -> bool:
            http = requests.get(server.url + "/info", timeout=TIMEOUT).json()["mindserve"]["http"]
            gate = server.loader.gate
            return http["slots_in_use"] == 0 and gate.loading == 0 and gate.held == 0 and server.backend.running == 0
        assert until(idle, 10, poll=0.05), (name, server.loader.gate.__dict__)


def image(url: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": url}}]


def refused(server: Server, inputs: list[dict[str, Any]], status: int, *fragments: str) -> str:
    """POST ``inputs``: the error reply (status, error.schema.json) whose message has every fragment; the
    backend got nothing."""
    error_type = {413: "Payload Too Large", 422: "Input Validation Error", 429: "Too Many Requests"}[status]
    submitted = len(server.backend.handles)
    message = error_json(post(server.url, {"inputs": inputs, "parameters": {"max_new_tokens": 2}}), status,
                         error_type)
    assert len(server.backend.handles) == submitted
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# --- remote: addresses --------------------------------------------------------------------------------

ADDRESS_CASES = [
    ("http://127.0.0.1/a.png", "127.0.0.1, which is a loopback address"),
    ("http://localhost/a.png", "127.0.0.1, which is a loopback address"),
    ("http://media.test/a.png", "host media.test resolves to 127.0.0.1, which is a loopback address"),
    ("http://127.0.0.1.nip.io/a.png", "127.0.0.1, which is a loopback address"),
    ("http://[::1]/a.png", "::1, which is a loopback address"),
    ("http://six.test/a.png", "::1, which is a loopback address"),
    ("http://mapped.test/a.png", "(IPv4 127.0.0.1), which is a loopback address"),
    ("http://private.test/a.png", "10.0.0.7, which is a private address"),
    ("http://192.168.1.10/a.png", "192.168.1.10, which is a private address"),
    ("http://mixed.test/a.png", "192.168.0.9, which is a private address"),
    ("http://metadata.test/latest/meta-data.png", "169.254.169.254, which is a link-local address"),
    ("http://169.254.169.254/latest/meta-data.png", "169.254.169.254, which is a link-local address"),
    ("http://linklocal6.test/a.png", "fe80::1, which is a link-local address"),
    ("http://multicast.test/a.png", "224.0.0.251, which is a multicast address"),
    ("http://zero.test/a.png", "0.0.0.0, which is an unspecified address"),
    ("http://cgnat.test/a.png", "100.64.0.1, which is not a globally routable address"),
]


@pytest.mark.parametrize("url, why", ADDRESS_CASES, ids=[c[0].split("/")[2] for c in ADDRESS_CASES])
def test_a_whitelisted_host_on_a_non_public_address_is_refused(servers, url, why):
    refused(servers["strict"], image(url), 422, "inputs[1]", url, why, "public addresses only")


def test_the_test_allowance_lets_loopback_through_and_nothing_else(servers, site):
    _, port = site
    refused(servers["loopback"], image("http://private.test/a.png"), 422, "10.0.0.7, which is a private address")
    # the strict server (no allowance) refuses the URL the loopback server fetches
    refused(servers["strict"], image(f"http://media.test:{port}/ok.png"), 422, "which is a loopback address")


# --- remote: the whitelist and the URL ------------------------------------------------------------------

@pytest.mark.parametrize("server, url, fragments", [
    ("strict", "http://evil.example/a.png", ["host evil.example is not on this server's media whitelist",
                                             "ALLOWED_MEDIA_DOMAINS_ENV"]),
    ("strict", "http://MEDIA.TEST.evil.example/a.png", ["not on this server's media whitelist"]),
    ("closed", "https://media.test/a.png", ["remote media are disabled on this server"]),
    ("strict", "http://user:secret@media.test/a.png", ["must not carry credentials"]),
    ("strict", "ftp://media.test/a.png", ["scheme ftp: is not supported"]),
    ("strict", "http://nowhere.test/a.png", ["download from host nowhere.test failed", "does not resolve"]),
], ids=["not-listed", "suffix-of-listed", "no-whitelist", "credentials", "ftp", "unresolvable"])
def test_remote_urls_outside_the_rules_are_refused(servers, server, url, fragments):
    refused(servers[server], image(url), 422, "inputs[1]", *fragments)


def test_a_url_of_4097_characters_is_refused(servers):
    url = "http://media.test/" + "a" * (4097 - len("http://media.test/") - 4) + ".png"
    assert len(url) == 4097
    refused(servers["strict"], image(url), 422, "inputs[1]", "at most 4096 characters, got 4097", url[:40])


# --- remote: what the host sends ----------------------------------------------------------------------

def test_a_redirect_is_not_followed(servers, site):
    _, port = site
    refused(servers["loopback"], image(f"http://media.test:{port}/redirect.png"), 422, "inputs[1]",
            "download from host media.test failed", "302", "169.254.169.254", "redirects are not followed")


def test_a_streamed_body_is_cut_at_the_cap(servers, site):
    media, port = site
    refused(servers["loopback"], image(f"http://media.test:{port}/endless.png"), 413, "inputs[1]",
            f"passed {CAP} bytes (the download was cut there)", f"at most {CAP} bytes (maxRequestLength)")
    assert until(lambda: media.cut.get("endless"), 10), media.__dict__
    assert media.sent["endless"] < 16 * 1024 * 1024  # it never got to send the whole body


def test_a_declared_oversize_body_is_refused_before_it_is_read(servers, site):
    _, port = site
    refused(servers["loopback"], image(f"http://media.test:{port}/declared.png"), 413, "inputs[1]",
            "is 1000000000000 bytes", f"at most {CAP} bytes")


@pytest.mark.parametrize("route, fragments", [
    ("stalled", ["download from host media.test failed", "no data for 0.5 s"]),
    ("silent", ["download from host media.test failed", "no data for 0.5 s"]),
    ("trickle", ["download from host media.test failed", "not complete in time", "of the request's 2 s for media"]),
    ("missing", ["download from host media.test failed", "it answered 404"]),
    ("gzip", ["Content-Encoding gzip; only identity is accepted"]),
    ("text", ["is not a valid image"]),
    ("raw-garbage", ["download from host media.test failed", "ended early or was not valid HTTP"]),
    ("raw-short", ["download from host media.test failed", "ended early or was not valid HTTP"]),
    ("raw-header", ["download from host media.test failed", "ended early or was not valid HTTP"]),
])
def test_a_misbehaving_host_is_refused(servers, site, route, fragments):
    _, port = site
    refused(servers["loopback"], image(f"http://media.test:{port}/{route}.png"), 422, "inputs[1]", *fragments)


def test_a_closed_port_names_the_host_and_the_reason(servers):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        refused(servers["loopback"], image(f"http://media.test:{port}/a.png"), 422, "inputs[1]",
                "download from host media.test failed: could not connect: Connection refused")


def test_a_whitelisted_image_is_fetched_and_handed_to_the_backend(servers, site):
    media, port = site
    server = servers["loopback"]
    before = len(server.backend.media)
    ok_json(post(server.url, {"inputs": image(f"http://media.test:{port}/ok.png"),
                              "parameters": {"max_new_tokens": 2}}))
    prompt, (item,) = server.backend.media[before]
    assert (prompt, item.kind, item.mime, item.data, item.position) == ("Describe ", "image", "image/png",
                                                                        media.image, len("Describe "))


# --- local files ---------------------------------------------------------------------------------------

def test_local_rules(servers, media_root):
    """The cases below in one place: each path and the rule it breaks."""
    outside = media_root.parent / "outside" / "secret.png"
    cases = [
        ("../outside/secret.png", 422, "must not contain '..'"),
        (f"{media_root}/../outside/secret.png", 422, "must not contain '..'"),
        (f"file://{media_root}/%2e%2e/outside/secret.png", 422, "must not contain '..'"),
        (str(outside), 422, "must be under the media root"),
        ("/etc/passwd.png", 422, "must be under the media root"),
        ("out.png", 422, "leads out of the media root"),
        ("outdir/secret.png", 422, "leads out of the media root"),
        ("zero.png", 422, "leads out of the media root"),
        ("fifo.png", 422, "is not a regular file"),
        ("dir.png", 422, "is a directory"),
        ("missing.png", 422, "no such file"),
        ("loop-a.png", 422, "Too many levels of symbolic links"),
        (f"file://otherhost{media_root}/ok.png", 422, "not on host otherhost"),
    ]
    for path, status, fragment in cases:
        refused(servers["strict"], image(path), status, "inputs[1]", fragment, path[:60])


def test_a_device_file_inside_the_root_is_refused(servers, media_root):
    if not (media_root / "zero-device.png").exists():
        pytest.skip("cannot create a device node here")
    refused(servers["strict"], image("zero-device.png"), 422, "inputs[1]", "is not a regular file")


def test_a_local_file_over_the_cap_is_refused(servers):
    refused(servers["strict"], image("big.png"), 413, "inputs[1]", f"at most {CAP} bytes (maxRequestLength)")


@pytest.mark.parametrize("path, fragment", [
    ("corrupt.png", "is not a valid image"),
    ("truncated.jpg", "is not a valid image"),
    ("bomb.png", "an image may have at most 33177600 pixels (a larger one could be a decompression bomb)"),
    ("bomb-small.png", "is 6000x6000 = 36000000 pixels; an image may have at most 33177600 pixels"),
])
def test_bad_images_are_refused(servers, path, fragment):
    message = refused(servers["strict"], image(path), 422, "inputs[1]", fragment)
    assert "garbage" not in message  # never the file's content


def test_a_video_that_is_not_a_video_is_refused(servers):
    inputs = [{"type": "video_url", "video_url": "fake.mp4"}]
    refused(servers["strict"], inputs, 422, "inputs[0]", "its header matches none")


@pytest.mark.parametrize("value, kind", [("photo.gif", "image_url"), ("clip.mkv", "video_url")])
def test_a_wrong_extension_is_refused(servers, value, kind):
    refused(servers["strict"], [{"type": kind, kind: value}], 422, "inputs[0]", "extension", value)


def test_local_files_and_inline_data_reach_the_backend(servers, media_root):
    server = servers["strict"]
    data = (media_root / "photo.jpg").read_bytes()
    inputs = [{"type": "image_url", "image_url": "ok.png"}, {"type": "text", "text": "and"},
              {"type": "image_url", "image_url": {"url": f"file://{media_root}/inside-link.png"}},
              {"type": "image_url", "image_url": "data:image/jpeg;base64," + base64.b64encode(data).decode()},
              {"type": "image_url", "image_url": base64.b64encode(data).decode()},
              {"type": "video_url", "video_url": str(media_root / "real.mp4")}]
    before = len(server.backend.media)
    ok_json(post(server.url, {"inputs": inputs, "parameters": {"max_new_tokens": 2}}))
    prompt, items = server.backend.media[before]
    assert prompt == "and"
    assert [(i.kind, i.mime, i.position) for i in items] == [
        ("image", "image/png", 0), ("image", "image/png", 3), ("image", "image/jpeg", 3), ("image", "image/jpeg", 3),
        ("video", "video/mp4", 3)]
    assert items[0].data == (media_root / "ok.png").read_bytes() and items[2].data == items[3].data == data


# --- inline data and counts -------------------------------------------------------------------------------

@pytest.mark.parametrize("url, status, fragments", [
    ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", 422, ["needs one of the image media types", "got image/gif"]),
    ("data:image/png,rawbytes", 422, ["must be base64"]),
    ("data:image/png;base64," + base64.b64encode(b"not a png" * 20).decode(), 422, ["is not a valid image"]),
    ("data:image/png;base64," + base64.b64encode(b"\x00" * (CAP + 1)).decode(), 413, [f"is {CAP + 1} bytes"]),
    ("data:image/png;base64,****", 422, ["is not valid base64"]),
])
def test_bad_inline_data_is_refused(servers, url, status, fragments):
    message = refused(servers["strict"], image(url), status, "inputs[1]", *fragments)
    assert url[30:60] not in message or len(url) < 60  # the payload is never echoed


def test_21_media_parts_are_refused(servers):
    inputs = [{"type": "image_url", "image_url": "ok.png"} for _ in range(21)]
    refused(servers["strict"], inputs, 422, "inputs[20]", "at most 20 media parts")


def test_20_media_parts_are_accepted(servers):
    ok_json(post(servers["strict"].url, {"inputs": [{"type": "image_url", "image_url": "ok.png"}] * 20,
                                         "parameters": {"max_new_tokens": 1}}))


# --- the model's part types ---------------------------------------------------------------------------

def test_a_text_only_model_refuses_a_media_part_by_its_type(servers):
    refused(servers["text"], image("ok.png"), 422, 'inputs[1] has type "image_url", which this model does not '
                                                   'accept (accepted part types: text)')


def test_a_part_type_the_model_lacks_is_refused(servers):
    refused(servers["strict"], [{"type": "audio_url", "audio_url": "a.wav"}], 422,
            'inputs[0] has type "audio_url"', "accepted part types: text, image_url, video_url")


def test_info_lists_the_accepted_part_types(servers):
    def listed(name: str) -> list[str]:
        return requests.get(servers[name].url + "/info", timeout=TIMEOUT).json()["mindserve"]["accepted_part_types"]
    assert listed("strict") == ["text", "image_url", "video_url"]
    assert listed("text") == ["text"]


# --- the client leaving -------------------------------------------------------------------------------

def test_a_client_leaving_during_a_download_frees_everything(servers, site):
    """The autouse check afterwards is the assertion: the download is dropped, nothing stays held."""
    media, port = site
    server = servers["loopback"]
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(server.url, json={"inputs": image(f"http://media.test:{port}/trickle.png")}, timeout=0.3)


# --- DNS rebinding and the process-wide bounds ------------------------------------------------------------

class RebindingResolver(MappedResolver):
    """media.test is 127.0.0.1 at the first lookup and 10.0.0.9 at every later one."""

    def initialize(self, table: dict[str, list[str]]) -> None:  # type: ignore[override]
        super().initialize(table)
        self.calls = 0

    async def resolve(self, host: str, port: int, family: socket.AddressFamily = socket.AF_UNSPEC):
        self.calls += 1
        if self.calls > 1:
            self.table = {**self.table, "media.test": ["10.0.0.9"]}
        return await super().resolve(host, port, family)


def test_the_connection_goes_to_the_address_that_was_checked(live_servers, servers, media_root, site):
    """No second lookup between the check and the connection: a rebinding name cannot swap the address."""
    media, port = site
    resolver = RebindingResolver(table={"media.test": ["127.0.0.1"]})
    server = _start(live_servers, MediaPolicy(root=media_root, domains=frozenset({"media.test"}), resolver=resolver,
                                              allow_loopback_for_tests=True))
    servers["rebinding"] = server  # checked after the test like the others
    ok_json(post(server.url, {"inputs": image(f"http://media.test:{port}/ok.png"),
                              "parameters": {"max_new_tokens": 1}}))
    assert resolver.calls == 1
    assert server.backend.media[-1][1][0].data == media.image
    refused(server, image(f"http://media.test:{port}/ok.png"), 422, "10.0.0.9, which is a private address")


def test_a_request_over_the_media_loads_bound_gets_429(live_servers, servers, media_root, site):
    import threading

    _, port = site
    server = _start(live_servers, MediaPolicy(root=media_root, domains=frozenset({"media.test"}),
                                              resolver=MappedResolver(table=NAMES), fetch_timeout=2.0,
                                              allow_loopback_for_tests=True, max_loads=1))
    servers["one-load"] = server
    slow = threading.Thread(target=post, args=(server.url, {"inputs": image(f"http://media.test:{port}/trickle.png")}))
    slow.start()
    assert until(lambda: server.loader.gate.loading == 1, 10)
    refused(server, image("ok.png"), 429, "loading media for 1 requests", "maxMediaLoads")
    slow.join(30)
    ok_json(post(server.url, {"inputs": image("ok.png"), "parameters": {"max_new_tokens": 1}}))


def test_a_part_over_the_media_buffer_gets_429(live_servers, servers, media_root):
    server = _start(live_servers, MediaPolicy(root=media_root, max_held_bytes=100))
    servers["small-buffer"] = server
    refused(server, image("photo.jpg"), 429, "inputs[1]", "maxMediaBufferMB")
    assert server.loader.gate.held == 0


@pytest.mark.skipif(__import__("shutil").which("curl") is None, reason="curl is not installed")
def test_the_readme_media_example_answers_what_it_says(servers):
    import json
    import re
    import subprocess

    from tests.support.paths import REPO

    section = re.search(r"^## Images and other media\n(.*?)(?=^## )", (REPO / "README.md").read_text(encoding="utf-8"),
                        re.S | re.M).group(1)
    (script,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    done = subprocess.run(["bash", "-e", "-c", script], env={**os.environ, "URL": servers["text"].url},
                          capture_output=True, text=True, timeout=TIMEOUT)
    claimed = json.loads(re.search(r"answers `(\{.*?\})`", section, re.S).group(1))
    assert json.loads(done.stdout) == claimed


def test_a_stream_request_with_a_bad_part_gets_a_json_error_not_a_stream(servers):
    reply = post(servers["strict"].url, {"inputs": image("out.png"), "stream": True})
    assert "leads out of the media root" in error_json(reply, 422, "Input Validation Error")


def test_a_stream_request_with_media_streams(servers):
    from tests.support.http import stream_events

    reply = post(servers["strict"].url, {"inputs": image("photo.jpg"), "stream": True,
                                         "parameters": {"max_new_tokens": 2}}, stream=True)
    assert len(stream_events(reply)) == 2


def test_the_requests_own_deadline_bounds_its_downloads(live_servers, servers, media_root, site):
    from service.config import ServerSettings

    _, port = site
    backend = FakeBackend(Pace(tokens=1), media_kinds=frozenset({"image"}))
    loader = MediaLoader(MediaPolicy(root=media_root, domains=frozenset({"media.test"}),
                                     resolver=MappedResolver(table=NAMES), allow_loopback_for_tests=True))
    server = Server(live_servers.start(backend, ServerSettings(e2e_timeout=1.0), media=loader), backend, loader)
    servers["short-e2e"] = server
    refused(server, image(f"http://media.test:{port}/trickle.png"), 422, "not complete in time",
            "of the request's 60 s for media")


def test_the_system_resolver_is_checked_the_same_way(live_servers, servers, media_root):
    """No test resolver: the system's own lookup of localhost (/etc/hosts) is vetted like any other, and a
    name it cannot even encode is a download failure, not a crash."""
    bad = "a" * 64 + ".example"
    server = _start(live_servers, MediaPolicy(root=media_root, domains=frozenset({"localhost", bad})))
    servers["system-dns"] = server
    refused(server, image("http://localhost/a.png"), 422, "host localhost resolves to", "which is a loopback address")
    refused(server, image(f"http://{bad}/a.png"), 422, f"download from host {bad} failed: its name does not resolve")
