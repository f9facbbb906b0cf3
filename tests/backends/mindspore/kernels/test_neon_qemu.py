"""The aarch64 builds of the kernels, run under qemu-aarch64, give the very bits of the native x86 library.

Every AOT entry is called on small odd shapes (tails of 16/32/48; Q8_0, Q4_0 and Q4_1 weights; LoRA inputs;
QKVAttention and the decoder layer with and without bias; one, two and three threads) through the kernel
driver (tests/support/kernel_driver.py), one qemu run per variant: ``armv8`` under ``-cpu cortex-a57`` (no
dotprod: a dotprod instruction would SIGILL) and ``armv8.2-dotprod`` under ``-cpu cortex-a76``. The expected
results are the same calls made through ctypes on the library this host loads. The driver built natively
must reproduce that library first, which guards the driver itself.
"""
from __future__ import annotations

import shutil
from collections.abc import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as gguf_quantize

from backends.mindspore.kernels import KernelBuildError, prepare_qweight, prepare_weight
from backends.mindspore.kernels import build as kbuild
from backends.mindspore.quant import QuantWeight
from tests.support.kernel_driver import Call, DriverError, Result, SetThreads, build_driver, qemu, run_driver, run_library

pytestmark = pytest.mark.slow

CROSS_CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
ARM_VARIANTS = {"armv8": "cortex-a57", "armv8.2-dotprod": "cortex-a76"}  # variant -> qemu CPU model
ARM_MARCH = {"armv8": "-march=armv8-a", "armv8.2-dotprod": "-march=armv8.2-a+dotprod+fp16"}
QTYPES = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1}
THREADS = 2  # the library's default; a case may ask for another count


def _arm_flags(variant: str) -> list[str]:
    base = [f for f in kbuild.CXXFLAGS if not f.startswith("-march=")]
    return [*base, ARM_MARCH[variant]]


# --- the cases: (name, threads, call) built from one seed each ----------------------------------------------

def _f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _out(*shape):
    return np.full(shape, np.nan, np.float32)


def _eps():
    return np.array([1e-5], np.float32)


def _qweight(rng, fmt: str, k: int, n: int) -> np.ndarray:
    w = _f32(rng, n, k, scale=0.05)
    w[:, :32] += 0.02 if fmt == "q4_1" else 0.0  # an offset block, so Q4_1's min matters
    blocks = gguf_quantize(w, QTYPES[fmt])
    return prepare_qweight(QuantWeight(fmt, n, k, np.ascontiguousarray(blocks.reshape(n, -1))))


def _weight(rng, k: int, n: int, fmt: str = "f32") -> np.ndarray:
    return prepare_weight(_f32(rng, k, n, scale=1 / np.sqrt(k))) if fmt == "f32" else _qweight(rng, fmt, k, n)


def _lora(rng, m: int, k: int, segs: list[int], slots=3, rank=3) -> list[np.ndarray]:
    """a [S, K, G*R], b [S, R, N], each row's slot (-1: none), segs (lora.h)."""
    g, n = len(segs) - 1, segs[-1]
    rows = rng.integers(-1, slots, m).astype(np.int32)
    rows[0] = -1  # a base row among the adapter rows
    return [_f32(rng, slots, k, g * rank, scale=1 / np.sqrt(k)), _f32(rng, slots, rank, n), rows,
            np.array(segs, np.int32)]


def _matmul(rng, m, k, n, fmt="f32", add=False, lora=None):
    x, w = _f32(rng, m, k), _weight(rng, k, n, fmt)
    res = [_f32(rng, m, n)] if add else []
    extra = _lora(rng, m, k, lora) if lora else []
    return Call("MindserveMatMulAdd" if add else "MindserveMatMul", (x, w, *res, *extra, _out(m, n)))


def _norm_matmul(rng, m, k, n, fmt="f32", lora=None):
    extra = _lora(rng, m, k, lora) if lora else []
    return Call("MindserveNormMatMul", (_f32(rng, m, k, scale=3), _f32(rng, k), _eps(), _weight(rng, k, n, fmt),
                                        *extra, _out(m, n)))


def _swiglu_matmul_add(rng, m, f, n, fmt="f32", lora=None):
    extra = _lora(rng, m, f, lora) if lora else []
    return Call("MindserveSwiGLUMatMulAdd", (_f32(rng, m, 2 * f, scale=4), _weight(rng, f, n, fmt), _f32(rng, m, n),
                                             *extra, _out(m, n)))


