// The tile table of Q8_0, Q4_0 and Q4_1 (qtable.h).
#include "qtable.h"

namespace mindserve::q {

static_assert(kQ8_0 == 0 && kQ4_0 == 1 && kQ4_1 == 2, "kQ8Q4Tiles is in Fmt order");
constinit const FormatTiles kQ8Q4Tiles[3] = {make_tiles<kQ8_0>(), make_tiles<kQ4_0>(), make_tiles<kQ4_1>()};

}  // namespace mindserve::q
