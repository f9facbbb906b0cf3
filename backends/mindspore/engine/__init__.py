"""The engine: its parts built once (and checked before anything is built: preflight.py), the continuous-batching
loop (engine.py), the request intake, the scheduler and sequences, speculative decoding, adapters, and the paged KV
cache's blocks."""
