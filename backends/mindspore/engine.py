"""The MindSpore engine: load a model directory, then loop plan -> run -> for each row: sample -> stop -> emit.

A vision-language model (Qwen2-VL / Qwen2.5-VL) takes image and video parts: preprocessed on the submitting
thread (``qwen2_vl.request``), the vision tower run on the engine thread once per item, at the first step
whose prompt chunk reaches it (``_encode_media``), its rows dropped once the prompt is in the cache."""
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
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from backends.base import Listener, RequestHandle
from backends.chat_template import render_chat_template
from backends.errors import EngineOverloaded, EngineUnavailable, GenerationFailed, InputRejected
from backends.grammar import GrammarCompiler, GrammarState, MaskBatch, MaskWorker
from backends.limits import longest_sequence, prompt_token_limit
from backends.mindspore.adapters import EngineAdapters
from backends.mindspore.config import VL_ARCHS, load_model_spec
from backends.mindspore.kv_cache import BlockAllocator
from backends.mindspore.graph_cache import enable_graph_cache, graph_key
from backends.mindspore.memory import Footprint, available_memory, plan_cache
from backends.mindspore.model import set_device
from backends.mindspore.qwen2_vl.config import VLSpec, load_vl_spec
from backends.mindspore.qwen2_vl.encoder import VisionEncoder
from backends.mindspore.qwen2_vl.pipeline import processor_chat_template
from backends.mindspore.qwen2_vl.preprocess import MediaError, Patches
from backends.mindspore.qwen2_vl.request import VisionPrompt, build_prompt, truncate_prompt
from backends.mindspore.qwen2_vl.weights import load_vl_weights
from backends.mindspore.runner import RowOutput, build_runner, choose_kernels
from backends.mindspore.scheduler import Scheduler, StepPlan
from backends.mindspore.sequence import SeqState
from backends.mindspore.shapes import plan_shapes
from backends.mindspore.tokenizer import Tokenizer
from backends.mindspore.weights import check_weight_dtype, load_weights
from backends.params import effective_max_new_tokens
from backends.settings import EngineConfig
from backends.stopping import StepOutcome
from backends.types import FinishReason, GenerationResult, MediaInput, RequestParams, Token, TokenEvent

log = logging.getLogger("mindserve.engine")


@functools.cache
def _torch_dtype(model_dir: Path) -> str | None:
    """config.json's ``torch_dtype`` (what /info reports as the model dtype), None if absent."""
    try:
        value = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("torch_dtype")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


