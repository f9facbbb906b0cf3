"""Qwen3 (dense): the Llama layer with q/k head norms by default."""
from __future__ import annotations

from functools import partial

from backends.mindspore.families.family import Family, GgufArch
from backends.mindspore.modeldir.llama_config import LayerDefaults, llama_spec

DEFAULTS = LayerDefaults(qk_norm=True)

QWEN3 = Family(
    name="qwen3", described="a Qwen3 model", archs=("Qwen3ForCausalLM",),
    read=partial(llama_spec, defaults=DEFAULTS), defaults=DEFAULTS,
    aot="backends.mindspore.network.llama:AotLlama", stock="backends.mindspore.network.llama:StockLlama",
    gguf=GgufArch("qwen3", "Qwen3ForCausalLM", "qwen3", permuted_qk=False),
)
