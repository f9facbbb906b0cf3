"""The ``threads`` key and ``serve --threads``: read, refused with the key named, one limit everywhere."""
from __future__ import annotations

import re

import pytest
import yaml

from backends.cpus import MAX_THREADS
from service.__main__ import build_parser
from service.config import ConfigFileError, load_server_config
from service.validation import default_schemas
from tests.support.paths import REPO

MINIMAL = {"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [
    {"modelName": "m", "modelWeightPath": "/nowhere", "backendType": "ms"}]}}}


def _load(tmp_path, **deploy):
    config = yaml.safe_load(yaml.safe_dump(MINIMAL))
    config["BackendConfig"]["ModelDeployConfig"].update(deploy)
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(config))
    return load_server_config(path)


def test_absent_is_automatic(tmp_path):
    assert _load(tmp_path).engine.threads is None


@pytest.mark.parametrize("value", [1, 3, MAX_THREADS])
def test_a_set_key_is_applied(tmp_path, value):
    assert _load(tmp_path, threads=value).engine.threads == value


@pytest.mark.parametrize("value", [0, -2, MAX_THREADS + 1, 1.5, "two", True])
def test_a_bad_value_names_the_key(tmp_path, value):
    with pytest.raises(ConfigFileError) as caught:
        _load(tmp_path, threads=value)
    message = str(caught.value)
    assert "server.yaml" in message and "ModelDeployConfig.threads" in message and "\n" not in message


@pytest.mark.parametrize("argv, want", [([], None), (["--threads", "1"], 1), (["--threads", "12"], 12)])
def test_the_flag_is_parsed(argv, want):
    assert build_parser().parse_args(["serve", *argv]).threads == want


@pytest.mark.parametrize("text, why", [("0", f"0 must be in [1, {MAX_THREADS}]"),
                                       (str(MAX_THREADS + 1), f"{MAX_THREADS + 1} must be in [1, {MAX_THREADS}]"),
                                       ("-1", f"-1 must be in [1, {MAX_THREADS}]"),
                                       ("2.5", "'2.5' is not an integer"), ("many", "'many' is not an integer")])
def test_a_bad_flag_is_one_line_naming_it(capsys, text, why):
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["serve", "--threads", text])
    assert caught.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"mindserve serve: error: argument --threads/-t: {why}"


def test_one_limit_for_the_key_the_flag_and_the_kernel_pool():
    prop = default_schemas().schema("server_config")["$defs"]["ModelDeployConfig"]["properties"]["threads"]
    assert (prop["minimum"], prop["maximum"]) == (1, MAX_THREADS)
    pool = (REPO / "backends" / "mindspore" / "kernels" / "pool.h").read_text()
    assert int(re.search(r"constexpr int kMaxThreads = (\d+);", pool).group(1)) == MAX_THREADS
