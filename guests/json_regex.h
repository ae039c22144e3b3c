/* A regular expression (JSON Schema's `pattern`, and the fixed shapes of `format`s) compiled to a DFA
 * over a string's content bytes: parsed into a Thompson NFA, then made deterministic by the subset
 * construction, with every state's distance to acceptance (what need() counts).
 *
 * The strings it writes hold printable ASCII only, never a byte JSON must escape ('"', '\\', control
 * characters): a pattern is a set of strings, and writing only some of them is never wrong; a pattern
 * that needs an escaped or non-ASCII character to match at all is refused. Unanchored ends match
 * anything (a pattern is a search: "ab" is ".*ab.*"); `^` and `$` are taken at the pattern's ends only.
 * The subset: literals, `.`, classes with ranges and negation, \d \w \s (and \D \W \S), \xHH, groups
 * (capturing, (?:...), named), alternation, ? * + {m} {m,} {m,n} (lazy too). Refused by name:
 * backreferences, lookaround, word boundaries, inline flags, possessive quantifiers.
 */
#ifndef JSON_REGEX_H
#define JSON_REGEX_H

#include "json_value.h"

#define RX_FIRST 0x20     /* the bytes written: 0x20..0x7E, less '"' and '\\' */
#define RX_SPAN 95
#define RX_NONE 0xFFFF
#define RX_MAX_NFA 4096
#define RX_MAX_DFA 1024
#define RX_MAX_STATES 16384 /* in all of a grammar's patterns and formats */
#define RX_MAX_REPEAT 1000

enum { RX_CHAR, RX_EPS, RX_SPLIT, RX_MATCH };

typedef struct { uint32_t bits[4]; } rx_set; /* ASCII 0..127 */

typedef struct {
    uint8_t kind;
    uint16_t out, out2;
    rx_set set;
} rx_node;

typedef struct {
    uint32_t n_states;
    uint16_t start;
    uint16_t *next;    /* [state * RX_SPAN + byte - RX_FIRST]: the next state, RX_NONE: refused */
    uint8_t *accept;
    uint16_t *dist;    /* the fewest bytes from the state to an accepting one */
} rx_dfa;

typedef struct {
    rx_node *nodes;
    uint32_t n;
    const char *p, *end;
    const char *error; /* what was refused, first one */
    int depth;
} rx_parser;

typedef struct { uint16_t start, end; } rx_frag; /* end: an RX_EPS node whose out is unset */

static void rx_fail(rx_parser *rx, const char *why) { if (!rx->error) rx->error = why; }

static int rx_node_new(rx_parser *rx, uint8_t kind) {
    if (rx->n >= RX_MAX_NFA) { rx_fail(rx, "a pattern that repeats too much (over 4096 automaton nodes)"); return 0; }
    rx_node *x = &rx->nodes[rx->n];
    __builtin_memset(x, 0, sizeof *x);
    x->kind = kind;
    return (int)rx->n++;
}

static rx_frag rx_atom(rx_parser *rx, const rx_set *set) {
    int c = rx_node_new(rx, RX_CHAR), e = rx_node_new(rx, RX_EPS);
    rx->nodes[c].set = *set;
    rx->nodes[c].out = (uint16_t)e;
    return (rx_frag){(uint16_t)c, (uint16_t)e};
}

static rx_frag rx_empty(rx_parser *rx) {
    int e = rx_node_new(rx, RX_EPS);
    return (rx_frag){(uint16_t)e, (uint16_t)e};
}

static rx_frag rx_concat(rx_parser *rx, rx_frag a, rx_frag b) {
    rx->nodes[a.end].out = b.start;
    return (rx_frag){a.start, b.end};
}

static rx_frag rx_alt(rx_parser *rx, rx_frag a, rx_frag b) {
    int s = rx_node_new(rx, RX_SPLIT), e = rx_node_new(rx, RX_EPS);
    rx->nodes[s].out = a.start, rx->nodes[s].out2 = b.start;
    rx->nodes[a.end].out = (uint16_t)e, rx->nodes[b.end].out = (uint16_t)e;
    return (rx_frag){(uint16_t)s, (uint16_t)e};
}

