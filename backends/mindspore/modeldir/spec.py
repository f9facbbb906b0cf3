"""What a model directory describes, as frozen data: ``ModelSpec`` (the language model, and ``vision`` for a
vision-language model). No reading here: the families' readers (``families/``: ``llama_config.py``,
``families/qwen2_vl/config.py``) fill these in."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.types import ModelDefaults


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything the network, tokenizer and engine need from a model directory."""

    yaml_path: Path
    model_dir: Path
    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # rows of the embedding
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    seq_length: int
    qkv_has_bias: bool
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    compute_dtype: str
    checkpoint: Path
    checkpoint_format: str  # "safetensors" | "ckpt"
    tokenizer: dict[str, Any]
    mode: int  # 0 = GRAPH_MODE, 1 = PYNATIVE_MODE
    device_target: str
    defaults: ModelDefaults
    config_vocab_size: int | None  # config.json vocab_size / padded_vocab_size (for top_k clamp)
    weight_dtype: str = "float32"  # model_config.weight_dtype: how the layers' matrices are stored (WEIGHT_DTYPES)
    vision: VLSpec | None = None  # a vision-language model's tower, processor and M-RoPE (its ``text`` is this spec)
    qk_norm: bool = False  # Qwen3: each q and k head RMS-normalised (q_norm / k_norm over head_dim) before RoPE
    moe: MoeSpec | None = None  # Qwen3-MoE: routed experts in the layers it names (the others keep a dense MLP)
    gemma3: Gemma3Spec | None = None  # Gemma 3's layer pattern and attention (families/gemma3.py), else None


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """Routed experts (Qwen3-MoE): a router ``mlp.gate`` [experts, hidden] per sparse layer; each token's softmax over
    the experts, its ``top_k`` most probable (renormalised to sum 1 when ``norm_topk_prob``), and the weighted sum of
    those experts' SwiGLU MLPs of width ``intermediate_size``."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]  # the layers with experts (HF: not mlp_only, (i + 1) % decoder_sparse_step == 0)


@dataclass(frozen=True, slots=True)
class Gemma3Spec:
    """What a Gemma 3 text model adds to the Llama-family fields: sliding-window (local) layers with their own rope
    base, global layers with rope_theta (and a linear rope scaling factor), the attention scale from
    query_pre_attn_scalar. The layers themselves differ too (families/gemma3/network.py): four (1 + weight) RMSNorms,
    GeGLU, the embedding scaled by sqrt(hidden_size)."""

    sliding_window: int  # a local layer's query attends to the last sliding_window positions (itself included)
    sliding_layers: tuple[bool, ...]  # per layer: True for a local (sliding-window) layer
    rope_local_theta: float
    rope_scaling_factor: float  # linear position scaling on the global layers; 1.0: none
    attn_scale: float  # query_pre_attn_scalar ** -0.5


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """The vision tower. ``family`` "qwen2_vl": LayerNorm blocks, fc1/fc2 MLP, full attention;
    "qwen2_5_vl": RMSNorm blocks, gated MLP, window attention but in ``full_attention_blocks``."""

    family: str
    depth: int
    width: int  # embed_dim (Qwen2-VL) / hidden_size (Qwen2.5-VL)
    num_heads: int
    mlp_hidden: int
    hidden_act: str
    out_dim: int  # the language model's hidden size
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    in_channels: int
    window_size: int  # pixels; 0 = no window attention
    full_attention_blocks: tuple[int, ...]
    tokens_per_second: float
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def window_units(self) -> int:
        """A window's side in merged units (Qwen2.5-VL: 112 px / 14 px / 2 = 4)."""
        return self.window_size // self.patch_size // self.merge_size if self.window_size else 0


@dataclass(frozen=True, slots=True)
class ProcessorSpec:
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    video_fps: float  # frames sampled per second of video
    video_min_frames: int
    video_max_frames: int
    video_frames: int | None = None  # a fixed frame count instead of fps (rounded to temporal_patch_size)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True, slots=True)
class VLSpec:
    family: str  # "qwen2_vl" | "qwen2_5_vl"
    text: ModelSpec
    vision: VisionSpec
    processor: ProcessorSpec
    mrope_section: tuple[int, int, int]
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    # float32 bytes the vision tower's largest call holds at once, for the memory budget (the family's reader
    # estimates it: families/qwen2_vl/config.py activation_bytes)
    tower_bytes: int = 0
