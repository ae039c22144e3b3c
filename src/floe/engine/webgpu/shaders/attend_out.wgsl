// A decode row's attention and output projection in one dispatch (the deeply fused step): workgroup
// (KV head h, tile of output rows, row b) rotates its GROUP query heads and the key of position pos_b,
// attends over its slot's cache (positions < pos_b from the cache, pos_b from workgroup memory: a tile
// other than 0, which writes the key and value into the cache, never reads what another workgroup
// writes), and projects the GROUP heads' outputs with their columns of Wo onto its tile of rows:
// partial[h, b, n] = Σ_{c in h's columns} Wo[n, c] · att[c]. The next dispatch adds the N_KV partials to
// the residual (mlp.wgsl). Workgroup (0, b) also zeroes row b's fixed-point sums, which the MLP
// dispatch after it accumulates. Every row is a distinct slot. Wo's rows are read LPR lanes a row.
// Constants: AWG, HEAD_DIM, HALF, GROUP, N_HEADS, N_KV, MAX_SEQ, QKV_STRIDE, SCALE, WINDOW, SOFTCAP, DIM, NT (rows a
// tile), ROWS (the partials' rows), LPR (a power of two dividing AWG).

struct Step { n_rows: u32, head_first: u32, head_count: u32, pad: u32, rows: array<vec4<u32>> };

@group(0) @binding(0) var<storage, read> step: Step;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> kc: array<f32>;
@group(0) @binding(3) var<storage, read_write> vc: array<f32>;
@group(0) @binding(4) var<storage, read> cos_t: array<f32>;
@group(0) @binding(5) var<storage, read> sin_t: array<f32>;
@group(0) @binding(6) var<storage, read> wo: array<W4>;
@group(0) @binding(7) var<storage, read_write> partial: array<f32>;
@group(0) @binding(8) var<storage, read_write> acc_zero: array<vec4<u32>>;

const DPT: u32 = (HEAD_DIM + AWG - 1u) / AWG;
const LOW: f32 = -3.0e38;
const COLS4: u32 = GROUP * HEAD_DIM / 4u;  // a KV head's columns of Wo, in W4s
const Q4: u32 = N_HEADS * HEAD_DIM / 4u;    // a row of Wo, in W4s
const GROUPS: u32 = AWG / LPR;

var<workgroup> qs: array<f32, GROUP * HEAD_DIM>;
var<workgroup> kcur: array<f32, HEAD_DIM>;
var<workgroup> vcur: array<f32, HEAD_DIM>;
var<workgroup> ss: array<f32, GROUP * AWG>;
var<workgroup> ps: array<f32, GROUP * AWG>;
var<workgroup> att: array<vec4<f32>, COLS4>;
var<workgroup> red: array<f32, AWG>;

// #include attention_common

