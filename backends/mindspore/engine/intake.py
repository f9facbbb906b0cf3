"""Intake: a request in, a ``SeqState`` out, on the submitting thread. The cheap refusals come first (the
media kinds), then the prompt: tokenized, cut by ``truncate`` and the token limit (or the server's
``truncation`` policy), for a vision-language model preprocessed with its vision tokens expanded; then the
state with its adapter lease, vision prompt and media (vLLM's input processor, TGI's ``Validation``)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.base import RequestHandle
from backends.errors import InputRejected
from backends.limits import PromptLimit
from backends.mindspore.engine.adapters import EngineAdapters
from backends.mindspore.engine.sequence import SeqState
from backends.params import effective_max_new_tokens
from backends.sampling import RowScanner
from backends.settings import EngineConfig
from backends.types import MediaInput, RequestParams

if TYPE_CHECKING:
    from backends.grammar import GrammarCompiler
    from backends.mindspore.families import MediaPrompt, VisionPart
    from backends.mindspore.engine.speculative import Speculator
    from backends.mindspore.modeldir.spec import ModelSpec
    from backends.mindspore.modeldir.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Intake:
    """The engine's request intake, built with the engine's parts (``engine_parts.build_parts``) from the ones it
    reads; ``vision`` (its family's ``VisionPart``) only for a vision-language model."""

    spec: ModelSpec
    config: EngineConfig
    tokenizer: Tokenizer
    model_name: str
    prompt_limit: PromptLimit
    max_seq_len: int
    max_window: int
    vision: VisionPart | None
    media_kinds: frozenset[str]
    adapters: EngineAdapters
    vocab_size: int
    eos_ids: frozenset[int]
    grammars: GrammarCompiler
    speculator: Speculator
    row_scan: RowScanner | None = None  # the choosers' one-pass scan of a logits row (engine_parts.row_scanner)

    def refuse_kinds(self, media: Sequence[MediaInput]) -> None:
        """InputRejected for a media part this model does not take (before anything is read)."""
        refused = sorted({m.kind for m in media} - self.media_kinds)
        if refused:
            raise InputRejected(f"model {self.model_name} does not take {refused[0]} parts (it takes "
                                f"{', '.join(['text', *sorted(self.media_kinds)])})")

    def build(self, handle: RequestHandle, inputs: str, params: RequestParams,
              media: Sequence[MediaInput] = ()) -> SeqState:
        """The request's state: its prompt, limits, adapter lease (released if building fails) and media."""
        vision, items = self.vision_prompt(inputs, media, params.truncate) if self.vision is not None else (None, [])
        ids = list(vision.ids) if vision is not None else self.prompt_ids(inputs, params.truncate)
        max_new = effective_max_new_tokens(params.max_new_tokens, self.config.max_iter_times, self.max_seq_len,
                                           len(ids))
        lease = self.adapters.lease(params.adapter_id)
        try:
            seq = SeqState.from_request(handle, ids, params, max_new_tokens=max_new, defaults=self.spec.defaults,
                                        vocab_size=self.vocab_size, eos_ids=self.eos_ids, tokenizer=self.tokenizer,
                                        grammars=self.grammars, lora=lease, vision=vision, media=items,
                                        scan=self.row_scan)
            seq.drafter = self.speculator.drafter(params.speculate)
            return seq
        except BaseException:
            if lease is not None:
                lease.release()
            raise

    def prompt_ids(self, text: str, truncate: int | None) -> list[int]:
        """Tokenize and apply ``truncate`` and the token limit (or the server's ``truncation`` policy)."""
        ids = self.tokenizer.encode(text)
        start, end = self.kept(len(ids), truncate)
        return ids[start:end]

    def kept(self, n: int, truncate: int | None) -> tuple[int, int]:
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

    def vision_prompt(self, text: str, media: Sequence[MediaInput], truncate: int | None
                      ) -> tuple[MediaPrompt | None, list]:
        """A vision-language model's prompt, by its vision part: the media preprocessed, the vision tokens
        expanded, then cut to the limits (never through an image); (None, []) for a prompt without media."""
        return self.vision.prompt(text, media, self.tokenizer.encode, lambda n: self.kept(n, truncate),
                                  self.max_seq_len, self.max_window)

