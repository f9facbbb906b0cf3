// mindserve fp32 matmul for MindSpore AOT custom ops on CPU (any ISA of vec.h).
//
//   y[M, N] = x[M, K] @ W[K, N]      (all float32; W pre-packed into column panels, see below)
//
// Packed weight layout (made once at load time by prepare_weight() in __init__.py): the columns
// of W are cut into panels of kPanel columns; panel p (columns [p*kPanel, min(N, (p+1)*kPanel)))
// is stored row-major as [K][width] starting at float offset p * kPanel * K. Only the last panel
// can be narrower, so the packed array holds exactly K*N floats; it is handed to MindSpore with
// shape [1, K, N] (the leading 1 marks it as packed, so a plain [K, N] matrix is rejected).
// A thread working on consecutive panels therefore streams one contiguous region of memory.
//
// Determinism contract: every output element y[m, n] is produced by the same sequence of
// floating-point operations whatever M is, whatever the other rows hold, whatever the thread
// count, whatever tile shape is picked and whatever instruction set runs it: acc = 0; for k = 0..K-1:
// acc = fma(x[m,k], W[k,n], acc). Accumulators live in registers for the whole K loop, and the work is only
// ever split across columns (panels) and rows, never across K. The arithmetic is vec.h's fused fmadd.
//
// Exported entry points:
//   int MindserveMatMul(int nparam, void **params, int *ndims, int64_t **shapes,
//                       const char **dtypes, void *stream, void *extra)   -- the AOT kernel
//   int mindserve_matmul_panel_width()        -- kPanel (prepare_weight must agree)
//   const char *mindserve_kernel_variant()    -- the build variant's name (build.py), e.g. "x86-64-v3"
//   const char *mindserve_vec_isa()           -- the vec.h backend: avx512-vnni, avx512bw, avx2, neon(-dotprod), scalar
//   int mindserve_matmul_set_threads(int n)   -- kernel threads including the caller (>=1)
//   int mindserve_matmul_get_threads()
//   void mindserve_kernel_stats(int kind, uint64_t *calls, uint64_t *ns, int reset)  -- time inside
//       each kernel of the library (pool.h Kind: matmul, attention, rmsnorm, swiglu, qkv_rope)
//   int mindserve_matmul_set_spin_us(int us)  -- how long idle workers spin before sleeping
//   void mindserve_matmul_tune(stream_pf, chunks_per_thread)  -- benchmarks only
//   void mindserve_matmul_raw(const float *x, const float *w_packed, float *y, int64_t M, K, N)
//   void mindserve_matmul_add_raw(x, w_packed, const float *res, y, M, K, N)   -- y = res + x @ W
//   int MindserveMatMulAdd(...)  -- the AOT kernel with a residual input: y = res + x @ W
//   Both take the four optional LoRA inputs of lora.h after their own, and a uint8 W (a quantized
//   weight, qmatmul.cc) instead of the packed float32 one.
//   void mindserve_matmul_lora_raw(x, w_packed, res, y, M, K, N, a, b, rows, segs, S, G, R)  -- tests
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <utility>
#include <string>

#include "entry.h"
#include "kv_format.h"
#include "lora.h"
#include "pool.h"
#include "qformat.h"
#include "qmatmul.h"
#include "vec.h"

#ifndef MINDSERVE_PANEL_VECS
#define MINDSERVE_PANEL_VECS 3
#endif

