"""A Qwen2-VL model served on a real socket (the tiny random checkpoint, tests/support/make_tiny_qwen2_vl.py):
POST / with media parts (a local file under the media root, a data: URL, a whitelisted URL served by the test
HTTP server on 127.0.0.1 with the test-only loopback allowance) returns HF transformers' golden greedy ids;
text-only requests still work, an audio part is a 422, /info lists the accepted part types, and no request is
left holding a slot.
"""
from __future__ import annotations

import base64
import shutil
from pathlib import Path

import pytest
import requests

from service.media.loader import MediaLoader
from service.media.policy import MediaPolicy
from tests.support.http import TIMEOUT, error_json, ok_json, post, stream_events, until
from tests.support.make_tiny_qwen2_vl import make_tiny_qwen2_vl
from tests.support.media import MappedResolver, MediaSite, start_media_site
from tests.support.vl_requests import golden, golden_request, write_golden_clip

pytestmark = pytest.mark.slow
ARCH = "qwen2_vl"
GREEDY = {"max_new_tokens": 16, "do_sample": False, "details": True}


@pytest.fixture(scope="module")
def media_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vl_media")
    write_golden_clip(root / "clip.mp4")
    return root


@pytest.fixture(scope="module")
def vl_engine(tmp_path_factory):
    from backends.mindspore.engine.engine import Engine
    from backends.settings import EngineConfig

    model_dir = make_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_vl_http") / ARCH, arch=ARCH)
    config = EngineConfig(max_seq_len=256, max_input_tokens=200, max_batch_size=4, max_iter_times=64, block_size=16,
                          prefill_chunk=32, window_buckets=(256,), batch_buckets=(1, 4), threads=2)
    with Engine(model_dir, config) as engine:
        yield engine


@pytest.fixture(scope="module")
def site_port(live_servers) -> tuple[MediaSite, int]:
    """The test media HTTP server on 127.0.0.1 (its /ok.png serves ``site.image``)."""
    return start_media_site(live_servers)


@pytest.fixture(scope="module")
def url(live_servers, vl_engine, media_root):
    policy = MediaPolicy(root=media_root, domains=frozenset({"media.test"}),
                         resolver=MappedResolver(table={"media.test": ["127.0.0.1"]}), allow_loopback_for_tests=True)
    return live_servers.start(vl_engine, media=MediaLoader(policy))


@pytest.fixture(autouse=True)
def leaves_no_slot(request):
    """After each case the server is healthy and no request holds a slot."""
    yield
    if "url" not in request.fixturenames:
        return
    url = request.getfixturevalue("url")
    assert requests.get(url + "/health", timeout=TIMEOUT).status_code == 200

    def idle() -> bool:
        return requests.get(url + "/info", timeout=TIMEOUT).json()["mindserve"]["http"]["slots_in_use"] == 0
    assert until(idle, 10, poll=0.05)


def inputs(name: str, urls: list[str], clip: Path) -> list[dict]:
    """The golden prompt ``name`` as TGI parts, its media given by ``urls`` in order."""
    req = golden_request(ARCH, name, clip)
    parts, at = [], 0
    for (kind, position, _), link in zip(req.parts, urls):
        if position > at:
            parts.append({"type": "text", "text": req.text[at:position]})
        parts.append({"type": f"{kind}_url", f"{kind}_url": {"url": link}})
        at = position
    return [*parts, {"type": "text", "text": req.text[at:]}]


def generated_ids(url: str, parts: list[dict]) -> list[int]:
    body = ok_json(post(url, {"inputs": parts, "parameters": GREEDY}))
    return [t["id"] for t in body["details"]["tokens"]]


def _image_files(name: str, media_root: Path) -> list[Path]:
    """The golden images of ``name``, copied under the media root."""
    req = golden_request(ARCH, name, media_root / "clip.mp4")
    out = []
    for kind, _, path in req.parts:
        target = media_root / path.name
        if kind == "image" and not target.exists():
            shutil.copy(path, target)
        out.append(target)
    return out


