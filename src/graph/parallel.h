// The project's one thread helper (no thread pool, no dependency): splits [0, count) into
// contiguous ranges, one per thread, and runs them at once. Work too small to repay a thread
// start (a few µs each) runs on the caller's thread. Results must not depend on the split:
// callers give each index its own output. Used by the CPU executor's heavy loops
// (contractions), quantize_affine (rows) and the synthetic checkpoints' draw (elements).
// Internal to the libraries: src/graph is on their include path like src/io.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace metile {

inline std::int64_t hardware_threads() {
  static const std::int64_t hardware = std::max<std::int64_t>(1, std::thread::hardware_concurrency());
  return hardware;
}

// How many ranges `items` make at one per `items_per_range` (rounded down, at least one),
// at most one per hardware thread.
inline std::int64_t ranges_for(std::int64_t items, std::int64_t items_per_range) {
  return std::clamp<std::int64_t>(items / std::max<std::int64_t>(1, items_per_range), 1, hardware_threads());
}

// body(first, last) over `ranges` contiguous ranges of [0, count) (range r starts at
// r * ceil(count / ranges)), one thread each, the first on the caller's thread. An exception
// thrown by a range is rethrown here after every thread has joined; with several, the one of
// the lowest range (so a body that throws at its first bad index reports the first bad index
// of the whole loop, as the sequential loop would).
template <typename Body>
void parallel_ranges(std::int64_t count, std::int64_t ranges, const Body& body) {
  if (count <= 0) return;
  ranges = std::clamp<std::int64_t>(ranges, 1, count);
  if (ranges == 1) {
    body(std::int64_t{0}, count);
    return;
  }
  std::vector<std::thread> workers;
  std::vector<std::exception_ptr> failures(static_cast<std::size_t>(ranges));
  const std::int64_t per_range = (count + ranges - 1) / ranges;
  for (std::int64_t range = 1; range < ranges; ++range) {
    const std::int64_t first = range * per_range;
    const std::int64_t last = std::min(count, first + per_range);
    if (first >= last) continue;
    workers.emplace_back([&body, &failures, range, first, last] {
      try {
        body(first, last);
      } catch (...) {  // rethrown on the caller's thread below
        failures[static_cast<std::size_t>(range)] = std::current_exception();
      }
    });
  }
  try {
    body(std::int64_t{0}, std::min(count, per_range));
  } catch (...) {
    failures[0] = std::current_exception();
  }
  for (std::thread& worker : workers) worker.join();
  for (const std::exception_ptr& failure : failures) {
    if (failure) std::rethrow_exception(failure);
  }
}

// `work` estimates the multiply-adds behind the whole range (the threshold's unit): one
// thread per 2^18 of them, at most one per hardware thread and one per index.
template <typename Body>
void parallel_for(std::int64_t count, std::int64_t work, const Body& body) {
  constexpr std::int64_t kWorkPerThread = std::int64_t{1} << 18;
  parallel_ranges(count, ranges_for(work, kWorkPerThread), body);
}

}  // namespace metile
