"""The predict yaml of a Llama-shaped text model (MindFormers' LlamaConfig keys, and the experts' keys of HF's
Qwen3MoeConfig) -> ``ModelSpec``: the reader the text families share (``families/``), each with its own defaults
(``LayerDefaults``), routed experts read where the family has them."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from backends.mindspore.modeldir.spec import ModelSpec, MoeSpec
from backends.mindspore.modeldir.yaml_tree import (ConfigError, YamlSection, read_checkpoint, read_context,
                                                   read_defaults, read_eos_ids, read_json_object)

# model_config.weight_dtype: float32, a GGUF block format kept by convert-gguf (served by the quantized AOT
# matmul, dequantized once at load for the stock ops), or mixed (the layers' matrices differ).
WEIGHT_DTYPES = ("float32", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "mixed")


@dataclass(frozen=True, slots=True)
class LayerDefaults:
    """The defaults that differ by family (``families/``; a key the yaml gives wins)."""

    qkv_bias: bool = False  # q/k/v projections with biases (Qwen2)
    qk_norm: bool = False  # q and k heads RMS-normalised before RoPE (Qwen3, Gemma 3)
    tied: bool = False  # the LM head is the embedding (Gemma 3)


def model_config(yaml_path: Path, model: YamlSection) -> YamlSection:
    """The yaml's ``model.model_config`` section."""
    return YamlSection(yaml_path, "model.model_config", model.get("model_config", dict))


def llama_spec(yaml_path: Path, tree: dict, model: YamlSection, arch: str, defaults: LayerDefaults = LayerDefaults(),
               experts: bool = False) -> ModelSpec:
    """The language model of a Llama-shaped yaml tree (``yaml_tree.read_model_yaml``); ``experts``: the family has
    routed experts (then required), else a ``num_experts`` key is refused."""
    mc = model_config(yaml_path, model)
    hidden, heads = mc.positive("hidden_size"), mc.positive("num_heads")
    kv_heads = mc.positive("n_kv_heads", heads, "num_key_value_heads")
    head_dim = mc.positive("head_dim", None)
    if head_dim is None and hidden % heads:
        raise ConfigError(yaml_path, "model.model_config.num_heads",
                          f"num_heads {heads} does not divide hidden_size {hidden}")
    if heads % kv_heads:
        raise ConfigError(yaml_path, "model.model_config.n_kv_heads",
                          f"n_kv_heads {kv_heads} does not divide num_heads {heads}")
    seq_length = mc.positive("seq_length", 2048)
    hf = read_json_object(yaml_path.parent / "config.json")
    cfg_vocab = hf.get("vocab_size") or hf.get("padded_vocab_size")
    if isinstance(cfg_vocab, bool):
        cfg_vocab = None
    ckpt, fmt = read_checkpoint(tree, yaml_path)
    mode, target = read_context(tree, yaml_path)
    tok = YamlSection(yaml_path, "processor", tree.get("processor") or {}).get("tokenizer", dict, {})
    dtype = mc.get("compute_dtype", str, "float32")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ConfigError(yaml_path, "model.model_config.compute_dtype", f"unknown dtype {dtype!r}")
    num_layers = mc.positive("num_layers", ..., "num_hidden_layers")
    weight_dtype = mc.get("weight_dtype", str, "float32")
    if weight_dtype not in WEIGHT_DTYPES:
        raise ConfigError(yaml_path, "model.model_config.weight_dtype",
                          f"must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    return ModelSpec(
        yaml_path=yaml_path, model_dir=yaml_path.parent, arch=arch,
        hidden_size=hidden, num_layers=num_layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim or hidden // heads,
        intermediate_size=_intermediate_size(mc, hidden),
        vocab_size=mc.positive("vocab_size"),
        rms_norm_eps=mc.get("rms_norm_eps", float, 1e-6),
        rope_theta=mc.get("theta", float, 10000.0, "rope_theta"),
        max_position_embeddings=mc.positive("max_position_embedding", seq_length, "max_position_embeddings"),
        seq_length=seq_length,
        qkv_has_bias=mc.get("qkv_has_bias", bool, defaults.qkv_bias),
        tie_word_embeddings=mc.get("tie_word_embeddings", bool, defaults.tied),
        bos_token_id=mc.get("bos_token_id", int, None),
        eos_token_ids=read_eos_ids(mc.get("eos_token_id", (int, list), 2), yaml_path),
        pad_token_id=mc.get("pad_token_id", int, None),
        compute_dtype=dtype, checkpoint=ckpt, checkpoint_format=fmt,
        tokenizer=tok, mode=mode, device_target=target,
        defaults=read_defaults(mc),
        config_vocab_size=cfg_vocab if isinstance(cfg_vocab, int) and cfg_vocab > 0 else None,
        weight_dtype=weight_dtype,
        qk_norm=mc.get("qk_layernorm", bool, defaults.qk_norm, "qk_norm", "use_qk_norm"),
        moe=_moe(yaml_path, mc, arch, num_layers) if experts else _dense(yaml_path, mc, arch),
    )


def _dense(yaml_path: Path, mc: YamlSection, arch: str) -> None:
    """A family without routed experts: a ``num_experts`` key is a mistake, not a model (families/ lists the
    architectures that have them)."""
    if mc.get("num_experts", int, 0):
        raise ConfigError(yaml_path, "model.model_config.num_experts", f"{arch} has no routed experts; remove the key "
                          "(or name an architecture with experts in model.arch.type)")


def _moe(yaml_path: Path, mc: YamlSection, arch: str, num_layers: int) -> MoeSpec:
    """The routed experts (HF Qwen3MoeConfig's keys); ``num_experts`` > 0 required."""
    experts = mc.get("num_experts", int, 0)
    if not experts:
        raise ConfigError(yaml_path, "model.model_config.num_experts", f"{arch} needs num_experts > 0")
    if experts < 0:
        raise ConfigError(yaml_path, "model.model_config.num_experts", f"must be > 0, got {experts}")
    top_k = mc.positive("num_experts_per_tok", ...)
    if top_k > experts:
        raise ConfigError(yaml_path, "model.model_config.num_experts_per_tok",
                          f"{top_k} routed experts per token, but num_experts is {experts}")
    step = mc.positive("decoder_sparse_step", 1)
    dense = mc.get("mlp_only_layers", list, [])
    bad = [i for i in dense if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ConfigError(yaml_path, "model.model_config.mlp_only_layers",
                          f"must list layer indices in [0, {num_layers}), got {bad}")
    return MoeSpec(num_experts=experts, top_k=top_k, intermediate_size=mc.positive("moe_intermediate_size", ...),
                   norm_topk_prob=mc.get("norm_topk_prob", bool, False),
                   sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0))


def _intermediate_size(mc: YamlSection, hidden: int) -> int:
    """``intermediate_size``, else derived as MindFormers' LlamaConfig does (Llama-2 yamls give only
    ``multiple_of``): 2/3 of 4*hidden, times ``ffn_dim_multiplier``, rounded up to ``multiple_of``."""
    size = mc.positive("intermediate_size", None)
    if size is not None:
        return size
    multiple_of = mc.positive("multiple_of", 256)
    size = int(2 * 4 * hidden / 3)
    multiplier = mc.get("ffn_dim_multiplier", float, None)
    if multiplier is not None:
        size = int(multiplier * size)
    return multiple_of * -(-size // multiple_of)
