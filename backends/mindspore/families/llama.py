"""The Llama family: Llama 2/3, SmolLM2, Mistral (and MindFormers' ParallelLlama name): the plain Llama layer."""
from __future__ import annotations

from backends.mindspore.families.family import Family, GgufArch
from backends.mindspore.modeldir.llama_config import llama_spec

LLAMA = Family(
    name="llama", described="a Llama-family model",
    archs=("LlamaForCausalLM", "MistralForCausalLM", "ParallelLlamaForCausalLM"),
    read=llama_spec,
    aot="backends.mindspore.network.llama:AotLlama", stock="backends.mindspore.network.llama:StockLlama",
    gguf=GgufArch("llama", "LlamaForCausalLM", "llama", permuted_qk=True),
)
