/* The model's vocabulary as a byte trie, read once per actor, and the token masks of automaton states.
 *
 * A mask (which tokens may come next) is computed by walking the trie with the automaton: a branch
 * ends at the first byte no reading of the schema takes, so a state that allows a few tokens costs a
 * few hundred steps, one inside a string most of the trie. Masks are cached by state: a reply passes
 * through the same few states again and again (a string's interior, "after a value in this object"),
 * so after the first replies of a schema nearly every token is a cache hit.
 */
#ifndef VOCAB_INDEX_H
#define VOCAB_INDEX_H

#include "json_automaton.h"

#define TOKEN_MAX_BYTES 48   /* longer tokens (runs of spaces or '#') are never offered */
#define CACHE_MASKS 512
#define CACHE_SLOTS 2048     /* open addressing, a power of two above 2 x CACHE_MASKS */
#define CACHE_KEY_BYTES (1u << 20)

typedef struct { int32_t next; int32_t token; uint8_t byte; uint8_t has_kid; uint16_t pad; } trie_node;

typedef struct {
    int32_t vocab, words;    /* tokens; 32-bit words of a mask */
    char *text;              /* every indexed token's bytes */
    uint32_t *off;
    uint8_t *len;            /* 0: never offered (empty, too long, end-of-sequence, a control token) */
    trie_node *trie;
    uint32_t n_trie;
    int32_t eos[8], n_eos;
} vocab_index;

typedef struct {
    uint32_t *bits;
    uint32_t allowed;        /* tokens allowed, end-of-sequence ids not counted */
    uint32_t max_need;       /* the largest need() after an allowed token */
    uint8_t complete;        /* the value may end here: end-of-sequence ids are allowed */
} token_mask;

/* A control token's text (<|im_end|>, <file_sep>): streamed as no text, so never offered. */
static int control_text(const char *t, int32_t n) { return n >= 3 && t[0] == '<' && t[n - 1] == '>'; }

static int text_before(const vocab_index *v, int32_t a, int32_t b) {
    return text_less(v->text + v->off[a], v->len[a], v->text + v->off[b], v->len[b]);
}

static void sort_ids(const vocab_index *v, int32_t *ids, int32_t *tmp, int32_t n) {
    for (int32_t width = 1; width < n; width *= 2) {
        for (int32_t lo = 0; lo < n; lo += 2 * width) {
            int32_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            int32_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) tmp[k++] = text_before(v, ids[j], ids[i]) ? ids[j++] : ids[i++];
            while (i < mid) tmp[k++] = ids[i++];
            while (j < hi) tmp[k++] = ids[j++];
        }
        __builtin_memcpy(ids, tmp, (size_t)n * sizeof *ids);
    }
}

/* Inserts the tokens in byte order: nodes come out in depth-first order, each node's first child
 * right after it, siblings chained by `next`. */
static int build_trie(vocab_index *v, const int32_t *ids, int32_t n, uint32_t total) {
    v->trie = floe_alloc((total + 1) * sizeof *v->trie);
    if (!v->trie) return 0;
    v->trie[0] = (trie_node){-1, -1, 0, 0, 0};
    v->n_trie = 1;
    uint32_t path[TOKEN_MAX_BYTES + 1] = {0};
    const char *prev = 0;
    uint32_t prev_len = 0;
    for (int32_t i = 0; i < n; i++) {
        const char *t = v->text + v->off[ids[i]];
        uint32_t len = v->len[ids[i]], l = 0;
        while (prev && l < len && l < prev_len && prev[l] == t[l]) l++;
        if (prev && l == len) { v->len[ids[i]] = 0; continue; } /* the same bytes as another token */
        for (uint32_t k = l + 1; k <= len; k++) {
            uint32_t x = v->n_trie++, parent = path[k - 1];
            v->trie[x] = (trie_node){-1, k == len ? ids[i] : -1, (uint8_t)t[k - 1], 0, 0};
            if (v->trie[parent].has_kid) v->trie[path[k]].next = (int32_t)x;
            else v->trie[parent].has_kid = 1; /* x == parent + 1: nodes are made depth first */
            path[k] = x;
        }
        prev = t, prev_len = len;
    }
    return 1;
}

/* Reads every token's bytes from the host (one detokenize each) and builds the trie; 0 on failure. */
static int vocab_build(vocab_index *v) {
    v->vocab = floe_vocab_size();
    v->words = (v->vocab + 31) / 32;
    v->n_eos = floe_eos_ids(v->eos, 8);
    if (v->n_eos > 8) v->n_eos = 8;
    v->off = floe_alloc((size_t)v->vocab * sizeof *v->off);
    v->len = floe_alloc((size_t)v->vocab);
    int32_t *ids = floe_alloc((size_t)v->vocab * sizeof *ids), *tmp = floe_alloc((size_t)v->vocab * sizeof *tmp);
    uint32_t cap = (uint32_t)v->vocab * 8, used = 0;
    v->text = floe_alloc(cap);
    if (!v->off || !v->len || !ids || !tmp || !v->text) return 0;
    int32_t n = 0;
    for (int32_t id = 0; id < v->vocab; id++) {
        if (cap - used < TOKEN_MAX_BYTES) {
            char *more = floe_alloc(cap * 2);
            if (!more) return 0;
            __builtin_memcpy(more, v->text, used);
            v->text = more, cap *= 2;
        }
        int32_t k = floe_detokenize(&id, 1, v->text + used, TOKEN_MAX_BYTES);
        int offered = k > 0 && k <= TOKEN_MAX_BYTES && !control_text(v->text + used, k);
        for (int32_t e = 0; e < v->n_eos; e++) offered &= v->eos[e] != id;
        v->off[id] = used;
        v->len[id] = (uint8_t)(offered ? k : 0);
        if (offered) used += (uint32_t)k, ids[n++] = id;
    }
    sort_ids(v, ids, tmp, n);
    return build_trie(v, ids, n, used);
}

