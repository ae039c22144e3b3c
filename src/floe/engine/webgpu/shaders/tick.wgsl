// The smallest useful kernel, for `floe bench dispatch --device webgpu`: add 1 to each of SIZE floats
// (every dispatch is counted in the result, so none can be skipped). Constants: SIZE.

@group(0) @binding(0) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {
    if (g.x < SIZE) {
        x[g.x] += 1.0;
    }
}
