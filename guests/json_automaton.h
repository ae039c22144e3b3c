/* A byte-level pushdown automaton over a compiled schema (json_schema.h): which bytes may come next.
 *
 * A configuration is a stack of frames, one per value being written (the innermost on top). Where the
 * schema allows several readings of the same bytes (anyOf, an optional property that may be skipped,
 * a number that may end or go on), the automaton keeps every reading: its state is a *set* of
 * configurations (`cset`), packed into bytes so that it is also the key of a cache of token masks.
 * Counters that cannot change what comes next are not kept (a string's length without min/maxLength,
 * an array's count past minItems without maxItems), so that the states a reply passes through repeat.
 *
 * need(): the fewest bytes that complete the value from a state; the guest allows a token only if the
 * reply can still be completed in the tokens left, so every reply ends as a whole value.
 */
#ifndef JSON_AUTOMATON_H
#define JSON_AUTOMATON_H

#include "json_schema.h"

#define JA_MAX_DEPTH 32
#define CSET_CAP 2048

typedef struct { uint16_t node; uint8_t state; uint8_t aux; uint16_t idx; uint16_t pos; } frame;
/* Configurations back to back: [depth byte][depth frames]…; len bytes in all. */
typedef struct { uint32_t len; uint8_t overflow; uint8_t data[CSET_CAP]; } cset;

enum { ST_START = 0 };
enum { O_OPEN = 1, O_KEY, O_COLON, O_GCOLON, O_AFTER, O_COMMA, O_DONE };
enum { A_OPEN = 1, A_AFTER, A_COMMA, A_DONE };
enum { S_IN = 1, S_ESC, S_HEX, S_UTF8, S_DONE };
enum { N_MINUS = 1, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP };
enum { L_IN = 1 };
#define EXP_MAX_DIGITS 3

static void cset_emit(cset *out, const frame *s, int d) {
    uint32_t size = 1 + (uint32_t)d * sizeof(frame);
    for (uint32_t at = 0; at < out->len; at += 1 + out->data[at] * sizeof(frame))
        if (out->data[at] == d && !mem_cmp(out->data + at + 1, s, size - 1)) return;
    if (out->len + size > CSET_CAP) { out->overflow = 1; return; } /* a reading dropped: never a wrong one */
    out->data[out->len] = (uint8_t)d;
    __builtin_memcpy(out->data + out->len + 1, s, size - 1);
    out->len += size;
}

/* A bounded number's frame: idx the digits of the part being written; aux, in the integer part, its
 * comparisons with the range's lo (bits 0-1) and hi (2-3); in the fraction, its comparisons with lo's and
 * hi's fraction digits (0-1, 2-3) and whether they bind (5, 6); the sign (4: negative); pos the integer
 * part's remainder modulo multipleOf. */
static int bounded_can_end(const schema_node *n, const frame *f) {
    const mag_range *r = &n->sides[f->aux >> 4 & 1];
    if (f->state == N_ZERO || f->state == N_INT) return mag_rest(r, f->idx, f->aux & 3, f->aux >> 2 & 3, 1, f->pos) == 0;
    return f->state == N_FRAC && frac_rest(r, f->idx, f->aux & 3, f->aux >> 2 & 3, f->aux >> 5 & 1, f->aux >> 6 & 1) == 0;
}

static uint32_t bounded_need(const schema_node *n, const frame *f) {
    const mag_range *r = &n->sides[f->aux >> 4 & 1];
    int closed = f->state == N_ZERO || f->idx >= NUM_MAX_DIGITS;
    if (f->state == N_MINUS || f->state == N_ZERO || f->state == N_INT)
        return (uint32_t)mag_need(r, f->idx, f->aux & 3, f->aux >> 2 & 3, closed, n->kind == SN_NUMBER, f->pos);
    return (uint32_t)frac_rest(r, f->state == N_DOT ? 0 : f->idx, f->aux & 3, f->aux >> 2 & 3, f->aux >> 5 & 1, f->aux >> 6 & 1);
}

