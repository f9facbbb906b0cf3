// mindserve vector layer, AArch64 NEON backend (vec.h states the contract): four q registers per vector
// (v[0] = lanes 0..3, ..., v[3] = lanes 12..15). The int8 dot products use sdot with the dotprod extension
// (armv8.2-a+dotprod), else widening multiplies and pairwise adds that keep each lane's 4-byte grouping.
#pragma once

#include <arm_neon.h>

#include <cstdint>
#include <cstring>

namespace mindserve::vec {

#if defined(__ARM_FEATURE_DOTPROD)
constexpr const char *kIsa = "neon-dotprod";
#else
constexpr const char *kIsa = "neon";
#endif
constexpr int kMatMulRows = 2;  // fp32 tile rows: 2 x 12 q accumulators + the weights in 32 q registers
constexpr int kQRows = 2;
constexpr int kQRows2 = 1;
constexpr int kKRows2 = 0;  // no two-group K-quant tiles (not measured on an ARM core)
constexpr int kQRolledRows = 1 << 20;  // quantized tiles unroll their loop over a block's quant dwords
constexpr int kQ8Bias = 0;  // dot_q8 flips u = q + 128 back to the signed q: sum q * x directly

struct F32x16 {
  float32x4_t v[4];
};
struct I32x16 {
  int32x4_t v[4];
};

#define MINDSERVE_EACH(expr) \
  F32x16 r;                  \
  for (int i = 0; i < 4; ++i) r.v[i] = (expr); \
  return r

inline F32x16 zero() { MINDSERVE_EACH(vdupq_n_f32(0.0f)); }
inline F32x16 set1(float x) { MINDSERVE_EACH(vdupq_n_f32(x)); }
inline F32x16 load(const float *p) { MINDSERVE_EACH(vld1q_f32(p + 4 * i)); }
inline F32x16 load_part(const float *p, int n) {
  float buf[16] = {};
  std::memcpy(buf, p, sizeof(float) * n);
  return load(buf);
}
inline void store(float *p, F32x16 a) {
  for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, a.v[i]);
}
inline void store_part(float *p, F32x16 a, int n) {
  float buf[16];
  store(buf, a);
  std::memcpy(p, buf, sizeof(float) * n);
}
inline F32x16 add(F32x16 a, F32x16 b) { MINDSERVE_EACH(vaddq_f32(a.v[i], b.v[i])); }
inline F32x16 sub(F32x16 a, F32x16 b) { MINDSERVE_EACH(vsubq_f32(a.v[i], b.v[i])); }
inline F32x16 mul(F32x16 a, F32x16 b) { MINDSERVE_EACH(vmulq_f32(a.v[i], b.v[i])); }
inline F32x16 div(F32x16 a, F32x16 b) { MINDSERVE_EACH(vdivq_f32(a.v[i], b.v[i])); }
inline F32x16 fmadd(F32x16 a, F32x16 b, F32x16 c) { MINDSERVE_EACH(vfmaq_f32(c.v[i], a.v[i], b.v[i])); }
inline F32x16 fnmadd(F32x16 a, F32x16 b, F32x16 c) { MINDSERVE_EACH(vfmsq_f32(c.v[i], a.v[i], b.v[i])); }
inline F32x16 max(F32x16 a, F32x16 b) { MINDSERVE_EACH(vmaxq_f32(a.v[i], b.v[i])); }
inline F32x16 abs(F32x16 a) { MINDSERVE_EACH(vabsq_f32(a.v[i])); }
inline F32x16 select_neg(F32x16 g, F32x16 a, F32x16 b) {
  MINDSERVE_EACH(vbslq_f32(vcltq_f32(g.v[i], vdupq_n_f32(0.0f)), a.v[i], b.v[i]));
}
inline uint32x4_t below(int n, int i) {
  const int32_t idx[4] = {4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3};
  return vcltq_s32(vld1q_s32(idx), vdupq_n_s32(n));
}
inline F32x16 keep_first(F32x16 a, int n) {
  MINDSERVE_EACH(vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(a.v[i]), below(n, i))));
}
inline F32x16 fill_tail(F32x16 a, int n, float f) { MINDSERVE_EACH(vbslq_f32(below(n, i), a.v[i], vdupq_n_f32(f))); }
inline F32x16 round_even(F32x16 a) { MINDSERVE_EACH(vrndnq_f32(a.v[i])); }
inline float32x4_t pow2(float32x4_t k) {  // 2^k, integral k in [-126, 127]
  return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(k), vdupq_n_s32(127)), 23));
}
// p * 2^n in one rounding (see vec_avx2.h): the exact step to 2^max(n, -125), then the rest.
inline F32x16 ldexp(F32x16 p, F32x16 n) {
  F32x16 r;
  for (int i = 0; i < 4; ++i) {
    const float32x4_t n1 = vmaxq_f32(n.v[i], vdupq_n_f32(-125.0f));
    r.v[i] = vmulq_f32(vmulq_f32(p.v[i], pow2(n1)), pow2(vsubq_f32(n.v[i], n1)));
  }
  return r;
}
inline float reduce_add(F32x16 a) {  // (0..3 + 8..11) + (4..7 + 12..15), then i + i+2, then 0 + 1
  const float32x4_t t = vaddq_f32(vaddq_f32(a.v[0], a.v[2]), vaddq_f32(a.v[1], a.v[3]));
  const float32x2_t u = vadd_f32(vget_low_f32(t), vget_high_f32(t));
  return vget_lane_f32(u, 0) + vget_lane_f32(u, 1);
}
inline float reduce_max(F32x16 a) {
  return vmaxvq_f32(vmaxq_f32(vmaxq_f32(a.v[0], a.v[1]), vmaxq_f32(a.v[2], a.v[3])));
}
inline F32x16 load_f16(const uint8_t *p) {
  MINDSERVE_EACH(vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t *>(p) + 4 * i))));
}
inline void store_f16(uint8_t *p, F32x16 x) {  // FPCR's rounding: to nearest even (fpenv.h)
  for (int i = 0; i < 4; ++i)
    vst1_u16(reinterpret_cast<uint16_t *>(p) + 4 * i, vreinterpret_u16_f16(vcvt_f16_f32(x.v[i])));
}
inline F32x16 load_f16_part(const uint8_t *p, int n) {
  uint8_t buf[32] = {};
  std::memcpy(buf, p, 2 * n);
  return load_f16(buf);
}
#undef MINDSERVE_EACH

