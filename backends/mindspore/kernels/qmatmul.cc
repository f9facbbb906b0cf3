// mindserve quantized matmul: y[M, N] = x[M, K] @ W (+ res), W in one of GGUF's 32-weight block formats,
// dequantized on the fly inside the dot product.
//
//   Q8_0  w = d * q,        q int8,  d fp16                (GGUF block: d, 32 x q        = 34 bytes)
//   Q4_0  w = d * (q - 8),  q 0..15, d fp16                (d, 16 bytes of nibbles       = 18 bytes)
//   Q4_1  w = d * q + m,    q 0..15, d, m fp16             (d, m, 16 bytes of nibbles    = 20 bytes)
//   Q5_0  w = d * (q - 16), q 0..31, d fp16               (d, 4 bytes of fifth bits, 16 of nibbles = 22 bytes)
//   Q5_1  w = d * q + m,    q 0..31, d, m fp16             (d, m, fifth bits, nibbles = 24 bytes)
// and the K-quants, super-blocks of 256 in sub-blocks (ggml-common.h):
//   Q4_K  w = d * sc_j * q - dmin * mn_j, q 0..15, 6-bit sc_j, mn_j per sub-block of 32   (144 bytes)
//   Q5_K  the same with q 0..31                                                         (176 bytes)
//   Q6_K  w = d * sc_j * (q - 32), q 0..63, int8 sc_j per sub-block of 16                (210 bytes)
// (GGUF nibble byte i of a block holds weight i in its low half and weight i + 16 in its high half.)
//
// Activations are quantized per row (quantize.h): blocks of 32 for the 32-weight formats, Q8_K for the K-quants.
// Each output element then is, over the blocks b = 0 .. K/32 - 1 in order (all float32, exact integer sums):
//   Q8_0, Q4_0: acc = fma(d_w * dx, (float)sum_k(q_k * qx_k) [- 8 sx for Q4_0], acc)
//   Q4_1:       acc = fma(d_w * dx, (float)sum_k(q_k * qx_k), acc);  acc = fma(m_w, sfx, acc)
// The Q5 formats as Q4_0 / Q4_1 (offset 16 for Q5_0, m for Q5_1); the K-quants per super-block (ktile below has
// the integer sums):
//   Q4_K, Q5_K: acc = fma(d_w * dx, (float)sum_j(sc_j * dot_j), acc);
//               acc = fnmadd(dmin_w * dx, (float)sum_j(mn_j * (bsum_2j + bsum_2j+1)), acc)
//   Q6_K:       acc = fma(d_w * dx, (float)sum_j(sc_j * (dot16_j - 32 bsum_j)), acc)
// and y = acc (+ res, added once at the end), then each row's LoRA delta (lora.h) when the LoRA inputs are
// given. This fixed sequence does not depend on M, on the other rows, on the thread count or on the tile
// shape (work is split over rows and over groups of 16 output columns, one or two at a time, never over K), so a row is
// bit-identical alone or batched. The integer sums are exact whatever instructions compute them, so every
// backend of vec.h (AVX-512 VNNI, AVX-512BW, AVX2, NEON with or without dotprod, scalar) gives identical bits.
//
// Packed weight (made once at load by prepare_qweight() in __init__.py), handed to MindSpore as uint8
// [1, (K/32) * B, N] with B the format's block bytes (34, 18, 20: the format is read from it). Columns are
// cut into groups of 16 (the last may be narrower, width w); group g starts at byte 16 * g * (K/32) * B and
// holds, for each block b in order, w * B bytes:
//   quants   D dwords per column, dword-major ([D][w] x 4 bytes): D = 8 for Q8_0 (dword j = weights 4j..4j+3,
//            stored as q + 128 so they are unsigned), D = 4 for Q4 (dword j = the GGUF nibble bytes 4j..4j+3:
//            low nibbles weights 4j.., high nibbles weights 16+4j..)
//   d        w fp16
//   m        w fp16 (Q4_1 only)
// so one 64-byte load gives one dword of each of 16 columns: the lanes of a VNNI dot product.
// The Q5 formats and the K-quants (packed bytes per column per block: Q5_0 22, Q5_1 24, Q4_K 148, Q5_K 180,
// Q6_K 210, the block being 32 weights or a super-block of 256) hold per block, for each sub-block of 32 in order:
//   nibbles  4 dwords per column as Q4's (the low 4 bits of each weight's q)
//   high     Q5: 1 dword, byte i bit t = bit 4 of weight 4t + i, bit 4 + t = that of weight 16 + 4t + i;
//            Q6_K: 2 dwords, dword h byte i bits 2t, 2t + 1 = bits 4, 5 of weight 16h + 4t + i; Q4_K: none
// then the K-quants' integer scales, 4 dwords per column (Q4_K, Q5_K: sc_0..7 then mn_0..7, one byte each;
// Q6_K: the 16 int8 sc), then d fp16, then Q5_1's m / Q4_K's and Q5_K's dmin fp16.
//
// A stack whose parts ship in different formats (Q4_K_M's Q4_K q and k beside a Q6_K v) is segmented: consecutive
// output columns [n0, n0 + cols) per format, each packed as above on its own (groups of 16 restart at n0), behind a
// table. Such a weight is [1, L, N] with L odd (a single format's L is even: every packed block size is), its
// bytes: int32 magic "MSQS", int32 count S (2..8), then per segment int32 format code, int32 cols, int64 byte offset
// of its packing (the end of the table or of the segment before, rounded up to 64; cols summing to N); L is the
// least odd length that holds them (kernels.prepare_qstack), so a table read with another K is refused. Each
// segment's columns are computed by its format's tiles from its own kind of activation quantization (Q8_K or the
// 32-blocks', each made once per call), so every output element has the bits it has when its part is multiplied
// alone.
//
// The instruction set is the build variant's (build.py): vec.h's dot_nib / dot_q8 are vpdpbusd with AVX-512
// VNNI, vpmaddubsw + vpmaddwd with AVX-512BW or AVX2, sdot with NEON dotprod, widening multiplies on plain
// NEON. mindserve_qmatmul_isa() says which.
//
// Exported: mindserve_qmatmul_raw(x, w_packed, fmt, res, y, M, K, N) (tests; fmt 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_0,
// 4 Q5_1, 5 Q4_K, 6 Q5_K, 7 Q6_K), mindserve_qmatmul_packed_raw(x, w_packed, L, res, y, M, K, N) (either kind
// of weight, as the AOT entry reads it), mindserve_qmatmul_isa(); the AOT path is qmatmul_entry()
// (qmatmul.h), reached through MindserveMatMul / MindserveMatMulAdd with a uint8 weight.
#include "qmatmul.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "entry.h"
#include "kv_format.h"
#include "pool.h"
#include "vec.h"
#include "lora.h"
#include "quantize.h"

