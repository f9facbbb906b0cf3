"""The MindSpore engine: load a model directory, then loop plan -> run -> for each row: sample -> stop -> emit.

A vision-language model takes image and video parts through its family's vision part (``families.VisionPart``):
preprocessed on the submitting thread, the vision tower run on the engine thread once per item, at the first step
whose prompt chunk reaches it (``encode_reached``), its rows dropped once the prompt is in the cache. A request
comes in through ``intake.py``; each row's sample -> detokenize -> stop is ``SeqState.advance``."""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from backends.base import Listener, RequestHandle
from backends.errors import EngineOverloaded, EngineUnavailable, GenerationFailed
from backends.grammar import MaskBatch, MaskWorker
from backends.mindspore.engine.engine_front import EngineFront
from backends.mindspore.engine.engine_parts import build_parts
from backends.mindspore.runners.step import RowOutput
from backends.mindspore.modeldir.tokenizer import Tokenizer
from backends.mindspore.engine.sequence import SeqState
from backends.sampling import vocab_log_softmax
from backends.settings import EngineConfig
from backends.step_stats import StepStats
from backends.stopping import StepOutcome
from backends.types import FinishReason, GenerationResult, MediaInput, RequestParams, Token, TokenEvent

log = logging.getLogger("mindserve.engine")


class Engine(EngineFront):
    """Owns the model's parts (``engine_parts.EngineParts``, read through: ``engine.spec``) and a thread that runs
    the continuous-batching loop; the client side that needs no loop is ``EngineFront``."""

    def __init__(self, model_dir: Path | str, config: EngineConfig = EngineConfig(), *,
                 warmup: bool = True, progress: bool = False, model_name: str | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        started = time.perf_counter()
        self.parts = parts = build_parts(model_dir, config, model_name, tokenizer)  # tokenizer: start-up's check's
        # what the loop drives, step by step
        self.runner, self.scheduler, self.speculator = parts.runner, parts.scheduler, parts.speculator
        self.vision, self.intake = parts.vision, parts.intake
        self.masks = MaskWorker()  # grammar masks, computed while the forward pass runs
        self.step_stats = StepStats()
        self._inbox: queue.SimpleQueue[SeqState] = queue.SimpleQueue()
        self._tasks: queue.SimpleQueue[tuple[Any, Future]] = queue.SimpleQueue()  # run between steps
        self._wake = threading.Event()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._closing = False
        spec = parts.spec
        log.info("loaded model %s (%s, %d layers, mode %s) in %.1fs; cache %d blocks x %d tokens",
                 parts.model_name, spec.arch, spec.num_layers, "GRAPH" if spec.mode == 0 else "PYNATIVE",
                 time.perf_counter() - started, parts.allocator.num_blocks, self.runner.shapes.block_size)
        if warmup:
            parts.warm_up(progress)

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
        if self.speculator.model is not None:  # the draft model (EngineParts.warm_up warms it the same way)
            self.speculator.model.close()
        if self._thread is not None and self._thread.is_alive():
            log.warning("the engine thread of %s did not stop within 30 s: its memory is kept", self.parts.model_name)
            return
        self.runner.release()  # no step runs any more: the network's memory goes back
        if self.speculator.model is not None:
            self.speculator.model.release()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, inputs: str, params: RequestParams, listener: Listener | None = None,
               media: Sequence[MediaInput] = ()) -> RequestHandle:
        """Queue a request (cheap refusals first: closing, media kinds, overload; then intake builds it)."""
        if self._closing:
            raise EngineUnavailable("the engine is shutting down")
        self.intake.refuse_kinds(media)
        config = self.parts.config
        if self._inbox.qsize() + len(self.scheduler) >= config.max_waiting + config.max_batch_size:
            raise EngineOverloaded(f"{config.max_waiting} requests already waiting")
        handle = RequestHandle(f"req-{next(self._ids)}", listener)
        self._inbox.put(self.intake.build(handle, inputs, params, media))
        self._wake.set()
        return handle

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
                                       vocab_log_softmax(self.runner.prompt_logits(out.hidden),
                                                                         self.parts.vocab_size))
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
