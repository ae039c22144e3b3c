// attention_split.wgsl's partials of a decode row combined, one workgroup per (query head, row): each
// split's sums weighted by exp(m_split - m) over the row's largest m, divided by the weighted sum of
// the splits' l. The row's splits: those of attention_split for its position (and WINDOW).
// Constants: AWG, SPLIT, NSPLIT, HEAD_DIM, N_HEADS, WINDOW (0: none).

struct Step { n_rows: u32, head_first: u32, head_count: u32, pad: u32, rows: array<vec4<u32>> };

@group(0) @binding(0) var<storage, read> step: Step;
@group(0) @binding(1) var<storage, read> parts: array<f32>;
@group(0) @binding(2) var<storage, read_write> att: array<f32>;

const PSTRIDE: u32 = HEAD_DIM + 2u;

var<workgroup> weights: array<f32, NSPLIT>;
var<workgroup> total: array<f32, 1>;

@compute @workgroup_size(AWG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let h = wg.x;
    let b = wg.y;
    let length = step.rows[b].y + 1u;
    let first = select(0u, length - WINDOW, WINDOW != 0u && length > WINDOW);
    let count = (length - first + SPLIT - 1u) / SPLIT;
    let base = (b * N_HEADS + h) * NSPLIT * PSTRIDE;
    if (t == 0u) {
        var m = -3.0e38;
        for (var s = 0u; s < count; s++) {
            m = max(m, parts[base + s * PSTRIDE]);
        }
        var l = 0.0;
        for (var s = 0u; s < count; s++) {
            let w = exp(parts[base + s * PSTRIDE] - m);
            weights[s] = w;
            l += w * parts[base + s * PSTRIDE + 1u];
        }
        total[0] = l;
    }
    workgroupBarrier();
    let scale = 1.0 / total[0];
    for (var d = t; d < HEAD_DIM; d += AWG) {
        var sum = 0.0;
        for (var s = 0u; s < count; s++) {
            sum += weights[s] * parts[base + s * PSTRIDE + 2u + d];
        }
        att[(b * N_HEADS + h) * HEAD_DIM + d] = sum * scale;
    }
}
