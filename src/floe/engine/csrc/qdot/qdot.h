// The quantized GEMV's mathematics, shared by every instruction-set variant (header-only, no ATen):
// the input row is quantized to int8 per group of 32 (step = absmax / 127, as llama.cpp does), each
// group's integer dot product with the weight's codes is exact, and groups combine in float:
//   y[n] = sum_g xs[g] * (scale[n,g] * dot(q[n,g], qx[g]) + offset[n,g] * sum(qx[g]))
// The weight is read in place in its file's block layout (abi.h's formats: a block of 32 weights is
// its scale, [offset,] and codes, one stream per row): 4-bit codes q in 0..15 with an offset (Q4_0's
// is -8 d), or Q8_0's signed bytes q in -128..127 with none.
//
// A variant supplies an `Isa` (isa_portable.h, isa_x86.h, isa_neon.h):
//   Acc, zero(), add(a, b), fma(d, s, acc) = acc + d * s, hsum(acc): float lanes of group dots
//   codes<FourBit>(codes) -> a group's codes unpacked, dot<FourBit>(those, qx) -> Acc whose lanes sum
//   to dot(q, qx)
//   half(bits): fp16 -> float32
//   Scales, scales8<Fmt>(blocks): eight blocks' [scale, offset] pairs (read once for every input row)
//   Cs, Off, off_zero(), block8<FourBit>(scales, xsu, off) -> Cs: per input row, the pairs times the
//   row's [step, step * sum] (off accumulates the offset products), cs_of(cs, j): group j's scale x step
//   kPairs, pair_codes(codes of g, codes of g + 1), pair_fma(...): whether it takes 4-bit groups two
//   at a time (see pair_layout)
//   kRows: how many input rows share one unpacking of the codes (as many as its registers hold)
//   dequant_group<FourBit>(codes, s, z, out): a group's 32 weights s * q + z (s * q for bytes),
//   float32 or bf16
#ifndef FLOE_QDOT_H
#define FLOE_QDOT_H

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "abi.h"

#if defined(__GNUC__)
#define FLOE_QDOT_EXPORT extern "C" __attribute__((visibility("default")))
#else
#define FLOE_QDOT_EXPORT extern "C"
#endif