namespace {

using mindserve::kPairs;
using mindserve::QX;
using mindserve::quantize_rows;
using mindserve::quantize_rows_k;

enum Fmt { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ5_0 = 3, kQ5_1 = 4, kQ4_K = 5, kQ5_K = 6, kQ6_K = 7, kFormats = 8 };
constexpr int kBlockBytes[kFormats] = {34, 18, 20, 22, 24, 148, 180, 210};  // packed bytes per column per block
constexpr bool is_k(int f) { return f >= kQ4_K; }
constexpr int block_size(int f) { return is_k(f) ? 256 : 32; }
constexpr int kGroup = 16;  // output columns per group (one vector of lanes)

// ---------------------------------------------------------------------------------------------
// 16 lanes of int32 / float32: vec.h. FULL: all 16 columns of a group, else the first w.
namespace v = mindserve::vec;
constexpr int kMaxMR = v::kQRows;    // rows per tile of one group of columns
constexpr int kMaxMR2 = v::kQRows2;  // rows per tile of two groups (0: the backend has no pair tiles)
constexpr int kMaxKMR2 = v::kKRows2;  // ... of two groups of a K-quant (0: none)
static_assert(kMaxMR2 <= kMaxMR && kMaxKMR2 <= kMaxMR, "a tile table row holds kMaxMR");
using VI = v::I32x16;
using VF = v::F32x16;
template <bool FULL>
inline VI load_q(const uint8_t *p, int w) {
  if constexpr (FULL) return v::load_bytes(p);
  return v::load_bytes_part(p, w);
}
template <bool FULL>
inline VF load_h(const uint8_t *p, int w) {
  if constexpr (FULL) return v::load_f16(p);
  return v::load_f16_part(p, w);
}
template <bool FULL>
inline VF load_f(const float *p, int w) {
  if constexpr (FULL) return v::load(p);
  return v::load_part(p, w);
}
template <bool FULL>
inline void store_f(float *p, VF a, int w) {
  if constexpr (FULL) v::store(p, a);
  else v::store_part(p, a, w);
}

// ---------------------------------------------------------------------------------------------
// The weight bytes a tile asks the cache for while it computes (none: bytes == 0): a slice of the next
// columns' weights, spread over the tile's blocks, so their first pass does not wait for memory.
struct Ahead {
  const uint8_t *p = nullptr;
  int64_t bytes = 0;
  inline void touch(int64_t b, int64_t nb) const {
    for (int64_t o = bytes * b / nb & ~int64_t{63}; o < bytes * (b + 1) / nb; o += 64)
      __builtin_prefetch(p + o, 0, 3);  // a hint: never faults, changes no result
  }
};

// ---------------------------------------------------------------------------------------------
// Register tile: rows [m0, m0 + MR) times NG groups of columns over every block: NG == 2 takes two full groups
// (g, and g + group_bytes), so every broadcast activation dword and scale feeds two dot products; NG == 1 one
// group of w columns (FULL: w == 16). Each output element sees the same operations either way.
template <int MR, int NG, int F, bool FULL>
void tile(const QX &qx, int64_t m0, const uint8_t *__restrict g, int64_t group_bytes, int w,
          const float *__restrict res, float *__restrict y, int64_t ldy, Ahead ahead) {
  constexpr int D = F == kQ8_0 ? 8 : 4;  // quant dwords per column per block
  constexpr int B = kBlockBytes[F];
  const int64_t K = qx.K, nb = qx.nb;
  VF facc[MR][NG];
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
    _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) facc[r][n] = v::zero();
  for (int64_t b = 0; b < nb; ++b) {
    ahead.touch(b, nb);
    const uint8_t *blk = g + b * w * B;
    const int8_t *xq = qx.q.data() + m0 * K + 32 * b;
    VI iacc[MR][NG];
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
      _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) iacc[r][n] = v::izero();
    v::NibAcc nacc[MR][NG];
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
      _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) nacc[r][n] = v::nib_zero();
    // Quant dword j of each column, for every row of the tile.
    const auto dword = [&](int j) __attribute__((always_inline)) {
      VI raw[NG];
      _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) raw[n] = load_q<FULL>(blk + n * group_bytes + j * 4 * w, w);
      if constexpr (F == kQ8_0) {
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
    if constexpr (F != kQ8_0) {  // D = 4 dwords x 2 halves: the 8 nibble sums NibAcc holds
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
        _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) iacc[r][n] = v::nib_widen(iacc[r][n], nacc[r][n]);
    }
    VF dw[NG];
    _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) dw[n] = load_h<FULL>(blk + n * group_bytes + D * 4 * w, w);
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
      const int64_t i = (m0 + r) * nb + b;
      const VF dx = v::set1(qx.d[i]);
      _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) {
        VI isum = iacc[r][n];
        if constexpr (F == kQ8_0 && v::kQ8Bias != 0) isum = v::isub(isum, v::kQ8Bias * qx.s[i]);
        if constexpr (F == kQ4_0) isum = v::isub(isum, 8 * qx.s[i]);
        facc[r][n] = v::fmadd(v::mul(dw[n], dx), v::to_f(isum), facc[r][n]);
      }
    }
    if constexpr (F == kQ4_1) {
      VF mw[NG];
      _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n)
        mw[n] = load_h<FULL>(blk + n * group_bytes + D * 4 * w + 2 * w, w);
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
        const VF sf = v::set1(qx.sf[(m0 + r) * nb + b]);
        _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) facc[r][n] = v::fmadd(mw[n], sf, facc[r][n]);
      }
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
    _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) {
      VF a = facc[r][n];
      if (res != nullptr) a = v::add(a, load_f<FULL>(res + r * ldy + kGroup * n, w));
      store_f<FULL>(y + r * ldy + kGroup * n, a, w);
    }
  }
}

