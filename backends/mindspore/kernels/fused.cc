// mindserve row-wise fused kernels for MindSpore AOT custom ops on CPU (any ISA of vec.h): each replaces a
// chain of small MindSpore ops (every op launch costs microseconds, and a decode step of a small
// model is mostly launches).
//
//   MindserveRMSNorm(x [N, C], w [C], eps [1]) -> y [N, C]
//       y = x / sqrt(mean(x^2) + eps) * w
//   MindserveSwiGLU(gu [N, 2F]) -> y [N, F]
//       y = silu(gu[:, :F]) * gu[:, F:]
//   MindserveQKVRope(qkv [N, (H + 2 KV) D], cos [N, D], sin [N, D]) -> q [N, H, D], k [N KV, D], v [N KV, D]
//       splits the fused projection and applies rotary embeddings (HF rotate_half layout: the
//       tables repeat their D/2 frequencies over both halves) to q and k; H and KV come from the
//       output shapes.
//   MindserveQKVAttention(qkv [N, (H + 2 KV) D], bias [(H + 2 KV) D] or [1], cos [N, D], sin [N, D],
//                         k_cache [KV S, W], v_cache [KV S, W] (one format of kv_format.h), write [N KV] i32,
//                         table [R, NB] i32, pos [N] (or [1, N]) i32, rows [N] i32, meta [3] i32 = (KV, bs, has_bias),
//                         (qk_norm [2, D], eps [1])) -> out [N, H D]
//       a layer's whole attention after the qkv projection, in one op: (+ bias,) with the two optional inputs
//       each q and k head RMS-normalised (row 0 of qk_norm the q weights, row 1 the k weights: Qwen3's
//       q_norm / k_norm, rmsnorm_row over D), the split and RoPE of
//       MindserveQKVRope, the new K/V rows written into the cache Parameters in place (row write[r KV + h]
//       gets head h of token r, encoded as kv_format.h says), then the paged
//       attention of attention.cc over the updated cache. H comes from the output shape. The writes
//       all happen before any key is read, so a token always sees itself and the earlier tokens of its
//       own chunk; duplicate rows (padding tokens all write the scratch slot 0) are written in token
//       order, the last one wins (write_and_rope: each kv head's rows by one thread of the pool).
//   MindserveNormMatMul(x [N, C], w [C], eps [1], W, (LoRA inputs)) -> y = MindserveMatMul(rmsnorm(x), W, ...)
//   MindserveSwiGLUMatMulAdd(gu [N, 2F], W, res, (LoRA inputs)) -> y = MindserveMatMulAdd(swiglu(gu), W, res, ...)
//       the row-wise kernel above written into a scratch buffer, then the matmul entry (matmul.cc: any
//       weight format it takes, the four optional LoRA inputs of lora.h) called on it with the remaining
//       inputs as they came: one op launch instead of two, the same arithmetic, the same bits.
//   MindserveGeGLUMatMul(gu [N, 2F], W, ...) -> y = MindserveMatMul(gelu_tanh(gu[:, :F]) * gu[:, F:], W, ...)
//   MindserveNormAdd(x [N, C], w [C], eps [1], res [N, C]) -> y = res + rmsnorm(x) * w
//   MindserveGemmaDecoderLayer(...): a Gemma 3 decoder layer as one op (its comment below).
//   MindserveQKVAttention's meta may be [5] = (KV, bs, has_bias, window, scale bits): a sliding window (0: none) and
//       the score scale as float32 bits (0: 1 / sqrt(D)).
//   MindserveEmbedRope(ids [N] i32, pos [N] i32 (any shape of N elements), embed [V, C], cos_t [P, D],
//                      sin_t [P, D]) -> x [N, C], cos [N, D], sin [N, D]
//       the rows of the embedding and of the rotary tables each token needs: three gathers in one op.
//   MindserveNormHead(x [N, C], w [C], eps [1], last [R] i32, W) -> logits [R, V], hidden [N, C]
//       hidden = rmsnorm(x); logits = MindserveMatMul(hidden[last], W): the final norm, the gather of the
//       logit rows and the LM head in one op.
//   MindserveDecoderLayer(x [N, C], attn_norm [C], eps [1], wqkv, bias, cos, sin, k_cache, v_cache, write, table,
//                         pos, rows, meta, wo, ffn_norm [C], w_gate_up, w_down, (qk_norm, qk_eps)) -> y [N, C]
//       a whole decoder layer (no adapters) as one op, by calling the entries above in order:
//         qkv = NormMatMul(x, attn_norm, eps, wqkv); a = QKVAttention(qkv, bias, cos, sin, k_cache, ..., (qk_norm,
//         qk_eps));
//         h = MatMulAdd(a, wo, x); gu = NormMatMul(h, ffn_norm, eps, w_gate_up); y = SwiGLUMatMulAdd(gu, w_down, h)
//       with the intermediates in scratch buffers of the calling thread: the same bits as those five ops.
//       A failing stage s (1..5) returns 100 s + its own error code.
//
// Every output row is a function of its own input row only, computed by a fixed sequence of
// operations, so results do not depend on the batch (the determinism contract of matmul.cc).
// Each entry returns 0, or non-zero on a shape/dtype mismatch (MindSpore then raises).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "entry.h"
#include "kv_format.h"
#include "pool.h"
#include "vec.h"

