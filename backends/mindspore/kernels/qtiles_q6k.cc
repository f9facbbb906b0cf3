// The tile table of Q6_K (qtable.h).
#include "qtable.h"

namespace mindserve::q {

constinit const FormatTiles kQ6KTiles = make_tiles<kQ6_K>();

}  // namespace mindserve::q
