/* A conversation kept in guest memory across messages, shared by the chat and constrained guests.
 *
 * Each message: append it, render the whole conversation with the model's chat template, tokenize,
 * keep the longest prefix the KV cache already holds, prefill only the rest, then generate with the
 * guest's own `next_token` rule until EOS, max_tokens, a full context, or the caller says stop.
 * With CONVERSATION_TOKENIZE_REST (the grammar guest) a turn keeps every token the cache holds where the
 * rendered conversation goes on from their bytes, and tokenizes only the text after them: a reply stays
 * as the model wrote it (docs/GUESTS.md, "What a turn reuses").
 */
#ifndef CONVERSATION_H
#define CONVERSATION_H

#include "floe.h"

typedef struct { char *data; uint32_t len, cap; } bytes_buf;
typedef struct { int32_t *data; uint32_t len, cap; } ids_buf;

static int reserve_bytes(bytes_buf *b, uint32_t need) {
    if (need <= b->cap) return 1;
    uint32_t cap = b->cap ? b->cap : 256;
    while (cap < need) cap *= 2;
    char *d = floe_alloc(cap);
    if (!d) return 0;
    __builtin_memcpy(d, b->data, b->len);
    b->data = d;
    b->cap = cap;
    return 1;
}

static int reserve_ids(ids_buf *b, uint32_t need) {
    if (need <= b->cap) return 1;
    uint32_t cap = b->cap ? b->cap : 256;
    while (cap < need) cap *= 2;
    int32_t *d = floe_alloc(cap * sizeof(int32_t));
    if (!d) return 0;
    __builtin_memcpy(d, b->data, b->len * sizeof(int32_t));
    b->data = d;
    b->cap = cap;
    return 1;
}

static floe_message *messages;
static uint32_t n_messages, cap_messages;
static ids_buf history;   /* exactly the token ids in this actor's KV cache */
static ids_buf prompt;    /* scratch: the rendered conversation's ids */
static bytes_buf rendered, reply, input;
static int32_t eos[8], n_eos = -1;
static floe_request req;

/* The guest's rule for the next token: called after each prefill/decode. */
typedef int32_t (*next_token_fn)(void);
/* Where prefill/decode should write logits (NULL: the host keeps them). */
static float *logits_target;

FLOE_EXPORT(floe_abi_version) int32_t floe_abi_version(void) { return FLOE_ABI_VERSION; }

/* The host writes each incoming message here (the buffer is reused). */
FLOE_EXPORT(alloc) void *alloc(int32_t size) {
    if (size < 0 || !reserve_bytes(&input, (uint32_t)size + 1)) return 0;
    return input.data;
}

static int add_message(const char *role, const char *text, uint32_t len) {
    if (n_messages == cap_messages) {
        uint32_t cap = cap_messages ? cap_messages * 2 : 16;
        floe_message *m = floe_alloc(cap * sizeof(floe_message));
        if (!m) return 0;
        __builtin_memcpy(m, messages, n_messages * sizeof(floe_message));
        messages = m;
        cap_messages = cap;
    }
    char *copy = floe_alloc(len ? len : 1); /* conversation text lives as long as the actor */
    if (!copy) return 0;
    __builtin_memcpy(copy, text, len);
    messages[n_messages++] = (floe_message){role, (uint32_t)floe_strlen(role), copy, len};
    return 1;
}

/* The host loads an earlier conversation (e.g. an OpenAI request's messages) one message at a time:
 * role 0 system, 1 user, 2 assistant. Nothing is generated; the next on_message renders it all and
 * prefills what the KV cache does not hold. */
FLOE_EXPORT(on_history) int32_t on_history(int32_t role, const char *text, int32_t len) {
    static const char *const roles[] = {"system", "user", "assistant"};
    if (role < 0 || role > 2 || len < 0) return 1;
    return add_message(roles[role], text, (uint32_t)len) ? 0 : 2;
}

static int is_eos(int32_t tok) {
    for (int i = 0; i < n_eos; i++)
        if (eos[i] == tok) return 1;
    return 0;
}

static void log_overflow(uint32_t tokens) {
    char msg[96] = "the conversation is ";
    int n = (int)floe_strlen(msg);
    n += floe_itoa((int32_t)tokens, msg + n);
    const char *mid = " tokens; the context holds ";
    __builtin_memcpy(msg + n, mid, floe_strlen(mid));
    n += (int)floe_strlen(mid);
    n += floe_itoa(floe_context_length(), msg + n);
    floe_log(msg, n);
}

/* Renders the conversation into `rendered`; returns its length in bytes, or -1 on failure. */
static int32_t render_text(void) {
    /* Room for the template's text around the messages, so that one call usually renders it all. */
    uint32_t guess = 1024;
    for (uint32_t i = 0; i < n_messages; i++) guess += messages[i].content_len + 64;
    if (!reserve_bytes(&rendered, guess)) return -1;
    int32_t n = floe_chat_render(messages, (int32_t)n_messages, 1, rendered.data, (int32_t)rendered.cap);
    if (n < 0) return -1;
    if ((uint32_t)n > rendered.cap) {
        if (!reserve_bytes(&rendered, (uint32_t)n)) return -1;
        floe_chat_render(messages, (int32_t)n_messages, 1, rendered.data, (int32_t)rendered.cap);
    }
    rendered.len = (uint32_t)n;
    return n;
}

