// mindserve activation quantizers (quantize.cc): each float32 row of a quantized matmul's input turned into the
// int8 blocks its dot products take, as llama.cpp's quantize_row_q8_0 / q8_1 / q8_K do.
//
// The 32-weight formats take blocks of 32 (quantize_rows): amax = max |x_k|, qx_k = round-half-even(x_k * (127 /
// amax)) in -127..127 (0 if amax is 0 or 127 / amax is not finite), sx = sum qx_k, and, as llama.cpp's x86
// quantize_row_q8_0 / quantize_row_q8_1 store them in block_q8_0.d / block_q8_1.s (fp16, nearest, ties to even; the
// product taken before either rounding): dx = fp16(amax / 127), sfx = fp16((amax / 127) * (float)sx).
// The K-quants take Q8_K (quantize_rows_k): per 256 values iscale = 127 / amax, q = round-half-even(x * iscale),
// dx = 1 / iscale, and the sums of each 16 q (bsums). A row's quantization depends on that row only.
#pragma once

#include <cstdint>
#include <vector>

namespace mindserve {

// q [M, K] int8; d, sf [M, K/32] float (dx and sfx: fp16 values); s [M, K/32] int32 (sum q). Q8_K: d [M, K/256],
// s [M, K/16] (the bsums), nb = K/256, and bp [M, K/256, kPairs]: the bsums again as int16 pairs (low, high half of
// an int32) for vec.h's dot_i16, in the order the tiles' scale bytes come: 4 for Q4_K's / Q5_K's mins (bsum_2j +
// bsum_2j+1 for j = 0, 2 | 1, 3 | 4, 6 | 5, 7), then 8 for Q6_K's (-bsum_i for i = 4d, 4d + 2 | 4d + 1, 4d + 3,
// d = 0..3). |bsum| <= 16 * 127: they fit.
constexpr int kPairs = 12;
struct QX {
  std::vector<int8_t> q;
  std::vector<float> d, sf;
  std::vector<int32_t> s, bp;
  int64_t K = 0, nb = 0;
};

// x [M, K] (K a multiple of 32) in blocks of 32, on the pool.
void quantize_rows(const float *x, int64_t M, int64_t K, QX *out);
// x [M, K] (K a multiple of 256) as Q8_K, on the pool.
void quantize_rows_k(const float *x, int64_t M, int64_t K, QX *out);

}  // namespace mindserve
