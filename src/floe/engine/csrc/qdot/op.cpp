// floe's quantized GEMV as a PyTorch operator. torch.ops.floe.gemv_q(x, blocks, kernel) (and
// dequant_q(blocks, k, dtype, kernel), the weight's values for a prompt's GEMM) runs instruction-set
// variant number `kernel`, as returned by torch.ops.floe.qdot_load(path), on a weight in its file's
// blocks (abi.h's formats): each
// variant (portable.cpp, avx2.cpp, vnni.cpp, neon.cpp) is a shared library of its own, built with its
// own compiler flags and opened here. This file is built once, with no instruction-set flags; it
// owns the tensors and the threads, the variants own the arithmetic (qdot.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <dlfcn.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "abi.h"
#include "gemm.h"
#include "pool.h"

namespace {

constexpr int64_t G = 32;
constexpr int kMaxKernels = 16;
constexpr int64_t kBlockBytes = 16 * 1024;  // weights of one block of output rows: in a core's L1
const FloeQdotKernel* g_kernels[kMaxKernels];
std::atomic<int> g_count{0};
std::mutex g_load;

// Open a variant's library (it stays open) and return its number (1-based; the same library twice:
// the same number). Refuses a library of another ABI or one this CPU cannot run.
int64_t qdot_load(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_load);
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(lib != nullptr, "cannot open the kernel library ", path, ": ", dlerror());
  auto entry = reinterpret_cast<const FloeQdotKernel* (*)()>(dlsym(lib, "floe_qdot_kernel"));
  TORCH_CHECK(entry != nullptr, path, " is not a floe kernel library (it has no floe_qdot_kernel)");
  const FloeQdotKernel* kernel = entry();
  TORCH_CHECK(kernel->abi == FLOE_QDOT_ABI, path, " has kernel ABI ", kernel->abi, ", this operator ",
              FLOE_QDOT_ABI, ": rebuild it");
  TORCH_CHECK(kernel->runs_here(), "this CPU lacks instructions the '", kernel->name, "' kernel uses");
  const int count = g_count.load();
  for (int i = 0; i < count; ++i) {
    if (g_kernels[i] == kernel) return i + 1;
  }
  TORCH_CHECK(count < kMaxKernels, "too many kernel libraries loaded");
  g_kernels[count] = kernel;
  g_count.store(count + 1);
  return count + 1;
}

const FloeQdotKernel* kernel_of(int64_t number) {
  TORCH_CHECK(number >= 1 && number <= g_count.load(), "no kernel number ", number,
              " (torch.ops.floe.qdot_load gives one)");
  return g_kernels[number - 1];
}

std::string qdot_name(int64_t number) { return kernel_of(number)->name; }

// A block format's size in bytes, its header's (scale, offset) and its fields' count, in abi.h's order.
constexpr int64_t kFormatBytes[FLOE_QDOT_FORMATS] = {18, 20, 34, 24};
constexpr int64_t kHeaderBytes[FLOE_QDOT_FORMATS] = {2, 4, 2, 8};
constexpr int64_t kFields[FLOE_QDOT_FORMATS] = {1, 2, 1, 2};

struct Layout {
  int format;
  bool bands;    // interleaved, 8 rows a band (abi.h): blocks [N/8, 8 x bytes a row]
  int64_t rows;  // the weight's rows, N
};

// blocks uint8 [N, K/32 blocks] (the file's rows) or [N/8, 8 x that] (interleaved bands), contiguous:
// which format (named by its block's size) and layout.
Layout layout_of(const at::Tensor& blocks, int64_t k) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks: uint8 [N, bytes a row], contiguous");
  TORCH_CHECK(k > 0 && k % G == 0, "K = ", k, " is not a positive multiple of ", G);
  for (int f = 0; f < FLOE_QDOT_FORMATS; ++f) {
    if (blocks.size(1) == k / G * kFormatBytes[f]) return {f, false, blocks.size(0)};
    if (blocks.size(1) == 8 * k / G * kFormatBytes[f]) return {f, true, 8 * blocks.size(0)};
  }
  TORCH_CHECK(false, "a row of ", blocks.size(1), " bytes is no block format's for K = ", k,
              " (blocks of 18, 20, 34 or 24 bytes: Q4_0, Q4_1, Q8_0, floe's Q4 with float32 scales; or 8 rows "
              "of them interleaved)");
  return {};
}

