// mindserve kernels: the one vector layer every kernel is written against.
//
// F32x16 is 16 float lanes, I32x16 64 bytes seen as 16 int32 lanes (or 64 int8/uint8 bytes, four per
// lane). The backend is picked by the compiler's predefined macros (build.py compiles one library per
// named variant, each with fixed -march flags):
//   vec_avx512.h  one zmm                 (__AVX512F__ + BW + VL; VNNI dot products with __AVX512VNNI__)
//   vec_avx2.h    two ymm                 (__AVX2__ + FMA + F16C)
//   vec_neon.h    four q registers        (__aarch64__; sdot with __ARM_FEATURE_DOTPROD)
//   vec_scalar.h  float[16] / int32[16]   (anything else, or MINDSERVE_VEC_SCALAR)
//
// The contract that makes every backend give the same output bits:
// * lane-wise arithmetic is IEEE single precision, one rounding per op: add, sub, mul, div, and fmadd /
//   fnmadd as fused operations (a * b + c and c - a * b rounded once). Builds use -ffp-contract=off, so
//   scalar code is never contracted either.
// * partial loads fill the lanes past `n` with +0.0 (or 0 bytes); partial stores write only the first n.
// * reduce_add is one fixed tree: lane i + lane i+8, then i + i+4, then i + i+2, then lane 0 + lane 1
//   (the tree of GCC's _mm512_reduce_add_ps). reduce_max is order-free for the finite values it sees.
// * round_even is round-half-to-even; ldexp(p, n) is p * 2^n rounded once (p >= 0.5, n integral, n >= -149).
// * the int8 dot products are exact integer sums of the four bytes of each lane: dot_nib (u of 0..15), dot_q8
//   (u = q + 128, the sum of q * x or of u * x: the backend's kQ8Bias says which, the kernel subtracts
//   kQ8Bias * sum x), and NibAcc, where up to 8 dot_nib sums gather before one widening to int32.
// * the bit fields of the 5- and 6-bit weight formats: shl_and / shr_and are per byte (b << s) & m and
//   (b >> s) & m for masks that keep only bits of the same byte (the backends shift wider lanes), bor is a | b,
//   lane_i8(v, k) byte k of each int32 lane sign-extended, imul the low 32 bits of int32 lane products, iset1 a
//   broadcast. NibAcc also holds the 5-bit (u <= 31: 4 dot_nib sums) and 6-bit (u <= 63: 2 sums) quants.
//   nib_widen_scaled(acc, n, nib_scale(v, k)) widens NibAcc's sums times byte k of each lane of v (signed), exact
//   for the K-quants' scales; kScaledWiden says whether the K-quant tiles use it (else they scale widened sums).
// * load_f16, load_bf16 and load_i8 (16 halves, bfloat16s or int8 to float32) are exact, so every backend agrees.
//   store_f16 (16 float32 to binary16: round to nearest even, a NaN stays a quiet NaN) gives
//   kv_format.h's f32_to_f16 bits on every backend (F16C / AVX-512 vcvtps2ph, AArch64 fcvtn, or that function).
// Every backend defines, in namespace mindserve::vec: the two types and the functions used below; kernels
// use nothing else (tile sizes come from the kMatMulRows / kQRows / kQRows2 constants of the backend, kQRows2 0:
// no two-group quantized tiles; kQRolledRows: from this many rows a quantized tile keeps its loop over a block's
// quant dwords rolled).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(MINDSERVE_VEC_SCALAR)
#include "vec_scalar.h"
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include "vec_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "vec_avx2.h"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include "vec_neon.h"
#else
#include "vec_scalar.h"
#endif

#ifndef MINDSERVE_VARIANT
#define MINDSERVE_VARIANT "unnamed"
#endif

namespace mindserve::vec {

// exp(x) for x <= 0: x = n ln2 + r, |r| <= ln2/2, exp(r) by its degree-7 Taylor polynomial (relative error
// < 2e-8 on that range), times 2^n. Arguments at or below -103 give 2^-149, the smallest subnormal (exp
// there is below float32's range anyway); the same input always gives the same bits, on every backend.
inline F32x16 exp_nonpositive(F32x16 x) {
  x = max(x, set1(-103.0f));
  const F32x16 n = round_even(mul(x, set1(1.44269504088896341f)));
  F32x16 r = fnmadd(n, set1(0.693359375f), x);  // ln2 split in two parts
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  F32x16 p = set1(1.0f / 5040);
  p = fmadd(p, r, set1(1.0f / 720));
  p = fmadd(p, r, set1(1.0f / 120));
  p = fmadd(p, r, set1(1.0f / 24));
  p = fmadd(p, r, set1(1.0f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  return ldexp(p, n);
}

// Lanes [0, n) of p (n >= 16: all), the rest +0.0.
inline F32x16 load_n(const float *p, int64_t n) { return n >= 16 ? load(p) : load_part(p, static_cast<int>(n)); }
inline void store_n(float *p, F32x16 v, int64_t n) {
  if (n >= 16) store(p, v);
  else store_part(p, v, static_cast<int>(n));
}

}  // namespace mindserve::vec