// How far ahead of its reads a one-pass ktile (M below a tile's rows, e.g. decode's M=1) asks for weight bytes.
// The hardware prefetcher alone kept AVX2 Q4_K at M=1 to 12 GB/s (Q4_1's tile streams 27 GB/s without help);
// measured on a 2048 x 16384 Q4_K matrix, AVX2, one thread: none 1.52 ms, 2368 bytes (one super-block) 1.12,
// 9472 bytes 0.64-0.75, 18944 bytes 0.53-0.61 (Q6_K: 1.94, 0.77, 0.96). Several passes (M above a tile's rows)
// prefetch for each other through run_chunk's Ahead instead.
constexpr int64_t kKPrefetch = 9472;

// The 5- and 6-bit formats and the K-quants: one group of columns, MR rows. Per block b (32 weights for Q5_0 /
// Q5_1, a super-block of 256 for the K-quants) and per sub-block j of 32 in order, the quants u (low nibble | high
// bits << 4) dotted with the activations in int16 pairs (NibAcc), widened to int32 before they could overflow;
// then, all exact in int32:
//   Q5_0, Q5_1:  isum = dot                        (Q5_0: - 16 sx)
//   Q4_K, Q5_K:  isum += sc_j * dot_j,    imin += mn_j * (bsum_2j + bsum_2j+1)
//   Q6_K:        isum += sc_2j * (dot_lo - 32 bsum_2j) + sc_2j+1 * (dot_hi - 32 bsum_2j+1)   (halves of 16)
// and per block: acc = fma(d_w * dx, (float)isum, acc); Q5_1: acc = fma(m_w, sfx, acc);
// Q4_K, Q5_K: acc = fnmadd(dmin_w * dx, (float)imin, acc).
template <int MR, int F, bool FULL>
void ktile(const QX &qx, int64_t m0, const uint8_t *__restrict g, int64_t /*group_bytes*/, int w_,
           const float *__restrict res, float *__restrict y, int64_t ldy, Ahead ahead) {
  // A full group's width as a constant: every dword offset below is then an immediate. (With the run-time width,
  // GCC kept the unrolled super-block's 40-odd offsets in registers and spilled them: AVX2 Q4_K M=1 was 2.3x Q4_1.)
  const int w = FULL ? kGroup : w_;
  constexpr int SB = is_k(F) ? 8 : 1;                             // sub-blocks of 32 per block
  constexpr int HB = F == kQ4_K ? 0 : (F == kQ6_K ? 2 : 1);       // high-bit dwords per sub-block
  constexpr int DS = 4 + HB;                                      // dwords per sub-block
  constexpr int SC = is_k(F) ? 4 : 0;                             // integer scale dwords per block
  constexpr int B = kBlockBytes[F];
  constexpr int RUN = HB == 0 || v::kNibI32 ? 4 : 2;  // quant dwords summed in int16 before widening (vec.h: NibAcc)
  // Where NibAcc is int32 (VNNI, NEON, scalar), the K-quants' scales multiply the sums as they widen (Q6_K: once per
  // half of 16, RUN 4) and Q6_K's -32 bsum term comes once per super-block (int16 pair products, vec.h's dot_i16).
  // With AVX2's int16 pairs both were slower (measured M=16, 1.7B shapes: Q4_K +9%, Q6_K +13% against the scales
  // after widening and the bsum per half), so there they stay so. With the mins as pair products too (below),
  // bench/qmatmul_step.py --rows 16 --shape 2048,8192 --layers 2, one thread, fastest step before -> after:
  // v4-vnni Q4_K 8.79 -> 7.77 ms, Q6_K 12.96 -> 10.55; v3 Q4_K 22.21 -> 21.18, Q6_K 26.49 -> 26.36; M=1 unchanged.
  constexpr bool SCALED = is_k(F) && v::kNibI32;
  const int64_t K = qx.K, nb = qx.nb;
  const bool fetch = ahead.bytes == 0;  // one pass over these columns (see kKPrefetch)
  VF facc[MR];
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) facc[r] = v::zero();
  for (int64_t b = 0; b < nb; ++b) {
    ahead.touch(b, nb);
    const uint8_t *blk = g + b * w * B;
    const uint8_t *scl = blk + SB * DS * 4 * w;  // the K-quants' scale dwords
    VI isum[MR];
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) isum[r] = v::izero();
    const auto sub = [&](int j) __attribute__((always_inline)) {
      const uint8_t *sb = blk + j * DS * 4 * w;
      if (fetch) {  // sub-block j's share of the block kKPrefetch bytes ahead (a hint: never faults, changes no result)
        const int64_t span = int64_t{B} * w;
        for (int64_t o = span * j / SB & ~int64_t{63}; o < span * (j + 1) / SB; o += 64)
          __builtin_prefetch(blk + kKPrefetch + o, 0, 3);
      }
      const int8_t *xq = qx.q.data() + m0 * K + b * SB * 32 + 32 * j;
      VI h0 = v::izero(), h1 = v::izero();
      if constexpr (HB >= 1) h0 = load_q<FULL>(sb + 16 * w, w);
      if constexpr (HB == 2) h1 = load_q<FULL>(sb + 20 * w, w);
      VI s_lo = v::izero(), s_hi = v::izero();  // the sub-block's scales (Q6_K: of its halves)
      const auto scales = [&]() __attribute__((always_inline)) {
        if constexpr (F == kQ6_K) {
          const VI sd = load_q<FULL>(scl + (j / 2) * 4 * w, w);
          s_lo = v::lane_i8(sd, 2 * (j % 2));
          s_hi = v::lane_i8(sd, 2 * (j % 2) + 1);
        } else if constexpr (F == kQ4_K || F == kQ5_K) {
          s_lo = v::lane_i8(load_q<FULL>(scl + (j / 4) * 4 * w, w), j % 4);
        }
      };
      if constexpr (SCALED) scales();  // else after the sums (AVX2: 4 ymm fewer live across them)
      VI dlo[MR], dhi[MR];
      v::NibAcc nlo[MR], nhi[MR];
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
        dlo[r] = dhi[r] = v::izero();
        nlo[r] = nhi[r] = v::nib_zero();
      }
      _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) {
        const VI raw = load_q<FULL>(sb + t * 4 * w, w);
        VI lo = v::nib_lo(raw), hi = v::nib_hi(raw);
        if constexpr (HB == 1) {  // byte i: bit t = weight 4t + i, bit 4 + t = weight 16 + 4t + i
          lo = v::bor(lo, v::shl_and(h0, 4 - t, 0x10));
          hi = v::bor(hi, v::shr_and(h0, t, 0x10));
        } else if constexpr (HB == 2) {  // h0 / h1 byte i: bits 2t, 2t + 1 = weight 4t + i / 16 + 4t + i
          if (t < 2) {
            lo = v::bor(lo, v::shl_and(h0, 4 - 2 * t, 0x30));
            hi = v::bor(hi, v::shl_and(h1, 4 - 2 * t, 0x30));
          } else {
            lo = v::bor(lo, v::shr_and(h0, 2 * t - 4, 0x30));
            hi = v::bor(hi, v::shr_and(h1, 2 * t - 4, 0x30));
          }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
          const VI xl = v::bcast4(xq + r * K + 4 * t), xh = v::bcast4(xq + r * K + 16 + 4 * t);
          nlo[r] = v::nib_add(nlo[r], lo, xl);
          if constexpr (F == kQ6_K) nhi[r] = v::nib_add(nhi[r], hi, xh);
          else nlo[r] = v::nib_add(nlo[r], hi, xh);
        }
        if ((t + 1) % RUN == 0) {
          _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
            if constexpr (SCALED) isum[r] = v::nib_widen_scaled(isum[r], nlo[r], s_lo);
            else dlo[r] = v::nib_widen(dlo[r], nlo[r]);
            nlo[r] = v::nib_zero();
            if constexpr (F == kQ6_K) {
              if constexpr (SCALED) isum[r] = v::nib_widen_scaled(isum[r], nhi[r], s_hi);
              else dhi[r] = v::nib_widen(dhi[r], nhi[r]);
              nhi[r] = v::nib_zero();
            }
          }
        }
      }
      if constexpr (F == kQ5_0 || F == kQ5_1) {
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) isum[r] = dlo[r];
      } else if constexpr (F == kQ6_K && !SCALED) {
        scales();
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
          const int32_t *bs = qx.s.data() + ((m0 + r) * nb + b) * 16 + 2 * j;
          isum[r] = v::iadd(isum[r], v::imul(s_lo, v::isub(dlo[r], 32 * bs[0])));
          isum[r] = v::iadd(isum[r], v::imul(s_hi, v::isub(dhi[r], 32 * bs[1])));
        }
      } else if constexpr (!SCALED) {
        scales();
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) isum[r] = v::iadd(isum[r], v::imul(s_lo, dlo[r]));
      }
    };
    // The loop over sub-blocks stays rolled for any row count (M=16: 3.2 ms rolled, 4.4 unrolled). At M=1, with
    // a full group's constant width, measured on AVX2 (bench/qmatmul_step.py, 1.7B shapes, 2 layers): rolled Q6_K
    // 10.5 -> 7.8 ms, Q4_K 5.5 -> 5.2 ms (unrolled, GCC hoists every sub-block's scales and spills them).
    _Pragma("GCC unroll 1") for (int j = 0; j < SB; ++j) sub(j);
    // + sum_i (32 sc_i) (-bsum_i), int16 pairs (|32 sc_i| <= 4096): 8 pair products a row
    if constexpr (F == kQ6_K && SCALED) {
      const int32_t *bp = qx.bp.data() + (m0 * nb + b) * kPairs + 4;
      _Pragma("GCC unroll 8") for (int k = 0; k < 8; ++k) {  // one scale pair at a time: AVX2 holds no 8 of them
        const VI sp = v::pairs_i8x32(load_q<FULL>(scl + (k / 2) * 4 * w, w), k % 2);
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
          isum[r] = v::dot_i16(isum[r], sp, v::iset1(bp[r * nb * kPairs + k]));
      }
    }
    const uint8_t *halves = scl + SC * 4 * w;
    const VF dw = load_h<FULL>(halves, w);
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
      const int64_t i = (m0 + r) * nb + b;
      const VF dx = v::set1(qx.d[i]);
      VI is = isum[r];
      if constexpr (F == kQ5_0) is = v::isub(is, 16 * qx.s[i]);
      facc[r] = v::fmadd(v::mul(dw, dx), v::to_f(is), facc[r]);
    }
    if constexpr (F == kQ5_1) {
      const VF mw = load_h<FULL>(halves + 2 * w, w);
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
        facc[r] = v::fmadd(mw, v::set1(qx.sf[(m0 + r) * nb + b]), facc[r]);
    }
    if constexpr (F == kQ4_K || F == kQ5_K) {  // the mins: 4 int16 pair products a row (were 8 vpmulld + 8 adds)
      const VF dmin = load_h<FULL>(halves + 2 * w, w);
      const VI mlo = load_q<FULL>(scl + 8 * w, w), mhi = load_q<FULL>(scl + 12 * w, w);
      const VI mp[4] = {v::pairs_u8(mlo, 0), v::pairs_u8(mlo, 1), v::pairs_u8(mhi, 0), v::pairs_u8(mhi, 1)};
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
        const int32_t *bp = qx.bp.data() + ((m0 + r) * nb + b) * kPairs;
        VI imin = v::izero();
        _Pragma("GCC unroll 4") for (int k = 0; k < 4; ++k) imin = v::dot_i16(imin, mp[k], v::iset1(bp[k]));
        facc[r] = v::fnmadd(v::mul(dmin, v::set1(qx.d[(m0 + r) * nb + b])), v::to_f(imin), facc[r]);
      }
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
    VF a = facc[r];
    if (res != nullptr) a = v::add(a, load_f<FULL>(res + r * ldy, w));
    store_f<FULL>(y + r * ldy, a, w);
  }
}

