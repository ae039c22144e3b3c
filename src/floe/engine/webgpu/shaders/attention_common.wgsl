// What the attention shaders share (attention, attend_out, attention_split: `// #include attention_common`,
// expanded by device.shader_source). They read the constants SOFTCAP, N_KV, N_HEADS, GROUP, MAX_SEQ,
// HEAD_DIM, HALF and declare the bindings src (the qkv rows), cos_t and sin_t and the workgroup's qs.

// Gemma 2's scores soft-capped (SOFTCAP > 0): SOFTCAP · tanh(score / SOFTCAP), as the CPU's forward.
fn capped(score: f32) -> f32 {
    if (SOFTCAP > 0.0) {
        return SOFTCAP * tanh(clamp(score / SOFTCAP, -15.0, 15.0));
    }
    return score;
}

// Where position pos of KV head kvh of slot `slot` starts in the cache.
fn cache_at(slot: u32, kvh: u32, pos: u32) -> u32 {
    return ((slot * N_KV + kvh) * MAX_SEQ + pos) * HEAD_DIM;
}

// The rotary pair (x0 at dimension i < HALF, x1 at i + HALF) of a head at position pos, rotated (half-split,
// as Hugging Face's Llama; the layer's cos_t and sin_t tables).
fn rotated(pos: u32, i: u32, x0: f32, x1: f32) -> vec2<f32> {
    let lo = pos * HEAD_DIM + i;
    return vec2<f32>(x0 * cos_t[lo] - x1 * sin_t[lo], x1 * cos_t[lo + HALF] + x0 * sin_t[lo + HALF]);
}

// Dimensions i and i + HALF of KV head kvh's GROUP query heads in the qkv row at `base` of src, rotated
// into qs (the shaders that rotate as they attend: attention_split, attend_out).
fn rotate_queries(base: u32, kvh: u32, pos: u32, i: u32) {
    for (var g = 0u; g < GROUP; g++) {
        let h = base + (kvh * GROUP + g) * HEAD_DIM;
        let q = rotated(pos, i, src[h + i], src[h + i + HALF]);
        qs[g * HEAD_DIM + i] = q.x;
        qs[g * HEAD_DIM + i + HALF] = q.y;
    }
}

// Dimensions i and i + HALF of KV head kvh's key in the qkv row at `base` of src, rotated.
fn rotated_key(base: u32, kvh: u32, pos: u32, i: u32) -> vec2<f32> {
    let kb = base + (N_HEADS + kvh) * HEAD_DIM;
    return rotated(pos, i, src[kb + i], src[kb + i + HALF]);
}
