"""The per-model parts of the server config: a model's LoRA modules (``LoraModules`` whose baseModelName it is,
checked across entries) and its speculative decoding (``plugin_params``), each error naming its key."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backends.settings import LoraModuleConfig, LoraSettings, SpeculationSettings

DEPLOY = "BackendConfig.ModelDeployConfig"


def resolve(base: Path, value: str | None) -> Path | None:
    """A path of the config file: relative ones are relative to the file's directory ``base``."""
    if value is None:
        return None
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base / path)


def lora_settings(deploy: Any, base: Path, index: int) -> LoraSettings:
    """The LoRA settings of ModelConfig[``index``]: its LoraModules (baseModelName its name), the LoRA keys;
    checked across entries: unique names, none a model's name, a served baseModelName, a loraRoot with runtime
    updates (which go to the first model). ValueError naming the key, the entry and the value."""
    served = [m["modelName"] for m in deploy["ModelConfig"]]
    modules, seen = [], {}
    for i, entry in enumerate(deploy["LoraModules"] or []):
        key = f"{DEPLOY}.LoraModules[{i}]"
        if entry["name"] in seen:
            raise ValueError(f"{key}.name {entry['name']!r} is already the name of LoraModules[{seen[entry['name']]}]; "
                             "adapter names must be unique")
        if entry["baseModelName"] not in served:
            raise ValueError(f"{key}.baseModelName {entry['baseModelName']!r} is not a served model "
                             f"(ModelConfig modelName: {', '.join(map(repr, served))})")
        if entry["name"] in served:
            raise ValueError(f"{key}.name {entry['name']!r} is already the modelName of ModelConfig"
                             f"[{served.index(entry['name'])}]; a request's model must name one of them")
        seen[entry["name"]] = i
        if entry["baseModelName"] == served[index]:
            modules.append(LoraModuleConfig(entry["name"], resolve(base, entry["path"])))
    runtime, root = bool(deploy["allowRuntimeLoraUpdating"]) and index == 0, resolve(base, deploy["loraRoot"])
    if runtime and root is None:
        raise ValueError(f"{DEPLOY}.allowRuntimeLoraUpdating is true but {DEPLOY}.loraRoot is not set: runtime "
                         "loads are taken only from under that directory")
    lora = LoraSettings(modules=tuple(modules), max_loras=deploy["maxLoras"], max_rank=deploy["maxLoraRank"],
                        runtime_updates=runtime, root=root, max_loaded=deploy["maxLoadedLoras"])
    if lora.max_loaded and lora.max_loaded < len(modules):
        raise ValueError(f"{DEPLOY}.maxLoadedLoras {lora.max_loaded} is fewer than the {len(modules)} LoraModules "
                         f"of {served[index]!r}")
    return lora


# plugin_params keys of the speculative plugin types: (default, lowest, highest); dynamic_algo is a boolean,
# draft_model_path a directory (draft_model's, required)
_PLUGIN_INTS = {"decoding_length": (8, 1, 64), "ngram_min": (2, 1, 8), "ngram_max": (3, 1, 8)}
_PLUGIN_KEYS = {"memory_decoding": ("decoding_length", "dynamic_algo", "ngram_min", "ngram_max"),
                "draft_model": ("decoding_length", "dynamic_algo", "draft_model_path")}


def speculation_settings(deploy: Any, model: Any, base: Path, index: int = 0) -> SpeculationSettings:
    """ModelConfig plugin_params (the reference server's JSON string) and speculationGamma -> the speculative
    decoding settings; without plugin_params, speculationGamma > 0 alone is memory_decoding with that
    decoding_length (0: off). plugin_type draft_model (mindserve) drafts with the model at draft_model_path
    (relative: to the config file). ValueError naming the key and the value."""
    key, raw = f"{DEPLOY}.ModelConfig[{index}].plugin_params", model["plugin_params"]
    gamma = deploy["speculationGamma"]
    if not raw:
        return SpeculationSettings(max_draft=gamma)
    try:
        params = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{key} {raw!r} is not a JSON object: {exc}") from None
    if not isinstance(params, dict) or params.get("plugin_type") not in _PLUGIN_KEYS:
        kind = params.get("plugin_type") if isinstance(params, dict) else params
        raise ValueError(f"{key} plugin_type {kind!r} is not supported: mindserve runs \"memory_decoding\" "
                         "(prompt-lookup speculative decoding) and \"draft_model\" (a draft model's proposals)")
    kind = params["plugin_type"]
    unknown = sorted(set(params) - {"plugin_type", *_PLUGIN_KEYS[kind]})
    if unknown:
        raise ValueError(f"{key} has the unknown key {unknown[0]!r} ({kind} takes {', '.join(_PLUGIN_KEYS[kind])})")
    ints = {}
    for name, (default, low, high) in _PLUGIN_INTS.items():
        value = params.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{key} {name} {value!r} must be an integer in [{low}, {high}]")
        ints[name] = value
    adaptive = params.get("dynamic_algo", True)
    if not isinstance(adaptive, bool):
        raise ValueError(f"{key} dynamic_algo {adaptive!r} must be true or false")
    if ints["ngram_min"] > ints["ngram_max"]:
        raise ValueError(f"{key} ngram_min {ints['ngram_min']} must be <= ngram_max {ints['ngram_max']}")
    if gamma and gamma < ints["decoding_length"]:
        raise ValueError(f"{DEPLOY}.speculationGamma {gamma} must be >= plugin_params decoding_length "
                         f"{ints['decoding_length']}")
    draft = None
    if kind == "draft_model":
        path = params.get("draft_model_path")
        if not isinstance(path, str) or not path:
            raise ValueError(f"{key} draft_model_path {path!r} must name the draft model's directory "
                             "(plugin_type draft_model needs it)")
        draft = resolve(base, path)
    return SpeculationSettings(max_draft=ints["decoding_length"], ngram_min=ints["ngram_min"],
                               ngram_max=ints["ngram_max"], adaptive=adaptive, draft_model=draft)