// The K-quants two full groups at a time where the backend has such tiles (v::kKRows2 > 0: AVX-512 VNNI), so each
// broadcast activation dword, each row's bsum pairs and d feed two groups: ktile's operations per output element,
// in its order (its SCALED form: NibAcc is int32 there). Group n's bytes start at g + n * group_bytes. Measured
// (bench/qmatmul_step.py --rows 16 --threads 1 --shape 2048,8192 --layers 2, v4-vnni, fastest step, one group of 8
// rows -> two groups of 4): Q4_K 7.77 -> 6.16 ms, Q6_K 10.55 -> 9.48 (main before both changes: 8.43, 12.01).
template <int MR, int F>
void ktile2(const QX &qx, int64_t m0, const uint8_t *__restrict g, int64_t group_bytes, int /*w*/,
            const float *__restrict res, float *__restrict y, int64_t ldy, Ahead ahead) {
  static_assert(is_k(F) && v::kNibI32, "pair K-quant tiles take the scales as the sums widen");
  constexpr int w = kGroup;
  constexpr int NG = 2;
  constexpr int HB = F == kQ4_K ? 0 : (F == kQ6_K ? 2 : 1);
  constexpr int DS = 4 + HB, B = kBlockBytes[F];
  const int64_t K = qx.K, nb = qx.nb;
  alignas(64) float facc[MR][NG][kGroup];  // in L1, touched once per super-block: its registers go to the sums
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
    _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) v::store(facc[r][n], v::zero());
  for (int64_t b = 0; b < nb; ++b) {
    ahead.touch(b, nb);
    const uint8_t *blk = g + b * w * B;
    const uint8_t *scl = blk + 8 * DS * 4 * w;
    VI isum[MR][NG];
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
      _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) isum[r][n] = v::izero();
    const auto sub = [&](int j) __attribute__((always_inline)) {
      const uint8_t *sb = blk + j * DS * 4 * w;
      const int8_t *xq = qx.q.data() + m0 * K + b * 256 + 32 * j;
      // Q6_K's halves of 16 (their own scales) one after the other, each through the 4 quant dwords again (L1), so
      // one set of MR x NG accumulators is live instead of two (with two, GCC spilled them); the same integer sums.
      // With facc in L1 as well, bench/qmatmul_step.py --threads 1 --shape 2048,8192 --layers 2 (v4-vnni, fastest
      // step, alternated with the one-pass tile): Q6_K M=8 5.62 -> 5.40 ms, M=16 9.64 -> 9.25, M=80 51.9 -> 49.0;
      // Q4_K M=16 6.42 -> 6.39, M=80 34.5 -> 32.6. (Also tried, no gain: separate sums for the low and high
      // nibbles, the scale as vpdpwssd on half sub-blocks instead of vpmulld, four groups a tile, one group of 8
      // rows for Q6_K; removing the scale multiply altogether would save 12% of Q4_K's M=80 time.)
      _Pragma("GCC unroll 2") for (int half = 0; half < (F == kQ6_K ? 2 : 1); ++half) {
        VI sc[NG], hb[NG];  // the half's scales (Q4_K, Q5_K: the sub-block's) and Q5_K's / Q6_K's high bits
        _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) {
          if constexpr (F == kQ6_K)
            sc[n] = v::lane_i8(load_q<true>(scl + n * group_bytes + (j / 2) * 4 * w, w), 2 * (j % 2) + half);
          else
            sc[n] = v::lane_i8(load_q<true>(scl + n * group_bytes + (j / 4) * 4 * w, w), j % 4);
          hb[n] = v::izero();
          if constexpr (HB >= 1) hb[n] = load_q<true>(sb + n * group_bytes + (16 + 4 * half) * w, w);
        }
        v::NibAcc acc[MR][NG];
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
          _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) acc[r][n] = v::nib_zero();
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) {
          VI lo[NG], hi[NG];  // Q6_K: lo is the half's quants (weights 4t.. or 16 + 4t..), hi unused
          _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) {
            const VI raw = load_q<true>(sb + n * group_bytes + t * 4 * w, w);
            if constexpr (F == kQ6_K) {  // hb byte i: bits 2t, 2t + 1 = bits 4, 5 of the half's weight 4t + i
              lo[n] = half == 0 ? v::nib_lo(raw) : v::nib_hi(raw);
              lo[n] = v::bor(lo[n], t < 2 ? v::shl_and(hb[n], 4 - 2 * t, 0x30) : v::shr_and(hb[n], 2 * t - 4, 0x30));
            } else {
              lo[n] = v::nib_lo(raw);
              hi[n] = v::nib_hi(raw);
              if constexpr (HB == 1) {  // byte i: bit t = weight 4t + i, bit 4 + t = weight 16 + 4t + i
                lo[n] = v::bor(lo[n], v::shl_and(hb[n], 4 - t, 0x10));
                hi[n] = v::bor(hi[n], v::shr_and(hb[n], t, 0x10));
              }
            }
          }
          _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
            const VI xl = v::bcast4(xq + r * K + 16 * half + 4 * t);
            _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) acc[r][n] = v::nib_add(acc[r][n], lo[n], xl);
            if constexpr (F != kQ6_K) {
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
    if constexpr (F == kQ6_K) {
      const int32_t *bp = qx.bp.data() + (m0 * nb + b) * kPairs + 4;
      _Pragma("GCC unroll 8") for (int k = 0; k < 8; ++k) {
        VI sp[NG];
        _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n)
          sp[n] = v::pairs_i8x32(load_q<true>(scl + n * group_bytes + (k / 2) * 4 * w, w), k % 2);
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
          const VI q = v::iset1(bp[r * nb * kPairs + k]);
          _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) isum[r][n] = v::dot_i16(isum[r][n], sp[n], q);
        }
      }
    }
    const uint8_t *halves = scl + 16 * w;
    VF dw[NG];
    _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) dw[n] = load_h<true>(halves + n * group_bytes, w);
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
      const VF dx = v::set1(qx.d[(m0 + r) * nb + b]);
      _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n)
        v::store(facc[r][n], v::fmadd(v::mul(dw[n], dx), v::to_f(isum[r][n]), v::load(facc[r][n])));
    }
    if constexpr (F == kQ4_K || F == kQ5_K) {
      _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) {
        const VF dmin = load_h<true>(halves + n * group_bytes + 2 * w, w);
        const uint8_t *sn = scl + n * group_bytes;
        const VI mlo = load_q<true>(sn + 8 * w, w), mhi = load_q<true>(sn + 12 * w, w);
        const VI mp[4] = {v::pairs_u8(mlo, 0), v::pairs_u8(mlo, 1), v::pairs_u8(mhi, 0), v::pairs_u8(mhi, 1)};
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
          const int32_t *bp = qx.bp.data() + ((m0 + r) * nb + b) * kPairs;
          VI imin = v::izero();
          _Pragma("GCC unroll 4") for (int k = 0; k < 4; ++k) imin = v::dot_i16(imin, mp[k], v::iset1(bp[k]));
          v::store(facc[r][n], v::fnmadd(v::mul(dmin, v::set1(qx.d[(m0 + r) * nb + b])), v::to_f(imin),
                                         v::load(facc[r][n])));
        }
      }
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
    _Pragma("GCC unroll 2") for (int n = 0; n < NG; ++n) {
      VF a = v::load(facc[r][n]);
      if (res != nullptr) a = v::add(a, v::load(res + r * ldy + kGroup * n));
      v::store(y + r * ldy + kGroup * n, a);
    }
  }
}

