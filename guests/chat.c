/* The default guest: a chat that keeps its conversation in guest memory and lets the host sample
 * with the caller's parameters (temperature, top-k, top-p, the actor's seeded RNG). */
#include "conversation.h"

static int32_t host_sample(void) { return floe_sample(0); }

FLOE_EXPORT(on_message) int32_t on_message(const char *text, int32_t len) {
    logits_target = 0;
    return conversation_turn(text, len, host_sample);
}
