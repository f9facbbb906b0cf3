// mindserve row-wise fused kernels (fused.h): the compute of the fused entries (fused_entries.cc) on plain
// pointers, on vec.h's 16 lanes. Every output row is a function of its own input row only, computed by a fixed
// sequence of operations, so results do not depend on the batch (the determinism contract of matmul.cc).
#include "fused.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kv_format.h"
#include "pool.h"
#include "vec.h"

namespace {

namespace v = mindserve::vec;

using mindserve::kv::kMaxHeadDim;
using mindserve::fused::QKVWrite;

// Rows [0, n) split over the pool in chunks of at least `min_rows` rows.
template <class Fn>
void for_rows(int64_t n, int64_t min_rows, const Fn &fn) {
  mindserve::for_row_chunks(n, std::min<int64_t>(n / std::max<int64_t>(1, min_rows), 2 * mindserve::pool().threads()),
                            fn);
}

void rmsnorm_row(const float *x, const float *w, float eps, float *y, int64_t C) {
  v::F32x16 acc = v::zero();
  for (int64_t c = 0; c < C; c += 16) {
    const v::F32x16 a = v::load_n(x + c, C - c);
    acc = v::fmadd(a, a, acc);
  }
  const float r = 1.0f / std::sqrt(v::reduce_add(acc) / static_cast<float>(C) + eps);
  const v::F32x16 vr = v::set1(r);
  for (int64_t c = 0; c < C; c += 16) {
    const v::F32x16 a = v::mul(v::load_n(x + c, C - c), vr);
    v::store_n(y + c, v::mul(a, v::load_n(w + c, C - c)), C - c);
  }
}

// silu(g) * u, with sigmoid from exp(-|g|) so the exponent is never positive.
void swiglu_row(const float *gu, float *y, int64_t F) {
  const v::F32x16 one = v::set1(1.0f);
  for (int64_t f = 0; f < F; f += 16) {
    const int64_t m = F - f;
    const v::F32x16 g = v::load_n(gu + f, m);
    const v::F32x16 u = v::load_n(gu + F + f, m);
    const v::F32x16 e = v::exp_nonpositive(v::sub(v::zero(), v::abs(g)));
    const v::F32x16 sig = v::div(v::select_neg(g, e, one), v::add(one, e));
    v::store_n(y + f, v::mul(v::mul(g, sig), u), m);
  }
}

// gelu_tanh(g) * u (Gemma's GeGLU, gelu_pytorch_tanh): gelu_tanh(g) = g / 2 (1 + tanh(z / 2)) = g * sigmoid(z) with
// z = 2 sqrt(2/pi) (g + 0.044715 g^3); the sigmoid as in swiglu_row, from exp(-|z|).
void geglu_row(const float *gu, float *y, int64_t F) {
  const v::F32x16 one = v::set1(1.0f), c1 = v::set1(0.044715f), c2 = v::set1(1.5957691216057308f);  // 2 sqrt(2/pi)
  for (int64_t f = 0; f < F; f += 16) {
    const int64_t m = F - f;
    const v::F32x16 g = v::load_n(gu + f, m);
    const v::F32x16 u = v::load_n(gu + F + f, m);
    const v::F32x16 z = v::mul(c2, v::fmadd(c1, v::mul(v::mul(g, g), g), g));
    const v::F32x16 e = v::exp_nonpositive(v::sub(v::zero(), v::abs(z)));
    const v::F32x16 sig = v::div(v::select_neg(z, e, one), v::add(one, e));
    v::store_n(y + f, v::mul(v::mul(g, sig), u), m);
  }
}

// y = res + rmsnorm(x) w (Gemma's post-attention / post-feedforward norms before the residual add).
void norm_add_row(const float *x, const float *w, float eps, const float *res, float *y, int64_t C) {
  rmsnorm_row(x, w, eps, y, C);
  for (int64_t c = 0; c < C; c += 16) v::store_n(y + c, v::add(v::load_n(res + c, C - c), v::load_n(y + c, C - c)), C - c);
}

// x (+ b) over n floats, one float add per element (the graph's bias Add, bit for bit).
template <bool kBias>
inline v::F32x16 load_biased(int64_t n, const float *x, const float *b) {
  const v::F32x16 a = v::load_n(x, n);
  if constexpr (kBias) return v::add(a, v::load_n(b, n));
  return a;
}

// One head vector: out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]); with
// kBias, x is first replaced by x + b.
template <bool kBias = false>
void rope_head(const float *x, const float *cos, const float *sin, float *out, int64_t D, const float *b = nullptr) {
  const int64_t half = D / 2;
  if constexpr (!kBias) b = x;  // never read
  for (int64_t i = 0; i < half; i += 16) {
    const int64_t m = half - i;
    const v::F32x16 lo = load_biased<kBias>(m, x + i, b + i), hi = load_biased<kBias>(m, x + half + i, b + half + i);
    const v::F32x16 out_lo = v::fnmadd(hi, v::load_n(sin + i, m), v::mul(lo, v::load_n(cos + i, m)));
    const v::F32x16 out_hi = v::fmadd(lo, v::load_n(sin + half + i, m), v::mul(hi, v::load_n(cos + half + i, m)));
    v::store_n(out + i, out_lo, m);
    v::store_n(out + half + i, out_hi, m);
  }
}

// out[0, n) = x (+ b), one float add per element.
template <bool kBias>
void copy_biased(const float *x, const float *b, float *out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) v::store_n(out + i, load_biased<kBias>(n - i, x + i, b + i), n - i);
}

