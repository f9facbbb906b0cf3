"""Real clients against the live server: the HuggingFace ``text-generation`` client (unmodified, 0.7.0) and
the README's curl examples, run as written."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from typing import Any

import pytest
import text_generation
from text_generation.types import FinishReason

from service.validation import default_schemas
from tests.support.golden import (
    EOS_PROMPT,
    GREEDY_TEXT,
    NUMPY_GOLDEN,
    PROMPT,
    PROMPT_IDS,
)
from tests.support.http import TIMEOUT, parse_sse
from tests.support.paths import REPO

README = REPO / "README.md"
TEN_TOKENS = "'m here to help you with your business. I"  # the first 10 greedy tokens


@pytest.fixture(params=["list", "int"])
def any_ids_url(request: Any, server_url: str, server_url_int_ids: str) -> str:
    return server_url if request.param == "list" else server_url_int_ids


# --- HuggingFace text-generation client ---------------------------------------------------------------

def test_hf_generate(any_ids_url: str) -> None:
    client = text_generation.Client(any_ids_url, timeout=TIMEOUT)
    response = client.generate(PROMPT, max_new_tokens=20)  # the client always asks for details
    assert response.generated_text == GREEDY_TEXT
    details = response.details
    assert [t.id for t in details.tokens] == NUMPY_GOLDEN["generated_ids"]
    assert "".join(t.text for t in details.tokens) == GREEDY_TEXT
    assert all(t.special is False and t.logprob is not None and t.logprob <= 0 for t in details.tokens)
    assert details.finish_reason == FinishReason.Length and details.generated_tokens == 20
    assert details.prefill == [] and isinstance(details.seed, int)


def test_hf_generate_with_prefill_and_parameters(any_ids_url: str) -> None:
    client = text_generation.Client(any_ids_url, timeout=TIMEOUT)
    response = client.generate(PROMPT, max_new_tokens=10, decoder_input_details=True, stop_sequences=["business"],
                               return_full_text=True, seed=5, truncate=100, repetition_penalty=1.0)
    assert response.generated_text == PROMPT + "'m here to help you with your "
    assert [t.id for t in response.details.prefill] == PROMPT_IDS
    assert response.details.prefill[0].logprob is None
    assert response.details.finish_reason == FinishReason.StopSequence
    assert response.details.seed == 5


def test_hf_generate_sampling_is_seeded(server_url_int_ids: str) -> None:
    client = text_generation.Client(server_url_int_ids, timeout=TIMEOUT)
    kwargs = {"do_sample": True, "temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 31, "max_new_tokens": 8}
    first = client.generate(PROMPT, **kwargs)
    assert client.generate(PROMPT, **kwargs).generated_text == first.generated_text
    streamed = list(client.generate_stream(PROMPT, **kwargs))
    assert [e.token.id for e in streamed] == [t.id for t in first.details.tokens]
    assert streamed[-1].generated_text == first.generated_text


@pytest.mark.parametrize("prompt, max_new_tokens, finish", [
    (PROMPT, 10, FinishReason.Length),
    (EOS_PROMPT, 30, FinishReason.EndOfSequenceToken),
])
def test_hf_generate_stream(server_url_int_ids: str, prompt: str, max_new_tokens: int, finish: FinishReason) -> None:
    client = text_generation.Client(server_url_int_ids, timeout=TIMEOUT)
    events = list(client.generate_stream(prompt, max_new_tokens=max_new_tokens))
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    final = events[-1]
    assert final.generated_text == "".join(e.token.text for e in events if not e.token.special)
    assert final.details.finish_reason == finish
    assert final.details.generated_tokens == len(events)
    if prompt == PROMPT:
        assert final.generated_text == TEN_TOKENS
        assert [e.token.id for e in events] == NUMPY_GOLDEN["generated_ids"][:10]
    else:
        assert events[-1].token.special and final.generated_text == client.generate(prompt).generated_text


def test_hf_errors_are_raised_with_the_server_message(any_ids_url: str, default_engine: Any) -> None:
    client = text_generation.Client(any_ids_url, timeout=TIMEOUT)
    too_long = " ".join(["word"] * 300)
    count = default_engine.count_tokens(too_long)
    with pytest.raises(Exception) as caught:
        client.generate(too_long, max_new_tokens=2)
    # POST /'s error_type strings (docs/api.md) are not TGI's ("validation"...), so the client maps by status:
    # 422 → Unknown.
    assert type(caught.value).__module__ == "text_generation.errors", repr(caught.value)
    assert f"{count} tokens" in str(caught.value) and "200" in str(caught.value)
    with pytest.raises(Exception) as caught:
        list(client.generate_stream(too_long, max_new_tokens=2))
    assert type(caught.value).__module__ == "text_generation.errors", repr(caught.value)


def test_hf_stream_needs_int_ids(server_url: str) -> None:
    """POST /'s list-shaped token.id (docs/api.md) is not what the client parses: why tokenIdFormat "int" exists."""
    client = text_generation.Client(server_url, timeout=TIMEOUT)
    with pytest.raises(KeyError, match="error"):
        list(client.generate_stream(PROMPT, max_new_tokens=2))


# --- README "Try it" -------------------------------------------------------------------------------

def _try_it_section() -> str:
    match = re.search(r"^## Try it\n(.*?)(?=^## )", README.read_text(encoding="utf-8"), re.S | re.M)
    assert match, "README.md has no '## Try it' section"
    return match.group(1)


def _split_outputs(out: str) -> tuple[Any, list[dict[str, Any]], Any]:
    """The three bodies curl printed back to back: a JSON list, an SSE stream, a JSON error."""
    first, end = json.JSONDecoder().raw_decode(out)
    rest = out[end:]
    cut = rest.rindex("\n\n") + 2
    return first, parse_sse(rest[:cut]), json.loads(rest[cut:])


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed (the README examples use it)")
def test_readme_curl_examples(server_url: str) -> None:
    section = _try_it_section()
    scripts = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(scripts) == 1, scripts
    done = subprocess.run(["bash", "-e", "-c", scripts[0]], env={**os.environ, "URL": server_url},
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    first, events, error = _split_outputs(done.stdout)
    schemas = default_schemas()

    schemas.validate("response", first, root="first output")
    assert first == [{"generated_text": GREEDY_TEXT}]
    assert GREEDY_TEXT == "'m here to help you with your business. I'll be your go-to person to ensure your"

    assert len(events) == 5
    for event in events:
        schemas.validate("stream_event", event, root="second output")
    assert all(e["generated_text"] is None for e in events[:-1])
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)

    schemas.validate("error", error, root="third output")
    assert error == {"error": "parameters.top_p must be < 1.0, got 1.0", "error_type": "Input Validation Error"}

    # What the prose under the block promises is what came out.
    claimed_first = re.search(r"The first answers `(.*?)`", section, re.S).group(1)
    assert json.loads(claimed_first) == first
    claimed_third = re.search(r"a 422\s+`(\{.*?\})`", section, re.S).group(1)
    assert json.loads(claimed_third) == error
