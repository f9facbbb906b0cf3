// mindserve quantized matmul: y[M, N] = x[M, K] @ W (+ res), W packed from one of GGUF's block formats (qformat.h:
// the formats, their traits and the packed layout), dequantized on the fly inside the dot product.
//
// Activations are quantized per row (quantize.h): blocks of 32 for the 32-weight formats, Q8_K's 256 for the
// K-quants, as llama.cpp does for these dot products. Each output element then is, over the blocks b = 0 .. K/B - 1
// in order (all float32, exact integer sums):
//   Q8_0, Q4_0: acc = fma(d_w * dx, (float)sum_k(q_k * qx_k) [- 8 sx for Q4_0], acc)
//   Q4_1:       acc = fma(d_w * dx, (float)sum_k(q_k * qx_k), acc);  acc = fma(m_w, sfx, acc)
//   Q5_0, Q5_1: as Q4_0, Q4_1 (offset 16 for Q5_0, m for Q5_1)
//   Q4_K, Q5_K: acc = fma(d_w * dx, (float)sum_j(sc_j * dot_j), acc);
//               acc = fnmadd(dmin_w * dx, (float)sum_j(mn_j * (bsum_2j + bsum_2j+1)), acc)
//   Q6_K:       acc = fma(d_w * dx, (float)sum_j(sc_j * (dot16_j - 32 bsum_j)), acc)
// and y = acc (+ res, added once at the end), then each row's LoRA delta (lora.h) when the LoRA inputs are
// given. This fixed sequence does not depend on M, on the other rows, on the thread count or on the tile
// shape (work is split over rows and over groups of 16 output columns, one or two at a time, never over K), so a row is
// bit-identical alone or batched. The integer sums are exact whatever instructions compute them, so every
// backend of vec.h (AVX-512 VNNI, AVX-512BW, AVX2, NEON with or without dotprod, scalar) gives identical bits.
// A segmented weight (qformat.h) has each segment's columns computed by its format's tiles from its own kind of
// activation quantization (each made once per call), so every output element has the bits it has when its part is
// multiplied alone.
//
// The instruction set is the build variant's (build.py): vec.h's dot_nib / dot_q8 are vpdpbusd with AVX-512
// VNNI, vpmaddubsw + vpmaddwd with AVX-512BW or AVX2, sdot with NEON dotprod, widening multiplies on plain
// NEON. mindserve_qmatmul_isa() says which.
//
// Exported: mindserve_qmatmul_raw(x, w_packed, fmt, res, y, M, K, N) (tests; fmt a qformat.h code),
// mindserve_qmatmul_packed_raw(x, w_packed, L, res, y, M, K, N) (either kind of weight, as the AOT entry reads it),
// mindserve_qmatmul_isa(); the AOT path is qmatmul_entry() (qmatmul.h), reached through MindserveMatMul /
// MindserveMatMulAdd with a uint8 weight.
#include "qmatmul.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "entry.h"
#include "lora.h"
#include "pool.h"
#include "qformat.h"
#include "qtable.h"
#include "qtile.h"
#include "quantize.h"
#include "vec.h"

namespace {

using namespace mindserve::q;  // NOLINT: the formats, their traits and the tiles
using mindserve::QX;
using mindserve::quantize_rows;
using mindserve::quantize_rows_k;

constexpr bool is_k(int f) { return kTraits[f].k8; }
constexpr int block_size(int f) { return kTraits[f].block; }
constexpr int packed_bytes(int f) { return kTraits[f].packed_bytes; }

// The tiles by format (qtable.h; built in the qtiles_*.cc sources).
const FormatTiles *const kTiles[kFormats] = {&kQ8Q4Tiles[0], &kQ8Q4Tiles[1], &kQ8Q4Tiles[2], &kQ5Tiles[0],
                                             &kQ5Tiles[1],   &kQ4KTiles,     &kQ5KTiles,     &kQ6KTiles};
static_assert(kQ5_1 == 4 && kQ4_K == 5 && kQ5_K == 6 && kQ6_K == 7 && kFormats == 8, "kTiles is in Fmt order");

// The columns [0, N) of one weight (or of one segment, the output's columns [n0, n0 + N): y and res point at column
// n0 of row 0) in one format; rows of y and res are ldy apart.
struct Job {
  const QX *qx;
  const uint8_t *w;
  const float *res;
  float *y;
  int64_t M, N, ldy;
  int fmt;
  int64_t groups, nchunks;
};

// Rows [0, M) cut into nearly equal blocks of at most `most` rows: block b of n has (M - m) / (n - b) rows;
// fn(m, rows, b, n).
template <typename Fn>
inline void row_blocks(int64_t M, int most, Fn &&fn) {
  const int64_t nblocks = (M + most - 1) / most;
  int64_t m = 0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t rows = (M - m) / (nblocks - b);
    fn(m, rows, b, nblocks);
    m += rows;
  }
}