namespace {

namespace v = mindserve::vec;

using mindserve::all_f32;
using mindserve::is_f32;
using mindserve::is_i32;
using mindserve::rows_of;

// Elements of a tensor: the product of all its dims.
inline int64_t count_of(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

// out[i] = table[idx[i]] for rows of `width` floats; false if an index is outside [0, rows).
bool gather_rows(const float *table, int64_t rows, int64_t width, const int32_t *idx, int64_t n, float *out) {
  for (int64_t i = 0; i < n; ++i)
    if (idx[i] < 0 || idx[i] >= rows) return false;
  for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * width, table + int64_t{idx[i]} * width, sizeof(float) * width);
  return true;
}

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

constexpr int64_t kMaxHeadDim = 512;  // attention.cc's bound (kernel_path.py MAX_AOT_HEAD_DIM)

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

struct QKVWrite {
  const float *qkv, *bias, *cos, *sin;
  uint8_t *k, *v;  // the caches [KV S, row bytes], in format fmt
  float *q;        // the roped queries [N, H, D]
  const int32_t *write;
  int64_t N, H, KV, D, rows;  // rows = KV S, the cache's row count
  mindserve::kv::Format fmt;
  const float *qk_norm;  // [2, D]: the q and k head-norm weights (read only with kNorm)
  float eps;
};

// One new cache row in the cache's format; float16 through the vector layer's store_f16 (kv::f32_to_f16's bits;
// the row's last D % 16 values take that function itself). Measured on the SmolLM2-1.7B shape (24 layers, 32 kv
// heads of 64, 16 decode rows at position 100, Zen 5 v4-vnni, bench/step_overhead.py --model-dir): the qkv_rope stage
// 4.48 -> 2.02 ms a step (1 row: 0.33 -> 0.18), the step 70.3 -> 65.6 ms; the scalar conversion was most of it.
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
int write_and_rope(const QKVWrite &a) {
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

int write_and_rope(const QKVWrite &a, bool has_bias, bool has_norm) {
  if (has_norm) return has_bias ? write_and_rope<true, true>(a) : write_and_rope<false, true>(a);
  return has_bias ? write_and_rope<true, false>(a) : write_and_rope<false, false>(a);
}


constexpr int kMaxParams = 16;

// Call `entry` (a matmul AOT entry) with params[0] replaced by `x` [rows..., C] (the shape of input 0 with
// its last dimension C) and params[1, skip) dropped: the prologue's own inputs.
int forward(int (*entry)(int, void **, int *, int64_t **, const char **, void *, void *), int nparam, void **params,
            int *ndims, int64_t **shapes, const char **dtypes, int skip, float *x, int64_t C) {
  void *p[kMaxParams];
  int nd[kMaxParams];
  int64_t *sh[kMaxParams];
  const char *dt[kMaxParams];
  int64_t xshape[8];
  const int n = nparam - skip + 1;
  if (n > kMaxParams || ndims[0] > 8) return 41;
  for (int d = 0; d < ndims[0]; ++d) xshape[d] = shapes[0][d];
  xshape[ndims[0] - 1] = C;
  p[0] = x, nd[0] = ndims[0], sh[0] = xshape, dt[0] = "float32";
  for (int i = 1; i < n; ++i) p[i] = params[i + skip - 1], nd[i] = ndims[i + skip - 1], sh[i] = shapes[i + skip - 1],
                              dt[i] = dtypes[i + skip - 1];
  return entry(n, p, nd, sh, dt, nullptr, nullptr);
}

// A scratch buffer of this thread (the calling runtime thread) of at least n floats.
float *scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}


using mindserve::Arg;  // entry.h: another entry called as MindSpore would
using mindserve::call;

}  // namespace

