// Shared by the GPU suites: a device fixture that skips where no CUDA device exists, and a
// helper that runs device work on fresh seeded inputs and gates every output against the CPU
// reference.
#pragma once

#include <gtest/gtest.h>

#include <fmt/core.h>

#include <optional>
#include <string>

#include "metile/cpu_runtime.h"
#include "metile/cuda_runtime.h"
#include "metile/dispatch.h"

namespace metile::testing_support {

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string reason;
    device_ = CudaDevice::try_open(0, &reason);
    if (!device_) GTEST_SKIP() << reason;
  }
  const CudaDevice& device() const { return *device_; }

 private:
  std::optional<CudaDevice> device_;
};

// Gates every output of `graph`; returns the worst relative L2 error for reporting.
inline double expect_outputs_match(const ComputeGraph& graph, const TensorMap& outputs, const TensorMap& reference,
                                   const std::string& what) {
  double worst = 0;
  for (ValueId id : graph.outputs()) {
    const std::string& name = graph.value(id).name;
    const NumericGateResult gate = numeric_gate(outputs.at(name), reference.at(name));
    EXPECT_TRUE(gate.passed) << what << ", output '" << name << "' " << graph.value(id).spec.to_string() << ": "
                             << gate.detail;
    worst = std::max(worst, gate.relative_l2);
  }
  return worst;
}

}  // namespace metile::testing_support
