// floe's quantized GEMV as a PyTorch operator. torch.ops.floe.gemv_q(x, codes, scale, offset, kernel)
// (and dequant_q(codes, scale, offset, dtype, kernel), the weight's values for a prompt's GEMM)
// runs instruction-set variant number `kernel`, as returned by torch.ops.floe.qdot_load(path): each
// variant (portable.cpp, avx2.cpp, vnni.cpp, neon.cpp) is a shared library of its own, built with its
// own compiler flags and opened here. This file is built once, with no instruction-set flags; it
// owns the tensors and the threads, the variants own the arithmetic (qdot.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <dlfcn.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "abi.h"

namespace {

constexpr int64_t G = 32;
constexpr int kMaxKernels = 16;
constexpr int64_t kBlockBytes = 16 * 1024;  // codes of one block of output rows: in a core's L1
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

// codes uint8 [N, K/2] (4-bit) or [N, K] (8-bit), scale and offset float32 or float16 [N, K/32].
void check_weight(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(),
              "codes: uint8 [N, *], contiguous");
  TORCH_CHECK((scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf) && scale.dim() == 2 &&
                  offset.scalar_type() == scale.scalar_type() && scale.is_contiguous() &&
                  offset.is_contiguous() && scale.size(0) == codes.size(0) && offset.sizes() == scale.sizes(),
              "scale/offset: float32 or float16 [N, K/32], both alike, contiguous");
  const int64_t groups = scale.size(1);
  TORCH_CHECK(codes.size(1) * 2 == groups * G || codes.size(1) == groups * G, "codes width ", codes.size(1),
              " is neither K/2 (4-bit) nor K (8-bit) for K = 32 x ", groups, " groups");
}

// y [..., N] = x [..., K] times the coded weight: codes uint8 [N, K/2] (4-bit) or [N, K] (8-bit),
// scale and offset float32 or float16 [N, K/32].
at::Tensor gemv_q(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scale,
                  const at::Tensor& offset, int64_t number) {
  const FloeQdotKernel* kernel = kernel_of(number);
  check_weight(codes, scale, offset);
  const int64_t n = codes.size(0), groups = scale.size(1), k = groups * G;
  const bool four_bit = codes.size(1) * 2 == k;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "input width must be K = ", k);
  auto sizes = x_in.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options());
  const floe_qdot_rows_fn rows = kernel->rows[four_bit][scale.scalar_type() == at::kHalf];
  const int64_t m = x.numel() / k;
  std::vector<int8_t> qx(m * k);
  std::vector<float> xs(m * groups), u(m * groups);
  const float* xp = x.data_ptr<float>();
  const auto quantize = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      kernel->quantize(xp + r * k, k, four_bit, &qx[r * k], &xs[r * groups], &u[r * groups]);
    }
  };
  if (m == 1) {
    quantize(0, 1);
  } else {
    at::parallel_for(0, m, 1, quantize);
  }
  // Several input rows (a batched decode step, a prompt): each block of output rows meets every input
  // row while its codes are in the core's cache (the variant unpacks them once for a few input rows
  // at a time), so the weights are read from memory once, not once per input row.
  const int64_t block = std::max<int64_t>(1, kBlockBytes / codes.size(1));
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const void* s = scale.data_ptr();
  const void* o = offset.data_ptr();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += block) {
      rows(c, s, o, qx.data(), xs.data(), u.data(), m, groups, b, std::min(end, b + block), out, n);
    }
  });
  return y;
}

// The weight's rows as values: codes uint8 [N, K/2] or [N, K], scale and offset [N, K/32] as gemv_q
// takes them -> [N, K] float32 or bfloat16 (what a prompt's matrix product reads), split over threads.
at::Tensor dequant_q(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                     at::ScalarType dtype, int64_t number) {
  const FloeQdotKernel* kernel = kernel_of(number);
  check_weight(codes, scale, offset);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequant_q writes float32 or bfloat16, not ",
              dtype);
  const int64_t n = codes.size(0), groups = scale.size(1);
  const bool four_bit = codes.size(1) * 2 == groups * G;
  at::Tensor w = at::empty({n, groups * G}, codes.options().dtype(dtype));
  const floe_qdot_dequant_fn dequant =
      kernel->dequant[four_bit][scale.scalar_type() == at::kHalf][dtype == at::kBFloat16];
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const void* s = scale.data_ptr();
  const void* o = offset.data_ptr();
  char* out = static_cast<char*>(w.data_ptr());
  const int64_t row_bytes = groups * G * w.element_size();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    dequant(c, s, o, groups, begin, end, out + begin * row_bytes);
  });
  return w;
}

}  // namespace

// gemv_q's schema is declared by floe.engine.qgemv (so that TorchScript can compile code naming it
// where this file cannot be built); this library adds its CPU implementation.
TORCH_LIBRARY_FRAGMENT(floe, m) {
  m.def("qdot_load(str path) -> int", &qdot_load);
  m.def("qdot_name(int kernel) -> str", &qdot_name);
}

TORCH_LIBRARY_IMPL(floe, CPU, m) {
  m.impl("gemv_q", gemv_q);
  m.impl("dequant_q", dequant_q);
}
