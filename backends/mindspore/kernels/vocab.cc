// mindserve kernels: the work of a step that is as wide as the vocabulary, outside the head's matmul.
//
//   mindserve_vocab_scan(logits, rows, stride, V, k, argmax [rows] i32, lse [rows] f64, best_ids [rows, k] i32,
//                        best_vals [rows, k] f32) -> 0, or 1 on bad arguments
//       one pass over each row of logits (row r: V floats at logits + r * stride) giving what a greedy or top-k
//       chooser needs of it, so that no row is copied or sorted: its argmax (the first index of its largest value),
//       its log-sum-exp, and its k best (value descending, then id ascending: a total order, so the set and its
//       order are unique; rows shorter than k end in id -1, value -inf), 0 <= k <= kMaxBest.
//       The log-sum-exp is defined chunk-wise, so its bits do not depend on the thread count: the row is cut into
//       chunks of kChunk values; chunk c has its max m_c and s_c = the double sum over its runs of 256 values of
//       reduce_add(the 16 lanes' float sums of exp_nonpositive(x - m_c)); then, in double and in chunk order,
//       lse = M + log(sum_c s_c * exp(m_c - M)) with M the row's max (-inf for a row of -inf only, +inf if M is).
//       exp_nonpositive (vec.h) is the same on every backend, so every variant gives the same bits.
//   MindserveEmbedRopePacked(ids [N] i32, pos [N] i32, head [1, C/32 * 34, V] u8, cos_t [P, D], sin_t [P, D])
//       -> x [N, C], cos [N, D], sin [N, D]: MindserveEmbedRope (fused.cc) with the embedding rows dequantized from
//       a tied head's packed Q8_0 weight (qformat.h: groups of 16 columns, per block 8 quant dwords per
//       column stored q + 128, then the fp16 scales), w = d * q as quant.dequantize computes it: the same bits as a
//       float32 embedding table, without the table (262,144 x 640 floats: 671 MB for Gemma 3).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "entry.h"
#include "qformat.h"
#include "kv_format.h"
#include "pool.h"
#include "vec.h"

namespace {

namespace v = mindserve::vec;

constexpr int64_t kChunk = 4096;  // values per chunk of a row (part of the log-sum-exp's definition)
constexpr int64_t kRun = 256;     // values per float partial sum inside a chunk
constexpr int kMaxBest = 256;     // the most best ids a scan keeps per row
constexpr int64_t kQ8Bytes = mindserve::q::kTraits[mindserve::q::kQ8_0].packed_bytes;  // per column per block of 32
constexpr int64_t kGroup = mindserve::q::kGroup;  // columns per group of a packed weight

// One chunk's results; its best list lives in the scan's buffers.
struct Part {
  float max;
  int32_t arg;
  int32_t count;  // entries of the best list
  double sum;
};

// Insert (val, id) into best [count] (value desc, id asc), keeping at most k; `id` is larger than every id there.
inline void insert(float val, int32_t id, int k, float *vals, int32_t *ids, int32_t *count) {
  int n = *count;
  int at = n;
  while (at > 0 && vals[at - 1] < val) --at;  // equal values keep the earlier (smaller) id first
  if (at >= k) return;
  if (n == k) --n;
  for (int i = n; i > at; --i) vals[i] = vals[i - 1], ids[i] = ids[i - 1];
  vals[at] = val, ids[at] = id;
  *count = n + 1;
}

void scan_chunk(const float *x, int64_t n, int32_t base, int k, Part *p, float *vals, int32_t *ids) {
  p->max = -INFINITY, p->arg = -1, p->count = 0, p->sum = 0.0;
  for (int64_t i = 0; i < n; i += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, n - i));
    const float bm = v::reduce_max(v::fill_tail(v::load_n(x + i, m), m, -INFINITY));
    if (bm > p->max || p->arg < 0) {
      int j = 0;
      while (j < m - 1 && !(x[i + j] == bm)) ++j;
      p->max = bm, p->arg = base + static_cast<int32_t>(i + j);
    }
    if (k > 0 && (p->count < k || bm > vals[k - 1]))
      for (int j = 0; j < m; ++j)
        if (p->count < k || x[i + j] > vals[k - 1]) insert(x[i + j], base + static_cast<int32_t>(i + j), k, vals, ids,
                                                            &p->count);
  }
  if (!(p->max > -INFINITY) || p->max == INFINITY) return;  // all -inf (sum 0), or +inf: the row's lse says so
  const v::F32x16 mx = v::set1(p->max);
  for (int64_t r = 0; r < n; r += kRun) {
    v::F32x16 acc = v::zero();
    for (int64_t i = r; i < std::min(r + kRun, n); i += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, n - i));
      acc = v::add(acc, v::keep_first(v::exp_nonpositive(v::sub(v::load_n(x + i, m), mx)), m));
    }
    p->sum += static_cast<double>(v::reduce_add(acc));
  }
}

