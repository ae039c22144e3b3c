/* A JSON Schema compiled into a graph of value nodes, the grammar the automaton (json_automaton.h)
 * walks: objects with their properties in the schema's order (required ones always written, optional
 * ones maybe), arrays, strings, numbers, integers, literal sets (enum, const, booleans, null) and
 * choices (anyOf, type lists). `$ref` is resolved here, so a recursive schema is a cycle in the graph.
 *
 * A keyword the compiler does not implement is refused by name, never ignored: a reply could then
 * break the schema.
 */
#ifndef JSON_SCHEMA_H
#define JSON_SCHEMA_H

#include "json_schema_compile.h"

/* min_bytes of every node: the least fixpoint (a recursive schema converges; one that can never end,
 * e.g. an object requiring itself, stays unbounded and is refused). */
static int g_min_bytes(grammar *g) {
    const uint32_t inf = 0x3FFFFFFF;
    for (uint32_t i = 0; i < g->n_nodes; i++) g->nodes[i].min_bytes = inf;
    for (int changed = 1; changed;) {
        changed = 0;
        for (uint32_t i = 0; i < g->n_nodes; i++) {
            schema_node *s = &g->nodes[i];
            uint32_t m = inf;
            if (s->kind == SN_OBJECT && s->generic) {
                uint32_t v = g->nodes[s->kids[0]].min_bytes;
                m = s->min == 0 ? 2 : v >= inf ? inf : 1 + s->min * (4 + v);
            } else if (s->kind == SN_OBJECT) { /* '{', the properties (with commas but the first), '}' */
                int writes;
                m = object_rest_counted(g->nodes, s, 0, 0, &writes);
                m = m >= inf ? inf : m + 1 - (writes ? 1 : 0);
            } else if (s->kind == SN_ARRAY) {
                uint32_t v = s->unique ? unique_items_bytes(g->nodes, s, 0, s->min) : array_items_bytes(g->nodes, s, 0, s->min);
                m = s->min == 0 ? 2 : v >= inf ? inf : 1 + v;
            } else if (s->kind == SN_STRING) m = 2 + (s->dfa ? s->dfa->dist[s->dfa->start] : s->min);
            else if ((s->kind == SN_NUMBER || s->kind == SN_INTEGER) && s->sides) {
                for (int neg = 0; neg < 2; neg++) {
                    int rest = s->sides[neg].on ? mag_need(&s->sides[neg], 0, CMP_EQ, CMP_EQ, 0, s->kind == SN_NUMBER, 0) : -1;
                    if (rest >= 0 && (uint32_t)(rest + neg) < m) m = (uint32_t)(rest + neg);
                }
            } else if (s->kind == SN_NUMBER || s->kind == SN_INTEGER) m = 1;
            else if (s->kind == SN_LITERALS) {
                for (uint32_t j = 0; j < s->n; j++) if (s->lens[j] < m) m = s->lens[j];
            } else for (uint32_t j = 0; j < s->n; j++) {
                uint32_t v = g->nodes[s->kids[j]].min_bytes;
                if (v < m) m = v;
            }
            if (m > inf) m = inf;
            if (m < s->min_bytes) { s->min_bytes = m; changed = 1; }
        }
    }
    if (g->nodes[g->root].min_bytes >= inf) {
        g_error(g, "no finite JSON value matches this schema (a required property that contains itself?)", 0, 0);
        return 0;
    }
    return 1;
}

/* Whether some anyOf is its own alternative (through $ref, maybe through other anyOfs): a choice takes
 * no byte before its alternative does, so such a schema refers to itself before any input and the
 * automaton would push choices forever. Kahn's order over the anyOf-to-anyOf edges: what is left over
 * lies on a cycle. */
static int g_left_recursion(grammar *g) {
    uint32_t n = g->n_nodes, *into = floe_alloc((n ? n : 1) * sizeof *into), *ready = floe_alloc((n ? n : 1) * sizeof *ready);
    if (!into || !ready) { g_error(g, "out of memory", 0, 0); return 0; }
    __builtin_memset(into, 0, n * sizeof *into);
    uint32_t n_ready = 0, done = 0, choices = 0;
    for (uint32_t i = 0; i < n; i++)
        if (g->nodes[i].kind == SN_ANYOF) {
            choices++;
            for (uint32_t j = 0; j < g->nodes[i].n; j++)
                if (g->nodes[g->nodes[i].kids[j]].kind == SN_ANYOF) into[g->nodes[i].kids[j]]++;
        }
    for (uint32_t i = 0; i < n; i++) if (g->nodes[i].kind == SN_ANYOF && !into[i]) ready[n_ready++] = i;
    while (n_ready) {
        const schema_node *s = &g->nodes[ready[--n_ready]];
        done++;
        for (uint32_t j = 0; j < s->n; j++)
            if (g->nodes[s->kids[j]].kind == SN_ANYOF && !--into[s->kids[j]]) ready[n_ready++] = s->kids[j];
    }
    if (done == choices) return 1;
    g_error(g, "the schema refers to itself without consuming input (an anyOf that is, through $ref, "
               "one of its own alternatives): a value of it could never begin", 0, 0);
    return 0;
}

/* Compiles `schema` (JSON text), or plain JSON mode when len is 0; 1 on success, else 0 with
 * g->error set. */
static int grammar_compile(grammar *g, const char *schema, uint32_t len) {
    __builtin_memset(g, 0, sizeof *g);
    if (!g_builtins(g)) return 0;
    g->rx_budget = RX_MAX_STATES;
    g->root = NODE_ANY;
    if (len) {
        const char *why;
        const json_value *doc = json_parse(schema, len, &why);
        if (!doc) { g_error(g, "the schema is not JSON: ", why, 0); return 0; }
        g->doc = doc;
        char path[256] = "#";
        int root = g_schema(g, doc, path, 1, 0);
        if (root < 0) return 0;
        g->root = (uint32_t)root;
    }
    return g_left_recursion(g) && g_min_bytes(g);
}

#endif