/* a* (loop 1) or a? (loop 0) */
static rx_frag rx_loop(rx_parser *rx, rx_frag a, int loop) {
    int s = rx_node_new(rx, RX_SPLIT), e = rx_node_new(rx, RX_EPS);
    rx->nodes[s].out = a.start, rx->nodes[s].out2 = (uint16_t)e;
    rx->nodes[a.end].out = loop ? (uint16_t)s : (uint16_t)e;
    return (rx_frag){(uint16_t)s, (uint16_t)e};
}

static void set_add(rx_set *s, int c) { if (c >= 0 && c < 128) s->bits[c >> 5] |= 1u << (c & 31); }
static int set_has(const rx_set *s, int c) { return c >= 0 && c < 128 && (s->bits[c >> 5] >> (c & 31) & 1); }
static void set_range(rx_set *s, int a, int b) { for (int c = a; c <= b; c++) set_add(s, c); }
static void set_invert(rx_set *s) { for (int i = 0; i < 4; i++) s->bits[i] = ~s->bits[i]; }
static void set_union(rx_set *s, const rx_set *t) { for (int i = 0; i < 4; i++) s->bits[i] |= t->bits[i]; }

/* \d \w \s and their complements into s; 0 if c names none of them. */
static int rx_class_escape(int c, rx_set *s) {
    rx_set t = {{0, 0, 0, 0}};
    int lower = c | 0x20;
    if (lower == 'd') set_range(&t, '0', '9');
    else if (lower == 'w') set_range(&t, '0', '9'), set_range(&t, 'a', 'z'), set_range(&t, 'A', 'Z'), set_add(&t, '_');
    else if (lower == 's') set_add(&t, ' '), set_range(&t, '\t', '\r');
    else return 0;
    if (c != lower) set_invert(&t);
    set_union(s, &t);
    return 1;
}

static int rx_hex(int c) {
    return c >= '0' && c <= '9' ? c - '0' : (c | 0x20) >= 'a' && (c | 0x20) <= 'f' ? (c | 0x20) - 'a' + 10 : -1;
}

/* One escaped character after '\\' (p at the character): its code, or -1 (class escapes: -2, s filled). */
static int rx_escape(rx_parser *rx, rx_set *s) {
    if (rx->p >= rx->end) { rx_fail(rx, "a pattern ending in '\\'"); return -1; }
    int c = (unsigned char)*rx->p++;
    if (rx_class_escape(c, s)) return -2;
    if (c >= '1' && c <= '9') { rx_fail(rx, "a backreference (\\1...) in 'pattern'"); return -1; }
    if (c == 'b' || c == 'B') { rx_fail(rx, "a word boundary (\\b, \\B) in 'pattern'"); return -1; }
    if (c == 'A' || c == 'Z' || c == 'z' || c == 'G') { rx_fail(rx, "an anchor escape (\\A, \\Z) in 'pattern': use ^ and $"); return -1; }
    static const char controls[] = "n\nt\tr\rf\fv\va\a";
    for (const char *k = controls; k[0]; k += 2) if (c == k[0]) return (unsigned char)k[1];
    if (c == '0') return 0; /* NUL: never written, like the other control characters */
    if (c == 'x' || c == 'u') {
        int digits = c == 'x' ? 2 : 4, v = 0;
        for (int i = 0; i < digits; i++) {
            int h = rx->p < rx->end ? rx_hex((unsigned char)*rx->p) : -1;
            if (h < 0) { rx_fail(rx, "a bad \\x or \\u escape in 'pattern'"); return -1; }
            v = v * 16 + h, rx->p++;
        }
        if (v >= 128) { rx_fail(rx, "a non-ASCII character in 'pattern' (this guest writes ASCII there)"); return -1; }
        return v;
    }
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) { rx_fail(rx, "an escape this guest does not know in 'pattern'"); return -1; }
    if (c >= 128) { rx_fail(rx, "a non-ASCII character in 'pattern' (this guest writes ASCII there)"); return -1; }
    return c; /* an escaped punctuation character: itself */
}

static int rx_class_char(rx_parser *rx, rx_set *s) {
    int c = (unsigned char)*rx->p++;
    if (c == '\\') return rx_escape(rx, s);
    if (c >= 128) { rx_fail(rx, "a non-ASCII character in 'pattern' (this guest writes ASCII there)"); return -1; }
    return c;
}

