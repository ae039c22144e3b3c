/* The JSON Schema compiler proper (json_schema.h drives it): one schema object into nodes. */
#ifndef JSON_SCHEMA_COMPILE_H
#define JSON_SCHEMA_COMPILE_H

#include "json_grammar.h"

/* Keywords that change nothing the grammar must enforce (annotations and containers of definitions),
 * then those it implements. Anything else is refused by name. */
#define N_ANNOTATIONS 13
static const char *const KEYWORDS_KNOWN[] = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "$defs", "definitions", "discriminator", "additionalProperties", "oneOf", "allOf",
    "type", "properties", "required", "minProperties", "maxProperties", "items", "prefixItems", "additionalItems", "uniqueItems", "minItems", "maxItems", "enum", "const", "anyOf", "$ref",
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", 0,
};

static int g_schema(grammar *g, const json_value *v, char *path, uint32_t plen, int depth);

static int key_is(const json_value *key, const char *word) {
    size_t n = floe_strlen(word);
    return key->n == n && !mem_cmp(key->text, word, n);
}

static uint32_t g_path(char *path, uint32_t plen, const char *a, const char *b, uint32_t blen) {
    while (*a && plen < 250) path[plen++] = *a++;
    for (uint32_t i = 0; i < blen && plen < 250; i++) path[plen++] = b[i];
    path[plen] = 0;
    return plen;
}

static int g_refuse(grammar *g, const char *what, const json_value *key, const char *path) {
    char name[64];
    uint32_t n = key ? (key->n < 60 ? key->n : 60) : 0;
    if (key) __builtin_memcpy(name, key->text, n);
    name[n] = 0;
    g_error(g, what, name, "' at ");
    uint32_t len = (uint32_t)floe_strlen(g->error);
    for (const char *p = path; *p && len + 1 < sizeof g->error; p++) g->error[len++] = *p;
    g->error[len] = 0;
    return -1;
}

/* A keyword of v beside `word` that constrains (not an annotation), or NULL. */
static const json_value *g_constraint_beside(const json_value *v, const char *word) {
    for (uint32_t i = 0; i < v->n; i++) {
        int k = 0;
        while (k < N_ANNOTATIONS && !key_is(&v->keys[i], KEYWORDS_KNOWN[k])) k++;
        if (k == N_ANNOTATIONS && !key_is(&v->keys[i], word)) return &v->keys[i];
    }
    return 0;
}

static int g_check_keywords(grammar *g, const json_value *v, const char *path) {
    for (uint32_t i = 0; i < v->n; i++) {
        const char *const *k = KEYWORDS_KNOWN;
        while (*k && !key_is(&v->keys[i], *k)) k++;
        if (!*k) return g_refuse(g, "unsupported JSON Schema keyword '", &v->keys[i], path);
    }
    return 0;
}

/* A bound keyword of v (minLength, maxItems, ...): a non-negative integer (2.0 too); `otherwise` where v
 * lacks it; -1 with g->error naming it where it is anything else. Counters hold 0xFFFE at most: a
 * larger maximum bounds nothing (SN_UNBOUNDED), a larger minimum is refused. */
static int64_t g_bound(grammar *g, const json_value *v, const char *key, uint32_t otherwise, const char *path) {
    const json_value *b = json_get(v, key);
    if (!b) return otherwise;
    uint32_t n = 0, i = 0;
    for (; b->type == JV_NUMBER && i < b->n && b->text[i] >= '0' && b->text[i] <= '9'; i++)
        n = n * 10 + (uint32_t)(b->text[i] - '0') > 0xFFFF ? 0xFFFF : n * 10 + (uint32_t)(b->text[i] - '0');
    if (i && i < b->n && b->text[i] == '.') /* an integral number written with a fraction: 2.0 */
        for (i++; i < b->n && b->text[i] == '0'; i++) {}
    const char *why = "' must be a non-negative integer at ";
    if (b->type == JV_NUMBER && i && i == b->n) {
        if (n <= 0xFFFE) return n;
        if (otherwise == SN_UNBOUNDED) return SN_UNBOUNDED;
        why = "' above 65534 is more than this guest writes at ";
    }
    char what[64] = "'";
    uint32_t k = 1;
    for (const char *p = key; *p && k < 40; p++) what[k++] = *p;
    what[k] = 0;
    g_error(g, what, why, path);
    return -1;
}

