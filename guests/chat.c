/* The default guest: a chat that keeps its conversation in guest memory and takes the host's sample
 * with the caller's parameters (temperature, top-k, top-p, the actor's seeded RNG): ABI v2 writes it
 * into the guest's memory before each on_token; v1 asks for it. */
#include "conversation.h"

static int32_t host_choice; /* v2: the host's choice for this step */

static int32_t host_sample(void) {
#ifdef FLOE_ABI_V1
    return floe_sample(0);
#else
    return host_choice;
#endif
}

FLOE_EXPORT(on_message) int32_t on_message(const char *text, int32_t len) {
    logits_target = 0;
    return conversation_turn(text, len, host_sample, &host_choice);
}
