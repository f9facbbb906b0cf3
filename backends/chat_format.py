"""How a model writes tool calls and reasoning in its output, chosen once per chat template (or set in the
server config): the tool-call syntax (Hermes/Qwen ``<tool_call>{…}</tool_call>``, Llama-3 JSON, or, for a
template that shows none, our generic JSON format) and the reasoning markers (``<think>…</think>``). The
parser of that output is ``backends/chat_output.py`` (``backends/generic_output.py`` for the generic format)."""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass


class ToolCallSyntax(str, enum.Enum):
    HERMES = "hermes"  # <tool_call>{"name": …, "arguments": {…}}</tool_call>, one block per call (Qwen2.5/3, Hermes)
    LLAMA3_JSON = "llama3_json"  # the whole answer is {"name": …, "parameters": {…}} (; another), Llama 3.1+
    GENERIC = "generic"  # ours, for any template: {"tool_calls": [{"name": …, "arguments": {…}}]} or {"response": …}
    # (backends/generic_tools.py: the tools in a system message we write, the answer held to that JSON)


@dataclass(frozen=True, slots=True)
class Markers:
    """A tagged block of the output: its opening and closing text."""

    open: str
    close: str


THINK = Markers("<think>", "</think>")
TOOL_CALL = Markers("<tool_call>", "</tool_call>")
AUTO = "auto"
NONE = "none"
TOOL_CALL_SETTINGS = (AUTO, NONE, *(s.value for s in ToolCallSyntax))  # the config's toolCallFormat
TEMPLATE, CONFIG = "template", "config"  # where a model's tool-call format comes from (/info)
REASONING_SETTINGS = (AUTO, NONE, "think")  # the server config's reasoningFormat


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """What the output parser looks for: a tool-call syntax (None: the model has none) and reasoning markers
    (None: the model does not think)."""

    tool_calls: ToolCallSyntax | None = None
    reasoning: Markers | None = None


@functools.lru_cache(maxsize=8)
def chat_format(template: str | None, tool_setting: str = AUTO, reasoning_setting: str = AUTO) -> ChatFormat:
    """The format of a model with chat ``template``: each part as the setting says, or, on ``auto``, as the
    template shows it (a template that writes ``<tool_call>`` takes Hermes calls, one that knows Llama's
    ``<|python_tag|>``/``ipython`` role Llama-3 JSON calls, any other the generic format; one that writes
    ``<think>`` reasons)."""
    text = template or ""
    if tool_setting == AUTO:
        tools = (ToolCallSyntax.HERMES if TOOL_CALL.open in text
                 else ToolCallSyntax.LLAMA3_JSON if "<|python_tag|>" in text or "ipython" in text
                 else ToolCallSyntax.GENERIC)
    else:
        tools = None if tool_setting == NONE else ToolCallSyntax(tool_setting)
    if reasoning_setting == AUTO:
        reasoning = THINK if THINK.open in text else None
    else:
        reasoning = None if reasoning_setting == NONE else THINK
    return ChatFormat(tools, reasoning)


def tool_call_source(template: str | None, tool_setting: str = AUTO) -> dict[str, str]:
    """The tool-call format a model gets and where it comes from (``/info``): ``{"format": "generic" | a
    native syntax | "none", "source": "template" | "config"}``."""
    syntax = chat_format(template, tool_setting).tool_calls
    return {"format": NONE if syntax is None else syntax.value, "source": TEMPLATE if tool_setting == AUTO else CONFIG}


def closes_reasoning(prompt: str, fmt: ChatFormat) -> bool:
    """True if the rendered ``prompt`` ends with a closed, empty reasoning block (thinking switched off, as
    Qwen3's ``enable_thinking: false`` does): the answer follows without one."""
    if fmt.reasoning is None:
        return False
    return prompt.rstrip().endswith(fmt.reasoning.close)


def opens_reasoning(prompt: str, fmt: ChatFormat) -> bool:
    """True if the rendered ``prompt`` leaves a reasoning block open (a template that starts the model's
    thinking itself): the output then begins inside it."""
    if fmt.reasoning is None:
        return False
    return prompt.rfind(fmt.reasoning.open) > prompt.rfind(fmt.reasoning.close)
