// mindserve quantized matmul tiles: rows [m0, m0 + MR) of y times one or two groups of 16 output columns, over
// every block of K, for the formats of qformat.h (their traits row says what each tile does). The pieces every
// tile shares are the small always-inline helpers first; each tile below them is only its loop nest.
//
// tile   Q8_0, Q4_0, Q4_1 (whole-byte or 4-bit quants): one or two groups of columns (NG).
// ktile  Q5_0, Q5_1 and the K-quants (high bits, sub-blocks, integer scales): one group.
// ktile2 the K-quants two full groups at a time (backends with v::kKRows2 > 0; they take the scales as the sums widen).
// Every one computes an output element with the same operations in the same order (qmatmul.cc's header), so which
// tile ran never changes a bit.
#pragma once

#include <cstdint>
#include <type_traits>

#include "qformat.h"
#include "quantize.h"
#include "vec.h"

#define MINDSERVE_AI inline __attribute__((always_inline))

namespace mindserve::q {

namespace v = mindserve::vec;
using VI = v::I32x16;
using VF = v::F32x16;

// --- loads and stores of a group of w columns (FULL: all 16) --------------------------------------------------------
template <bool FULL>
MINDSERVE_AI VI load_q(const uint8_t *p, int w) {
  if constexpr (FULL) return v::load_bytes(p);
  return v::load_bytes_part(p, w);
}
template <bool FULL>
MINDSERVE_AI VF load_h(const uint8_t *p, int w) {
  if constexpr (FULL) return v::load_f16(p);
  return v::load_f16_part(p, w);
}
// y = acc (+ res): the residual added once, after the product.
template <bool FULL>
MINDSERVE_AI void store_out(float *y, const float *res, VF acc, int w) {
  if (res != nullptr) acc = v::add(acc, FULL ? v::load(res) : v::load_part(res, w));
  if constexpr (FULL) v::store(y, acc);
  else v::store_part(y, acc, w);
}

template <class T, int R, int N>
MINDSERVE_AI void fill(T (&a)[R][N], T x) {
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 2") for (int n = 0; n < N; ++n) a[r][n] = x;
}

// Cache lines [i, i + 1) / n of the `bytes` at p asked for ahead of use (a hint: never faults, changes no result).
MINDSERVE_AI void prefetch_share(const uint8_t *p, int64_t bytes, int64_t i, int64_t n) {
  for (int64_t o = bytes * i / n & ~int64_t{63}; o < bytes * (i + 1) / n; o += 64) __builtin_prefetch(p + o, 0, 3);
}

// The weight bytes a tile asks the cache for while it computes (none: bytes == 0): a slice of the next
// columns' weights, spread over the tile's blocks, so their first pass does not wait for memory.
struct Ahead {
  const uint8_t *p = nullptr;
  int64_t bytes = 0;
  MINDSERVE_AI void touch(int64_t b, int64_t nb) const { prefetch_share(p, bytes, b, nb); }
};

// --- a block's float step --------------------------------------------------------------------------------------------
// acc + (d_w * dx) * isum, one fma.
MINDSERVE_AI VF scaled_sum(VF acc, VF dw, VF dx, VI isum) { return v::fmadd(v::mul(dw, dx), v::to_f(isum), acc); }

// The integer sum of one 32-block less its quants' offset (sx the activations' sum): Q4_0's 8, Q5_0's 16, and the
// backend's bias of unsigned Q8_0 bytes (vec.h's kQ8Bias).
template <const Traits &T>
MINDSERVE_AI VI offset_sum(VI isum, int32_t sx) {
  if constexpr (T.bytes() && v::kQ8Bias != 0) isum = v::isub(isum, v::kQ8Bias * sx);
  if constexpr (T.offset != 0) isum = v::isub(isum, T.offset * sx);
  return isum;
}

// --- the K-quants' and Q5's pieces -----------------------------------------------------------------------------------
// The high bits of quant dword t, in place in each byte, from one high-bits dword h:
//   HB 1 (Q5):   byte i bit t = bit 4 of weight 4t + i (UPPER false), bit 4 + t = that of weight 16 + 4t + i (true)
//   HB 2 (Q6_K): byte i bits 2t, 2t + 1 = bits 4, 5 of weight 4t + i of the half h belongs to
template <int HB, bool UPPER>
MINDSERVE_AI VI high_bits(VI h, int t) {
  if constexpr (HB == 1) return UPPER ? v::shr_and(h, t, 0x10) : v::shl_and(h, 4 - t, 0x10);
  return t < 2 ? v::shl_and(h, 4 - 2 * t, 0x30) : v::shr_and(h, 2 * t - 4, 0x30);
}

// The scale dword of sub-block j among a block's scale dwords (scl, groups of w columns), and sub-block j's scale
// in it (Q6_K: of its half `half`), sign-extended: as nib_widen_scaled takes it (SCALED), else as int32 lanes.
template <const Traits &T, bool FULL>
MINDSERVE_AI VI scale_dword(const uint8_t *scl, int j, int w) {
  return load_q<FULL>(scl + (j / (T.halves ? 2 : 4)) * 4 * w, w);
}
template <bool SCALED>
using ScaleOf = std::conditional_t<SCALED, v::NibScale, VI>;
template <const Traits &T, bool SCALED>
MINDSERVE_AI ScaleOf<SCALED> scale_of(VI dword, int j, int half) {
  const int k = T.halves ? 2 * (j % 2) + half : j % 4;
  if constexpr (SCALED) return v::nib_scale(dword, k);
  else return v::lane_i8(dword, k);
}

// Q6_K's + sum_i (32 sc_i) (-bsum_i) of one super-block, int16 pairs (|32 sc_i| <= 4096): 8 pair products a row and
// group, one scale pair at a time (AVX2 holds no 8 of them). bp: row m0's Q6_K bsum pairs, rows `stride` apart.
template <int MR, int NG, bool FULL>
MINDSERVE_AI void q6_bsums(VI (&isum)[MR][NG], const uint8_t *scl, int64_t group_bytes, int w, const int32_t *bp,
                           int64_t stride) {
  _Pragma("GCC unroll 8") for (int k = 0; k < 8; ++k) {
    VI sp[NG];
    _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n)
      sp[n] = v::pairs_i8x32(load_q<FULL>(scl + n * group_bytes + (k / 2) * 4 * w, w), k % 2);
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
      const VI q = v::iset1(bp[r * stride + k]);
      _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) isum[r][n] = v::dot_i16(isum[r][n], sp[n], q);
    }
  }
}