/* [...] after its '['. */
static void rx_class(rx_parser *rx, rx_set *s) {
    int negate = rx->p < rx->end && *rx->p == '^';
    rx->p += negate;
    for (int first = 1; !rx->error; first = 0) {
        if (rx->p >= rx->end) { rx_fail(rx, "a '[' without its ']' in 'pattern'"); return; }
        if (*rx->p == ']' && !first) { rx->p++; break; }
        if (*rx->p == '[' && rx->p + 1 < rx->end && rx->p[1] == ':') { rx_fail(rx, "a POSIX class ([:alpha:]) in 'pattern'"); return; }
        int a = rx_class_char(rx, s);
        if (a == -1) return;
        if (a == -2 && rx->p + 1 < rx->end && *rx->p == '-' && rx->p[1] != ']') {
            rx_fail(rx, "a range from a class escape ([\\d-z]) in 'pattern'");
            return;
        }
        if (a >= 0 && rx->p + 1 < rx->end && *rx->p == '-' && rx->p[1] != ']') {
            rx->p++;
            int b = rx_class_char(rx, s);
            if (b == -1) return;
            if (b < a) { rx_fail(rx, b == -2 ? "a range to a class escape in 'pattern'" : "a reversed range in 'pattern'"); return; }
            set_range(s, a, b);
        } else if (a >= 0) set_add(s, a);
    }
    if (negate) set_invert(s);
}

static rx_frag rx_alternatives(rx_parser *rx, int top);
static int rx_braces(rx_parser *rx, int *lo, int *hi);

static rx_frag rx_group(rx_parser *rx) {
    if (rx->p < rx->end && *rx->p == '?') {
        const char *q = rx->p + 1;
        if (q < rx->end && *q == ':') rx->p = q + 1;
        else if (q < rx->end && (*q == '=' || *q == '!' || (*q == '<' && q + 1 < rx->end && (q[1] == '=' || q[1] == '!'))))
            rx_fail(rx, "a lookaround ((?=, (?!, (?<=, (?<!) in 'pattern'");
        else if (q + 1 < rx->end && q[0] == 'P' && q[1] == '=') rx_fail(rx, "a backreference ((?P=name)) in 'pattern'");
        else if (q < rx->end && (*q == '<' || (*q == 'P' && q + 1 < rx->end && q[1] == '<'))) { /* a named group */
            while (rx->p < rx->end && *rx->p != '>') rx->p++;
            rx->p++;
        } else rx_fail(rx, "an inline flag or extension ((?i), (?#...)) in 'pattern'");
    }
    if (rx->error) return rx_empty(rx);
    if (++rx->depth > 64) { rx_fail(rx, "groups nested deeper than 64 in 'pattern'"); return rx_empty(rx); }
    rx_frag f = rx_alternatives(rx, 0);
    rx->depth--;
    if (rx->p >= rx->end || *rx->p != ')') rx_fail(rx, "a '(' without its ')' in 'pattern'");
    else rx->p++;
    return f;
}

/* One atom at rx->p (a character, class, '.' or group); *none: there is no atom here. */
static rx_frag rx_single(rx_parser *rx, int *none) {
    rx_set s = {{0, 0, 0, 0}};
    int c = (unsigned char)*rx->p;
    *none = 0;
    int lo, hi;
    if (c == '(') { rx->p++; return rx_group(rx); }
    if (c == '{' && rx_braces(rx, &lo, &hi)) rx_fail(rx, "a quantifier with nothing to repeat in 'pattern'");
    else rx->p++;
    if (c == '[') rx_class(rx, &s);
    else if (c == '.') set_range(&s, 0, 127), s.bits[0] &= ~(1u << '\n');
    else if (c == '\\') {
        int e = rx_escape(rx, &s);
        if (e >= 0) set_add(&s, e);
    } else if (c == '*' || c == '+' || c == '?') rx_fail(rx, "a quantifier with nothing to repeat in 'pattern'");
    else if (c >= 128) rx_fail(rx, "a non-ASCII character in 'pattern' (this guest writes ASCII there)");
    else set_add(&s, c);
    return rx_atom(rx, &s);
}

