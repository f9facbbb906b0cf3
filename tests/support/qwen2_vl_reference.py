"""A reference driver for tests/backends/mindspore/qwen2_vl/test_qwen2_vl.py, beside the engine (which serves with
``qwen2_vl/encoder.py`` and the runners).

Qwen2-VL end to end on the paged KV cache: weights (HF safetensors layout) -> the vision tower and the
language model cells; a prompt with its media -> expanded ids, M-RoPE positions and media rows (the vision
tower runs once per image or video) -> prefill in fixed-size chunks through the cache (a media item may
span chunks: each chunk carries its own rows) -> decode steps at ``cache index + delta``.

Graphs: the vision tower once per patch-count bucket, the language model once per (rows, tokens, window).
``kernels``: "stock" (stock ops, windowed attention under a mask, as ``SplitRunner``) or "aot" (the AOT
kernels' paged attention and fused ops, as ``PackedRunner``).
``Qwen2VL`` drives one or several sequences on explicit block lists (block 0 is the scratch block, as in
``kv_cache``); the engine's scheduler is not involved here.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import mindspore as ms

from backends.chat_template import render_chat_template
from backends.mindspore.runners.step import block_table, token_slots
from backends.mindspore.planning.device import set_device
from backends.mindspore.runners.packed import packed_inputs
from backends.mindspore.families.qwen2_vl.config import VISION_BUCKETS, load_vl_spec, processor_chat_template
from backends.mindspore.families.qwen2_vl.positions import (WindowLayout, frame_ids, rope_index, segment_mask,
                                                            vision_cos_sin, window_ids, window_layout)
from backends.mindspore.families.qwen2_vl.preprocess import MediaError, Patches, expand_media_tokens
from backends.mindspore.families.qwen2_vl.text import AotQwen2VLText, StockQwen2VLText
from backends.mindspore.families.qwen2_vl.vision import VisionTower
from backends.mindspore.families.qwen2_vl.weights import load_vl_weights
from backends.mindspore.runners import _aot_ops  # the text models' AOT kernel build (and its fit check)
from backends.mindspore.runners.split import window_inputs
from backends.mindspore.modeldir.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt ready for prefill: expanded ids, their M-RoPE positions and the media rows."""

    ids: np.ndarray  # [L] int32
    positions: np.ndarray  # [3, L] int32
    delta: int  # decode position = cache index + delta
    media: np.ndarray  # [L, D] float32: the vision tower's rows at the placeholder tokens, zeros elsewhere
    media_mask: np.ndarray  # [L] float32: 1 at the placeholder tokens

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(slots=True)
class VLSequence:
    """One sequence's cache state: its prompt, its blocks, the tokens after the prompt."""

    prompt: Prompt
    blocks: list[int]
    generated: list[int] = field(default_factory=list)
    prefilled: int = 0


