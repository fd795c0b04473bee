// The CUDA driver API, loaded with dlopen at first use (never linked), so every metile
// binary starts where no driver exists. Each entry point is resolved by its base name through
// cuGetProcAddress for the ABI of the cuda.h we were compiled against, so "cuMemAlloc" gets
// the same versioned symbol (cuMemAlloc_v2) a linked program would.
#pragma once

#include <cuda.h>

#include <string>
#include <string_view>

namespace metile::cuda_driver {

#define METILE_CUDA_DRIVER_ENTRIES(X)                                                                \
  X(cuInit) X(cuDriverGetVersion) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetName)              \
  X(cuDeviceGetAttribute) X(cuDeviceTotalMem) X(cuDevicePrimaryCtxRetain)                           \
  X(cuDevicePrimaryCtxRelease) X(cuCtxSetCurrent) X(cuCtxGetCurrent) X(cuCtxGetDevice) X(cuCtxSynchronize)            \
  X(cuMemAlloc) X(cuMemFree) X(cuMemcpyHtoD) X(cuMemcpyDtoH) X(cuMemcpyDtoDAsync) X(cuMemsetD8)     \
  X(cuMemsetD8Async) X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamSynchronize) X(cuEventCreate)   \
  X(cuEventDestroy) X(cuEventRecord) X(cuEventSynchronize) X(cuEventElapsedTime)                    \
  X(cuModuleLoadData) X(cuModuleUnload) X(cuModuleGetFunction) X(cuFuncGetAttribute)                \
  X(cuFuncSetAttribute) X(cuLaunchKernel) X(cuStreamBeginCapture) X(cuStreamEndCapture)             \
  X(cuGraphInstantiate) X(cuGraphLaunch) X(cuGraphExecDestroy) X(cuGraphDestroy) X(cuGetErrorName)  \
  X(cuGetErrorString)

// decltype(&cuMemAlloc) expands the cuda.h macro to the versioned prototype (cuMemAlloc_v2).
struct DriverApi {
#define METILE_DECLARE_ENTRY(name) decltype(&::name) name = nullptr;
  METILE_CUDA_DRIVER_ENTRIES(METILE_DECLARE_ENTRY)
#undef METILE_DECLARE_ENTRY
};

// The loaded, initialised driver (cuInit done). Throws NoCudaDevice("no CUDA device: <reason>")
// when libcuda is missing, an entry point cannot be resolved, or cuInit fails.
const DriverApi& driver();

// Empty if the driver loaded and cuInit succeeded, else the reason.
const std::string& driver_unavailable_reason();

// "CUDA_ERROR_OUT_OF_MEMORY (out of memory)"
std::string describe(CUresult result);

// Throws CudaError("<call>: <error>") unless result is CUDA_SUCCESS.
void check(CUresult result, std::string_view call);

}  // namespace metile::cuda_driver
