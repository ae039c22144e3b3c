/* A JSON document parsed into guest memory (for the grammar guest's schemas), and the compact form of
 * a value written back as text (what an `enum` or `const` value must be, byte for byte).
 *
 * No libc: memory comes from floe_alloc and is never freed (a schema is small; the guest keeps the
 * last one it compiled).
 */
#ifndef JSON_VALUE_H
#define JSON_VALUE_H

#include "floe.h"

/* memcmp (no libc here, and clang does not inline __builtin_memcmp for wasm32). */
static int mem_cmp(const void *a, const void *b, size_t n) {
    const unsigned char *x = a, *y = b;
    for (size_t i = 0; i < n; i++)
        if (x[i] != y[i]) return x[i] < y[i] ? -1 : 1;
    return 0;
}

enum { JV_NULL, JV_FALSE, JV_TRUE, JV_NUMBER, JV_STRING, JV_ARRAY, JV_OBJECT };

typedef struct json_value json_value;
struct json_value {
    int type;
    uint32_t n;          /* string: bytes; array, object: items */
    const char *text;    /* string: its UTF-8 bytes (unescaped); number: its text as written */
    json_value *items;   /* array items, object values */
    json_value *keys;    /* object keys (strings), parallel to items */
};

typedef struct {
    const char *p, *end;
    const char *error; /* the first error, NULL while none */
    int depth;
} json_parser;

static void jp_fail(json_parser *jp, const char *why) {
    if (!jp->error) jp->error = why;
}

static void jp_space(json_parser *jp) {
    while (jp->p < jp->end && (*jp->p == ' ' || *jp->p == '\t' || *jp->p == '\n' || *jp->p == '\r')) jp->p++;
}

static int jp_hex(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static uint32_t jp_u4(json_parser *jp) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        int h = jp->p < jp->end ? jp_hex(*jp->p) : -1;
        if (h < 0) { jp_fail(jp, "a bad \\u escape in a string"); return 0; }
        v = v * 16 + (uint32_t)h;
        jp->p++;
    }
    return v;
}

static uint32_t jp_utf8(char *out, uint32_t cp) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) { out[0] = (char)(0xC0 | cp >> 6); out[1] = (char)(0x80 | (cp & 63)); return 2; }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | cp >> 12); out[1] = (char)(0x80 | (cp >> 6 & 63));
        out[2] = (char)(0x80 | (cp & 63));
        return 3;
    }
    out[0] = (char)(0xF0 | cp >> 18); out[1] = (char)(0x80 | (cp >> 12 & 63));
    out[2] = (char)(0x80 | (cp >> 6 & 63)); out[3] = (char)(0x80 | (cp & 63));
    return 4;
}

/* A string at jp->p (its opening quote), unescaped into fresh memory. */
static void jp_string(json_parser *jp, json_value *v) {
    const char *start = ++jp->p;
    while (jp->p < jp->end && *jp->p != '"') jp->p += *jp->p == '\\' ? 2 : 1;
    if (jp->p >= jp->end) { jp_fail(jp, "a string without its closing quote"); return; }
    char *out = floe_alloc((size_t)(jp->p - start) + 1);
    if (!out) { jp_fail(jp, "out of memory"); return; }
    uint32_t n = 0;
    jp->p = start;
    while (*jp->p != '"') {
        unsigned char c = (unsigned char)*jp->p++;
        if (c < 0x20) { jp_fail(jp, "a control character in a string"); return; }
        if (c != '\\') { out[n++] = (char)c; continue; }
        char e = *jp->p++;
        const char *simple = "\"\\/bfnrt", *means = "\"\\/\b\f\n\r\t";
        int k = 0;
        while (simple[k] && simple[k] != e) k++;
        if (simple[k]) { out[n++] = means[k]; continue; }
        if (e != 'u') { jp_fail(jp, "a bad escape in a string"); return; }
        uint32_t cp = jp_u4(jp);
        if (cp >= 0xD800 && cp < 0xDC00 && jp->end - jp->p >= 6 && jp->p[0] == '\\' && jp->p[1] == 'u') {
            jp->p += 2;
            uint32_t lo = jp_u4(jp);
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        }
        n += jp_utf8(out + n, cp); /* an escape is at least 6 bytes: the room is there */
    }
    jp->p++;
    v->type = JV_STRING;
    v->text = out;
    v->n = n;
}

static void jp_value(json_parser *jp, json_value *v);