struct ScanJob {
  const float *logits;
  int64_t rows, stride, V, chunks, units, tasks;
  int k;
  Part *parts;
  float *vals;
  int32_t *ids;
};

void scan_units(const void *ctx, int64_t t) {
  const ScanJob &j = *static_cast<const ScanJob *>(ctx);
  for (int64_t u = j.units * t / j.tasks; u < j.units * (t + 1) / j.tasks; ++u) {
    const int64_t r = u / j.chunks, c = u % j.chunks, start = c * kChunk;
    scan_chunk(j.logits + r * j.stride + start, std::min(kChunk, j.V - start), static_cast<int32_t>(start), j.k,
               j.parts + u, j.vals + u * j.k, j.ids + u * j.k);
  }
}

// Row r's results from its chunks' parts, in chunk order.
void combine(const ScanJob &j, int64_t r, int32_t *argmax, double *lse, int32_t *best_ids, float *best_vals) {
  const Part *parts = j.parts + r * j.chunks;
  float M = parts[0].max;
  int32_t arg = parts[0].arg;
  for (int64_t c = 1; c < j.chunks; ++c)
    if (parts[c].max > M) M = parts[c].max, arg = parts[c].arg;
  *argmax = arg;
  if (!(M > -INFINITY) || M == INFINITY) {
    *lse = M;
  } else {
    double s = 0.0;
    for (int64_t c = 0; c < j.chunks; ++c)
      if (parts[c].max > -INFINITY) s += parts[c].sum * std::exp(static_cast<double>(parts[c].max) - M);
    *lse = static_cast<double>(M) + std::log(s);
  }
  if (j.k == 0) return;
  int32_t count = 0;
  for (int64_t c = 0; c < j.chunks; ++c) {  // chunks in id order: each merge keeps the ids-ascending tie rule
    const int64_t u = r * j.chunks + c;
    for (int i = 0; i < parts[c].count; ++i) {
      const float val = j.vals[u * j.k + i];
      if (count == j.k && !(val > best_vals[j.k - 1])) break;  // this chunk's list is sorted: none of the rest fit
      insert(val, j.ids[u * j.k + i], j.k, best_vals, best_ids, &count);
    }
  }
  for (int i = count; i < j.k; ++i) best_vals[i] = -INFINITY, best_ids[i] = -1;
}

}  // namespace

