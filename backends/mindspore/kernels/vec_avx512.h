// mindserve vector layer, AVX-512 backend (vec.h states the contract): one zmm per vector.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace mindserve::vec {

#if defined(__AVX512VNNI__)
constexpr const char *kIsa = "avx512-vnni";
#else
constexpr const char *kIsa = "avx512bw";
#endif
constexpr int kMatMulRows = 8;  // fp32 tile rows: 8 x 3 accumulators + 3 weights + a broadcast in 32 zmm
constexpr int kQRows = 8;       // quantized tile rows, one group of 16 columns
#if defined(__AVX512VNNI__)
constexpr int kQRows2 = 6;      // ... two groups
constexpr int kKRows2 = 4;  // ... two groups of a K-quant (4 rows: the best of 3, 4 and 6 against one group of 8)
#else
constexpr int kQRows2 = 0;      // AVX-512BW: no two-group tiles (one group is faster)
constexpr int kKRows2 = 0;
#endif
constexpr int kQRolledRows = 1 << 20;  // quantized tiles unroll their loop over a block's quant dwords
#if defined(__AVX512VNNI__)
constexpr int kQ8Bias = 128;  // dot_q8 sums u * x with u = q + 128 (vpdpbusd is unsigned x signed)
#else
constexpr int kQ8Bias = 0;  // dot_q8 flips u = q + 128 back to the signed q: sum q * x directly
#endif

struct F32x16 {
  __m512 v;
};
struct I32x16 {
  __m512i v;
};

inline __mmask16 first(int n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : ((1u << n) - 1)); }

inline F32x16 zero() { return {_mm512_setzero_ps()}; }
inline F32x16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline F32x16 load(const float *p) { return {_mm512_loadu_ps(p)}; }
inline F32x16 load_part(const float *p, int n) { return {_mm512_maskz_loadu_ps(first(n), p)}; }
inline void store(float *p, F32x16 a) { _mm512_storeu_ps(p, a.v); }
inline void store_part(float *p, F32x16 a, int n) { _mm512_mask_storeu_ps(p, first(n), a.v); }
inline F32x16 add(F32x16 a, F32x16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F32x16 sub(F32x16 a, F32x16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F32x16 mul(F32x16 a, F32x16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F32x16 div(F32x16 a, F32x16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F32x16 fmadd(F32x16 a, F32x16 b, F32x16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F32x16 fnmadd(F32x16 a, F32x16 b, F32x16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline F32x16 max(F32x16 a, F32x16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F32x16 abs(F32x16 a) { return {_mm512_abs_ps(a.v)}; }
// g < 0 ? a : b, lane by lane.
inline F32x16 select_neg(F32x16 g, F32x16 a, F32x16 b) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(g.v, _mm512_setzero_ps(), _CMP_LT_OQ), b.v, a.v)};
}
inline F32x16 keep_first(F32x16 a, int n) { return {_mm512_maskz_mov_ps(first(n), a.v)}; }
inline F32x16 fill_tail(F32x16 a, int n, float f) { return {_mm512_mask_mov_ps(_mm512_set1_ps(f), first(n), a.v)}; }
inline F32x16 round_even(F32x16 a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline F32x16 ldexp(F32x16 p, F32x16 n) { return {_mm512_scalef_ps(p.v, n.v)}; }
inline float reduce_add(F32x16 a) {  // the fixed tree, spelled out
  const __m256 h = _mm256_add_ps(_mm512_extractf32x8_ps(a.v, 1), _mm512_extractf32x8_ps(a.v, 0));
  const __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}
inline float reduce_max(F32x16 a) { return _mm512_reduce_max_ps(a.v); }
inline F32x16 load_f16(const uint8_t *p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)))};
}
inline void store_f16(uint8_t *p, F32x16 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline F32x16 load_f16_part(const uint8_t *p, int n) { return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first(n), p))}; }

