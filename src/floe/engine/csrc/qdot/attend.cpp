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
#include <cmath>
#include <vector>

#include "pool.h"

namespace {

// Built without instruction-set flags (the operator runs on any CPU); on x86-64 Linux the loops below
// are compiled three times, for AVX-512, AVX2 and baseline, and the loader picks the one this CPU runs.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define FLOE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FLOE_CLONES
#endif

// out[j] = scale * (x[j] cos[j] - x[j + h] sin[j]) for j < h, scale * (x[j] cos[j] + x[j - h] sin[j])
// after (h = hd / 2): the half-split rotary of Transformer's apply_rotary.
inline void rotate(const float* x, const float* cos, const float* sin, int64_t hd, float scale, float* out) {
  const int64_t h = hd / 2;
  for (int64_t j = 0; j < h; ++j) out[j] = scale * (x[j] * cos[j] - x[j + h] * sin[j]);
  for (int64_t j = h; j < hd; ++j) out[j] = scale * (x[j] * cos[j] + x[j - h] * sin[j]);
}

// The `group` query heads q [group, HD] that share one KV head, over `len` positions of its K and V
// [len, HD]: softmax(K q) V into out [group, HD] (softcap > 0: the scores capped first); scores:
// scratch of group * len floats. K and V are read once for the group; with HD known when compiled, a
// head's output stays in registers.
template <int64_t HD>
inline void heads(const float* q, int64_t group, const float* k, const float* v, int64_t len, int64_t hd,
                  float softcap, float* scores, float* out) {
  const int64_t d = HD > 0 ? HD : hd;
  for (int64_t t = 0; t < len; ++t) {
    const float* kt = k + t * d;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < d; ++j) s += qg[j] * kt[j];
      scores[g * len + t] = softcap > 0.f ? softcap * std::tanh(s / softcap) : s;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* p = scores + g * len;
    float top = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < len; ++t) top = std::max(top, p[t]);
    for (int64_t t = 0; t < len; ++t) {
      p[t] = std::exp(p[t] - top);
      sum += p[t];
    }
    float acc[HD > 0 ? HD : 1024] = {};
    for (int64_t t = 0; t < len; ++t) {
      const float pt = p[t], *vt = v + t * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) acc[j] += pt * vt[j];
    }
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < d; ++j) out[g * d + j] = acc[j] * inv;
  }
}

FLOE_CLONES void attend_group(const float* q, int64_t group, const float* k, const float* v, int64_t len,
                              int64_t hd, float softcap, float* scores, float* out) {
  if (hd == 64) return heads<64>(q, group, k, v, len, hd, softcap, scores, out);
  if (hd == 128) return heads<128>(q, group, k, v, len, hd, softcap, scores, out);
  if (hd == 256) return heads<256>(q, group, k, v, len, hd, softcap, scores, out);  // Gemma's
  heads<0>(q, group, k, v, len, hd, softcap, scores, out);  // head_dim <= 1024 (checked)
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
  // One item a row and KV head: its group of query heads (consecutive in q and out).
  const float cap = static_cast<float>(softcap);
  floe::parallel_for(0, rows * n_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * seq);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / n_kv, h = i % n_kv, length = positions[b] + 1;
      const int64_t from = window > 0 ? std::max<int64_t>(0, length - window) : 0;  // the first key seen
      const int64_t at = slots[b] * slot_size + (h * seq + from) * hd, first = (b * n_heads + h * group) * hd;
      attend_group(&q[first], group, kc + at, vc + at, length - from, hd, cap, scores.data(), o + first);
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
