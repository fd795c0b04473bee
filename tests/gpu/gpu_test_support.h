// Shared by the GPU suites: a device fixture that skips where no CUDA device exists, the seed of
// the running test (printed, METILE_TEST_SEED overrides it, like the CPU suites), and a helper that
// gates every output of device work against the CPU reference.
#pragma once

#include <gtest/gtest.h>

#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "metile/cpu_runtime.h"
#include "metile/cuda_runtime.h"
#include "metile/dispatch.h"
#include "metile_test_support.h"

namespace metile::testing_support {

// The seed of the running test, named "Suite.Test" when printed; a test derives its cases' seeds
// from it (seed + case), so one printed number replays the whole test.
inline std::uint64_t current_test_seed() {
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  return metile::testing::test_seed(std::string(test->test_suite_name()) + "." + test->name());
}

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string reason;
    device_ = CudaDevice::try_open(0, &reason);
    if (!device_) GTEST_SKIP() << reason;
  }
  const CudaDevice& device() const { return *device_; }
  // The seeds of this test's cases: the first call prints the test's seed (current_test_seed),
  // each call returns the next one.
  std::uint64_t next_seed() {
    if (!seed_) seed_ = current_test_seed();
    return (*seed_)++;
  }

 private:
  std::optional<CudaDevice> device_;
  std::optional<std::uint64_t> seed_;
};

// A whole decode-step graph chains every layer's bf16 roundings, and two orders of accumulation
// differ by an ulp here and there that the next layer carries on: on the tiny synthetic models the
// native path itself (cuBLASLt + unfused kernels) exceeds one region's gate by up to 32% (max) and
// 23% (L2) against the CPU reference (notes/gpu_check.md, session 4). Step graphs allow this factor
// on both.
inline constexpr double kWholeStepMaxErrorFactor = 3;

// Gates every output of `graph` (relative L2 and max within `error_factor` times the dtype's gate;
// a NaN or shape mismatch always fails); returns the worst relative L2 error for reporting.
inline double expect_outputs_match(const ComputeGraph& graph, const TensorMap& outputs, const TensorMap& reference,
                                   const std::string& what, double error_factor = 1) {
  double worst = 0;
  for (ValueId id : graph.outputs()) {
    const std::string& name = graph.value(id).name;
    const NumericGateResult gate = numeric_gate(outputs.at(name), reference.at(name));
    const bool within =
        gate.relative_l2 <= error_factor * gate.threshold && gate.relative_max <= error_factor * gate.threshold;
    EXPECT_TRUE(within) << what << ", output '" << name << "' " << graph.value(id).spec.to_string()
                        << ": relative L2 " << gate.relative_l2 << ", relative max " << gate.relative_max
                        << " (gate " << gate.threshold << ", x" << error_factor << ") " << gate.detail;
    worst = std::max(worst, gate.relative_l2);
  }
  return worst;
}

// CUDA source for kernels that stand in for a slow previous kernel of a decode step (the tests of
// what a programmatic dependent reads before griddepcontrol.wait): release the dependents at once,
// then spin for spin_ns nanoseconds before writing anything.
inline constexpr std::string_view kReleaseDependentsThenSpinSource = R"CUDA(
__device__ __forceinline__ void release_dependents_then_spin(long long spin_ns) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < (unsigned long long)spin_ns);
}
)CUDA";

// Runs `work` on `stream` `rounds` times, eagerly on even rounds and as a replay of its CUDA graph
// on odd ones, synchronizing and calling check(label) after each ("eager" or "graph").
template <class Work, class Check>
void run_eager_and_in_a_graph(const CudaStream& stream, Work&& work, int rounds, Check&& check) {
  const CudaGraph graph = CudaGraph::capture(stream, work);
  for (int round = 0; round < rounds; ++round) {
    if (round % 2 == 0) {
      work(stream);
    } else {
      graph.replay(stream);
    }
    stream.synchronize();
    check(round % 2 ? "graph" : "eager");
  }
}

// The other user of a shared context, as a second CudaModel in another Python thread is: while `work` runs on a
// thread of its own, the calling thread uploads, downloads, copies and fills buffers (DeviceBuffer's synchronous
// operations, on the legacy stream) and checks every byte. Captures on a blocking stream made these copies fail
// (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) and invalidated the capture (an H100, session 55). `work` gets a
// `wait_for_copies` to call inside a capture: it returns once a whole round of copies begun after the call has ended
// (at once when the copies stopped on a failure), so the copies certainly ran while the capture was open, not only
// while the work ran. Returns "" or what failed (work's exception, or a copy's, with how far each got); `rounds`
// counts the rounds of copies made meanwhile.
using WaitForCopies = std::function<void()>;
inline std::string run_beside_copies(const CudaDevice& device, std::uint64_t copy_seed,
                                     const std::function<void(const WaitForCopies& wait_for_copies)>& work, int& rounds) {
  std::atomic<bool> work_done{false}, copies_stopped{false};
  std::atomic<int> rounds_done{0};
  const WaitForCopies wait_for_copies = [&] {
    // The round under way may have begun before the call: wait for the one after it.
    const int wanted = rounds_done.load() + 2;
    while (rounds_done.load() < wanted && !copies_stopped.load()) std::this_thread::yield();
  };
  std::string work_failure, copy_failure;
  std::thread worker([&] {
    try {
      device.make_current();
      work(wait_for_copies);
    } catch (const std::exception& error) {
      work_failure = error.what();
    } catch (...) {
      work_failure = "an exception of a type not derived from std::exception";
    }
    work_done = true;
  });
  try {
    device.make_current();
    std::mt19937_64 random(copy_seed);
    std::vector<std::uint32_t> words(1 << 16);
    while (!work_done) {
      for (auto& word : words) word = static_cast<std::uint32_t>(random());
      DeviceBuffer buffer = DeviceBuffer::from_vector<std::uint32_t>(words);
      if (buffer.to_vector<std::uint32_t>() != words) throw std::runtime_error("a download differs from its upload");
      DeviceBuffer copy(buffer.size_bytes());
      copy.copy_from_device(buffer, buffer.size_bytes());
      buffer.fill_bytes(0x5A);
      if (copy.to_vector<std::uint32_t>() != words) throw std::runtime_error("a device copy differs from its source");
      const auto filled = buffer.to_vector<std::uint32_t>();
      if (std::any_of(filled.begin(), filled.end(), [](std::uint32_t word) { return word != 0x5A5A5A5Au; })) {
        throw std::runtime_error("a filled buffer holds other bytes");
      }
      ++rounds_done;
    }
  } catch (const std::exception& error) {
    copy_failure = fmt::format("after {} rounds of copies: {}", rounds_done.load(), error.what());
  }
  copies_stopped = true;
  worker.join();
  rounds = rounds_done.load();
  if (!work_failure.empty()) return "the work beside the copies: " + work_failure + (copy_failure.empty() ? "" : "; " + copy_failure);
  return copy_failure;
}

}  // namespace metile::testing_support
