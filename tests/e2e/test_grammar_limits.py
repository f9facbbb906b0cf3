"""Grammar limits at the edge, through a real socket: a grammar over the grammar engine's limits is a 422
(the OpenAI routes: 400, as every refusal there) naming its field, in our words, before the request takes a
generation slot (the backend never sees it); the check runs off the event loop; a normal grammar still
generates.

The backend is the fake one with a real grammar check: ``backends.grammar.GrammarCompiler`` on the tiny
trained tokenizer, the same code the engine asks."""
from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest
import requests

from backends.grammar import GrammarCompiler
from backends.types import Grammar
from service.admission import Admission
from service.config import ServerSettings
from tests.support.fake_backend import FakeBackend
from tests.support.http import until
from tests.support.tiny_checkpoint import EOS, train_tokenizer

HUGE_REGEX = {"type": "regex", "value": "a{1000000}"}


def _nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


class CheckingBackend(FakeBackend):
    """The fake backend with the engine's grammar check on a real tokenizer."""

    def __init__(self) -> None:
        super().__init__()
        tok = train_tokenizer(384)
        self.grammars = GrammarCompiler(tok.to_str(), tok.get_vocab_size(), [tok.token_to_id(EOS)])
        self.checked: list[Grammar] = []
        self.hold: threading.Event | None = None  # set up by a test: each check waits for it (at most 30 s)

    def check_grammar(self, grammar: Grammar) -> None:
        self.checked.append(grammar)
        if self.hold is not None:
            self.hold.wait(30)
        self.grammars.check(grammar)


@pytest.fixture(scope="module")
def server(live_servers):
    backend, admission = CheckingBackend(), Admission(1)
    return live_servers.start(backend, replace(ServerSettings(), max_link_num=1), admission=admission), backend, \
        admission


@pytest.mark.parametrize("path, body, field, words", [
    ("/generate", {"inputs": "x", "parameters": {"grammar": HUGE_REGEX}}, "parameters.grammar",
     "the regex is too complex for the grammar engine"),
    ("/", {"inputs": "x", "parameters": {"grammar": HUGE_REGEX}, "stream": True}, "parameters.grammar",
     "the regex is too complex for the grammar engine"),
    ("/generate", {"inputs": "x", "parameters": {"grammar": {"type": "json",
                                                             "value": json.dumps(_nested_schema(200))}}},
     "parameters.grammar", "the JSON Schema nests too deeply"),
    ("/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "deep", "schema": {"type": "object", "properties": {
                                      "a": {"type": "string", "pattern": "a{1000000}"}}, "required": ["a"]}}}},
     "response_format", "the JSON Schema has a pattern 'a{1000000}' that is too complex for the grammar engine"),
], ids=["generate-regex", "root-stream-regex", "generate-deep-schema", "chat-schema-pattern"])
def test_over_limit_grammar_is_refused_naming_the_field_before_a_slot(server, path, body, field, words):
    url, backend, admission = server
    submitted = len(backend.handles)
    reply = requests.post(url + path, json=body, timeout=60)
    assert reply.status_code == (400 if path.startswith("/v1/") else 422), reply.text  # OpenAI: every refusal 400
    error = reply.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert message.startswith(field) and words in message, message
    assert "<state>" not in message and "Tokens:" not in message
    assert len(backend.handles) == submitted  # never submitted
    assert admission.in_flight == 0 and admission.waiting == 0
    assert requests.get(url + "/health", timeout=10).status_code == 200


def test_a_normal_grammar_passes_the_check_and_generates(server):
    url, backend, _ = server
    grammar = {"type": "json", "value": {"type": "object", "properties": {"name": {"type": "string"}}}}
    reply = requests.post(url + "/generate", json={"inputs": "x", "parameters": {"grammar": grammar}}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert backend.checked[-1].kind == "json" and json.loads(backend.checked[-1].value) == grammar["value"]


def test_the_check_runs_off_the_event_loop(server):
    """While the 1,000,000-repetition regex is being checked (seconds of CPU), the server answers others."""
    url, backend, _ = server
    checks = len(backend.checked)
    replies: list[requests.Response] = []
    backend.hold = threading.Event()  # the check stays under way until the test has its answer
    try:
        thread = threading.Thread(target=lambda: replies.append(requests.post(
            url + "/generate", json={"inputs": "x", "parameters": {"grammar": HUGE_REGEX}}, timeout=60)))
        thread.start()
        assert until(lambda: len(backend.checked) > checks, 30)  # the check has started on its thread
        assert requests.get(url + "/v2/health/live", timeout=10).status_code == 200
        assert not replies and not backend.hold.is_set()  # answered while the check was still held
    finally:
        backend.hold.set()
        backend.hold = None
    thread.join(60)
    assert [r.status_code for r in replies] == [422], [r.text for r in replies]
