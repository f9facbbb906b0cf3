"""The "Adding a model family" recipe of docs/architecture.md, followed for a throwaway family with nothing but what
the recipe names: its folder (written here into a temporary directory: the entry with its reader, and its own
networks over the shared Llama layers), its registry line (the record added to the registry's table, as the line in
``families/__init__.py`` adds it) and this test. No other file knows it, yet preflight reads its model directory and
refuses what it declares it cannot do before a weight is read, and the engine builds the networks its record names
and gives the very tokens the Llama entry gives on the same checkpoint."""
from __future__ import annotations

import json
import shutil

import pytest

from backends.settings import EngineConfig, LoraSettings

pytestmark = pytest.mark.slow  # the engines compile the network

ARCH = "ThrowawayForCausalLM"
ENTRY = '''\
"""A throwaway family: the Llama layers under their own networks, a tied head by default, no adapter slots."""
from functools import partial

from backends.mindspore.families.family import Capabilities, Family
from backends.mindspore.modeldir.llama_config import LayerDefaults, llama_spec

DEFAULTS = LayerDefaults(tied=True)

THROWAWAY = Family(
    name="throwaway", described="a throwaway family", archs=("ThrowawayForCausalLM",),
    read=partial(llama_spec, defaults=DEFAULTS), defaults=DEFAULTS,
    aot="throwaway_family.network:AotThrowaway", stock="throwaway_family.network:StockThrowaway",
    capabilities=Capabilities(lora=False),
)
'''
NETWORK = '''\
"""Its networks: the shared Llama ones, under its own names."""
from backends.mindspore.network.llama import AotLlama, StockLlama


class AotThrowaway(AotLlama):
    pass


class StockThrowaway(StockLlama):
    pass
'''
CONFIG = EngineConfig(max_seq_len=128, max_input_tokens=100, max_batch_size=2, max_iter_times=16, block_size=16,
                      prefill_chunk=32, window_buckets=(128,), batch_buckets=(1, 2), kernels="aot", threads=2)


@pytest.fixture(scope="module")
def throwaway(tmp_path_factory):
    """The family's folder, importable; its record registered for this module's tests only."""
    import sys

    from backends.mindspore import families
    from backends.mindspore.families.family import table

    root = tmp_path_factory.mktemp("families")
    folder = root / "throwaway_family"
    folder.mkdir()
    (folder / "__init__.py").write_text('"""A family kept outside the tree (test_family_recipe.py)."""\n')
    (folder / "entry.py").write_text(ENTRY)
    (folder / "network.py").write_text(NETWORK)
    sys.path.insert(0, str(root))
    from throwaway_family.entry import THROWAWAY

    saved = families.FAMILIES, families.BY_ARCH
    families.FAMILIES = (*families.FAMILIES, THROWAWAY)  # the registry line
    families.BY_ARCH = table(families.FAMILIES)
    yield THROWAWAY
    families.FAMILIES, families.BY_ARCH = saved
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m.split(".")[0] == "throwaway_family"]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def throwaway_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Llama checkpoint declaring the throwaway architecture (config.json and the predict yaml)."""
    out = tmp_path_factory.mktemp("throwaway_model") / "model"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = [ARCH]
    (out / "config.json").write_text(json.dumps(config))
    yaml = out / "predict_tiny.yaml"
    text = yaml.read_text()
    assert "type: LlamaForCausalLM" in text
    yaml.write_text(text.replace("type: LlamaForCausalLM", f"type: {ARCH}"))
    return out


def test_the_registry_reads_its_model_directory(throwaway, throwaway_dir):
    from backends.mindspore.engine.preflight import check_model
    from backends.mindspore.families import family_of, load_model

    assert family_of(ARCH) is throwaway
    spec = load_model(throwaway_dir)
    assert spec.arch == ARCH and spec.tie_word_embeddings
    assert check_model(throwaway_dir, CONFIG).arch == ARCH


def test_what_it_cannot_do_is_refused_before_the_weights(throwaway, throwaway_dir, monkeypatch):
    from backends.mindspore.engine.preflight import ADAPTERS, PreflightError, check_model
    import backends.mindspore.planning.memory as memory

    def opened(*args, **kwargs):
        raise AssertionError("the weights were read before the capability refusal")

    monkeypatch.setattr(memory.Footprint, "of", opened)
    with pytest.raises(PreflightError) as err:
        check_model(throwaway_dir, EngineConfig(lora=LoraSettings(runtime_updates=True)))
    assert err.value.about == ADAPTERS
    assert err.value.detail == (f": LoRA adapters are not supported for a throwaway family ({ARCH}); remove "
                                "LoraModules and allowRuntimeLoraUpdating")


def test_its_engine_runs_its_networks_and_gives_the_llama_tokens(throwaway, throwaway_dir, tiny_model_dir):
    from backends.mindspore.engine.engine import Engine
    from backends.types import RequestParams

    greedy = RequestParams(max_new_tokens=12, do_sample=False, ignore_eos=True)
    prompt = "Once upon a time there was a little robot"
    with Engine(throwaway_dir, CONFIG) as engine:
        assert type(engine.runner.net).__name__ == "AotThrowaway"
        assert type(engine.runner.net).__module__ == "throwaway_family.network"
        got = engine.submit(prompt, greedy).result(timeout=120)
    with Engine(tiny_model_dir, CONFIG) as engine:
        want = engine.submit(prompt, greedy).result(timeout=120)
    assert [t.id for t in got.tokens] == [t.id for t in want.tokens] and len(want.tokens) == 12
