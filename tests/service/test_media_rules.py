"""The media rules with I/O or state, one function at a time: public addresses, the whitelist from the
environment, the media gate, files under the root, and what the bytes must be (Pillow, container headers)."""
from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from service.config import ServerSettings
from service.media import content, local
from service.media.addresses import refusal
from service.media.errors import MediaBusy, MediaRefused, OverLimit
from service.media.gate import MediaGate
from service.media.kinds import BY_NAME
from service.media.parts import media_ref
from service.media.policy import MediaPolicy, allowed_domains
from tests.support.media import bomb_png, jpeg, mp4_header, png


@pytest.mark.parametrize("address, why", [
    ("8.8.8.8", None), ("93.184.216.34", None), ("2606:4700:4700::1111", None),
    ("127.0.0.1", "a loopback address"), ("127.255.0.9", "a loopback address"), ("::1", "a loopback address"),
    ("10.1.2.3", "a private address"), ("172.16.0.1", "a private address"), ("192.168.7.7", "a private address"),
    ("fd12::1", "a private address"), ("169.254.169.254", "a link-local address"),
    ("fe80::1%eth0", "a link-local address"), ("224.0.0.1", "a multicast address"), ("ff02::1", "a multicast address"),
    ("0.0.0.0", "an unspecified address"), ("::", "an unspecified address"),
    ("240.0.0.1", "a private address"),  # 240/4 is reserved; Python files it under private too
    ("100.64.0.1", "not a globally routable address"), ("192.0.2.5", "a private address"),
    ("::ffff:127.0.0.1", "(IPv4 127.0.0.1), which is a loopback address"),
    ("::ffff:10.0.0.1", "(IPv4 10.0.0.1), which is a private address"),
    ("2002:a9fe:a9fe::1", "(IPv4 169.254.169.254), which is a link-local address"),  # 6to4
    ("64:ff9b::7f00:1", "(IPv4 127.0.0.1), which is a loopback address"),  # NAT64
])
def test_only_public_addresses_pass(address, why):
    got = refusal(address)
    assert got == why if why is None else why in got, got


def test_the_test_allowance_is_loopback_only():
    assert refusal("127.0.0.1", allow_loopback=True) is None and refusal("::1", allow_loopback=True) is None
    assert "private" in refusal("10.0.0.1", allow_loopback=True)
    assert "link-local" in refusal("169.254.169.254", allow_loopback=True)


@pytest.mark.parametrize("value, hosts", [
    (None, set()), ("", set()), (" , ", set()), ("Media.Example.com", {"media.example.com"}),
    (" a.example , B.example,,", {"a.example", "b.example"}),
])
def test_the_whitelist_from_the_environment(value, hosts):
    environ = {} if value is None else {"ALLOWED_MEDIA_DOMAINS_ENV": value}
    assert allowed_domains(environ) == hosts
    assert MediaPolicy.from_settings(ServerSettings(), environ).domains == hosts


def test_the_policy_of_the_settings():
    policy = MediaPolicy.from_settings(ServerSettings(max_request_bytes=3 << 20, media_root="/srv/m/"))
    assert (policy.root, policy.cap("image"), policy.cap("audio"), policy.cap("video")) == (
        Path("/srv/m"), 3 << 20, 3 << 20, 512 << 20)
    assert policy.allow_loopback_for_tests is False and policy.domains == frozenset()


def test_the_gate_bounds_loads_and_bytes():
    gate = MediaGate(max_loads=2, max_bytes=100)
    first, second = gate.lease(), gate.lease()
    with pytest.raises(MediaBusy, match="maxMediaLoads"):
        gate.lease()
    assert first.reserve_upto(80, "inputs[0]") == 80
    first.settle(80, 30)
    assert second.reserve_upto(80, "inputs[0]") == 70  # what is free
    with pytest.raises(MediaBusy, match=r"inputs\[1\].*maxMediaBufferMB"):
        first.reserve_upto(10, "inputs[1]")
    first.loaded()
    assert gate.loading == 1 and gate.held == 100
    first.release()
    second.release()
    second.release()
    assert (gate.loading, gate.held) == (0, 0)


# --- local files ----------------------------------------------------------------------------------------

@pytest.fixture()
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "a.png").write_bytes(b"12345")
    (root / "sub" / "b.png").write_bytes(b"xy")
    (root / "link.png").symlink_to("sub/b.png")
    (tmp_path / "outside.png").write_bytes(b"no")
    (root / "out.png").symlink_to(tmp_path / "outside.png")
    return root


def _read(path: str, root: Path, limit: int = 100) -> bytes:
    return local.read_local(media_ref(BY_NAME["image"], path, "inputs[0]"), root, limit)


def test_files_under_the_root_are_read(root):
    assert _read("a.png", root) == b"12345"
    assert _read(str(root / "sub" / "b.png"), root) == b"xy"
    assert _read("link.png", root) == b"xy"  # a link that stays inside is fine


def test_a_root_that_is_a_link_is_followed(root, tmp_path):
    (tmp_path / "alias").symlink_to(root)
    assert _read(str(tmp_path / "alias" / "a.png"), tmp_path / "alias") == b"12345"


@pytest.mark.parametrize("path, fragment", [
    ("out.png", "leads out of the media root"), ("missing.png", "no such file"),
])
def test_files_that_break_a_rule(root, path, fragment):
    with pytest.raises(MediaRefused, match=fragment):
        _read(path, root)


