// mindserve activation quantizers (quantize.h says what they compute), on vec.h's 16 lanes, and their test entries.
#include "quantize.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "fpenv.h"
#include "kv_format.h"
#include "pool.h"
#include "vec.h"

namespace mindserve {
namespace {

namespace v = vec;
using VI = v::I32x16;
using VF = v::F32x16;

// float -> the nearest fp16 (ties to even, +-inf at or above 65520, as F16C's vcvtps2ph) -> float, in integer
// steps on the bits (the same on every ISA). In fp16's normal range the float keeps 11 significant bits,
// rounded as kv_format.h's f32_to_f16 rounds (a carry moves into the exponent); zero, fp16 subnormals,
// overflow and NaN take kv_format.h's conversions (they would cost a quarter of quantize_rows on every value).
inline float round_f16(float f) {
  const uint32_t x = kv::bits_of(f), ax = x & 0x7FFFFFFFu;
  if (ax - 0x38800000u < 0x477FF000u - 0x38800000u) {  // 2^-14 <= |f| < 65520
    const uint32_t r = (ax + 0xFFFu + ((ax >> 13) & 1u)) & ~0x1FFFu;
    return kv::float_of((x & 0x80000000u) | r);
  }
  return kv::f16_to_f32(kv::f32_to_f16(f));
}

// 127 / amax, or 0 where that is not finite (amax 0, or below 127 / FLT_MAX): x * id never overflows, so every
// ISA's float -> int conversion sees the same in-range values.
inline float inverse_scale(float amax) {
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  return id <= 3.40282347e38f ? id : 0.0f;
}

inline void quantize_block(const float *x, int8_t *q, float *d, int32_t *s, float *sf) {
  const VF v0 = v::load(x), v1 = v::load(x + 16);
  const float amax = v::reduce_max(v::max(v::abs(v0), v::abs(v1)));
  const VF vid = v::set1(inverse_scale(amax));
  const VI q0 = v::cvt_round(v::mul(v0, vid)), q1 = v::cvt_round(v::mul(v1, vid));
  v::store_i8_sat(q, q0);
  v::store_i8_sat(q + 16, q1);
  const int32_t sum = v::reduce_add_i32(v::iadd(q0, q1));
  const float dv = amax / 127.0f;
  *d = round_f16(dv);
  *s = sum;
  *sf = round_f16(dv * static_cast<float>(sum));
}

inline int32_t pair16(int32_t lo, int32_t hi) {
  return static_cast<int32_t>((static_cast<uint32_t>(lo) & 0xFFFFu) | (static_cast<uint32_t>(hi) << 16));
}

// Q8_K, ggml's quantize_row_q8_K (which takes iscale = -127 / the signed extreme: the same |iscale|, and the negated
// q and d give the same products).
inline void quantize_superblock(const float *x, int8_t *q, float *d, int32_t *bs, int32_t *bp) {
  VF m = v::abs(v::load(x));
  for (int c = 1; c < 16; ++c) m = v::max(m, v::abs(v::load(x + 16 * c)));
  const float id = inverse_scale(v::reduce_max(m));
  const VF vid = v::set1(id);
  for (int c = 0; c < 16; ++c) {
    const VI qc = v::cvt_round(v::mul(v::load(x + 16 * c), vid));
    v::store_i8_sat(q + 16 * c, qc);
    bs[c] = v::reduce_add_i32(qc);
  }
  *d = id != 0.0f ? 1.0f / id : 0.0f;
  int32_t p[8];
  for (int j = 0; j < 8; ++j) p[j] = bs[2 * j] + bs[2 * j + 1];
  for (int h = 0; h < 2; ++h) {
    bp[2 * h] = pair16(p[4 * h], p[4 * h + 2]);
    bp[2 * h + 1] = pair16(p[4 * h + 1], p[4 * h + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    bp[4 + 2 * c] = pair16(-bs[4 * c], -bs[4 * c + 2]);
    bp[5 + 2 * c] = pair16(-bs[4 * c + 1], -bs[4 * c + 3]);
  }
}

// Rows of x [M, K] on the pool, about 8192 values a chunk.
template <class Fn>
void rows_on_pool(int64_t M, int64_t K, const Fn &fn) {
  for_row_chunks(M, std::clamp<int64_t>(M * K / 8192, 1, 4 * pool().threads()), fn);
}

}  // namespace

void quantize_rows(const float *x, int64_t M, int64_t K, QX *out) {
  const int64_t nb = K / 32;
  out->K = K;
  out->nb = nb;
  out->q.resize(static_cast<size_t>(M * K));
  out->d.resize(static_cast<size_t>(M * nb));
  out->sf.resize(static_cast<size_t>(M * nb));
  out->s.resize(static_cast<size_t>(M * nb));
  rows_on_pool(M, K, [x, out, K, nb](int64_t m) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i = m * nb + b;
      quantize_block(x + m * K + 32 * b, out->q.data() + m * K + 32 * b, &out->d[i], &out->s[i], &out->sf[i]);
    }
  });
}

void quantize_rows_k(const float *x, int64_t M, int64_t K, QX *out) {
  const int64_t nb = K / 256;
  out->K = K;
  out->nb = nb;
  out->q.resize(static_cast<size_t>(M * K));
  out->d.resize(static_cast<size_t>(M * nb));
  out->s.resize(static_cast<size_t>(M * nb * 16));
  out->bp.resize(static_cast<size_t>(M * nb * kPairs));
  out->sf.clear();
  rows_on_pool(M, K, [x, out, K, nb](int64_t m) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i = m * nb + b;
      quantize_superblock(x + m * K + 256 * b, out->q.data() + m * K + 256 * b, &out->d[i], &out->s[16 * i],
                          &out->bp[kPairs * i]);
    }
  });
}

}  // namespace mindserve

extern "C" {

// The activation quantization alone: q [M, K] int8, d [M, K/32] float (dx, an fp16 value), s [M, K/32] int32.
int mindserve_quantize_rows_raw(const float *x, int64_t M, int64_t K, int8_t *q, float *d, int32_t *s) {
  mindserve::FpScope fp;
  if (K % 32 != 0) return 2;
  mindserve::QX qx;
  mindserve::quantize_rows(x, M, K, &qx);
  std::memcpy(q, qx.q.data(), qx.q.size());
  std::memcpy(d, qx.d.data(), sizeof(float) * qx.d.size());
  std::memcpy(s, qx.s.data(), sizeof(int32_t) * qx.s.size());
  return 0;
}

// The K-quants' activation quantization alone: q [M, K] int8, d [M, K/256] float, bsums [M, K/16] int32.
int mindserve_quantize_rows_k_raw(const float *x, int64_t M, int64_t K, int8_t *q, float *d, int32_t *bs) {
  mindserve::FpScope fp;
  if (K % 256 != 0) return 2;
  mindserve::QX qx;
  mindserve::quantize_rows_k(x, M, K, &qx);
  std::memcpy(q, qx.q.data(), qx.q.size());
  std::memcpy(d, qx.d.data(), sizeof(float) * qx.d.size());
  std::memcpy(bs, qx.s.data(), sizeof(int32_t) * qx.s.size());
  return 0;
}

}  // extern "C"
