// x86-64 group dot products on 256-bit vectors. Vnni: vpdpbusd (u8 x s8, four products summed per
// 32-bit lane, no saturation; AVX-512 VNNI + VL). Without it, AVX2 as llama.cpp does: vpmaddubsw
// (u8 x s8 pairs summed to int16, SATURATING) then vpmaddwd to int32. 4-bit codes (0..15) are the
// unsigned operand as they are (|pair| <= 2 x 15 x 127 = 3810). Q8_0's signed bytes are not
// unsigned, so, as llama.cpp does, the sign moves to the input: |q| x sign(qx, q), whose pairs are at
// most 2 x 128 x 127 = 32512 (q = -128: |q| is 0x80, read unsigned as 128).
#ifndef FLOE_QDOT_ISA_X86_H
#define FLOE_QDOT_ISA_X86_H

#include <immintrin.h>

#include <cstring>
#include <type_traits>

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
  static __m256 zero() { return _mm256_setzero_ps(); }
  static __m256 add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
  static __m256 fma(__m256 d, float s, __m256 acc) { return _mm256_fmadd_ps(d, _mm256_set1_ps(s), acc); }
  static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  static float half(uint16_t h) { return _cvtsh_ss(h); }

  // quantize_row (qdot.h) eight lanes at a time, the same numbers: the group's absmax (NaN lanes
  // ignored, as fmax does), one product by the inverse step and a round to nearest even a weight
  // (vroundps: nearbyint's rounding), the codes packed to int8, their sum in int32. ~15x faster than
  // the scalar loop, whose rounding was a libm call a weight (~4 us of a 576-wide row's GEMV).
  static void quantize_row(const float* x, int64_t k, int8_t* qx, float* xsu) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t g = 0; g < k / G; ++g) {
      const float* xg = x + g * G;
      __m256 v[4], m = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xg + 8 * i);
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m);  // a NaN lane keeps m's
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float d = _mm_cvtss_f32(h) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      const __m256 iv = _mm256_set1_ps(inv);
      __m256i q[4], sum = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        q[i] = _mm256_cvtps_epi32(
            _mm256_round_ps(_mm256_mul_ps(v[i], iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        sum = _mm256_add_epi32(sum, q[i]);
      }
      // packs work within 128-bit lanes: the dwords come out [0lo 1lo 2lo 3lo 0hi 1hi 2hi 3hi]
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + g * G), _mm256_permutevar8x32_epi32(packed, order));
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
      xsu[2 * g] = d;
      xsu[2 * g + 1] = d * static_cast<float>(_mm_cvtsi128_si32(s));
    }
  }

  // Eight blocks' [scale, offset] pairs, groups 0-3 in lo and 4-7 in hi. The first four bytes of
  // each block (Q4_1: d and m; Q4_0, Q8_0: d and two code bytes) are gathered by broadcasts (load
  // ports only) and blends, four to a register, whose eight fp16 halves one vcvtph2ps converts: no
  // shuffle, where inserting each (vpinsrw) would queue them all on the port the dot products use.
  struct Scales {
    __m256 lo, hi;
  };
  using Cs = Scales;  // [scale * step, offset * step * sum] per group
  template <class Fmt>
  static Scales scales8(const uint8_t* b) {
    constexpr int64_t S = Fmt::kBytes;
    if constexpr (std::is_same_v<Fmt, Q4_F>) {  // float32 s and o: 8 bytes a block
      return {pairs4<S>(b), pairs4<S>(b + 4 * S)};
    } else {
      __m256 lo = _mm256_cvtph_ps(dwords4<S>(b)), hi = _mm256_cvtph_ps(dwords4<S>(b + 4 * S));
      if constexpr (std::is_same_v<Fmt, Q4_0>) {  // [d, -8 d]
        const __m256 k = _mm256_setr_ps(1.f, -8.f, 1.f, -8.f, 1.f, -8.f, 1.f, -8.f);
        lo = _mm256_mul_ps(_mm256_moveldup_ps(lo), k);
        hi = _mm256_mul_ps(_mm256_moveldup_ps(hi), k);
      } else if constexpr (std::is_same_v<Fmt, Q8_0>) {  // [d, 0]
        lo = _mm256_blend_ps(lo, _mm256_setzero_ps(), 0xAA);
        hi = _mm256_blend_ps(hi, _mm256_setzero_ps(), 0xAA);
      }
      return {lo, hi};
    }
  }
  template <int64_t S>
  static __m128i dwords4(const uint8_t* p) {  // the 32 bits at p, p + S, p + 2 S, p + 3 S
    const auto at = [p](int j) { return _mm_set1_epi32(static_cast<int>(load_u32(p + j * S))); };
    return _mm_blend_epi32(_mm_blend_epi32(at(0), at(1), 0xA), _mm_blend_epi32(at(2), at(3), 0xA), 0xC);
  }
  template <int64_t S>
  static __m256 pairs4(const uint8_t* p) {  // the 64 bits at p, p + S, p + 2 S, p + 3 S
    const auto at = [p](int j) {
      uint64_t v;
      std::memcpy(&v, p + j * S, sizeof v);
      return _mm256_set1_epi64x(static_cast<long long>(v));
    };
    const __m256i a = _mm256_blend_epi32(at(0), at(1), 0x0C), c = _mm256_blend_epi32(at(2), at(3), 0xC0);
    return _mm256_castsi256_ps(_mm256_blend_epi32(a, c, 0xF0));
  }
  // per input row: the pairs times its [step, step * sum]; off gathers the offset lanes (summed in
  // off_sum), the scale lanes are cs_of's and pair_fma's
  template <bool FourBit>
  static Cs block8(const Scales& s, const float* xsu, __m256& off) {
    const Cs c{_mm256_mul_ps(s.lo, _mm256_loadu_ps(xsu)), _mm256_mul_ps(s.hi, _mm256_loadu_ps(xsu + 8))};
    if constexpr (FourBit) off = _mm256_add_ps(off, _mm256_add_ps(c.lo, c.hi));
    return c;
  }
  static __m256 cs_of(const Cs& c, int j) {  // group j's scale * step, in every lane
    return _mm256_permutevar8x32_ps(j < 4 ? c.lo : c.hi, _mm256_set1_epi32(2 * (j % 4)));
  }
  static __m256 off_zero() { return _mm256_setzero_ps(); }
  static float off_sum(__m256 off) {  // the odd lanes'
    return hsum(_mm256_blend_ps(off, _mm256_setzero_ps(), 0x55));
  }
  static __m256 fma(__m256 d, __m256 s, __m256 acc) { return _mm256_fmadd_ps(d, s, acc); }

  // A group's codes as one register of 32 bytes (4-bit: low nibbles, then high).
  template <bool FourBit>
  static __m256i codes(const uint8_t* c) {
    if constexpr (FourBit) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
      return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
    }
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  }
  template <bool FourBit>
  static __m256 dot(__m256i w, const int8_t* q) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    __m256i d;
    if constexpr (FourBit) {
      if constexpr (Vnni) {
        d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
      } else {
        d = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
      }
    } else {  // signed bytes: |q| x sign(qx, q)
      const __m256i uw = _mm256_abs_epi8(w), sx = _mm256_sign_epi8(x, w);
      if constexpr (Vnni) {
        d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), uw, sx);
      } else {
        d = _mm256_madd_epi16(_mm256_maddubs_epi16(uw, sx), _mm256_set1_epi16(1));
      }
    }
    return _mm256_cvtepi32_ps(d);
  }

  // Two four-bit groups at once (pair_layout): two 16-byte loads (the groups' blocks are apart), one
  // shift and two masks give a register of low nibbles and one of high nibbles; per input row two dot
  // products fill one register, lanes 0-3 group g's, lanes 4-7 group g+1's, and the pair's two scales
  // are spread to match. 1.6x the groups a second of taking them one at a time.
  struct PairCodes {
    __m256i lo, hi;
  };
  static PairCodes pair_codes(const uint8_t* c0, const uint8_t* c1) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    const __m256i b = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(c1),
                                          reinterpret_cast<const __m128i*>(c0));
    return {_mm256_and_si256(b, m), _mm256_and_si256(_mm256_srli_epi16(b, 4), m)};
  }
  // acc + the pair's dots with q, times pair p's scales of cs (a block's 8)
  static __m256 pair_fma(const PairCodes& w, const int8_t* q, const Cs& cs, int p, __m256 acc) {
    const __m256i qlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i qhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
    __m256i d;
    if constexpr (Vnni) {
      d = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w.lo, qlo), w.hi, qhi);
    } else {  // each int16 pair sum is at most 2 x 15 x 127, so adding two of them stays in range
      const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(w.lo, qlo), _mm256_maddubs_epi16(w.hi, qhi));
      d = _mm256_madd_epi16(s, _mm256_set1_epi16(1));
    }
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), spread(cs, p), acc);
  }
  static __m256 spread(const Cs& cs, int p) {  // [group 2p's scale x 4, group 2p + 1's x 4]
    const __m256i lanes = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    const __m256i at = _mm256_add_epi32(lanes, _mm256_set1_epi32(4 * (p % 2)));
    return _mm256_permutevar8x32_ps(p < 2 ? cs.lo : cs.hi, at);
  }

  // ---- interleaved bands (abi.h): each 32-bit lane is one of 8 weight rows -----------------------
  // A group: its 8 rows' scales (and offsets) in one register each; per chunk of codes (4 bytes of
  // each row) one load unpacked once for every input row, whose 4 inputs are broadcast to all lanes;
  // the group's integer sums (exact) times scale x step, accumulated per input row across groups in
  // one register of the 8 rows' outputs, the offset term apart, in the same order whatever R is.
  // AVX2: vpmaddubsw's int16 pair sums of a 4-bit chunk are at most 2 x 15 x 127, so a group's four
  // chunks, low and high nibbles (8 of them), stay below 32767 before one vpmaddwd widens them.
  // Input rows a pass. vnni: 8, band_pair_dots' 3 registers a row (24 of AVX-512's 32); an odd last band's
  // band_dots (4 a row) spills there, rare (blocks of bands are even). AVX2: 2 (3 measured no faster).
  static constexpr int kBandRows = Vnni ? 8 : 2;
  // Each group's bytes of the band kAheadBands on are prefetched as a group is read: the next block's
  // bands (a block of bands meets the input rows in passes, the first from memory) arrive while this
  // one's are computed. (The whole weights of a SmolLM2 step at 8 rows: 7.8-8.0 -> 5.4-5.7 ms.)
  static constexpr int64_t kAheadBands = 4;

  template <class Fmt, int R>
  static void band_dots(const uint8_t* band, const int8_t* q, const float* xsu, int64_t groups, float* y,
                        int64_t ldy) {
    constexpr int64_t B = Fmt::kBytes, H = 8 * Fmt::kCodes;
    constexpr bool four = Fmt::kFourBit, q4_0 = std::is_same_v<Fmt, Q4_0>, q8_0 = std::is_same_v<Fmt, Q8_0>;
    const int64_t k = groups * G;
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[R], off[R];
    FLOE_UNROLL
    for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = band + g * 8 * B;
      for (int64_t i = 0; i < 8 * B; i += 64) __builtin_prefetch(p + kAheadBands * groups * 8 * B + i);
      __m256 d, o = _mm256_setzero_ps();
      if constexpr (std::is_same_v<Fmt, Q4_F>) {
        d = _mm256_loadu_ps(reinterpret_cast<const float*>(p));
        o = _mm256_loadu_ps(reinterpret_cast<const float*>(p + 32));
      } else {
        d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        if constexpr (std::is_same_v<Fmt, Q4_1>) o = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
      }
      const uint8_t* c = p + H;
      __m256i s[R], t[R];
      if constexpr (four) {
        FLOE_UNROLL
        for (int cc = 0; cc < 4; ++cc) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * cc));
          const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
          FLOE_UNROLL
          for (int r = 0; r < R; ++r) {
            const int8_t* qg = q + r * k + g * G;
            const __m256i xl = _mm256_set1_epi32(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(qg + 4 * cc))));
            const __m256i xh = _mm256_set1_epi32(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(qg + 16 + 4 * cc))));
            if constexpr (Vnni) {
              s[r] = _mm256_dpbusd_epi32(cc ? s[r] : _mm256_setzero_si256(), lo, xl);
              t[r] = _mm256_dpbusd_epi32(cc ? t[r] : _mm256_setzero_si256(), hi, xh);
            } else {
              const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
              s[r] = cc ? _mm256_add_epi16(s[r], pair) : pair;
            }
          }
        }
        FLOE_UNROLL
        for (int r = 0; r < R; ++r) s[r] = Vnni ? _mm256_add_epi32(s[r], t[r]) : _mm256_madd_epi16(s[r], ones);
      } else {  // signed bytes: |q| x sign(x, q), as dot()
        FLOE_UNROLL
        for (int cc = 0; cc < 8; ++cc) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * cc));
          const __m256i uw = _mm256_abs_epi8(w);
          FLOE_UNROLL
          for (int r = 0; r < R; ++r) {
            const int8_t* qg = q + r * k + g * G;
            const __m256i x = _mm256_set1_epi32(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(qg + 4 * cc))));
            const __m256i sx = _mm256_sign_epi8(x, w);
            __m256i* into = cc % 2 ? t : s;
            if constexpr (Vnni) {
              into[r] = _mm256_dpbusd_epi32(cc > 1 ? into[r] : _mm256_setzero_si256(), uw, sx);
            } else {
              const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(uw, sx), ones);
              into[r] = cc > 1 ? _mm256_add_epi32(into[r], dot) : dot;
            }
          }
        }
        FLOE_UNROLL
        for (int r = 0; r < R; ++r) s[r] = _mm256_add_epi32(s[r], t[r]);
      }
      FLOE_UNROLL
      for (int r = 0; r < R; ++r) {
        const float* xu = xsu + 2 * (r * groups + g);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(d, _mm256_set1_ps(xu[0])), acc[r]);
        if constexpr (!q8_0) off[r] = _mm256_fmadd_ps(q4_0 ? d : o, _mm256_set1_ps(xu[1]), off[r]);
      }
    }
    FLOE_UNROLL
    for (int r = 0; r < R; ++r) {
      __m256 out = acc[r];
      if constexpr (q4_0) {
        out = _mm256_fmadd_ps(off[r], _mm256_set1_ps(-8.f), acc[r]);  // w = d q - 8 d
      } else if constexpr (!q8_0) {
        out = _mm256_add_ps(acc[r], off[r]);
      }
      _mm256_storeu_ps(y + r * ldy, out);
    }
  }

  // Two neighbouring bands at once in 512-bit registers (AVX-512 VNNI only): band b's 8 rows in the low
  // lanes, band b + 1's in the high, so one broadcast of an input's 4 bytes and one vpdpbusd serve 16
  // weight rows, half the instructions a row of band_dots takes where several input rows make the
  // step compute-bound (a batched decode step). Each output lane goes through the same operations in
  // the same order as in band_dots (exact integer sums, then the same float products and sums), so
  // its value is bitwise band_dots'. Q8_0: AVX-512 has no vpsignb; the input's bytes are negated where
  // the weight's are negative (a byte mask), |q| x that, as band_dots' sign(qx, q).
  static constexpr bool kBandPairs = Vnni;

  static __m512 join(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
  }
  static __m512i join(const uint8_t* a, const uint8_t* b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
  }
  static __m256 halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static __m512i bcast(const int8_t* p) {
    return _mm512_set1_epi32(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(p))));
  }

  template <class Fmt, int R>
  static void band_pair_dots(const uint8_t* band, int64_t width, const int8_t* q, const float* xsu, int64_t groups,
                             float* y, int64_t ldy) {
    constexpr int64_t B = Fmt::kBytes, H = 8 * Fmt::kCodes;
    constexpr bool four = Fmt::kFourBit, q4_0 = std::is_same_v<Fmt, Q4_0>, q8_0 = std::is_same_v<Fmt, Q8_0>;
    const int64_t k = groups * G;
    const __m512i m4 = _mm512_set1_epi8(0x0F), none = _mm512_setzero_si512();
    __m512 acc[R], off[R];
    FLOE_UNROLL
    for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t *p = band + g * 8 * B, *p1 = p + width;
      for (int64_t i = 0; i < 8 * B; i += 64) {
        __builtin_prefetch(p + kAheadBands * width + i);
        __builtin_prefetch(p1 + kAheadBands * width + i);
      }
      __m512 d, o = _mm512_setzero_ps();
      if constexpr (std::is_same_v<Fmt, Q4_F>) {
        d = join(_mm256_loadu_ps(reinterpret_cast<const float*>(p)), _mm256_loadu_ps(reinterpret_cast<const float*>(p1)));
        o = join(_mm256_loadu_ps(reinterpret_cast<const float*>(p + 32)),
                 _mm256_loadu_ps(reinterpret_cast<const float*>(p1 + 32)));
      } else {
        d = join(halves(p), halves(p1));
        if constexpr (std::is_same_v<Fmt, Q4_1>) o = join(halves(p + 16), halves(p1 + 16));
      }
      const uint8_t *c = p + H, *c1 = p1 + H;
      __m512i s[R];  // (the low and high codes' sums in one: exact integers, any order)
      if constexpr (four) {
        FLOE_UNROLL
        for (int cc = 0; cc < 4; ++cc) {
          const __m512i w = join(c + 32 * cc, c1 + 32 * cc);
          const __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
          FLOE_UNROLL
          for (int r = 0; r < R; ++r) {
            const int8_t* qg = q + r * k + g * G;
            s[r] = _mm512_dpbusd_epi32(cc ? s[r] : none, lo, bcast(qg + 4 * cc));
            s[r] = _mm512_dpbusd_epi32(s[r], hi, bcast(qg + 16 + 4 * cc));
          }
        }
      } else {
        FLOE_UNROLL
        for (int cc = 0; cc < 8; ++cc) {
          const __m512i w = join(c + 32 * cc, c1 + 32 * cc);
          const __m512i uw = _mm512_abs_epi8(w);
          const __mmask64 negative = _mm512_movepi8_mask(w);
          FLOE_UNROLL
          for (int r = 0; r < R; ++r) {
            const __m512i x = bcast(q + r * k + g * G + 4 * cc);
            const __m512i sx = _mm512_mask_sub_epi8(x, negative, none, x);
            s[r] = _mm512_dpbusd_epi32(cc ? s[r] : none, uw, sx);
          }
        }
      }
      FLOE_UNROLL
      for (int r = 0; r < R; ++r) {
        const float* xu = xsu + 2 * (r * groups + g);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(d, _mm512_set1_ps(xu[0])), acc[r]);
        if constexpr (!q8_0) off[r] = _mm512_fmadd_ps(q4_0 ? d : o, _mm512_set1_ps(xu[1]), off[r]);
      }
    }
    FLOE_UNROLL
    for (int r = 0; r < R; ++r) {
      __m512 out = acc[r];
      if constexpr (q4_0) {
        out = _mm512_fmadd_ps(off[r], _mm512_set1_ps(-8.f), acc[r]);
      } else if constexpr (!q8_0) {
        out = _mm512_add_ps(acc[r], off[r]);
      }
      _mm512_storeu_ps(y + r * ldy, out);
    }
  }

  // Whole bands' values at once (AVX-512 only), what dequant8 gives a row at a time: per group, the 8
  // rows' codes taken out of the band's chunks by two permutes of 32-bit lanes (row r's bytes are lane
  // r of each chunk), each row's 32 weights s * q + z (s * q for bytes) in 512-bit registers, in the
  // same operations as dequant_group (so the same values), written to out row r at out + r * K.
  static constexpr bool kBandValues = Vnni;

  // (compiled for AVX-512 BF16 too: where the CPU has it, bfloat16 values are rounded by vcvtne2ps2bf16,
  // round to nearest even as bf16_bits; weights s * q + z of a file's scales are never float32
  // denormals, which that instruction flushes; a NaN weight keeps its sign there.)
  template <class Fmt, typename Out>
  __attribute__((target("avx512bf16"))) static void band_values(const uint8_t* band, int64_t groups, Out* out) {
    static const bool cvt = __builtin_cpu_supports("avx512bf16");
    constexpr int64_t B = Fmt::kBytes, H = 8 * Fmt::kCodes;
    constexpr bool four = Fmt::kFourBit;
    const int64_t k = groups * G;
    const __m512i low4 = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
    const __m512i high4 = _mm512_add_epi32(low4, _mm512_set1_epi32(4));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    alignas(64) uint8_t codes[8 * 32];  // row r's code bytes at 16 r (4-bit) or 32 r (bytes)
    alignas(32) float scales[8], offsets[8];
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = band + g * 8 * B;
      // the 8 rows' scales and offsets, as Fmt::scale gives them (a band's header: each field of rows 0..7)
      if constexpr (std::is_same_v<Fmt, Q4_F>) {
        _mm256_store_ps(scales, _mm256_loadu_ps(reinterpret_cast<const float*>(p)));
        _mm256_store_ps(offsets, _mm256_loadu_ps(reinterpret_cast<const float*>(p + 32)));
      } else {
        const __m256 d = halves(p);
        _mm256_store_ps(scales, d);
        _mm256_store_ps(offsets, std::is_same_v<Fmt, Q4_1> ? halves(p + 16)
                                 : std::is_same_v<Fmt, Q4_0> ? _mm256_mul_ps(_mm256_set1_ps(-8.f), d)
                                                             : _mm256_setzero_ps());
      }
      const uint8_t* c = p + H;
      if constexpr (four) {
        const __m512i a = _mm512_loadu_si512(c), b = _mm512_loadu_si512(c + 64);
        _mm512_store_si512(codes, _mm512_permutex2var_epi32(a, low4, b));
        _mm512_store_si512(codes + 64, _mm512_permutex2var_epi32(a, high4, b));
      } else {
        const __m512i a = _mm512_loadu_si512(c), b = _mm512_loadu_si512(c + 64);
        const __m512i e = _mm512_loadu_si512(c + 128), f = _mm512_loadu_si512(c + 192);
        const __m512i r03a = _mm512_permutex2var_epi32(a, low4, b), r47a = _mm512_permutex2var_epi32(a, high4, b);
        const __m512i r03b = _mm512_permutex2var_epi32(e, low4, f), r47b = _mm512_permutex2var_epi32(e, high4, f);
        // row r's first 16 bytes, then its last 16: lanes r % 4 of the a and b halves side by side
        const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
        _mm512_store_si512(codes, _mm512_permutex2var_epi64(r03a, first, r03b));
        _mm512_store_si512(codes + 64, _mm512_permutex2var_epi64(r03a, second, r03b));
        _mm512_store_si512(codes + 128, _mm512_permutex2var_epi64(r47a, first, r47b));
        _mm512_store_si512(codes + 192, _mm512_permutex2var_epi64(r47a, second, r47b));
      }
      for (int r = 0; r < 8; ++r) {
        const __m512 sv = _mm512_set1_ps(scales[r]), zv = _mm512_set1_ps(offsets[r]);
        Out* o = out + r * k + g * G;
        __m512 lo, hi;
        if constexpr (four) {
          const __m128i bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(codes + 16 * r));
          lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, m4)));
          hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), m4)));
          lo = _mm512_add_ps(_mm512_mul_ps(lo, sv), zv);
          hi = _mm512_add_ps(_mm512_mul_ps(hi, sv), zv);
        } else {
          lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                 _mm_load_si128(reinterpret_cast<const __m128i*>(codes + 32 * r)))), sv);
          hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                 _mm_load_si128(reinterpret_cast<const __m128i*>(codes + 32 * r + 16)))), sv);
        }
        if constexpr (std::is_same_v<Out, uint16_t>) {
          if (cvt) {
            _mm512_storeu_si512(o, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
            continue;
          }
        }
        store32(lo, hi, o);
      }
    }
  }
  static void store32(__m512 a, __m512 b, float* out) {
    _mm512_storeu_ps(out, a);
    _mm512_storeu_ps(out + 16, b);
  }
  static void store32(__m512 a, __m512 b, uint16_t* out) {  // to bf16, as to_bf16 and bf16_bits
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(bf16_bits(a)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), _mm512_cvtepi32_epi16(bf16_bits(b)));
  }
  static __m512i bf16_bits(__m512 w) {
    const __m512i u = _mm512_castps_si512(w);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(w, w, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
  }

  // A group's 32 weights s * q + z (a product, then a sum, as ScalarBlocks), or s * q for signed
  // bytes, 16 codes at a time.
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
    store16(weights8<FourBit>(lo, sv, zv), weights8<FourBit>(_mm_srli_si128(lo, 8), sv, zv), out);
    store16(weights8<FourBit>(hi, sv, zv), weights8<FourBit>(_mm_srli_si128(hi, 8), sv, zv), out + 16);
  }
  template <bool FourBit>
  static __m256 weights8(__m128i codes, __m256 s, __m256 z) {  // the low 8 bytes' weights
    if constexpr (FourBit) {
      return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), s), z);
    }
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), s);
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
};

}  // namespace
}  // namespace floe_qdot

#endif