@compute @workgroup_size(AWG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let kvh = wg.x % N_KV;
    let tile = wg.x / N_KV;
    let b = wg.y;
    let row = step.rows[b];
    let pos = row.y;
    let slot = row.z;
    let length = pos + 1u;
    if (wg.x == 0u) {
        for (var i = t; i < DIM / 2u; i += AWG) {
            acc_zero[b * DIM / 2u + i] = vec4<u32>(0u);
        }
    }
    let base = b * QKV_STRIDE;
    let at = cache_at(slot, kvh, pos);
    for (var i = t; i < HALF; i += AWG) {
        rotate_queries(base, kvh, pos, i);
        let k = rotated_key(base, kvh, pos, i);
        kcur[i] = k.x;
        kcur[i + HALF] = k.y;
    }
    let vb = base + (N_HEADS + N_KV + kvh) * HEAD_DIM;
    for (var d = t; d < HEAD_DIM; d += AWG) {
        vcur[d] = src[vb + d];
    }
    workgroupBarrier();
    if (tile == 0u) {
        for (var d = t; d < HEAD_DIM; d += AWG) {
            kc[at + d] = kcur[d];
            vc[at + d] = vcur[d];
        }
    }

    var m: array<f32, GROUP>;
    var l: array<f32, GROUP>;
    var alpha: array<f32, GROUP>;
    var acc: array<f32, GROUP * DPT>;
    for (var g = 0u; g < GROUP; g++) {
        m[g] = LOW;
        l[g] = 0.0;
        for (var j = 0u; j < DPT; j++) {
            acc[g * DPT + j] = 0.0;
        }
    }
    let kbase = cache_at(slot, kvh, 0u);
    // A sliding window (WINDOW > 0): the row sees its last WINDOW positions, its own included.
    let first = select(0u, length - WINDOW, WINDOW != 0u && length > WINDOW);
    for (var c0 = first; c0 < length; c0 += AWG) {
        let p = c0 + t;
        var dots: array<f32, GROUP>;
        for (var g = 0u; g < GROUP; g++) {
            dots[g] = 0.0;
        }
        if (p < pos) {
            let kp = kbase + p * HEAD_DIM;
            for (var d = 0u; d < HEAD_DIM; d++) {
                let kv = kc[kp + d];
                for (var g = 0u; g < GROUP; g++) {
                    dots[g] += qs[g * HEAD_DIM + d] * kv;
                }
            }
        } else if (p == pos) {
            for (var d = 0u; d < HEAD_DIM; d++) {
                let kv = kcur[d];
                for (var g = 0u; g < GROUP; g++) {
                    dots[g] += qs[g * HEAD_DIM + d] * kv;
                }
            }
        }
        for (var g = 0u; g < GROUP; g++) {
            ss[g * AWG + t] = select(LOW, capped(dots[g] * SCALE), p < length);
        }
        workgroupBarrier();
        let n = min(AWG, length - c0);
        for (var g = 0u; g < GROUP; g++) {
            var cm = m[g];
            for (var j = 0u; j < n; j++) {
                cm = max(cm, ss[g * AWG + j]);
            }
            ps[g * AWG + t] = exp(ss[g * AWG + t] - cm);
            alpha[g] = exp(m[g] - cm);
            m[g] = cm;
        }
        workgroupBarrier();
        for (var g = 0u; g < GROUP; g++) {
            var sum = 0.0;
            for (var j = 0u; j < n; j++) {
                sum += ps[g * AWG + j];
            }
            l[g] = l[g] * alpha[g] + sum;
            for (var dd = 0u; dd < DPT; dd++) {
                let d = t + dd * AWG;
                if (d < HEAD_DIM) {
                    var a = acc[g * DPT + dd] * alpha[g];
                    for (var j = 0u; j < n; j++) {
                        let q = c0 + j;
                        var v = 0.0;
                        if (q < pos) {
                            v = vc[kbase + q * HEAD_DIM + d];
                        } else {
                            v = vcur[d];
                        }
                        a += ps[g * AWG + j] * v;
                    }
                    acc[g * DPT + dd] = a;
                }
            }
        }
        workgroupBarrier();
    }
    for (var g = 0u; g < GROUP; g++) {
        for (var dd = 0u; dd < DPT; dd++) {
            let d = t + dd * AWG;
            if (d < HEAD_DIM) {
                let c = g * HEAD_DIM + d;
                att[c / 4u][c % 4u] = acc[g * DPT + dd] / l[g];
            }
        }
    }
    workgroupBarrier();

    // This tile's rows of Wo times the group's outputs: GROUPS rows at a time, LPR lanes a row.
    let lane = t % LPR;
    let n0 = tile * NT;
    let col0 = kvh * COLS4;
    for (var r0 = 0u; r0 < NT; r0 += GROUPS) {
        let n = n0 + r0 + t / LPR;
        var s = 0.0;
        if (r0 + t / LPR < NT && n < DIM) {
            for (var c = lane; c < COLS4; c += LPR) {
                s += dot(w4(wo[n * Q4 + col0 + c]), att[c]);
            }
        }
        red[t] = s;
        for (var h = LPR / 2u; h > 0u; h = h / 2u) {
            workgroupBarrier();
            if (lane < h) {
                red[t] += red[t + h];
            }
        }
        workgroupBarrier();
        if (lane == 0u && r0 + t / LPR < NT && n < DIM) {
            partial[(kvh * ROWS + b) * DIM + n] = red[t];
        }
        workgroupBarrier();
    }
}
