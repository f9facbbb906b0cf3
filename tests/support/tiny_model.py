"""Tiny random Llama/Qwen2 model directories for tests: HF-named float32 safetensors, config.json,
a byte-level BPE tokenizer trained on a built-in corpus, tokenizer_config.json and a predict yaml.

Weights are honest seeded randoms (nothing is biased against EOS); under them `<|im_end|>` is just one of
~384 tokens, so greedy runs usually go the full length. Same arguments → byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 (as in SmolLM2)
BOS, EOS, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
}
_ARCH = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}

CORPUS = """\
The small model reads a line of text and guesses the next word. It is not clever, but it is quick.
Tests need a model that is cheap to build, easy to check, and always the same from one run to the next.
A tokenizer splits text into pieces. Common pieces such as "the", "ing" and "tion" get their own ids,
while rare words fall back to single bytes, so every string can be encoded and decoded again.
Numbers like 12, 345 and 2024 are split into digits. Punctuation, tabs\tand new lines are kept.
Hello! How are you today? I am fine, thank you. What is the capital of France? Paris is the capital.
Once upon a time there was a little robot who wanted to learn how to write poems about the sea.
Every morning it counted the waves: one, two, three, four, five, six, seven, eight, nine, ten.
The server streams tokens to the client as soon as they are ready, and stops at the end of a turn.
Please write a short story about a cat, a dog and a bird who share a house near the river.
Unicode is welcome too: café, naïve, 東京, and a smile 🙂 are all bytes in the end.
"""


def make_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    arch: str = "llama",
    tie: bool | None = None,
    vocab: int | None = None,
) -> Path:
    """Write a complete tiny model directory and return its path.

    arch "llama": no biases, tied head by default. arch "qwen2": q/k/v biases, separate lm_head by default.
    vocab: target tokenizer vocab size (default 384, specials included); config vocab_size is the
    trained tokenizer's actual size.
    """
    if arch not in _ARCH:
        raise ValueError(f"arch must be one of {sorted(_ARCH)}, got {arch!r}")
    tie = (arch == "llama") if tie is None else tie
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(vocab or 384)
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    vocab_size = tokenizer.get_vocab_size()
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}

    weights = random_weights(vocab_size, seed=seed, qkv_bias=arch == "qwen2", tie=tie)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", _config(arch, vocab_size, tie, ids))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(ids))
    (out / "predict_tiny.yaml").write_text(_predict_yaml(vocab_size, arch == "qwen2", tie, ids), encoding="utf-8")
    return out


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def random_weights(vocab_size: int, *, seed: int, qkv_bias: bool, tie: bool) -> dict[str, np.ndarray]:
    """HF-named float32 tensors [out, in]. Norm weights are 1 + noise (not all ones) so a network that
    forgets a norm weight gives different logits."""
    rng = np.random.default_rng(seed)
    hidden, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    q_out = SHAPE["num_attention_heads"] * SHAPE["head_dim"]
    kv_out = SHAPE["num_key_value_heads"] * SHAPE["head_dim"]

    def normal(*shape: int, std: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + rng.standard_normal(hidden) * 0.1).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(vocab_size, hidden)}
    for layer in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = normal(q_out, hidden)
        w[p + "self_attn.k_proj.weight"] = normal(kv_out, hidden)
        w[p + "self_attn.v_proj.weight"] = normal(kv_out, hidden)
        if qkv_bias:
            w[p + "self_attn.q_proj.bias"] = normal(q_out, std=0.5)
            w[p + "self_attn.k_proj.bias"] = normal(kv_out, std=0.5)
            w[p + "self_attn.v_proj.bias"] = normal(kv_out, std=0.5)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, q_out)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.down_proj.weight"] = normal(hidden, inter)
    w["model.norm.weight"] = norm()
    if not tie:
        w["lm_head.weight"] = normal(vocab_size, hidden)
    return w


def _config(arch: str, vocab_size: int, tie: bool, ids: dict[str, int]) -> dict:
    architecture, model_type = _ARCH[arch]
    return {
        "architectures": [architecture],
        "model_type": model_type,
        **SHAPE,
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        # Qwen2 semantics: bias on q/k/v only (o_proj never has one here).
        "attention_bias": arch == "qwen2",
        "tie_word_embeddings": tie,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "torch_dtype": "float32",
    }


def _tokenizer_config(ids: dict[str, int]) -> dict:
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "model_max_length": SHAPE["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(ids[tok]): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for tok in SPECIAL_TOKENS
        },
    }


def _predict_yaml(vocab_size: int, qkv_bias: bool, tie: bool, ids: dict[str, int]) -> str:
    def b(flag: bool) -> str:
        return "true" if flag else "false"

    return f"""\
run_mode: predict
load_checkpoint: model.safetensors
load_ckpt_format: safetensors
context: {{mode: 0, device_target: CPU}}
model:
  arch: {{type: LlamaForCausalLM}}
  model_config:
    type: LlamaConfig
    seq_length: {SHAPE["max_position_embeddings"]}
    hidden_size: {SHAPE["hidden_size"]}
    num_layers: {SHAPE["num_hidden_layers"]}
    num_heads: {SHAPE["num_attention_heads"]}
    n_kv_heads: {SHAPE["num_key_value_heads"]}
    intermediate_size: {SHAPE["intermediate_size"]}
    vocab_size: {vocab_size}
    rms_norm_eps: 1.0e-6
    theta: 10000.0
    max_position_embedding: {SHAPE["max_position_embeddings"]}
    qkv_has_bias: {b(qkv_bias)}
    tie_word_embeddings: {b(tie)}
    bos_token_id: {ids[BOS]}
    eos_token_id: {ids[EOS]}
    pad_token_id: {ids[PAD]}
    compute_dtype: float32
    param_init_type: float32
    use_past: true
processor:
  return_tensors: ms
  tokenizer: {{type: PreTrainedTokenizerFast, tokenizer_file: tokenizer.json}}
"""


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def quantized_copy(src: str | Path, out_dir: str | Path, fmt: str, formats: dict[str, str] | None = None) -> Path:
    """A copy of the model directory `src` with every matrix (the projections, the embedding, the head) stored
    as GGUF `fmt` blocks, the way ``convert-gguf --dtype`` writes them: uint8 [rows, row bytes], the safetensors
    metadata ``mindserve.quantization`` naming each, and the predict yaml's ``weight_dtype``. The
    32-block formats are quantized by the `gguf` package, the K-quants (which it cannot write) by
    ``quant.quantize``. ``formats`` maps a name suffix (``self_attn.v_proj.weight``) to another format for the
    matrices ending so (a mix like llama-quantize's Q4_K_M: the yaml then says ``mixed``). Returns out_dir."""
    import shutil

    from safetensors.numpy import load_file

    from backends.mindspore.modeldir.quant import layers_format, quantize

    formats = formats or {}
    src, out = Path(src), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    tensors, names = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if w.ndim == 2:
            f = next((v for k, v in formats.items() if name.endswith(k)), fmt)
            tensors[name] = np.ascontiguousarray(quantize(w, f).blocks)
            names[name] = f
        else:
            tensors[name] = w
    save_file(tensors, str(out / "model.safetensors"),
              metadata={"format": "pt", "mindserve.quantization": json.dumps(names, sort_keys=True)})
    dtype = layers_format(names)
    for y in out.glob("*.yaml"):
        y.write_text(y.read_text().replace("  model_config:\n", f"  model_config:\n    weight_dtype: {dtype}\n", 1))
    return out
