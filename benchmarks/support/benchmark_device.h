// What every GPU benchmark (benchmarks/*/) does before it measures: open device 0 or say in one line
// why there is none (the program then exits 0: a machine without a GPU is not a failure, so CI can
// run them), and describe the device in the table's heading.
#pragma once

#include <fmt/core.h>

#include <optional>
#include <string>
#include <string_view>

#include "metile/cuda_runtime.h"

namespace metile::benchmarks {

// Device 0, or nullopt after printing "<program>: no CUDA device: ...; nothing to measure".
inline std::optional<CudaDevice> open_device_or_say_why(std::string_view program) {
  std::string reason;
  std::optional<CudaDevice> device = CudaDevice::try_open(0, &reason);
  if (!device) fmt::print("{}: {}; nothing to measure\n", program, reason);
  return device;
}

// "NVIDIA H200 (sm_90, 132 SMs, L2 60 MiB, driver 12080, NVRTC 12.8)".
inline std::string describe_device(const CudaDeviceInfo& info) {
  return fmt::format("{} ({}, {} SMs, L2 {} MiB, driver {}, NVRTC {})", info.name, info.architecture(),
                     info.multiprocessor_count, info.l2_cache_bytes >> 20, info.driver_version, nvrtc_version());
}

}  // namespace metile::benchmarks
