"""The checks shared by the served-model tests of an architecture against its HF transformers golden
(tests/golden/<arch>_tiny.json): the tiny random checkpoint on a real socket (AOT kernels), POST /, /generate_stream
and /v1/completions returning the golden greedy ids, alone and with the three prompts in flight at once; /info naming
the architecture.

A test module declares its ``golden`` fixture (tests.support.hf_golden_engine.golden_fixture) and its ``served``
and ``url`` fixtures with :func:`served_fixtures`, and imports the ``test_*`` functions below, which pytest then
collects in that module."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests.support.hf_golden_engine import NAMES
from tests.support.http import TIMEOUT, event_ids, ok_json, post, stream_events


@dataclass(frozen=True)
class Served:
    model_dir: Path
    model_name: str  # the name the server answers to
    arch: str  # what /info reports


def served_fixtures(checkpoint_fixture: str, model_name: str, arch: str):
    """The module-scoped ``served`` (a :class:`Served`) and ``url`` (the live server's address) fixtures over the
    checkpoint directory that the fixture named ``checkpoint_fixture`` gives."""
    @pytest.fixture(scope="module", name="served")
    def served(request) -> Served:
        return Served(Path(request.getfixturevalue(checkpoint_fixture)), model_name, arch)

    @pytest.fixture(scope="module", name="url")
    def url(live_servers, served):
        from backends.mindspore.engine.engine import Engine
        from backends.settings import EngineConfig

        config = EngineConfig(max_seq_len=256, max_input_tokens=200, max_batch_size=4, max_iter_times=64,
                              block_size=16, prefill_chunk=32, window_buckets=(256,), batch_buckets=(1, 4),
                              kernels="aot", threads=2)
        with Engine(served.model_dir, config, model_name=served.model_name) as engine:
            yield live_servers.start(engine)
    return served, url


def greedy(golden: dict) -> dict:
    return {"max_new_tokens": golden["new_tokens"], "do_sample": False, "details": True}


def generated_ids(url: str, golden: dict, name: str) -> list[int]:
    body = ok_json(post(url, {"inputs": golden["prompts"][name]["chat"], "parameters": greedy(golden)}))
    return [t["id"] for t in body["details"]["tokens"]]


@pytest.mark.parametrize("name", NAMES)
def check_generate_gives_the_golden_ids(url, golden, name):
    assert generated_ids(url, golden, name) == golden["prompts"][name]["greedy_ids"]


def check_generate_stream_streams_the_golden_ids(url, golden):
    want = golden["prompts"]["story"]
    reply = post(url, {"inputs": want["chat"], "parameters": greedy(golden)}, path="/generate_stream", stream=True)
    assert event_ids(stream_events(reply)) == want["greedy_ids"]


def check_concurrent_requests_each_give_their_golden_ids(url, golden):
    """The three prompts, four times over, in flight at once: batched by the engine, each as alone."""
    names = [n for n in NAMES for _ in range(4)]
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: generated_ids(url, golden, n), names))
    assert got == [golden["prompts"][n]["greedy_ids"] for n in names]


def check_openai_completions_gives_the_golden_text(url, golden, served):
    """/v1/completions: the golden prompt as text in, the golden ids' text out (what the tokenizer decodes)."""
    from backends.mindspore.modeldir.tokenizer import Tokenizer
    from service.validation import default_schemas

    want = golden["prompts"]["capital"]
    reply = post(url, {"model": served.model_name, "prompt": want["chat"], "max_tokens": golden["new_tokens"],
                       "temperature": 0}, path="/v1/completions")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    default_schemas().validate("openai_completion_response", body, root="response")
    # the random ids end inside a UTF-8 character: the served text never carries that half character
    text = Tokenizer.from_model_dir(served.model_dir).decode(want["greedy_ids"]).rstrip("\ufffd")
    assert body["choices"][0]["text"] == text and body["usage"]["completion_tokens"] == golden["new_tokens"]


def check_info_names_the_architecture(url, served):
    info = requests.get(url + "/info", timeout=TIMEOUT).json()
    assert info["mindserve"]["arch"] == served.arch