// y [..., N] = x [..., K] times the weight: blocks uint8 [N, K/32 blocks of one format], or its
// interleaved bands [N/8, ...] (abi.h) for a variant that has rows8.
at::Tensor gemv_q(const at::Tensor& x_in, const at::Tensor& blocks, int64_t number) {
  const FloeQdotKernel* kernel = kernel_of(number);
  TORCH_CHECK(x_in.dim() >= 1, "x: [..., K]");
  const int64_t k = x_in.size(-1), groups = k / G;
  const Layout layout = layout_of(blocks, k);
  const int64_t n = layout.rows;
  const floe_qdot_rows_fn rows = layout.bands ? kernel->rows8[layout.format] : kernel->rows[layout.format];
  TORCH_CHECK(rows != nullptr, "the '", kernel->name, "' kernel has no interleaved bands");
  // the input as the variant's rows read it: for the file's rows, its 4-bit groups' pairs; else in order
  const int paired = layout.format != FLOE_Q8_0 && !layout.bands;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  auto sizes = x_in.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options());
  const int64_t m = x.numel() / k;
  std::vector<int8_t> qx(m * k);
  std::vector<float> xsu(2 * m * groups);
  const float* xp = x.data_ptr<float>();
  const auto quantize = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      kernel->quantize(xp + r * k, k, paired, &qx[r * k], &xsu[2 * r * groups]);
    }
  };
  if (m == 1) {
    quantize(0, 1);
  } else {
    floe::parallel_for(0, m, 1, quantize);
  }
  // Several input rows (a batched decode step, a prompt): each block of output rows (or bands) meets
  // every input row while its weights are in the core's cache (the variant unpacks them once for a
  // few input rows at a time), so the weights are read from memory once, not once per input row.
  // (bands: an even number, as the pool's pieces are, so that a variant's pairs of bands stay whole)
  const int64_t block = layout.bands ? std::max<int64_t>(2, kBlockBytes / blocks.size(1) / 2 * 2)
                                     : std::max<int64_t>(1, kBlockBytes / blocks.size(1));
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  floe::parallel_for(0, blocks.size(0), layout.bands ? 2 : 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += block) {
      rows(w, qx.data(), xsu.data(), m, groups, b, std::min(end, b + block), out, n);
    }
  });
  return y;
}

// The weight's rows as values: blocks as gemv_q takes them -> [N, K] float32 or bfloat16 (what a
// prompt's matrix product reads), split over threads.
at::Tensor dequant_q(const at::Tensor& blocks, int64_t k, at::ScalarType dtype, int64_t number) {
  const FloeQdotKernel* kernel = kernel_of(number);
  const Layout layout = layout_of(blocks, k);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequant_q writes float32 or bfloat16, not ",
              dtype);
  const int64_t n = layout.rows, groups = k / G;
  at::Tensor w = at::empty({n, k}, blocks.options().dtype(dtype));
  const floe_qdot_dequant_fn dequant =
      (layout.bands ? kernel->dequant8 : kernel->dequant)[layout.format][dtype == at::kBFloat16];
  TORCH_CHECK(dequant != nullptr, "the '", kernel->name, "' kernel has no interleaved bands");
  const uint8_t* b = blocks.data_ptr<uint8_t>();
  char* out = static_cast<char*>(w.data_ptr());
  const int64_t row_bytes = k * w.element_size();
  // On PyTorch's intra-op threads (OpenMP), as gemm_q: a prompt's bands (prefill.banded_linear) are
  // dequantized between its GEMMs, which run there; on floe's pool each band's workers spun and yielded
  // after it while OpenMP's needed the cores (a 64-token prefill in the engine loop's thread, 2-core Zen
  // 4: 51-54 ms here against 54-61 on the pool, with the wait policy floe sets: cli.machine.polite_openmp).
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    dequant(b, groups, begin, end, out + begin * row_bytes);
  });
  return w;
}

