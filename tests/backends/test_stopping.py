"""Stopper: precedence length → eos → stop sequence, stop strings anywhere, held-back text."""
import random

import pytest

from backends.stopping import Stopper
from backends.types import FinishReason

LENGTH, EOS, STOP = FinishReason.LENGTH, FinishReason.EOS_TOKEN, FinishReason.STOP_SEQUENCE
EOS_ID = 0


def run(stopper: Stopper, pushes) -> tuple[list[str], list]:
    """Push (id, delta) pairs (or bare deltas, id 9) until a finish; return emits and finishes."""
    emits, finishes = [], []
    for push in pushes:
        token_id, delta = push if isinstance(push, tuple) else (9, push)
        outcome = stopper.push(token_id, delta)
        emits.append(outcome.emit_text)
        finishes.append(outcome.finish)
        if outcome.finish is not None:
            break
    return emits, finishes


@pytest.mark.parametrize(
    "max_new, eos_ids, stop, pushes, reason, steps, text",
    [
        (3, {EOS_ID}, (), ["a", "b", "c"], LENGTH, 3, "abc"),
        (5, {EOS_ID}, (), ["a", (EOS_ID, "</s>")], EOS, 2, "a"),
        # length is checked first: an EOS on the last allowed step reports length
        (2, {EOS_ID}, (), ["a", (EOS_ID, "</s>")], LENGTH, 2, "a"),
        (1, {EOS_ID}, (), [(EOS_ID, "</s>")], LENGTH, 1, ""),
        (5, {EOS_ID, 2}, (), ["a", (2, "<|im_end|>")], EOS, 2, "a"),
        (5, {EOS_ID}, ("c",), ["a", "b", "c", "d"], STOP, 3, "ab"),
        # a stop string completed on the last allowed step: reason length, text still cut
        (3, {EOS_ID}, ("c",), ["a", "b", "xcy"], LENGTH, 3, "abx"),
        # EOS text is not generated text, so it cannot complete a stop string
        (5, {EOS_ID}, ("</s>",), ["a", (EOS_ID, "</s>")], EOS, 2, "a"),
        (5, set(), (), ["a", (EOS_ID, "</s>"), "b"], None, 3, "a</s>b"),  # no eos ids: an ordinary token
    ],
)
def test_precedence(max_new, eos_ids, stop, pushes, reason, steps, text):
    stopper = Stopper(max_new, eos_ids, stop)
    emits, finishes = run(stopper, pushes)
    assert len(finishes) == steps
    assert finishes[-1] == reason and finishes[:-1] == [None] * (steps - 1)
    assert "".join(emits) == text
    assert stopper.generated_tokens == steps
    if reason is not None:
        assert stopper.generated_text == text and stopper.finish == reason


@pytest.mark.parametrize(
    "deltas, stop, text, steps",
    [
        (["Hel", "lo wo", "rld"], ["o w"], "Hell", 2),  # spans a token boundary
        (["The capital is", " Paris", "."], ["Pari"], "The capital is ", 2),  # inside one token
        (["a", "b", "c", "d"], ["bcd"], "a", 4),  # spans three tokens
        (["xabcdef"], ["cd", "b"], "xa", 1),
        # the first stop string to complete wins, however the text is split into tokens
        (["xab", "cd"], ["abcd", "bc"], "xa", 2),
        (["xabcd"], ["abcd", "bc"], "xa", 1),
        (["x", "a", "b", "c", "d"], ["abcd", "bc"], "xa", 4),
        (["xabc"], ["c", "abc"], "x", 1),  # two complete together: the longer one cuts
        (["aa", "ab"], ["aab"], "a", 2),  # overlapping partial matches
        (["EN", "D"], ["END"], "", 2),
        (["héllo", " wörld"], ["ö"], "héllo w", 2),
        (["line\n", "\nnext"], ["\n\n"], "line", 2),
    ],
)
def test_stop_strings_match_anywhere(deltas, stop, text, steps):
    stopper = Stopper(100, {EOS_ID}, stop)
    emits, finishes = run(stopper, deltas)
    assert finishes == [None] * (steps - 1) + [STOP]
    assert "".join(emits) == text == stopper.generated_text


@pytest.mark.parametrize(
    "max_new, stop, pushes, emits, reason",
    [
        # "E", then "EN", may begin "END": held back until "x" rules it out
        (100, ["END"], ["foo E", "N", "x", "E", "ND"], ["foo ", "", "ENx", "", ""], STOP),
        # held "ab" is output after all when the match starts later
        (100, ["abc"], ["xab", "abc"], ["x", "ab"], STOP),
        (100, ["abc", "b"], ["xa", "b"], ["x", "a"], STOP),  # "a" was held for "abc"
        # finishing by length or eos releases what was held
        (2, ["END"], ["a", "EN"], ["a", "EN"], LENGTH),
        (5, ["END"], ["aE", (EOS_ID, "</s>")], ["a", "E"], EOS),
        (100, [], ["ab", "c", ""], ["ab", "c", ""], None),
    ],
)
def test_held_back_text(max_new, stop, pushes, emits, reason):
    stopper = Stopper(max_new, {EOS_ID}, stop)
    got, finishes = run(stopper, pushes)
    assert got == emits
    assert finishes[-1] == reason


def test_cancel_releases_held_text():
    stopper = Stopper(100, {EOS_ID}, ["END"])
    assert stopper.push(5, "okE").emit_text == "ok"
    outcome = stopper.cancel()
    assert (outcome.emit_text, outcome.finish) == ("E", STOP)
    assert stopper.generated_text == "okE"


def test_push_after_finish_and_empty_stop_are_errors():
    stopper = Stopper(1, {EOS_ID})
    stopper.push(5, "a")
    with pytest.raises(RuntimeError):
        stopper.push(6, "b")
    with pytest.raises(ValueError):
        Stopper(5, {EOS_ID}, ["ok", ""])


def reference_output(text: str, stops: list[str]) -> tuple[str, bool]:
    """Shortest prefix that contains a stop string, minus the longest stop string it ends with."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return text[: end - max(map(len, ending))], True
    return text, False


def reference_held(text: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@pytest.mark.parametrize("seed", range(300))
def test_stream_concatenation_equals_final_text(seed):
    rng = random.Random(seed)
    alphabet = "abé"
    stops = [''.join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    text = ''.join(rng.choices(alphabet, k=rng.randint(0, 30)))
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 8))))
    deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    stopper = Stopper(len(deltas), {EOS_ID}, stops)
    released, seen = "", ""
    for i, delta in enumerate(deltas):
        outcome = stopper.push(9, delta)
        released += outcome.emit_text
        seen += delta
        if outcome.finish is not None:
            break
        # nothing more is held back than a possible stop-string start
        assert released == seen[: len(seen) - reference_held(seen, stops)]
    want, matched = reference_output(text, stops)
    assert released == stopper.generated_text == want
    last = i == len(deltas) - 1
    assert outcome.finish == (LENGTH if last else STOP)
    assert matched or last
