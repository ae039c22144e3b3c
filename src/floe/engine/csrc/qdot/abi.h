// The C interface between floe's PyTorch operator (op.cpp) and one instruction-set variant of the
// quantized GEMV (portable.cpp, avx2.cpp, vnni.cpp, neon.cpp), each built as its own shared library
// with that variant's compiler flags and opened with dlopen. Plain C types only: no ATen here.
#ifndef FLOE_QDOT_ABI_H
#define FLOE_QDOT_ABI_H

#include <stdint.h>

#define FLOE_QDOT_ABI 4

#ifdef __cplusplus
extern "C" {
#endif

// Outputs [begin, end) of y = x Wt for m input rows quantized by `quantize` (qx [m, K], xs and u
// [m, K/32]), row r's written to y[r * ldy + begin .. end). codes: uint8 [N, K/2] (4-bit) or [N, K]
// (8-bit); scale, offset: [N, K/32], float32 or IEEE half (uint16 bits).
typedef void (*floe_qdot_rows_fn)(const uint8_t* codes, const void* scale, const void* offset,
                                  const int8_t* qx, const float* xs, const float* u, int64_t m,
                                  int64_t groups, int64_t begin, int64_t end, float* y, int64_t ldy);

// Weight rows [begin, end) as values, w = scale * code + offset (codes, scale, offset as above),
// written as float32 or bfloat16 (bits) to out, row n at out + (n - begin) * K.
typedef void (*floe_qdot_dequant_fn)(const uint8_t* codes, const void* scale, const void* offset,
                                     int64_t groups, int64_t begin, int64_t end, void* out);

typedef struct FloeQdotKernel {
  int abi;           // FLOE_QDOT_ABI
  const char* name;  // "portable", "avx2", "vnni", "neon"
  int (*runs_here)(void);  // whether this CPU has every instruction the variant uses
  // x [K] -> qx int8 [K], xs [K/32] (each group's step), u [K/32] (step * sum of the group's qx);
  // qx is laid out as this variant's rows for codes of that width (four_bit) read it
  void (*quantize)(const float* x, int64_t k, int four_bit, int8_t* qx, float* xs, float* u);
  floe_qdot_rows_fn rows[2][2];  // [four_bit][half_scales]
  floe_qdot_dequant_fn dequant[2][2][2];  // [four_bit][half_scales][bfloat16 out]
} FloeQdotKernel;

const FloeQdotKernel* floe_qdot_kernel(void);

#ifdef __cplusplus
}
#endif

#endif
