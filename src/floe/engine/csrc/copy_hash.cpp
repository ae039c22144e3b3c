// Copy tensors' bytes into place and hash each one (XXH3-128) on the way, on several threads at
// once, without Python's GIL: floe.engine.copyhash calls `floe_copy_hash_start` and `_join` through
// ctypes. The threads are this library's own (a pool kept for the process), so the caller's thread
// never waits for a GIL that another Python thread holds (on the H200's host each such hand-over
// cost up to milliseconds) nor for threads to start.
//
// A tensor is a list of pieces (source, destination, length) whose concatenation is its bytes; each
// tensor is taken by one thread, which works in 256 KB steps: it hashes the step's source bytes
// (bringing them into its cache) and copies them from there with non-temporal stores, so memory
// sees one read of the source and one write of the destination (a plain copy would also read the
// destination first). A destination of 0 only hashes. `done[t]` becomes 1 (release order, after
// the stores are visible) once tensor t is in place and its digest written, so a caller can start
// using it while the other tensors are still copying.
// third_party/xxhash/xxhash.h is the xxHash library (BSD 2-clause, see its LICENSE), included whole.

#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr uint64_t kStep = 256 * 1024;
// A job of at most this many bytes copies with plain stores: its destination stays in the caches
// (a small context's KV, read by the next decode step) and the stores cost less than non-temporal
// ones, which go to memory (a 7 MB thaw: ~3x the time of a plain copy of the same bytes).
constexpr uint64_t kCachedBytes = 8 << 20;

struct Job {
  int64_t n_tensors;
  const int64_t *first_piece;  // [n_tensors + 1]: tensor t owns pieces first_piece[t] .. [t + 1] - 1
  const uint64_t *src, *dst, *len;
  int hash;
  int cached;  // total <= kCachedBytes: plain stores
  uint64_t *digests;  // [2 * n_tensors]: high 64 bits, low 64 bits
  int32_t *done;      // [n_tensors]
  std::atomic<int64_t> next{0};
};

// dst <- src, bypassing the caches for the bulk (aligned 32-byte non-temporal stores).
void stream_copy(char *dst, const char *src, uint64_t n) {
#if defined(__AVX2__)
  uint64_t i = (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31;
  if (i > n) i = n;
  std::memcpy(dst, src, i);
  for (; i + 128 <= n; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + i + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i *>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i *>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i *>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i *>(dst + i + 96), d);
  }
  std::memcpy(dst + i, src + i, n - i);
#else
  std::memcpy(dst, src, n);
#endif
}

void work(Job *job) {
  XXH3_state_t state;
  for (;;) {
    const int64_t t = job->next.fetch_add(1);
    if (t >= job->n_tensors) return;
    XXH3_128bits_reset(&state);
    for (int64_t p = job->first_piece[t]; p < job->first_piece[t + 1]; ++p) {
      const char *src = reinterpret_cast<const char *>(job->src[p]);
      char *dst = reinterpret_cast<char *>(job->dst[p]);
      for (uint64_t at = 0; at < job->len[p]; at += kStep) {
        const uint64_t n = job->len[p] - at < kStep ? job->len[p] - at : kStep;
        if (job->hash) XXH3_128bits_update(&state, src + at, n);
        if (dst && job->cached) {
          std::memcpy(dst + at, src + at, n);
        } else if (dst) {
          stream_copy(dst + at, src + at, n);
        }
      }
    }
#if defined(__AVX2__)
    _mm_sfence();  // the non-temporal stores are visible before the flag says so
#endif
    const XXH128_hash_t h = XXH3_128bits_digest(&state);
    job->digests[2 * t] = h.high64;
    job->digests[2 * t + 1] = h.low64;
    __atomic_store_n(&job->done[t], 1, __ATOMIC_RELEASE);
  }
}

// Threads that live as long as the process and run one job at a time.
class Pool {
 public:
  explicit Pool(int n) {
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { loop(); });
  }
  bool try_run(Job *job) {  // false if another job is running
    std::lock_guard<std::mutex> lock(mutex_);
    if (job_ != nullptr) return false;
    job_ = job;
    active_ = static_cast<int>(threads_.size());
    ++generation_;
    wake_.notify_all();
    return true;
  }
  void wait() {  // until every thread has left the job
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [this] { return active_ == 0; });
    job_ = nullptr;
  }
  int size() const { return static_cast<int>(threads_.size()); }

 private:
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      Job *job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        job = job_;
      }
      work(job);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--active_ == 0) idle_.notify_all();
    }
  }
  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  Job *job_ = nullptr;
  int active_ = 0;
  uint64_t generation_ = 0;
};

std::mutex g_pool_mutex;
Pool *g_pool = nullptr;  // never destroyed: its threads wait for work until the process ends

Pool *pool(int n_threads) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (g_pool == nullptr) {
    try {
      g_pool = new Pool(n_threads);
    } catch (...) {
      return nullptr;
    }
    pthread_atfork(nullptr, nullptr, [] { g_pool = nullptr; });  // a forked child has no threads
  }
  return g_pool;
}

}  // namespace

struct Running {
  Job job;
  Pool *pool = nullptr;             // the job runs on the pool, or
  std::vector<std::thread> threads;  // (pool busy with another job) on threads of its own
};

// Starts the copy and returns at once; floe_copy_hash_join waits for it and frees the job. The
// caller keeps every array alive (and `done` readable) until then.
extern "C" void *floe_copy_hash_start(int64_t n_tensors, const int64_t *first_piece, const uint64_t *src,
                                      const uint64_t *dst, const uint64_t *len, int hash,
                                      uint64_t *digests, int32_t *done, int n_threads) {
  auto *run = new Running;
  Job &job = run->job;
  job.n_tensors = n_tensors;
  job.first_piece = first_piece;
  job.src = src;
  job.dst = dst;
  job.len = len;
  job.hash = hash;
  uint64_t total = 0;
  for (int64_t p = 0; p < first_piece[n_tensors]; ++p) total += dst[p] ? len[p] : 0;
  job.cached = total <= kCachedBytes;
  job.digests = digests;
  job.done = done;
  Pool *p = pool(n_threads);
  if (p != nullptr && p->size() > 0 && p->try_run(&job)) {
    run->pool = p;
    return run;
  }
  try {
    for (int i = 0; i < n_threads; ++i) run->threads.emplace_back(work, &job);
  } catch (...) {  // fewer threads than asked for: the ones started do all the work
  }
  if (run->threads.empty()) work(&job);  // none at all: do it here, now
  return run;
}

extern "C" void floe_copy_hash_join(void *handle) {
  auto *run = static_cast<Running *>(handle);
  if (run->pool != nullptr) run->pool->wait();
  for (auto &t : run->threads) t.join();
  delete run;
}
