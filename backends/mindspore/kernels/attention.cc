// mindserve paged attention for MindSpore AOT custom ops on CPU (any ISA of vec.h).
//
// For every query token i (of N, from any number of sequences: decode rows and packed prompt
// chunks alike) and head h, with its sequence's block-table row b = rows[i], G = H / KV query heads
// per kv head, kvh = h / G, n = min(pos[i] + 1, NB * bs) visible keys and
// slot(b, j) = table[b, j / bs] * bs + j % bs:
//
//   s_j = dot(q[i, h], K[kvh * S + slot(b, j)]) / sqrt(D)          for j in [0, n)
//   out[i, h * D : (h + 1) * D] = sum_j softmax(s)_j * V[kvh * S + slot(b, j)]
//
// K and V are the layer's cache Parameters, [KV * S, width] with row kvh * S + slot (S = num_blocks
// * bs slots), exactly as QKVAttention has just written them, in one format of kv_format.h (the cache's
// dtype: float32, float16, bfloat16, or uint8 q8_0 blocks), read as float32 values: exact conversions, and
// float(q) * float(d) for q8_0, so the arithmetic below is the float32 one over the values the cache holds. The causal mask is the
// key count n, so the work follows each row's real length, not a padded window, and no mask,
// gathered window or score tensor is ever materialised.
//
// Determinism contract: a query's output depends only on its own q, its keys and values, read
// in key order with a fixed sequence of floating-point operations (dots in 16-lane FMA vectors
// reduced by vec.h's fixed tree; the softmax sum in one fixed vector order; the weighted sum
// in key order), the same on every instruction set. Nothing depends on the batch, the other rows, the thread count or the chunking,
// so a request's tokens are bit-identical alone or batched.
//
// Work is done in groups: the queries of one kv head from a run of up to kGroupQueries / G consecutive tokens of
// the same sequence (a verify row's 1 + k tokens, a prompt chunk's) read each key and value row once, converted to
// float32 once, and each query then does with it exactly the operations it would do alone (the same FMAs in the
// same order), so grouping changes the cost, never the bits. A lone token (a plain decode row) runs its queries one
// by one, and a batch of lone tokens only is chunked by queries. The pool's chunks hold about equal numbers of keys
// read (balanced_bounds), whatever the units.
//
// Exported entry points:
//   int MindservePagedAttention(int nparam, void **params, int *ndims, int64_t **shapes,
//                               const char **dtypes, void *stream, void *extra)  -- the AOT kernel
//       inputs q [N, H, D] f32, k [KV*S, width], v [KV*S, width] (one format of kv_format.h, the same for
//       both), table [R, NB] i32, pos [N] i32,
//       rows [N] i32, meta [2] i32 = (KV, bs); output [N, H*D] f32.
//       Returns non-zero (MindSpore raises) on a shape/dtype mismatch, a row index or a block id
//       out of range.
//   int mindserve_attention_raw(...)  -- the same on plain pointers (float32 caches), for the tests
//   int mindserve_attention_kv_raw(..., fmt)  -- ... caches in format fmt (kv::Format), for fused.cc and the tests
//   int mindserve_attention_window_raw(..., fmt, window, scale)  -- ... a query at position p reading only the keys
//       (p - window, p] when window > 0 (Gemma's sliding-window layers), scores scaled by scale when > 0 (else
//       1 / sqrt(D))
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "entry.h"
#include "kv_format.h"
#include "pool.h"
#include "vec.h"

