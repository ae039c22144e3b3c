// RMSNorm of DIM-element vectors, one workgroup per (vector, row): vector v of row b is
// x[b·STRIDE + v·DIM ..], times weight[v·DIM ..]. The unfused step normalises each residual row (one
// vector a row, STRIDE DIM) into out [b, DIM] (the fused one normalises inside the next projection,
// gemv.wgsl MODE 1). Qwen3's q/k norm: every query head and then every key head of the qkv rows
// (STRIDE QKV_STRIDE, DIM HEAD_DIM, the weights stacked per head), in place before rotary (IN_PLACE 1:
// x is written, out unused). Gemma's post norms: ADD 1 adds the normalised rows into out (the residual
// stream) instead of storing them.
// Constants: WG, DIM, EPS, STRIDE, IN_PLACE, ADD.

struct Step { n_rows: u32, head_first: u32, head_count: u32, pad: u32, rows: array<vec4<u32>> };

@group(0) @binding(0) var<storage, read> step: Step;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let base = wg.y * STRIDE + wg.x * DIM;
    let w = wg.x * DIM;
    var s = 0.0;
    for (var k = t; k < DIM; k += WG) {
        let v = x[base + k];
        s += v * v;
    }
    red[t] = s;
    workgroupBarrier();
    var total = 0.0;
    for (var j = 0u; j < WG; j++) {
        total += red[j];
    }
    let scale = inverseSqrt(total / f32(DIM) + EPS);
    // each thread writes only the elements it read: in place, no other thread's read is overtaken
    for (var k = t; k < DIM; k += WG) {
        let y = x[base + k] * scale * weight[w + k];
        if (IN_PLACE == 1u) {
            x[base + k] = y;
        } else if (ADD == 1u) {
            out[base + k] += y;
        } else {
            out[base + k] = y;
        }
    }
}