static void g_memo(grammar *g, const json_value *v, int node) {
    if (g->n_memo % 64 == 0) {
        const json_value **of = floe_alloc((g->n_memo + 64) * sizeof *of);
        uint32_t *nodes = floe_alloc((g->n_memo + 64) * sizeof *nodes);
        if (!of || !nodes) return; /* no memo: a recursive schema then fails on depth, not silently */
        __builtin_memcpy(of, g->memo_of, g->n_memo * sizeof *of);
        __builtin_memcpy(nodes, g->memo_node, g->n_memo * sizeof *nodes);
        g->memo_of = of, g->memo_node = nodes;
    }
    g->memo_of[g->n_memo] = v;
    g->memo_node[g->n_memo++] = (uint32_t)node;
}

/* "#", "#/$defs/Name", any JSON pointer into the schema document (array indexes too). */
static const json_value *g_resolve(grammar *g, const json_value *ref) {
    if (ref->type != JV_STRING || !ref->n || ref->text[0] != '#') return 0;
    const json_value *at = g->doc;
    uint32_t i = 1;
    while (at && i < ref->n) {
        if (ref->text[i++] != '/') return 0;
        char seg[128];
        uint32_t n = 0;
        for (; i < ref->n && ref->text[i] != '/' && n < sizeof seg - 1; i++) {
            char c = ref->text[i];
            if (c == '~' && i + 1 < ref->n) c = ref->text[++i] == '1' ? '/' : '~';
            seg[n++] = c;
        }
        seg[n] = 0;
        if (at->type == JV_ARRAY) { /* an index: digits only */
            uint32_t k = 0, j = 0;
            for (; j < n && seg[j] >= '0' && seg[j] <= '9' && k < 0x10000; j++) k = k * 10 + (uint32_t)(seg[j] - '0');
            at = n && j == n && k < at->n ? &at->items[k] : 0;
        } else at = json_get(at, seg);
    }
    return at;
}

static int type_matches(const json_value *value, const json_value *type) {
    if (!type || type->type != JV_STRING) return 1;
    static const char *const names[] = {"null", "boolean", "boolean", "number", "string", "array", "object"};
    if (key_is(type, "integer")) {
        if (value->type != JV_NUMBER) return 0;
        for (uint32_t i = 0; i < value->n; i++) if (value->text[i] == '.' || value->text[i] == 'e' || value->text[i] == 'E') return 0;
        return 1;
    }
    return key_is(type, names[value->type]);
}

static int g_enum(grammar *g, const json_value *v, const json_value *type) {
    const json_value *e = json_get(v, "enum"), *c = json_get(v, "const");
    if (c) return g_literals(g, c, type_matches(c, type));
    if (e->type != JV_ARRAY) { g_error(g, "'enum' must be an array", 0, 0); return -1; }
    json_value *kept = floe_alloc((e->n ? e->n : 1) * sizeof *kept);
    uint32_t n = 0;
    for (uint32_t i = 0; kept && i < e->n; i++) if (type_matches(&e->items[i], type)) kept[n++] = e->items[i];
    return kept ? g_literals(g, kept, n) : -1;
}

/* minProperties and maxProperties into node (counted in a frame's byte: at most 254; a larger maximum
 * bounds nothing where it is at least the properties listed); 0 with g->error naming them else. */
static int g_property_counts(grammar *g, const json_value *v, int node, uint32_t listed, uint32_t required,
                             const char *path) {
    int64_t min = g_bound(g, v, "minProperties", 0, path), max = g_bound(g, v, "maxProperties", SN_UNBOUNDED, path);
    if (min < 0 || max < 0) return 0;
    schema_node *s = &g->nodes[node];
    if (max > 254 && max != SN_UNBOUNDED && !s->generic && listed <= max) max = SN_UNBOUNDED;
    const char *why = min > 254 || (max > 254 && max != SN_UNBOUNDED) ? "minProperties/maxProperties above 254 (what this guest counts) at "
                    : min > max ? "minProperties > maxProperties at "
                    : !s->generic && min > listed ? "minProperties above the properties listed (this guest writes no others) at "
                    : s->generic && min > 1 ? "minProperties above 1 on an object of any keys (this guest cannot keep them distinct) at "
                    : required > max ? "maxProperties below the required properties at " : 0;
    if (why) { g_error(g, why, path, 0); return 0; }
    s->min = (uint32_t)min, s->max = (uint32_t)max;
    return 1;
}

static int has_property_counts(const json_value *v) { return json_get(v, "minProperties") || json_get(v, "maxProperties"); }

