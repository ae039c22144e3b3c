// Rotary (half-split, as Hugging Face's Llama) for every query and key head of the step's rows, the
// rotated queries into q [b, N_HEADS·HEAD_DIM], the rotated keys and the values into the KV cache at
// each row's position of its slot. One thread per (row, rotated pair or value element).
// Constants: WG, HEAD_DIM, HALF, N_HEADS, N_KV, MAX_SEQ, QKV_STRIDE.

struct Step { n_rows: u32, head_first: u32, head_count: u32, pad: u32, rows: array<vec4<u32>> };

@group(0) @binding(0) var<storage, read> step: Step;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read_write> kc: array<f32>;
@group(0) @binding(3) var<storage, read_write> vc: array<f32>;
@group(0) @binding(4) var<storage, read> cos_t: array<f32>;
@group(0) @binding(5) var<storage, read> sin_t: array<f32>;
@group(0) @binding(6) var<storage, read_write> q: array<f32>;

const PAIRS: u32 = (N_HEADS + N_KV) * HALF;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let i = wg.x * WG + t;
    let b = wg.y;
    if (i >= PAIRS + N_KV * HEAD_DIM) {
        return;
    }
    let row = step.rows[b];
    let pos = row.y;
    let slot = row.z;
    let base = b * QKV_STRIDE;
    if (i < PAIRS) {
        let h = i / HALF;
        let j = i % HALF;
        let x0 = qkv[base + h * HEAD_DIM + j];
        let x1 = qkv[base + h * HEAD_DIM + j + HALF];
        let r0 = x0 * cos_t[pos * HEAD_DIM + j] - x1 * sin_t[pos * HEAD_DIM + j];
        let r1 = x1 * cos_t[pos * HEAD_DIM + j + HALF] + x0 * sin_t[pos * HEAD_DIM + j + HALF];
        if (h < N_HEADS) {
            q[b * N_HEADS * HEAD_DIM + h * HEAD_DIM + j] = r0;
            q[b * N_HEADS * HEAD_DIM + h * HEAD_DIM + j + HALF] = r1;
        } else {
            let at = ((slot * N_KV + h - N_HEADS) * MAX_SEQ + pos) * HEAD_DIM;
            kc[at + j] = r0;
            kc[at + j + HALF] = r1;
        }
    } else {
        let v = i - PAIRS;
        let kvh = v / HEAD_DIM;
        let d = v % HEAD_DIM;
        vc[((slot * N_KV + kvh) * MAX_SEQ + pos) * HEAD_DIM + d] = qkv[base + (N_HEADS + N_KV + kvh) * HEAD_DIM + d];
    }
}
