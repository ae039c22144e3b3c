/* A guest that chooses every token itself, inside the sandbox, from the float32 logits the engine
 * writes straight into its memory: a lipogram that never uses the letter "e" (greedy among the
 * allowed tokens; end-of-sequence stays allowed). */
#include "conversation.h"

static uint8_t *allowed; /* allowed[id]: the token's text has no 'e' or 'E' */
static int32_t vocab;

static int build_mask(void) {
    vocab = floe_vocab_size();
    allowed = floe_alloc((size_t)vocab);
    logits_target = floe_alloc((size_t)vocab * sizeof(float));
    if (!allowed || !logits_target) return 0;
    char text[256];
    for (int32_t id = 0; id < vocab; id++) {
        int32_t n = floe_detokenize(&id, 1, text, sizeof text);
        int ok = n >= 0 && n <= (int32_t)sizeof text; /* a longer token is not checked: not allowed */
        for (int32_t i = 0; ok && i < n; i++)
            if (text[i] == 'e' || text[i] == 'E') ok = 0;
        allowed[id] = (uint8_t)ok;
    }
    int32_t ids[8];
    int32_t k = floe_eos_ids(ids, 8);
    for (int32_t i = 0; i < k && i < 8; i++) allowed[ids[i]] = 1;
    return 1;
}

static int32_t argmax_allowed(void) {
    int32_t best = -1;
    float best_score = 0;
    for (int32_t id = 0; id < vocab; id++) {
        if (allowed[id] && (best < 0 || logits_target[id] > best_score)) {
            best = id;
            best_score = logits_target[id];
        }
    }
    return best;
}

FLOE_EXPORT(on_message) int32_t on_message(const char *text, int32_t len) {
    if (!allowed && !build_mask()) return 9;
    return conversation_turn(text, len, argmax_allowed, 0);
}
