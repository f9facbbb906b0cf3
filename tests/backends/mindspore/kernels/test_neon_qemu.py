"""The aarch64 builds of the kernels, run under qemu-aarch64, give the very bits of the native x86 library.

Every AOT entry is called on small odd shapes -- tests/support/kernel_entries.py's cases, and more here: fp32
panel tails, one and three threads, LoRA on the plain matmul, the decoder layer without bias and on fp32
weights -- through the kernel driver (tests/support/kernel_driver.py), one qemu run per variant: ``armv8``
under ``-cpu cortex-a57`` (no dotprod: a dotprod instruction would SIGILL) and ``armv8.2-dotprod`` under
``-cpu cortex-a76``. The expected results are the same calls made through ctypes on the library this host
loads (its best variant). The driver built natively must reproduce that library first, which guards the
driver itself.
"""
from __future__ import annotations

import shutil
from collections.abc import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as gguf_quantize

from backends.mindspore.kernels import prepare_qweight, prepare_weight
from backends.mindspore.kernels import build as kbuild
from backends.mindspore.modeldir.quant import QuantWeight
from backends.mindspore.modeldir.quant import quantize as quant_quantize
from tests.support.kernel_variants import NATIVE, variant_lib
from tests.support.kernel_driver import DriverError, Result, SetThreads, build_driver, qemu, run_driver, run_library
from tests.support.kernel_entries import Case, cases

pytestmark = pytest.mark.slow

CROSS_CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
ARM_VARIANTS = {"armv8": "cortex-a57", "armv8.2-dotprod": "cortex-a76"}  # variant -> qemu CPU model
QTYPES = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1}
THREADS = 2  # the library's default; a case may ask for another count


# --- the cases kernel_entries.py leaves out: each (threads, builder of a Case from its own rng) -------------

def _f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _out(*shape):
    return np.full(shape, np.nan, np.float32)


def _eps():
    return np.array([1e-5], np.float32)


def _weight(rng, k: int, n: int, fmt: str = "f32") -> np.ndarray:
    if fmt == "f32":
        return prepare_weight(_f32(rng, k, n, scale=1 / np.sqrt(k)))
    if fmt not in QTYPES:  # the K-quants: the gguf package cannot write them
        return prepare_qweight(quant_quantize(_f32(rng, n, k, scale=0.05), fmt))
    blocks = gguf_quantize(_f32(rng, n, k, scale=0.05), QTYPES[fmt])
    return prepare_qweight(QuantWeight(fmt, n, k, np.ascontiguousarray(blocks.reshape(n, -1))))


def _lora(rng, m: int, k: int, segs: list[int], slots=3, rank=3) -> list[np.ndarray]:
    """a [S, K, G*R], b [S, R, N], each row's slot (-1: none, row 0 among them), segs (lora.h)."""
    rows = rng.integers(-1, slots, m).astype(np.int32)
    rows[0] = -1
    return [_f32(rng, slots, k, (len(segs) - 1) * rank, scale=1 / np.sqrt(k)), _f32(rng, slots, rank, segs[-1]), rows,
            np.array(segs, np.int32)]


def _matmul(rng, m, k, n, fmt="f32", lora=None):
    extra = _lora(rng, m, k, lora) if lora else []
    return "MindserveMatMul", (_f32(rng, m, k), _weight(rng, k, n, fmt), *extra, _out(m, n))