static int g_object(grammar *g, const json_value *v, char *path, uint32_t plen, int depth) {
    const json_value *props = json_get(v, "properties"), *req = json_get(v, "required");
    const json_value *extra = json_get(v, "additionalProperties");
    int map = !props && !req && extra && extra->type == JV_OBJECT;
    if (map || (!props && !req && !(extra && extra->type == JV_FALSE) && has_property_counts(v))) {
        /* a map (any keys, values of one schema) or any object with a count of properties */
        int node = g_node(g, SN_OBJECT);
        if (node < 0 || !g_alloc_kids(g, node, 1, 0)) return -1;
        g_memo(g, v, node);
        g->nodes[node].generic = 1, g->nodes[node].n = 0, g->nodes[node].kids[0] = NODE_ANY;
        if (!g_property_counts(g, v, node, 0, 0, path)) return -1;
        if (!map) return node;
        int kid = g_schema(g, extra, path, g_path(path, plen, "/additionalProperties", 0, 0), depth + 1);
        path[plen] = 0;
        if (kid < 0) return -1;
        g->nodes[node].kids[0] = (uint16_t)kid;
        return node;
    }
    if (!props && !req && !(extra && extra->type == JV_FALSE)) return NODE_ANY_OBJECT;
    if ((props && props->type != JV_OBJECT) || (req && req->type != JV_ARRAY)) {
        g_error(g, "'properties' must be an object and 'required' an array at ", path, 0);
        return -1;
    }
    uint32_t np = props ? props->n : 0, nr = req ? req->n : 0, n = np;
    const json_value **names = floe_alloc((np + nr + 1) * sizeof *names);
    if (!names) return -1;
    for (uint32_t i = 0; i < np; i++) names[i] = &props->keys[i];
    for (uint32_t r = 0; r < nr; r++) { /* a required name without a schema: any value */
        uint32_t i = 0;
        while (i < n && (names[i]->n != req->items[r].n || mem_cmp(names[i]->text, req->items[r].text, names[i]->n))) i++;
        if (req->items[r].type != JV_STRING) { g_error(g, "'required' lists a non-string at ", path, 0); return -1; }
        if (i == n) names[n++] = &req->items[r];
    }
    int node = g_node(g, SN_OBJECT);
    if (node < 0 || !g_alloc_kids(g, node, n, 1)) return -1;
    g_memo(g, v, node);
    for (uint32_t i = 0; i < n; i++) {
        schema_node *s = &g->nodes[node];
        s->texts[i] = g_text(names[i], &s->lens[i]);
        for (uint32_t r = 0; r < nr; r++)
            if (req->items[r].n == names[i]->n && !mem_cmp(req->items[r].text, names[i]->text, names[i]->n))
                s->required[i] = 1;
        int kid = NODE_ANY;
        if (i < np) {
            uint32_t at = g_path(path, plen, "/properties/", names[i]->text, names[i]->n);
            kid = g_schema(g, &props->items[i], path, at, depth + 1);
            path[plen] = 0;
        }
        if (kid < 0) return -1;
        g->nodes[node].kids[i] = (uint16_t)kid;
    }
    uint32_t required = 0;
    for (uint32_t i = 0; i < n; i++) required += g->nodes[node].required[i];
    return g_property_counts(g, v, node, n, required, path) ? node : -1;
}

/* uniqueItems: nothing to keep where at most one item is written; else over an enum of at most 8
 * strings, integers, booleans or null (values equal exactly when their texts are: a frame keeps a bit
 * for each one taken); refused by name otherwise. 1, or 0 with g->error set. */
static int g_unique(grammar *g, const json_value *v, int node, const char *path) {
    const json_value *u = json_get(v, "uniqueItems");
    schema_node *s = &g->nodes[node];
    if (!u || u->type == JV_FALSE || s->max <= 1) return 1;
    const schema_node *lit = &g->nodes[s->kids[0]];
    int ok = u->type == JV_TRUE && s->n == 1 && lit->kind == SN_LITERALS && lit->n <= 8;
    for (uint32_t j = 0; ok && j < lit->n; j++)
        for (uint32_t i = 0; i < lit->lens[j]; i++) {
            char c = lit->texts[j][0];
            if (c == '{' || c == '[' || ((c == '-' || (c >= '0' && c <= '9')) &&
                (lit->texts[j][i] == '.' || lit->texts[j][i] == 'e' || lit->texts[j][i] == 'E'))) ok = 0;
        }
    if (!ok) {
        g_error(g, "'uniqueItems' on items that are not an enum of at most 8 strings, integers, booleans or null "
                   "(what this guest keeps apart) at ", path, 0);
        return 0;
    }
    s->unique = 1;
    if (s->max > lit->n) s->max = lit->n; /* no more items than distinct values */
    if (s->min > s->max) { g_error(g, "minItems above the distinct values uniqueItems allows at ", path, 0); return 0; }
    return 1;
}

