// mindserve kernels: the KV cache's storage formats (the server config's kvCacheDtype) and the one way each
// cache row is written. Plain C++ on the bits: the same output on every CPU and build.
//
// A cache is [KV * S, width]: one row per (kv head, slot), D values each, in one of
//   f32   float32 [.., D]
//   f16   IEEE binary16 [.., D] (MindSpore float16)
//   bf16  bfloat16 [.., D] (MindSpore bfloat16)
//   q8_0  uint8 [.., ceil(D / 32) * 34]: llama.cpp's block_q8_0 per 32 values (the last block of a D that is not
//         a multiple of 32 zero-padded): an fp16 scale d, then 32 int8 q, value = float(q) * float(d).
// The format is the cache tensor's dtype; the attention kernel reads every format as float32 values (exact for
// f16 and bf16; q8_0 as float(q) * float(d), one rounding), so its arithmetic is the float32 one over those.
//
// Encoding (the writes of fused.cc's QKVAttention): f16 and bf16 round to nearest, ties to even (overflow to
// +-inf as IEEE says); q8_0: amax = max |x| of the block, d = amax / 127, q = round-half-even(x / d) in
// [-127, 127] (0 when d is 0), d stored as f16.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace mindserve::kv {

enum class Format : int { kF32 = 0, kF16 = 1, kBF16 = 2, kQ8_0 = 3 };

constexpr int64_t kMaxHeadDim = 512;  // the longest head the attention kernels take (their stack buffers)

constexpr int64_t kQ8Block = 32;       // values per q8_0 block
constexpr int64_t kQ8BlockBytes = 34;  // the fp16 scale and 32 int8

// Bytes of one cache row of D values.
inline int64_t row_bytes(Format f, int64_t D) {
  switch (f) {
    case Format::kF32: return 4 * D;
    case Format::kF16:
    case Format::kBF16: return 2 * D;
    case Format::kQ8_0: return (D + kQ8Block - 1) / kQ8Block * kQ8BlockBytes;
  }
  return 0;
}

// The format of a cache tensor from its MindSpore dtype and last dimension (D values, or q8_0's row bytes);
// false when they name none.
inline bool format_of(const char *dtype, int64_t width, int64_t D, Format *out) {
  Format f;
  if (std::strcmp(dtype, "float32") == 0 || std::strcmp(dtype, "float") == 0) f = Format::kF32;
  else if (std::strcmp(dtype, "float16") == 0) f = Format::kF16;
  else if (std::strcmp(dtype, "bfloat16") == 0) f = Format::kBF16;
  else if (std::strcmp(dtype, "uint8") == 0) f = Format::kQ8_0;
  else return false;
  const int64_t elem = f == Format::kF32 ? 4 : f == Format::kQ8_0 ? 1 : 2;
  if (width * elem != row_bytes(f, D)) return false;
  *out = f;
  return true;
}

inline uint32_t bits_of(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return x;
}
inline float float_of(uint32_t x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

// binary32 -> binary16, round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t f32_to_f16(float f) {
  const uint32_t x = bits_of(f), sign = (x >> 16) & 0x8000, ax = x & 0x7FFFFFFF;
  if (ax > 0x7F800000) return static_cast<uint16_t>(sign | 0x7E00 | ((ax >> 13) & 0x3FF));
  if (ax >= 0x477FF000) return static_cast<uint16_t>(sign | 0x7C00);  // >= 65520 rounds to infinity
  if (ax >= 0x38800000) {                                              // a normal binary16 (>= 2^-14)
    uint32_t m = ax - 0x38000000;                                      // the exponent rebiased (127 -> 15)
    m += 0xFFF + ((m >> 13) & 1);
    return static_cast<uint16_t>(sign | (m >> 13));
  }
  if (ax < 0x33000000) return static_cast<uint16_t>(sign);  // below 2^-25: zero (2^-25 itself ties to 0)
  // subnormal binary16: the value in units of 2^-24 is mant * 2^(e - 126), shift = 126 - e in [14, 24]
  const uint32_t e = ax >> 23, mant = (ax & 0x7FFFFF) | 0x800000, shift = 126 - e;
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1))) ++q;
  return static_cast<uint16_t>(sign | q);
}

// binary16 -> binary32, exact: the bits moved into place read as a float 2^-112 times the value (a subnormal
// float for a subnormal half), then one exact multiplication (builds keep subnormals: no fast-math).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, rest = h & 0x7FFFu;
  if (rest >= 0x7C00u) return float_of(sign | 0x7F800000u | ((rest & 0x3FF) << 13));  // inf, NaN
  return float_of(bits_of(float_of(rest << 13) * 0x1p112f) | sign);
}

// binary32 -> bfloat16, round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t x = bits_of(f);
  if ((x & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((x >> 16) | 0x40);
  return static_cast<uint16_t>((x + 0x7FFF + ((x >> 16) & 1)) >> 16);
}

// One q8_0 block of n <= 32 values (the rest of its 32 q zero).
inline void encode_q8_0(const float *x, int64_t n, uint8_t *dst) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  const uint16_t h = f32_to_f16(d);
  std::memcpy(dst, &h, 2);
  int8_t q[kQ8Block] = {};
  if (d != 0.0f)
    for (int64_t i = 0; i < n; ++i) {
      const float r = std::nearbyint(x[i] / d);  // the default rounding mode: ties to even
      q[i] = static_cast<int8_t>(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
  std::memcpy(dst + 2, q, kQ8Block);
}

// One cache row of D values in format f (f32 included).
inline void encode_row(Format f, const float *x, int64_t D, uint8_t *dst) {
  switch (f) {
    case Format::kF32:
      std::memcpy(dst, x, 4 * D);
      return;
    case Format::kF16:
      for (int64_t i = 0; i < D; ++i) {
        const uint16_t h = f32_to_f16(x[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    case Format::kBF16:
      for (int64_t i = 0; i < D; ++i) {
        const uint16_t h = f32_to_bf16(x[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    case Format::kQ8_0:
      for (int64_t b = 0; b * kQ8Block < D; ++b) {
        const int64_t n = D - b * kQ8Block < kQ8Block ? D - b * kQ8Block : kQ8Block;
        encode_q8_0(x + b * kQ8Block, n, dst + b * kQ8BlockBytes);
      }
      return;
  }
}

}  // namespace mindserve::kv
