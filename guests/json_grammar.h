/* The grammar a JSON Schema compiles to: value nodes and the helpers that build them (used by the
 * compiler, json_schema_compile.h, and its driver, json_schema.h). */
#ifndef JSON_GRAMMAR_H
#define JSON_GRAMMAR_H

#include "json_number.h"
#include "json_regex.h"

enum { SN_OBJECT, SN_ARRAY, SN_STRING, SN_NUMBER, SN_INTEGER, SN_LITERALS, SN_ANYOF };
#define SN_UNBOUNDED 0xFFFFu
#define SN_MAX_NODES 4096

typedef struct {
    uint8_t kind;
    uint8_t generic;      /* object: any keys, any values (kids[0] is the any-value node) */
    uint8_t unique;       /* array: uniqueItems over kids[0], a literal set of at most 8 */
    uint32_t n;           /* object: properties; literals: literal texts; anyOf: alternatives */
    const char **texts;   /* object: each key as JSON text ("name" with its quotes); literals: sorted */
    uint32_t *lens;
    uint16_t *kids;       /* object: each property's value node; array: kids[0] the items; anyOf */
    uint8_t *required;
    uint32_t min, max;    /* array: items; string: characters (SN_UNBOUNDED: no maximum) */
    uint32_t min_bytes;   /* the shortest valid value, in bytes */
    mag_range *sides;     /* number, integer: [0] positive, [1] negative magnitudes (NULL: unbounded) */
    rx_dfa *dfa;          /* string: its content's automaton (pattern, format); NULL: any content */
} schema_node;

/* An array's node for the item at position i (0-based): prefixItems' own, then kids[0]. */
static uint32_t array_item(const schema_node *n, uint32_t i) {
    return n->kids[i + 1 < n->n ? i + 1 : 0];
}

/* The fewest bytes of the items at positions [from, to), each with the comma or bracket after it. */
static uint32_t array_items_bytes(const schema_node *nodes, const schema_node *n, uint32_t from, uint32_t to) {
    const uint32_t inf = 0x3FFFFFFF;
    uint32_t m = 0;
    for (uint32_t i = from; i < to && m < inf; i++) {
        if (i + 1 >= n->n) { /* past the prefix: every item alike */
            uint64_t rest = (uint64_t)(to - i) * (nodes[n->kids[0]].min_bytes + 1);
            return m + rest >= inf ? inf : m + (uint32_t)rest;
        }
        m += nodes[array_item(n, i)].min_bytes + 1;
    }
    return m >= inf ? inf : m;
}

#define SN_INF 0x3FFFFFFFu

static uint32_t add_sat(uint32_t a, uint32_t b) { return a >= SN_INF || b >= SN_INF || a + b >= SN_INF ? SN_INF : a + b; }

/* An object's property j written after a comma: ,"key":value */
static uint32_t property_bytes(const schema_node *nodes, const schema_node *n, uint32_t j) {
    return add_sat(n->lens[j] + 2, nodes[n->kids[j]].min_bytes);
}

/* The fewest bytes that end an object whose properties from k on are still to come, count of them
 * written (minProperties counts them): each required one, the cheapest optional ones minProperties
 * still asks for (each with a comma), and '}'; SN_INF if too few are left. *writes: some property must be. */
static uint32_t object_rest_counted(const schema_node *nodes, const schema_node *n, uint32_t k, uint32_t count, int *writes) {
    uint32_t m = 1, required = 0;
    for (uint32_t j = k; j < n->n; j++)
        if (n->required[j]) m = add_sat(m, property_bytes(nodes, n, j)), required++;
    uint32_t deficit = n->min > count + required ? n->min - count - required : 0;
    if (writes) *writes = required + deficit > 0;
    if (!deficit) return m;
    uint32_t cheapest[256], kept = 0; /* the `deficit` cheapest optional ones, sorted */
    for (uint32_t j = k; j < n->n; j++) {
        if (n->required[j]) continue;
        uint32_t c = property_bytes(nodes, n, j), at = kept < deficit ? kept++ : deficit;
        if (at == deficit && c >= cheapest[deficit - 1]) continue;
        if (at == deficit) at = deficit - 1;
        while (at > 0 && cheapest[at - 1] > c) cheapest[at] = cheapest[at - 1], at--;
        cheapest[at] = c;
    }
    if (kept < deficit) return SN_INF;
    for (uint32_t i = 0; i < deficit; i++) m = add_sat(m, cheapest[i]);
    return m;
}

/* A uniqueItems array's fewest bytes for `count` more items (each with the comma or bracket after it):
 * the shortest literals not in `used` (a bit a literal); SN_INF if too few are left. */
static uint32_t unique_items_bytes(const schema_node *nodes, const schema_node *n, uint32_t used, uint32_t count) {
    const schema_node *lit = &nodes[n->kids[0]];
    uint32_t m = 0;
    for (uint32_t k = 0; k < count; k++) {
        uint32_t best = SN_INF, at = 0;
        for (uint32_t j = 0; j < lit->n; j++)
            if (!(used >> j & 1) && lit->lens[j] < best) best = lit->lens[j], at = j;
        if (best == SN_INF) return SN_INF;
        used |= 1u << at, m += best + 1;
    }
    return m;
}

/* Nodes 0..5 of every grammar: what plain JSON mode and untyped schemas produce. */
enum { NODE_ANY, NODE_ANY_OBJECT, NODE_ANY_ARRAY, NODE_ANY_STRING, NODE_ANY_NUMBER, NODE_ANY_WORD };

