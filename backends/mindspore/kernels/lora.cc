// mindserve LoRA tail (see lora.h): the per-row low-rank delta every matmul entry can add.
#include "lora.h"

#include <algorithm>
#include <vector>

#include "entry.h"
#include "pool.h"
#include "vec.h"

namespace mindserve {
namespace {

namespace v = vec;

constexpr int kVecs = 4;  // 16-float vectors per block of columns

// t [GR] = x [K] @ a [K, GR]: for each element, acc = fma(x[k], a[k, j], acc) over k in order.
void shrink_row(const float *x, const float *a, int64_t K, int64_t GR, float *t) {
  for (int64_t j0 = 0; j0 < GR; j0 += 16 * kVecs) {
    const int64_t width = std::min<int64_t>(16 * kVecs, GR - j0);
    const int nv = static_cast<int>((width + 15) / 16);
    v::F32x16 acc[kVecs];
    for (int c = 0; c < kVecs; ++c) acc[c] = v::zero();
    const float *ak = a + j0;
    for (int64_t k = 0; k < K; ++k, ak += GR) {
      const v::F32x16 xb = v::set1(x[k]);
      for (int c = 0; c < nv; ++c) acc[c] = v::fmadd(xb, v::load_n(ak + 16 * c, width - 16 * c), acc[c]);
    }
    for (int c = 0; c < nv; ++c) v::store_n(t + j0 + 16 * c, acc[c], width - 16 * c);
  }
}

// y[n] += sum_j t[g(n)*R + j] * b[j, n] for the columns [c0, c1) of one row (b is the slot's [R, N]).
void expand_row(const float *t, const float *b, const int32_t *segs, int64_t G, int64_t R, int64_t N, int64_t c0,
                int64_t c1, float *y) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t lo = std::max<int64_t>(c0, segs[g]), hi = std::min<int64_t>(c1, segs[g + 1]);
    const float *tg = t + g * R;
    for (int64_t n0 = lo; n0 < hi; n0 += 16 * kVecs) {
      const int64_t width = std::min<int64_t>(16 * kVecs, hi - n0);
      const int nv = static_cast<int>((width + 15) / 16);
      v::F32x16 acc[kVecs];
      for (int c = 0; c < kVecs; ++c) acc[c] = v::zero();
      const float *bj = b + n0;
      for (int64_t j = 0; j < R; ++j, bj += N) {
        const v::F32x16 tb = v::set1(tg[j]);
        for (int c = 0; c < nv; ++c) acc[c] = v::fmadd(tb, v::load_n(bj + 16 * c, width - 16 * c), acc[c]);
      }
      for (int c = 0; c < nv; ++c) {
        float *yv = y + n0 + 16 * c;
        const int64_t m = width - 16 * c;
        v::store_n(yv, v::add(v::load_n(yv, m), acc[c]), m);
      }
    }
  }
}

struct Job {
  const LoraArgs *l;
  const float *x;
  float *y;
  float *t;  // [M, G*R] scratch
  int64_t M, K, N, GR;
  int64_t chunks;
};

}  // namespace

int lora_args(void **params, int *ndims, int64_t **shapes, const char **dtypes, int first, int64_t M, int64_t K,
              int64_t N, LoraArgs *out) {
  const int a = first, b = first + 1, rows = first + 2, segs = first + 3;
  if (!is_f32(dtypes[a]) || !is_f32(dtypes[b]) || !is_i32(dtypes[rows]) || !is_i32(dtypes[segs])) return 20;
  if (ndims[a] != 3 || ndims[b] != 3 || ndims[segs] != 1) return 21;
  const int64_t S = shapes[a][0], GR = shapes[a][2], R = shapes[b][1];
  if (shapes[a][1] != K || shapes[b][0] != S || shapes[b][2] != N || R <= 0 || GR % R != 0) return 22;
  const int64_t G = GR / R;
  if (shapes[segs][0] != G + 1 || rows_of(ndims[rows], shapes[rows]) * shapes[rows][ndims[rows] - 1] != M) return 23;
  const auto *sg = static_cast<const int32_t *>(params[segs]);
  if (sg[0] != 0 || sg[G] != N) return 24;
  for (int64_t g = 0; g < G; ++g)
    if (sg[g + 1] <= sg[g]) return 24;
  const auto *rw = static_cast<const int32_t *>(params[rows]);
  for (int64_t m = 0; m < M; ++m)
    if (rw[m] < -1 || rw[m] >= S) return 25;
  *out = LoraArgs{static_cast<const float *>(params[a]), static_cast<const float *>(params[b]), rw, sg, S, G, R};
  return 0;
}

void lora_apply(const LoraArgs &l, const float *x, int64_t M, int64_t K, float *y, int64_t N) {
  if (!std::any_of(l.rows, l.rows + M, [](int32_t s) { return s >= 0; })) return;
  const int64_t GR = l.groups * l.rank;
  std::vector<float> t(static_cast<size_t>(M * GR));
  const int64_t threads = pool().threads();
  Job job{&l, x, y, t.data(), M, K, N, GR, std::max<int64_t>(1, std::min<int64_t>(M, 2 * threads))};
  pool().run(Task{[](const void *p, int64_t c) {  // shrink: rows split over the pool
                    const Job &j = *static_cast<const Job *>(p);
                    for (int64_t m = j.M * c / j.chunks; m < j.M * (c + 1) / j.chunks; ++m) {
                      const int32_t s = j.l->rows[m];
                      if (s >= 0) shrink_row(j.x + m * j.K, j.l->a + s * j.K * j.GR, j.K, j.GR, j.t + m * j.GR);
                    }
                  },
                  &job, job.chunks});
  job.chunks = std::max<int64_t>(1, std::min<int64_t>((N + 63) / 64, 4 * threads));
  pool().run(Task{[](const void *p, int64_t c) {  // expand: columns split over the pool, every row
                    const Job &j = *static_cast<const Job *>(p);
                    const int64_t c0 = j.N * c / j.chunks, c1 = j.N * (c + 1) / j.chunks;
                    for (int64_t m = 0; m < j.M; ++m) {
                      const int32_t s = j.l->rows[m];
                      if (s >= 0)
                        expand_row(j.t + m * j.GR, j.l->b + s * j.l->rank * j.N, j.l->segs, j.l->groups, j.l->rank,
                                   j.N, c0, c1, j.y + m * j.N);
                    }
                  },
                  &job, job.chunks});
}

}  // namespace mindserve
