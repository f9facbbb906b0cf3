"""/v1/messages and /v1/messages/count_tokens on the default model (SmolLM2-135M-Instruct), through a real
socket, with the official ``anthropic`` client unmodified: ``messages.create`` checked against the chat route
for the same conversation (greedy), ``messages.stream`` (events in order, the final message equal to the
non-streamed one), ``count_tokens`` equal to the prompt tokens the server reports and to ``/tokenize``, the stop
sequence, the length cap, and the errors as the client's exception classes (400, 401, 404, 503, 529)."""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import anthropic
import pytest
import requests

from service.admission import Admission
from service.config import ServerSettings
from service.state import ServerState
from service.validation import default_schemas

pytestmark = pytest.mark.slow

SCHEMAS = default_schemas()
SYSTEM = "You are a helpful assistant. Answer in one sentence."
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0}
KEY = "sk-local-test"


@pytest.fixture(scope="module")
def name(server_url) -> str:
    return requests.get(server_url + "/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server_url, api_key="none", max_retries=0, timeout=120)


def ask(name: str, **fields) -> dict:
    return {"model": name, "max_tokens": 24, "system": SYSTEM,
            "messages": [{"role": "user", "content": QUESTION}], **fields}


def chat(url: str, name: str, max_tokens: int = 24, **fields) -> dict:
    """The same conversation on /v1/chat/completions (greedy)."""
    body = {"model": name, "max_tokens": max_tokens, "temperature": 0, **fields,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]}
    reply = requests.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_create_answers_as_the_chat_route_does(client, server_url, name):
    message = client.messages.create(**ask(name), extra_body=GREEDY)
    reference = chat(server_url, name)
    choice = reference["choices"][0]
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == name
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == choice["message"]["content"] and message.content[0].text
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[choice["finish_reason"]]
    assert message.stop_sequence is None
    assert message.usage.input_tokens == reference["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == reference["usage"]["completion_tokens"]


def test_stream_sends_the_events_in_order_and_ends_with_the_created_message(client, name):
    created = client.messages.create(**ask(name), extra_body=GREEDY)
    with client.messages.stream(**ask(name), extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    deltas = kinds.count("text")
    assert kinds == ["message_start", "content_block_start", *["content_block_delta", "text"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    texts = [event.text for event in events if event.type == "text"]
    assert len(texts) > 1 and "".join(texts) == created.content[0].text
    assert events[0].message.usage.input_tokens == created.usage.input_tokens  # known at message_start
    assert final.model_dump(exclude={"id"}) == created.model_dump(exclude={"id"})


def test_raw_body_and_stream_frames_follow_their_schemas(server_url, name):
    reply = requests.post(server_url + "/v1/messages", json=ask(name, **GREEDY), timeout=120)
    assert reply.status_code == 200 and reply.headers["Content-Type"].startswith("application/json")
    SCHEMAS.validate("anthropic_messages_response", reply.json(), root="message")
    reply = requests.post(server_url + "/v1/messages", json=ask(name, stream=True, **GREEDY), timeout=120)
    assert reply.status_code == 200 and reply.headers["Content-Type"].startswith("text/event-stream")
    frames = reply.content.decode("utf-8").removesuffix("\n\n").split("\n\n")
    types = []
    for frame in frames:
        head, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == "event: " + event["type"]
        SCHEMAS.validate("anthropic_messages_event", event, root="event")
        types.append(event["type"])
    assert types[:3] == ["message_start", "ping", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[3:-3]) == {"content_block_delta"}


def test_count_tokens_equals_the_reported_prompt_tokens(client, server_url, name):
    for fields in ({}, {"system": [{"type": "text", "text": SYSTEM}, {"type": "text", "text": "Be kind."}]},
                   {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "It is"}]}):
        body = ask(name, **fields)
        counted = client.messages.count_tokens(model=name, system=body["system"], messages=body["messages"])
        created = client.messages.create(**body, extra_body=GREEDY)
        assert counted.input_tokens == created.usage.input_tokens > 0
    chat_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    tokenized = requests.post(server_url + "/tokenize", json={"messages": chat_messages}, timeout=30).json()
    counted = client.messages.count_tokens(model=name, system=SYSTEM, messages=ask(name)["messages"])
    assert counted.input_tokens == tokenized["count"]


def test_a_prefill_is_continued(client, server_url, name):
    """A last assistant turn: the answer continues it (the prompt ends with the prefill's text)."""
    message = client.messages.create(**ask(name, messages=[{"role": "user", "content": QUESTION},
                                                            {"role": "assistant", "content": "The capital"}]),
                                     extra_body=GREEDY)
    chat_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    ids = requests.post(server_url + "/tokenize", json={"messages": chat_messages, "add_special_tokens": False},
                        timeout=30).json()["tokens"]
    prompt = requests.post(server_url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    full = requests.post(server_url + "/v1/completions", json={
        "model": name, "prompt": prompt + "The capital", "max_tokens": 24, "temperature": 0}, timeout=120).json()
    assert message.content[0].text == full["choices"][0]["text"]


def test_stop_sequence_and_length_cap(client, name):
    text = client.messages.create(**ask(name), extra_body=GREEDY).content[0].text
    word = text.split()[2]
    stopped = client.messages.create(**ask(name, stop_sequences=["\u2603", word]), extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[:text.index(word)]
    cut = client.messages.create(**ask(name, max_tokens=3), extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


@pytest.mark.parametrize("change, exception, kind, says", [
    ({"max_tokens": anthropic.omit}, anthropic.BadRequestError, "invalid_request_error", "max_tokens is required"),
    ({"model": "claude-nope"}, anthropic.NotFoundError, "not_found_error", 'model "claude-nope" is not served'),
    ({"messages": [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Hi"}]},
     anthropic.BadRequestError, "invalid_request_error", 'messages[0].role must be "user"'),
    ({"messages": [{"role": "system", "content": "Hi"}]}, anthropic.BadRequestError, "invalid_request_error",
     "messages[0].role must be one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     anthropic.BadRequestError, "invalid_request_error", "messages[0].content[0] is an image block, which this model"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}]},
     anthropic.BadRequestError, "invalid_request_error", 'messages[0].content[0].type must be one of'),
    ({"tools": [{"name": "f", "input_schema": {"type": "objectx"}}], "tool_choice": {"type": "any"}},
     anthropic.BadRequestError, "invalid_request_error", "tools[0].input_schema does not compile"),
    ({"temperature": 1.5}, anthropic.BadRequestError, "invalid_request_error", "temperature must be <= 1"),
])
def test_errors_raise_the_clients_exception_classes(client, name, change, exception, kind, says):
    fields = {**ask(name), **{k: v for k, v in change.items() if k != "temperature"}}
    with pytest.raises(exception) as caught:
        client.messages.create(**fields, extra_body={k: v for k, v in change.items() if k == "temperature"})
    assert caught.value.type == kind and says in caught.value.api_message, caught.value.body
    assert caught.value.body["type"] == "error"


def test_api_key_as_x_api_key_or_bearer(live_servers, default_engine, name):
    url = live_servers.start(default_engine, replace(ServerSettings(), api_key=KEY))
    body = ask(name, max_tokens=2)
    assert anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.create(**body).type == "message"
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        assert requests.post(url + "/v1/messages/count_tokens", json={"model": name, "messages": body["messages"]},
                             headers=headers, timeout=30).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}, {"x-api-key": "wrong", "Authorization": f"Bearer {KEY}"}):
        reply = requests.post(url + "/v1/messages", json=body, headers=headers, timeout=30)
        assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error", reply.text
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(**body)


def test_a_full_line_is_529_overloaded_and_not_ready_is_503(live_servers, default_engine, name):
    admission = Admission(1, max_waiting=0)
    url = live_servers.start(default_engine, admission=admission)
    asyncio.run_coroutine_threadsafe(admission.acquire(), live_servers.loop).result(10)  # the one slot taken
    try:
        with pytest.raises(anthropic.OverloadedError) as caught:
            anthropic.Anthropic(base_url=url, api_key="none", max_retries=0).messages.create(**ask(name))
        assert caught.value.status_code == 529 and caught.value.type == "overloaded_error"
    finally:
        live_servers.loop.call_soon_threadsafe(admission.release)
    loading = live_servers.start(default_engine, state=ServerState())
    for call in (lambda c: c.messages.create(**ask(name)),
                 lambda c: c.messages.count_tokens(model=name, messages=ask(name)["messages"])):
        with pytest.raises(anthropic.ServiceUnavailableError) as caught:
            call(anthropic.Anthropic(base_url=loading, api_key="none", max_retries=0))
        assert caught.value.type == "overloaded_error"


def test_a_repeated_prompt_reads_its_prefix_from_the_cache(client, name):
    """usage.cache_read_input_tokens: the prompt tokens the prefix cache held; the second time the same prompt
    comes, some are held (never the whole prompt: its last token is computed to sample from)."""
    body = ask(name, system=SYSTEM + " This prompt is sent twice.", max_tokens=2)
    client.messages.create(**body, extra_body=GREEDY)
    again = client.messages.create(**body, extra_body=GREEDY)
    assert 0 < again.usage.cache_read_input_tokens < again.usage.input_tokens