extern "C" {

int MindserveRMSNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                     void *extra) {
  mindserve::FpScope fp;
  mindserve::ScopeTimer timer(mindserve::kRMSNorm);
  (void)stream;
  (void)extra;
  if (nparam != 4) return 1;
  if (!all_f32(dtypes, 4)) return 2;
  if (ndims[0] < 1 || ndims[1] != 1 || ndims[2] != 1 || shapes[2][0] != 1) return 3;
  const int64_t C = shapes[0][ndims[0] - 1], N = rows_of(ndims[0], shapes[0]);
  if (shapes[1][0] != C || shapes[3][ndims[3] - 1] != C) return 4;
  const float *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *y = static_cast<float *>(params[3]);
  for_rows(N, 16, [&](int64_t r) { rmsnorm_row(x + r * C, w, eps, y + r * C, C); });
  return 0;
}

int MindserveSwiGLU(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                    void *extra) {
  mindserve::FpScope fp;
  mindserve::ScopeTimer timer(mindserve::kSwiGLU);
  (void)stream;
  (void)extra;
  if (nparam != 2) return 1;
  if (!all_f32(dtypes, 2)) return 2;
  if (ndims[0] < 1 || ndims[1] != ndims[0]) return 3;
  const int64_t F = shapes[1][ndims[1] - 1], N = rows_of(ndims[0], shapes[0]);
  if (shapes[0][ndims[0] - 1] != 2 * F) return 4;
  const float *gu = static_cast<const float *>(params[0]);
  float *y = static_cast<float *>(params[1]);
  for_rows(N, 8, [&](int64_t r) { swiglu_row(gu + r * 2 * F, y + r * F, F); });
  return 0;
}

int MindserveQKVRope(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                     void *extra) {
  mindserve::FpScope fp;
  mindserve::ScopeTimer timer(mindserve::kQKVRope);
  (void)stream;
  (void)extra;
  if (nparam != 6) return 1;
  if (!all_f32(dtypes, 6)) return 2;
  if (ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2 || ndims[3] != 3 || ndims[4] != 2 || ndims[5] != 2) return 3;
  const int64_t N = shapes[0][0], H = shapes[3][1], D = shapes[3][2];
  if (N <= 0) return 0;
  const int64_t KV = shapes[4][0] / N;
  if (D % 2 != 0 || shapes[3][0] != N || shapes[4][0] != N * KV || shapes[4][1] != D || shapes[5][0] != N * KV ||
      shapes[5][1] != D || shapes[0][1] != (H + 2 * KV) * D || shapes[1][0] != N || shapes[1][1] != D ||
      shapes[2][0] != N || shapes[2][1] != D)
    return 4;
  const float *qkv = static_cast<const float *>(params[0]);
  const float *cos = static_cast<const float *>(params[1]), *sin = static_cast<const float *>(params[2]);
  float *q = static_cast<float *>(params[3]), *k = static_cast<float *>(params[4]), *v = static_cast<float *>(params[5]);
  const int64_t width = (H + 2 * KV) * D;
  for_rows(N, 16, [&](int64_t r) {
    const float *row = qkv + r * width, *c = cos + r * D, *s = sin + r * D;
    for (int64_t h = 0; h < H; ++h) rope_head(row + h * D, c, s, q + (r * H + h) * D, D);
    for (int64_t h = 0; h < KV; ++h) rope_head(row + (H + h) * D, c, s, k + (r * KV + h) * D, D);
    std::memcpy(v + r * KV * D, row + (H + KV) * D, sizeof(float) * KV * D);
  });
  return 0;
}

int MindserveQKVAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                          void *extra) {
  mindserve::FpScope fp;
  (void)stream;
  (void)extra;
  if (nparam != 12 && nparam != 14) return 1;
  const bool has_norm = nparam == 14;  // (qk_norm [2, D], eps [1]) before the output
  const int out = nparam - 1;
  for (int i : {0, 1, 2, 3})  // the caches (4, 5) are in any format of kv_format.h, checked below
    if (!is_f32(dtypes[i])) return 2;
  for (int i : {6, 7, 8, 9, 10})
    if (!is_i32(dtypes[i])) return 2;
  if (!is_f32(dtypes[out]) || (has_norm && (!is_f32(dtypes[11]) || !is_f32(dtypes[12])))) return 2;
  if (ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 2 || ndims[3] != 2 || ndims[4] != 2 || ndims[5] != 2 ||
      ndims[6] != 1 || ndims[7] != 2 || ndims[8] < 1 || ndims[9] != 1 || ndims[10] != 1 || ndims[out] != 2 ||
      (shapes[10][0] != 3 && shapes[10][0] != 5) || (has_norm && (ndims[11] != 2 || ndims[12] != 1 ||
                                                                  shapes[12][0] != 1)))
    return 3;
  const int32_t *meta = static_cast<const int32_t *>(params[10]);
  const int64_t N = shapes[0][0], D = shapes[2][1], KV = meta[0], bs = meta[1];
  const bool has_bias = meta[2] != 0;
  // meta [5]: (..., window, the score scale's float32 bits): Gemma 3's sliding window (0: none) and scale (0: 1/sqrt D)
  const int64_t window = shapes[10][0] == 5 ? meta[3] : 0;
  float scale = 0.0f;
  if (shapes[10][0] == 5) std::memcpy(&scale, meta + 4, sizeof(float));
  if (N <= 0) return 0;
  if (D <= 0 || D % 2 != 0 || KV <= 0 || shapes[out][1] % D != 0) return 4;
  if (has_norm && (D > kMaxHeadDim || shapes[11][0] != 2 || shapes[11][1] != D)) return 4;
  const int64_t H = shapes[out][1] / D, width = (H + 2 * KV) * D, cache_rows = shapes[4][0];
  mindserve::kv::Format fk, fv;
  if (!mindserve::kv::format_of(dtypes[4], shapes[4][1], D, &fk) ||
      !mindserve::kv::format_of(dtypes[5], shapes[5][1], D, &fv) || fk != fv)
    return 2;
  if (shapes[0][1] != width || shapes[out][0] != N || shapes[1][0] != (has_bias ? width : 1) || shapes[2][0] != N ||
      shapes[3][0] != N || shapes[3][1] != D || shapes[5][0] != cache_rows ||
      shapes[6][0] != N * KV || count_of(ndims[8], shapes[8]) != N || shapes[9][0] != N || cache_rows % KV != 0)
    return 4;
  thread_local std::vector<float> q;
  if (static_cast<int64_t>(q.size()) < N * H * D) q.resize(N * H * D);
  auto *k = static_cast<uint8_t *>(params[4]), *v = static_cast<uint8_t *>(params[5]);
  const QKVWrite args{static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
                      static_cast<const float *>(params[2]), static_cast<const float *>(params[3]), k, v, q.data(),
                      static_cast<const int32_t *>(params[6]), N, H, KV, D, cache_rows, fk,
                      has_norm ? static_cast<const float *>(params[11]) : nullptr,
                      has_norm ? *static_cast<const float *>(params[12]) : 0.0f};
  {
    mindserve::ScopeTimer timer(mindserve::kQKVRope);
    const int rc = write_and_rope(args, has_bias, has_norm);
    if (rc != 0) return rc;
  }
  return mindserve_attention_window_raw(q.data(), k, v, static_cast<const int32_t *>(params[7]),
                                        static_cast<const int32_t *>(params[8]), static_cast<const int32_t *>(params[9]),
                                        static_cast<float *>(params[out]), N, shapes[7][0], H, D, KV, cache_rows / KV,
                                        shapes[7][1], bs, static_cast<int>(fk), window, scale);
}

