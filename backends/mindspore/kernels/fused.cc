// mindserve row-wise fused kernels for MindSpore AOT custom ops on CPU (AVX-512): each replaces a
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
//
// Every output row is a function of its own input row only, computed by a fixed sequence of
// operations, so results do not depend on the batch (the determinism contract of matmul.cc).
// Each entry returns 0, or non-zero on a shape/dtype mismatch (MindSpore then raises).
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "entry.h"
#include "pool.h"
#include "simd.h"

namespace {

using mindserve::exp_nonpositive;
using mindserve::tail_mask;

using mindserve::all_f32;
using mindserve::rows_of;

// Rows [0, n) split over the pool in chunks of at least `min_rows` rows.
template <class Fn>
void for_rows(int64_t n, int64_t min_rows, const Fn &fn) {
  struct Ctx {
    const Fn *fn;
    int64_t n, chunks;
  };
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(n / std::max<int64_t>(1, min_rows),
                                                                 2 * mindserve::pool().threads()));
  Ctx ctx{&fn, n, chunks};
  mindserve::pool().run(mindserve::Task{
      [](const void *p, int64_t c) {
        const Ctx &x = *static_cast<const Ctx *>(p);
        for (int64_t r = x.n * c / x.chunks; r < x.n * (c + 1) / x.chunks; ++r) (*x.fn)(r);
      },
      &ctx, chunks});
}

void rmsnorm_row(const float *x, const float *w, float eps, float *y, int64_t C) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; c += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(tail_mask(C - c), x + c);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(C) + eps);
  const __m512 vr = _mm512_set1_ps(r);
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 m = tail_mask(C - c);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + c), vr);
    _mm512_mask_storeu_ps(y + c, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + c)));
  }
}

// silu(g) * u, with sigmoid from exp(-|g|) so the exponent is never positive.
void swiglu_row(const float *gu, float *y, int64_t F) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t f = 0; f < F; f += 16) {
    const __mmask16 m = tail_mask(F - f);
    const __m512 g = _mm512_maskz_loadu_ps(m, gu + f);
    const __m512 u = _mm512_maskz_loadu_ps(m, gu + F + f);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(y + f, m, _mm512_mul_ps(_mm512_mul_ps(g, sig), u));
  }
}

// One head vector: out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]).
void rope_head(const float *x, const float *cos, const float *sin, float *out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = tail_mask(half - i);
    const __m512 lo = _mm512_maskz_loadu_ps(m, x + i), hi = _mm512_maskz_loadu_ps(m, x + half + i);
    const __m512 out_lo = _mm512_fnmadd_ps(hi, _mm512_maskz_loadu_ps(m, sin + i),
                                           _mm512_mul_ps(lo, _mm512_maskz_loadu_ps(m, cos + i)));
    const __m512 out_hi = _mm512_fmadd_ps(lo, _mm512_maskz_loadu_ps(m, sin + half + i),
                                          _mm512_mul_ps(hi, _mm512_maskz_loadu_ps(m, cos + half + i)));
    _mm512_mask_storeu_ps(out + i, m, out_lo);
    _mm512_mask_storeu_ps(out + half + i, m, out_hi);
  }
}

}  // namespace

extern "C" {

int MindserveRMSNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                     void *extra) {
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

}  // extern "C"
