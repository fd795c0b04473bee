// Helpers shared by the tests of several modules (graph, cpu_runtime, fusion,
// codegen, gpu) and the kernel benchmark: the message of the InputError an action
// throws, a file read whole, the seed of a randomised test, the seed graph of docs/architecture.md and
// a brute-force argmax and its test rows. Module-specific helpers stay in their folders.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "metile/error.h"
#include "metile/graph.h"

namespace metile::testing {

// What the `Error` thrown by `action` says, or `none` when it throws none.
template <class Error>
std::string message_thrown(const std::function<void()>& action, const char* none) {
  try {
    action();
  } catch (const Error& error) {
    return error.what();
  }
  return none;
}

// What the InputError thrown by `action` says, or "(no InputError)" when it
// throws none, so a test compares the whole message in one EXPECT_EQ.
inline std::string error_of(const std::function<void()>& action) {
  return message_thrown<InputError>(action, "(no InputError)");
}

// What the WriteError thrown by `action` says (a write the system refused), or "(no WriteError)".
inline std::string write_error_of(const std::function<void()>& action) {
  return message_thrown<WriteError>(action, "(no WriteError)");
}

// Runs `action`, which should never open the FIFO at `fifo`, and says whether it returned within
// `seconds`. Where it did not (blocked opening the FIFO, which waits for a writer), a writer is opened
// and closed, so the reader sees an empty file and the test fails instead of hanging.
inline bool returns_without_opening_fifo(const std::filesystem::path& fifo, const std::function<void()>& action,
                                         int seconds = 10) {
  std::future<void> done = std::async(std::launch::async, action);
  if (done.wait_for(std::chrono::seconds(seconds)) == std::future_status::ready) {
    done.get();
    return true;
  }
  while (done.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready) {
    const int writer = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (writer >= 0) ::close(writer);
  }
  return false;
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
    // Decimal or 0x hexadecimal; anything else stops the test (it would replay seed 0 silently).
    char* end = nullptr;
    errno = 0;
    seed = std::strtoull(text, &end, 0);
    if (*end != '\0' || errno == ERANGE || *text == '-') {
      std::fprintf(stderr, "METILE_TEST_SEED='%s' is not a seed (an integer from 0 to 2^64 - 1)\n", text);
      std::abort();
    }
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

// argmax's rule stated apart from argmax_index (graph.h), the oracle of the argmax op and of greedy
// decoding: the first NaN when the row has one, else the first index that holds the row's largest
// value (-0 and +0 compare equal).
inline std::int64_t brute_force_argmax(const std::vector<double>& row) {
  for (std::size_t index = 0; index < row.size(); ++index) {
    if (std::isnan(row[index])) return static_cast<std::int64_t>(index);
  }
  const double largest = *std::max_element(row.begin(), row.end());
  return std::find(row.begin(), row.end(), largest) - row.begin();
}

// Rows for argmax tests: drawn from five values (ties everywhere) when `few_values`, else from
// [-10, 10); about 3% -inf, 0.5% +inf, 1% -0 and, `with_nan`, 0.5% NaN.
inline std::vector<double> argmax_test_values(std::mt19937_64& generator, std::size_t count, bool few_values,
                                              bool with_nan) {
  std::vector<double> values(count);
  for (double& value : values) {
    const std::uint64_t draw = generator() % 1000;
    value = few_values ? 0.5 * (static_cast<double>(generator() % 5) - 2)
                       : static_cast<double>(generator() >> 11) * 0x1.0p-53 * 20 - 10;
    if (draw < 30) {
      value = -HUGE_VAL;
    } else if (draw < 35) {
      value = HUGE_VAL;
    } else if (draw < 45) {
      value = -0.0;
    } else if (with_nan && draw < 50) {
      value = std::nan("");
    }
  }
  return values;
}

}  // namespace metile::testing
