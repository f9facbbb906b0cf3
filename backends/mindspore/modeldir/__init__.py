"""A model directory's vocabulary: the yaml tree, the spec, the Llama-shaped reader the families share, the weights
and their quantized blocks, the tokenizer. The registry (``families/``) reads a directory with them; ``sources/``
makes one."""
