/* floe guest ABI, version 2 — the `floe` import module. See docs/ABI.md.
 *
 * Every pointer is an offset into this module's linear memory; the host bounds-checks each
 * (pointer, length) and traps the guest on a bad one. Calls that can fail recoverably return a
 * negative FLOE_ERR_* status. A v2 guest exports `memory`, `floe_abi_version` (returning 2), `alloc`,
 * `on_message` (prepare the turn: queue its prompt with floe_prefill), `on_token` (choose the next
 * token after each step) and optionally `on_end` and `on_history`. The engine drives: one loop steps
 * every actor's turn in one batched forward and calls each guest's on_token. A guest that defines
 * FLOE_ABI_V1 before including this file speaks version 1 (it drives the engine itself with
 * floe_prefill and floe_decode; see docs/ABI.md). See the bottom of this file for helpers.
 */
#ifndef FLOE_H
#define FLOE_H

#include <stddef.h>
#include <stdint.h>

#ifdef FLOE_ABI_V1
#define FLOE_ABI_VERSION 1
#else
#define FLOE_ABI_VERSION 2
#endif
#define FLOE_IMPORT(name) __attribute__((import_module("floe"), import_name(#name)))
#define FLOE_EXPORT(name) __attribute__((export_name(#name)))

enum {
    FLOE_OK = 0,
    FLOE_ERR_CONTEXT_FULL = -1, /* the KV cache cannot hold the tokens */
    FLOE_ERR_BAD_TOKEN = -2,    /* a token id outside [0, vocab_size) */
    FLOE_ERR_BAD_ARGUMENT = -3, /* e.g. n == 0, or invalid sampling parameters */
};

/* v2: what on_token returns to end the turn (any token id >= 0 continues it). */
#define FLOE_STOP (-1)
/* v2: why a turn ended, passed to on_end. */
enum { FLOE_END_STOP = 0, FLOE_END_LENGTH = 1, FLOE_END_CONTEXT_FULL = 2, FLOE_END_CANCELLED = 3 };

/* One chat message, for floe_chat_render (16 bytes on wasm32). */
typedef struct {
    const char *role;
    uint32_t role_len;
    const char *content;
    uint32_t content_len;
} floe_message;

/* Host-side sampling parameters (16 bytes). temperature 0 = greedy; top_k 0 = all; top_p 1 = off. */
typedef struct {
    float temperature;
    int32_t top_k;
    float top_p;
    uint32_t reserved;
} floe_sampling;

/* What the caller asked for this message (32 bytes). */
typedef struct {
    uint32_t max_tokens;
    float temperature;
    int32_t top_k;
    float top_p;
    uint64_t seed;
    uint64_t reserved;
} floe_request;

/* The model */
FLOE_IMPORT(abi_version) int32_t floe_host_abi_version(void);
FLOE_IMPORT(vocab_size) int32_t floe_vocab_size(void);
FLOE_IMPORT(context_length) int32_t floe_context_length(void);
FLOE_IMPORT(eos_ids) int32_t floe_eos_ids(int32_t *out, int32_t cap);

/* Text. Each returns the full count (ids or bytes) and writes at most `cap` of them: call again
 * with a larger buffer when the result exceeds cap. */
FLOE_IMPORT(tokenize) int32_t floe_tokenize(const char *text, int32_t len, int32_t *out, int32_t cap);
FLOE_IMPORT(detokenize) int32_t floe_detokenize(const int32_t *ids, int32_t n, char *out, int32_t cap);
FLOE_IMPORT(chat_render) int32_t floe_chat_render(const floe_message *msgs, int32_t n,
                                                  int32_t add_generation_prompt, char *out, int32_t cap);

/* Compute. v1: prefill appends ids to this actor's KV cache and runs them now; decode appends one
 * token. v2: prefill (only inside on_message) queues the ids: the engine loop runs them, then calls
 * on_token after every step; decode is not available (on_token returns the next token). With a
 * non-null `logits` (4-byte aligned, vocab_size floats) the engine writes the next-token float32
 * logits there (v2: for every step of the turn). Both return FLOE_OK or a FLOE_ERR_* status. */
FLOE_IMPORT(prefill) int32_t floe_prefill(const int32_t *ids, int32_t n, float *logits);
FLOE_IMPORT(decode) int32_t floe_decode(int32_t token, float *logits);
/* A token drawn from the latest logits (if they were written into guest memory: from those bytes as
 * they are now, so a guest may mask them first). NULL params: the request's. Uses the actor's RNG. */
FLOE_IMPORT(sample) int32_t floe_sample(const floe_sampling *params);
#ifndef FLOE_ABI_V1
/* v2, only in on_message, for this turn: before each on_token the host writes its own choice at `out`:
 * the forward's argmax for a greedy request, else a draw with the request's parameters (the actor's
 * RNG, once a step, taken or not); -3 if the logits allow no draw. NULL: no more. Saves a sample call
 * a token. */
FLOE_IMPORT(choice_at) int32_t floe_choice_at(int32_t *out);
/* v2, only in on_message, for this turn: 1: the host streams the text of every token on_token returns
 * (no detokenize and emit a token); 0: the guest emits what it wants. */
FLOE_IMPORT(stream_tokens) int32_t floe_stream_tokens(int32_t on);
#endif
FLOE_IMPORT(kv_len) int32_t floe_kv_len(void);
FLOE_IMPORT(kv_truncate) int32_t floe_kv_truncate(int32_t n);

/* The caller */
FLOE_IMPORT(request) int32_t floe_request_params(floe_request *out);
/* The caller's system prompt for this conversation (UTF-8); returns its length, 0 if none. */
FLOE_IMPORT(system) int32_t floe_system(char *out, int32_t cap);
/* Streams text to the caller; returns 1 when the caller wants the guest to stop, else 0. */
FLOE_IMPORT(emit) int32_t floe_emit(const char *text, int32_t len);
FLOE_IMPORT(log) int32_t floe_log(const char *text, int32_t len);

/* ---- helpers for guests without a libc ------------------------------------------------------- */

extern unsigned char __heap_base;
static uintptr_t floe_heap_top;

/* Bump allocation (16-byte aligned) that grows memory as needed; NULL when memory cannot grow. */
static void *floe_alloc(size_t size) {
    if (!floe_heap_top) floe_heap_top = (uintptr_t)&__heap_base;
    uintptr_t p = (floe_heap_top + 15) & ~(uintptr_t)15;
    uintptr_t end = p + size;
    uintptr_t have = __builtin_wasm_memory_size(0) * 65536u;
    if (end > have) {
        size_t pages = (end - have + 65535) / 65536;
        if (__builtin_wasm_memory_grow(0, pages) == (size_t)-1) return NULL;
    }
    floe_heap_top = end;
    return (void *)p;
}

static inline size_t floe_strlen(const char *s) {
    size_t n = 0;
    while (s[n]) n++;
    return n;
}

static inline void floe_log_str(const char *s) { floe_log(s, (int32_t)floe_strlen(s)); }

/* Writes the decimal form of v at out (room for 12 bytes); returns its length. */
static inline int floe_itoa(int32_t v, char *out) {
    char tmp[12];
    int n = 0, neg = v < 0;
    uint32_t u = neg ? (uint32_t)(-(int64_t)v) : (uint32_t)v;
    do { tmp[n++] = (char)('0' + u % 10); u /= 10; } while (u);
    int len = 0;
    if (neg) out[len++] = '-';
    while (n) out[len++] = tmp[--n];
    return len;
}

#endif
