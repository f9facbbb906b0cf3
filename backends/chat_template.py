"""Render chat messages into one prompt string with a model's Jinja2 chat template (HF `chat_template`).

Pure: template text + messages in, prompt text out. The template runs in Jinja2's immutable sandbox
with the variables HF templates expect (``messages``, ``add_generation_prompt``, ``bos_token``,
``eos_token``, ``raise_exception``, ``strftime_now``).
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from backends.errors import GenerationFailed, InputRejected


class TemplateRejected(jinja2.TemplateError):
    """Raised by a template's own ``raise_exception(...)``: the conversation is not acceptable."""


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """The prompt for ``messages``; a template's ``raise_exception`` → ``InputRejected``.

    Any other template failure (syntax, sandbox violation) is the model's fault → ``GenerationFailed``.
    """
    try:
        compiled = _compile(template)
        return compiled.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **variables,
        )
    except TemplateRejected as exc:
        raise InputRejected(f"messages rejected by the model's chat template: {exc.message}") from None
    except (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError) as exc:
        # e.g. a chat_template_kwargs value of a type the template does not expect
        raise GenerationFailed(f"the model's chat template failed: {exc}") from None


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # trim_blocks/lstrip_blocks: HF renders templates with these, and templates are written for them.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRejected(str(message))


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates want the JSON text as is.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)
