// mindserve LoRA tail: each row of a product adds its own adapter's low-rank delta (multi-LoRA serving:
// base rows and rows of different adapters share one step; segmented by adapter slot, no merged weights).
//
// Any matmul entry (fp32 or quantized) takes four optional inputs after its own:
//   a    float32 [S, K, G*R]  shrink factors of S adapter slots; G sub-projections (a fused qkv: 3), rank R
//   b    float32 [S, R, N]    expand factors, the adapter's scale already applied; output column n belongs
//                             to sub-projection g(n) and uses t[g*R .. g*R + R)
//   rows int32   [M]          adapter slot of each row; -1 = the base model (no delta: bit-identical)
//   segs int32   [G + 1]      column boundaries of the sub-projections (0 = segs[0] < ... < segs[G] = N)
// and after the base product y [M, N] computes, for every row m with slot s = rows[m] >= 0:
//   t = x[m] @ a[s]                      (acc = fma(x[m, k], a[s, k, j], acc) for k = 0..K-1)
//   y[m, n] += sum_j t[g(n)*R + j] * b[s, j, n]   (acc = fma(t[...], b[...], acc) for j = 0..R-1, then one add)
// Every element is computed by that fixed sequence whatever the other rows hold, the thread count or the
// batch size (the determinism contract of matmul.cc). Zero-padded ranks (an adapter of rank r < R) add
// exact zeros.
#pragma once

#include <cstdint>

namespace mindserve {

struct LoraArgs {
  const float *a = nullptr;
  const float *b = nullptr;
  const int32_t *rows = nullptr;
  const int32_t *segs = nullptr;
  int64_t slots = 0, groups = 0, rank = 0;
};

constexpr int kLoraInputs = 4;

// Check the four LoRA inputs at params[first .. first + 3] for a product x [M, K] -> y [M, N]; fills `out`.
// Returns 0, or an error code >= 20 (MindSpore then raises).
int lora_args(void **params, int *ndims, int64_t **shapes, const char **dtypes, int first, int64_t M, int64_t K,
              int64_t N, LoraArgs *out);

// y [M, N] += each row's delta (see above). Row-deterministic; uses the shared pool.
void lora_apply(const LoraArgs &l, const float *x, int64_t M, int64_t K, float *y, int64_t N);

}  // namespace mindserve
