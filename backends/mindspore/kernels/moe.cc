// mindserve routed experts (Qwen3-MoE) for MindSpore AOT custom ops on CPU (any ISA of vec.h).
//
//   MindserveMoE(h [N, C], ffn_norm [C], eps [1], router W (out E), w_gate_up [E, K1, 2F], w_down [E, K2, C],
//                meta [2] i32 = (top_k, norm_topk)) -> y [N, C]
//       a sparse layer's whole MLP half, residual included:
//         x = rmsnorm(h, ffn_norm, eps)                       (MindserveRMSNorm)
//         logits = x @ router                                 (MindserveMatMul: any weight it takes)
//         p = softmax(logits): m = the max (in index order), e = exp_nonpositive(l - m), s = the 16-lane sum of e
//             (acc = acc + chunk, then reduce_add), p = e / s
//         the top_k experts of the row by p (ties: the lower index), in rank order; their weights p_j, or with
//         norm_topk p_j / (p_0 + p_1 + ... in rank order)
//         for each expert e in index order, the rows that chose it gathered into one block X_e:
//             d = (swiglu(X_e @ W_gu[e])) @ W_d[e]             (MindserveMatMul, MindserveSwiGLU, MindserveMatMul)
//         y = h + acc, acc = 0 then acc = acc + w_j * d_j over the row's experts in index order (HF's index_add_)
//       Each expert's slice of w_gate_up / w_down is one matmul weight of matmul.cc (float32 packed by
//       prepare_weight, [1, C, 2F] and [1, F, C], or GGUF blocks packed by prepare_qstack, uint8, a gate and up
//       of different formats as a segmented weight, qmatmul.cc): only the
//       experts some row routes to are read. Every matmul computes each row the same way whatever else is in
//       the block, so a row's result does not depend on the batch.
//   MindserveMoEDecoderLayer(x, attn_norm, eps, wqkv, bias, cos, sin, k_cache, v_cache, write, table, pos, rows, meta,
//                            wo, ffn_norm, router, w_gate_up, w_down, moe_meta, (qk_norm, qk_eps)) -> y [N, C]
//       MindserveDecoderLayer's first three stages (NormMatMul, QKVAttention, MatMulAdd) and MindserveMoE as the
//       fourth, in one op: the same bits as those four ops. A failing stage s (1..4) returns 100 s + its code.
//
// Each entry returns 0, or non-zero on a shape/dtype mismatch (MindSpore then raises).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "entry.h"
#include "vec.h"


namespace {

namespace v = mindserve::vec;

using mindserve::is_f32;
using mindserve::is_i32;
using mindserve::Arg;
using mindserve::call;

constexpr int64_t kMaxExperts = 1024;



// The softmax of one row of E logits into p, then its top_k experts (rank order, ties to the lower index) and
// their weights.
void route(const float *logits, int64_t E, int64_t top_k, bool norm, float *p, int32_t *sel, float *weight) {
  float m = logits[0];
  for (int64_t e = 1; e < E; ++e) m = logits[e] > m ? logits[e] : m;
  const v::F32x16 vm = v::set1(m);
  v::F32x16 acc = v::zero();
  for (int64_t e = 0; e < E; e += 16) {
    const v::F32x16 ex = v::exp_nonpositive(v::sub(v::load_n(logits + e, E - e), vm));
    v::store_n(p + e, ex, E - e);
    acc = v::add(acc, v::load_n(p + e, E - e));  // the stored lanes only (the others load as +0.0)
  }
  const float s = v::reduce_add(acc);
  for (int64_t e = 0; e < E; ++e) p[e] = p[e] / s;
  for (int64_t j = 0; j < top_k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || sel[i] == e;
      if (!taken && (best < 0 || p[e] > p[best])) best = e;
    }
    sel[j] = static_cast<int32_t>(best);
    weight[j] = p[best];
  }
  if (norm) {
    float total = weight[0];
    for (int64_t j = 1; j < top_k; ++j) total = total + weight[j];
    for (int64_t j = 0; j < top_k; ++j) weight[j] = weight[j] / total;
  }
}

// One expert's slice of a stacked [E, rows, cols] weight, as the [1, rows, cols] matmul weight it is.
struct Slice {
  void *p;
  int64_t shape[3];
};

Slice expert_slice(void *w, const int64_t *shape, const char *dtype, int64_t e) {
  const int64_t elem = is_f32(dtype) ? 4 : 1;
  return Slice{static_cast<uint8_t *>(w) + e * shape[1] * shape[2] * elem, {1, shape[1], shape[2]}};
}

struct Buffers {
  std::vector<float> x, logits, p, weight, xe, gu, act, de, slots;
  std::vector<int32_t> sel, members;
};

}  // namespace