namespace {

using mindserve::kv::kMaxHeadDim;

namespace v = mindserve::vec;
namespace kv = mindserve::kv;
using kv::Format;

// q8_0: the scale of the block holding value d of a row, in every lane (other formats: unused).
template <Format F>
inline v::F32x16 row_scale(const uint8_t *row, int64_t d) {
  if constexpr (F == Format::kQ8_0) {
    uint16_t h;
    std::memcpy(&h, row + d / kv::kQ8Block * kv::kQ8BlockBytes, 2);
    return v::set1(kv::f16_to_f32(h));
  } else {
    return v::zero();
  }
}

// Lanes [d, d + n) of a cache row of format F as float32 (d a multiple of 16; n >= 16: all 16; lanes past n
// are +0.0: q8_0's past the row's D are its zero padding); q8_0 multiplies by `scale`, row_scale(row, d).
template <Format F>
inline v::F32x16 load_row(const uint8_t *row, int64_t d, int64_t n, v::F32x16 scale) {
  if constexpr (F == Format::kF32) {
    return v::load_n(reinterpret_cast<const float *>(row) + d, n);
  } else if constexpr (F == Format::kF16) {
    return n >= 16 ? v::load_f16(row + 2 * d) : v::load_f16_part(row + 2 * d, static_cast<int>(n));
  } else if constexpr (F == Format::kBF16) {
    return n >= 16 ? v::load_bf16(row + 2 * d) : v::load_bf16_part(row + 2 * d, static_cast<int>(n));
  } else {
    const uint8_t *q = row + d / kv::kQ8Block * kv::kQ8BlockBytes + 2 + d % kv::kQ8Block;
    return v::mul(v::load_i8(reinterpret_cast<const int8_t *>(q)), scale);
  }
}

// dot(a, row) over D values: 16-lane FMAs in order, then one fixed reduction.
template <Format F>
inline float dot(const float *a, const uint8_t *row, int64_t D) {
  v::F32x16 acc = v::zero(), scale = v::zero();
  for (int64_t d = 0; d < D; d += 16) {
    if (d % kv::kQ8Block == 0) scale = row_scale<F>(row, d);  // once per q8_0 block
    acc = v::fmadd(v::load_n(a + d, D - d), load_row<F>(row, d, D - d, scale), acc);
  }
  return v::reduce_add(acc);
}

// Queries attended together: tokens [t0, t1) (consecutive, one table row) and kv head kvh's G query heads.
struct Group {
  int64_t t0, t1, kvh;
};

constexpr int64_t kGroupQueries = 24;  // queries of one group at most (8 tokens of 3 heads, SmolLM2's G)

struct Job {
  const float *q;
  const uint8_t *k, *v;
  const int32_t *table, *pos, *rows;
  float *out;
  int64_t N, R, H, D, KV, S, NB, bs;
  Format fmt;
  int64_t row_bytes;  // of one cache row (kv::row_bytes)
  int64_t queries;    // N * H
  int64_t nchunks;
  int64_t window = 0;  // > 0: a query at position p reads only keys (p - window, p] (a sliding-window layer)
  float scale = 0.0f;  // > 0: the score scale (Gemma's query_pre_attn_scalar^-1/2); 0: 1 / sqrt(D)
  const Group *groups = nullptr;  // the work units, or none: each query alone (attend)
  int64_t ngroups = 0;
  const int64_t *bounds = nullptr;  // chunk c runs units (groups, or queries) [bounds[c], bounds[c + 1])
};

// A query's keys: [first, end) of its sequence, and where its kv head's rows are.
struct Span {
  int64_t first, end;
  const int32_t *blocks;  // its table row
  const uint8_t *k, *v;   // its kv head's cache rows
};

inline Span span_of(const Job &j, int64_t token, int64_t kvh) {
  const int64_t end = std::clamp<int64_t>(int64_t{j.pos[token]} + 1, 1, j.NB * j.bs);
  const int64_t first = j.window > 0 ? std::max<int64_t>(0, end - j.window) : 0;
  return Span{first, end, j.table + int64_t{j.rows[token]} * j.NB, j.k + kvh * j.S * j.row_bytes,
              j.v + kvh * j.S * j.row_bytes};
}

// How many keys a token's queries read.
inline int64_t key_count(const Job &j, int64_t token) {
  const Span s = span_of(j, token, 0);
  return s.end - s.first;
}

inline float score_scale(const Job &j) {
  return j.scale > 0.0f ? j.scale : 1.0f / std::sqrt(static_cast<float>(j.D));
}

// Calls f(key, row) for the keys [k0, k1) of a span in order, row a cache row of `base` (rows of one block are
// contiguous).
template <typename Fn>
inline void each_row(const Job &j, const int32_t *blocks, const uint8_t *base, int64_t k0, int64_t k1, Fn &&f) {
  while (k0 < k1) {
    const int64_t off = k0 % j.bs, count = std::min(j.bs - off, k1 - k0);
    const uint8_t *rows = base + (int64_t{blocks[k0 / j.bs]} * j.bs + off) * j.row_bytes;
    for (int64_t i = 0; i < count; ++i) f(k0 + i, rows + i * j.row_bytes);
    k0 += count;
  }
}

// The scores of a query (scores[i] is key first + i) to softmax weights in place: max, exp, sum (vector lanes in
// fixed order, then one reduction); returns 1 / the sum. Forced inline: a call here slows a plain decode row's
// attention (attend).
__attribute__((always_inline)) inline float softmax(float *scores, int64_t n) {
  v::F32x16 vmax = v::set1(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, n - i));
    vmax = v::max(vmax, v::fill_tail(v::load_n(scores + i, m), m, -INFINITY));
  }
  const v::F32x16 mx = v::set1(v::reduce_max(vmax));
  v::F32x16 vsum = v::zero();
  for (int64_t i = 0; i < n; i += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, n - i));
    const v::F32x16 e = v::exp_nonpositive(v::sub(v::load_n(scores + i, m), mx));
    v::store_n(scores + i, e, m);
    vsum = v::add(vsum, v::keep_first(e, m));
  }
  return 1.0f / v::reduce_add(vsum);
}

