// Loads libcuda.so.1 with dlopen and resolves every driver entry point once, thread-safely.
// Failures are remembered as a reason string: the first CUDA path that needs the driver
// reports "no CUDA device: <reason>", CPU paths never notice.
#include "cuda_driver.h"

#include <dlfcn.h>

#include <fmt/core.h>

#include <mutex>

#include "metile/cuda_runtime.h"

namespace metile::cuda_driver {
namespace {

struct LoadedDriver {
  DriverApi api;
  std::string unavailable_reason;  // empty when usable
};

LoadedDriver load_driver() {
  LoadedDriver loaded;
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* error = dlerror();
    loaded.unavailable_reason = fmt::format("libcuda.so.1 could not be loaded ({})", error ? error : "unknown");
    return loaded;
  }
  using GetProcAddress = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
  auto get_proc_address = reinterpret_cast<GetProcAddress>(dlsym(library, "cuGetProcAddress_v2"));
  if (get_proc_address == nullptr) {
    loaded.unavailable_reason = "the CUDA driver is too old (no cuGetProcAddress_v2; CUDA 12 or newer is needed)";
    return loaded;
  }
  DriverApi& api = loaded.api;
  std::string missing;
  // #name is the unexpanded base name ("cuMemAlloc"); the version picks the prototype we call.
#define METILE_RESOLVE_ENTRY(name, version)                                                            \
  {                                                                                                    \
    void* address = nullptr;                                                                           \
    CUdriverProcAddressQueryResult status{};                                                           \
    if (get_proc_address(#name, &address, version, CU_GET_PROC_ADDRESS_DEFAULT, &status) !=            \
            CUDA_SUCCESS ||                                                                            \
        address == nullptr) {                                                                          \
      missing += missing.empty() ? #name : ", " #name;                                                 \
    } else {                                                                                           \
      api.name = reinterpret_cast<decltype(api.name)>(address);                                        \
    }                                                                                                  \
  }
  METILE_CUDA_DRIVER_ENTRIES(METILE_RESOLVE_ENTRY)
#undef METILE_RESOLVE_ENTRY
  if (!missing.empty()) {
    loaded.unavailable_reason = fmt::format("the CUDA driver lacks entry points: {}", missing);
    return loaded;
  }
  const CUresult init = api.cuInit(0);
  if (init != CUDA_SUCCESS) {
    std::string name = "unknown error";
    const char* text = nullptr;
    if (api.cuGetErrorName(init, &text) == CUDA_SUCCESS && text != nullptr) name = text;
    loaded.unavailable_reason = fmt::format("cuInit failed: {}", name);
    return loaded;
  }
  int device_count = 0;
  if (api.cuDeviceGetCount(&device_count) != CUDA_SUCCESS || device_count == 0) {
    loaded.unavailable_reason = "the CUDA driver reports no devices";
  }
  return loaded;
}

const LoadedDriver& loaded_driver() {
  static const LoadedDriver loaded = load_driver();
  return loaded;
}

}  // namespace

const DriverApi& driver() {
  const LoadedDriver& loaded = loaded_driver();
  if (!loaded.unavailable_reason.empty()) throw NoCudaDevice("no CUDA device: " + loaded.unavailable_reason);
  return loaded.api;
}

const std::string& driver_unavailable_reason() { return loaded_driver().unavailable_reason; }

std::string describe(CUresult result) {
  const LoadedDriver& loaded = loaded_driver();
  const char* name = nullptr;
  const char* text = nullptr;
  if (loaded.api.cuGetErrorName != nullptr) loaded.api.cuGetErrorName(result, &name);
  if (loaded.api.cuGetErrorString != nullptr) loaded.api.cuGetErrorString(result, &text);
  return fmt::format("{} ({})", name ? name : fmt::format("CUresult {}", static_cast<int>(result)),
                     text ? text : "no description");
}

void check(CUresult result, std::string_view call) {
  if (result != CUDA_SUCCESS) throw CudaError(fmt::format("{}: {}", call, describe(result)));
}

}  // namespace metile::cuda_driver
