// floe's own thread pool for its CPU operators (gemv_q, dequant_q, attend), whichever Python thread
// calls them.
//
// Why not at::parallel_for (OpenMP): each thread that enters an OpenMP parallel region gets a team of
// its own, and once libgomp manages more threads than the process has CPUs it stops spinning between
// regions, so each of a decode token's ~120 regions waits for its workers to be woken by the kernel.
// An engine loop's thread beside the main thread is enough for that: decode fell from 93 to 35 tok/s
// on two cores (bench/probes/cpu_second_thread.py, docs/PERF.md). Here there is one set of workers
// for the process; the calling thread works too; workers spin a short while after a job (a token's
// next operator follows within microseconds), yield, then sleep until the next one.
//
// Work is claimed, not assigned: a job is cut into chunks taken one at a time from a shared counter,
// so a worker whose core is busy with another process delays nothing — the others take its chunks.
// Every item is computed alone and in the same way whoever takes it, so results do not depend on the
// number of threads or on who ran what.
//
// One job at a time: a second thread calling while a job runs waits for it (the operators' callers
// are serialised by the engine anyway). A job started from inside a job (not done by floe's
// operators) runs on the calling thread alone. A forked child starts from a new pool (its workers
// are made again when it first needs them).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <pthread.h>
#include <sched.h>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FLOE_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define FLOE_PAUSE() asm volatile("yield")
#else
#define FLOE_PAUSE() ((void)0)
#endif

namespace floe {

class Pool {
 public:
  using Body = std::function<void(int64_t, int64_t)>;

  // Spin this long after a job before yielding, and yield this long before sleeping.
  static constexpr auto kSpin = std::chrono::microseconds(50);
  static constexpr auto kYield = std::chrono::microseconds(1000);
  static constexpr int64_t kChunksPerThread = 4;

  static Pool& get() {
    static std::once_flag once;
    std::call_once(once, [] {
      instance() = new Pool();  // never destroyed: workers may outlive static destructors
      // A forked child has none of the workers, and may have been forked while another thread held
      // a job's locks: it starts from a new pool (the old one is left as it was, never touched).
      pthread_atfork(nullptr, nullptr, [] { instance() = new Pool(); });
    });
    return *instance();
  }

  // body(begin, end) over [0, n) in pieces of at least `grain` items (a multiple of it), on up to
  // at::get_num_threads() threads (the caller one of them).
  void run(int64_t n, int64_t grain, const Body& body) {
    if (n <= 0) return;
    grain = std::max<int64_t>(1, grain);
    const int64_t threads = std::max(1, at::get_num_threads());
    const int64_t pieces = (n + grain - 1) / grain;
    if (threads == 1 || pieces == 1 || inside_) {
      body(0, n);
      return;
    }
    std::unique_lock<std::mutex> caller(callers_);
    const int64_t helpers = std::min<int64_t>(threads, pieces) - 1;
    grow(static_cast<int>(helpers));
    int64_t chunk = (n + (helpers + 1) * kChunksPerThread - 1) / ((helpers + 1) * kChunksPerThread);
    chunk = (chunk + grain - 1) / grain * grain;
    body_ = &body;
    n_ = n;
    chunk_ = chunk;
    chunks_ = (n + chunk - 1) / chunk;
    helpers_ = helpers;
    next_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    failed_.store(false, std::memory_order_relaxed);
    const uint64_t open = generation_.load(std::memory_order_relaxed) + 1;  // odd: a job is open
    generation_.store(open, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lock(sleep_); }
      wake_.notify_all();
    }
    inside_ = true;
    work();
    inside_ = false;
    for (int spins = 0; done_.load(std::memory_order_acquire) < chunks_; ++spins) {
      if (spins < 4096) {
        FLOE_PAUSE();
      } else {
        std::this_thread::yield();
      }
    }
    // Close the job (even generation), then wait until no worker still reads its fields.
    generation_.store(open + 1, std::memory_order_seq_cst);
    while (busy_.load(std::memory_order_seq_cst) > 0) FLOE_PAUSE();
    body_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  Pool() = default;

  static Pool*& instance() {
    static Pool* pool = nullptr;
    return pool;
  }

  void grow(int helpers) {
    while (static_cast<int>(workers_.size()) < helpers) {
      const int index = static_cast<int>(workers_.size());
      workers_.emplace_back([this, index] { loop(index); });
      workers_.back().detach();
    }
  }

  // Take chunks until none is left.
  void work() {
    for (;;) {
      const int64_t c = next_.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks_) return;
      const int64_t begin = c * chunk_;
      if (!failed_.load(std::memory_order_relaxed)) {
        try {
          (*body_)(begin, std::min(n_, begin + chunk_));
        } catch (...) {
          std::lock_guard<std::mutex> lock(sleep_);
          if (!failed_.exchange(true)) error_ = std::current_exception();
        }
      }
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void loop(int index) {
    inside_ = true;  // a job's body that starts a job runs it alone
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t now = wait(seen);
      seen = now;
      if ((now & 1) == 0) continue;  // closed already: wait for the next
      busy_.fetch_add(1, std::memory_order_seq_cst);
      if (generation_.load(std::memory_order_seq_cst) == now && index < helpers_) work();
      busy_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  // The generation once it differs from `seen`: spin, then yield, then sleep.
  uint64_t wait(uint64_t seen) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0;; ++i) {
      const uint64_t now = generation_.load(std::memory_order_acquire);
      if (now != seen) return now;
      if ((i & 255) != 255) {
        FLOE_PAUSE();
        continue;
      }
      const auto waited = std::chrono::steady_clock::now() - start;
      if (waited < kSpin) continue;
      if (waited < kSpin + kYield) {
        sched_yield();
        continue;
      }
      std::unique_lock<std::mutex> lock(sleep_);
      sleeping_.fetch_add(1, std::memory_order_seq_cst);
      wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
      sleeping_.fetch_sub(1, std::memory_order_seq_cst);
      return generation_.load(std::memory_order_acquire);
    }
  }

  static inline thread_local bool inside_ = false;

  std::mutex callers_;  // one job at a time
  std::mutex sleep_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> busy_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> done_{0};
  // The open job (written only while no worker reads them: between a close and the next open).
  const Body* body_ = nullptr;
  int64_t n_ = 0, chunk_ = 1, chunks_ = 0;
  int64_t helpers_ = 0;
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;  // the first exception a chunk threw (rethrown to the caller)
};

// at::parallel_for's contract on floe's pool.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end <= begin) return;
  Pool::get().run(end - begin, grain, [&](int64_t b, int64_t e) { f(begin + b, begin + e); });
}

}  // namespace floe
