// mindserve vector layer, AVX2 + FMA + F16C backend (vec.h states the contract): two ymm per vector
// (a = lanes 0..7, b = lanes 8..15).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace mindserve::vec {

constexpr const char *kIsa = "avx2";
constexpr int kMatMulRows = 2;  // fp32 tile rows: 2 x 6 ymm accumulators + the weights in 16 ymm
constexpr int kQRows = 4;   // quantized tile rows (4 beat 2 even with the spills)
constexpr int kKRows2 = 0;  // no two-group K-quant tiles either
constexpr int kQRows2 = 0;  // no two-group tiles: one group of 4 rows is faster (fewer spills)
// Tiles of 2+ rows keep their loop over a block's quant dwords rolled: unrolled, GCC hoists the nibble unpacks of
// all four dwords and spills the rows' int16 sums (16 ymm registers); one row is faster unrolled.
constexpr int kQRolledRows = 2;
constexpr int kQ8Bias = 0;  // dot_q8 flips u = q + 128 back to the signed q: sum q * x directly

struct F32x16 {
  __m256 a, b;
};
struct I32x16 {
  __m256i a, b;
};

// Lanes i < n of each half set (all ones), the rest clear.
inline __m256i lanes_below(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline F32x16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F32x16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F32x16 load(const float *p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F32x16 load_part(const float *p, int n) {  // vmaskmovps: masked lanes read as 0 and never fault
  return {_mm256_maskload_ps(p, lanes_below(n)), _mm256_maskload_ps(p + 8, lanes_below(n - 8))};
}
inline void store(float *p, F32x16 v) {
  _mm256_storeu_ps(p, v.a);
  _mm256_storeu_ps(p + 8, v.b);
}
inline void store_part(float *p, F32x16 v, int n) {
  _mm256_maskstore_ps(p, lanes_below(n), v.a);
  _mm256_maskstore_ps(p + 8, lanes_below(n - 8), v.b);
}
#define MINDSERVE_VEC2(name, op)                                                                   \
  inline F32x16 name(F32x16 x, F32x16 y) { return {op(x.a, y.a), op(x.b, y.b)}; }
MINDSERVE_VEC2(add, _mm256_add_ps)
MINDSERVE_VEC2(sub, _mm256_sub_ps)
MINDSERVE_VEC2(mul, _mm256_mul_ps)
MINDSERVE_VEC2(div, _mm256_div_ps)
MINDSERVE_VEC2(max, _mm256_max_ps)
#undef MINDSERVE_VEC2
inline F32x16 fmadd(F32x16 x, F32x16 y, F32x16 z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline F32x16 fnmadd(F32x16 x, F32x16 y, F32x16 z) {
  return {_mm256_fnmadd_ps(x.a, y.a, z.a), _mm256_fnmadd_ps(x.b, y.b, z.b)};
}
inline F32x16 abs(F32x16 x) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(x.a, m), _mm256_and_ps(x.b, m)};
}
inline F32x16 select_neg(F32x16 g, F32x16 x, F32x16 y) {
  const __m256 z = _mm256_setzero_ps();
  return {_mm256_blendv_ps(y.a, x.a, _mm256_cmp_ps(g.a, z, _CMP_LT_OQ)),
          _mm256_blendv_ps(y.b, x.b, _mm256_cmp_ps(g.b, z, _CMP_LT_OQ))};
}
inline F32x16 keep_first(F32x16 x, int n) {
  return {_mm256_and_ps(x.a, _mm256_castsi256_ps(lanes_below(n))),
          _mm256_and_ps(x.b, _mm256_castsi256_ps(lanes_below(n - 8)))};
}
inline F32x16 fill_tail(F32x16 x, int n, float f) {
  const __m256 v = _mm256_set1_ps(f);
  return {_mm256_blendv_ps(v, x.a, _mm256_castsi256_ps(lanes_below(n))),
          _mm256_blendv_ps(v, x.b, _mm256_castsi256_ps(lanes_below(n - 8)))};
}
inline F32x16 round_even(F32x16 x) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.a, kMode), _mm256_round_ps(x.b, kMode)};
}
// 2^k for integral k in [-126, 127], from its exponent bits.
inline __m256 pow2(__m256 k) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23));
}
// p * 2^n in one rounding, as vscalefps: p * 2^max(n, -125) is exact (p >= 0.5 stays normal), then the
// remaining 2^(n - max(n, -125)) in [2^-24, 1] rounds once.
inline __m256 ldexp8(__m256 p, __m256 n) {
  const __m256 n1 = _mm256_max_ps(n, _mm256_set1_ps(-125.0f));
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(n1)), pow2(_mm256_sub_ps(n, n1)));
}
inline F32x16 ldexp(F32x16 p, F32x16 n) { return {ldexp8(p.a, n.a), ldexp8(p.b, n.b)}; }
inline float reduce_add(F32x16 x) {
  const __m256 h = _mm256_add_ps(x.b, x.a);
  const __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}
