// A decode row's attention over its slot's KV cache cut into splits of SPLIT positions, one workgroup per
// (split, KV head, row) (flash-decoding): where one workgroup per (KV head, row) walked every position
// (attention.wgsl), a 1B model's eight KV heads kept eight workgroups busy on a GPU of 132 SMs
// (~320 us a layer at 256 positions on an H100). Each workgroup writes its split's partial softmax for
// its GROUP query heads (the split's max score m, the sum l of exp(score - m), and the exp-weighted sum
// of values) to `parts`; attention_merge.wgsl combines a row's splits. The split that holds the row's
// own position rotates its key and writes it and its value into the cache first (storageBarrier: its
// own reads see them); every split rotates the group's queries from the qkv row itself. Row b attends
// to positions first..pos_b (first: WINDOW's start, else 0); splits start at `first`.
// Constants: AWG, SPLIT, NSPLIT, HEAD_DIM, HALF, GROUP, N_HEADS, N_KV, MAX_SEQ, QKV_STRIDE, SCALE,
// WINDOW (0: none), SOFTCAP (0: none).

struct Step { n_rows: u32, head_first: u32, head_count: u32, pad: u32, rows: array<vec4<u32>> };

@group(0) @binding(0) var<storage, read> step: Step;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> kc: array<f32>;
@group(0) @binding(3) var<storage, read_write> vc: array<f32>;
@group(0) @binding(4) var<storage, read> cos_t: array<f32>;
@group(0) @binding(5) var<storage, read> sin_t: array<f32>;
@group(0) @binding(6) var<storage, read_write> parts: array<f32>;

const PAIRS: u32 = GROUP * SPLIT;  // (query head, position) scores of a split
const PPT: u32 = (PAIRS + AWG - 1u) / AWG;
const DPT: u32 = (HEAD_DIM + AWG - 1u) / AWG;
const PSTRIDE: u32 = HEAD_DIM + 2u;  // a partial: m, l, then HEAD_DIM sums
const LOW: f32 = -3.0e38;

var<workgroup> qs: array<f32, GROUP * HEAD_DIM>;
var<workgroup> ps: array<f32, PAIRS>;

// #include attention_common

@compute @workgroup_size(AWG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let kvh = wg.x % N_KV;
    let s = wg.x / N_KV;
    let b = wg.y;
    let row = step.rows[b];
    let pos = row.y;
    let slot = row.z;
    let length = pos + 1u;
    let first = select(0u, length - WINDOW, WINDOW != 0u && length > WINDOW);
    let c0 = first + s * SPLIT;
    if (c0 >= length) {  // (the same for every thread of the workgroup: no barrier is skipped by some)
        return;
    }
    let n = min(SPLIT, length - c0);
    let base = b * QKV_STRIDE;
    let holds_pos = c0 + n == length;
    for (var i = t; i < HALF; i += AWG) {
        rotate_queries(base, kvh, pos, i);
        if (holds_pos) {
            let at = cache_at(slot, kvh, pos);
            let k = rotated_key(base, kvh, pos, i);
            kc[at + i] = k.x;
            kc[at + i + HALF] = k.y;
        }
    }
    if (holds_pos) {
        let at = cache_at(slot, kvh, pos);
        let vb = base + (N_HEADS + N_KV + kvh) * HEAD_DIM;
        for (var d = t; d < HEAD_DIM; d += AWG) {
            vc[at + d] = src[vb + d];
        }
        storageBarrier();
    }
    workgroupBarrier();
    // Scores: a thread per (query head, position) pair, its key row read once per pair.
    for (var k = 0u; k < PPT; k++) {
        let pair = t + k * AWG;
        if (pair < PAIRS) {
            let g = pair / SPLIT;
            let j = pair % SPLIT;
            var score = LOW;
            if (j < n) {
                let kp = cache_at(slot, kvh, c0 + j);
                var dot = 0.0;
                for (var d = 0u; d < HEAD_DIM; d++) {
                    dot += qs[g * HEAD_DIM + d] * kc[kp + d];
                }
                score = capped(dot * SCALE);
            }
            ps[pair] = score;
        }
    }
    workgroupBarrier();
    // Each query head's max, the exps and their sum: a thread a head, over the split's positions.
    let out = ((b * N_HEADS + kvh * GROUP) * NSPLIT + s) * PSTRIDE;  // head g: + g * NSPLIT * PSTRIDE
    if (t < GROUP) {
        var m = LOW;
        for (var j = 0u; j < n; j++) {
            m = max(m, ps[t * SPLIT + j]);
        }
        var l = 0.0;
        for (var j = 0u; j < n; j++) {
            let e = exp(ps[t * SPLIT + j] - m);
            ps[t * SPLIT + j] = e;
            l += e;
        }
        parts[out + t * NSPLIT * PSTRIDE] = m;
        parts[out + t * NSPLIT * PSTRIDE + 1u] = l;
    }
    workgroupBarrier();
    // The exp-weighted values: a thread a dimension (or a few), every query head of the group.
    let vbase = cache_at(slot, kvh, c0);
    for (var dd = 0u; dd < DPT; dd++) {
        let d = t + dd * AWG;
        if (d < HEAD_DIM) {
            var acc: array<f32, GROUP>;
            for (var g = 0u; g < GROUP; g++) {
                acc[g] = 0.0;
            }
            for (var j = 0u; j < n; j++) {
                let v = vc[vbase + j * HEAD_DIM + d];
                for (var g = 0u; g < GROUP; g++) {
                    acc[g] += ps[g * SPLIT + j] * v;
                }
            }
            for (var g = 0u; g < GROUP; g++) {
                parts[out + g * NSPLIT * PSTRIDE + 2u + d] = acc[g];
            }
        }
    }
}
