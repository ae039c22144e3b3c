/* Structured output: a chat guest whose every reply is one JSON value, valid against the JSON Schema
 * the caller sent (or any JSON value, in plain JSON mode). See docs/GUESTS.md.
 *
 * A message may begin with a header that sets the grammar for it and for the messages after it:
 *     "\0json-schema <N>\n" then N bytes of JSON Schema, then the user's text
 *     "\0json\n" then the user's text (plain JSON mode; also the mode before any header)
 * either with " new" before its "\n": the conversation starts again with this message; and either with
 * " kv <K>" last before its "\n": K bytes after the schema (before the user's text) list the token ids
 * the KV cache holds (decimal, each followed by a space), for a conversation the host loaded into this
 * actor's KV slot (a session's, copied): the turn then prefills only what they do not already hold.
 * A list whose count is not the cache's length is ignored (the turn prefills everything).
 * A schema the guest cannot compile fails the message: status 21 and a log line naming the keyword.
 * A max_tokens in which no value of the schema can be written (no first token leaves room to finish
 * it) fails the message before its prompt is read: status 22 and a log line saying how many bytes
 * the shortest value takes (a max_tokens of that many always suffices: a token is at least a byte).
 *
 * Each step (on_token): the state's mask (cached, see vocab_index.h) is applied to the logits the
 * engine wrote into this memory (disallowed tokens set to -inf), then the token is the argmax
 * (temperature 0) or the host's draw from the masked logits (the request's sampling), and the
 * automaton takes its bytes. A token is allowed only if the value can still be completed within
 * max_tokens; once the value is complete and nothing can extend it, the turn ends.
 */
#define CONVERSATION_TOKENIZE_REST /* a reply stays in the KV cache as written (conversation.h) */
#include "conversation.h"
#include "vocab_index.h"

enum { STATUS_VOCAB = 9, STATUS_HEADER = 20, STATUS_SCHEMA = 21, STATUS_BUDGET = 22 };

static vocab_index vocab;
static mask_cache cache;
static int ready;
static grammar active, candidate;
static int active_ok;
static char *active_spec;          /* the schema text `active` was compiled from (NULL: plain JSON) */
static uint32_t active_spec_len;
static cset state, next_state;
static token_mask exact;           /* near max_tokens: the mask that also counts the tokens left */
static uint32_t chosen, exact_steps;

/* This guest reads the grammar header (the host checks for this export before sending one). */
FLOE_EXPORT(floe_grammar_version) int32_t floe_grammar_version(void) { return 1; }

static void log_parts(const char *a, const char *b) {
    char line[600];
    uint32_t n = 0;
    for (const char *p = a; *p && n < sizeof line; p++) line[n++] = *p;
    for (const char *p = b; p && *p && n < sizeof line; p++) line[n++] = *p;
    floe_log(line, (int32_t)n);
}

static int set_up(void) {
    if (!vocab_build(&vocab) || !cache_init(&cache, &vocab)) return 0;
    exact.bits = floe_alloc((size_t)vocab.words * 4);
    logits_target = floe_alloc((size_t)vocab.vocab * sizeof(float));
    cache_clear(&cache);
    return exact.bits && logits_target;
}

/* A decimal count at *p (at most 9 digits); 0 with *p unchanged if there is none. */
static int read_count(const char **p, const char *end, uint32_t *n) {
    const char *q = *p;
    *n = 0;
    for (; q < end && *q >= '0' && *q <= '9' && q - *p < 9; q++) *n = *n * 10 + (uint32_t)(*q - '0');
    if (q == *p) return 0;
    *p = q;
    return 1;
}

/* The header, if any: 0 none (text unchanged), 1 plain JSON, 2 a schema at *spec, -1 malformed;
 * *fresh: the header ends with " new" (the conversation starts again with this message); *kv, *kv_len:
 * the ids the KV cache holds (" kv <K>"; *kv_len 0: none given). */
