// The threads our kernels share (pool.cpp).
#pragma once

#include <functional>

namespace mlx_engine {

// How many threads the kernels use: the cores the process may run on, or $MLX_ENGINE_CPU_THREADS.
int pool_threads();

// Runs fn(0) .. fn(n - 1) on the calling thread and the pool's workers, and returns when all have run (n == 1: on
// the calling thread alone, no worker woken). Each thread runs a contiguous share of the indices in ascending order,
// then takes what is left of the others' from their ends. Calls from several threads (MLX evaluates each stream on a
// thread of its own) run one after another; fn must not call parallel_for.
void parallel_for(int n, const std::function<void(int)>& fn);

}  // namespace mlx_engine
