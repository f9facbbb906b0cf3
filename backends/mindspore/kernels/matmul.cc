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
//   int mindserve_matmul_set_spin_us(int us)  -- how long idle workers spin before sleeping
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
template <int MR, int NV>
inline void tile(const float *__restrict x, int64_t ldx, const float *__restrict w, int64_t ldw,
                 float *__restrict y, int64_t ldy, int64_t k0, int64_t k1, __mmask16 last, bool first) {
  __m512 acc[MR][NV];
  if (first) {
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  } else {
    for (int r = 0; r < MR; ++r) {
      for (int v = 0; v < NV - 1; ++v) acc[r][v] = _mm512_loadu_ps(y + r * ldy + 16 * v);
      acc[r][NV - 1] = _mm512_maskz_loadu_ps(last, y + r * ldy + 16 * (NV - 1));
    }
  }
  const float *wk = w + k0 * ldw;
  for (int64_t k = k0; k < k1; ++k, wk += ldw) {
    __m512 wv[NV];
    for (int v = 0; v < NV - 1; ++v) wv[v] = _mm512_loadu_ps(wk + 16 * v);
    wv[NV - 1] = _mm512_maskz_loadu_ps(last, wk + 16 * (NV - 1));
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV - 1; ++v) _mm512_storeu_ps(y + r * ldy + 16 * v, acc[r][v]);
    _mm512_mask_storeu_ps(y + r * ldy + 16 * (NV - 1), last, acc[r][NV - 1]);
  }
}

using TileFn = void (*)(const float *, int64_t, const float *, int64_t, float *, int64_t, int64_t, int64_t,
                        __mmask16, bool);

// Column strip [n, n + ncols) (ncols <= 16*NV), rows [m0, m1): dispatch on the remaining rows and
// vectors so any M and N are covered by the same arithmetic.
template <int NV>
struct Strip {
  template <int MR>
  static void rows(const float *x, int64_t K, const float *w, int64_t N, float *y, int64_t m, int64_t n,
                   int nv, __mmask16 last, int64_t k0, int64_t k1, bool first) {
    const float *xr = x + m * K;
    float *yr = y + m * N + n;
    const float *wn = w + n;
    switch (nv) {
#define MS_CASE(V) \
  case V:          \
    if (V <= NV) tile<MR, (V <= NV ? V : 1)>(xr, K, wn, N, yr, N, k0, k1, last, first); break;
      MS_CASE(1) MS_CASE(2) MS_CASE(3) MS_CASE(4) MS_CASE(5) MS_CASE(6) MS_CASE(7) MS_CASE(8)
#undef MS_CASE
      default: break;
    }
  }
};

constexpr int kMaxMR = 6;   // 6 rows x 4 vectors = 24 accumulators + 4 weight registers
constexpr int kNVBig = 4;   // M > 1: 64-column tiles
constexpr int kNVGemv = 8;  // M small: 128-column tiles