class Qwen2VL:
    """The model on a KV cache of ``num_blocks`` x ``block_size`` slots; prefill chunks of ``prefill_chunk``
    tokens, attention windows of ``window`` tokens."""

    def __init__(self, model_dir: str | Path, *, num_blocks: int = 64, block_size: int = 16,
                 prefill_chunk: int = 64, window: int = 256,
                 vision_buckets: Sequence[int] = VISION_BUCKETS, threads: int | None = None,
                 kernels: str = "stock") -> None:
        if kernels not in ("stock", "aot"):
            raise ValueError(f"kernels must be 'stock' or 'aot', got {kernels!r}")
        if window % block_size or window > (num_blocks - 1) * block_size:
            raise ValueError(f"window {window} must be a multiple of block_size {block_size} within the cache "
                             f"({num_blocks - 1} usable blocks)")
        self.spec = spec = load_vl_spec(model_dir)
        self.device = set_device(spec.text, threads)  # the yaml's context (mode, device_target)
        weights = load_vl_weights(spec)
        self.tokenizer = Tokenizer.from_model_dir(spec.text.model_dir, spec.text.tokenizer)
        self.chat_template = self.tokenizer.chat_template or processor_chat_template(spec.text.model_dir)
        self.block_size, self.num_slots = block_size, num_blocks * block_size
        self.prefill_chunk, self.window = prefill_chunk, window
        merge2 = spec.vision.merge_size ** 2
        self.vision_buckets = tuple(sorted(b for b in vision_buckets if b % merge2 == 0))
        self.max_positions = spec.text.max_position_embeddings
        self.vision = VisionTower(spec.vision, weights)
        self.aot = _aot_ops(spec.text) if kernels == "aot" else None
        if kernels == "aot" and self.aot is None:
            raise RuntimeError("kernels 'aot' asked for, but the AOT kernels could not be built (see the log)")
        model = replace(spec.text, vision=spec)  # the networks take the model's spec (its vision part set)
        self.text = (AotQwen2VLText(model, weights, num_blocks, block_size, self.max_positions, self.aot)
                     if self.aot is not None else StockQwen2VLText(model, weights, num_blocks, block_size,
                                                                   self.max_positions))
        self.vision.set_train(False)
        self.text.set_train(False)
        head = weights["model.embed_tokens.weight"] if spec.text.tie_word_embeddings else weights["lm_head.weight"]
        self._head = np.ascontiguousarray(head.T)  # prompt logits from hidden rows, host side
        self.first_call_seconds: dict[tuple, float] = {}

    # --- prompt ---

    def chat(self, messages: Sequence[dict]) -> str:
        """The chat template's prompt text (one vision_start/pad/vision_end per image or video part)."""
        return render_chat_template(self.chat_template, messages, add_generation_prompt=True)

    def prompt(self, text: str, media: Sequence[Patches] = ()) -> Prompt:
        """Tokenise ``text``, expand its placeholders for ``media`` (in order), run the vision tower on each
        item and place its rows at the item's tokens."""
        s = self.spec
        merge = s.vision.merge_size
        ids = expand_media_tokens(self.tokenizer.encode(text), media, s.image_token_id, s.video_token_id, merge)
        positions, delta = rope_index(ids, media, s.image_token_id, s.video_token_id, merge,
                                      s.vision.tokens_per_second, timed_video=s.family == "qwen2_5_vl")
        if len(ids) and positions.max() >= self.max_positions:
            raise MediaError(f"M-RoPE position {int(positions.max())} exceeds the model's "
                             f"max_position_embedding {self.max_positions}")
        rows = np.zeros((len(ids), s.text.hidden_size), np.float32)
        mask = np.zeros(len(ids), np.float32)
        ids_arr = np.asarray(ids, np.int32)
        for kind, token in (("image", s.image_token_id), ("video", s.video_token_id)):
            items = [p for p in media if p.kind == kind]
            where = np.flatnonzero(ids_arr == token)
            if items:
                rows[where] = np.concatenate([self.encode_media(p) for p in items])
                mask[where] = 1.0
        return Prompt(ids_arr, positions.astype(np.int32), delta, rows, mask)

    def encode_media(self, item: Patches) -> np.ndarray:
        """The vision tower's rows [tokens, D] for one image or video (padded to a compiled bucket)."""
        v = self.spec.vision
        n = len(item.pixel_values)
        bucket = next((b for b in self.vision_buckets if b >= n), None)
        if bucket is None:
            raise MediaError(f"the {item.kind} has {n} patches, more than the largest vision bucket "
                             f"{self.vision_buckets[-1]}; lower max_pixels")
        patches = np.zeros((bucket, v.patch_dim), np.float32)
        patches[:n] = item.pixel_values
        cos = np.zeros((bucket, v.head_dim), np.float32)
        sin = np.zeros((bucket, v.head_dim), np.float32)
        cos[:n], sin[:n] = vision_cos_sin(item.grid, v.merge_size, v.head_dim, v.rope_theta)
        full = segment_mask(frame_ids(item.grid), bucket)
        layout = self.window_layout(item, bucket)
        started = time.perf_counter()
        out = self.vision(*(ms.Tensor(a) for a in (patches, cos, sin, full, layout.index, layout.inverse,
                                                     layout.key_mask))).asnumpy()
        self._timed(("vision", bucket, layout.key_mask.shape[0], layout.key_mask.shape[3]), started)
        return out[: item.tokens(v.merge_size)]

    def window_layout(self, item: Patches, bucket: int) -> WindowLayout:
        """Qwen2.5-VL's windows of ``item`` (a power-of-two window count, so few graphs); a one-slot
        placeholder for a tower without window blocks."""
        v = self.spec.vision
        if not v.window_size:
            return window_layout(np.zeros(1, np.int64), bucket, 1, 1)
        segments = window_ids(item.grid, v.merge_size, v.window_units)
        windows = 1 << int(segments.max()).bit_length()  # the next power of two above the largest id
        return window_layout(segments, bucket, (v.window_units * v.merge_size) ** 2, windows)

    # --- cache ---

    def blocks_for(self, tokens: int, first: int = 1) -> list[int]:
        """Consecutive blocks from ``first`` for ``tokens`` cache slots (block 0 is the scratch block)."""
        n = -(-tokens // self.block_size)
        if first + n > self.num_slots // self.block_size:
            raise ValueError(f"{tokens} tokens from block {first} do not fit the cache")
        return list(range(first, first + n))

    def prefill(self, seqs: Sequence[VLSequence]) -> tuple[np.ndarray, list[np.ndarray]]:
        """The next chunk (up to ``prefill_chunk`` tokens) of each sequence's prompt, one row each, in one
        call: (logits of each row's last token [n, V], each row's final-normed hidden rows)."""
        size, n, d = self.prefill_chunk, len(seqs), self.spec.text.hidden_size
        ids, pos = np.zeros((n, size), np.int32), np.zeros((n, size), np.int32)
        slots = np.zeros((n, size), np.int32)
        media, media_mask = np.zeros((n, size, d), np.float32), np.zeros((n, size, 1), np.float32)
        mpos = np.zeros((3, n, size), np.int32)
        last_rows, lengths = np.arange(n, dtype=np.int32) * size, []
        for i, seq in enumerate(seqs):
            a = seq.prefilled
            b = min(a + size, len(seq.prompt))
            t = b - a
            if t <= 0:
                raise ValueError(f"sequence {i} has no prompt left to prefill")
            ids[i, :t], pos[i, :t] = seq.prompt.ids[a:b], np.arange(a, b)
            slots[i, :t] = token_slots(seq.blocks, pos[i, :t], self.block_size)
            media[i, :t], media_mask[i, :t, 0] = seq.prompt.media[a:b], seq.prompt.media_mask[a:b]
            mpos[:, i, :t] = seq.prompt.positions[:, a:b]
            last_rows[i] += t - 1
            lengths.append(t)
        logits, hidden = self._forward(("prefill", n, size), ids, media, media_mask, mpos, pos, slots,
                                       [s.blocks for s in seqs], last_rows)
        for seq, t in zip(seqs, lengths):
            seq.prefilled += t
        return logits, [hidden[i * size: i * size + t] for i, t in enumerate(lengths)]

    def decode(self, seqs: Sequence[VLSequence]) -> np.ndarray:
        """One step for each sequence (its last generated token): logits [n, V]."""
        n, d = len(seqs), self.spec.text.hidden_size
        ids = np.array([[s.generated[-1]] for s in seqs], np.int32)
        pos = np.array([[len(s.prompt) + len(s.generated) - 1] for s in seqs], np.int32)
        mpos = np.broadcast_to(pos + np.array([[s.prompt.delta] for s in seqs], np.int32), (3, n, 1)).copy()
        slots = np.array([token_slots(s.blocks, p, self.block_size) for s, p in zip(seqs, pos)], np.int32)
        no_media = np.zeros((n, 1, d), np.float32), np.zeros((n, 1, 1), np.float32)
        logits, _ = self._forward(("decode", n), ids, *no_media, mpos, pos, slots, [s.blocks for s in seqs],
                                  np.arange(n, dtype=np.int32))
        return logits

    def prompt_logits(self, hidden: np.ndarray) -> np.ndarray:
        """Logits [t, V] of final-normed hidden rows (the head as a host matmul)."""
        return hidden @ self._head

    def _forward(self, key: tuple, ids, media, media_mask, mpos, pos, slots, blocks, last_rows):
        spec = self.spec.text
        table = block_table(blocks, self.window // self.block_size)
        if self.aot is not None:  # the paged attention kernel: the table and each token's table row
            ids, pos, write, index, aux, last_rows = packed_inputs(ids, pos, slots.reshape(-1), table, last_rows,
                                                                   spec.num_kv_heads, self.num_slots)
        else:  # stock ops: each row's window of cache rows under a causal mask over cache indices
            ids, pos, write, index, aux, last_rows = window_inputs(ids, pos, slots.reshape(-1), table, last_rows,
                                                                   self.block_size, spec.num_kv_heads, self.num_slots)
        started = time.perf_counter()
        logits, hidden = self.text(*(ms.Tensor(a) for a in (ids, media, media_mask, mpos, pos, write, index, aux,
                                                              last_rows)))
        out = logits.asnumpy(), hidden.asnumpy()
        self._timed((*key, self.window), started)
        return out

    def _timed(self, key: tuple, started: float) -> None:
        self.first_call_seconds.setdefault(key, time.perf_counter() - started)

    # --- generation ---

    def greedy(self, prompt: Prompt, new_tokens: int,
               first_block: int = 1) -> tuple[list[int], list[np.ndarray], np.ndarray]:
        """Greedy ids (EOS not special), the logits of every step (step 0: the prompt's last token) and the
        prompt's final-normed hidden rows."""
        if len(prompt) + new_tokens > self.window:
            raise ValueError(f"{len(prompt)} prompt + {new_tokens} new tokens exceed the window {self.window}")
        seq = VLSequence(prompt, self.blocks_for(len(prompt) + new_tokens, first_block))
        hidden_rows, steps = [], []
        while seq.prefilled < len(prompt):
            logits, hidden = self.prefill([seq])
            hidden_rows.append(hidden[0])
        steps.append(logits[0])
        seq.generated.append(int(np.argmax(logits[0])))
        while len(seq.generated) < new_tokens:
            steps.append(self.decode([seq])[0])
            seq.generated.append(int(np.argmax(steps[-1])))
        return seq.generated, steps, np.concatenate(hidden_rows)