namespace {

namespace q = mindserve::q;

namespace v = mindserve::vec;

constexpr int kNV = MINDSERVE_PANEL_VECS;  // 16-float vectors per panel row
constexpr int64_t kPanel = 16 * kNV;       // panel width in columns (48: divides 576, 960, 3072, 49152)
// Rows per register tile: as many as the backend's registers hold (the same bits for any tile shape).
constexpr int kMaxMR = v::kMatMulRows;

// Tunables (benchmarking only; none of them changes any result bit).
std::atomic<int64_t> g_stream_pf{0};      // > 0: prefetch this many floats ahead in the stream
std::atomic<int> g_chunks_per_thread{0};  // 0 auto

// ---------------------------------------------------------------------------------------------
// Register tile: rows [0, MR) of x (leading dim K) times one panel (NV vectors wide, row stride
// ldw floats, its last vector `last` columns wide), over the whole K. pf != nullptr: prefetch pf + k*ldw
// alongside each weight row.
template <int MR, int NV>
inline void tile(const float *__restrict x, int64_t K, const float *__restrict w, int64_t ldw,
                 float *__restrict y, int64_t ldy, int last, const float *pf, const float *__restrict res) {
  v::F32x16 acc[MR][NV];
  _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r)
    _Pragma("GCC unroll 4") for (int c = 0; c < NV; ++c) acc[r][c] = v::zero();
  const float *wk = w;
  for (int64_t k = 0; k < K; ++k, wk += ldw) {
    if (pf != nullptr) {
      // One prefetch per 64-byte line of the row (rows are ldw*4 bytes, not line aligned).
      _Pragma("GCC unroll 4") for (int c = 0; c < NV; ++c) __builtin_prefetch(pf + k * ldw + 16 * c, 0, 3);
    }
    v::F32x16 wv[NV];
    _Pragma("GCC unroll 4") for (int c = 0; c < NV - 1; ++c) wv[c] = v::load(wk + 16 * c);
    wv[NV - 1] = v::load_n(wk + 16 * (NV - 1), last);
    _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {
      const v::F32x16 xb = v::set1(x[r * K + k]);
      _Pragma("GCC unroll 4") for (int c = 0; c < NV; ++c) acc[r][c] = v::fmadd(xb, wv[c], acc[r][c]);
    }
  }
  if (res != nullptr) {  // y = res + x @ W: the residual is added once, after the whole K loop
    _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {
      _Pragma("GCC unroll 4") for (int c = 0; c < NV - 1; ++c)
        acc[r][c] = v::add(acc[r][c], v::load(res + r * ldy + 16 * c));
      acc[r][NV - 1] = v::add(acc[r][NV - 1], v::load_n(res + r * ldy + 16 * (NV - 1), last));
    }
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r) {
    _Pragma("GCC unroll 4") for (int c = 0; c < NV - 1; ++c) v::store(y + r * ldy + 16 * c, acc[r][c]);
    v::store_n(y + r * ldy + 16 * (NV - 1), acc[r][NV - 1], last);
  }
}

using TileFn = void (*)(const float *, int64_t, const float *, int64_t, float *, int64_t, int, const float *,
                        const float *);

// Dispatch table [rows - 1][vectors - 1], built at compile time.
template <int MR, int... NVs>
constexpr void fill_row(TileFn *row, std::integer_sequence<int, NVs...>) {
  ((row[NVs] = &tile<MR, NVs + 1>), ...);
}
template <int... MRs>
constexpr void fill(TileFn (*t)[kNV], std::integer_sequence<int, MRs...>) {
  (fill_row<MRs + 1>(t[MRs], std::make_integer_sequence<int, kNV>{}), ...);
}
struct Tiles {
  TileFn fn[kMaxMR][kNV]{};
  constexpr Tiles() { fill(fn, std::make_integer_sequence<int, kMaxMR>{}); }
};
constexpr Tiles kTiles{};

// Compute y[:, panels [p0, p1)) for all M rows.
void compute_panels(const float *x, const float *w, const float *res, float *y, int64_t M, int64_t K, int64_t N,
                    int64_t p0,
                    int64_t p1) {
  // Rows are cut into nearly equal blocks of at most kMaxMR (16 rows -> 8 + 8, 20 -> 6 + 7 + 7).
  // The first block pulls the panel from DRAM (one sequential stream per thread, which the
  // hardware prefetchers follow well: measured, software prefetch gained nothing on Zen 4, nor
  // did prefetching the next panel into L2); later blocks reuse it from L2.
  const int64_t nblocks = (M + kMaxMR - 1) / kMaxMR;
  const int64_t stream_pf = g_stream_pf.load(std::memory_order_relaxed);
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * kPanel;
    const int64_t width = std::min(kPanel, N - n0);
    const float *wp = w + n0 * K;  // panel p starts after p full panels of kPanel * K floats
    const int nv = static_cast<int>((width + 15) / 16);
    const int last = static_cast<int>(width - 16 * (nv - 1));
    int64_t m = 0;
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t rows = (M - m) / (nblocks - b);  // even split of what is left
      const float *pf = (b == 0 && stream_pf > 0) ? wp + stream_pf : nullptr;  // prefetch never faults
      kTiles.fn[rows - 1][nv - 1](x + m * K, K, wp, width, y + m * N + n0, N, last, pf,
                                  res == nullptr ? nullptr : res + m * N + n0);
      m += rows;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Work split: the panels are cut into a few chunks per thread of the shared pool (pool.h).
struct Job {
  const float *x;
  const float *w;
  const float *res;  // nullptr, or [M, N] added to the product
  float *y;
  int64_t M, K, N;
  int64_t panels;   // ceil(N / kPanel)
  int64_t nchunks;  // chunk c covers panels [panels*c/nchunks, panels*(c+1)/nchunks)
};

void run_chunk(const void *ctx, int64_t c) {
  const Job &j = *static_cast<const Job *>(ctx);
  compute_panels(j.x, j.w, j.res, j.y, j.M, j.K, j.N, j.panels * c / j.nchunks, j.panels * (c + 1) / j.nchunks);
}

// Chunks per thread: a chunk should be long enough to stream well (>= ~256 KB of weights) but a
// few per thread let a thread that keeps its core steal from one that lost it.
int64_t chunk_count(const Job &j, int nthreads) {
  int64_t per = g_chunks_per_thread.load(std::memory_order_relaxed);
  if (per <= 0) {
    const int64_t bytes = j.K * j.N * 4;
    per = std::clamp<int64_t>(bytes / (int64_t{256} << 10) / std::max(1, nthreads), 1, 8);
  }
  return std::max<int64_t>(1, std::min<int64_t>({j.panels, nthreads * per, mindserve::kMaxChunks}));
}

using mindserve::pool;


void matmul(const float *x, const float *w, const float *res, float *y, int64_t M, int64_t K, int64_t N) {
  if (M <= 0 || N <= 0) return;
  mindserve::ScopeTimer timer(mindserve::kMatMul);
  if (K <= 0) {
    if (res != nullptr) std::memcpy(y, res, sizeof(float) * M * N);
    else std::memset(y, 0, sizeof(float) * M * N);
    return;
  }
  Job job{x, w, res, y, M, K, N, (N + kPanel - 1) / kPanel, 1};
  job.nchunks = chunk_count(job, pool().threads());
  pool().run(mindserve::Task{&run_chunk, &job, job.nchunks});
}

}  // namespace