extern "C" {

int mindserve_vocab_scan(const float *logits, int64_t rows, int64_t stride, int64_t V, int64_t k, int32_t *argmax,
                         double *lse, int32_t *best_ids, float *best_vals) {
  mindserve::FpScope fp;
  if (rows < 0 || V <= 0 || V > INT32_MAX || stride < V || k < 0 || k > kMaxBest) return 1;
  if (rows == 0) return 0;
  ScanJob job{logits, rows, stride, V, (V + kChunk - 1) / kChunk, 0, 0, static_cast<int>(k), nullptr, nullptr,
              nullptr};
  job.units = rows * job.chunks;
  job.tasks = std::clamp<int64_t>(job.units, 1, 8 * mindserve::pool().threads());
  thread_local std::vector<Part> parts;  // kept between calls: no fresh pages each step
  thread_local std::vector<float> vals;
  thread_local std::vector<int32_t> ids;
  parts.resize(std::max<size_t>(parts.size(), job.units));
  vals.resize(std::max<size_t>(vals.size(), job.units * k));
  ids.resize(std::max<size_t>(ids.size(), job.units * k));
  job.parts = parts.data(), job.vals = vals.data(), job.ids = ids.data();
  mindserve::pool().run(mindserve::Task{&scan_units, &job, job.tasks});
  for (int64_t r = 0; r < rows; ++r) combine(job, r, argmax + r, lse + r, best_ids + r * k, best_vals + r * k);
  return 0;
}

static int entry_embed_rope_packed(int nparam, void **params, int *ndims, int64_t **shapes,
                                   const char **dtypes) {
  if (nparam != 8) return 1;
  if (!mindserve::is_i32(dtypes[0]) || !mindserve::is_i32(dtypes[1]) || std::strcmp(dtypes[2], "uint8") != 0 ||
      !mindserve::all_f32(dtypes + 3, 5))
    return 2;
  if (ndims[2] != 3 || shapes[2][0] != 1) return 3;
  for (int i = 3; i < 8; ++i)
    if (ndims[i] != 2) return 3;
  int64_t N = 1, Np = 1;
  for (int d = 0; d < ndims[0]; ++d) N *= shapes[0][d];
  for (int d = 0; d < ndims[1]; ++d) Np *= shapes[1][d];
  const int64_t C = shapes[5][1], D = shapes[3][1], V = shapes[2][2], nb = C / 32, P = shapes[3][0];
  if (Np != N || C % 32 != 0 || shapes[2][1] != nb * kQ8Bytes || shapes[4][0] != P || shapes[4][1] != D ||
      shapes[5][0] != N || shapes[6][0] != N || shapes[6][1] != D || shapes[7][0] != N || shapes[7][1] != D)
    return 4;
  const auto *ids = static_cast<const int32_t *>(params[0]), *pos = static_cast<const int32_t *>(params[1]);
  const auto *head = static_cast<const uint8_t *>(params[2]);
  for (int64_t i = 0; i < N; ++i) {
    if (ids[i] < 0 || ids[i] >= V) return 5;  // a token id outside the embedding
    if (pos[i] < 0 || pos[i] >= P) return 6;  // a position outside the rotary tables
  }
  float *x = static_cast<float *>(params[5]), *cos = static_cast<float *>(params[6]);
  float *sin = static_cast<float *>(params[7]);
  const auto *cos_t = static_cast<const float *>(params[3]), *sin_t = static_cast<const float *>(params[4]);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t g = ids[i] / kGroup, col = ids[i] % kGroup, w = std::min(kGroup, V - g * kGroup);
    const uint8_t *group = head + g * kGroup * nb * kQ8Bytes;  // the groups before it are all 16 columns wide
    float *row = x + i * C;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t *blk = group + b * w * kQ8Bytes;
      uint16_t h;
      std::memcpy(&h, blk + 32 * w + 2 * col, 2);  // little-endian fp16, as the packing writes it
      const float d = mindserve::kv::f16_to_f32(h);
      for (int q = 0; q < 8; ++q) {
        const uint8_t *dw = blk + (q * w + col) * 4;
        for (int l = 0; l < 4; ++l) row[32 * b + 4 * q + l] = d * static_cast<float>(static_cast<int>(dw[l]) - 128);
      }
    }
    std::memcpy(cos + i * D, cos_t + int64_t{pos[i]} * D, sizeof(float) * D);
    std::memcpy(sin + i * D, sin_t + int64_t{pos[i]} * D, sizeof(float) * D);
  }
  return 0;
}
MINDSERVE_ENTRY(MindserveEmbedRopePacked, entry_embed_rope_packed)

}  // extern "C"
