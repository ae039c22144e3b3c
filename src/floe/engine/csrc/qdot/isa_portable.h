// Plain C++ group dot products (no intrinsics): runs on any CPU; the compiler vectorises what it can
// for the target it is given.
#ifndef FLOE_QDOT_ISA_PORTABLE_H
#define FLOE_QDOT_ISA_PORTABLE_H

#include "qdot.h"

namespace floe_qdot {
namespace {

struct Portable : ScalarBlocks {
  using Acc = float;
  static int runs_here() { return 1; }
  static float zero() { return 0.f; }
  static float add(float a, float b) { return a + b; }
  static float hsum(float a) { return a; }
  static float fma(float d, float s, float acc) { return acc + d * s; }

  static constexpr int kRows = 4;

  // Both operands widened to int16 first: then compilers find the multiply-add of int16 pairs into
  // int32 lanes (SSE2's pmaddwd, NEON's smlal) that no int8 instruction offers without extensions.
  struct Codes {
    int16_t w[32];
  };
  template <bool FourBit>
  static Codes codes(const uint8_t* c) {
    Codes w;
    if constexpr (FourBit) {
      for (int j = 0; j < 16; ++j) {
        w.w[j] = c[j] & 15;
        w.w[j + 16] = c[j] >> 4;
      }
    } else {
      for (int j = 0; j < 32; ++j) w.w[j] = static_cast<int8_t>(c[j]);
    }
    return w;
  }
  template <bool FourBit>
  static float dot(const Codes& w, const int8_t* q) {
    int16_t x[32];
    for (int j = 0; j < 32; ++j) x[j] = q[j];
    int32_t sum = 0;  // at most 32 x 128 x 127: exact in int32, and in float
    for (int j = 0; j < 32; ++j) sum += w.w[j] * x[j];
    return static_cast<float>(sum);
  }
};

}  // namespace
}  // namespace floe_qdot

#endif