/* {m}, {m,}, {m,n}, {,n} at rx->p: 1 with *lo, *hi (-1: unbounded); 0 if it is no quantifier (a '{' is then literal). */
static int rx_braces(rx_parser *rx, int *lo, int *hi) {
    const char *q = rx->p + 1;
    int a = 0, b = -1, digits = 0;
    for (; q < rx->end && *q >= '0' && *q <= '9'; q++, digits++) a = a < 100000 ? a * 10 + (*q - '0') : a;
    if (q < rx->end && *q == '}') { if (!digits) return 0; b = a; }
    else if (q < rx->end && *q == ',') {
        int bd = 0;
        for (q++, b = 0; q < rx->end && *q >= '0' && *q <= '9'; q++, bd++) b = b < 100000 ? b * 10 + (*q - '0') : b;
        if (!bd) b = -1;
        if (q >= rx->end || *q != '}' || (!digits && !bd)) return 0;
    } else return 0;
    rx->p = q + 1;
    *lo = a, *hi = b;
    return 1;
}

/* An atom and its quantifier; copies for {m,n} are parsed again from the atom's text. */
static rx_frag rx_repeat(rx_parser *rx, int *none) {
    const char *at = rx->p;
    rx_frag f = rx_single(rx, none);
    if (rx->error || rx->p >= rx->end) return f;
    int c = *rx->p, lo, hi;
    if (c == '*') rx->p++, lo = 0, hi = -1;
    else if (c == '+') rx->p++, lo = 1, hi = -1;
    else if (c == '?') rx->p++, lo = 0, hi = 1;
    else if (!(c == '{' && rx_braces(rx, &lo, &hi))) return f;
    if (rx->p < rx->end && *rx->p == '+') { rx_fail(rx, "a possessive quantifier (*+, ++) in 'pattern'"); return f; }
    if (rx->p < rx->end && *rx->p == '?') rx->p++; /* lazy: the same strings */
    if (lo > RX_MAX_REPEAT || hi > RX_MAX_REPEAT || (hi >= 0 && hi < lo)) {
        rx_fail(rx, "a repetition {m,n} past 1000 or with n < m in 'pattern'");
        return f;
    }
    const char *resume = rx->p;
    rx_frag out = rx_empty(rx);
    for (int i = 0; i < (hi < 0 ? lo + 1 : hi) && !rx->error; i++) {
        rx_frag copy = f;
        if (i) { rx->p = at; copy = rx_single(rx, none); }
        if (i >= lo) copy = rx_loop(rx, copy, hi < 0);
        out = rx_concat(rx, out, copy);
    }
    rx->p = resume;
    if (rx->p < rx->end && (*rx->p == '*' || *rx->p == '+' || *rx->p == '?' || (*rx->p == '{' && rx_braces(rx, &lo, &hi))))
        rx_fail(rx, "a quantifier on a quantifier (a**, a{2}{3}) in 'pattern': group it");
    return out;
}

/* concat ('|' concat)*; at the top, '^' may open and '$' close each alternative. */
static rx_frag rx_alternatives(rx_parser *rx, int top) {
    rx_frag result = {0, 0};
    rx_set any = {{0, 0, 0, 0}};
    set_range(&any, 0, 127);
    for (int first = 1;; first = 0) {
        int anchored_start = top && rx->p < rx->end && *rx->p == '^', anchored_end = 0;
        rx->p += anchored_start;
        rx_frag f = anchored_start ? rx_empty(rx) : top ? rx_loop(rx, rx_atom(rx, &any), 1) : rx_empty(rx);
        while (!rx->error && rx->p < rx->end && *rx->p != '|' && *rx->p != ')') {
            if (*rx->p == '$' && top && (rx->p + 1 == rx->end || rx->p[1] == '|')) { rx->p++; anchored_end = 1; break; }
            if (*rx->p == '^' || *rx->p == '$') { rx_fail(rx, "'^' or '$' inside 'pattern' (this guest takes them at its ends only)"); break; }
            int none;
            f = rx_concat(rx, f, rx_repeat(rx, &none));
        }
        if (top && !anchored_end) f = rx_concat(rx, f, rx_loop(rx, rx_atom(rx, &any), 1));
        result = first ? f : rx_alt(rx, result, f);
        if (rx->error || rx->p >= rx->end || *rx->p != '|') break;
        rx->p++;
    }
    if (top && !rx->error && rx->p < rx->end) rx_fail(rx, "a ')' without its '(' in 'pattern'");
    return result;
}

