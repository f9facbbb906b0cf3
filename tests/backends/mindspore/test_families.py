"""The family registry (backends/mindspore/families/): every family resolves from its HF and GGUF names and names
networks that exist; the capability rules refuse before any weight is read, one message per rule."""
from __future__ import annotations

from pathlib import Path

import pytest

from backends.mindspore.families import BY_ARCH, FAMILIES, family_of, refuse_adapters
from backends.mindspore.modeldir.gguf_archs import GGUF_ARCHS, UnsupportedGguf, gguf_arch
from backends.settings import EngineConfig, LoraSettings
from tests.support.make_tiny_gemma3 import make_tiny_gemma3
from tests.support.make_tiny_qwen2_vl import make_tiny_qwen2_vl
from tests.support.make_tiny_qwen3_moe import make_tiny_qwen3_moe

LORA = EngineConfig(lora=LoraSettings(runtime_updates=True))


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


def test_the_adapter_rule_follows_the_declared_capability():
    for family in FAMILIES:
        refuse_adapters(family.archs[0], False)  # never refused without adapters
        if family.capabilities.lora:
            refuse_adapters(family.archs[0], True)
        else:
            with pytest.raises(ValueError, match=rf"^LoRA adapters are not supported for {family.described} "):
                refuse_adapters(family.archs[0], True)


@pytest.fixture(scope="module")
def no_lora_dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny model of every family that takes no adapter slots (files only)."""
    root = tmp_path_factory.mktemp("no_lora")
    return {"gemma3": make_tiny_gemma3(root / "gemma3"), "qwen3_moe": make_tiny_qwen3_moe(root / "qwen3_moe"),
            "qwen2_vl": make_tiny_qwen2_vl(root / "qwen2_vl")}


@pytest.fixture
def weights_untouchable(monkeypatch):
    """Opening a model's weights (or reading their headers for the budget) fails the test."""
    def opened(*args, **kwargs):
        raise AssertionError("the weights were read before the capability refusal")

    import backends.mindspore.engine.engine_parts as parts
    import backends.mindspore.planning.memory as memory

    for module, name in ((parts, "load_weights"), (parts, "load_vl_weights"), (memory.Footprint, "of")):
        monkeypatch.setattr(module, name, opened)


@pytest.mark.parametrize("name", ["gemma3", "qwen3_moe", "qwen2_vl"])
def test_lora_is_refused_in_preflight_before_the_weights(no_lora_dirs, weights_untouchable, name):
    from backends.mindspore.planning.preflight import ADAPTERS, PreflightError, check_model

    family = family_of(next(f.archs[0] for f in FAMILIES if f.name == name))
    with pytest.raises(PreflightError) as err:
        check_model(no_lora_dirs[name], LORA)
    assert err.value.about == ADAPTERS
    assert err.value.detail.startswith(f": LoRA adapters are not supported for {family.described} (")


@pytest.mark.parametrize("name", ["gemma3", "qwen3_moe"])
def test_the_engine_refuses_lora_before_the_weights(no_lora_dirs, weights_untouchable, name):
    """Built without preflight (as bench and tests build it), the engine asks the same rule first."""
    from backends.mindspore.engine.engine_parts import build_parts

    with pytest.raises(ValueError, match="LoRA adapters are not supported for"):
        build_parts(no_lora_dirs[name], LORA)
