"""The one writer of the tiny random-weight checkpoints in the HF layout (NumPy + safetensors only): the byte-level
BPE tokenizer trained on a built-in corpus, the weights drawn from one seeded generator by a :class:`Layout` (what
every decoder layer holds, with each family's extras: q/k/v biases, q/k head norms, Gemma's four norms a layer,
routed experts), ``config.json``, ``tokenizer_config.json``, a MindFormers-style predict yaml and any extra files.

Each family's module (tiny_model.py for Llama and Qwen2, make_tiny_<family>.py) keeps only its shapes, its layout
and its architecture-specific fields. Same arguments, byte-identical files: tests/golden/*.json depend on them."""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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


def train_tokenizer(vocab_size: int, specials: tuple[str, ...] = SPECIAL_TOKENS, corpus: str = CORPUS) -> Tokenizer:
    """The byte-level BPE (digits split) trained on ``corpus`` to ``vocab_size``, ``specials`` first."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def tokenizer_config(ids: dict[str, int], model_max_length: int = 512) -> dict:
    """tokenizer_config.json of the ChatML tokenizer (``ids``: the special tokens' ids)."""
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "model_max_length": model_max_length,
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


def write_checkpoint(out_dir: str | Path, *, vocab_size: int, weights: Callable[[int], dict[str, np.ndarray]],
                     config: Callable[[int, dict[str, int]], dict],
                     tokenizer_config: Callable[[dict[str, int]], dict], yaml_name: str,
                     yaml: Callable[[int, dict[str, int]], str], tokenizer: Tokenizer | None = None,
                     specials: tuple[str, ...] = SPECIAL_TOKENS,
                     extra_json: Mapping[str, dict] | None = None) -> Path:
    """Write the model directory: ``tokenizer`` (default: the byte-level BPE trained to ``vocab_size``), then
    ``weights(vocab)``, ``config(vocab, ids)``, ``tokenizer_config(ids)``, ``extra_json`` (file name -> object)
    and ``yaml(vocab, ids)`` as ``yaml_name`` (``ids``: the ``specials``' ids). Returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or train_tokenizer(vocab_size)
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    vocab = tokenizer.get_vocab_size()
    ids = {tok: tokenizer.token_to_id(tok) for tok in specials}
    save_file(weights(vocab), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", config(vocab, ids))
    write_json(out / "tokenizer_config.json", tokenizer_config(ids))
    for name, obj in (extra_json or {}).items():
        write_json(out / name, obj)
    (out / yaml_name).write_text(yaml(vocab, ids), encoding="utf-8")
    return out


def config_tail(ids: dict[str, int]) -> dict:
    """The last keys of config.json: the special token ids and the dtype."""
    return {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD], "torch_dtype": "float32"}


def predict_yaml(arch: str, script: str, config_type: str, shape: dict, fields: str, ids: dict[str, int]) -> str:
    """The predict yaml: header, the shape's sizes, ``fields`` (the architecture's own lines of model_config, each
    indented by 4 and ending in a newline), the special token ids, the processor."""
    return f"""\
# A tiny random-weight {arch} (tests/support/{script}).
run_mode: predict
load_checkpoint: model.safetensors
load_ckpt_format: safetensors
context: {{mode: 0, device_target: CPU}}
model:
  arch: {{type: {arch}}}
  model_config:
    type: {config_type}
    seq_length: {shape["max_position_embeddings"]}
    hidden_size: {shape["hidden_size"]}
    num_layers: {shape["num_hidden_layers"]}
    num_heads: {shape["num_attention_heads"]}
    n_kv_heads: {shape["num_key_value_heads"]}
    head_dim: {shape["head_dim"]}
    intermediate_size: {shape["intermediate_size"]}
{fields}\
    bos_token_id: {ids[BOS]}
    eos_token_id: {ids[EOS]}
    pad_token_id: {ids[PAD]}
    compute_dtype: float32
processor:
  return_tensors: ms
  tokenizer: {{type: PreTrainedTokenizerFast, tokenizer_file: tokenizer.json}}
"""


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(doc: str, make: Callable[..., Path], default_seed: int) -> None:
    """``python -m tests.support.make_tiny_<arch> OUT_DIR [--seed N]``: ``make(OUT_DIR, seed=N)``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=default_seed)
    args = parser.parse_args()
    print(make(args.out_dir, seed=args.seed))


class Draws:
    """The float32 draws of the random weights from one seeded generator, in call order: ``normal`` (noise of
    ``std``) and ``norm`` (norm weights: ``center`` + noise of ``spread``; 1 for RMSNorm, 0 where the network
    applies ``1 + weight``)."""

    def __init__(self, seed: int, center: float = 1.0):
        self.rng = np.random.default_rng(seed)
        self.center = center

    def normal(self, *shape: int, std: float = 0.1) -> np.ndarray:
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def norm(self, n: int, spread: float = 0.1) -> np.ndarray:
        return (self.center + self.rng.standard_normal(n) * spread).astype(np.float32)


