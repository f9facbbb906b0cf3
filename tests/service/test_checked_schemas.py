"""The meta-schema check of the schema files is skipped only for the very bytes that passed it before
(service/checked_schemas.py): a start checks an unchanged set once, a changed file is checked again and a broken
one still fails."""
from __future__ import annotations

import json
import shutil

import pytest
from jsonschema import Draft202012Validator

from service.package_data import SCHEMA_DIR
from service.validation import SchemaError, Schemas


@pytest.fixture()
def folder(tmp_path):
    out = tmp_path / "schemas"
    out.mkdir()
    for name in ("parameters.schema.json", "generate_request.schema.json"):
        shutil.copyfile(SCHEMA_DIR / name, out / name)
    return out


@pytest.fixture()
def checks(monkeypatch) -> list[str]:
    seen: list[str] = []
    real = Draft202012Validator.check_schema.__func__

    def counting(cls, schema, *args, **kwargs):
        seen.append(schema.get("$id", "?"))
        return real(cls, schema, *args, **kwargs)

    monkeypatch.setattr(Draft202012Validator, "check_schema", classmethod(counting))
    return seen


def test_an_unchanged_set_is_checked_once(folder, tmp_path, checks):
    stamps = tmp_path / "stamps"
    Schemas(folder, stamp_dir=stamps)
    assert len(checks) == 2 and len(list(stamps.iterdir())) == 1
    again = Schemas(folder, stamp_dir=stamps)
    assert len(checks) == 2  # stamped: not checked again
    assert again.names == ("generate_request", "parameters")


def test_a_changed_file_is_checked_again(folder, tmp_path, checks):
    stamps = tmp_path / "stamps"
    Schemas(folder, stamp_dir=stamps)
    path = folder / "parameters.schema.json"
    schema = json.loads(path.read_text())
    schema["description"] = "changed"
    path.write_text(json.dumps(schema))
    Schemas(folder, stamp_dir=stamps)
    assert len(checks) == 4 and len(list(stamps.iterdir())) == 2


def test_a_broken_file_fails_whatever_was_stamped(folder, tmp_path):
    stamps = tmp_path / "stamps"
    Schemas(folder, stamp_dir=stamps)
    path = folder / "parameters.schema.json"
    schema = json.loads(path.read_text())
    schema["type"] = 12  # not a JSON Schema type
    path.write_text(json.dumps(schema))
    with pytest.raises(SchemaError, match="parameters.schema.json"):
        Schemas(folder, stamp_dir=stamps)
    assert len(list(stamps.iterdir())) == 1  # nothing stamped for the broken set


def test_an_unwritable_stamp_dir_still_checks(folder, tmp_path, checks):
    blocker = tmp_path / "file"
    blocker.write_text("")
    Schemas(folder, stamp_dir=blocker / "stamps")  # cannot be created: checked, no error
    Schemas(folder, stamp_dir=blocker / "stamps")
    assert len(checks) == 4