// Q4_K's / Q5_K's mins of one group: dmin_w and the 8 mn_j as 4 int16 pairs; sub() takes them off a row's acc:
// acc - (dmin_w * dx) * sum_j mn_j (bsum_2j + bsum_2j+1), 4 pair products (bp: the row's pairs).
struct KMins {
  VF dmin;
  VI mp[4];
  template <bool FULL>
  MINDSERVE_AI static KMins of(const uint8_t *scl, const uint8_t *halves, int w) {
    const VI lo = load_q<FULL>(scl + 8 * w, w), hi = load_q<FULL>(scl + 12 * w, w);
    return {load_h<FULL>(halves + 2 * w, w), {v::pairs_u8(lo, 0), v::pairs_u8(lo, 1), v::pairs_u8(hi, 0),
                                              v::pairs_u8(hi, 1)}};
  }
  MINDSERVE_AI VF sub(VF acc, float dx, const int32_t *bp) const {
    VI imin = v::izero();
    _Pragma("GCC unroll 4") for (int k = 0; k < 4; ++k) imin = v::dot_i16(imin, mp[k], v::iset1(bp[k]));
    return v::fnmadd(v::mul(dmin, v::set1(dx)), v::to_f(imin), acc);
  }
};

// --- the tiles -------------------------------------------------------------------------------------------------------
// tile: Q8_0, Q4_0, Q4_1. NG == 2 takes two full groups (g, and g + group_bytes), so every broadcast activation dword
// and scale feeds two dot products; NG == 1 one group of w columns (FULL: w == 16).
template <int MR, int NG, int F, bool FULL>
void tile(const QX &qx, int64_t m0, const uint8_t *__restrict g, int64_t group_bytes, int w,
          const float *__restrict res, float *__restrict y, int64_t ldy, Ahead ahead) {
  static constexpr const Traits &T = kTraits[F];
  constexpr int D = T.quant_dwords, B = T.packed_bytes;
  const int64_t K = qx.K, nb = qx.nb;
  VF facc[MR][NG];
  fill(facc, v::zero());
  for (int64_t b = 0; b < nb; ++b) {
    ahead.touch(b, nb);
    const uint8_t *blk = g + b * w * B;
    const int8_t *xq = qx.q.data() + m0 * K + 32 * b;
    VI iacc[MR][NG];
    v::NibAcc nacc[MR][NG];
    fill(iacc, v::izero());
    fill(nacc, v::nib_zero());
    // Quant dword j of each column, for every row of the tile.
    const auto dword = [&](int j) __attribute__((always_inline)) {
      VI raw[NG];
      _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) raw[n] = load_q<FULL>(blk + n * group_bytes + j * 4 * w, w);
      if constexpr (T.bytes()) {
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
          const VI xb = v::bcast4(xq + r * K + 4 * j);
          _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) iacc[r][n] = v::dot_q8(iacc[r][n], raw[n], xb);
        }
      } else {
        VI lo[NG], hi[NG];
        _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) {
          lo[n] = v::nib_lo(raw[n]);
          hi[n] = v::nib_hi(raw[n]);
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
          const VI xl = v::bcast4(xq + r * K + 4 * j), xh = v::bcast4(xq + r * K + 16 + 4 * j);
          _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) {
            nacc[r][n] = v::nib_add(nacc[r][n], lo[n], xl);
            nacc[r][n] = v::nib_add(nacc[r][n], hi[n], xh);
          }
        }
      }
    };
    if constexpr (MR >= v::kQRolledRows) {
      _Pragma("GCC unroll 1") for (int j = 0; j < D; ++j) dword(j);
    } else {
      _Pragma("GCC unroll 8") for (int j = 0; j < D; ++j) dword(j);
    }
    if constexpr (!T.bytes()) {  // D = 4 dwords x 2 halves: the 8 nibble sums NibAcc holds
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
        _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) iacc[r][n] = v::nib_widen(iacc[r][n], nacc[r][n]);
    }
    VF dw[NG];
    _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) dw[n] = load_h<FULL>(blk + n * group_bytes + D * 4 * w, w);
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
      const int64_t i = (m0 + r) * nb + b;
      const VF dx = v::set1(qx.d[i]);
      _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n)
        facc[r][n] = scaled_sum(facc[r][n], dw[n], dx, offset_sum<T>(iacc[r][n], qx.s[i]));
    }
    if constexpr (T.add_m) {
      VF mw[NG];
      _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n)
        mw[n] = load_h<FULL>(blk + n * group_bytes + D * 4 * w + 2 * w, w);
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
        const VF sf = v::set1(qx.sf[(m0 + r) * nb + b]);
        _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) facc[r][n] = v::fmadd(mw[n], sf, facc[r][n]);
      }
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
    _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n)
      store_out<FULL>(y + r * ldy + kGroup * n, res == nullptr ? nullptr : res + r * ldy + kGroup * n, facc[r][n], w);
}

