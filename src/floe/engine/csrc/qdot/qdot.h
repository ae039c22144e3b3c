// The quantized GEMV's mathematics, shared by every instruction-set variant (header-only, no ATen):
// the input row is quantized to int8 per group of 32 (step = absmax / 127, as llama.cpp does), each
// group's integer dot product with the weight codes is exact, and groups combine in float:
//   y[n] = sum_g xs[g] * (scale[n,g] * dot(codes[n,g], qx[g]) + offset[n,g] * sum(qx[g]))
// q4: 4-bit codes (0..15), 16 bytes a group, byte j = element j (low nibble) and j + 16 (high);
// q8: byte codes (0..255), 32 a group; w = scale * code + offset (int8 weights: code = w8 + 128).
//
// A variant supplies an `Isa` (isa_portable.h, isa_x86.h, isa_neon.h):
//   Acc, zero(), add(a, b), fma(d, s, acc) = acc + d * s, hsum(acc): float lanes of group dots
//   codes<FourBit>(codes) -> a group's codes unpacked, dot<FourBit>(those, qx) -> Acc whose lanes sum
//   to dot(codes - code_bias(FourBit), qx)
//   Off, off_zero(), block8(scale, offset, xs, u, bias, cs, off), off_sum(off), to_float(S)
//   kPairs, pair_codes(codes), pair_fma(...): whether it takes 4-bit groups two at a time (see
//   pair_layout)
//   kRows: how many input rows share one unpacking of the codes (as many as its registers hold)
//   dequant_group<FourBit>(codes, s, z, out): a group's 32 weights s * code + z, float32 or bf16
// A variant whose instructions cannot multiply the unsigned 8-bit codes directly works on
// code - 128 (a signed byte) and reports code_bias = 128; the loop below adds 128 * scale back as
// part of the offset, so every variant computes the same sum.
#ifndef FLOE_QDOT_H
#define FLOE_QDOT_H

#include <cmath>
#include <cstdint>
#include <cstring>

#include "abi.h"

#if defined(__GNUC__)
#define FLOE_QDOT_EXPORT extern "C" __attribute__((visibility("default")))
#else
#define FLOE_QDOT_EXPORT extern "C"
#endif