int MindserveNormMatMul(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                        void *extra) {
  mindserve::FpScope fp;
  (void)stream;
  (void)extra;
  if (nparam < 5) return 1;
  if (!all_f32(dtypes, 3)) return 2;
  if (ndims[0] < 1 || ndims[1] != 1 || ndims[2] != 1 || shapes[2][0] != 1) return 3;
  const int64_t C = shapes[0][ndims[0] - 1], N = rows_of(ndims[0], shapes[0]);
  if (shapes[1][0] != C) return 4;
  const float *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *normed = scratch(N * C);
  {
    mindserve::ScopeTimer timer(mindserve::kRMSNorm);
    for_rows(N, 16, [&](int64_t r) { rmsnorm_row(x + r * C, w, eps, normed + r * C, C); });
  }
  return forward(&MindserveMatMul, nparam, params, ndims, shapes, dtypes, 3, normed, C);
}

// A gated activation row by row ([N, 2F] gate|up -> [N, F], `row` is swiglu_row or geglu_row), then `entry` on it
// with the remaining inputs: the shared body of the SwiGLU and GeGLU entries.
static int glu_forward(void (*row)(const float *, float *, int64_t),
                       int (*entry)(int, void **, int *, int64_t **, const char **, void *, void *), int min_params,
                       int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam < min_params) return 1;
  if (!all_f32(dtypes, 1)) return 2;
  if (ndims[0] < 1 || shapes[0][ndims[0] - 1] % 2 != 0) return 3;
  const int64_t F = shapes[0][ndims[0] - 1] / 2, N = rows_of(ndims[0], shapes[0]);
  const float *gu = static_cast<const float *>(params[0]);
  float *act = scratch(N * F);
  {
    mindserve::ScopeTimer timer(mindserve::kSwiGLU);
    for_rows(N, 8, [&](int64_t r) { row(gu + r * 2 * F, act + r * F, F); });
  }
  return forward(entry, nparam, params, ndims, shapes, dtypes, 1, act, F);
}

int MindserveSwiGLUMatMulAdd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  mindserve::FpScope fp;
  (void)stream;
  (void)extra;
  return glu_forward(&swiglu_row, &MindserveMatMulAdd, 4, nparam, params, ndims, shapes, dtypes);
}

int MindserveGeGLUMatMul(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                         void *extra) {
  mindserve::FpScope fp;
  (void)stream;
  (void)extra;
  return glu_forward(&geglu_row, &MindserveMatMul, 3, nparam, params, ndims, shapes, dtypes);
}