static void consume_bounded(frame *c, int d, const schema_node *n, int b, cset *out) {
    frame *t = &c[d - 1];
    int digit = b >= '0' && b <= '9', neg = t->aux >> 4 & 1, number = n->kind == SN_NUMBER;
    const mag_range *r = &n->sides[neg];
    uint8_t s = t->state;
    if (s == ST_START && b == '-') {
        if (!n->sides[1].on) return;
        t->state = N_MINUS, t->aux = 1 << 4, t->idx = 0;
    } else if ((s == ST_START || s == N_MINUS || s == N_INT) && digit) {
        int k = s == N_INT ? t->idx : 0, closed = (k == 0 && b == '0') || k + 1 >= NUM_MAX_DIGITS;
        if (!r->on || k >= NUM_MAX_DIGITS) return;
        int cl = cmp_next(t->aux & 3, k, r->lo, r->lo_len, b), ch = cmp_next(t->aux >> 2 & 3, k, r->hi, r->hi_len, b);
        uint32_t rem = ((s == N_INT ? t->pos : 0) * 10u + (uint32_t)(b - '0')) % r->multiple;
        if (mag_need(r, k + 1, cl, ch, closed, number, rem) < 0) return;
        t->state = k == 0 && b == '0' ? N_ZERO : N_INT, t->idx = (uint16_t)(k + 1), t->pos = (uint16_t)rem;
        t->aux = (uint8_t)(cl | ch << 2 | neg << 4);
    } else if ((s == N_ZERO || s == N_INT) && b == '.' && number) {
        int k = t->idx, cl = t->aux & 3, ch = t->aux >> 2 & 3;
        if (!mag_within(r, k, cl, ch)) return;
        int la = k == r->lo_len && cl == CMP_EQ && r->lo_open, ha = k == r->hi_len && ch == CMP_EQ && r->hi_fraction;
        if (frac_rest(r, 0, CMP_EQ, CMP_EQ, la, ha) < 0) return;
        t->state = N_DOT, t->idx = 0, t->aux = (uint8_t)(neg << 4 | la << 5 | ha << 6);
    } else if ((s == N_DOT || s == N_FRAC) && digit) {
        int k = s == N_DOT ? 0 : t->idx, la = t->aux >> 5 & 1, ha = t->aux >> 6 & 1;
        int clf = t->aux & 3, chf = t->aux >> 2 & 3;
        if (k >= NUM_MAX_DIGITS) return;
        if (la) clf = frac_cmp_next(clf, k, r->lo_frac, r->lo_frac_len, b);
        if (ha) chf = frac_cmp_next(chf, k, r->hi_frac, r->hi_frac_len, b);
        if (frac_rest(r, k + 1, clf, chf, la, ha) < 0) return;
        if (la && clf == CMP_GT) la = 0, clf = 0; /* past lo for good: forget it (states repeat) */
        if (ha && chf == CMP_LT) ha = 0, chf = 0;
        t->state = N_FRAC, t->idx = (uint16_t)(k + 1), t->aux = (uint8_t)(clf | chf << 2 | neg << 4 | la << 5 | ha << 6);
    } else return;
    cset_emit(out, c, d);
}

static int frame_can_end(const grammar *g, const frame *f) {
    const schema_node *n = &g->nodes[f->node];
    switch (n->kind) {
    case SN_OBJECT: return f->state == O_DONE;
    case SN_ARRAY: return f->state == A_DONE;
    case SN_STRING: return f->state == S_DONE;
    case SN_NUMBER: case SN_INTEGER:
        if (n->sides) return bounded_can_end(n, f);
        return f->state == N_ZERO || f->state == N_INT || f->state == N_FRAC || f->state == N_EXP;
    case SN_LITERALS: return f->state == L_IN && f->pos == n->lens[f->idx];
    default: return 0;
    }
}

static int first_required(const schema_node *n, uint32_t k) {
    while (k < n->n && !n->required[k]) k++;
    return (int)k;
}

static void ja_consume(const grammar *g, const frame *s, int d, int b, cset *out);

