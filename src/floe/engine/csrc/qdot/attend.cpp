// A decode step's attention for B rows on the CPU, as one operator a layer:
// torch.ops.floe.attend(qkv, cos, sin, k_cache, v_cache, slots, positions, n_heads, out, window,
// softcap); and the step's RMSNorm over its rows, torch.ops.floe.rms_norm_rows(x, weight, eps, out).
// Per row b: its K and V heads (rotary on K) are written at positions[b] of slot slots[b]'s cache, and
// each of its Q heads (scaled by 1/sqrt(head_dim), rotated) attends over that slot's first
// positions[b] + 1 positions (window > 0: the last `window` of them, Mistral's and Gemma's windowed
// layers; softcap > 0: each score softcap * tanh(score / softcap) first, Gemma 2) into out[b]. PyTorch's ops for the same thing (a rotary product, two
// small bmm and a softmax a row and layer, views and copies into the cache) cost ~25 us each of
// dispatch and small-matrix set-up; here a step's attention is one call a layer, its heads split over
// the threads (a row's KV head and the query heads that share it). Every row is computed alone, in the
// same order whatever B is.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "clones.h"
#include "pool.h"

namespace {

// The loops below: FLOE_CLONES (clones.h), compiled for AVX-512, AVX2 and baseline.

// out[j] = scale * (x[j] cos[j] - x[j + h] sin[j]) for j < h, scale * (x[j] cos[j] + x[j - h] sin[j])
// after (h = hd / 2): the half-split rotary of Transformer's apply_rotary.
inline void rotate(const float* x, const float* cos, const float* sin, int64_t hd, float scale, float* out) {
  const int64_t h = hd / 2;
  for (int64_t j = 0; j < h; ++j) out[j] = scale * (x[j] * cos[j] - x[j + h] * sin[j]);
  for (int64_t j = h; j < hd; ++j) out[j] = scale * (x[j] * cos[j] + x[j - h] * sin[j]);
}

// L floats as one value (GCC/Clang vector extensions: each target_clones variant lowers it to its own
// registers), loaded from any 4-byte-aligned address. L = 16 (one 512-bit register) where the CPU has
// AVX-512; 8 elsewhere: lowered to AVX2's 16 registers, 16 lanes took two registers a value and spilled
// (a SmolLM2 head over 300 positions, one thread, 2-core Zen 3: 14.4 us at 16 lanes, ~2.3 at 8).
template <int L>
struct Lanes {
  typedef float f __attribute__((vector_size(4 * L), aligned(4)));
  typedef int32_t i __attribute__((vector_size(4 * L), aligned(4)));
};
constexpr int64_t kMaxLanes = 16;  // the scores' padding


template <class V>
FLOE_INLINE V splat(float x) { return V{} + x; }

// e^x of each lane (x <= 0 here: softmax's scores less their top), Cephes' expf: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its degree-6 polynomial, 2^n put in the exponent (within 1 ulp of e^x on
// [-87.3, 0]; lanes under -87.3, -inf too, give 2^-126 ~ 1.2e-38, not expf's denormal or 0: beside the
// top score's 1 in the softmax's sum, nothing; NaN stays NaN).
template <class V, class I>
FLOE_INLINE V exp_lanes(V x) {
  const V floor_ = splat<V>(-87.33654f);
  x = x < floor_ ? floor_ : x;  // NaN compares false: stays
  V y = x * splat<V>(1.44269504088896341f) + splat<V>(0.5f);
  I n = __builtin_convertvector(y, I);  // toward 0: floor for y < 0 ...
  n += (__builtin_convertvector(n, V) > y);  // ... true lanes are -1
  const V fn = __builtin_convertvector(n, V);
  x = x - fn * splat<V>(0.693359375f) - fn * splat<V>(-2.12194440e-4f);
  V p = splat<V>(1.9875691500e-4f);
  p = p * x + splat<V>(1.3981999507e-3f);
  p = p * x + splat<V>(8.3334519073e-3f);
  p = p * x + splat<V>(4.1665795894e-2f);
  p = p * x + splat<V>(1.6666665459e-1f);
  p = p * x + splat<V>(5.0000001201e-1f);
  p = p * x * x + x + splat<V>(1.f);
  const I e = (n + 127) << 23;  // 2^n (n >= -126 after the floor above)
  V two_n;
  __builtin_memcpy(&two_n, &e, sizeof two_n);
  return p * two_n;
}

// s[i] = the sum of a[i]'s lanes, for 16 values at once: four rounds of halving, each adding a pair's
// halves side by side (30 shuffles and 15 additions where one sum at a time takes 64 and 60).
FLOE_INLINE Lanes<16>::f lane_sums(Lanes<16>::f* a) {
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    a[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(a[0], a[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a[0], a[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// The same for 8 values of 8 lanes: the 16-lane tree but its first level (lanes i + 4, i + 2, i + 1).
FLOE_INLINE Lanes<8>::f lane_sums(Lanes<8>::f* a) {
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    a[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(a[0], a[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(a[0], a[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

// One query head q [HD] over `len` positions of its KV head's K and V [len, HD] (HD a multiple of 16):
// softmax(K q) V into out [HD] (softcap > 0: the scores capped first); scores: scratch of len floats
// (rounded up to 16). The arithmetic is that of 16-lane words, whatever the registers: a word of q
// times one of K lane by lane, added over the head's words, each position's 16 lanes summed as one
// tree (lanes i + 8, then i + 4, i + 2, i + 1); exponentials lane by lane, their sum in a word's lanes
// (position t in lane t % 16); V's rows weighted into two sets of accumulators (alternate
// positions). L = 16 holds a word in one register (AVX-512); L = 8 in two (the first tree level is
// the two halves' sum), every sum the same, so that a CPU's vector width never changes a result.
template <int64_t HD, int L>
FLOE_INLINE void head(const float* q, const float* k, const float* v, int64_t len, float softcap, float* scores,
                      float* out) {
  using V = typename Lanes<L>::f;
  using I = typename Lanes<L>::i;
  constexpr int H = 16 / L;        // registers a word takes
  constexpr int64_t C = HD / L;    // registers a head vector takes
  V qv[C];
  for (int64_t c = 0; c < C; ++c) __builtin_memcpy(&qv[c], q + c * L, sizeof(V));
  const int64_t padded = (len + 15) / 16 * 16;
  for (int64_t t = 0; t < padded; t += L) {  // L positions a tree
    V acc[L];
    for (int64_t i = 0; i < L; ++i) {
      const V* kt = reinterpret_cast<const V*>(k + std::min(t + i, len - 1) * HD);  // the tail repeats
      V part[H];
      for (int h = 0; h < H; ++h) part[h] = qv[h] * kt[h];
      for (int64_t c = H; c < C; c += H)
        for (int h = 0; h < H; ++h) part[h] += qv[c + h] * kt[c + h];
      acc[i] = part[0];
      if constexpr (H == 2) acc[i] += part[1];  // (the tree's first level)
    }
    V s = lane_sums(acc);
    if (softcap > 0.f) {
      for (int64_t i = 0; i < L; ++i) s[i] = softcap * std::tanh(s[i] / softcap);
    }
    __builtin_memcpy(scores + t, &s, sizeof s);
  }
  float top = -INFINITY;
  for (int64_t t = 0; t < len; ++t) top = std::max(top, scores[t]);
  V sum[H] = {}, lanes;
  for (int i = 0; i < L; ++i) lanes[i] = static_cast<float>(i);
  for (int64_t t = 0; t < padded; t += L) {
    V p = exp_lanes<V, I>(*reinterpret_cast<const V*>(scores + t) - top);
    p = lanes + static_cast<float>(t) < static_cast<float>(len) ? p : V{};  // the tail's repeats: 0
    __builtin_memcpy(scores + t, &p, sizeof p);
    sum[(t / L) % H] += p;
  }
  V a0[C] = {}, a1[C] = {};
  int64_t t = 0;
  for (; t + 2 <= len; t += 2) {
    const V *v0 = reinterpret_cast<const V*>(v + t * HD), *v1 = reinterpret_cast<const V*>(v + (t + 1) * HD);
    const V p0 = splat<V>(scores[t]), p1 = splat<V>(scores[t + 1]);
    for (int64_t c = 0; c < C; ++c) {
      a0[c] += p0 * v0[c];
      a1[c] += p1 * v1[c];
    }
  }
  if (t < len) {
    const V* v0 = reinterpret_cast<const V*>(v + t * HD);
    for (int64_t c = 0; c < C; ++c) a0[c] += splat<V>(scores[t]) * v0[c];
  }
  float total = 0.f;
  for (int h = 0; h < H; ++h)
    for (int64_t i = 0; i < L; ++i) total += sum[h][i];
  const V inv = splat<V>(1.f / total);
  for (int64_t c = 0; c < C; ++c) {
    const V o = (a0[c] + a1[c]) * inv;
    __builtin_memcpy(out + c * L, &o, sizeof o);
  }
}

// The same for any head_dim (<= 1024): plain loops.
FLOE_INLINE void head_any(const float* q, const float* k, const float* v, int64_t len, int64_t hd, float softcap,
                     float* scores, float* out) {
  float top = -INFINITY;
  for (int64_t t = 0; t < len; ++t) {
    float s = 0.f;
    for (int64_t j = 0; j < hd; ++j) s += q[j] * k[t * hd + j];
    scores[t] = softcap > 0.f ? softcap * std::tanh(s / softcap) : s;
    top = std::max(top, scores[t]);
  }
  float sum = 0.f, acc[1024] = {};
  for (int64_t t = 0; t < len; ++t) {
    const float p = std::exp(scores[t] - top);
    sum += p;
    for (int64_t j = 0; j < hd; ++j) acc[j] += p * v[t * hd + j];
  }
  for (int64_t j = 0; j < hd; ++j) out[j] = acc[j] / sum;
}

}  // namespace

namespace floe {

// The lanes `head` takes (and gemm.cpp's band_gemm): 16 where the CPU runs the x86-64-v4 clone
// (AVX-512 F, BW, CD, DQ, VL: its 512-bit registers), else 8 (head: the same results);
// attend_lanes(n) sets 8 or 16 for head (a test runs both where the CPU has them), 0 goes back to the
// CPU's.

int64_t cpu_lanes() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const int64_t lanes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                       __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
                                       __builtin_cpu_supports("avx512vl")
                                   ? 16
                                   : 8;
  return lanes;
#else
  return 8;
#endif
}
}  // namespace floe

namespace {

std::atomic<int64_t> chosen_lanes{0};

int64_t attend_lanes(int64_t lanes) {
  TORCH_CHECK(lanes == 0 || lanes == 8 || (lanes == 16 && floe::cpu_lanes() == 16),
              "attend_lanes: 0 (the CPU's), 8, or 16 where the CPU has AVX-512, not ", lanes);
  chosen_lanes.store(lanes);
  return lanes ? lanes : floe::cpu_lanes();
}

template <int L>
FLOE_INLINE void attend_head_lanes(const float* q, const float* k, const float* v, int64_t len, int64_t hd,
                                   float softcap, float* scores, float* out) {
  if (hd == 64) return head<64, L>(q, k, v, len, softcap, scores, out);
  if (hd == 128) return head<128, L>(q, k, v, len, softcap, scores, out);
  if (hd == 256) return head<256, L>(q, k, v, len, softcap, scores, out);  // Gemma's
  head_any(q, k, v, len, hd, softcap, scores, out);  // head_dim <= 1024 (checked)
}

FLOE_CLONES void attend_head(const float* q, const float* k, const float* v, int64_t len, int64_t hd,
                             float softcap, float* scores, float* out, int64_t lanes) {
  if (lanes == 16) return attend_head_lanes<16>(q, k, v, len, hd, softcap, scores, out);
  attend_head_lanes<8>(q, k, v, len, hd, softcap, scores, out);
}

void check_f32(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == dim && t.is_contiguous(), what,
              ": float32, contiguous, ", dim, " dimensions");
}

// qkv float32 [B, (n_heads + 2 n_kv) hd]: each row's Q heads, K heads, V heads; cos, sin [seq, hd];
// k_cache, v_cache [n_slots, n_kv, seq, hd]; out [B, n_heads hd]; window, softcap: 0 for none.
void attend(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
            const at::Tensor& v_cache, at::IntArrayRef slots, at::IntArrayRef positions, int64_t n_heads,
            const at::Tensor& out, int64_t window, double softcap) {
  check_f32(qkv, 2, "qkv");
  check_f32(cos, 2, "cos");
  check_f32(sin, 2, "sin");
  check_f32(k_cache, 4, "k_cache");
  check_f32(v_cache, 4, "v_cache");
  check_f32(out, 2, "out");
  const int64_t rows = qkv.size(0), n_kv = k_cache.size(1), seq = k_cache.size(2), hd = k_cache.size(3);
  TORCH_CHECK(n_heads > 0 && n_kv > 0 && n_heads % n_kv == 0, "n_heads is not a multiple of the KV heads");
  TORCH_CHECK(qkv.size(1) == (n_heads + 2 * n_kv) * hd && out.size(0) == rows && out.size(1) == n_heads * hd,
              "qkv [B, (n_heads + 2 n_kv) head_dim] and out [B, n_heads head_dim] do not match the cache");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && cos.sizes() == sin.sizes() && cos.size(1) == hd &&
                  hd % 2 == 0 && hd <= 1024,
              "k_cache, v_cache, cos and sin do not match (head_dim: even, at most 1024)");
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == rows && static_cast<int64_t>(positions.size()) == rows,
              "one slot and one position a row");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap: 0 (none) or positive");
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(slots[b] >= 0 && slots[b] < k_cache.size(0), "slot ", slots[b], " is not in the cache");
    TORCH_CHECK(positions[b] >= 0 && positions[b] < std::min(seq, cos.size(0)), "position ", positions[b],
                " is past the cache");
  }
  const int64_t width = qkv.size(1), group = n_heads / n_kv, slot_size = n_kv * seq * hd;
  const float *x = qkv.data_ptr<float>(), *cs = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>(), *o = out.data_ptr<float>();
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  // Queries rotated and scaled; this row's K and V into the cache (before any head reads them).
  std::vector<float> q(rows * n_heads * hd);
  for (int64_t b = 0; b < rows; ++b) {
    const float *row = x + b * width, *c = cs + positions[b] * hd, *s = sn + positions[b] * hd;
    for (int64_t h = 0; h < n_heads; ++h) rotate(row + h * hd, c, s, hd, scale, &q[(b * n_heads + h) * hd]);
    for (int64_t h = 0; h < n_kv; ++h) {
      const int64_t at = slots[b] * slot_size + (h * seq + positions[b]) * hd;
      rotate(row + (n_heads + h) * hd, c, s, hd, 1.f, kc + at);
      std::copy_n(row + (n_heads + n_kv + h) * hd, hd, vc + at);
    }
  }
  // One item a row and query head (a KV head's K and V, read by each of its query heads in turn, stay in
  // the core's cache).
  const float cap = static_cast<float>(softcap);
  const int64_t chosen = chosen_lanes.load(), lanes = chosen ? chosen : floe::cpu_lanes();
  floe::parallel_for(0, rows * n_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(seq + kMaxLanes);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / n_heads, h = i % n_heads, length = positions[b] + 1;
      const int64_t from = window > 0 ? std::max<int64_t>(0, length - window) : 0;  // the first key seen
      const int64_t at = slots[b] * slot_size + (h / group * seq + from) * hd, first = (b * n_heads + h) * hd;
      attend_head(&q[first], kc + at, vc + at, length - from, hd, cap, scores.data(), o + first, lanes);
    }
  });
}

FLOE_CLONES void norm_row(const float* x, const float* w, int64_t dim, double eps, float* out) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t j = 0; j < dim; ++j) squares += x[j] * x[j];
  const float r = static_cast<float>(1.0 / std::sqrt(static_cast<double>(squares) / dim + eps));
  for (int64_t j = 0; j < dim; ++j) out[j] = x[j] * r * w[j];
}

// RMSNorm of each row of x [B, dim] times weight [dim], into out [B, dim] (all float32): one call for
// a step's rows where PyTorch's ops take a dot product, a scalar read and two products a row.
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& out) {
  check_f32(x, 2, "x");
  check_f32(weight, 1, "weight");
  check_f32(out, 2, "out");
  const int64_t rows = x.size(0), dim = x.size(1);
  TORCH_CHECK(weight.size(0) == dim && out.size(0) == rows && out.size(1) == dim,
              "x, weight, out do not match");
  const float *xp = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t b = 0; b < rows; ++b) norm_row(xp + b * dim, w, dim, eps, o + b * dim);
}

}  // namespace

TORCH_LIBRARY_IMPL(floe, CPU, m) {
  m.impl("attend", attend);
  m.impl("rms_norm_rows", rms_norm_rows);
}

TORCH_LIBRARY_IMPL(floe, CompositeExplicitAutograd, m) {
  m.impl("attend_lanes", attend_lanes);
}
