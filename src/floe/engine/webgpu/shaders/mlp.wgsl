// A decode row's whole MLP in one dispatch (the deeply fused step): workgroup (tile of FT MLP columns,
// row b) takes the residual r = x[b] + Σ_h partial[h, b] (attend_out.wgsl's output projection, not yet
// added), RMSNorm, its FT gate and FT up rows of W13 (LPR lanes a row), SwiGLU, and its FT columns of
// W2: contribution[n] = Σ_{j in tile} W2[n, j] · act[j], added into row b's sums acc[b, n]. The sums
// are fixed point (an i64 of 2^-32 units in two u32 words, the carry added by hand): integer addition
// does not depend on the order the workgroups add in, so the result is the same every run, which float
// atomics would not be. Workgroups (0, b) write r into x_out (the next projection adds the sums:
// gemv.wgsl MODE 3). acc was zeroed by attend_out.wgsl.
// Constants: WG, DIM, FFN, FT, LPR (a power of two dividing WG), N_KV, ROWS, EPS.

struct Step { n_rows: u32, head_first: u32, head_count: u32, pad: u32, rows: array<vec4<u32>> };

@group(0) @binding(0) var<storage, read> step: Step;
@group(0) @binding(1) var<storage, read> x_in: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> partial: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> norm_w: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> w13: array<W4>;
@group(0) @binding(5) var<storage, read> w2: array<W4>;
@group(0) @binding(6) var<storage, read_write> x_out: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> acc: array<atomic<u32>>;

const DIM4: u32 = DIM / 4u;
const FFN4: u32 = FFN / 4u;
const GROUPS: u32 = WG / LPR;
const RPG: u32 = (2u * FT + GROUPS - 1u) / GROUPS;  // gate/up rows a lane group computes

var<workgroup> xs: array<vec4<f32>, DIM4>;
var<workgroup> red: array<f32, RPG * WG>;
var<workgroup> gu: array<f32, 2u * FT>;
var<workgroup> act: array<vec4<f32>, FT / 4u>;

// acc[i] += v, v as round(v · 2^32) in two's complement over (low, high).
fn add_fixed(i: u32, v: f32) {
    let x = round(v * 4294967296.0);
    let a = abs(x);
    let high = floor(a * 2.3283064365386963e-10);
    var lo = u32(a - high * 4294967296.0);  // exact: a - high·2^32 is in [0, 2^32)
    var hi = u32(high);
    if (x < 0.0) {
        hi = ~hi + select(0u, 1u, lo == 0u);
        lo = 0u - lo;
    }
    let old = atomicAdd(&acc[2u * i], lo);
    let carry = select(0u, 1u, old + lo < old);
    atomicAdd(&acc[2u * i + 1u], hi + carry);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let b = wg.y;
    let f0 = wg.x * FT;
    var s = 0.0;
    for (var c = t; c < DIM4; c += WG) {
        var v = x_in[b * DIM4 + c];
        for (var h = 0u; h < N_KV; h++) {
            v += partial[(h * ROWS + b) * DIM4 + c];
        }
        xs[c] = v;
        s += dot(v, v);
        if (wg.x == 0u) {
            x_out[b * DIM4 + c] = v;
        }
    }
    red[t] = s;
    for (var h = WG / 2u; h > 0u; h = h / 2u) {
        workgroupBarrier();
        if (t < h) {
            red[t] += red[t + h];
        }
    }
    workgroupBarrier();
    let scale = inverseSqrt(red[0] / f32(DIM) + EPS);
    workgroupBarrier();
    for (var c = t; c < DIM4; c += WG) {
        xs[c] = xs[c] * scale * norm_w[c];
    }
    workgroupBarrier();

    // Gate rows f0.. and up rows FFN + f0.. (q < FT: gate; else up), rows q = g + r·GROUPS.
    let g = t / LPR;
    let lane = t % LPR;
    var part: array<f32, RPG>;
    for (var r = 0u; r < RPG; r++) {
        part[r] = 0.0;
    }
    for (var c = lane; c < DIM4; c += LPR) {
        let xv = xs[c];
        for (var r = 0u; r < RPG; r++) {
            let q = g + r * GROUPS;
            let j = f0 + q % FT;
            if (q < 2u * FT && j < FFN) {
                let n = select(j, FFN + j, q >= FT);
                part[r] += dot(w4(w13[n * DIM4 + c]), xv);
            }
        }
    }
    for (var r = 0u; r < RPG; r++) {
        red[(g * RPG + r) * LPR + lane] = part[r];
    }
    for (var h = LPR / 2u; h > 0u; h = h / 2u) {
        workgroupBarrier();
        if (lane < h) {
            for (var r = 0u; r < RPG; r++) {
                red[(g * RPG + r) * LPR + lane] += red[(g * RPG + r) * LPR + lane + h];
            }
        }
    }
    workgroupBarrier();
    if (lane == 0u) {
        for (var r = 0u; r < RPG; r++) {
            let q = g + r * GROUPS;
            if (q < 2u * FT) {
                gu[q] = red[(g * RPG + r) * LPR];
            }
        }
    }
    workgroupBarrier();
    for (var j = t; j < FT; j += WG) {
        let gate = gu[j];
        var a = 0.0;
        if (f0 + j < FFN) {
            a = gate / (1.0 + exp(-gate)) * gu[FT + j];
        }
        act[j / 4u][j % 4u] = a;
    }
    workgroupBarrier();

    // The tile's columns of W2, a thread an output row.
    let c0 = f0 / 4u;
    let cols = min(FT, FFN - f0) / 4u;
    for (var n = t; n < DIM; n += WG) {
        var v = 0.0;
        for (var c = 0u; c < cols; c++) {
            v += dot(w4(w2[n * FFN4 + c0 + c]), act[c]);
        }
        add_fixed(b * DIM + n, v);
    }
}