/* Pushes a value of `node` on c[0..d) (c has room) and feeds it byte b, or (b < 0) emits it unfed. */
static void ja_push(const grammar *g, frame *c, int d, uint32_t node, int b, cset *out) {
    if (d >= JA_MAX_DEPTH) { out->overflow = 1; return; }
    const schema_node *n = &g->nodes[node];
    if (n->kind == SN_ANYOF) {
        for (uint32_t i = 0; i < n->n; i++) ja_push(g, c, d, n->kids[i], b, out);
        return;
    }
    c[d] = (frame){(uint16_t)node, ST_START, 0, 0, 0};
    if (b < 0) cset_emit(out, c, d + 1);
    else ja_consume(g, c, d + 1, b, out);
}

static uint16_t count_kept(const schema_node *n, uint32_t count) {
    if (n->max == SN_UNBOUNDED && count > n->min) count = n->min; /* past min: all counts alike */
    return (uint16_t)count;
}

/* An object's count after one more property: kept only while minProperties or maxProperties can
 * tell counts apart. */
static uint8_t property_counted(const schema_node *n, uint8_t count) {
    if (n->max == SN_UNBOUNDED) return (uint8_t)(count + 1u > n->min ? n->min : count + 1u);
    return (uint8_t)(count + 1u);
}

/* Whether property j may come next, `count` written with it: enough left after it for minProperties,
 * room for the required ones after it within maxProperties. */
static int key_fits(const schema_node *n, uint32_t j, uint32_t count) {
    if (count + (n->n - 1 - j) < n->min) return 0;
    if (n->max == SN_UNBOUNDED) return 1;
    for (uint32_t k = j + 1; k < n->n; k++) count += n->required[k];
    return count <= n->max;
}

static void consume_object(const grammar *g, frame *c, int d, const schema_node *n, int b, cset *out) {
    frame *t = &c[d - 1];
    switch (t->state) {
    case ST_START:
        if (b == '{') { t->state = O_OPEN; cset_emit(out, c, d); }
        return;
    case O_OPEN: case O_COMMA: case O_AFTER:
        if (b == '}' && t->state != O_COMMA && t->aux >= n->min && (n->generic || first_required(n, t->idx) == (int)n->n)) {
            t->state = O_DONE;
            cset_emit(out, c, d);
        } else if (b == ',' && t->state == O_AFTER && t->aux < n->max && (n->generic || t->idx < n->n)) {
            t->state = O_COMMA;
            cset_emit(out, c, d);
        } else if (b == '"' && t->state != O_AFTER && t->aux < n->max) {
            t->aux = property_counted(n, t->aux);
            if (n->generic) {
                t->state = O_GCOLON;
                c[d] = (frame){NODE_ANY_STRING, S_IN, 0, 0, 0};
                cset_emit(out, c, d + 1);
                return;
            }
            uint32_t last = (uint32_t)first_required(n, t->idx);
            for (uint32_t j = t->idx; j < n->n && j <= last; j++) {
                if (!key_fits(n, j, t->aux)) continue;
                t->state = O_KEY, t->idx = (uint16_t)j, t->pos = 1;
                cset_emit(out, c, d);
            }
        }
        return;
    case O_KEY:
        if (n->texts[t->idx][t->pos] == b) {
            if (++t->pos == n->lens[t->idx]) t->state = O_COLON, t->pos = 0;
            cset_emit(out, c, d);
        }
        return;
    case O_COLON: case O_GCOLON:
        if (b != ':') return;
        uint32_t kid = n->kids[n->generic ? 0 : t->idx];
        t->idx = n->generic ? 0 : t->idx + 1;
        t->state = O_AFTER;
        ja_push(g, c, d, kid, -1, out);
        return;
    }
}

