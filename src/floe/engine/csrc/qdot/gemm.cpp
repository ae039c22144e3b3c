// floe::band_gemm (gemm.h): a band of a quantized weight's rows, dequantized to float32, times a
// prompt's rows. Its loops: FLOE_CLONES (clones.h), compiled for AVX-512, AVX2 and baseline.
//
// Why not the dequantized band and PyTorch's GEMM (floe.engine.prefill.banded_linear's path where the
// CPU has no native bf16 GEMM): a short prompt's product there reads the whole band of float32 values
// from memory once per product and writes it once per dequant (a 16-token prompt of the default model on
// a 2-core Zen 3: dequant 40 ms, GEMM 70 ms of ~115); here the band is dequantized into a buffer that
// stays in the core's cache and meets every prompt row there.
#include "gemm.h"

// Each product added as one fused multiply-add where the clone has FMA (the library is built as ISO
// C++, where GCC would not fuse them): one instruction, and the product unrounded.
#pragma GCC optimize("fp-contract=fast")

namespace {

template <int L>
struct Lanes {
  typedef float f __attribute__((vector_size(4 * L), aligned(4)));
};

template <class V, int L>
FLOE_INLINE float lane_sum(V v) {  // lanes i and i + L/2, then i and i + L/4, ...: one fixed tree
  float s[L];
  for (int i = 0; i < L; ++i) s[i] = v[i];
  for (int width = L / 2; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) s[i] += s[i + width];
  }
  return s[0];
}

// MR input rows times NR weight rows: MR x NR partial-sum vectors over k, each summed once at the end.
template <int L, int MR, int NR>
FLOE_INLINE void tile(const float* x, int64_t k, const float* w, float* y, int64_t ldy) {
  using V = typename Lanes<L>::f;
  V acc[MR][NR] = {};
  for (int64_t c = 0; c < k; c += L) {
    V wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = *reinterpret_cast<const V*>(w + j * k + c);
    for (int i = 0; i < MR; ++i) {
      const V xv = *reinterpret_cast<const V*>(x + i * k + c);
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = lane_sum<V, L>(acc[i][j]);
}

template <int L, int NR>
FLOE_INLINE void rows_of(const float* x, int64_t rows_x, int64_t k, const float* w, float* y, int64_t ldy) {
  int64_t m = 0;  // 12 accumulators, NR weight vectors and an input's: within AVX2's 16 registers
  constexpr int MR = NR == 4 ? 3 : NR == 2 ? 6 : 4;
  for (; m + MR <= rows_x; m += MR) tile<L, MR, NR>(x + m * k, k, w, y + m * ldy, ldy);
  for (; m < rows_x; ++m) tile<L, 1, NR>(x + m * k, k, w, y + m * ldy, ldy);
}

template <int L>
FLOE_INLINE void band(const float* x, int64_t rows_x, int64_t k, const float* w, int64_t rows_w, float* y,
                      int64_t ldy) {
  int64_t n = 0;
  for (; n + 4 <= rows_w; n += 4) rows_of<L, 4>(x, rows_x, k, w + n * k, y + n, ldy);
  for (; n + 2 <= rows_w; n += 2) rows_of<L, 2>(x, rows_x, k, w + n * k, y + n, ldy);
  for (; n < rows_w; ++n) rows_of<L, 1>(x, rows_x, k, w + n * k, y + n, ldy);
}

FLOE_CLONES void band_any(const float* x, int64_t rows_x, int64_t k, const float* w, int64_t rows_w, float* y,
                          int64_t ldy, int64_t lanes) {
  if (lanes == 16) return band<16>(x, rows_x, k, w, rows_w, y, ldy);  // one AVX-512 register a value
  band<8>(x, rows_x, k, w, rows_w, y, ldy);  // (16 lanes on AVX2 would take two registers a value)
}

}  // namespace

namespace floe {

void band_gemm(const float* x, int64_t rows_x, int64_t k, const float* w, int64_t rows_w, float* y, int64_t ldy,
               int64_t lanes) {
  band_any(x, rows_x, k, w, rows_w, y, ldy, lanes);
}

}  // namespace floe