static int read_header(const char **text, int32_t *len, const char **spec, uint32_t *spec_len, int *fresh,
                       const char **kv, uint32_t *kv_len) {
    const char *t = *text, *end = t + *len, *p = t + 5;
    *fresh = 0, *kv_len = 0;
    if (*len < 1 || t[0] != 0) return 0;
    if (end - t < 6 || mem_cmp(t + 1, "json", 4)) return -1;
    int kind = 1;
    uint32_t n = 0;
    if (end - p >= 8 && !mem_cmp(p, "-schema ", 8)) {
        p += 8;
        if (!read_count(&p, end, &n)) return -1;
        kind = 2;
    }
    if (end - p >= 4 && !mem_cmp(p, " new", 4)) *fresh = 1, p += 4;
    if (end - p >= 4 && !mem_cmp(p, " kv ", 4) && !(p += 4, read_count(&p, end, kv_len))) return -1;
    if (p >= end || *p != '\n' || (uint64_t)(end - p - 1) < (uint64_t)n + *kv_len) return -1;
    *spec = p + 1, *spec_len = n;
    *kv = p + 1 + n;
    *text = p + 1 + n + *kv_len, *len = (int32_t)(end - *text);
    return kind;
}

/* The ids the KV cache holds, as the header listed them: the conversation's history, if their count is
 * the cache's length (else none: the turn prefills everything); 0 if the list is malformed. */
static int take_kv_ids(const char *list, uint32_t len) {
    const char *p = list, *end = list + len;
    history.len = 0;
    uint32_t count = 0;
    for (const char *q = list; q < end; q++) count += *q == ' ';
    if (!reserve_ids(&history, count ? count : 1)) return 0;
    for (uint32_t id; p < end; p++) {
        if (!read_count(&p, end, &id) || p >= end || *p != ' ') return history.len = 0, 0;
        history.data[history.len++] = (int32_t)id;
    }
    if (history.len != (uint32_t)floe_kv_len()) history.len = 0;
    return 1;
}

static int same_spec(const char *spec, uint32_t len) {
    return active_ok && active_spec && active_spec_len == len && !mem_cmp(active_spec, spec, len);
}

/* Compiles the grammar a header asks for, unless it is the one in force; 0 or the message's status. */
static int32_t use_grammar(int kind, const char *spec, uint32_t len) {
    static char *spec_buffer;
    static uint32_t spec_cap;
    if (kind == 0 && active_ok) return 0;
    if (kind == 2 && same_spec(spec, len)) return 0;
    if (kind != 2 && active_ok && !active_spec) return 0;
    if (!grammar_compile(&candidate, kind == 2 ? spec : 0, kind == 2 ? len : 0)) {
        log_parts("grammar: ", candidate.error);
        return STATUS_SCHEMA;
    }
    if (kind == 2 && len > spec_cap) {
        spec_buffer = floe_alloc(len);
        if (!spec_buffer) return 2;
        spec_cap = len;
    }
    active = candidate;
    active_ok = 1;
    active_spec = kind == 2 ? spec_buffer : 0;
    active_spec_len = kind == 2 ? len : 0;
    if (kind == 2) __builtin_memcpy(spec_buffer, spec, len);
    cache_clear(&cache); /* masks of another grammar's states */
    return 0;
}

static void advance(int32_t tok) {
    const char *t = vocab.text + vocab.off[tok];
    for (uint32_t i = 0; i < vocab.len[tok]; i++) {
        cset_step(&active, &state, (unsigned char)t[i], &next_state);
        state = next_state; /* a struct copy of CSET_CAP bytes: a few per token */
    }
}

static void apply_mask(const token_mask *m) {
    const float minus_inf = -__builtin_inff();
    for (int32_t w = 0; w < vocab.words; w++) {
        uint32_t bits = m->bits[w];
        if (bits == 0xFFFFFFFFu) continue;
        int32_t base = w * 32, end = base + 32 < vocab.vocab ? base + 32 : vocab.vocab;
        for (int32_t id = base; id < end; id++)
            if (!(bits >> (id - base) & 1)) logits_target[id] = minus_inf;
    }
}

static int32_t argmax_allowed(const token_mask *m) {
    int32_t best = -1;
    float best_score = 0;
    for (int32_t w = 0; w < vocab.words; w++)
        for (uint32_t bits = m->bits[w]; bits; bits &= bits - 1) {
            int32_t id = w * 32 + __builtin_ctz(bits);
            float x = logits_target[id];
            if (x == x && (best < 0 || x > best_score)) best = id, best_score = x;
        }
    return best;
}

