// mindserve kernels: the dtype and shape checks every AOT entry point makes on MindSpore's arguments, and the
// plain-pointer entries one kernel calls from another.
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

}  // namespace mindserve

// The matmul AOT entries (matmul.cc) and paged attention on plain pointers (attention.cc), for the entries
// of fused.cc that end in them.
extern "C" int MindserveMatMul(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                               void *stream, void *extra);
extern "C" int MindserveMatMulAdd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *stream, void *extra);
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
