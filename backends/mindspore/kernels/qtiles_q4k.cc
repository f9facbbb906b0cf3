// The tile table of Q4_K (qtable.h).
#include "qtable.h"

namespace mindserve::q {

constinit const FormatTiles kQ4KTiles = make_tiles<kQ4_K>();

}  // namespace mindserve::q
