// mindserve quantized weights: GGUF's block formats, one traits row each (kTraits), and the packed layout the
// quantized matmul (qmatmul.cc, its tiles in qtile.h) reads and pack.cc writes.
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
// Packed weight (made once at load by pack.cc, kernels.prepare_qweight), uint8 [1, (K/B) * P, N], B the block size,
// P the packed bytes per column per block (kTraits). Columns are cut into groups of kGroup = 16 (the last may be
// narrower, width w); group g starts at byte 16 * g * (K/B) * P and holds, for each block in order, w * P bytes:
//   quants   D dwords per column, dword-major ([D][w] x 4 bytes): D = 8 for Q8_0 (dword j = weights 4j..4j+3,
//            stored as q + 128 so they are unsigned), D = 4 for Q4 (dword j = the GGUF nibble bytes 4j..4j+3:
//            low nibbles weights 4j.., high nibbles weights 16+4j..)
//   d        w fp16
//   m        w fp16 (Q4_1 only)
// so one 64-byte load gives one dword of each of 16 columns: the lanes of a VNNI dot product.
// The Q5 formats and the K-quants hold per block, for each sub-block of 32 in order:
//   nibbles  4 dwords per column as Q4's (the low 4 bits of each weight's q)
//   high     Q5: 1 dword, byte i bit t = bit 4 of weight 4t + i, bit 4 + t = that of weight 16 + 4t + i;
//            Q6_K: 2 dwords, dword h byte i bits 2t, 2t + 1 = bits 4, 5 of weight 16h + 4t + i; Q4_K: none
// then the K-quants' integer scales, 4 dwords per column (Q4_K, Q5_K: sc_0..7 then mn_0..7, one byte each;
// Q6_K: the 16 int8 sc), then d fp16, then Q5_1's m / Q4_K's and Q5_K's dmin fp16.
//
// A stack whose parts ship in different formats (Q4_K_M's Q4_K q and k beside a Q6_K v) is segmented: consecutive
// output columns [n0, n0 + cols) per format, each packed as above on its own (groups of 16 restart at n0), behind a
// table. Such a weight is [1, L, N] with L odd (a single format's L is even: every packed block size is), its
// bytes: int32 magic kSegMagic, int32 count S (2..kMaxSegments), then per segment int32 format code, int32 cols,
// int64 byte offset of its packing (the end of the table or of the segment before, rounded up to 64; cols summing
// to N); L is the least odd length that holds them (kernels.prepare_qstack), so a table read with another K is
// refused. The layout is the same on every CPU; only the kernels' instructions differ.
#pragma once

#include <cstdint>

namespace mindserve::q {

enum Fmt { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ5_0 = 3, kQ5_1 = 4, kQ4_K = 5, kQ5_K = 6, kQ6_K = 7, kFormats = 8 };
constexpr int kGroup = 16;  // output columns per group (one vector of lanes)
constexpr int kMaxSegments = 8;
constexpr int32_t kSegMagic = 0x5351534D;  // "MSQS", little-endian

// One format: its sizes, where its packed bytes are, and what its dot product adds to the exact integer sum of
// quants times activations (qmatmul.cc's header has the arithmetic).
struct Traits {
  const char *name;   // as quant.py and GGUF's type names spell it, lower case
  int block;          // weights per block: 32, or a K-quant's super-block of 256
  int gguf_bytes;     // GGUF bytes per block
  int packed_bytes;   // packed bytes per column per block
  int subblocks;      // sub-blocks of 32 per block
  int quant_dwords;   // quant dwords per column per sub-block: 8 whole bytes (Q8_0), else 4 of nibbles
  int high_dwords;    // dwords of high bits per sub-block: bit 4 (Q5: 1), bits 4 and 5 (Q6_K: 2)
  int scale_dwords;   // the K-quants' integer scale dwords per block
  int offset;         // subtracted from every quant: - offset * sx on the sum (Q4_0 8, Q5_0 16)
  bool add_m;         // + m_w * sfx per block (Q4_1, Q5_1)
  bool sub_mins;      // - dmin_w * dx * sum_j mn_j (bsum_2j + bsum_2j+1) per super-block (Q4_K, Q5_K)
  bool halves;        // a scale per half sub-block of 16, with q - 32 through the bsums (Q6_K)
  bool k8;            // Q8_K activations (the K-quants), else blocks of 32
  constexpr bool bytes() const { return quant_dwords == 8; }
  // Whether tile (whole-byte or 4-bit quants, no sub-blocks) computes it, else ktile.
  constexpr bool simple() const { return subblocks == 1 && high_dwords == 0; }
};

constexpr Traits kTraits[kFormats] = {
    //  name   block gguf packed sub dw hi sc off  add_m  sub_mins halves k8
    {"q8_0", 32, 34, 34, 1, 8, 0, 0, 0, false, false, false, false},
    {"q4_0", 32, 18, 18, 1, 4, 0, 0, 8, false, false, false, false},
    {"q4_1", 32, 20, 20, 1, 4, 0, 0, 0, true, false, false, false},
    {"q5_0", 32, 22, 22, 1, 4, 1, 0, 16, false, false, false, false},
    {"q5_1", 32, 24, 24, 1, 4, 1, 0, 0, true, false, false, false},
    {"q4_k", 256, 144, 148, 8, 4, 0, 4, 0, false, true, false, true},
    {"q5_k", 256, 176, 180, 8, 4, 1, 4, 0, false, true, false, true},
    {"q6_k", 256, 210, 210, 8, 4, 2, 4, 0, false, false, true, true},
};

// The packed bytes add up: quants, high bits, scales, then d and (Q4_1, Q5_1, Q4_K, Q5_K) a second fp16.
constexpr bool packed_bytes_add_up() {
  for (const Traits &t : kTraits)
    if (t.packed_bytes != 4 * (t.subblocks * (t.quant_dwords + t.high_dwords) + t.scale_dwords) + 2 +
                              2 * (t.add_m || t.sub_mins))
      return false;
  return true;
}
static_assert(packed_bytes_add_up(), "kTraits: a packed size does not match its layout");

}  // namespace mindserve::q
