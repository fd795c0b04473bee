// NVRTC compilation of CUDA C++ to a cubin, with an on-disk cache.
//
// A cache entry is one file named by the hash of (source, kernel name, architecture, options,
// NVRTC version). Its first line is a header holding that name, the payload size and the payload's
// checksum; a file whose header, name, size or checksum does not match (torn write, disk damage, a
// stranger's file, another entry's file copied or renamed into its place) is treated as absent:
// recompiled and replaced. Writes go to a temporary
// file renamed into place, so a reader never sees half an entry.
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/core.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "cuda_driver.h"
#include "cuda_libraries.h"
#include "metile/cuda_runtime.h"
#include "metile/io.h"

#ifndef METILE_CUDA_INCLUDE_DIR
#define METILE_CUDA_INCLUDE_DIR "/usr/local/cuda/include"
#endif

namespace metile {
namespace {

// Version 2 names its entry: a version-1 file (size and checksum only) copied over another entry
// passed its checks and served the other kernel.
constexpr std::string_view cache_magic = "METILE-KERNEL-CACHE 2";

const cuda_libraries::NvrtcApi& nvrtc_api() { return cuda_libraries::nvrtc(); }

void check_nvrtc(nvrtcResult result, std::string_view call) {
  if (result != NVRTC_SUCCESS) throw CudaError(fmt::format("{}: {}", call, nvrtc_api().nvrtcGetErrorString(result)));
}

std::uint64_t hash64(std::string_view bytes, std::uint64_t seed) {
  // FNV-1a over the bytes, then a splitmix64 finalizer to spread the low-entropy tail.
  std::uint64_t hash = fnv1a_64(bytes, seed);
  hash ^= hash >> 30;
  hash *= 0xbf58476d1ce4e5b9ULL;
  hash ^= hash >> 27;
  hash *= 0x94d049bb133111ebULL;
  hash ^= hash >> 31;
  return hash;
}

// The largest cubin the cache holds (the largest generated kernels' are a few MB).
constexpr std::uint64_t kMaximumCacheEntryBytes = std::uint64_t{256} << 20;

std::optional<std::string> read_cache_entry(const std::filesystem::path& path, bool& was_corrupt) {
  const std::optional<std::string> entry = read_cache_file(path, kMaximumCacheEntryBytes, was_corrupt);
  if (!entry) return std::nullopt;
  std::istringstream file(*entry);
  std::string header;
  std::getline(file, header);
  std::istringstream fields(header);
  std::string magic_first, magic_second, name, checksum;
  std::size_t size = 0;
  fields >> magic_first >> magic_second >> name >> size >> checksum;
  std::string payload((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (magic_first + " " + magic_second != cache_magic || !fields || name != path.filename().string() ||
      payload.size() != size || stable_hash_hex(payload) != checksum) {
    was_corrupt = true;
    return std::nullopt;
  }
  return payload;
}

void write_cache_entry(const std::filesystem::path& path, std::string_view payload) {
  static std::atomic<int> counter{0};
  std::error_code error;
  std::filesystem::create_directories(path.parent_path(), error);
  if (error) return;  // the cache is an optimisation: an unwritable directory only costs recompiles
  const std::filesystem::path temporary =
      path.string() + fmt::format(".tmp.{}.{}", static_cast<long>(getpid()), counter.fetch_add(1));
  {
    std::ofstream file(temporary, std::ios::binary | std::ios::trunc);
    if (!file) return;
    file << cache_magic << ' ' << path.filename().string() << ' ' << payload.size() << ' ' << stable_hash_hex(payload)
         << '\n';
    file.write(payload.data(), static_cast<std::streamsize>(payload.size()));
    if (!file) {
      file.close();
      std::filesystem::remove(temporary, error);
      return;
    }
  }
  std::filesystem::rename(temporary, path, error);
  if (error) std::filesystem::remove(temporary, error);
}


}  // namespace

std::string current_device_architecture() {
  if (!cuda_driver::driver_unavailable_reason().empty()) return "sm_90";
  const auto& api = cuda_driver::driver();
  CUcontext context = nullptr;
  if (api.cuCtxGetCurrent(&context) != CUDA_SUCCESS || context == nullptr) return "sm_90";
  CUdevice device = 0;
  cuda_driver::check(api.cuCtxGetDevice(&device), "cuCtxGetDevice");
  int major = 0;
  int minor = 0;
  cuda_driver::check(api.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device),
                     "cuDeviceGetAttribute(compute capability)");
  cuda_driver::check(api.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device),
                     "cuDeviceGetAttribute(compute capability)");
  return fmt::format("sm_{}{}", major, minor);
}

namespace {
// One attribute of the device of the context current on this thread.
int current_device_attribute(CUdevice_attribute attribute, const char* what) {
  const auto& api = cuda_driver::driver();
  CUdevice device = 0;
  cuda_driver::check(api.cuCtxGetDevice(&device), "cuCtxGetDevice");
  int value = 0;
  cuda_driver::check(api.cuDeviceGetAttribute(&value, attribute, device), fmt::format("cuDeviceGetAttribute({})", what));
  return value;
}
}  // namespace

int current_device_multiprocessors() {
  return current_device_attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "multiprocessor count");
}