/* The NFA states reachable from `from` without reading (into set, a bitset; stack: scratch). */
static void rx_closure(const rx_parser *rx, uint32_t *set, uint16_t from, uint16_t *stack) {
    uint32_t top = 0;
    if (set[from >> 5] >> (from & 31) & 1) return;
    set[from >> 5] |= 1u << (from & 31);
    stack[top++] = from;
    while (top) {
        const rx_node *x = &rx->nodes[stack[--top]];
        uint16_t next[2] = {x->out, x->out2};
        int n = x->kind == RX_EPS ? 1 : x->kind == RX_SPLIT ? 2 : 0;
        for (int i = 0; i < n; i++)
            if (!(set[next[i] >> 5] >> (next[i] & 31) & 1)) {
                set[next[i] >> 5] |= 1u << (next[i] & 31);
                stack[top++] = next[i];
            }
    }
}

static uint32_t rx_hash(const uint32_t *set, uint32_t words) {
    uint32_t h = 2166136261u;
    for (uint32_t i = 0; i < words; i++) h = (h ^ set[i]) * 16777619u;
    return h;
}

static int rx_writable(int b) { return b >= RX_FIRST && b <= 0x7E && b != '"' && b != '\\'; }

/* Scratch kept from one pattern to the next (a guest's memory only grows). */
static struct { uint32_t *sets, *scratch; uint16_t *stack, *slots; rx_node *nodes; } rx_work;

/* Renumbers classes 0..k-1 in the order of their first byte (rep: that byte); k. */
static uint32_t rx_dense(uint8_t *cls, uint8_t *rep) {
    uint8_t dense[256];
    __builtin_memset(dense, 0xFF, sizeof dense);
    uint32_t k = 0;
    for (int b = 0; b < RX_SPAN; b++) {
        if (cls[b] == 0xFF) continue;
        if (dense[cls[b]] == 0xFF) rep[k] = (uint8_t)(b + RX_FIRST), dense[cls[b]] = (uint8_t)k++;
        cls[b] = dense[cls[b]];
    }
    return k;
}

/* Classes of the written bytes that every character set of the NFA treats alike; their count. */
static uint32_t rx_byte_classes(const rx_parser *rx, uint8_t *cls, uint8_t *rep) {
    for (int b = 0; b < RX_SPAN; b++) cls[b] = rx_writable(b + RX_FIRST) ? 0 : 0xFF;
    uint32_t n = rx_dense(cls, rep);
    for (uint32_t i = 0; i < rx->n; i++) {
        if (rx->nodes[i].kind != RX_CHAR) continue;
        uint8_t split[RX_SPAN]; /* a class's new number for the members of this set */
        __builtin_memset(split, 0xFF, sizeof split);
        uint32_t more = n;
        for (int b = 0; b < RX_SPAN; b++) {
            if (cls[b] == 0xFF || !set_has(&rx->nodes[i].set, b + RX_FIRST)) continue;
            if (split[cls[b]] == 0xFF) split[cls[b]] = (uint8_t)more++;
            cls[b] = split[cls[b]];
        }
        n = rx_dense(cls, rep);
    }
    return n;
}

/* The subset construction over the bytes written (a class of alike bytes at a time), then each state's
 * distance to acceptance; states from which nothing is accepted are cut off. NULL with *why set when
 * refused; *budget: DFA states the grammar may still make. */
