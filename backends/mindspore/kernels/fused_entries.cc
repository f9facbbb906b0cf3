// mindserve fused AOT entries: MindSpore's arguments checked, then the compute of fused.h, or other entries called in
// order on scratch buffers of the calling thread: each replaces a chain of small MindSpore ops (every op launch costs
// microseconds, and a decode step of a small model is mostly launches). The entries the network uses are the rows of
// kernels/ops.py (their inputs, outputs and what they compute); here are what that table leaves out:
//   - the parts, entries of their own so the tests can check each fused entry against them bit for bit:
//     MindserveSwiGLU(gu [N, 2F]) -> [N, F]; MindserveQKVRope(qkv [N, (H + 2 KV) D], cos, sin [N, D]) -> q [N, H, D],
//     k, v [N KV, D] (H and KV from the output shapes); MindserveGeGLUMatMul(gu, W, ...) = MatMul(geglu(gu), W, ...);
//     MindserveNormAdd(x [N, C], w [C], eps [1], res [N, C]) -> res + rmsnorm(x) * w.
//   - the prologue entries (NormMatMul, SwiGLUMatMulAdd, GeGLUMatMul) hand their remaining inputs to the matmul entry
//     as they came (any weight it takes, the four optional LoRA inputs of lora.h).
//   - QKVAttention writes all its cache rows before any key is read, so a token always sees itself and the earlier
//     tokens of its own chunk; duplicate rows (padding tokens all write the scratch slot 0) are written in token
//     order, the last one wins.
//   - a layer entry's failing stage s returns 100 s + that stage's own error code.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <vector>

#include "entry.h"
#include "fused.h"
#include "kv_format.h"
#include "pool.h"

namespace {

using mindserve::all_f32;
using mindserve::Arg;  // entry.h: another entry called as MindSpore would
using mindserve::call;
using mindserve::count_of;
using mindserve::is_f32;
using mindserve::is_i32;
using mindserve::rows_of;
using mindserve::kv::kMaxHeadDim;
using namespace mindserve::fused;  // NOLINT: the compute

constexpr int kMaxParams = 16;

// Call `entry` (a matmul AOT entry) with params[0] replaced by `x` [rows..., C] (the shape of input 0 with
// its last dimension C) and params[1, skip) dropped: the prologue's own inputs.
int forward(mindserve::Entry entry, int nparam, void **params,
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

// What the decoder-layer entries check and read of MindSpore's arguments before their stages (indices as both number
// them: x 0, wqkv 3, cos 5, meta 13 with the KV heads first; `out` and `wgu` are the entry's own): x and the output
// float32 [N, C], meta int32 [meta_len], cos [N, D]; the stages' widths from the weights' last dimensions.
struct LayerDims {
  int64_t N, C, D, width, gu_width, HD;  // HD: the query heads' width, wqkv's columns less the K and V heads'
};

// 0 with `d` filled (N <= 0: nothing to compute), else 2 (a dtype), 3 (a rank) or 4 (a shape).
int layer_dims(void **params, int *ndims, int64_t **shapes, const char **dtypes, int out, int wgu, int meta_len,
               LayerDims &d) {
  enum { X = 0, WQKV = 3, COS = 5, META = 13 };
  if (!is_f32(dtypes[X]) || !is_f32(dtypes[out]) || !is_i32(dtypes[META])) return 2;
  if (ndims[X] != 2 || ndims[out] != 2 || ndims[COS] != 2 || ndims[META] != 1 || shapes[META][0] != meta_len) return 3;
  d.N = shapes[X][0], d.C = shapes[X][1], d.D = shapes[COS][1];
  const int64_t KV = static_cast<const int32_t *>(params[META])[0];
  d.width = shapes[WQKV][ndims[WQKV] - 1], d.gu_width = shapes[wgu][ndims[wgu] - 1];
  d.HD = d.width - 2 * KV * d.D;
  if (d.N <= 0) return 0;
  if (shapes[out][0] != d.N || shapes[out][1] != d.C || d.HD <= 0) return 4;
  return 0;
}

// A layer entry's arguments as arguments of the entries it calls: MindSpore's own (`in`) and a scratch buffer [N, w]
// of the calling thread (`buf`), grown to at least the elements its shape holds (`grow`).
struct LayerArgs {
  void **params;
  int *ndims;
  int64_t **shapes;
  const char **dtypes;
  Arg in(int i) const { return Arg{params[i], ndims[i], shapes[i], dtypes[i]}; }
};

Arg buf(std::vector<float> &v, int64_t *shape) { return Arg{v.data(), 2, shape, "float32"}; }

void grow(std::vector<float> &v, int64_t n) { v.resize(std::max<size_t>(v.size(), n)); }

}  // namespace

static int entry_rmsnorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  mindserve::ScopeTimer timer(mindserve::kRMSNorm);
  if (int rc = mindserve::expect(nparam, 4, dtypes, 4)) return rc;
  if (ndims[0] < 1 || ndims[1] != 1 || ndims[2] != 1 || shapes[2][0] != 1) return 3;
  const int64_t C = shapes[0][ndims[0] - 1], N = rows_of(ndims[0], shapes[0]);
  if (shapes[1][0] != C || shapes[3][ndims[3] - 1] != C) return 4;
  const float *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *y = static_cast<float *>(params[3]);
  rmsnorm_rows(x, w, eps, y, N, C);
  return 0;
}
MINDSERVE_ENTRY(MindserveRMSNorm, entry_rmsnorm)

