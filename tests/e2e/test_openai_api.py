"""The OpenAI-compatible routes through a real socket, driven by the official ``openai`` client.

Real-model tests use the default engine (SmolLM2-135M-Instruct); handler mechanics that need a
controllable backend (disconnect, failures mid-stream) use a scripted fake. The chat template
renderer is tested on its own at the end.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Callable
from urllib.parse import urlsplit

import openai
import pytest
import requests

from backends.base import RequestHandle
from backends.chat_template import render_chat_template
from backends.errors import GenerationFailed, InputRejected
from backends.mindspore.modeldir.tokenizer import Tokenizer
from backends.types import FinishReason, GenerationResult, Token, TokenEvent
from service.errors import from_backend_error
from service.validation import default_schemas
from tests.support.paths import GOLDEN_DIR

GOLDEN = json.loads((GOLDEN_DIR / "smollm2_greedy.json").read_text())
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


# --- the real model --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def openai_url(live_servers, default_engine) -> str:
    return live_servers.start(default_engine)


@pytest.fixture(scope="module")
def client(openai_url) -> openai.OpenAI:
    return client_for(openai_url)


@pytest.fixture(scope="module")
def model(default_engine) -> str:
    return default_engine.model_name


@pytest.mark.slow
def test_completion_greedy_matches_the_golden(client, model):
    out = client.completions.create(model=model, prompt=GOLDEN["prompt"], max_tokens=20, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == model
    assert len(out.choices) == 1
    assert out.choices[0].text == GOLDEN["generated_text"]
    assert out.choices[0].finish_reason == "length" and out.choices[0].index == 0
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (8, 20, 28)


@pytest.mark.slow
def test_completion_stream_deltas_concatenate_to_the_golden(client, model):
    stream = client.completions.create(model=model, prompt=GOLDEN["prompt"], max_tokens=20, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == GOLDEN["generated_text"]
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    usage = chunks[-1]
    assert usage.choices == [] and (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (8, 20)


@pytest.mark.slow
def test_completion_stop_string_and_echo(client, model):
    out = client.completions.create(model=model, prompt=GOLDEN["prompt"], max_tokens=20, temperature=0,
                                    stop=["."], echo=True)
    assert out.choices[0].text == GOLDEN["prompt"] + "'m here to help you with your business"
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_chat_answers_paris(client, model, default_engine):
    out = client.chat.completions.create(model=model, messages=FRANCE, max_tokens=20, temperature=0)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    message = out.choices[0].message
    assert message.role == "assistant" and "Paris" in message.content
    assert "<|im_end|>" not in message.content
    prompt = default_engine.apply_chat_template(FRANCE)
    assert out.usage.prompt_tokens == default_engine.count_tokens(prompt)
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_chat_stream_equals_the_non_stream_answer(client, model):
    kwargs = {"model": model, "messages": FRANCE, "max_completion_tokens": 20, "temperature": 0}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.slow
def test_stream_wire_format_ends_with_done(openai_url, model):
    body = {"model": model, "prompt": GOLDEN["prompt"], "max_tokens": 3, "temperature": 0, "stream": True}
    reply = requests.post(openai_url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    assert reply.text.endswith("data: [DONE]\n\n")
    events = [e for e in reply.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert [json.loads(e[6:])["object"] for e in events[:-1]] == ["text_completion"] * (len(events) - 1)


@pytest.mark.slow
@pytest.mark.parametrize("path, body, response, chunk", [
    ("/v1/completions", {"prompt": GOLDEN["prompt"], "echo": True}, "openai_completion_response",
     "openai_completion_chunk"),
    ("/v1/chat/completions", {"messages": FRANCE}, "openai_chat_response", "openai_chat_chunk"),
])
def test_bodies_and_chunks_match_their_schemas(openai_url, model, path, body, response, chunk):
    schemas = default_schemas()
    body = {"model": model, "max_tokens": 4, "temperature": 0, **body}
    reply = requests.post(openai_url + path, json=body, timeout=120)
    schemas.validate(response, reply.json(), root="response")
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    events = requests.post(openai_url + path, json=stream, timeout=120).text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    for event in events[:-2]:
        schemas.validate(chunk, json.loads(event.removeprefix("data: ")), root="chunk")
    error = requests.post(openai_url + path, json={**body, "n": 17}, timeout=30)
    assert error.status_code == 400
    schemas.validate("openai_error", error.json(), root="error")


# --- errors ------------------------------------------------------------------------------------------
# Validation errors are 400 (openai.BadRequestError), as OpenAI answers; an unknown model is 404.

@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 17}, "n"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"logprobs": 21}, "logprobs"),
    ({"extra_body": {"tmperature": 0.5}}, "tmperature"),
    ({"stop": ["x" * 1025]}, "stop[0]"),
    ({"stream": True, "n": 2}, "n"),
])
def test_invalid_completion_params_raise_bad_request(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", **kwargs)
    assert info.value.status_code == 400
    assert info.value.param == param and info.value.type == "invalid_request_error"
    assert param.split("[")[0] in info.value.message


@pytest.mark.parametrize("kwargs, param", [
    ({"n": 0}, "n"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": []}, "messages"),
    ({"max_tokens": 5, "max_completion_tokens": 5}, "max_tokens"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
     "tools[0].function.parameters"),  # tools themselves work on any model (the generic format)
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_invalid_chat_params_raise_bad_request(client, model, kwargs, param):
    kwargs = {"messages": FRANCE, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, **kwargs)
    assert info.value.param == param


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="hi")
    assert info.value.code == "model_not_found" and "gpt-4o" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=FRANCE)


def test_prompt_over_the_token_limit_names_the_prompt(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hello " * 400, max_tokens=1)
    assert info.value.param == "prompt" and "tokens" in info.value.message


def test_bad_json_and_wrong_method_use_the_openai_shape(openai_url):
    reply = requests.post(openai_url + "/v1/completions", data=b"{not json", timeout=30)
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "invalid_request_error"
    reply = requests.get(openai_url + "/v1/chat/completions", timeout=30)
    assert reply.status_code == 405 and set(reply.json()["error"]) == {"message", "type", "param", "code"}


# --- handler mechanics on a scripted backend --------------------------------------------------------

class ScriptedBackend:
    """Runs ``script(handle)`` on a thread for each request; records prompts and handles."""

    model_name = "scripted"

    def __init__(self, script: Callable[[RequestHandle], None], template: str = CHATML) -> None:
        self.script = script
        self.template = template
        self.prompts: list[str] = []
        self.handles: list[RequestHandle] = []

    def submit(self, inputs: str, params: Any, listener: Any = None) -> RequestHandle:
        handle = RequestHandle(f"req-{len(self.handles) + 1}", listener)
        self.prompts.append(inputs)
        self.handles.append(handle)
        threading.Thread(target=self.script, args=(handle,), daemon=True).start()
        return handle

    def apply_chat_template(self, messages):
        return render_chat_template(self.template, messages)

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def info(self) -> dict:
        return {"model_name": self.model_name}

    def adapters(self) -> list[dict]:
        return []

    def close(self) -> None:
        pass


def _token(i: int, text: str, special: bool = False) -> TokenEvent:
    return TokenEvent(Token(i, text, -0.5, special), i, "" if special else text)


def _result(text: str, n: int, reason: FinishReason = FinishReason.EOS_TOKEN) -> GenerationResult:
    return GenerationResult(text, reason, prompt_tokens=3, generated_tokens=n, seed=1)


def test_stream_sends_text_held_back_until_the_end(live_servers):
    def script(handle: RequestHandle) -> None:
        # The last token is EOS (special): its event shows "<|im_end|>", the held-back "Pa" is only in the result.
        for event in (_token(0, "Hello"), _token(1, " "), _token(2, "<|im_end|>", special=True)):
            handle.emit(event)
        handle.emit(_result("Hello Pa", 3))

    client = client_for(live_servers.start(ScriptedBackend(script)))
    chunks = list(client.chat.completions.create(model="scripted", messages=FRANCE, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello Pa"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_failure_after_the_stream_opened_is_an_error_event(live_servers):
    def script(handle: RequestHandle) -> None:
        handle.emit(_token(0, "Hi"))
        handle.emit(GenerationFailed("the device fell over"))

    client = client_for(live_servers.start(ScriptedBackend(script)))
    stream = client.completions.create(model="scripted", prompt="x", stream=True)
    with pytest.raises(openai.APIError, match="the device fell over"):
        list(stream)


def test_failure_before_the_stream_opened_is_an_http_error(live_servers):
    client = client_for(live_servers.start(ScriptedBackend(lambda h: h.emit(GenerationFailed("boom")))))
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="scripted", prompt="x", stream=True)
    assert info.value.status_code == 424 and info.value.type == "server_error"


def test_chat_uses_the_backend_template_and_developer_is_system(live_servers):
    backend = ScriptedBackend(lambda h: h.emit(_result("ok", 1)))
    client = client_for(live_servers.start(backend))
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model="scripted", messages=messages)
    assert out.choices[0].message.content == "ok"
    assert backend.prompts == ["<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                               "<|im_start|>assistant\n"]


def test_template_raise_exception_is_a_bad_request(live_servers):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}x"
    client = client_for(live_servers.start(ScriptedBackend(lambda h: None, template=template)))
    with pytest.raises(openai.BadRequestError, match="first must be user") as info:
        client.chat.completions.create(model="scripted", messages=[{"role": "assistant", "content": "a"}])
    assert info.value.param == "messages"


def test_disconnect_cancels_the_engine_request(live_servers):
    def script(handle: RequestHandle) -> None:
        for i in range(2000):
            if handle.cancelled:
                handle.emit(_result("", i, FinishReason.STOP_SEQUENCE))
                return
            handle.emit(_token(i, "a"))
            time.sleep(0.01)
        handle.emit(_result("a" * 2000, 2000, FinishReason.LENGTH))

    backend = ScriptedBackend(script)
    url = urlsplit(live_servers.start(backend))
    body = json.dumps({"model": "scripted", "prompt": "x", "stream": True}).encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert b"data: " in sock.recv(4096)
    deadline = time.monotonic() + 2
    while not backend.handles[0].cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert backend.handles[0].cancelled


# --- the chat template renderer ------------------------------------------------------------------------

def test_chatml_two_turn_conversation():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Name a colour."}]
    assert render_chat_template(CHATML, messages) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nName a colour.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not render_chat_template(CHATML, messages, add_generation_prompt=False).endswith("assistant\n")


def test_template_variables_bos_eos_and_tojson():
    template = "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}{{ eos_token }}"
    out = render_chat_template(template, [{"role": "user", "content": "é<b>"}], bos_token="<s>", eos_token="</s>")
    assert out == '<s>{"role": "user", "content": "é<b>"}</s>'


def test_template_raise_exception_is_input_rejected_422():
    template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InputRejected, match="roles must alternate") as info:
        render_chat_template(template, FRANCE)
    assert from_backend_error(info.value).status == 422  # as POST /'s taxonomy maps it


@pytest.mark.parametrize("template", [
    "{% for m in messages %}",  # syntax error
    "{{ messages.append(1) }}",  # the immutable sandbox forbids mutation
    "{{ ''.__class__.__mro__ }}",  # and attribute escapes
])
def test_broken_or_unsafe_template_is_a_generation_failure(template):
    with pytest.raises(GenerationFailed):
        render_chat_template(template, FRANCE)


def test_default_model_template_is_chatml_with_a_default_system_prompt(default_model_dir):
    tok = Tokenizer.from_model_dir(default_model_dir)
    out = render_chat_template(tok.chat_template, FRANCE, bos_token=tok.bos_token, eos_token=tok.eos_token)
    assert out.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert out.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    own_system = [{"role": "system", "content": "Be terse."}, *FRANCE]
    assert render_chat_template(tok.chat_template, own_system).startswith("<|im_start|>system\nBe terse.<|im_end|>")
