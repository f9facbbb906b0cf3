"""Independent NumPy forward of a Llama-family decoder: the oracle the MindSpore network is checked against.

Covers Llama 2/3 (default RoPE), Mistral (within its sliding window), Qwen2 (q/k/v bias) and SmolLM2.
Reads an HF directory (config.json + safetensors) or a GGUF file directly (own dequantisation and Q/K
un-permutation), never the project's loader or converter. No KV cache: every call recomputes the whole
sequence. Arithmetic is float64 by default (weights upcast once at load); pass dtype=np.float32 to mimic
an fp32 engine.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# GGUF tensor name pieces → HF names. llama.cpp stores Q/K rows permuted for interleaved rotary
# only for these architectures (Qwen2 uses NEOX rotary in llama.cpp and is stored unpermuted).
_GGUF_PERMUTED_ARCHS = frozenset({"llama"})
_GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


@dataclass(frozen=True, slots=True)
class _HfModelType:
    """What HF transformers' config class of a ``model_type`` implies beyond config.json's keys (the reference's own
    table, read as HF reads the file: independent of the registry under test)."""

    qkv_bias: bool = False  # Qwen2: biases on q/k/v always
    qk_norm: bool = False  # Qwen3: q_norm / k_norm always
    window_needs_switch: bool = False  # Qwen2: sliding_window applies only with use_sliding_window


_HF_MODEL_TYPES = {"qwen2": _HfModelType(qkv_bias=True, window_needs_switch=True), "qwen3": _HfModelType(qk_norm=True)}


@dataclass(frozen=True, slots=True)
class RefConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2, or Llama attention_bias (which also puts a bias on o_proj)
    sliding_window: int | None = None  # longer inputs are refused, not silently mis-masked
    qk_norm: bool = False  # Qwen3: q_norm / k_norm, an RMSNorm over each head before RoPE

    @classmethod
    def from_hf(cls, cfg: dict) -> RefConfig:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"rope scaling {rope_type!r} is not implemented in the reference")
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        heads = cfg["num_attention_heads"]
        window = cfg.get("sliding_window")
        implied = _HF_MODEL_TYPES.get(cfg.get("model_type"), _HfModelType())
        if implied.window_needs_switch and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=float(theta),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=implied.qkv_bias or bool(cfg.get("attention_bias", False)),
            sliding_window=window,
            qk_norm=implied.qk_norm,
        )


# ---------------------------------------------------------------- building blocks (pure functions)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_tables(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [T, head_dim] in HF layout: frequency i drives both column i and column i + head_dim/2."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles), np.sin(angles)


def rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: [heads, T, head_dim]; cos/sin: [T, head_dim]."""
    return x * cos + rotate_half(x) * sin


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q: [H, T, hd]; k, v: [KV, T, hd] with H % KV == 0. Query head h reads kv head h // (H/KV)
    (HF repeat_kv). Returns [H, T, hd]."""
    n_heads, seq, head_dim = q.shape
    kv_of_head = np.arange(n_heads) // (n_heads // k.shape[0])
    k, v = k[kv_of_head], v[kv_of_head]
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(head_dim)  # [H, T, T]
    future = np.triu(np.ones((seq, seq), dtype=bool), k=1)
    scores = np.where(future, -np.inf, scores)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (scores / scores.sum(axis=-1, keepdims=True)) @ v


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def unpermute_gguf_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. GGUF row h*hd + 2i + s holds HF row h*hd + s*hd/2 + i, so
    that llama.cpp's interleaved rotary (pairs 2i, 2i+1) equals HF rotate_half (pairs i, i + hd/2).
    w: [n_heads*hd, in] weight or [n_heads*hd] bias."""
    head_dim = w.shape[0] // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------- the model