static void consume_array(const grammar *g, frame *c, int d, const schema_node *n, int b, cset *out) {
    frame *t = &c[d - 1];
    if (t->state == ST_START) {
        if (b == '[') { t->state = A_OPEN; cset_emit(out, c, d); }
    } else if (t->state == A_OPEN || t->state == A_COMMA) {
        if (t->state == A_OPEN && b == ']' && n->min == 0) {
            t->state = A_DONE;
            cset_emit(out, c, d);
            return;
        }
        if (t->state == A_OPEN && n->max == 0) return; /* maxItems 0: no first item (only A_AFTER's ',' checked it) */
        uint32_t count = t->state == A_OPEN ? 1 : (uint32_t)t->idx + 1, prefix = n->n - 1;
        t->state = A_AFTER;
        /* past minItems and the prefix, without maxItems: all counts alike */
        t->idx = (uint16_t)(n->max == SN_UNBOUNDED && count > n->min && count > prefix ? (n->min > prefix ? n->min : prefix) : count);
        if (n->unique) { /* the item's literal frame is told which literals are taken (pos: a bit each) */
            c[d] = (frame){n->kids[0], ST_START, (uint8_t)t->pos, 0, 0};
            ja_consume(g, c, d + 1, b, out);
        } else ja_push(g, c, d, array_item(n, count - 1), b, out);
    } else if (t->state == A_AFTER) {
        if (b == ',' && t->idx < n->max) { t->state = A_COMMA; cset_emit(out, c, d); }
        if (b == ']' && t->idx >= n->min) { t->state = A_DONE; cset_emit(out, c, d); }
    }
}

/* UTF-8: after a lead byte, how many continuation bytes, and the range of the first (aux >> 4):
 * 0 80-BF, 1 A0-BF, 2 80-9F, 3 90-BF, 4 80-8F (no overlong forms, no surrogates, nothing past U+10FFFF). */
static int utf8_lead(int b) {
    if (b >= 0xC2 && b <= 0xDF) return 1;
    if (b == 0xE0) return 2 | 1 << 4;
    if (b == 0xED) return 2 | 2 << 4;
    if (b >= 0xE1 && b <= 0xEF) return 2;
    if (b == 0xF0) return 3 | 3 << 4;
    if (b >= 0xF1 && b <= 0xF3) return 3;
    if (b == 0xF4) return 3 | 4 << 4;
    return 0;
}

static int hex_digit(int b) { return (b >= '0' && b <= '9') || (b >= 'a' && b <= 'f') || (b >= 'A' && b <= 'F'); }

static void consume_string(frame *c, int d, const schema_node *n, int b, cset *out) {
    frame *t = &c[d - 1];
    int tracked = n->min > 0 || n->max != SN_UNBOUNDED;
    switch (t->state) {
    case ST_START:
        if (b == '"') t->state = S_IN, t->idx = 0, t->pos = n->dfa ? n->dfa->start : 0;
        else return;
        break;
    case S_IN:
        if (b == '"') {
            if (t->idx < n->min || (n->dfa && !n->dfa->accept[t->pos])) return;
            t->state = S_DONE, t->idx = 0, t->pos = 0;
            break;
        }
        if (n->dfa) { /* printable ASCII, never escaped: the DFA's bytes (minLength is in the DFA) */
            uint16_t next = b >= RX_FIRST && b < RX_FIRST + RX_SPAN ? n->dfa->next[t->pos * RX_SPAN + (uint32_t)(b - RX_FIRST)] : RX_NONE;
            if (next == RX_NONE) return;
            if (n->max != SN_UNBOUNDED) { /* maxLength: the shortest match from there must still fit */
                if ((uint32_t)t->idx + 1 + n->dfa->dist[next] > n->max) return;
                t->idx++;
            }
            t->pos = next;
            break;
        }
        if (b < 0x20 || b == 0x7F) return; /* control characters: JSON forbids them raw */
        int lead = b >= 0x80 ? utf8_lead(b) : 0;
        if (b >= 0x80 && !lead) return;
        if (tracked && t->idx >= n->max) return;
        if (tracked) t->idx = count_kept(n, (uint32_t)t->idx + 1);
        if (b == '\\') t->state = S_ESC;
        else if (lead) t->state = S_UTF8, t->aux = (uint8_t)lead;
        break;
    case S_ESC:
        if (b == 'u') { t->state = S_HEX, t->pos = 0, t->aux = 0; break; }
        for (const char *e = "\"\\/bfnrt"; *e; e++)
            if (*e == b) { t->state = S_IN; cset_emit(out, c, d); }
        return;
    case S_HEX:
        if (!hex_digit(b) || (t->aux && !(b >= '0' && b <= '7'))) return; /* \uD800-\uDFFF: no surrogates */
        t->aux = t->pos == 0 && (b == 'd' || b == 'D');
        if (++t->pos == 4) t->state = S_IN, t->pos = 0;
        break;
    case S_UTF8: {
        static const uint8_t lo[] = {0x80, 0xA0, 0x80, 0x90, 0x80}, hi[] = {0xBF, 0xBF, 0x9F, 0xBF, 0x8F};
        int range = t->aux >> 4, left = t->aux & 15;
        if (b < lo[range] || b > hi[range]) return;
        t->aux = (uint8_t)(left - 1);
        if (left == 1) t->state = S_IN;
        break;
    }
    default: return;
    }
    cset_emit(out, c, d);
}

