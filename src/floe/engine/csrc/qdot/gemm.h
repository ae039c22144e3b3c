// A prompt's matrix product on float32 values, one band of weight rows at a time (gemm.cpp; op.cpp's
// gemm_q dequantizes each band with the variant's own dequant and hands it here).
#pragma once

#include <cstdint>

#include "clones.h"  // (cpu_lanes: the lanes argument)

namespace floe {

// y[m * ldy + n] = sum_j x[m * k + j] w[n * k + j] for m < rows_x, n < rows_w (a band: at most 8),
// k a multiple of 32, in `lanes` (8 or 16: cpu_lanes()) partial sums. Each output is its two rows' dot
// product alone, in one fixed order whatever rows_x is (lanes of partial sums over k, then the lanes
// summed as a tree): a prompt's outputs do not depend on which rows are computed beside it.
void band_gemm(const float* x, int64_t rows_x, int64_t k, const float* w, int64_t rows_w, float* y, int64_t ldy,
               int64_t lanes);

}  // namespace floe