int MindserveNormAdd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                     void *extra) {
  mindserve::FpScope fp;
  mindserve::ScopeTimer timer(mindserve::kRMSNorm);
  (void)stream;
  (void)extra;
  if (nparam != 5) return 1;
  if (!all_f32(dtypes, 5)) return 2;
  if (ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 1 || shapes[2][0] != 1 || ndims[3] != 2 || ndims[4] != 2) return 3;
  const int64_t N = shapes[0][0], C = shapes[0][1];
  if (shapes[1][0] != C || shapes[3][0] != N || shapes[3][1] != C || shapes[4][0] != N || shapes[4][1] != C) return 4;
  const float *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]), *res = static_cast<const float *>(params[3]);
  float *y = static_cast<float *>(params[4]);
  if (y == res) return 5;  // norm_add_row writes y before it reads res
  for_rows(N, 16, [&](int64_t r) { norm_add_row(x + r * C, w, eps, res + r * C, y + r * C, C); });
  return 0;
}

// MindserveGemmaDecoderLayer(x, attn_norm, eps, wqkv, bias, cos, sin, k_cache, v_cache, write, table, pos, rows,
//                            meta [5], wo, post_attn_norm, ffn_norm, w_gate_up, w_down, post_ffn_norm, qk_norm, qk_eps)
//     -> y [N, C]: a Gemma 3 layer (norm weights already 1 + w) as one op, the entries above in order:
//   qkv = NormMatMul(x, attn_norm, eps, wqkv); a = QKVAttention(qkv, ..., meta, qk_norm, qk_eps) (meta's window and
//   scale); o = MatMul(a, wo); h = NormAdd(o, post_attn_norm, eps, x); gu = NormMatMul(h, ffn_norm, eps, w_gate_up);
//   m = GeGLUMatMul(gu, w_down); y = NormAdd(m, post_ffn_norm, eps, h). A failing stage s (1..7) returns 100 s + its
//   own error code.
int MindserveGemmaDecoderLayer(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                               void *stream, void *extra) {
  mindserve::FpScope fp;
  (void)stream;
  (void)extra;
  enum { X, NA, EPS, WQKV, BIAS, COS, SIN, KC, VC, WR, TAB, POS, ROWS, META, WO, PAN, NF, WGU, WD, PFN, QKN, QEPS, OUT };
  if (nparam != OUT + 1) return 1;
  if (!is_f32(dtypes[X]) || !is_f32(dtypes[OUT]) || !is_i32(dtypes[META])) return 2;
  if (ndims[X] != 2 || ndims[OUT] != 2 || ndims[COS] != 2 || ndims[META] != 1 || shapes[META][0] != 5) return 3;
  const int64_t N = shapes[X][0], C = shapes[X][1], D = shapes[COS][1];
  const int64_t KV = static_cast<const int32_t *>(params[META])[0];
  const int64_t width = shapes[WQKV][ndims[WQKV] - 1], gu_width = shapes[WGU][ndims[WGU] - 1];
  const int64_t HD = width - 2 * KV * D;
  if (N <= 0) return 0;
  if (shapes[OUT][0] != N || shapes[OUT][1] != C || HD <= 0) return 4;
  struct Buffers {
    std::vector<float> qkv, attn, o, h, gu, m;
  };
  thread_local Buffers b;
  for (auto [buf, size] : {std::pair{&b.qkv, N * width}, {&b.attn, N * HD}, {&b.o, N * C}, {&b.h, N * C},
                           {&b.gu, N * gu_width}, {&b.m, N * C}})
    buf->resize(std::max<size_t>(buf->size(), size));
  int64_t s_qkv[2] = {N, width}, s_attn[2] = {N, HD}, s_c[2] = {N, C}, s_gu[2] = {N, gu_width};
  const char *f32 = "float32";
  auto in = [&](int i) { return Arg{params[i], ndims[i], shapes[i], dtypes[i]}; };
  auto buf = [&](std::vector<float> &v, int64_t *shape) { return Arg{v.data(), 2, shape, f32}; };
  int rc = call(&MindserveNormMatMul, {in(X), in(NA), in(EPS), in(WQKV), buf(b.qkv, s_qkv)});
  if (rc != 0) return 100 + rc;
  rc = call(&MindserveQKVAttention, {buf(b.qkv, s_qkv), in(BIAS), in(COS), in(SIN), in(KC), in(VC), in(WR), in(TAB),
                                     in(POS), in(ROWS), in(META), in(QKN), in(QEPS), buf(b.attn, s_attn)});
  if (rc != 0) return 200 + rc;
  rc = call(&MindserveMatMul, {buf(b.attn, s_attn), in(WO), buf(b.o, s_c)});
  if (rc != 0) return 300 + rc;
  rc = call(&MindserveNormAdd, {buf(b.o, s_c), in(PAN), in(EPS), in(X), buf(b.h, s_c)});
  if (rc != 0) return 400 + rc;
  rc = call(&MindserveNormMatMul, {buf(b.h, s_c), in(NF), in(EPS), in(WGU), buf(b.gu, s_gu)});
  if (rc != 0) return 500 + rc;
  rc = call(&MindserveGeGLUMatMul, {buf(b.gu, s_gu), in(WD), buf(b.m, s_c)});
  if (rc != 0) return 600 + rc;
  rc = call(&MindserveNormAdd, {buf(b.m, s_c), in(PFN), in(EPS), buf(b.h, s_c), in(OUT)});
  return rc != 0 ? 700 + rc : 0;
}