namespace floe_qdot {
namespace {  // each variant's library has its own copy: nothing here is shared between them

constexpr int64_t G = 32;

// Loops over a few input rows, pairs or groups unrolled whole, so that their accumulators (arrays
// indexed by those loops) live in registers: left as loops, GCC kept them on the stack, and every
// multiply-add of several rows waited on a store and a load (3-4x slower for 4 rows).
#if defined(__clang__)
#define FLOE_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define FLOE_UNROLL _Pragma("GCC unroll 16")
#else
#define FLOE_UNROLL
#endif

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

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

// qx int8 [K]; xsu [K/16]: per group its step xs = absmax / 127 and xs * sum(qx of the group),
// side by side as a block's scale and offset are
inline void quantize_row(const float* x, int64_t k, int8_t* qx, float* xsu) {
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
    xsu[2 * g] = d;
    xsu[2 * g + 1] = d * static_cast<float>(sum);
  }
}

// For variants with kPairs: each pair of 4-bit groups (g, g+1) of a block of 8 is read into one
// register of 32 code bytes (g's 16, then g+1's), whose low nibbles are elements 0..15 of g and of g+1
// and whose high nibbles are their elements 16..31; the input is laid out to match, once per input row:
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

// Whether a variant quantizes a row in vectors of its own (Isa::quantize_row, the same numbers as
// quantize_row's: a max, one product and one round-to-nearest-even a weight).
template <class Isa, class = void>
struct VectorQuantize : std::false_type {};
template <class Isa>
struct VectorQuantize<Isa, std::void_t<decltype(&Isa::quantize_row)>> : std::true_type {};

template <class Isa>
void quantize(const float* x, int64_t k, int four_bit, int8_t* qx, float* xsu) {
  if constexpr (VectorQuantize<Isa>::value) {
    Isa::quantize_row(x, k, qx, xsu);
  } else {
    quantize_row(x, k, qx, xsu);
  }
  if (four_bit && Isa::kPairs) pair_layout(qx, k / G);
}

// The block formats (abi.h): a block's size, where its codes start, and its scale and offset.
struct Q4_0 {  // fp16 d, 16 nibble bytes: w = d q - 8 d
  static constexpr int64_t kBytes = 18, kCodes = 2;
  static constexpr bool kFourBit = true;
  static constexpr int kFields = 1;  // header fields (scale[, offset]), each kCodes / kFields bytes
  template <class Isa>
  static void scale(const uint8_t* b, float& s, float& o) {
    s = Isa::half(load_u16(b));
    o = -8.f * s;
  }
};
struct Q4_1 {  // fp16 d, fp16 m, 16 nibble bytes: w = d q + m
  static constexpr int64_t kBytes = 20, kCodes = 4;
  static constexpr bool kFourBit = true;
  static constexpr int kFields = 2;  // header fields (scale[, offset]), each kCodes / kFields bytes
  template <class Isa>
  static void scale(const uint8_t* b, float& s, float& o) {
    s = Isa::half(load_u16(b));
    o = Isa::half(load_u16(b + 2));
  }
};
struct Q8_0 {  // fp16 d, 32 signed bytes: w = d q
  static constexpr int64_t kBytes = 34, kCodes = 2;
  static constexpr bool kFourBit = false;
  static constexpr int kFields = 1;  // header fields (scale[, offset]), each kCodes / kFields bytes
  template <class Isa>
  static void scale(const uint8_t* b, float& s, float& o) {
    s = Isa::half(load_u16(b));
    o = 0.f;
  }
};
struct Q4_F {  // float32 s, float32 o, 16 nibble bytes: w = s q + o (floe's own, for Q4_K's groups)
  static constexpr int64_t kBytes = 24, kCodes = 8;
  static constexpr bool kFourBit = true;
  static constexpr int kFields = 2;  // header fields (scale[, offset]), each kCodes / kFields bytes
  template <class Isa>
  static void scale(const uint8_t* b, float& s, float& o) {
    s = load_f32(b);
    o = load_f32(b + 4);
  }
};

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
  struct Scales {
    float v[16];  // [scale, offset] of groups 0..7
  };
  using Cs = Scales;  // [scale * step, offset * step * sum] of groups 0..7
  static float half(uint16_t h) { return half_to_float(h); }
  static float off_zero() { return 0.f; }
  static float off_sum(float off) { return off; }
  template <class Fmt>
  static Scales scales8(const uint8_t* b) {
    Scales s;
    for (int j = 0; j < 8; ++j) {
      Fmt::template scale<ScalarBlocks>(b + j * Fmt::kBytes, s.v[2 * j], s.v[2 * j + 1]);
    }
    return s;
  }
  template <bool FourBit>
  static Cs block8(const Scales& s, const float* xsu, float& off) {
    Cs c;
    for (int i = 0; i < 16; ++i) c.v[i] = s.v[i] * xsu[i];
    if constexpr (FourBit) {
      for (int j = 0; j < 8; ++j) off += c.v[2 * j + 1];
    }
    return c;
  }
  static float cs_of(const Cs& c, int j) { return c.v[2 * j]; }
  // A group's 32 weights, s * q + z (a product, then a sum: as PyTorch's addcmul) or, for signed
  // bytes, s * q, to out.
  template <bool FourBit, typename Out>
  static void dequant_group(const uint8_t* c, float s, float z, Out* out) {
    float w[G];
    if constexpr (FourBit) {
      for (int j = 0; j < G / 2; ++j) {
        w[j] = s * static_cast<float>(c[j] & 15) + z;
        w[j + G / 2] = s * static_cast<float>(c[j] >> 4) + z;
      }
    } else {
      for (int j = 0; j < G; ++j) w[j] = s * static_cast<float>(static_cast<int8_t>(c[j]));
    }
    for (int j = 0; j < G; ++j) store(w[j], out + j);
  }
};

