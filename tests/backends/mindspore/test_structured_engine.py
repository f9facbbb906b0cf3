"""Constrained decoding and the sampling controls on the real default model (the session's shared engine):
outputs parse and validate against 22 JSON Schemas, greedy and sampled, batched with unconstrained requests;
a batched constrained request is bit-identical to its solo run; logit_bias bans and forces, ignore_eos runs
to the limit, min_tokens holds EOS back; hostile grammars are refused and the engine goes on."""
from __future__ import annotations

import json

import jsonschema
import pytest

from backends.grammar import GrammarRejected
from backends.types import FinishReason, Grammar, RequestParams
from tests.support.paths import REPO

SCHEMAS = json.loads((REPO / "tests" / "data" / "structured_schemas.json").read_text())["schemas"]
FREE = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


def prompt_for(engine, name: str) -> str:
    return engine.apply_chat_template([{"role": "user", "content": f"Answer in JSON only: an example of {name}."}])


def run_all(engine, requests: list[tuple[str, RequestParams]]):
    handles = [engine.submit(text, params) for text, params in requests]  # all in the engine at once
    return [h.result() for h in handles]


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_outputs_validate_against_every_schema_batched_with_free_requests(default_engine, do_sample):
    names = list(SCHEMAS)
    requests = []
    for i, name in enumerate(names):
        grammar = Grammar("json", json.dumps(SCHEMAS[name]))
        requests.append((prompt_for(default_engine, name),
                         RequestParams(grammar=grammar, do_sample=do_sample, seed=100 + i, max_new_tokens=64)))
        if i % 4 == 0:  # unconstrained rows in the same batches
            requests.append((FREE[i % len(FREE)], RequestParams(max_new_tokens=12, do_sample=do_sample, seed=i + 1)))
    results = run_all(default_engine, requests)
    constrained = [(req, res) for req, res in zip(requests, results) if req[1].grammar is not None]
    assert len(constrained) == len(SCHEMAS) >= 20
    wrong = []
    for (_, params), result in constrained:
        schema = json.loads(params.grammar.value)
        try:
            assert result.finish_reason is FinishReason.EOS_TOKEN, "cut by the length"
            jsonschema.validate(json.loads(result.generated_text), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            wrong.append((schema, result.generated_text, str(exc)[:200]))
    assert not wrong, wrong


def test_regex_output_fullmatches(default_engine):
    import re

    for pattern in (r"(yes|no)", r"[A-Z][a-z]{2,8} [0-9]{1,3}", r"\d{3}-\d{4}"):
        result = default_engine.generate("Answer:", RequestParams(grammar=Grammar("regex", pattern), max_new_tokens=40))
        assert re.fullmatch(pattern, result.generated_text), (pattern, result.generated_text)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_batched_constrained_request_is_bit_identical_to_its_solo_run(default_engine, do_sample):
    grammar = Grammar("json", json.dumps(SCHEMAS["person"]))
    params = RequestParams(grammar=grammar, do_sample=do_sample, seed=7, max_new_tokens=48)
    text = prompt_for(default_engine, "a person")
    solo = default_engine.generate(text, params)
    batch = run_all(default_engine, [(FREE[0], RequestParams(max_new_tokens=30)), (text, params),
                                     (FREE[1], RequestParams(max_new_tokens=20, do_sample=True, seed=3)),
                                     (FREE[2], RequestParams(grammar=Grammar("regex", "[a-z ]{1,40}"),
                                                             max_new_tokens=30))])
    assert [(t.id, t.logprob) for t in batch[1].tokens] == [(t.id, t.logprob) for t in solo.tokens]
    assert batch[1].generated_text == solo.generated_text


def test_logit_bias_bans_and_forces(default_engine):
    text = FREE[0]
    plain = default_engine.generate(text, RequestParams(max_new_tokens=3))
    first = plain.tokens[0].id
    banned = default_engine.generate(text, RequestParams(max_new_tokens=3, logit_bias=((first, -100.0),)))
    assert first not in [t.id for t in banned.tokens]
    forced_id = default_engine.tokenize(" banana")[-1]
    forced = default_engine.generate(text, RequestParams(max_new_tokens=3, logit_bias=((forced_id, 100.0),)))
    assert [t.id for t in forced.tokens] == [forced_id] * 3


def test_logit_bias_outside_the_vocabulary_is_refused(default_engine):
    with pytest.raises(GrammarRejected.__mro__[1], match="logit_bias"):  # ParameterRejected
        default_engine.submit("x", RequestParams(logit_bias=((default_engine.vocab_size, 1.0),)))


def test_ignore_eos_runs_to_max_new_tokens(default_engine):
    chat = default_engine.apply_chat_template([{"role": "user", "content": "Say hi."}])
    ends = default_engine.generate(chat, RequestParams(max_new_tokens=60))
    assert ends.finish_reason is FinishReason.EOS_TOKEN  # the model would stop early
    result = default_engine.generate(chat, RequestParams(max_new_tokens=60, ignore_eos=True))
    assert result.generated_tokens == 60 and result.finish_reason is FinishReason.LENGTH
    assert not default_engine.eos_ids & {t.id for t in result.tokens}


def test_min_tokens_holds_back_eos(default_engine):
    chat = default_engine.apply_chat_template([{"role": "user", "content": "Say hi."}])
    natural = default_engine.generate(chat, RequestParams(max_new_tokens=60)).generated_tokens
    held = default_engine.generate(chat, RequestParams(max_new_tokens=60, min_tokens=natural + 5))
    ids = [t.id for t in held.tokens]
    assert len(ids) >= natural + 5
    assert not default_engine.eos_ids & set(ids[: natural + 4])


HOSTILE = {
    "deep recursion": Grammar("json", '{"type":"object","required":["a"],"properties":{"a":' * 1000
                              + '{"type":"integer"}' + "}}" * 1000),
    "huge enum": Grammar("json", json.dumps({"enum": [f"value-{i}" for i in range(100_000)]})),
    "enum at the size bound": Grammar("json", json.dumps({"enum": [f"v{i}" for i in range(7_000)]})),
    "catastrophic regex, unclosed": Grammar("regex", "(a+)+(b+)+" * 300 + "("),
    "catastrophic regex": Grammar("regex", "((a+)+(b+)+c)" * 300),  # nested quantifiers: no backtracking here
    "nested stars": Grammar("regex", "(x*)*y" * 1000),
    "huge repetition": Grammar("regex", "[a-z]{1000}{1000}"),
    "unclosed regex": Grammar("regex", "a(b"),
    "unknown type": Grammar("json", '{"type": "objectx"}'),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_grammars_are_refused_quickly_and_the_engine_goes_on(default_engine, name):
    import time

    started = time.perf_counter()
    try:
        handle = default_engine.submit("x", RequestParams(grammar=HOSTILE[name], max_new_tokens=4))
    except GrammarRejected as exc:
        assert str(exc)
    else:  # compiled within the bounds: it must still generate, not hang
        assert handle.result().generated_tokens <= 4
    assert time.perf_counter() - started < 5.0
    assert default_engine.generate(FREE[0], RequestParams(max_new_tokens=2)).generated_tokens == 2


def test_mask_cost_is_measured(default_engine):
    before = default_engine.masks.stats.masks
    default_engine.generate("x", RequestParams(grammar=Grammar("regex", "[0-9]{5}"), max_new_tokens=8))
    stats = default_engine.masks.stats
    assert stats.masks - before >= 5 and 0 < stats.ms_per_token < 50