#define MINDSERVE_EACH(expr) \
  I32x16 r;                  \
  for (int i = 0; i < 4; ++i) r.v[i] = (expr); \
  return r

inline I32x16 izero() { MINDSERVE_EACH(vdupq_n_s32(0)); }
inline I32x16 load_bytes(const uint8_t *p) { MINDSERVE_EACH(vreinterpretq_s32_u8(vld1q_u8(p + 16 * i))); }
inline I32x16 load_bytes_part(const uint8_t *p, int lanes) {
  uint8_t buf[64] = {};
  std::memcpy(buf, p, 4 * lanes);
  return load_bytes(buf);
}
inline I32x16 bcast4(const int8_t *p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  MINDSERVE_EACH(vdupq_n_s32(v));
}
inline I32x16 nib_lo(I32x16 a) { MINDSERVE_EACH(vandq_s32(a.v[i], vdupq_n_s32(0x0F0F0F0F))); }
inline I32x16 nib_hi(I32x16 a) {
  MINDSERVE_EACH(vreinterpretq_s32_u8(vshrq_n_u8(vreinterpretq_u8_s32(a.v[i]), 4)));
}
// acc + per lane sum of its 4 signed bytes of u times those of x.
inline int32x4_t sdot4(int32x4_t acc, int8x16_t u, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, u, x);
#else
  const int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(u), vget_low_s8(x)));    // byte pairs of lanes 0, 1
  const int32x4_t hi = vpaddlq_s16(vmull_high_s8(u, x));                          // ... of lanes 2, 3
  return vaddq_s32(acc, vpaddq_s32(lo, hi));