typedef struct {
    schema_node *nodes;
    uint32_t n_nodes, cap_nodes;
    uint32_t root;
    const json_value *doc;           /* the schema, for $ref */
    const json_value **memo_of;      /* compiled schema objects, for $ref cycles */
    uint32_t *memo_node, n_memo;
    uint32_t rx_budget;              /* DFA states its patterns and formats may still take */
    rx_dfa *formats[10];             /* each format's DFA, made once a grammar */
    char error[512];
} grammar;

static void g_error(grammar *g, const char *a, const char *b, const char *c) {
    uint32_t n = 0;
    for (const char *parts[3] = {a, b, c}, **s = parts; s < parts + 3; s++)
        for (const char *p = *s; p && *p && n + 1 < sizeof g->error; p++) g->error[n++] = *p;
    g->error[n] = 0;
}

static int g_node(grammar *g, uint8_t kind) {
    if (g->n_nodes == g->cap_nodes) {
        uint32_t cap = g->cap_nodes ? g->cap_nodes * 2 : 64;
        schema_node *more = cap <= SN_MAX_NODES ? floe_alloc(cap * sizeof *more) : 0;
        if (!more) { g_error(g, "the schema needs more than 4096 nodes", 0, 0); return -1; }
        __builtin_memcpy(more, g->nodes, g->n_nodes * sizeof *more);
        g->nodes = more;
        g->cap_nodes = cap;
    }
    schema_node *s = &g->nodes[g->n_nodes];
    __builtin_memset(s, 0, sizeof *s);
    s->kind = kind;
    s->max = SN_UNBOUNDED;
    return (int)g->n_nodes++;
}

static int g_alloc_kids(grammar *g, int node, uint32_t n, int texts) {
    schema_node *s = &g->nodes[node];
    s->n = n;
    s->kids = floe_alloc((n ? n : 1) * sizeof *s->kids);
    s->required = floe_alloc(n ? n : 1);
    if (texts) {
        s->texts = floe_alloc((n ? n : 1) * sizeof *s->texts);
        s->lens = floe_alloc((n ? n : 1) * sizeof *s->lens);
    }
    if (!s->kids || !s->required || (texts && (!s->texts || !s->lens))) { g_error(g, "out of memory", 0, 0); return 0; }
    __builtin_memset(s->required, 0, n ? n : 1);
    return 1;
}

/* The JSON text of v, in fresh memory. */
static const char *g_text(const json_value *v, uint32_t *len) {
    uint32_t n = json_write(v, 0, 0);
    char *out = floe_alloc(n ? n : 1);
    if (out) json_write(v, out, n);
    *len = n;
    return out;
}

static int text_less(const char *a, uint32_t na, const char *b, uint32_t nb) {
    uint32_t n = na < nb ? na : nb;
    int c = mem_cmp(a, b, n);
    return c < 0 || (c == 0 && na < nb);
}

/* A literal set from `count` values; sorted, duplicates dropped (the automaton needs the order). */
static int g_literals(grammar *g, const json_value *values, uint32_t count) {
    int node = g_node(g, SN_LITERALS);
    if (node < 0 || !g_alloc_kids(g, node, count, 1)) return -1;
    schema_node *s = &g->nodes[node];
    uint32_t n = 0;
    for (uint32_t i = 0; i < count; i++) {
        uint32_t len;
        const char *t = g_text(&values[i], &len);
        if (!t) { g_error(g, "out of memory", 0, 0); return -1; }
        uint32_t at = n;
        while (at > 0 && text_less(t, len, s->texts[at - 1], s->lens[at - 1])) at--;
        if (at > 0 && s->lens[at - 1] == len && !mem_cmp(s->texts[at - 1], t, len)) continue;
        for (uint32_t j = n; j > at; j--) s->texts[j] = s->texts[j - 1], s->lens[j] = s->lens[j - 1];
        s->texts[at] = t, s->lens[at] = len, n++;
    }
    s->n = n;
    if (!n) { g_error(g, "an empty enum: no value can match", 0, 0); return -1; }
    return node;
}

static int g_words(grammar *g, const char *const *words, uint32_t n) {
    json_value v[3];
    json_parser jp = {0, 0, 0, 0};
    for (uint32_t i = 0; i < n; i++) {
        jp.p = words[i], jp.end = words[i] + floe_strlen(words[i]);
        jp_value(&jp, &v[i]);
    }
    return g_literals(g, v, n);
}

/* Nodes 0..5, the same in every grammar. */
static int g_builtins(grammar *g) {
    static const char *const words[] = {"true", "false", "null"};
    int any = g_node(g, SN_ANYOF), obj = g_node(g, SN_OBJECT), arr = g_node(g, SN_ARRAY);
    int str = g_node(g, SN_STRING), num = g_node(g, SN_NUMBER);
    if (any < 0 || obj < 0 || arr < 0 || str < 0 || num < 0 || g_words(g, words, 3) != NODE_ANY_WORD) return 0;
    if (!g_alloc_kids(g, NODE_ANY, 5, 0) || !g_alloc_kids(g, NODE_ANY_ARRAY, 1, 0)) return 0;
    for (int i = 0; i < 5; i++) g->nodes[NODE_ANY].kids[i] = (uint16_t)(NODE_ANY_OBJECT + i);
    g->nodes[NODE_ANY_ARRAY].kids[0] = NODE_ANY;
    if (!g_alloc_kids(g, NODE_ANY_OBJECT, 1, 0)) return 0;
    g->nodes[NODE_ANY_OBJECT].generic = 1;
    g->nodes[NODE_ANY_OBJECT].kids[0] = NODE_ANY;
    g->nodes[NODE_ANY_OBJECT].n = 0;
    return 1;
}

#endif