def _paged(rng, n, kv, d, bs, nb):
    """A paged cache of nb * 2 + 3 blocks and n tokens of two sequences, consecutive positions in each."""
    num_blocks = nb * 2 + 3
    table = np.stack([rng.permutation(np.arange(1, num_blocks))[:nb] for _ in range(2)]).astype(np.int32)
    rows = (np.arange(n) >= n // 2).astype(np.int32)
    start = rng.integers(0, nb * bs - n, 2)
    pos = np.array([start[r] + i for i, r in enumerate(rows)], np.int32)
    slots = num_blocks * bs
    write = ((table[rows, pos // bs].astype(np.int64) * bs + pos % bs)[:, None] + np.arange(kv) * slots)
    return dict(k=_f32(rng, kv * slots, d), v=_f32(rng, kv * slots, d), table=table, pos=pos, rows=rows,
                write=write.reshape(-1).astype(np.int32))


def _attention(rng, n, h, kv, d, bs, nb):
    p = _paged(rng, n, kv, d, bs, nb)
    return "MindservePagedAttention", (_f32(rng, n, h, d), p["k"], p["v"], p["table"], p["pos"], p["rows"],
                                       np.array([kv, bs], np.int32), _out(n, h, d))


def _qkv_args(rng, n, h, kv, d, bs, nb, bias) -> list[np.ndarray]:
    """QKVAttention's arguments after qkv: bias (or [1]), cos, sin, k, v, write, table, pos, rows, meta."""
    p = _paged(rng, n, kv, d, bs, nb)
    angle = rng.uniform(-np.pi, np.pi, (n, d))
    bias_arg = _f32(rng, (h + 2 * kv) * d) if bias else np.zeros(1, np.float32)
    return [bias_arg, np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32), p["k"], p["v"], p["write"],
            p["table"], p["pos"], p["rows"], np.array([kv, bs, int(bias)], np.int32)]


def _qkv_attention(rng, n, h, kv, d, bs, nb, bias):
    return "MindserveQKVAttention", (_f32(rng, n, (h + 2 * kv) * d), *_qkv_args(rng, n, h, kv, d, bs, nb, bias),
                                     _out(n, h * d))


def _decoder_layer(rng, n, c, h, kv, d, f, bias):
    """A whole layer on fp32 weights of odd widths (kernel_entries' layer is quantized, with bias)."""
    return "MindserveDecoderLayer", (_f32(rng, n, c), _f32(rng, c), _eps(), _weight(rng, c, (h + 2 * kv) * d),
                                     *_qkv_args(rng, n, h, kv, d, 4, 5, bias), _weight(rng, h * d, c), _f32(rng, c),
                                     _weight(rng, c, 2 * f), _weight(rng, f, c), _out(n, c))


EXTRA: list[tuple[str, int, Callable]] = [
    ("matmul-fp32-3x100x161", THREADS, lambda r: _matmul(r, 3, 100, 161)),  # 161 = 3 panels of 48 + 17
    ("matmul-fp32-17x33x97-1thread", 1, lambda r: _matmul(r, 17, 33, 97)),
    ("matmul-fp32-17x33x97-3threads", 3, lambda r: _matmul(r, 17, 33, 97)),
    ("matmul-lora-fp32-5x37x53", THREADS, lambda r: _matmul(r, 5, 37, 53, lora=[0, 20, 53])),
    ("matmul-lora-q4_0-4x160x20-3threads", 3, lambda r: _matmul(r, 4, 160, 20, "q4_0", lora=[0, 7, 20])),
    ("matmul-q8_0-2x32x1", THREADS, lambda r: _matmul(r, 2, 32, 1, "q8_0")),
    ("paged-attention-3x4x1x18-3threads", 3, lambda r: _attention(r, 3, 4, 1, 18, 8, 3)),
    ("rmsnorm-2x5", THREADS, lambda r: ("MindserveRMSNorm", (_f32(r, 2, 5), _f32(r, 5), _eps(), _out(2, 5)))),
    ("swiglu-2x16", THREADS, lambda r: ("MindserveSwiGLU", (_f32(r, 2, 32, scale=6), _out(2, 16)))),
    ("norm-matmul-fp32-3x64x100", THREADS, lambda r: ("MindserveNormMatMul", (
        _f32(r, 3, 64, scale=3), _f32(r, 64), _eps(), _weight(r, 64, 100), _out(3, 100)))),
    ("swiglu-matmul-add-lora-fp32-5x37x53", THREADS, lambda r: ("MindserveSwiGLUMatMulAdd", (
        _f32(r, 5, 74, scale=4), _weight(r, 37, 53), _f32(r, 5, 53), *_lora(r, 5, 37, [0, 30, 53]), _out(5, 53)))),
    ("decoder-layer-fp32-5x44", THREADS, lambda r: _decoder_layer(r, 5, 44, 3, 1, 10, 37, False)),
    ("decoder-layer-fp32-bias-6x44", THREADS, lambda r: _decoder_layer(r, 6, 44, 4, 2, 6, 21, True)),
    ("norm-head-q8_0-6x64x45", THREADS, lambda r: ("MindserveNormHead", (
        _f32(r, 6, 64, scale=2), _f32(r, 64), _eps(), np.array([5, 1], np.int32), _weight(r, 64, 45, "q8_0"),
        _out(2, 45), _out(6, 64)))),
    # model-sized (SmolLM2-135M widths): still well under a second under qemu
    ("matmul-fp32-16x576x960", THREADS, lambda r: _matmul(r, 16, 576, 960)),
    ("matmul-q8_0-5x576x576", THREADS, lambda r: _matmul(r, 5, 576, 576, "q8_0")),
    ("matmul-q4_1-3x1536x576-3threads", 3, lambda r: _matmul(r, 3, 1536, 576, "q4_1")),
    ("matmul-q4_k-16x1536x576", THREADS, lambda r: _matmul(r, 16, 1536, 576, "q4_k")),
    ("matmul-q6_k-3x1536x200", THREADS, lambda r: _matmul(r, 3, 1536, 200, "q6_k")),
    ("matmul-q5_0-5x576x100", THREADS, lambda r: _matmul(r, 5, 576, 100, "q5_0")),
    ("qkv-attention-bias-8x9x3x64-long", THREADS, lambda r: _qkv_attention(r, 8, 9, 3, 64, 16, 12, True)),
]


def _all_cases() -> list[tuple[int, Case]]:
    extra = [(n, Case(name, *make(np.random.default_rng(1000 + i)))) for i, (name, n, make) in enumerate(EXTRA)]
    return [(THREADS, c) for c in cases()] + extra


CASES = _all_cases()
NAMES = [c.name for _, c in CASES]


@pytest.fixture(scope="module")
def requests() -> list:
    """Every case, each after the thread count it asks for; the library's default restored at the end."""
    out, threads = [SetThreads(THREADS)], THREADS
    for n, case in CASES:
        if n != threads:
            out.append(SetThreads(n))
            threads = n
        out.append(case)
    return out + [SetThreads(THREADS)]


def _by_case(requests: list, results: list[Result]) -> dict[str, tuple[Case, Result]]:
    return {r.name: (r, res) for r, res in zip(requests, results) if isinstance(r, Case)}


@pytest.fixture(scope="module")
def expected(kernel_cache, requests):
    """The results of this host's best variant (ctypes), by case name."""
    return _by_case(requests, run_library(variant_lib(kernel_cache, NATIVE), requests))


@pytest.fixture(scope="module")
def driver_results(requests):
    """``(key, build, emulator) -> results by case name``: one driver run per key for the whole module (one qemu
    start covers every case); a failed build or run fails every case of its key with the same error."""
    runs: dict[str, dict | Exception] = {}

    def results(key: str, build: Callable[[], object], emulator: list[str]) -> dict[str, tuple[Case, Result]]:
        if key not in runs:
            try:
                runs[key] = _by_case(requests, run_driver(build(), requests, emulator))
            except DriverError as exc:
                runs[key] = exc
        if isinstance(runs[key], Exception):
            raise runs[key]
        return runs[key]

    return results


def _first_difference(case: Case, want: Result, got: Result) -> str | None:
    shapes = ", ".join(str(a.shape) for a in case.arrays)
    if want[0] != got[0]:
        return f"{case.entry} ({shapes}): rc {got[0]}, native {want[0]}"
    for i, (w, g) in enumerate(zip(want[1], got[1])):
        bits = np.dtype(f"u{w.dtype.itemsize}")
        wb, gb = w.view(bits), g.view(bits)
        if not np.array_equal(wb, gb):
            at = np.unravel_index(int(np.flatnonzero(wb != gb)[0]), w.shape)
            return (f"{case.entry} ({shapes}): argument {i} {w.dtype}{list(w.shape)} first differs at "
                    f"{[int(j) for j in at]}: {g[at]!r} (0x{int(gb[at]):x}), native {w[at]!r} (0x{int(wb[at]):x}); "
                    f"{int((wb != gb).sum())} of {w.size} elements differ")
    return None


def _assert_same_bits(expected, results, name: str):
    case, want = expected[name]
    assert want[0] == 0, f"{name}: the native call itself failed (rc {want[0]})"
    assert not any(np.isnan(a).any() for a in want[1] if a.dtype == np.float32), f"{name}: an output left unwritten"
    difference = _first_difference(case, want, results[name][1])
    assert difference is None, f"{name}: {difference}"


def _driver_flags(name: str, machine: str | None = None) -> tuple[str, ...]:
    return kbuild.compile_flags(kbuild.variant_named(name), machine)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("name", NAMES)
def test_native_driver_reproduces_the_library(expected, driver_results, name):
    """The driver built for this host, statically, with the native library's flags: the ctypes calls' very bits."""
    results = driver_results("native", lambda: build_driver("g++", _driver_flags(NATIVE)), [])
    _assert_same_bits(expected, results, name)


@pytest.mark.skipif(shutil.which(CROSS_CXX) is None, reason=f"needs {CROSS_CXX} (apt: g++-aarch64-linux-gnu)")
@pytest.mark.skipif(shutil.which(QEMU) is None, reason=f"needs {QEMU} (apt: qemu-user)")
@pytest.mark.parametrize("variant", ARM_VARIANTS)
@pytest.mark.parametrize("name", NAMES)
def test_arm_variant_under_qemu_matches_x86(expected, driver_results, variant, name):
    results = driver_results(variant, lambda: build_driver(CROSS_CXX, _driver_flags(variant, "aarch64")),
                             qemu(ARM_VARIANTS[variant]))
    _assert_same_bits(expected, results, name)


@pytest.mark.skipif(shutil.which(CROSS_CXX) is None, reason=f"needs {CROSS_CXX} (apt: g++-aarch64-linux-gnu)")
@pytest.mark.skipif(shutil.which(QEMU) is None, reason=f"needs {QEMU} (apt: qemu-user)")
def test_cortex_a57_refuses_the_dotprod_build(requests):
    """What makes the armv8 run a proof: qemu's cortex-a57 really lacks the ARMv8.2 instructions, so a leak of
    one into the armv8 build would die the same way."""
    driver = build_driver(CROSS_CXX, _driver_flags("armv8.2-dotprod", "aarch64"))
    with pytest.raises(DriverError, match="killed by SIGILL at request"):
        run_driver(driver, requests, qemu("cortex-a57"))