int current_device_shared_memory_per_block_optin() {
  return current_device_attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, "shared memory per block opt-in");
}

std::string stable_hash_hex(std::string_view bytes) {
  return fmt::format("{:016x}{:016x}", hash64(bytes, 0), hash64(bytes, 0x9e3779b97f4a7c15ULL));
}

std::string nvrtc_version() {
  int major = 0;
  int minor = 0;
  check_nvrtc(nvrtc_api().nvrtcVersion(&major, &minor), "nvrtcVersion");
  return fmt::format("{}.{}", major, minor);
}

namespace {
// Without HOME (cron, a service): the account's home from the password database, else a folder of this
// user's own in /tmp. A shared /tmp/metile-cache served whatever kernels another user had put there (an
// entry's header proves it is whole, not who wrote it), so the /tmp folder is used only where it is this
// user's and no one else may write into it; otherwise a fresh private folder for this process.
std::string homeless_cache_directory() {
  // getpwuid_r: cache_directory() may be called from several threads (Python releases the GIL).
  passwd entry{};
  passwd* account = nullptr;
  std::vector<char> buffer(16384);
  if (::getpwuid_r(::getuid(), &entry, buffer.data(), buffer.size(), &account) == 0 && account != nullptr &&
      account->pw_dir != nullptr && account->pw_dir[0] == '/' && std::strcmp(account->pw_dir, "/") != 0) {
    return (std::filesystem::path(account->pw_dir) / ".cache" / "metile").string();
  }
  const std::string shared = fmt::format("/tmp/metile-cache-{}", static_cast<unsigned long>(::getuid()));
  ::mkdir(shared.c_str(), 0700);  // fails harmlessly where it exists; checked below either way
  struct stat status {};
  if (::lstat(shared.c_str(), &status) == 0 && S_ISDIR(status.st_mode) && status.st_uid == ::getuid() &&
      (status.st_mode & (S_IWGRP | S_IWOTH)) == 0) {
    return shared;
  }
  static const std::string private_folder = [] {
    std::string pattern = "/tmp/metile-cache-XXXXXX";
    return ::mkdtemp(pattern.data()) != nullptr ? pattern : std::string();
  }();
  if (private_folder.empty()) throw InputError("no cache folder: HOME is unset and /tmp has no private folder for it");
  return private_folder;
}
}  // namespace

std::string cache_directory() {
  if (const char* directory = std::getenv("METILE_CACHE_DIR"); directory != nullptr && *directory != '\0') {
    return directory;
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    return (std::filesystem::path(home) / ".cache" / "metile").string();
  }
  return homeless_cache_directory();
}

