// mindserve kernels: a model's decoder layers as one op of few inputs. MindSpore's own time around an op grows with its
// inputs (measured: one op of ~400 inputs was no faster than 30 of 18; docs/performance.md "One op for the layers"),
// so the layers' weights, norms, metadata and caches are not inputs: the layout table gives their addresses, shapes and
// dtypes (the network's Parameters' own memory, the memory the one-op-a-layer graph reads and writes), and each
// layer's own entry (MindserveDecoderLayer, MindserveGemmaDecoderLayer or MindserveMoEDecoderLayer) is called in
// order with them, as MindSpore would call it, the hidden rows passing between layers through two scratch buffers.
// The same entries on the same memory in the same order: the same bits as one op a layer.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "entry.h"

namespace {

using mindserve::Entry;

constexpr const char *kDtypes[] = {"float32", "int32", "uint8", "float16", "bfloat16"};
constexpr int kDtypeCount = sizeof(kDtypes) / sizeof(kDtypes[0]);
constexpr int kLayoutCols = 6;  // address, ndim (or -1 - k: the step's rope input k), dims 0-2, dtype code

// MindserveDecoderStack(x [N, C], write, table, pos, rows, smeta [3] i32 = (L, P, kind), layout [L * P, 6] i64,
//                       R rope inputs [N, D] (cos, sin, ...)) -> y [N, C]
// kind: 0 MindserveDecoderLayer, 1 MindserveGemmaDecoderLayer, 2 MindserveMoEDecoderLayer. Layer l is called with
// its entry's inputs in that entry's order: x (the input rows, or the layer before's output) first, the step's
// write, table, pos and rows (shared) at the entries' common places 9-12, and layout rows l P .. l P + P - 1 in the
// other places in order: each an address with its ndim, dims and dtype (kDtypes), or (address 0, ndim -1 - k) the
// step's rope input k. Its output is y for the last layer, else a scratch buffer. A failing layer l returns
// 1000 (l + 1) + its code.
int entry_decoder_stack(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  enum { X, WR, TAB, POS, ROWS, SMETA, LAYOUT, ROPES };
  constexpr int kFirstShared = 9, kShared = 4;  // write, table, pos, rows: inputs 9..12 of every layer entry
  constexpr int kMaxArgs = 32;
  if (nparam < ROPES + 1) return 1;
  const int OUT = nparam - 1, ropes = OUT - ROPES;
  if (!mindserve::is_i32(dtypes[SMETA]) || mindserve::count_of(ndims[SMETA], shapes[SMETA]) != 3) return 2;
  if (std::strcmp(dtypes[LAYOUT], "int64") != 0 || ndims[LAYOUT] != 2 || shapes[LAYOUT][1] != kLayoutCols) return 2;
  const int32_t *smeta = static_cast<const int32_t *>(params[SMETA]);
  const int L = smeta[0], P = smeta[1], kind = smeta[2];
  const int n = 1 + kShared + P + 1;  // a layer's inputs and its output
  if (L < 1 || P < kFirstShared - 1 || n > kMaxArgs || shapes[LAYOUT][0] != int64_t{L} * P) return 3;
  if (kind < 0 || kind > 2) return 3;
  if (!mindserve::is_f32(dtypes[X]) || !mindserve::is_f32(dtypes[OUT]) || ndims[X] != 2 || ndims[OUT] != 2) return 2;
  const int64_t N = shapes[X][0], C = shapes[X][1];
  if (shapes[OUT][0] != N || shapes[OUT][1] != C) return 4;
  const int64_t *layout = static_cast<const int64_t *>(params[LAYOUT]);
  for (int64_t r = 0; r < int64_t{L} * P; ++r) {  // every row an address, or a rope input there is
    const int64_t *row = layout + r * kLayoutCols;
    const bool rope = row[0] == 0 && row[1] < 0 && -1 - row[1] < ropes;
    if (!rope && (row[0] == 0 || row[1] < 1 || row[1] > 3 || row[5] < 0 || row[5] >= kDtypeCount)) return 5;
  }
  if (N <= 0) return 0;
  const Entry layer = kind == 0 ? &MindserveDecoderLayer : kind == 1 ? &MindserveGemmaDecoderLayer
                                                                      : &MindserveMoEDecoderLayer;
  thread_local std::vector<float> ping, pong;
  for (std::vector<float> *v : {&ping, &pong}) v->resize(std::max<size_t>(v->size(), N * C));
  int64_t s_x[2] = {N, C};
  static char f32[] = "float32";
  void *p[kMaxArgs];
  int nd[kMaxArgs];
  int64_t *sh[kMaxArgs];
  const char *dt[kMaxArgs];
  void *in = params[X];
  for (int l = 0; l < L; ++l) {
    for (int i = 1, k = 0; i < n - 1; ++i) {  // input i of the layer's entry: shared, a rope input or a layout row
      int src = -1;
      if (i >= kFirstShared && i < kFirstShared + kShared) {
        src = WR + i - kFirstShared;
      } else {
        const int64_t r = int64_t{l} * P + k++;
        const int64_t *row = layout + r * kLayoutCols;
        if (row[0] == 0) {
          src = ROPES + int(-1 - row[1]);
        } else {  // the row's own dims (the entries read shapes, never write them)
          p[i] = reinterpret_cast<void *>(row[0]), nd[i] = int(row[1]), sh[i] = const_cast<int64_t *>(row + 2);
          dt[i] = kDtypes[row[5]];
        }
      }
      if (src >= 0) p[i] = params[src], nd[i] = ndims[src], sh[i] = shapes[src], dt[i] = dtypes[src];
    }
    void *out = l == L - 1 ? params[OUT] : (l % 2 == 0 ? ping : pong).data();
    p[0] = in, nd[0] = 2, sh[0] = s_x, dt[0] = f32;
    p[n - 1] = out, nd[n - 1] = 2, sh[n - 1] = s_x, dt[n - 1] = f32;
    if (const int rc = layer(n, p, nd, sh, dt, nullptr, nullptr)) return 1000 * (l + 1) + rc;
    in = out;
  }
  return 0;
}

}  // namespace

MINDSERVE_ENTRY(MindserveDecoderStack, entry_decoder_stack)