// How far ahead of its reads a one-pass ktile (M below a tile's rows, e.g. decode's M=1) asks for weight bytes: the
// hardware prefetcher alone does not keep up with its scattered reads. Several passes (M above a tile's rows)
// prefetch for each other through run_chunk's Ahead instead.
constexpr int64_t kKPrefetch = 9472;

// ktile: Q5_0, Q5_1 and the K-quants, one group of columns. Per block b and per sub-block j of 32 in order, the
// quants u (low nibble | high bits << 4) dotted with the activations in int16 pairs (NibAcc), widened to int32
// before they could overflow; then, all exact in int32:
//   Q5_0, Q5_1:  isum = dot                        (Q5_0: - 16 sx)
//   Q4_K, Q5_K:  isum += sc_j * dot_j,    imin += mn_j * (bsum_2j + bsum_2j+1)
//   Q6_K:        isum += sc_2j * (dot_lo - 32 bsum_2j) + sc_2j+1 * (dot_hi - 32 bsum_2j+1)   (halves of 16)
// and per block: acc = fma(d_w * dx, (float)isum, acc); Q5_1: acc = fma(m_w, sfx, acc);
// Q4_K, Q5_K: acc = fnmadd(dmin_w * dx, (float)imin, acc).
template <int MR, int F, bool FULL>
void ktile(const QX &qx, int64_t m0, const uint8_t *__restrict g, int64_t /*group_bytes*/, int w_,
           const float *__restrict res, float *__restrict y, int64_t ldy, Ahead ahead) {
  static constexpr const Traits &T = kTraits[F];
  // A full group's width as a constant: every dword offset below is then an immediate (with the run-time width,
  // GCC keeps the unrolled super-block's 40-odd offsets in registers and spills them).
  const int w = FULL ? kGroup : w_;
  constexpr int SB = T.subblocks, HB = T.high_dwords, DS = 4 + HB, B = T.packed_bytes;
  constexpr int RUN = HB == 0 || v::kNibI32 ? 4 : 2;  // quant dwords summed in int16 before widening (vec.h: NibAcc)
  // Where the backend says so (v::kScaledWiden: VNNI, AVX2, NEON, scalar), the K-quants' scales multiply the sums as
  // they widen (Q6_K: per half of 16; AVX2 in the vpmaddwd that widens its int16 pair sums) and Q6_K's -32 bsum term
  // comes once per super-block (int16 pair products). Else (AVX-512BW) the scales come after widening and the bsum
  // per half.
  constexpr bool SCALED = T.k8 && v::kScaledWiden;
  // Where the backend says so (v::kTwoPasses: AVX2), the formats with high bits (Q5_0, Q5_1, Q5_K, Q6_K) take a
  // sub-block in two passes, the low nibbles' weights (Q6_K: its half of 16) then the high ones', each through the 4
  // quant dwords (the second from L1): one set of MR int16 sums is live instead of two, and they widen once a pass
  // (Q6_K twice: u <= 63).
  constexpr bool SPLIT = v::kTwoPasses && HB > 0 && (SCALED || !T.k8);
  constexpr int RUN_SPLIT = HB == 2 ? 2 : 4;
  const int64_t K = qx.K, nb = qx.nb;
  const bool fetch = ahead.bytes == 0;  // one pass over these columns (see kKPrefetch)
  VF facc[MR];
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) facc[r] = v::zero();
  for (int64_t b = 0; b < nb; ++b) {
    ahead.touch(b, nb);
    const uint8_t *blk = g + b * w * B;
    const uint8_t *scl = blk + SB * DS * 4 * w;  // the K-quants' scale dwords
    VI isum[MR][1];
    fill(isum, v::izero());
    const auto sub = [&](int j) __attribute__((always_inline)) {
      const uint8_t *sb = blk + j * DS * 4 * w;
      if (fetch) prefetch_share(blk + kKPrefetch, int64_t{B} * w, j, SB);  // sub-block j's share, a block ahead
      const int8_t *xq = qx.q.data() + m0 * K + b * SB * 32 + 32 * j;
      VI h0 = v::izero(), h1 = v::izero();
      if constexpr (HB >= 1) h0 = load_q<FULL>(sb + 16 * w, w);
      if constexpr (HB == 2) h1 = load_q<FULL>(sb + 20 * w, w);
      ScaleOf<SCALED> s_lo{}, s_hi{};  // the sub-block's scales (Q6_K: of its halves)
      const auto scales = [&]() __attribute__((always_inline)) {
        if constexpr (T.scale_dwords > 0) {
          const VI sd = scale_dword<T, FULL>(scl, j, w);
          s_lo = scale_of<T, SCALED>(sd, j, 0);
          if constexpr (T.halves) s_hi = scale_of<T, SCALED>(sd, j, 1);
        }
      };
      if constexpr (SCALED) scales();  // else after the sums (fewer registers live across them)
      if constexpr (SPLIT) {
        _Pragma("GCC unroll 2") for (int half = 0; half < 2; ++half) {
          v::NibAcc acc[MR];
          _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) acc[r] = v::nib_zero();
          _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) {
            const VI raw = load_q<FULL>(sb + t * 4 * w, w);
            VI u;  // the pass's quants of weights 4t.. (half 0) or 16 + 4t.. (half 1)
            if constexpr (HB == 2) {
              u = v::bor(half == 0 ? v::nib_lo(raw) : v::nib_hi(raw), high_bits<2, false>(half == 0 ? h0 : h1, t));
            } else {
              u = half == 0 ? v::bor(v::nib_lo(raw), high_bits<1, false>(h0, t))
                            : v::bor(v::nib_hi(raw), high_bits<1, true>(h0, t));
            }
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
              acc[r] = v::nib_add(acc[r], u, v::bcast4(xq + r * K + 16 * half + 4 * t));
            if ((t + 1) % RUN_SPLIT == 0) {
              _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
                if constexpr (SCALED)
                  isum[r][0] = v::nib_widen_scaled(isum[r][0], acc[r], half == 0 || !T.halves ? s_lo : s_hi);
                else isum[r][0] = v::nib_widen(isum[r][0], acc[r]);
                acc[r] = v::nib_zero();
              }
            }
          }
        }
        return;
      }
      VI dlo[MR], dhi[MR];
      v::NibAcc nlo[MR], nhi[MR];
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
        dlo[r] = dhi[r] = v::izero();
        nlo[r] = nhi[r] = v::nib_zero();
      }
      _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) {
        const VI raw = load_q<FULL>(sb + t * 4 * w, w);
        VI lo = v::nib_lo(raw), hi = v::nib_hi(raw);
        if constexpr (HB == 1) {
          lo = v::bor(lo, high_bits<1, false>(h0, t));
          hi = v::bor(hi, high_bits<1, true>(h0, t));
        } else if constexpr (HB == 2) {
          lo = v::bor(lo, high_bits<2, false>(h0, t));
          hi = v::bor(hi, high_bits<2, true>(h1, t));
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
          const VI xl = v::bcast4(xq + r * K + 4 * t), xh = v::bcast4(xq + r * K + 16 + 4 * t);
          nlo[r] = v::nib_add(nlo[r], lo, xl);
          if constexpr (T.halves) nhi[r] = v::nib_add(nhi[r], hi, xh);
          else nlo[r] = v::nib_add(nlo[r], hi, xh);
        }
        if ((t + 1) % RUN == 0) {
          _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
            if constexpr (SCALED) isum[r][0] = v::nib_widen_scaled(isum[r][0], nlo[r], s_lo);
            else dlo[r] = v::nib_widen(dlo[r], nlo[r]);
            nlo[r] = v::nib_zero();
            if constexpr (T.halves) {
              if constexpr (SCALED) isum[r][0] = v::nib_widen_scaled(isum[r][0], nhi[r], s_hi);
              else dhi[r] = v::nib_widen(dhi[r], nhi[r]);
              nhi[r] = v::nib_zero();
            }
          }
        }
      }
      if constexpr (!T.k8) {
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) isum[r][0] = dlo[r];
      } else if constexpr (T.halves && !SCALED) {
        scales();
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
          const int32_t *bs = qx.s.data() + ((m0 + r) * nb + b) * 16 + 2 * j;
          isum[r][0] = v::iadd(isum[r][0], v::imul(s_lo, v::isub(dlo[r], 32 * bs[0])));
          isum[r][0] = v::iadd(isum[r][0], v::imul(s_hi, v::isub(dhi[r], 32 * bs[1])));
        }
      } else if constexpr (!SCALED) {
        scales();
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) isum[r][0] = v::iadd(isum[r][0], v::imul(s_lo, dlo[r]));
      }
    };
    // The loop over sub-blocks stays rolled for any row count: unrolled, GCC hoists every sub-block's scales and
    // spills them.
    _Pragma("GCC unroll 1") for (int j = 0; j < SB; ++j) sub(j);
    if constexpr (T.halves && SCALED)
      q6_bsums<MR, 1, FULL>(isum, scl, 0, w, qx.bp.data() + (m0 * nb + b) * kPairs + 4, nb * kPairs);
    const uint8_t *halves = scl + T.scale_dwords * 4 * w;
    const VF dw = load_h<FULL>(halves, w);
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
      const int64_t i = (m0 + r) * nb + b;
      facc[r] = scaled_sum(facc[r], dw, v::set1(qx.d[i]), offset_sum<T>(isum[r][0], qx.s[i]));
    }
    if constexpr (T.add_m) {
      const VF mw = load_h<FULL>(halves + 2 * w, w);
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
        facc[r] = v::fmadd(mw, v::set1(qx.sf[(m0 + r) * nb + b]), facc[r]);
    }
    if constexpr (T.sub_mins) {
      const KMins mins = KMins::of<FULL>(scl, halves, w);
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
        const int64_t i = (m0 + r) * nb + b;
        facc[r] = mins.sub(facc[r], qx.d[i], qx.bp.data() + i * kPairs);
      }
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
    store_out<FULL>(y + r * ldy, res == nullptr ? nullptr : res + r * ldy, facc[r], w);
}

