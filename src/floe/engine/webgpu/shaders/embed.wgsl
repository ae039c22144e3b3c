// The token embedding of each of the step's rows, x [b, DIM] = E[token_b], from one band of the
// table's rows (the tied head's own weight: one copy serves both), four weights (a W4) a thread; a
// row whose token is outside the band is left to the other bands' dispatches. ZERO 1 (the deeply
// fused decode): the row's fixed-point residual sums (mlp.wgsl) are zeroed too.
// SCALE: the embeddings' factor (Gemma's sqrt(dim), rounded to float32 as the CPU's forward has it; 1 else).
// Constants: WG, DIM, ZERO, SCALE.

struct Step { n_rows: u32, head_first: u32, head_count: u32, pad: u32, rows: array<vec4<u32>> };
struct Params { start: u32, count: u32, p0: u32, p1: u32 };

@group(0) @binding(0) var<storage, read> step: Step;
@group(0) @binding(1) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read> table: array<W4>;
@group(0) @binding(3) var<storage, read_write> x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> acc: array<vec4<u32>>;

const DIM4: u32 = DIM / 4u;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let d = wg.x * WG + t;
    let b = wg.y;
    if (d >= DIM4) {
        return;
    }
    if (ZERO == 1u) {
        acc[(b * DIM4 + d) * 2u] = vec4<u32>(0u);
        acc[(b * DIM4 + d) * 2u + 1u] = vec4<u32>(0u);
    }
    let token = step.rows[b].x;
    if (token < P.start || token >= P.start + P.count) {
        return;
    }
    x[b * DIM4 + d] = w4(table[(token - P.start) * DIM4 + d]) * SCALE;
}
