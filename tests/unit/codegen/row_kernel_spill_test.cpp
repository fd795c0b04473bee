// Every row-kernel variant a region races keeps its row values out of local memory: ptxas reports at most
// 32 bytes of spills (tests/support/ptxas_report.h) for regions of one to eight resident arrays, rows from 1000 to
// the vocabulary's 151936 elements, held in registers and streamed. Before the register budget
// (row_kernel.cpp, choose_config) rows past 32768 bf16 elements and the `narrow` variants spilled
// 0.1-8 KB a thread. An NVRTC compile suite: no device needed.
#include <gtest/gtest.h>

#include <fmt/core.h>

#include <functional>
#include <future>
#include <string>
#include <vector>

#include "metile/codegen.h"
#include "metile/graph.h"
#include "codegen_test_support.h"
#include "metile_test_support.h"
#include "ptxas_report.h"

namespace metile {
namespace {

struct RegionCase {
  std::string name;
  std::function<ComputeGraph(std::int64_t rows, std::int64_t length, DType dtype)> build;
};

std::vector<RegionCase> region_cases() {
  return {
      {"add+rms_norm", [](std::int64_t rows, std::int64_t length, DType dtype) { return testing::seed_graph(rows, length, dtype); }},
      {"softmax",
       [](std::int64_t rows, std::int64_t length, DType dtype) {
         GraphBuilder b;
         return b.build({b.softmax(b.input("x", {{rows, length}, dtype}), -1, "probabilities")});
       }},
      {"layer_norm",  // its f64 statistics: x is read widened by two later phases
       [](std::int64_t rows, std::int64_t length, DType dtype) {
         GraphBuilder b;
         return b.build({b.layer_norm(b.input("x", {{rows, length}, dtype}), b.input("gamma", {{length}, dtype}),
                                      b.input("beta", {{length}, dtype}), 1e-5, "normalized")});
       }},
      {"add+layer_norm",
       [](std::int64_t rows, std::int64_t length, DType dtype) {
         GraphBuilder b;
         auto summed = b.add(b.input("x", {{rows, length}, dtype}), b.input("residual", {{rows, length}, dtype}), "summed");
         auto normalized = b.layer_norm(summed, b.input("gamma", {{length}, dtype}), b.input("beta", {{length}, dtype}),
                                        1e-5, "normalized");
         return b.build({summed, normalized});
       }},
      {"scale+bias+softmax, both out",
       [](std::int64_t rows, std::int64_t length, DType dtype) {
         GraphBuilder b;
         auto biased = b.add(b.scale(b.input("x", {{rows, length}, dtype}), 0.5, "scaled"),
                             b.input("bias", {{length}, dtype}), "biased");
         return b.build({biased, b.softmax(biased, -1, "probabilities")});
       }},
      // Four values computed before the norm, read again after it, beside four inputs: eight resident arrays.
      {"chain, rms_norm, chain",
       [](std::int64_t rows, std::int64_t length, DType dtype) {
         GraphBuilder b;
         auto a = b.multiply(b.input("x", {{rows, length}, dtype}), b.input("g", {{length}, dtype}), "a");
         auto s = b.silu(a, "s");
         auto c = b.add(s, b.input("residual", {{rows, length}, dtype}), "c");
         auto n = b.rms_norm(b.gelu(c, "tanh", "d"), b.input("w", {{length}, dtype}), 1e-6, "n");
         return b.build({c, b.multiply(b.add(b.multiply(n, a, "e"), s, "f"), c, "h")});
       }},
  };
}

TEST(RowKernelSpills, EveryVariantKeepsItsRowOutOfLocalMemory) {
  struct Compile {
    std::string what;
    GeneratedKernel kernel;
  };
  std::vector<Compile> compiles;
  for (const RegionCase& region : region_cases()) {
    for (const auto& [rows, length, dtype] : {std::tuple{1, 1000, DType::bf16}, {3, 4096, DType::bf16},
                                              {1, 14336, DType::f32}, {1, 14336, DType::bf16}, {1, 16384, DType::bf16}, {1, 32768, DType::bf16},
                                              {1, 65536, DType::bf16}, {1, 151936, DType::bf16}}) {
      const ComputeGraph graph = region.build(rows, length, dtype);
      const FusionRegion whole = testing_support::whole_graph_region(graph);
      for (const RowKernelOptions& options : row_kernel_variants(graph, whole)) {
        GeneratedKernel kernel = generate_region_kernel(graph, whole, options);
        compiles.push_back({fmt::format("{} {}x{} {}: {}", region.name, rows, length, dtype_name(dtype), kernel.summary),
                            std::move(kernel)});
      }
    }
  }
  // Two at a time (NVRTC needs no device; the CI machine has two cores).
  for (std::size_t first = 0; first < compiles.size(); first += 2) {
    std::vector<std::future<CompiledProgram>> programs;
    for (std::size_t index = first; index < std::min(first + 2, compiles.size()); ++index) {
      programs.push_back(std::async(std::launch::async, [&kernel = compiles[index].kernel] {
        return testing::compile_for_sm90_with_ptxas_report(kernel.source, kernel.kernel_name);
      }));
    }
    for (std::size_t index = first; index < std::min(first + 2, compiles.size()); ++index) {
      testing::expect_no_spills(programs[index - first].get().log, compiles[index].what);
    }
  }
  EXPECT_GE(compiles.size(), 65u);  // every region x shape x variant above
}

}  // namespace
}  // namespace metile
