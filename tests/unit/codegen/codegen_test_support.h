// Helpers shared by the codegen tests: small graphs and an NVRTC compile for sm_90 that never
// touches the user's kernel cache.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "metile/codegen.h"
#include "metile/cuda_runtime.h"

namespace metile::testing_support {

// Compiles for sm_90 without the cache; fails the test with NVRTC's log on error or warning.
inline void expect_compiles_for_sm90(const GeneratedKernel& kernel) {
  CompileOptions options;
  options.architecture = "sm_90";
  options.use_cache = false;
  try {
    const CompiledProgram program = compile_cuda_program(kernel.source, kernel.kernel_name, options);
    EXPECT_GT(program.cubin.size(), 0u) << kernel.kernel_name;
    EXPECT_EQ(program.log.find("warning"), std::string::npos) << kernel.kernel_name << ":\n" << program.log;
  } catch (const CudaError& error) {
    ADD_FAILURE() << kernel.summary << "\n" << error.what() << "\n" << kernel.source;
  }
}

// The part of a generated source after the shared device prelude: the kernel itself.
inline std::string kernel_body(const GeneratedKernel& kernel) {
  const auto at = kernel.source.find("extern \"C\" __global__");
  return at == std::string::npos ? std::string() : kernel.source.substr(at);
}

inline int count_occurrences(const std::string& text, const std::string& needle) {
  int count = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + needle.size())) ++count;
  return count;
}

// A region made of every node of the graph, writing the graph's outputs.
inline FusionRegion whole_graph_region(const ComputeGraph& graph, std::string rule = "test") {
  FusionRegion region;
  region.rule = std::move(rule);
  for (const Node& node : graph.nodes()) region.nodes.push_back(node.id);
  region.inputs = graph.inputs();
  region.outputs = graph.outputs();
  return region;
}

}  // namespace metile::testing_support