// One head roped into out: with kNorm, x (+ b) is first RMS-normalised with the weights w (a per-head norm
// before the rotation, Qwen3's q_norm / k_norm: rmsnorm_row over the D elements of the head).
template <bool kBias, bool kNorm>
void norm_rope_head(const float *x, const float *b, const float *w, float eps, const float *cos, const float *sin,
                    float *out, int64_t D) {
  if constexpr (kNorm) {
    float head[kMaxHeadDim];
    copy_biased<kBias>(x, b, head, D);
    rmsnorm_row(head, w, eps, head, D);  // in place: each element is read before it is written
    rope_head(head, cos, sin, out, D);
  } else {
    (void)w, (void)eps;
    rope_head<kBias>(x, cos, sin, out, D, b);
  }
}

// One new cache row in the cache's format; float16 through the vector layer's store_f16 (kv::f32_to_f16's bits;
// the row's last D % 16 values take that function itself): the scalar conversion was most of the qkv_rope stage.
__attribute__((always_inline)) inline void encode_cache_row(mindserve::kv::Format f, const float *x, int64_t D,
                                                            uint8_t *dst) {
  if (f != mindserve::kv::Format::kF16) return mindserve::kv::encode_row(f, x, D, dst);
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) v::store_f16(dst + 2 * i, v::load(x + i));
  mindserve::kv::encode_row(f, x + i, D - i, dst + 2 * i);
}

// Heads [h0, h1) of token r into their rows of each cache (row write[r KV + h], rb bytes a row), in its format.
template <bool kBias, bool kNorm>
__attribute__((always_inline)) inline void write_kv_rows(const QKVWrite &a, int64_t rb, int64_t r, int64_t h0,
                                                         int64_t h1) {
  const int64_t width = (a.H + 2 * a.KV) * a.D;
  const float *kn = a.qk_norm + (kNorm ? a.D : 0);
  float kt[2 * kMaxHeadDim], *vt = kt + kMaxHeadDim;  // a row before its encoding
  const float *row = a.qkv + r * width, *c = a.cos + r * a.D, *s = a.sin + r * a.D;
  for (int64_t h = h0; h < h1; ++h) {
    const int64_t kc = (a.H + h) * a.D, vc = (a.H + a.KV + h) * a.D, at = int64_t{a.write[r * a.KV + h]} * rb;
    norm_rope_head<kBias, kNorm>(row + kc, a.bias + (kBias ? kc : 0), kn, a.eps, c, s, kt, a.D);
    copy_biased<kBias>(row + vc, a.bias + (kBias ? vc : 0), vt, a.D);
    encode_cache_row(a.fmt, kt, a.D, a.k + at);
    encode_cache_row(a.fmt, vt, a.D, a.v + at);
  }
}

