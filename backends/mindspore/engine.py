"""The MindSpore engine: load a model directory, then loop schedule -> forward -> sample -> stop -> update."""
from __future__ import annotations

import functools
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import numpy as np

from backends.base import Listener, RequestHandle
from backends.chat_template import render_chat_template
from backends.errors import EngineOverloaded, EngineUnavailable, GenerationFailed, InputRejected
from backends.mindspore.config import ModelSpec, load_model_spec
from backends.mindspore.kv_cache import BlockAllocator
from backends.mindspore.model import set_mode
from backends.mindspore.runner import DecodeRow, ModelRunner, PrefillChunk, Shapes
from backends.mindspore.scheduler import PREFILL_FIRST, Scheduler, Sequence
from backends.mindspore.tokenizer import IncrementalDetokenizer, Tokenizer
from backends.mindspore.weights import load_weights
from backends.settings import EngineConfig
from backends.params import effective_max_new_tokens, resolve
from backends.sampling import NextTokenChooser
from backends.stopping import Stopper
from backends.types import FinishReason, GenerationResult, RequestParams, Token, TokenEvent

log = logging.getLogger("mindserve.engine")
MAX_PROMPT_TOKENS = 1048576  # the seed document's hard cap


@functools.cache
def _torch_dtype(model_dir: Path) -> str | None:
    """config.json's ``torch_dtype`` (what /info reports as the model dtype), None if absent."""
    try:
        value = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("torch_dtype")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _default_batches(max_batch: int) -> tuple[int, ...]:
    buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch]
    return (*buckets, max_batch)


