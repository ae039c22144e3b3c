// SwiGLU of each of the step's rows, gate_up [b, 2·FFN] -> out [b, FFN] = silu(gate) · up (the unfused
// step: the fused one computes it inside the down projection, gemv.wgsl MODE 2).
// GELU 1: Gemma's GeGLU, gelu(gate) · up.
// Constants: WG, FFN, GELU.

struct Step { n_rows: u32, head_first: u32, head_count: u32, pad: u32, rows: array<vec4<u32>> };

@group(0) @binding(0) var<storage, read> step: Step;
@group(0) @binding(1) var<storage, read> gate_up: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

// Gemma's GeGLU gate (GELU 1): gelu, tanh-approximated as PyTorch's; else SwiGLU's silu. (tanh's argument
// clamped: tanh(±15) is ±1 in float32, and some drivers' tanh of a large argument is inf / inf.)
fn gate(g: f32) -> f32 {
    if (GELU == 1u) {
        return 0.5 * g * (1.0 + tanh(clamp(0.7978845608028654 * (g + 0.044715 * g * g * g), -15.0, 15.0)));
    }
    return g / (1.0 + exp(-g));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let k = wg.x * WG + t;
    if (k >= FFN) {
        return;
    }
    let b = wg.y;
    let g = gate_up[b * 2u * FFN + k];
    out[b * FFN + k] = gate(g) * gate_up[b * 2u * FFN + FFN + k];
}
