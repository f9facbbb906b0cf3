"""The MindSpore engine: load a model directory, then loop plan -> run -> for each row: sample -> stop -> emit.

A vision-language model (Qwen2-VL / Qwen2.5-VL) takes image and video parts: preprocessed on the submitting
thread (``qwen2_vl.request``), the vision tower run on the engine thread once per item, at the first step
whose prompt chunk reaches it (``VisionEncoder.encode_reached``), its rows dropped once the prompt is in the
cache. A request comes in through ``intake.py``; each row's sample -> detokenize -> stop is ``SeqState.advance``."""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from backends.base import Listener, RequestHandle
from backends.chat_template import render_chat_template
from backends.errors import (EngineOverloaded, EngineUnavailable, GenerationFailed, InputRejected,
                             ParameterRejected)
from backends.grammar import MaskBatch, MaskWorker
from backends.mindspore.engine_parts import build_parts, engine_info, warm_up
from backends.mindspore.intake import Intake
from backends.mindspore.step import RowOutput
from backends.mindspore.tokenizer import Tokenizer
from backends.mindspore.sequence import SeqState
from backends.sampling import RowScanner, vocab_log_softmax
from backends.settings import EngineConfig
from backends.step_stats import StepStats
from backends.stopping import StepOutcome
from backends.types import FinishReason, GenerationResult, Grammar, MediaInput, RequestParams, Token, TokenEvent

log = logging.getLogger("mindserve.engine")


def _row_scanner(runner) -> RowScanner | None:
    """The choosers' one-pass scan of a logits row: the kernel library's (kernels/vocab.py) on the AOT path, whose
    library is built; none on stock ops (the choosers' NumPy paths)."""
    if runner.kernels != "aot":
        return None
    from backends.mindspore.kernels import kernel_library
    from backends.mindspore.kernels.vocab import native_scanner

    return native_scanner(kernel_library())


