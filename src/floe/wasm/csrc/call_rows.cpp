// floe_call_rows: one export of many guests called in one native loop (the engine loop's on_token for
// every turn of a step), holding the GIL throughout (it is called through ctypes.PyDLL). The Python
// layers around each call (arming, context managers, ctypes argument conversion) cost more than the
// call itself. Each turn's state is a row of int64 words (floe.actor.turn.TurnTable: one per KV slot;
// floe.wasm.rows.Col names them), read and written here: a row costs the store of the host's choice,
// its watchdog's deadline (armed from the row's own start: min(its message's deadline, now + bound)),
// an epoch deadline and the call; and what the guest returned is judged here (the engine loop's plain
// case: a token to append, or the token of the row in flight confirmed) and taken into the row, so
// that Python handles only the rows that are not plain (floe.actor.loop._took): a plain token goes into
// its turn's decoded ids and, where the reply streams token ids (floe.actor.stream.TokenStream), into
// the stream, charged to the message's host budget and counted as Python's stream would count it.
// The Wasmtime C API's functions come in as pointers (the library wasmtime-py loaded): no headers, no
// link. A row that fails (an error, a trap, a result that is not one i32) ends the loop: the caller
// turns it into its GuestError with the Python path's own classification and calls the rest again.
#include <time.h>

#include <cstddef>
#include <cstdint>

