// The tile table of Q5_0 and Q5_1 (qtable.h).
#include "qtable.h"

namespace mindserve::q {

static_assert(kQ5_0 == 3 && kQ5_1 == 4, "kQ5Tiles is in Fmt order");
constinit const FormatTiles kQ5Tiles[2] = {make_tiles<kQ5_0>(), make_tiles<kQ5_1>()};

}  // namespace mindserve::q
