"""The MindSpore ("ms") backend: yaml configs, weights, tokenizer, network, engine."""