def test_an_outside_absolute_path(root, tmp_path):
    with pytest.raises(MediaRefused, match="must be under the media root"):
        _read(str(tmp_path / "outside.png"), root)


def test_a_missing_root(tmp_path):
    with pytest.raises(MediaRefused, match="is not a directory on this server"):
        _read("a.png", tmp_path / "nothing")


def test_a_fifo_does_not_block(root):
    os.mkfifo(root / "f.png")
    with pytest.raises(MediaRefused, match="not a regular file"):
        _read("f.png", root)


def test_the_limit(root):
    assert _read("a.png", root, limit=5) == b"12345"
    with pytest.raises(OverLimit) as caught:
        _read("a.png", root, limit=4)
    assert (caught.value.size, caught.value.declared) == (5, True)


# --- content ---------------------------------------------------------------------------------------------

def _ref(kind: str, url: str = "x.png"):
    return media_ref(BY_NAME[kind], url, "inputs[0]")


def test_inline_data_decodes_within_its_limit():
    data = b"\x00\x01\x02\x03\x04"
    ref = _ref("image", "data:image/png;base64," + base64.b64encode(data).decode())
    assert content.decode_inline(ref, 5) == data
    with pytest.raises(OverLimit):
        content.decode_inline(ref, 4)


@pytest.mark.parametrize("data, mime", [(png(), "image/png"), (jpeg(), "image/jpeg")])
def test_images_that_decode(data, mime):
    assert content.checked(_ref("image"), data, 10_000) == mime


@pytest.mark.parametrize("data, fragment", [
    (b"GIF89a" + b"\x00" * 40, "not a JPEG or PNG image"),
    (png()[:40], "is not a valid image"),
    (jpeg(64, 64)[:200], "is not a valid image"),
    (bomb_png(200, 100), "is 200x100 = 20000 pixels; an image may have at most 10000 pixels"),
    (bomb_png(), "too large to decode safely"),
])
def test_images_that_do_not(data, fragment):
    with pytest.raises(MediaRefused, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        content.checked(_ref("image"), data, 10_000)


def test_a_gif_that_pillow_reads_is_not_parsed_as_one():
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (2, 2)).save(buf, format="GIF")
    with pytest.raises(MediaRefused, match="is not a valid image: not a JPEG or PNG image"):
        content.checked(_ref("image"), buf.getvalue(), 10_000)


@pytest.mark.parametrize("kind, data, mime", [
    ("video", mp4_header(), "video/mp4"),
    ("video", b"RIFF\x00\x00\x00\x00AVI LIST", "video/x-msvideo"),
    ("video", bytes.fromhex("3026b2758e66cf11a6d900aa0062ce6c") + b"\x00" * 8, "video/x-ms-wmv"),
    ("audio", b"RIFF\x00\x00\x00\x00WAVEfmt ", "audio/wav"),
    ("audio", b"fLaC\x00\x00\x00\x22", "audio/flac"),
    ("audio", b"ID3\x04\x00\x00", "audio/mpeg"),
    ("audio", b"\xff\xfb\x90\x64", "audio/mpeg"),
])
def test_containers_by_their_header(kind, data, mime):
    assert content.checked(_ref(kind, "x.mp4" if kind == "video" else "x.wav"), data, 0) == mime


@pytest.mark.parametrize("kind, data", [("video", png()), ("video", b"RIFX\x00\x00\x00\x00AVI "),
                                        ("audio", b"RIFF\x00\x00\x00\x00AVI "), ("audio", b"")])
def test_containers_that_are_not(kind, data):
    with pytest.raises(MediaRefused, match="its header matches none"):
        content.checked(_ref(kind, "x.mp4" if kind == "video" else "x.wav"), data, 0)


def test_the_service_kinds_are_the_backend_kinds():
    from backends.base import MEDIA_KINDS
    from service.media.kinds import KINDS

    assert tuple(kind.name for kind in KINDS) == MEDIA_KINDS


def test_the_loading_stand_in_forwards_media_and_kinds():
    from backends.settings import EngineConfig
    from backends.types import MediaInput, RequestParams
    from service.loading import LoadingBackend
    from tests.support.fake_backend import FakeBackend, Pace

    stand_in, fake = LoadingBackend("m", EngineConfig()), FakeBackend(Pace(tokens=1), media_kinds=frozenset({"image"}))
    assert stand_in.media_kinds == frozenset()
    stand_in.attach(fake)
    assert stand_in.media_kinds == frozenset({"image"})
    item = MediaInput("image", png(), "image/png", "a.png", 2)
    stand_in.submit("ab", RequestParams(max_new_tokens=1), media=(item,)).result(10)
    stand_in.submit("text only", RequestParams(max_new_tokens=1)).result(10)
    assert fake.media == [("ab", (item,))]
    assert "data=" not in repr(item)  # the bytes never show in a repr (logs)


def test_the_system_resolver_answers_from_its_own_threads():
    import asyncio
    import socket
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from service.media.fetch import SystemResolver

    names: list[str] = []
    executor = ThreadPoolExecutor(1, thread_name_prefix="test-dns", initializer=lambda: names.append(
        threading.current_thread().name))
    answers = asyncio.run(SystemResolver(executor=executor).resolve("127.0.0.1", 80, socket.AF_INET))
    assert answers == [(socket.AF_INET, ("127.0.0.1", 80))] and names[0].startswith("test-dns")
    executor.shutdown()
