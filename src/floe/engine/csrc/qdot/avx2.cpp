// The quantized GEMV on AVX2 + FMA + F16C (built with -mavx2 -mfma -mf16c).
#include "isa_x86.h"

FLOE_QDOT_EXPORT const FloeQdotKernel* floe_qdot_kernel(void) {
  return floe_qdot::kernel<floe_qdot::X86<false>>("avx2");
}
