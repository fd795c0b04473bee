// Opens NVRTC and cuBLASLt with dlopen: first by soname (the loader's usual search: ld.so.cache,
// LD_LIBRARY_PATH), then at the path the build found them (the toolkit folder need not be known
// to the loader on the build machine). What failed is remembered as a sentence, so the first
// compile or matmul reports it and CPU paths never notice.
#include "cuda_libraries.h"

#include <dlfcn.h>

#include <fmt/core.h>

#include <initializer_list>

#include "metile/cuda_runtime.h"

#ifndef METILE_NVRTC_SONAME
#error "METILE_NVRTC_SONAME (e.g. libnvrtc.so.13) comes from src/runtime/cuda/CMakeLists.txt"
#endif

namespace metile::cuda_libraries {
namespace {

template <class Api>
struct Loaded {
  Api api;
  std::string unavailable_reason;  // empty when usable
};

// The first of `candidates` dlopen accepts, or nullptr with every failure in `reason`.
void* open_first(std::initializer_list<const char*> candidates, std::string& reason) {
  std::string failures;
  for (const char* candidate : candidates) {
    if (candidate == nullptr || *candidate == '\0') continue;
    if (void* library = dlopen(candidate, RTLD_NOW | RTLD_LOCAL)) return library;
    const char* error = dlerror();
    failures += fmt::format("{}{} ({})", failures.empty() ? "" : "; ", candidate, error ? error : "unknown");
  }
  reason = failures;
  return nullptr;
}

// Resolves one entry point; a missing name is added to `missing`.
template <class Function>
void resolve(void* library, const char* name, Function& slot, std::string& missing) {
  slot = reinterpret_cast<Function>(dlsym(library, name));
  if (slot == nullptr) missing += missing.empty() ? name : fmt::format(", {}", name);
}

// Opens the first of `candidates` and fills `Api` through resolve_all(library, api, missing).
template <class Api, class ResolveAll>
Loaded<Api> load_library(const char* what, std::initializer_list<const char*> candidates, ResolveAll resolve_all) {
  Loaded<Api> loaded;
  std::string reason;
  void* library = open_first(candidates, reason);
  if (library == nullptr) {
    loaded.unavailable_reason = fmt::format("{} could not be loaded: {}", what, reason);
    return loaded;
  }
  std::string missing;
  resolve_all(library, loaded.api, missing);
  if (!missing.empty()) loaded.unavailable_reason = fmt::format("{} lacks entry points: {}", what, missing);
  return loaded;
}

#define METILE_RESOLVE_LIBRARY_ENTRY(name) resolve(library, #name, api.name, missing);

const Loaded<NvrtcApi>& loaded_nvrtc() {
  static const Loaded<NvrtcApi> loaded = load_library<NvrtcApi>(
      "NVRTC", {METILE_NVRTC_SONAME, METILE_NVRTC_BUILD_PATH},
      [](void* library, NvrtcApi& api, std::string& missing) { METILE_NVRTC_ENTRIES(METILE_RESOLVE_LIBRARY_ENTRY) });
  return loaded;
}

const Loaded<CublasLtApi>& loaded_cublaslt() {
  static const Loaded<CublasLtApi> loaded = load_library<CublasLtApi>(
      "cuBLASLt", {METILE_CUBLASLT_SONAME, METILE_CUBLASLT_BUILD_PATH},
      [](void* library, CublasLtApi& api, std::string& missing) { METILE_CUBLASLT_ENTRIES(METILE_RESOLVE_LIBRARY_ENTRY) });
  return loaded;
}

#undef METILE_RESOLVE_LIBRARY_ENTRY

}  // namespace

const NvrtcApi& nvrtc() {
  const auto& loaded = loaded_nvrtc();
  if (!loaded.unavailable_reason.empty()) throw CudaError(loaded.unavailable_reason);
  return loaded.api;
}

const CublasLtApi& cublaslt() {
  const auto& loaded = loaded_cublaslt();
  if (!loaded.unavailable_reason.empty()) throw CudaError(loaded.unavailable_reason);
  return loaded.api;
}

const std::string& nvrtc_unavailable_reason() { return loaded_nvrtc().unavailable_reason; }
const std::string& cublaslt_unavailable_reason() { return loaded_cublaslt().unavailable_reason; }

}  // namespace metile::cuda_libraries
