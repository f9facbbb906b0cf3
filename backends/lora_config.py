"""A PEFT ``adapter_config.json`` read and checked against the base model: which (layer, projection) modules an
adapter targets and each one's rank and scale, matched the way PEFT matches (``target_modules``,
``layers_to_transform``, ``exclude_modules``, ``rank_pattern``/``alpha_pattern``). No tensor is read here."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends import bounded_json

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
MAX_VALUE = 1024  # r, lora_alpha and every pattern value lie in (0, MAX_VALUE]
CONFIG_CAP = 1 << 20  # bytes of adapter_config.json read at most
CONFIG_DEPTH = 16  # PEFT's own nest 3 deep (layer_replication, the variants' configs)
EMBEDDINGS = ("model.embed_tokens", "lm_head")
_LAYER_PARTS = ("", ".self_attn", ".mlp", ".input_layernorm", ".post_attention_layernorm", ".mlp.act_fn",
                ".self_attn.rotary_emb")
_TOP_MODULES = ("model", "model.layers", "model.norm", "model.rotary_emb")
# LoRA variants and options whose forward pass is not W x + scale * B A x on the seven projections.
_REFUSED = {
    "use_dora": "DoRA (use_dora) is not supported",
    "fan_in_fan_out": "fan_in_fan_out (transposed Conv1D-style weights) is not supported",
    "modules_to_save": "modules_to_save (fully trained copies of base modules) is not supported",
    "lora_bias": "lora_bias (a trained bias on lora_B) is not supported",
    "target_parameters": "target_parameters (LoRA on bare parameters) is not supported",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows) is not supported",
    "layer_replication": "layer_replication is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    **{key: f"the LoRA variant {key} is not supported"
       for key in ("velora_config", "monteclora_config", "use_bdlora", "arrow_config", "kasa_config")},
}
# init_lora_weights values that rewrite the base weights: the adapter only works on the modified base.
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter, the file and the tensor or key."""

    def __init__(self, adapter: str, file: Path | str, detail: str, key: str | None = None) -> None:
        super().__init__(f"LoRA adapter {adapter!r}: {file}: {detail}")
        self.adapter, self.file, self.key = adapter, str(file), key


@dataclass(frozen=True, slots=True)
class BaseDims:
    """The base model's shapes, what an adapter is checked against."""

    num_layers: int
    hidden: int  # hidden_size
    q_out: int  # num_heads * head_dim
    kv_out: int  # num_kv_heads * head_dim
    intermediate: int

    def shape(self, proj: str) -> tuple[int, int]:
        """(in_features, out_features) of a projection."""
        return {"q_proj": (self.hidden, self.q_out), "k_proj": (self.hidden, self.kv_out),
                "v_proj": (self.hidden, self.kv_out), "o_proj": (self.q_out, self.hidden),
                "gate_proj": (self.hidden, self.intermediate), "up_proj": (self.hidden, self.intermediate),
                "down_proj": (self.intermediate, self.hidden)}[proj]

    @classmethod
    def of(cls, spec: Any) -> BaseDims:
        """From a ``backends.mindspore.modeldir.spec.ModelSpec`` (or anything with its attribute names)."""
        return cls(spec.num_layers, spec.hidden_size, spec.num_heads * spec.head_dim,
                   spec.num_kv_heads * spec.head_dim, spec.intermediate_size)


@dataclass(frozen=True, slots=True)
class ModulePlan:
    rank: int
    scale: float
    rank_key: str  # the config key that set the rank ("r" or "rank_pattern[...]"), for messages


@dataclass(frozen=True, slots=True)
class AdapterPlan:
    """What adapter_config.json asks for, checked against the base model."""

    rank: int  # r
    alpha: float  # lora_alpha
    use_rslora: bool
    scale: float  # the default (non-pattern) scale
    modules: Mapping[tuple[int, str], ModulePlan]  # (layer, projection) -> rank and scale


def module_name(layer: int, proj: str) -> str:
    """The module's name in the HF model, the name PEFT matches its config keys against."""
    return f"model.layers.{layer}.{BLOCK[proj]}.{proj}"