static void consume_number(frame *c, int d, int integer, int b, cset *out) {
    frame *t = &c[d - 1];
    int digit = b >= '0' && b <= '9';
    uint8_t s = t->state, next = 0;
    uint16_t idx = t->idx;
    if (s == ST_START && b == '-') next = N_MINUS;
    else if ((s == ST_START || s == N_MINUS) && digit) next = b == '0' ? N_ZERO : N_INT, idx = 1;
    else if (s == N_INT && digit && idx < NUM_MAX_DIGITS) next = N_INT, idx++;
    else if ((s == N_ZERO || s == N_INT) && b == '.' && !integer) next = N_DOT;
    else if ((s == N_ZERO || s == N_INT || s == N_FRAC) && (b == 'e' || b == 'E') && !integer) next = N_E;
    else if (s == N_DOT && digit) next = N_FRAC, idx = 1;
    else if (s == N_FRAC && digit && idx < NUM_MAX_DIGITS) next = N_FRAC, idx++;
    else if (s == N_E && (b == '+' || b == '-')) next = N_ESIGN;
    else if ((s == N_E || s == N_ESIGN) && digit) next = N_EXP, idx = 1;
    else if (s == N_EXP && digit && idx < EXP_MAX_DIGITS) next = N_EXP, idx++;
    if (!next) return;
    t->state = next, t->idx = idx;
    cset_emit(out, c, d);
}

static void consume_literal(frame *c, int d, const schema_node *n, int b, cset *out) {
    frame *t = &c[d - 1];
    uint32_t i = t->state == ST_START ? 0 : t->idx, p = t->state == ST_START ? 0 : t->pos;
    /* Literals are sorted: those sharing the bytes so far follow idx; the first to go on with b, not
     * one taken (aux: a bit each, in a uniqueItems array). */
    for (uint32_t j = i; j < n->n; j++) {
        if (n->lens[j] < p || mem_cmp(n->texts[j], n->texts[i], p)) break;
        if (j < 8 && (t->aux >> j & 1)) continue;
        if (n->lens[j] > p && (unsigned char)n->texts[j][p] == b) {
            t->state = L_IN, t->idx = (uint16_t)j, t->pos = (uint16_t)(p + 1);
            cset_emit(out, c, d);
            return;
        }
    }
}

/* Feeds byte b to the top frame of s[0..d) (s unchanged; results emitted). */
static void ja_consume(const grammar *g, const frame *s, int d, int b, cset *out) {
    frame c[JA_MAX_DEPTH];
    __builtin_memcpy(c, s, (size_t)d * sizeof *c);
    const schema_node *n = &g->nodes[c[d - 1].node];
    switch (n->kind) {
    case SN_OBJECT: consume_object(g, c, d, n, b, out); break;
    case SN_ARRAY: consume_array(g, c, d, n, b, out); break;
    case SN_STRING: consume_string(c, d, n, b, out); break;
    case SN_NUMBER: case SN_INTEGER:
        if (n->sides) consume_bounded(c, d, n, b, out);
        else consume_number(c, d, n->kind == SN_INTEGER, b, out);
        break;
    case SN_LITERALS: consume_literal(c, d, n, b, out); break;
    }
}