inline I32x16 izero() { return {_mm512_setzero_si512()}; }
inline I32x16 load_bytes(const uint8_t *p) { return {_mm512_loadu_si512(p)}; }
inline I32x16 load_bytes_part(const uint8_t *p, int lanes) { return {_mm512_maskz_loadu_epi32(first(lanes), p)}; }
inline I32x16 bcast4(const int8_t *p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return {_mm512_set1_epi32(v)};
}
inline I32x16 nib_lo(I32x16 a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(0x0F))}; }
inline I32x16 nib_hi(I32x16 a) { return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(0x0F))}; }
// acc + per lane sum of its 4 bytes of u (unsigned, <= 15) times those of x (signed, -127..127).
inline I32x16 dot_nib(I32x16 acc, I32x16 u, I32x16 x) {
#if defined(__AVX512VNNI__)
  return {_mm512_dpbusd_epi32(acc.v, u.v, x.v)};
#else
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(_mm512_maddubs_epi16(u.v, x.v), _mm512_set1_epi16(1)))};
#endif
}
// The same for u = q + 128 of 0..255: vpdpbusd sums u * x (kQ8Bias 128 takes 128 * sum x off later); without
// VNNI, q = u ^ 0x80 and q * x = |q| * (x with q's sign), whose pair sums fit vpmaddubsw's int16 (kQ8Bias 0).
inline I32x16 dot_q8(I32x16 acc, I32x16 u, I32x16 x) {
#if defined(__AVX512VNNI__)
  return {_mm512_dpbusd_epi32(acc.v, u.v, x.v)};
#else
  const __m512i q = _mm512_xor_si512(u.v, _mm512_set1_epi8(static_cast<char>(0x80)));
  const __m512i sx = _mm512_mask_sub_epi8(x.v, _mm512_movepi8_mask(q), _mm512_setzero_si512(), x.v);
  const __m512i pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(q), sx);
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
#endif
}
// Up to 8 nibble dot products before one widening (vec.h): VNNI sums in int32 directly; vpmaddubsw's int16 pair
// sums (at most 2 * 15 * 127 each, so 8 fit) are widened once.
#if defined(__AVX512VNNI__)
using NibAcc = I32x16;
inline NibAcc nib_zero() { return {_mm512_setzero_si512()}; }
inline NibAcc nib_add(NibAcc acc, I32x16 u, I32x16 x) { return dot_nib(acc, u, x); }
inline I32x16 nib_widen(I32x16 acc, NibAcc n) { return {_mm512_add_epi32(acc.v, n.v)}; }
// kNibI32: NibAcc is int32 already (no run limit); nib_widen_scaled(acc, n, sc) acc + sc * (the sums), exact for
// the K-quants' scales.
constexpr bool kNibI32 = true;
constexpr bool kScaledWiden = true;  // the K-quant tiles take the scales as the sums widen (nib_scale: lane_i8)
using NibScale = I32x16;
inline I32x16 nib_widen_scaled(I32x16 acc, NibAcc n, I32x16 sc) {
  return {_mm512_add_epi32(acc.v, _mm512_mullo_epi32(n.v, sc.v))};
}
#else
struct NibAcc {
  __m512i v;
};
inline NibAcc nib_zero() { return {_mm512_setzero_si512()}; }
inline NibAcc nib_add(NibAcc acc, I32x16 u, I32x16 x) { return {_mm512_add_epi16(acc.v, _mm512_maddubs_epi16(u.v, x.v))}; }
inline I32x16 nib_widen(I32x16 acc, NibAcc n) {
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(n.v, _mm512_set1_epi16(1)))};
}
// kNibI32: NibAcc is int32 already (no run limit); nib_widen_scaled(acc, n, sc) acc + sc * (the sums), exact for
// the K-quants' scales.
constexpr bool kNibI32 = false;
constexpr bool kScaledWiden = false;  // the K-quant tiles scale the widened sums (measured faster here)
using NibScale = I32x16;
inline I32x16 nib_widen_scaled(I32x16 acc, NibAcc n, I32x16 sc) {
  return {_mm512_add_epi32(acc.v, _mm512_mullo_epi32(_mm512_madd_epi16(n.v, _mm512_set1_epi16(1)), sc.v))};
}
#endif
constexpr bool kTwoPasses = false;  // the 5- and 6-bit quants' sub-blocks in one pass (qtile.h)
inline I32x16 isub(I32x16 a, int32_t c) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(c))}; }
inline I32x16 iadd(I32x16 a, I32x16 b) { return {_mm512_add_epi32(a.v, b.v)}; }
// The bit fields of the 5- and 6-bit formats (vec.h): per byte (b << s) & m, (b >> s) & m, a | b; sign-extended
// byte k of each lane; int32 lane products (low 32 bits); an int32 broadcast.
inline I32x16 shl_and(I32x16 a, int s, uint8_t m) {
  return {_mm512_and_si512(_mm512_sll_epi16(a.v, _mm_cvtsi32_si128(s)), _mm512_set1_epi8(static_cast<char>(m)))};
}
inline I32x16 shr_and(I32x16 a, int s, uint8_t m) {
  return {_mm512_and_si512(_mm512_srl_epi16(a.v, _mm_cvtsi32_si128(s)), _mm512_set1_epi8(static_cast<char>(m)))};
}
inline I32x16 bor(I32x16 a, I32x16 b) { return {_mm512_or_si512(a.v, b.v)}; }
inline I32x16 lane_i8(I32x16 a, int k) {
  return {_mm512_srai_epi32(_mm512_sll_epi32(a.v, _mm_cvtsi32_si128(24 - 8 * k)), 24)};
}
inline I32x16 imul(I32x16 a, I32x16 b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
inline NibScale nib_scale(I32x16 a, int k) { return lane_i8(a, k); }
inline I32x16 iset1(int32_t c) { return {_mm512_set1_epi32(c)}; }
// The K-quants' min and bsum terms as int16 pair products (vec.h): pairs_u8 (k 0 or 1) the bytes k and k + 2 of each
// lane zero-extended into its low and high int16, pairs_i8x32 the same sign-extended times 32; dot_i16 acc + lo(a) *
// lo(b) + hi(a) * hi(b), the int16 halves signed.
inline I32x16 pairs_u8(I32x16 a, int k) {
  return {k == 0 ? _mm512_and_si512(a.v, _mm512_set1_epi16(0x00FF)) : _mm512_srli_epi16(a.v, 8)};
}
inline I32x16 pairs_i8x32(I32x16 a, int k) {
  return {_mm512_srai_epi16(k == 0 ? _mm512_slli_epi16(a.v, 8) : _mm512_and_si512(a.v, _mm512_set1_epi16(-256)), 3)};
}
inline I32x16 dot_i16(I32x16 acc, I32x16 a, I32x16 b) {
#if defined(__AVX512VNNI__)
  return {_mm512_dpwssd_epi32(acc.v, a.v, b.v)};
#else
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(a.v, b.v))};
#endif
}
inline F32x16 to_f(I32x16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline I32x16 cvt_round(F32x16 a) {
  return {_mm512_cvt_roundps_epi32(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline void store_i8_sat(int8_t *p, I32x16 a) { _mm_storeu_si128(reinterpret_cast<__m128i *>(p), _mm512_cvtsepi32_epi8(a.v)); }
inline int32_t reduce_add_i32(I32x16 a) { return _mm512_reduce_add_epi32(a.v); }

inline void cpu_relax() { _mm_pause(); }

// --- KV cache formats (kv_format.h): exact conversions to float32, for attention.cc ---------------
// 16 int8 -> float32.
inline F32x16 load_i8(const int8_t *p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))))};
}
// 16 bfloat16 (their bits are a float32's upper half) -> float32; _part: lanes [0, n), the rest +0.0.
inline F32x16 bf16_widen(__m256i h) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))}; }
inline F32x16 load_bf16(const uint8_t *p) { return bf16_widen(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))); }
inline F32x16 load_bf16_part(const uint8_t *p, int n) { return bf16_widen(_mm256_maskz_loadu_epi16(first(n), p)); }

}  // namespace mindserve::vec
