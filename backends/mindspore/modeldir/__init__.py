"""Reading a model directory: the yaml tree and the families' readers' shared parts, the spec, the weights and
tokenizer files, GGUF and HF-directory conversion, the model cache and packages."""