static void log_turn(const char *what) {
    char line[160];
    int n = 0;
    const char *parts[] = {"grammar: ", what, "; tokens ", 0, ", mask walks ", 0, ", cache hits ", 0,
                           ", exact steps ", 0};
    uint32_t values[] = {chosen, cache.walks, cache.hits, exact_steps};
    for (int i = 0, v = 0; i < 10; i++) {
        if (!parts[i]) { n += floe_itoa((int32_t)values[v++], line + n); continue; }
        for (const char *p = parts[i]; *p; p++) line[n++] = *p;
    }
    floe_log(line, n);
}

/* The turn's rule (conversation.h's on_token calls it after every step). */
static int32_t grammar_next(void) {
    uint32_t left = req.max_tokens > chosen ? req.max_tokens - chosen : 1;
    const token_mask *m = cache_mask(&cache, &active, &vocab, &state);
    if (m->complete && !m->allowed) { log_turn("the value is complete"); return FLOE_STOP; }
    if (m->max_need > left - 1) { /* near max_tokens: only tokens after which the value still fits */
        mask_compute(&active, &vocab, &state, left - 1, &exact);
        exact_steps++;
        m = &exact;
    }
    if (!m->allowed && !m->complete) { log_turn("no token can continue the value"); return -10; }
    apply_mask(m);
    int32_t tok = req.temperature == 0.0f ? argmax_allowed(m) : floe_sample(0);
    if (tok < 0) { log_turn("no token could be drawn from the masked logits"); return -11; }
    if (is_eos(tok)) { log_turn("the value is complete (end of sequence)"); return tok; }
    advance(tok);
    chosen++;
    return tok;
}

/* Whether some value can be written within the request's max_tokens from the start state; else the
 * log line saying what would do. */
static int fits_max_tokens(void) {
    floe_request_params(&req);
    uint32_t left = req.max_tokens ? req.max_tokens : 1;
    const token_mask *m = cache_mask(&cache, &active, &vocab, &state);
    if (m->max_need <= left - 1 && (m->allowed || m->complete)) return 1;
    mask_compute(&active, &vocab, &state, left - 1, &exact);
    if (exact.allowed || exact.complete) return 1;
    char line[200], digits[2][12];
    digits[0][floe_itoa((int32_t)req.max_tokens, digits[0])] = 0;
    digits[1][floe_itoa((int32_t)active.nodes[active.root].min_bytes, digits[1])] = 0;
    const char *parts[] = {"grammar: max_tokens ", digits[0], " is too small for any value of this schema: the "
                           "shortest takes ", digits[1], " bytes (max_tokens ", digits[1], " always suffices)"};
    uint32_t n = 0;
    for (int i = 0; i < 7; i++) for (const char *p = parts[i]; *p && n < sizeof line; p++) line[n++] = *p;
    floe_log(line, (int32_t)n);
    return 0;
}

FLOE_EXPORT(on_message) int32_t on_message(const char *text, int32_t len) {
    if (!ready && !(ready = set_up())) { floe_log_str("grammar: out of memory for the vocabulary"); return STATUS_VOCAB; }
    const char *spec = 0, *kv = 0;
    uint32_t spec_len = 0, kv_len = 0;
    int fresh;
    int kind = read_header(&text, &len, &spec, &spec_len, &fresh, &kv, &kv_len);
    if (kind < 0 || (kv_len && !take_kv_ids(kv, kv_len))) {
        floe_log_str("grammar: a message starting with NUL must be \\0json[ new][ kv <bytes>]\\n or "
                     "\\0json-schema <bytes>[ new][ kv <bytes>]\\n<schema><ids, each and a space>");
        return STATUS_HEADER;
    }
    int32_t status = use_grammar(kind, spec, spec_len);
    if (status) return status;
    cset_start(&active, &state);
    if (!fits_max_tokens()) return STATUS_BUDGET;
    if (fresh) n_messages = 0; /* the KV cache keeps what it holds: a shared prefix is not prefilled again */
    chosen = exact_steps = cache.walks = cache.hits = 0;
    return conversation_turn(text, len, grammar_next, 0);
}
