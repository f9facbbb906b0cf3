"""Tiny random-weight Qwen2-VL and Qwen2.5-VL checkpoints in the HF layout, for tests (NumPy + safetensors only).

A directory holds what a real Qwen2-VL download holds, shrunk: ``config.json`` (text fields flat, as the
released checkpoints have them, plus ``vision_config`` and ``rope_scaling`` with an ``mrope_section``),
``model.safetensors`` with the released parameter names (``model.layers.*``, ``visual.*``, ``lm_head``),
a byte-level BPE ``tokenizer.json`` whose first ids are the Qwen specials (``<|vision_start|>``,
``<|image_pad|>``, ``<|video_pad|>`` ...), ``tokenizer_config.json`` and ``chat_template.json`` with a
Qwen2-VL-style chat template, ``preprocessor_config.json`` (small min/max pixels) and a MindFormers-style
predict yaml. Same arguments, byte-identical files.

    python -m tests.support.make_tiny_qwen2_vl OUT_DIR [--arch qwen2_vl|qwen2_5_vl] [--seed N]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from tests.support.tiny_checkpoint import CORPUS, Draws, Layout, decoder_weights, train_tokenizer, write_checkpoint

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")  # ids 0..7
PAD, EOS = "<|endoftext|>", "<|im_end|>"
ARCHS = {"qwen2_vl": ("Qwen2VLForConditionalGeneration", "qwen2_vl"),
         "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl")}
DEFAULT_SEED = {"qwen2_vl": 20, "qwen2_5_vl": 25}
VISION_CORPUS = "Describe the picture. What is in this image? Compare the two images. What happens in the video?\n"

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1024,
}
MROPE_SECTION = [2, 3, 3]  # sums to head_dim / 2 = 8
PATCH = {"patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3, "in_chans": 3}
VISION = {
    # Qwen2-VL: LayerNorm blocks, QuickGELU MLP (mlp_ratio), full attention, LayerNorm merger.
    "qwen2_vl": {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2, "hidden_act": "quick_gelu",
                 "hidden_size": TEXT["hidden_size"], **PATCH},
    # Qwen2.5-VL: RMSNorm blocks, gated SiLU MLP, window attention except the fullatt_block_indexes layers.
    "qwen2_5_vl": {"depth": 4, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "hidden_act": "silu",
                   "out_hidden_size": TEXT["hidden_size"], "window_size": 112, "fullatt_block_indexes": [1, 3],
                   "tokens_per_second": 2, **PATCH},
}
# Small pixel bounds so test images stay a few hundred patches (the released default is 3136..1003520).
MIN_PIXELS, MAX_PIXELS = 56 * 56, 56 * 56 * 16
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]  # OpenAI CLIP, as the released preprocessor_config.json
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]

# The Qwen2-VL chat template's behaviour: a default system turn, string or part-list content, one
# vision_start/pad/vision_end triple per image or video part (the processor expands each pad).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_qwen2_vl(out_dir: str | Path, *, arch: str = "qwen2_vl", seed: int | None = None) -> Path:
    """Write a complete tiny model directory for ``arch`` and return its path."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    seed = DEFAULT_SEED[arch] if seed is None else seed
    tie = False  # tied tiny heads (as the 2B ships) make greedy repeat its input token; the loader handles both
    return write_checkpoint(
        out_dir, vocab_size=448, tokenizer=train_tokenizer(448, SPECIAL_TOKENS, CORPUS + VISION_CORPUS),
        specials=SPECIAL_TOKENS, weights=lambda vocab: random_weights(arch, vocab, seed, tie),
        config=lambda vocab, ids: hf_config(arch, vocab, tie, ids),
        tokenizer_config=lambda ids: _tokenizer_config(ids, arch),
        extra_json={"chat_template.json": {"chat_template": CHAT_TEMPLATE},
                    "preprocessor_config.json": _preprocessor_config(arch)},
        yaml_name=f"predict_tiny_{arch}.yaml", yaml=lambda vocab, ids: predict_yaml(arch, vocab, tie, ids))


def random_weights(arch: str, vocab: int, seed: int, tie: bool) -> dict[str, np.ndarray]:
    """The text decoder (Qwen2's: q/k/v biases, each drawn after its projection), then the vision tower, from one
    seeded generator."""
    draws = Draws(seed)
    w = decoder_weights(vocab, draws, Layout(TEXT, std=0.1, qkv_bias=True, bias_after_each=True, qk_norm=False,
                                             tied=tie))
    w.update(_vision_weights(draws, arch))
    return w


