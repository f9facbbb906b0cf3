// mindserve fp32 matmul for MindSpore AOT custom ops on CPU (AVX-512).
//
//   y[M, N] = x[M, K] @ W[K, N]      (W row-major [K, N], all float32)
//
// Determinism contract: every output element y[m, n] is produced by the same sequence of
// floating-point operations whatever M is, whatever the other rows hold, whatever the thread
// count and whatever tile shape is picked: acc = 0; for k = 0..K-1: acc = fma(x[m,k], W[k,n], acc).
// Partial accumulators may be spilled to y between K blocks (an exact fp32 store/load), and the
// work is only ever split across N (columns), never across K. Only FMA intrinsics are used for
// the arithmetic, so compiler contraction settings cannot change the result.
//
// Exported entry points:
//   int MindserveMatMul(int nparam, void **params, int *ndims, int64_t **shapes,
//                       const char **dtypes, void *stream, void *extra)   -- the AOT kernel
//   int mindserve_matmul_set_threads(int n)   -- kernel threads including the caller (>=1)
//   int mindserve_matmul_get_threads()
//   void mindserve_matmul_stats(uint64_t *calls, uint64_t *ns, int reset)  -- time inside the kernel
//   int mindserve_matmul_set_spin_us(int us)  -- how long idle workers spin before sleeping
//   void mindserve_matmul_tune(gemv_kc, gemm_kc, chunks_per_thread, gemv_pf, gemm_pf) -- benchmarks
//   void mindserve_matmul_raw(const float*, const float*, float*, int64_t M, int64_t K, int64_t N)
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#if !defined(__AVX512F__)
#error "matmul.cc needs AVX-512F (build with -march=native on an AVX-512 CPU)"
#endif

namespace {

// ---------------------------------------------------------------------------------------------
// Micro-kernel: rows [0, MR) of x (leading dim ldx), columns [n, n + 16*NV) of W / y, k in
// [k0, k1). The last vector is masked with `last` (all ones when the tile is full).
// first == true starts from zero accumulators, otherwise from the partial sums held in y.
// pfd > 0: software-prefetch the weights pfd floats ahead of each row of the tile (pass
// pfd = r * ldw to prefetch the same columns r rows further down, i.e. the next K block).
template <int MR, int NV>
inline void tile(const float *__restrict x, int64_t ldx, const float *__restrict w, int64_t ldw,
                 float *__restrict y, int64_t ldy, int64_t k0, int64_t k1, __mmask16 last, bool first,
                 int64_t pfd) {
  __m512 acc[MR][NV];
  if (first) {
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
      _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  } else {
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
      _Pragma("GCC unroll 8") for (int v = 0; v < NV - 1; ++v) acc[r][v] = _mm512_loadu_ps(y + r * ldy + 16 * v);
      acc[r][NV - 1] = _mm512_maskz_loadu_ps(last, y + r * ldy + 16 * (NV - 1));
    }
  }
  const float *wk = w + k0 * ldw;
  for (int64_t k = k0; k < k1; ++k, wk += ldw) {
    if (pfd > 0) {
      _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v)
        _mm_prefetch(reinterpret_cast<const char *>(wk + pfd + 16 * v), _MM_HINT_T0);
    }
    __m512 wv[NV];
    _Pragma("GCC unroll 8") for (int v = 0; v < NV - 1; ++v) wv[v] = _mm512_loadu_ps(wk + 16 * v);
    wv[NV - 1] = _mm512_maskz_loadu_ps(last, wk + 16 * (NV - 1));
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
    _Pragma("GCC unroll 8") for (int v = 0; v < NV - 1; ++v) _mm512_storeu_ps(y + r * ldy + 16 * v, acc[r][v]);
    _mm512_mask_storeu_ps(y + r * ldy + 16 * (NV - 1), last, acc[r][NV - 1]);
  }
}

// Column strip [n, n + ncols) (ncols <= 16*NV), rows [m0, m1): dispatch on the remaining rows and
// vectors so any M and N are covered by the same arithmetic.
template <int NV>
struct Strip {
  template <int MR>
  static void rows(const float *x, int64_t K, const float *w, int64_t N, float *y, int64_t m, int64_t n,
                   int nv, __mmask16 last, int64_t k0, int64_t k1, bool first, int64_t pfd) {
    const float *xr = x + m * K;
    float *yr = y + m * N + n;
    const float *wn = w + n;
    switch (nv) {
#define MS_CASE(V)                                                                   \
  case V:                                                                            \
    if (V <= NV) {                                                                   \
      tile<MR, (V <= NV ? V : 1)>(xr, K, wn, N, yr, N, k0, k1, last, first, pfd);    \
    }                                                                                \
    break;
      MS_CASE(1) MS_CASE(2) MS_CASE(3) MS_CASE(4) MS_CASE(5) MS_CASE(6) MS_CASE(7) MS_CASE(8)
#undef MS_CASE
      default: break;
    }
  }
};

