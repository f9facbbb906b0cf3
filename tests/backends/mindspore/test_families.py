"""The family registry (backends/mindspore/families/): every family resolves from its HF and GGUF names and names
networks that exist; the capability rules refuse before any weight is read, one message per rule."""
from __future__ import annotations

from pathlib import Path

import pytest

from backends.mindspore.families import BY_ARCH, FAMILIES, family_of, refuse_adapters
from backends.mindspore.sources.gguf_archs import GGUF_ARCHS, UnsupportedGguf, gguf_arch
from backends.settings import EngineConfig, LoraSettings
from tests.support.families import BY_NAME, CHECKPOINTS, GOLDEN, TINY

LORA = EngineConfig(lora=LoraSettings(runtime_updates=True))
NO_LORA = [f.name for f in FAMILIES if not f.capabilities.lora]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_resolves_from_each_hf_name(family):
    assert family.archs and all(family_of(arch) is family for arch in family.archs)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.gguf is not None], ids=lambda f: f.name)
def test_every_gguf_family_resolves_from_its_gguf_name(family):
    arch = gguf_arch({"general.architecture": family.gguf.name})
    assert arch is family.gguf and GGUF_ARCHS[arch.name] is arch
    assert family_of(arch.hf_arch) is family  # the converted directory is read by the same family


def test_an_unknown_name_resolves_to_nothing():
    assert family_of("GPT2LMHeadModel") is None
    with pytest.raises(UnsupportedGguf, match="'gpt2'.*'llama'"):
        gguf_arch({"general.architecture": "gpt2"})


def test_no_architecture_is_claimed_twice():
    assert len(BY_ARCH) == sum(len(f.archs) for f in FAMILIES)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_names_networks_that_exist(family):
    aot, stock = family.network("aot"), family.network("stock")
    assert aot is not stock and aot.__name__.startswith("Aot") and stock.__name__.startswith("Stock")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_a_family_takes_media_exactly_when_it_names_a_vision_part(family):
    """Media parts are admitted by the capability and run by the part: either one alone would drop them or refuse
    them late."""
    assert bool(family.vision) == family.capabilities.vision
    if family.vision:
        part = family.vision_part()
        assert all(callable(getattr(part, name, None))
                   for name in ("read_weights", "chat_template", "prompt", "encode_reached", "warmup"))


def test_the_adapter_rule_follows_the_declared_capability():
    for family in FAMILIES:
        refuse_adapters(family.archs[0], False)  # never refused without adapters
        if family.capabilities.lora:
            refuse_adapters(family.archs[0], True)
        else:
            with pytest.raises(ValueError, match=rf"^LoRA adapters are not supported for {family.described} "):
                refuse_adapters(family.archs[0], True)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Every family's tiny checkpoint (tests/support/families.py; files only)."""
    root = tmp_path_factory.mktemp("tiny")
    return {t.name: t.checkpoint.make(root / t.name) for t in TINY}


def test_every_family_has_a_tiny_checkpoint_in_the_tests_table():
    """tests/support/families.py names each registry entry's checkpoint, and nothing else."""
    assert set(CHECKPOINTS) == {f.name for f in FAMILIES} and [t.family for t in TINY] == list(FAMILIES)
    assert {t.name for t in GOLDEN} >= {"qwen3", "qwen3_moe", "gemma3"}


@pytest.mark.parametrize("tiny", TINY, ids=str)
def test_every_tiny_checkpoint_names_its_family_and_its_window(tiny_dirs, tiny):
    """config.json's architecture resolves to the entry's family; a family that declares sliding-window layers has
    the window the table states (which the window checks rely on), and only such a family states one."""
    import json

    config = json.loads((tiny_dirs[tiny.name] / "config.json").read_text())
    assert family_of(config["architectures"][0]) is tiny.family
    if tiny.family.capabilities.sliding_window:
        assert config["sliding_window"] == tiny.checkpoint.sliding_window
    else:
        assert tiny.checkpoint.sliding_window is None


@pytest.fixture
def weights_untouchable(monkeypatch):
    """Opening a model's weights (or reading their headers for the budget) fails the test."""
    def opened(*args, **kwargs):
        raise AssertionError("the weights were read before the capability refusal")

    import backends.mindspore.engine.engine_parts as parts
    import backends.mindspore.planning.memory as memory

    for module, name in ((parts, "load_weights"), (parts, "_read_weights"), (memory.Footprint, "of")):
        monkeypatch.setattr(module, name, opened)


@pytest.mark.parametrize("name", NO_LORA)
def test_lora_is_refused_in_preflight_before_the_weights(tiny_dirs, weights_untouchable, name):
    from backends.mindspore.engine.preflight import ADAPTERS, PreflightError, check_model

    family = BY_NAME[name].family
    with pytest.raises(PreflightError) as err:
        check_model(tiny_dirs[name], LORA)
    assert err.value.about == ADAPTERS
    assert err.value.detail.startswith(f": LoRA adapters are not supported for {family.described} (")


@pytest.mark.parametrize("name", NO_LORA)
def test_the_engine_refuses_lora_before_the_weights(tiny_dirs, weights_untouchable, name):
    """Built without preflight (as bench and tests build it), the engine asks the same rule first."""
    from backends.mindspore.engine.engine_parts import build_parts

    with pytest.raises(ValueError, match="LoRA adapters are not supported for"):
        build_parts(tiny_dirs[name], LORA)