def _vision_weights(r: Draws, arch: str) -> dict[str, np.ndarray]:
    v = VISION[arch]
    width = v["embed_dim"] if arch == "qwen2_vl" else v["hidden_size"]
    out_dim = v["hidden_size"] if arch == "qwen2_vl" else v["out_hidden_size"]
    merged = width * v["spatial_merge_size"] ** 2
    w = {"visual.patch_embed.proj.weight": r.normal(width, 3, v["temporal_patch_size"], v["patch_size"],
                                                    v["patch_size"], std=0.03)}
    for i in range(v["depth"]):
        p = f"visual.blocks.{i}."
        for norm in ("norm1", "norm2"):
            w[p + f"{norm}.weight"] = r.norm(width)
            if arch == "qwen2_vl":
                w[p + f"{norm}.bias"] = r.normal(width)
        w[p + "attn.qkv.weight"] = r.normal(3 * width, width, std=0.2)
        w[p + "attn.qkv.bias"] = r.normal(3 * width)
        w[p + "attn.proj.weight"] = r.normal(width, width, std=0.2)
        w[p + "attn.proj.bias"] = r.normal(width)
        if arch == "qwen2_vl":
            hidden = width * v["mlp_ratio"]
            w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"] = r.normal(hidden, width, std=0.2), r.normal(hidden)
            w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"] = r.normal(width, hidden, std=0.2), r.normal(width)
        else:
            hidden = v["intermediate_size"]
            for name, shape in (("gate_proj", (hidden, width)), ("up_proj", (hidden, width)),
                                ("down_proj", (width, hidden))):
                w[p + f"mlp.{name}.weight"], w[p + f"mlp.{name}.bias"] = r.normal(*shape, std=0.2), r.normal(shape[0])
    w["visual.merger.ln_q.weight"] = r.norm(width)
    if arch == "qwen2_vl":
        w["visual.merger.ln_q.bias"] = r.normal(width)
    w["visual.merger.mlp.0.weight"], w["visual.merger.mlp.0.bias"] = r.normal(merged, merged), r.normal(merged)
    w["visual.merger.mlp.2.weight"], w["visual.merger.mlp.2.bias"] = r.normal(out_dim, merged), r.normal(out_dim)
    return w


def hf_config(arch: str, vocab: int, tie: bool, ids: dict[str, int]) -> dict:
    architecture, model_type = ARCHS[arch]
    return {
        "architectures": [architecture],
        "model_type": model_type,
        **TEXT,
        "vocab_size": vocab,
        "hidden_act": "silu",
        "tie_word_embeddings": tie,
        "bos_token_id": ids[PAD],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "rope_scaling": {"type": "mrope", "mrope_section": MROPE_SECTION},
        "use_sliding_window": False,
        "sliding_window": TEXT["max_position_embeddings"],
        "max_window_layers": TEXT["num_hidden_layers"],
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
        "vision_config": dict(VISION[arch]),
    }


def _tokenizer_config(ids: dict[str, int], arch: str) -> dict:
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "model_max_length": TEXT["max_position_embeddings"],
        "tokenizer_class": "Qwen2TokenizerFast",
        "processor_class": "Qwen2VLProcessor" if arch == "qwen2_vl" else "Qwen2_5_VLProcessor",
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(ids[tok]): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True}
            for tok in SPECIAL_TOKENS
        },
    }


def _preprocessor_config(arch: str) -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor" if arch == "qwen2_vl" else "Qwen2_5_VLProcessor",
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "patch_size": PATCH["patch_size"],
        "temporal_patch_size": PATCH["temporal_patch_size"],
        "merge_size": PATCH["spatial_merge_size"],
        "image_mean": IMAGE_MEAN,
        "image_std": IMAGE_STD,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
    }


def predict_yaml(arch: str, vocab: int, tie: bool, ids: dict[str, int]) -> str:
    architecture, _ = ARCHS[arch]
    v = VISION[arch]
    lines = [f"    {k}: {json.dumps(val)}" for k, val in v.items() if k != "in_chans"]
    vision = "\n".join(lines)
    return f"""\
# A tiny random-weight {architecture} (tests/support/make_tiny_qwen2_vl.py), shaped like
# configs/models/predict_{arch}_*.yaml.
run_mode: predict
load_checkpoint: model.safetensors
load_ckpt_format: safetensors
context: {{mode: 0, device_target: CPU}}
model:
  arch: {{type: {architecture}}}
  model_config:
    type: {"Qwen2VLConfig" if arch == "qwen2_vl" else "Qwen2_5_VLConfig"}
    seq_length: {TEXT["max_position_embeddings"]}
    hidden_size: {TEXT["hidden_size"]}
    num_layers: {TEXT["num_hidden_layers"]}
    num_heads: {TEXT["num_attention_heads"]}
    n_kv_heads: {TEXT["num_key_value_heads"]}
    intermediate_size: {TEXT["intermediate_size"]}
    vocab_size: {vocab}
    rms_norm_eps: 1.0e-6
    theta: {TEXT["rope_theta"]}
    max_position_embedding: {TEXT["max_position_embeddings"]}
    qkv_has_bias: true
    tie_word_embeddings: {"true" if tie else "false"}
    eos_token_id: {ids[EOS]}
    pad_token_id: {ids[PAD]}
    compute_dtype: float32
    mrope_section: {json.dumps(MROPE_SECTION)}
    image_token_id: {ids["<|image_pad|>"]}
    video_token_id: {ids["<|video_pad|>"]}
    vision_start_token_id: {ids["<|vision_start|>"]}
  vision_config:
{vision}
processor:
  return_tensors: ms
  tokenizer: {{type: PreTrainedTokenizerFast, tokenizer_file: tokenizer.json}}
  image_processor:
    min_pixels: {MIN_PIXELS}
    max_pixels: {MAX_PIXELS}
    image_mean: {json.dumps(IMAGE_MEAN)}
    image_std: {json.dumps(IMAGE_STD)}
  video:
    fps: 2.0
    min_frames: 4
    max_frames: 768
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", choices=sorted(ARCHS), default="qwen2_vl")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    print(make_tiny_qwen2_vl(args.out_dir, arch=args.arch, seed=args.seed))


if __name__ == "__main__":
    main()
