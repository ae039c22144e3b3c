// The vector loops of the operator library (attend.cpp, gemm.cpp): built without instruction-set
// flags (the operator runs on any CPU); on x86-64 Linux a FLOE_CLONES function is compiled three
// times, for AVX-512, AVX2 and baseline, and the loader picks the one this CPU runs. What it calls
// must be FLOE_INLINE (inlined into each clone: a callee is not cloned).
#pragma once

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define FLOE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FLOE_CLONES
#endif
#define FLOE_INLINE inline __attribute__((always_inline))

#include <cstdint>

namespace floe {

// The lanes a FLOE_CLONES loop takes: 16 where the CPU runs the x86-64-v4 clone (AVX-512), else 8
// (defined in attend.cpp).
int64_t cpu_lanes();

}  // namespace floe
