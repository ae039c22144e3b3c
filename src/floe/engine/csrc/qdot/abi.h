// The C interface between floe's PyTorch operator (op.cpp) and one instruction-set variant of the
// quantized GEMV (portable.cpp, avx2.cpp, vnni.cpp, neon.cpp), each built as its own shared library
// with that variant's compiler flags and opened with dlopen. Plain C types only: no ATen here.
#ifndef FLOE_QDOT_ABI_H
#define FLOE_QDOT_ABI_H

#include <stdint.h>

#define FLOE_QDOT_ABI 7

#ifdef __cplusplus
extern "C" {
#endif

// The weight's block formats: each row is K/32 blocks of 32 weights, one after another, as a GGUF file
// stores them (the kernel reads the file's bytes in place). A format is named by its block's size, so
// the operator tells them apart by the bytes a row has per 32 inputs.
enum FloeQdotFormat {
  FLOE_Q4_0 = 0,  // 18 bytes: fp16 d, 16 bytes of nibbles; w = d (q - 8)
  FLOE_Q4_1 = 1,  // 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles; w = d q + m
  FLOE_Q8_0 = 2,  // 34 bytes: fp16 d, 32 int8 q; w = d q
  FLOE_Q4_F = 3,  // 24 bytes: float32 s, float32 o, 16 bytes of nibbles; w = s q + o (floe's Q4_K groups)
  FLOE_QDOT_FORMATS = 4
};
// (in the nibble formats, byte j of a block holds weight j in its low nibble and weight j + 16 in its high)
//
// Interleaved ("x8"): the same blocks, 8 rows a band, for variants whose `rows8` is not NULL (one
// vector instruction then serves 8 weight rows, its lanes, with one broadcast of the input, as
// llama.cpp's repacked Q4_0x8). A band is [N/8] bands of K/32 groups; a group of a band is 8 blocks'
// bytes rearranged: first each field of the block header (d; d, m; s, o) for rows 0..7 in turn (the
// field of row r at r x its size), then the codes in chunks of 32 bytes: chunk c holds bytes
// 4c..4c+3 of rows 0..7's codes, row r at 4r. torch.ops.floe.interleave_q makes it from the file's.

// Outputs [begin, end) of y = x Wt for m input rows quantized by `quantize` (qx [m, K], xsu [m, K/16]),
// row r's written to y[r * ldy + begin .. end); blocks: the weight, [N, K/32] blocks.
typedef void (*floe_qdot_rows_fn)(const uint8_t* blocks, const int8_t* qx, const float* xsu, int64_t m,
                                  int64_t groups, int64_t begin, int64_t end, float* y, int64_t ldy);

// Weight rows [begin, end) as values (blocks as above), written as float32 or bfloat16 (bits) to out,
// row n at out + (n - begin) * K.
typedef void (*floe_qdot_dequant_fn)(const uint8_t* blocks, int64_t groups, int64_t begin, int64_t end,
                                     void* out);

typedef struct FloeQdotKernel {
  int abi;           // FLOE_QDOT_ABI
  const char* name;  // "portable", "avx2", "vnni", "neon"
  int (*runs_here)(void);  // whether this CPU has every instruction the variant uses
  // x [K] -> qx int8 [K], xsu [K/16] (per group of 32: its step, and step * the sum of its qx);
  // qx is laid out as this variant's rows for codes of that width (four_bit) read it
  void (*quantize)(const float* x, int64_t k, int four_bit, int8_t* qx, float* xsu);
  floe_qdot_rows_fn rows[FLOE_QDOT_FORMATS];
  floe_qdot_dequant_fn dequant[FLOE_QDOT_FORMATS][2];  // [format][bfloat16 out]
  // The same on interleaved bands (NULL: the variant has none). begin, end: bands for rows8 (outputs
  // 8 begin .. 8 end), rows for dequant8 (row n: lane n % 8 of band n / 8).
  floe_qdot_rows_fn rows8[FLOE_QDOT_FORMATS];
  floe_qdot_dequant_fn dequant8[FLOE_QDOT_FORMATS][2];
  // The input rows of a pass from which rows8 takes neighbouring bands two at a time in 512-bit
  // registers (the same values either way): rows > 0 sets it; returns the one in force. NULL: the
  // variant has no band pairs.
  int (*pair_rows)(int rows);
} FloeQdotKernel;

const FloeQdotKernel* floe_qdot_kernel(void);

#ifdef __cplusplus
}
#endif

#endif