static int entry_swiglu(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  mindserve::ScopeTimer timer(mindserve::kSwiGLU);
  if (int rc = mindserve::expect(nparam, 2, dtypes, 2)) return rc;
  if (ndims[0] < 1 || ndims[1] != ndims[0]) return 3;
  const int64_t F = shapes[1][ndims[1] - 1], N = rows_of(ndims[0], shapes[0]);
  if (shapes[0][ndims[0] - 1] != 2 * F) return 4;
  const float *gu = static_cast<const float *>(params[0]);
  float *y = static_cast<float *>(params[1]);
  swiglu_rows(gu, y, N, F);
  return 0;
}
MINDSERVE_ENTRY(MindserveSwiGLU, entry_swiglu)

static int entry_qkv_rope(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  mindserve::ScopeTimer timer(mindserve::kQKVRope);
  if (int rc = mindserve::expect(nparam, 6, dtypes, 6)) return rc;
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
  qkv_rope_rows(qkv, cos, sin, q, k, v, N, H, KV, D);

  return 0;
}
MINDSERVE_ENTRY(MindserveQKVRope, entry_qkv_rope)

static int entry_qkv_attention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
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
MINDSERVE_ENTRY(MindserveQKVAttention, entry_qkv_attention)

static int entry_norm_matmul(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
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
    rmsnorm_rows(x, w, eps, normed, N, C);
  }
  return forward(&MindserveMatMul, nparam, params, ndims, shapes, dtypes, 3, normed, C);
}
MINDSERVE_ENTRY(MindserveNormMatMul, entry_norm_matmul)

// A gated activation ([N, 2F] gate|up -> [N, F], `rows` is swiglu_rows or geglu_rows), then `entry` on it
// with the remaining inputs: the shared body of the SwiGLU and GeGLU entries.
static int glu_forward(void (*rows)(const float *, float *, int64_t, int64_t),
                       mindserve::Entry entry, int min_params,
                       int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam < min_params) return 1;
  if (!all_f32(dtypes, 1)) return 2;
  if (ndims[0] < 1 || shapes[0][ndims[0] - 1] % 2 != 0) return 3;
  const int64_t F = shapes[0][ndims[0] - 1] / 2, N = rows_of(ndims[0], shapes[0]);
  const float *gu = static_cast<const float *>(params[0]);
  float *act = scratch(N * F);
  {
    mindserve::ScopeTimer timer(mindserve::kSwiGLU);
    rows(gu, act, N, F);
  }
  return forward(entry, nparam, params, ndims, shapes, dtypes, 1, act, F);
}

static int entry_swiglu_matmul_add(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  return glu_forward(&swiglu_rows, &MindserveMatMulAdd, 4, nparam, params, ndims, shapes, dtypes);
}
MINDSERVE_ENTRY(MindserveSwiGLUMatMulAdd, entry_swiglu_matmul_add)

static int entry_geglu_matmul(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  return glu_forward(&geglu_rows, &MindserveMatMul, 3, nparam, params, ndims, shapes, dtypes);
}
MINDSERVE_ENTRY(MindserveGeGLUMatMul, entry_geglu_matmul)