// ktile2: the K-quants two full groups at a time, so each broadcast activation dword, each row's bsum pairs and d
// feed two groups: ktile's operations per output element, in its order (its SCALED form).
// Group n's bytes start at g + n * group_bytes. Q6_K's halves of 16 (their own scales) come one after the other,
// each through the 4 quant dwords again (L1), so one set of MR x NG accumulators is live instead of two (with two,
// GCC spills them); the float accumulators live in L1 too, touched once per super-block, their registers going to
// the sums.
template <int MR, int F>
void ktile2(const QX &qx, int64_t m0, const uint8_t *__restrict g, int64_t group_bytes, int /*w*/,
            const float *__restrict res, float *__restrict y, int64_t ldy, Ahead ahead) {
  static constexpr const Traits &T = kTraits[F];
  static_assert(T.k8 && v::kScaledWiden, "pair K-quant tiles take the scales as the sums widen");
  constexpr int w = kGroup, NG = 2, HB = T.high_dwords, DS = 4 + HB, B = T.packed_bytes;
  const int64_t K = qx.K, nb = qx.nb;
  alignas(64) float facc[MR][NG][kGroup];
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
    _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) v::store(facc[r][n], v::zero());
  for (int64_t b = 0; b < nb; ++b) {
    ahead.touch(b, nb);
    const uint8_t *blk = g + b * w * B;
    const uint8_t *scl = blk + 8 * DS * 4 * w;
    VI isum[MR][NG];
    fill(isum, v::izero());
    const auto sub = [&](int j) __attribute__((always_inline)) {
      const uint8_t *sb = blk + j * DS * 4 * w;
      const int8_t *xq = qx.q.data() + m0 * K + b * 256 + 32 * j;
      _Pragma("GCC unroll 2") for (int half = 0; half < (T.halves ? 2 : 1); ++half) {
        v::NibScale sc[NG];  // the half's scales (Q4_K, Q5_K: the sub-block's)
        VI hb[NG];           // Q5_K's / Q6_K's high bits
        _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) {
          sc[n] = scale_of<T, true>(scale_dword<T, true>(scl + n * group_bytes, j, w), j, half);
          hb[n] = v::izero();
          if constexpr (HB >= 1) hb[n] = load_q<true>(sb + n * group_bytes + (16 + 4 * half) * w, w);
        }
        v::NibAcc acc[MR][NG];
        fill(acc, v::nib_zero());
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) {
          VI lo[NG], hi[NG];  // Q6_K: lo is the half's quants (weights 4t.. or 16 + 4t..), hi unused
          _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) {
            const VI raw = load_q<true>(sb + n * group_bytes + t * 4 * w, w);
            if constexpr (T.halves) {
              lo[n] = v::bor(half == 0 ? v::nib_lo(raw) : v::nib_hi(raw), high_bits<2, false>(hb[n], t));
            } else {
              lo[n] = v::nib_lo(raw);
              hi[n] = v::nib_hi(raw);
              if constexpr (HB == 1) {
                lo[n] = v::bor(lo[n], high_bits<1, false>(hb[n], t));
                hi[n] = v::bor(hi[n], high_bits<1, true>(hb[n], t));
              }
            }
          }
          _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
            const VI xl = v::bcast4(xq + r * K + 16 * half + 4 * t);
            _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) acc[r][n] = v::nib_add(acc[r][n], lo[n], xl);
            if constexpr (!T.halves) {
              const VI xh = v::bcast4(xq + r * K + 16 + 4 * t);
              _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) acc[r][n] = v::nib_add(acc[r][n], hi[n], xh);
            }
          }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
          _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n)
            isum[r][n] = v::nib_widen_scaled(isum[r][n], acc[r][n], sc[n]);
      }
    };
    _Pragma("GCC unroll 1") for (int j = 0; j < 8; ++j) sub(j);
    if constexpr (T.halves)
      q6_bsums<MR, NG, true>(isum, scl, group_bytes, w, qx.bp.data() + (m0 * nb + b) * kPairs + 4, nb * kPairs);
    const uint8_t *halves = scl + 16 * w;
    VF dw[NG];
    _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) dw[n] = load_h<true>(halves + n * group_bytes, w);
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
      const VF dx = v::set1(qx.d[(m0 + r) * nb + b]);
      _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n)
        v::store(facc[r][n], scaled_sum(v::load(facc[r][n]), dw[n], dx, isum[r][n]));
    }
    if constexpr (T.sub_mins) {
      _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) {
        const KMins mins = KMins::of<true>(scl + n * group_bytes, halves + n * group_bytes, w);
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
          const int64_t i = (m0 + r) * nb + b;
          v::store(facc[r][n], mins.sub(v::load(facc[r][n]), qx.d[i], qx.bp.data() + i * kPairs));
        }
      }
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
    _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n)
      store_out<true>(y + r * ldy + kGroup * n, res == nullptr ? nullptr : res + r * ldy + kGroup * n,
                      v::load(facc[r][n]), w);
}

}  // namespace mindserve::q

#undef MINDSERVE_AI
