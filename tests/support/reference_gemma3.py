"""Independent NumPy forward of Gemma 3 text: tests/support/reference_numpy.py's model and building blocks, extended
with what Gemma 3 adds (HF ``Gemma3ForCausalLM`` semantics): the embedding scaled by sqrt(hidden), four norms a layer
multiplying by ``1 + w``, RMS-normed q/k heads, GeGLU with the tanh GELU, the score scale query_pre_attn_scalar**-0.5,
sliding-window layers (query i reads keys j with 0 <= i - j < window, rope base rope_local_base_freq) beside global
layers (rope_theta, linear rope scaling). Reads an HF directory or a GGUF, dequantised by the ``gguf`` package
(llama.cpp's own reader), never the project's converter. No KV cache; float64 by default."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.support.reference_numpy import RefModel, _read_safetensors_dir, apply_rope, rms_norm, rope_tables

# GGUF tensor kinds of a gemma3 layer → HF names (llama.cpp's tensor map for LLM_ARCH_GEMMA3)
_GGUF_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
          "self_attn.q_norm", "self_attn.k_norm")


@dataclass(frozen=True, slots=True)
class Gemma3RefConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float  # global layers
    rope_local_theta: float  # sliding-window layers
    rope_scaling_factor: float  # linear, global layers only (1: none)
    sliding_window: int
    sliding_layers: tuple[bool, ...]
    attn_scale: float
    tie_word_embeddings: bool = True  # Gemma 3 ties its head (RefModel's rule reads this)

    @classmethod
    def from_hf(cls, cfg: dict) -> Gemma3RefConfig:
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if cfg.get(key) is not None:
                raise NotImplementedError(f"{key} is not implemented in the reference")
        scaling = cfg.get("rope_scaling") or {"rope_type": "default"}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("default", "linear"):
            raise NotImplementedError(f"rope scaling {kind!r} is not implemented in the reference")
        layers = cfg["num_hidden_layers"]
        types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                           for i in range(layers)]
        return cls(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"], num_layers=layers,
                   num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
                   head_dim=cfg["head_dim"], vocab_size=cfg["vocab_size"], rms_norm_eps=float(cfg["rms_norm_eps"]),
                   rope_theta=float(cfg["rope_theta"]), rope_local_theta=float(cfg["rope_local_base_freq"]),
                   rope_scaling_factor=float(scaling["factor"]) if kind == "linear" else 1.0,
                   sliding_window=int(cfg["sliding_window"]),
                   sliding_layers=tuple(t == "sliding_attention" for t in types),
                   attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5)

    @classmethod
    def from_gguf(cls, reader) -> Gemma3RefConfig:
        """As llama.cpp's loader reads a gemma3 GGUF: every 6th layer global, local rope base 10000, the score scale
        1 / sqrt(key_length) (the released query_pre_attn_scalar of every size but 27B, which this refuses)."""
        def field(key: str, default=None):
            f = reader.fields.get(f"gemma3.{key}")
            if f is None and default is None:
                raise KeyError(f"GGUF metadata key gemma3.{key} missing")
            return default if f is None else f.contents()

        if field("rope.scaling.type", "none") != "none":
            raise NotImplementedError("rope scaling is not implemented for GGUFs in the reference")
        layers, heads = int(field("block_count")), int(field("attention.head_count"))
        if layers == 62:
            raise NotImplementedError("Gemma 3 27B's score scale (hidden / heads) is not implemented")
        pattern = int(field("attention.sliding_window_pattern", 6))
        embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
        return cls(hidden_size=int(field("embedding_length")), intermediate_size=int(field("feed_forward_length")),
                   num_layers=layers, num_heads=heads, num_kv_heads=int(field("attention.head_count_kv")),
                   head_dim=int(field("attention.key_length")), vocab_size=int(embd.shape[-1]),
                   rms_norm_eps=float(field("attention.layer_norm_rms_epsilon")),
                   rope_theta=float(field("rope.freq_base")), rope_local_theta=float(field("rope.freq_base_swa", 1e4)),
                   rope_scaling_factor=1.0, sliding_window=int(field("attention.sliding_window")),
                   sliding_layers=tuple(bool((i + 1) % pattern) for i in range(layers)),
                   attn_scale=float(field("attention.key_length")) ** -0.5)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """HF gelu_pytorch_tanh."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def windowed_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                       window: int | None) -> np.ndarray:
    """q: [H, T, hd]; k, v: [KV, T, hd]. Query i reads key j when 0 <= i - j (< window, if given); head h reads kv
    head h // (H / KV). Returns [H, T, hd]."""
    n_heads, seq, _ = q.shape
    kv_of_head = np.arange(n_heads) // (n_heads // k.shape[0])
    k, v = k[kv_of_head], v[kv_of_head]
    scores = q @ k.transpose(0, 2, 1) * scale  # [H, T, T]
    behind = np.arange(seq)[:, None] - np.arange(seq)[None, :]  # i - j
    hidden = (behind < 0) | ((behind >= window) if window is not None else False)
    scores = np.where(hidden, -np.inf, scores)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (scores / scores.sum(axis=-1, keepdims=True)) @ v


