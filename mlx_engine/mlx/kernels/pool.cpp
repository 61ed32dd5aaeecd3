// A fixed set of worker threads for the kernels (pool.h).
//
// A job's indices are split into one contiguous region per thread, which that thread claims from its front, one
// index at a time; a thread whose region is done takes indices from the back of the others' (so a worker that has
// lost its core, or wakes late, holds back at most the index it is running: on a machine with as many threads as
// cores, Python's thread and MLX's own compete with the workers). Contiguous regions keep each thread reading memory
// in one ascending stream, as the hardware prefetchers follow best (indices handed out in turn from one counter had
// each thread skip every other chunk of a weight: a new stream per chunk). Each region's word holds the job's
// number, the region's end and its next index, so a worker that wakes late can neither claim an index of a finished
// job nor read the function of the next one before that job is published. Workers spin for a short while after a
// job (a decode step runs a few hundred small jobs back to back, and waking a sleeping thread costs more than one of
// them), yielding their core to any other thread that wants it, then sleep on a condition variable.
#include "pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

namespace mlx_engine {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

int default_threads() {
  if (const char* env = std::getenv("MLX_ENGINE_CPU_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// A region's claim word: job number (20 bits, wrapping) | the region's end (22 bits) | its next index (22 bits).
constexpr int kIndexBits = 22;
constexpr uint64_t kIndexMask = (uint64_t(1) << kIndexBits) - 1;
constexpr uint64_t kJobMask = (uint64_t(1) << (64 - 2 * kIndexBits)) - 1;

class Pool {
 public:
  explicit Pool(int n) : n_(n), regions_(n) {
    if (const char* env = std::getenv("MLX_ENGINE_SPIN_US")) spin_ = std::chrono::microseconds(std::atoi(env));
    for (int t = 1; t < n_; ++t) threads_.emplace_back([this, t] { worker(t); });
  }
  ~Pool() {
    stop_.store(true);
    epoch_.fetch_add(1);
    {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    for (auto& t : threads_) t.join();
  }
  int size() const { return n_; }

  void run(int n, const std::function<void(int)>& f) {
    if (n <= 0) return;
    if (uint64_t(n) > kIndexMask) throw std::invalid_argument("parallel_for: too many indices: " + std::to_string(n));
    if (n_ == 1 || n == 1) {
      for (int i = 0; i < n; ++i) f(i);
      return;
    }
    // One job at a time: each MLX stream evaluates on a thread of its own, and two streams (a server's text and
    // image models, two loaded models) may call at once; a second job published over the first had a worker run
    // one job's index with the other's function, on a frame already gone (a segmentation fault in the server tests)
    std::lock_guard<std::mutex> one_job(run_mu_);
    fn_ = &f;
    completed_.store(0, std::memory_order_relaxed);
    job_ = (job_ + 1) & kJobMask;
    for (int t = 0; t < n_; ++t) {
      const uint64_t begin = uint64_t(n) * t / n_, end = uint64_t(n) * (t + 1) / n_;
      regions_[t].store((job_ << (2 * kIndexBits)) | (end << kIndexBits) | begin, std::memory_order_seq_cst);
    }
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    work(0);
    while (completed_.load(std::memory_order_acquire) < n) cpu_relax();
  }

 private:
  // The next index of region t claimed from its front (or, `back`, its last one), or -1 when none is left.
  int claim(int t, bool back) {
    std::atomic<uint64_t>& word = regions_[t];
    uint64_t c = word.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t next = c & kIndexMask, end = (c >> kIndexBits) & kIndexMask;
      if (next >= end) return -1;
      const uint64_t to = back ? c - (uint64_t(1) << kIndexBits) : c + 1;
      if (word.compare_exchange_weak(c, to, std::memory_order_acq_rel)) return int(back ? end - 1 : next);
    }
  }

  void run_index(int i) {
    (*fn_)(i);  // the job cannot finish (and fn_ change) before this index is counted below
    completed_.fetch_add(1, std::memory_order_release);
  }

  // Runs thread `me`'s region of the current job, then what is left of the others', until no index is left.
  void work(int me) {
    for (int i; (i = claim(me, false)) >= 0;) run_index(i);
    for (int k = 1; k < n_; ++k)
      for (int i; (i = claim((me + k) % n_, true)) >= 0;) run_index(i);
  }

  void worker(int me) {
    uint64_t seen = 0;
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      int spins = 0;
      while (epoch_.load(std::memory_order_acquire) == seen) {
        // yield, not pause: on a machine with as many threads as cores, Python's thread (building the next decode
        // step) and MLX's wait for a core that a spinning worker holds
        std::this_thread::yield();
        if (++spins % 64) continue;
        if (std::chrono::steady_clock::now() - start < spin_) continue;
        std::unique_lock<std::mutex> lk(mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lk, [&] { return epoch_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      }
      seen = epoch_.load(std::memory_order_acquire);
      if (stop_.load()) return;
      work(me);
    }
  }

  int n_;
  // about the gap between two products of a decode step once its other operations are kernels of ours too: shorter
  // makes workers sleep between products, longer takes the core from Python
  std::chrono::microseconds spin_{30};
  std::vector<std::thread> threads_;
  uint64_t job_ = 0;
  std::vector<std::atomic<uint64_t>> regions_;  // one claim word per thread
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> completed_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* fn_ = nullptr;
  std::mutex mu_;
  std::mutex run_mu_;  // held by the thread whose job is running
  std::condition_variable cv_;
};

Pool& pool() {
  static Pool p(default_threads());
  return p;
}

}  // namespace

int pool_threads() { return pool().size(); }

void parallel_for(int n, const std::function<void(int)>& fn) { pool().run(n, fn); }

}  // namespace mlx_engine
