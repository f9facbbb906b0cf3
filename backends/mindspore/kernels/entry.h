// mindserve kernels: the ABI of an AOT entry point once -- its preamble (MINDSERVE_ENTRY), the dtype and shape checks
// every entry makes on MindSpore's arguments, every entry's declaration -- and the plain-pointer entries one kernel
// calls from another.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "fpenv.h"  // every entry below opens an FpScope

namespace mindserve {

inline bool is_f32(const char *dtype) { return std::strcmp(dtype, "float32") == 0 || std::strcmp(dtype, "float") == 0; }
inline bool is_i32(const char *dtype) { return std::strcmp(dtype, "int32") == 0; }

// Every one of the first n dtypes is float32.
inline bool all_f32(const char **dtypes, int n) {
  for (int i = 0; i < n; ++i)
    if (!is_f32(dtypes[i])) return false;
  return true;
}

// 0 if there are n arguments, the first `f32` of them float32; else 1 (a count) or 2 (a dtype).
inline int expect(int nparam, int n, const char **dtypes, int f32) {
  if (nparam != n) return 1;
  return all_f32(dtypes, f32) ? 0 : 2;
}

// Elements of a tensor: the product of all its dims.
inline int64_t count_of(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

// Rows of a tensor seen as [rows, last dim]: the product of all dims but the last.
inline int64_t rows_of(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int d = 0; d < ndim - 1; ++d) n *= shape[d];
  return n;
}

// An AOT entry's signature, and one argument of a call to it made by another entry (the fused layers call the
// matmul, norm and attention entries as MindSpore would): a pointer, its shape and dtype.
using Entry = int (*)(int, void **, int *, int64_t **, const char **, void *, void *);
struct Arg {
  void *p;
  int nd;
  int64_t *shape;
  const char *dtype;
};

// entry(args...): the call MindSpore would make.
inline int call(Entry entry, std::initializer_list<Arg> args) {
  constexpr int kMaxArgs = 24;
  void *p[kMaxArgs];
  int nd[kMaxArgs];
  int64_t *sh[kMaxArgs];
  const char *dt[kMaxArgs];
  int n = 0;
  for (const Arg &a : args) {
    if (n == kMaxArgs) return 41;
    p[n] = a.p, nd[n] = a.nd, sh[n] = a.shape, dt[n] = a.dtype, ++n;
  }
  return entry(n, p, nd, sh, dt, nullptr, nullptr);
}

// An entry's body: the entry's arguments but MindSpore's stream and extra (unused on CPU).
using Body = int(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes);

}  // namespace mindserve

// Defines the AOT entry Name (the C symbol MindSpore's Custom op looks up): the floating-point mode every kernel
// computes in (fpenv.h), then body(nparam, params, ndims, shapes, dtypes). Each returns 0, or non-zero on a
// shape/dtype mismatch (MindSpore then raises).
#define MINDSERVE_ENTRY(Name, body)                                                                       \
  extern "C" int Name(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, \
                      void *) {                                                                           \
    mindserve::FpScope fp;                                                                                \
    return body(nparam, params, ndims, shapes, dtypes);                                                   \
  }

// Every AOT entry of the library (kernels/ops.py lists them for Python), for the entries that call others.
#define MINDSERVE_DECLARE(Name) \
  extern "C" int Name(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *)
MINDSERVE_DECLARE(MindserveMatMul);  // matmul.cc
MINDSERVE_DECLARE(MindserveMatMulAdd);
MINDSERVE_DECLARE(MindservePagedAttention);  // attention.cc
MINDSERVE_DECLARE(MindserveRMSNorm);  // fused_entries.cc
MINDSERVE_DECLARE(MindserveSwiGLU);
MINDSERVE_DECLARE(MindserveQKVRope);
MINDSERVE_DECLARE(MindserveQKVAttention);
MINDSERVE_DECLARE(MindserveNormMatMul);
MINDSERVE_DECLARE(MindserveSwiGLUMatMulAdd);
MINDSERVE_DECLARE(MindserveGeGLUMatMul);
MINDSERVE_DECLARE(MindserveNormAdd);
MINDSERVE_DECLARE(MindserveDecoderLayer);
MINDSERVE_DECLARE(MindserveGemmaDecoderLayer);
MINDSERVE_DECLARE(MindserveEmbedRope);
MINDSERVE_DECLARE(MindserveNormHead);
MINDSERVE_DECLARE(MindserveMoE);  // moe.cc
MINDSERVE_DECLARE(MindserveMoEDecoderLayer);
MINDSERVE_DECLARE(MindservePackQWeight);  // pack.cc
MINDSERVE_DECLARE(MindserveDequantize);
MINDSERVE_DECLARE(MindserveEmbedRopePacked);  // vocab.cc
MINDSERVE_DECLARE(MindserveDecoderStack);  // stack.cc

// Paged attention on plain pointers (attention.cc), for the entries that end in it.
extern "C" int mindserve_attention_raw(const float *q, const float *k, const float *v, const int32_t *table,
                                       const int32_t *pos, const int32_t *rows, float *out, int64_t N, int64_t R,
                                       int64_t H, int64_t D, int64_t KV, int64_t S, int64_t NB, int64_t bs);
// The same over caches in format fmt (kv_format.h's kv::Format).
extern "C" int mindserve_attention_kv_raw(const float *q, const void *k, const void *v, const int32_t *table,
                                          const int32_t *pos, const int32_t *rows, float *out, int64_t N, int64_t R,
                                          int64_t H, int64_t D, int64_t KV, int64_t S, int64_t NB, int64_t bs, int fmt);
// ... reading only the keys (p - window, p] of a query at position p when window > 0, scores scaled by scale when
// > 0 (else 1 / sqrt(D)): Gemma 3's sliding-window layers and query_pre_attn_scalar.
extern "C" int mindserve_attention_window_raw(const float *q, const void *k, const void *v, const int32_t *table,
                                              const int32_t *pos, const int32_t *rows, float *out, int64_t N,
                                              int64_t R, int64_t H, int64_t D, int64_t KV, int64_t S, int64_t NB,
                                              int64_t bs, int fmt, int64_t window, float scale);