std::optional<std::string> read_cache_file(const std::filesystem::path& path, std::uint64_t maximum_bytes,
                                           bool& unusable) {
  unusable = false;
  std::error_code error;
  if (std::filesystem::status(path, error).type() == std::filesystem::file_type::not_found) return std::nullopt;
  // The cache directory is shared and may hold anything: io's readers refuse what is not a regular file
  // before opening it (regular_file_size) and read at most maximum_bytes (read_input_file); whatever
  // they refuse is a corrupt entry here, not the user's error.
  try {
    regular_file_size(path, "cache");
    return read_input_file(path, maximum_bytes, "cache");
  } catch (const InputError&) {
    unusable = true;
    return std::nullopt;
  }
}

std::string kernel_cache_directory() { return (std::filesystem::path(cache_directory()) / "kernels").string(); }

std::string kernel_cache_path(std::string_view cache_key) {
  return (std::filesystem::path(kernel_cache_directory()) / (std::string(cache_key) + ".cubin")).string();
}

CompiledProgram compile_cuda_program(std::string_view source, std::string_view kernel_name,
                                     const CompileOptions& options) {
  CompiledProgram program;
  program.kernel_name = std::string(kernel_name);
  program.architecture = options.architecture.empty() ? std::string("sm_90") : options.architecture;

  std::vector<std::string> arguments = {"--gpu-architecture=" + program.architecture, "--std=c++17",
                                        "-default-device", std::string("-I") + METILE_CUDA_INCLUDE_DIR};
  arguments.insert(arguments.end(), options.extra.begin(), options.extra.end());

  std::string key_material = fmt::format("nvrtc {}\nkernel {}\n", nvrtc_version(), kernel_name);
  for (const std::string& argument : arguments) key_material += argument + "\n";
  key_material += source;
  program.cache_key = stable_hash_hex(key_material);
  const std::filesystem::path cache_path = kernel_cache_path(program.cache_key);

  if (options.use_cache) {
    bool was_corrupt = false;
    if (auto cached = read_cache_entry(cache_path, was_corrupt)) {
      program.cubin = std::move(*cached);
      program.from_cache = true;
      return program;
    }
    program.rebuilt_corrupt_cache_entry = was_corrupt;
  }

  const std::string source_text(source);
  const std::string program_name = program.kernel_name + ".cu";
  nvrtcProgram handle = nullptr;
  check_nvrtc(nvrtc_api().nvrtcCreateProgram(&handle, source_text.c_str(), program_name.c_str(), 0, nullptr, nullptr),
              "nvrtcCreateProgram");
  std::unique_ptr<_nvrtcProgram, void (*)(_nvrtcProgram*)> owned(handle, [](_nvrtcProgram* p) {
    nvrtc_api().nvrtcDestroyProgram(&p);
  });
  std::vector<const char*> argument_pointers;
  for (const std::string& argument : arguments) argument_pointers.push_back(argument.c_str());
  const nvrtcResult compiled =
      nvrtc_api().nvrtcCompileProgram(handle, static_cast<int>(argument_pointers.size()), argument_pointers.data());
  std::size_t log_size = 0;
  check_nvrtc(nvrtc_api().nvrtcGetProgramLogSize(handle, &log_size), "nvrtcGetProgramLogSize");
  program.log.resize(log_size);
  if (log_size > 0) check_nvrtc(nvrtc_api().nvrtcGetProgramLog(handle, program.log.data()), "nvrtcGetProgramLog");
  while (!program.log.empty() && (program.log.back() == '\0' || program.log.back() == '\n')) program.log.pop_back();
  if (compiled != NVRTC_SUCCESS) {
    throw CudaError(fmt::format("nvrtcCompileProgram({}, {}): {}\n{}", program.kernel_name, program.architecture,
                                nvrtc_api().nvrtcGetErrorString(compiled), program.log));
  }
  std::size_t cubin_size = 0;
  check_nvrtc(nvrtc_api().nvrtcGetCUBINSize(handle, &cubin_size), "nvrtcGetCUBINSize");
  program.cubin.resize(cubin_size);
  check_nvrtc(nvrtc_api().nvrtcGetCUBIN(handle, program.cubin.data()), "nvrtcGetCUBIN");
  if (options.use_cache) write_cache_entry(cache_path, program.cubin);
  return program;
}

