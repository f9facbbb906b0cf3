// mindserve weight loading: GGUF blocks of the eight formats (quant.py's docstring, ggml-common.h) repacked into the
// quantized matmul's layout (qformat.h), or dequantized to float32. Run once per weight at load time.
//
//   MindservePackQWeight(blocks [N, R] u8, fmt [1] i32, out [1, K/B * P, N] u8)
//       R = K/B * the format's GGUF block bytes (B 32, or 256 for the K-quants), P its packed bytes per column
//       per block; fmt a format code of qformat.h.
//       The fp16 scales are copied as they are.
//   MindserveDequantize(blocks [N, R] u8, fmt [1] i32, out [N, K] f32)
//       ggml's float32 operation order (each product and sum rounded to float32, no fma): 32-blocks
//       w = d * (float)(q - offset) (+ m); Q4_K / Q5_K w = (d * (float)sc) * (float)q - dmin * (float)mn;
//       Q6_K w = (d * (float)sc) * (float)(q - 32).
// Return codes: 1 wrong number of inputs, 2 a dtype, 3 an unknown format, 4 a shape that does not fit the format.
//
// Plain C++ on bytes and integers (no vector layer: the compiler may vectorize it), the same bytes and bits on
// every build variant; the work is split over groups of 16 columns (packing) or rows (dequantizing) on the pool.
// tests/support/qpack_ref.py is the NumPy reference of the packing.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "entry.h"
#include "kv_format.h"
#include "pool.h"
#include "qformat.h"

namespace {

using namespace mindserve::q;  // NOLINT: the formats and their traits (qformat.h)

inline uint16_t le16(const uint8_t *p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
inline uint32_t le32(const uint8_t *p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
         (static_cast<uint32_t>(p[3]) << 24);
}

// One GGUF block as numbers: u the unsigned quants (q8_0: q + 128), sc the K-quants' 16 scale bytes (Q4_K / Q5_K:
// the 8 six-bit scales then the 8 mins; Q6_K: the 16 int8 scales), d and m the fp16 bit patterns (m: Q4_1 / Q5_1's
// m, Q4_K / Q5_K's dmin).
struct Block {
  uint8_t u[256];
  uint8_t sc[16];
  uint16_t d, m;
  int nhalves;
};

// ggml's get_scale_min_k4 for the 8 sub-blocks.
void k4_scales(const uint8_t *s, uint8_t *sc) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    sc[8 + j] = s[4 + j] & 63;
    sc[4 + j] = static_cast<uint8_t>((s[8 + j] & 15) | ((s[j] >> 6) << 4));
    sc[12 + j] = static_cast<uint8_t>((s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4));
  }
}

void decode(int fmt, const uint8_t *b, Block *o) {
  o->m = 0;
  o->nhalves = 1;
  switch (fmt) {
    case kQ8_0:
      o->d = le16(b);
      for (int i = 0; i < 32; ++i) o->u[i] = b[2 + i] ^ 0x80;
      return;
    case kQ4_0:
    case kQ4_1:
    case kQ5_0:
    case kQ5_1: {
      const bool five = fmt == kQ5_0 || fmt == kQ5_1, two = fmt == kQ4_1 || fmt == kQ5_1;
      const int lo = (two ? 4 : 2) + (five ? 4 : 0);  // the nibble bytes
      o->d = le16(b);
      if (two) {
        o->m = le16(b + 2);
        o->nhalves = 2;
      }
      const uint32_t qh = five ? le32(b + lo - 4) : 0;
      for (int i = 0; i < 16; ++i) {
        o->u[i] = static_cast<uint8_t>((b[lo + i] & 15) | (((qh >> i) & 1) << 4));
        o->u[16 + i] = static_cast<uint8_t>((b[lo + i] >> 4) | (((qh >> (16 + i)) & 1) << 4));
      }
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      o->d = le16(b);
      o->m = le16(b + 2);
      o->nhalves = 2;
      k4_scales(b + 4, o->sc);
      const uint8_t *qs = b + (fmt == kQ5_K ? 48 : 16), *qh = b + 16;
      for (int c = 0; c < 4; ++c)  // chunk c of 64 weights: sub-block 2c the low nibbles, 2c + 1 the high ones
        for (int l = 0; l < 32; ++l) {
          const uint8_t q = qs[32 * c + l];
          uint8_t lo = q & 15, hi = q >> 4;
          if (fmt == kQ5_K) {
            lo |= static_cast<uint8_t>(((qh[l] >> (2 * c)) & 1) << 4);
            hi |= static_cast<uint8_t>(((qh[l] >> (2 * c + 1)) & 1) << 4);
          }
          o->u[64 * c + l] = lo;
          o->u[64 * c + 32 + l] = hi;
        }
      return;
    }
    default: {  // kQ6_K: ql [128], qh [64], sc [16] int8, d
      o->d = le16(b + 208);
      std::memcpy(o->sc, b + 192, 16);
      for (int h = 0; h < 2; ++h) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        uint8_t *u = o->u + 128 * h;
        for (int l = 0; l < 32; ++l) {
          u[l] = static_cast<uint8_t>((ql[l] & 15) | ((qh[l] & 3) << 4));
          u[32 + l] = static_cast<uint8_t>((ql[32 + l] & 15) | (((qh[l] >> 2) & 3) << 4));
          u[64 + l] = static_cast<uint8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
          u[96 + l] = static_cast<uint8_t>((ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4));
        }
      }
      return;
    }
  }
}