using TileFn = void (*)(const QX &, int64_t, const uint8_t *, int64_t, int, const float *, float *, int64_t, Ahead);

template <int NG, int F, bool FULL, int... MRs>
constexpr void fill_rows(TileFn *row, std::integer_sequence<int, MRs...>) {
  ((row[MRs] = &tile<MRs + 1, NG, F, FULL>), ...);
}
template <int F, bool FULL, int... MRs>
constexpr void fill_krows(TileFn *row, std::integer_sequence<int, MRs...>) {
  ((row[MRs] = &ktile<MRs + 1, F, FULL>), ...);
}
template <int F, int... MRs>
constexpr void fill_kpairs(TileFn *row, std::integer_sequence<int, MRs...>) {
  ((row[MRs] = &ktile2<MRs + 1, F>), ...);
}
template <int F>
constexpr void fill_format(TileFn (*t)[kMaxMR]) {
  if constexpr (F <= kQ4_1) {
    fill_rows<1, F, false>(t[0], std::make_integer_sequence<int, kMaxMR>{});
    fill_rows<1, F, true>(t[1], std::make_integer_sequence<int, kMaxMR>{});
    fill_rows<2, F, true>(t[2], std::make_integer_sequence<int, kMaxMR2>{});
  } else {  // one group at a time; the K-quants two where the backend has such tiles
    fill_krows<F, false>(t[0], std::make_integer_sequence<int, kMaxMR>{});
    fill_krows<F, true>(t[1], std::make_integer_sequence<int, kMaxMR>{});
    if constexpr (is_k(F) && kMaxKMR2 > 0) fill_kpairs<F>(t[2], std::make_integer_sequence<int, kMaxKMR2>{});
  }
}
struct Tiles {
  TileFn fn[kFormats][3][kMaxMR]{};  // [format][0 one partial group, 1 one full group, 2 two full groups][rows - 1]
  constexpr Tiles() {
    fill_format<kQ8_0>(fn[kQ8_0]);
    fill_format<kQ4_0>(fn[kQ4_0]);
    fill_format<kQ4_1>(fn[kQ4_1]);
    fill_format<kQ5_0>(fn[kQ5_0]);
    fill_format<kQ5_1>(fn[kQ5_1]);
    fill_format<kQ4_K>(fn[kQ4_K]);
    fill_format<kQ5_K>(fn[kQ5_K]);
    fill_format<kQ6_K>(fn[kQ6_K]);
  }
};
constexpr Tiles kTiles{};

