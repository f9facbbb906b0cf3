"""Structured output through real sockets on the default model: every ``run`` example of
docs/structured-output.md (curl, the text-generation client, the openai client) executed and its output
validated; TGI streaming with a grammar; bad and hostile grammars are a 422 / 400 naming the field and the
server stays healthy; the OpenAI sampling controls."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import openai
import pytest
import requests

from tests.support.http import parse_sse
from tests.support.paths import REPO

DOC = (REPO / "docs" / "structured-output.md").read_text(encoding="utf-8")
RUN_BLOCKS = re.findall(r"<!-- run -->\n```(bash|python)\n(.*?)```", DOC, re.S)
DOC_URL = "http://127.0.0.1:1025"
PERSON = json.loads((REPO / "tests" / "data" / "structured_schemas.json").read_text())["schemas"]["person"]
CHAT_PROMPT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def url(live_servers, default_engine) -> str:
    return live_servers.start(default_engine)


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def generated(stdout: str) -> str:
    """The generated text an example printed: the bare text, or the text inside a response body."""
    try:
        body = json.loads(stdout)
    except ValueError:
        return stdout.strip()
    if isinstance(body, dict) and "generated_text" in body:
        return body["generated_text"]
    if isinstance(body, dict) and "choices" in body:
        return body["choices"][0]["message"]["content"]
    return stdout.strip()


def test_the_doc_has_its_examples():
    assert [lang for lang, _ in RUN_BLOCKS].count("bash") >= 2
    assert any("text_generation" in code for _, code in RUN_BLOCKS)
    assert any("import openai" in code for _, code in RUN_BLOCKS)


@pytest.mark.parametrize("lang, code", RUN_BLOCKS, ids=[f"{lang}-{i}" for i, (lang, _) in enumerate(RUN_BLOCKS)])
def test_doc_example_runs_and_its_output_validates(url, default_engine, lang, code):
    code = code.replace(DOC_URL, url).replace("SmolLM2-135M-Instruct", default_engine.model_name)
    command = ["bash", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(generated(done.stdout)), PERSON)


def test_stream_with_a_grammar_concatenates_to_valid_json(url):
    body = {"inputs": CHAT_PROMPT,
            "parameters": {"max_new_tokens": 60, "details": True, "grammar": {"type": "json", "value": PERSON}}}
    reply = requests.post(url + "/generate_stream", json=body, timeout=120)
    events = parse_sse(reply.text)
    assert reply.status_code == 200 and events[-1]["details"]["finish_reason"] == "eos_token"
    jsonschema.validate(json.loads(events[-1]["generated_text"]), PERSON)
    assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == events[-1]["generated_text"]


@pytest.mark.parametrize("grammar, fragments", [
    ({"type": "regex", "value": "a(b"}, ["parameters.grammar does not compile", "unclosed group"]),
    ({"type": "json", "value": {"type": "objectx"}}, ["parameters.grammar does not compile", "objectx"]),
    ({"type": "json", "value": {"enum": [f"value-{i}" for i in range(100_000)]}}, ["more than the limit of 65536"]),
    ({"type": "json", "value": '{"required":["a"],"properties":{"a":' * 1000 + "{}" + "}}" * 1000},
     ["parameters.grammar does not compile"]),
    ({"type": "regex", "value": "(a+)+(b+)+" * 300 + "("}, ["parameters.grammar does not compile"]),
    ({"type": "lark", "value": "start: a"}, ["parameters.grammar.type"]),
])
def test_bad_and_hostile_grammars_are_422_and_the_server_stays_healthy(url, grammar, fragments):
    reply = requests.post(url + "/generate", json={"inputs": "x", "parameters": {"grammar": grammar}}, timeout=30)
    assert reply.status_code == 422, reply.text
    message = reply.json()["error"]
    assert all(f in message for f in fragments), message
    assert requests.get(url + "/health", timeout=10).status_code == 200
    ok = requests.post(url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200


def test_openai_json_object(client, default_engine):
    completion = client.chat.completions.create(
        model=default_engine.model_name, max_tokens=60, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give a JSON object with one key."}])
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(completion.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a valid prefix of an object
        assert completion.choices[0].message.content.startswith("{")


def test_openai_schema_that_does_not_compile_is_a_bad_request(client, default_engine):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=default_engine.model_name, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
    assert info.value.param == "response_format" and "objectx" in info.value.message


def test_openai_ignore_eos_min_tokens_and_logit_bias(client, default_engine):
    model, messages = default_engine.model_name, [{"role": "user", "content": "Say hi."}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=40,
                                          extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 40 and full.choices[0].finish_reason == "length"
    natural = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0)
    assert natural.choices[0].finish_reason == "stop"
    held = client.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0,
                                          extra_body={"min_tokens": natural.usage.completion_tokens + 5})
    assert held.usage.completion_tokens >= natural.usage.completion_tokens + 5
    forced = default_engine.tokenize(" banana")[-1]
    banana = client.completions.create(model=model, prompt="I like", max_tokens=3, logit_bias={str(forced): 100})
    assert banana.choices[0].text == " banana" * 3
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="x", logit_bias={str(default_engine.vocab_size): 5})
    assert info.value.param == "logit_bias"


def test_openai_logprobs_on_the_real_model(client, default_engine):
    model, messages = default_engine.model_name, [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    reported = chat.usage.completion_tokens - (chat.choices[0].finish_reason == "stop")
    assert len(content) == reported and "".join(c.token for c in content) == chat.choices[0].message.content
    for entry in content:  # greedy: the chosen token is the most likely alternative
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert [a.logprob for a in entry.top_logprobs] == sorted((a.logprob for a in entry.top_logprobs), reverse=True)
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, logprobs=2,
                                           temperature=0)
    lp = completion.choices[0].logprobs
    assert "".join(lp.tokens) == completion.choices[0].text and len(lp.top_logprobs) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    streamed = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                              logprobs=True, stream=True)
    tokens = [c.choices[0].logprobs.content[0].token for c in streamed if c.choices and c.choices[0].logprobs]
    assert tokens == [c.token for c in content]


def test_openai_n_gives_n_choices(client, default_engine):
    model, messages = default_engine.model_name, [{"role": "user", "content": "Name a fruit."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, n=3, temperature=1.0, seed=11)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=8, n=1, temperature=1.0, seed=12)
    assert chat.choices[1].message.content == again.choices[0].message.content  # choice i samples with seed + i
    greedy = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, n=3,
                                       temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert len({c.text for c in greedy.choices}) == 1 and greedy.choices[0].text.startswith("{")
    single = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0,
                                       extra_body={"response_format": {"type": "json_object"}})
    assert greedy.usage.prompt_tokens == single.usage.prompt_tokens
    assert greedy.usage.completion_tokens == 3 * single.usage.completion_tokens


@pytest.mark.parametrize("pattern", ["((a+)+(b+)+c)" * 300, "(x*)*y" * 1000, "[a-z]{1000}{1000}"])
def test_catastrophic_regexes_compile_within_bounds_and_generate(url, pattern):
    import time

    started = time.perf_counter()
    body = {"inputs": "x", "parameters": {"max_new_tokens": 4, "grammar": {"type": "regex", "value": pattern}}}
    reply = requests.post(url + "/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert re.fullmatch("[abcxy]*|[a-z]*", reply.json()["generated_text"])
    assert time.perf_counter() - started < 10
    assert requests.get(url + "/health", timeout=10).status_code == 200
