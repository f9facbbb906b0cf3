"""How long a sequence and a prompt may be: the one home of the prompt-token limit (every caller asks
``prompt_token_limit``). Plain arithmetic on the engine settings, no MindSpore."""
from __future__ import annotations

from dataclasses import dataclass

from backends.settings import EngineConfig

MAX_PROMPT_TOKENS = 1048576  # the hard cap on prompt tokens, whatever the settings (docs/api.md)


@dataclass(frozen=True, slots=True)
class PromptLimit:
    tokens: int  # the most prompt tokens a request may have (after ``truncate``)
    setting: str  # what sets it, for the error message ("maxInputTokenLen", ...)


def longest_sequence(config: EngineConfig, max_positions: int | None = None) -> int:
    """Tokens one sequence may hold (prompt + generated): maxSeqLen, capped by the model's
    max_position_embeddings (None: not known yet)."""
    return config.max_seq_len if max_positions is None else min(config.max_seq_len, max_positions)


def prompt_token_limit(config: EngineConfig, max_positions: int | None = None) -> PromptLimit:
    """min(maxInputTokenLen, the longest sequence - 1 (room for one new token), the hard cap), with the
    setting that sets it."""
    longest = "maxSeqLen" if longest_sequence(config, max_positions) == config.max_seq_len else \
        "max_position_embeddings"
    candidates = {"maxInputTokenLen": config.max_input_tokens,
                  f"{longest} - 1": longest_sequence(config, max_positions) - 1, "the hard cap": MAX_PROMPT_TOKENS}
    setting, tokens = min(candidates.items(), key=lambda kv: kv[1])
    return PromptLimit(tokens, setting)
