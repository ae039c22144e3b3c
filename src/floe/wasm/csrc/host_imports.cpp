// floe_host_imports: the host ABI's imports a chat's arrival and its end call, answered natively
// (floe.actor.native_imports): request, system, eos_ids, choice_at, stream_tokens, detokenize,
// kv_truncate and prefill (taken by Python after the call), and chat_render and tokenize of the
// conversation of the thread's prompt hint. Each is a Wasmtime unchecked host function whose
// env is an Import (its actor's State and the key of its Python twin in floe.wasm.raw.HostFunctions).
// Only the plain case is answered here, exactly as floe.actor.abi.HostABI answers it: every pointer
// aligned and inside the guest's memory, the message's budget not exceeded, its deadline not past, the
// actor's State staged for this guest call. Anything else (a bad argument, an error to raise, a state
// not staged) is handed to the Python twin, which answers it as it always did: errors, their messages
// and the budget's accounting come from one place. What the native answers charge (the budget's bytes,
// the ledger's copies, choice_at's and stream_tokens' settings) is kept in the State until Python
// takes it (NativeImports.fold), before any Python import runs and after the guest call.
// No Python API and no Wasmtime header: the Python twin's trampoline comes in as a pointer.
#include <time.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

extern "C" {

typedef void* (*trampoline_t)(void* env, void* caller, uint64_t* raw, size_t n);  // -> wasm_trap_t*
typedef void (*finalizer_t)(void* env);

constexpr int64_t CALL_OVERHEAD = 64;  // bytes a host call costs the budget beyond its data (floe.actor.budget)
constexpr int64_t MAX_IDS_PER_CALL = 1 << 16;  // detokenize (floe.actor.abi)
constexpr uint64_t MASK32 = 0xFFFFFFFFu;

// The ledger's boundaries the native answers cross (floe.actor.native_imports.BOUNDARIES, in order).
enum Boundary {
    REQUEST, SYSTEM_PROMPT, EOS_IDS, TOKEN_IDS_IN, TEXT_OUT, MESSAGE_TABLE, MESSAGE_ROLE, MESSAGE, PROMPT_TEXT,
    TEXT_IN, TOKEN_IDS_OUT, PROMPT_IDS_SHARED, N_BOUNDARIES
};

// An actor's state: int64 words (floe.actor.native_imports.W names them, in this order).
struct State {
    int64_t on;              // staged for the guest call under way (0: every import goes to Python)
    uint8_t* base;           // the guest memory's first byte
    const int64_t* size_at;  // its accessible size (floe.memory.Region's size word)
    const double* when_at;   // the call's deadline (time.monotonic(): floe.wasm.watchdog)
    int64_t room;            // budget bytes the message has left (its limit less what it spent)
    int64_t charged;         // out: bytes charged here since Python last took them
    int64_t preparing_v2;    // ABI v2 inside on_message: choice_at and stream_tokens may be asked
    const uint8_t* request;  // the message's request record (floe.actor.abi.REQUEST), or null
    int64_t request_len;
    const uint8_t* system;   // the system prompt's bytes
    int64_t system_len;
    const int32_t* eos;      // the tokenizer's EOS ids
    int64_t eos_n;
    const int64_t* token_end;  // token i's bytes: token_bytes[token_end[i - 1] .. token_end[i]) (i >= 0)
    const uint8_t* token_bytes;
    int64_t vocab;           // ids answered (0: detokenize goes to Python)
    int64_t choice_set;      // out: choice_at answered here (choice_ptr: its pointer, 0 for none)
    int64_t choice_ptr;
    int64_t streams_set;     // out: stream_tokens answered here (streams: its flag)
    int64_t streams;
    trampoline_t python;     // the Python twins' trampoline (HostFunctions' _call)
    finalizer_t forget;      // and their finalizer (HostFunctions' _forget)
    int64_t text_cap;        // the most text one tokenize or chat_render takes (HostABI.text_cap)
    int64_t max_seq;         // the engine's context
    int64_t hint_n;          // the messages of this thread's prompt hint (floe.model.tokenizer.Hint; -1: none)
    const int64_t* hint_ends;  // message i's role ends at hint_ends[2i] in hint_text, its content at [2i + 1]
    const uint8_t* hint_text;
    const uint8_t* rendered;   // the hint's render (UTF-8) and its ids
    int64_t rendered_len;
    const int32_t* hint_ids;
    int64_t hint_ids_n;
    int64_t rendered_set;    // in and out: the last chat_render of this call answered the hint's render
    int64_t hint_used;       // out: renders and encodes the hint answered here
    int64_t kv_len;          // the slot's tokens (-1: no slot: kv_truncate and prefill go to Python)
    int64_t kv_holds;        // the slot holds ids for reuse (prefill goes to Python)
    int64_t queued;          // prompt ids queued in Python
    int32_t* prefill_at;     // room for prefill_cap ids queued here
    int64_t prefill_cap;
    int64_t prefill_n;       // out: ids queued here (0: none), and where their logits go
    int64_t prefill_logits;
    int64_t truncate_n;      // out: the KV length kv_truncate asked here (-1: none)
    int64_t touched;         // out: bit b set where ledger[b] counts something
    int64_t ledger[2 * N_BOUNDARIES];  // out: calls and bytes per boundary since Python last took them
    std::atomic<int64_t> refs;  // the imports that still point here (the last one's finalizer frees it)
};

// One import's env.
struct Import {
    State* state;
    int64_t key;  // its Python twin's (HostFunctions' table)
};

static inline double monotonic() {  // (CLOCK_MONOTONIC: Python's time.monotonic() on Linux)
    timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

static inline int64_t as_i32(uint64_t word) { return (int64_t)(int32_t)(uint32_t)(word & MASK32); }

static inline bool ready(const State* s) { return s->on && monotonic() <= *s->when_at; }

// Whether [offset, offset + length) lies in the guest's accessible bytes (floe.memory.Region.check).
static inline bool inside(const State* s, int64_t offset, int64_t length) {
    return offset >= 0 && length >= 0 && offset + length <= *s->size_at;
}

static inline void record(State* s, Boundary b, int64_t nbytes, int64_t calls = 1) {
    s->ledger[2 * b] += calls;
    s->ledger[2 * b + 1] += nbytes;
    s->touched |= int64_t(1) << b;
}

static inline void* python(Import* im, void* caller, uint64_t* raw, size_t n) {
    return im->state->python((void*)im->key, caller, raw, n);
}

static inline void* answer(uint64_t* raw, int64_t result) {
    raw[0] = (uint64_t)result & MASK32;
    return nullptr;
}

// _write(ptr, cap, data, what): min(cap, len) bytes written, cap bytes checked, charged and recorded.
static bool write_bytes(State* s, int64_t ptr, int64_t cap, const uint8_t* data, int64_t len, Boundary b,
                        int64_t already) {
    int64_t n = cap < len ? cap : len;
    if (CALL_OVERHEAD + n + already > s->room || !inside(s, ptr, cap)) return false;
    if (n) std::memcpy(s->base + ptr, data, (size_t)n);
    s->room -= CALL_OVERHEAD + n;
    s->charged += CALL_OVERHEAD + n;
    record(s, b, n);
    return true;
}

__attribute__((visibility("default"))) void* floe_import_request(void* env, void* caller, uint64_t* raw,
                                                                 size_t n) {
    Import* im = (Import*)env;
    State* s = im->state;
    int64_t ptr = (int64_t)(raw[0] & MASK32);
    if (!ready(s) || !s->request || ptr % 8 || !write_bytes(s, ptr, s->request_len, s->request, s->request_len,
                                                            REQUEST, 0))
        return python(im, caller, raw, n);
    return answer(raw, 0);
}

__attribute__((visibility("default"))) void* floe_import_system(void* env, void* caller, uint64_t* raw,
                                                                size_t n) {
    Import* im = (Import*)env;
    State* s = im->state;
    int64_t ptr = (int64_t)(raw[0] & MASK32), cap = as_i32(raw[2]);
    if (!ready(s) || cap < 0 || !write_bytes(s, ptr, cap, s->system, s->system_len, SYSTEM_PROMPT, 0))
        return python(im, caller, raw, n);
    return answer(raw, s->system_len);
}

__attribute__((visibility("default"))) void* floe_import_eos_ids(void* env, void* caller, uint64_t* raw,
                                                                 size_t n) {
    Import* im = (Import*)env;
    State* s = im->state;
    int64_t ptr = (int64_t)(raw[0] & MASK32), cap = as_i32(raw[2]);
    if (!ready(s) || cap < 0 || ptr % 4) return python(im, caller, raw, n);
    int64_t k = cap < s->eos_n ? cap : s->eos_n;
    if (CALL_OVERHEAD + 4 * k > s->room || !inside(s, ptr, 4 * cap)) return python(im, caller, raw, n);
    if (k) std::memcpy(s->base + ptr, s->eos, (size_t)(4 * k));
    s->room -= CALL_OVERHEAD + 4 * k;
    s->charged += CALL_OVERHEAD + 4 * k;
    record(s, EOS_IDS, 4 * k);
    return answer(raw, s->eos_n);
}

__attribute__((visibility("default"))) void* floe_import_choice_at(void* env, void* caller, uint64_t* raw,
                                                                   size_t n) {
    Import* im = (Import*)env;
    State* s = im->state;
    int64_t ptr = (int64_t)(raw[0] & MASK32);
    if (!ready(s) || !s->preparing_v2 || (ptr && (ptr % 4 || !inside(s, ptr, 4))))
        return python(im, caller, raw, n);
    s->choice_set = 1;
    s->choice_ptr = ptr;
    return answer(raw, 0);
}

__attribute__((visibility("default"))) void* floe_import_stream_tokens(void* env, void* caller, uint64_t* raw,
                                                                       size_t n) {
    Import* im = (Import*)env;
    State* s = im->state;
    int64_t on = as_i32(raw[0]);
    if (!ready(s) || !s->preparing_v2 || (on != 0 && on != 1)) return python(im, caller, raw, n);
    s->streams_set = 1;
    s->streams = on;
    return answer(raw, 0);
}

__attribute__((visibility("default"))) void* floe_import_detokenize(void* env, void* caller, uint64_t* raw,
                                                                    size_t n) {
    Import* im = (Import*)env;
    State* s = im->state;
    int64_t ids_ptr = (int64_t)(raw[0] & MASK32), count = as_i32(raw[2]);
    int64_t out_ptr = (int64_t)(raw[4] & MASK32), out_cap = as_i32(raw[6]);
    if (!ready(s) || !s->vocab || count < 0 || out_cap < 0 || count > MAX_IDS_PER_CALL || ids_ptr % 4 ||
        !inside(s, ids_ptr, 4 * count) || CALL_OVERHEAD + 4 * count > s->room)
        return python(im, caller, raw, n);
    const int32_t* ids = (const int32_t*)(s->base + ids_ptr);
    int64_t len = 0;
    for (int64_t i = 0; i < count; i++) {
        int64_t id = ids[i];
        if (id < 0 || id >= s->vocab) return python(im, caller, raw, n);  // (ERR_BAD_TOKEN, by Python)
        len += s->token_end[id] - (id ? s->token_end[id - 1] : 0);
    }
    int64_t k = out_cap < len ? out_cap : len;
    if (CALL_OVERHEAD + 4 * count + CALL_OVERHEAD + k > s->room || !inside(s, out_ptr, out_cap))
        return python(im, caller, raw, n);
    uint8_t* out = s->base + out_ptr;
    int64_t at = 0;
    for (int64_t i = 0; i < count && at < k; i++) {
        int64_t id = ids[i], start = id ? s->token_end[id - 1] : 0, m = s->token_end[id] - start;
        if (m > k - at) m = k - at;
        std::memcpy(out + at, s->token_bytes + start, (size_t)m);
        at += m;
    }
    int64_t spent = CALL_OVERHEAD + 4 * count + CALL_OVERHEAD + k;
    s->room -= spent;
    s->charged += spent;
    record(s, TOKEN_IDS_IN, 4 * count);
    record(s, TEXT_OUT, k);
    return answer(raw, len);
}

// Lets go of a State (floe_import_state's caller, or an import's finalizer): freed by the last.
__attribute__((visibility("default"))) void floe_import_release(State* s) {
    if (s->refs.fetch_sub(1) == 1) std::free(s);
}

// chat_render(msgs, n, add_generation_prompt, out, cap) of exactly the hint's messages, with the
// generation prompt: the hint's render (Tokenizer.render_chat_spans with a hint).
__attribute__((visibility("default"))) void* floe_import_chat_render(void* env, void* caller, uint64_t* raw,
                                                                     size_t n) {
    Import* im = (Import*)env;
    State* s = im->state;
    int64_t msgs = (int64_t)(raw[0] & MASK32), count = as_i32(raw[2]), generation = (int64_t)(raw[4] & MASK32);
    int64_t out_ptr = (int64_t)(raw[6] & MASK32), out_cap = as_i32(raw[8]);
    if (!ready(s) || s->hint_n < 0 || count != s->hint_n || out_cap < 0 || count > s->max_seq || msgs % 4 ||
        !generation || !inside(s, msgs, 16 * count))
        return python(im, caller, raw, n);
    int64_t charge = CALL_OVERHEAD + 16 * count, text = 0, roles = 0, contents = 0, at = 0;
    for (int64_t i = 0; i < count; i++) {
        uint32_t r[4];  // role_ptr, role_len, content_ptr, content_len (floe.actor.abi.MESSAGE)
        std::memcpy(r, s->base + msgs + 16 * i, sizeof r);
        int64_t role_end = s->hint_ends[2 * i], content_end = s->hint_ends[2 * i + 1];
        if (r[1] != role_end - at || r[3] != content_end - role_end || !inside(s, r[0], r[1]) ||
            !inside(s, r[2], r[3]) || std::memcmp(s->base + r[0], s->hint_text + at, r[1]) ||
            std::memcmp(s->base + r[2], s->hint_text + role_end, r[3]))
            return python(im, caller, raw, n);
        at = content_end;
        roles += r[1];
        contents += r[3];
        charge += 2 * CALL_OVERHEAD + r[1] + r[3];
    }
    text = roles + contents;
    int64_t k = out_cap < s->rendered_len ? out_cap : s->rendered_len;
    charge += CALL_OVERHEAD + k;
    if (text > s->text_cap || charge > s->room || !inside(s, out_ptr, out_cap)) return python(im, caller, raw, n);
    if (k) std::memcpy(s->base + out_ptr, s->rendered, (size_t)k);
    s->room -= charge;
    s->charged += charge;
    record(s, MESSAGE_TABLE, 16 * count);
    if (count) {
        record(s, MESSAGE_ROLE, roles, count);
        record(s, MESSAGE, contents, count);
    }
    record(s, PROMPT_TEXT, k);
    s->rendered_set = 1;
    s->hint_used += 1;
    return answer(raw, s->rendered_len);
}

// tokenize(text, len, out, cap) of the render the last chat_render answered here: the hint's ids.
__attribute__((visibility("default"))) void* floe_import_tokenize(void* env, void* caller, uint64_t* raw,
                                                                  size_t n) {
    Import* im = (Import*)env;
    State* s = im->state;
    int64_t text = (int64_t)(raw[0] & MASK32), len = as_i32(raw[2]);
    int64_t out_ptr = (int64_t)(raw[4] & MASK32), out_cap = as_i32(raw[6]);
    if (!ready(s) || !s->rendered_set || len < 0 || out_cap < 0 || len > s->text_cap || len != s->rendered_len ||
        !inside(s, text, len) || out_ptr % 4 || !inside(s, out_ptr, 4 * out_cap) ||
        std::memcmp(s->base + text, s->rendered, (size_t)len))
        return python(im, caller, raw, n);
    int64_t k = out_cap < s->hint_ids_n ? out_cap : s->hint_ids_n;
    int64_t charge = CALL_OVERHEAD + len + CALL_OVERHEAD + 4 * k;
    if (charge > s->room) return python(im, caller, raw, n);
    if (k) std::memcpy(s->base + out_ptr, s->hint_ids, (size_t)(4 * k));
    s->room -= charge;
    s->charged += charge;
    record(s, TEXT_IN, len);
    record(s, TOKEN_IDS_OUT, 4 * k);
    s->hint_used += 1;
    return answer(raw, s->hint_ids_n);
}

// kv_truncate(n) in on_message before anything is queued: taken by Python at the fold (nothing reads the
// slot before it: a Python import folds first).
__attribute__((visibility("default"))) void* floe_import_kv_truncate(void* env, void* caller, uint64_t* raw,
                                                                     size_t n) {
    Import* im = (Import*)env;
    State* s = im->state;
    int64_t to = as_i32(raw[0]);
    if (!ready(s) || !s->preparing_v2 || s->kv_len < 0 || s->queued || s->prefill_n || to < 0 || to > s->kv_len)
        return python(im, caller, raw, n);
    s->truncate_n = s->kv_len = to;
    return answer(raw, 0);
}

// prefill(ids, n, logits) in on_message (ABI v2): the ids queued here, taken by Python at the fold.
__attribute__((visibility("default"))) void* floe_import_prefill(void* env, void* caller, uint64_t* raw,
                                                                 size_t n) {
    Import* im = (Import*)env;
    State* s = im->state;
    int64_t ids_ptr = (int64_t)(raw[0] & MASK32), count = as_i32(raw[2]), logits = (int64_t)(raw[4] & MASK32);
    if (!ready(s) || !s->preparing_v2 || s->kv_len < 0 || s->kv_holds || s->queued || s->prefill_n ||
        count <= 0 || count > s->prefill_cap || count > s->max_seq || CALL_OVERHEAD + 4 * count > s->room ||
        ids_ptr % 4 || !inside(s, ids_ptr, 4 * count) || s->kv_len + count > s->max_seq ||
        (logits && (logits % 4 || !inside(s, logits, 4 * s->vocab))) || !s->vocab)
        return python(im, caller, raw, n);
    const int32_t* ids = (const int32_t*)(s->base + ids_ptr);
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= s->vocab) return python(im, caller, raw, n);  // (ERR_BAD_TOKEN, by Python)
    std::memcpy(s->prefill_at, ids, (size_t)(4 * count));
    s->prefill_n = count;
    s->prefill_logits = logits;
    s->room -= CALL_OVERHEAD + 4 * count;
    s->charged += CALL_OVERHEAD + 4 * count;
    record(s, PROMPT_IDS_SHARED, 4 * count);
    return answer(raw, 0);
}

// An import's finalizer (Wasmtime drops it with its store): its Python twin forgotten, and the State
// freed with the last of its imports.
__attribute__((visibility("default"))) void floe_import_finalize(void* env) {
    Import* im = (Import*)env;
    State* s = im->state;
    s->forget((void*)im->key);
    std::free(im);
    floe_import_release(s);
}

// A State for an actor's imports (zeroed: not staged), held by its caller (floe_import_release) and
// by each import made for it: freed when the last of them lets go.
__attribute__((visibility("default"))) State* floe_import_state() {
    State* s = (State*)std::calloc(1, sizeof(State));
    if (s) s->refs.store(1);
    return s;
}

__attribute__((visibility("default"))) Import* floe_import_env(State* s, int64_t key) {
    Import* im = (Import*)std::malloc(sizeof(Import));
    if (im) {
        im->state = s;
        im->key = key;
        s->refs.fetch_add(1);
    }
    return im;
}

__attribute__((visibility("default"))) int64_t floe_import_state_words() { return sizeof(State) / 8; }

}  // extern "C"
