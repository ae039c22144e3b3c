// Attention of one row's query heads over its slot's KV cache, one workgroup per (KV head, row): the
// GROUP query heads that share a KV head read each cached key and value once. Online softmax over
// chunks of AWG positions (running max and sum per head), float32 throughout; row b attends to
// positions 0..pos_b of its slot (causal within a prompt: its rows' keys are written before). src: the
// rotated queries [b, N_HEADS·HEAD_DIM] (rope_kv.wgsl wrote them and the keys). A prompt's rows and
// the unfused decode plan's; the fused decode rows' attention is attention_split.wgsl's.
// Constants: AWG, HEAD_DIM, HALF, GROUP, N_HEADS, N_KV, MAX_SEQ, QKV_STRIDE, SCALE, WINDOW (0: none),
// SOFTCAP (0: none).

struct Step { n_rows: u32, head_first: u32, head_count: u32, pad: u32, rows: array<vec4<u32>> };

@group(0) @binding(0) var<storage, read> step: Step;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> kc: array<f32>;
@group(0) @binding(3) var<storage, read_write> vc: array<f32>;
@group(0) @binding(4) var<storage, read> cos_t: array<f32>;
@group(0) @binding(5) var<storage, read> sin_t: array<f32>;
@group(0) @binding(6) var<storage, read_write> att: array<f32>;

const DPT: u32 = (HEAD_DIM + AWG - 1u) / AWG;
const LOW: f32 = -3.0e38;

var<workgroup> qs: array<f32, GROUP * HEAD_DIM>;
var<workgroup> ss: array<f32, GROUP * AWG>;
var<workgroup> ps: array<f32, GROUP * AWG>;

// #include attention_common

@compute @workgroup_size(AWG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let kvh = wg.x;
    let b = wg.y;
    let row = step.rows[b];
    let pos = row.y;
    let slot = row.z;
    let length = pos + 1u;
    let qb = b * N_HEADS * HEAD_DIM + kvh * GROUP * HEAD_DIM;
    for (var i = t; i < GROUP * HEAD_DIM; i += AWG) {
        qs[i] = src[qb + i];
    }
    workgroupBarrier();

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
        if (p < length) {
            let kp = kbase + p * HEAD_DIM;
            for (var d = 0u; d < HEAD_DIM; d++) {
                let kv = kc[kp + d];
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
                        a += ps[g * AWG + j] * vc[kbase + (c0 + j) * HEAD_DIM + d];
                    }
                    acc[g * DPT + dd] = a;
                }
            }
        }
        workgroupBarrier();
    }
    let ob = b * N_HEADS * HEAD_DIM + kvh * GROUP * HEAD_DIM;
    for (var g = 0u; g < GROUP; g++) {
        for (var dd = 0u; dd < DPT; dd++) {
            let d = t + dd * AWG;
            if (d < HEAD_DIM) {
                att[ob + g * HEAD_DIM + d] = acc[g * DPT + dd] / l[g];
            }
        }
    }
}
