// `metile run GRAPH.json --backend cuda [--check] [--no-discovery]`: plans the graph (nodes no output
// depends on removed and the certified attention rewrite, as `metile plan`; one line each), builds an Executable
// (compiles, gates and tunes every region, dispatch.h), runs it once on the inputs and returns
// the outputs; with --check, compares every output with the CPU reference and prints the error.
// Built only with the CUDA backend (METILE_HAVE_CUDA_BACKEND).
#include <stdexcept>

#include <fmt/core.h>

#include "commands.h"
#include "metile/cpu_runtime.h"
#include "metile/discovery.h"
#include "metile/dispatch.h"
#include "metile/error.h"
#include "metile/fusion.h"

namespace metile::cli {

TensorMap run_on_cuda(const ComputeGraph& graph, const TensorMap& inputs, bool check, bool no_discovery) {
  std::string reason;
  const std::optional<CudaDevice> device = CudaDevice::try_open(0, &reason);
  // A machine without a GPU is the user's environment, not a metile failure: exit 2, one line.
  if (!device) throw InputError(reason + " (--backend cpu runs everywhere)");
  const CudaDeviceInfo& info = device->info();
  fmt::print("cuda: {} ({}, {} SMs, driver {}, NVRTC {}), dispatch {}\n", info.name, info.architecture(),
             info.multiprocessor_count, info.driver_version, nvrtc_version(),
             dispatch_mode_name(dispatch_mode_from_environment()));
  // The plan `metile plan` shows for the H200: nodes no output depends on removed and the certified
  // attention rewrite first (the flash_attention nodes it makes refuse to run without a verified
  // certificate), unless --no-discovery.
  const FusionTarget target = FusionTarget::h200();
  const FusionPlan plan = no_discovery ? plan_graph_fusion(graph, target) : plan_with_discovery(graph, target);
  for (const std::string& rewrite : plan.rewrites) fmt::print("rewrite: {}\n", rewrite);
  Executable executable = Executable::build(plan, *device);
  for (const RegionReport& report : executable.reports()) fmt::print("{}\n", report.sentence);
  const TensorMap outputs = executable.run(inputs);
  if (check) {
    // The CPU reference of the graph the GPU runs: with rewrites, the flash_attention evaluator, which
    // keeps its scores unrounded as the kernels do; the recorded chain rounds them to the dtype, which
    // in bf16 moves a softmax of scores near 10-30 further from float64 than the gate (tests/python/
    // test_discovery.py: 1.1e-2 to 1.9e-2, the rewrite 1.2e-3 to 1.5e-3), so a right kernel could have
    // read FAILED against it.
    const ComputeGraph& checked = *plan.graph;
    const TensorMap reference = run_reference(checked, inputs);
    if (!plan.rewrites.empty()) fmt::print("check: against the CPU reference of the rewritten graph\n");
    int failures = 0;
    for (ValueId id : checked.outputs()) {
      const std::string& name = checked.value(id).name;
      const NumericGateResult gate = numeric_gate(outputs.at(name), reference.at(name));
      fmt::print("check '{}': relative L2 error {:.2e}, max error / max |ref| {:.2e} (gate {:.0e}): {}\n", name,
                 gate.relative_l2, gate.relative_max, gate.threshold, gate.passed ? "ok" : "FAILED, " + gate.detail);
      failures += gate.passed ? 0 : 1;
    }
    if (failures > 0) throw std::runtime_error(fmt::format("--check: {} output(s) differ from the CPU reference", failures));
  }
  return outputs;
}

}  // namespace metile::cli
