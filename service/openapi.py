"""The OpenAPI 3.1 document served at ``GET /openapi.json``, built from the schema files in ``schemas/``.

Every schema file becomes ``components.schemas.<name>`` as loaded (its ``$ref``s rewritten from the
files' ``$id`` URIs to component pointers); ``ROUTES`` says which of them each route takes and returns.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urldefrag, urljoin

from service.config import BUSINESS, MANAGEMENT, METRICS
from service.errors import for_status
from service.info import version
from service.validation import Schemas

COMPONENT_PREFIX = "#/components/schemas/"
_GENERATION_ERRORS = (400, 413, 415, 422, 424, 429, 500, 503)
_OPENAI_ERRORS = (400, 404, 413, 415, 429, 500, 503)
_ANTHROPIC_ERRORS = (400, 404, 413, 415, 500, 503, 529)  # a full line of waiting requests: 529 overloaded_error


@dataclass(frozen=True, slots=True)
class RouteDoc:
    method: str
    path: str
    summary: str
    plane: str = BUSINESS
    request: str | None = None  # a schema pointer under components.schemas, e.g. "generate_request"
    response: str | None = None  # the 200 application/json body
    stream: bool = False  # the 200 may (or, without ``response``, always) be text/event-stream
    event: str = "stream_event"  # the JSON of each ``data:`` event
    errors: tuple[int, ...] = ()
    error_schema: str = "error"
    empty_ok: bool = False  # 200 with no body
    plain_text: bool = False  # 200 is text/plain
    media: tuple[str, ...] = ()  # other media types of the 200 (the playground's page and files)
    playground: bool | None = None  # True: only with ServerConfig.playgroundEnabled; False: only without it
    request_also: dict[str, Any] | None = None  # a rule of this route only, beside the request schema


ROUTES: tuple[RouteDoc, ...] = (
    RouteDoc("post", "/", "Generate (TGI 0.9.4 compat): a one-element list, or SSE with stream: true",
             request="generate_request", response="response", stream=True, errors=_GENERATION_ERRORS),
    RouteDoc("post", "/generate", "Generate (TGI): one JSON object", request="generate_request",
             response="response/$defs/result", errors=_GENERATION_ERRORS),
    RouteDoc("post", "/generate_stream", "Generate (TGI): server-sent events, one per token",
             request="generate_request", stream=True, errors=_GENERATION_ERRORS,
             request_also={"if": {"required": ["parameters"], "properties": {"parameters": {
                               "required": ["decoder_input_details"],
                               "properties": {"decoder_input_details": {"const": True}}}}},
                           "then": {"properties": {"parameters": {"properties": {"decoder_input_details": {
                               "description": "a stream has no prompt details", "not": {}}}}}}}),
    RouteDoc("post", "/v1/completions", "OpenAI-compatible text completion (SSE with stream: true)",
             request="openai_completion_request", response="openai_completion_response", stream=True,
             event="openai_completion_chunk",
             errors=_OPENAI_ERRORS, error_schema="openai_error"),
    RouteDoc("post", "/v1/chat/completions", "OpenAI-compatible chat completion (SSE with stream: true)",
             request="openai_chat_request", response="openai_chat_response", stream=True, event="openai_chat_chunk",
             errors=_OPENAI_ERRORS, error_schema="openai_error"),
    RouteDoc("post", "/v1/responses", "OpenAI Responses API, stateless (SSE with stream: true): translated into a "
             "chat completion", request="openai_responses_request", response="openai_responses_response",
             stream=True, event="openai_responses_event", errors=_OPENAI_ERRORS, error_schema="openai_error"),
    RouteDoc("post", "/v1/messages", "Anthropic Messages API (SSE with stream: true): translated into a chat "
             "completion", request="anthropic_messages_request", response="anthropic_messages_response", stream=True,
             event="anthropic_messages_event", errors=_ANTHROPIC_ERRORS, error_schema="anthropic_error"),
    RouteDoc("post", "/v1/messages/count_tokens", "The prompt tokens a /v1/messages request would report (its "
             "usage.input_tokens)", request="anthropic_count_tokens_request",
             response="anthropic_count_tokens_response", errors=(400, 404, 413, 415, 500, 503),
             error_schema="anthropic_error"),
    RouteDoc("post", "/v1/tokenizer", "Tokenize text as POST / would", request="tokenizer_request",
             response="tokenizer_response", errors=(400, 413, 415, 422)),
    RouteDoc("post", "/tokenize", "Tokenize a prompt, or chat messages rendered with the model's template (vLLM's "
             "shape)", request="tokenize_request", response="tokenize_response", errors=_OPENAI_ERRORS,
             error_schema="openai_error"),
    RouteDoc("post", "/detokenize", "Token ids back to text (vLLM's shape)", request="detokenize_request",
             response="detokenize_response", errors=_OPENAI_ERRORS, error_schema="openai_error"),
    RouteDoc("get", "/v1/models", "The served model (OpenAI list shape)", response="model_list"),
    RouteDoc("get", "/v1/models/{model_id}", "One model (OpenAI shape)", response="model_list/$defs/model",
             errors=(404,)),
    RouteDoc("get", "/v1/loads", "Each model's load in SGLang's shape, for a gateway (?model=NAME: that model's)",
             response="loads_response", errors=(404,)),
    RouteDoc("get", "/openapi.json", "This document"),
    RouteDoc("get", "/", "The playground page (text/html) for a GET whose Accept ranks text/html above "
             "application/json (a browser); any other GET / gets a JSON document pointing at this document",
             response="root_response", media=("text/html",), playground=True),
    RouteDoc("get", "/", "A JSON document pointing at this document (the playground is off)",
             response="root_response", playground=False),
    RouteDoc("get", "/playground", "The playground page: a form for POST / built from this document",
             media=("text/html",), playground=True),
    RouteDoc("get", "/playground/{asset}", "A file of the playground page", media=("text/css", "text/javascript"),
             errors=(404,), playground=True),
    RouteDoc("get", "/health", "200 (empty) once the model is loaded and warmed up; 503 before and while "
             "shutting down", plane=MANAGEMENT, empty_ok=True, errors=(503,)),
    RouteDoc("get", "/v2/health/live", "200 (empty) while the process serves", plane=MANAGEMENT, empty_ok=True),
    RouteDoc("get", "/v2/health/ready", "Same as /health", plane=MANAGEMENT, empty_ok=True, errors=(503,)),
    RouteDoc("get", "/info", "Model and limits (the reference server's /info shape)", plane=MANAGEMENT,
             response="info"),
    RouteDoc("post", "/v1/load_lora_adapter", "Load a LoRA adapter from under loraRoot (only with "
             "allowRuntimeLoraUpdating; 404 otherwise)", plane=MANAGEMENT, request="lora_load_request",
             errors=(400, 404, 413, 415, 422)),
    RouteDoc("post", "/v1/unload_lora_adapter", "Unload a LoRA adapter: refused from now on, freed when its "
             "requests end (only with allowRuntimeLoraUpdating)", plane=MANAGEMENT, request="lora_unload_request",
             errors=(400, 404, 413, 415, 422)),
    RouteDoc("get", "/metrics", "Prometheus metrics (text exposition format)", plane=METRICS, plain_text=True),
)

_PLANE_NOTE = {
    MANAGEMENT: "Management plane: served at ServerConfig.managementIpAddress:managementPort (defaults: "
                "ipAddress, port).",
    METRICS: "Metrics plane: served at ServerConfig.managementIpAddress:metricsPort (defaults: ipAddress, port).",
}


@dataclass(frozen=True, slots=True)
class Served:
    """What the running server serves, for the document to describe it rather than every server: the model
    names a request's ``model`` may be (the base model, then the loaded adapters) and the part types a
    prompt may have (``/info``'s ``accepted_part_types``)."""

    models: tuple[str, ...]
    part_types: tuple[str, ...] = ("text",)
    vocab_size: int | None = None  # the tokenizer's: the ids /detokenize takes are below it


# Where the served names and part types go in the components: (component, path to the schema to narrow)
_MODEL_FIELDS = (("openai_completion_request", ("properties", "model")),
                 ("anthropic_messages_request", ("properties", "model")),
                 ("tokenize_request", ("properties", "model")))
_PART_TYPE_FIELDS = (("generate_request", ("$defs", "part", "properties", "type")),
                     ("openai_chat_request", ("$defs", "content_part", "properties", "type")),
                     ("openai_responses_request", ("$defs", "content_part", "properties", "type")))
_RESPONSES_PART_TYPES = {"input_text": "text", "output_text": "text", "input_image": "image_url"}  # → chat's


def build_openapi(schemas: Schemas, *, playground: bool = True, served: Served | None = None) -> dict[str, Any]:
    """The whole document; routes whose request schema is not loaded are left out, and the playground's
    unless ``playground``. With ``served``, ``model`` fields enumerate the served names and the part types
    are those the loaded model accepts."""
    components = {name: component_schema(schemas.schema(name), schemas) for name in schemas.names}
    if served is not None:
        _describe_served(components, served)
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        if (route.request is not None and route.request not in components) or (
                route.playground is not None and route.playground != playground):
            continue
        operations = paths.setdefault(route.path, {})
        operations[route.method] = _operation(route, components)
        if route.method == "get":
            operations["head"] = _head_operation(operations["get"])
    statuses = sorted({s for route in ROUTES if route.error_schema == "error" for s in route.errors})
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "mindserve",
            "version": version(),
            "summary": "MindSpore LLM inference server: TGI 0.9.4-compatible, OpenAI-compatible, "
                       "Anthropic-compatible and operations routes.",
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "responses": {_error_response_name(s): _error_response(s, "error") for s in statuses},
        },
    }