extern "C" {

typedef void* (*func_call_t)(void* context, const void* func, const void* args, size_t nargs,
                             void* results, size_t nresults, void** trap);
typedef void* (*func_call_unchecked_t)(void* context, const void* func, void* args_and_results,
                                       size_t n, void** trap);
typedef void (*set_deadline_t)(void* context, uint64_t ticks_beyond_current);

// Row.judged: what the returned token is for the engine loop (floe.wasm.rows, floe.actor.loop._took).
enum : int64_t {
    PLAIN = 1,      // a token in the vocabulary, not the turn's last (max_tokens), its row's own: either
                    // no row was in flight for it or the one in flight (speculated) had this token
    TAKES = 2,      // the token is the host's choice (Row.choice)
    CONFIRMED = 4,  // the row in flight had this token (nothing to append)
};
constexpr int64_t NONE = INT64_MIN;  // Row.choice / speculated / next_token: none
constexpr uintptr_t RAW_RESULTS = 1;  // (floe.wasm.raw.RAW_RESULTS)
constexpr int64_t CALL_OVERHEAD = 64;  // bytes a streamed token costs the budget beyond its text (floe.actor.budget)

// One turn's row: 32 int64 words (floe.wasm.rows.Col, in this order).
struct Row {
    void* context;       // wasmtime_context_t* of the guest's store
    const void* func;    // wasmtime_func_t* of the export
    uintptr_t results;   // wasmtime_val_t[1]: kind (uint8) at 0, the value at 8; | RAW_RESULTS once the
                         // function's type is known to be () -> i32: called unchecked, its raw i32 at 0
    int32_t* choice_at;  // where the host's choice goes before the call (null: the guest asked none)
    double* when_at;     // the guest's watchdog deadline (time.monotonic()), armed before the call (null: not)
    int64_t choice;      // the host's choice (NONE: none)
    double deadline;     // the turn's message deadline (time.monotonic())
    int64_t vocab;       // the judgement's inputs (vocab 0: not judged)
    int64_t speculated;  // the token of the turn's row in flight (NONE: none)
    int64_t generated;   // tokens the turn has generated (+1 for a plain token)
    int64_t max_tokens;
    void* error;         // out: wasmtime_error_t* or null
    void* trap;          // out: wasm_trap_t* or null
    int64_t result;      // out: the i32 the call returned
    int64_t judged;      // out: PLAIN | TAKES | CONFIRMED
    int64_t next_token;  // out for a plain token not in flight: the token (NONE: none)
    int64_t takes_choice;  // out for a plain token: it was the host's choice and the guest drew none
    int64_t refused;     // 0 once a row in flight is confirmed
    int64_t fresh;       // 0 once the guest is asked
    int64_t draws;       // the turn's steps draw its host choice
    int64_t sampled;     // set by the guest's sample() (host call) during the call; 0 before it
    int64_t streams;     // (the host streams its tokens: Python's part)
    int64_t choices;     // host choices written (+1 a call with choice_at)
    int64_t loop[9];     // the engine loop's own (floe.wasm.rows.Col.ROWS ...)
    int32_t* decoded_at;   // the turn's decoded ids (room for max_tokens): a plain token goes at n_decoded
    int64_t n_decoded;
    int32_t* stream_ids_at;  // the reply's TokenStream (null: Python streams, or nothing streams):
    int64_t* stream_n_at;    // its ids (room reserved for the turn) and their count
    const int32_t* reply_len_at;  // each token's reply bytes (the budget's charge, and whether it is text)
    int64_t room;        // the budget's room for streamed tokens: what Python had not spent at bind
    int64_t streamed;    // charged here for streamed tokens (CALL_OVERHEAD + its reply bytes each)
    int64_t emit_calls;  // streamed tokens (MessageStats.emit_calls)
    int64_t emits;       // ... of them with reply text (MessageStats.emits)
    double first_text;   // the first and last of those (CLOCK_MONOTONIC: time.perf_counter), 0: none
    double last_text;
    int64_t decoded_cap;  // the room of decoded_at and of stream_ids_at (ids): a full one is Python's
    int64_t stream_cap;
    int64_t flying;      // the engine loop's own (floe.wasm.rows.Col.FLYING)
    int64_t spare[2];
};
static_assert(sizeof(Row) == 384, "Row is 48 int64 words");

static inline int64_t judge(const Row& row, int64_t token) {
    int64_t flags = token == row.choice ? TAKES : 0;
    if (token < 0 || token >= row.vocab || row.generated + 1 >= row.max_tokens) return flags;
    if (row.decoded_at != nullptr && row.n_decoded >= row.decoded_cap) return flags;
    if (row.stream_n_at != nullptr && (*row.stream_n_at >= row.stream_cap
                                       || row.streamed + CALL_OVERHEAD + row.reply_len_at[token] > row.room))
        return flags;  // (full, or past the budget: Python's path grows it, or its stream raises the error)
    if (row.speculated == NONE) return flags | PLAIN;
    return token == row.speculated ? (flags | PLAIN | CONFIRMED) : flags;
}

static inline double monotonic() {  // (CLOCK_MONOTONIC: Python's time.monotonic() and perf_counter() on Linux)
    timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

// A plain token taken: into the turn's decoded ids, and streamed where its reply streams ids natively.
static inline void take(Row& row, int64_t token) {
    if (row.decoded_at != nullptr) row.decoded_at[row.n_decoded++] = static_cast<int32_t>(token);
    if (row.stream_n_at == nullptr) return;
    const int64_t bytes = row.reply_len_at[token];
    row.streamed += CALL_OVERHEAD + bytes;
    const int64_t n = *row.stream_n_at;
    row.stream_ids_at[n] = static_cast<int32_t>(token);
    *row.stream_n_at = n + 1;
    ++row.emit_calls;
    if (bytes > 0) {
        ++row.emits;
        row.last_text = monotonic();
        if (row.first_text == 0.0) row.first_text = row.last_text;
    }
}

// hold_gil.cpp's: this thread's innermost GIL-holding guest call (these calls hold it throughout: none
// of them may let it go at a tick, as floe_call_holding's do).
struct Holding {
    bool active;
    void* saved;
};
extern thread_local Holding floe_holding;

static int64_t call_slots(Row* table, const int64_t* slots, int64_t n, func_call_t call,
                          func_call_unchecked_t call_unchecked, set_deadline_t set_deadline, int64_t i32_kind,
                          double bound);

// Call rows table[slots[k]] for k in [0, n): the index of the first that failed, or n.
__attribute__((visibility("default")))
int64_t floe_call_slots(Row* table, const int64_t* slots, int64_t n, func_call_t call,
                        func_call_unchecked_t call_unchecked, set_deadline_t set_deadline, int64_t i32_kind,
                        double bound) {
    const Holding outer = floe_holding;
    floe_holding = Holding{false, nullptr};
    const int64_t done = call_slots(table, slots, n, call, call_unchecked, set_deadline, i32_kind, bound);
    floe_holding = outer;
    return done;
}

static int64_t call_slots(Row* table, const int64_t* slots, int64_t n, func_call_t call,
                          func_call_unchecked_t call_unchecked, set_deadline_t set_deadline, int64_t i32_kind,
                          double bound) {
    alignas(16) static thread_local unsigned char no_args[32];  // (a valid pointer for zero arguments)
    for (int64_t k = 0; k < n; ++k) {
        Row& row = table[slots[k]];
        row.fresh = 0;
        row.sampled = 0;
        if (row.choice_at != nullptr) {
            *row.choice_at = static_cast<int32_t>(row.choice);
            ++row.choices;
        }
        if (row.when_at != nullptr) {
            const double until = monotonic() + bound;
            *row.when_at = until < row.deadline ? until : row.deadline;
        }
        set_deadline(row.context, 1);  // the next epoch tick asks the guest's watchdog
        void* trap = nullptr;
        int64_t token;
        if (row.results & RAW_RESULTS) {  // (its type known: Wasmtime's check at each call skipped)
            void* raw = reinterpret_cast<void*>(row.results & ~RAW_RESULTS);
            row.error = call_unchecked(row.context, row.func, raw, 1, &trap);
            token = *static_cast<const int32_t*>(raw);
        } else {
            void* results = reinterpret_cast<void*>(row.results);
            row.error = call(row.context, row.func, no_args, 0, results, 1, &trap);
            const unsigned char* value = static_cast<const unsigned char*>(results);
            token = NONE;  // (not an i32)
            if (row.error == nullptr && trap == nullptr && value[0] == static_cast<unsigned char>(i32_kind)) {
                token = *reinterpret_cast<const int32_t*>(value + 8);
                row.results |= RAW_RESULTS;  // () -> i32, as Wasmtime just checked: unchecked from now on
            }
        }
        row.trap = trap;
        row.judged = 0;
        if (row.error != nullptr || trap != nullptr || token == NONE) return k;
        row.result = token;
        if (row.vocab <= 0) continue;
        row.judged = judge(row, token);
        if (!(row.judged & PLAIN)) continue;  // (Python's path: floe.actor.loop._took)
        ++row.generated;
        take(row, token);
        row.takes_choice = (row.judged & TAKES) && !(row.sampled && row.draws);
        if (row.judged & CONFIRMED) {
            row.speculated = NONE;
            row.refused = 0;
        } else {
            row.next_token = token;
        }
    }
    return n;
}

}  // extern "C"
