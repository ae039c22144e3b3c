/* The text completion guest (/v1/completions): one message, continued as raw text, no chat template.
 *
 * The message is the sequence's start (the text of the model's BOS token where its tokenizer adds one,
 * else nothing), a NUL byte, then the prompt. Each part is tokenized by the host's tokenize (which makes
 * special-token text its token, as llama.cpp's completion endpoint parses it); the two are tokenized
 * apart so that the prompt's ids are the tokenizer's for the prompt alone, as after a BOS it adds
 * itself. The ids are prefilled into an empty KV cache; each step takes the host's choice (the
 * request's sampling parameters, the actor's seeded RNG) and the host streams its text; an EOS id ends
 * the turn. The guest keeps nothing between messages: a completion is stateless.
 */
#include "floe.h"

static char *input;
static uint32_t input_cap;
static int32_t *ids;
static uint32_t ids_cap;
static int32_t eos[8], n_eos = -1;
static int32_t host_choice; /* the host writes its choice here before each on_token */

FLOE_EXPORT(floe_abi_version) int32_t floe_abi_version(void) { return FLOE_ABI_VERSION; }

/* Makes room for `need` items of `size` bytes at *buf, keeping its first `keep`; 0 if memory ran out. */
static int grow(void **buf, uint32_t *cap, uint32_t need, uint32_t keep, uint32_t size) {
    if (need <= *cap) return 1;
    uint32_t n = *cap ? *cap : 256;
    while (n < need) n *= 2;
    void *p = floe_alloc((size_t)n * size); /* bump memory: the old buffer is not reused */
    if (!p) return 0;
    if (keep) __builtin_memcpy(p, *buf, (size_t)keep * size);
    *buf = p;
    *cap = n;
    return 1;
}

/* The host writes each incoming message here (the buffer is reused). */
FLOE_EXPORT(alloc) void *alloc(int32_t size) {
    if (size < 0 || !grow((void **)&input, &input_cap, (uint32_t)size + 1, 0, 1)) return 0;
    return input;
}

/* Appends the ids of text[0..len) at ids[*n..]; 0 if memory ran out. A token stands for at least one
 * byte (plus a few the tokenizer may add), so one call usually does. */
static int tokenize_into(const char *text, int32_t len, uint32_t *n) {
    if (len == 0) return 1;
    uint32_t need = *n + (uint32_t)len + 16;
    for (;;) {
        if (!grow((void **)&ids, &ids_cap, need, *n, sizeof(int32_t))) return 0;
        int32_t m = floe_tokenize(text, len, ids + *n, (int32_t)(ids_cap - *n));
        if (m < 0) return 0;
        if ((uint32_t)m <= ids_cap - *n) {
            *n += (uint32_t)m;
            return 1;
        }
        need = *n + (uint32_t)m; /* again, with room for all of them */
    }
}

FLOE_EXPORT(on_message) int32_t on_message(const char *text, int32_t len) {
    if (floe_choice_at(&host_choice) != FLOE_OK || floe_stream_tokens(1) != FLOE_OK) return 5;
    if (n_eos < 0) n_eos = floe_eos_ids(eos, 8);
    int32_t head = 0;
    while (head < len && text[head] != 0) head++;
    if (head == len) { floe_log_str("the message has no NUL between the sequence's start and the prompt"); return 1; }
    uint32_t n = 0;
    if (!tokenize_into(text, head, &n) || !tokenize_into(text + head + 1, len - head - 1, &n)) return 2;
    if (n == 0) { floe_log_str("the prompt has no tokens"); return 3; }
    floe_kv_truncate(0);
    int32_t status = floe_prefill(ids, (int32_t)n, 0);
    if (status == FLOE_ERR_CONTEXT_FULL) {
        char msg[96] = "the prompt is ";
        int k = (int)floe_strlen(msg);
        k += floe_itoa((int32_t)n, msg + k);
        const char *mid = " tokens; the context holds ";
        __builtin_memcpy(msg + k, mid, floe_strlen(mid));
        k += (int)floe_strlen(mid);
        k += floe_itoa(floe_context_length(), msg + k);
        floe_log(msg, k);
        return 4;
    }
    return status == FLOE_OK ? 0 : 5;
}

FLOE_EXPORT(on_token) int32_t on_token(void) {
    int32_t tok = host_choice;
    if (tok < 0) return FLOE_STOP;
    for (int32_t i = 0; i < n_eos && i < 8; i++)
        if (eos[i] == tok) return FLOE_STOP;
    return tok; /* the host appends it and streams its text */
}
