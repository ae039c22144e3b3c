// out[b, n] (=, +=) Σ_k in'[b, k] · W[n, k] for a prompt's rows, the lanes of a workgroup spanning ROWS
// input rows and each thread computing NB output columns for its row: every weight load is the same
// address in every lane (one load, broadcast), every input load a lane's own row. (gemv.wgsl spans the
// output columns instead: a decode step has one row.) W is row-major [n, k], k % 4 == 0, in W4s
// (WEIGHT_FORMATS).
// MODE 0: in[b, k]; 1: RMSNorm, in[b, k] · rsqrt(mean_k in[b, k]² + EPS) · norm_w[k].
// EPI: 0 store, 1 add into out (the residual stream), 2 store + bias[n]. The bindings are gemv's.
// Constants: ROWS, NB, MODE, EPI, EPS.

struct Step { n_rows: u32, head_first: u32, head_count: u32, pad: u32, rows: array<vec4<u32>> };
struct Params { k: u32, n: u32, out_stride: u32, row0: u32, in_stride: u32, p0: u32, p1: u32, p2: u32 };

@group(0) @binding(0) var<storage, read> step: Step;
@group(0) @binding(1) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read> inp: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> w: array<W4>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> norm_w: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> bias: array<f32>;

@compute @workgroup_size(ROWS)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let count = step.n_rows;
    let b = wg.y * ROWS + t;
    let row = min(b, count - 1u);
    let n0 = wg.x * NB;
    let k4 = P.k / 4u;
    let base = row * P.in_stride / 4u;
    var scale = 1.0;
    if (MODE == 1u) {
        var s = vec4<f32>(0.0);
        for (var c = 0u; c < k4; c++) {
            let v = inp[base + c];
            s += v * v;
        }
        scale = inverseSqrt((s.x + s.y + s.z + s.w) / f32(P.k) + EPS);
    }
    var acc: array<f32, NB>;
    for (var j = 0u; j < NB; j++) {
        acc[j] = 0.0;
    }
    let last = P.n - 1u;
    for (var c = 0u; c < k4; c++) {
        var x = inp[base + c];
        if (MODE == 1u) {
            x = x * scale * norm_w[c];
        }
        for (var j = 0u; j < NB; j++) {
            acc[j] += dot(w4(w[min(n0 + j, last) * k4 + c]), x);
        }
    }
    if (b < count) {
        for (var j = 0u; j < NB; j++) {
            let n = n0 + j;
            if (n < P.n) {
                let o = b * P.out_stride + P.row0 + n;
                if (EPI == 1u) {
                    out[o] += acc[j];
                } else if (EPI == 2u) {
                    out[o] = acc[j] + bias[P.row0 + n];
                } else {
                    out[o] = acc[j];
                }
            }
        }
    }
}