/* Byte b after configuration s[0..d): the top frame takes it, or ends and lets its parent take it. */
static void ja_step(const grammar *g, const frame *s, int d, int b, cset *out) {
    frame c[JA_MAX_DEPTH];
    while (d > 0) {
        ja_consume(g, s, d, b, out);
        if (!frame_can_end(g, &s[d - 1])) return;
        if (d > 1 && g->nodes[s[d - 2].node].unique) { /* an item ends: its literal is taken */
            if (s != c) __builtin_memcpy(c, s, (size_t)d * sizeof *c), s = c;
            c[d - 2].pos |= (uint16_t)(1u << c[d - 1].idx);
        }
        d--;
    }
}

static void cset_step(const grammar *g, const cset *in, int b, cset *out) {
    out->len = 0;
    out->overflow = in->overflow;
    frame s[JA_MAX_DEPTH];
    for (uint32_t at = 0; at < in->len; at += 1 + in->data[at] * sizeof(frame)) {
        int d = in->data[at];
        __builtin_memcpy(s, in->data + at + 1, (size_t)d * sizeof *s);
        ja_step(g, s, d, b, out);
    }
}

/* The start state: a value of the grammar's root. */
static void cset_start(const grammar *g, cset *out) {
    frame c[JA_MAX_DEPTH];
    out->len = 0;
    out->overflow = 0;
    ja_push(g, c, 0, g->root, -1, out);
}

/* Bytes to end an object after property k-1 (state O_AFTER at k) with `count` written. */
static uint32_t object_rest(const grammar *g, const schema_node *n, uint32_t k, uint32_t count) {
    return object_rest_counted(g->nodes, n, k, count, 0);
}

/* A map (any keys, each value of kids[0]): the fewest bytes of `keys` more ,"":value and then '}'. */
static uint32_t map_rest(const grammar *g, const schema_node *n, uint32_t count) {
    uint32_t keys = n->min > count ? n->min - count : 0;
    return add_sat(1, keys * (4 + g->nodes[n->kids[0]].min_bytes));
}

static uint32_t frame_need(const grammar *g, const frame *f) {
    const schema_node *n = &g->nodes[f->node];
    if (f->state == ST_START) return n->min_bytes;
    switch (n->kind) {
    case SN_OBJECT: {
        uint32_t count = f->aux; /* properties written, the one being written too (minProperties) */
        if (f->state == O_DONE) return 0;
        if (n->generic) { /* any keys; each value of kids[0] */
            uint32_t value = g->nodes[n->kids[0]].min_bytes;
            if (f->state == O_GCOLON) return add_sat(value + 1, map_rest(g, n, count));
            if (f->state == O_COMMA) return add_sat(value + 3, map_rest(g, n, count + 1));
            if (f->state == O_OPEN && n->min > 0) return map_rest(g, n, 0) - 1; /* no comma before the first */
            return map_rest(g, n, count);
        }
        uint32_t j = f->idx;
        if (f->state == O_AFTER) return object_rest(g, n, j, count);
        if (f->state == O_OPEN) { /* the first property needs no comma */
            int writes;
            uint32_t m = object_rest_counted(g->nodes, n, 0, 0, &writes);
            return writes && m < SN_INF ? m - 1 : m;
        }
        uint32_t value = add_sat(g->nodes[n->kids[j]].min_bytes, object_rest(g, n, j + 1, count));
        if (f->state == O_KEY) return add_sat(n->lens[j] - f->pos + 1, value);
        if (f->state == O_COLON) return add_sat(1, value);
        uint32_t best = 0xFFFFFFFF, last = (uint32_t)first_required(n, j); /* O_COMMA: some key next */
        for (uint32_t k = j; k < n->n && k <= last; k++) {
            if (!key_fits(n, k, property_counted(n, (uint8_t)count))) continue;
            uint32_t m = add_sat(property_bytes(g->nodes, n, k) - 1, object_rest(g, n, k + 1, count + 1));
            if (m < best) best = m;
        }
        return best;
    }
    case SN_ARRAY: {
        if (f->state == A_DONE) return 0;
        if (n->unique) { /* the shortest literals not taken */
            uint32_t left = n->min > f->idx ? n->min - f->idx : 0;
            if (f->state == A_OPEN) return n->min ? unique_items_bytes(g->nodes, n, 0, n->min) : 1;
            if (f->state == A_COMMA) return unique_items_bytes(g->nodes, n, f->pos, left ? left : 1);
            return unique_items_bytes(g->nodes, n, f->pos, left) + 1;
        }
        if (f->state == A_OPEN) return n->min ? array_items_bytes(g->nodes, n, 0, n->min) : 1;
        if (f->state == A_COMMA) /* an item now, then the rest */
            return g->nodes[array_item(n, f->idx)].min_bytes + array_items_bytes(g->nodes, n, f->idx + 1u, n->min) + 1;
        return array_items_bytes(g->nodes, n, f->idx, n->min) + 1;
    }
    case SN_STRING: {
        uint32_t rest = (n->min > f->idx ? n->min - f->idx : 0) + 1;
        if (f->state == S_DONE) return 0;
        if (f->state == S_ESC) return 1 + rest;
        if (f->state == S_HEX) return (uint32_t)(4 - f->pos) + rest;
        if (f->state == S_UTF8) return (uint32_t)(f->aux & 15) + rest;
        return n->dfa ? n->dfa->dist[f->pos] + 1u : rest;
    }
    case SN_NUMBER: case SN_INTEGER:
        if (n->sides) return bounded_need(n, f);
        return f->state == N_MINUS || f->state == N_DOT || f->state == N_E || f->state == N_ESIGN;
    case SN_LITERALS: {
        uint32_t best = 0xFFFFFFFF;
        for (uint32_t j = f->idx; j < n->n; j++) {
            if (n->lens[j] < f->pos || mem_cmp(n->texts[j], n->texts[f->idx], f->pos)) break;
            if (!(j < 8 && (f->aux >> j & 1)) && n->lens[j] - f->pos < best) best = n->lens[j] - f->pos;
        }
        return best;
    }
    }
    return 0;
}