// y [M, N] = x [M, K] (float32) times the weight's values, for a prompt's rows where the CPU has no
// native bf16 GEMM: each band of 8 weight rows (or 8 of the file's rows) dequantized by the variant's
// dequant (the values dequant_q gives) into a buffer in the core's cache, then every row of x times it
// (floe::band_gemm: each output its two rows' dot product alone, in one order whatever M is).
at::Tensor gemm_q(const at::Tensor& x_in, const at::Tensor& blocks, int64_t number) {
  const FloeQdotKernel* kernel = kernel_of(number);
  TORCH_CHECK(x_in.dim() == 2, "x: [M, K]");
  const int64_t k = x_in.size(1), groups = k / G, m = x_in.size(0);
  const Layout layout = layout_of(blocks, k);
  const int64_t n = layout.rows;
  const floe_qdot_dequant_fn dequant = (layout.bands ? kernel->dequant8 : kernel->dequant)[layout.format][0];
  TORCH_CHECK(dequant != nullptr, "the '", kernel->name, "' kernel has no interleaved bands");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const uint8_t* b = blocks.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const int64_t lanes = floe::cpu_lanes(), bands = (n + 7) / 8;
  // On PyTorch's intra-op threads (OpenMP), not floe's pool: a prompt's other operators run there, and
  // their threads, spinning after each one, held the cores the pool's workers needed (with libgomp's
  // default spin, a 64-token prefill of the default model on 2 cores took 1.2x the time on the pool).
  at::parallel_for(0, bands, 1, [&](int64_t begin, int64_t end) {
    // one band's values, in this core's cache while every row meets it (each written before it is read)
    const std::unique_ptr<float[]> values(new float[8 * k]);
    for (int64_t band = begin; band < end; ++band) {
      const int64_t first = 8 * band, rows = std::min<int64_t>(8, n - first);
      dequant(b, groups, first, first + rows, values.get());
      floe::band_gemm(xp, m, k, values.get(), rows, out + first, n, lanes);
    }
  });
  return y;
}

// Rows `index` of an interleaved weight (bands as gemv_q takes them) as values, [len(index), K]: a
// head's few scattered rows (exact_top), one call on the calling thread.
at::Tensor dequant_rows_q(const at::Tensor& blocks, int64_t k, const at::Tensor& index, at::ScalarType dtype,
                          int64_t number) {
  const FloeQdotKernel* kernel = kernel_of(number);
  const Layout layout = layout_of(blocks, k);
  TORCH_CHECK(layout.bands, "dequant_rows_q reads interleaved bands (the file's rows: index them)");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequant_rows_q writes float32 or bfloat16");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1, "index: int64 [n]");
  const at::Tensor at = index.contiguous();
  const int64_t* rows = at.data_ptr<int64_t>();
  const int64_t count = at.numel(), groups = k / G;
  at::Tensor w = at::empty({count, k}, blocks.options().dtype(dtype));
  const floe_qdot_dequant_fn dequant = kernel->dequant8[layout.format][dtype == at::kBFloat16];
  TORCH_CHECK(dequant != nullptr, "the '", kernel->name, "' kernel has no interleaved bands");
  char* out = static_cast<char*>(w.data_ptr());
  for (int64_t i = 0; i < count; ++i) {
    const int64_t row = rows[i] < 0 ? rows[i] + layout.rows : rows[i];
    TORCH_CHECK(row >= 0 && row < layout.rows, "row ", rows[i], " of a weight of ", layout.rows, " rows");
    dequant(blocks.data_ptr<uint8_t>(), groups, row, row + 1, out + i * k * w.element_size());
  }
  return w;
}

// The file's rows [N, K/32 blocks] (N a multiple of 8) as interleaved bands [N/8, 8 x bytes a row]
// (abi.h), split over threads.
at::Tensor interleave_q(const at::Tensor& blocks, int64_t k) {
  const Layout layout = layout_of(blocks, k);
  TORCH_CHECK(!layout.bands, "these blocks are interleaved already");
  TORCH_CHECK(layout.rows % 8 == 0, "interleaving takes 8 rows a band: ", layout.rows, " rows");
  const int f = layout.format;
  const int64_t bytes = kFormatBytes[f], header = kHeaderBytes[f], field = header / kFields[f];
  const int64_t groups = k / G, chunks = (bytes - header) / 4, width = blocks.size(1);
  at::Tensor out = at::empty({layout.rows / 8, 8 * width}, blocks.options());
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  floe::parallel_for(0, layout.rows / 8, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* dst = o + b * 8 * width + g * 8 * bytes;
        for (int r = 0; r < 8; ++r) {
          const uint8_t* src = in + (8 * b + r) * width + g * bytes;
          for (int64_t j = 0; j < kFields[f]; ++j) std::memcpy(dst + j * 8 * field + r * field, src + j * field, field);
          for (int64_t c = 0; c < chunks; ++c) std::memcpy(dst + 8 * header + 32 * c + 4 * r, src + header + 4 * c, 4);
        }
      }
    }
  });
  return out;
}

