"""Every request case of tests/data/schema_cases.json, sent to a live server on a real socket: the status the
file expects (200 or 422) and, for errors, an ``{"error", "error_type"}`` body naming what is wrong.

The server is the file's "reference test server": the default model, text only, no LoRA adapters loaded
(the file's ``limits``). Valid cases are made cheap to generate (see ``shortened``); the length caps
themselves are checked in test_e2e_generate.py.
"""
from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from service.context import RequestLimits
from tests.support.http import error_json, ok_json, post, stream_events
from tests.support.schema_cases import load_cases

CASES_DOC = load_cases()
CASES = CASES_DOC["cases"]
LIMITS = RequestLimits(media_types=frozenset(CASES_DOC["limits"]["media_types"]),
                       adapter_ids=frozenset(CASES_DOC["limits"]["adapter_ids"]))
SHORT = 2  # max_new_tokens forced on valid cases, to keep the run short
# Cases whose point is the shape of `parameters` itself: sent exactly as written (20 tokens each).
SENT_AS_IS = {"only_inputs", "parameters_null", "parameters_empty", "all_parameters_null"}
# What an answer must also say beyond the file's error_contains (cases the file leaves open).
EXTRA_FRAGMENTS = {"inputs_max_chars": ["1048576 tokens", "200"]}


@pytest.fixture(scope="module")
def cases_url(live_servers: Any, default_engine: Any) -> str:
    return live_servers.start(default_engine, limits=LIMITS)


def shortened(case: dict[str, Any]) -> dict[str, Any]:
    """The case's body, made cheap to generate: a small max_new_tokens when the case is not about it; when
    it is (2147483647, null), a stop string ending the greedy text at its first "." (9 tokens) instead."""
    body = case["body"]
    if case["status"] != 200 or case["name"] in SENT_AS_IS:
        return body
    body = copy.deepcopy(body)
    parameters = body.setdefault("parameters", {})
    if parameters.get("max_new_tokens") is not None and parameters["max_new_tokens"] <= SHORT:
        return body
    if case["name"].startswith("max_new_tokens"):
        assert parameters.get("stop") is None, case["name"]
        parameters["stop"] = ["."]
    else:
        parameters["max_new_tokens"] = SHORT
    return body


def _case_id(case: dict[str, Any]) -> str:
    return case["name"]


def test_every_case_is_sent() -> None:
    assert len(CASES) > 100
    assert {c["status"] for c in CASES} == {200, 422}


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_case_on_live_server(cases_url: str, case: dict[str, Any]) -> None:
    body = shortened(case)
    reply = post(cases_url, None, data=json.dumps(body).encode("utf-8"),
                 headers={"Content-Type": "application/json"})
    if case["status"] == 422:
        message = error_json(reply, 422, "Input Validation Error")
        for fragment in case.get("error_contains", []) + EXTRA_FRAGMENTS.get(case["name"], []):
            assert fragment in message, (fragment, message)
        return
    assert case["status"] == 200
    if isinstance(body, dict) and body.get("stream"):
        events = stream_events(reply)
        assert all(isinstance(e["token"]["id"], list) for e in events)
        return
    result = ok_json(reply)
    parameters = body.get("parameters") or {}
    want_details = bool(parameters.get("details") or parameters.get("decoder_input_details"))
    assert ("details" in result) is want_details
    if want_details:
        details = result["details"]
        assert details["generated_tokens"] == len(details["tokens"]) <= min(
            parameters.get("max_new_tokens") or 20, 64)
        if isinstance(parameters.get("seed"), int):
            assert details["seed"] == parameters["seed"]