static cset walk_level[TOKEN_MAX_BYTES + 1];

static void walk(const grammar *g, const vocab_index *v, uint32_t first, int depth, uint32_t limit,
                 token_mask *m) {
    for (int32_t c = (int32_t)first; c >= 0; c = v->trie[c].next) {
        cset *next = &walk_level[depth + 1];
        cset_step(g, &walk_level[depth], v->trie[c].byte, next);
        if (!next->len) continue;
        int32_t tok = v->trie[c].token;
        if (tok >= 0) {
            uint32_t need = cset_need(g, next);
            if (need <= limit) {
                m->bits[tok >> 5] |= 1u << (tok & 31);
                m->allowed++;
                if (need > m->max_need) m->max_need = need;
            }
        }
        if (v->trie[c].has_kid) walk(g, v, (uint32_t)c + 1, depth + 1, limit, m);
    }
}

/* The tokens that may follow `state` and leave a value completable in `limit` bytes (or tokens). */
static void mask_compute(const grammar *g, const vocab_index *v, const cset *state, uint32_t limit,
                         token_mask *m) {
    __builtin_memset(m->bits, 0, (size_t)v->words * 4);
    m->allowed = m->max_need = 0;
    walk_level[0].len = state->len;
    walk_level[0].overflow = 0;
    __builtin_memcpy(walk_level[0].data, state->data, state->len);
    if (v->trie[0].has_kid) walk(g, v, 1, 0, limit, m);
    m->complete = (uint8_t)cset_complete(g, state);
    for (int32_t e = 0; m->complete && e < v->n_eos; e++) m->bits[v->eos[e] >> 5] |= 1u << (v->eos[e] & 31);
}

/* ---- the cache of masks, by state ---- */

typedef struct { uint32_t hash, key_off, key_len; int32_t mask; } cache_slot;

typedef struct {
    cache_slot slots[CACHE_SLOTS];
    token_mask masks[CACHE_MASKS];
    uint32_t n_masks, key_used;
    uint8_t *keys;
    uint32_t *bits;
    uint32_t hits, walks;    /* since the cache was made */
} mask_cache;

static int cache_init(mask_cache *c, const vocab_index *v) {
    c->keys = floe_alloc(CACHE_KEY_BYTES);
    c->bits = floe_alloc((size_t)CACHE_MASKS * (size_t)v->words * 4);
    return c->keys && c->bits;
}

static void cache_clear(mask_cache *c) {
    for (uint32_t i = 0; i < CACHE_SLOTS; i++) c->slots[i].mask = -1;
    c->n_masks = c->key_used = 0;
}

/* The state's bytes with its readings in a canonical order (the same set, the same key). */
static uint32_t state_key(const cset *s, uint8_t *key) {
    uint32_t at[CSET_CAP / (1 + sizeof(frame)) + 1], n = 0;
    for (uint32_t p = 0; p < s->len; p += 1 + s->data[p] * sizeof(frame)) {
        uint32_t i = n++;
        uint32_t size = 1 + s->data[p] * sizeof(frame);
        while (i > 0) {
            uint32_t q = at[i - 1], qsize = 1 + s->data[q] * sizeof(frame);
            if (!text_less((const char *)s->data + p, size, (const char *)s->data + q, qsize)) break;
            at[i] = at[i - 1];
            i--;
        }
        at[i] = p;
    }
    uint32_t len = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t size = 1 + s->data[at[i]] * sizeof(frame);
        __builtin_memcpy(key + len, s->data + at[i], size);
        len += size;
    }
    return len;
}

/* The mask of `state` (computed on a miss and kept). */
static const token_mask *cache_mask(mask_cache *c, const grammar *g, const vocab_index *v, const cset *state) {
    static uint8_t key[CSET_CAP];
    uint32_t len = state_key(state, key), hash = 2166136261u;
    for (uint32_t i = 0; i < len; i++) hash = (hash ^ key[i]) * 16777619u;
    uint32_t slot = hash & (CACHE_SLOTS - 1);
    for (; c->slots[slot].mask >= 0; slot = (slot + 1) & (CACHE_SLOTS - 1)) {
        cache_slot *s = &c->slots[slot];
        if (s->hash == hash && s->key_len == len && !mem_cmp(c->keys + s->key_off, key, len)) {
            c->hits++;
            return &c->masks[s->mask];
        }
    }
    if (c->n_masks == CACHE_MASKS || c->key_used + len > CACHE_KEY_BYTES) { /* full: start again */
        cache_clear(c);
        slot = hash & (CACHE_SLOTS - 1);
    }
    token_mask *m = &c->masks[c->n_masks];
    m->bits = c->bits + (size_t)c->n_masks * (size_t)v->words;
    mask_compute(g, v, state, 0xFFFFFFFF, m);
    c->walks++;
    __builtin_memcpy(c->keys + c->key_used, key, len);
    c->slots[slot] = (cache_slot){hash, c->key_used, len, (int32_t)c->n_masks++};
    c->key_used += len;
    return m;
}

#endif
