// NVRTC and cuBLASLt, loaded with dlopen on first use (never linked), like the driver in
// cuda_driver.h: a metile binary carries no dependency on any CUDA library, so `metile plan`,
// `metile maxflow` and every CPU path start on machines without the CUDA toolkit, and start
// fast (the two libraries are about 200 MB of mappings). The first call that compiles a kernel
// or runs a matmul opens the library; a missing one is a CudaError naming what was tried.
//
// Each entry point keeps the prototype of the header we compile against (decltype of the
// declared function), so a call through the table type-checks exactly like a direct call.
#pragma once

#include <cublasLt.h>
#include <nvrtc.h>

#include <string>

namespace metile::cuda_libraries {

#define METILE_NVRTC_ENTRIES(X)                                                                              \
  X(nvrtcGetErrorString) X(nvrtcVersion) X(nvrtcCreateProgram) X(nvrtcDestroyProgram) X(nvrtcCompileProgram) \
  X(nvrtcGetProgramLogSize) X(nvrtcGetProgramLog) X(nvrtcGetCUBINSize) X(nvrtcGetCUBIN)

#define METILE_CUBLASLT_ENTRIES(X)                                                                 \
  X(cublasLtCreate) X(cublasLtDestroy) X(cublasLtGetStatusName) X(cublasLtGetStatusString)         \
  X(cublasLtMatmulDescCreate) X(cublasLtMatmulDescDestroy) X(cublasLtMatmulDescSetAttribute)       \
  X(cublasLtMatrixLayoutCreate) X(cublasLtMatrixLayoutDestroy) X(cublasLtMatrixLayoutSetAttribute) \
  X(cublasLtMatmulPreferenceCreate) X(cublasLtMatmulPreferenceDestroy)                             \
  X(cublasLtMatmulPreferenceSetAttribute) X(cublasLtMatmulAlgoGetHeuristic) X(cublasLtMatmul)

#define METILE_DECLARE_LIBRARY_ENTRY(name) decltype(&::name) name = nullptr;
struct NvrtcApi {
  METILE_NVRTC_ENTRIES(METILE_DECLARE_LIBRARY_ENTRY)
};
struct CublasLtApi {
  METILE_CUBLASLT_ENTRIES(METILE_DECLARE_LIBRARY_ENTRY)
};
#undef METILE_DECLARE_LIBRARY_ENTRY

// The loaded libraries. Throw CudaError("NVRTC is not available: <every path tried and why>")
// when the library or one of its entry points is missing. Thread-safe; loaded once.
const NvrtcApi& nvrtc();
const CublasLtApi& cublaslt();

// Empty when the library loads, else the reason (tests, and messages that want to explain).
const std::string& nvrtc_unavailable_reason();
const std::string& cublaslt_unavailable_reason();

}  // namespace metile::cuda_libraries