static int entry_norm_add(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  mindserve::ScopeTimer timer(mindserve::kRMSNorm);
  if (int rc = mindserve::expect(nparam, 5, dtypes, 5)) return rc;
  if (ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 1 || shapes[2][0] != 1 || ndims[3] != 2 || ndims[4] != 2) return 3;
  const int64_t N = shapes[0][0], C = shapes[0][1];
  if (shapes[1][0] != C || shapes[3][0] != N || shapes[3][1] != C || shapes[4][0] != N || shapes[4][1] != C) return 4;
  const float *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]), *res = static_cast<const float *>(params[3]);
  float *y = static_cast<float *>(params[4]);
  if (y == res) return 5;  // norm_add_rows writes y before it reads res
  norm_add_rows(x, w, eps, res, y, N, C);
  return 0;
}
MINDSERVE_ENTRY(MindserveNormAdd, entry_norm_add)

// MindserveGemmaDecoderLayer(x, attn_norm, eps, wqkv, bias, cos, sin, k_cache, v_cache, write, table, pos, rows,
//                            meta [5], wo, post_attn_norm, ffn_norm, w_gate_up, w_down, post_ffn_norm, qk_norm, qk_eps)
//     -> y [N, C]: a Gemma 3 layer (norm weights already 1 + w) as one op, the entries above in order:
//   qkv = NormMatMul(x, attn_norm, eps, wqkv); a = QKVAttention(qkv, ..., meta, qk_norm, qk_eps) (meta's window and
//   scale); o = MatMul(a, wo); h = NormAdd(o, post_attn_norm, eps, x); gu = NormMatMul(h, ffn_norm, eps, w_gate_up);
//   m = GeGLUMatMul(gu, w_down); y = NormAdd(m, post_ffn_norm, eps, h). A failing stage s (1..7) returns 100 s + its
//   own error code.
static int entry_gemma_decoder_layer(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  enum { X, NA, EPS, WQKV, BIAS, COS, SIN, KC, VC, WR, TAB, POS, ROWS, META, WO, PAN, NF, WGU, WD, PFN, QKN, QEPS, OUT };
  if (nparam != OUT + 1) return 1;
  LayerDims d;
  if (int rc = layer_dims(params, ndims, shapes, dtypes, OUT, WGU, 5, d)) return rc;
  if (d.N <= 0) return 0;
  struct Buffers {
    std::vector<float> qkv, attn, o, h, gu, m;
  };
  thread_local Buffers b;
  const int64_t N = d.N;
  grow(b.qkv, N * d.width), grow(b.attn, N * d.HD), grow(b.o, N * d.C), grow(b.h, N * d.C);
  grow(b.gu, N * d.gu_width), grow(b.m, N * d.C);
  int64_t s_qkv[2] = {N, d.width}, s_attn[2] = {N, d.HD}, s_c[2] = {N, d.C}, s_gu[2] = {N, d.gu_width};
  const LayerArgs a{params, ndims, shapes, dtypes};
  int rc = call(&MindserveNormMatMul, {a.in(X), a.in(NA), a.in(EPS), a.in(WQKV), buf(b.qkv, s_qkv)});
  if (rc != 0) return 100 + rc;
  rc = call(&MindserveQKVAttention, {buf(b.qkv, s_qkv), a.in(BIAS), a.in(COS), a.in(SIN), a.in(KC), a.in(VC),
                                     a.in(WR), a.in(TAB), a.in(POS), a.in(ROWS), a.in(META), a.in(QKN), a.in(QEPS),
                                     buf(b.attn, s_attn)});
  if (rc != 0) return 200 + rc;
  rc = call(&MindserveMatMul, {buf(b.attn, s_attn), a.in(WO), buf(b.o, s_c)});
  if (rc != 0) return 300 + rc;
  rc = call(&MindserveNormAdd, {buf(b.o, s_c), a.in(PAN), a.in(EPS), a.in(X), buf(b.h, s_c)});
  if (rc != 0) return 400 + rc;
  rc = call(&MindserveNormMatMul, {buf(b.h, s_c), a.in(NF), a.in(EPS), a.in(WGU), buf(b.gu, s_gu)});
  if (rc != 0) return 500 + rc;
  rc = call(&MindserveGeGLUMatMul, {buf(b.gu, s_gu), a.in(WD), buf(b.m, s_c)});
  if (rc != 0) return 600 + rc;
  rc = call(&MindserveNormAdd, {buf(b.m, s_c), a.in(PFN), a.in(EPS), buf(b.h, s_c), a.in(OUT)});
  return rc != 0 ? 700 + rc : 0;
}
MINDSERVE_ENTRY(MindserveGemmaDecoderLayer, entry_gemma_decoder_layer)