// One query: (token, head) = (index / H, index % H). scores is scratch of at least NB * bs floats.
template <Format F>
void attend(const Job &j, int64_t index, float *scores) {
  const int64_t h = index % j.H, token = index / j.H;
  const int64_t kvh = h / (j.H / j.KV);
  const float *q = j.q + index * j.D;
  float *out = j.out + index * j.D;
  const int64_t end = std::clamp<int64_t>(int64_t{j.pos[token]} + 1, 1, j.NB * j.bs);
  const int64_t first = j.window > 0 ? std::max<int64_t>(0, end - j.window) : 0;  // keys [first, end)
  const int64_t n = end - first;
  const int32_t *blocks = j.table + int64_t{j.rows[token]} * j.NB;
  const int64_t rb = j.row_bytes;
  const uint8_t *kbase = j.k + kvh * j.S * rb;
  const uint8_t *vbase = j.v + kvh * j.S * rb;
  const float scale = j.scale > 0.0f ? j.scale : 1.0f / std::sqrt(static_cast<float>(j.D));

  // scores, block by block (rows of one block are contiguous); scores[i] is key first + i
  for (int64_t k0 = first; k0 < end;) {
    const int64_t off = k0 % j.bs, count = std::min(j.bs - off, end - k0);
    const uint8_t *rows = kbase + (int64_t{blocks[k0 / j.bs]} * j.bs + off) * rb;
    for (int64_t i = 0; i < count; ++i) scores[k0 - first + i] = dot<F>(q, rows + i * rb, j.D) * scale;
    k0 += count;
  }
  const float inv = softmax(scores, n);
  // weighted sum of the values, in key order
  const int64_t nv = (j.D + 15) / 16;
  v::F32x16 acc[kMaxHeadDim / 16];
  for (int64_t c = 0; c < nv; ++c) acc[c] = v::zero();
  const int last = static_cast<int>(j.D - 16 * (nv - 1));
  for (int64_t k0 = first; k0 < end;) {
    const int64_t off = k0 % j.bs, count = std::min(j.bs - off, end - k0);
    const uint8_t *rows = vbase + (int64_t{blocks[k0 / j.bs]} * j.bs + off) * rb;
    for (int64_t i = 0; i < count; ++i) {
      const v::F32x16 p = v::set1(scores[k0 - first + i]);
      const uint8_t *vr = rows + i * rb;
      v::F32x16 vscale = v::zero();
      for (int64_t c = 0; c < nv; ++c) {
        if (16 * c % kv::kQ8Block == 0) vscale = row_scale<F>(vr, 16 * c);
        acc[c] = v::fmadd(p, load_row<F>(vr, 16 * c, c == nv - 1 ? last : 16, vscale), acc[c]);
      }
    }
    k0 += count;
  }
  const v::F32x16 vinv = v::set1(inv);
  for (int64_t c = 0; c < nv - 1; ++c) v::store(out + 16 * c, v::mul(acc[c], vinv));
  v::store_n(out + 16 * (nv - 1), v::mul(acc[nv - 1], vinv), last);
}

