"""A bounded schemathesis run against the served OpenAPI document, through a real socket: every operation the
document lists, a few generated requests each, ``--checks all`` (no 5xx, statuses, content types, headers
and bodies as documented, 405s with ``Allow``, schema-valid requests accepted, schema-invalid ones refused).

Phases: the coverage phase's negative cases (boundary violations, and every method an operation does not
declare: a 405 with ``Allow``), then fuzzing (positive and negative). ``positive_data_acceptance`` (a
schema-valid request must not get a 4xx) runs on every operation, through tests/support/schemathesis_hooks.py,
less exactly the rules JSON Schema cannot state, each named there and recognised by the server's refusal (a
grammar must compile, tool_choice must name one of the tools, a logit_bias id must be in the vocabulary, the
prompt must fit the token limit, ...); the document says each in words. Every rule it can state, it states
(cross-field rules as if/then, "0 or > 1e-6" as anyOf): ``STATED_RULES`` are requests the server refuses, each
of which the served document must call invalid.

The server runs the default model with a context wide enough (2048 tokens) that generated prompts fit, with
ASCII strings; generation is capped at 4 tokens by the engine (maxIterTimes). The run is seeded and
deterministic: the same document gets the same requests; a failure prints schemathesis' report, with a curl
line per case."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from jsonschema import Draft202012Validator

from backends.mindspore.engine.engine import Engine
from backends.settings import EngineConfig
from tests.support.paths import REPO

WIDE = EngineConfig(max_seq_len=2048, max_input_tokens=2040, max_batch_size=2, max_iter_times=4, block_size=64,
                    prefill_chunk=64, window_buckets=(2048,), batch_buckets=(1, 2))
EXAMPLES = 6  # per operation
SEED = 20261202
CONFIG = """
[checks]
enabled = true
positive_data_acceptance.enabled = false

[phases.coverage.generation]
mode = "negative"
"""
HOOKS = "tests.support.schemathesis_hooks"  # positive_data_acceptance less the named rules JSON Schema cannot state


@pytest.fixture(scope="module")
def url(live_servers, default_model_dir):
    with Engine(default_model_dir, WIDE) as engine:
        yield live_servers.start(engine)


def test_schemathesis_checks_all_pass_against_the_served_document(url, tmp_path):
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or "st"
    (tmp_path / "schemathesis.toml").write_text(CONFIG, encoding="utf-8")
    command = [st, "--config-file", str(tmp_path / "schemathesis.toml"), "run", f"{url}/openapi.json",
               "--max-examples", str(EXAMPLES),
               "--phases", "examples,coverage,fuzzing", "--seed", str(SEED), "--generation-deterministic",
               "--generation-codec", "ascii", "--request-timeout", "120",
               "--max-response-time", "120", "--workers", "1", "--no-color", "--warnings", "off"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": HOOKS, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-5000:]
    assert "generated" in done.stdout and "Selected: " in done.stdout


MODEL = "served"  # replaced by the served model's name
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
RESPONSES = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
# Requests the server refuses for a rule JSON Schema can state (the first four are issue 40's fuzz finds): the
# served document must call each invalid, so that a client generated from it never sends one.
STATED_RULES = [
    ("/", {"inputs": "Hi", "parameters": {"grammar": {"type": "json", "value": ""}}}),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 2.7e-53}),
    ("/v1/chat/completions", {**CHAT, "tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}, "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("/v1/responses", {**RESPONSES, "input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}),
    ("/v1/responses", {**RESPONSES, "previous_response_id": "resp_1"}),
    ("/v1/responses", {**RESPONSES, "tool_choice": "required"}),
    ("/v1/responses", {**RESPONSES, "input": [{"role": "user", "content": [  # the default model takes text only
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}]}),
]


@pytest.fixture(scope="module")
def document(url):
    return requests.get(f"{url}/openapi.json", timeout=60).json()


@pytest.fixture(scope="module")
def model(url):
    return requests.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]


def with_model(body: dict, model: str) -> dict:
    return {**body, "model": model} if body.get("model") == MODEL else body


def request_schema(document: dict, path: str) -> Draft202012Validator:
    """The validator of ``path``'s POST body as the served document states it (its refs into components)."""
    body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return Draft202012Validator({"components": document["components"], "allOf": [body]})


RULE_IDS = ["grammar-json-empty", "required-without-tools", "temperature-tiny", "named-without-tools",
            "top_logprobs-without-logprobs", "both-max-tokens", "json-format-with-required-call",
            "responses-only-reasoning", "responses-previous-id", "responses-required-without-tools",
            "responses-image-on-a-text-model"]


@pytest.mark.parametrize("path, body", STATED_RULES, ids=RULE_IDS)
def test_a_request_refused_for_a_statable_rule_is_invalid_in_the_served_document(url, document, model, path, body):
    body = with_model(body, model)
    reply = requests.post(url + path, json=body, timeout=120)
    assert 400 <= reply.status_code < 500, reply.text
    assert not request_schema(document, path).is_valid(body), (reply.status_code, reply.text)


@pytest.mark.parametrize("temperature", [0, 1e-6 * 1.01, 0.7])
def test_the_temperatures_the_document_allows_are_accepted(url, document, model, temperature):
    body = {"model": model, "prompt": "Hi", "max_tokens": 2, "temperature": temperature}
    assert request_schema(document, "/v1/completions").is_valid(body)
    reply = requests.post(url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