static int entry_decoder_layer(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  enum { X, NA, EPS, WQKV, BIAS, COS, SIN, KC, VC, WR, TAB, POS, ROWS, META, WO, NF, WGU, WD, QKN, QEPS };
  if (nparam != WD + 2 && nparam != QEPS + 2) return 1;
  const bool has_norm = nparam == QEPS + 2;  // (qk_norm, qk_eps): QKVAttention's optional head norms
  const int OUT = nparam - 1;
  LayerDims d;
  if (int rc = layer_dims(params, ndims, shapes, dtypes, OUT, WGU, 3, d)) return rc;
  if (d.N <= 0) return 0;
  struct Buffers {
    std::vector<float> qkv, attn, h, gu;
  };
  thread_local Buffers b;
  const int64_t N = d.N;
  grow(b.qkv, N * d.width), grow(b.attn, N * d.HD), grow(b.h, N * d.C), grow(b.gu, N * d.gu_width);
  int64_t s_qkv[2] = {N, d.width}, s_attn[2] = {N, d.HD}, s_h[2] = {N, d.C}, s_gu[2] = {N, d.gu_width};
  const LayerArgs a{params, ndims, shapes, dtypes};
  int rc = call(&MindserveNormMatMul, {a.in(X), a.in(NA), a.in(EPS), a.in(WQKV), buf(b.qkv, s_qkv)});
  if (rc != 0) return 100 + rc;
  rc = has_norm ? call(&MindserveQKVAttention, {buf(b.qkv, s_qkv), a.in(BIAS), a.in(COS), a.in(SIN), a.in(KC),
                                                a.in(VC), a.in(WR), a.in(TAB), a.in(POS), a.in(ROWS), a.in(META),
                                                a.in(QKN), a.in(QEPS), buf(b.attn, s_attn)})
                : call(&MindserveQKVAttention, {buf(b.qkv, s_qkv), a.in(BIAS), a.in(COS), a.in(SIN), a.in(KC),
                                                a.in(VC), a.in(WR), a.in(TAB), a.in(POS), a.in(ROWS), a.in(META),
                                                buf(b.attn, s_attn)});
  if (rc != 0) return 200 + rc;
  rc = call(&MindserveMatMulAdd, {buf(b.attn, s_attn), a.in(WO), a.in(X), buf(b.h, s_h)});
  if (rc != 0) return 300 + rc;
  rc = call(&MindserveNormMatMul, {buf(b.h, s_h), a.in(NF), a.in(EPS), a.in(WGU), buf(b.gu, s_gu)});
  if (rc != 0) return 400 + rc;
  rc = call(&MindserveSwiGLUMatMulAdd, {buf(b.gu, s_gu), a.in(WD), buf(b.h, s_h), a.in(OUT)});
  return rc != 0 ? 500 + rc : 0;
}
MINDSERVE_ENTRY(MindserveDecoderLayer, entry_decoder_layer)

static int entry_embed_rope(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
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
MINDSERVE_ENTRY(MindserveEmbedRope, entry_embed_rope)

static int entry_norm_head(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
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
    rmsnorm_rows(x, w, eps, hidden, N, C);
  }
  float *last = scratch(R * C);
  if (!gather_rows(hidden, N, C, static_cast<const int32_t *>(params[3]), R, last)) return 7;
  int64_t s_last[2] = {R, C};
  const int rc = call(&MindserveMatMul, {Arg{last, 2, s_last, "float32"}, Arg{params[4], ndims[4], shapes[4], dtypes[4]},
                                         Arg{params[5], ndims[5], shapes[5], dtypes[5]}});
  return rc != 0 ? 100 + rc : 0;
}
MINDSERVE_ENTRY(MindserveNormHead, entry_norm_head)