/* Items (and keys) of an array or object, collected in a growing list then copied. */
static void jp_container(json_parser *jp, json_value *v, int object) {
    char close = object ? '}' : ']';
    uint32_t cap = 8, n = 0;
    json_value *items = floe_alloc(cap * sizeof *items), *keys = object ? floe_alloc(cap * sizeof *keys) : 0;
    if (++jp->depth > 64) { jp_fail(jp, "nesting deeper than 64"); return; }
    jp->p++;
    jp_space(jp);
    if (jp->p < jp->end && *jp->p == close) jp->p++;
    else for (;;) {
        if (n == cap) {
            json_value *more = floe_alloc(2 * cap * sizeof *more), *more_keys = 0;
            if (!more) { jp_fail(jp, "out of memory"); return; }
            __builtin_memcpy(more, items, n * sizeof *more);
            if (object) {
                more_keys = floe_alloc(2 * cap * sizeof *more_keys);
                if (!more_keys) { jp_fail(jp, "out of memory"); return; }
                __builtin_memcpy(more_keys, keys, n * sizeof *more_keys);
            }
            items = more, keys = more_keys, cap *= 2;
        }
        if (object) {
            jp_space(jp);
            if (jp->p >= jp->end || *jp->p != '"') { jp_fail(jp, "an object key that is not a string"); return; }
            jp_string(jp, &keys[n]);
            jp_space(jp);
            if (jp->p >= jp->end || *jp->p != ':') { jp_fail(jp, "a key without ':'"); return; }
            jp->p++;
        }
        jp_value(jp, &items[n++]);
        if (jp->error) return;
        jp_space(jp);
        if (jp->p < jp->end && *jp->p == ',') { jp->p++; continue; }
        if (jp->p < jp->end && *jp->p == close) { jp->p++; break; }
        jp_fail(jp, object ? "an object without ',' or '}'" : "an array without ',' or ']'");
        return;
    }
    jp->depth--;
    v->type = object ? JV_OBJECT : JV_ARRAY;
    v->n = n;
    v->items = items;
    v->keys = keys;
}

static int jp_word(json_parser *jp, const char *w) {
    size_t n = floe_strlen(w);
    if ((size_t)(jp->end - jp->p) < n || mem_cmp(jp->p, w, n)) return 0;
    jp->p += n;
    return 1;
}

static void jp_number(json_parser *jp, json_value *v) {
    const char *s = jp->p;
    if (jp->p < jp->end && *jp->p == '-') jp->p++;
    int digits = 0;
    while (jp->p < jp->end && ((*jp->p >= '0' && *jp->p <= '9') || *jp->p == '.' || *jp->p == 'e' ||
                               *jp->p == 'E' || *jp->p == '+' || *jp->p == '-')) {
        digits += *jp->p >= '0' && *jp->p <= '9';
        jp->p++;
    }
    if (!digits) { jp_fail(jp, "not a JSON value"); return; }
    v->type = JV_NUMBER;
    v->text = s;
    v->n = (uint32_t)(jp->p - s);
}

static void jp_value(json_parser *jp, json_value *v) {
    jp_space(jp);
    __builtin_memset(v, 0, sizeof *v);
    if (jp->p >= jp->end) { jp_fail(jp, "the text ends before a value"); return; }
    char c = *jp->p;
    if (c == '{' || c == '[') jp_container(jp, v, c == '{');
    else if (c == '"') jp_string(jp, v);
    else if (jp_word(jp, "null")) v->type = JV_NULL;
    else if (jp_word(jp, "true")) v->type = JV_TRUE;
    else if (jp_word(jp, "false")) v->type = JV_FALSE;
    else jp_number(jp, v);
}

/* Parses the whole of text[0, len); NULL (and *error set) if it is not one JSON value. */
static json_value *json_parse(const char *text, uint32_t len, const char **error) {
    json_parser jp = {text, text + len, 0, 0};
    json_value *v = floe_alloc(sizeof *v);
    if (!v) { *error = "out of memory"; return 0; }
    jp_value(&jp, v);
    jp_space(&jp);
    if (!jp.error && jp.p != jp.end) jp_fail(&jp, "text after the JSON value");
    *error = jp.error;
    return jp.error ? 0 : v;
}

static const json_value *json_get(const json_value *obj, const char *key) {
    if (!obj || obj->type != JV_OBJECT) return 0;
    size_t n = floe_strlen(key);
    for (uint32_t i = 0; i < obj->n; i++)
        if (obj->keys[i].n == n && !mem_cmp(obj->keys[i].text, key, n)) return &obj->items[i];
    return 0;
}

/* The compact JSON text of v (no spaces; strings escaped only where JSON requires) into out, which
 * holds cap bytes; returns the full length (write again with a bigger buffer if it exceeds cap). */
static uint32_t json_write(const json_value *v, char *out, uint32_t cap) {
    uint32_t n = 0;
#define PUT(c) do { char put_ = (char)(c); if (n < cap) out[n] = put_; n++; } while (0)
    switch (v->type) {
    case JV_NULL: case JV_FALSE: case JV_TRUE: {
        const char *w = v->type == JV_NULL ? "null" : v->type == JV_TRUE ? "true" : "false";
        while (*w) PUT(*w++);
        break;
    }
    case JV_NUMBER:
        for (uint32_t i = 0; i < v->n; i++) PUT(v->text[i]);
        break;
    case JV_STRING:
        PUT('"');
        for (uint32_t i = 0; i < v->n; i++) {
            unsigned char c = (unsigned char)v->text[i];
            if (c == '"' || c == '\\') { PUT('\\'); PUT(c); }
            else if (c < 0x20) {
                PUT('\\'); PUT('u'); PUT('0'); PUT('0'); PUT("0123456789abcdef"[c >> 4]); PUT("0123456789abcdef"[c & 15]);
            } else PUT(c);
        }
        PUT('"');
        break;
    default: {
        int obj = v->type == JV_OBJECT;
        PUT(obj ? '{' : '[');
        for (uint32_t i = 0; i < v->n; i++) {
            if (i) PUT(',');
            if (obj) { n += json_write(&v->keys[i], n < cap ? out + n : out, n < cap ? cap - n : 0); PUT(':'); }
            n += json_write(&v->items[i], n < cap ? out + n : out, n < cap ? cap - n : 0);
        }
        PUT(obj ? '}' : ']');
    }
    }
#undef PUT
    return n;
}

#endif