// Scratch of a thread: the queries' scores, and q, the accumulators and a tile of cache rows as vectors
// (attend_group).
struct Scratch {
  std::vector<float> scores;
  std::vector<v::F32x16> vecs;
};

constexpr int64_t kTile = 32;  // cache rows converted at a time by attend_group

// The G heads of kv head g.kvh for tokens [g.t0, g.t1) of one sequence, each exactly as attend() computes it
// alone. The keys, then the values, are converted to float32 a tile of kTile rows at a time, once for all the
// queries; each query then does over the tile's rows it reads exactly the operations attend() does, in its order
// (dot()'s FMAs and fixed reduction for a score; its weighted sum's FMAs into its accumulators, kept in scratch
// between tiles). NV is the head's vector count D / 16 rounded up when it is a compile-time constant (its loops
// unrolled and q and the accumulators in registers), or 0: taken from D at run time.
template <Format F, int NV>
void attend_group(const Job &j, const Group &g, Scratch &w) {
  constexpr int64_t kMaxVecs = kMaxHeadDim / 16;
  const int64_t G = j.H / j.KV, nq = (g.t1 - g.t0) * G, nv = NV > 0 ? NV : (j.D + 15) / 16;
  const int last = static_cast<int>(j.D - 16 * (nv - 1));
  Span spans[kGroupQueries];
  int64_t lo = j.NB * j.bs, hi = 0;
  for (int64_t a = 0; a < nq; ++a) {
    spans[a] = span_of(j, g.t0 + a / G, g.kvh);
    lo = std::min(lo, spans[a].first);
    hi = std::max(hi, spans[a].end);
  }
  const int64_t stride = hi - lo + 16;  // of a query's scores: scores[a * stride + key - spans[a].first]
  if (static_cast<int64_t>(w.scores.size()) < nq * stride) w.scores.resize(nq * stride);
  if (static_cast<int64_t>(w.vecs.size()) < (2 * nq + kTile) * nv) w.vecs.resize((2 * nq + kTile) * nv);
  v::F32x16 *qv = w.vecs.data(), *acc = qv + nq * nv, *tile = acc + nq * nv;
  for (int64_t a = 0; a < nq; ++a) {
    const float *q = j.q + ((g.t0 + a / G) * j.H + g.kvh * G + a % G) * j.D;
    for (int64_t c = 0; c < nv; ++c) {
      qv[a * nv + c] = v::load_n(q + 16 * c, j.D - 16 * c);
      acc[a * nv + c] = v::zero();
    }
  }
  // rows [k0, k1) of `base` into tile, each as attend() loads it (lanes past D: +0.0)
  auto convert = [&](const uint8_t *base, int64_t k0, int64_t k1) {
    each_row(j, spans[0].blocks, base, k0, k1, [&](int64_t key, const uint8_t *r) {
      v::F32x16 *row = tile + (key - k0) * nv, rs = v::zero();
      for (int64_t c = 0; c < nv; ++c) {
        if (16 * c % kv::kQ8Block == 0) rs = row_scale<F>(r, 16 * c);
        row[c] = load_row<F>(r, 16 * c, j.D - 16 * c, rs);
      }
    });
  };
  const float scale = score_scale(j);
  for (int64_t k0 = lo; k0 < hi; k0 += kTile) {
    const int64_t k1 = std::min(hi, k0 + kTile);
    convert(spans[0].k, k0, k1);
    for (int64_t a = 0; a < nq; ++a) {
      const int64_t from = std::max(k0, spans[a].first), to = std::min(k1, spans[a].end);
      v::F32x16 q[NV > 0 ? NV : kMaxVecs];
      for (int64_t c = 0; c < nv; ++c) q[c] = qv[a * nv + c];
      float *sc = w.scores.data() + a * stride + (from - spans[a].first);
      for (int64_t key = from; key < to; ++key) {
        const v::F32x16 *row = tile + (key - k0) * nv;
        v::F32x16 s = v::zero();
        for (int64_t c = 0; c < nv; ++c) s = v::fmadd(q[c], row[c], s);
        sc[key - from] = v::reduce_add(s) * scale;
      }
    }
  }
  float inv[kGroupQueries];
  for (int64_t a = 0; a < nq; ++a) inv[a] = softmax(w.scores.data() + a * stride, spans[a].end - spans[a].first);
  for (int64_t k0 = lo; k0 < hi; k0 += kTile) {
    const int64_t k1 = std::min(hi, k0 + kTile);
    convert(spans[0].v, k0, k1);
    for (int64_t a = 0; a < nq; ++a) {
      const int64_t from = std::max(k0, spans[a].first), to = std::min(k1, spans[a].end);
      if (from >= to) continue;
      v::F32x16 r[NV > 0 ? NV : kMaxVecs];
      for (int64_t c = 0; c < nv; ++c) r[c] = acc[a * nv + c];
      const float *sc = w.scores.data() + a * stride + (from - spans[a].first);
      for (int64_t key = from; key < to; ++key) {
        const v::F32x16 p = v::set1(sc[key - from]), *row = tile + (key - k0) * nv;
        for (int64_t c = 0; c < nv; ++c) r[c] = v::fmadd(p, row[c], r[c]);
      }
      for (int64_t c = 0; c < nv; ++c) acc[a * nv + c] = r[c];
    }
  }
  for (int64_t a = 0; a < nq; ++a) {
    float *out = j.out + ((g.t0 + a / G) * j.H + g.kvh * G + a % G) * j.D;
    const v::F32x16 vinv = v::set1(inv[a]);
    for (int64_t c = 0; c < nv - 1; ++c) v::store(out + 16 * c, v::mul(acc[a * nv + c], vinv));
    v::store_n(out + 16 * (nv - 1), v::mul(acc[a * nv + nv - 1], vinv), last);
  }
}

