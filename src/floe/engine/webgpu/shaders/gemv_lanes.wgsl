// gemv.wgsl's projection, out[b, n] (=, +=) Σ_k in'[b, k] · W[n, k], laid out for a GPU: the WG lanes of
// a workgroup split the inputs of its R output rows, lane t reading four weights (a W4) at t, t + WG, …,
// so a warp's loads are one contiguous run of each row (coalesced); the lanes' partial sums are then
// added in workgroup memory (a tree, in a fixed order: the result is the same every run). Each lane
// keeps TB input rows, so a weight is read once per TB rows. in' (MODE), EPI, HEAD and RES as gemv.wgsl;
// the bindings are gemv's.
// A lane's load is a WL of WE weights (LANE_LOADS: a W4, or eight f16 weights in 16 bytes where WIDE).
// Constants: WG (a power of two), R, U, TB, MODE, EPI, HEAD, RES, EPS, GELU, WIDE.

struct Step { n_rows: u32, head_first: u32, head_count: u32, pad: u32, rows: array<vec4<u32>> };
struct Params { k: u32, n: u32, out_stride: u32, row0: u32, in_stride: u32, p0: u32, p1: u32, p2: u32 };

@group(0) @binding(0) var<storage, read> step: Step;
@group(0) @binding(1) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read> inp: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> w: array<WL>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> norm_w: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> bias: array<f32>;
@group(0) @binding(7) var<storage, read> acc_in: array<vec2<u32>>;
@group(0) @binding(8) var<storage, read_write> res: array<vec4<f32>>;

const RT: u32 = R * TB;

var<workgroup> red: array<f32, RT * WG>;

fn fixed(v: vec2<u32>) -> f32 {
    return f32(bitcast<i32>(v.y)) + f32(v.x) * 2.3283064365386963e-10;
}

// Gemma's GeGLU gate (GELU 1): gelu, tanh-approximated as PyTorch's; else SwiGLU's silu (see gemv.wgsl).
fn gate(g: vec4<f32>) -> vec4<f32> {
    if (GELU == 1u) {
        return 0.5 * g * (1.0 + tanh(clamp(0.7978845608028654 * (g + 0.044715 * g * g * g), vec4<f32>(-15.0),
                                           vec4<f32>(15.0))));
    }
    return g / (1.0 + exp(-g));
}

// The input's four elements at vec4 c of a row starting at vec4 base, before any norm.
fn raw(base: u32, c: u32) -> vec4<f32> {
    if (MODE == 2u) {
        return gate(inp[base + c]) * inp[base + P.k / 4u + c];
    }
    if (MODE == 3u) {
        let a = 4u * (base + c);
        return inp[base + c] + vec4<f32>(fixed(acc_in[a]), fixed(acc_in[a + 1u]), fixed(acc_in[a + 2u]),
                                         fixed(acc_in[a + 3u]));
    }
    return inp[base + c];
}

// Sum red[j * WG + 0 .. WG) into red[j * WG] for j < count, in a fixed tree order.
fn reduce(t: u32, count: u32) {
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        workgroupBarrier();
        if (t < s) {
            for (var j = 0u; j < count; j++) {
                red[j * WG + t] += red[j * WG + t + s];
            }
        }
    }
    workgroupBarrier();
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
    let k4 = P.k / 4u;
    let s4 = P.in_stride / 4u;
    var scale: array<f32, TB>;
    for (var i = 0u; i < TB; i++) {
        scale[i] = 1.0;
    }
    if (MODE == 1u || MODE == 3u) {
        for (var i = 0u; i < TB; i++) {
            var s = 0.0;
            if (b0 + i < count) {
                let base = (first + b0 + i) * s4;
                for (var c = t; c < k4; c += WG) {
                    let v = raw(base, c);
                    s += dot(v, v);
                    if (RES == 1u && g == 0u) {
                        res[base + c] = v;
                    }
                }
            }
            red[i * WG + t] = s;
        }
        reduce(t, TB);
        for (var i = 0u; i < TB; i++) {
            scale[i] = inverseSqrt(red[i * WG] / f32(P.k) + EPS);
        }
        workgroupBarrier();
    }
    var acc: array<f32, RT>;
    for (var j = 0u; j < RT; j++) {
        acc[j] = 0.0;
    }
    let n0 = g * R;
    let last = P.n - 1u;
    let ke = P.k / WE;  // WLs a row
    // Lane t reads U adjacent WLs of each of its R rows an iteration (every load issued before any sum:
    // more of a row's bytes in flight a lane), then the next U at + WG·U.
    for (var c0 = t * U; c0 < ke; c0 += WG * U) {
        var wv: array<WL, U * R>;
        for (var u = 0u; u < U; u++) {
            let c = min(c0 + u, ke - 1u);  // (past the row's end: a valid weight, its sum discarded)
            for (var r = 0u; r < R; r++) {
                wv[u * R + r] = w[min(n0 + r, last) * ke + c];
            }
        }
        for (var u = 0u; u < U; u++) {
            if (c0 + u < ke) {
                for (var h = 0u; h < WE / 4u; h++) {
                    let c = (c0 + u) * (WE / 4u) + h;  // (the input's vec4)
                    var xs: array<vec4<f32>, TB>;
                    for (var i = 0u; i < TB; i++) {
                        var v = vec4<f32>(0.0);
                        if (b0 + i < count) {
                            v = raw((first + b0 + i) * s4, c);
                            if (MODE == 1u || MODE == 3u) {
                                v = v * scale[i] * norm_w[c];
                            }
                        }
                        xs[i] = v;
                    }
                    for (var r = 0u; r < R; r++) {
                        let wr = wl(wv[u * R + r], h);
                        for (var i = 0u; i < TB; i++) {
                            acc[r * TB + i] += dot(wr, xs[i]);
                        }
                    }
                }
            }
        }
    }
    for (var j = 0u; j < RT; j++) {
        red[j * WG + t] = acc[j];
    }
    reduce(t, RT);
    if (t < RT) {
        let r = t / TB;
        let i = t % TB;
        let n = n0 + r;
        if (n < P.n && b0 + i < count) {
            let o = (b0 + i) * P.out_stride + P.row0 + n;
            let v = red[t * WG];
            if (EPI == 1u) {
                out[o] += v;
            } else if (EPI == 2u) {
                out[o] = v + bias[P.row0 + n];
            } else {
                out[o] = v;
            }
        }
    }
}
