/* The zero-copy probe guest: fills A and B in its own memory, asks the engine to compute C = A @ B
 * in place (floe.gemm), and checks C itself. Every value is a multiple of 1/8 with a small numerator,
 * so the float32 products and sums are exact and any difference is an error, not rounding. */
#include "floe.h"

FLOE_IMPORT(gemm) int32_t floe_probe_gemm(const float *a, const float *b, float *c, int32_t n);

typedef struct {
    int32_t status;
    int32_t mismatches;
    float max_error;
    uint32_t a, b, c;
} probe_result;

static probe_result result;

FLOE_EXPORT(floe_abi_version) int32_t floe_abi_version(void) { return FLOE_ABI_VERSION; }
FLOE_EXPORT(alloc) void *alloc(int32_t size) { return size < 0 ? 0 : floe_alloc((size_t)size); }

FLOE_EXPORT(run) probe_result *run(int32_t n) {
    size_t bytes = (size_t)n * (size_t)n * sizeof(float);
    float *a = floe_alloc(bytes), *b = floe_alloc(bytes), *c = floe_alloc(bytes);
    if (!a || !b || !c) { result.status = -1; return &result; }
    for (int32_t i = 0; i < n; i++)
        for (int32_t j = 0; j < n; j++) {
            a[i * n + j] = (float)((i * 7 + j * 3) % 17 - 8) / 8.0f;
            b[i * n + j] = (float)((i * 5 + j * 11) % 13 - 6) / 8.0f;
            c[i * n + j] = -12345.0f; /* must be overwritten */
        }
    result = (probe_result){floe_probe_gemm(a, b, c, n), 0, 0.0f, (uint32_t)a, (uint32_t)b, (uint32_t)c};
    for (int32_t i = 0; i < n; i++)
        for (int32_t j = 0; j < n; j++) {
            float ref = 0.0f;
            for (int32_t k = 0; k < n; k++) ref += a[i * n + k] * b[k * n + j];
            float err = c[i * n + j] - ref;
            if (err < 0) err = -err;
            if (err > result.max_error) result.max_error = err;
            if (err != 0.0f) result.mismatches++;
        }
    return &result;
}