// attend_group with the head's vector count unrolled where a served model's head dim has it (64, 128).
template <Format F>
void attend_group(const Job &j, const Group &g, Scratch &w) {
  switch ((j.D + 15) / 16) {
    case 4: return attend_group<F, 4>(j, g, w);
    case 8: return attend_group<F, 8>(j, g, w);
    default: return attend_group<F, 0>(j, g, w);
  }
}

template <Format F>
void run_chunk(const void *ctx, int64_t c) {
  const Job &j = *static_cast<const Job *>(ctx);
  thread_local Scratch w;
  if (static_cast<int64_t>(w.scores.size()) < j.NB * j.bs + 16) w.scores.resize(j.NB * j.bs + 16);  // attend's
  const int64_t u0 = j.bounds[c], u1 = j.bounds[c + 1];
  if (j.groups == nullptr) {
    for (int64_t i = u0; i < u1; ++i) attend<F>(j, i, w.scores.data());
    return;
  }
  const int64_t G = j.H / j.KV;
  for (int64_t i = u0; i < u1; ++i) {
    const Group &g = j.groups[i];
    if (g.t1 - g.t0 > 1) {
      attend_group<F>(j, g, w);
    } else {  // a lone token (a plain decode row): its heads one by one, the scores in registers
      for (int64_t h = g.kvh * G; h < (g.kvh + 1) * G; ++h) attend<F>(j, g.t0 * j.H + h, w.scores.data());
    }
  }
}

// A query's cost in keys: the keys it reads and this much for its softmax and output (a rough fit; it only
// balances the chunks).
constexpr int64_t kQueryCost = 16;

