"""One request's state inside the engine, built from the request (TGI's ``from_pb``): its sampler,
stopper, detokenizer and grammar state are per-row pieces, dropped with the row when it finishes.
``advance`` is the per-row step: sample -> detokenize -> stop, in that order, in one place."""
from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from backends.base import RequestHandle
from backends.errors import ParameterRejected
from backends.grammar import GrammarCompiler, GrammarState
from backends.mindspore.engine.lora_slots import Lease
from backends.mindspore.runners.step import DecodeRow, PrefillChunk
from backends.mindspore.modeldir.tokenizer import IncrementalDetokenizer, Tokenizer
from backends.params import resolve
from backends.logit_processors import request_processors
from backends.sampling import NextTokenChooser, RowScanner
from backends.stopping import StepOutcome, Stopper
from backends.thinking import thinking_budget
from backends.types import ModelDefaults, RequestParams, Token

if TYPE_CHECKING:
    from backends.mindspore.families import MediaPrompt
    from backends.mindspore.engine.speculative import Drafter


@dataclass(eq=False, slots=True)
class SeqState:
    """One request: its prompt, what it generated, its cache blocks and its per-request objects."""

    handle: RequestHandle
    prompt_ids: list[int]
    max_new_tokens: int
    chooser: NextTokenChooser
    stopper: Stopper
    detokenizer: IncrementalDetokenizer
    seed: int
    tokenizer: Tokenizer | None = None  # token texts and which ids are special (``advance``, ``token``)
    want_prefill: bool = False  # decoder_input_details: prompt tokens with their logprobs
    grammar: GrammarState | None = None  # constrained decoding: the mask before sampling, advanced after
    top_logprobs: int = 0  # alternatives reported with each token
    lora: Lease | None = None  # the LoRA adapter this request runs with (None: the base model)
    priority: int = 0  # the scheduler's order (lower: more urgent; RequestParams.priority)
    vision: MediaPrompt | None = None  # a prompt with media: M-RoPE positions, delta, each item's span
    media: list = field(default_factory=list)  # each span's patches, until the prompt is in
    media_rows: dict[int, np.ndarray] = field(default_factory=dict)  # span index -> the vision tower's rows
    drafter: Drafter | None = None  # speculative decoding's drafts (None: this sequence decodes plainly)
    blocks: list[int] = field(default_factory=list)
    local_blocks: list[int] = field(default_factory=list)  # the sliding-window layers' (window_pool.py), if any
    prefilled: int = 0  # prompt tokens already in the cache
    cached: int = 0  # of which found in the prefix cache at admission (GenerationResult.cached_tokens)
    generated: list[int] = field(default_factory=list)
    tokens: list[Token] = field(default_factory=list)
    prefill_tokens: list[Token] = field(default_factory=list)

    @classmethod
    def from_request(cls, handle: RequestHandle, prompt_ids: list[int], params: RequestParams, *,
                     max_new_tokens: int, defaults: ModelDefaults, vocab_size: int, eos_ids: Iterable[int],
                     tokenizer: Tokenizer, grammars: GrammarCompiler | None = None, lora: Lease | None = None,
                     vision: MediaPrompt | None = None, media: list | None = None,
                     scan: RowScanner | None = None) -> SeqState:
        """The state of a new request: ``params`` resolved against the model's defaults into its chooser
        (logit_bias and the EOS ban of min_tokens/ignore_eos first), its stop rules into its stopper, its
        grammar compiled (``GrammarRejected`` if it does not compile); its adapter ``lora``, and a vision
        prompt's ``vision`` and ``media``; ``scan`` the engine's one-pass scan of a logits row, if it has one."""
        sampling = resolve(params, defaults, vocab_size)
        outside = [tid for tid, _ in params.logit_bias if not 0 <= tid < vocab_size]
        if outside:
            raise ParameterRejected("logit_bias", f"logit_bias has token id {outside[0]}, outside the "
                                                  f"vocabulary of {vocab_size} tokens")
        first = request_processors(params.logit_bias, sorted(eos_ids), _eos_banned_until(params, len(prompt_ids)))
        first += thinking_budget(params.thinking_budget, prompt_ids, tokenizer.token_id)
        grammar = None
        if params.grammar is not None:
            if grammars is None:
                raise ValueError("a grammar needs the engine's GrammarCompiler")
            grammar = grammars.compile(params.grammar)
        return cls(handle=handle, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
                   chooser=NextTokenChooser(sampling, vocab_size, first, scan), grammar=grammar,
                   stopper=Stopper(max_new_tokens, eos_ids, params.stop),
                   detokenizer=IncrementalDetokenizer(tokenizer, prompt_ids), tokenizer=tokenizer, seed=sampling.seed,
                   want_prefill=params.decoder_input_details, top_logprobs=params.top_logprobs, lora=lora,
                   priority=params.priority,
                   vision=vision, media=list(media or []))

    @property
    def adapter(self) -> str | None:
        """The adapter's name, None for the base model."""
        return self.lora.name if self.lora is not None else None

    @property
    def lora_slot(self) -> int:
        """The adapter slot its rows name; -1 = the base model."""
        return self.lora.slot if self.lora is not None else -1

    def decode_row(self, drafts: tuple[int, ...] = ()) -> DecodeRow:
        """This step's decode row: the last token, at its position, and the ``drafts`` to verify after it."""
        return DecodeRow(self.generated[-1], self.length - 1, self.blocks, self.lora_slot, self.delta, drafts,
                         self.local_blocks)

    def prompt_chunk(self, n: int) -> PrefillChunk:
        """The next ``n`` prompt tokens from ``prefilled`` on (a prompt that shares cached prefix blocks starts
        after them, and its block table still lists them, so attention reads them), with the media rows they
        reach (encoded by then) and their M-RoPE positions."""
        start, end = self.prefilled, self.prefilled + n
        return PrefillChunk(self.prompt_ids[start:end], start, self.blocks, self.lora_slot,
                            self.chunk_media(start, end), self.chunk_positions(start, end), self.delta,
                            local_blocks=self.local_blocks)

    def close(self) -> None:
        """The request is over (finished, failed or refused): let go of what it holds outside the cache."""
        if self.lora is not None:
            self.lora.release()
        self.drop_media()

    # --- media (a vision-language prompt) ---

    @property
    def delta(self) -> int:
        """M-RoPE: a token after the prompt sits at position cache index + delta (0 without media)."""
        return self.vision.delta if self.vision is not None else 0

    def media_spans(self) -> list[tuple[int, int, bytes]]:
        """(start, end, digest) of each media item, for the prefix cache's block hashes."""
        return [(s.start, s.end, s.digest) for s in self.vision.spans] if self.vision is not None else []

    def _overlapping(self, start: int, end: int) -> list:
        """(index, span) of the media items whose tokens overlap prompt tokens [start, end)."""
        if self.vision is None:
            return []
        return [(i, s) for i, s in enumerate(self.vision.spans) if s.start < end and s.end > start]

    def unencoded(self, start: int, end: int) -> list[int]:
        """The media items overlapping prompt tokens [start, end) whose rows are not computed yet."""
        return [i for i, _ in self._overlapping(start, end) if i not in self.media_rows]

    def chunk_media(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The media rows [t, D] and mask [t] of prompt tokens [start, end) (each overlapping item's rows
        computed, ``unencoded``); None if no item overlaps."""
        spans = self._overlapping(start, end)
        if not spans:
            return None
        dim = self.media_rows[spans[0][0]].shape[1]
        rows, mask = np.zeros((end - start, dim), np.float32), np.zeros(end - start, np.float32)
        for i, s in spans:
            a, b = max(s.start, start), min(s.end, end)
            rows[a - start:b - start] = self.media_rows[i][a - s.start:b - s.start]
            mask[a - start:b - start] = 1.0
        return rows, mask

    def chunk_positions(self, start: int, end: int) -> np.ndarray | None:
        """M-RoPE positions [3, t] of prompt tokens [start, end); None without media (plain positions)."""
        return self.vision.positions[:, start:end] if self.vision is not None else None

    def drop_media(self) -> None:
        """The prompt is in the cache: its patches and vision rows are not needed any more."""
        self.media = []
        self.media_rows.clear()

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def capacity(self) -> int:
        """Tokens this sequence may ever hold in the cache (prompt + max new tokens)."""
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def prompt_done(self) -> bool:
        return self.prefilled == len(self.prompt_ids)

    def advance(self, logits: np.ndarray) -> tuple[Token, StepOutcome]:
        """One generated token from ``logits`` [V]: sample (``sample``), detokenize, stop (the ``Stopper``);
        the token as the client sees it (with its top alternatives), recorded in ``tokens``, and the outcome."""
        token_id, logprob, top = self.sample(logits)
        alternatives = tuple(self.token(i, lp) for i, lp in top)
        if self.tokenizer.is_special(token_id):  # adds no text to the output
            token, delta = Token(token_id, self.tokenizer.token_text(token_id), logprob, True, alternatives), ""
        else:
            delta = self.detokenizer.push(token_id)
            token = Token(token_id, delta, logprob, False, alternatives)
        outcome = self.stopper.push(token_id, delta)
        self.tokens.append(token)
        return token, outcome

    def token(self, tid: int, logprob: float | None) -> Token:
        """A token with its own text (a prompt token, an alternative)."""
        return Token(tid, self.tokenizer.token_text(tid), logprob, self.tokenizer.is_special(tid))

    def record_prompt_logprobs(self, start: int, logprobs: np.ndarray) -> None:
        """Prefill tokens with their logprobs: ``logprobs`` [t, V] the rows of prompt tokens from ``start``
        (row i predicts token start + i + 1; the first prompt token has none)."""
        if start == 0:
            self.prefill_tokens.append(self.token(self.prompt_ids[0], None))
        for i, row in enumerate(logprobs):
            nxt = start + i + 1
            if nxt < len(self.prompt_ids):
                tid = self.prompt_ids[nxt]
                self.prefill_tokens.append(self.token(tid, float(row[tid])))

    def sample(self, logits: np.ndarray) -> tuple[int, float, tuple[tuple[int, float], ...]]:
        """Choose the next token from ``logits`` [V] (within the grammar's mask), append it and advance
        the grammar: (id, logprob, the top_logprobs most likely (id, logprob))."""
        allowed = self.grammar.allowed() if self.grammar is not None else None
        token_id, logprob, top = self.chooser.choose_with_top(logits, self.prompt_ids + self.generated, allowed,
                                                              self.top_logprobs)
        self.generated.append(token_id)
        if self.grammar is not None:
            self.grammar.advance(token_id)
        return token_id, logprob, top


def _eos_banned_until(params: RequestParams, prompt_len: int) -> int:
    """The sequence length before which EOS is banned: never reached with ignore_eos, the prompt plus
    min_tokens with min_tokens, else 0 (no ban)."""
    if params.ignore_eos:
        return sys.maxsize
    return prompt_len + params.min_tokens if params.min_tokens else 0