class Engine:
    """Owns the model, the cache and a thread that runs the continuous-batching loop."""

    def __init__(self, model_dir: Path | str, config: EngineConfig = EngineConfig(), *,
                 warmup: bool = True, progress: bool = False, model_name: str | None = None) -> None:
        started = time.perf_counter()
        self.spec = spec = load_model_spec(model_dir)
        self.vl = vl = _vl_spec(spec)
        self.media_kinds = frozenset({"image", "video"}) if vl is not None else frozenset()
        self.lora = EngineAdapters(spec, config.lora)  # read and checked now: their slots count in the budget
        if vl is not None and self.lora.shape is not None:
            raise ValueError(f"{spec.arch}: LoRA adapters are not supported for a vision-language model; "
                             "remove LoraModules / allowRuntimeLoraUpdating")
        self.device = set_device(spec, config.threads)
        # The execution strategy, chosen once and before the budget: the AOT kernels (the packed step), or None
        # for stock ops (the split step), which hold float32 weights and every compiled graph's activations.
        aot = choose_kernels(spec, config.kernels, self.device, config.kernel_isa)
        # The cache within its memory budget (npuMemSize), the batch capped at what it holds.
        cache = plan_cache(config, Footprint.of(spec, self.lora.bytes, stock=aot is None), available_memory(),
                           spec.max_position_embeddings)
        log.info("%s", cache.describe())
        self.config = config = cache.apply(config)
        num_blocks = cache.num_blocks
        self.model_name = model_name or spec.model_dir.name
        self.tokenizer = Tokenizer.from_model_dir(spec.model_dir, spec.tokenizer)
        self.chat_template = self.tokenizer.chat_template
        if self.chat_template is None and vl is not None:
            self.chat_template = processor_chat_template(spec.model_dir)
        self.max_seq_len = longest_sequence(config, spec.max_position_embeddings)
        self.prompt_limit = prompt_token_limit(config, spec.max_position_embeddings)
        shapes = plan_shapes(config, spec.max_position_embeddings)
        weights = _load_weights(spec, vl)
        check_weight_dtype(weights, spec.yaml_path, spec.weight_dtype)
        self.runner = build_runner(spec, weights, shapes, num_blocks, config.kernels, self.device, self.lora.shape, vl,
                                   aot=aot)
        self.vision = VisionEncoder(vl, weights) if vl is not None else None
        del weights
        self.lora.attach(self.runner.write_lora)
        self.allocator = BlockAllocator(num_blocks, self.runner.shapes.block_size, config.prefix_caching)
        self.scheduler = Scheduler(self.allocator, config.max_batch_size, config.max_waiting,
                                   prefill_rows=self.runner.shapes.prefill_batch_buckets[-1],
                                   prefill_tokens=self.runner.prefill_budget(config),
                                   chunk=self.runner.shapes.prefill_chunk, prefill_first=self.runner.prefill_first,
                                   max_loras=config.lora.max_loras)
        self.eos_ids = frozenset(spec.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        self.vocab_size = spec.config_vocab_size or spec.vocab_size
        self.grammars = GrammarCompiler(self.tokenizer.to_json(), self.vocab_size, self.eos_ids)
        self.masks = MaskWorker()  # grammar masks, computed while the forward pass runs
        self._inbox: queue.SimpleQueue[SeqState] = queue.SimpleQueue()
        self._tasks: queue.SimpleQueue[tuple[Any, Future]] = queue.SimpleQueue()  # run between steps
        self._wake = threading.Event()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._closing = False
        log.info("loaded model %s (%s, %d layers, mode %s) in %.1fs; cache %d blocks x %d tokens",
                 self.model_name, spec.arch, spec.num_layers, "GRAPH" if spec.mode == 0 else "PYNATIVE",
                 time.perf_counter() - started, num_blocks, self.runner.shapes.block_size)
        if warmup:
            if config.graph_cache and spec.mode == 0:
                enable_graph_cache(graph_key(self.runner.graph_parts(), spec.model_dir, spec.yaml_path))
            self.runner.warmup(progress)
            if self.vision is not None:
                self.vision.warmup()

    @property
    def max_prompt_tokens(self) -> int:
        return self.prompt_limit.tokens

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
        self.masks.close()

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
        template = self.chat_template
        if template is None:
            raise InputRejected(f"model {self.model_name} has no chat template; "
                                "send a plain prompt to /v1/completions instead")
        return render_chat_template(template, messages, bos_token=self.tokenizer.bos_token or "",
                                    eos_token=self.tokenizer.eos_token or "")

    def prompt_ids(self, text: str, truncate: int | None) -> list[int]:
        """Tokenize and apply ``truncate`` and the token limit (or the server's ``truncation`` policy)."""
        ids = self.tokenizer.encode(text)
        start, end = self._kept(len(ids), truncate)
        return ids[start:end]

    def _kept(self, n: int, truncate: int | None) -> tuple[int, int]:
        """The tokens [start, end) of an ``n``-token prompt kept by ``truncate`` and the token limit (or the
        server's ``truncation`` policy); InputRejected if over the limit without truncation, or none left."""
        start, end = (n - truncate, n) if truncate is not None and truncate < n else (0, n)
        limit = self.prompt_limit.tokens
        if end - start > limit:
            if self.config.truncation == 0:
                raise InputRejected(f"inputs has {end - start} tokens, more than the limit of {limit} "
                                    f"({self.prompt_limit.setting} = {limit})")
            start, end = (end - limit, end) if self.config.truncation == 1 else (start, start + limit)
        if end <= start:
            raise InputRejected("inputs encodes to 0 tokens")
        return start, end

    def vision_prompt(self, text: str, media: Seq[MediaInput], truncate: int | None
                      ) -> tuple[VisionPrompt | None, list[Patches]]:
        """A vision-language model's prompt: the media preprocessed, the vision tokens expanded, then cut to
        the limits (never through an image); (None, []) for a prompt without media."""
        try:
            prompt, items = build_prompt(text, media, self.vl, self.tokenizer.encode, self.vision.max_patches)
            start, end = self._kept(len(prompt.ids), truncate)
            if (start, end) != (0, len(prompt.ids)):
                prompt, items = truncate_prompt(prompt, items, start, end, self.vl)
        except MediaError as exc:
            raise InputRejected(str(exc)) from None
        longest = int(prompt.positions.max(initial=0)) + 1, self.max_seq_len + prompt.delta
        if max(longest) > self.runner.shapes.max_window:
            raise InputRejected(f"inputs reaches M-RoPE position {max(longest) - 1}, past the model's "
                                f"{self.runner.shapes.max_window} positions")
        return (prompt, items) if prompt.spans else (None, [])

    def submit(self, inputs: str, params: RequestParams, listener: Listener | None = None,
               media: Seq[MediaInput] = ()) -> RequestHandle:
        if self._closing:
            raise EngineUnavailable("the engine is shutting down")
        refused = sorted({m.kind for m in media} - self.media_kinds)
        if refused:
            raise InputRejected(f"model {self.model_name} does not take {refused[0]} parts (it takes "
                                f"{', '.join(['text', *sorted(self.media_kinds)])})")
        vision, items = (self.vision_prompt(inputs, media, params.truncate) if self.vl is not None
                         else (None, []))
        ids = list(vision.ids) if vision is not None else self.prompt_ids(inputs, params.truncate)
        handle = RequestHandle(f"req-{next(self._ids)}", listener)
        max_new = effective_max_new_tokens(params.max_new_tokens, self.config.max_iter_times,
                                           self.max_seq_len, len(ids))
        lease = self.lora.lease(params.adapter_id)
        try:
            seq = SeqState.from_request(handle, ids, params, max_new_tokens=max_new, defaults=self.spec.defaults,
                                        vocab_size=self.vocab_size, eos_ids=self.eos_ids, tokenizer=self.tokenizer,
                                        grammars=self.grammars)
            seq.lora = lease
            seq.vision, seq.media = vision, items
            if self._inbox.qsize() + len(self.scheduler) >= self.config.max_waiting + self.config.max_batch_size:
                raise EngineOverloaded(f"{self.config.max_waiting} requests already waiting")
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        self._inbox.put(seq)
        self._wake.set()
        return handle

    # --- LoRA adapters at run time (the management plane; adapters.py) ---

    def adapters(self) -> list[dict]:
        return self.lora.describe()

    def load_adapter(self, name: str, path: Path | str) -> dict:
        return self.lora.load(name, path, self._between_steps)

    def unload_adapter(self, name: str) -> bool:
        return self.lora.unload(name)

    def _between_steps(self, task) -> Future:
        """Run ``task`` on the engine thread before its next step (or here, if the loop is not running)."""
        done: Future = Future()
        if self._thread is None or not self._thread.is_alive():
            _run_task(task, done)
        else:
            self._tasks.put((task, done))
            self._wake.set()
        return done

    def generate(self, inputs: str, params: RequestParams = RequestParams()) -> GenerationResult:
        return self.submit(inputs, params).result()

    def info(self) -> dict:
        return {"model_name": self.model_name, "arch": self.spec.arch, "max_seq_len": self.max_seq_len,
                "max_input_tokens": self.prompt_limit.tokens, "max_batch_size": self.config.max_batch_size,
                "compiled_graphs": self.compiled_graphs, "free_blocks": self.allocator.free_blocks,
                "total_blocks": self.allocator.usable_blocks, "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting) + len(self.scheduler.prefilling),
                "dtype": _torch_dtype(self.spec.model_dir) or self.spec.compute_dtype,
                "max_prefill_tokens": self.config.max_prefill_tokens, "block_size": self.runner.shapes.block_size,
                "device": self.device, "kernels": self.runner.kernels,
                "kernel_variant": self.runner.kernel_variant, "compute_dtype": self.runner.dtype,
                "weight_dtype": self.spec.weight_dtype,
                "prefix_caching": self.allocator.prefix_caching, "prefix_cache_blocks": self.allocator.cached_blocks,
                "prefix_cache_hit_rate": self.scheduler.hit_tokens / max(self.scheduler.prompt_tokens, 1),
                "prefix_cache_hit_tokens": self.scheduler.hit_tokens, "adapters": self.adapters(),
                "lora": self.lora.info()}

    @property
    def compiled_graphs(self) -> int:
        """Graphs compiled so far: the language model's and the vision tower's."""
        return len(self.runner.compiled) + (len(self.vision.compiled) if self.vision is not None else 0)

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
        """One iteration: admit, drop the cancelled, plan, run, then each row in turn. False if idle."""
        while not self._tasks.empty():
            _run_task(*self._tasks.get())
        self._admit()
        self._drop_cancelled()
        plan = self.scheduler.plan()
        if self.vision is not None:
            plan = self._encode_media(plan)
        masks = self.masks.start(_constrained_rows(plan))  # overlaps the forward pass
        for out in self.runner.run(plan):
            self._advance(out, masks)
        return not plan.empty

    def _encode_media(self, plan: StepPlan) -> StepPlan:
        """Run the vision tower for each media item the planned prompt chunks reach and no earlier step
        encoded (an item the prefix cache holds is never reached); a request whose item fails is failed and
        leaves the plan."""
        failed = []
        for seq, n in plan.prefill:
            try:
                for i in seq.unencoded(seq.prefilled, seq.prefilled + n):
                    seq.media_rows[i] = self.vision.encode(seq.media[i])
            except Exception as exc:
                failed.append(seq)
                self._fail(seq, exc)
        if not failed:
            return plan
        return StepPlan(tuple(w for w in plan.prefill if w[0] not in failed), plan.decode)

    def _admit(self) -> None:
        while not self._inbox.empty():
            seq = self._inbox.get()
            if not self.scheduler.add(seq):
                seq.close()
                seq.handle.emit(EngineOverloaded("the wait queue is full"))

    def _drop_cancelled(self) -> None:
        for seq in self.scheduler.all():
            if seq.handle.cancelled:
                self._finish(seq, seq.stopper.cancel().finish)

    def _advance(self, out: RowOutput, masks: MaskBatch) -> None:
        """One row of a step: record a prompt chunk; a row with a next token samples, stops, emits.
        A failure fails this request only (its client gets a Generation Error); the others go on."""
        seq = out.seq
        try:
            if out.error is not None:
                raise out.error
            if out.prompt is not None and not self._prefilled(seq, out):
                return  # more of the prompt to go
            if seq.grammar is not None:
                masks.wait()
            token_id, logprob, top = seq.sample(out.logits)
            token, delta = self._detokenize(seq, token_id, logprob, tuple(self._token(i, lp) for i, lp in top))
            self._emit(seq, token, seq.stopper.push(token_id, delta))
        except Exception as exc:
            self._fail(seq, exc)

    def _prefilled(self, seq: SeqState, out: RowOutput) -> bool:
        """Record a prompt chunk in ``seq`` (and its prompt logprobs); True once the whole prompt is in."""
        if seq.want_prefill:
            self._prompt_logprobs(seq, out.prompt.start, out.hidden)
        seq.prefilled += len(out.prompt.ids)
        if seq.prompt_done:
            seq.drop_media()
            self.scheduler.prefill_done(seq)
        return seq.prompt_done

    def _prompt_logprobs(self, seq: SeqState, start: int, hidden: np.ndarray) -> None:
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

    def _detokenize(self, seq: SeqState, token_id: int, logprob: float, top: tuple[Token, ...] = ()
                    ) -> tuple[Token, str]:
        """The token as the client sees it (with its top alternatives), and the text it adds to the output
        (none for a special token)."""
        if self.tokenizer.is_special(token_id):
            return Token(token_id, self.tokenizer.token_text(token_id), logprob, True, top), ""
        delta = seq.detokenizer.push(token_id)
        return Token(token_id, delta, logprob, False, top), delta

    def _emit(self, seq: SeqState, token: Token, outcome: StepOutcome) -> None:
        """The token's event (the released text), then the result if the request finished."""
        seq.tokens.append(token)
        seq.handle.emit(TokenEvent(token, len(seq.generated) - 1, outcome.emit_text, last=outcome.finish is not None))
        if outcome.finish is not None:
            self._finish(seq, outcome.finish)

    def _finish(self, seq: SeqState, reason: FinishReason) -> None:
        self.scheduler.finish(seq)
        seq.handle.emit(GenerationResult(
            generated_text=seq.stopper.generated_text, finish_reason=reason, prompt_tokens=len(seq.prompt_ids),
            generated_tokens=len(seq.generated), seed=seq.seed, tokens=tuple(seq.tokens),
            prefill=tuple(seq.prefill_tokens)))

    def _fail(self, seq: SeqState, exc: Exception) -> None:
        log.error("request %s failed in the engine: %r", seq.handle.request_id, exc, exc_info=exc)
        self.scheduler.finish(seq)
        seq.handle.emit(GenerationFailed(f"request failed during generation: {exc}"))

    def _fail_active(self, exc: Exception) -> None:
        for seq in self.scheduler.all():
            self.scheduler.finish(seq)
            seq.handle.emit(exc if isinstance(exc, EngineUnavailable) else GenerationFailed(str(exc)))


def _vl_spec(spec) -> VLSpec | None:
    """The vision-language spec of a Qwen2-VL / Qwen2.5-VL model directory, None for a text model."""
    return load_vl_spec(spec.yaml_path) if spec.arch in VL_ARCHS else None


def _load_weights(spec, vl: VLSpec | None) -> dict[str, np.ndarray]:
    """The checkpoint's arrays (a vision-language checkpoint checked name by name against both towers)."""
    return load_vl_weights(vl) if vl is not None else load_weights(spec.checkpoint, spec.checkpoint_format)


def _run_task(task, done: Future) -> None:
    try:
        done.set_result(task())
    except Exception as exc:
        done.set_exception(exc)


def _constrained_rows(plan: StepPlan) -> list[GrammarState]:
    """The grammar states of the rows that sample this step: every decode row, and each prompt whose
    last chunk is in this step."""
    rows = [seq for seq in plan.decode]
    rows += [seq for seq, n in plan.prefill if seq.prefilled + n == len(seq.prompt_ids)]
    return [seq.grammar for seq in rows if seq.grammar is not None]