/* An array: kids[0] the items past the prefix, kids[1..n) prefixItems' schemas, one a position. */
static int g_array(grammar *g, const json_value *v, char *path, uint32_t plen, int depth) {
    const json_value *items = json_get(v, "items"), *prefix = json_get(v, "prefixItems");
    const char *prefix_name = "/prefixItems/";
    if (items && items->type == JV_ARRAY) { /* draft 7's tuple: items a list, then additionalItems */
        if (prefix) { g_error(g, "'items' as a list beside 'prefixItems' at ", path, 0); return -1; }
        prefix = items, items = json_get(v, "additionalItems"), prefix_name = "/items/";
    }
    if (prefix && (prefix->type != JV_ARRAY || prefix->n > 0xFFFE)) {
        g_error(g, "'prefixItems' must be an array of schemas at ", path, 0);
        return -1;
    }
    uint32_t n_prefix = prefix ? prefix->n : 0;
    int node = g_node(g, SN_ARRAY);
    if (node < 0 || !g_alloc_kids(g, node, 1 + n_prefix, 0)) return -1;
    g_memo(g, v, node);
    int64_t min = g_bound(g, v, "minItems", 0, path), max = g_bound(g, v, "maxItems", SN_UNBOUNDED, path);
    if (min < 0 || max < 0) return -1;
    if (items && items->type == JV_FALSE && n_prefix < max) max = n_prefix; /* nothing past the prefix */
    g->nodes[node].min = (uint32_t)min, g->nodes[node].max = (uint32_t)max;
    int kid = NODE_ANY;
    if (items && items->type != JV_FALSE) {
        kid = g_schema(g, items, path, g_path(path, plen, prefix_name[1] == 'i' ? "/additionalItems" : "/items", 0, 0), depth + 1);
        path[plen] = 0;
    }
    if (kid < 0) return -1;
    g->nodes[node].kids[0] = (uint16_t)kid;
    for (uint32_t i = 0; i < n_prefix; i++) {
        char digit[12];
        uint32_t at = g_path(path, plen, prefix_name, digit, (uint32_t)floe_itoa((int32_t)i, digit));
        kid = g_schema(g, &prefix->items[i], path, at, depth + 1);
        path[plen] = 0;
        if (kid < 0) return -1;
        g->nodes[node].kids[1 + i] = (uint16_t)kid;
    }
    if (!g_unique(g, v, node, path)) return -1;
    if (g->nodes[node].min > g->nodes[node].max) {
        g_error(g, items && items->type == JV_FALSE ? "minItems > the positions a tuple allows ('items' or 'additionalItems' false) at "
                                                    : "minItems > maxItems at ", path, 0);
        return -1;
    }
    return node;
}

/* `format`s as patterns (json_regex.h): exact for date, time, date-time (RFC 3339; February 29th in
 * leap years only), uuid, ipv4; subsets for email (as email-validator accepts it), hostname (up to 3
 * labels), uri (scheme://host...),
 * duration (ISO 8601, whole numbers), ipv6 (the full form of 8 groups). */
#define RX_YEAR "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
#define RX_DATE "(" RX_YEAR "-((0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])|(0[13-9]|1[0-2])-(29|30)|(0[13578]|1[02])-31)" \
    "|([0-9]{2}(0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)-02-29)"
#define RX_TIME "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
#define RX_OCTET "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
#define RX_LABEL "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
#define RX_NAME "[A-Za-z0-9]+(-[A-Za-z0-9]+)*"
/* An email's local part: up to 4 runs of 1-15 characters joined by . _ + - (at most 63 characters); its
 * domain up to 2 labels of at most 63 and a top-level name of 2-24 letters: what email-validator (pydantic's
 * EmailStr) accepts — a domain label past 63 characters, or an address past 254, it refuses. */
#define RX_LOCAL "[A-Za-z0-9]{1,15}([._+-][A-Za-z0-9]{1,15}){0,3}"
#define RX_HEX4 "[0-9a-fA-F]{4}"
#define RX_HEX16 "[0-9a-fA-F]{1,4}"
#define RX_DUR_TIME "T([0-9]+H([0-9]+M)?([0-9]+S)?|[0-9]+M([0-9]+S)?|[0-9]+S)"
static const char *const FORMATS[10][2] = {
    {"date", "^" RX_DATE "$"},
    {"time", "^" RX_TIME "$"},
    {"date-time", "^" RX_DATE "T" RX_TIME "$"},
    {"uuid", "^" RX_HEX4 RX_HEX4 "-" RX_HEX4 "-" RX_HEX4 "-" RX_HEX4 "-" RX_HEX4 RX_HEX4 RX_HEX4 "$"},
    {"ipv4", "^" RX_OCTET "(\\." RX_OCTET "){3}$"},
    {"email", "^" RX_LOCAL "@" RX_LABEL "(\\." RX_LABEL ")?\\.[A-Za-z]{2,24}$"},
    {"hostname", "^" RX_LABEL "(\\." RX_LABEL "){0,2}$"},
    {"duration", "^P(([0-9]+Y([0-9]+M)?([0-9]+D)?|[0-9]+M([0-9]+D)?|[0-9]+D)(" RX_DUR_TIME ")?|" RX_DUR_TIME "|[0-9]+W)$"},
    {"ipv6", "^" RX_HEX16 "(:" RX_HEX16 "){7}$"},
    {"uri", "^[a-z][a-z0-9+.-]*://" RX_NAME "(\\." RX_NAME ")*(:[0-9]{1,5})?(/[A-Za-z0-9._~!$&'()*+,;=:@-]*)*"
            "(\\?[A-Za-z0-9._~!$&'()*+,;=:@/?-]*)?$"},
};

