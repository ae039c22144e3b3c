// attention_split.wgsl's partials of a decode row combined, one workgroup per (query head, row): each
// split's sums weighted by exp(m_split - m) over the row's largest m, divided by the weighted sum of
// the splits' l. The row's splits: those of attention_split for its position (and WINDOW). Each thread
// takes every AWG-th split for the max and the sum (a tree over the threads, in a fixed order), then a
// dimension (or a few) over every split.
// Constants: AWG (a power of two), SPLIT, NSPLIT, HEAD_DIM, N_HEADS, WINDOW (0: none).

struct Step { n_rows: u32, head_first: u32, head_count: u32, pad: u32, rows: array<vec4<u32>> };

@group(0) @binding(0) var<storage, read> step: Step;
@group(0) @binding(1) var<storage, read> parts: array<f32>;
@group(0) @binding(2) var<storage, read_write> att: array<f32>;

const PSTRIDE: u32 = HEAD_DIM + 2u;

var<workgroup> red: array<f32, AWG>;

fn tree(t: u32, is_max: bool) -> f32 {
    for (var w = AWG / 2u; w > 0u; w = w / 2u) {
        workgroupBarrier();
        if (t < w) {
            red[t] = select(red[t] + red[t + w], max(red[t], red[t + w]), is_max);
        }
    }
    workgroupBarrier();
    let out = red[0];
    workgroupBarrier();
    return out;
}

@compute @workgroup_size(AWG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let h = wg.x;
    let b = wg.y;
    let length = step.rows[b].y + 1u;
    let first = select(0u, length - WINDOW, WINDOW != 0u && length > WINDOW);
    let count = (length - first + SPLIT - 1u) / SPLIT;
    let base = (b * N_HEADS + h) * NSPLIT * PSTRIDE;
    var m = -3.0e38;
    for (var s = t; s < count; s += AWG) {
        m = max(m, parts[base + s * PSTRIDE]);
    }
    red[t] = m;
    m = tree(t, true);
    var l = 0.0;
    for (var s = t; s < count; s += AWG) {
        l += exp(parts[base + s * PSTRIDE] - m) * parts[base + s * PSTRIDE + 1u];
    }
    red[t] = l;
    let scale = 1.0 / tree(t, false);
    for (var d = t; d < HEAD_DIM; d += AWG) {
        var sum = 0.0;
        for (var s = 0u; s < count; s++) {
            let p = base + s * PSTRIDE;
            sum += exp(parts[p] - m) * parts[p + 2u + d];
        }
        att[(b * N_HEADS + h) * HEAD_DIM + d] = sum * scale;
    }
}