static rx_dfa *rx_determinize(rx_parser *rx, rx_frag f, uint32_t *budget, const char **why) {
    int match = rx_node_new(rx, RX_MATCH);
    if (rx->error) { *why = rx->error; return 0; }
    rx->nodes[f.end].out = (uint16_t)match;
    uint32_t words = (rx->n + 31) / 32, cap = *budget < RX_MAX_DFA ? *budget : RX_MAX_DFA, table = 4096;
    if (!rx_work.sets) {
        rx_work.sets = floe_alloc((size_t)RX_MAX_DFA * (RX_MAX_NFA / 32) * 4);
        rx_work.scratch = floe_alloc(RX_MAX_NFA / 8), rx_work.stack = floe_alloc(RX_MAX_NFA * 2);
        rx_work.slots = floe_alloc(table * 2);
    }
    uint32_t *sets = rx_work.sets, *scratch = rx_work.scratch;
    uint16_t *stack = rx_work.stack, *slots = rx_work.slots;
    uint8_t cls[RX_SPAN], rep[RX_SPAN];
    uint32_t n_cls = rx_byte_classes(rx, cls, rep);
    uint16_t *moves = floe_alloc((size_t)cap * RX_SPAN * 2); /* by class while built; by byte at the end */
    rx_dfa *d = floe_alloc(sizeof *d);
    if (!sets || !scratch || !stack || !slots || !moves || !d) { *why = "out of memory for 'pattern'"; return 0; }
    __builtin_memset(slots, 0xFF, table * 2);
    __builtin_memset(sets, 0, words * 4);
    rx_closure(rx, sets, f.start, stack);
    slots[rx_hash(sets, words) & (table - 1)] = 0;
    uint32_t n = 1;
    for (uint32_t s = 0; s < n; s++) {
        for (uint32_t k = 0; k < n_cls; k++) {
            uint16_t *to = &moves[s * RX_SPAN + k];
            *to = RX_NONE;
            __builtin_memset(scratch, 0, words * 4);
            int any = 0;
            for (uint32_t w = 0; w < words; w++)
                for (uint32_t bits = sets[s * words + w]; bits; bits &= bits - 1) {
                    const rx_node *x = &rx->nodes[w * 32 + (uint32_t)__builtin_ctz(bits)];
                    if (x->kind == RX_CHAR && set_has(&x->set, rep[k])) rx_closure(rx, scratch, x->out, stack), any = 1;
                }
            if (!any) continue;
            uint32_t h = rx_hash(scratch, words) & (table - 1);
            while (slots[h] != RX_NONE && mem_cmp(&sets[slots[h] * words], scratch, words * 4)) h = (h + 1) & (table - 1);
            if (slots[h] == RX_NONE) {
                if (n == cap) {
                    *why = cap < RX_MAX_DFA ? "the schema's patterns and formats need more than 16384 automaton states in all"
                                            : "a 'pattern' whose automaton needs more than 1024 states";
                    return 0;
                }
                __builtin_memcpy(&sets[n * words], scratch, words * 4);
                slots[h] = (uint16_t)n++;
            }
            *to = slots[h];
        }
    }
    *budget -= n;
    d->n_states = n, d->start = 0, d->next = moves;
    d->accept = floe_alloc(n), d->dist = floe_alloc(n * 2);
    if (!d->accept || !d->dist) { *why = "out of memory for 'pattern'"; return 0; }
    for (uint32_t s = 0; s < n; s++) {
        d->accept[s] = (uint8_t)(sets[s * words + ((uint32_t)match >> 5)] >> (match & 31) & 1);
        d->dist[s] = d->accept[s] ? 0 : RX_NONE;
    }
    for (int changed = 1; changed;) { /* later states lie nearer acceptance, mostly: walk back */
        changed = 0;
        for (uint32_t s = n; s-- > 0;)
            for (uint32_t k = 0; k < n_cls; k++) {
                uint16_t t = moves[s * RX_SPAN + k];
                if (t != RX_NONE && d->dist[t] != RX_NONE && d->dist[t] + 1 < d->dist[s]) d->dist[s] = (uint16_t)(d->dist[t] + 1), changed = 1;
            }
    }
    if (d->dist[0] == RX_NONE) {
        *why = "no string this guest writes matches 'pattern' (it writes printable ASCII but '\"' and '\\', unescaped)";
        return 0;
    }
    for (uint32_t s = 0; s < n; s++) { /* by class -> by byte, in place from the top */
        uint16_t row[RX_SPAN];
        for (uint32_t k = 0; k < n_cls; k++) {
            uint16_t t = moves[s * RX_SPAN + k];
            row[k] = t != RX_NONE && d->dist[t] != RX_NONE ? t : RX_NONE;
        }
        for (int b = 0; b < RX_SPAN; b++) moves[s * RX_SPAN + (uint32_t)b] = cls[b] == 0xFF ? RX_NONE : row[cls[b]];
    }
    return d;
}

