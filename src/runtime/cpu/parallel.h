// parallel_for: splits [0, count) into one contiguous range per hardware thread
// for the CPU executor's heavy loops (contractions). Work too small to repay a
// thread start (a few µs each) runs on the caller's thread. Results must not
// depend on the split: callers give each index its own output.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace metile::cpu {

// `work` estimates the multiply-adds behind the whole range (the threshold's unit).
template <typename Body>
void parallel_for(std::int64_t count, std::int64_t work, const Body& body) {
  constexpr std::int64_t kWorkPerThread = std::int64_t{1} << 18;
  static const std::int64_t hardware = std::max<std::int64_t>(1, std::thread::hardware_concurrency());
  const std::int64_t threads = std::clamp<std::int64_t>(work / kWorkPerThread, 1, std::min(hardware, count));
  if (threads <= 1) {
    if (count > 0) body(std::int64_t{0}, count);
    return;
  }
  std::vector<std::thread> workers;
  std::vector<std::exception_ptr> failures(static_cast<std::size_t>(threads));
  const std::int64_t per_thread = (count + threads - 1) / threads;
  for (std::int64_t thread = 1; thread < threads; ++thread) {
    const std::int64_t first = thread * per_thread;
    const std::int64_t last = std::min(count, first + per_thread);
    if (first >= last) continue;
    workers.emplace_back([&body, &failures, thread, first, last] {
      try {
        body(first, last);
      } catch (...) {  // rethrown on the caller's thread below
        failures[static_cast<std::size_t>(thread)] = std::current_exception();
      }
    });
  }
  try {
    body(std::int64_t{0}, std::min(count, per_thread));
  } catch (...) {
    failures[0] = std::current_exception();
  }
  for (std::thread& worker : workers) worker.join();
  for (const std::exception_ptr& failure : failures) {
    if (failure) std::rethrow_exception(failure);
  }
}

}  // namespace metile::cpu
