"""What the tiny random-weight HF checkpoints of make_tiny_qwen3.py, make_tiny_qwen3_moe.py and make_tiny_gemma3.py
write alike: the model directory (tokenizer.json, model.safetensors, config.json, tokenizer_config.json, a
MindFormers-style predict yaml, in that order), the token ids closing config.json, the predict yaml's frame and
the scripts' command line. Each script keeps its shapes, weights and architecture-specific fields."""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tests.support.tiny_model import BOS, EOS, PAD, SPECIAL_TOKENS, train_tokenizer


def write_checkpoint(out_dir: str | Path, *, vocab_size: int, weights: Callable[[int], dict[str, np.ndarray]],
                     config: Callable[[int, dict[str, int]], dict],
                     tokenizer_config: Callable[[dict[str, int]], dict], yaml_name: str,
                     yaml: Callable[[int, dict[str, int]], str]) -> Path:
    """Write the model directory: the byte-level BPE tokenizer trained to ``vocab_size``, then ``weights(vocab)``,
    ``config(vocab, ids)``, ``tokenizer_config(ids)`` and ``yaml(vocab, ids)`` as ``yaml_name`` (``ids``: the
    special tokens' ids). Returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size)
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    vocab = tokenizer.get_vocab_size()
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    save_file(weights(vocab), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", config(vocab, ids))
    write_json(out / "tokenizer_config.json", tokenizer_config(ids))
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


def attention_weights(w: dict[str, np.ndarray], prefix: str, draws: Draws, shape: dict) -> None:
    """Layer ``prefix``'s input norm and attention (q/k/v, the q/k head norms of a wide spread, so the scores depend
    on them visibly, o) into ``w``, HF-named [out, in]."""
    d, heads, kv, hd = (shape[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    w[prefix + "input_layernorm.weight"] = draws.norm(d)
    w[prefix + "self_attn.q_proj.weight"] = draws.normal(heads * hd, d, std=0.2)
    w[prefix + "self_attn.k_proj.weight"] = draws.normal(kv * hd, d, std=0.2)
    w[prefix + "self_attn.v_proj.weight"] = draws.normal(kv * hd, d, std=0.2)
    w[prefix + "self_attn.q_norm.weight"] = draws.norm(hd, 0.5)
    w[prefix + "self_attn.k_norm.weight"] = draws.norm(hd, 0.5)
    w[prefix + "self_attn.o_proj.weight"] = draws.normal(d, heads * hd, std=0.2)


def mlp_weights(w: dict[str, np.ndarray], prefix: str, draws: Draws, d: int, inter: int) -> None:
    """A dense gated MLP (gate/up/down of ``inter``) under ``prefix`` into ``w``."""
    w[prefix + "gate_proj.weight"] = draws.normal(inter, d, std=0.2)
    w[prefix + "up_proj.weight"] = draws.normal(inter, d, std=0.2)
    w[prefix + "down_proj.weight"] = draws.normal(d, inter, std=0.2)
