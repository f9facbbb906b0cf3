"""The JSON Schema files in ``schemas/`` → one Draft 2020-12 validator each, built once at start-up.
The files are read as package data (``service.package_data.SCHEMA_DIR``), so a wheel install finds them too.

``Schemas.validate(name, instance)`` raises the domain ``ValidationError`` with a human message naming
the field path and the offending value, e.g. ``parameters.top_p must be < 1.0, got 1.0``.
"""
from __future__ import annotations

import difflib
import functools
import json
import os
from collections.abc import Iterable, Mapping
from importlib.abc import Traversable
from pathlib import Path
from typing import Any, Callable

import jsonschema.exceptions
import jsonschema.validators
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from service.checked_schemas import default_stamp_dir, mark_checked, schema_set_key, was_checked
from service.errors import ValidationError
from service.package_data import SCHEMA_DIR

SCHEMA_SUFFIX = ".schema.json"
MAX_SHOWN_CHARS = 100
REQUEST_BODY = "request body"
_STRICT_END = "$(?!\\n)"  # patterns end so; shown to users as plain "$"

SchemaError = jsonschema.exceptions.SchemaError
_JsonError = jsonschema.exceptions.ValidationError
_DRAFT_ITEMS = Draft202012Validator.VALIDATORS["items"]


def _items_within_max(validator, items, instance, schema):
    """``items``, skipped for an array already over its ``maxItems``: that error is reported and is the one
    ``best_match`` picks, while checking every item of, say, 200,000 stop strings would cost seconds of CPU per
    request (all errors are collected to choose the most relevant)."""
    if validator.is_type(instance, "array") and len(instance) > schema.get("maxItems", len(instance)):
        return
    yield from _DRAFT_ITEMS(validator, items, instance, schema)


_Validator = jsonschema.validators.extend(Draft202012Validator, {"items": _items_within_max})


class Schemas:
    """Every ``*.schema.json`` of a directory, checked, registered by ``$id``, one validator each."""

    def __init__(self, schema_dir: Traversable | str | os.PathLike = SCHEMA_DIR, *,
                 stamp_dir: Path | None = None) -> None:
        """``stamp_dir``: where the sets of files that passed the meta-schema check are stamped
        (``checked_schemas.py``; default under ~/.cache/mindserve)."""
        self.schema_dir = Path(schema_dir) if isinstance(schema_dir, (str, os.PathLike)) else schema_dir
        self._schemas = _read_schemas(self.schema_dir, stamp_dir or default_stamp_dir())
        # Validated without their "$schema" (every file is Draft 2020-12, checked above): with it, a $ref into
        # another file would be validated by jsonschema's stock Draft202012Validator, not by _Validator.
        plain = {name: {k: v for k, v in schema.items() if k != "$schema"} for name, schema in self._schemas.items()}
        self.registry: Registry = Registry().with_resources(
            (schema["$id"], Resource.from_contents(schema, default_specification=DRAFT202012))
            for schema in plain.values()
        )
        self._validators = {
            name: _Validator(schema, registry=self.registry, format_checker=Draft202012Validator.FORMAT_CHECKER)
            for name, schema in plain.items()
        }

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._schemas))

    def schema(self, name: str) -> dict[str, Any]:
        return self._schemas[name]

    def validator(self, name: str) -> Draft202012Validator:
        try:
            return self._validators[name]
        except KeyError:
            have = ", ".join(self.names)
            raise KeyError(f"no schema named {name!r} in {self.schema_dir} (have: {have})") from None

    def is_valid(self, name: str, instance: Any) -> bool:
        return self.validator(name).is_valid(instance)

    def first_error(self, name: str, instance: Any) -> _JsonError | None:
        """The most relevant of ``instance``'s errors against schema ``name`` (``best_match``), None when valid:
        the one error every refusal reports (``describe`` words it)."""
        return jsonschema.exceptions.best_match(self.validator(name).iter_errors(instance))

    def validate(self, name: str, instance: Any, *, root: str = REQUEST_BODY) -> None:
        """Raise ``ValidationError`` describing the most relevant error; ``root`` names the whole instance."""
        error = self.first_error(name, instance)
        if error is not None:
            raise ValidationError(describe(error, root=root))