int MindserveDecoderLayer(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                          void *extra) {
  mindserve::FpScope fp;
  (void)stream;
  (void)extra;
  enum { X, NA, EPS, WQKV, BIAS, COS, SIN, KC, VC, WR, TAB, POS, ROWS, META, WO, NF, WGU, WD, QKN, QEPS };
  if (nparam != WD + 2 && nparam != QEPS + 2) return 1;
  const bool has_norm = nparam == QEPS + 2;  // (qk_norm, qk_eps): QKVAttention's optional head norms
  const int OUT = nparam - 1;
  if (!is_f32(dtypes[X]) || !is_f32(dtypes[OUT]) || !is_i32(dtypes[META])) return 2;
  if (ndims[X] != 2 || ndims[OUT] != 2 || ndims[COS] != 2 || ndims[META] != 1 || shapes[META][0] != 3) return 3;
  const int64_t N = shapes[X][0], C = shapes[X][1], D = shapes[COS][1];
  const int64_t KV = static_cast<const int32_t *>(params[META])[0];
  const int64_t width = shapes[WQKV][ndims[WQKV] - 1], gu_width = shapes[WGU][ndims[WGU] - 1];
  const int64_t HD = width - 2 * KV * D;
  if (N <= 0) return 0;
  if (shapes[OUT][0] != N || shapes[OUT][1] != C || HD <= 0) return 4;
  struct Buffers {
    std::vector<float> qkv, attn, h, gu;
  };
  thread_local Buffers b;
  b.qkv.resize(std::max<size_t>(b.qkv.size(), N * width));
  b.attn.resize(std::max<size_t>(b.attn.size(), N * HD));
  b.h.resize(std::max<size_t>(b.h.size(), N * C));
  b.gu.resize(std::max<size_t>(b.gu.size(), N * gu_width));
  int64_t s_qkv[2] = {N, width}, s_attn[2] = {N, HD}, s_h[2] = {N, C}, s_gu[2] = {N, gu_width};
  const char *f32 = "float32";
  auto in = [&](int i) { return Arg{params[i], ndims[i], shapes[i], dtypes[i]}; };
  int rc = call(&MindserveNormMatMul, {in(X), in(NA), in(EPS), in(WQKV), Arg{b.qkv.data(), 2, s_qkv, f32}});
  if (rc != 0) return 100 + rc;
  const Arg attn_out{b.attn.data(), 2, s_attn, f32};
  rc = has_norm ? call(&MindserveQKVAttention, {Arg{b.qkv.data(), 2, s_qkv, f32}, in(BIAS), in(COS), in(SIN), in(KC),
                                                in(VC), in(WR), in(TAB), in(POS), in(ROWS), in(META), in(QKN), in(QEPS),
                                                attn_out})
                : call(&MindserveQKVAttention, {Arg{b.qkv.data(), 2, s_qkv, f32}, in(BIAS), in(COS), in(SIN), in(KC),
                                                in(VC), in(WR), in(TAB), in(POS), in(ROWS), in(META), attn_out});
  if (rc != 0) return 200 + rc;
  rc = call(&MindserveMatMulAdd, {Arg{b.attn.data(), 2, s_attn, f32}, in(WO), in(X), Arg{b.h.data(), 2, s_h, f32}});
  if (rc != 0) return 300 + rc;
  rc = call(&MindserveNormMatMul, {Arg{b.h.data(), 2, s_h, f32}, in(NF), in(EPS), in(WGU), Arg{b.gu.data(), 2, s_gu, f32}});
  if (rc != 0) return 400 + rc;
  rc = call(&MindserveSwiGLUMatMulAdd, {Arg{b.gu.data(), 2, s_gu, f32}, in(WD), Arg{b.h.data(), 2, s_h, f32}, in(OUT)});
  return rc != 0 ? 500 + rc : 0;
}