extern "C" {

static int entry_moe(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  enum { H, NW, EPS, WR, WGU, WD, META, OUT };
  if (nparam != OUT + 1) return 1;
  if (!is_f32(dtypes[H]) || !is_f32(dtypes[NW]) || !is_f32(dtypes[EPS]) || !is_f32(dtypes[OUT]) ||
      !is_i32(dtypes[META]))
    return 2;
  if ((!is_f32(dtypes[WGU]) && std::strcmp(dtypes[WGU], "uint8") != 0) ||
      (!is_f32(dtypes[WD]) && std::strcmp(dtypes[WD], "uint8") != 0))
    return 2;
  if (ndims[H] != 2 || ndims[OUT] != 2 || ndims[WGU] != 3 || ndims[WD] != 3 || ndims[META] != 1 ||
      shapes[META][0] != 2 || ndims[WR] < 1)
    return 3;
  const int64_t N = shapes[H][0], C = shapes[H][1], E = shapes[WGU][0], GU = shapes[WGU][2], F = GU / 2;
  const int32_t *meta = static_cast<const int32_t *>(params[META]);
  const int64_t top_k = meta[0];
  const bool norm = meta[1] != 0;
  if (shapes[OUT][0] != N || shapes[OUT][1] != C || shapes[WD][0] != E || shapes[WD][2] != C || GU % 2 != 0 ||
      shapes[WR][ndims[WR] - 1] != E || E <= 0 || E > kMaxExperts || top_k < 1 || top_k > E)
    return 4;
  if (N <= 0) return 0;
  thread_local Buffers b;
  b.x.resize(std::max<size_t>(b.x.size(), N * C));
  b.logits.resize(std::max<size_t>(b.logits.size(), N * E));
  b.p.resize(std::max<size_t>(b.p.size(), E + 16));
  b.weight.resize(std::max<size_t>(b.weight.size(), N * top_k));
  b.sel.resize(std::max<size_t>(b.sel.size(), N * top_k));
  b.members.resize(std::max<size_t>(b.members.size(), N * top_k));
  b.xe.resize(std::max<size_t>(b.xe.size(), N * C));
  b.gu.resize(std::max<size_t>(b.gu.size(), N * GU));
  b.act.resize(std::max<size_t>(b.act.size(), N * F));
  b.de.resize(std::max<size_t>(b.de.size(), N * C));
  b.slots.resize(std::max<size_t>(b.slots.size(), N * top_k * C));
  const char *f32 = "float32";
  auto in = [&](int i) { return Arg{params[i], ndims[i], shapes[i], dtypes[i]}; };
  int64_t s_x[2] = {N, C}, s_logits[2] = {N, E};
  int rc = call(&MindserveRMSNorm, {in(H), in(NW), in(EPS), Arg{b.x.data(), 2, s_x, f32}});
  if (rc != 0) return 10 + rc;
  rc = call(&MindserveMatMul, {Arg{b.x.data(), 2, s_x, f32}, in(WR), Arg{b.logits.data(), 2, s_logits, f32}});
  if (rc != 0) return 20 + rc;
  for (int64_t r = 0; r < N; ++r)
    route(b.logits.data() + r * E, E, top_k, norm, b.p.data(), b.sel.data() + r * top_k, b.weight.data() + r * top_k);
  // Expert by expert, in index order: the rows that chose it (ascending), their one block through the expert.
  for (int64_t e = 0; e < E; ++e) {
    int64_t n = 0;
    for (int64_t i = 0; i < N * top_k; ++i)
      if (b.sel[i] == e) b.members[n++] = static_cast<int32_t>(i);  // slot i = row * top_k + rank
    if (n == 0) continue;  // never read
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(b.xe.data() + i * C, b.x.data() + (b.members[i] / top_k) * C, sizeof(float) * C);
    Slice gu = expert_slice(params[WGU], shapes[WGU], dtypes[WGU], e);
    Slice dw = expert_slice(params[WD], shapes[WD], dtypes[WD], e);
    int64_t s_xe[2] = {n, C}, s_gu[2] = {n, GU}, s_act[2] = {n, F}, s_de[2] = {n, C};
    rc = call(&MindserveMatMul, {Arg{b.xe.data(), 2, s_xe, f32}, Arg{gu.p, 3, gu.shape, dtypes[WGU]},
                                 Arg{b.gu.data(), 2, s_gu, f32}});
    if (rc != 0) return 30 + rc;
    rc = call(&MindserveSwiGLU, {Arg{b.gu.data(), 2, s_gu, f32}, Arg{b.act.data(), 2, s_act, f32}});
    if (rc != 0) return 40 + rc;
    rc = call(&MindserveMatMul, {Arg{b.act.data(), 2, s_act, f32}, Arg{dw.p, 3, dw.shape, dtypes[WD]},
                                 Arg{b.de.data(), 2, s_de, f32}});
    if (rc != 0) return 50 + rc;
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(b.slots.data() + int64_t{b.members[i]} * C, b.de.data() + i * C, sizeof(float) * C);
  }
  const float *h = static_cast<const float *>(params[H]);
  float *y = static_cast<float *>(params[OUT]);
  for (int64_t r = 0; r < N; ++r) {
    const int32_t *sel = b.sel.data() + r * top_k;
    int32_t order[kMaxExperts];
    for (int64_t j = 0; j < top_k; ++j) order[j] = static_cast<int32_t>(j);
    std::sort(order, order + top_k, [&](int32_t a, int32_t c) { return sel[a] < sel[c]; });  // expert index order
    for (int64_t c = 0; c < C; c += 16) {
      v::F32x16 acc = v::zero();
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t slot = r * top_k + order[j];
        acc = v::add(acc, v::mul(v::load_n(b.slots.data() + slot * C + c, C - c), v::set1(b.weight[slot])));
      }
      v::store_n(y + r * C + c, v::add(v::load_n(h + r * C + c, C - c), acc), C - c);
    }
  }
  return 0;
}
MINDSERVE_ENTRY(MindserveMoE, entry_moe)