def lora_scale(alpha: float, rank: int, use_rslora: bool) -> float:
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def read_plan(adapter: str, file: Path, dims: BaseDims, max_rank: int | None = None) -> AdapterPlan:
    """Read ``file`` (an adapter_config.json) and check every rule; AdapterError names the key that fails."""
    fail = _Failer(adapter, file)
    config = _read_json(fail, file)
    _check_features(fail, config)
    r = _number(fail, "r", config.get("r"), integer=True)
    alpha = _number(fail, "lora_alpha", config.get("lora_alpha"), integer=False)
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise fail(f"`use_rslora` must be true or false, got {use_rslora!r}", "use_rslora")
    ranks = _patterns(fail, config, "rank_pattern", integer=True)
    alphas = _patterns(fail, config, "alpha_pattern", integer=False)
    modules = {}
    for layer, proj in _targeted(fail, config, dims.num_layers):
        name = module_name(layer, proj)
        rank_key, rank = _pattern_value(ranks, name) or ("r", r)
        alpha_here = (_pattern_value(alphas, name) or ("lora_alpha", alpha))[1]
        if max_rank is not None and rank > max_rank:
            raise fail(f"rank {rank} of module {name} (from `{rank_key}`) exceeds maxLoraRank {max_rank}", rank_key)
        modules[(layer, proj)] = ModulePlan(rank, lora_scale(alpha_here, rank, use_rslora), rank_key)
    return AdapterPlan(r, alpha, use_rslora, lora_scale(alpha, r, use_rslora), modules)


class _Failer:
    def __init__(self, adapter: str, file: Path) -> None:
        self.adapter, self.file = adapter, file

    def __call__(self, detail: str, key: str | None = None) -> AdapterError:
        return AdapterError(self.adapter, self.file, detail, key)


