"""Where a model directory comes from: a GGUF file or an HF directory converted (by the registry's GGUF maps and
config keys), a package or the default model fetched, and the model cache that keeps them."""
