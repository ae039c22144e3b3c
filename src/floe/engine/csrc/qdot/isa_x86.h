// x86-64 group dot products on 256-bit vectors. Vnni: one vpdpbusd (u8 x s8, four products summed
// per 32-bit lane, no saturation; AVX-512 VNNI + VL). Without it, AVX2 as llama.cpp does:
// vpmaddubsw (u8 x s8 pairs summed to int16, SATURATING) then vpmaddwd to int32. 4-bit codes are
// safe (|pair| <= 2 x 15 x 127 = 3810); byte codes are not (2 x 255 x 127 > 32767), so for those
// the codes become signed (code - 128, code_bias 128) and the sign moves to the input:
// |code - 128| x sign(qx, code - 128), whose pairs are at most 2 x 128 x 127 = 32512.
#ifndef FLOE_QDOT_ISA_X86_H
#define FLOE_QDOT_ISA_X86_H

#include <immintrin.h>

#include "qdot.h"

namespace floe_qdot {
namespace {

template <bool Vnni>
struct X86 {
  static constexpr bool kPairs = true;
  static constexpr int kRows = Vnni ? 4 : 2;  // 16 accumulators in AVX-512's 32 registers, 8 in AVX2's 16
  using Acc = __m256;
  using Off = __m256;

  static int runs_here() {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if constexpr (Vnni) {
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    }
    return avx2;
  }
  static constexpr float code_bias(bool four_bit) { return Vnni || four_bit ? 0.f : 128.f; }
  static __m256 zero() { return _mm256_setzero_ps(); }
  static __m256 add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
  static __m256 fma(__m256 d, float s, __m256 acc) { return _mm256_fmadd_ps(d, _mm256_set1_ps(s), acc); }
  static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  // A group's codes as one register of 32 bytes (byte codes without VNNI: made signed, code - 128).
  template <bool FourBit>
  static __m256i codes(const uint8_t* c) {
    if constexpr (FourBit) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
      return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
    }
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
    return Vnni ? w : _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
  }
  template <bool FourBit>
  static __m256 dot(__m256i w, const int8_t* q) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    __m256i d;
    if constexpr (Vnni) {
      d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
    } else if constexpr (FourBit) {
      d = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
    } else {  // w = code - 128
      const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
      d = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
    }
    return _mm256_cvtepi32_ps(d);
  }

  // Two four-bit groups at once (pair_layout): one load, one shift and two masks give a register of
  // low nibbles and one of high nibbles; per input row two dot products fill one register, lanes 0-3
  // group g's, lanes 4-7 group g+1's, and the pair's two scales are spread to match. 1.6x the groups a
  // second of taking them one at a time.
  struct PairCodes {
    __m256i lo, hi;
  };
  static PairCodes pair_codes(const uint8_t* c) {
    const __m256i m = _mm256_set1_epi8(0x0F), b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
    return {_mm256_and_si256(b, m), _mm256_and_si256(_mm256_srli_epi16(b, 4), m)};
  }
  // acc + the pair's dots with q, times pair p's scales of cs (a block's 8)
  static __m256 pair_fma(const PairCodes& w, const int8_t* q, const float* cs, int p, __m256 acc) {
    const __m256i qlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i qhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
    __m256i d;
    if constexpr (Vnni) {
      d = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w.lo, qlo), w.hi, qhi);
    } else {  // each int16 pair sum is at most 2 x 15 x 127, so adding two of them stays in range
      const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(w.lo, qlo), _mm256_maddubs_epi16(w.hi, qhi));
      d = _mm256_madd_epi16(s, _mm256_set1_epi16(1));
    }
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), spread(_mm256_load_ps(cs), p), acc);
  }
  static __m256 spread(__m256 scales, int p) {  // [scales[2p] x 4, scales[2p + 1] x 4]
    const __m256i lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    return _mm256_permutevar8x32_ps(scales, _mm256_add_epi32(lanes, _mm256_set1_epi32(2 * p)));
  }

  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 load8(const Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static float to_float(float v) { return v; }
  static float to_float(Half h) { return _cvtsh_ss(h.bits); }

  // A group's 32 weights s * code + z (a product, then a sum, as ScalarBlocks), 16 codes at a time.
  template <bool FourBit, typename Out>
  static void dequant_group(const uint8_t* c, float s, float z, Out* out) {
    const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z);
    __m128i lo, hi;  // elements 0..15 and 16..31
    if constexpr (FourBit) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c)), m = _mm_set1_epi8(0x0F);
      lo = _mm_and_si128(b, m);
      hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    } else {
      lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
      hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16));
    }
    store16(weights8(lo, sv, zv), weights8(_mm_srli_si128(lo, 8), sv, zv), out);
    store16(weights8(hi, sv, zv), weights8(_mm_srli_si128(hi, 8), sv, zv), out + 16);
  }
  static __m256 weights8(__m128i codes, __m256 s, __m256 z) {  // the low 8 bytes' weights
    return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), s), z);
  }
  static void store16(__m256 a, __m256 b, float* out) {
    _mm256_storeu_ps(out, a);
    _mm256_storeu_ps(out + 8, b);
  }
  static void store16(__m256 a, __m256 b, uint16_t* out) {  // to bf16, as to_bf16
    // packus packs within 128-bit lanes (a0-3 b0-3 a4-7 b4-7); the permute puts a before b
    const __m256i packed = _mm256_packus_epi32(bf16_bits(a), bf16_bits(b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(packed, 0xD8));
  }
  static __m256i bf16_bits(__m256 w) {  // in the low 16 bits of each lane
    const __m256i u = _mm256_castps_si256(w);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))),
                                        16);
    const __m256 nan = _mm256_cmp_ps(w, w, _CMP_UNORD_Q);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
  }
  static __m256 off_zero() { return _mm256_setzero_ps(); }
  static float off_sum(__m256 off) { return hsum(off); }
  template <typename S>
  static __m256 block8(const S* s, const S* o, const float* xs, const float* u, float bias, float* cs,
                       __m256 off) {
    const __m256 sv = load8(s);
    _mm256_store_ps(cs, _mm256_mul_ps(sv, _mm256_loadu_ps(xs)));
    __m256 ov = load8(o);
    if (bias != 0.f) ov = _mm256_fmadd_ps(_mm256_set1_ps(bias), sv, ov);
    return _mm256_fmadd_ps(ov, _mm256_loadu_ps(u), off);
  }
};

}  // namespace
}  // namespace floe_qdot

#endif