class Engine:
    """Owns the model, the cache and a thread that runs the continuous-batching loop."""

    def __init__(self, model_dir: Path | str, config: EngineConfig = EngineConfig(), *,
                 warmup: bool = True, progress: bool = False, model_name: str | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        started = time.perf_counter()
        parts = build_parts(model_dir, config, model_name, tokenizer)  # tokenizer: start-up's check's, if any
        self.spec, self.config, self.model_name, self.device = parts.spec, parts.config, parts.model_name, parts.device
        self.threads = parts.threads
        self.vl, self.media_kinds, self.vision = parts.spec.vision, parts.media_kinds, parts.vision
        self.tokenizer, self.chat_template, self.grammars = parts.tokenizer, parts.chat_template, parts.grammars
        self.eos_ids, self.vocab_size = parts.eos_ids, parts.vocab_size
        self.max_seq_len, self.prompt_limit = parts.max_seq_len, parts.prompt_limit
        self.lora, self.runner = parts.lora, parts.runner
        self.allocator, self.scheduler, self.speculator = parts.allocator, parts.scheduler, parts.speculator
        self.masks = MaskWorker()  # grammar masks, computed while the forward pass runs
        self.row_scan = _row_scanner(self.runner)
        self.step_stats = StepStats()
        self.intake = Intake(self)
        self._inbox: queue.SimpleQueue[SeqState] = queue.SimpleQueue()
        self._tasks: queue.SimpleQueue[tuple[Any, Future]] = queue.SimpleQueue()  # run between steps
        self._wake = threading.Event()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._closing = False
        spec = self.spec
        log.info("loaded model %s (%s, %d layers, mode %s) in %.1fs; cache %d blocks x %d tokens",
                 self.model_name, spec.arch, spec.num_layers, "GRAPH" if spec.mode == 0 else "PYNATIVE",
                 time.perf_counter() - started, self.allocator.num_blocks, self.runner.shapes.block_size)
        if warmup:
            warm_up(self, progress)

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
        self.runner.close()
        if self.speculator.model is not None:  # the draft model (engine_parts.warm_up warms it the same way)
            self.speculator.model.close()
        if self._thread is not None and self._thread.is_alive():
            log.warning("the engine thread of %s did not stop within 30 s: its memory is kept", self.model_name)
            return
        self.runner.release()  # no step runs any more: the network's memory goes back
        if self.speculator.model is not None:
            self.speculator.model.release()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids ``submit`` would start from (before ``truncate`` and the length policy)."""
        return self.tokenizer.encode(text, add_special_tokens)

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens included; ParameterRejected("tokens") for an id outside the
        vocabulary."""
        self._check_ids(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary string (``Ġthe``)."""
        self._check_ids(ids)
        return [self.tokenizer.token_str(i) for i in ids]

    def _check_ids(self, ids: Sequence[int]) -> None:
        outside = next((at for at, i in enumerate(ids) if not 0 <= i < self.tokenizer.vocab_size), None)
        if outside is not None:
            raise ParameterRejected("tokens", f"tokens[{outside}] is {ids[outside]}, outside the vocabulary of "
                                              f"{self.tokenizer.vocab_size} tokens")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **variables: Any) -> str:
        """The prompt for a chat (the tokenizer config's template, with the generation prompt unless
        ``add_generation_prompt`` is false); ``variables``: more template variables (``tools``, a request's
        chat_template_kwargs)."""
        template = self.chat_template
        if template is None:
            raise InputRejected(f"model {self.model_name!r} has no chat template (a base model: its tokenizer "
                                "config carries none), so chat messages cannot be turned into its prompt; send the "
                                "text to continue as a plain prompt to /v1/completions (or as inputs to POST /)")
        return render_chat_template(template, messages, bos_token=self.tokenizer.bos_token or "",
                                    eos_token=self.tokenizer.eos_token or "",
                                    add_generation_prompt=add_generation_prompt, **variables)

    def check_grammar(self, grammar: Grammar) -> None:
        """GrammarRejected if ``grammar`` does not compile or meets the grammar engine's limits in its first
        steps (any thread; ``backends/grammar.py``)."""
        self.grammars.check(grammar)

    def prompt_ids(self, text: str, truncate: int | None) -> list[int]:
        return self.intake.prompt_ids(text, truncate)  # what submit starts a text prompt from

    def submit(self, inputs: str, params: RequestParams, listener: Listener | None = None,
               media: Sequence[MediaInput] = ()) -> RequestHandle:
        """Queue a request (cheap refusals first: closing, media kinds, overload; then intake builds it)."""
        if self._closing:
            raise EngineUnavailable("the engine is shutting down")
        self.intake.refuse_kinds(media)
        if self._inbox.qsize() + len(self.scheduler) >= self.config.max_waiting + self.config.max_batch_size:
            raise EngineOverloaded(f"{self.config.max_waiting} requests already waiting")
        handle = RequestHandle(f"req-{next(self._ids)}", listener)
        self._inbox.put(self.intake.build(handle, inputs, params, media))
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
        return engine_info(self)

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
        """One iteration: admit, drop the cancelled, plan, draft, run, then each row in turn (its wall time and
        tokens go to ``step_stats``; the tasks run before it do not count). False if idle."""
        while not self._tasks.empty():
            _run_task(*self._tasks.get())
        started = time.perf_counter()
        self._admit()
        self._drop_cancelled()
        plan = self.scheduler.plan()
        if self.vision is not None:  # the media items this step's prompt chunks reach, encoded first
            plan = plan.without(self.vision.encode_reached(plan.prefill, self._fail))
        drafts = self.speculator.propose(plan.decode, self.runner.draft_budget(len(plan.decode), len(plan.prefill)),
                                         lambda n: self.runner.fit_drafts(plan.tokens, n))
        # after the drafts: a grammar row's draft is checked against its matcher, which the mask thread then takes
        masks = self.masks.start([seq.grammar for seq in plan.sampling_rows() if seq.grammar is not None])
        seqs = plan.sequences()
        for out in self.runner.run(plan.batch(drafts)):
            self._advance(seqs[out.row], out, masks)
        if plan.empty:
            return False
        self.step_stats.record("prefill" if plan.prefill else "decode", time.perf_counter() - started,
                               plan.tokens + sum(len(d) for d in drafts.values()))
        return True

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

    def _advance(self, seq: SeqState, out: RowOutput, masks: MaskBatch) -> None:
        """One row of a step: record a prompt chunk; a row with a next token samples, stops, emits, then
        verifies its drafts. A failure fails this request only (its client gets a Generation Error); the others
        go on."""
        try:
            if out.error is not None:
                raise out.error
            if out.prompt is not None and not self._prefilled(seq, out):
                return  # more of the prompt to go
            if seq.grammar is not None:
                masks.wait()
            run = [seq.advance(out.logits)]
            if out.drafts:
                self._verify(seq, out, run)
            self._emit(seq, run)
        except Exception as exc:
            self._fail(seq, exc)

    def _verify(self, seq: SeqState, out: RowOutput, run: list[tuple[Token, StepOutcome]]) -> None:
        """Speculative decoding: while the token just chosen (the last of ``run``) equals the next draft, that
        draft's position was computed with the right token, so its logits give the next token; each is chosen
        and stopped as a plain step would, and added to ``run`` (emitted together: a streaming client's server
        writes them at once). The rest are dropped: their cache slots lie past the sequence's length (never
        read, rewritten by the next steps; its blocks were reserved at admission, never registered). A grammar
        row's mask at each verified position is its grammar's after the accepted tokens, as plain decoding's."""
        for draft, logits in zip(out.drafts, out.verify):
            token, outcome = run[-1]
            if outcome.finish is not None or token.id != draft:
                break
            if seq.grammar is not None:
                self.masks.now(seq.grammar)
            run.append(seq.advance(logits))
        self.speculator.record(seq, len(out.drafts), len(run) - 1, len(run))

    def _prefilled(self, seq: SeqState, out: RowOutput) -> bool:
        """Record a prompt chunk in ``seq`` (and its prompt logprobs); True once the whole prompt is in."""
        if seq.want_prefill:  # the prompt tokens' logprobs, over the chooser's vocabulary
            seq.record_prompt_logprobs(out.prompt.start,
                                       vocab_log_softmax(self.runner.prompt_logits(out.hidden), self.vocab_size))
        seq.prefilled += len(out.prompt.ids)
        if seq.prompt_done:
            seq.drop_media()
            self.scheduler.prefill_done(seq)
        return seq.prompt_done

    def _emit(self, seq: SeqState, run: list[tuple[Token, StepOutcome]]) -> None:
        """The event of each token of ``run`` (the step's last tokens, in order; with its released text), then the
        result if the request finished."""
        first = len(seq.generated) - len(run)
        for i, (token, outcome) in enumerate(run):
            seq.handle.emit(TokenEvent(token, first + i, outcome.emit_text, last=outcome.finish is not None))
        if (finish := run[-1][1].finish) is not None:
            self._finish(seq, finish)

    def _finish(self, seq: SeqState, reason: FinishReason) -> None:
        self.scheduler.finish(seq)
        seq.handle.emit(GenerationResult(
            generated_text=seq.stopper.generated_text, finish_reason=reason, prompt_tokens=len(seq.prompt_ids),
            generated_tokens=len(seq.generated), seed=seq.seed, tokens=tuple(seq.tokens),
            prefill=tuple(seq.prefill_tokens), cached_tokens=seq.cached))

    def _fail(self, seq: SeqState, exc: Exception) -> None:
        log.error("request %s failed in the engine: %r", seq.handle.request_id, exc, exc_info=exc)
        self.scheduler.finish(seq)
        seq.handle.emit(GenerationFailed(f"request failed during generation: {exc}"))

    def _fail_active(self, exc: Exception) -> None:
        for seq in self.scheduler.all():
            self.scheduler.finish(seq)
            seq.handle.emit(exc if isinstance(exc, EngineUnavailable) else GenerationFailed(str(exc)))


def _run_task(task, done: Future) -> None:
    try:
        done.set_result(task())
    except Exception as exc:
        done.set_exception(exc)
