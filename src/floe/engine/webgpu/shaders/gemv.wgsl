// out[b, n] (=, +=) Σ_k in'[b, k] · W[n, k] for the step's rows: a projection for one row (decode) or
// many (a prompt's chunk). W is row-major [n, k] (one band of its rows per binding; k % 16 == 0), its
// weights W4s of four (WEIGHT_FORMATS: f32, or f16 pairs); each thread computes one output row n for
// TB input rows, reading its weight row 16 at a time, so a weight is read once per TB rows. (On lavapipe a lane streaming its own row is ~2-3x faster than lanes sharing
// one; a GPU wants lanes splitting k instead: a layout of its own, see docs/PERF.md.)
// in'[b, k] is staged in workgroup memory KT at a time, transformed on the way (MODE):
//   0: in[b, k]
//   1: RMSNorm, in[b, k] · rsqrt(mean_k in[b, k]² + EPS) · norm_w[k]  (the norm before the projection)
//   2: SwiGLU, silu(in[b, k]) · in[b, K + k]                          (the MLP's gate and up halves;
//      GELU 1: Gemma's GeGLU, gelu for silu)
//   3: RMSNorm of the deferred residual in[b, k] + acc[b, k] (acc: the MLP's fixed-point sums, see
//      mlp.wgsl); with RES 1 the workgroups of x 0 write that residual whole into res.
// EPI: 0 store, 1 add into out (the residual stream), 2 store + bias[n].
// HEAD 1: the rows are step.head_first.. (head_count of them), written from out row 0.
// Constants prepended by floe.engine.webgpu.device: WG, TB, KT, MODE, EPI, HEAD, RES, EPS, GELU.

struct Step { n_rows: u32, head_first: u32, head_count: u32, pad: u32, rows: array<vec4<u32>> };
struct Params { k: u32, n: u32, out_stride: u32, row0: u32, in_stride: u32, p0: u32, p1: u32, p2: u32 };

@group(0) @binding(0) var<storage, read> step: Step;
@group(0) @binding(1) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read> inp: array<f32>;
@group(0) @binding(3) var<storage, read> w: array<W4>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> norm_w: array<f32>;
@group(0) @binding(6) var<storage, read> bias: array<f32>;
@group(0) @binding(7) var<storage, read> acc_in: array<vec2<u32>>;
@group(0) @binding(8) var<storage, read_write> res: array<f32>;

const KT4: u32 = KT / 4u;

var<workgroup> xs: array<vec4<f32>, TB * KT4>;
var<workgroup> red: array<f32, TB * WG>;

// The fixed-point sum (low word, high word: an i64 of 2^-32 units) as f32.
fn fixed(v: vec2<u32>) -> f32 {
    return f32(bitcast<i32>(v.y)) + f32(v.x) * 2.3283064365386963e-10;
}

// Gemma's GeGLU gate (GELU 1): gelu, tanh-approximated as PyTorch's; else SwiGLU's silu. (tanh's argument
// clamped: tanh(±15) is ±1 in float32, and some drivers' tanh of a large argument is inf / inf.)
fn gate(g: f32) -> f32 {
    if (GELU == 1u) {
        return 0.5 * g * (1.0 + tanh(clamp(0.7978845608028654 * (g + 0.044715 * g * g * g), -15.0, 15.0)));
    }
    return g / (1.0 + exp(-g));
}

fn raw(base: u32, k: u32) -> f32 {
    if (MODE == 3u) {
        return inp[base + k] + fixed(acc_in[base + k]);
    }
    return inp[base + k];
}

fn staged(base: u32, k: u32, scale: f32) -> f32 {
    if (MODE == 2u) {
        return gate(inp[base + k]) * inp[base + P.k + k];
    }
    if (MODE == 1u || MODE == 3u) {
        return raw(base, k) * scale * norm_w[k];
    }
    return inp[base + k];
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    var first = 0u;
    var count = step.n_rows;
    if (HEAD == 1u) {
        first = step.head_first;
        count = step.head_count;
    }
    let b0 = wg.y * TB;
    let g = wg.x + P.p0;  // (P.p0: the dispatch's first workgroup, where a band takes several)
    let n = g * WG + t;
    let k4 = P.k / 4u;
    var scale: array<f32, TB>;
    for (var i = 0u; i < TB; i++) {
        scale[i] = 1.0;
    }
    if (MODE == 1u || MODE == 3u) {
        for (var i = 0u; i < TB; i++) {
            var s = 0.0;
            if (b0 + i < count) {
                let base = (first + b0 + i) * P.in_stride;
                for (var k = t; k < P.k; k += WG) {
                    let v = raw(base, k);
                    s += v * v;
                    if (RES == 1u && g == 0u) {
                        res[base + k] = v;
                    }
                }
            }
            red[i * WG + t] = s;
        }
        workgroupBarrier();
        for (var i = 0u; i < TB; i++) {
            var s = 0.0;
            for (var j = 0u; j < WG; j++) {
                s += red[i * WG + j];
            }
            scale[i] = inverseSqrt(s / f32(P.k) + EPS);
        }
    }
    var acc: array<vec4<f32>, TB>;
    for (var i = 0u; i < TB; i++) {
        acc[i] = vec4<f32>(0.0);
    }
    for (var c0 = 0u; c0 < k4; c0 += KT4) {
        let ct = min(KT4, k4 - c0);
        for (var i = 0u; i < TB; i++) {
            let valid = b0 + i < count;
            let base = (first + b0 + i) * P.in_stride;
            for (var c = t; c < ct; c += WG) {
                var v = vec4<f32>(0.0);
                if (valid) {
                    let k = 4u * (c0 + c);
                    v = vec4<f32>(staged(base, k, scale[i]), staged(base, k + 1u, scale[i]),
                                  staged(base, k + 2u, scale[i]), staged(base, k + 3u, scale[i]));
                }
                xs[i * KT4 + c] = v;
            }
        }
        workgroupBarrier();
        if (n < P.n) {
            let wrow = n * k4 + c0;
            for (var c = 0u; c < ct; c += 4u) {
                let w0 = w4(w[wrow + c]);
                let w1 = w4(w[wrow + c + 1u]);
                let w2 = w4(w[wrow + c + 2u]);
                let w3 = w4(w[wrow + c + 3u]);
                for (var i = 0u; i < TB; i++) {
                    let j = i * KT4 + c;
                    acc[i] += w0 * xs[j] + w1 * xs[j + 1u] + w2 * xs[j + 2u] + w3 * xs[j + 3u];
                }
            }
        }
        workgroupBarrier();
    }
    if (n < P.n) {
        for (var i = 0u; i < TB; i++) {
            if (b0 + i < count) {
                let o = (b0 + i) * P.out_stride + P.row0 + n;
                let r = acc[i].x + acc[i].y + acc[i].z + acc[i].w;
                if (EPI == 1u) {
                    out[o] += r;
                } else if (EPI == 2u) {
                    out[o] = r + bias[P.row0 + n];
                } else {
                    out[o] = r;
                }
            }
        }
    }
}