/* Tokenizes the rendered conversation (its n bytes) into `prompt`; returns 0 on failure. */
static int tokenize_text(int32_t n) {
    /* A token stands for at least one byte of text (plus a few the tokenizer may add): one call. */
    if (!reserve_ids(&prompt, (uint32_t)n + 16)) return 0;
    int32_t m = floe_tokenize(rendered.data, n, prompt.data, (int32_t)prompt.cap);
    if ((uint32_t)m > prompt.cap) {
        if (!reserve_ids(&prompt, (uint32_t)m)) return 0;
        floe_tokenize(rendered.data, n, prompt.data, (int32_t)prompt.cap);
    }
    prompt.len = (uint32_t)m;
    return m > 0;
}

/* Renders and tokenizes the conversation into `prompt`; returns 0 on failure. */
static int render_prompt(void) {
    int32_t n = render_text();
    return n >= 0 && tokenize_text(n);
}

/* The longest prefix of the prompt the KV cache holds. */
static uint32_t common_prefix(void) {
    uint32_t p = 0;
    while (p < history.len && p < prompt.len && history.data[p] == prompt.data[p]) p++;
    return p;
}

#ifdef CONVERSATION_TOKENIZE_REST
/* The host's tokenization of the last render's text after the bytes of `ids` (docs/ABI.md). */
FLOE_IMPORT(tokenize_rest) int32_t floe_tokenize_rest(const int32_t *ids, int32_t n, int32_t *out, int32_t cap);

/* The prompt as the ids the KV cache holds, then the host's tokenization of the rendered text after
 * their bytes: a reply stays as the model wrote it (its tokens, which the whole text's tokenization may
 * split otherwise: `":` `"` where it reads `":"`), so the next turn prefills only what is new. *p: the
 * tokens the cache holds. 0 where the text does not go on from them (an edited conversation). */
static int tokenize_rest(uint32_t *p) {
    uint32_t h = history.len;
    if (!h || !reserve_ids(&prompt, h + rendered.len + 16)) return 0;
    int32_t m = floe_tokenize_rest(history.data, (int32_t)h, prompt.data + h, (int32_t)(prompt.cap - h));
    if (m >= 0 && (uint32_t)m > prompt.cap - h) {
        if (!reserve_ids(&prompt, h + (uint32_t)m)) return 0;
        m = floe_tokenize_rest(history.data, (int32_t)h, prompt.data + h, (int32_t)(prompt.cap - h));
    }
    if (m < 0) return 0;
    __builtin_memcpy(prompt.data, history.data, h * sizeof(int32_t));
    prompt.len = h + (uint32_t)m;
    *p = h;
    return 1;
}
#endif

/* Adds the user's message, renders and tokenizes the conversation, and reuses the longest prefix
 * the KV cache holds: the tokens still to prefill are prompt.data[p .. prompt.len). Returns 0 and sets
 * *p, or the turn's error status. */
static int32_t begin_turn(const char *text, int32_t len, uint32_t *start) {
    floe_request_params(&req);
    if (n_eos < 0) n_eos = floe_eos_ids(eos, 8);
    if (n_messages == 0) {
        int32_t n = floe_system(rendered.data, (int32_t)rendered.cap);
        if (n > (int32_t)rendered.cap && reserve_bytes(&rendered, (uint32_t)n))
            n = floe_system(rendered.data, (int32_t)rendered.cap);
        if (n > 0 && !add_message("system", rendered.data, (uint32_t)n)) return 2;
    }
    if (!add_message("user", text, (uint32_t)len)) return 2;
    /* Reuse what the KV cache already holds; prefill at least one token to get fresh logits. */
    uint32_t p;
#ifdef CONVERSATION_TOKENIZE_REST
    int32_t n = render_text();
    if (n < 0) { floe_log_str("could not render the conversation"); return 3; }
    if (!tokenize_rest(&p)) {
        if (!tokenize_text(n)) { floe_log_str("could not render the conversation"); return 3; }
        p = common_prefix();
    }
#else
    if (!render_prompt()) { floe_log_str("could not render the conversation"); return 3; }
    p = common_prefix();
#endif
    if (p == prompt.len) p--;
    floe_kv_truncate((int32_t)p);
    history.len = p;
    *start = p;
    return 0;
}

/* Records the prompt's tokens as what the KV cache holds (after a prefill was taken). */
static int32_t took_prompt(uint32_t p) {
    if (!reserve_ids(&history, prompt.len)) return 5;
    __builtin_memcpy(history.data + p, prompt.data + p, (prompt.len - p) * sizeof(int32_t));
    history.len = prompt.len;
    reply.len = 0;
    return 0;
}

/* One chosen token: EOS ends the reply; otherwise its bytes are kept and streamed. Returns 1 to go
 * on, 0 when the reply is over (EOS, the caller said stop), or a negative error. */
