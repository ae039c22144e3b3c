// floe_call_holding: a guest call that holds the GIL until its first epoch tick, then lets it go for the
// rest of the call (floe.wasm.raw.PreparedCall, hold_gil=HOLD_TO_A_TICK). Called through ctypes.PyDLL,
// so it starts holding the GIL. A call that releases it (ctypes.CDLL) hands the GIL to any waiting thread
// at each crossing: the call itself, and each host call's entry into Python and return from it; during
// a burst of arrivals each crossing of an on_message waited behind the engine loop and the other
// arrivals to take it back. Held through a short call, there are none; a long call (a runaway guest)
// still lets other threads run after its first tick, as a released call does from its start: floe_tick,
// the store's epoch deadline callback, calls the watchdog's own (Python: the deadline, a cancellation)
// and then, in such a call still holding the GIL, lets it go; floe_call_holding takes it back when the
// call returns. The GIL's functions come in as pointers (ctypes.pythonapi's): no Python headers.
#include <atomic>
#include <cstddef>
#include <cstdint>

extern "C" {

typedef void* (*func_call_t)(void* context, const void* func, const void* args, size_t nargs,
                             void* results, size_t nresults, void** trap);
typedef void* (*func_call_unchecked_t)(void* context, const void* func, void* args_and_results,
                                       size_t n, void** trap);
typedef size_t (*tick_t)(void* context, void* env, uint64_t* delta, uint8_t* kind);
typedef void* (*save_thread_t)();
typedef void (*restore_thread_t)(void* thread_state);
typedef int (*gil_check_t)();

static save_thread_t save_thread = nullptr;      // PyEval_SaveThread
static restore_thread_t restore_thread = nullptr;  // PyEval_RestoreThread
static gil_check_t gil_check = nullptr;          // PyGILState_Check

// The innermost guest call of this thread made holding the GIL: whether it is a floe_call_holding (it
// lets the GIL go at a tick), and the thread state it let go of the GIL with (null: it holds the GIL, or
// never did). A call that holds the GIL throughout (floe_call_held, the engine loop's floe_call_slots)
// sets it inactive for its own duration: inside an actor's message a host call may make one (an on_text
// callback's send to another actor runs that actor's on_end so), and a tick in it must not let go of a
// GIL its caller (ctypes, PYFUNCTYPE) expects held at the return.
struct Holding {
    bool active;
    void* saved;
};
thread_local Holding floe_holding{false, nullptr};  // (call_rows.cpp's floe_call_slots sets it too)
static std::atomic<int64_t> let_go{0};  // calls that let the GIL go at a tick (tests, probes)

__attribute__((visibility("default")))
void floe_gil_functions(void* save, void* restore, void* check) {
    save_thread = reinterpret_cast<save_thread_t>(save);
    restore_thread = reinterpret_cast<restore_thread_t>(restore);
    gil_check = reinterpret_cast<gil_check_t>(check);
}

// The epoch deadline callback of every store (env: the watchdog's own callback).
__attribute__((visibility("default")))
size_t floe_tick(void* context, void* env, uint64_t* delta, uint8_t* kind) {
    const size_t error = reinterpret_cast<tick_t>(env)(context, nullptr, delta, kind);
    if (error == 0 && floe_holding.active && floe_holding.saved == nullptr && gil_check()) {
        floe_holding.saved = save_thread();
        let_go.fetch_add(1, std::memory_order_relaxed);
    }
    return error;
}

static inline void* end(const Holding& outer, void* error) {
    if (floe_holding.saved != nullptr) restore_thread(floe_holding.saved);
    floe_holding = outer;  // (a call from a host call of another: the outer one's state again)
    return error;
}

__attribute__((visibility("default")))
void* floe_call_holding(func_call_t call, void* context, const void* func, const void* args, size_t nargs,
                        void* results, size_t nresults, void** trap) {
    const Holding outer = floe_holding;
    floe_holding = Holding{true, nullptr};
    return end(outer, call(context, func, args, nargs, results, nresults, trap));
}

__attribute__((visibility("default")))
void* floe_call_holding_unchecked(func_call_unchecked_t call, void* context, const void* func,
                                  void* args_and_results, size_t n, void** trap) {
    const Holding outer = floe_holding;
    floe_holding = Holding{true, nullptr};
    return end(outer, call(context, func, args_and_results, n, trap));
}

// The same calls holding the GIL throughout (hold_gil=True): never let go at a tick.
__attribute__((visibility("default")))
void* floe_call_held(func_call_t call, void* context, const void* func, const void* args, size_t nargs,
                     void* results, size_t nresults, void** trap) {
    const Holding outer = floe_holding;
    floe_holding = Holding{false, nullptr};
    void* error = call(context, func, args, nargs, results, nresults, trap);
    floe_holding = outer;
    return error;
}

__attribute__((visibility("default")))
void* floe_call_held_unchecked(func_call_unchecked_t call, void* context, const void* func,
                               void* args_and_results, size_t n, void** trap) {
    const Holding outer = floe_holding;
    floe_holding = Holding{false, nullptr};
    void* error = call(context, func, args_and_results, n, trap);
    floe_holding = outer;
    return error;
}

__attribute__((visibility("default")))
int64_t floe_gil_let_go() {
    return let_go.load(std::memory_order_relaxed);
}

}  // extern "C"
