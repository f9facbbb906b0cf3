"""The schema files: valid Draft 2020-12, $refs resolve, the request cases of tests/data/schema_cases.json
hold (schema and cross-field rules), messages name the field and value, and server configs validate."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator

from service.body import parse_json_body
from service.context import RequestLimits
from service.dialects.tgi import parse_generate_request
from service.errors import BadRequest, ErrorType, ValidationError
from service.validation import SCHEMA_DIR, Schemas, describe
from tests.support.paths import REPO as ROOT
from tests.support.schema_cases import load_cases

ID_BASE = "https://mindserve.dev/schemas/"
DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_FILES = sorted(SCHEMA_DIR.glob("*.schema.json"))
EXPECTED_SCHEMAS = {"generate_request", "parameters", "response", "stream_event", "error", "server_config",
                    "openai_completion_request", "openai_chat_request", "openai_error",
                    "openai_completion_response", "openai_chat_response", "openai_completion_chunk",
                    "openai_chat_chunk", "openai_responses_request", "openai_responses_response",
                    "openai_responses_event",
                    "tokenizer_request", "tokenizer_response", "tokenize_request", "tokenize_response",
                    "detokenize_request", "detokenize_response", "root_response", "info", "model_list",
                    "lora_load_request", "lora_unload_request", "loads_response",
                    "anthropic_messages_request", "anthropic_messages_response", "anthropic_messages_event",
                    "anthropic_count_tokens_request", "anthropic_count_tokens_response", "anthropic_error"}


CASES_DOC = load_cases()
CASES = CASES_DOC["cases"]
FILE_LIMITS = RequestLimits(
    media_types=frozenset(CASES_DOC["limits"]["media_types"]),
    adapter_ids=frozenset(CASES_DOC["limits"]["adapter_ids"]),
)


@pytest.fixture(scope="module")
def schemas() -> Schemas:
    return Schemas(SCHEMA_DIR)


def _schema_valid(case: dict[str, Any]) -> bool:
    return case.get("valid_schema", case["valid"])


def _walk_refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _walk_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk_refs(value)


# --- the schema files --------------------------------------------------------------------------------

def test_all_expected_schema_files_exist(schemas: Schemas) -> None:
    assert set(schemas.names) == EXPECTED_SCHEMAS


@pytest.mark.parametrize("path", SCHEMA_FILES, ids=lambda p: p.name)
def test_schema_file_is_valid_draft_2020_12(path: Path) -> None:
    schema = json.loads(path.read_text(encoding="utf-8"))
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == DRAFT_2020_12
    assert schema["$id"] == ID_BASE + path.name


@pytest.mark.parametrize("path", SCHEMA_FILES, ids=lambda p: p.name)
def test_every_ref_resolves(schemas: Schemas, path: Path) -> None:
    schema = json.loads(path.read_text(encoding="utf-8"))
    resolver = schemas.registry.resolver(base_uri=schema["$id"])
    refs = list(_walk_refs(schema))
    for ref in refs:
        resolved = resolver.lookup(ref).contents
        assert isinstance(resolved, (dict, bool)), ref
    if path.name in {"generate_request.schema.json", "stream_event.schema.json"}:
        assert any(ref.startswith(ID_BASE) for ref in refs), "expected a cross-file $ref"


# --- the request cases ---------------------------------------------------------------------------------

def test_cases_file_is_consistent() -> None:
    names = [case["name"] for case in CASES]
    assert len(names) == len(set(names))
    for case in CASES:
        assert case["status"] in (200, 422), case["name"]
        if not case["valid"]:
            assert case["status"] == 422 and case.get("error_contains"), case["name"]
        if "valid_schema" in case:
            assert case["valid_schema"] and not case["valid"], case["name"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_case_against_schema(schemas: Schemas, case: dict[str, Any]) -> None:
    expected = _schema_valid(case)
    if expected:
        schemas.validate("generate_request", case["body"])
        return
    with pytest.raises(ValidationError) as caught:
        schemas.validate("generate_request", case["body"])
    for fragment in case["error_contains"]:
        assert fragment in str(caught.value), (fragment, str(caught.value))


@pytest.mark.parametrize("case", [c for c in CASES if _schema_valid(c)], ids=lambda c: c["name"])
def test_case_against_cross_field_rules(case: dict[str, Any]) -> None:
    if case["valid"]:
        parse_generate_request(case["body"], limits=FILE_LIMITS)
        return
    with pytest.raises(ValidationError) as caught:
        parse_generate_request(case["body"], limits=FILE_LIMITS)
    for fragment in case["error_contains"]:
        assert fragment in str(caught.value), (fragment, str(caught.value))


def test_cases_cover_every_parameter(schemas: Schemas) -> None:
    fields = set(schemas.schema("parameters")["properties"])
    covered = {key for case in CASES if isinstance(case["body"], dict)
               for key in (case["body"].get("parameters") or {})}
    assert fields <= covered, fields - covered


# --- messages --------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, message", [
    ({"inputs": "x", "parameters": {"top_p": 1.0}}, "parameters.top_p must be < 1.0, got 1.0"),
    ({"inputs": "x", "parameters": {"tmperature": 0.5}},
     "parameters.tmperature is not a known parameter (did you mean temperature?)"),
    ({"inputs": ""}, "inputs must not be empty"),
    ({}, "inputs is required"),
    ({"inputs": "x", "parameters": {"seed": 0}}, "parameters.seed must be >= 1, got 0"),
    ({"inputs": "x", "parameters": {"details": "true"}},
     'parameters.details must be a boolean or null, got "true"'),
    ({"inputs": "x", "parameters": {"stop": ["a", ""]}}, "parameters.stop[1] must not be empty"),
    ({"inputs": "x", "parameters": {"adapter_id": "a b"}},
     'parameters.adapter_id must match ^[A-Za-z0-9._/-]{1,256}$, got "a b"'),
    ({"inputs": "x", "parameters": {"best_of": 2}}, "parameters.best_of must be one of null, 1; got 2"),
    ({"inputs": [{"type": "text", "text": "a", "image_url": "b"}]},
     'inputs[0].image_url is not allowed here, got "b"'),
    ([1], "request body must be an object, got [1]"),
])
def test_message_wording(schemas: Schemas, body: Any, message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        schemas.validate("generate_request", body)
    assert str(caught.value) == message
    assert caught.value.status == 422 and caught.value.error_type is ErrorType.VALIDATION


def test_first_error_is_the_one_every_refusal_reports(schemas: Schemas) -> None:
    assert schemas.first_error("generate_request", {"inputs": "x"}) is None
    error = schemas.first_error("generate_request", {"inputs": "x", "parameters": {"seed": 0, "top_p": 1.0}})
    assert error is not None
    with pytest.raises(ValidationError) as caught:
        schemas.validate("generate_request", {"inputs": "x", "parameters": {"seed": 0, "top_p": 1.0}})
    assert str(caught.value) == describe(error)


class _CountedList(list):
    """A JSON array that counts how often it is walked item by item (iterated or indexed)."""
    walks = 0

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()

    def __getitem__(self, index):
        type(self).walks += 1
        return super().__getitem__(index)


@pytest.mark.parametrize("schema, body", [
    ("generate_request", lambda big: {"inputs": "x", "parameters": {"stop": big}}),  # through a $ref'd file
    ("openai_chat_request", lambda big: {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                         "stop": big}),
])
def test_an_array_over_its_max_items_is_refused_without_walking_its_items(schemas: Schemas, schema, body) -> None:
    """200,000 stop strings cost 3-10 s of CPU per request when every item was checked (to pick the most relevant
    of all errors); the maxItems error is the one reported, and the items are not walked."""
    big = _CountedList(["s"] * 200_000)
    _CountedList.walks = 0
    with pytest.raises(ValidationError) as caught:
        schemas.validate(schema, body(big))
    assert "stop" in str(caught.value) and "200000" in str(caught.value), str(caught.value)
    assert _CountedList.walks == 0


def test_long_values_are_cut_in_messages(schemas: Schemas) -> None:
    with pytest.raises(ValidationError) as caught:
        schemas.validate("generate_request", {"inputs": "x", "parameters": {"stop": ["é" * 5000]}})
    assert "5000" in str(caught.value) and len(str(caught.value)) < 250


def test_unknown_schema_name_is_a_key_error(schemas: Schemas) -> None:
    with pytest.raises(KeyError, match="generate_request"):
        schemas.validate("generate_reqest", {})


@pytest.mark.parametrize("raw", [b"{", b"NaN", b'{"inputs": "x", "parameters": {"temperature": Infinity}}',
                                 b'{"inputs": "x", "parameters": {"temperature": 1e999}}', b"\xff\xfe\x00",
                                 b"[" * 100000])
def test_parse_json_body_rejects_non_json(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_json_body(raw)


def test_parse_json_body_keeps_big_integers() -> None:
    assert parse_json_body(b'{"seed": 18446744073709551615}') == {"seed": 18446744073709551615}


# --- response-side schemas --------------------------------------------------------------------------------

TOKEN = {"id": 2776, "logprob": -0.53, "special": False, "text": "'m"}
RESPONSE = [{"details": {"prompt_tokens": 6, "finish_reason": "length", "generated_tokens": 1,
                         "prefill": [{"id": 5050, "logprob": None, "special": False, "text": "My"}],
                         "seed": 789070824, "tokens": [TOKEN]}, "generated_text": "'m"}]
EVENT = {"token": {"id": [29915], "text": "'", "logprob": -0.1, "special": False},
         "generated_text": None, "details": None}
LAST_EVENT = {"token": {"id": 263, "text": " a", "logprob": None, "special": False}, "generated_text": "'m a",
              "details": {"prompt_tokens": 8, "finish_reason": "length", "generated_tokens": 2, "seed": 218884523}}


@pytest.mark.parametrize("name, instance, valid", [
    ("response", RESPONSE, True),
    ("response", [{"generated_text": "hi"}], True),
    ("response", [{"generated_text": "hi"}, {"generated_text": "again"}], False),
    ("response", {"generated_text": "hi"}, False),
    ("response", [{"details": {**RESPONSE[0]["details"], "finish_reason": "stop"}, "generated_text": "x"}], False),
    ("response", [{"details": {**RESPONSE[0]["details"], "tokens": [{**TOKEN, "special": None}]},
                   "generated_text": "x"}], False),
    ("stream_event", EVENT, True),
    ("stream_event", LAST_EVENT, True),
    ("stream_event", {**EVENT, "token": {**EVENT["token"], "id": []}}, False),
    ("stream_event", {"error": "Request failed during generation", "error_type": "Generation Error"}, True),
    ("stream_event", {"token": EVENT["token"]}, False),
    ("error", {"error": "parameters.top_p must be < 1.0, got 1.0", "error_type": "Input Validation Error"}, True),
    ("error", {"error": "x", "error_type": "validation"}, False),
    ("error", {"error": "x", "error_type": "Bad Request", "code": 400}, False),
])
def test_response_side_schemas(schemas: Schemas, name: str, instance: Any, valid: bool) -> None:
    assert schemas.is_valid(name, instance) is valid


def test_error_schema_lists_every_error_type(schemas: Schemas) -> None:
    assert set(schemas.schema("error")["properties"]["error_type"]["enum"]) == {t.value for t in ErrorType}


# --- server configuration -----------------------------------------------------------------------------------

REFERENCE_CONFIG: dict[str, Any] = {
    "Version": "1.0.0",
    "ServerConfig": {
        "ipAddress": "127.0.0.1", "managementIpAddress": "127.0.0.2", "port": 1025, "managementPort": 1026,
        "metricsPort": 1027, "allowAllZeroIpListening": False, "maxLinkNum": 1000, "httpsEnabled": True,
        "fullTextEnabled": False, "tlsCaPath": "security/ca/", "tlsCaFile": ["ca.pem"],
        "tlsCert": "security/certs/server.pem", "tlsPk": "security/keys/server.key.pem",
        "tlsCrlPath": "security/certs/", "tlsCrlFiles": ["server_crl.pem"], "inferMode": "standard",
        "interCommTLSEnabled": True, "interCommPort": 1121, "openAiSupport": "vllm", "tokenTimeout": 600,
        "e2eTimeout": 600, "distDPServerEnabled": False, "HealthCheckConfig": {"npuUsageThreshold": 0},
    },
    "BackendConfig": {
        "backendName": "mindieservice_llm_engine", "modelInstanceNumber": 1, "npuDeviceIds": [[0, 1, 2, 3]],
        "tokenizerProcessNumber": 8, "multiNodesInferEnabled": False, "multiNodesInferPort": 1120,
        "kvPoolConfig": {"backend": "", "configPath": ""},
        "ModelDeployConfig": {
            "maxSeqLen": 2560, "maxInputTokenLen": 2048, "truncation": 0,
            "ModelConfig": [{
                "modelInstanceType": "Standard", "modelName": "llama_65b",
                "modelWeightPath": "/data/atb_testdata/weights/llama1-65b-safetensors", "worldSize": 4,
                "cpuMemSize": 0, "npuMemSize": -1, "backendType": "ms", "trustRemoteCode": False,
                "async_scheduler_wait_time": 120, "kv_trans_timeout": 10, "kv_link_timeout": 1080,
            }],
        },
        "ScheduleConfig": {
            "templateType": "Standard", "templateName": "Standard_LLM", "cacheBlockSize": 128,
            "maxPrefillBatchSize": 50, "maxPrefillTokens": 8192, "prefillTimeMsPerReq": 150,
            "prefillPolicyType": 0, "decodeTimeMsPerReq": 50, "decodePolicyType": 0, "maxBatchSize": 200,
            "maxIterTimes": 512, "maxPreemptCount": 0, "supportSelectBatch": False,
            "maxQueueDelayMicroseconds": 5000, "maxFirstTokenWaitTime": 2500,
        },
    },
    "LogConfig": {"dynamicLogLevel": "", "dynamicLogLevelValidHours": 2, "dynamicLogLevelValidTime": ""},
    "EnableDynamicAdjustTimeoutConfig": False,
}
MINIMAL_CONFIG: dict[str, Any] = {
    "ServerConfig": {"port": 0, "tokenIdFormat": "int", "maxRequestLength": 1},
    "BackendConfig": {
        "ModelDeployConfig": {"ModelConfig": [{"modelName": "smollm2", "modelWeightPath": "models/smollm2"}]},
        "ScheduleConfig": {"batchBuckets": [1, 2, 4], "windowBuckets": [256, 512]},
    },
}


def _with(config: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``config`` with the dotted ``path`` set (ints index lists)."""
    copy = json.loads(json.dumps(config))
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = copy
    for key in parents:
        node = node[key]
    node[last] = value
    return copy