def _describe_served(components: dict[str, Any], served: Served) -> None:
    """Narrow the components to the running server: ``model`` to its names, part types to the model's."""
    for name, path in _MODEL_FIELDS:
        node = _node(components, name, path)
        if node is not None:
            nullable = "null" in (node.get("type") or [])
            node["enum"] = [*served.models, *([None] if nullable else [])]
            node["description"] = (node.get("description", "") + " This server serves: "
                                   + ", ".join(served.models) + ".").strip()
    for name, path in _PART_TYPE_FIELDS:
        node = _node(components, name, path)
        if node is not None and "enum" in node:
            node["enum"] = [t for t in node["enum"] if _RESPONSES_PART_TYPES.get(t, t) in served.part_types]
    node = _node(components, "parameters", ("properties", "adapter_id"))
    if node is not None:  # "None" (the base model), null, or a loaded adapter
        node["enum"] = ["None", None, *served.models[1:]]
    node = _node(components, "detokenize_request", ("properties", "tokens", "items"))
    if node is not None and served.vocab_size:
        node["maximum"] = served.vocab_size - 1


def _node(components: dict[str, Any], name: str, path: tuple[str, ...]) -> dict[str, Any] | None:
    node = components.get(name)
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def component_schema(schema: dict[str, Any], schemas: Schemas) -> dict[str, Any]:
    """A schema file as a component: ``$schema``/``$id`` dropped, every ``$ref`` made a component pointer."""
    out = copy.deepcopy(schema)
    base = out.pop("$id")
    out.pop("$schema", None)
    ids = {schemas.schema(name)["$id"]: name for name in schemas.names}
    _rewrite_refs(out, base, ids)
    return out


