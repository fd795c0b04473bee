// The CUDA driver API, loaded with dlopen at first use (never linked), so every metile
// binary starts where no driver exists. Each entry point is resolved through cuGetProcAddress
// at the API version whose prototype we call (cudaTypedefs.h's PFN_<name>_v<version>): asking
// for a name at the toolkit's own version can return a newer ABI under the same name
// (cuCtxGetDevice and cuCtxSynchronize gained a context argument in CUDA 13.0).
#pragma once

#include <cuda.h>
#include <cudaProfilerTypedefs.h>
#include <cudaTypedefs.h>

#include <string>
#include <string_view>

namespace metile::cuda_driver {

#define METILE_CUDA_DRIVER_ENTRIES(X)                                                                   \
  X(cuInit, 2000) X(cuDriverGetVersion, 2020) X(cuDeviceGet, 2000) X(cuDeviceGetCount, 2000)           \
  X(cuDeviceGetName, 2000) X(cuDeviceGetAttribute, 2000) X(cuDeviceTotalMem, 3020)                     \
  X(cuDevicePrimaryCtxRetain, 7000) X(cuDevicePrimaryCtxRelease, 11000) X(cuCtxSetCurrent, 4000)       \
  X(cuCtxGetCurrent, 4000) X(cuCtxGetId, 12000) X(cuCtxGetDevice, 2000) X(cuMemAlloc, 3020)       \
  X(cuMemFree, 3020) X(cuMemcpyHtoD, 3020) X(cuMemcpyDtoH, 3020) X(cuMemcpyDtoDAsync, 3020)            \
  X(cuMemcpyHtoDAsync, 3020) X(cuMemcpyDtoHAsync, 3020)                                                \
  X(cuMemsetD8, 3020) X(cuMemsetD8Async, 3020) X(cuStreamCreate, 2000) X(cuStreamDestroy, 4000)        \
  X(cuStreamSynchronize, 2000) X(cuEventCreate, 2000) X(cuEventDestroy, 4000) X(cuEventRecord, 2000)   \
  X(cuEventSynchronize, 2000) X(cuEventElapsedTime, 2000) X(cuModuleLoadData, 2000)                    \
  X(cuModuleUnload, 2000) X(cuModuleGetFunction, 2000) X(cuFuncGetAttribute, 2020)                     \
  X(cuFuncSetAttribute, 9000) X(cuLaunchKernel, 4000) X(cuLaunchKernelEx, 11060)                       \
  X(cuStreamBeginCapture, 10010)                                                                        \
  X(cuStreamEndCapture, 10000) X(cuGraphInstantiateWithFlags, 11040) X(cuGraphLaunch, 10000)           \
  X(cuGraphExecDestroy, 10000) X(cuGraphDestroy, 10000) X(cuGetErrorName, 6000) X(cuGetErrorString, 6000) \
  X(cuOccupancyMaxActiveClusters, 11070) X(cuOccupancyMaxActiveBlocksPerMultiprocessor, 6050)          \
  X(cuProfilerStart, 4000) X(cuProfilerStop, 4000) X(cuStreamWaitEvent, 3020)                       \
  X(cuMemHostAlloc, 2020) X(cuMemFreeHost, 2000) X(cuMemHostGetDevicePointer, 3020)

// Member names go through cuda.h's macros (cuMemAlloc -> cuMemAlloc_v2) at the declaration and
// at every use alike; the types and versions come from the unexpanded names.
struct DriverApi {
#define METILE_DECLARE_ENTRY(name, version) PFN_##name##_v##version name = nullptr;
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