// Compute y[:, n_begin:n_end] for all M rows (one thread's share).
void compute_cols(const float *x, const float *w, float *y, int64_t M, int64_t K, int64_t N, int64_t n_begin,
                  int64_t n_end) {
  if (n_begin >= n_end) return;
  // Row-block size and tile width depend only on M (the same for every row of one call); the
  // arithmetic per element does not depend on them at all (see the contract above).
  const int nv_max = (M <= 2) ? kNVGemv : kNVBig;
  const int64_t strip = 16 * nv_max;
  // K blocking: GEMV-like calls stream a few rows of W at a time (sequential streams for the
  // prefetchers, partial sums in y which stays in L1/L2); GEMM-like calls keep a KC x strip
  // panel of W hot in L1 while all row blocks use it.
  const int64_t KC = (M <= 2) ? 16 : 128;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    const bool first = (k0 == 0);
    for (int64_t n = n_begin; n < n_end; n += strip) {
      const int64_t ncols = std::min(strip, n_end - n);
      const int nv = static_cast<int>((ncols + 15) / 16);
      const int rem = static_cast<int>(ncols - 16 * (nv - 1));
      const __mmask16 last = static_cast<__mmask16>(rem == 16 ? 0xFFFF : ((1u << rem) - 1));
      for (int64_t m = 0; m < M;) {
        const int64_t mr = std::min<int64_t>(kMaxMR, M - m);
        if (nv_max == kNVGemv) {
          switch (mr) {
            case 1: Strip<kNVGemv>::rows<1>(x, K, w, N, y, m, n, nv, last, k0, k1, first); break;
            default: Strip<kNVGemv>::rows<2>(x, K, w, N, y, m, n, nv, last, k0, k1, first); break;
          }
        } else {
          switch (mr) {
            case 1: Strip<kNVBig>::rows<1>(x, K, w, N, y, m, n, nv, last, k0, k1, first); break;
            case 2: Strip<kNVBig>::rows<2>(x, K, w, N, y, m, n, nv, last, k0, k1, first); break;
            case 3: Strip<kNVBig>::rows<3>(x, K, w, N, y, m, n, nv, last, k0, k1, first); break;
            case 4: Strip<kNVBig>::rows<4>(x, K, w, N, y, m, n, nv, last, k0, k1, first); break;
            case 5: Strip<kNVBig>::rows<5>(x, K, w, N, y, m, n, nv, last, k0, k1, first); break;
            default: Strip<kNVBig>::rows<6>(x, K, w, N, y, m, n, nv, last, k0, k1, first); break;
          }
        }
        m += (nv_max == kNVGemv) ? std::min<int64_t>(2, M - m) : mr;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// A tiny persistent thread pool: the caller is thread 0, workers 1..n-1. Workers spin for a short
// while after each job (kernels come in bursts inside a graph) and then sleep on a futex
// (std::atomic::wait), so they do not steal the cores from MindSpore's own kernels for long.
struct Job {
  const float *x;
  const float *w;
  float *y;
  int64_t M, K, N;
  int parts;
};

void run_part(const Job &j, int t) {
  // Split N into `parts` contiguous column ranges aligned to 16 (whole vectors).
  const int64_t vecs = (j.N + 15) / 16;
  const int64_t v0 = vecs * t / j.parts, v1 = vecs * (t + 1) / j.parts;
  compute_cols(j.x, j.w, j.y, j.M, j.K, j.N, std::min(j.N, 16 * v0), std::min(j.N, 16 * v1));
}

class Pool {
 public:
  ~Pool() { stop(); }

  void set_threads(int n) {
    std::lock_guard<std::mutex> g(busy_);
    stop();
    n = std::max(1, std::min(n, 64));
    nthreads_ = n;
    quit_.store(false);
    for (int t = 1; t < n; ++t) workers_.emplace_back([this, t] { loop(t); });
  }
  int threads() const { return nthreads_; }
  void set_spin_us(int us) { spin_us_.store(std::max(0, us)); }

  void run(const Job &job) {
    const int n = std::min<int64_t>(nthreads_, std::max<int64_t>(1, (job.N + 15) / 16));
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (n <= 1 || !lock.owns_lock()) {  // single thread, or a concurrent kernel owns the pool
      Job j = job;
      j.parts = 1;
      run_part(j, 0);
      return;
    }
    job_ = job;
    job_.parts = n;
    active_.store(n);
    remaining_.store(n - 1);
    gen_.fetch_add(1);
    if (sleepers_.load() > 0) gen_.notify_all();
    run_part(job_, 0);
    while (remaining_.load(std::memory_order_acquire) != 0) _mm_pause();
  }

 private:
  void loop(int t) {
    uint64_t seen = gen_.load();
    for (;;) {
      uint64_t g = gen_.load(std::memory_order_acquire);
      if (g == seen) {
        const auto start = std::chrono::steady_clock::now();
        const auto budget = std::chrono::microseconds(spin_us_.load());
        int iter = 0;
        while ((g = gen_.load(std::memory_order_acquire)) == seen) {
          _mm_pause();
          if (++iter == 64) {
            iter = 0;
            if (std::chrono::steady_clock::now() - start > budget) break;
          }
        }
        if (g == seen) {
          sleepers_.fetch_add(1);
          gen_.wait(seen);
          sleepers_.fetch_sub(1);
          continue;
        }
      }
      seen = g;
      if (quit_.load()) return;
      if (t < active_.load()) {
        run_part(job_, t);
        remaining_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  void stop() {
    if (workers_.empty()) return;
    quit_.store(true);
    gen_.fetch_add(1);
    gen_.notify_all();
    for (auto &th : workers_) th.join();
    workers_.clear();
  }

  std::mutex busy_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> remaining_{0};
  std::atomic<int> active_{0};
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

void matmul(const float *x, const float *w, float *y, int64_t M, int64_t K, int64_t N) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    std::memset(y, 0, sizeof(float) * M * N);
    return;
  }
  pool().run(Job{x, w, y, M, K, N, 1});
}

}  // namespace

extern "C" {

int mindserve_matmul_set_threads(int n) {
  pool().set_threads(n);
  return pool().threads();
}
int mindserve_matmul_get_threads() { return pool().threads(); }
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