def _paged(rng, n, h, kv, d, bs, nb, num_blocks, rows=2):
    """One packed step's paged-cache arguments: n tokens of `rows` sequences, consecutive positions in each."""
    slots = num_blocks * bs
    table = np.stack([rng.permutation(np.arange(1, num_blocks))[:nb] for _ in range(rows)]).astype(np.int32)
    row = (np.arange(n) * rows // n).astype(np.int32)
    start = rng.integers(0, nb * bs - n, rows)
    pos = np.array([start[r] + i for i, r in enumerate(row)], np.int32)
    return dict(k=_f32(rng, kv * slots, d), v=_f32(rng, kv * slots, d), table=table, pos=pos, rows=row, slots=slots)


def _attention(rng, n, h, kv, d, bs, nb):
    p = _paged(rng, n, h, kv, d, bs, nb, nb * 2 + 3)
    return Call("MindservePagedAttention", (_f32(rng, n, h, d), p["k"], p["v"], p["table"], p["pos"], p["rows"],
                                            np.array([kv, bs], np.int32), _out(n, h, d)))


def _qkv_inputs(rng, n, h, kv, d, bs, nb, bias: bool):
    """QKVAttention's inputs after qkv: bias, cos, sin, k, v, write, table, pos, rows, meta."""
    p = _paged(rng, n, h, kv, d, bs, nb, nb * 2 + 3)
    width = (h + 2 * kv) * d
    slot = p["table"][p["rows"], p["pos"] // bs].astype(np.int64) * bs + p["pos"] % bs
    write = (slot[:, None] + np.arange(kv) * p["slots"]).reshape(-1).astype(np.int32)
    angle = rng.uniform(-np.pi, np.pi, (n, d))
    return [_f32(rng, width) if bias else np.zeros(1, np.float32), np.cos(angle).astype(np.float32),
            np.sin(angle).astype(np.float32), p["k"], p["v"], write, p["table"], p["pos"], p["rows"],
            np.array([kv, bs, int(bias)], np.int32)]


def _qkv_attention(rng, n, h, kv, d, bs, nb, bias):
    return Call("MindserveQKVAttention", (_f32(rng, n, (h + 2 * kv) * d), *_qkv_inputs(rng, n, h, kv, d, bs, nb, bias),
                                          _out(n, h * d)))


def _decoder_layer(rng, n, c, h, kv, d, f, bias, fmt="f32"):
    att = _qkv_inputs(rng, n, h, kv, d, 4, 5, bias)
    return Call("MindserveDecoderLayer", (_f32(rng, n, c), _f32(rng, c), _eps(), _weight(rng, c, (h + 2 * kv) * d, fmt),
                                          *att, _weight(rng, h * d, c, fmt), _f32(rng, c), _weight(rng, c, 2 * f, fmt),
                                          _weight(rng, f, c, fmt), _out(n, c)))


def _qkv_rope(rng, n, h, kv, d):
    angle = rng.uniform(-np.pi, np.pi, (n, d))
    return Call("MindserveQKVRope", (_f32(rng, n, (h + 2 * kv) * d), np.cos(angle).astype(np.float32),
                                     np.sin(angle).astype(np.float32), _out(n, h, d), _out(n * kv, d), _out(n * kv, d)))


def _embed_rope(rng, n, vocab, c, s, d):
    ids, pos = rng.integers(0, vocab, (1, n)).astype(np.int32), rng.integers(0, s, (1, n)).astype(np.int32)
    return Call("MindserveEmbedRope", (ids, pos, _f32(rng, vocab, c), _f32(rng, s, d), _f32(rng, s, d), _out(n, c),
                                       _out(n, d), _out(n, d)))


def _norm_head(rng, n, c, v, last, fmt="f32"):
    return Call("MindserveNormHead", (_f32(rng, n, c, scale=2), _f32(rng, c), _eps(), np.array(last, np.int32),
                                      _weight(rng, c, v, fmt), _out(len(last), v), _out(n, c)))


CASES: list[tuple[str, int, Callable[[np.random.Generator], Call]]] = [
    ("matmul_5x37x53", THREADS, lambda r: _matmul(r, 5, 37, 53)),
    ("matmul_3x100x161", THREADS, lambda r: _matmul(r, 3, 100, 161)),
    ("matmul_17x33x97_1thread", 1, lambda r: _matmul(r, 17, 33, 97)),
    ("matmul_17x33x97_3threads", 3, lambda r: _matmul(r, 17, 33, 97)),
    ("matmul_lora_5x37x53", THREADS, lambda r: _matmul(r, 5, 37, 53, lora=[0, 20, 53])),
    ("matmul_add_7x70x99", THREADS, lambda r: _matmul(r, 7, 70, 99, add=True)),
    ("matmul_add_lora_7x70x99", THREADS, lambda r: _matmul(r, 7, 70, 99, add=True, lora=[0, 99])),
    *[(f"qmatmul_{fmt}_3x64x17", THREADS, lambda r, fmt=fmt: _matmul(r, 3, 64, 17, fmt)) for fmt in QTYPES],
    *[(f"qmatmul_add_{fmt}_9x96x33", THREADS, lambda r, fmt=fmt: _matmul(r, 9, 96, 33, fmt, add=True))
      for fmt in QTYPES],
    ("qmatmul_lora_q8_0_4x160x20", THREADS, lambda r: _matmul(r, 4, 160, 20, "q8_0", lora=[0, 7, 20])),
    ("qmatmul_add_lora_q4_1_5x32x49_3threads", 3, lambda r: _matmul(r, 5, 32, 49, "q4_1", add=True, lora=[0, 49])),
    ("rmsnorm_7x33", THREADS, lambda r: Call("MindserveRMSNorm", (_f32(r, 7, 33, scale=3), _f32(r, 33), _eps(),
                                                                   _out(7, 33)))),
    ("rmsnorm_2x5", THREADS, lambda r: Call("MindserveRMSNorm", (_f32(r, 2, 5), _f32(r, 5), _eps(), _out(2, 5)))),
    ("swiglu_5x37", THREADS, lambda r: Call("MindserveSwiGLU", (_f32(r, 5, 74, scale=6), _out(5, 37)))),
    ("swiglu_2x16", THREADS, lambda r: Call("MindserveSwiGLU", (_f32(r, 2, 32, scale=6), _out(2, 16)))),
    ("qkv_rope_2x3x1x40", THREADS, lambda r: _qkv_rope(r, 2, 3, 1, 40)),
    ("qkv_rope_4x2x2x6", THREADS, lambda r: _qkv_rope(r, 4, 2, 2, 6)),
    ("paged_attention_5x6x2x40", THREADS, lambda r: _attention(r, 5, 6, 2, 40, 4, 7)),
    ("paged_attention_3x4x1x18_3threads", 3, lambda r: _attention(r, 3, 4, 1, 18, 8, 3)),
    ("qkv_attention_bias_5x6x2x40", THREADS, lambda r: _qkv_attention(r, 5, 6, 2, 40, 4, 7, True)),
    ("qkv_attention_nobias_4x2x1x6", THREADS, lambda r: _qkv_attention(r, 4, 2, 1, 6, 2, 9, False)),
    ("qkv_attention_nobias_6x3x1x18", THREADS, lambda r: _qkv_attention(r, 6, 3, 1, 18, 4, 5, False)),
    ("norm_matmul_3x64x100", THREADS, lambda r: _norm_matmul(r, 3, 64, 100)),
    ("norm_matmul_lora_5x37x53", THREADS, lambda r: _norm_matmul(r, 5, 37, 53, lora=[0, 53])),
    ("norm_matmul_q4_0_3x64x17", THREADS, lambda r: _norm_matmul(r, 3, 64, 17, "q4_0")),
    ("swiglu_matmul_add_4x40x50", THREADS, lambda r: _swiglu_matmul_add(r, 4, 40, 50)),
    ("swiglu_matmul_add_lora_5x37x53", THREADS, lambda r: _swiglu_matmul_add(r, 5, 37, 53, lora=[0, 30, 53])),
    ("swiglu_matmul_add_q8_0_3x64x33", THREADS, lambda r: _swiglu_matmul_add(r, 3, 64, 33, "q8_0")),
    ("decoder_layer_bias_6x44", THREADS, lambda r: _decoder_layer(r, 6, 44, 3, 1, 10, 37, True)),
    ("decoder_layer_nobias_5x44", THREADS, lambda r: _decoder_layer(r, 5, 44, 3, 1, 10, 37, False)),
    ("decoder_layer_q4_1_bias_4x64", THREADS, lambda r: _decoder_layer(r, 4, 64, 4, 2, 16, 32, True, "q4_1")),
    ("embed_rope_7", THREADS, lambda r: _embed_rope(r, 7, 50, 37, 40, 10)),
    ("norm_head_10x37x101", THREADS, lambda r: _norm_head(r, 10, 37, 101, [9, 2, 2, 0])),
    ("norm_head_q8_0_6x64x45", THREADS, lambda r: _norm_head(r, 6, 64, 45, [5, 1], "q8_0")),
]
NAMES = [name for name, _, _ in CASES]


@pytest.fixture(scope="module")
def requests() -> list:
    """Every case's call, each after the thread count it asks for; the library's default restored at the end."""
    out, threads = [SetThreads(THREADS)], THREADS
    for i, (_, n, make) in enumerate(CASES):
        if n != threads:
            out.append(SetThreads(n))
            threads = n
        out.append(make(np.random.default_rng(1000 + i)))
    return out + [SetThreads(THREADS)]


def _by_case(requests: list, results: list[Result]) -> dict[str, tuple[Call, Result]]:
    calls = [(r, res) for r, res in zip(requests, results) if isinstance(r, Call)]
    return dict(zip(NAMES, calls))


@pytest.fixture(scope="module")
def expected(lib, requests):
    """The native library's results (ctypes), by case name."""
    return _by_case(requests, run_library(lib, requests))


@pytest.fixture(scope="module")
def lib(cache_dir):
    from backends.mindspore.kernels import kernel_library
    try:
        return kernel_library(cache_dir)
    except KernelBuildError as exc:
        pytest.skip(f"no native kernel library to compare with: {exc}")


@pytest.fixture(scope="module")
def driver_results(requests):
    """``(key, build, emulator) -> results by case name``: one driver run per key for the whole module (one qemu
    start covers every case); a failed build or run fails every case of its key with the same error."""
    runs: dict[str, dict | Exception] = {}

    def results(key: str, build: Callable[[], object], emulator: list[str]) -> dict[str, tuple[Call, Result]]:
        if key not in runs:
            try:
                runs[key] = _by_case(requests, run_driver(build(), requests, emulator))
            except DriverError as exc:
                runs[key] = exc
        if isinstance(runs[key], Exception):
            raise runs[key]
        return runs[key]

    return results


def _first_difference(call: Call, want: Result, got: Result) -> str | None:
    shapes = ", ".join(str(a.shape) for a in call.args)
    if want.rc != got.rc:
        return f"{call.entry} ({shapes}): rc {got.rc}, native {want.rc}"
    for i, (w, g) in enumerate(zip(want.args, got.args)):
        bits = np.dtype(f"u{w.dtype.itemsize}")
        wb, gb = w.view(bits), g.view(bits)
        if not np.array_equal(wb, gb):
            at = np.unravel_index(int(np.flatnonzero(wb != gb)[0]), w.shape)
            return (f"{call.entry} ({shapes}): argument {i} {w.dtype}{list(w.shape)} first differs at {list(at)}: "
                    f"{g[at]!r} (0x{int(gb[at]):x}), native {w[at]!r} (0x{int(wb[at]):x}); "
                    f"{int((wb != gb).sum())} of {w.size} elements differ")
    return None


def _assert_same_bits(expected, results, name: str):
    call, want = expected[name]
    assert want.rc == 0, f"{name}: the native call itself failed (rc {want.rc})"
    difference = _first_difference(call, want, results[name][1])
    assert difference is None, difference


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("name", NAMES)
def test_native_driver_reproduces_the_library(expected, driver_results, name):
    """The driver built for this host, statically, with the library's flags: the ctypes calls' very bits."""
    results = driver_results("native", lambda: build_driver("g++", kbuild.CXXFLAGS), [])
    _assert_same_bits(expected, results, name)


@pytest.mark.skipif(shutil.which(CROSS_CXX) is None, reason=f"needs {CROSS_CXX} (apt: g++-aarch64-linux-gnu)")
@pytest.mark.skipif(shutil.which(QEMU) is None, reason=f"needs {QEMU} (apt: qemu-user)")
@pytest.mark.parametrize("variant", ARM_VARIANTS)
@pytest.mark.parametrize("name", NAMES)
def test_arm_variant_under_qemu_matches_x86(expected, driver_results, variant, name):
    results = driver_results(variant, lambda: build_driver(CROSS_CXX, _arm_flags(variant)), qemu(ARM_VARIANTS[variant]))
    _assert_same_bits(expected, results, name)
