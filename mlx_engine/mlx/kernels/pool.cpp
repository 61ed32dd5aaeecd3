// A fixed set of worker threads for the kernels (pool.h).
//
// Work is handed out index by index from one atomic word, not in fixed shares: on a machine with as many threads as
// cores, Python's thread and MLX's own compete with the workers, and a worker that has lost its core would otherwise
// keep the caller waiting for its share (measured: a sixth of a decode step spent so). The word holds the job's
// number, its size and the next index, so a worker that wakes late can neither claim an index of a finished job nor
// read the function of the next one before that job is published. Workers spin for a short while after a job (a
// decode step runs a few hundred small jobs back to back, and waking a sleeping thread costs more than one of them),
// yielding their core to any other thread that wants it, then sleep on a condition variable.
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

// The claim word: job number (20 bits, wrapping) | job size (22 bits) | next index (22 bits).
constexpr int kIndexBits = 22;
constexpr uint64_t kIndexMask = (uint64_t(1) << kIndexBits) - 1;
constexpr uint64_t kJobMask = (uint64_t(1) << (64 - 2 * kIndexBits)) - 1;

class Pool {
 public:
  explicit Pool(int n) : n_(n) {
    if (const char* env = std::getenv("MLX_ENGINE_SPIN_US")) spin_ = std::chrono::microseconds(std::atoi(env));
    for (int t = 1; t < n_; ++t) threads_.emplace_back([this] { worker(); });
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
    fn_ = &f;
    completed_.store(0, std::memory_order_relaxed);
    job_ = (job_ + 1) & kJobMask;
    claim_.store((job_ << (2 * kIndexBits)) | (uint64_t(n) << kIndexBits), std::memory_order_seq_cst);
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    work();
    while (completed_.load(std::memory_order_acquire) < n) cpu_relax();
  }

 private:
  // Claims and runs indices of the current job until none is left.
  void work() {
    for (;;) {
      uint64_t c = claim_.load(std::memory_order_acquire);
      const uint64_t i = c & kIndexMask, total = (c >> kIndexBits) & kIndexMask;
      if (i >= total) return;
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
      (*fn_)(int(i));  // the job cannot finish (and fn_ change) before this index is counted below
      completed_.fetch_add(1, std::memory_order_release);
    }
  }

  void worker() {
    uint64_t seen = 0;
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      int spins = 0;
      while (epoch_.load(std::memory_order_acquire) == seen) {
        // yield, not pause: on a machine with as many threads as cores, Python's thread (building the next decode
        // step) and MLX's wait for a core that a spinning worker holds (measured: smollm2 decode about a tenth
        // faster, gemma3 unchanged)
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
      work();
    }
  }

  int n_;
  // 30 us: about the gap between two products of a decode step once its other operations are kernels of ours too
  // (measured: smollm2 decode +8 %, gemma3 +18 % over sleeping at once; longer spins take the core from Python)
  std::chrono::microseconds spin_{30};
  std::vector<std::thread> threads_;
  uint64_t job_ = 0;
  std::atomic<uint64_t> claim_{0};
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> completed_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* fn_ = nullptr;
  std::mutex mu_;
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