// Chunk boundaries over n units of costs cost(i): chunk c is [b[c], b[c + 1]), the units whose cost starts in
// [total c / nchunks, total (c + 1) / nchunks), so every chunk holds about the same work (a unit is never split;
// a chunk may be empty). Splitting by count instead left most of a prompt chunk's queries, which read many keys,
// in the last chunk or two, on one thread.
template <typename Cost>
std::vector<int64_t> balanced_bounds(int64_t n, int64_t nchunks, Cost &&cost) {
  std::vector<int64_t> start(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) start[i + 1] = start[i] + cost(i);
  std::vector<int64_t> b(nchunks + 1, n);
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t at = start[n] * c / nchunks;
    b[c] = std::lower_bound(start.begin(), start.begin() + n, at) - start.begin();
  }
  return b;
}

// 0 on success; the error codes of the AOT entry otherwise.
int paged_attention(Job j) {
  mindserve::ScopeTimer timer(mindserve::kAttention);
  if (j.N <= 0 || j.H <= 0) return 0;
  if (j.D <= 0 || j.D > kMaxHeadDim) return 6;
  if (j.KV <= 0 || j.H % j.KV != 0 || j.bs <= 0 || j.NB <= 0 || j.S % j.bs != 0) return 7;
  const int64_t num_blocks = j.S / j.bs;
  for (int64_t i = 0; i < j.R * j.NB; ++i)
    if (j.table[i] < 0 || j.table[i] >= num_blocks) return 8;  // never read outside the cache
  for (int64_t i = 0; i < j.N; ++i)
    if (j.rows[i] < 0 || j.rows[i] >= j.R) return 9;
  j.row_bytes = kv::row_bytes(j.fmt, j.D);
  j.queries = j.N * j.H;
  // A few chunks per thread, so a thread that keeps its core takes over from one that lost it;
  // chunks hold at least a few queries (a chunk is a pool round trip).
  const int threads = mindserve::pool().threads();
  j.nchunks = std::max<int64_t>(1, std::min<int64_t>(j.queries / 4, threads * 4));
  // Groups (when a kv head's G query heads fit one): runs of up to kGroupQueries / G consecutive tokens of one
  // table row, times the kv heads.
  std::vector<Group> groups;
  const int64_t G = j.H / j.KV;
  bool runs = false;  // any two consecutive tokens of one sequence (else every query alone, as plain decoding)
  for (int64_t i = 1; i < j.N && !runs; ++i) runs = j.rows[i] == j.rows[i - 1];
  if (runs && G <= kGroupQueries) {
    const int64_t most = kGroupQueries / G;
    for (int64_t t0 = 0; t0 < j.N;) {
      int64_t t1 = t0 + 1;
      while (t1 < j.N && t1 - t0 < most && j.rows[t1] == j.rows[t0]) ++t1;
      for (int64_t h = 0; h < j.KV; ++h) groups.push_back(Group{t0, t1, h});
      t0 = t1;
    }
    j.groups = groups.data();
    j.ngroups = static_cast<int64_t>(groups.size());
    j.nchunks = std::max<int64_t>(1, std::min<int64_t>(j.ngroups, threads * 4));
  }
  std::vector<int64_t> bounds;
  if (j.groups == nullptr) {
    bounds = balanced_bounds(j.queries, j.nchunks, [&](int64_t i) { return key_count(j, i / j.H) + kQueryCost; });
  } else {
    bounds = balanced_bounds(j.ngroups, j.nchunks, [&](int64_t i) {
      const Group &g = j.groups[i];
      int64_t cost = 0;
      for (int64_t t = g.t0; t < g.t1; ++t) cost += G * (key_count(j, t) + kQueryCost);
      return cost;
    });
  }
  j.bounds = bounds.data();
  void (*chunk)(const void *, int64_t) = nullptr;
  switch (j.fmt) {
    case Format::kF32: chunk = &run_chunk<Format::kF32>; break;
    case Format::kF16: chunk = &run_chunk<Format::kF16>; break;
    case Format::kBF16: chunk = &run_chunk<Format::kBF16>; break;
    case Format::kQ8_0: chunk = &run_chunk<Format::kQ8_0>; break;
    default: return 10;
  }
  mindserve::pool().run(mindserve::Task{chunk, &j, j.nchunks});
  return 0;
}

