"""Every family with an HF transformers golden (tests/support/families.py: GOLDEN) served on a real socket, its tiny
random checkpoint on the AOT kernels: POST /, /generate_stream, /v1/completions and /v1/chat/completions (the golden
messages through the checkpoint's own chat template) return HF's golden greedy ids, alone and with the three prompts
in flight at once; /info names the architecture."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.support.families import GOLDEN
from tests.support.golden_prompts import NAMES, load_golden
from tests.support.http import TIMEOUT, event_ids, ok_json, post, stream_events
from tests.support.scripts.hf_goldens import PROMPTS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=GOLDEN, ids=str)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def golden(family) -> dict:
    return load_golden(family.checkpoint.golden)


@pytest.fixture(scope="module")
def model_dir(request, family) -> Path:
    return Path(request.getfixturevalue(family.checkpoint.fixture))


@pytest.fixture(scope="module")
def url(live_servers, family, model_dir):
    from backends.mindspore.engine.engine import Engine
    from backends.settings import EngineConfig

    config = EngineConfig(max_seq_len=256, max_input_tokens=200, max_batch_size=4, max_iter_times=64,
                          block_size=16, prefill_chunk=32, window_buckets=(256,), batch_buckets=(1, 4),
                          kernels="aot", threads=2)
    with Engine(model_dir, config, model_name=family.served_name) as engine:
        yield live_servers.start(engine)


def greedy(golden: dict) -> dict:
    return {"max_new_tokens": golden["new_tokens"], "do_sample": False, "details": True}


def generated_ids(url: str, golden: dict, name: str) -> list[int]:
    body = ok_json(post(url, {"inputs": golden["prompts"][name]["chat"], "parameters": greedy(golden)}))
    return [t["id"] for t in body["details"]["tokens"]]


def golden_text(model_dir: Path, want: dict) -> str:
    """The golden ids' text; the random ids end inside a UTF-8 character: the served text never carries that half
    character."""
    from backends.mindspore.modeldir.tokenizer import Tokenizer

    return Tokenizer.from_model_dir(model_dir).decode(want["greedy_ids"]).rstrip("\ufffd")


@pytest.mark.parametrize("name", NAMES)
def test_generate_gives_the_golden_ids(url, golden, name):
    assert generated_ids(url, golden, name) == golden["prompts"][name]["greedy_ids"]


def test_generate_stream_streams_the_golden_ids(url, golden):
    want = golden["prompts"]["story"]
    reply = post(url, {"inputs": want["chat"], "parameters": greedy(golden)}, path="/generate_stream", stream=True)
    assert event_ids(stream_events(reply)) == want["greedy_ids"]


def test_concurrent_requests_each_give_their_golden_ids(url, golden):
    """The three prompts, four times over, in flight at once: batched by the engine, each as alone."""
    names = [n for n in NAMES for _ in range(4)]
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: generated_ids(url, golden, n), names))
    assert got == [golden["prompts"][n]["greedy_ids"] for n in names]


def test_openai_completions_gives_the_golden_text(url, golden, family, model_dir):
    """/v1/completions: the golden prompt as text in, the golden ids' text out (what the tokenizer decodes)."""
    from service.validation import default_schemas

    want = golden["prompts"]["capital"]
    reply = post(url, {"model": family.served_name, "prompt": want["chat"], "max_tokens": golden["new_tokens"],
                       "temperature": 0}, path="/v1/completions")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    default_schemas().validate("openai_completion_response", body, root="response")
    assert body["choices"][0]["text"] == golden_text(model_dir, want)
    assert body["usage"]["completion_tokens"] == golden["new_tokens"]


def test_openai_chat_renders_the_template_and_gives_the_golden_text(url, golden, family, model_dir):
    """/v1/chat/completions: the golden messages through the checkpoint's chat template (ChatML; Gemma's bos first
    and user / model turns) give HF's prompt, so the golden ids' text."""
    want = golden["prompts"]["capital"]
    reply = post(url, {"model": family.served_name, "messages": PROMPTS["capital"],
                       "max_tokens": golden["new_tokens"], "temperature": 0}, path="/v1/chat/completions")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["prompt_tokens"] == len(want["input_ids"])
    assert body["choices"][0]["message"]["content"] == golden_text(model_dir, want)


def test_info_names_the_architecture(url, family):
    info = requests.get(url + "/info", timeout=TIMEOUT).json()
    assert info["mindserve"]["arch"] == family.arch
