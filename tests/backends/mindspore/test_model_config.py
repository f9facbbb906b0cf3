"""Model config loading: deep_merge, base_config inheritance, the shipped yamls, and errors that name file and key."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from backends.mindspore.modeldir.yaml_tree import ConfigError, deep_merge, load_yaml_tree

from backends.mindspore.families import load_model
from tests.support.paths import REPO

MODELS = REPO / "configs" / "models"

# The smallest yaml load_model accepts; cases below edit a deep copy of it.
MINIMAL = {
    "model": {
        "arch": {"type": "LlamaForCausalLM"},
        "model_config": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "n_kv_heads": 2,
                         "intermediate_size": 128, "vocab_size": 384},
    },
}


def write_tree(root: Path, files: dict[str, object]) -> None:
    """Write ``{relative path: data or raw yaml text}`` under root."""
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else yaml.safe_dump(content), encoding="utf-8")


def spec_from(tmp_path: Path, edit=None, name: str = "predict_case.yaml"):
    data = copy.deepcopy(MINIMAL)
    if edit:
        edit(data)
    write_tree(tmp_path, {name: data})
    return load_model(tmp_path / name)


def mc(**changes):
    """An edit that sets (or, with value ..., deletes) keys of model.model_config."""
    def edit(data: dict) -> None:
        for key, value in changes.items():
            if value is ...:
                del data["model"]["model_config"][key]
            else:
                data["model"]["model_config"][key] = value
    return edit


def moe(**changes):
    """``mc`` on a Qwen3-MoE yaml (the family with routed experts)."""
    def edit(data: dict) -> None:
        data["model"]["arch"]["type"] = "Qwen3MoeForCausalLM"
        mc(**changes)(data)
    return edit


def top(**changes):
    def edit(data: dict) -> None:
        data.update(changes)
    return edit


# --- deep_merge ---

@pytest.mark.parametrize("base, child, want", [
    ({}, {}, {}),
    ({"a": 1}, {}, {"a": 1}),
    ({}, {"a": 1}, {"a": 1}),
    ({"a": 1}, {"b": 2}, {"a": 1, "b": 2}),
    ({"a": 1}, {"a": 2}, {"a": 2}),
    ({"c": {"x": 1, "y": 2}}, {"c": {"y": 3, "z": 4}}, {"c": {"x": 1, "y": 3, "z": 4}}),
    ({"c": {"d": {"x": 1, "y": 2}}}, {"c": {"d": {"y": 3}}}, {"c": {"d": {"x": 1, "y": 3}}}),
    ({"c": {"x": 1}}, {"c": 5}, {"c": 5}),  # a scalar replaces a dict
    ({"c": 5}, {"c": {"x": 1}}, {"c": {"x": 1}}),  # a dict replaces a scalar
    ({"l": [1, 2]}, {"l": [3]}, {"l": [3]}),  # lists are replaced, not concatenated
    ({"c": {"x": 1}}, {"c": None}, {"c": None}),
    ({"c": {"x": 1}}, {"c": {}}, {"c": {"x": 1}}),
], ids=["empty", "base-only", "child-only", "disjoint", "child-wins", "nested", "two-levels",
        "scalar-over-dict", "dict-over-scalar", "list", "none", "empty-child-dict"])
def test_deep_merge(base, child, want):
    base_before, child_before = copy.deepcopy(base), copy.deepcopy(child)
    assert deep_merge(base, child) == want
    assert (base, child) == (base_before, child_before)  # inputs untouched


# --- base_config inheritance ---

CONTEXT = {"mode": 0, "device_target": "CPU", "device_id": 0}

INHERITANCE = {
    "single-base-string": (
        {"child.yaml": {"base_config": "a.yaml", "b": 2}, "a.yaml": {"a": 1, "b": 1}},
        {"a": 1, "b": 2}),
    "single-base-list": (
        {"child.yaml": {"base_config": ["a.yaml"]}, "a.yaml": {"a": 1}},
        {"a": 1}),
    "later-base-wins": (
        {"child.yaml": {"base_config": ["a.yaml", "b.yaml"]}, "a.yaml": {"k": "a", "only_a": 1},
         "b.yaml": {"k": "b", "only_b": 2}},
        {"k": "b", "only_a": 1, "only_b": 2}),
    "list-order-matters": (
        {"child.yaml": {"base_config": ["b.yaml", "a.yaml"]}, "a.yaml": {"k": "a"}, "b.yaml": {"k": "b"}},
        {"k": "a"}),
    "bases-merge-shallow": (  # b's context replaces a's whole context: device_target/device_id are gone
        {"child.yaml": {"base_config": ["a.yaml", "b.yaml"]}, "a.yaml": {"context": CONTEXT},
         "b.yaml": {"context": {"mode": 1}}},
        {"context": {"mode": 1}}),
    "child-deep-merged": (
        {"child.yaml": {"base_config": "a.yaml", "context": {"mode": 1, "max_device_memory": "8GB"}},
         "a.yaml": {"context": CONTEXT, "seed": 0}},
        {"context": {**CONTEXT, "mode": 1, "max_device_memory": "8GB"}, "seed": 0}),
    "child-over-shallow-bases": (
        {"child.yaml": {"base_config": ["a.yaml", "b.yaml"], "context": {"device_id": 3}},
         "a.yaml": {"context": CONTEXT}, "b.yaml": {"context": {"mode": 1}}},
        {"context": {"mode": 1, "device_id": 3}}),
    "nested-inheritance": (  # mid's own tree is root with mid deep-merged over it
        {"child.yaml": {"base_config": "mid.yaml", "c": 3},
         "mid.yaml": {"base_config": "root.yaml", "b": 2, "context": {"mode": 1}},
         "root.yaml": {"a": 1, "b": 1, "context": CONTEXT}},
        {"a": 1, "b": 2, "c": 3, "context": {**CONTEXT, "mode": 1}}),
    "diamond-is-not-a-cycle": (
        {"child.yaml": {"base_config": ["a.yaml", "b.yaml"]},
         "a.yaml": {"base_config": "root.yaml", "a": 1}, "b.yaml": {"base_config": "root.yaml", "b": 2},
         "root.yaml": {"r": 0}},
        {"a": 1, "b": 2, "r": 0}),
    "relative-to-own-directory": (  # common/base.yaml's "more/deep.yaml" means common/more/deep.yaml
        {"models/child.yaml": {"base_config": "../common/base.yaml"},
         "common/base.yaml": {"base_config": "more/deep.yaml", "from_base": 1},
         "common/more/deep.yaml": {"from_deep": 2},
         "models/more/deep.yaml": {"wrong_file": True}},
        {"from_base": 1, "from_deep": 2}),
    "empty-base-file": (
        {"child.yaml": {"base_config": "a.yaml", "x": 1}, "a.yaml": ""},
        {"x": 1}),
    "empty-base-config": (
        {"child.yaml": {"base_config": "", "x": 1}},
        {"x": 1}),
}


@pytest.mark.parametrize("files, want", INHERITANCE.values(), ids=INHERITANCE.keys())
def test_base_config_inheritance(tmp_path, monkeypatch, files, want):
    write_tree(tmp_path, files)
    entry = next(rel for rel in files if rel.endswith("child.yaml"))
    monkeypatch.chdir(tmp_path.parent)  # paths must not depend on the working directory
    assert load_yaml_tree(tmp_path / entry) == want


INHERITANCE_ERRORS = {
    "self-cycle": ({"child.yaml": {"base_config": "child.yaml"}}, "child.yaml", "base_config"),
    "two-file-cycle": ({"child.yaml": {"base_config": "a.yaml"}, "a.yaml": {"base_config": "b.yaml"},
                        "b.yaml": {"base_config": "a.yaml"}}, "a.yaml", "base_config"),
    "cycle-via-other-spelling": ({"child.yaml": {"base_config": "sub/a.yaml"},
                                  "sub/a.yaml": {"base_config": "../child.yaml"}}, "child.yaml", "base_config"),
    "missing-base": ({"child.yaml": {"base_config": "nope.yaml"}}, "nope.yaml", "<file>"),
    "bad-base-yaml": ({"child.yaml": {"base_config": "a.yaml"}, "a.yaml": "a: [1,\n"}, "a.yaml", "<yaml>"),
    "base-config-int": ({"child.yaml": {"base_config": 3}}, "child.yaml", "base_config"),
    "base-config-list-of-ints": ({"child.yaml": {"base_config": ["a.yaml", 3]}, "a.yaml": {}},
                                 "child.yaml", "base_config"),
    "base-root-list": ({"child.yaml": {"base_config": "a.yaml"}, "a.yaml": [1, 2]}, "a.yaml", "<root>"),
}


@pytest.mark.parametrize("files, file_name, key", INHERITANCE_ERRORS.values(), ids=INHERITANCE_ERRORS.keys())
def test_base_config_errors(tmp_path, files, file_name, key):
    write_tree(tmp_path, files)
    with pytest.raises(ConfigError) as err:
        load_yaml_tree(tmp_path / "child.yaml")
    assert err.value.key == key
    assert Path(err.value.path).name == file_name
    assert file_name in str(err.value) and key in str(err.value)


# --- the yamls shipped in configs/models ---

QWEN_7B = {
    "arch": "LlamaForCausalLM", "hidden_size": 3584, "num_layers": 28, "num_heads": 28, "num_kv_heads": 4,
    "head_dim": 128, "intermediate_size": 18944, "vocab_size": 152064, "qkv_has_bias": True,
    "rope_theta": 1e6, "rms_norm_eps": 1e-6, "eos_token_ids": (151645, 151643), "bos_token_id": 151643,
    "pad_token_id": 151643, "seq_length": 32768, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "compute_dtype": "bfloat16", "mode": 0, "device_target": "Ascend",
    "checkpoint_format": "safetensors",
    "defaults.top_k": 20, "defaults.top_p": 0.8, "defaults.temperature": 0.7, "defaults.do_sample": True,
    "defaults.repetition_penalty": 1.05,
    "tokenizer.type": "Qwen2Tokenizer", "tokenizer.vocab_file": "vocab.json", "tokenizer.merges_file": "merges.txt",
}
LLAMA2_7B = {
    "arch": "LlamaForCausalLM", "hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 32,
    "head_dim": 128, "intermediate_size": 11008, "vocab_size": 32000, "qkv_has_bias": False,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "eos_token_ids": (2,), "bos_token_id": 1, "pad_token_id": 0,
    "seq_length": 4096, "max_position_embeddings": 4096, "compute_dtype": "float16", "mode": 0,
    "device_target": "Ascend", "checkpoint_format": "ckpt",
    "defaults.top_k": 3, "defaults.top_p": 1.0, "defaults.temperature": None, "defaults.do_sample": False,
    "defaults.repetition_penalty": 1.0,
    "tokenizer.type": "LlamaTokenizer", "tokenizer.vocab_file": "tokenizer.model",
}
QWEN3_0_6B = {
    "arch": "Qwen3ForCausalLM", "hidden_size": 1024, "num_layers": 28, "num_heads": 16, "num_kv_heads": 8,
    "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "qkv_has_bias": False, "qk_norm": True,
    "tie_word_embeddings": True, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "eos_token_ids": (151645, 151643),
    "max_position_embeddings": 40960, "defaults.top_k": 20, "defaults.top_p": 0.95, "defaults.temperature": 0.6,
    "tokenizer.tokenizer_file": "tokenizer.json",
}
SMOLLM2 = {
    "hidden_size": 576, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64,
    "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True, "eos_token_ids": (2,),
    "rope_theta": 100000.0, "device_target": "CPU", "checkpoint_format": "safetensors",
    "defaults.top_k": None, "defaults.do_sample": None, "tokenizer.tokenizer_file": "tokenizer.json",
}


def _field(spec, dotted: str):
    value = spec
    for part in dotted.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value


@pytest.mark.parametrize("name, want", [
    ("predict_qwen2_5_7b_instruct.yaml", QWEN_7B),
    ("predict_llama2_7b.yaml", LLAMA2_7B),
    ("predict_qwen3_0_6b.yaml", QWEN3_0_6B),
    ("predict_smollm2_135m_instruct.yaml", SMOLLM2),
])
def test_shipped_yaml_loads(name, want):
    spec = load_model(MODELS / name)  # no weights next to these yamls: loading the spec must not need them
    assert not spec.checkpoint.exists()
    got = {key: _field(spec, key) for key in want}
    assert got == want


@pytest.mark.parametrize("name", ["predict_qwen2_5_7b_instruct.yaml", "predict_llama2_7b.yaml",
                                  "predict_qwen3_0_6b.yaml"])
def test_real_world_yamls_inherit_common_keys(name):
    raw = yaml.safe_load((MODELS / name).read_text(encoding="utf-8"))
    assert raw["base_config"] == "base/llama_common.yaml"
    assert "parallel_config" not in raw
    tree = load_yaml_tree(MODELS / name)
    assert "base_config" not in tree
    assert tree["parallel_config"]["model_parallel"] == 1
    assert tree["context"]["device_id"] == 0 and tree["context"]["mode"] == 0
    assert tree["run_mode"] == "predict" and tree["use_parallel"] is False


def test_llama2_context_is_deep_merged_over_base():
    base = yaml.safe_load((MODELS / "base" / "llama_common.yaml").read_text(encoding="utf-8"))
    tree = load_yaml_tree(MODELS / "predict_llama2_7b.yaml")
    assert base["context"]["max_device_memory"] == "59GB"
    assert tree["context"] == {**base["context"], "max_device_memory": "58GB"}


def test_shipped_default_yaml_is_what_the_converter_writes(default_model_dir):
    written = default_model_dir / "predict_smollm2_135m_instruct.yaml"
    shipped = MODELS / "predict_smollm2_135m_instruct.yaml"
    assert yaml.safe_load(shipped.read_text(encoding="utf-8")) == yaml.safe_load(written.read_text(encoding="utf-8"))


# --- fields and defaults ---

FIELDS = {
    "defaults": (None, {"num_kv_heads": 2, "head_dim": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                        "seq_length": 2048, "max_position_embeddings": 2048, "eos_token_ids": (2,),
                        "bos_token_id": None, "qkv_has_bias": False, "tie_word_embeddings": False,
                        "compute_dtype": "float32", "mode": 0, "device_target": "CPU",
                        "checkpoint_format": "safetensors", "defaults.top_k": None, "tokenizer": {},
                        "config_vocab_size": None, "qk_norm": False}),
    "hf-style-names": (mc(num_layers=..., n_kv_heads=..., num_hidden_layers=3, num_key_value_heads=1,
                          rope_theta=500000.0),
                       {"num_layers": 3, "num_kv_heads": 1, "rope_theta": 500000.0}),
    "int-for-float": (mc(theta=10000, rms_norm_eps=0, top_p=1, temperature=2, repetition_penalty=1),
                      {"rope_theta": 10000.0, "rms_norm_eps": 0.0, "defaults.top_p": 1.0,
                       "defaults.temperature": 2.0, "defaults.repetition_penalty": 1.0}),
    "eos-list": (mc(eos_token_id=[5, 7]), {"eos_token_ids": (5, 7)}),
    "top-k-0-is-off": (mc(top_k=0), {"defaults.top_k": None}),
    "explicit-head-dim": (mc(head_dim=32, hidden_size=90), {"head_dim": 32, "hidden_size": 90}),
    "qwen2-arch-bias-default": (lambda d: d["model"]["arch"].update(type="Qwen2ForCausalLM"),
                                {"arch": "Qwen2ForCausalLM", "qkv_has_bias": True}),
    "qwen3-arch-head-norm-default": (lambda d: d["model"]["arch"].update(type="Qwen3ForCausalLM"),
                                     {"arch": "Qwen3ForCausalLM", "qkv_has_bias": False, "qk_norm": True}),
    "qk-layernorm-key": (mc(qk_layernorm=True), {"arch": "LlamaForCausalLM", "qk_norm": True}),
    "qk-norm-alias": (mc(use_qk_norm=True), {"qk_norm": True}),
    "qwen3moe-experts": (moe(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                            mlp_only_layers=[0]),
                         {"moe.num_experts": 4, "moe.top_k": 2, "moe.intermediate_size": 32, "moe.norm_topk_prob": True,
                          "moe.sparse_layers": (1,)}),
    "qwen3moe-sparse-step": (moe(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32, decoder_sparse_step=2),
                             {"moe.sparse_layers": (1,), "moe.norm_topk_prob": False}),
    "qwen3moe-arch-head-norms": (lambda d: (d["model"]["arch"].update(type="Qwen3MoeForCausalLM"),
                                            mc(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8)(d)),
                                 {"qk_norm": True, "moe.sparse_layers": (0, 1)}),
    "dense-has-no-experts": (None, {"moe": None}),
    "seq-length-is-position-default": (mc(seq_length=512), {"seq_length": 512, "max_position_embeddings": 512}),
    "ffn-from-multiple-of": (mc(intermediate_size=..., hidden_size=4096, num_heads=32, n_kv_heads=32,
                                multiple_of=256), {"intermediate_size": 11008}),
    "ffn-default-multiple-of": (mc(intermediate_size=..., hidden_size=4096, num_heads=32, n_kv_heads=32),
                                {"intermediate_size": 11008}),
    "ffn-dim-multiplier": (mc(intermediate_size=..., hidden_size=8192, num_heads=64, n_kv_heads=8,
                              multiple_of=4096, ffn_dim_multiplier=1.3), {"intermediate_size": 28672}),
    "ckpt-inferred-from-suffix": (top(load_checkpoint="w/model.ckpt"), {"checkpoint_format": "ckpt"}),
    "pynative-ascend": (top(context={"mode": 1, "device_target": "Ascend"}),
                        {"mode": 1, "device_target": "Ascend"}),
    "tokenizer-section": (top(processor={"tokenizer": {"type": "PreTrainedTokenizerFast"}}),
                          {"tokenizer.type": "PreTrainedTokenizerFast"}),
}


@pytest.mark.parametrize("edit, want", FIELDS.values(), ids=FIELDS.keys())
def test_fields(tmp_path, edit, want):
    spec = spec_from(tmp_path, edit)
    assert {key: _field(spec, key) for key in want} == want


@pytest.mark.parametrize("load_checkpoint, want", [
    (None, "model.safetensors"),
    ("", "model.safetensors"),
    ("weights/model.ckpt", "weights/model.ckpt"),
])
def test_checkpoint_is_relative_to_the_yaml(tmp_path, monkeypatch, load_checkpoint, want):
    monkeypatch.chdir(tmp_path.parent)
    spec = spec_from(tmp_path, top(load_checkpoint=load_checkpoint))
    assert spec.checkpoint == tmp_path / want
    assert spec.model_dir == tmp_path


@pytest.mark.parametrize("config_json, want", [
    ({"vocab_size": 400}, 400),
    ({"padded_vocab_size": 512}, 512),
    ({"vocab_size": 400, "padded_vocab_size": 512}, 400),
    ({}, None),
    ({"vocab_size": 0}, None),
    ({"vocab_size": True}, None),
])
def test_config_json_vocab_size(tmp_path, config_json, want):
    (tmp_path / "config.json").write_text(json.dumps(config_json), encoding="utf-8")
    assert spec_from(tmp_path).config_vocab_size == want


def test_model_dir_and_its_yaml_give_the_same_spec(tiny_qwen2_dir):
    assert load_model(tiny_qwen2_dir) == load_model(tiny_qwen2_dir / "predict_tiny.yaml")


# --- errors name the file and the dotted key ---

def _set(*path_and_value):
    *path, value = path_and_value

    def edit(data: dict) -> None:
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return edit


SPEC_ERRORS = {
    "missing-hidden-size": (mc(hidden_size=...), "model.model_config.hidden_size"),
    "missing-num-layers": (mc(num_layers=...), "model.model_config.num_layers"),
    "missing-vocab-size": (mc(vocab_size=...), "model.model_config.vocab_size"),
    "heads-not-dividing-hidden": (mc(num_heads=6), "model.model_config.num_heads"),
    "kv-heads-not-dividing-heads": (mc(n_kv_heads=3), "model.model_config.n_kv_heads"),
    "zero-heads": (mc(num_heads=0), "model.model_config.num_heads"),
    "negative-intermediate": (mc(intermediate_size=-1), "model.model_config.intermediate_size"),
    "string-for-num-layers": (mc(num_layers="2"), "model.model_config.num_layers"),
    "float-for-num-layers": (mc(num_layers=2.0), "model.model_config.num_layers"),
    "bool-for-num-layers": (mc(num_layers=True), "model.model_config.num_layers"),
    "bool-for-hidden-size": (mc(hidden_size=True), "model.model_config.hidden_size"),
    "bool-for-float": (mc(rms_norm_eps=True), "model.model_config.rms_norm_eps"),
    "bool-for-top-k": (mc(top_k=False), "model.model_config.top_k"),
    "string-for-bool": (mc(qkv_has_bias="yes please"), "model.model_config.qkv_has_bias"),
    "int-for-bool": (mc(do_sample=1), "model.model_config.do_sample"),
    "eos-strings": (mc(eos_token_id=["</s>"]), "model.model_config.eos_token_id"),
    "eos-empty-list": (mc(eos_token_id=[]), "model.model_config.eos_token_id"),
    "unknown-dtype": (mc(compute_dtype="int8"), "model.model_config.compute_dtype"),
    "context-mode-2": (_set("context", "mode", 2), "context.mode"),
    "context-mode-string": (_set("context", "mode", "graph"), "context.mode"),
    "device-target": (_set("context", "device_target", "TPU"), "context.device_target"),
    "context-not-mapping": (top(context=[0]), "context"),
    "unknown-arch": (_set("model", "arch", "type", "GPT2LMHeadModel"), "model.arch.type"),
    "missing-arch": (lambda d: d["model"].pop("arch"), "model.arch"),
    "missing-model-config": (lambda d: d["model"].pop("model_config"), "model.model_config"),
    "model-config-list": (_set("model", "model_config", [1]), "model.model_config"),
    "missing-model": (lambda d: d.pop("model"), "model"),
    "checkpoint-format": (top(load_ckpt_format="pt"), "load_ckpt_format"),
    "checkpoint-not-path": (top(load_checkpoint=["a", "b"]), "load_checkpoint"),
    "tokenizer-not-mapping": (top(processor={"tokenizer": "tokenizer.json"}), "processor.tokenizer"),
    "processor-not-mapping": (top(processor="Qwen2Processor"), "processor"),
    "moe-arch-without-experts": (lambda d: d["model"]["arch"].update(type="Qwen3MoeForCausalLM"),
                                 "model.model_config.num_experts"),
    "experts-on-a-dense-arch": (mc(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8),
                                "model.model_config.num_experts"),
    "moe-top-k-above-experts": (moe(num_experts=2, num_experts_per_tok=3, moe_intermediate_size=8),
                                "model.model_config.num_experts_per_tok"),
    "moe-without-expert-width": (moe(num_experts=2, num_experts_per_tok=1), "model.model_config.moe_intermediate_size"),
    "moe-dense-layer-out-of-range": (moe(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
                                        mlp_only_layers=[2]), "model.model_config.mlp_only_layers"),
}


@pytest.mark.parametrize("edit, key", SPEC_ERRORS.values(), ids=SPEC_ERRORS.keys())
def test_spec_errors_name_file_and_key(tmp_path, edit, key):
    with pytest.raises(ConfigError) as err:
        spec_from(tmp_path, edit, name="predict_broken.yaml")
    assert err.value.key == key
    assert "predict_broken.yaml" in str(err.value)
    assert f": {key}: " in str(err.value)


FILE_ERRORS = {
    "invalid-yaml-syntax": ({"m.yaml": "model: {arch: [LlamaForCausalLM\n"}, "m.yaml", "m.yaml", "<yaml>"),
    "tab-indentation": ({"m.yaml": "model:\n\tarch: x\n"}, "m.yaml", "m.yaml", "<yaml>"),
    "root-is-list": ({"m.yaml": "- a\n- b\n"}, "m.yaml", "m.yaml", "<root>"),
    "root-is-scalar": ({"m.yaml": "just text\n"}, "m.yaml", "m.yaml", "<root>"),
    "missing-file": ({}, "absent.yaml", "absent.yaml", "<file>"),
    "empty-file": ({"m.yaml": ""}, "m.yaml", "m.yaml", "model"),
    "dir-without-yaml": ({"d/config.json": "{}"}, "d", "d", "<yaml>"),
    "dir-with-two-yamls": ({"d/a.yaml": MINIMAL, "d/b.yml": MINIMAL}, "d", "d", "<yaml>"),
    "bad-config-json": ({"d/m.yaml": MINIMAL, "d/config.json": "{nope"}, "d", "config.json", "<json>"),
    "config-json-not-object": ({"d/m.yaml": MINIMAL, "d/config.json": "[1]"}, "d", "config.json", "<root>"),
}


@pytest.mark.parametrize("files, target, file_name, key", FILE_ERRORS.values(), ids=FILE_ERRORS.keys())
def test_file_errors_name_file_and_key(tmp_path, files, target, file_name, key):
    write_tree(tmp_path, files)
    with pytest.raises(ConfigError) as err:
        load_model(tmp_path / target)
    assert err.value.key == key
    assert Path(err.value.path).name == file_name
    assert file_name in str(err.value) and key in str(err.value)


def test_two_yamls_error_lists_them(tmp_path):
    write_tree(tmp_path, {"a.yaml": MINIMAL, "b.yaml": MINIMAL})
    with pytest.raises(ConfigError, match=r"a\.yaml.*b\.yaml"):
        load_model(tmp_path)


def test_error_in_a_base_names_the_base(tmp_path):
    """A bad value inherited from a base is reported against the yaml being loaded, with its key."""
    write_tree(tmp_path, {"base.yaml": {"context": {"mode": 2}},
                          "predict_child.yaml": {**MINIMAL, "base_config": "base.yaml"}})
    with pytest.raises(ConfigError) as err:
        load_model(tmp_path / "predict_child.yaml")
    assert err.value.key == "context.mode" and "predict_child.yaml" in str(err.value)


def test_a_vision_language_directory_is_read_once_into_spec_vision():
    """``load_model`` reads with the family the arch names: a vision-language yaml gives its language
    model's spec with ``vision`` set (the same ``VLSpec`` ``load_vl_spec`` reads), a text yaml ``vision`` None."""
    from dataclasses import replace

    from backends.mindspore.families.qwen2_vl.config import load_vl_spec
    from backends.mindspore.families import family_of

    yaml_path = MODELS / "predict_qwen2_vl_7b_instruct.yaml"
    spec, vl = load_model(yaml_path), load_vl_spec(yaml_path)
    assert spec.vision == vl and replace(spec, vision=None) == vl.text
    assert family_of(spec.arch).capabilities.vision
    assert load_model(MODELS / "predict_llama2_7b.yaml").vision is None
