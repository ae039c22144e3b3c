// AArch64 group dot products with the dot-product extension (ARMv8.2-A +dotprod): vdotq_s32 sums
// four s8 x s8 products per 32-bit lane. 4-bit codes (0..15) and Q8_0's signed bytes are valid s8 as
// they are. Compiled in floe's tests by cross-compiling, not run there.
#ifndef FLOE_QDOT_ISA_NEON_H
#define FLOE_QDOT_ISA_NEON_H

#include <arm_neon.h>
#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

#include "qdot.h"

namespace floe_qdot {
namespace {

struct Neon : ScalarBlocks {
  using Acc = float32x4_t;

  static int runs_here() {
#if defined(__linux__)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__APPLE__)
    return 1;  // every Apple silicon core has it
#else
    return 0;
#endif
  }
  static float half(uint16_t h) {
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
  }
  template <class Fmt>
  static Scales scales8(const uint8_t* b) {  // as ScalarBlocks', with the hardware's fp16 conversion
    Scales s;
    for (int j = 0; j < 8; ++j) Fmt::template scale<Neon>(b + j * Fmt::kBytes, s.v[2 * j], s.v[2 * j + 1]);
    return s;
  }
  static float32x4_t zero() { return vdupq_n_f32(0.f); }
  static float32x4_t add(float32x4_t a, float32x4_t b) { return vaddq_f32(a, b); }
  static float32x4_t fma(float32x4_t d, float s, float32x4_t acc) { return vfmaq_n_f32(acc, d, s); }
  static float hsum(float32x4_t v) { return vaddvq_f32(v); }

  static constexpr int kRows = 4;

  struct Codes {
    int8x16_t w0, w1;
  };
  template <bool FourBit>
  static Codes codes(const uint8_t* c) {
    if constexpr (FourBit) {
      const uint8x16_t b = vld1q_u8(c);
      return {vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(0x0F))), vreinterpretq_s8_u8(vshrq_n_u8(b, 4))};
    }
    return {vreinterpretq_s8_u8(vld1q_u8(c)), vreinterpretq_s8_u8(vld1q_u8(c + 16))};
  }
  template <bool FourBit>
  static float32x4_t dot(const Codes& w, const int8_t* q) {
    const int8x16_t q0 = vld1q_s8(q), q1 = vld1q_s8(q + 16);
    return vcvtq_f32_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), w.w0, q0), w.w1, q1));
  }
};

}  // namespace
}  // namespace floe_qdot

#endif