/* The fewest bytes that complete the value from any reading in `c` (0: it is complete). */
/* A uniqueItems array writing an item (its literal frame `item` on top of it): the fewest bytes of the
 * two, for each literal the item may still become (which is then taken for the items after it). */
static uint32_t unique_pair_need(const grammar *g, const frame *array, const frame *item) {
    const schema_node *n = &g->nodes[array->node], *lit = &g->nodes[item->node];
    uint32_t left = n->min > array->idx ? n->min - array->idx : 0, best = 0xFFFFFFFF;
    for (uint32_t j = item->idx; j < lit->n; j++) {
        if (lit->lens[j] < item->pos || mem_cmp(lit->texts[j], lit->texts[item->idx], item->pos)) break;
        if (item->aux >> j & 1) continue;
        uint32_t m = lit->lens[j] - item->pos + unique_items_bytes(g->nodes, n, array->pos | 1u << j, left) + 1;
        if (m < best) best = m;
    }
    return best;
}

static uint32_t cset_need(const grammar *g, const cset *c) {
    uint32_t best = 0xFFFFFFFF;
    for (uint32_t at = 0; at < c->len; at += 1 + c->data[at] * sizeof(frame)) {
        uint32_t need = 0;
        frame f[JA_MAX_DEPTH];
        int d = c->data[at];
        __builtin_memcpy(f, c->data + at + 1, (size_t)d * sizeof *f);
        for (int i = 0; i < d; i++) {
            if (i + 1 < d && g->nodes[f[i].node].unique && f[i].state == A_AFTER) { /* the item taken with it */
                need += unique_pair_need(g, &f[i], &f[i + 1]);
                i++;
            } else need += frame_need(g, &f[i]);
        }
        if (need < best) best = need;
    }
    return best;
}

/* Whether some reading has written a whole value (every open frame may end here). */
static int cset_complete(const grammar *g, const cset *c) {
    for (uint32_t at = 0; at < c->len; at += 1 + c->data[at] * sizeof(frame)) {
        int d = c->data[at], ok = 1;
        frame f;
        for (int i = 0; i < d && ok; i++) {
            __builtin_memcpy(&f, c->data + at + 1 + i * sizeof f, sizeof f);
            ok = frame_can_end(g, &f);
        }
        if (ok) return 1;
    }
    return 0;
}

#endif