@functools.cache
def default_schemas() -> Schemas:
    """The package's schemas (the repository's ``schemas/``), loaded once per process."""
    return Schemas(SCHEMA_DIR)


def validate(name: str, instance: Any, *, root: str = REQUEST_BODY) -> None:
    """``default_schemas().validate(...)``: validate against ``schemas/<name>.schema.json``."""
    default_schemas().validate(name, instance, root=root)


def _read_schemas(schema_dir: Traversable, stamp_dir: Path) -> dict[str, dict[str, Any]]:
    """Every schema file, checked against the meta-schema unless these very bytes passed before (a stamp)."""
    schemas: dict[str, dict[str, Any]] = {}
    found = schema_dir.iterdir() if schema_dir.is_dir() else ()
    paths = sorted((p for p in found if p.name.endswith(SCHEMA_SUFFIX)), key=lambda p: p.name)
    texts = {path.name: path.read_text(encoding="utf-8") for path in paths}
    key = schema_set_key(texts)
    checked = was_checked(key, stamp_dir)
    for path in paths:
        schema = json.loads(texts[path.name])
        try:
            if not checked:
                Draft202012Validator.check_schema(schema)
        except SchemaError as exc:
            raise SchemaError(f"{path}: {exc.message}") from exc
        if "$id" not in schema:
            raise SchemaError(f"{path}: missing $id")
        schemas[path.name.removesuffix(SCHEMA_SUFFIX)] = schema
    if not schemas:
        raise FileNotFoundError(f"no *{SCHEMA_SUFFIX} files in {schema_dir}")
    if not checked:
        mark_checked(key, stamp_dir)
    return schemas


# --- messages -------------------------------------------------------------------------------------

def describe(error: _JsonError, *, root: str = REQUEST_BODY) -> str:
    """One sentence naming the field (``parameters.stop[2]``) and the offending value."""
    where = field_path(error.absolute_path) or root
    if "propertyNames" in error.absolute_schema_path:
        where += " key"
    render = _RENDERERS.get(str(error.validator), _render_other)
    return render(where, error)


