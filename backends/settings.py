"""Engine settings (plain data, no MindSpore import): limits and compiled shapes."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class LoraModuleConfig:
    """One ``LoraModules`` entry: an adapter name and its PEFT directory."""

    name: str
    path: Path


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """Multi-LoRA serving (``ModelDeployConfig``'s LoraModules, maxLoras, maxLoraRank and the runtime keys)."""

    modules: tuple[LoraModuleConfig, ...] = ()
    max_loras: int = 0  # distinct adapters in one step; 0 = as many as loaded
    max_rank: int = 0  # the slots' rank; 0 = the largest configured rank (16 if none and runtime loading)
    runtime_updates: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    root: Path | None = None  # runtime loads only from directories under this one
    max_loaded: int = 0  # adapter slots; 0 = len(modules), plus 4 with runtime updates

    @property
    def enabled(self) -> bool:
        return bool(self.modules) or self.runtime_updates

    @property
    def slots(self) -> int:
        return self.max_loaded or len(self.modules) + (4 if self.runtime_updates else 0)


@dataclass(frozen=True, slots=True)
class SpeculationSettings:
    """Prompt-lookup (n-gram) speculative decoding (the reference server's ``plugin_params`` with
    ``plugin_type`` memory_decoding; docs/speculative.md). ``max_draft`` 0 turns it off."""

    max_draft: int = 0  # draft tokens a sequence may propose per step (decoding_length); 0: off
    ngram_min: int = 2  # the shortest suffix looked up (1-token matches in free text are mostly noise)
    ngram_max: int = 3  # the longest suffix looked up (tried first)
    adaptive: bool = True  # dynamic_algo: k follows the sequence's acceptance, low acceptance pauses drafting
    # plugin_type draft_model: the directory of a smaller model of the same tokenizer that drafts instead of the
    # n-gram lookup (draft_model_path; docs/speculative.md "A draft model"); None: prompt lookup
    draft_model: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.max_draft > 0

    @property
    def method(self) -> str:
        """The reference server's plugin_type of these settings ("off" when disabled)."""
        if not self.enabled:
            return "off"
        return "draft_model" if self.draft_model is not None else "memory_decoding"


PREFILL_CHUNK = 64  # most prompt tokens per prefill chunk


def prefill_chunk(max_prefill_tokens: int) -> int:
    """The prefill chunk for a ``maxPrefillTokens`` budget: the one home of this rule (``shapes.plan_shapes``
    caps it by the largest window)."""
    return min(max_prefill_tokens, PREFILL_CHUNK)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine limits and compiled shapes (the server config's ModelDeployConfig/ScheduleConfig)."""

    max_seq_len: int = 2048
    max_input_tokens: int = 2048
    truncation: int = 0  # 0: reject long prompts; 1: keep the last tokens; other: keep the first
    max_batch_size: int = 16
    max_iter_times: int = 512
    max_waiting: int = 1024
    block_size: int = 128
    prefill_chunk: int = PREFILL_CHUNK  # prefill_chunk(max_prefill_tokens) from a server config
    max_prefill_batch: int = 4  # sequences prefilled together (maxPrefillBatchSize)
    max_prefill_tokens: int = 256  # prompt tokens prefilled per step (maxPrefillTokens)
    prefill_batch_buckets: tuple[int, ...] | None = None  # default: 1 and max_prefill_batch
    batch_buckets: tuple[int, ...] | None = None  # default: 1, 2, 4, ... up to max_batch_size
    window_buckets: tuple[int, ...] | None = None  # default: 256, 1024, ... up to max_seq_len
    num_blocks: int | None = None  # default: enough for max_batch_size full sequences (+ scratch), within cache_gb
    cache_gb: float = -1.0  # npuMemSize: GB (2**30 bytes) the KV cache may take; -1: derived from the free memory
    prefix_caching: bool = True  # share cached full prompt blocks between requests (enablePrefixCaching)
    # the kernel pool's and MindSpore's CPU threads (the server config's threads key, serve --threads); None: the
    # CPUs this process may run on (backends/cpus.py: affinity mask, physical cores, cgroup quota)
    threads: int | None = None
    # "aot": the AOT matmul + paged attention kernels (rows batch-independent; attention reads only each
    # row's real keys, so one window serves every length); "stock": MindSpore MatMul and ops attention over
    # bucketed windows; "auto": aot if the kernels build (g++; a variant for every x86-64 and AArch64 CPU), else
    # stock.
    kernels: str = "auto"
    # which build of the AOT kernels (kernels/build.py VARIANTS); "auto": MINDSERVE_KERNEL_ISA, else the best
    # this CPU runs
    kernel_isa: str = "auto"
    # the KV cache's format (backends/mindspore/planning/kv_dtype.py): auto, float32, float16, bfloat16 or q8_0.
    # A server config's kvCacheDtype is auto by default (the measured default, float16 on the AOT kernels); an engine
    # of the Python API keeps float32, the model's own arithmetic, unless asked
    kv_cache_dtype: str = "float32"
    # keep the warm-up's compiled graphs (MindSpore's compile cache) under ~/.cache/mindserve/graphs, one directory
    # per everything that shapes them (graph_cache.py): a restart loads them instead of compiling. Only for a process
    # whose first compiled graphs are the engine's (the server config's graphCache): the cache numbers graphs by order
    graph_cache: bool = False
    # map the KV cache's pages before the warm-up ends (network/common.py CacheWarmer): the server config's
    # mapKvCache (true by default there). An engine of the Python API lets them fault in as written unless asked
    map_kv_cache: bool = False
    # Gemma 3's sliding-window layers in their own smaller block pool (engine/window_pool.py): -65 MiB peak RSS
    # at c16 on Gemma 3 270M, but c16 throughput 232-239 -> 195-202 tok/s (docs/performance.md), so off.
    window_pool: bool = False
    lora: LoraSettings = field(default_factory=LoraSettings)
    speculation: SpeculationSettings = field(default_factory=SpeculationSettings)