bool qdot_interleaves(int64_t number) { return kernel_of(number)->rows8[0] != nullptr; }

// The input rows from which the variant takes band pairs (abi.h): rows > 0 sets it; the one in force,
// 0 where the variant has none.
int64_t qdot_pair_rows(int64_t number, int64_t rows) {
  const FloeQdotKernel* kernel = kernel_of(number);
  TORCH_CHECK(rows >= 0 && rows <= 1 << 20, "pair rows: a count of input rows, not ", rows);
  return kernel->pair_rows != nullptr ? kernel->pair_rows(static_cast<int>(rows)) : 0;
}

// exact_top's candidates (qgemv.QLinear.exact_top): per row m of y [M, N] (float32, a head's
// outputs), the indices j whose interval y[m, j] +- b reaches the best lower end, b = spread[m] *
// bound[j] + 1e-4. Two passes over the row on the calling thread, in vectors (compiled for AVX-512,
// AVX2 and baseline on x86-64 Linux; b may round as one fused multiply-add there: bound carries a
// slack far wider than a rounding). Five vocabulary-sized PyTorch ops did this, each an OpenMP region.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define FLOE_OP_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FLOE_OP_CLONES
#endif

FLOE_OP_CLONES float best_lower(const float* row, const float* bound, float s, int64_t n) {
  float best = -INFINITY;
#pragma omp simd reduction(max : best)
  for (int64_t j = 0; j < n; ++j) {
    const float v = row[j] - (s * bound[j] + 1e-4f);
    best = v > best ? v : best;
  }
  return best;
}

FLOE_OP_CLONES int64_t reaching(const float* row, const float* bound, float s, float lower, int64_t n,
                                int64_t* out) {
  int64_t count = 0;  // a few of the row's outputs reach it: a rarely taken branch
  for (int64_t j = 0; j < n; ++j) {
    if (row[j] + (s * bound[j] + 1e-4f) >= lower) out[count++] = j;
  }
  return count;
}

std::vector<at::Tensor> top_candidates(const at::Tensor& y, const at::Tensor& bound, const at::Tensor& spread) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.is_contiguous(), "y: float32 [M, N], contiguous");
  const int64_t m = y.size(0), n = y.size(1);
  TORCH_CHECK(bound.scalar_type() == at::kFloat && bound.dim() == 1 && bound.size(0) == n && bound.is_contiguous(),
              "bound: float32 [N], contiguous");
  TORCH_CHECK(spread.scalar_type() == at::kFloat && spread.numel() == m && spread.is_contiguous(),
              "spread: float32, one a row of y");
  const float *yp = y.data_ptr<float>(), *bp = bound.data_ptr<float>(), *sp = spread.data_ptr<float>();
  std::vector<at::Tensor> out;
  std::vector<int64_t> picked(n);
  for (int64_t r = 0; r < m; ++r) {
    const float* row = yp + r * n;
    const float lower = best_lower(row, bp, sp[r], n);
    const int64_t count = reaching(row, bp, sp[r], lower, n, picked.data());
    at::Tensor index = at::empty({count}, y.options().dtype(at::kLong));
    std::copy_n(picked.data(), count, index.data_ptr<int64_t>());
    out.push_back(index);
  }
  return out;
}

}  // namespace

// gemv_q's schema is declared by floe.engine.qgemv (so that TorchScript can compile code naming it
// where this file cannot be built); this library adds its CPU implementation.
TORCH_LIBRARY_FRAGMENT(floe, m) {
  m.def("qdot_load(str path) -> int", &qdot_load);
  m.def("qdot_name(int kernel) -> str", &qdot_name);
  m.def("qdot_interleaves(int kernel) -> bool", &qdot_interleaves);
  m.def("qdot_pair_rows(int kernel, int rows) -> int", &qdot_pair_rows);
  m.def("interleave_q(Tensor blocks, int k) -> Tensor", &interleave_q);
  m.def("dequant_rows_q(Tensor blocks, int k, Tensor index, ScalarType dtype, int kernel) -> Tensor", &dequant_rows_q);
}

TORCH_LIBRARY_IMPL(floe, CPU, m) {
  m.impl("gemv_q", gemv_q);
  m.impl("dequant_q", dequant_q);
  m.impl("gemm_q", gemm_q);
  m.impl("top_candidates", top_candidates);
}