// Output columns of groups [g0, g1) for every row; full groups two at a time where the backend has pair tiles
// (a pair never straddles chunks). When several row blocks pass over a step's columns (a group or a pair), they
// prefetch the next step's weights, each block its share: weights never stay in cache from one step to the next,
// and the first pass would otherwise wait on memory. One pass of one group leaves it to the hardware prefetcher
// (which does better alone), but one pass of a pair (two weight streams) waits on memory without it.
void run_chunk(const void *ctx, int64_t c) {
  const Job &j = *static_cast<const Job *>(ctx);
  const int64_t g0 = j.groups * c / j.nchunks, g1 = j.groups * (c + 1) / j.nchunks;
  const int64_t group_bytes = int64_t{kGroup} * j.qx->nb * packed_bytes(j.fmt);
  for (int64_t g = g0; g < g1;) {
    const int64_t n0 = g * kGroup;
    const int w = static_cast<int>(std::min<int64_t>(kGroup, j.N - n0));
    // Rows of a pair tile (0: none). A K-quant pair only when it takes several passes (in one pass, M <= 4, its
    // two weight streams wait on memory); Q6_K's (two halves a sub-block) only from passes of kMaxKMR2 rows.
    const Traits &t = kTraits[j.fmt];
    const int64_t kmin = t.halves ? 2 * kMaxKMR2 : kMaxKMR2 + 1;  // the fewest rows a K-quant pair takes
    const int most2 = t.k8 ? (j.M >= kmin ? kMaxKMR2 : 0) : t.simple() ? kMaxMR2 : 0;
    const bool pair = most2 > 0 && j.M > 1 && g + 1 < g1 && j.N - n0 >= 2 * kGroup;  // no gain for one row
    const int step = pair ? 2 : 1;
    const uint8_t *wg = j.w + g * group_bytes;
    const float *res = j.res == nullptr ? nullptr : j.res + n0;
    const int64_t next = std::min<int64_t>(step, g1 - g - step) * group_bytes;  // the next step's weight bytes
    row_blocks(j.M, pair ? most2 : kMaxMR, [&](int64_t m, int64_t rows, int64_t pass, int64_t passes) {
      const int64_t ahead = passes > 1 || pair ? next : 0;
      const Ahead a{wg + step * group_bytes + ahead * pass / passes, ahead * (pass + 1) / passes - ahead * pass / passes};
      const TileFn fn = pair ? kTiles[j.fmt]->fn[2][rows - 1] : kTiles[j.fmt]->fn[w == kGroup][rows - 1];
      fn(*j.qx, m, wg, group_bytes, w, res == nullptr ? nullptr : res + m * j.ldy, j.y + m * j.ldy + n0, j.ldy, a);
    });
    g += step;
  }
}

int64_t chunk_count(int64_t groups, int64_t bytes, int threads) {
  const int64_t per = std::clamp<int64_t>(bytes / (int64_t{128} << 10) / std::max(1, threads), 1, 8);
  return std::max<int64_t>(1, std::min<int64_t>({groups, threads * per, mindserve::kMaxChunks}));
}

// y = x @ W (+ res). K a multiple of the format's block size, fmt in 0..kFormats-1 (checked by the callers).
void qmatmul(const float *x, const uint8_t *w, int fmt, const float *res, float *y, int64_t M, int64_t K, int64_t N) {
  if (M <= 0 || N <= 0) return;
  mindserve::ScopeTimer timer(mindserve::kMatMul);
  if (K == 0) {
    if (res != nullptr) std::memcpy(y, res, sizeof(float) * M * N);
    else std::memset(y, 0, sizeof(float) * M * N);
    return;
  }
  QX qx;
  if (is_k(fmt)) quantize_rows_k(x, M, K, &qx);
  else quantize_rows(x, M, K, &qx);
  const int64_t groups = (N + kGroup - 1) / kGroup;
  Job job{&qx, w, res, y, M, N, N, fmt, groups, 1};
  job.nchunks = chunk_count(groups, N * qx.nb * packed_bytes(fmt), mindserve::pool().threads());
  mindserve::pool().run(mindserve::Task{&run_chunk, &job, job.nchunks});
}

