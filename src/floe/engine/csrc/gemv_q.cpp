// Batch-1 matrix-vector products on GGUF-style quantized weights, for CPU decode (floe.engine.qgemv).
//
// The input row x is quantized to int8 per group of 32 (scale = absmax / 127), as llama.cpp does for
// its dot products; each group's integer dot product with the weight codes runs on VNNI
// (vpdpbusd: unsigned 8-bit x signed 8-bit, four products summed per 32-bit lane), and the groups
// are combined in float:
//   y[n] = sum_g xs[g] * (scale[n,g] * dot(codes[n,g], qx[g]) + offset[n,g] * sum(qx[g]))
// q4: codes are 4-bit (0..15), 16 bytes per group, byte j = element j (low nibble) and element
//     j + 16 (high nibble); w = scale * code + offset.
// q8: codes are bytes (0..255), 32 per group; w = scale * code + offset (int8 weights use
//     code = w8 + 128, offset = -128 * scale).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t G = 32;

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
constexpr bool kVnni = true;
#else
inline __m256i dot_u8s8(__m256i u, __m256i s) {  // AVX2: u8 x s8 pairs to s16, then to s32
  __m256i p = _mm256_maddubs_epi16(u, s);
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
constexpr bool kVnni = false;
#endif

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// qx int8 [K], xs float [K/32], u = xs * sum(qx) per group
void quantize_row(const float* x, int64_t k, int8_t* qx, float* xs, float* u) {
  for (int64_t g = 0; g < k / G; ++g) {
    const float* xg = x + g * G;
    float amax = 0.f;
    for (int j = 0; j < G; ++j) amax = std::max(amax, std::fabs(xg[j]));
    float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < G; ++j) {
      int q = static_cast<int>(std::nearbyint(xg[j] * inv));
      qx[g * G + j] = static_cast<int8_t>(q);
      sum += q;
    }
    xs[g] = d;
    u[g] = d * static_cast<float>(sum);
  }
}

template <bool FourBit>
inline __m256 group_dot(const uint8_t* cr, const int8_t* q, int64_t g) {
  __m256i w;
  if constexpr (FourBit) {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cr + g * 16));
    w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
  } else {
    w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cr + g * G));
  }
  __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * G));
  return _mm256_cvtepi32_ps(dot_u8s8(w, s));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float to_float(float v) { return v; }
inline float to_float(at::Half v) { return static_cast<float>(v); }

// One output. Groups go in blocks of 8: their scales (times the input's) in one vector, spread over
// four independent accumulators (an FMA's latency is four of its issue slots); the offset term is a
// separate vector dot product.
template <bool FourBit, typename S>
inline float row_dot(const uint8_t* cr, const S* sr, const S* orow, const int8_t* q, const float* xs,
                     const float* u, int64_t groups) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, off = a0;
  alignas(32) float cs[8];
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    _mm256_store_ps(cs, _mm256_mul_ps(load8(sr + g), _mm256_loadu_ps(xs + g)));
    off = _mm256_fmadd_ps(load8(orow + g), _mm256_loadu_ps(u + g), off);
    a0 = _mm256_fmadd_ps(group_dot<FourBit>(cr, q, g), _mm256_set1_ps(cs[0]), a0);
    a1 = _mm256_fmadd_ps(group_dot<FourBit>(cr, q, g + 1), _mm256_set1_ps(cs[1]), a1);
    a2 = _mm256_fmadd_ps(group_dot<FourBit>(cr, q, g + 2), _mm256_set1_ps(cs[2]), a2);
    a3 = _mm256_fmadd_ps(group_dot<FourBit>(cr, q, g + 3), _mm256_set1_ps(cs[3]), a3);
    a0 = _mm256_fmadd_ps(group_dot<FourBit>(cr, q, g + 4), _mm256_set1_ps(cs[4]), a0);
    a1 = _mm256_fmadd_ps(group_dot<FourBit>(cr, q, g + 5), _mm256_set1_ps(cs[5]), a1);
    a2 = _mm256_fmadd_ps(group_dot<FourBit>(cr, q, g + 6), _mm256_set1_ps(cs[6]), a2);
    a3 = _mm256_fmadd_ps(group_dot<FourBit>(cr, q, g + 7), _mm256_set1_ps(cs[7]), a3);
  }
  float rest = 0.f;
  for (; g < groups; ++g) {
    a0 = _mm256_fmadd_ps(group_dot<FourBit>(cr, q, g), _mm256_set1_ps(to_float(sr[g]) * xs[g]), a0);
    rest += to_float(orow[g]) * u[g];
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) + hsum(off) + rest;
}

template <bool FourBit, typename S>
void gemv_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
               const at::Tensor& offset, at::Tensor& y) {
  const int64_t n = codes.size(0), groups = scale.size(1), k = groups * G, rows = x.numel() / k;
  std::vector<int8_t> qx(k);
  std::vector<float> xs(groups), u(groups);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const S* sc = scale.data_ptr<S>();
  const S* of = offset.data_ptr<S>();
  for (int64_t r = 0; r < rows; ++r) {
    quantize_row(x.data_ptr<float>() + r * k, k, qx.data(), xs.data(), u.data());
    float* out = y.data_ptr<float>() + r * n;
    const int8_t* q = qx.data();
    const float* xsp = xs.data();
    const float* up = u.data();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        out[row] = row_dot<FourBit>(c + row * (FourBit ? k / 2 : k), sc + row * groups,
                                    of + row * groups, q, xsp, up, groups);
      }
    });
  }
}

// y [..., N] = x [..., K] times the coded weight. scale/offset: float32 or float16 [N, K/32].
template <bool FourBit>
at::Tensor gemv(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scale,
                const at::Tensor& offset) {
  TORCH_CHECK(codes.dtype() == at::kByte && codes.dim() == 2 && codes.is_contiguous(), "codes: uint8 [N, *]");
  const int64_t n = codes.size(0), groups = scale.size(1), k = groups * G;
  TORCH_CHECK((scale.dtype() == at::kFloat || scale.dtype() == at::kHalf) &&
              offset.dtype() == scale.dtype() && scale.is_contiguous() && offset.is_contiguous() &&
              scale.size(0) == n && offset.sizes() == scale.sizes(),
              "scale/offset: float32 or float16 [N, K/32], both alike");
  TORCH_CHECK(codes.size(1) == (FourBit ? k / 2 : k), "codes width does not match the scales");
  at::Tensor x = x_in.to(at::kFloat).contiguous();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "input width must be K = 32 x groups");
  auto sizes = x_in.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options());
  if (scale.dtype() == at::kHalf) {
    gemv_rows<FourBit, at::Half>(x, codes, scale, offset, y);
  } else {
    gemv_rows<FourBit, float>(x, codes, scale, offset, y);
  }
  return y;
}

at::Tensor gemv_q4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                   const at::Tensor& offset) {
  return gemv<true>(x, codes, scale, offset);
}

at::Tensor gemv_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                   const at::Tensor& offset) {
  return gemv<false>(x, codes, scale, offset);
}

bool vnni() { return kVnni; }

}  // namespace

TORCH_LIBRARY(floe, m) {
  m.def("gemv_q4(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor");
  m.def("gemv_q8(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor");
  m.def("vnni() -> bool");
}

TORCH_LIBRARY_IMPL(floe, CPU, m) {
  m.impl("gemv_q4", gemv_q4);
  m.impl("gemv_q8", gemv_q8);
}

TORCH_LIBRARY_IMPL(floe, CompositeExplicitAutograd, m) { m.impl("vnni", vnni); }