// The new K/V rows into the caches, and every query head roped into q. The engine writes head h of a token to
// row h S + slot (S = rows / KV), inside that head's rows [h S, (h + 1) S): then each kv head's rows are written
// by one thread in token order, head by head (a prompt chunk's rows of a head are contiguous), chunks of heads in
// parallel, so where tokens share a row (padding tokens all write slot 0) the last one still wins, as in one
// serial pass; one pool task runs those chunks and the query rows'. Writes that leave their head's rows (never
// from the engine), one kernel thread, or a decode step's few rows (under 64: two pool chunks would cost more
// than they save) are written in that one serial pass, token by token, on this thread first.
template <bool kBias, bool kNorm>
int write_and_rope_as(const QKVWrite &a) {
  const int64_t width = (a.H + 2 * a.KV) * a.D;
  const float *qn = a.qk_norm;
  const int64_t S = a.rows / a.KV;
  bool per_head = a.KV > 1 && a.rows % a.KV == 0 && mindserve::pool().threads() > 1 && a.N * a.KV >= 64;
  for (int64_t r = 0; r < a.N; ++r)
    for (int64_t h = 0; h < a.KV; ++h) {
      const int32_t at = a.write[r * a.KV + h];
      if (at < 0 || at >= a.rows) return 8;  // never write outside the cache
      per_head = per_head && at >= h * S && at < (h + 1) * S;
    }
  if (a.D > kMaxHeadDim) return 6;
  const int64_t rb = mindserve::kv::row_bytes(a.fmt, a.D);
  auto write_heads = [&a, rb](int64_t r, int64_t h0, int64_t h1) { write_kv_rows<kBias, kNorm>(a, rb, r, h0, h1); };
  auto rope_queries = [&](int64_t r) {
    const float *row = a.qkv + r * width, *c = a.cos + r * a.D, *s = a.sin + r * a.D;
    for (int64_t h = 0; h < a.H; ++h)
      norm_rope_head<kBias, kNorm>(row + h * a.D, a.bias + (kBias ? h * a.D : 0), qn, a.eps, c, s,
                                   a.q + (r * a.H + h) * a.D, a.D);
  };
  if (!per_head)
    for (int64_t r = 0; r < a.N; ++r) write_heads(r, 0, a.KV);
  // chunks: [0, kchunks) the kv heads (when per_head), then [kchunks, kchunks + qchunks) the query rows
  const int64_t most = 2 * mindserve::pool().threads();
  const int64_t kchunks = per_head ? std::clamp<int64_t>(a.N * a.KV / 32, 2, std::min(a.KV, most)) : 0;
  const int64_t qchunks = std::clamp<int64_t>(a.N / 16, 1, most);
  struct Ctx {
    decltype(write_heads) *write;
    decltype(rope_queries) *rope;
    int64_t N, KV, kchunks, qchunks;
  } ctx{&write_heads, &rope_queries, a.N, a.KV, kchunks, qchunks};
  mindserve::pool().run(mindserve::Task{
      [](const void *p, int64_t c) {
        const Ctx &x = *static_cast<const Ctx *>(p);
        if (c < x.kchunks) {
          for (int64_t h = x.KV * c / x.kchunks; h < x.KV * (c + 1) / x.kchunks; ++h)
            for (int64_t r = 0; r < x.N; ++r) (*x.write)(r, h, h + 1);
        } else {
          c -= x.kchunks;
          for (int64_t r = x.N * c / x.qchunks; r < x.N * (c + 1) / x.qchunks; ++r) (*x.rope)(r);
        }
      },
      &ctx, kchunks + qchunks});
  return 0;
}

}  // namespace

namespace mindserve::fused {

int write_and_rope(const QKVWrite &a, bool has_bias, bool has_norm) {
  if (has_norm) return has_bias ? write_and_rope_as<true, true>(a) : write_and_rope_as<false, true>(a);
  return has_bias ? write_and_rope_as<true, false>(a) : write_and_rope_as<false, false>(a);
}

bool gather_rows(const float *table, int64_t rows, int64_t width, const int32_t *idx, int64_t n, float *out) {
  for (int64_t i = 0; i < n; ++i)
    if (idx[i] < 0 || idx[i] >= rows) return false;
  for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * width, table + int64_t{idx[i]} * width, sizeof(float) * width);
  return true;
}

void rmsnorm_rows(const float *x, const float *w, float eps, float *y, int64_t N, int64_t C) {
  for_rows(N, 16, [&](int64_t r) { rmsnorm_row(x + r * C, w, eps, y + r * C, C); });
}

void swiglu_rows(const float *gu, float *y, int64_t N, int64_t F) {
  for_rows(N, 8, [&](int64_t r) { swiglu_row(gu + r * 2 * F, y + r * F, F); });
}

void geglu_rows(const float *gu, float *y, int64_t N, int64_t F) {
  for_rows(N, 8, [&](int64_t r) { geglu_row(gu + r * 2 * F, y + r * F, F); });
}

void norm_add_rows(const float *x, const float *w, float eps, const float *res, float *y, int64_t N, int64_t C) {
  for_rows(N, 16, [&](int64_t r) { norm_add_row(x + r * C, w, eps, res + r * C, y + r * C, C); });
}

void qkv_rope_rows(const float *qkv, const float *cos, const float *sin, float *q, float *k, float *v, int64_t N,
                   int64_t H, int64_t KV, int64_t D) {
  const int64_t width = (H + 2 * KV) * D;
  for_rows(N, 16, [&](int64_t r) {
    const float *row = qkv + r * width, *c = cos + r * D, *s = sin + r * D;
    for (int64_t h = 0; h < H; ++h) rope_head(row + h * D, c, s, q + (r * H + h) * D, D);
    for (int64_t h = 0; h < KV; ++h) rope_head(row + (H + h) * D, c, s, k + (r * KV + h) * D, D);
    std::memcpy(v + r * KV * D, row + (H + KV) * D, sizeof(float) * KV * D);
  });
}

}  // namespace mindserve::fused
