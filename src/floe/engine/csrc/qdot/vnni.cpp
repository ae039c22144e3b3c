// The quantized GEMV on AVX-512 VNNI's 256-bit form (built with -mavx512vnni -mavx512vl ...).
#include "isa_x86.h"

FLOE_QDOT_EXPORT const FloeQdotKernel* floe_qdot_kernel(void) {
  return floe_qdot::kernel<floe_qdot::X86<true>>("vnni");
}
