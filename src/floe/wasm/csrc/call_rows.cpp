// floe_call_rows: one export of many guests called in one native loop (the engine loop's on_token for
// every turn of a step), holding the GIL throughout (it is called through ctypes.PyDLL). The Python
// layers around each call (arming, context managers, ctypes argument conversion) cost more than the
// call itself; here a row costs a store of the host's choice, its deadline (the watchdog's, armed here
// from the row's own start: min(its message's deadline, now + bound)), an epoch deadline and the call, and what
// the guest returned is judged here too (the engine loop's plain case: a token to append, or the
// speculated token confirmed), so that Python handles only the rows that are not plain.
// The Wasmtime C API's functions come in as pointers (the library wasmtime-py loaded): no headers, no
// link. A row that fails (an error, a trap, a result that is not one i32) ends the loop: the caller
// turns it into its GuestError with the Python path's own classification and calls the rest again.
#include <time.h>

#include <cstddef>
#include <cstdint>

extern "C" {

typedef void* (*func_call_t)(void* context, const void* func, const void* args, size_t nargs,
                             void* results, size_t nresults, void** trap);
typedef void (*set_deadline_t)(void* context, uint64_t ticks_beyond_current);

// Row.judged: what the returned token is for the engine loop (floe.wasm.rows, floe.actor.loop._took).
enum : int64_t {
    PLAIN = 1,      // a token in the vocabulary, not the turn's last (max_tokens), its row's own: either
                    // no row was in flight for it or the one in flight (speculated) had this token
    TAKES = 2,      // the token is the host's choice (Row.choice)
    CONFIRMED = 4,  // the row in flight had this token (nothing to append)
};
constexpr int64_t NONE = INT64_MIN;  // Row.choice / Row.speculated: none

// One guest's call: 16 int64s (numpy's view of the rows is an (n, 16) int64 array). The first five
// are fixed for a turn (floe.wasm.rows.heads), the next six its step's inputs, the last five out.
struct Row {
    void* context;       // wasmtime_context_t* of the guest's store
    const void* func;    // wasmtime_func_t* of the export
    void* results;       // wasmtime_val_t[1]: kind (uint8) at 0, the value at 8
    int32_t* choice_at;  // where the host's choice goes before the call (null: the guest asked none)
    double* when_at;     // the guest's watchdog deadline (time.monotonic()), armed before the call (null: not)
    int64_t choice;      // the host's choice (NONE: none)
    double deadline;     // the row's message deadline (time.monotonic())
    int64_t vocab;       // the judgement's inputs (vocab 0: not judged)
    int64_t speculated;  // the token of the turn's row in flight (NONE: none)
    int64_t generated;   // tokens the turn has generated
    int64_t max_tokens;
    void* error;         // out: wasmtime_error_t* or null
    void* trap;          // out: wasm_trap_t* or null
    int64_t result;      // out: the i32 the call returned
    int64_t judged;      // out: PLAIN | TAKES | CONFIRMED
    int64_t reserved;
};
static_assert(sizeof(Row) == 128, "Row is 16 int64s");

static inline int64_t judge(const Row& row, int64_t token) {
    int64_t flags = token == row.choice ? TAKES : 0;
    if (token < 0 || token >= row.vocab || row.generated + 1 >= row.max_tokens) return flags;
    if (row.speculated == NONE) return flags | PLAIN;
    return token == row.speculated ? (flags | PLAIN | CONFIRMED) : flags;
}

__attribute__((visibility("default")))
int64_t floe_call_rows(Row* rows, int64_t n, func_call_t call, set_deadline_t set_deadline,
                       int64_t i32_kind, double bound) {
    alignas(16) static thread_local unsigned char no_args[32];  // (a valid pointer for zero arguments)
    for (int64_t i = 0; i < n; ++i) {
        Row& row = rows[i];
        if (row.choice_at != nullptr) *row.choice_at = static_cast<int32_t>(row.choice);
        if (row.when_at != nullptr) {  // (CLOCK_MONOTONIC: Python's time.monotonic() on Linux)
            timespec now;
            clock_gettime(CLOCK_MONOTONIC, &now);
            double until = static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec) + bound;
            *row.when_at = until < row.deadline ? until : row.deadline;
        }
        set_deadline(row.context, 1);  // the next epoch tick asks the guest's watchdog
        void* trap = nullptr;
        row.error = call(row.context, row.func, no_args, 0, row.results, 1, &trap);
        row.trap = trap;
        if (row.error != nullptr || trap != nullptr) return i;
        const unsigned char* value = static_cast<const unsigned char*>(row.results);
        if (value[0] != static_cast<unsigned char>(i32_kind)) return i;
        row.result = *reinterpret_cast<const int32_t*>(value + 8);
        row.judged = row.vocab > 0 ? judge(row, row.result) : 0;
    }
    return n;
}

}  // extern "C"