// ---------------------------------------------------------------- loading
CompiledKernel CompiledKernel::load(const CompiledProgram& program) {
  const auto& api = cuda_driver::driver();
  CUmodule module = nullptr;
  cuda_driver::check(api.cuModuleLoadData(&module, program.cubin.data()),
                     fmt::format("cuModuleLoadData({}, {})", program.kernel_name, program.architecture));
  CompiledKernel kernel;
  kernel.module_ = std::shared_ptr<CUmod_st>(module, [](CUmod_st* handle) {
    cuda_driver::driver().cuModuleUnload(handle);
  });
  cuda_driver::check(api.cuModuleGetFunction(&kernel.function_, module, program.kernel_name.c_str()),
                     fmt::format("cuModuleGetFunction({})", program.kernel_name));
  kernel.name_ = program.kernel_name;
  kernel.from_cache_ = program.from_cache;
  return kernel;
}

int CompiledKernel::registers_per_thread() const {
  int registers = 0;
  cuda_driver::check(cuda_driver::driver().cuFuncGetAttribute(&registers, CU_FUNC_ATTRIBUTE_NUM_REGS, function_),
                     fmt::format("cuFuncGetAttribute({}, registers)", name_));
  return registers;
}

int CompiledKernel::max_active_blocks_per_multiprocessor(int block_threads, std::size_t dynamic_shared_bytes) const {
  int blocks = 0;
  cuda_driver::check(cuda_driver::driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, function_, block_threads,
                                                                                       dynamic_shared_bytes),
                     fmt::format("cuOccupancyMaxActiveBlocksPerMultiprocessor({}, {} threads)", name_, block_threads));
  return blocks;
}

void CompiledKernel::set_max_dynamic_shared_memory(int bytes) const {
  cuda_driver::check(cuda_driver::driver().cuFuncSetAttribute(
                         function_, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes),
                     fmt::format("cuFuncSetAttribute({}, max dynamic shared memory {})", name_, bytes));
}

void CompiledKernel::set_preferred_shared_memory_carveout(int percent) const {
  cuda_driver::check(cuda_driver::driver().cuFuncSetAttribute(
                         function_, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, percent),
                     fmt::format("cuFuncSetAttribute({}, preferred shared memory carveout {}%)", name_, percent));
}

CompiledKernel compile_cuda(std::string_view source, std::string_view kernel_name, CompileOptions options) {
  if (options.architecture.empty()) options.architecture = current_device_architecture();
  return CompiledKernel::load(compile_cuda_program(source, kernel_name, options));
}

std::vector<CubinInstruction> cubin_kernel_instructions(const std::string& cubin, const std::string& kernel) {
  auto read = [&](std::size_t offset, auto value) {
    if (offset + sizeof(value) > cubin.size()) throw std::runtime_error("cubin_kernel_instructions: truncated cubin");
    std::memcpy(&value, cubin.data() + offset, sizeof(value));
    return value;
  };
  const auto section_offset = read(0x28, std::uint64_t{});
  const auto entry_size = read(0x3A, std::uint16_t{}), count = read(0x3C, std::uint16_t{}), names = read(0x3E, std::uint16_t{});
  auto header = [&](int index, int field) { return section_offset + static_cast<std::uint64_t>(index) * entry_size + field; };
  const auto name_table = read(header(names, 0x18), std::uint64_t{});
  for (int i = 0; i < count; ++i) {
    const std::string name(cubin.c_str() + name_table + read(header(i, 0), std::uint32_t{}));
    if (name != ".text." + kernel) continue;
    const auto offset = read(header(i, 0x18), std::uint64_t{}), size = read(header(i, 0x20), std::uint64_t{});
    std::vector<CubinInstruction> text(size / 16);
    for (std::size_t k = 0; k < text.size(); ++k) {
      text[k].low = read(offset + 16 * k, std::uint64_t{});
      text[k].high = read(offset + 16 * k + 8, std::uint64_t{});
    }
    return text;
  }
  throw std::runtime_error(fmt::format("cubin_kernel_instructions: no section .text.{} in the cubin", kernel));
}

}  // namespace metile
