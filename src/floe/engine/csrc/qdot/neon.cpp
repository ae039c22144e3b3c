// The quantized GEMV on AArch64 NEON with dot products (built with -march=armv8.2-a+dotprod).
#include "isa_neon.h"

FLOE_QDOT_EXPORT const FloeQdotKernel* floe_qdot_kernel(void) {
  return floe_qdot::kernel<floe_qdot::Neon>("neon");
}