// A segmented weight's columns [n0, n0 + cols), in format fmt, packed at w (qformat.h).
struct Segment {
  int fmt;
  int64_t n0, cols;
  const uint8_t *w;
};

struct SegmentJobs {
  Job job[kMaxSegments];
  int64_t first[kMaxSegments + 1];  // segment s's chunks are [first[s], first[s + 1])
};

void run_segment_chunk(const void *ctx, int64_t c) {
  const SegmentJobs &j = *static_cast<const SegmentJobs *>(ctx);
  int s = 0;
  while (c >= j.first[s + 1]) ++s;
  run_chunk(&j.job[s], c - j.first[s]);
}

// y = x @ W (+ res) for a segmented W: x quantized once per kind its segments take (Q8_K for the K-quants, the
// 32-blocks' for the others), then every segment's chunks in one pool task, each writing its own columns of y.
// An output element sees only its segment's format's operations: the bits of its part multiplied alone.
void qmatmul_segments(const float *x, const Segment *seg, int count, const float *res, float *y, int64_t M, int64_t K,
                      int64_t N) {
  if (M <= 0 || N <= 0) return;
  mindserve::ScopeTimer timer(mindserve::kMatMul);
  bool blocks = false, supers = false;
  for (int s = 0; s < count; ++s) (is_k(seg[s].fmt) ? supers : blocks) = true;
  QX q32, qk;
  if (blocks) quantize_rows(x, M, K, &q32);
  if (supers) quantize_rows_k(x, M, K, &qk);
  SegmentJobs jobs;
  jobs.first[0] = 0;
  const int threads = mindserve::pool().threads();
  for (int s = 0; s < count; ++s) {
    const Segment &g = seg[s];
    const QX *qx = is_k(g.fmt) ? &qk : &q32;
    const int64_t groups = (g.cols + kGroup - 1) / kGroup;
    jobs.job[s] = Job{qx, g.w, res == nullptr ? nullptr : res + g.n0, y + g.n0, M, g.cols, N, g.fmt, groups, 1};
    jobs.job[s].nchunks = std::min<int64_t>(chunk_count(groups, g.cols * qx->nb * packed_bytes(g.fmt), threads),
                                            mindserve::kMaxChunks / kMaxSegments);
    jobs.first[s + 1] = jobs.first[s] + jobs.job[s].nchunks;
  }
  mindserve::pool().run(mindserve::Task{&run_segment_chunk, &jobs, jobs.first[count]});
}

// The segment table of a packed weight of L * N bytes for x [.., K] (its count), or -1 if it is not a valid one.
int segments_of(const uint8_t *w, int64_t K, int64_t L, int64_t N, Segment *seg) {
  const int64_t size = L * N;
  if (K <= 0 || L % 2 == 0 || size < 8) return -1;
  int32_t head[2];
  std::memcpy(head, w, sizeof head);
  if (head[0] != kSegMagic || head[1] < 2 || head[1] > kMaxSegments || size < 8 + 16 * int64_t{head[1]}) return -1;
  int64_t end = 8 + 16 * int64_t{head[1]}, n0 = 0;
  for (int s = 0; s < head[1]; ++s) {
    int32_t fc[2];
    int64_t off;
    std::memcpy(fc, w + 8 + 16 * s, sizeof fc);
    std::memcpy(&off, w + 16 + 16 * s, sizeof off);
    const int f = fc[0];
    const int64_t cols = fc[1];
    if (f < 0 || f >= kFormats || K % block_size(f) != 0 || cols <= 0 || off != (end + 63) / 64 * 64) return -1;
    const int64_t bytes = cols * (K / block_size(f)) * packed_bytes(f);
    if (off > size - bytes) return -1;
    seg[s] = Segment{f, n0, cols, w + off};
    end = off + bytes;
    n0 += cols;
  }
  return n0 == N && end > (L - 2) * N ? head[1] : -1;  // the least odd L: a table for another K does not fit
}

}  // namespace

