// Helpers shared by the tests of several modules (graph, cpu_runtime, fusion,
// codegen, gpu) and the kernel benchmark: the message of the InputError an action
// throws, a file read whole, and the seed graph of DESIGN.md. Module-specific helpers stay in their folders.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

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