class Gemma3RefModel(RefModel):
    """HF-named weights, [out, in]; every norm weight held as the multiplier it applies (HF's 1 + w; a GGUF stores
    that already), so the forward never asks where they came from."""

    def __init__(self, config: Gemma3RefConfig, weights: dict[str, np.ndarray], dtype: type = np.float64):
        super().__init__(config, weights, dtype)

    @classmethod
    def from_dir(cls, path: str | Path, *, dtype: type = np.float64) -> Gemma3RefModel:
        path = Path(path)
        config = Gemma3RefConfig.from_hf(json.loads((path / "config.json").read_text()))
        weights = {k: (1.0 + v.astype(np.float64) if _is_norm(k) else v)
                   for k, v in _read_safetensors_dir(path).items()}
        return cls(config, weights, dtype)

    @classmethod
    def from_gguf(cls, gguf_path: str | Path, *, dtype: type = np.float64) -> Gemma3RefModel:
        """Every tensor dequantised to float32 by ``gguf.quants.dequantize`` (llama.cpp's Python reader)."""
        from gguf import GGUFReader
        from gguf.quants import dequantize

        reader = GGUFReader(str(gguf_path))
        arch = reader.fields["general.architecture"].contents()
        if arch != "gemma3":
            raise ValueError(f"{gguf_path}: general.architecture is {arch!r}, not 'gemma3'")
        weights = {_hf_name(t.name): np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
                   for t in reader.tensors}
        return cls(Gemma3RefConfig.from_gguf(reader), weights, dtype)

    def hidden_states(self, ids: list[int]) -> np.ndarray:
        """Final-normed hidden states [T, hidden]."""
        cfg = self.config
        x = self.w["model.embed_tokens.weight"][np.asarray(ids)] * self.dtype.type(np.sqrt(cfg.hidden_size))
        positions = np.arange(len(ids))
        ropes = {True: rope_tables(positions, cfg.head_dim, cfg.rope_local_theta),
                 False: rope_tables(positions / cfg.rope_scaling_factor, cfg.head_dim, cfg.rope_theta)}
        ropes = {local: tuple(t.astype(self.dtype) for t in cs) for local, cs in ropes.items()}
        for layer, local in enumerate(cfg.sliding_layers):
            p = f"model.layers.{layer}."
            h = self._attention(self._norm(x, p + "input_layernorm"), p, *ropes[local],
                                cfg.sliding_window if local else None)
            x = x + self._norm(h, p + "post_attention_layernorm")
            h = self._mlp(self._norm(x, p + "pre_feedforward_layernorm"), p)
            x = x + self._norm(h, p + "post_feedforward_layernorm")
        return self._norm(x, "model.norm")

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return rms_norm(x, self.w[name + ".weight"], self.config.rms_norm_eps)

    def _attention(self, h: np.ndarray, p: str, cos: np.ndarray, sin: np.ndarray,  # type: ignore[override]
                   window: int | None = None) -> np.ndarray:
        cfg = self.config
        seq = h.shape[0]

        def heads(name: str, n: int) -> np.ndarray:  # [T, n*hd] → [n, T, hd]
            return self._linear(h, p + name).reshape(seq, n, cfg.head_dim).transpose(1, 0, 2)

        q = self._norm(heads("self_attn.q_proj", cfg.num_heads), p + "self_attn.q_norm")
        k = self._norm(heads("self_attn.k_proj", cfg.num_kv_heads), p + "self_attn.k_norm")
        v = heads("self_attn.v_proj", cfg.num_kv_heads)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = windowed_attention(q, k, v, cfg.attn_scale, window)
        return self._linear(out.transpose(1, 0, 2).reshape(seq, cfg.num_heads * cfg.head_dim), p + "self_attn.o_proj")

    def _mlp(self, h: np.ndarray, p: str) -> np.ndarray:
        gate = self._linear(h, p + "mlp.gate_proj")
        return self._linear(gelu_tanh(gate) * self._linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")

    def _check_shapes(self) -> None:
        cfg = self.config
        d, q_out, kv_out = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        want = {"model.embed_tokens.weight": (cfg.vocab_size, d), "lm_head.weight": (cfg.vocab_size, d),
                "model.norm.weight": (d,)}
        for layer in range(cfg.num_layers):
            p = f"model.layers.{layer}."
            want |= {p + n + ".weight": (d,) for n in _NORMS[:4]}
            want |= {p + n + ".weight": (cfg.head_dim,) for n in _NORMS[4:]}
            want |= {p + "self_attn.q_proj.weight": (q_out, d), p + "self_attn.k_proj.weight": (kv_out, d),
                     p + "self_attn.v_proj.weight": (kv_out, d), p + "self_attn.o_proj.weight": (d, q_out),
                     p + "mlp.gate_proj.weight": (cfg.intermediate_size, d),
                     p + "mlp.up_proj.weight": (cfg.intermediate_size, d),
                     p + "mlp.down_proj.weight": (d, cfg.intermediate_size)}
        got = {name: a.shape for name, a in self.w.items()}
        if got != want:
            wrong = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
            raise ValueError(f"tensors missing, extra or misshapen (name, want, got): "
                             f"{[(n, want.get(n), got.get(n)) for n in wrong[:5]]}")


def _is_norm(name: str) -> bool:
    return name == "model.norm.weight" or any(name.endswith(f".{n}.weight") for n in _NORMS)


def _hf_name(gguf_name: str) -> str:
    stem, suffix = gguf_name.rsplit(".", 1)
    if stem in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _GGUF_LAYER:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not understood by the reference")
    return f"model.layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}.{suffix}"