using mindserve::is_f32;
using mindserve::is_i32;

}  // namespace

extern "C" {

int mindserve_attention_window_raw(const float *q, const void *k, const void *v, const int32_t *table,
                                   const int32_t *pos, const int32_t *rows, float *out, int64_t N, int64_t R, int64_t H,
                                   int64_t D, int64_t KV, int64_t S, int64_t NB, int64_t bs, int fmt, int64_t window,
                                   float scale) {
  mindserve::FpScope fp;
  if (fmt < 0 || fmt > static_cast<int>(Format::kQ8_0)) return 10;
  if (window < 0 || !(scale >= 0.0f)) return 11;
  return paged_attention(Job{q, static_cast<const uint8_t *>(k), static_cast<const uint8_t *>(v), table, pos, rows,
                             out, N, R, H, D, KV, S, NB, bs, static_cast<Format>(fmt), 0, 0, 1, window, scale});
}

int mindserve_attention_kv_raw(const float *q, const void *k, const void *v, const int32_t *table, const int32_t *pos,
                               const int32_t *rows, float *out, int64_t N, int64_t R, int64_t H, int64_t D, int64_t KV,
                               int64_t S, int64_t NB, int64_t bs, int fmt) {
  mindserve::FpScope fp;
  return mindserve_attention_window_raw(q, k, v, table, pos, rows, out, N, R, H, D, KV, S, NB, bs, fmt, 0, 0.0f);
}

int mindserve_attention_raw(const float *q, const float *k, const float *v, const int32_t *table,
                            const int32_t *pos, const int32_t *rows, float *out, int64_t N, int64_t R, int64_t H,
                            int64_t D, int64_t KV, int64_t S, int64_t NB, int64_t bs) {
  mindserve::FpScope fp;
  return mindserve_attention_kv_raw(q, k, v, table, pos, rows, out, N, R, H, D, KV, S, NB, bs,
                                    static_cast<int>(Format::kF32));
}

static int entry_paged_attention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != 8) return 1;
  if (!is_f32(dtypes[0]) || !is_i32(dtypes[3]) || !is_i32(dtypes[4]) || !is_i32(dtypes[5]) || !is_i32(dtypes[6]) ||
      !is_f32(dtypes[7]))
    return 2;
  if (ndims[0] != 3 || ndims[1] != 2 || ndims[2] != 2 || ndims[3] != 2 || ndims[4] != 1 || ndims[5] != 1 ||
      ndims[6] != 1 || shapes[6][0] != 2)
    return 3;
  const int64_t N = shapes[0][0], H = shapes[0][1], D = shapes[0][2];
  Format fk, fv;
  if (!kv::format_of(dtypes[1], shapes[1][1], D, &fk) || !kv::format_of(dtypes[2], shapes[2][1], D, &fv) || fk != fv)
    return 2;
  if (shapes[4][0] != N || shapes[5][0] != N || shapes[1][0] != shapes[2][0]) return 4;
  const int32_t *meta = static_cast<const int32_t *>(params[6]);
  const int64_t KV = meta[0], bs = meta[1];
  if (KV <= 0 || shapes[1][0] % KV != 0) return 5;
  const int64_t S = shapes[1][0] / KV;
  return mindserve_attention_kv_raw(static_cast<const float *>(params[0]), params[1], params[2],
                                    static_cast<const int32_t *>(params[3]), static_cast<const int32_t *>(params[4]),
                                    static_cast<const int32_t *>(params[5]), static_cast<float *>(params[7]), N,
                                    shapes[3][0], H, D, KV, S, shapes[3][1], bs, static_cast<int>(fk));
}
MINDSERVE_ENTRY(MindservePagedAttention, entry_paged_attention)

}  // extern "C"