static int has_string_shape(const json_value *v) { return json_get(v, "pattern") || json_get(v, "format"); }

/* A string of a pattern or a format: its content's DFA. */
static int g_shaped_string(grammar *g, const json_value *v, const char *path) {
    const json_value *pattern = json_get(v, "pattern"), *format = json_get(v, "format");
    if (pattern && format) { g_error(g, "'pattern' beside 'format' (this guest writes one of them) at ", path, 0); return -1; }
    int64_t min = g_bound(g, v, "minLength", 0, path), max = g_bound(g, v, "maxLength", SN_UNBOUNDED, path);
    if (min < 0 || max < 0) return -1;
    if (min > max) { g_error(g, "minLength > maxLength at ", path, 0); return -1; }
    const json_value *shape = pattern ? pattern : format;
    if (shape->type != JV_STRING) { g_error(g, pattern ? "'pattern' must be a string at " : "'format' must be a string at ", path, 0); return -1; }
    const char *text = shape->text;
    uint32_t len = shape->n;
    rx_dfa **cached = 0;
    if (format) {
        uint32_t i = 0, n = sizeof FORMATS / sizeof FORMATS[0];
        while (i < n && !key_is(format, FORMATS[i][0])) i++;
        if (i == n) return g_refuse(g, "unsupported JSON Schema format '", format, path);
        text = FORMATS[i][1], len = (uint32_t)floe_strlen(text);
        cached = &g->formats[i];
    }
    const char *why = 0;
    rx_dfa *dfa = cached && *cached ? *cached : rx_compile(text, len, &g->rx_budget, &why);
    if (cached) *cached = dfa;
    if (dfa && min > 0) dfa = rx_with_length(dfa, (uint32_t)min, -1, &g->rx_budget, &why); /* counts to min */
    if (dfa && max != SN_UNBOUNDED && dfa->dist[dfa->start] > max) /* a maximum: the frame counts */
        why = "no string of minLength to maxLength characters matches this 'pattern' or 'format'", dfa = 0;
    if (!dfa) { g_error(g, why, " at ", path); return -1; }
    int node = g_node(g, SN_STRING);
    if (node >= 0) g->nodes[node].dfa = dfa, g->nodes[node].max = (uint32_t)max;
    return node;
}

