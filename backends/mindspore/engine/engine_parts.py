"""The engine's parts, built once from a model directory and the engine settings, in order: the spec
(read once), the adapters (their slots count in the memory budget), the device, the kernel path (the strategy,
chosen once: it changes what the budget counts), the cache within its budget, the tokenizer, the shapes, the
weights, the runner, the vision tower,
the block allocator, the scheduler, the speculator and the request intake; the thread count (backends/cpus.py)
applied to MindSpore and the kernel pool. ``EngineParts.info`` is what ``/info`` reports of a running engine."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from backends.cpus import ThreadCount, engine_threads
from backends.grammar import GrammarCompiler
from backends.heap import give_back
from backends.limits import PromptLimit, longest_sequence, prompt_token_limit
from backends.mindspore.engine.adapters import EngineAdapters
from backends.mindspore.engine.collector import older_objects_frozen
from backends.mindspore.modeldir.yaml_tree import torch_dtype
from backends.mindspore.planning.device import mindspore_threads, set_device
from backends.mindspore.engine.draft_model import KEY as DRAFT_KEY
from backends.mindspore.families import VisionPart, family_of, load_model
from backends.mindspore.engine.draft_model import DraftModel, DraftModelError, check_draft_spec, check_tokenizer
from backends.mindspore.engine.intake import Intake
from backends.mindspore.planning.graph_cache import cache_for_this_warm_up, enable_graph_cache, graph_key
from backends.mindspore.engine.kv_cache import PART_TOKENS, BlockAllocator
from backends.mindspore.engine.window_pool import WindowPool
from backends.mindspore.planning.kv_dtype import cache_dtype
from backends.mindspore.planning.load_clock import LoadClock, phase
from backends.mindspore.planning.memory import Footprint, available_memory, plan_cache
from backends.mindspore.runners import ModelRunner, build_runner, choose_kernels
from backends.mindspore.engine.scheduler import Scheduler
from backends.mindspore.planning.shapes import plan_shapes
from backends.mindspore.engine.speculative import Speculator
from backends.mindspore.modeldir.spec import ModelSpec
from backends.mindspore.modeldir.tokenizer import Tokenizer
from backends.mindspore.modeldir.weights import check_weight_dtype, load_weights
from backends.sampling import RowScanner
from backends.settings import EngineConfig
from backends.step_stats import StepStats

log = logging.getLogger("mindserve.engine")


@dataclass(frozen=True, slots=True)
class EngineParts:
    spec: ModelSpec
    config: EngineConfig  # as applied: the batch capped at what the cache holds
    model_name: str
    device: str
    threads: ThreadCount  # the kernel pool's and MindSpore's CPU threads, and why that many
    tokenizer: Tokenizer
    chat_template: str | None
    grammars: GrammarCompiler
    eos_ids: frozenset[int]
    vocab_size: int  # the chooser's: config.json's vocab_size, else the embedding's rows
    max_seq_len: int
    prompt_limit: PromptLimit
    lora: EngineAdapters
    runner: ModelRunner
    vision: VisionPart | None  # a vision family's tower
    allocator: BlockAllocator
    scheduler: Scheduler
    speculator: Speculator
    intake: Intake

    @property
    def media_kinds(self) -> frozenset[str]:
        return media_kinds(self.spec)

    @property
    def compiled_graphs(self) -> int:
        """Graphs compiled so far: the language model's and the vision tower's."""
        return len(self.runner.compiled) + (len(self.vision.compiled) if self.vision is not None else 0)

    def warm_up(self, progress: bool) -> None:
        """Compile every graph the engine will call (loaded from the graph cache where ``graph_cache`` is on)."""
        spec, draft = self.spec, self.speculator.model
        if cache_for_this_warm_up(self.config.graph_cache and spec.mode == 0):
            parts = self.runner.graph_parts + (draft.graph_parts() if draft is not None else [])
            enable_graph_cache(graph_key(parts, spec.model_dir, spec.yaml_path))
        with older_objects_frozen():  # MindSpore's full gc pass before each compile skips them (collector.py)
            self.runner.warmup(progress)
            if draft is not None:
                draft.warmup(progress)
            if self.vision is not None:
                self.vision.warmup()
        give_back()  # what the compiles freed (heap.py)

    def info(self, steps: StepStats) -> dict:
        """What ``/info`` reports of the running engine (``steps``: its step timings)."""
        scheduler, allocator, runner = self.scheduler, self.allocator, self.runner
        return {"model_name": self.model_name, "arch": self.spec.arch, "max_seq_len": self.max_seq_len,
                "max_input_tokens": self.prompt_limit.tokens, "max_batch_size": self.config.max_batch_size,
                "compiled_graphs": self.compiled_graphs, "free_blocks": allocator.free_blocks,
                "total_blocks": allocator.usable_blocks, "running": len(scheduler.running),
                "waiting": len(scheduler.waiting) + len(scheduler.prefilling), "priorities": scheduler.by_priority(),
                "vocab_size": self.tokenizer.vocab_size,
                "dtype": torch_dtype(self.spec.model_dir) or self.spec.compute_dtype,
                "max_prefill_tokens": self.config.max_prefill_tokens, "block_size": runner.shapes.block_size,
                "device": self.device, "threads": {"count": self.threads.count, "reason": self.threads.reason},
                "kernels": runner.kernels, "kernel_variant": runner.kernel_variant, "compute_dtype": runner.dtype,
                "weight_dtype": self.spec.weight_dtype, "kv_cache_dtype": runner.kv_dtype,
                "prefix_caching": allocator.prefix_caching, "prefix_cache_blocks": allocator.cached_blocks,
                "prefix_cache_hit_rate": scheduler.hit_tokens / max(scheduler.prompt_tokens, 1),
                "prefix_cache_hit_tokens": scheduler.hit_tokens, "prefix_cache_query_tokens": scheduler.prompt_tokens,
                **scheduler.queue_load(), "adapters": self.lora.describe(),
                "lora": self.lora.info(), "speculation": self.speculator.info(), "steps": steps.snapshot()}


def media_kinds(spec: ModelSpec) -> frozenset[str]:
    """The media parts the model takes (its family's capability)."""
    return frozenset({"image", "video"}) if family_of(spec.arch).capabilities.vision else frozenset()


def build_parts(model_dir: Path | str, config: EngineConfig, model_name: str | None = None,
                tokenizer: Tokenizer | None = None) -> EngineParts:
    """The parts of an engine; ``tokenizer``: one already read from this model directory (start-up's check's)."""
    spec = load_model(model_dir)
    with LoadClock(spec.num_layers) as clock:  # each phase's seconds, and progress lines (load_clock.py)
        parts = _build_parts(spec, config, model_name, tokenizer)
    log.info("load phases: %s", clock.summary(cpu=True))
    return parts


def _build_parts(spec: ModelSpec, config: EngineConfig, model_name: str | None,
                 loaded: Tokenizer | None) -> EngineParts:
    tower = family_of(spec.arch).vision_part()  # a vision family's part (the registry names it)
    lora = EngineAdapters(spec, config.lora)  # read and checked now: their slots count in the budget
    threads = engine_threads(config.threads)
    config = replace(config, threads=threads.count)
    device = set_device(spec, threads.count)
    # The execution strategy, chosen once and before the budget: the AOT kernels (the packed step), or None
    # for stock ops (the split step), which hold float32 weights and every compiled graph's activations.
    with phase("kernels"):
        aot = choose_kernels(spec, config.kernels, device, config.kernel_isa)
    _apply_threads(threads, aot is not None)
    kv_dtype = cache_dtype(config.kv_cache_dtype, stock=aot is None)  # kvCacheDtype on that path
    # The cache within its memory budget (npuMemSize), the batch capped at what it holds.
    # A draft model (speculation's plugin_type draft_model) runs on the AOT path only; its weights and a cache of
    # as many blocks as the target's count in the same budget.
    draft_spec = None
    if config.speculation.draft_model is not None and config.speculation.enabled:
        if aot is None:
            log.warning("the draft model is not loaded: the stock-op kernels do not speculate")
        else:
            draft_spec = load_model(config.speculation.draft_model)
    footprint = Footprint.of(spec, lora.bytes, stock=aot is None, kv_dtype=kv_dtype)
    if draft_spec is not None:
        footprint = footprint.plus(Footprint.of(draft_spec, kv_dtype=kv_dtype))
    cache = plan_cache(config, footprint, available_memory(), spec.max_position_embeddings)
    log.info("%s", cache.describe())
    config, num_blocks = cache.apply(config), cache.num_blocks
    tokenizer = _tokenizer(spec, loaded)
    chat_template = tokenizer.chat_template
    if chat_template is None and tower is not None:
        chat_template = tower.chat_template(spec.model_dir)
    shapes = plan_shapes(config, spec.max_position_embeddings)
    with phase("read weights"):
        weights = _read_weights(spec, tower)
    check_weight_dtype(weights, spec.yaml_path, spec.weight_dtype)
    window_blocks = cache.window_blocks if aot is not None else 0  # the sliding-window layers' pool
    runner = build_runner(spec, weights, shapes, num_blocks, config.kernels, device, lora.shape, aot=aot,
                          kv_dtype=kv_dtype, window_blocks=window_blocks)
    vision = tower(spec.vision, weights) if tower is not None else None
    del weights
    give_back()  # the build's temporaries (packing, dequantizing): else kept in malloc's arenas for good (heap.py)
    draft = _draft_model(draft_spec, tokenizer, shapes, num_blocks, config, kv_dtype, vocab_size=
                         spec.config_vocab_size or spec.vocab_size) if draft_spec is not None else None
    if config.map_kv_cache:  # while the graphs compile; the warm-up waits for them
        for warmer in (runner.warmer, *((draft.runner.warmer,) if draft is not None else ())):
            warmer.start()
    lora.attach(runner.write_lora)
    allocator = BlockAllocator(num_blocks, runner.shapes.block_size, config.prefix_caching, PART_TOKENS)
    row_tokens = max(runner.shapes.prefill_chunk, runner.shapes.batch_buckets[-1])  # the most a row computes a step
    window_pool = WindowPool(BlockAllocator(window_blocks, runner.shapes.block_size, config.prefix_caching),
                             spec.gemma3.sliding_window, row_tokens) if window_blocks else None
    scheduler = Scheduler(allocator, config.max_batch_size, config.max_waiting,
                          prefill_rows=runner.shapes.prefill_batch_buckets[-1],
                          prefill_tokens=runner.prefill_budget(config), chunk=runner.shapes.prefill_chunk,
                          step_tokens=runner.step_tokens(),
                          prefill_first=runner.prefill_first, max_loras=config.lora.max_loras,
                          copy_rows=runner.copy_cache_rows, window_pool=window_pool, row_tokens=row_tokens)
    eos_ids = frozenset(spec.eos_token_ids) | frozenset(tokenizer.eos_token_ids)
    vocab_size = spec.config_vocab_size or spec.vocab_size
    grammars = GrammarCompiler(tokenizer.to_json, vocab_size, eos_ids)
    max_seq_len = longest_sequence(config, spec.max_position_embeddings)
    prompt_limit = prompt_token_limit(config, spec.max_position_embeddings)
    speculator = Speculator(config.speculation, runner.draft_budget(1, 0) > 0, draft)
    model_name = model_name or spec.model_dir.name
    intake = Intake(spec=spec, config=config, tokenizer=tokenizer, model_name=model_name, prompt_limit=prompt_limit,
                    max_seq_len=max_seq_len, max_window=runner.shapes.max_window, vision=vision,
                    media_kinds=media_kinds(spec), adapters=lora, vocab_size=vocab_size, eos_ids=eos_ids,
                    grammars=grammars, speculator=speculator, row_scan=row_scanner(runner))
    return EngineParts(spec=spec, config=config, model_name=model_name, device=device, threads=threads,
                       tokenizer=tokenizer, chat_template=chat_template, grammars=grammars, eos_ids=eos_ids,
                       vocab_size=vocab_size, max_seq_len=max_seq_len, prompt_limit=prompt_limit, lora=lora,
                       runner=runner, vision=vision, allocator=allocator, scheduler=scheduler, speculator=speculator,
                       intake=intake)


def row_scanner(runner) -> RowScanner | None:
    """The choosers' one-pass scan of a logits row: the kernel library's (kernels/vocab.py) on the AOT path, whose
    library is built; none on stock ops (the choosers' NumPy paths)."""
    if runner.kernels != "aot":
        return None
    from backends.mindspore.kernels import kernel_library
    from backends.mindspore.kernels.vocab import native_scanner

    return native_scanner(kernel_library())


def _tokenizer(spec: ModelSpec, loaded: Tokenizer | None) -> Tokenizer:
    """The model's tokenizer: ``loaded`` if it was read from this model directory (start-up's check reads it
    before the ports open; parsed once, not twice: 1.4 s of CPU for Gemma 3's 33 MB tokenizer.json), else read
    now."""
    if loaded is not None and loaded.is_from(spec.model_dir):
        return loaded
    with phase("tokenizer"):
        return Tokenizer.from_model_dir(spec.model_dir, spec.tokenizer)


def _apply_threads(threads: ThreadCount, aot: bool) -> None:
    """The AOT kernels' pool takes ``threads`` (MindSpore's CPU ops took them in ``set_device``); the log says
    how many and why."""
    if aot:
        from backends.mindspore.kernels import set_kernel_threads

        set_kernel_threads(threads.count)
    ms_threads = mindspore_threads()
    where = "the AOT kernels' pool and " if aot else ""
    where += "MindSpore's CPU ops" if ms_threads in (0, threads.count) else \
        f"MindSpore's CPU ops (which keep the {ms_threads} of this process's first engine)"
    log.info("threads: %d (%s) for %s", threads.count, threads.reason, where)


def _draft_model(spec: ModelSpec, tokenizer: Tokenizer, shapes, num_blocks: int, config: EngineConfig,
                 kv_dtype: str, vocab_size: int) -> DraftModel:
    """The draft model on the target's shapes and block count (DraftModelError naming the keys if its tokenizer
    is not the target's, or the AOT kernels do not fit it)."""
    check_tokenizer(Tokenizer.from_model_dir(spec.model_dir, spec.tokenizer), tokenizer, spec.model_dir)
    check_draft_spec(spec, shapes.max_window)
    aot = choose_kernels(spec, "auto", "CPU", config.kernel_isa)
    if aot is None:
        raise DraftModelError(f"{DRAFT_KEY} {spec.model_dir}: the AOT kernels do not run this model (see the log); "
                              "a draft model needs them")
    weights = load_weights(spec.checkpoint, spec.checkpoint_format)
    check_weight_dtype(weights, spec.yaml_path, spec.weight_dtype)
    runner = build_runner(spec, weights, shapes, num_blocks, "aot", "CPU", None, aot=aot, kv_dtype=kv_dtype)
    log.info("draft model %s: %d layers, hidden %d", spec.model_dir.name, spec.num_layers, spec.hidden_size)
    return DraftModel(spec, runner, vocab_size)


def _read_weights(spec: ModelSpec, tower: type[VisionPart] | None) -> dict[str, np.ndarray]:
    """The checkpoint's arrays (a vision family's part reads them, checked against both towers)."""
    return tower.read_weights(spec) if tower is not None else load_weights(spec.checkpoint, spec.checkpoint_format)
