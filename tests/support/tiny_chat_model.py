"""A tiny random Llama whose chat template is Qwen3-like: tools rendered into the system turn, Hermes
``<tool_call>{…}</tool_call>`` calls, ``<tool_response>`` turns, ``<think>`` reasoning and
``enable_thinking``. ``<think>``, ``</think>``, ``<tool_call>`` and ``</tool_call>`` are added, non-special
tokens, as in Qwen3's tokenizer (so they stay in the decoded text). Written by the one writer
(``tiny_checkpoint.py``) with ``tiny_model.py``'s Llama."""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken

from backends.chat_template import render_chat_template
from tests.support import tiny_checkpoint as tc
from tests.support import tiny_model as tm

MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
MAX_POSITIONS = 2048  # a prompt with tools is long in a 388-token vocabulary

# Qwen3's template, shortened: the same turns, tool section, call and response syntax and thinking switch.
QWEN3_LIKE_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if call.function %}{%- set call = call.function %}{%- endif %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def make_tiny_chat_model(out_dir: str | Path, *, seed: int = 3) -> Path:
    """Write the model directory and return its path (same arguments → the same files)."""
    tokenizer = tc.train_tokenizer(384)
    tokenizer.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])

    def config(ids: dict[str, int]) -> dict:
        out = tc.tokenizer_config(ids, MAX_POSITIONS)
        out["chat_template"] = QWEN3_LIKE_TEMPLATE
        for marker in MARKERS:
            out["added_tokens_decoder"][str(tokenizer.token_to_id(marker))] = {
                "content": marker, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                "special": False}
        return out

    positions = str(tm.SHAPE["max_position_embeddings"])
    return tc.write_checkpoint(
        out_dir, vocab_size=384, tokenizer=tokenizer,
        weights=lambda vocab: tc.random_weights(vocab, seed, tm.layout("llama", True)),
        config=lambda vocab, ids: {**tm._config("llama", vocab, True, ids), "max_position_embeddings": MAX_POSITIONS},
        tokenizer_config=config, yaml_name="predict_tiny.yaml",
        yaml=lambda vocab, ids: tm._predict_yaml(vocab, False, True, ids).replace(f": {positions}\n",
                                                                                   f": {MAX_POSITIONS}\n"))


def marker_ids(model_dir: str | Path) -> dict[str, int]:
    """The token id of each marker in the model's tokenizer.json."""
    added = json.loads((Path(model_dir) / "tokenizer.json").read_text())["added_tokens"]
    return {t["content"]: t["id"] for t in added if t["content"] in MARKERS}


def independent_parse(raw: str) -> tuple[str | None, str, list[tuple[str, dict]]]:
    """(reasoning, content, [(name, arguments)]) of a Qwen3-style output: the tests' own reading, independent
    of the server's parser."""
    reasoning = None
    found = re.match(r"\s*<think>(.*?)</think>", raw, re.S)
    if found:
        reasoning, raw = found.group(1).strip(), raw[found.end():]
    calls = [json.loads(body) for body in re.findall(r"<tool_call>(.*?)</tool_call>", raw, re.S)]
    content = re.sub(r"<tool_call>.*?</tool_call>", "", raw, flags=re.S).strip()
    return reasoning, content, [(c["name"], c["arguments"]) for c in calls]


class TemplateBackend:
    """What request parsing asks of a backend: its name and its chat template (rendered for real)."""

    def __init__(self, template: str, model_name: str = "m") -> None:
        self.chat_template = template
        self.model_name = model_name

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], **variables: Any) -> str:
        return render_chat_template(self.chat_template, messages, **variables)
