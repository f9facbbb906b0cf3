"""What any thread may ask of a loaded model without the loop: its tokenizer (count, encode, decode), its chat
template, a grammar pre-check, the adapters (their loads run between two steps), and ``/info``. ``Engine``
(engine.py, the loop) inherits these; they read the engine's parts (``engine_parts.EngineParts``)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from backends.chat_template import render_chat_template
from backends.errors import InputRejected, ParameterRejected
from backends.mindspore.engine.engine_parts import EngineParts
from backends.step_stats import StepStats
from backends.types import Grammar


class EngineFront:
    """The engine's client side: everything here reads ``parts``; nothing touches the step loop."""

    parts: EngineParts
    step_stats: StepStats
    _between_steps: Callable[[Callable[[], object]], Future]

    def __getattr__(self, name: str) -> Any:
        """The parts' facts read through (``engine.spec`` is ``engine.parts.spec``): held once, in the parts."""
        if name == "parts":
            raise AttributeError(name)
        return getattr(self.parts, name)

    @property
    def max_prompt_tokens(self) -> int:
        return self.parts.prompt_limit.tokens

    def count_tokens(self, text: str) -> int:
        return len(self.parts.tokenizer.encode(text))

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids ``submit`` would start from (before ``truncate`` and the length policy)."""
        return self.parts.tokenizer.encode(text, add_special_tokens)

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens included; ParameterRejected("tokens") for an id outside the
        vocabulary."""
        self._check_ids(ids)
        return self.parts.tokenizer.decode(ids, skip_special_tokens=False)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary string (``Ġthe``)."""
        self._check_ids(ids)
        return [self.parts.tokenizer.token_str(i) for i in ids]

    def _check_ids(self, ids: Sequence[int]) -> None:
        vocab = self.parts.tokenizer.vocab_size
        outside = next((at for at, i in enumerate(ids) if not 0 <= i < vocab), None)
        if outside is not None:
            raise ParameterRejected("tokens", f"tokens[{outside}] is {ids[outside]}, outside the vocabulary of "
                                              f"{vocab} tokens")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **variables: Any) -> str:
        """The prompt for a chat (the tokenizer config's template, with the generation prompt unless
        ``add_generation_prompt`` is false); ``variables``: more template variables (``tools``, a request's
        chat_template_kwargs)."""
        template, tokenizer = self.parts.chat_template, self.parts.tokenizer
        if template is None:
            raise InputRejected(f"model {self.parts.model_name!r} has no chat template (a base model: its tokenizer "
                                "config carries none), so chat messages cannot be turned into its prompt; send the "
                                "text to continue as a plain prompt to /v1/completions (or as inputs to POST /)")
        return render_chat_template(template, messages, bos_token=tokenizer.bos_token or "",
                                    eos_token=tokenizer.eos_token or "",
                                    add_generation_prompt=add_generation_prompt, **variables)

    def check_grammar(self, grammar: Grammar) -> None:
        """GrammarRejected if ``grammar`` does not compile or meets the grammar engine's limits in its first
        steps (any thread; ``backends/grammar.py``)."""
        self.parts.grammars.check(grammar)

    def prompt_ids(self, text: str, truncate: int | None) -> list[int]:
        return self.parts.intake.prompt_ids(text, truncate)  # what submit starts a text prompt from

    # --- LoRA adapters at run time (the management plane; adapters.py) ---

    def adapters(self) -> list[dict]:
        return self.parts.lora.describe()

    def load_adapter(self, name: str, path: Path | str) -> dict:
        return self.parts.lora.load(name, path, self._between_steps)

    def unload_adapter(self, name: str) -> bool:
        return self.parts.lora.unload(name)

    def info(self) -> dict:
        return self.parts.info(self.step_stats)

    @property
    def compiled_graphs(self) -> int:
        """Graphs compiled so far: the language model's and the vision tower's."""
        return self.parts.compiled_graphs