// The columns [0, N) of one weight (or of one segment, the output's columns [n0, n0 + N): y and res point at column
// n0 of row 0) in one format; rows of y and res are ldy apart.
struct Job {
  const QX *qx;
  const uint8_t *w;
  const float *res;
  float *y;
  int64_t M, N, ldy;
  int fmt;
  int64_t groups, nchunks;
};

// Rows [0, M) cut into nearly equal blocks of at most `most` rows: block b of n has (M - m) / (n - b) rows;
// fn(m, rows, b, n).
template <typename Fn>
inline void row_blocks(int64_t M, int most, Fn &&fn) {
  const int64_t nblocks = (M + most - 1) / most;
  int64_t m = 0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t rows = (M - m) / (nblocks - b);
    fn(m, rows, b, nblocks);
    m += rows;
  }
}

// Output columns of groups [g0, g1) for every row; full groups two at a time where the backend has pair tiles
// (a pair never straddles chunks). When several row blocks pass over a step's columns (a group or a pair),
// they prefetch the next step's weights, each block its share: measured at M=16 on a model's worth of
// weights (which never stay in cache from one step to the next), the first pass otherwise waits on memory
// (-8% AVX2, -17% AVX-512 VNNI time); with one pass of one group the hardware prefetcher does better alone
// (+15% if added), but one pass of pairs (two weight streams) waits on memory without it: measured (AVX-512
// VNNI, Zen 5, one thread, the default model's Q4_1 matmuls, bench/qmatmul_step.py, side by side) M=2 6.23 ->
// 4.81 ms, M=4 6.56 -> 4.83, M=6 8.56 -> 5.77 (M=1 4.33 and M=8, two passes, 6.14 unchanged): the speculative
// verify rows of 2 and 4 tokens and small decode batches.
void run_chunk(const void *ctx, int64_t c) {
  const Job &j = *static_cast<const Job *>(ctx);
  const int64_t g0 = j.groups * c / j.nchunks, g1 = j.groups * (c + 1) / j.nchunks;
  const int64_t group_bytes = int64_t{kGroup} * j.qx->nb * kBlockBytes[j.fmt];
  for (int64_t g = g0; g < g1;) {
    const int64_t n0 = g * kGroup;
    const int w = static_cast<int>(std::min<int64_t>(kGroup, j.N - n0));
    // Rows of a pair tile (0: none). A K-quant pair only when it takes several passes: in one pass (M <= 4) the
    // two weight streams wait on memory (measured v4-vnni, 1.7B shapes, main's one group -> pairs: M=2 Q4_K 2.07 ->
    // 2.94 ms, Q6_K 2.91 -> 4.24; M=4 2.99 -> 3.49, 3.70 -> 5.93; M=8 4.43 -> 3.61, 6.53 -> 6.15); Q6_K's only from
    // M=8 (passes of 3 rows lose: M=6 4.81 -> 5.09 ms, Q4_K 3.52 -> 3.22).
    const int64_t kmin = j.fmt == kQ6_K ? 2 * kMaxKMR2 : kMaxKMR2 + 1;  // the fewest rows a K-quant pair takes
    const int most2 = is_k(j.fmt) ? (j.M >= kmin ? kMaxKMR2 : 0) : j.fmt <= kQ4_1 ? kMaxMR2 : 0;
    const bool pair = most2 > 0 && j.M > 1 && g + 1 < g1 && j.N - n0 >= 2 * kGroup;  // no gain for one row
    const int step = pair ? 2 : 1;
    const uint8_t *wg = j.w + g * group_bytes;
    const float *res = j.res == nullptr ? nullptr : j.res + n0;
    const int64_t next = std::min<int64_t>(step, g1 - g - step) * group_bytes;  // the next step's weight bytes
    row_blocks(j.M, pair ? most2 : kMaxMR, [&](int64_t m, int64_t rows, int64_t pass, int64_t passes) {
      const int64_t ahead = passes > 1 || pair ? next : 0;
      const Ahead a{wg + step * group_bytes + ahead * pass / passes, ahead * (pass + 1) / passes - ahead * pass / passes};
      const TileFn fn = pair ? kTiles.fn[j.fmt][2][rows - 1] : kTiles.fn[j.fmt][w == kGroup][rows - 1];
      fn(*j.qx, m, wg, group_bytes, w, res == nullptr ? nullptr : res + m * j.ldy, j.y + m * j.ldy + n0, j.ldy, a);
    });
    g += step;
  }
}

