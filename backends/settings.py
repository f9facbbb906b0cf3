"""Engine settings (plain data, no MindSpore import): limits and compiled shapes."""
from __future__ import annotations

from dataclasses import dataclass


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
    prefill_chunk: int = 64
    max_prefill_batch: int = 4  # sequences prefilled together (maxPrefillBatchSize)
    max_prefill_tokens: int = 256  # prompt tokens prefilled per step (maxPrefillTokens)
    prefill_batch_buckets: tuple[int, ...] | None = None  # default: 1 and max_prefill_batch
    batch_buckets: tuple[int, ...] | None = None  # default: 1, 2, 4, ... up to max_batch_size
    window_buckets: tuple[int, ...] | None = None  # default: 256, 1024, ... up to max_seq_len
    num_blocks: int | None = None  # default: enough for max_batch_size full sequences (+ scratch), within cache_gb
    cache_gb: float = -1.0  # npuMemSize: GB (2**30 bytes) the KV cache may take; -1: derived from the free memory
    prefix_caching: bool = True  # share cached full prompt blocks between requests (enablePrefixCaching)
    threads: int = 2
    # "aot": the AOT matmul + paged attention kernels (rows batch-independent; attention reads only each
    # row's real keys, so one window serves every length); "ms": MindSpore MatMul and ops attention over
    # bucketed windows; "auto": aot if the kernels build (g++ and an AVX-512 CPU), else ms
    kernels: str = "auto"
