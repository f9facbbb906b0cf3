"""Qwen3-MoE: Qwen3's layers with routed experts in the layers the yaml names (HF Qwen3MoeConfig's keys); the
expert layers take no adapter slots."""
from __future__ import annotations

from functools import partial

from backends.mindspore.families.family import Capabilities, Family, GgufArch
from backends.mindspore.modeldir.llama_config import LayerDefaults, llama_spec

DEFAULTS = LayerDefaults(qk_norm=True)

QWEN3_MOE = Family(
    name="qwen3_moe", described="a model with routed experts", archs=("Qwen3MoeForCausalLM",),
    read=partial(llama_spec, defaults=DEFAULTS, experts=True), defaults=DEFAULTS,
    aot="backends.mindspore.families.qwen3_moe.network:AotMoeLlama",
    stock="backends.mindspore.families.qwen3_moe.network:StockMoeLlama",
    capabilities=Capabilities(lora=False, moe=True),
    gguf=GgufArch("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe", permuted_qk=False),
    config_keys=("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                 "decoder_sparse_step", "mlp_only_layers"),
)