class RefModel:
    """Weights keyed by HF names, [out, in] like HF. Every bias present is applied; q/k/v biases must be
    present exactly when config.qkv_bias."""

    def __init__(self, config: RefConfig, weights: dict[str, np.ndarray], dtype: type = np.float64):
        self.config = config
        self.dtype = np.dtype(dtype)
        self.w = {name: np.ascontiguousarray(a, dtype=self.dtype) for name, a in weights.items()}
        if config.tie_word_embeddings or "lm_head.weight" not in self.w:
            if not config.tie_word_embeddings:
                raise ValueError("tie_word_embeddings is false but there is no lm_head.weight")
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        self._check_shapes()

    @classmethod
    def from_dir(cls, path: str | Path, *, dtype: type = np.float64) -> RefModel:
        path = Path(path)
        config = RefConfig.from_hf(json.loads((path / "config.json").read_text()))
        return cls(config, _read_safetensors_dir(path), dtype)

    @classmethod
    def from_gguf(cls, gguf_path: str | Path, *, dtype: type = np.float64, cache_dir: Path | None = None) -> RefModel:
        """Dequantise every tensor to float32 (as transformers does), un-permute Q/K, tie the head when
        there is no output.weight. With cache_dir, the dequantised float32 weights are kept in an npz keyed
        by the GGUF's name, size and mtime and by this file's hash, so editing the reference invalidates it
        (parsing + dequantising SmolLM2-135M takes ~5 s, loading the npz ~1.3 s)."""
        gguf_path = Path(gguf_path)
        cache = None
        if cache_dir is not None:
            st = gguf_path.stat()
            code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
            cache = Path(cache_dir) / f"{gguf_path.stem}.{st.st_size}.{st.st_mtime_ns}.{code}.ref-f32.npz"
            if cache.exists():
                with np.load(cache) as npz:
                    config = RefConfig(**json.loads(str(npz["__config__"])))
                    return cls(config, {k: npz[k] for k in npz.files if k != "__config__"}, dtype)
        config, weights = _read_gguf(gguf_path)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp.npz")
            np.savez(tmp, __config__=np.array(json.dumps(asdict(config))), **weights)
            tmp.replace(cache)  # atomic: a concurrent reader never sees half a file
            for stale in cache.parent.glob(f"{gguf_path.stem}.*.ref-f32.npz"):
                if stale != cache:
                    stale.unlink(missing_ok=True)
        return cls(config, weights, dtype)

    def hidden_states(self, ids: list[int]) -> np.ndarray:
        """Final-normed hidden states [T, hidden]."""
        cfg = self.config
        if cfg.sliding_window is not None and len(ids) > cfg.sliding_window:
            raise NotImplementedError("sequence longer than the sliding window")
        x = self.w["model.embed_tokens.weight"][np.asarray(ids)]  # [T, D]
        cos, sin = (t.astype(self.dtype) for t in rope_tables(np.arange(len(ids)), cfg.head_dim, cfg.rope_theta))
        for layer in range(cfg.num_layers):
            p = f"model.layers.{layer}."
            x = x + self._attention(rms_norm(x, self.w[p + "input_layernorm.weight"], cfg.rms_norm_eps), p, cos, sin)
            x = x + self._mlp(rms_norm(x, self.w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps), p)
        return rms_norm(x, self.w["model.norm.weight"], cfg.rms_norm_eps)

    def logits(self, ids: list[int]) -> np.ndarray:
        """[T, V] in self.dtype."""
        return self.hidden_states(ids) @ self.w["lm_head.weight"].T

    def next_logits(self, ids: list[int]) -> np.ndarray:
        """[V] logits for the token after ids (only the last row goes through the head)."""
        return self.hidden_states(ids)[-1] @ self.w["lm_head.weight"].T

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """n argmax tokens after ids (ties → lowest id, like np/torch argmax); EOS is not special."""
        seq = list(ids)
        for _ in range(n):
            seq.append(int(np.argmax(self.next_logits(seq))))
        return seq[len(ids):]

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return y if bias is None else y + bias

    def _attention(self, h: np.ndarray, p: str, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        cfg = self.config
        seq = h.shape[0]

        def heads(name: str, n: int) -> np.ndarray:  # [T, n*hd] → [n, T, hd]
            return self._linear(h, p + name).reshape(seq, n, cfg.head_dim).transpose(1, 0, 2)

        q, k = heads("self_attn.q_proj", cfg.num_heads), heads("self_attn.k_proj", cfg.num_kv_heads)
        if cfg.qk_norm:
            q = rms_norm(q, self.w[p + "self_attn.q_norm.weight"], cfg.rms_norm_eps)
            k = rms_norm(k, self.w[p + "self_attn.k_norm.weight"], cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = heads("self_attn.v_proj", cfg.num_kv_heads)
        out = causal_attention(q, k, v).transpose(1, 0, 2).reshape(seq, cfg.num_heads * cfg.head_dim)
        return self._linear(out, p + "self_attn.o_proj")

    def _mlp(self, h: np.ndarray, p: str) -> np.ndarray:
        gate = self._linear(h, p + "mlp.gate_proj")
        return self._linear(silu(gate) * self._linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")

    def _check_shapes(self) -> None:
        cfg = self.config
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        want = {
            "model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
            "lm_head.weight": (cfg.vocab_size, cfg.hidden_size),
            "model.norm.weight": (cfg.hidden_size,),
        }
        for layer in range(cfg.num_layers):
            p = f"model.layers.{layer}."
            want |= {
                p + "input_layernorm.weight": (cfg.hidden_size,),
                p + "post_attention_layernorm.weight": (cfg.hidden_size,),
                p + "self_attn.q_proj.weight": (q_out, cfg.hidden_size),
                p + "self_attn.k_proj.weight": (kv_out, cfg.hidden_size),
                p + "self_attn.v_proj.weight": (kv_out, cfg.hidden_size),
                p + "self_attn.o_proj.weight": (cfg.hidden_size, q_out),
                p + "mlp.gate_proj.weight": (cfg.intermediate_size, cfg.hidden_size),
                p + "mlp.up_proj.weight": (cfg.intermediate_size, cfg.hidden_size),
                p + "mlp.down_proj.weight": (cfg.hidden_size, cfg.intermediate_size),
            }
            if cfg.qk_norm:
                want |= {p + f"self_attn.{n}_norm.weight": (cfg.head_dim,) for n in "qk"}
            biased = ("q_proj", "k_proj", "v_proj") if cfg.qkv_bias else ()
            if "model.layers.0.self_attn.o_proj.bias" in self.w:  # Llama attention_bias
                biased += ("o_proj",)
            want |= {p + f"self_attn.{proj}.bias": want[p + f"self_attn.{proj}.weight"][:1] for proj in biased}
        for name, shape in want.items():
            if name not in self.w or self.w[name].shape != shape:
                got = self.w[name].shape if name in self.w else "missing"
                raise ValueError(f"{name}: expected {shape}, got {got}")
        extra = set(self.w) - set(want)
        if extra:
            raise ValueError(f"unexpected tensors (the reference would ignore them): {sorted(extra)[:5]}")


# ---------------------------------------------------------------- file readers


def _read_safetensors_dir(path: Path) -> dict[str, np.ndarray]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in _read_safetensors(path / shard).items()}
    return _read_safetensors(path / "model.safetensors")


def _read_safetensors(file: Path) -> dict[str, np.ndarray]:
    """Minimal safetensors reader (8-byte header length, JSON header, raw little-endian data);
    handles BF16, which safetensors.numpy cannot."""
    raw = np.memmap(file, dtype=np.uint8, mode="r")
    header_len = int(raw[:8].view("<u8")[0])
    header = json.loads(bytes(raw[8 : 8 + header_len]))
    data = raw[8 + header_len :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        chunk = data[start:end]
        if info["dtype"] == "BF16":  # bf16 is the top half of an fp32
            arr = (chunk.view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = chunk.view(np.dtype(_ST_DTYPES[info["dtype"]]).newbyteorder("<"))
        out[name] = arr.reshape(info["shape"])
    return out


def _read_gguf(path: Path) -> tuple[RefConfig, dict[str, np.ndarray]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    config, arch = _config_from_gguf(reader)
    weights = {}
    for tensor in reader.tensors:
        name, head_count = _hf_name_from_gguf(tensor.name, config)
        w = dequantize(tensor.data, tensor.tensor_type)  # numpy layout is already [out, in]
        if head_count and arch in _GGUF_PERMUTED_ARCHS:
            w = unpermute_gguf_rows(w, head_count)
        weights[name] = np.asarray(w, dtype=np.float32)
    return config, weights


def _config_from_gguf(reader) -> tuple[RefConfig, str]:
    def field(key: str, default=None):
        f = reader.fields.get(key)
        if f is None:
            if default is None:
                raise KeyError(f"GGUF metadata key {key!r} missing")
            return default
        return f.contents()

    arch = field("general.architecture")
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    if "rope_freqs.weight" in names or field(f"{arch}.rope.scaling.type", "none") not in ("none",):
        raise NotImplementedError("rope scaling is not implemented in the reference")
    hidden = int(field(f"{arch}.embedding_length"))
    heads = int(field(f"{arch}.attention.head_count"))
    head_dim = int(field(f"{arch}.attention.key_length", hidden // heads))
    if int(field(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise NotImplementedError("partial rotary is not implemented in the reference")
    config = RefConfig(
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        num_layers=int(field(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        vocab_size=int(field(f"{arch}.vocab_size", int(embd.shape[-1]))),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
    )
    return config, arch


def _hf_name_from_gguf(gguf_name: str, config: RefConfig) -> tuple[str, int]:
    """HF name and, for Q/K tensors, the head count their rows are grouped by (else 0)."""
    stem, suffix = gguf_name.rsplit(".", 1)
    if stem in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[stem]}.{suffix}", 0
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _GGUF_LAYER:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not understood by the reference")
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(parts[2], 0)
    return f"model.layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}.{suffix}", heads
