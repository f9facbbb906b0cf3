"""Speculative decoding through a real socket: the TGI stream and the OpenAI chat stream send one event per
accepted token, in order, equal to the same request with ``speculate: false``; details, logprobs and ``n``
are the plain run's; /info and /metrics report the counts."""
from __future__ import annotations

import openai
import pytest
import requests

from backends.settings import EngineConfig, SpeculationSettings
from tests.support.http import parse_sse

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a tin of oil, "
           "a clean rag and a small brass key that opened the lamp room.")
ASK = f"Repeat the following passage exactly, word for word.\n\n{PASSAGE}"
QUOTE = f"<|im_start|>user\n{ASK}<|im_end|>\n<|im_start|>assistant\n"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(default_model_dir):
    from backends.mindspore.engine.engine import Engine

    config = EngineConfig(max_seq_len=256, max_input_tokens=200, max_batch_size=8, max_iter_times=64, block_size=64,
                          prefill_chunk=32, window_buckets=(256,), batch_buckets=(1, 4, 8),
                          cache_gb=0.25, speculation=SpeculationSettings(max_draft=6))
    with Engine(default_model_dir, config, model_name="spec") as eng:
        yield eng


@pytest.fixture(scope="module")
def url(live_servers, engine) -> str:
    return live_servers.start(engine)


def tgi_stream(url: str, speculate: bool, **params) -> list[dict]:
    body = {"inputs": QUOTE, "parameters": {"max_new_tokens": 48, "details": True, "speculate": speculate, "seed": 3,
                                            **params}}
    reply = requests.post(url + "/generate_stream", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return parse_sse(reply.text)


def test_tgi_stream_sends_each_accepted_token_as_its_own_event(url, engine):
    before = engine.speculator.stats.accepted
    on, off = tgi_stream(url, True, stop=["lamp room"]), tgi_stream(url, False, stop=["lamp room"])
    assert engine.speculator.stats.accepted - before >= 10  # the answer was mostly accepted drafts
    assert on == off
    assert len(on) > 20 and on[-1]["details"]["finish_reason"] == "stop_sequence"
    assert "brass key" in on[-1]["generated_text"]


def test_tgi_details_and_seeded_sampling_equal_the_plain_run(url):
    for params in ({"do_sample": False, "decoder_input_details": True, "seed": 2},
                   {"do_sample": True, "temperature": 0.7, "seed": 5}):
        body = {"inputs": QUOTE, "parameters": {"max_new_tokens": 40, "details": True, **params}}
        on = requests.post(url + "/generate", json=body, timeout=120).json()
        off = requests.post(url + "/generate", json={**body, "parameters": {**body["parameters"], "speculate": False}},
                            timeout=120).json()
        assert on == off and on["details"]["generated_tokens"] > 20


def test_openai_chat_stream_and_n_equal_the_plain_run(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": ASK}]

    def chunks(speculate: bool) -> list:
        stream = client.chat.completions.create(model="spec", messages=messages, max_tokens=40, temperature=0,
                                                logprobs=True, top_logprobs=2, stream=True,
                                                extra_body={"speculate": speculate})
        return [(c.choices[0].delta.content, c.choices[0].logprobs, c.choices[0].finish_reason)
                for c in stream if c.choices]

    on, off = chunks(True), chunks(False)
    assert on == off and len([c for c in on if c[0]]) > 20
    both = [client.completions.create(model="spec", prompt=QUOTE, max_tokens=30, n=3, temperature=0.8, seed=11,
                                      extra_body={"speculate": s}) for s in (True, False)]
    assert [c.text for c in both[0].choices] == [c.text for c in both[1].choices]


def test_info_and_metrics_report_the_counts(url, engine):
    info = requests.get(url + "/info", timeout=30).json()["mindserve"]["speculation"]
    assert info["enabled"] and info["method"] == "memory_decoding"
    assert info["accepted_tokens"] == engine.speculator.stats.accepted > 0
    text = requests.get(url + "/metrics", timeout=30).text
    assert f'spec_decode_num_accepted_tokens_total{{model_name="spec"}} {float(info["accepted_tokens"])}' in text
    assert "spec_decode_acceptance_rate{" in text
