"""``/tokenize`` and ``/detokenize`` (vLLM's shapes) through a real socket.

On the default model the ids, counts and token strings equal what the HF ``tokenizers`` library finds on the
model directory's own tokenizer.json, a chat rendered by plain Jinja from its tokenizer_config.json (an
independent renderer); detokenize gives the text back. Bad bodies and out-of-range ids are 400s naming the
field (OpenAI's error shape), an unknown model a 404; those run on the fake backend too (fast)."""
from __future__ import annotations

import json

import jinja2
import pytest
import requests
import tokenizers

from tests.support.fake_backend import FakeBackend

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."}, {"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                                     {"type": "text", "text": "b"}]}]


@pytest.fixture(scope="module")
def fake_url(live_servers) -> str:
    return live_servers.start(FakeBackend())


@pytest.mark.parametrize("path, body, param, words", [
    ("/tokenize", {}, None, "exactly one of prompt (text) and messages"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None, "exactly one of prompt"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt",
     "add_generation_prompt is not allowed: it is a chat option: send it only with messages"),
    ("/tokenize", {"prompt": "a", "add_special_token": True}, "add_special_token",
     "add_special_token is not a known field (did you mean add_special_tokens?)"),
    ("/tokenize", {"prompt": 3}, "prompt", "prompt must be a string, got 3"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "messages[0].role must be"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]},
     "messages[0].content[0].type", "must be \"text\""),
    ("/detokenize", {"tokens": [1, -2]}, "tokens[1]", "tokens[1] must be >= 0, got -2"),
    ("/detokenize", {"tokens": ["1"]}, "tokens[0]", "tokens[0] must be an integer"),
    ("/detokenize", {}, "tokens", "tokens is required"),
], ids=["neither", "both", "generation-prompt-without-messages", "typo", "prompt-type", "role", "image-part",
        "negative-id", "string-id", "no-tokens"])
def test_bad_bodies_are_400_naming_the_field(fake_url, path, body, param, words):
    reply = requests.post(fake_url + path, json=body, timeout=10)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("path, body", [("/tokenize", {"model": "gpt-4", "prompt": "a"}),
                                        ("/detokenize", {"model": "gpt-4", "tokens": [1]})])
def test_another_model_is_404(fake_url, path, body):
    reply = requests.post(fake_url + path, json=body, timeout=10)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    assert requests.post(fake_url + path, json={**body, "model": "fake"}, timeout=10).status_code == 200


# --- the default model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def url(live_servers, default_engine) -> str:
    return live_servers.start(default_engine)


@pytest.fixture(scope="module")
def reference(default_model_dir) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))


def render(default_model_dir, messages, add_generation_prompt: bool) -> str:
    """The chat as HF renders it: the config's template, trim_blocks/lstrip_blocks, developer read as system."""
    config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    plain = [{"role": "system" if m["role"] == "developer" else m["role"],
              "content": m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])}
             for m in messages]
    return env.from_string(config["chat_template"]).render(messages=plain, add_generation_prompt=add_generation_prompt,
                                                          bos_token=config.get("bos_token") or "",
                                                          eos_token=config.get("eos_token") or "")


@pytest.mark.parametrize("special", [True, False])
def test_prompt_ids_match_the_reference_tokenizer(url, reference, default_engine, special):
    text = "The capital of France is Paris. Unicode: café 東京 🙂"
    reply = requests.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": special,
                                                   "return_token_strs": True}, timeout=30)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    expected = reference.encode(text, add_special_tokens=special)
    assert body["tokens"] == expected.ids and body["count"] == len(expected.ids)
    assert body["token_strs"] == expected.tokens
    assert body["max_model_len"] == default_engine.max_seq_len


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_ids_match_the_template_rendered_independently(url, reference, default_model_dir, generation_prompt):
    reply = requests.post(url + "/tokenize", json={"messages": CHAT, "add_generation_prompt": generation_prompt},
                          timeout=30)
    assert reply.status_code == 200, reply.text
    text = render(default_model_dir, CHAT, generation_prompt)
    assert reply.json()["tokens"] == reference.encode(text).ids
    assert "token_strs" not in reply.json()
    back = requests.post(url + "/detokenize", json={"tokens": reply.json()["tokens"]}, timeout=30)
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_chat_count_equals_the_chat_routes_prompt_tokens(url, default_engine):
    counted = requests.post(url + "/tokenize", json={"messages": CHAT[:2]}, timeout=30).json()["count"]
    chat = requests.post(url + "/v1/chat/completions", json={"model": default_engine.model_name,
                                                             "messages": CHAT[:2], "max_tokens": 1}, timeout=60)
    assert chat.json()["usage"]["prompt_tokens"] == counted


def test_out_of_vocabulary_id_is_400_naming_its_position(url, reference):
    size = reference.get_vocab_size(with_added_tokens=True)
    reply = requests.post(url + "/detokenize", json={"tokens": [1, size]}, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "tokens" and f"tokens[1] is {size}, outside the vocabulary of {size}" in error["message"]
    assert requests.post(url + "/detokenize", json={"tokens": [size - 1]}, timeout=30).status_code == 200