// The outputs of one weight row (its blocks) for R input rows (q, xsu: the first row's; each next
// row `k`, and 2 `groups`, further on), written to y[0], y[ldy], ... Each group's codes and scales are
// read and unpacked once for all R rows. Per row, groups go in blocks of 8, spread over four
// independent accumulators (an FMA's latency is about four of its issue slots), the offset term
// accumulated apart, in the same order whatever R is: every output is the same number for R = 1 as
// for R = 4.
template <class Isa, class Fmt, int R>
inline void row_dots(const uint8_t* row, const int8_t* q, const float* xsu, int64_t groups, float* y,
                     int64_t ldy) {
  constexpr bool four = Fmt::kFourBit;
  constexpr int64_t B = Fmt::kBytes, C = Fmt::kCodes;
  const int64_t k = groups * G;
  using Acc = typename Isa::Acc;
  Acc a[R][4];
  typename Isa::Off off[R];
  FLOE_UNROLL
  for (int r = 0; r < R; ++r) {
    a[r][0] = a[r][1] = a[r][2] = a[r][3] = Isa::zero();
    off[r] = Isa::off_zero();
  }
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const uint8_t* b = row + g * B;
    const auto scales = Isa::template scales8<Fmt>(b);
    typename Isa::Cs cs[R];
    FLOE_UNROLL
    for (int r = 0; r < R; ++r) {
      cs[r] = Isa::template block8<four>(scales, xsu + 2 * (r * groups + g), off[r]);
    }
    const int8_t* qg = q + g * G;
    if constexpr (four && Isa::kPairs) {
      FLOE_UNROLL
      for (int p = 0; p < 4; ++p) {
        const auto w = Isa::pair_codes(b + 2 * p * B + C, b + (2 * p + 1) * B + C);
        FLOE_UNROLL
        for (int r = 0; r < R; ++r) a[r][p] = Isa::pair_fma(w, qg + r * k + 64 * p, cs[r], p, a[r][p]);
      }
    } else {
      FLOE_UNROLL
      for (int j = 0; j < 8; ++j) {
        const auto w = Isa::template codes<four>(b + j * B + C);
        FLOE_UNROLL
        for (int r = 0; r < R; ++r) {
          a[r][j % 4] = Isa::fma(Isa::template dot<four>(w, qg + r * k + j * G), Isa::cs_of(cs[r], j),
                                 a[r][j % 4]);
        }
      }
    }
  }
  float rest[R] = {};
  for (; g < groups; ++g) {
    float s, o;
    Fmt::template scale<Isa>(row + g * B, s, o);
    const auto w = Isa::template codes<four>(row + g * B + C);
    FLOE_UNROLL
    for (int r = 0; r < R; ++r) {
      const float* xu = xsu + 2 * (r * groups + g);
      a[r][0] = Isa::fma(Isa::template dot<four>(w, q + r * k + g * G), s * xu[0], a[r][0]);
      if constexpr (four) rest[r] += o * xu[1];
    }
  }
  FLOE_UNROLL
  for (int r = 0; r < R; ++r) {
    y[r * ldy] = Isa::hsum(Isa::add(Isa::add(a[r][0], a[r][1]), Isa::add(a[r][2], a[r][3]))) +
                 Isa::off_sum(off[r]) + rest[r];
  }
}

// Rows of blocks are asked for from memory this many rows ahead of the one being read, a cache line
// at a time: a decode token streams every weight once, and on the machines measured (docs/PERF.md)
// the hardware's prefetchers alone left a core waiting for its rows.
constexpr int64_t kAheadRows = 4;

// Outputs [begin, end) for R input rows.
template <class Isa, class Fmt, int R>
void rows_of(const uint8_t* blocks, const int8_t* q, const float* xsu, int64_t groups, int64_t begin,
             int64_t end, float* y, int64_t ldy) {
  const int64_t width = groups * Fmt::kBytes;
  for (int64_t n = begin; n < end; ++n) {
    if (n + kAheadRows < end) {
      const uint8_t* ahead = blocks + (n + kAheadRows) * width;
      for (int64_t i = 0; i < width; i += 64) __builtin_prefetch(ahead + i);
    }
    row_dots<Isa, Fmt, R>(blocks + n * width, q, xsu, groups, y + n, ldy);
  }
}

// pass(std::integral_constant<int, n>) for n = count <= R (the row count as a compile-time constant).
template <int R, class Pass>
inline void with_rows(int64_t count, const Pass& pass) {
  if constexpr (R > 1) {
    if (count < R) return with_rows<R - 1>(count, pass);
  }
  pass(std::integral_constant<int, R>{});
}

// m input rows R at a time (the last pass fewer): pass(n, qx, xsu, y) of each pass's n rows.
template <int R, class Pass>
inline void in_passes(int64_t m, int64_t groups, const int8_t* qx, const float* xsu, float* y, int64_t ldy,
                      const Pass& pass) {
  const int64_t k = groups * G;
  for (int64_t r = 0; r < m; r += R) {
    with_rows<R>(m - r < R ? m - r : R, [&](auto n) { pass(n, qx + r * k, xsu + 2 * r * groups, y + r * ldy); });
  }
}

