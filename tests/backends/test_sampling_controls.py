"""The per-request controls before the sampling chain: a grammar mask, logit_bias, the EOS ban of
min_tokens / ignore_eos (backends/sampling.py)."""
import numpy as np
import pytest

from backends.logit_processors import LogitBias, SuppressEos, request_processors
from backends.sampling import NextTokenChooser
from backends.types import SamplingParams

GREEDY = SamplingParams(do_sample=False, temperature=1.0, top_k=None, top_p=1.0, typical_p=1.0,
                        repetition_penalty=1.0, watermark=False, seed=7)
SAMPLED = SamplingParams(do_sample=True, temperature=1.0, top_k=None, top_p=1.0, typical_p=1.0,
                         repetition_penalty=1.0, watermark=False, seed=7)
LOGITS = np.array([0.0, 3.0, 1.0, 2.0, -1.0])
EOS = 1  # the best logit


def test_mask_restricts_greedy_and_sampled_and_renormalises():
    allowed = np.array([True, False, True, False, True])
    assert NextTokenChooser(GREEDY).choose(LOGITS, [0], allowed)[0] == 2
    chooser = NextTokenChooser(SAMPLED)
    picks = {chooser.choose(LOGITS, [0], allowed)[0] for _ in range(200)}
    assert picks <= {0, 2, 4} and len(picks) == 3
    token, logprob = NextTokenChooser(GREEDY).choose(LOGITS, [0], allowed)
    expected = 1.0 - np.log(np.exp(0.0) + np.exp(1.0) + np.exp(-1.0))  # softmax over the allowed three
    assert logprob == pytest.approx(expected)


@pytest.mark.parametrize("bias, expected", [({4: 100.0}, 4), ({1: -100.0}, 3), ({1: -100.0, 3: -100.0}, 2)])
def test_logit_bias_forces_and_bans(bias, expected):
    first = request_processors(tuple(bias.items()), (), 0)
    assert NextTokenChooser(GREEDY, first=first).choose(LOGITS, [0])[0] == expected


def test_logit_bias_ignores_ids_past_the_vocabulary():
    assert LogitBias(np.array([99]), np.array([5.0]))(LOGITS.copy(), np.array([])).tolist() == LOGITS.tolist()


def test_eos_banned_until_the_length_then_allowed():
    ban = SuppressEos(np.array([EOS]), until=3)
    assert ban(LOGITS.copy(), np.array([0, 0]))[EOS] == -np.inf
    assert ban(LOGITS.copy(), np.array([0, 0, 0]))[EOS] == 3.0


def test_eos_kept_when_it_is_the_only_choice():
    only_eos = np.array([-np.inf, 3.0, -np.inf, -np.inf, -np.inf])
    assert SuppressEos(np.array([EOS]), until=10)(only_eos.copy(), np.array([0]))[EOS] == 3.0


def test_neutral_values_add_no_processor():
    assert request_processors((), (EOS,), 0) == []
    assert len(request_processors(((1, 2.0),), (EOS,), 5)) == 2