@pytest.mark.parametrize("config", [REFERENCE_CONFIG, MINIMAL_CONFIG], ids=["reference", "minimal"])
def test_example_config_validates(schemas: Schemas, config: dict[str, Any]) -> None:
    schemas.validate("server_config", config, root="config")


@pytest.mark.parametrize("path, value, fragment", [
    ("ServerConfig.port", 70000, "ServerConfig.port must be <= 65535, got 70000"),
    ("ServerConfig.port", "1025", 'ServerConfig.port must be an integer, got "1025"'),
    ("ServerConfig.ipAddress", "1.2.3", 'ServerConfig.ipAddress is invalid'),
    ("ServerConfig.tokenIdFormat", "str", 'ServerConfig.tokenIdFormat must be one of "list", "int"; got "str"'),
    ("ServerConfig.maxRequestLength", 101, "ServerConfig.maxRequestLength must be <= 100, got 101"),
    ("ServerConfig.maxLinkNum", 0, "ServerConfig.maxLinkNum must be >= 1, got 0"),
    ("ServerConfig.tokenTimeout", 3601, "ServerConfig.tokenTimeout must be <= 3600, got 3601"),
    ("ServerConfig.adapters", {"sql-lora/v1": "/a"}, "ServerConfig.adapters is not allowed: Not a key of this server"),
    ("ServerConfig.adapters", {}, "ServerConfig.adapters is not allowed: Not a key of this server"),
    ("BackendConfig.ModelDeployConfig.ModelConfig", [], "ModelConfig must not be empty"),
    ("BackendConfig.ModelDeployConfig.ModelConfig.0.backendType", "atb", 'backendType must be "ms", got "atb"'),
    ("BackendConfig.ModelDeployConfig.ModelConfig.0.modelName", "-x", "modelName must match"),
    ("BackendConfig.ModelDeployConfig.maxInputTokenLen", 0, "maxInputTokenLen must be >= 1, got 0"),
    ("BackendConfig.ScheduleConfig.cacheBlockSize", 256, "cacheBlockSize must be <= 128, got 256"),
    ("BackendConfig.ScheduleConfig.batchBuckets", [1, 1], "batchBuckets must not contain duplicates"),
    ("BackendConfig.ScheduleConfig.windowBuckets", [0], "windowBuckets[0] must be >= 1, got 0"),
])
def test_bad_config_names_the_key(schemas: Schemas, path: str, value: Any, fragment: str) -> None:
    with pytest.raises(ValidationError) as caught:
        schemas.validate("server_config", _with(MINIMAL_CONFIG, path, value), root="config")
    assert fragment in str(caught.value)


def test_https_needs_cert_and_key(schemas: Schemas) -> None:
    with pytest.raises(ValidationError, match=r"ServerConfig\.tlsCert is required"):
        schemas.validate("server_config", _with(MINIMAL_CONFIG, "ServerConfig.httpsEnabled", True))


def test_missing_backend_config_is_named(schemas: Schemas) -> None:
    errors = list(schemas.validator("server_config").iter_errors({"ServerConfig": {}}))
    assert [describe(e, root="config") for e in errors] == ["BackendConfig is required"]


def _repo_server_configs() -> list[Path]:
    files = [p for ext in ("json", "yaml", "yml") for p in sorted((ROOT / "configs").glob(f"**/*.{ext}"))]
    out = []
    for path in files:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))  # YAML is a superset of JSON
        if isinstance(data, dict) and "BackendConfig" in data:
            out.append(path)
    return out


@pytest.mark.parametrize("path", _repo_server_configs(), ids=lambda p: p.name)
def test_repo_server_configs_validate(schemas: Schemas, path: Path) -> None:
    schemas.validate("server_config", yaml.safe_load(path.read_text(encoding="utf-8")), root=path.name)
