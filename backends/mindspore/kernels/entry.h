// mindserve kernels: the dtype and shape checks every AOT entry point makes on MindSpore's arguments.
#pragma once

#include <cstdint>
#include <cstring>

namespace mindserve {

inline bool is_f32(const char *dtype) { return std::strcmp(dtype, "float32") == 0 || std::strcmp(dtype, "float") == 0; }
inline bool is_i32(const char *dtype) { return std::strcmp(dtype, "int32") == 0; }

// Every one of the first n dtypes is float32.
inline bool all_f32(const char **dtypes, int n) {
  for (int i = 0; i < n; ++i)
    if (!is_f32(dtypes[i])) return false;
  return true;
}

// Rows of a tensor seen as [rows, last dim]: the product of all dims but the last.
inline int64_t rows_of(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int d = 0; d < ndim - 1; ++d) n *= shape[d];
  return n;
}

}  // namespace mindserve