int MindserveEmbedRope(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                       void *extra) {
  mindserve::FpScope fp;
  (void)stream;
  (void)extra;
  if (nparam != 8) return 1;
  if (!is_i32(dtypes[0]) || !is_i32(dtypes[1]) || !all_f32(dtypes + 2, 6)) return 2;
  for (int i = 2; i < 8; ++i)
    if (ndims[i] != 2) return 3;
  const int64_t N = count_of(ndims[0], shapes[0]), C = shapes[2][1], D = shapes[3][1];
  if (count_of(ndims[1], shapes[1]) != N || shapes[4][0] != shapes[3][0] || shapes[4][1] != D || shapes[5][0] != N ||
      shapes[5][1] != C || shapes[6][0] != N || shapes[6][1] != D || shapes[7][0] != N || shapes[7][1] != D)
    return 4;
  const auto *ids = static_cast<const int32_t *>(params[0]), *pos = static_cast<const int32_t *>(params[1]);
  if (!gather_rows(static_cast<const float *>(params[2]), shapes[2][0], C, ids, N, static_cast<float *>(params[5])))
    return 5;  // a token id outside the embedding
  if (!gather_rows(static_cast<const float *>(params[3]), shapes[3][0], D, pos, N, static_cast<float *>(params[6])) ||
      !gather_rows(static_cast<const float *>(params[4]), shapes[4][0], D, pos, N, static_cast<float *>(params[7])))
    return 6;  // a position outside the rotary tables
  return 0;
}

int MindserveNormHead(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                      void *extra) {
  mindserve::FpScope fp;
  (void)stream;
  (void)extra;
  if (nparam != 7) return 1;
  if (!all_f32(dtypes, 3) || !is_i32(dtypes[3]) || !is_f32(dtypes[5]) || !is_f32(dtypes[6])) return 2;
  if (ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 1 || shapes[2][0] != 1 || ndims[3] != 1 || ndims[6] != 2) return 3;
  const int64_t N = shapes[0][0], C = shapes[0][1], R = shapes[3][0];
  if (shapes[1][0] != C || shapes[6][0] != N || shapes[6][1] != C) return 4;
  const float *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *hidden = static_cast<float *>(params[6]);
  {
    mindserve::ScopeTimer timer(mindserve::kRMSNorm);
    for_rows(N, 16, [&](int64_t r) { rmsnorm_row(x + r * C, w, eps, hidden + r * C, C); });
  }
  float *last = scratch(R * C);
  if (!gather_rows(hidden, N, C, static_cast<const int32_t *>(params[3]), R, last)) return 7;
  int64_t s_last[2] = {R, C};
  const int rc = call(&MindserveMatMul, {Arg{last, 2, s_last, "float32"}, Arg{params[4], ndims[4], shapes[4], dtypes[4]},
                                         Arg{params[5], ndims[5], shapes[5], dtypes[5]}});
  return rc != 0 ? 100 + rc : 0;
}

}  // extern "C"
