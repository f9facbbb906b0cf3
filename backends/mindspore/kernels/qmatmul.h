// mindserve quantized matmul (qmatmul.cc): y = x @ W (+ res) with W in GGUF block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
// Q4_K, Q5_K, Q6_K).
#pragma once

#include <cstdint>

namespace mindserve {

// The AOT entry for a uint8 (quantized) weight; matmul.cc's MindserveMatMul / MindserveMatMulAdd hand over
// to it when their second input is uint8. `add`: inputs are x, W, res (else x, W); the four optional LoRA
// inputs of lora.h may follow. Returns 0 or a nonzero error code (MindSpore then raises).
int qmatmul_entry(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool add);

}  // namespace mindserve