/* Each state's distance to acceptance (states numbered so that later ones lie nearer it, mostly: the
 * passes walk back); transitions into states that never accept cut off. 0 if the start never accepts. */
static int rx_distances(rx_dfa *d) {
    uint32_t n = d->n_states;
    for (uint32_t s = 0; s < n; s++) d->dist[s] = d->accept[s] ? 0 : RX_NONE;
    for (int changed = 1; changed;) {
        changed = 0;
        for (uint32_t s = n; s-- > 0;)
            for (uint32_t b = 0; b < RX_SPAN; b++) {
                uint16_t t = d->next[s * RX_SPAN + b];
                if (t != RX_NONE && d->dist[t] != RX_NONE && d->dist[t] + 1 < d->dist[s]) d->dist[s] = (uint16_t)(d->dist[t] + 1), changed = 1;
            }
    }
    for (uint32_t i = 0; i < n * RX_SPAN; i++) if (d->next[i] != RX_NONE && d->dist[d->next[i]] == RX_NONE) d->next[i] = RX_NONE;
    return d->dist[d->start] != RX_NONE;
}

/* The strings of d with min to max characters (max < 0: no maximum): d's states times a count of the
 * bytes written (each one character: the strings are ASCII), capped at max, or at min without a max.
 * (The grammar asks for min only: a frame counts up to maxLength, cheaper than states for each count.) */
static rx_dfa *rx_with_length(const rx_dfa *d, uint32_t min, int32_t max, uint32_t *budget, const char **why) {
    uint32_t cap = max >= 0 ? (uint32_t)max : min, ns = d->n_states;
    uint64_t n = (uint64_t)ns * (cap + 1);
    if (n > RX_MAX_DFA * 4 || n > *budget) {
        *why = "'minLength' beside this 'pattern' or 'format' takes more than 4096 automaton states (or the schema's 16384)";
        return 0;
    }
    rx_dfa *out = floe_alloc(sizeof *out);
    uint16_t *next = floe_alloc((size_t)n * RX_SPAN * 2);
    uint8_t *accept = floe_alloc((size_t)n);
    uint16_t *dist = floe_alloc((size_t)n * 2);
    if (!out || !next || !accept || !dist) { *why = "out of memory for 'pattern'"; return 0; }
    for (uint32_t c = 0; c <= cap; c++)
        for (uint32_t s = 0; s < ns; s++) {
            uint32_t at = c * ns + s, to = (c < cap ? c + 1 : cap) * ns;
            accept[at] = (uint8_t)(d->accept[s] && c >= min);
            for (uint32_t b = 0; b < RX_SPAN; b++) {
                uint16_t t = d->next[s * RX_SPAN + b];
                next[at * RX_SPAN + b] = t == RX_NONE || (max >= 0 && c == cap) ? RX_NONE : (uint16_t)(to + t);
            }
        }
    *out = (rx_dfa){(uint32_t)n, d->start, next, accept, dist};
    if (!rx_distances(out)) { *why = "no string of minLength to maxLength characters matches this 'pattern' or 'format'"; return 0; }
    *budget -= (uint32_t)n;
    return out;
}

/* Compiles pattern text (UTF-8 bytes) into a DFA; NULL with *why naming what was refused. */
static rx_dfa *rx_compile(const char *text, uint32_t len, uint32_t *budget, const char **why) {
    if (!rx_work.nodes) rx_work.nodes = floe_alloc(RX_MAX_NFA * sizeof(rx_node));
    rx_parser rx = {rx_work.nodes, 0, text, text + len, 0, 0};
    if (!rx.nodes) { *why = "out of memory for 'pattern'"; return 0; }
    rx_frag f = rx_alternatives(&rx, 1);
    if (rx.error) { *why = rx.error; return 0; }
    return rx_determinize(&rx, f, budget, why);
}

#endif