static int entry_moe_decoder_layer(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  enum { X, NA, EPS, WQKV, BIAS, COS, SIN, KC, VC, WR, TAB, POS, ROWS, META, WO, NF, ROUTER, WGU, WD, MM, QKN, QEPS };
  if (nparam != MM + 2 && nparam != QEPS + 2) return 1;
  const bool has_norm = nparam == QEPS + 2;
  const int OUT = nparam - 1;
  if (!is_f32(dtypes[X]) || !is_f32(dtypes[OUT]) || !is_i32(dtypes[META])) return 2;
  if (ndims[X] != 2 || ndims[OUT] != 2 || ndims[COS] != 2 || ndims[META] != 1 || shapes[META][0] != 3) return 3;
  const int64_t N = shapes[X][0], C = shapes[X][1], D = shapes[COS][1];
  const int64_t KV = static_cast<const int32_t *>(params[META])[0];
  const int64_t width = shapes[WQKV][ndims[WQKV] - 1], HD = width - 2 * KV * D;
  if (N <= 0) return 0;
  if (shapes[OUT][0] != N || shapes[OUT][1] != C || HD <= 0) return 4;
  struct LayerBuffers {
    std::vector<float> qkv, attn, h;
  };
  thread_local LayerBuffers b;
  b.qkv.resize(std::max<size_t>(b.qkv.size(), N * width));
  b.attn.resize(std::max<size_t>(b.attn.size(), N * HD));
  b.h.resize(std::max<size_t>(b.h.size(), N * C));
  int64_t s_qkv[2] = {N, width}, s_attn[2] = {N, HD}, s_h[2] = {N, C};
  const char *f32 = "float32";
  auto in = [&](int i) { return Arg{params[i], ndims[i], shapes[i], dtypes[i]}; };
  int rc = call(&MindserveNormMatMul, {in(X), in(NA), in(EPS), in(WQKV), Arg{b.qkv.data(), 2, s_qkv, f32}});
  if (rc != 0) return 100 + rc;
  const Arg qkv{b.qkv.data(), 2, s_qkv, f32}, attn{b.attn.data(), 2, s_attn, f32};
  rc = has_norm ? call(&MindserveQKVAttention, {qkv, in(BIAS), in(COS), in(SIN), in(KC), in(VC), in(WR), in(TAB),
                                                in(POS), in(ROWS), in(META), in(QKN), in(QEPS), attn})
                : call(&MindserveQKVAttention, {qkv, in(BIAS), in(COS), in(SIN), in(KC), in(VC), in(WR), in(TAB),
                                                in(POS), in(ROWS), in(META), attn});
  if (rc != 0) return 200 + rc;
  rc = call(&MindserveMatMulAdd, {attn, in(WO), in(X), Arg{b.h.data(), 2, s_h, f32}});
  if (rc != 0) return 300 + rc;
  rc = call(&MindserveMoE, {Arg{b.h.data(), 2, s_h, f32}, in(NF), in(EPS), in(ROUTER), in(WGU), in(WD), in(MM),
                            in(OUT)});
  return rc != 0 ? 400 + rc : 0;
}
MINDSERVE_ENTRY(MindserveMoEDecoderLayer, entry_moe_decoder_layer)

}  // extern "C"
