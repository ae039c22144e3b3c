// The token embedding of each of the step's rows, x [b, DIM] = E[token_b], from one band of the
// table's rows (the tied head's own weight: one copy serves both); a row whose token is outside the
// band is left to the other bands' dispatches.
// Constants: WG, DIM.

struct Step { n_rows: u32, head_first: u32, head_count: u32, pad: u32, rows: array<vec4<u32>> };
struct Params { start: u32, count: u32, p0: u32, p1: u32 };

@group(0) @binding(0) var<storage, read> step: Step;
@group(0) @binding(1) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read> table: array<f32>;
@group(0) @binding(3) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let d = wg.x * WG + t;
    let b = wg.y;
    let token = step.rows[b].x;
    if (d >= DIM || token < P.start || token >= P.start + P.count) {
        return;
    }
    x[b * DIM + d] = table[(token - P.start) * DIM + d];
}