int64_t chunk_count(int64_t groups, int64_t bytes, int threads) {
  const int64_t per = std::clamp<int64_t>(bytes / (int64_t{128} << 10) / std::max(1, threads), 1, 8);
  return std::max<int64_t>(1, std::min<int64_t>({groups, threads * per, mindserve::kMaxChunks}));
}

// y = x @ W (+ res). K a multiple of the format's block size, fmt in 0..kFormats-1 (checked by the callers).
void qmatmul(const float *x, const uint8_t *w, int fmt, const float *res, float *y, int64_t M, int64_t K, int64_t N) {
  if (M <= 0 || N <= 0) return;
  mindserve::ScopeTimer timer(mindserve::kMatMul);
  if (K == 0) {
    if (res != nullptr) std::memcpy(y, res, sizeof(float) * M * N);
    else std::memset(y, 0, sizeof(float) * M * N);
    return;
  }
  QX qx;
  if (is_k(fmt)) quantize_rows_k(x, M, K, &qx);
  else quantize_rows(x, M, K, &qx);
  const int64_t groups = (N + kGroup - 1) / kGroup;
  Job job{&qx, w, res, y, M, N, N, fmt, groups, 1};
  job.nchunks = chunk_count(groups, N * qx.nb * kBlockBytes[fmt], mindserve::pool().threads());
  mindserve::pool().run(mindserve::Task{&run_chunk, &job, job.nchunks});
}

// A segmented weight's columns [n0, n0 + cols), in format fmt, packed at w (qmatmul.cc's header).
struct Segment {
  int fmt;
  int64_t n0, cols;
  const uint8_t *w;
};
constexpr int kMaxSegments = 8;
constexpr int32_t kSegMagic = 0x5351534D;  // "MSQS", little-endian

struct SegmentJobs {
  Job job[kMaxSegments];
  int64_t first[kMaxSegments + 1];  // segment s's chunks are [first[s], first[s + 1])
};

void run_segment_chunk(const void *ctx, int64_t c) {
  const SegmentJobs &j = *static_cast<const SegmentJobs *>(ctx);
  int s = 0;
  while (c >= j.first[s + 1]) ++s;
  run_chunk(&j.job[s], c - j.first[s]);
}

// y = x @ W (+ res) for a segmented W: x quantized once per kind its segments take (Q8_K for the K-quants, the
// 32-blocks' for the others), then every segment's chunks in one pool task, each writing its own columns of y.
// An output element sees only its segment's format's operations: the bits of its part multiplied alone.
void qmatmul_segments(const float *x, const Segment *seg, int count, const float *res, float *y, int64_t M, int64_t K,
                      int64_t N) {
  if (M <= 0 || N <= 0) return;
  mindserve::ScopeTimer timer(mindserve::kMatMul);
  bool blocks = false, supers = false;
  for (int s = 0; s < count; ++s) (is_k(seg[s].fmt) ? supers : blocks) = true;
  QX q32, qk;
  if (blocks) quantize_rows(x, M, K, &q32);
  if (supers) quantize_rows_k(x, M, K, &qk);
  SegmentJobs jobs;
  jobs.first[0] = 0;
  const int threads = mindserve::pool().threads();
  for (int s = 0; s < count; ++s) {
    const Segment &g = seg[s];
    const QX *qx = is_k(g.fmt) ? &qk : &q32;
    const int64_t groups = (g.cols + kGroup - 1) / kGroup;
    jobs.job[s] = Job{qx, g.w, res == nullptr ? nullptr : res + g.n0, y + g.n0, M, g.cols, N, g.fmt, groups, 1};
    jobs.job[s].nchunks = std::min<int64_t>(chunk_count(groups, g.cols * qx->nb * kBlockBytes[g.fmt], threads),
                                            mindserve::kMaxChunks / kMaxSegments);
    jobs.first[s + 1] = jobs.first[s] + jobs.job[s].nchunks;
  }
  mindserve::pool().run(mindserve::Task{&run_segment_chunk, &jobs, jobs.first[count]});
}