namespace mindserve {

namespace {
// Format of a packed weight [1, L, N] for x [.., K]: L = (K / block size) * packed block bytes. -1 if none fits.
// (Unique: per 256 weights the formats take 272, 144, 160, 176, 192, 148, 180, 210 bytes.)
int format_of(int64_t K, int64_t L) {
  if (K <= 0) return -1;
  for (int f = 0; f < kFormats; ++f)
    if (K % block_size(f) == 0 && L == K / block_size(f) * packed_bytes(f)) return f;
  return -1;
}

// y = x @ W (+ res) for a packed weight of either kind, [1, L, N]: 0, or 4 if L fits no format and the bytes are no
// segment table. A single format is found from L alone, as before segments (the hot path: one branch more).
int qmatmul_packed(const float *x, const uint8_t *w, int64_t L, const float *res, float *y, int64_t M, int64_t K,
                   int64_t N) {
  const int fmt = format_of(K, L);
  if (fmt >= 0) {
    qmatmul(x, w, fmt, res, y, M, K, N);
    return 0;
  }
  Segment seg[kMaxSegments];
  const int count = segments_of(w, K, L, N, seg);
  if (count < 0) return 4;
  qmatmul_segments(x, seg, count, res, y, M, K, N);
  return 0;
}

}  // namespace

int qmatmul_entry(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool add) {
  const int nin = add ? 3 : 2;
  const bool lora = nparam == nin + kLoraInputs + 1;
  if (nparam != nin + 1 && !lora) return 1;
  const int out = nparam - 1;
  if (!is_f32(dtypes[0]) || std::strcmp(dtypes[1], "uint8") != 0 || (add && !is_f32(dtypes[2])) ||
      !is_f32(dtypes[out]))
    return 2;
  if (ndims[0] < 1 || ndims[1] != 3 || shapes[1][0] != 1 || ndims[out] < 1) return 3;
  const int64_t K = shapes[0][ndims[0] - 1];
  const int64_t M = rows_of(ndims[0], shapes[0]);
  if (K <= 0) return 4;
  const int64_t N = shapes[1][2];
  if (shapes[out][ndims[out] - 1] != N) return 5;
  if (add && (ndims[2] < 1 || shapes[2][ndims[2] - 1] != N || rows_of(ndims[2], shapes[2]) != M)) return 6;
  LoraArgs l;
  if (lora) {
    const int err = lora_args(params, ndims, shapes, dtypes, nin, M, K, N, &l);
    if (err != 0) return err;
  }
  const auto *x = static_cast<const float *>(params[0]);
  auto *y = static_cast<float *>(params[out]);
  const int err = qmatmul_packed(x, static_cast<const uint8_t *>(params[1]), shapes[1][1],
                                 add ? static_cast<const float *>(params[2]) : nullptr, y, M, K, N);
  if (err != 0) return err;
  if (lora) lora_apply(l, x, M, K, y, N);
  return 0;
}

}  // namespace mindserve

extern "C" {

// 0 ok; 1 bad format; 2 K not a multiple of the format's block size (32, or 256 for the K-quants).
int mindserve_qmatmul_raw(const float *x, const uint8_t *w_packed, int fmt, const float *res, float *y, int64_t M,
                          int64_t K, int64_t N) {
  mindserve::FpScope fp;
  if (fmt < 0 || fmt >= kFormats) return 1;
  if (K % block_size(fmt) != 0) return 2;
  qmatmul(x, w_packed, fmt, res, y, M, K, N);
  return 0;
}

// A packed weight of either kind ([1, L, N]: one format, read from L, or a segmented stack): 0 ok; 4 L fits no
// format and w holds no valid segment table.
int mindserve_qmatmul_packed_raw(const float *x, const uint8_t *w_packed, int64_t L, const float *res, float *y,
                                 int64_t M, int64_t K, int64_t N) {
  mindserve::FpScope fp;
  if (K <= 0) return 4;
  return mindserve::qmatmul_packed(x, w_packed, L, res, y, M, K, N);
}

// Which instruction set the dot products use (vec.h's backend): "avx512-vnni", "avx512bw", "avx2", "neon-dotprod",
// "neon" or "scalar".
const char *mindserve_qmatmul_isa() { return v::kIsa; }


}  // extern "C"
