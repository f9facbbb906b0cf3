"""A Gemma 3 text model served on a real socket (the tiny random checkpoint, tests/support/make_tiny_gemma3.py, on
the AOT kernels): POST /, /generate_stream, /v1/completions and /v1/chat/completions return HF transformers' golden
greedy ids (tests/golden/gemma3_tiny.json), alone and with the three prompts in flight at once; /info names the
architecture."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import pytest
import requests

from tests.support.http import TIMEOUT, event_ids, ok_json, post, stream_events
from tests.support.paths import GOLDEN_DIR

pytestmark = pytest.mark.slow
NAMES = ("greeting", "capital", "story")


@cache
def golden() -> dict:
    return json.loads((GOLDEN_DIR / "gemma3_tiny.json").read_text(encoding="utf-8"))


def greedy() -> dict:
    return {"max_new_tokens": golden()["new_tokens"], "do_sample": False, "details": True}


@pytest.fixture(scope="module")
def url(live_servers, tiny_gemma3_dir):
    from backends.mindspore.engine import Engine
    from backends.settings import EngineConfig

    config = EngineConfig(max_seq_len=256, max_input_tokens=200, max_batch_size=4, max_iter_times=64, block_size=16,
                          prefill_chunk=32, window_buckets=(256,), batch_buckets=(1, 4), kernels="aot", threads=2)
    with Engine(tiny_gemma3_dir, config, model_name="tiny-gemma3") as engine:
        yield live_servers.start(engine)


def generated_ids(url: str, name: str) -> list[int]:
    body = ok_json(post(url, {"inputs": golden()["prompts"][name]["chat"], "parameters": greedy()}))
    return [t["id"] for t in body["details"]["tokens"]]


@pytest.mark.parametrize("name", NAMES)
def test_generate_gives_the_golden_ids(url, name):
    assert generated_ids(url, name) == golden()["prompts"][name]["greedy_ids"]


def test_generate_stream_streams_the_golden_ids(url):
    want = golden()["prompts"]["story"]
    reply = post(url, {"inputs": want["chat"], "parameters": greedy()}, path="/generate_stream", stream=True)
    assert event_ids(stream_events(reply)) == want["greedy_ids"]


def test_concurrent_requests_each_give_their_golden_ids(url):
    """The three prompts, four times over, in flight at once: batched by the engine, each as alone."""
    names = [n for n in NAMES for _ in range(4)]
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: generated_ids(url, n), names))
    assert got == [golden()["prompts"][n]["greedy_ids"] for n in names]


def test_openai_completions_gives_the_golden_text(url, tiny_gemma3_dir):
    """/v1/completions: the golden prompt as text in, the golden ids' text out (what the tokenizer decodes)."""
    from backends.mindspore.tokenizer import Tokenizer
    from service.validation import default_schemas

    want = golden()["prompts"]["capital"]
    reply = post(url, {"model": "tiny-gemma3", "prompt": want["chat"], "max_tokens": golden()["new_tokens"],
                       "temperature": 0}, path="/v1/completions")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    default_schemas().validate("openai_completion_response", body, root="response")
    # the random ids end inside a UTF-8 character: the served text never carries that half character
    text = Tokenizer.from_model_dir(tiny_gemma3_dir).decode(want["greedy_ids"]).rstrip("\ufffd")
    assert body["choices"][0]["text"] == text and body["usage"]["completion_tokens"] == golden()["new_tokens"]


def test_info_names_the_architecture(url):
    info = requests.get(url + "/info", timeout=TIMEOUT).json()
    assert info["mindserve"]["arch"] == "Gemma3ForCausalLM"


def test_openai_chat_renders_the_gemma_template_and_gives_the_golden_text(url, tiny_gemma3_dir):
    """/v1/chat/completions: the golden messages through the checkpoint's Gemma-style template (bos, user / model
    turns) give HF's prompt, so the golden ids' text."""
    from backends.mindspore.tokenizer import Tokenizer

    want = golden()["prompts"]["capital"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]  # make_gemma3_goldens.PROMPTS
    reply = post(url, {"model": "tiny-gemma3", "messages": messages,
                       "max_tokens": golden()["new_tokens"], "temperature": 0}, path="/v1/chat/completions")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["prompt_tokens"] == len(want["input_ids"])
    text = Tokenizer.from_model_dir(tiny_gemma3_dir).decode(want["greedy_ids"]).rstrip("\ufffd")
    assert body["choices"][0]["message"]["content"] == text
