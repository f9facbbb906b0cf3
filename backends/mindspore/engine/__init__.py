"""The engine: its parts built once, the continuous-batching loop (engine.py), the request intake, the scheduler and
sequences, speculative decoding, adapters, and the paged KV cache with its page mapping."""