// The segment table of a packed weight of L * N bytes for x [.., K] (its count), or -1 if it is not a valid one.
int segments_of(const uint8_t *w, int64_t K, int64_t L, int64_t N, Segment *seg) {
  const int64_t size = L * N;
  if (K <= 0 || L % 2 == 0 || size < 8) return -1;
  int32_t head[2];
  std::memcpy(head, w, sizeof head);
  if (head[0] != kSegMagic || head[1] < 2 || head[1] > kMaxSegments || size < 8 + 16 * int64_t{head[1]}) return -1;
  int64_t end = 8 + 16 * int64_t{head[1]}, n0 = 0;
  for (int s = 0; s < head[1]; ++s) {
    int32_t fc[2];
    int64_t off;
    std::memcpy(fc, w + 8 + 16 * s, sizeof fc);
    std::memcpy(&off, w + 16 + 16 * s, sizeof off);
    const int f = fc[0];
    const int64_t cols = fc[1];
    if (f < 0 || f >= kFormats || K % block_size(f) != 0 || cols <= 0 || off != (end + 63) / 64 * 64) return -1;
    const int64_t bytes = cols * (K / block_size(f)) * kBlockBytes[f];
    if (off > size - bytes) return -1;
    seg[s] = Segment{f, n0, cols, w + off};
    end = off + bytes;
    n0 += cols;
  }
  return n0 == N && end > (L - 2) * N ? head[1] : -1;  // the least odd L: a table for another K does not fit
}

}  // namespace

namespace mindserve {

namespace {
// Format of a packed weight [1, L, N] for x [.., K]: L = (K / block size) * packed block bytes. -1 if none fits.
// (Unique: per 256 weights the formats take 272, 144, 160, 176, 192, 148, 180, 210 bytes.)
int format_of(int64_t K, int64_t L) {
  if (K <= 0) return -1;
  for (int f = 0; f < kFormats; ++f)
    if (K % block_size(f) == 0 && L == K / block_size(f) * kBlockBytes[f]) return f;
  return -1;
}

// y = x @ W (+ res) for a packed weight of either kind, [1, L, N]: 0, or 4 if L fits no format and the bytes are no
// segment table. A single format is found from L alone, as before segments (the hot path: one branch more).
int qmatmul_packed(const float *x, const uint8_t *w, int64_t L, const float *res, float *y, int64_t M, int64_t K,
                   int64_t N) {
  const int fmt = format_of(K, L);
  if (fmt >= 0) {
    qmatmul(x, w, fmt, res, y, M, K, N);
    return 0;
  }
  Segment seg[kMaxSegments];
  const int count = segments_of(w, K, L, N, seg);
  if (count < 0) return 4;
  qmatmul_segments(x, seg, count, res, y, M, K, N);
  return 0;
}

}  // namespace

int qmatmul_entry(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool add) {
  const int nin = add ? 3 : 2;
  const bool lora = nparam == nin + kLoraInputs + 1;
  if (nparam != nin + 1 && !lora) return 1;
  const int out = nparam - 1;
  if (!is_f32(dtypes[0]) || std::strcmp(dtypes[1], "uint8") != 0 || (add && !is_f32(dtypes[2])) ||
      !is_f32(dtypes[out]))
    return 2;
  if (ndims[0] < 1 || ndims[1] != 3 || shapes[1][0] != 1 || ndims[out] < 1) return 3;
  const int64_t K = shapes[0][ndims[0] - 1];
  const int64_t M = rows_of(ndims[0], shapes[0]);
  if (K <= 0) return 4;
  const int64_t N = shapes[1][2];
  if (shapes[out][ndims[out] - 1] != N) return 5;
  if (add && (ndims[2] < 1 || shapes[2][ndims[2] - 1] != N || rows_of(ndims[2], shapes[2]) != M)) return 6;
  LoraArgs l;
  if (lora) {
    const int err = lora_args(params, ndims, shapes, dtypes, nin, M, K, N, &l);
    if (err != 0) return err;
  }
  const auto *x = static_cast<const float *>(params[0]);
  auto *y = static_cast<float *>(params[out]);
  const int err = qmatmul_packed(x, static_cast<const uint8_t *>(params[1]), shapes[1][1],
                                 add ? static_cast<const float *>(params[2]) : nullptr, y, M, K, N);
  if (err != 0) return err;
  if (lora) lora_apply(l, x, M, K, y, N);
  return 0;
}

}  // namespace mindserve

extern "C" {

// 0 ok; 1 bad format; 2 K not a multiple of the format's block size (32, or 256 for the K-quants).
int mindserve_qmatmul_raw(const float *x, const uint8_t *w_packed, int fmt, const float *res, float *y, int64_t M,
                          int64_t K, int64_t N) {
  mindserve::FpScope fp;
  if (fmt < 0 || fmt >= kFormats) return 1;
  if (K % block_size(fmt) != 0) return 2;
  qmatmul(x, w_packed, fmt, res, y, M, K, N);
  return 0;
}

// A packed weight of either kind ([1, L, N]: one format, read from L, or a segmented stack): 0 ok; 4 L fits no
// format and w holds no valid segment table.
int mindserve_qmatmul_packed_raw(const float *x, const uint8_t *w_packed, int64_t L, const float *res, float *y,
                                 int64_t M, int64_t K, int64_t N) {
  mindserve::FpScope fp;
  if (K <= 0) return 4;
  return mindserve::qmatmul_packed(x, w_packed, L, res, y, M, K, N);
}

// Which instruction set the dot products use (vec.h's backend): "avx512-vnni", "avx512bw", "avx2", "neon-dotprod",
// "neon" or "scalar".
const char *mindserve_qmatmul_isa() { return v::kIsa; }


}  // extern "C"
