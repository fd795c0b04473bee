// Loading and launching generated GEMVs: what every caller (the GEMV lowerings, the decode-MLP
// executor, the GPU tests, the benchmark) needs beyond a plain launch, written once. A streamed or
// staged kernel may ask for more than 48 KiB of dynamic shared memory (the limit is raised at load);
// a streamed or split-K kernel reads a workspace of fp32 partials and per-tile counters, zeroed here
// once; each launch leaves the counters at zero. A tile loop's grid is cut to what stays resident.
#include <fmt/core.h>

#include <algorithm>
#include <future>

#include "metile/dispatch.h"

namespace metile {

LoadedGemv LoadedGemv::load(GemvKernelSource kernel, const CompiledProgram& program) {
  LoadedGemv loaded;
  loaded.compiled = CompiledKernel::load(program);
  // The opt-in counts static shared memory too: a staged kernel with 48 KiB of rings and 4 KiB of
  // partial sums fails to launch without it (CUDA_ERROR_INVALID_VALUE, notes/mlp_decode.md call 8).
  if (kernel.dynamic_shared_bytes + kernel.static_shared_bytes > 48 * 1024) {
    loaded.compiled.set_max_dynamic_shared_memory(static_cast<int>(kernel.dynamic_shared_bytes));
  }
  if (kernel.shared_memory_carveout_percent >= 0) {
    loaded.compiled.set_preferred_shared_memory_carveout(kernel.shared_memory_carveout_percent);
  }
  if (kernel.co_resident_blocks_per_multiprocessor > 0) {
    // A grid whose blocks wait for one another (a grid-wide barrier) deadlocks unless every block is
    // resident at once: refuse it unless the driver keeps that many blocks per SM for this kernel.
    const int resident = loaded.compiled.max_active_blocks_per_multiprocessor(
        static_cast<int>(kernel.block_threads), kernel.dynamic_shared_bytes);
    const std::int64_t capacity = std::int64_t{resident} * current_device_multiprocessors();
    if (resident < kernel.co_resident_blocks_per_multiprocessor || kernel.grid_blocks > capacity) {
      throw CudaError(fmt::format("{}: {} blocks must be resident at once, the device keeps {} per SM ({} in all)",
                                  kernel.kernel_name, kernel.grid_blocks, resident, capacity));
    }
  }
  if (kernel.blocks_per_multiprocessor_cap > 0) {
    // Shared memory the kernel does not use, the least (in 256-byte steps) that leaves at most the cap
    // of blocks an SM; none where registers or shared memory already hold it there. Past 48 KiB the
    // kernel opts in (a cap of 1 on Hopper's 228 KiB an SM takes over 114 KiB a block).
    auto resident = [&] {
      return loaded.compiled.max_active_blocks_per_multiprocessor(static_cast<int>(kernel.block_threads),
                                                                  kernel.dynamic_shared_bytes);
    };
    const std::int64_t limit = current_device_shared_memory_per_block_optin();
    while (resident() > kernel.blocks_per_multiprocessor_cap &&
           std::int64_t{kernel.dynamic_shared_bytes} + kernel.static_shared_bytes + 256 <= limit) {
      kernel.dynamic_shared_bytes += 256;
      if (kernel.dynamic_shared_bytes + kernel.static_shared_bytes > 48 * 1024) {
        loaded.compiled.set_max_dynamic_shared_memory(static_cast<int>(kernel.dynamic_shared_bytes));
      }
    }
  }
  if (kernel.grid_shrinks_to_resident) {
    const int resident = loaded.compiled.max_active_blocks_per_multiprocessor(
        static_cast<int>(kernel.block_threads), kernel.dynamic_shared_bytes);
    if (resident < 1) throw CudaError(fmt::format("{}: no block of it fits an SM", kernel.kernel_name));
    const std::int64_t capacity = std::int64_t{resident} * current_device_multiprocessors();
    kernel.grid_blocks = static_cast<unsigned>(std::min<std::int64_t>(kernel.grid_blocks, capacity));
  }
  if (kernel.workspace_bytes > 0) {
    loaded.workspace = std::make_shared<DeviceBuffer>(static_cast<std::size_t>(kernel.workspace_bytes));
    loaded.workspace->fill_bytes(0);
  }
  loaded.kernel = std::move(kernel);
  return loaded;
}

void LoadedGemv::launch(const CudaStream& stream, KernelArguments arguments, bool programmatic_dependent) const {
  if (workspace) arguments.add_pointer(*workspace);
  const Dim3 grid{kernel.grid_blocks, 1, 1}, block{kernel.block_threads, 1, 1};
  launch_waiting_kernel(compiled, grid, block, kernel.dynamic_shared_bytes, stream, arguments, programmatic_dependent);
}

std::vector<CompiledProgram> compile_gemvs(const std::vector<GemvKernelSource>& kernels) {
  // The compiling threads have no context of their own: the architecture comes from this one.
  CompileOptions options;
  options.architecture = current_device_architecture();
  std::vector<std::future<CompiledProgram>> futures;
  for (const GemvKernelSource& kernel : kernels) {
    futures.push_back(std::async(std::launch::async, [&kernel, options] {
      return compile_cuda_program(kernel.source, kernel.kernel_name, options);
    }));
  }
  std::vector<CompiledProgram> programs;
  for (auto& future : futures) programs.push_back(future.get());
  return programs;
}

std::vector<LoadedGemv> load_gemvs(std::vector<GemvKernelSource> kernels) {
  const std::vector<CompiledProgram> programs = compile_gemvs(kernels);
  std::vector<LoadedGemv> loaded;
  for (std::size_t i = 0; i < kernels.size(); ++i) loaded.push_back(LoadedGemv::load(std::move(kernels[i]), programs[i]));
  return loaded;
}

}  // namespace metile
