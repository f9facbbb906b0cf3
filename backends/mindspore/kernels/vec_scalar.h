// mindserve vector layer, portable scalar backend (vec.h states the contract): plain arrays of 16 lanes,
// one C++ operation per lane (std::fma for the fused ones). It runs on any CPU, and it is the readable
// statement of what every other backend computes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kv_format.h"

namespace mindserve::vec {

constexpr const char *kIsa = "scalar";
constexpr int kMatMulRows = 2;
constexpr int kQRows = 2;
constexpr int kQRows2 = 1;
constexpr int kKRows2 = 0;  // no two-group K-quant tiles
constexpr int kQRolledRows = 1 << 20;  // quantized tiles unroll their loop over a block's quant dwords
constexpr int kQ8Bias = 128;

struct F32x16 {
  float v[16];
};
struct I32x16 {
  int32_t v[16];
};

#define MINDSERVE_EACH(T, expr) \
  T r;                          \
  for (int i = 0; i < 16; ++i) r.v[i] = (expr); \
  return r

inline F32x16 zero() { MINDSERVE_EACH(F32x16, 0.0f); }
inline F32x16 set1(float x) { MINDSERVE_EACH(F32x16, x); }
inline F32x16 load(const float *p) { MINDSERVE_EACH(F32x16, p[i]); }
inline F32x16 load_part(const float *p, int n) { MINDSERVE_EACH(F32x16, i < n ? p[i] : 0.0f); }
inline void store(float *p, F32x16 a) { std::memcpy(p, a.v, sizeof a.v); }
inline void store_part(float *p, F32x16 a, int n) { std::memcpy(p, a.v, sizeof(float) * n); }
inline F32x16 add(F32x16 a, F32x16 b) { MINDSERVE_EACH(F32x16, a.v[i] + b.v[i]); }
inline F32x16 sub(F32x16 a, F32x16 b) { MINDSERVE_EACH(F32x16, a.v[i] - b.v[i]); }
inline F32x16 mul(F32x16 a, F32x16 b) { MINDSERVE_EACH(F32x16, a.v[i] * b.v[i]); }
inline F32x16 div(F32x16 a, F32x16 b) { MINDSERVE_EACH(F32x16, a.v[i] / b.v[i]); }
inline F32x16 fmadd(F32x16 a, F32x16 b, F32x16 c) { MINDSERVE_EACH(F32x16, std::fma(a.v[i], b.v[i], c.v[i])); }
inline F32x16 fnmadd(F32x16 a, F32x16 b, F32x16 c) { MINDSERVE_EACH(F32x16, std::fma(-a.v[i], b.v[i], c.v[i])); }
inline F32x16 max(F32x16 a, F32x16 b) { MINDSERVE_EACH(F32x16, a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
inline F32x16 abs(F32x16 a) { MINDSERVE_EACH(F32x16, std::fabs(a.v[i])); }
inline F32x16 select_neg(F32x16 g, F32x16 a, F32x16 b) { MINDSERVE_EACH(F32x16, g.v[i] < 0.0f ? a.v[i] : b.v[i]); }
inline F32x16 keep_first(F32x16 a, int n) { MINDSERVE_EACH(F32x16, i < n ? a.v[i] : 0.0f); }
inline F32x16 fill_tail(F32x16 a, int n, float f) { MINDSERVE_EACH(F32x16, i < n ? a.v[i] : f); }
inline F32x16 round_even(F32x16 a) { MINDSERVE_EACH(F32x16, std::nearbyint(a.v[i])); }  // default mode: ties even
// p * 2^n in one rounding (see vec_avx2.h): the exact step to 2^max(n, -125), then the rest.
inline F32x16 ldexp(F32x16 p, F32x16 n) {
  F32x16 r;
  for (int i = 0; i < 16; ++i) {
    const int k = static_cast<int>(n.v[i]), k1 = std::max(k, -125);
    r.v[i] = std::ldexp(std::ldexp(p.v[i], k1), k - k1);
  }
  return r;
}
inline float reduce_add(F32x16 a) {
  float h[8], q[4];
  for (int i = 0; i < 8; ++i) h[i] = a.v[i] + a.v[i + 8];
  for (int i = 0; i < 4; ++i) q[i] = h[i] + h[i + 4];
  return (q[0] + q[2]) + (q[1] + q[3]);
}
inline float reduce_max(F32x16 a) {
  float m = a.v[0];
  for (int i = 1; i < 16; ++i) m = a.v[i] > m ? a.v[i] : m;
  return m;
}
inline F32x16 load_f16(const uint8_t *p) {
  F32x16 r;
  for (int i = 0; i < 16; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    r.v[i] = kv::f16_to_f32(h);  // exact (subnormals, inf, NaN)
  }
  return r;
}
inline void store_f16(uint8_t *p, F32x16 x) {
  for (int i = 0; i < 16; ++i) {
    const uint16_t h = kv::f32_to_f16(x.v[i]);
    std::memcpy(p + 2 * i, &h, 2);
  }
}
inline F32x16 load_f16_part(const uint8_t *p, int n) {
  uint8_t buf[32] = {};
  std::memcpy(buf, p, 2 * n);
  return load_f16(buf);
}

inline I32x16 izero() { MINDSERVE_EACH(I32x16, 0); }
inline I32x16 load_bytes(const uint8_t *p) {
  I32x16 r;
  std::memcpy(r.v, p, 64);
  return r;
}
inline I32x16 load_bytes_part(const uint8_t *p, int lanes) {
  I32x16 r = izero();
  std::memcpy(r.v, p, 4 * lanes);
  return r;
}
inline I32x16 bcast4(const int8_t *p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  MINDSERVE_EACH(I32x16, v);
}
inline I32x16 nib_lo(I32x16 a) { MINDSERVE_EACH(I32x16, a.v[i] & 0x0F0F0F0F); }
inline I32x16 nib_hi(I32x16 a) {
  MINDSERVE_EACH(I32x16, static_cast<int32_t>((static_cast<uint32_t>(a.v[i]) >> 4) & 0x0F0F0F0Fu));
}
inline int32_t dot4(int32_t u, int32_t x, bool u_unsigned) {
  uint8_t ub[4];
  int8_t xb[4];
  std::memcpy(ub, &u, 4);
  std::memcpy(xb, &x, 4);
  int32_t s = 0;
  for (int b = 0; b < 4; ++b) s += (u_unsigned ? int32_t{ub[b]} : int32_t{static_cast<int8_t>(ub[b])}) * xb[b];
  return s;
}
inline I32x16 dot_nib(I32x16 acc, I32x16 u, I32x16 x) { MINDSERVE_EACH(I32x16, acc.v[i] + dot4(u.v[i], x.v[i], true)); }
inline I32x16 dot_q8(I32x16 acc, I32x16 u, I32x16 x) { MINDSERVE_EACH(I32x16, acc.v[i] + dot4(u.v[i], x.v[i], true)); }
inline I32x16 isub(I32x16 a, int32_t c) { MINDSERVE_EACH(I32x16, a.v[i] - c); }
inline I32x16 iadd(I32x16 a, I32x16 b) { MINDSERVE_EACH(I32x16, a.v[i] + b.v[i]); }
// The bit fields of the 5- and 6-bit formats (vec.h): per byte (b << s) & m, (b >> s) & m, a | b; sign-extended
// byte k of each lane; int32 lane products (low 32 bits); an int32 broadcast.
inline I32x16 shl_and(I32x16 a, int s, uint8_t m) {
  MINDSERVE_EACH(I32x16, static_cast<int32_t>((static_cast<uint32_t>(a.v[i]) << s) & (m * 0x01010101u)));
}
inline I32x16 shr_and(I32x16 a, int s, uint8_t m) {
  MINDSERVE_EACH(I32x16, static_cast<int32_t>((static_cast<uint32_t>(a.v[i]) >> s) & (m * 0x01010101u)));
}
inline I32x16 bor(I32x16 a, I32x16 b) { MINDSERVE_EACH(I32x16, a.v[i] | b.v[i]); }
inline I32x16 lane_i8(I32x16 a, int k) {
  MINDSERVE_EACH(I32x16, static_cast<int32_t>(static_cast<int8_t>(static_cast<uint32_t>(a.v[i]) >> (8 * k))));
}
inline I32x16 imul(I32x16 a, I32x16 b) {
  MINDSERVE_EACH(I32x16, static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) * static_cast<uint32_t>(b.v[i])));
}
inline I32x16 iset1(int32_t c) { MINDSERVE_EACH(I32x16, c); }
// The K-quants' min and bsum terms as int16 pair products (vec.h): pairs_u8 (k 0 or 1) the bytes k and k + 2 of each
// lane zero-extended into its low and high int16, pairs_i8x32 the same sign-extended times 32; dot_i16 acc + lo(a) *
// lo(b) + hi(a) * hi(b), the int16 halves signed.
inline int32_t half_i16(int32_t a, int h) { return static_cast<int16_t>(static_cast<uint32_t>(a) >> (16 * h)); }
inline I32x16 pairs_u8(I32x16 a, int k) {
  MINDSERVE_EACH(I32x16, static_cast<int32_t>((static_cast<uint32_t>(a.v[i]) >> (8 * k)) & 0x00FF00FFu));
}
inline I32x16 pairs_i8x32(I32x16 a, int k) {
  MINDSERVE_EACH(I32x16, static_cast<int32_t>(
                             (static_cast<uint32_t>(32 * static_cast<int8_t>(static_cast<uint32_t>(a.v[i]) >> (8 * k))) & 0xFFFFu) |
                             (static_cast<uint32_t>(32 * static_cast<int8_t>(static_cast<uint32_t>(a.v[i]) >> (8 * k + 16))) << 16)));
}
inline I32x16 dot_i16(I32x16 acc, I32x16 a, I32x16 b) {
  MINDSERVE_EACH(I32x16, static_cast<int32_t>(static_cast<uint32_t>(acc.v[i]) +
                                              static_cast<uint32_t>(int64_t{half_i16(a.v[i], 0)} * half_i16(b.v[i], 0) +
                                                                    int64_t{half_i16(a.v[i], 1)} * half_i16(b.v[i], 1))));
}
// Up to 8 nibble dot products before one widening (vec.h): here they sum in int32 directly.
using NibAcc = I32x16;
inline NibAcc nib_zero() { return izero(); }
inline NibAcc nib_add(NibAcc acc, I32x16 u, I32x16 x) { return dot_nib(acc, u, x); }
inline I32x16 nib_widen(I32x16 acc, NibAcc n) { return iadd(acc, n); }
// kNibI32: NibAcc is int32 already (no run limit); nib_widen_scaled(acc, n, sc) acc + sc * (the sums), exact for
// the K-quants' scales.
constexpr bool kNibI32 = true;
constexpr bool kScaledWiden = true;  // the K-quant tiles take the scales as the sums widen
constexpr bool kTwoPasses = false;  // the 5- and 6-bit quants' sub-blocks in one pass (qtile.h)
using NibScale = I32x16;
inline NibScale nib_scale(I32x16 a, int k) { return lane_i8(a, k); }
inline I32x16 nib_widen_scaled(I32x16 acc, NibAcc n, I32x16 sc) { return iadd(acc, imul(n, sc)); }
inline I32x16 cvt_round(F32x16 a) { MINDSERVE_EACH(I32x16, static_cast<int32_t>(std::nearbyint(a.v[i]))); }
inline F32x16 to_f(I32x16 a) { MINDSERVE_EACH(F32x16, static_cast<float>(a.v[i])); }
#undef MINDSERVE_EACH
inline void store_i8_sat(int8_t *p, I32x16 a) {
  for (int i = 0; i < 16; ++i) p[i] = static_cast<int8_t>(std::clamp<int32_t>(a.v[i], -128, 127));
}
inline int32_t reduce_add_i32(I32x16 a) {
  int32_t s = 0;
  for (int i = 0; i < 16; ++i) s += a.v[i];
  return s;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// --- KV cache formats (kv_format.h): exact conversions to float32, for attention.cc ---------------
// 16 int8 -> float32.
inline F32x16 load_i8(const int8_t *p) {
  F32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
// 16 bfloat16 (their bits are a float32's upper half) -> float32; _part: lanes [0, n), the rest +0.0.
inline F32x16 load_bf16(const uint8_t *p) {
  F32x16 r;
  for (int i = 0; i < 16; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    std::memcpy(&r.v[i], &bits, 4);
  }
  return r;
}
inline F32x16 load_bf16_part(const uint8_t *p, int n) {
  uint8_t buf[32] = {};
  std::memcpy(buf, p, 2 * n);
  return load_bf16(buf);
}

}  // namespace mindserve::vec