namespace floe_qdot {
namespace {  // each variant's library has its own copy: nothing here is shared between them

constexpr int64_t G = 32;

struct Half {  // IEEE binary16, as stored (PyTorch's float16)
  uint16_t bits;
};

inline float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);  // 112 = 127 - 15
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: man * 2^-24, normalised
    uint32_t shift = 0;
    while (!(man & 0x400u)) {
      man <<= 1;
      ++shift;
    }
    bits = sign | ((113 - shift) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// qx int8 [K], xs [K/32] each group's step, u [K/32] = step * sum(qx of the group)
inline void quantize_row(const float* x, int64_t k, int8_t* qx, float* xs, float* u) {
  for (int64_t g = 0; g < k / G; ++g) {
    const float* xg = x + g * G;
    float amax = 0.f;
    for (int j = 0; j < G; ++j) amax = std::fmax(amax, std::fabs(xg[j]));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < G; ++j) {
      const int q = static_cast<int>(std::nearbyint(xg[j] * inv));
      qx[g * G + j] = static_cast<int8_t>(q);
      sum += q;
    }
    xs[g] = d;
    u[g] = d * static_cast<float>(sum);
  }
}

// For variants with kPairs: each pair of 4-bit groups (g, g+1) of a block of 8 is read as one
// register of 32 code bytes, whose low nibbles are elements 0..15 of g and of g+1 and whose high
// nibbles are their elements 16..31; the input is laid out to match, once per input row:
// [g 0..15 | g 16..31 | g+1 0..15 | g+1 16..31] -> [g 0..15 | g+1 0..15 | g 16..31 | g+1 16..31].
// Groups after the last full block of 8 stay as they are (the tail reads them one at a time).
inline void pair_layout(int8_t* qx, int64_t groups) {
  for (int64_t g = 0; g + 8 <= groups; g += 8) {
    for (int64_t p = g; p < g + 8; p += 2) {
      int8_t swap[16];
      std::memcpy(swap, qx + p * G + 16, 16);
      std::memcpy(qx + p * G + 16, qx + p * G + 32, 16);
      std::memcpy(qx + p * G + 32, swap, 16);
    }
  }
}

template <class Isa>
void quantize(const float* x, int64_t k, int four_bit, int8_t* qx, float* xs, float* u) {
  quantize_row(x, k, qx, xs, u);
  if (four_bit && Isa::kPairs) pair_layout(qx, k / G);
}

// float32 -> bfloat16 bits, rounded to nearest even (NaN -> a quiet NaN), as PyTorch rounds.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return f != f ? uint16_t{0x7fc0} : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline void store(float w, float* out) { *out = w; }
inline void store(float w, uint16_t* out) { *out = to_bf16(w); }

// The per-group scale arithmetic in plain C++, for variants without a vector version of it.
struct ScalarBlocks {
  static constexpr bool kPairs = false;
  using Off = float;
  static float off_zero() { return 0.f; }
  static float off_sum(float off) { return off; }
  static float to_float(float v) { return v; }
  static float to_float(Half h) { return half_to_float(h.bits); }
  // cs[j] = scale[j] * xs[j]; off += (offset[j] + bias * scale[j]) * u[j], for 8 groups
  template <typename S>
  static float block8(const S* s, const S* o, const float* xs, const float* u, float bias, float* cs,
                      float off) {
    for (int j = 0; j < 8; ++j) {
      const float sj = to_float(s[j]);
      cs[j] = sj * xs[j];
      off += (to_float(o[j]) + bias * sj) * u[j];
    }
    return off;
  }
  // A group's 32 weights, s * code + z (a product, then a sum: as PyTorch's addcmul), to out.
  template <bool FourBit, typename Out>
  static void dequant_group(const uint8_t* c, float s, float z, Out* out) {
    float w[G];
    if constexpr (FourBit) {
      for (int j = 0; j < G / 2; ++j) {
        w[j] = s * static_cast<float>(c[j] & 15) + z;
        w[j + G / 2] = s * static_cast<float>(c[j] >> 4) + z;
      }
    } else {
      for (int j = 0; j < G; ++j) w[j] = s * static_cast<float>(c[j]) + z;
    }
    for (int j = 0; j < G; ++j) store(w[j], out + j);
  }
};

// The outputs of one weight row for R input rows (q, xs, u: the first row's; each next row `k`, and
// `groups`, further on), written to y[0], y[ldy], ... Each group's codes are read and unpacked once
// for all R rows. Per row, groups go in blocks of 8, spread over four independent accumulators (an
// FMA's latency is about four of its issue slots), the offset term accumulated apart, in the same
// order whatever R is: every output is the same number for R = 1 as for R = 4.
template <class Isa, bool FourBit, typename S, int R>
inline void row_dots(const uint8_t* cr, const S* sr, const S* orow, const int8_t* q, const float* xs,
                     const float* u, int64_t groups, float* y, int64_t ldy) {
  constexpr int64_t width = FourBit ? G / 2 : G;  // code bytes a group
  constexpr float bias = Isa::code_bias(FourBit);
  const int64_t k = groups * G;
  using Acc = typename Isa::Acc;
  Acc a[R][4];
  typename Isa::Off off[R];
  alignas(32) float cs[R][8];
  for (int r = 0; r < R; ++r) {
    a[r][0] = a[r][1] = a[r][2] = a[r][3] = Isa::zero();
    off[r] = Isa::off_zero();
  }
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    for (int r = 0; r < R; ++r) {
      off[r] = Isa::block8(sr + g, orow + g, xs + r * groups + g, u + r * groups + g, bias, cs[r], off[r]);
    }
    const uint8_t* c = cr + g * width;
    const int8_t* qg = q + g * G;
    if constexpr (FourBit && Isa::kPairs) {
      for (int p = 0; p < 4; ++p) {
        const auto w = Isa::pair_codes(c + 32 * p);
        for (int r = 0; r < R; ++r) a[r][p] = Isa::pair_fma(w, qg + r * k + 64 * p, cs[r], p, a[r][p]);
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        const auto w = Isa::template codes<FourBit>(c + j * width);
        for (int r = 0; r < R; ++r) {
          a[r][j % 4] = Isa::fma(Isa::template dot<FourBit>(w, qg + r * k + j * G), cs[r][j], a[r][j % 4]);
        }
      }
    }
  }
  float rest[R] = {};
  for (; g < groups; ++g) {
    const float s = Isa::to_float(sr[g]);
    const auto w = Isa::template codes<FourBit>(cr + g * width);
    for (int r = 0; r < R; ++r) {
      a[r][0] = Isa::fma(Isa::template dot<FourBit>(w, q + r * k + g * G), s * xs[r * groups + g], a[r][0]);
      rest[r] += (Isa::to_float(orow[g]) + bias * s) * u[r * groups + g];
    }
  }
  for (int r = 0; r < R; ++r) {
    y[r * ldy] = Isa::hsum(Isa::add(Isa::add(a[r][0], a[r][1]), Isa::add(a[r][2], a[r][3]))) +
                 Isa::off_sum(off[r]) + rest[r];
  }
}

