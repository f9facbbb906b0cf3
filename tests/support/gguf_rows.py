"""GGUF test helpers shared by the conversion tests: the tiny vocabulary and llama.cpp's row permutation."""
from __future__ import annotations

import numpy as np


TINY_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab", "Ġ", "Ġab"]


def hf_to_gguf_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's forward permutation, written out independently."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, hd // 2, -1).swapaxes(1, 2).reshape(w.shape)
