// mindserve kernels: small AVX-512 helpers shared by the kernels.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace mindserve {

// The first `rem` lanes (all 16 when rem >= 16).
inline __mmask16 tail_mask(int64_t rem) {
  return static_cast<__mmask16>(rem >= 16 ? 0xFFFF : ((1u << rem) - 1));
}

// exp(x) for x <= 0: x = n ln2 + r, |r| <= ln2/2, exp(r) by its degree-7 Taylor polynomial
// (relative error < 2e-8 on that range), times 2^n. Arguments below -103 give 0 (as exp does in
// float32); the same input always gives the same bits.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 split in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace mindserve