def field_path(path: Iterable[str | int]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def show(value: Any) -> str:
    """A JSON rendering of ``value`` cut to about 100 characters."""
    if isinstance(value, str) and len(value) > MAX_SHOWN_CHARS:
        return json.dumps(value[:MAX_SHOWN_CHARS] + "…", ensure_ascii=False)
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + "…"


_TYPE_NAMES = {
    "string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
    "object": "an object", "array": "a list", "null": "null",
}


def _type_phrase(types: str | list[str]) -> str:
    names = [_TYPE_NAMES.get(t, t) for t in ([types] if isinstance(types, str) else types)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _join(where: str, key: str, root_level: bool) -> str:
    return key if root_level else f"{where}.{key}"


def _render_type(where: str, e: _JsonError) -> str:
    return f"{where} must be {_type_phrase(e.validator_value)}, got {show(e.instance)}"


def _bound(symbol: str) -> Callable[[str, _JsonError], str]:
    return lambda where, e: f"{where} must be {symbol} {show(e.validator_value)}, got {show(e.instance)}"


def _render_min_length(where: str, e: _JsonError) -> str:
    if e.validator_value == 1:
        return f"{where} must not be empty"
    return f"{where} must be at least {e.validator_value} characters, got {len(e.instance)}: {show(e.instance)}"


def _render_max_length(where: str, e: _JsonError) -> str:
    return f"{where} must be at most {e.validator_value} characters, got {len(e.instance)}: {show(e.instance)}"


def _render_min_items(where: str, e: _JsonError) -> str:
    if e.validator_value == 1:
        return f"{where} must not be empty"
    return f"{where} must have at least {e.validator_value} items, got {len(e.instance)}"


def _render_max_items(where: str, e: _JsonError) -> str:
    return f"{where} must have at most {e.validator_value} items, got {len(e.instance)}"


def _render_required(where: str, e: _JsonError) -> str:
    missing = [key for key in e.validator_value if key not in e.instance]
    root_level = not e.absolute_path
    return f"{_join(where, missing[0], root_level)} is required"


def _render_additional(where: str, e: _JsonError) -> str:
    known = list(e.schema.get("properties", {}))
    extra = [key for key in e.instance if key not in known]
    key = extra[0] if extra else "?"
    noun = "parameter" if where.endswith("parameters") else "field"
    message = f"{_join(where, key, not e.absolute_path)} is not a known {noun}"
    close = difflib.get_close_matches(key, known, n=1)
    return message + (f" (did you mean {close[0]}?)" if close else "")


def _render_enum(where: str, e: _JsonError) -> str:
    allowed = [show(v) for v in e.validator_value]
    if len(allowed) == 1:
        return f"{where} must be {allowed[0]}, got {show(e.instance)}"
    return f"{where} must be one of {', '.join(allowed)}; got {show(e.instance)}"


def _render_pattern(where: str, e: _JsonError) -> str:
    pattern = str(e.validator_value).replace(_STRICT_END, "$")
    return f"{where} must match {pattern}, got {show(e.instance)}"


def _render_not(where: str, e: _JsonError) -> str:
    if e.validator_value == {}:  # {"not": {}} forbids the key outright; its description says why
        description = e.schema.get("description") if isinstance(e.schema, Mapping) else None
        if description:
            return f"{where} is not allowed: {description.rstrip('.')}"
        return f"{where} is not allowed here, got {show(e.instance)}"
    return f"{where} must not be {show(e.instance)}"


def _render_false(where: str, e: _JsonError) -> str:
    return f"{where} is not allowed here, got {show(e.instance)}"


_PHRASES: dict[str, Callable[[Any], str]] = {
    "const": show, "minimum": lambda v: f">= {show(v)}", "maximum": lambda v: f"<= {show(v)}",
    "exclusiveMinimum": lambda v: f"> {show(v)}", "exclusiveMaximum": lambda v: f"< {show(v)}",
}


def _render_any_of(where: str, e: _JsonError) -> str:
    """``temperature must be 0 or > 1e-06``: the alternatives of an ``anyOf`` of bounds and constants (the
    instance's type is among the alternatives'); any other ``anyOf`` as ``_render_other``."""
    options = [c for c in e.context if c.validator != "type"]
    if not options or any(c.relative_path or str(c.validator) not in _PHRASES for c in options):
        return _render_other(where, e)
    alternatives = " or ".join(_PHRASES[str(c.validator)](c.validator_value) for c in options)
    return f"{where} must be {alternatives}, got {show(e.instance)}"


def _render_other(where: str, e: _JsonError) -> str:
    description = e.schema.get("description") if isinstance(e.schema, Mapping) else None
    hint = f" ({description.rstrip('.')})" if description else ""
    return f"{where} is invalid{hint}, got {show(e.instance)}"


_RENDERERS: dict[str, Callable[[str, _JsonError], str]] = {
    "type": _render_type,
    "minimum": _bound(">="),
    "maximum": _bound("<="),
    "exclusiveMinimum": _bound(">"),
    "exclusiveMaximum": _bound("<"),
    "minLength": _render_min_length,
    "maxLength": _render_max_length,
    "minItems": _render_min_items,
    "maxItems": _render_max_items,
    "required": _render_required,
    "additionalProperties": _render_additional,
    "enum": _render_enum,
    "const": lambda where, e: f"{where} must be {show(e.validator_value)}, got {show(e.instance)}",
    "pattern": _render_pattern,
    "format": lambda where, e: f"{where} must be a valid {e.validator_value}, got {show(e.instance)}",
    "uniqueItems": lambda where, e: f"{where} must not contain duplicates, got {show(e.instance)}",
    "not": _render_not,
    "anyOf": _render_any_of,
    "None": _render_false,
}