// Outputs [begin, end) (a block whose weights stay in the core's cache) for m input rows, kRows at a
// time: the weights are read from memory once, and unpacked once for every kRows input rows.
template <class Isa, class Fmt>
void rows(const uint8_t* blocks, const int8_t* qx, const float* xsu, int64_t m, int64_t groups,
          int64_t begin, int64_t end, float* y, int64_t ldy) {
  in_passes<Isa::kRows>(m, groups, qx, xsu, y, ldy, [&](auto n, const int8_t* q, const float* x, float* out) {
    rows_of<Isa, Fmt, decltype(n)::value>(blocks, q, x, groups, begin, end, out, ldy);
  });
}

// Weight rows [begin, end) themselves, w = s * q + o in float32 (a code times a file's scale is
// exact in float32: the one rounding is the sum's), written to out as float32 or bfloat16
// (Out = uint16_t), row n at out + (n - begin) * K: the values a prompt's matrix product reads, in
// one pass from the blocks.
template <class Isa, class Fmt, typename Out>
void dequant(const uint8_t* blocks, int64_t groups, int64_t begin, int64_t end, void* out) {
  Out* o = static_cast<Out*>(out);
  for (int64_t i = begin * groups; i < end * groups; ++i, o += G) {
    const uint8_t* b = blocks + i * Fmt::kBytes;
    float s, z;
    Fmt::template scale<Isa>(b, s, z);
    Isa::template dequant_group<Fmt::kFourBit>(b + Fmt::kCodes, s, z, o);
  }
}

// ---- interleaved bands (abi.h): 8 weight rows a band, for variants with Isa::band_dots ----------

// Row r's block of group g of an interleaved band, rebuilt in the file's layout (into `block`).
template <class Fmt>
inline void band_block(const uint8_t* group, int r, uint8_t* block) {
  constexpr int64_t F = Fmt::kCodes / Fmt::kFields, H = 8 * Fmt::kCodes, Chunks = (Fmt::kBytes - Fmt::kCodes) / 4;
  for (int f = 0; f < Fmt::kFields; ++f) std::memcpy(block + f * F, group + f * 8 * F + r * F, F);
  for (int64_t c = 0; c < Chunks; ++c) std::memcpy(block + Fmt::kCodes + 4 * c, group + H + 32 * c + 4 * r, 4);
}

template <class Isa, class = void>
struct HasBandPairs : std::false_type {};
template <class Isa>
struct HasBandPairs<Isa, std::enable_if_t<Isa::kBandPairs>> : std::true_type {};

// The input rows of a pass from which bands_of takes band pairs (abi.h's pair_rows; floe.engine.qgemv
// sets it for the CPU): where a core runs a 512-bit operation as two 256-bit halves (AMD's Zen 4), one
// input row's pairs were slower than single bands (a Llama-3.2-1B-shape decode step 15 % slower, two
// rows 13 %), and from four rows on they are the faster (eight rows: 1.6x); where it runs them whole
// (Intel's AVX-512 cores), pairs were the faster from one row.
inline std::atomic<int> g_pair_rows{1};

inline int pair_rows(int rows) {
  if (rows > 0) g_pair_rows.store(rows, std::memory_order_relaxed);
  return g_pair_rows.load(std::memory_order_relaxed);
}

// Bands [begin, end) for R input rows (as rows_of for the file's rows): band b's outputs at y + 8 b;
// two at a time where the variant has Isa::band_pair_dots and R reaches g_pair_rows (the same values).
template <class Isa, class Fmt, int R>
void bands_of(const uint8_t* bands, const int8_t* q, const float* xsu, int64_t groups, int64_t begin,
              int64_t end, float* y, int64_t ldy) {
  const int64_t width = groups * 8 * Fmt::kBytes;
  int64_t b = begin;
  if constexpr (HasBandPairs<Isa>::value) {
    if (R >= g_pair_rows.load(std::memory_order_relaxed)) {
      for (; b + 2 <= end; b += 2) {
        Isa::template band_pair_dots<Fmt, R>(bands + b * width, width, q, xsu, groups, y + 8 * b, ldy);
      }
    }
  }
  for (; b < end; ++b) {
    Isa::template band_dots<Fmt, R>(bands + b * width, q, xsu, groups, y + 8 * b, ldy);
  }
}