static int32_t take_token(int32_t tok) {
    if (tok < 0 || is_eos(tok)) return 0;
    /* The token's text goes straight to the end of the reply; a token longer than the room left
     * (some are 80 bytes of '#' or spaces) is asked for again with room for all of it. */
    uint32_t room = 64;
    for (;;) {
        if (!reserve_bytes(&reply, reply.len + room)) return -6;
        int32_t k = floe_detokenize(&tok, 1, reply.data + reply.len, (int32_t)room);
        if (k < 0) return -6;
        if ((uint32_t)k <= room) {
            const char *piece = reply.data + reply.len;
            reply.len += (uint32_t)k;
            return floe_emit(piece, k) ? 0 : 1;
        }
        room = (uint32_t)k;
    }
}

static int32_t end_reply(void) { return add_message("assistant", reply.data, reply.len) ? 0 : 8; }

/* Prefills (v1) or queues (v2) the prompt from token p on; 0, or the turn's error status. */
static int32_t prefill_prompt(uint32_t p) {
    int32_t status = floe_prefill(prompt.data + p, (int32_t)(prompt.len - p), logits_target);
    if (status == FLOE_ERR_CONTEXT_FULL) {
        log_overflow(prompt.len);
        n_messages--; /* the message was not taken */
        return 4;
    }
    return status == FLOE_OK ? 0 : 5;
}

/* The start of a turn, either ABI: the message appended and rendered, its new prompt tokens prefilled
 * (v1) or queued (v2) from token *p on; 0, or the turn's error status. */
static int32_t start_turn(const char *text, int32_t len, uint32_t *p) {
    int32_t status = begin_turn(text, len, p);
    return status ? status : prefill_prompt(*p);
}

/* A token the KV cache now holds, kept in the history; 0 if memory ran out. */
static int keep_token(int32_t tok) {
    if (!reserve_ids(&history, history.len + 1)) return 0;
    history.data[history.len++] = tok;
    return 1;
}

#ifdef FLOE_ABI_V1
/* ABI v1: the guest drives the engine itself, one blocking call at a time (no host choice). */
static int32_t conversation_turn(const char *text, int32_t len, next_token_fn next_token, int32_t *choice) {
    (void)choice;
    uint32_t p;
    int32_t status = start_turn(text, len, &p);
    if (status) return status;
    if (took_prompt(p)) return 5;
    for (uint32_t i = 0; i < req.max_tokens; i++) {
        int32_t tok = next_token();
        int32_t go = take_token(tok);
        if (go < 0) return -go;
        if (!go || i + 1 == req.max_tokens) break;
        if (floe_decode(tok, logits_target) != FLOE_OK) break; /* context full: the reply ends here */
        if (!keep_token(tok)) return 7;
    }
    return end_reply();
}
#else
/* ABI v2: on_message queues the prompt; the engine loop calls on_token after each step (the host
 * appends the token it returns, counts max_tokens and streams the token's text), then on_end. */
static next_token_fn turn_rule;
static int32_t pending = -1; /* the token on_token returned last, appended by the host's next step */
static ids_buf reply_ids;    /* the reply's tokens, detokenized once at its end */

/* `choice`: where the host writes its choice before each on_token (the rule reads it), or NULL for a
 * rule that chooses from the logits itself. */
static int32_t conversation_turn(const char *text, int32_t len, next_token_fn next_token, int32_t *choice) {
    /* The turn's options first: a failure then leaves the conversation as it was. */
    if (floe_choice_at(choice) != FLOE_OK || floe_stream_tokens(1) != FLOE_OK) return 5;
    uint32_t p;
    int32_t status = start_turn(text, len, &p);
    if (status) return status;
    turn_rule = next_token;
    pending = -1;
    reply_ids.len = 0;
    return took_prompt(p);
}

FLOE_EXPORT(on_token) int32_t on_token(void) {
    if (pending >= 0) { /* the host appended the token we returned last time */
        if (!keep_token(pending)) return -7;
        pending = -1;
    }
    int32_t tok = turn_rule();
    if (tok < 0 || is_eos(tok)) return FLOE_STOP;
    if (!reserve_ids(&reply_ids, reply_ids.len + 1)) return -7;
    reply_ids.data[reply_ids.len++] = tok;
    pending = tok;
    return tok; /* the host streams its text */
}

FLOE_EXPORT(on_end) int32_t on_end(int32_t reason) {
    (void)reason; /* the last token returned was not appended: history holds what the cache holds */
    pending = -1;
    /* The reply's text, for the conversation: its tokens' bytes, a chunk of ids at a time. */
    for (uint32_t i = 0; i < reply_ids.len;) {
        uint32_t n = reply_ids.len - i < 4096 ? reply_ids.len - i : 4096;
        int32_t k = floe_detokenize(reply_ids.data + i, (int32_t)n, reply.data + reply.len,
                                    (int32_t)(reply.cap - reply.len));
        if (k < 0) return 6;
        if ((uint32_t)k > reply.cap - reply.len) {
            if (!reserve_bytes(&reply, reply.len + (uint32_t)k)) return 6;
            continue; /* again, with room */
        }
        reply.len += (uint32_t)k;
        i += n;
    }
    return end_reply();
}
#endif

#endif
