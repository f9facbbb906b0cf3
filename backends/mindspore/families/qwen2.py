"""Qwen2 (and Qwen2.5) text: the Llama layer with q/k/v biases by default."""
from __future__ import annotations

from functools import partial

from backends.mindspore.families.family import Family, GgufArch
from backends.mindspore.modeldir.llama_config import LayerDefaults, llama_spec

DEFAULTS = LayerDefaults(qkv_bias=True)

QWEN2 = Family(
    name="qwen2", described="a Qwen2 model", archs=("Qwen2ForCausalLM",),
    read=partial(llama_spec, defaults=DEFAULTS), defaults=DEFAULTS,
    aot="backends.mindspore.network.llama:AotLlama", stock="backends.mindspore.network.llama:StockLlama",
    gguf=GgufArch("qwen2", "Qwen2ForCausalLM", "qwen2", permuted_qk=False),
)