// The packed dwords of one column's block (qformat.h), in the order the kernel reads them; returns how
// many. The 32-blocks' quant bytes are GGUF's (Q8_0 + 128); the others per sub-block of 32: 4 nibble dwords, then
// Q5's one or Q6_K's two dwords of high bits; then the K-quants' 4 scale dwords.
int block_dwords(int fmt, const uint8_t *b, const Block &k, uint8_t (*dw)[4]) {
  if (fmt == kQ8_0) {
    for (int i = 0; i < 32; ++i) dw[i / 4][i % 4] = b[2 + i] ^ 0x80;
    return 8;
  }
  if (fmt == kQ4_0 || fmt == kQ4_1) {
    std::memcpy(dw, b + (fmt == kQ4_1 ? 4 : 2), 16);
    return 4;
  }
  int n = 0;
  for (int s = 0; s < kTraits[fmt].block / 32; ++s) {
    const uint8_t *u = k.u + 32 * s;  // weight 16h + 4t + i of the sub-block: u[16h + 4t + i]
    for (int t = 0; t < 4; ++t, ++n)
      for (int i = 0; i < 4; ++i) dw[n][i] = static_cast<uint8_t>((u[4 * t + i] & 15) | ((u[16 + 4 * t + i] & 15) << 4));
    if (fmt == kQ6_K) {
      for (int h = 0; h < 2; ++h, ++n)
        for (int i = 0; i < 4; ++i) {
          uint8_t v = 0;
          for (int t = 0; t < 4; ++t) v |= static_cast<uint8_t>((u[16 * h + 4 * t + i] >> 4) << (2 * t));
          dw[n][i] = v;
        }
    } else if (fmt != kQ4_K) {
      for (int i = 0; i < 4; ++i) {
        uint8_t v = 0;
        for (int t = 0; t < 4; ++t)
          v |= static_cast<uint8_t>((((u[4 * t + i] >> 4) & 1) << t) | (((u[16 + 4 * t + i] >> 4) & 1) << (4 + t)));
        dw[n][i] = v;
      }
      ++n;
    }
  }
  if (fmt >= kQ4_K) {
    std::memcpy(dw + n, k.sc, 16);
    n += 4;
  }
  return n;
}

struct PackJob {
  const uint8_t *blocks;
  uint8_t *out;
  int fmt;
  int64_t N, nb, groups, chunks;
};

void pack_groups(const void *ctx, int64_t c) {
  const PackJob &j = *static_cast<const PackJob *>(ctx);
  const int bytes = kTraits[j.fmt].gguf_bytes, P = kTraits[j.fmt].packed_bytes;
  Block k;
  uint8_t dw[64][4];
  for (int64_t g = j.groups * c / j.chunks; g < j.groups * (c + 1) / j.chunks; ++g) {
    const int64_t n0 = g * kGroup;
    const int w = static_cast<int>(std::min<int64_t>(kGroup, j.N - n0));
    uint8_t *base = j.out + n0 * j.nb * P;  // the groups before this one are all 16 columns wide
    for (int64_t b = 0; b < j.nb; ++b) {
      uint8_t *blk = base + b * w * P;
      for (int col = 0; col < w; ++col) {
        const uint8_t *src = j.blocks + ((n0 + col) * j.nb + b) * bytes;
        decode(j.fmt, src, &k);
        const int D = block_dwords(j.fmt, src, k, dw);
        for (int d = 0; d < D; ++d) std::memcpy(blk + (d * w + col) * 4, dw[d], 4);
        uint8_t *halves = blk + D * w * 4;
        const uint16_t h[2] = {k.d, k.m};
        for (int i = 0; i < k.nhalves; ++i) {
          halves[(i * w + col) * 2] = static_cast<uint8_t>(h[i] & 0xFF);
          halves[(i * w + col) * 2 + 1] = static_cast<uint8_t>(h[i] >> 8);
        }
      }
    }
  }
}

