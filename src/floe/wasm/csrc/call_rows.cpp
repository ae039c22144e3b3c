// floe_call_rows: one export of many guests called in one native loop (the engine loop's on_token for
// every turn of a step), holding the GIL throughout (it is called through ctypes.PyDLL). The Python
// layers around each call (arming, context managers, ctypes argument conversion) cost more than the
// call itself; here a row costs a store of the host's choice, an epoch deadline and the call.
// The Wasmtime C API's functions come in as pointers (the library wasmtime-py loaded): no headers, no
// link. A row that fails (an error, a trap, a result that is not one i32) ends the loop: the caller
// turns it into its GuestError with the Python path's own classification and calls the rest again.
#include <cstddef>
#include <cstdint>

extern "C" {

typedef void* (*func_call_t)(void* context, const void* func, const void* args, size_t nargs,
                             void* results, size_t nresults, void** trap);
typedef void (*set_deadline_t)(void* context, uint64_t ticks_beyond_current);

// One guest's call: 8 int64s (numpy's view of the rows is an (n, 8) int64 array).
struct Row {
    void* context;       // wasmtime_context_t* of the guest's store
    const void* func;    // wasmtime_func_t* of the export
    void* results;       // wasmtime_val_t[1]: kind (uint8) at 0, the value at 8
    int32_t* choice_at;  // where the host's choice goes before the call (null: the guest asked none)
    int64_t choice;
    void* error;         // out: wasmtime_error_t* or null
    void* trap;          // out: wasm_trap_t* or null
    int64_t result;      // out: the i32 the call returned
};
static_assert(sizeof(Row) == 64, "Row is 8 int64s");

__attribute__((visibility("default")))
int64_t floe_call_rows(Row* rows, int64_t n, func_call_t call, set_deadline_t set_deadline,
                       int64_t i32_kind) {
    alignas(16) static thread_local unsigned char no_args[32];  // (a valid pointer for zero arguments)
    for (int64_t i = 0; i < n; ++i) {
        Row& row = rows[i];
        if (row.choice_at != nullptr) *row.choice_at = static_cast<int32_t>(row.choice);
        set_deadline(row.context, 1);  // the next epoch tick asks the guest's watchdog
        void* trap = nullptr;
        row.error = call(row.context, row.func, no_args, 0, row.results, 1, &trap);
        row.trap = trap;
        if (row.error != nullptr || trap != nullptr) return i;
        const unsigned char* value = static_cast<const unsigned char*>(row.results);
        if (value[0] != static_cast<unsigned char>(i32_kind)) return i;
        row.result = *reinterpret_cast<const int32_t*>(value + 8);
    }
    return n;
}

}  // extern "C"
