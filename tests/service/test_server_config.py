"""The server config: defaults come from the schema (and the docs say the same), rules across keys on the
applied values, listen addresses, refused keys, and ``validate-config`` running every check that needs
no weights."""
from __future__ import annotations

import copy
import re
import shutil
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from backends.settings import EngineConfig
from service.config import (
    BUSINESS,
    MANAGEMENT,
    METRICS,
    ConfigFileError,
    ServerSettings,
    check_engine,
    load_server_config,
    planes_by_listener,
    schema_defaults,
)
from service.preflight import busy_listeners, check_model
from service.validation import default_schemas
from tests.support.cli import run_cli
from tests.support.paths import REPO

MINIMAL = {"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelName": "m", "modelWeightPath": "m"}]}}}
SECTIONS = {"ServerConfig": ("ServerConfig",), "ModelDeployConfig": ("BackendConfig", "ModelDeployConfig"),
            "ModelConfig": ("BackendConfig", "ModelDeployConfig", "ModelConfig", 0),
            "ScheduleConfig": ("BackendConfig", "ScheduleConfig")}


def write(tmp_path: Path, config: dict, name: str = "server.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def config_with(**sections: dict) -> dict:
    """MINIMAL with keys set per section, e.g. ``config_with(ScheduleConfig={"maxBatchSize": 2})``."""
    config = copy.deepcopy(MINIMAL)
    for section, values in sections.items():
        node = config
        for key in SECTIONS[section]:
            node = node[key] if isinstance(key, int) else node.setdefault(key, {})
        node.update(values)
    return config


# --- defaults: one source -----------------------------------------------------------------------------

# What each schema default becomes in the loaded settings.
APPLIED = {
    ("ServerConfig", "ipAddress"): lambda c: c.server.ip_address,
    ("ServerConfig", "allowAllZeroIpListening"): lambda c: c.server.allow_all_zero_ip_listening,
    ("ServerConfig", "port"): lambda c: c.server.port,
    ("ServerConfig", "maxLinkNum"): lambda c: c.server.max_link_num,
    ("ServerConfig", "httpsEnabled"): lambda c: c.server.https_enabled,
    ("ServerConfig", "fullTextEnabled"): lambda c: c.server.full_text_enabled,
    ("ServerConfig", "playgroundEnabled"): lambda c: c.server.playground_enabled,
    ("ServerConfig", "toolCallFormat"): lambda c: c.server.tool_call_format,
    ("ServerConfig", "reasoningFormat"): lambda c: c.server.reasoning_format,
    ("ServerConfig", "tokenTimeout"): lambda c: c.server.token_timeout,
    ("ServerConfig", "e2eTimeout"): lambda c: c.server.e2e_timeout,
    ("ServerConfig", "maxRequestLength"): lambda c: c.server.max_request_bytes // (1024 * 1024),
    ("ServerConfig", "shutdownGracePeriod"): lambda c: c.server.shutdown_grace_period,
    ("ServerConfig", "tokenIdFormat"): lambda c: c.server.token_id_format,
    ("ServerConfig", "ownedBy"): lambda c: c.server.owned_by,
    ("ServerConfig", "headerTimeout"): lambda c: c.server.header_timeout,
    ("ServerConfig", "bodyTimeout"): lambda c: c.server.body_timeout,
    ("ServerConfig", "keepAliveTimeout"): lambda c: c.server.keep_alive_timeout,
    ("ServerConfig", "maxHeaderBytes"): lambda c: c.server.max_header_bytes,
    ("ServerConfig", "maxReadingRequests"): lambda c: c.server.max_reading_requests,
    ("ServerConfig", "maxBufferedBodyMB"): lambda c: c.server.max_buffered_body_bytes // (1024 * 1024),
    ("ServerConfig", "listenBacklog"): lambda c: c.server.listen_backlog,
    ("ServerConfig", "mediaRoot"): lambda c: c.server.media_root,
    ("ServerConfig", "maxMediaLoads"): lambda c: c.server.max_media_loads,
    ("ServerConfig", "maxMediaBufferMB"): lambda c: c.server.max_media_buffer_bytes // (1024 * 1024),
    ("ModelDeployConfig", "maxSeqLen"): lambda c: c.engine.max_seq_len,
    ("ModelDeployConfig", "maxInputTokenLen"): lambda c: c.engine.max_input_tokens,
    ("ModelDeployConfig", "truncation"): lambda c: c.engine.truncation,
    ("ModelConfig", "backendType"): lambda c: c.model.backend_type,
    ("ModelConfig", "npuMemSize"): lambda c: c.engine.cache_gb,
    ("ModelConfig", "kvCacheDtype"): lambda c: c.engine.kv_cache_dtype,
    ("ScheduleConfig", "cacheBlockSize"): lambda c: c.engine.block_size,
    ("ScheduleConfig", "maxBatchSize"): lambda c: c.engine.max_batch_size,
    ("ScheduleConfig", "maxPrefillBatchSize"): lambda c: c.engine.max_prefill_batch,
    ("ScheduleConfig", "maxPrefillTokens"): lambda c: c.engine.max_prefill_tokens,
    ("ScheduleConfig", "maxIterTimes"): lambda c: c.engine.max_iter_times,
    ("ScheduleConfig", "enablePrefixCaching"): lambda c: c.engine.prefix_caching,
    ("ModelDeployConfig", "maxLoras"): lambda c: c.engine.lora.max_loras,
    ("ModelDeployConfig", "maxLoraRank"): lambda c: c.engine.lora.max_rank,
    ("ModelDeployConfig", "maxLoadedLoras"): lambda c: c.engine.lora.max_loaded,
    ("ModelDeployConfig", "kernels"): lambda c: c.engine.kernels,
    ("ModelDeployConfig", "kernelIsa"): lambda c: c.engine.kernel_isa,
    ("ModelDeployConfig", "graphCache"): lambda c: c.engine.graph_cache,
    ("ModelDeployConfig", "mapKvCache"): lambda c: c.engine.map_kv_cache,
    ("ModelDeployConfig", "speculationGamma"): lambda c: c.engine.speculation.max_draft,
    ("ModelDeployConfig", "allowRuntimeLoraUpdating"): lambda c: c.engine.lora.runtime_updates,
    ("ModelDeployConfig", "maxLoadedModels"): lambda c: c.max_loaded_models,
}
# Reference keys whose schema default documents the reference server; mindserve does not use them.
UNUSED = {("ModelConfig", "worldSize"), ("ModelConfig", "trustRemoteCode")}


def _schema_default_keys() -> list[tuple[str, str]]:
    return sorted((section, key) for section, keys in schema_defaults().items() for key in keys)


def test_every_schema_default_is_mapped_here():
    assert set(_schema_default_keys()) == set(APPLIED) | UNUSED


@pytest.mark.parametrize("section, key", sorted(APPLIED))
def test_an_absent_key_gets_the_schema_default(tmp_path, section, key):
    config = load_server_config(write(tmp_path, MINIMAL))
    assert APPLIED[section, key](config) == schema_defaults()[section][key]


# A value other than the default for each key (with what else it needs to stay valid).
OTHER = {
    "ipAddress": ("::1", {}), "allowAllZeroIpListening": (True, {}), "port": (8080, {}), "maxLinkNum": (7, {}),
    "fullTextEnabled": (True, {}), "playgroundEnabled": (False, {}), "tokenTimeout": (5, {}), "e2eTimeout": (9, {}),
    "toolCallFormat": ("hermes", {}), "reasoningFormat": ("none", {}),
    "maxRequestLength": (2, {}),
    "shutdownGracePeriod": (0.5, {}), "tokenIdFormat": ("int", {}), "ownedBy": ("vllm", {}), "headerTimeout": (2.5, {}),
    "bodyTimeout": (7, {}), "keepAliveTimeout": (4, {}), "maxHeaderBytes": (8192, {}), "maxReadingRequests": (5, {}),
    "maxBufferedBodyMB": (64, {}), "listenBacklog": (16, {}), "mediaRoot": ("/srv/media", {}),
    "maxMediaLoads": (2, {}), "maxMediaBufferMB": (100, {}), "maxSeqLen": (300, {"maxIterTimes": 100}),
    "maxInputTokenLen": (99, {}), "truncation": (1, {}), "cacheBlockSize": (64, {}),
    "maxBatchSize": (3, {"maxPrefillBatchSize": 1}), "maxPrefillBatchSize": (2, {}), "maxPrefillTokens": (64, {}),
    "maxIterTimes": (100, {}), "npuMemSize": (0.5, {}), "kvCacheDtype": ("q8_0", {}),
    "enablePrefixCaching": (False, {}),
    "maxLoras": (2, {}), "maxLoraRank": (32, {}), "maxLoadedLoras": (3, {}), "kernelIsa": ("x86-64-v3", {}),
    "kernels": ("stock", {}), "graphCache": (False, {}), "mapKvCache": (False, {}),
    "speculationGamma": (4, {}), "maxLoadedModels": (1, {}),
    "allowRuntimeLoraUpdating": (True, {"ModelDeployConfig.loraRoot": "/tmp"}),
}


@pytest.mark.parametrize("section, key", sorted(k for k in APPLIED if k[1] in OTHER))
def test_a_set_key_is_applied(tmp_path, section, key):
    """The mapping above reads the right setting: a value set in the file shows up there."""
    value, extra = OTHER[key]
    assert value != schema_defaults()[section][key]
    sections = {section: {key: value}}
    if extra:
        sections = {"ModelDeployConfig": {}, "ScheduleConfig": {}, **sections}
        for name, extra_value in extra.items():  # "key" (a ScheduleConfig key) or "Section.key"
            target, _, extra_key = name.rpartition(".")
            target = target or "ScheduleConfig"
            sections[target] = {**sections[target], extra_key: extra_value}
    config = load_server_config(write(tmp_path, config_with(**sections)))
    assert APPLIED[section, key](config) == value


def test_server_settings_dataclass_defaults_equal_the_loaded_defaults(tmp_path):
    assert ServerSettings() == load_server_config(write(tmp_path, MINIMAL)).server


def test_absent_ports_and_management_address_follow_the_business_ones(tmp_path):
    server = load_server_config(write(tmp_path, MINIMAL)).server
    assert (server.management_ip_address, server.management_port, server.metrics_port) == (None, None, None)
    assert planes_by_listener(server) == {("127.0.0.1", 1025): frozenset({BUSINESS, MANAGEMENT, METRICS})}


def _doc_tables() -> dict[str, dict[str, list[str]]]:
    """docs/configuration.md: {section: {key: [type, default, range, what]}} of the four key tables."""
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    tables: dict[str, dict[str, list[str]]] = {}
    for heading, section in (("### `ServerConfig`", "ServerConfig"),
                             ("### `BackendConfig.ModelDeployConfig`\n", "ModelDeployConfig"),
                             ("### `BackendConfig.ModelDeployConfig.ModelConfig[]`", "ModelConfig"),
                             ("### `BackendConfig.ScheduleConfig`", "ScheduleConfig")):
        body = text[text.index(heading) + len(heading):]
        body = body[:body.index("\n### ")]
        rows = [line for line in body.splitlines() if line.startswith("| `")]
        tables[section] = {re.match(r"\| `([^`]+)`", row).group(1): [c.strip() for c in row.split("|")[2:-1]]
                           for row in rows}
    return tables


def _literal(value: Any) -> str:
    return "`" + (str(value).lower() if isinstance(value, bool) else str(value)) + "`"


def _resolved(prop: dict) -> dict:
    defs = default_schemas().schema("server_config")["$defs"]
    while "$ref" in prop:
        prop = {**defs[prop["$ref"].rsplit("/", 1)[1]], **{k: v for k, v in prop.items() if k != "$ref"}}
    return prop


@pytest.mark.parametrize("section", ["ServerConfig", "ModelDeployConfig", "ModelConfig", "ScheduleConfig"])
def test_docs_state_the_schema_defaults_and_ranges(section):
    table = _doc_tables()[section]
    props = default_schemas().schema("server_config")["$defs"][section]["properties"]
    for key, (_, default, rng, _) in table.items():
        assert key in props, f"docs list {section}.{key}, the schema does not"
        prop = _resolved(props[key])
        if "default" in prop:
            assert default == _literal(prop["default"]), (section, key, default)
        elif "not" not in prop:
            assert not re.fullmatch(r"`[^`]*`", default), f"{section}.{key}: docs give a default the server " \
                                                          f"does not apply: {default}"
        low, high = prop.get("minimum"), prop.get("maximum")
        if low is not None and high is not None:
            assert f"{low}..{high}" in rng, (section, key, rng)
        elif low is not None:
            assert f"≥ {low}" in rng, (section, key, rng)
    documented = {k for k in props if "default" in props[k]} - {key for s, key in UNUSED if s == section}
    assert documented <= set(table), f"{section}: keys with a default missing from the docs"


# --- refused keys and rules across keys -------------------------------------------------------------------

SCHED, DEPLOY = "BackendConfig.ScheduleConfig", "BackendConfig.ModelDeployConfig"
ZERO_IP = "listens on every network interface; set ServerConfig.allowAllZeroIpListening: true"


@pytest.mark.parametrize("sections, fragment", [
    ({"ServerConfig": {"adapters": {"sql-lora": "/a"}}},
     "ServerConfig.adapters is not allowed: Not a key of this server"),
    # maxPrefillBatchSize absent: its default (4) is checked against maxBatchSize
    ({"ScheduleConfig": {"maxBatchSize": 2}}, f"{SCHED}.maxPrefillBatchSize 4 must be <= maxBatchSize 2"),
    ({"ScheduleConfig": {"maxBatchSize": 8, "maxPrefillBatchSize": 9}},
     "maxPrefillBatchSize 9 must be <= maxBatchSize 8"),
    # maxIterTimes absent: its default (512) is checked against maxSeqLen
    ({"ModelDeployConfig": {"maxSeqLen": 256}}, f"{SCHED}.maxIterTimes 512 must be <= {DEPLOY}.maxSeqLen 256"),
    ({"ScheduleConfig": {"maxBatchSize": 16, "batchBuckets": [1, 4]}},
     f"{SCHED}.batchBuckets [1, 4]: the largest must be >= maxBatchSize 16"),
    ({"ScheduleConfig": {"windowBuckets": [200, 2560]}},
     f"{SCHED}.windowBuckets [200, 2560]: 200 is not a multiple of cacheBlockSize 128"),
    ({"ServerConfig": {"ipAddress": "0.0.0.0"}}, f"ServerConfig.ipAddress 0.0.0.0 {ZERO_IP}"),
    ({"ServerConfig": {"ipAddress": "::"}}, f"ServerConfig.ipAddress :: {ZERO_IP}"),
    ({"ServerConfig": {"managementIpAddress": "0.0.0.0", "allowAllZeroIpListening": False}},
     f"ServerConfig.managementIpAddress 0.0.0.0 {ZERO_IP}"),
    ({"ServerConfig": {"ipAddress": "0.0.0.0", "allowAllZeroIpListening": True, "managementIpAddress": "127.0.0.1"}},
     "port 1025 is wanted on 0.0.0.0 and on 127.0.0.1"),
])
def test_config_errors_name_the_key(tmp_path, sections, fragment):
    with pytest.raises(ConfigFileError) as caught:
        load_server_config(write(tmp_path, config_with(**sections), "bad.yaml"))
    assert fragment in str(caught.value) and "bad.yaml" in str(caught.value)


ALL = {BUSINESS, MANAGEMENT, METRICS}


@pytest.mark.parametrize("server, listeners", [
    ({"ipAddress": "0.0.0.0", "allowAllZeroIpListening": True}, {("0.0.0.0", 1025): ALL}),
    ({"managementIpAddress": "127.0.0.2"},
     {("127.0.0.1", 1025): {BUSINESS}, ("127.0.0.2", 1025): {MANAGEMENT, METRICS}}),
    ({"managementIpAddress": "127.0.0.2", "metricsPort": 1027},
     {("127.0.0.1", 1025): {BUSINESS}, ("127.0.0.2", 1025): {MANAGEMENT}, ("127.0.0.2", 1027): {METRICS}}),
    ({"managementPort": 1026, "metricsPort": 1026},
     {("127.0.0.1", 1025): {BUSINESS}, ("127.0.0.1", 1026): {MANAGEMENT, METRICS}}),
    ({"managementPort": 1025, "metricsPort": 1027},
     {("127.0.0.1", 1025): {BUSINESS, MANAGEMENT}, ("127.0.0.1", 1027): {METRICS}}),
])
def test_planes_by_listener(tmp_path, server, listeners):
    loaded = load_server_config(write(tmp_path, config_with(ServerConfig=server))).server
    assert {k: set(v) for k, v in planes_by_listener(loaded).items()} == listeners


def test_the_engine_rules_agree_with_the_engine(tiny_model_dir):
    """``check_engine`` + preflight's window rule refuse exactly what the engine's ``plan_shapes`` refuses
    (preflight asks ``plan_shapes`` itself; ``check_engine`` asks its config-only part)."""
    from backends.mindspore.families import load_model
    from backends.mindspore.planning.shapes import check_window_coverage, plan_shapes

    spec = load_model(tiny_model_dir)
    base = EngineConfig(max_seq_len=64, max_batch_size=4, max_prefill_batch=1, max_iter_times=32, block_size=16)
    cases = [base, replace(base, batch_buckets=(1, 2)), replace(base, batch_buckets=(1, 4)),
             replace(base, window_buckets=(32,)), replace(base, window_buckets=(32, 64)),
             replace(base, window_buckets=(24, 64)), replace(base, max_seq_len=10_000, window_buckets=(64,)),
             replace(base, max_seq_len=10_000, window_buckets=(spec.max_position_embeddings,))]
    for config in cases:
        try:
            plan_shapes(config, spec.max_position_embeddings)
            engine_ok = True
        except ValueError:
            engine_ok = False
        try:
            check_engine(config)
            check_window_coverage(config, spec.max_position_embeddings)
            ours_ok = True
        except ValueError:
            ours_ok = False
        assert ours_ok == engine_ok, config


# --- validate-config: every check that needs no weights ------------------------------------------------

def cli_config(model_dir: Path, **server) -> dict:
    return {
        "ServerConfig": {"ipAddress": "127.0.0.1", "port": 0, **server},
        "BackendConfig": {
            "ModelDeployConfig": {"maxSeqLen": 64, "maxInputTokenLen": 48,
                                  "ModelConfig": [{"modelName": "tiny", "modelWeightPath": str(model_dir)}]},
            "ScheduleConfig": {"maxBatchSize": 2, "maxPrefillBatchSize": 1, "maxIterTimes": 32,
                               "cacheBlockSize": 16, "batchBuckets": [1, 2], "windowBuckets": [64]},
        },
    }


def _copy_model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def _no_weights(model: Path) -> None:
    (model / "model.safetensors").unlink()


def _no_tokenizer(model: Path) -> None:
    (model / "tokenizer.json").write_text("{not json")


def _bad_yaml(model: Path) -> None:
    (yaml_path,) = model.glob("*.yaml")
    tree = yaml.safe_load(yaml_path.read_text())
    del tree["model"]["model_config"]["num_heads"]
    yaml_path.write_text(yaml.safe_dump(tree))


@pytest.mark.parametrize("break_model, fragment", [
    (lambda m: shutil.rmtree(m), "modelWeightPath: {model} is not a model directory"),
    (_no_weights, "modelWeightPath: weights {model}/model.safetensors not found"),
    (_no_tokenizer, "modelWeightPath: cannot load the tokenizer"),
    (_bad_yaml, "model.model_config.num_heads: is required"),
])
def test_validate_config_checks_the_model_directory(tmp_path, tiny_model_dir, break_model, fragment):
    model = _copy_model(tiny_model_dir, tmp_path)
    break_model(model)
    out = run_cli("validate-config", str(write(tmp_path, cli_config(model), "bad.yaml")))
    assert out.returncode == 2, out.stdout
    assert fragment.format(model=model) in out.stderr and "bad.yaml" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_window_coverage_uses_the_models_max_position_embeddings(tmp_path, tiny_model_dir):
    from backends.mindspore.families import load_model

    max_pos = load_model(tiny_model_dir).max_position_embeddings
    config = cli_config(tiny_model_dir)
    config["BackendConfig"]["ModelDeployConfig"]["maxSeqLen"] = max_pos * 4  # capped by the model
    config["BackendConfig"]["ScheduleConfig"]["windowBuckets"] = [max_pos]
    cfg = load_server_config(write(tmp_path, config))
    assert check_model(cfg).max_position_embeddings == max_pos
    config["BackendConfig"]["ScheduleConfig"]["windowBuckets"] = [max_pos // 2]
    out = run_cli("validate-config", str(write(tmp_path, config, "short.yaml")))
    assert out.returncode == 2
    assert f"windowBuckets [{max_pos // 2}]: the largest must be >= {max_pos}" in out.stderr
    assert f"max_position_embeddings is {max_pos}" in out.stderr


def test_validate_config_checks_the_tls_files(tmp_path, tiny_model_dir):
    out = run_cli("validate-config", str(write(tmp_path, cli_config(
        tiny_model_dir, httpsEnabled=True, tlsCert="nope.pem", tlsPk="nope.key"), "tls.yaml")))
    assert out.returncode == 2
    assert f"tls.yaml: ServerConfig.tlsCert: {tmp_path}/nope.pem is not a file" in out.stderr


def test_validate_config_refuses_all_zero_addresses_unless_allowed(tmp_path, tiny_model_dir):
    out = run_cli("validate-config", str(write(tmp_path, cli_config(tiny_model_dir, ipAddress="0.0.0.0"))))
    assert out.returncode == 2 and "allowAllZeroIpListening" in out.stderr
    out = run_cli("validate-config", str(write(tmp_path, cli_config(tiny_model_dir, ipAddress="0.0.0.0",
                                                                     allowAllZeroIpListening=True))))
    assert out.returncode == 0, out.stderr


def test_validate_config_warns_about_a_busy_port_and_passes(tmp_path, tiny_model_dir):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        path = write(tmp_path, cli_config(tiny_model_dir, port=port))
        assert busy_listeners(load_server_config(path)) == [
            f"127.0.0.1:{port} (business, management, metrics): in use"]
        out = run_cli("validate-config", str(path))
    assert out.returncode == 0, out.stderr
    assert f"warning: {path}: cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "OK (model tiny" in out.stdout and "LlamaForCausalLM" in out.stdout


def test_serve_names_the_key_of_a_port_it_cannot_bind(tmp_path, tiny_model_dir):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = run_cli("serve", "--config", str(write(tmp_path, cli_config(tiny_model_dir, managementPort=port))))
    assert out.returncode == 2, out.stderr[-2000:]
    assert (f"ServerConfig.managementIpAddress/managementPort: cannot listen on 127.0.0.1:{port} "
            f"(management): the port is in use") in out.stderr
    assert "Traceback" not in out.stderr


# --- LoRA adapters (BackendConfig.ModelDeployConfig) --------------------------------------------------

def _lora(modules: list[dict], **keys) -> dict:
    return config_with(ModelDeployConfig={"LoraModules": modules, **keys})


@pytest.mark.parametrize("modules, keys, message", [
    ([{"name": "a", "path": "/x", "baseModelName": "m"}, {"name": "a", "path": "/y", "baseModelName": "m"}], {},
     "BackendConfig.ModelDeployConfig.LoraModules[1].name 'a' is already the name of LoraModules[0]"),
    ([{"name": "a", "path": "/x", "baseModelName": "other"}], {},
     "BackendConfig.ModelDeployConfig.LoraModules[0].baseModelName 'other' is not a served model "
     "(ModelConfig modelName: 'm')"),
    ([{"name": "_a", "path": "/x", "baseModelName": "m"}], {},
     'BackendConfig.ModelDeployConfig.LoraModules[0].name must match'),
    ([{"name": "a-", "path": "/x", "baseModelName": "m"}], {}, 'LoraModules[0].name must match'),
    ([{"name": "a.b", "path": "/x", "baseModelName": "m"}], {}, 'LoraModules[0].name must match'),
    ([{"name": "a" * 257, "path": "/x", "baseModelName": "m"}], {}, 'LoraModules[0].name must match'),
    ([{"name": "a", "baseModelName": "m"}], {}, "LoraModules[0]"),
    ([{"name": "a", "path": "/x"}], {}, "LoraModules[0]"),
    ([], {"allowRuntimeLoraUpdating": True},
     "BackendConfig.ModelDeployConfig.allowRuntimeLoraUpdating is true but BackendConfig.ModelDeployConfig.loraRoot "
     "is not set"),
    ([{"name": "a", "path": "/x", "baseModelName": "m"}, {"name": "b", "path": "/y", "baseModelName": "m"}],
     {"maxLoadedLoras": 1}, "maxLoadedLoras 1 is fewer than the 2 LoraModules"),
    ([], {"maxLoraRank": 1025}, "maxLoraRank"),
    ([], {"maxLoras": -1}, "maxLoras"),
])
def test_lora_config_errors_name_the_key_the_entry_and_the_value(tmp_path, modules, keys, message):
    with pytest.raises(ConfigFileError) as err:
        load_server_config(write(tmp_path, _lora(modules, **keys)))
    assert message in str(err.value)


def test_lora_modules_are_read_with_paths_relative_to_the_file(tmp_path):
    config = load_server_config(write(tmp_path, _lora(
        [{"name": "sql-v1", "path": "adapters/sql", "baseModelName": "m"}],
        maxLoras=2, maxLoraRank=16, allowRuntimeLoraUpdating=True, loraRoot="adapters")))
    lora = config.engine.lora
    assert [(m.name, m.path) for m in lora.modules] == [("sql-v1", tmp_path / "adapters" / "sql")]
    assert (lora.max_loras, lora.max_rank, lora.runtime_updates, lora.root) == (2, 16, True, tmp_path / "adapters")
    assert lora.slots == 1 + 4  # the configured one and four for runtime loads