extern "C" {

// Calls and total nanoseconds spent inside one kind of kernel (pool.h: 0 matmul, 1 attention,
// 2 rmsnorm, 3 swiglu, 4 qkv_rope) since the last reset (reset != 0 clears).
void mindserve_kernel_stats(int kind, uint64_t *calls, uint64_t *ns, int reset) {
  if (kind < 0 || kind >= mindserve::kKinds) {
    *calls = *ns = 0;
    return;
  }
  mindserve::Stats &s = mindserve::stats()[kind];
  *calls = reset ? s.calls.exchange(0) : s.calls.load();
  *ns = reset ? s.ns.exchange(0) : s.ns.load();
}

int mindserve_matmul_panel_width() { return static_cast<int>(kPanel); }

// The constants the Python side needs, as JSON (kernels.kernel_constants reads them; nothing restates them): the
// float panel width, the quantized formats in code order (qformat.h's traits), the column group, the segment table's
// bounds, the longest attention head and the stats kinds (pool.h).
const char *mindserve_kernel_constants() {
  static const std::string json = [] {
    std::string s = "{\"panel\": " + std::to_string(kPanel) + ", \"qgroup\": " + std::to_string(q::kGroup) +
                    ", \"max_segments\": " + std::to_string(q::kMaxSegments) +
                    ", \"segment_magic\": " + std::to_string(q::kSegMagic) +
                    ", \"max_head_dim\": " + std::to_string(mindserve::kv::kMaxHeadDim) + ", \"formats\": [";
    for (int f = 0; f < q::kFormats; ++f) {
      const q::Traits &t = q::kTraits[f];
      s += std::string(f ? ", " : "") + "{\"name\": \"" + t.name + "\", \"block\": " + std::to_string(t.block) +
           ", \"gguf_bytes\": " + std::to_string(t.gguf_bytes) +
           ", \"packed_bytes\": " + std::to_string(t.packed_bytes) + "}";
    }
    s += "], \"kinds\": [";
    for (int k = 0; k < mindserve::kKinds; ++k) s += std::string(k ? ", " : "") + "\"" + mindserve::kKindNames[k] + "\"";
    return s + "]}";
  }();
  return json.c_str();
}
// The named build variant (build.py's -DMINDSERVE_VARIANT) and the vector backend it compiled to.
const char *mindserve_kernel_variant() { return MINDSERVE_VARIANT; }
const char *mindserve_vec_isa() { return v::kIsa; }
int mindserve_matmul_set_threads(int n) {
  pool().set_threads(n);
  return pool().threads();
}
int mindserve_matmul_get_threads() { return pool().threads(); }
// For the tests: set the calling thread's floating-point mode and return the one it had; and the mode that flushes
// subnormals (MindSpore's pool threads: FTZ + DAZ on x86, FZ on ARM), 0 where there is none.
uint64_t mindserve_swap_fp_mode(uint64_t mode) {
  const uint64_t old = mindserve::get_fp_mode();
  mindserve::set_fp_mode(static_cast<mindserve::FpMode>(mode));
  return old;
}
uint64_t mindserve_flush_fp_mode() {
#if defined(__x86_64__) || defined(__i386__)
  return mindserve::kDefaultFp | 0x8040;
#elif defined(__aarch64__)
  return uint64_t{1} << 24;
#else
  return 0;
#endif
}
// Benchmark knobs (negative = leave unchanged): software prefetch distance in floats (0 = off,
// the default) and chunks per thread (0 = automatic). None of them changes any result bit.
void mindserve_matmul_tune(int64_t stream_pf, int chunks_per_thread) {
  if (stream_pf >= 0) g_stream_pf.store(stream_pf);
  if (chunks_per_thread >= 0) g_chunks_per_thread.store(chunks_per_thread);
}
int mindserve_matmul_set_spin_us(int us) {
  pool().set_spin_us(us);
  return 0;
}

void mindserve_matmul_raw(const float *x, const float *w_packed, float *y, int64_t M, int64_t K, int64_t N) {
  mindserve::FpScope fp;
  matmul(x, w_packed, nullptr, y, M, K, N);
}

void mindserve_matmul_add_raw(const float *x, const float *w_packed, const float *res, float *y, int64_t M, int64_t K,
                              int64_t N) {
  mindserve::FpScope fp;
  matmul(x, w_packed, res, y, M, K, N);
}

// y = (res +) x @ W + each row's LoRA delta (lora.h; a [S, K, G*R], b [S, R, N], rows [M], segs [G + 1]).
void mindserve_matmul_lora_raw(const float *x, const float *w_packed, const float *res, float *y, int64_t M,
                               int64_t K, int64_t N, const float *a, const float *b, const int32_t *rows,
                               const int32_t *segs, int64_t S, int64_t G, int64_t R) {
  mindserve::FpScope fp;
  matmul(x, w_packed, res, y, M, K, N);
  mindserve::lora_apply(mindserve::LoraArgs{a, b, rows, segs, S, G, R}, x, M, K, y, N);
}

// AOT entries: inputs x [..., K], the packed W [1, K, N], (MatMulAdd) res [..., N] and optionally the four
// LoRA inputs of lora.h; output y [..., N] = x @ W (+ res) (+ each row's LoRA delta); float32 only.
// A uint8 W is a quantized one (qmatmul.cc).
static int matmul_entry(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool add) {
  if (nparam >= 2 && std::strcmp(dtypes[1], "uint8") == 0)
    return mindserve::qmatmul_entry(nparam, params, ndims, shapes, dtypes, add);
  const int nin = add ? 3 : 2;
  const bool lora = nparam == nin + mindserve::kLoraInputs + 1;
  if (nparam != nin + 1 && !lora) return 1;
  const int out = nparam - 1;
  if (!mindserve::all_f32(dtypes, nin) || !mindserve::is_f32(dtypes[out])) return 2;
  if (ndims[0] < 1 || ndims[1] != 3 || shapes[1][0] != 1 || ndims[out] < 1) return 3;
  const int64_t K = shapes[0][ndims[0] - 1];
  const int64_t M = mindserve::rows_of(ndims[0], shapes[0]);
  if (shapes[1][1] != K) return 4;
  const int64_t N = shapes[1][2];
  if (shapes[out][ndims[out] - 1] != N) return 5;
  if (add && (ndims[2] < 1 || shapes[2][ndims[2] - 1] != N || mindserve::rows_of(ndims[2], shapes[2]) != M)) return 6;
  mindserve::LoraArgs l;
  if (lora) {
    const int err = mindserve::lora_args(params, ndims, shapes, dtypes, nin, M, K, N, &l);
    if (err != 0) return err;
  }
  const auto *x = static_cast<const float *>(params[0]);
  auto *y = static_cast<float *>(params[out]);
  matmul(x, static_cast<const float *>(params[1]), add ? static_cast<const float *>(params[2]) : nullptr, y, M, K, N);
  if (lora) mindserve::lora_apply(l, x, M, K, y, N);
  return 0;
}

static int entry_matmul(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  return matmul_entry(nparam, params, ndims, shapes, dtypes, false);
}
MINDSERVE_ENTRY(MindserveMatMul, entry_matmul)

static int entry_matmul_add(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  return matmul_entry(nparam, params, ndims, shapes, dtypes, true);
}
MINDSERVE_ENTRY(MindserveMatMulAdd, entry_matmul_add)

}  // extern "C"
