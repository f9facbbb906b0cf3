// mindserve kernels: the persistent thread pool shared by every kernel in the library.
//
// The caller always works too. A task is cut into chunks and every thread (caller included)
// claims chunks until none are left, so a worker that the OS has descheduled (the box is shared)
// only delays the chunk it already holds. Idle workers spin for a short while (kernels come in
// bursts inside a graph) and then sleep on a futex, so they do not keep a core away from
// MindSpore's own kernels. Which thread runs a chunk never changes what the chunk computes (every thread
// computes in fpenv.h's one floating-point mode).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "fpenv.h"
#include "vec.h"

namespace mindserve {

constexpr int64_t kMaxChunks = 4096;  // must fit the ticket's 20-bit fields
// Most threads of the pool (backends/cpus.py MAX_THREADS, the threads key's maximum). The kernels cut a task
// into at most 8 chunks a thread, so 8 * kMaxThreads stays within kMaxChunks.
constexpr int kMaxThreads = 256;
static_assert(8 * kMaxThreads <= kMaxChunks);

// run(ctx, chunk) for chunk in [0, nchunks).
struct Task {
  void (*run)(const void *ctx, int64_t chunk);
  const void *ctx;
  int64_t nchunks;
};

class Pool {
 public:
  void set_threads(int n) {
    std::lock_guard<std::mutex> g(busy_);
    stop();
    n = std::max(1, std::min(n, kMaxThreads));
    nthreads_ = n;
    quit_.store(false);
    // Workers start from the current wake generation: a task published before a worker first
    // runs must still be seen as new by it.
    const uint32_t g0 = wake_.load();
    for (int t = 1; t < n; ++t) workers_.emplace_back([this, g0] { loop(g0); });
  }
  int threads() const { return nthreads_; }
  void set_spin_us(int us) { spin_us_.store(std::max(0, us)); }

  void run(const Task &in) {
    Task task = in;
    task.nchunks = std::clamp<int64_t>(task.nchunks, 1, kMaxChunks);
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (nthreads_ <= 1 || task.nchunks == 1 || !lock.owns_lock()) {
      // Single thread, or a concurrent kernel owns the pool: do it here (same arithmetic).
      for (int64_t c = 0; c < task.nchunks; ++c) task.run(task.ctx, c);
      return;
    }
    task_ = task;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t g = ((ticket_.load(std::memory_order_relaxed) >> 40) + 1) & 0xFFFFFFu;
    ticket_.store((g << 40) | (static_cast<uint64_t>(task.nchunks) << 20),
                  std::memory_order_release);  // publishes task_ and done_
    wake_.fetch_add(1);
    if (sleepers_.load() > 0) wake_.notify_all();
    work();
    int spins = 0;
    while (done_.load(std::memory_order_acquire) != task.nchunks) {
      vec::cpu_relax();
      if (++spins > 4096) std::this_thread::yield();  // a preempted worker holds a chunk
    }
  }

 private:
  // Claim and run chunks of the current task until none are left.
  void work() {
    for (;;) {
      // ticket_ = (generation << 40) | (nchunks << 20) | next index, all in one word: a claim
      // (CAS) succeeds only on the live ticket of the current task, and a chunk that is not yet
      // done keeps that task (and task_) alive until we report it.
      uint64_t t = ticket_.load(std::memory_order_acquire);
      const int64_t n = static_cast<int64_t>((t >> 20) & 0xFFFFFu);
      const int64_t idx = static_cast<int64_t>(t & 0xFFFFFu);
      if (idx >= n) return;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      task_.run(task_.ctx, idx);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void loop(uint32_t seen) {
    set_fp_mode(kDefaultFp);  // the mode every chunk runs in (fpenv.h), not the creating thread's
    for (;;) {
      uint32_t g = wake_.load(std::memory_order_acquire);
      if (g == seen) {
        const auto start = std::chrono::steady_clock::now();
        const auto budget = std::chrono::microseconds(spin_us_.load());
        int iter = 0;
        while ((g = wake_.load(std::memory_order_acquire)) == seen) {
          vec::cpu_relax();
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
  std::atomic<uint64_t> ticket_{0};    // (task generation << 40) | (nchunks << 20) | next index
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> spin_us_{50};
  std::atomic<bool> quit_{false};
  int nthreads_ = 1;
  Task task_{};
};

// The one pool of the library (an inline function: every source file gets the same instance).
inline Pool &pool() {
  static Pool *p = [] {
    auto *q = new Pool();  // leaked on purpose: no teardown ordering issues at process exit
    q->set_threads(2);     // until the engine sets its count (EngineConfig.threads) with set_kernel_threads
    return q;
  }();
  return *p;
}

// fn(r) for every row r in [0, n), the rows cut into `chunks` nearly equal runs, one pool chunk each.
template <class Fn>
void for_row_chunks(int64_t n, int64_t chunks, const Fn &fn) {
  struct Ctx {
    const Fn *fn;
    int64_t n, chunks;
  } ctx{&fn, n, std::max<int64_t>(1, chunks)};
  pool().run(Task{[](const void *p, int64_t c) {
                    const Ctx &x = *static_cast<const Ctx *>(p);
                    for (int64_t r = x.n * c / x.chunks; r < x.n * (c + 1) / x.chunks; ++r) (*x.fn)(r);
                  },
                  &ctx, ctx.chunks});
}

// Kernel-side accounting (cheap; for benchmarks): calls and nanoseconds spent inside each kind of
// kernel, read with mindserve_kernel_stats(kind, ...).
enum Kind { kMatMul = 0, kAttention, kRMSNorm, kSwiGLU, kQKVRope, kKinds };
constexpr const char *kKindNames[kKinds] = {"matmul", "attention", "rmsnorm", "swiglu", "qkv_rope"};

struct Stats {
  std::atomic<uint64_t> calls{0}, ns{0};
};

inline Stats *stats() {
  static Stats s[kKinds];
  return s;
}

// Times its scope into stats()[kind].
class ScopeTimer {
 public:
  explicit ScopeTimer(Kind kind) : kind_(kind), t0_(std::chrono::steady_clock::now()) {}
  ~ScopeTimer() {
    const auto dt = std::chrono::steady_clock::now() - t0_;
    stats()[kind_].ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(dt).count(),
                                std::memory_order_relaxed);
    stats()[kind_].calls.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  Kind kind_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace mindserve
