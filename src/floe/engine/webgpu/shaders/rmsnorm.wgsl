// RMSNorm of each of the step's rows, x [b, DIM] -> out [b, DIM] (the unfused step: the fused one
// normalises inside the next projection, gemv.wgsl MODE 1). One workgroup per row.
// Constants: WG, DIM, EPS.

struct Step { n_rows: u32, head_first: u32, head_count: u32, pad: u32, rows: array<vec4<u32>> };

@group(0) @binding(0) var<storage, read> step: Step;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let base = wg.y * DIM;
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
    for (var k = t; k < DIM; k += WG) {
        out[base + k] = x[base + k] * scale * weight[k];
    }
}