struct DequantJob {
  const uint8_t *blocks;
  float *out;
  int fmt;
  int64_t N, nb, chunks;
};

void dequantize_block(int fmt, const Block &k, float *y) {
  const float d = mindserve::kv::f16_to_f32(k.d);
  if (fmt < kQ4_K) {
    const int offset = fmt == kQ8_0 ? 128 : fmt == kQ4_0 ? 8 : fmt == kQ5_0 ? 16 : 0;
    if (k.nhalves == 2) {
      const float m = mindserve::kv::f16_to_f32(k.m);
      for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(k.u[i]) + m;
    } else {
      for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(k.u[i] - offset);
    }
  } else if (fmt == kQ6_K) {
    for (int s = 0; s < 16; ++s) {
      const float ds = d * static_cast<float>(static_cast<int8_t>(k.sc[s]));
      for (int i = 0; i < 16; ++i) y[16 * s + i] = ds * static_cast<float>(k.u[16 * s + i] - 32);
    }
  } else {
    const float dmin = mindserve::kv::f16_to_f32(k.m);
    for (int s = 0; s < 8; ++s) {
      const float ds = d * static_cast<float>(k.sc[s]), dm = dmin * static_cast<float>(k.sc[8 + s]);
      for (int i = 0; i < 32; ++i) y[32 * s + i] = ds * static_cast<float>(k.u[32 * s + i]) - dm;
    }
  }
}

void dequantize_rows(const void *ctx, int64_t c) {
  const DequantJob &j = *static_cast<const DequantJob *>(ctx);
  const int bytes = kTraits[j.fmt].gguf_bytes, B = kTraits[j.fmt].block;
  Block k;
  for (int64_t r = j.N * c / j.chunks; r < j.N * (c + 1) / j.chunks; ++r)
    for (int64_t b = 0; b < j.nb; ++b) {
      decode(j.fmt, j.blocks + (r * j.nb + b) * bytes, &k);
      dequantize_block(j.fmt, k, j.out + (r * j.nb + b) * B);
    }
}

// The checks both entries make: (blocks [N, R] u8, fmt [1] i32, out); 0 and the format, N and blocks per row.
int check(int nparam, int *ndims, int64_t **shapes, const char **dtypes, void **params, const char *out_dtype,
          int *fmt, int64_t *N, int64_t *nb) {
  if (nparam != 3) return 1;
  if (std::strcmp(dtypes[0], "uint8") != 0 || !mindserve::is_i32(dtypes[1]) || std::strcmp(dtypes[2], out_dtype) != 0)
    return 2;
  if (ndims[0] != 2 || ndims[1] != 1 || shapes[1][0] != 1) return 4;
  *fmt = *static_cast<const int32_t *>(params[1]);
  if (*fmt < 0 || *fmt >= kFormats) return 3;
  *N = shapes[0][0];
  if (shapes[0][1] % kTraits[*fmt].gguf_bytes != 0) return 4;
  *nb = shapes[0][1] / kTraits[*fmt].gguf_bytes;
  return 0;
}

int64_t chunks_of(int64_t units) { return std::clamp<int64_t>(units, 1, 8 * mindserve::pool().threads()); }

}  // namespace

extern "C" {

static int entry_pack_qweight(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  int fmt;
  int64_t N, nb;
  if (int rc = check(nparam, ndims, shapes, dtypes, params, "uint8", &fmt, &N, &nb)) return rc;
  if (ndims[2] != 3 || shapes[2][0] != 1 || shapes[2][1] != nb * kTraits[fmt].packed_bytes || shapes[2][2] != N)
    return 4;
  PackJob job{static_cast<const uint8_t *>(params[0]), static_cast<uint8_t *>(params[2]), fmt, N, nb,
              (N + kGroup - 1) / kGroup, 1};
  job.chunks = chunks_of(job.groups);
  mindserve::pool().run(mindserve::Task{&pack_groups, &job, job.chunks});
  return 0;
}
MINDSERVE_ENTRY(MindservePackQWeight, entry_pack_qweight)

static int entry_dequantize(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  int fmt;
  int64_t N, nb;
  if (int rc = check(nparam, ndims, shapes, dtypes, params, "float32", &fmt, &N, &nb)) return rc;
  if (ndims[2] != 2 || shapes[2][0] != N || shapes[2][1] != nb * kTraits[fmt].block) return 4;
  DequantJob job{static_cast<const uint8_t *>(params[0]), static_cast<float *>(params[2]), fmt, N, nb, chunks_of(N)};
  mindserve::pool().run(mindserve::Task{&dequantize_rows, &job, job.chunks});
  return 0;
}
MINDSERVE_ENTRY(MindserveDequantize, entry_dequantize)

}  // extern "C"
