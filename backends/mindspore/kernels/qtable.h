// The quantized matmul's tile table (qmatmul.cc reads it): for each format of qformat.h, the tile functions of
// qtile.h by kind (one partial group, one full group, two full groups) and row count. The tables are built in
// their own sources, one per K-quant and two for the 32-weight formats (qtiles_*.cc): instantiating every tile is
// most of the library's compile time, and split this way the build's compiler runs share it over the CPUs.
#pragma once

#include <cstdint>
#include <utility>

#include "qformat.h"
#include "qtile.h"
#include "quantize.h"
#include "vec.h"

namespace mindserve::q {

constexpr int kMaxMR = vec::kQRows;     // rows per tile of one group of columns
constexpr int kMaxMR2 = vec::kQRows2;   // rows per tile of two groups (0: the backend has no pair tiles)
constexpr int kMaxKMR2 = vec::kKRows2;  // ... of two groups of a K-quant (0: none)
static_assert(kMaxMR2 <= kMaxMR && kMaxKMR2 <= kMaxMR, "a tile table row holds kMaxMR");

using TileFn = void (*)(const mindserve::QX &, int64_t, const uint8_t *, int64_t, int, const float *, float *,
                        int64_t, Ahead);

// [0 one partial group, 1 one full group, 2 two full groups][rows - 1]; null where a format has no such tile.
struct FormatTiles {
  TileFn fn[3][kMaxMR]{};
};

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

// Format F's tiles. Only a qtiles_*.cc source calls it (each instantiates its formats' tiles).
template <int F>
constexpr FormatTiles make_tiles() {
  FormatTiles t;
  constexpr const Traits &T = kTraits[F];
  if constexpr (T.simple()) {
    fill_rows<1, F, false>(t.fn[0], std::make_integer_sequence<int, kMaxMR>{});
    fill_rows<1, F, true>(t.fn[1], std::make_integer_sequence<int, kMaxMR>{});
    fill_rows<2, F, true>(t.fn[2], std::make_integer_sequence<int, kMaxMR2>{});
  } else {  // one group at a time; the K-quants two where the backend has such tiles
    fill_krows<F, false>(t.fn[0], std::make_integer_sequence<int, kMaxMR>{});
    fill_krows<F, true>(t.fn[1], std::make_integer_sequence<int, kMaxMR>{});
    if constexpr (T.k8 && kMaxKMR2 > 0) fill_kpairs<F>(t.fn[2], std::make_integer_sequence<int, kMaxKMR2>{});
  }
  return t;
}

// Defined (constant-initialized) in qtiles_q8_q4.cc (Q8_0, Q4_0, Q4_1), qtiles_q5.cc (Q5_0, Q5_1), qtiles_q4k.cc,
// qtiles_q5k.cc and qtiles_q6k.cc.
extern const FormatTiles kQ8Q4Tiles[3];
extern const FormatTiles kQ5Tiles[2];
extern const FormatTiles kQ4KTiles;
extern const FormatTiles kQ5KTiles;
extern const FormatTiles kQ6KTiles;

}  // namespace mindserve::q