constexpr int kMaxMR = 6;   // 6 rows x 4 vectors = 24 accumulators + 4 weight registers
constexpr int kNVBig = 4;   // M > 2: 64-column tiles
constexpr int kNVGemv = 8;  // M <= 2: 128-column tiles

// Tunables (benchmarking only; none of them changes any result bit).
// 0 = automatic (measured on Zen 4: see compute_cols).
std::atomic<int> g_gemv_kc{0};          // K block for M <= 2
std::atomic<int> g_gemm_kc{0};          // K block for M > 2
std::atomic<int> g_chunks_per_thread{1};  // long row segments stream best; idle chunks are stolen
std::atomic<int> g_gemv_pf{-1};         // prefetch distance (floats along a row), M <= 2; -1 auto
std::atomic<int> g_gemm_pf{-1};         // same for M > 2 (issued by the first row block only)
std::atomic<int> g_pf_rows{-1};         // > 0: prefetch that many rows ahead instead; -1 auto

// Compute y[:, n_begin:n_end] for all M rows.
void compute_cols(const float *x, const float *w, float *y, int64_t M, int64_t K, int64_t N, int64_t n_begin,
                  int64_t n_end) {
  if (n_begin >= n_end) return;
  // Tile shapes depend only on M; the arithmetic per element does not depend on them at all.
  const bool gemv = (M <= 2);
  const int nv_max = gemv ? kNVGemv : kNVBig;
  const int64_t strip = 16 * nv_max;
  // K blocking: GEMV-like calls stream a few rows of W at a time (sequential streams for the
  // prefetchers, partial sums in y which stays in L1/L2); GEMM-like calls keep a KC x strip
  // panel of W hot in L1 while all row blocks use it.
  // Measured defaults: wide GEMV streams 4 rows at a time with no software prefetch; narrow
  // (short rows) GEMV prefers 16 rows and a 2 KB prefetch; GEMM 16-row panels, 1 KB prefetch.
  const bool narrow = N <= 1024;
  int64_t KC = gemv ? g_gemv_kc.load(std::memory_order_relaxed) : g_gemm_kc.load(std::memory_order_relaxed);
  if (KC <= 0) KC = gemv ? (narrow ? 16 : 4) : 16;
  int64_t pfd = gemv ? g_gemv_pf.load(std::memory_order_relaxed) : g_gemm_pf.load(std::memory_order_relaxed);
  if (pfd < 0) pfd = gemv ? (narrow ? 512 : 0) : 256;
  int64_t pf_rows = g_pf_rows.load(std::memory_order_relaxed);
  if (pf_rows < 0) pf_rows = 0;
  if (pf_rows > 0) pfd = pf_rows * N;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    const bool first = (k0 == 0);
    for (int64_t n = n_begin; n < n_end; n += strip) {
      const int64_t ncols = std::min(strip, n_end - n);
      const int nv = static_cast<int>((ncols + 15) / 16);
      const int rem = static_cast<int>(ncols - 16 * (nv - 1));
      const __mmask16 last = static_cast<__mmask16>(rem == 16 ? 0xFFFF : ((1u << rem) - 1));
      if (gemv) {
        for (int64_t m = 0; m < M; m += 2) {
          const int64_t pf = pfd;
          if (M - m == 1)
            Strip<kNVGemv>::rows<1>(x, K, w, N, y, m, n, nv, last, k0, k1, first, pf);
          else
            Strip<kNVGemv>::rows<2>(x, K, w, N, y, m, n, nv, last, k0, k1, first, pf);
        }
        continue;
      }
      for (int64_t m = 0; m < M; m += kMaxMR) {
        const int64_t pf = (m == 0) ? pfd : 0;
        switch (std::min<int64_t>(kMaxMR, M - m)) {
          case 1: Strip<kNVBig>::rows<1>(x, K, w, N, y, m, n, nv, last, k0, k1, first, pf); break;
          case 2: Strip<kNVBig>::rows<2>(x, K, w, N, y, m, n, nv, last, k0, k1, first, pf); break;
          case 3: Strip<kNVBig>::rows<3>(x, K, w, N, y, m, n, nv, last, k0, k1, first, pf); break;
          case 4: Strip<kNVBig>::rows<4>(x, K, w, N, y, m, n, nv, last, k0, k1, first, pf); break;
          case 5: Strip<kNVBig>::rows<5>(x, K, w, N, y, m, n, nv, last, k0, k1, first, pf); break;
          default: Strip<kNVBig>::rows<6>(x, K, w, N, y, m, n, nv, last, k0, k1, first, pf); break;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// A tiny persistent thread pool. The caller always works too. The columns are cut into a few
// chunks per thread and every thread (caller included) claims chunks until none are left, so a
// worker that the OS has descheduled (the box is shared) only delays the chunk it already holds.
// Idle workers spin for a short while (kernels come in bursts inside a graph) and then sleep on
// a futex, so they do not keep a core away from MindSpore's own kernels.
constexpr int64_t kMaxChunks = 4096;  // must fit the ticket's 20-bit fields

struct Job {
  const float *x;
  const float *w;
  float *y;
  int64_t M, K, N;
  int64_t vecs;     // ceil(N / 16)
  int64_t nchunks;  // chunk c covers vectors [vecs*c/nchunks, vecs*(c+1)/nchunks)
};

void run_chunk(const Job &j, int64_t c) {
  const int64_t v0 = j.vecs * c / j.nchunks, v1 = j.vecs * (c + 1) / j.nchunks;
  compute_cols(j.x, j.w, j.y, j.M, j.K, j.N, std::min(j.N, 16 * v0), std::min(j.N, 16 * v1));
}

class Pool {
 public:
  void set_threads(int n) {
    std::lock_guard<std::mutex> g(busy_);
    stop();
    n = std::max(1, std::min(n, 64));
    nthreads_ = n;
    quit_.store(false);
    // Workers start from the current wake generation: a job published before a worker first
    // runs must still be seen as new by it.
    const uint32_t g0 = wake_.load();
    for (int t = 1; t < n; ++t) workers_.emplace_back([this, g0] { loop(g0); });
  }
  int threads() const { return nthreads_; }
  void set_spin_us(int us) { spin_us_.store(std::max(0, us)); }

  void run(const Job &in) {
    Job job = in;
    const int64_t want = static_cast<int64_t>(nthreads_) * std::max(1, g_chunks_per_thread.load());
    job.nchunks = std::max<int64_t>(1, std::min<int64_t>({job.vecs, want, kMaxChunks}));
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (nthreads_ <= 1 || job.nchunks == 1 || !lock.owns_lock()) {
      // Single thread, or a concurrent kernel owns the pool: do it here (same arithmetic).
      for (int64_t c = 0; c < job.nchunks; ++c) run_chunk(job, c);
      return;
    }
    job_ = job;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t g = ((ticket_.load(std::memory_order_relaxed) >> 40) + 1) & 0xFFFFFFu;
    ticket_.store((g << 40) | (static_cast<uint64_t>(job.nchunks) << 20),
                  std::memory_order_release);  // publishes job_ and done_
    wake_.fetch_add(1);
    if (sleepers_.load() > 0) wake_.notify_all();
    work();
    int spins = 0;
    while (done_.load(std::memory_order_acquire) != job.nchunks) {
      _mm_pause();
      if (++spins > 4096) std::this_thread::yield();  // a preempted worker holds a chunk
    }
  }

 private:
  // Claim and run chunks of the current job until none are left.
  void work() {
    for (;;) {
      // ticket_ = (generation << 40) | (nchunks << 20) | next index, all in one word: a claim
      // (CAS) succeeds only on the live ticket of the current job, and a chunk that is not yet
      // done keeps that job (and job_) alive until we report it.
      uint64_t t = ticket_.load(std::memory_order_acquire);
      const int64_t n = static_cast<int64_t>((t >> 20) & 0xFFFFFu);
      const int64_t idx = static_cast<int64_t>(t & 0xFFFFFu);
      if (idx >= n) return;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      run_chunk(job_, idx);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void loop(uint32_t seen) {
    for (;;) {
      uint32_t g = wake_.load(std::memory_order_acquire);
      if (g == seen) {
        const auto start = std::chrono::steady_clock::now();
        const auto budget = std::chrono::microseconds(spin_us_.load());
        int iter = 0;
        while ((g = wake_.load(std::memory_order_acquire)) == seen) {
          _mm_pause();
          if (++iter == 64) {
            iter = 0;
            if (std::chrono::steady_clock::now() - start > budget) break;
          }
        }
        if (g == seen) {
          sleepers_.fetch_add(1);
          wake_.wait(seen);
          sleepers_.fetch_sub(1);
          continue;
        }
      }
      seen = g;
      if (quit_.load()) return;
      work();
    }
  }

  void stop() {
    if (workers_.empty()) return;
    quit_.store(true);
    wake_.fetch_add(1);
    wake_.notify_all();
    for (auto &th : workers_) th.join();
    workers_.clear();
  }

  std::mutex busy_;
  std::vector<std::thread> workers_;
  std::atomic<uint32_t> wake_{0};      // 32-bit: std::atomic::wait is a plain futex
  std::atomic<uint64_t> ticket_{0};    // (job generation << 40) | (nchunks << 20) | next index
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> spin_us_{50};
  std::atomic<bool> quit_{false};
  int nthreads_ = 1;
  Job job_{};
};

Pool &pool() {
  static Pool *p = [] {
    auto *q = new Pool();  // leaked on purpose: no teardown ordering issues at process exit
    int n = 2;
    if (const char *e = std::getenv("MINDSERVE_MATMUL_THREADS")) n = std::atoi(e);
    if (const char *e = std::getenv("MINDSERVE_MATMUL_SPIN_US")) q->set_spin_us(std::atoi(e));
    q->set_threads(n);
    return q;
  }();
  return *p;
}

std::atomic<uint64_t> g_calls{0}, g_ns{0};  // kernel-side accounting (cheap; for benchmarks)

void matmul(const float *x, const float *w, float *y, int64_t M, int64_t K, int64_t N) {
  if (M <= 0 || N <= 0) return;
  struct Timer {
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    ~Timer() {
      const auto dt = std::chrono::steady_clock::now() - t0;
      g_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(dt).count(), std::memory_order_relaxed);
      g_calls.fetch_add(1, std::memory_order_relaxed);
    }
  } timer;
  if (K <= 0) {
    std::memset(y, 0, sizeof(float) * M * N);
    return;
  }
  pool().run(Job{x, w, y, M, K, N, (N + 15) / 16, 1});
}

}  // namespace

extern "C" {

int mindserve_matmul_set_threads(int n) {
  pool().set_threads(n);
  return pool().threads();
}
int mindserve_matmul_get_threads() { return pool().threads(); }
// Calls and total nanoseconds spent inside the kernel since the last reset (reset != 0 clears).
void mindserve_matmul_stats(uint64_t *calls, uint64_t *ns, int reset) {
  *calls = reset ? g_calls.exchange(0) : g_calls.load();
  *ns = reset ? g_ns.exchange(0) : g_ns.load();
}
// Benchmark knobs: kc 0 = auto, pf -1 = auto; a value below that (e.g. -2) leaves a knob unchanged. None of them changes any result bit.
void mindserve_matmul_tune(int gemv_kc, int gemm_kc, int chunks_per_thread, int gemv_pf, int gemm_pf) {
  if (gemv_kc >= 0) g_gemv_kc.store(gemv_kc);
  if (gemm_kc >= 0) g_gemm_kc.store(gemm_kc);
  if (chunks_per_thread > 0) g_chunks_per_thread.store(chunks_per_thread);
  if (gemv_pf >= -1) g_gemv_pf.store(gemv_pf);
  if (gemm_pf >= -1) g_gemm_pf.store(gemm_pf);
}
void mindserve_matmul_tune_pf_rows(int rows) {
  if (rows >= -1) g_pf_rows.store(rows);
}
int mindserve_matmul_set_spin_us(int us) {
  pool().set_spin_us(us);
  return 0;
}

void mindserve_matmul_raw(const float *x, const float *w, float *y, int64_t M, int64_t K, int64_t N) {
  matmul(x, w, y, M, K, N);
}

// AOT entry: inputs x [..., K] and W [K, N], output y [..., N]; float32 only.
int MindserveMatMul(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                    void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 3) return 1;
  for (int i = 0; i < 3; ++i)
    if (std::strcmp(dtypes[i], "float32") != 0 && std::strcmp(dtypes[i], "float") != 0) return 2;
  if (ndims[0] < 1 || ndims[1] != 2 || ndims[2] < 1) return 3;
  const int64_t K = shapes[0][ndims[0] - 1];
  int64_t M = 1;
  for (int d = 0; d < ndims[0] - 1; ++d) M *= shapes[0][d];
  if (shapes[1][0] != K) return 4;
  const int64_t N = shapes[1][1];
  if (shapes[2][ndims[2] - 1] != N) return 5;
  matmul(static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
         static_cast<float *>(params[2]), M, K, N);
  return 0;
}

}  // extern "C"