def _rewrite_refs(node: Any, base: str, ids: dict[str, str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            target, fragment = urldefrag(urljoin(base, ref))
            if target in ids:
                node["$ref"] = COMPONENT_PREFIX + ids[target] + fragment  # fragment: "" or "/$defs/…"
        for value in node.values():
            _rewrite_refs(value, base, ids)
    elif isinstance(node, list):
        for value in node:
            _rewrite_refs(value, base, ids)


def _ref(pointer: str) -> dict[str, str]:
    return {"$ref": COMPONENT_PREFIX + pointer}


def _operation(route: RouteDoc, components: dict[str, Any]) -> dict[str, Any]:
    op: dict[str, Any] = {
        "operationId": _operation_id(route),
        "summary": route.summary,
        "tags": [route.plane],
        "responses": {"200": _ok_response(route, components)},
    }
    if route.plane in _PLANE_NOTE:
        op["description"] = _PLANE_NOTE[route.plane]
    if names := re.findall(r"{(\w+)}", route.path):
        op["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                            for name in names]
    if route.request is not None:
        schema = _ref(route.request) if route.request_also is None else {"allOf": [_ref(route.request),
                                                                                    route.request_also]}
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    for status in route.errors:
        op["responses"][str(status)] = (_error_response(status, route.error_schema)
                                        if route.error_schema != "error"
                                        else {"$ref": "#/components/responses/" + _error_response_name(status)})
    return op


def _head_operation(get: dict[str, Any]) -> dict[str, Any]:
    """HEAD on a GET route (what probes send): the same statuses and headers, never a body."""
    op = {key: value for key, value in get.items() if key != "responses"}
    op["operationId"] = "head" + get["operationId"].removeprefix("get")
    op["summary"] = "Same as GET, without the body"
    op["responses"] = {status: {"description": response.get("description")
                                or for_status(int(status), "").error_type.value}
                       for status, response in get["responses"].items()}
    return op


def _ok_response(route: RouteDoc, components: dict[str, Any]) -> dict[str, Any]:
    if route.empty_ok:
        return {"description": "OK (empty body)"}
    content: dict[str, Any] = {}
    if route.response is not None:
        content["application/json"] = {"schema": _ref(route.response)}
    if route.stream:
        event = route.event if route.event in components else None
        content["text/event-stream"] = {"schema": _sse_event(event)}
    if route.plain_text:
        content["text/plain"] = {"schema": {"type": "string"}}
    for media in route.media:
        content[media] = {"schema": {"type": "string"}}
    if not content:
        content["application/json"] = {"schema": {"type": "object"}}
    return {"description": "OK", "content": content}


def _sse_event(event: str | None) -> dict[str, Any]:
    """One server-sent event, as OpenAPI 3.1 tools read a text/event-stream ``schema`` (OpenAPI 3.2 calls it
    ``itemSchema``): its ``data`` is the JSON text of ``event`` (or ``[DONE]``, the OpenAI streams' end)."""
    data: dict[str, Any] = {"type": "string", "contentMediaType": "application/json",
                            "description": "The event's JSON (one line)."}
    if event is not None:
        data["contentSchema"] = _ref(event)
    if event is not None and event.startswith("openai_"):
        data = {"anyOf": [data, {"const": "[DONE]", "description": "The end of an OpenAI stream."}]}
    return {"type": "object", "required": ["data"], "description": "One server-sent event: a `data: <JSON>` line, "
            "then a blank line.", "properties": {"data": data, "event": {"type": "string"},
                                                  "id": {"type": "string"}, "retry": {"type": "integer"}}}


def _error_response(status: int, schema: str) -> dict[str, Any]:
    error = for_status(status, "")
    description = error.error_type.value if schema == "error" else f"HTTP {status}"
    return {"description": description, "content": {"application/json": {"schema": _ref(schema)}}}


def _error_response_name(status: int) -> str:
    return f"Error{status}"


def _operation_id(route: RouteDoc) -> str:
    words = [w for w in route.path.replace("{", "").replace("}", "").replace(".", "_").split("/") if w]
    return route.method + "_" + ("_".join(words) or "root")

