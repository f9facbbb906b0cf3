"""Plain data that crosses the service/backend boundary: params, media, token events, results."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from backends.defaults import MAX_NEW_TOKENS


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"


@dataclass(frozen=True, slots=True)
class Grammar:
    """A constraint on the generated text: ``kind`` "json" (``value`` is a JSON Schema's text), "regex", or
    "tool_calls" (the server's tool-call constraint: backends/tool_grammar.py)."""

    kind: str
    value: str


@dataclass(frozen=True, slots=True)
class RequestParams:
    """Sampling/stopping parameters as the client sent them; None means "not set".

    The backend resolves the unset ones against the model's yaml defaults
    (see ``backends.params.resolve``).
    """

    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    watermark: bool = False
    seed: int | None = None
    max_new_tokens: int = MAX_NEW_TOKENS
    stop: tuple[str, ...] = ()
    truncate: int | None = None
    decoder_input_details: bool = False
    adapter_id: str | None = None
    grammar: Grammar | None = None  # constrained decoding (backends/grammar.py)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    ignore_eos: bool = False  # never choose EOS: generate until the length cap
    min_tokens: int = 0  # no EOS before this many generated tokens
    top_logprobs: int = 0  # report this many most likely alternatives with each generated token
    thinking_budget: int | None = None  # at most this many tokens inside <think>…</think> (backends/thinking.py)
    priority: int = 0  # scheduling order, vLLM's convention: lower is more urgent (docs/configuration.md)
    speculate: bool = True  # False: this request never drafts, even with speculative decoding on


@dataclass(frozen=True, slots=True)
class MediaInput:
    """One media part of a prompt, fetched and checked by the service (``service/media/``): the bytes of
    the file as it came (an image is verified to decode), never a path or URL the backend would open.

    ``position`` is where the part sits in the prompt text: the number of prompt characters before it
    (the text parts before it, joined). ``source`` says where it came from, for logs and errors only.
    """

    kind: str  # "image" | "video" | "audio"
    data: bytes = field(repr=False)
    mime: str  # the content's own media type, e.g. "image/png"
    source: str  # a path, an http(s) URL, or "data: URL" / "base64 data"
    position: int = 0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Fully resolved sampling parameters (every value concrete)."""

    do_sample: bool
    temperature: float
    top_k: int | None  # None = off
    top_p: float  # 1.0 = off
    typical_p: float  # 1.0 = off
    repetition_penalty: float  # 1.0 = off
    watermark: bool
    seed: int  # uint64, 1..2**64-1


@dataclass(frozen=True, slots=True)
class ModelDefaults:
    """Per-model defaults from the yaml's ``model.model_config`` (None = absent; a yaml top_k of 0 reads as
    absent, i.e. off)."""

    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None


@dataclass(frozen=True, slots=True)
class Token:
    id: int
    text: str
    logprob: float | None
    special: bool
    top: tuple[Token, ...] = ()  # the most likely alternatives (RequestParams.top_logprobs), best first


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token.

    ``token.text`` is the token's own decoded text (a special token's literal text); ``text`` is what this
    token adds to the generated text: "" while it completes no character or while the text might still
    be the start of a stop string (held back, released with a later token). Joined, the ``text`` of all
    events equals ``GenerationResult.generated_text``.
    """

    token: Token
    index: int  # 0-based position among generated tokens
    text: str
    last: bool = False  # the generation ends with this token (length, EOS, stop): its GenerationResult follows


@dataclass(frozen=True, slots=True)
class GenerationResult:
    generated_text: str
    finish_reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    seed: int
    tokens: tuple[Token, ...] = ()
    prefill: tuple[Token, ...] = ()
    cached_tokens: int = 0  # prompt tokens the prefix cache held (not prefilled)