def _default_windows(max_window: int, block: int) -> tuple[int, ...]:
    sizes, w = [], max(block, 256 // block * block)
    while w < max_window:
        sizes.append(w)
        w *= 4
    return (*sizes, max_window)


def derive_shapes(config: EngineConfig, spec: ModelSpec) -> tuple[Shapes, int, int]:
    """(shapes, max_seq_len, num_blocks) for a config, capped by what the model supports."""
    max_seq = min(config.max_seq_len, spec.max_position_embeddings)
    block = config.block_size
    max_window = -(-max_seq // block) * block
    shapes = Shapes(block, min(config.prefill_chunk, max_window),
                    config.batch_buckets or _default_batches(config.max_batch_size),
                    config.window_buckets or _default_windows(max_window, block),
                    config.prefill_batch_buckets or tuple(sorted({1, config.max_prefill_batch})))
    if shapes.max_window < max_seq or shapes.batch_buckets[-1] < config.max_batch_size:
        raise ValueError(f"buckets {shapes} do not cover maxSeqLen {max_seq} / maxBatchSize {config.max_batch_size}")
    num_blocks = config.num_blocks or config.max_batch_size * (max_window // block) + 1
    return shapes, max_seq, num_blocks


class Engine:
    """Owns the model, the cache and a thread that runs the continuous-batching loop."""

    def __init__(self, model_dir: Path | str, config: EngineConfig = EngineConfig(), *,
                 warmup: bool = True, progress: bool = False, model_name: str | None = None) -> None:
        started = time.perf_counter()
        self.spec = load_model_spec(model_dir)
        self.config = config
        self.model_name = model_name or self.spec.model_dir.name
        self.tokenizer = Tokenizer.from_model_dir(self.spec.model_dir, self.spec.tokenizer)
        self.shapes, self.max_seq_len, num_blocks = derive_shapes(config, self.spec)
        set_mode(self.spec.mode, self.spec.device_target if self.spec.device_target == "CPU" else "CPU",
                 config.threads)
        weights = load_weights(self.spec.checkpoint, self.spec.checkpoint_format)
        self.runner = ModelRunner(self.spec, weights, self.shapes, num_blocks, config.kernels)
        self.shapes = self.runner.shapes  # the paged attention kernel needs one window only
        del weights
        self.allocator = BlockAllocator(num_blocks, self.shapes.block_size)
        chunk = self.shapes.prefill_chunk
        # AOT kernels: one forward per step, the decode tokens and at most one chunk of prompt tokens
        # packed, so decoding never waits for prompts. Stock ops: a prefill call (each prompt its own
        # chunk-sized row, up to maxPrefillTokens in all), then a decode call, prompts first.
        paged = self.runner.paged
        self.scheduler = Scheduler(self.allocator, config.max_batch_size, config.max_waiting,
                                   prefill_rows=self.shapes.prefill_batch_buckets[-1],
                                   prefill_tokens=chunk if paged else max(config.max_prefill_tokens, chunk),
                                   chunk=chunk, prefill_first=0 if paged else PREFILL_FIRST)
        self.eos_ids = frozenset(self.spec.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        self.vocab_size = self.spec.config_vocab_size or self.spec.vocab_size
        limits = {"maxInputTokenLen": config.max_input_tokens, "maxSeqLen - 1": self.max_seq_len - 1,
                  "max_position_embeddings": self.spec.max_position_embeddings, "the hard cap": MAX_PROMPT_TOKENS}
        self.limit_name, self.max_prompt_tokens = min(limits.items(), key=lambda kv: kv[1])
        self._inbox: queue.SimpleQueue[Sequence] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._closing = False
        log.info("loaded model %s (%s, %d layers, mode %s) in %.1fs; cache %d blocks x %d tokens",
                 self.model_name, self.spec.arch, self.spec.num_layers,
                 "GRAPH" if self.spec.mode == 0 else "PYNATIVE", time.perf_counter() - started,
                 num_blocks, self.shapes.block_size)
        if warmup:
            self.runner.warmup(progress)

    # --- client side (any thread) ---

    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mindserve-engine", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def tokenize(self, text: str) -> list[int]:
        """The ids ``submit`` would start from (before ``truncate`` and the length policy)."""
        return self.tokenizer.encode(text)

    def apply_chat_template(self, messages: Seq[Mapping[str, Any]]) -> str:
        """The prompt for a chat (the tokenizer config's template, with the generation prompt)."""
        template = self.tokenizer.chat_template
        if template is None:
            raise InputRejected(f"model {self.model_name} has no chat template; "
                                "send a plain prompt to /v1/completions instead")
        return render_chat_template(template, messages, bos_token=self.tokenizer.bos_token or "",
                                    eos_token=self.tokenizer.eos_token or "")

    def prompt_ids(self, text: str, truncate: int | None) -> list[int]:
        """Tokenize and apply ``truncate`` and the token limit (or the server's ``truncation`` policy)."""
        ids = self.tokenizer.encode(text)
        if truncate is not None and truncate < len(ids):
            ids = ids[-truncate:]
        limit = self.max_prompt_tokens
        if len(ids) > limit:
            if self.config.truncation == 0:
                raise InputRejected(f"inputs has {len(ids)} tokens, more than the limit of {limit} "
                                    f"({self.limit_name} = {limit})")
            ids = ids[-limit:] if self.config.truncation == 1 else ids[:limit]
        if not ids:
            raise InputRejected("inputs encodes to 0 tokens")
        return ids

    def submit(self, inputs: str, params: RequestParams, listener: Listener | None = None) -> RequestHandle:
        if self._closing:
            raise EngineUnavailable("the engine is shutting down")
        ids = self.prompt_ids(inputs, params.truncate)
        sampling = resolve(params, self.spec.defaults, self.vocab_size)
        max_new = effective_max_new_tokens(params.max_new_tokens, self.config.max_iter_times,
                                           self.max_seq_len, len(ids))
        handle = RequestHandle(f"req-{next(self._ids)}", listener)
        seq = Sequence(handle=handle, prompt_ids=ids, max_new_tokens=max_new,
                       chooser=NextTokenChooser(sampling, self.vocab_size),
                       stopper=Stopper(max_new, self.eos_ids, params.stop),
                       detokenizer=IncrementalDetokenizer(self.tokenizer, ids), seed=sampling.seed,
                       want_prefill=params.decoder_input_details)
        if self._inbox.qsize() + len(self.scheduler) >= self.config.max_waiting + self.config.max_batch_size:
            raise EngineOverloaded(f"{self.config.max_waiting} requests already waiting")
        self._inbox.put(seq)
        self._wake.set()
        return handle

    def generate(self, inputs: str, params: RequestParams = RequestParams()) -> GenerationResult:
        return self.submit(inputs, params).result()

    def info(self) -> dict:
        return {"model_name": self.model_name, "arch": self.spec.arch, "max_seq_len": self.max_seq_len,
                "max_input_tokens": self.max_prompt_tokens, "max_batch_size": self.config.max_batch_size,
                "compiled_graphs": len(self.runner.compiled), "free_blocks": self.allocator.free_blocks,
                "total_blocks": self.allocator.usable_blocks, "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting) + len(self.scheduler.prefilling),
                "dtype": _torch_dtype(self.spec.model_dir) or self.spec.compute_dtype,
                "max_prefill_tokens": self.config.max_prefill_tokens, "block_size": self.shapes.block_size}

    # --- engine thread ---

    def _loop(self) -> None:
        while not self._closing:
            try:
                worked = self.step()
            except Exception as exc:  # one failing step must not kill the server
                log.exception("engine step failed")
                self._fail_active(exc)
                worked = True
            if not worked:
                self._wake.wait(0.05)
                self._wake.clear()
        self._fail_active(EngineUnavailable("the engine shut down"))

    def step(self) -> bool:
        """One iteration: admit, drop cancelled, one prefill chunk, one decode step. False if idle."""
        while not self._inbox.empty():
            seq = self._inbox.get()
            if not self.scheduler.add(seq):
                seq.handle.emit(EngineOverloaded("the wait queue is full"))
        for seq in self.scheduler.all():
            if seq.handle.cancelled:
                self._finish(seq, seq.stopper.cancel().finish)
        plan = self.scheduler.plan()
        if self.runner.paged and plan.prefill:  # the decode rows ride along with the prompt chunks
            self._packed_step(plan)
            return True
        if plan.prefill:
            self._prefill(plan.prefill)
        if plan.decode:
            rows = [(s, DecodeRow(s.generated[-1], s.length - 1, s.blocks)) for s in plan.decode]
            for seq, _, logits in self._isolated(self.runner.decode, rows):
                self._guarded(self._append, seq, logits)
        return bool(plan.prefill) or bool(plan.decode)

    def _isolated(self, forward, rows: list[tuple[Sequence, object]]) -> list[tuple[Sequence, object, object]]:
        """Run ``forward`` on all rows; if it fails, rerun each row alone so only the culprit fails.

        Rerunning is safe: a row rewrites the same cache slots with the same values.
        """
        try:
            return [(seq, row, out) for (seq, row), out in zip(rows, forward([r for _, r in rows]))]
        except Exception as exc:
            if len(rows) == 1:
                self._fail(rows[0][0], exc)
                return []
            log.warning("batched forward of %d rows failed (%s); isolating rows", len(rows), exc)
        results = []
        for seq, row in rows:
            try:
                results.append((seq, row, forward([row])[0]))
            except Exception as exc:
                self._fail(seq, exc)
        return results

    def _guarded(self, fn, seq: Sequence, *args) -> None:
        try:
            fn(seq, *args)
        except Exception as exc:
            self._fail(seq, exc)

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        """Fail one request (its client gets a Generation Error); the others go on."""
        log.error("request %s failed in the engine: %r", seq.handle.request_id, exc, exc_info=exc)
        self.scheduler.finish(seq)
        seq.handle.emit(GenerationFailed(f"request failed during generation: {exc}"))

    @staticmethod
    def _prompt_chunks(work: tuple[tuple[Sequence, int], ...]) -> list[tuple[Sequence, PrefillChunk]]:
        """The next ``n`` prompt tokens of each planned sequence."""
        return [(seq, PrefillChunk(seq.prompt_ids[seq.prefilled:seq.prefilled + n], seq.prefilled, seq.blocks))
                for seq, n in work]

    def _run_chunks(self, rows: list[tuple[Sequence, PrefillChunk]]) -> list[tuple[Sequence, PrefillChunk, object]]:
        """``runner.prefill`` on the rows' chunks with fault isolation: (seq, chunk, (logits, hidden))."""
        return self._isolated(lambda chunks: list(zip(*self.runner.prefill(chunks))), rows)

    def _packed_step(self, plan) -> None:
        """Decode tokens and prompt chunks in one packed forward (a decode row is a 1-token chunk)."""
        rows = [(s, PrefillChunk([s.generated[-1]], s.length - 1, s.blocks)) for s in plan.decode]
        decoding = set(plan.decode)
        for seq, chunk, (logits, hidden) in self._run_chunks(rows + self._prompt_chunks(plan.prefill)):
            if seq in decoding:
                self._guarded(self._append, seq, logits)
            else:
                self._guarded(self._after_prefill, seq, chunk, logits, hidden)

    def _prefill(self, work: tuple[tuple[Sequence, int], ...]) -> None:
        """One chunk for each planned sequence, in one call; finished prompts sample their first token."""
        for seq, chunk, (logits, hidden) in self._run_chunks(self._prompt_chunks(work)):
            self._guarded(self._after_prefill, seq, chunk, logits, hidden)

    def _after_prefill(self, seq: Sequence, chunk: PrefillChunk, logits: np.ndarray, hidden: np.ndarray) -> None:
        if seq.want_prefill:
            self._prompt_logprobs(seq, chunk.start, hidden)
        seq.prefilled += len(chunk.ids)
        if seq.prefilled == len(seq.prompt_ids):
            self.scheduler.prefill_done(seq)
            self._append(seq, logits)

    def _prompt_logprobs(self, seq: Sequence, start: int, hidden: np.ndarray) -> None:
        """Prefill tokens with the logprob of each prompt token under the raw model distribution."""
        if start == 0:
            first = seq.prompt_ids[0]
            seq.prefill_tokens.append(self._token(first, None))
        logits = self.runner.prompt_logits(hidden).astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        for i, row in enumerate(logprobs):
            nxt = start + i + 1
            if nxt < len(seq.prompt_ids):
                tid = seq.prompt_ids[nxt]
                seq.prefill_tokens.append(self._token(tid, float(row[tid])))

    def _token(self, tid: int, logprob: float | None) -> Token:
        return Token(tid, self.tokenizer.token_text(tid), logprob, self.tokenizer.is_special(tid))

    def _append(self, seq: Sequence, logits: np.ndarray) -> None:
        """Sample the next token of ``seq``, run its stop criteria, emit the event (and the result)."""
        token_id, logprob = seq.chooser.choose(logits, seq.prompt_ids + seq.generated)
        seq.generated.append(token_id)
        special = self.tokenizer.is_special(token_id)
        delta = "" if special else seq.detokenizer.push(token_id)
        outcome = seq.stopper.push(token_id, delta)
        token = Token(token_id, self.tokenizer.token_text(token_id) if special else delta, logprob, special)
        seq.tokens.append(token)
        seq.handle.emit(TokenEvent(token, len(seq.generated) - 1, outcome.emit_text, last=outcome.finish is not None))
        if outcome.finish is not None:
            self._finish(seq, outcome.finish)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.finish(seq)
        seq.handle.emit(GenerationResult(
            generated_text=seq.stopper.generated_text, finish_reason=reason, prompt_tokens=len(seq.prompt_ids),
            generated_tokens=len(seq.generated), seed=seq.seed, tokens=tuple(seq.tokens),
            prefill=tuple(seq.prefill_tokens)))

    def _fail_active(self, exc: Exception) -> None:
        for seq in self.scheduler.all():
            self.scheduler.finish(seq)
            seq.handle.emit(exc if isinstance(exc, EngineUnavailable) else GenerationFailed(str(exc)))
