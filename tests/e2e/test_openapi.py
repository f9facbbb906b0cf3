"""``GET /openapi.json``: a valid OpenAPI 3.1 document, built from the schema files, covering every route
the app serves, and describing what the live server actually answers."""
from __future__ import annotations

import json
import re
from importlib import metadata
from typing import Any

import pytest
import requests
from jsonschema import Draft202012Validator
from openapi_spec_validator import OpenAPIV31SpecValidator, validate
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from service.app import make_app
from service.validation import SCHEMA_DIR

ID_BASE = "https://mindserve.dev/schemas/"
DOC_URI = "urn:mindserve:openapi"
PROMPT = "My name is Olivier and I"


@pytest.fixture(scope="module")
def document(server_url) -> dict[str, Any]:
    reply = requests.get(server_url + "/openapi.json", timeout=10)
    assert reply.status_code == 200 and reply.headers["Content-Type"].startswith("application/json")
    return reply.json()


def test_document_validates_as_openapi_3_1(document):
    assert document["openapi"].startswith("3.1.")
    validate(document, cls=OpenAPIV31SpecValidator)
    assert document["info"]["version"] == metadata.version("mindserve")


def _path_template(pattern: str) -> str:
    pattern = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", pattern)  # a named group is a path parameter
    return pattern.removesuffix("$").replace("(.+)", "{model_id}").replace("\\.", ".")


def test_every_served_route_is_documented_and_nothing_else(default_engine, document):
    app = make_app(default_engine)
    served = {_path_template(rule.matcher.regex.pattern) for rule in app.wildcard_router.rules}
    assert served == set(document["paths"])


def _expected_component(name: str, schema: Any) -> Any:
    """The file as a component: refs to a file's $id or to "#..." become component pointers."""
    if isinstance(schema, dict):
        out = {}
        for key, value in schema.items():
            if key in ("$id", "$schema"):
                continue
            if key == "$ref":
                if value.startswith("#"):
                    value = f"#/components/schemas/{name}{value[1:]}"
                else:
                    target, _, fragment = value.removeprefix(ID_BASE).partition("#")
                    value = f"#/components/schemas/{target.removesuffix('.schema.json')}{fragment}"
            out[key] = _expected_component(name, value)
        return out
    if isinstance(schema, list):
        return [_expected_component(name, v) for v in schema]
    return schema


# The nodes the served document narrows to the running server (the model names, the part types it accepts)
NARROWED = {("openai_completion_request", "properties", "model"), ("tokenize_request", "properties", "model"),
            ("anthropic_messages_request", "properties", "model"),
            ("generate_request", "$defs", "part", "properties", "type"),
            ("openai_chat_request", "$defs", "content_part", "properties", "type"),
            ("openai_responses_request", "$defs", "content_part", "properties", "type"),
            ("parameters", "properties", "adapter_id"), ("detokenize_request", "properties", "tokens", "items")}