#endif
}
inline I32x16 dot_nib(I32x16 acc, I32x16 u, I32x16 x) {  // u <= 15 is the same as a signed byte
  MINDSERVE_EACH(sdot4(acc.v[i], vreinterpretq_s8_s32(u.v[i]), vreinterpretq_s8_s32(x.v[i])));
}
inline I32x16 dot_q8(I32x16 acc, I32x16 u, I32x16 x) {  // u = q + 128: u ^ 0x80 is q again
  MINDSERVE_EACH(sdot4(acc.v[i], veorq_s8(vreinterpretq_s8_s32(u.v[i]), vdupq_n_s8(-128)),
                       vreinterpretq_s8_s32(x.v[i])));
}
inline I32x16 isub(I32x16 a, int32_t c) { MINDSERVE_EACH(vsubq_s32(a.v[i], vdupq_n_s32(c))); }
inline I32x16 iadd(I32x16 a, I32x16 b) { MINDSERVE_EACH(vaddq_s32(a.v[i], b.v[i])); }
// The bit fields of the 5- and 6-bit formats (vec.h): per byte (b << s) & m, (b >> s) & m, a | b; sign-extended
// byte k of each lane; int32 lane products (low 32 bits); an int32 broadcast.
inline I32x16 shl_and(I32x16 a, int s, uint8_t m) {
  MINDSERVE_EACH(vreinterpretq_s32_u8(vandq_u8(vshlq_u8(vreinterpretq_u8_s32(a.v[i]), vdupq_n_s8(static_cast<int8_t>(s))),
                                               vdupq_n_u8(m))));
}
inline I32x16 shr_and(I32x16 a, int s, uint8_t m) {
  MINDSERVE_EACH(vreinterpretq_s32_u8(vandq_u8(vshlq_u8(vreinterpretq_u8_s32(a.v[i]), vdupq_n_s8(static_cast<int8_t>(-s))),
                                               vdupq_n_u8(m))));
}
inline I32x16 bor(I32x16 a, I32x16 b) { MINDSERVE_EACH(vorrq_s32(a.v[i], b.v[i])); }
inline I32x16 lane_i8(I32x16 a, int k) { MINDSERVE_EACH(vshrq_n_s32(vshlq_s32(a.v[i], vdupq_n_s32(24 - 8 * k)), 24)); }
inline I32x16 imul(I32x16 a, I32x16 b) { MINDSERVE_EACH(vmulq_s32(a.v[i], b.v[i])); }
inline I32x16 iset1(int32_t c) { MINDSERVE_EACH(vdupq_n_s32(c)); }
// The K-quants' min and bsum terms as int16 pair products (vec.h): pairs_u8 (k 0 or 1) the bytes k and k + 2 of each
// lane zero-extended into its low and high int16, pairs_i8x32 the same sign-extended times 32; dot_i16 acc + lo(a) *
// lo(b) + hi(a) * hi(b), the int16 halves signed.
inline I32x16 pairs_u8(I32x16 a, int k) {
  if (k == 0) {
    MINDSERVE_EACH(vandq_s32(a.v[i], vdupq_n_s32(0x00FF00FF)));
  }
  MINDSERVE_EACH(vreinterpretq_s32_u16(vshrq_n_u16(vreinterpretq_u16_s32(a.v[i]), 8)));
}
inline I32x16 pairs_i8x32(I32x16 a, int k) {
  if (k == 0) {
    MINDSERVE_EACH(vreinterpretq_s32_s16(vshrq_n_s16(vshlq_n_s16(vreinterpretq_s16_s32(a.v[i]), 8), 3)));
  }
  MINDSERVE_EACH(vreinterpretq_s32_s16(vshrq_n_s16(vandq_s16(vreinterpretq_s16_s32(a.v[i]), vdupq_n_s16(-256)), 3)));
}
inline I32x16 dot_i16(I32x16 acc, I32x16 a, I32x16 b) {
  MINDSERVE_EACH(vmlaq_s32(vmlaq_s32(acc.v[i], vshrq_n_s32(vshlq_n_s32(a.v[i], 16), 16), vshrq_n_s32(vshlq_n_s32(b.v[i], 16), 16)),
                           vshrq_n_s32(a.v[i], 16), vshrq_n_s32(b.v[i], 16)));
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
inline I32x16 cvt_round(F32x16 a) { MINDSERVE_EACH(vcvtnq_s32_f32(a.v[i])); }
#undef MINDSERVE_EACH
inline F32x16 to_f(I32x16 a) {
  F32x16 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vcvtq_f32_s32(a.v[i]);
  return r;
}
inline void store_i8_sat(int8_t *p, I32x16 a) {
  const int16x8_t lo = vcombine_s16(vqmovn_s32(a.v[0]), vqmovn_s32(a.v[1]));
  const int16x8_t hi = vcombine_s16(vqmovn_s32(a.v[2]), vqmovn_s32(a.v[3]));
  vst1q_s8(p, vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi)));
}
inline int32_t reduce_add_i32(I32x16 a) {
  return vaddvq_s32(vaddq_s32(vaddq_s32(a.v[0], a.v[1]), vaddq_s32(a.v[2], a.v[3])));
}

inline void cpu_relax() { asm volatile("yield" ::: "memory"); }

// --- KV cache formats (kv_format.h): exact conversions to float32, for attention.cc ---------------
// 16 int8 -> float32.
inline F32x16 load_i8(const int8_t *p) {
  const int8x16_t b = vld1q_s8(p);
  const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_high_s8(b);
  F32x16 r;
  r.v[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
  r.v[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
  r.v[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
  r.v[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
  return r;
}
// 16 bfloat16 (their bits are a float32's upper half) -> float32; _part: lanes [0, n), the rest +0.0.
inline F32x16 load_bf16(const uint8_t *p) {
  F32x16 r;
  for (int i = 0; i < 4; ++i)
    r.v[i] = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t *>(p) + 4 * i), 16));
  return r;
}
inline F32x16 load_bf16_part(const uint8_t *p, int n) {
  uint8_t buf[32] = {};
  std::memcpy(buf, p, 2 * n);
  return load_bf16(buf);
}

}  // namespace mindserve::vec