@pytest.mark.parametrize("name", ["one_image", "two_images", "video"])
def test_local_files_under_the_media_root_give_the_golden_ids(url, media_root, name):
    links = [str(p) for p in _image_files(name, media_root)]
    want = golden(ARCH)["prompts"][name]["greedy_ids"]
    assert generated_ids(url, inputs(name, links, media_root / "clip.mp4")) == want


def test_data_url_gives_the_golden_ids(url, media_root):
    (path,) = _image_files("one_image", media_root)
    link = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    assert generated_ids(url, inputs("one_image", [link], path)) == golden(ARCH)["prompts"]["one_image"]["greedy_ids"]


def test_whitelisted_url_gives_the_golden_ids(url, media_root, site_port):
    site, port = site_port
    (path,) = _image_files("one_image", media_root)
    site.image = path.read_bytes()
    link = f"http://media.test:{port}/ok.png"
    assert generated_ids(url, inputs("one_image", [link], path)) == golden(ARCH)["prompts"]["one_image"]["greedy_ids"]


def test_generate_stream_streams_the_golden_ids(url, media_root):
    links = [str(p) for p in _image_files("two_images", media_root)]
    reply = post(url, {"inputs": inputs("two_images", links, media_root / "clip.mp4"), "parameters": GREEDY},
                 path="/generate_stream", stream=True)
    ids = [event["token"]["id"] for event in stream_events(reply)]
    ids = [i[0] if isinstance(i, list) else i for i in ids]  # tokenIdFormat list (the default): [id]
    assert ids == golden(ARCH)["prompts"]["two_images"]["greedy_ids"]


def test_text_only_requests_still_work(url):
    body = ok_json(post(url, {"inputs": "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
                              "parameters": {"max_new_tokens": 5, "do_sample": False, "details": True}}))
    assert body["details"]["generated_tokens"] == 5


def test_audio_part_is_a_422_naming_the_type(url):
    reply = post(url, {"inputs": [{"type": "text", "text": "Listen "},
                                  {"type": "audio_url", "audio_url": {"url": "/nowhere/a.wav"}}]})
    message = error_json(reply, 422, "Input Validation Error")
    assert "audio_url" in message and "image_url" in message


def test_info_lists_the_accepted_part_types(url):
    info = requests.get(url + "/info", timeout=TIMEOUT).json()
    assert info["mindserve"]["accepted_part_types"] == ["text", "image_url", "video_url"]


def test_a_media_error_the_ingress_lets_through_is_a_422(url, media_root):
    """A literal placeholder token in the text with no image for it: the engine's 422, the server healthy."""
    reply = post(url, {"inputs": "look <|vision_start|><|image_pad|><|vision_end|>", "parameters": GREEDY})
    assert "more image placeholders than images" in error_json(reply, 422, "Input Validation Error")


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_readme_vision_example_answers_what_it_says(url):
    """README's "Vision-language models" curl, run from the repository root against this server."""
    import json
    import os
    import re
    import subprocess

    from tests.support.paths import REPO

    section = re.search(r"^## Vision-language models\n(.*?)(?=^## )", (REPO / "README.md").read_text(encoding="utf-8"),
                        re.S | re.M).group(1)
    (script,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    done = subprocess.run(["bash", "-e", "-c", script], env={**os.environ, "URL": url}, cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT)
    claimed = json.loads(re.search(r"answers `(\[.*?\])`", section, re.S).group(1))
    assert json.loads(done.stdout) == claimed


def test_mindserve_serve_a_qwen2_vl_model_directory(tmp_path, media_root):
    """``mindserve serve --config`` on the tiny checkpoint's directory (its predict yaml): an image as a
    data: URL gives the golden ids; SIGTERM exits 0."""
    import signal

    import yaml

    from tests.support.cli import server_config
    from tests.support.served import Served

    model_dir = make_tiny_qwen2_vl(tmp_path / ARCH, arch=ARCH)
    config = server_config(model_dir, mediaRoot=str(media_root))
    deploy = config["BackendConfig"]["ModelDeployConfig"]
    deploy.update({"maxSeqLen": 256, "maxInputTokenLen": 200})
    config["BackendConfig"]["ScheduleConfig"]["windowBuckets"] = [256]
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(config))
    served = Served(path)
    try:
        url = served.wait_url()
        assert "vision warm-up done" in served.text()
        (image,) = _image_files("one_image", media_root)
        link = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
        want = golden(ARCH)["prompts"]["one_image"]["greedy_ids"]
        assert generated_ids(url, inputs("one_image", [link], image)) == want
        info = requests.get(url + "/info", timeout=TIMEOUT).json()
        assert info["mindserve"]["accepted_part_types"] == ["text", "image_url", "video_url"]
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(60) == 0
    finally:
        served.stop()


