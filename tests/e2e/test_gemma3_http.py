"""A Gemma 3 text model served on a real socket (the tiny random checkpoint, tests/support/make_tiny_gemma3.py, on
the AOT kernels): POST /, /generate_stream, /v1/completions and /v1/chat/completions return HF transformers' golden
greedy ids (tests/golden/gemma3_tiny.json), alone and with the three prompts in flight at once; /info names the
architecture.
The checks are tests/support/hf_golden_http.py's, collected here."""
from __future__ import annotations

import pytest

from tests.support.hf_golden_engine import golden_fixture
from tests.support.hf_golden_http import served_fixtures
from tests.support.http import post
from tests.support.hf_golden_http import (
    check_generate_gives_the_golden_ids,
    check_generate_stream_streams_the_golden_ids,
    check_concurrent_requests_each_give_their_golden_ids,
    check_openai_completions_gives_the_golden_text,
    check_info_names_the_architecture,
)


# hf_golden_http's checks, collected as this module's tests
test_generate_gives_the_golden_ids = check_generate_gives_the_golden_ids
test_generate_stream_streams_the_golden_ids = check_generate_stream_streams_the_golden_ids
test_concurrent_requests_each_give_their_golden_ids = check_concurrent_requests_each_give_their_golden_ids
test_openai_completions_gives_the_golden_text = check_openai_completions_gives_the_golden_text
test_info_names_the_architecture = check_info_names_the_architecture

pytestmark = pytest.mark.slow
golden = golden_fixture("gemma3_tiny.json")
served, url = served_fixtures("tiny_gemma3_dir", model_name="tiny-gemma3", arch="Gemma3ForCausalLM")


def test_openai_chat_renders_the_gemma_template_and_gives_the_golden_text(url, golden, served):
    """/v1/chat/completions: the golden messages through the checkpoint's Gemma-style template (bos, user / model
    turns) give HF's prompt, so the golden ids' text."""
    from backends.mindspore.tokenizer import Tokenizer

    want = golden["prompts"]["capital"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]  # scripts/hf_goldens.PROMPTS
    reply = post(url, {"model": served.model_name, "messages": messages,
                       "max_tokens": golden["new_tokens"], "temperature": 0}, path="/v1/chat/completions")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["prompt_tokens"] == len(want["input_ids"])
    text = Tokenizer.from_model_dir(served.model_dir).decode(want["greedy_ids"]).rstrip("\ufffd")
    assert body["choices"][0]["message"]["content"] == text