inline float reduce_max(F32x16 x) {
  const __m256 h = _mm256_max_ps(x.a, x.b);
  __m128 q = _mm_max_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}
inline F32x16 load_f16(const uint8_t *p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + 16)))};
}
inline void store_f16(uint8_t *p, F32x16 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i *>(p), _mm256_cvtps_ph(x.a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  _mm_storeu_si128(reinterpret_cast<__m128i *>(p + 16), _mm256_cvtps_ph(x.b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline F32x16 load_f16_part(const uint8_t *p, int n) {
  alignas(32) uint8_t buf[32] = {};
  std::memcpy(buf, p, 2 * n);
  return load_f16(buf);
}

inline I32x16 izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I32x16 load_bytes(const uint8_t *p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + 32))};
}
inline I32x16 load_bytes_part(const uint8_t *p, int lanes) {
  const auto *q = reinterpret_cast<const int *>(p);
  return {_mm256_maskload_epi32(q, lanes_below(lanes)), _mm256_maskload_epi32(q + 8, lanes_below(lanes - 8))};
}
inline I32x16 bcast4(const int8_t *p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  const __m256i b = _mm256_set1_epi32(v);
  return {b, b};
}
inline I32x16 nib_lo(I32x16 v) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(v.a, m), _mm256_and_si256(v.b, m)};
}
inline I32x16 nib_hi(I32x16 v) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(v.a, 4), m), _mm256_and_si256(_mm256_srli_epi16(v.b, 4), m)};
}
inline I32x16 dot_nib(I32x16 acc, I32x16 u, I32x16 x) {
  const __m256i one = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.a, _mm256_madd_epi16(_mm256_maddubs_epi16(u.a, x.a), one)),
          _mm256_add_epi32(acc.b, _mm256_madd_epi16(_mm256_maddubs_epi16(u.b, x.b), one))};
}
// u = q + 128: q = u ^ 0x80, and q * x = |q| * (x with q's sign), an unsigned x signed byte product whose pair
// sums (at most 2 * 128 * 127) fit vpmaddubsw's int16 without saturating.
inline __m256i dot_q8_half(__m256i acc, __m256i u, __m256i x) {
  const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline I32x16 dot_q8(I32x16 acc, I32x16 u, I32x16 x) { return {dot_q8_half(acc.a, u.a, x.a), dot_q8_half(acc.b, u.b, x.b)}; }
// Up to 8 nibble dot products summed in int16 pairs (each at most 2 * 15 * 127, so 8 fit), then widened once.
struct NibAcc {
  __m256i a, b;
};
inline NibAcc nib_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
// The empty asm keeps each sum a chain: GCC would otherwise reassociate a tile's unrolled int16 additions into a tree
// at its end, every product live until then (spilled: 16 ymm hold no 4 rows of them).
inline NibAcc nib_add(NibAcc acc, I32x16 u, I32x16 x) {
  NibAcc r{_mm256_add_epi16(acc.a, _mm256_maddubs_epi16(u.a, x.a)), _mm256_add_epi16(acc.b, _mm256_maddubs_epi16(u.b, x.b))};
  __asm__("" : "+x"(r.a), "+x"(r.b));
  return r;
}
inline I32x16 nib_widen(I32x16 acc, NibAcc n) {
  const __m256i one = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.a, _mm256_madd_epi16(n.a, one)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(n.b, one))};
}
// kNibI32: NibAcc is int32 already (no run limit). The K-quants' scales multiply the sums as they widen
// (kScaledWiden): nib_scale(v, k) is byte k of each lane, sign-extended into both int16 halves, so one vpmaddwd widens
// the int16 pair sums and multiplies them by the scale, exactly (|sum| <= 32767, |scale| <= 128: the int32 products
// and their pair sum fit); nib_widen_scaled(acc, n, sc) = acc + sc * (the sums).
constexpr bool kNibI32 = false;
constexpr bool kScaledWiden = true;
// kTwoPasses: the 5- and 6-bit quants' sub-blocks in two passes (qtile.h ktile): 16 ymm hold no two sets of int16
// sums of 4 rows.
constexpr bool kTwoPasses = true;
struct NibScale {
  __m256i a, b;
};
inline NibScale nib_scale(I32x16 v, int k) {
  // vpshufb within each 128-bit lane: dword i's byte k into the high byte of both its int16 halves (the low byte 0),
  // then an arithmetic shift by 8 sign-extends it.
  const __m256i base = _mm256_setr_epi8(-128, 0, -128, 0, -128, 4, -128, 4, -128, 8, -128, 8, -128, 12, -128, 12,
                                        -128, 0, -128, 0, -128, 4, -128, 4, -128, 8, -128, 8, -128, 12, -128, 12);
  const __m256i idx = _mm256_add_epi16(base, _mm256_set1_epi16(static_cast<int16_t>(k << 8)));
  return {_mm256_srai_epi16(_mm256_shuffle_epi8(v.a, idx), 8), _mm256_srai_epi16(_mm256_shuffle_epi8(v.b, idx), 8)};
}
inline I32x16 nib_widen_scaled(I32x16 acc, NibAcc n, NibScale sc) {  // a chain too (nib_add)
  I32x16 r{_mm256_add_epi32(acc.a, _mm256_madd_epi16(n.a, sc.a)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(n.b, sc.b))};
  __asm__("" : "+x"(r.a), "+x"(r.b));
  return r;
}
inline I32x16 isub(I32x16 v, int32_t c) {
  const __m256i b = _mm256_set1_epi32(c);
  return {_mm256_sub_epi32(v.a, b), _mm256_sub_epi32(v.b, b)};
}
inline I32x16 iadd(I32x16 x, I32x16 y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
// The bit fields of the 5- and 6-bit formats (vec.h): per byte (b << s) & m, (b >> s) & m, a | b; sign-extended
// byte k of each lane; int32 lane products (low 32 bits); an int32 broadcast.
inline I32x16 shl_and(I32x16 v, int s, uint8_t m) {
  const __m128i c = _mm_cvtsi32_si128(s);
  const __m256i k = _mm256_set1_epi8(static_cast<char>(m));
  return {_mm256_and_si256(_mm256_sll_epi16(v.a, c), k), _mm256_and_si256(_mm256_sll_epi16(v.b, c), k)};
}
inline I32x16 shr_and(I32x16 v, int s, uint8_t m) {
  const __m128i c = _mm_cvtsi32_si128(s);
  const __m256i k = _mm256_set1_epi8(static_cast<char>(m));
  return {_mm256_and_si256(_mm256_srl_epi16(v.a, c), k), _mm256_and_si256(_mm256_srl_epi16(v.b, c), k)};
}
inline I32x16 bor(I32x16 x, I32x16 y) { return {_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)}; }
inline I32x16 lane_i8(I32x16 v, int k) {
  const __m128i c = _mm_cvtsi32_si128(24 - 8 * k);
  return {_mm256_srai_epi32(_mm256_sll_epi32(v.a, c), 24), _mm256_srai_epi32(_mm256_sll_epi32(v.b, c), 24)};
}
inline I32x16 imul(I32x16 x, I32x16 y) { return {_mm256_mullo_epi32(x.a, y.a), _mm256_mullo_epi32(x.b, y.b)}; }
inline I32x16 iset1(int32_t c) {
  const __m256i b = _mm256_set1_epi32(c);
  return {b, b};
}
// The K-quants' min and bsum terms as int16 pair products (vec.h): pairs_u8 (k 0 or 1) the bytes k and k + 2 of each
// lane zero-extended into its low and high int16, pairs_i8x32 the same sign-extended times 32; dot_i16 acc + lo(a) *
// lo(b) + hi(a) * hi(b), the int16 halves signed.
inline I32x16 pairs_u8(I32x16 v, int k) {
  if (k == 0) {
    const __m256i m = _mm256_set1_epi16(0x00FF);
    return {_mm256_and_si256(v.a, m), _mm256_and_si256(v.b, m)};
  }
  return {_mm256_srli_epi16(v.a, 8), _mm256_srli_epi16(v.b, 8)};
}
inline I32x16 pairs_i8x32(I32x16 v, int k) {
  if (k == 0) return {_mm256_srai_epi16(_mm256_slli_epi16(v.a, 8), 3), _mm256_srai_epi16(_mm256_slli_epi16(v.b, 8), 3)};
  const __m256i m = _mm256_set1_epi16(-256);
  return {_mm256_srai_epi16(_mm256_and_si256(v.a, m), 3), _mm256_srai_epi16(_mm256_and_si256(v.b, m), 3)};
}
inline I32x16 dot_i16(I32x16 acc, I32x16 x, I32x16 y) {
  return {_mm256_add_epi32(acc.a, _mm256_madd_epi16(x.a, y.a)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(x.b, y.b))};
}
inline F32x16 to_f(I32x16 v) { return {_mm256_cvtepi32_ps(v.a), _mm256_cvtepi32_ps(v.b)}; }
inline I32x16 cvt_round(F32x16 v) {  // vcvtps2dq under the default MXCSR: nearest, ties to even
  return {_mm256_cvtps_epi32(v.a), _mm256_cvtps_epi32(v.b)};
}
inline void store_i8_sat(int8_t *p, I32x16 v) {
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(v.a, v.b), 0xD8);  // 16 x int16, in order
  const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i *>(p), b);
}
inline int32_t reduce_add_i32(I32x16 v) {
  const __m256i h = _mm256_add_epi32(v.a, v.b);
  __m128i q = _mm_add_epi32(_mm256_extracti128_si256(h, 1), _mm256_castsi256_si128(h));
  q = _mm_add_epi32(q, _mm_unpackhi_epi64(q, q));
  return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 1)));
}

inline void cpu_relax() { _mm_pause(); }

// --- KV cache formats (kv_format.h): exact conversions to float32, for attention.cc ---------------
// 16 int8 -> float32.
inline F32x16 load_i8(const int8_t *p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p + 8))))};
}
// 16 bfloat16 (their bits are a float32's upper half) -> float32; _part: lanes [0, n), the rest +0.0.
inline __m256 bf16_widen8(const uint8_t *p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline F32x16 load_bf16(const uint8_t *p) { return {bf16_widen8(p), bf16_widen8(p + 16)}; }
inline F32x16 load_bf16_part(const uint8_t *p, int n) {
  alignas(32) uint8_t buf[32] = {};
  std::memcpy(buf, p, 2 * n);
  return load_bf16(buf);
}

}  // namespace mindserve::vec