@dataclass(frozen=True)
class Experts:
    """Routed experts (Qwen3-MoE): a router [count, hidden] and ``count`` gated MLPs of ``width`` per sparse layer."""

    count: int
    width: int
    sparse_layers: tuple[int, ...]
    router_std: float = 0.3
    std: float = 0.25


@dataclass(frozen=True)
class Layout:
    """What a family's decoder holds and how its random weights are drawn, in the order drawn: the embedding; per
    layer the input norm, q/k/v (each with its bias right after it when ``bias_after_each``, else the three biases
    after v), the q/k head norms, o, the post-attention norm, ``ffn_norms``, the MLP (or the experts on their
    layers); the final norm; a separate head unless ``tied``. ``shape``: config.json's sizes."""

    shape: Mapping[str, int | float]
    std: float = 0.2  # the projections'
    embed_std: float = 0.1
    norm_center: float = 1.0  # 0 where the network applies 1 + weight (Gemma)
    qkv_bias: bool = False
    bias_after_each: bool = False
    qk_norm: bool = True
    ffn_norms: tuple[str, ...] = ()  # further norms after the post-attention one (Gemma's pre/post feedforward)
    experts: Experts | None = None
    tied: bool = True


def random_weights(vocab: int, seed: int, layout: Layout) -> dict[str, np.ndarray]:
    """The decoder's weights drawn from ``seed`` (:func:`decoder_weights`)."""
    return decoder_weights(vocab, Draws(seed, layout.norm_center), layout)


def decoder_weights(vocab: int, draws: Draws, layout: Layout) -> dict[str, np.ndarray]:
    """HF-named float32 tensors [out, in] from ``draws`` (a vision tower may draw on after them). Norm weights are
    center + noise (not constant) so a network that forgets one gives different logits; the q/k head norms have a
    wide spread, so the scores depend on them visibly."""
    d, inter = layout.shape["hidden_size"], layout.shape["intermediate_size"]
    w = {"model.embed_tokens.weight": draws.normal(vocab, d, std=layout.embed_std)}
    for i in range(layout.shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        _attention(w, p, draws, layout)
        w[p + "post_attention_layernorm.weight"] = draws.norm(d)
        for norm in layout.ffn_norms:
            w[p + norm + ".weight"] = draws.norm(d)
        if layout.experts and i in layout.experts.sparse_layers:
            _experts(w, p + "mlp.", draws, d, layout.experts)
        else:
            _mlp(w, p + "mlp.", draws, d, inter, layout.std)
    w["model.norm.weight"] = draws.norm(d)
    if not layout.tied:
        w["lm_head.weight"] = draws.normal(vocab, d, std=layout.embed_std)
    return w


def _attention(w: dict[str, np.ndarray], p: str, draws: Draws, layout: Layout) -> None:
    shape, std = layout.shape, layout.std
    d, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = shape.get("head_dim", d // heads)
    w[p + "input_layernorm.weight"] = draws.norm(d)
    widths = {"q": heads * hd, "k": kv * hd, "v": kv * hd}
    for name, out in widths.items():
        w[p + f"self_attn.{name}_proj.weight"] = draws.normal(out, d, std=std)
        if layout.qkv_bias and layout.bias_after_each:
            w[p + f"self_attn.{name}_proj.bias"] = draws.normal(out, std=0.5)
    if layout.qkv_bias and not layout.bias_after_each:
        for name, out in widths.items():
            w[p + f"self_attn.{name}_proj.bias"] = draws.normal(out, std=0.5)
    if layout.qk_norm:
        w[p + "self_attn.q_norm.weight"] = draws.norm(hd, 0.5)
        w[p + "self_attn.k_norm.weight"] = draws.norm(hd, 0.5)
    w[p + "self_attn.o_proj.weight"] = draws.normal(d, heads * hd, std=std)


def _mlp(w: dict[str, np.ndarray], p: str, draws: Draws, d: int, inter: int, std: float) -> None:
    w[p + "gate_proj.weight"] = draws.normal(inter, d, std=std)
    w[p + "up_proj.weight"] = draws.normal(inter, d, std=std)
    w[p + "down_proj.weight"] = draws.normal(d, inter, std=std)


def _experts(w: dict[str, np.ndarray], p: str, draws: Draws, d: int, experts: Experts) -> None:
    """The router of spread-out logits (each token's top experts clear winners, differing between tokens), then
    each expert's gated MLP."""
    w[p + "gate.weight"] = draws.normal(experts.count, d, std=experts.router_std)
    for e in range(experts.count):
        _mlp(w, f"{p}experts.{e}.", draws, d, experts.width, experts.std)
