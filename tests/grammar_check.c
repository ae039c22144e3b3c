/* The grammar guest's schema compiler and automaton alone, for tests/test_grammar_keywords.py: compile a
 * schema, ask whether bytes are a value of it, or draw values from it at random. No model, no imports.
 * Built by the test with guests/build.py's compiler settings. */
#include "json_automaton.h"

static grammar g;
static cset state, next;

FLOE_EXPORT(alloc) void *check_alloc(uint32_t n) { return floe_alloc(n); }
FLOE_EXPORT(error) const char *check_error(void) { return g.error; }
FLOE_EXPORT(min_bytes) uint32_t check_min_bytes(void) { return g.nodes[g.root].min_bytes; }

/* 1: compiled; 0: refused (error() says why). */
FLOE_EXPORT(compile) int32_t check_compile(const char *schema, uint32_t len) {
    return grammar_compile(&g, schema, len);
}

/* 1: text is a whole value; 0: some byte was refused or the value is unfinished; -1: need() said more
 * bytes were needed than the rest of this value has (need must never overstate), or a reading was lost. */
FLOE_EXPORT(accepts) int32_t check_accepts(const unsigned char *text, uint32_t len) {
    cset_start(&g, &state);
    for (uint32_t i = 0; i < len; i++) {
        cset_step(&g, &state, text[i], &next);
        state = next;
        if (!state.len) return 0;
        if (state.overflow) return -1;
    }
    if (!cset_complete(&g, &state)) return 0;
    /* accepted: along the way need() must be at most the bytes that did follow */
    cset_start(&g, &state);
    for (uint32_t i = 0; i <= len; i++) {
        if (cset_need(&g, &state) > len - i) return -1;
        if (i == len) break;
        cset_step(&g, &state, text[i], &next);
        state = next;
    }
    return 1;
}

static uint64_t rng;
static uint32_t draw(uint32_t n) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng % n);
}

/* A value of the schema drawn at random into out (at most cap bytes): random allowed bytes while
 * `soft` bytes are written, then bytes that lower need() by one each. Its length; -1 when a state of
 * need n has no byte to need n - 1 (the guest relies on one), -2 when it ran past cap. */
FLOE_EXPORT(sample) int32_t check_sample(uint64_t seed, unsigned char *out, uint32_t cap, uint32_t soft) {
    static cset options[256];
    rng = seed * 2654435761u + 1;
    cset_start(&g, &state);
    for (uint32_t len = 0;; len++) {
        uint32_t need = cset_need(&g, &state);
        if (cset_complete(&g, &state) && (need == 0) && (len >= soft || draw(8) == 0)) return (int32_t)len;
        if (len >= cap) return -2;
        int allowed[256], n = 0;
        for (int b = 0; b < 256; b++) {
            cset_step(&g, &state, b, &options[b]);
            if (!options[b].len) continue;
            if (len >= soft && cset_need(&g, &options[b]) != need - 1) continue;
            allowed[n++] = b;
        }
        if (!n) return cset_complete(&g, &state) ? (int32_t)len : -1;
        /* ASCII mostly: a string's interior would otherwise be all multi-byte UTF-8 */
        int b = allowed[draw((uint32_t)n)];
        for (int tries = 0; tries < 4 && b >= 0x80; tries++) b = allowed[draw((uint32_t)n)];
        out[len] = (unsigned char)b;
        state = options[b];
    }
}