static const char *const NUMBER_BOUNDS[] = {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"};

static int has_number_bounds(const json_value *v) {
    for (int i = 0; i < 4; i++) if (json_get(v, NUMBER_BOUNDS[i])) return 1;
    return json_get(v, "multipleOf") != 0;
}

/* multipleOf: a whole number from 1 to 65535 (what a frame's remainder holds); 1 where v lacks it;
 * 0 with g->error naming it otherwise. A number that is a multiple of a whole number is an integer. */
static uint32_t g_multiple(grammar *g, const json_value *v, const char *path) {
    const json_value *m = json_get(v, "multipleOf");
    if (!m) return 1;
    int whole = 0;
    int64_t k = m->type == JV_NUMBER ? number_floor(m->text, m->n, &whole) : 0;
    if (whole && k >= 1 && k <= 0xFFFF) return (uint32_t)k;
    json_value key = {JV_STRING, 10, "multipleOf", 0, 0};
    g_refuse(g, whole && k > 0xFFFF ? "a multiple above 65535 (more than this guest counts) in '"
                                    : "a multiple that is not a positive integer (this guest writes multiples of "
                                      "1 to 65535 only) in '", &key, path);
    return 0;
}

/* A number or integer node; with bounds, the magnitudes each sign may take (json_number.h). */
static int g_number(grammar *g, const json_value *v, int integer, const char *path) {
    if (!has_number_bounds(v)) return integer ? g_node(g, SN_INTEGER) : NODE_ANY_NUMBER;
    uint32_t multiple = g_multiple(g, v, path);
    if (!multiple) return -1;
    integer |= json_get(v, "multipleOf") != 0;
    /* integers: inclusive integer bounds (lo, hi); numbers: decimal ones with their strictness */
    int64_t lo = -NUM_HUGE, hi = NUM_HUGE;
    decimal dlo, dhi;
    int has_lo = 0, has_hi = 0, lo_strict = 0, hi_strict = 0;
    for (int i = 0; i < 4; i++) {
        const json_value *b = json_get(v, NUMBER_BOUNDS[i]);
        if (!b) continue;
        json_value key = {JV_STRING, (uint32_t)floe_strlen(NUMBER_BOUNDS[i]), NUMBER_BOUNDS[i], 0, 0};
        if (b->type != JV_NUMBER) return g_refuse(g, "a non-number bound '", &key, path);
        int strict = i % 2, upper = i >= 2, whole;
        if (integer) { /* to inclusive integer bounds */
            int64_t x = number_floor(b->text, b->n, &whole);
            if (!upper) x = strict || !whole ? x + 1 : x;
            else x = strict && whole ? x - 1 : x;
            if (!upper && x > lo) lo = x;
            if (upper && x < hi) hi = x;
            continue;
        }
        decimal x;
        if (!number_decimal(b->text, b->n, &x))
            return g_refuse(g, "a bound with more than 16 fraction digits (more than this guest writes) in '", &key, path);
        int c = upper ? (has_hi ? decimal_cmp(&x, &dhi) : -1) : (has_lo ? decimal_cmp(&x, &dlo) : 1);
        if (!upper && (c > 0 || (c == 0 && strict))) dlo = x, has_lo = 1, lo_strict = strict;
        if (upper && (c < 0 || (c == 0 && strict))) dhi = x, has_hi = 1, hi_strict = strict;
    }
    int node = g_node(g, integer ? SN_INTEGER : SN_NUMBER);
    mag_range *sides = node < 0 ? 0 : floe_alloc(2 * sizeof *sides);
    if (!sides) return -1;
    __builtin_memset(sides, 0, 2 * sizeof *sides);
    g->nodes[node].sides = sides;
    if (integer) {
        if (hi >= 0) mag_set(&sides[0], lo > 0 ? lo : 0, hi);
        if (lo < 0) mag_set(&sides[1], hi < -1 ? -hi : 1, -lo);
    } else { /* a negative number's magnitude lies below -lo and above -hi */
        decimal zero, mlo = dlo, mhi = dhi;
        __builtin_memset(&zero, 0, sizeof zero);
        mlo.neg = mhi.neg = 0;
        int hi_zero = has_hi && !dhi.whole && !dhi.frac_len;
        if (!has_hi || (!dhi.neg && !hi_zero) || (hi_zero && !hi_strict))
            mag_set_number(&sides[0], has_lo && !dlo.neg ? &dlo : &zero, has_lo && !dlo.neg && lo_strict,
                           has_hi ? &dhi : 0, hi_strict);
        if (!has_lo || dlo.neg)
            mag_set_number(&sides[1], has_hi && dhi.neg ? &mhi : &zero, has_hi && (dhi.neg || hi_zero) && hi_strict,
                           has_lo ? &mlo : 0, lo_strict);
    }
    for (int neg = 0; neg < 2; neg++) { /* a range may hold no multiple, or only a fraction none is */
        sides[neg].multiple = multiple;
        if (sides[neg].on && mag_need(&sides[neg], 0, CMP_EQ, CMP_EQ, 0, !integer, 0) < 0) sides[neg].on = 0;
    }
    if (!sides[0].on && !sides[1].on) {
        g_error(g, integer ? "no integer of at most 16 digits lies within minimum/maximum (a multiple of multipleOf) at "
                           : "no number of at most 16 integer digits lies within minimum/maximum at ", path, 0);
        return -1;
    }
    return node;
}

/* One schema object under one type name. */
static int g_typed(grammar *g, const json_value *v, const json_value *type, char *path, uint32_t plen, int depth) {
    if (json_get(v, "enum") || json_get(v, "const")) {
        if (has_number_bounds(v)) {
            g_error(g, "minimum/maximum/multipleOf beside 'enum' or 'const' (list only the values that hold) at ", path, 0);
            return -1;
        }
        return g_enum(g, v, type);
    }
    if (!type && has_number_bounds(v)) return g_number(g, v, 0, path);
    if (!type) {
        if (json_get(v, "properties") || json_get(v, "required") || has_property_counts(v)) return g_object(g, v, path, plen, depth);
        if (json_get(v, "items") || json_get(v, "prefixItems") || json_get(v, "minItems") || json_get(v, "maxItems") ||
            json_get(v, "uniqueItems"))
            return g_array(g, v, path, plen, depth);
        const json_value *extra = json_get(v, "additionalProperties");
        if (extra && (extra->type == JV_OBJECT || extra->type == JV_FALSE)) return g_object(g, v, path, plen, depth);
        if (!json_get(v, "minLength") && !json_get(v, "maxLength") && !has_string_shape(v)) return NODE_ANY;
    }
    if (!type || key_is(type, "string")) {
        if (has_string_shape(v)) return g_shaped_string(g, v, path);
        if (!json_get(v, "minLength") && !json_get(v, "maxLength")) return NODE_ANY_STRING;
        int64_t min = g_bound(g, v, "minLength", 0, path), max = g_bound(g, v, "maxLength", SN_UNBOUNDED, path);
        int node = min < 0 || max < 0 ? -1 : g_node(g, SN_STRING);
        if (node < 0) return -1;
        g->nodes[node].min = (uint32_t)min, g->nodes[node].max = (uint32_t)max;
        if (g->nodes[node].min > g->nodes[node].max) { g_error(g, "minLength > maxLength at ", path, 0); return -1; }
        return node;
    }
    if (key_is(type, "object")) return g_object(g, v, path, plen, depth);
    if (key_is(type, "array")) return g_array(g, v, path, plen, depth);
    if (key_is(type, "number") || key_is(type, "integer")) return g_number(g, v, key_is(type, "integer"), path);
    if (key_is(type, "boolean") || key_is(type, "null")) {
        static const char *const words[] = {"false", "true"}, *const null_word[] = {"null"};
        return key_is(type, "null") ? g_words(g, null_word, 1) : g_words(g, words, 2);
    }
    return g_refuse(g, "unsupported JSON Schema type '", type, path);
}

/* A choice: anyOf's schemas, or one schema under each name of a type list. */
static int g_choice(grammar *g, const json_value *v, const json_value *list, int is_types, char *path,
                    uint32_t plen, int depth) {
    if (list->type != JV_ARRAY || !list->n) { g_error(g, "'anyOf', 'oneOf' and a type list must be non-empty arrays at ", path, 0); return -1; }
    const char *segment = list == json_get(v, "oneOf") ? "/oneOf/" : "/anyOf/";
    int node = g_node(g, SN_ANYOF);
    if (node < 0 || !g_alloc_kids(g, node, list->n, 0)) return -1;
    g_memo(g, v, node);
    for (uint32_t i = 0; i < list->n; i++) {
        char digit[12];
        uint32_t at = g_path(path, plen, segment, digit, (uint32_t)floe_itoa((int32_t)i, digit));
        if (is_types && list->items[i].type != JV_STRING) { g_error(g, "a type list of non-strings at ", path, 0); return -1; }
        int kid = is_types ? g_typed(g, v, &list->items[i], path, plen, depth)
                           : g_schema(g, &list->items[i], path, at, depth + 1);
        path[plen] = 0;
        if (kid < 0) return -1;
        g->nodes[node].kids[i] = (uint16_t)kid;
    }
    return node;
}

/* Whether no JSON value is written by both nodes: different types, literal sets apart, or objects with
 * a property both require whose values are apart (a discriminator). */
static int family_of(const schema_node *n) {
    return n->kind == SN_OBJECT ? 0 : n->kind == SN_ARRAY ? 1 : n->kind == SN_STRING ? 2
         : n->kind == SN_NUMBER || n->kind == SN_INTEGER ? 3 : -1;
}

static int literal_family(const char *text) {
    return *text == '{' ? 0 : *text == '[' ? 1 : *text == '"' ? 2 : *text == 't' || *text == 'f' ? 4 : *text == 'n' ? 5 : 3;
}

static int g_disjoint(const grammar *g, uint32_t a, uint32_t b, int depth) {
    const schema_node *x = &g->nodes[a], *y = &g->nodes[b];
    if (depth > 8) return 0;
    if (x->kind == SN_ANYOF || y->kind == SN_ANYOF) {
        const schema_node *c = x->kind == SN_ANYOF ? x : y;
        uint32_t other = x->kind == SN_ANYOF ? b : a;
        for (uint32_t i = 0; i < c->n; i++) if (!g_disjoint(g, c->kids[i], other, depth + 1)) return 0;
        return 1;
    }
    if (x->kind == SN_LITERALS && y->kind == SN_LITERALS) {
        for (uint32_t i = 0; i < x->n; i++)
            for (uint32_t j = 0; j < y->n; j++)
                if (x->lens[i] == y->lens[j] && !mem_cmp(x->texts[i], y->texts[j], x->lens[i])) return 0;
        return 1;
    }
    if (x->kind == SN_LITERALS || y->kind == SN_LITERALS) { /* literals none of the other's type */
        const schema_node *l = x->kind == SN_LITERALS ? x : y, *t = x->kind == SN_LITERALS ? y : x;
        for (uint32_t i = 0; i < l->n; i++) if (literal_family(l->texts[i]) == family_of(t)) return 0;
        return 1;
    }
    if (family_of(x) != family_of(y)) return 1;
    if (x->kind != SN_OBJECT || x->generic || y->generic) return 0;
    for (uint32_t i = 0; i < x->n; i++)
        for (uint32_t j = 0; j < y->n; j++)
            if (x->required[i] && y->required[j] && x->lens[i] == y->lens[j] &&
                !mem_cmp(x->texts[i], y->texts[j], x->lens[i]) && g_disjoint(g, x->kids[i], y->kids[j], depth + 1))
                return 1;
    return 0;
}

/* oneOf: an anyOf whose alternatives the compiler proves apart (no value matches two), else refused. */
static int g_one_of(grammar *g, const json_value *v, const json_value *list, char *path, uint32_t plen, int depth) {
    int node = g_choice(g, v, list, 0, path, plen, depth);
    if (node < 0) return -1;
    const schema_node *s = &g->nodes[node];
    for (uint32_t i = 0; i < s->n; i++)
        for (uint32_t j = i + 1; j < s->n; j++)
            if (!g_disjoint(g, s->kids[i], s->kids[j], 0)) {
                g_error(g, "'oneOf' whose alternatives this guest cannot prove apart (it needs different types, "
                           "different const/enum values, or a required property with those: a discriminator) at ", path, 0);
                return -1;
            }
    return node;
}

static int g_schema(grammar *g, const json_value *v, char *path, uint32_t plen, int depth) {
    if (depth > 64) { g_error(g, "the schema nests (or refers) deeper than 64 at ", path, 0); return -1; }
    if (v->type == JV_TRUE) return NODE_ANY;
    if (v->type != JV_OBJECT) { g_error(g, "a schema must be an object or true at ", path, 0); return -1; }
    for (uint32_t i = 0; i < g->n_memo; i++) if (g->memo_of[i] == v) return (int)g->memo_node[i];
    if (g_check_keywords(g, v, path)) return -1;
    const json_value *ref = json_get(v, "$ref"), *any = json_get(v, "anyOf"), *type = json_get(v, "type");
    const json_value *one = json_get(v, "oneOf"), *all = json_get(v, "allOf");
    const char *alone = ref ? "$ref" : one ? "oneOf" : all ? "allOf" : 0;
    const json_value *beside = alone ? g_constraint_beside(v, alone) : 0;
    if (beside) { /* a keyword this guest would not apply: refused by name */
        char what[200];
        uint32_t n = 0;
        const char *parts[] = {"unsupported JSON Schema keyword '", 0, "' beside '", alone, "' at "};
        for (int i = 0; i < 5; i++) {
            if (!parts[i]) for (uint32_t j = 0; j < beside->n && j < 60; j++) what[n++] = beside->text[j];
            else for (const char *p = parts[i]; *p; p++) what[n++] = *p;
        }
        what[n] = 0;
        g_error(g, what, path, 0);
        return -1;
    }
    if (all) { /* allOf of one schema (pydantic v1 wraps a $ref so) is that schema */
        if (all->type != JV_ARRAY || all->n != 1) {
            json_value key = {JV_STRING, 31, "allOf (of more than one schema)", 0, 0};
            return g_refuse(g, "unsupported JSON Schema keyword '", &key, path);
        }
        int node = g_schema(g, &all->items[0], path, g_path(path, plen, "/allOf/0", 0, 0), depth + 1);
        path[plen] = 0;
        return node;
    }
    if (one) return g_one_of(g, v, one, path, plen, depth);
    if (ref) {
        const json_value *target = g_resolve(g, ref);
        if (!target) { g_error(g, "a $ref this guest cannot resolve (only '#...' pointers) at ", path, 0); return -1; }
        uint32_t at = g_path(path, plen, " -> ", ref->text, ref->n);
        int node = g_schema(g, target, path, at, depth + 1);
        path[plen] = 0;
        return node;
    }
    if (any) return g_choice(g, v, any, 0, path, plen, depth);
    if (type && type->type == JV_ARRAY) return g_choice(g, v, type, 1, path, plen, depth);
    if (type && type->type != JV_STRING) { g_error(g, "'type' must be a string or a list at ", path, 0); return -1; }
    return g_typed(g, v, type, path, plen, depth);
}

#endif