// Outputs [begin, end) for R input rows.
template <class Isa, bool FourBit, typename S, int R>
void rows_of(const uint8_t* codes, const S* sc, const S* of, const int8_t* q, const float* xs, const float* u,
             int64_t groups, int64_t begin, int64_t end, float* y, int64_t ldy) {
  const int64_t width = groups * (FourBit ? G / 2 : G);
  for (int64_t n = begin; n < end; ++n) {
    row_dots<Isa, FourBit, S, R>(codes + n * width, sc + n * groups, of + n * groups, q, xs, u, groups, y + n,
                                 ldy);
  }
}

// rows_of for `count` <= R input rows.
template <class Isa, bool FourBit, typename S, int R>
void rows_upto(int64_t count, const uint8_t* codes, const S* sc, const S* of, const int8_t* q,
               const float* xs, const float* u, int64_t groups, int64_t begin, int64_t end, float* y,
               int64_t ldy) {
  if constexpr (R > 1) {
    if (count < R) {
      return rows_upto<Isa, FourBit, S, R - 1>(count, codes, sc, of, q, xs, u, groups, begin, end, y, ldy);
    }
  }
  rows_of<Isa, FourBit, S, R>(codes, sc, of, q, xs, u, groups, begin, end, y, ldy);
}

// Outputs [begin, end) (a block whose codes stay in the core's cache) for m input rows, kRows at a
// time: the weights are read from memory once, and unpacked once for every kRows input rows.
template <class Isa, bool FourBit, typename S>
void rows(const uint8_t* codes, const void* scale, const void* offset, const int8_t* qx, const float* xs,
          const float* u, int64_t m, int64_t groups, int64_t begin, int64_t end, float* y, int64_t ldy) {
  constexpr int R = Isa::kRows;
  const S* sc = static_cast<const S*>(scale);
  const S* of = static_cast<const S*>(offset);
  const int64_t k = groups * G;
  for (int64_t r = 0; r < m; r += R) {
    rows_upto<Isa, FourBit, S, R>(m - r < R ? m - r : R, codes, sc, of, qx + r * k, xs + r * groups,
                                  u + r * groups, groups, begin, end, y + r * ldy, ldy);
  }
}

// Weight rows [begin, end) themselves, w = scale * code + offset in float32 (a code times a file's
// scale is exact in float32: the one rounding is the sum's), written to out as float32 or bfloat16
// (Out = uint16_t), row n at out + (n - begin) * K: the values a prompt's matrix product reads, in
// one pass from the codes.
template <class Isa, bool FourBit, typename S, typename Out>
void dequant(const uint8_t* codes, const void* scale, const void* offset, int64_t groups, int64_t begin,
             int64_t end, void* out) {
  constexpr int64_t width = FourBit ? G / 2 : G;  // code bytes a group
  const S* sc = static_cast<const S*>(scale);
  const S* of = static_cast<const S*>(offset);
  Out* o = static_cast<Out*>(out);
  for (int64_t i = begin * groups; i < end * groups; ++i, o += G) {
    Isa::template dequant_group<FourBit>(codes + i * width, Isa::to_float(sc[i]), Isa::to_float(of[i]), o);
  }
}

// The table a variant's library hands to floe's operator.
template <class Isa>
const FloeQdotKernel* kernel(const char* name) {
  static const FloeQdotKernel table = {
      FLOE_QDOT_ABI, name, &Isa::runs_here, &quantize<Isa>,
      {{&rows<Isa, false, float>, &rows<Isa, false, Half>},
       {&rows<Isa, true, float>, &rows<Isa, true, Half>}},
      {{{&dequant<Isa, false, float, float>, &dequant<Isa, false, float, uint16_t>},
        {&dequant<Isa, false, Half, float>, &dequant<Isa, false, Half, uint16_t>}},
       {{&dequant<Isa, true, float, float>, &dequant<Isa, true, float, uint16_t>},
        {&dequant<Isa, true, Half, float>, &dequant<Isa, true, Half, uint16_t>}}}};
  return &table;
}

}  // namespace
}  // namespace floe_qdot

#endif