def _at(tree: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for key in path:
        tree = tree[key]
    return tree


def test_components_are_the_schema_files_narrowed_to_the_server(document, default_engine):
    files = {p.name.removesuffix(".schema.json"): json.loads(p.read_text(encoding="utf-8"))
             for p in SCHEMA_DIR.glob("*.schema.json")}
    components = document["components"]["schemas"]
    assert set(components) == set(files)
    expected = {name: _expected_component(name, schema) for name, schema in files.items()}
    name = default_engine.model_name
    assert _at(components, ("openai_completion_request", "properties", "model"))["enum"] == [name]
    assert _at(components, ("tokenize_request", "properties", "model"))["enum"] == [name, None]
    assert _at(components, ("anthropic_messages_request", "properties", "model"))["enum"] == [name]
    assert _at(components, ("generate_request", "$defs", "part", "properties", "type"))["enum"] == ["text"]
    assert _at(components, ("openai_chat_request", "$defs", "content_part", "properties", "type"))["enum"] == ["text"]
    assert _at(components, ("openai_responses_request", "$defs", "content_part", "properties", "type"))["enum"] == [
        "input_text", "output_text"]
    assert _at(components, ("parameters", "properties", "adapter_id"))["enum"] == ["None", None]  # no adapters
    vocab = default_engine.tokenizer.vocab_size
    assert _at(components, ("detokenize_request", "properties", "tokens", "items"))["maximum"] == vocab - 1
    for path in NARROWED:  # the rest of each file is as it is
        for tree in (components, expected):
            for key in ("enum", "description", "maximum"):
                _at(tree, path).pop(key, None)
    for schema_name in files:
        assert components[schema_name] == expected[schema_name], schema_name


def _refs(node: Any):
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_every_ref_points_inside_the_document(document):
    refs = set(_refs(document))
    assert refs
    for ref in refs:
        assert ref.startswith("#/"), ref
        node: Any = document
        for part in ref[2:].split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        assert isinstance(node, dict), ref


def test_routes_name_their_request_and_error_schemas(document):
    paths = document["paths"]
    for path in ("/", "/generate", "/generate_stream"):
        op = paths[path]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        if path == "/generate_stream":  # with its own rule: a stream has no prompt details
            schema, rule = schema["allOf"]
            assert "decoder_input_details" in json.dumps(rule)
        assert schema == {"$ref": "#/components/schemas/generate_request"}
        assert {"400", "422", "424", "429", "500", "503"} <= set(op["responses"])
    assert paths["/generate"]["post"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/response/$defs/result"}
    assert "text/event-stream" in paths["/generate_stream"]["post"]["responses"]["200"]["content"]
    assert paths["/v1/tokenizer"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/tokenizer_request"}
    error = document["components"]["responses"]["Error422"]
    assert error["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/error"}
    assert error["description"] == "Input Validation Error"
    assert paths["/health"]["get"]["tags"] == ["management"] and paths["/metrics"]["get"]["tags"] == ["metrics"]


def _response_validator(document: dict[str, Any], path: str, method: str, status: str,
                        media: str = "application/json") -> Draft202012Validator:
    response = document["paths"][path][method]["responses"][status]
    if "$ref" in response:
        response = document["components"]["responses"][response["$ref"].rsplit("/", 1)[1]]
    schema = response["content"][media]["schema"]
    registry = Registry().with_resource(DOC_URI, Resource.from_contents(document, default_specification=DRAFT202012))
    ref = schema["$ref"]
    return Draft202012Validator({"$ref": DOC_URI + ref}, registry=registry)


@pytest.mark.parametrize("method, path, body, status", [
    ("post", "/", {"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "details": True}}, "200"),
    ("post", "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "decoder_input_details": True}},
     "200"),
    ("post", "/generate", {"inputs": PROMPT, "parameters": {"top_k": 0}}, "422"),
    ("post", "/v1/tokenizer", {"inputs": PROMPT}, "200"),
    ("get", "/v1/models", None, "200"),
    ("get", "/info", None, "200"),
    ("get", "/", None, "200"),
    ("post", "/tokenize", {"prompt": PROMPT, "return_token_strs": True}, "200"),
    ("post", "/tokenize", {"messages": [{"role": "user", "content": PROMPT}]}, "200"),
    ("post", "/detokenize", {"tokens": [1, 2, 3]}, "200"),
])
def test_live_responses_match_the_documented_schemas(server_url, document, method, path, body, status):
    reply = requests.request(method, server_url + path, json=body, timeout=120)
    assert str(reply.status_code) == status, reply.text
    validator = _response_validator(document, path, method, status)
    errors = [e.message for e in validator.iter_errors(reply.json())]
    assert not errors


def test_documented_model_path_matches_a_live_model(server_url, document, default_engine):
    reply = requests.get(f"{server_url}/v1/models/{default_engine.model_name}", timeout=10)
    validator = _response_validator(document, "/v1/models/{model_id}", "get", "200")
    assert validator.is_valid(reply.json())
    ids = [op["operationId"] for item in document["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids)) and all(re.fullmatch(r"[a-z0-9_]+", i) for i in ids)