def test_openai_chat_with_text_parts_works(url, vl_engine):
    """/v1/chat/completions (text parts only: the OpenAI routes take no media) renders the model's Qwen2-VL chat
    template (its default system turn) and generates."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    reply = requests.post(url + "/v1/chat/completions", json={"model": vl_engine.model_name, "messages": messages,
                                                              "max_tokens": 4, "temperature": 0}, timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    prompt = vl_engine.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert reply.json()["usage"]["prompt_tokens"] == vl_engine.count_tokens(prompt)


def test_lora_on_a_qwen2_vl_model_is_refused_before_start_up(tmp_path):
    import yaml

    from tests.support.cli import run_cli, server_config

    model_dir = make_tiny_qwen2_vl(tmp_path / ARCH, arch=ARCH)
    config = server_config(model_dir)
    config["BackendConfig"]["ModelDeployConfig"].update(allowRuntimeLoraUpdating=True, loraRoot=str(tmp_path))
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(config))
    out = run_cli("validate-config", str(path))
    assert out.returncode == 2, out.stderr
    assert ("LoraModules: LoRA adapters are not supported for a vision-language model "
            "(Qwen2VLForConditionalGeneration)") in out.stderr and "Traceback" not in out.stderr


def _chat(url: str, model: str, content: list[dict], **extra) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", json={"model": model, "temperature": 0, "max_tokens": 16,
                                                              "messages": [{"role": "user", "content": content}],
                                                              **extra}, timeout=TIMEOUT)


def test_openai_chat_image_parts_give_the_golden_text(url, vl_engine, media_root):
    """/v1/chat/completions with image_url parts (a data: URL, a local path) renders the chat template with each
    image where its part was: the golden prompt, the golden greedy text."""
    a, = _image_files("one_image", media_root)
    b, c = _image_files("two_images", media_root)
    data = "data:image/png;base64," + base64.b64encode(a.read_bytes()).decode()
    cases = {"one_image": [{"type": "image_url", "image_url": {"url": data, "detail": "auto"}},
                           {"type": "text", "text": "Describe the picture."}],
             "two_images": [{"type": "image_url", "image_url": str(b)},
                            {"type": "image_url", "image_url": {"url": str(c)}},
                            {"type": "text", "text": "Compare the two images."}]}
    for name, content in cases.items():
        want = golden(ARCH)["prompts"][name]
        reply = _chat(url, vl_engine.model_name, content)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == len(want["input_ids"])
        assert reply.json()["choices"][0]["message"]["content"] == vl_engine.tokenizer.decode(want["greedy_ids"])


def test_openai_chat_media_errors_are_400s_naming_the_part(url, vl_engine):
    outside = _chat(url, vl_engine.model_name, [{"type": "text", "text": "Look "},
                                                {"type": "image_url", "image_url": {"url": "/etc/passwd.png"}}])
    assert outside.status_code == 400
    error = outside.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("messages[0].content[1] ")
    video = _chat(url, vl_engine.model_name, [{"type": "video_url", "video_url": {"url": "clip.mp4"}}])
    assert video.status_code == 400 and video.json()["error"]["param"] == "messages[0].content[0].type"
    marked = _chat(url, vl_engine.model_name, [{"type": "text", "text": "a \ue000 b"},
                                               {"type": "image_url", "image_url": {"url": "x.png"}}])
    assert marked.status_code == 400 and "U+E000" in marked.json()["error"]["message"]