// rows for interleaved bands: the input rows Isa::kBandRows at a time (qx in quantize_row's order).
template <class Isa, class Fmt>
void rows8(const uint8_t* bands, const int8_t* qx, const float* xsu, int64_t m, int64_t groups,
           int64_t begin, int64_t end, float* y, int64_t ldy) {
  in_passes<Isa::kBandRows>(m, groups, qx, xsu, y, ldy, [&](auto n, const int8_t* q, const float* x, float* out) {
    bands_of<Isa, Fmt, decltype(n)::value>(bands, q, x, groups, begin, end, out, ldy);
  });
}

template <class Isa, class = void>
struct HasBandValues : std::false_type {};
template <class Isa>
struct HasBandValues<Isa, std::enable_if_t<Isa::kBandValues>> : std::true_type {};

// dequant for interleaved bands: rows [begin, end) (row n is lane n % 8 of band n / 8), each row's
// values written in order (a band, read 8 times, stays in the core's cache), its blocks rebuilt in
// the file's layout one at a time; whole bands at once where the variant has Isa::band_values.
template <class Isa, class Fmt, typename Out>
void dequant8(const uint8_t* bands, int64_t groups, int64_t begin, int64_t end, void* out) {
  const int64_t k = groups * G, width = groups * 8 * Fmt::kBytes;
  Out* o = static_cast<Out*>(out);
  if constexpr (HasBandValues<Isa>::value) {  // whole bands at once where the variant can
    for (; begin % 8 == 0 && begin + 8 <= end; begin += 8, o += 8 * k) {
      Isa::template band_values<Fmt, Out>(bands + begin / 8 * width, groups, o);
    }
  }
  uint8_t block[Fmt::kBytes];
  for (int64_t n = begin; n < end; ++n, o += k) {
    const uint8_t* band = bands + n / 8 * width;
    for (int64_t g = 0; g < groups; ++g) {
      band_block<Fmt>(band + g * 8 * Fmt::kBytes, static_cast<int>(n % 8), block);
      float s, z;
      Fmt::template scale<Isa>(block, s, z);
      Isa::template dequant_group<Fmt::kFourBit>(block + Fmt::kCodes, s, z, o + g * G);
    }
  }
}

template <class Isa, class = void>
struct HasBands : std::false_type {};
template <class Isa>
struct HasBands<Isa, std::void_t<decltype(Isa::kBandRows)>> : std::true_type {};

// The table a variant's library hands to floe's operator (formats in abi.h's order).
template <class Isa>
const FloeQdotKernel* kernel(const char* name) {
  static const FloeQdotKernel table = [name] {
    FloeQdotKernel t = {
        FLOE_QDOT_ABI, name, &Isa::runs_here, &quantize<Isa>,
        {&rows<Isa, Q4_0>, &rows<Isa, Q4_1>, &rows<Isa, Q8_0>, &rows<Isa, Q4_F>},
        {{&dequant<Isa, Q4_0, float>, &dequant<Isa, Q4_0, uint16_t>},
         {&dequant<Isa, Q4_1, float>, &dequant<Isa, Q4_1, uint16_t>},
         {&dequant<Isa, Q8_0, float>, &dequant<Isa, Q8_0, uint16_t>},
         {&dequant<Isa, Q4_F, float>, &dequant<Isa, Q4_F, uint16_t>}},
        {},
        {},
        HasBandPairs<Isa>::value ? &pair_rows : nullptr};
    if constexpr (HasBands<Isa>::value) {
      const floe_qdot_rows_fn rows[] = {&rows8<Isa, Q4_0>, &rows8<Isa, Q4_1>, &rows8<Isa, Q8_0>, &rows8<Isa, Q4_F>};
      const floe_qdot_dequant_fn values[][2] = {
          {&dequant8<Isa, Q4_0, float>, &dequant8<Isa, Q4_0, uint16_t>},
          {&dequant8<Isa, Q4_1, float>, &dequant8<Isa, Q4_1, uint16_t>},
          {&dequant8<Isa, Q8_0, float>, &dequant8<Isa, Q8_0, uint16_t>},
          {&dequant8<Isa, Q4_F, float>, &dequant8<Isa, Q4_F, uint16_t>}};
      for (int f = 0; f < FLOE_QDOT_FORMATS; ++f) {
        t.rows8[f] = rows[f];
        t.dequant8[f][0] = values[f][0];
        t.dequant8[f][1] = values[f][1];
      }
    }
    return t;
  }();
  return &table;
}

}  // namespace
}  // namespace floe_qdot

#endif