def _read_json(fail: _Failer, file: Path) -> dict[str, Any]:
    try:
        with file.open("rb") as f:  # never more than the file's size is allocated (read(n) allocates n)
            raw = f.read(min(os.fstat(f.fileno()).st_size, CONFIG_CAP) + 1)
    except OSError as exc:
        raise fail(f"cannot be read: {exc.strerror or exc}") from None
    if len(raw) > CONFIG_CAP:
        raise fail(f"is larger than {CONFIG_CAP} bytes")
    try:
        config = bounded_json.loads(raw, max_depth=CONFIG_DEPTH)
    except ValueError as exc:
        raise fail(f"is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise fail(f"must hold a JSON object, not a {type(config).__name__}")
    return config


def _check_features(fail: _Failer, config: dict[str, Any]) -> None:
    if config.get("peft_type") != "LORA":
        raise fail(f"`peft_type` must be \"LORA\", got {config.get('peft_type')!r}", "peft_type")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise fail(f"`task_type` must be \"CAUSAL_LM\", got {config['task_type']!r}", "task_type")
    for key, why in _REFUSED.items():
        if config.get(key):
            raise fail(f"{why} (`{key}` is {config[key]!r})", key)
    if config.get("bias", "none") != "none":
        raise fail(f"`bias` must be \"none\" (trained biases are not supported), got {config['bias']!r}", "bias")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise fail(f"`init_lora_weights` {init!r} rewrites the base weights, so the adapter needs that modified "
                   "base; save it from PEFT with path_initial_model_for_weight_conversion to get a plain LoRA",
                   "init_lora_weights")


def _number(fail: _Failer, key: str, value: Any, *, integer: bool) -> Any:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value <= MAX_VALUE:
        what = "an integer" if integer else "a number"
        raise fail(f"`{key}` must be {what} in (0, {MAX_VALUE}], got {value!r}", key)
    return value


def _patterns(fail: _Failer, config: dict[str, Any], key: str, *, integer: bool) -> dict[re.Pattern, tuple]:
    """``rank_pattern``/``alpha_pattern``: each key compiled the way PEFT matches it against a module name
    (``(.*\\.)?(key)$`` from the start: the key matches the end of the name, at a dot boundary)."""
    patterns = config.get(key) or {}
    if not isinstance(patterns, dict):
        raise fail(f"`{key}` must be an object mapping module names to values, got {patterns!r}", key)
    out = {}
    for pattern, value in patterns.items():
        entry = f"{key}[{pattern!r}]"
        try:
            compiled = re.compile(rf"(.*\.)?({pattern})$")
        except re.error as exc:
            raise fail(f"`{entry}` is not a valid regular expression: {exc}", entry) from None
        out[compiled] = (entry, _number(fail, entry, value, integer=integer))
    return out


def _pattern_value(patterns: dict[re.Pattern, tuple], name: str) -> tuple | None:
    """The first pattern (in file order, as PEFT) matching module ``name``: (its config key, its value)."""
    return next((entry for compiled, entry in patterns.items() if compiled.match(name)), None)


def _targeted(fail: _Failer, config: dict[str, Any], num_layers: int) -> list[tuple[int, str]]:
    """The (layer, projection) modules ``target_modules`` selects, less ``exclude_modules``, in layer order."""
    names = {(layer, proj): module_name(layer, proj) for layer in range(num_layers) for proj in PROJECTIONS}
    targets = config.get("target_modules")
    if targets == "all-linear":  # PEFT's shorthand, expanded before matching: every linear layer but the head
        targets = list(PROJECTIONS)
    if isinstance(targets, str):
        chosen = _regex_targets(fail, config, targets, names, num_layers)
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        for target in targets:
            _check_listed_target(fail, target, names.values())
        chosen = _layer_filter(fail, config, [k for k, n in names.items() if any(_ends(t, n) for t in targets)],
                               num_layers)
    else:
        raise fail(f"`target_modules` must be a non-empty list of module names or a regular expression, "
                   f"got {targets!r}", "target_modules")
    chosen = [k for k in chosen if not _excluded(fail, config.get("exclude_modules"), names[k])]
    if not chosen:
        raise fail("`target_modules` (with layers_to_transform and exclude_modules) selects no module of the "
                   "base model", "target_modules")
    return chosen


def _ends(target: str, name: str) -> bool:
    """PEFT's list rule: the module name is the target or ends with '.' + target."""
    return name == target or name.endswith("." + target)


def _other_modules(num_layers: int) -> list[str]:
    return [*_TOP_MODULES, *(f"model.layers.{i}{part}" for i in range(num_layers) for part in _LAYER_PARTS)]


def _check_listed_target(fail: _Failer, target: str, names: Any) -> None:
    entry = f"target_modules[{target!r}]"
    if any(_ends(target, e) for e in EMBEDDINGS):
        raise fail(f"{target!r} in `target_modules` is unsupported: LoRA on embed_tokens or lm_head is not "
                   f"served (only {', '.join(PROJECTIONS)})", entry)
    if not any(_ends(target, n) for n in names):
        raise fail(f"{target!r} in `target_modules` is not a projection of the base model "
                   f"(supported: {', '.join(PROJECTIONS)})", entry)


def _regex_targets(fail: _Failer, config: dict[str, Any], regex: str, names: dict,
                   num_layers: int) -> list[tuple[int, str]]:
    for key in ("layers_to_transform", "layers_pattern"):
        if config.get(key) is not None:
            raise fail(f"`{key}` cannot be used when `target_modules` is a regular expression (as in PEFT)", key)
    try:
        compiled = re.compile(regex)
    except re.error as exc:
        raise fail(f"`target_modules` {regex!r} is not a valid regular expression: {exc}", "target_modules") from None
    for other in [*EMBEDDINGS, *_other_modules(num_layers)]:
        if compiled.fullmatch(other):
            what = "unsupported (embed_tokens and lm_head are not served)" if other in EMBEDDINGS else \
                f"not a projection (supported: {', '.join(PROJECTIONS)})"
            raise fail(f"`target_modules` {regex!r} matches module {other}, which is {what}", "target_modules")
    return [k for k, n in names.items() if compiled.fullmatch(n)]


def _layer_filter(fail: _Failer, config: dict[str, Any], chosen: list, num_layers: int) -> list:
    """``layers_to_transform`` (with ``layers_pattern``), honoured as PEFT does for list targets."""
    layers, pattern = config.get("layers_to_transform"), config.get("layers_pattern")
    if pattern and layers is None:
        raise fail("`layers_pattern` needs `layers_to_transform` (as in PEFT)", "layers_pattern")
    if layers is None or layers == []:
        return chosen
    wanted = [layers] if not isinstance(layers, list) else layers
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in wanted):
        raise fail(f"`layers_to_transform` must be layer indices in [0, {num_layers}), got {layers!r}",
                   "layers_to_transform")
    patterns = [pattern] if isinstance(pattern, str) else (pattern or [])
    if not all(isinstance(p, str) for p in patterns):
        raise fail(f"`layers_pattern` must be a string or a list of strings, got {pattern!r}", "layers_pattern")
    try:  # PEFT's rules: the first numbered segment after a `layers_pattern` (or after any segment)
        regexes = [re.compile(rf".*?\.{p}\.(\d+)\.") for p in patterns if p] \
            or [re.compile(r".*?\.[^.]*\.(\d+)\.")]
    except re.error as exc:
        raise fail(f"`layers_pattern` {pattern!r} is not a valid regular expression: {exc}", "layers_pattern") from None
    out = []
    for layer, proj in chosen:
        found = next((m for rx in regexes if (m := rx.match(module_name(layer, proj)))), None)
        if found is not None and int(found.group(1)) in wanted:
            out.append((layer, proj))
    return out


def _excluded(fail: _Failer, exclude: Any, name: str) -> bool:
    if exclude is None or exclude == []:
        return False
    if isinstance(exclude, str):
        try:
            return re.fullmatch(exclude, name) is not None
        except re.error as exc:
            raise fail(f"`exclude_modules` {exclude!r} is not a valid regular expression: {exc}",
                       "exclude_modules") from None
    if isinstance(exclude, list) and all(isinstance(e, str) for e in exclude):
        return any(_ends(e, name) for e in exclude)
    raise fail(f"`exclude_modules` must be a list of module names or a regular expression, got {exclude!r}",
               "exclude_modules")
