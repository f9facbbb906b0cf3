// The tile table of Q5_K (qtable.h).
#include "qtable.h"

namespace mindserve::q {

constinit const FormatTiles kQ5KTiles = make_tiles<kQ5_K>();

}  // namespace mindserve::q
