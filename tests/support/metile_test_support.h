// Helpers shared by the tests of several modules (graph, cpu_runtime, fusion,
// codegen, gpu) and the kernel benchmark: the message of the InputError an action
// throws, a file read whole, the seed of a randomised test, and the seed graph of docs/architecture.md. Module-specific helpers stay in their folders.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>

#include "metile/error.h"
#include "metile/graph.h"

namespace metile::testing {

// What the InputError thrown by `action` says, or "(no InputError)" when it
// throws none, so a test compares the whole message in one EXPECT_EQ.
inline std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const InputError& error) {
    return error.what();
  }
  return "(no InputError)";
}

// The whole file as text; empty when it cannot be opened (the comparison then fails).
inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream stream(path);
  std::ostringstream text;
  text << stream.rdbuf();
  return text.str();
}

// The seed of a randomised test: METILE_TEST_SEED=N replays a run, otherwise a fresh one. Printed
// as "<what>: METILE_TEST_SEED=N", so a failing test's output says how to replay it.
// `pinned`, where given, replaces the fresh seed: only for a test a fresh seed is known to break
// through a bug that is not fixed yet (the test says which).
inline std::uint64_t test_seed(std::string_view what, std::optional<std::uint64_t> pinned = std::nullopt) {
  std::uint64_t seed = 0;
  if (const char* text = std::getenv("METILE_TEST_SEED"); text != nullptr && *text != '\0') {
    seed = std::strtoull(text, nullptr, 10);
  } else if (pinned) {
    seed = *pinned;
  } else {
    std::random_device device;
    seed = (std::uint64_t{device()} << 32) ^ device();
  }
  std::printf("%.*s: METILE_TEST_SEED=%llu\n", static_cast<int>(what.size()), what.data(),
              static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  return seed;
}

// The seed graph, both values outputs: summed = values + residual;
// normalized = rms_norm(summed, weight, 1e-5), over [rows, hidden] (f16 in the seed).
inline ComputeGraph seed_graph(std::int64_t rows = 1, std::int64_t hidden = 2048, DType dtype = DType::f16) {
  GraphBuilder builder;
  const ValueRef values = builder.input("values", TensorSpec({rows, hidden}, dtype));
  const ValueRef residual = builder.input("residual", TensorSpec({rows, hidden}, dtype));
  const ValueRef weight = builder.input("weight", TensorSpec({hidden}, dtype));
  const ValueRef summed = builder.add(values, residual, "summed");
  const ValueRef normalized = builder.rms_norm(summed, weight, 1e-5, "normalized");
  return builder.build({summed, normalized});
}

}  // namespace metile::testing
