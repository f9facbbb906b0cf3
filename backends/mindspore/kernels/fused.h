// mindserve row-wise fused kernels (fused.cc) on plain pointers: the compute the fused AOT entries
// (fused_entries.cc) run after checking MindSpore's arguments. Each *_rows function works on N rows on the pool.
#pragma once

#include <cstdint>

#include "kv_format.h"

namespace mindserve::fused {

// y = x / sqrt(mean(x^2) + eps) * w, rows of C.
void rmsnorm_rows(const float *x, const float *w, float eps, float *y, int64_t N, int64_t C);
// y = silu(gu[:, :F]) * gu[:, F:] (the sigmoid from exp(-|g|), so the exponent is never positive).
void swiglu_rows(const float *gu, float *y, int64_t N, int64_t F);
// y = gelu_tanh(gu[:, :F]) * gu[:, F:] (Gemma's GeGLU).
void geglu_rows(const float *gu, float *y, int64_t N, int64_t F);
// y = res + rmsnorm(x) * w (y must not alias res: it is written first).
void norm_add_rows(const float *x, const float *w, float eps, const float *res, float *y, int64_t N, int64_t C);
// qkv [N, (H + 2 KV) D] split into q [N, H, D], k, v [N KV, D], q and k roped with cos, sin [N, D] (HF rotate_half).
void qkv_rope_rows(const float *qkv, const float *cos, const float *sin, float *q, float *k, float *v, int64_t N,
                   int64_t H, int64_t KV, int64_t D);
// out[i] = table[idx[i]] for rows of `width` floats; false if an index is outside [0, rows).
bool gather_rows(const float *table, int64_t rows, int64_t width, const int32_t *idx, int64_t n, float *out);

// A step's new K/V rows into the paged caches and its queries roped (MindserveQKVAttention before the attention).
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

// The caches' rows written (row write[r KV + h] gets head h of token r, (+ bias,) (head-normed,) roped, encoded as
// kv_format.h says; duplicates in token order, the last one wins) and every query head roped into q: 0, or 8 for a
// row outside the cache, 6 for D above kv::kMaxHeadDim.
int write_and_rope(const QKVWrite &a, bool has_bias, bool has_norm);

}  // namespace mindserve::fused
