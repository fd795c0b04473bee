// FlashAttention: one flash_attention problem's generated kernel (src/codegen/attention_kernels.cpp)
// compiled for the current device, its scratch (decode: partial states of every split and the
// per-head arrival counters the last split uses to find itself), and its launch.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>

#include "cuda_driver.h"
#include "metile/attention_runtime.h"

namespace metile {

struct FlashAttention::State {
  AttentionProblem problem;
  AttentionKernelSource kernel;
  CompiledKernel compiled;
  bool decode = false;
  float scale_log2 = 0;
  DeviceBuffer partial_values, partial_states, arrivals;
};

FlashAttention::FlashAttention(std::unique_ptr<State> state) : state_(std::move(state)) {}
FlashAttention::~FlashAttention() = default;
FlashAttention::FlashAttention(FlashAttention&&) noexcept = default;
FlashAttention& FlashAttention::operator=(FlashAttention&&) noexcept = default;

DecodeAttentionConfig decode_attention_config(const AttentionProblem& problem, const FlashAttentionOptions& options,
                                              int multiprocessors) {
  DecodeAttentionConfig config;
  config.problem = problem;
  const DecodeShape shape = options.decode_warps == 0 ? default_decode_shape(problem)
                                                      : DecodeShape{options.decode_warps, options.decode_cluster, false};
  config.warps = shape.warps;
  config.cluster = shape.cluster;
  config.keys_per_split = options.keys_per_split;
  config.stages = options.decode_stages;
  config.l2_prefetch = options.decode_l2_prefetch;
  config.cache_before_wait = options.decode_cache_before_wait;
  if (config.keys_per_split == 0 && shape.one_split) config.keys_per_split = (problem.keys + 15) / 16 * 16;
  if (config.keys_per_split == 0) {
    // A head's splits in one cluster: at most kMaxClusterSplits of them.
    const std::int64_t blocks = config.cluster ? std::min<std::int64_t>(multiprocessors, kMaxClusterSplits * problem.heads)
                                               : multiprocessors;
    config.keys_per_split = decode_keys_per_split(problem, config.warps, static_cast<int>(blocks));
  }
  return config;
}

std::vector<DecodeVariant> decode_attention_variants(const AttentionProblem& problem) {
  std::vector<DecodeVariant> variants = {{"", {}}};
  if (!problem.is_decode()) return variants;
  // Beyond kLongestClustered keys a cluster holds too few bytes in flight (default_decode_shape).
  if (problem.keys <= kLongestClustered && problem.heads < kOneSplitHeads) {
    for (int warps : {1, 2}) {
      FlashAttentionOptions options;
      options.decode_warps = warps;
      options.decode_cluster = true;
      variants.push_back({fmt::format("cluster w{}", warps), options});
    }
  }
  if (problem.keys <= kLongestOneSplit) {
    FlashAttentionOptions options;
    options.decode_warps = 8;
    options.keys_per_split = (problem.keys + 15) / 16 * 16;
    variants.push_back({"one split w8", options});
  } else {
    FlashAttentionOptions options;
    options.decode_l2_prefetch = true;
    variants.push_back({"l2 prefetch", options});
  }
  // The default is one of the shapes above for some problems: keep each kernel once, first name wins.
  std::vector<DecodeVariant> distinct;
  std::vector<std::string> names;
  for (DecodeVariant& variant : variants) {
    const AttentionKernelSource kernel = generate_decode_attention_kernel(decode_attention_config(problem, variant.options, 132));
    const std::string identity = fmt::format("{} {} {}", kernel.kernel_name, kernel.splits, kernel.keys_per_split);
    if (std::find(names.begin(), names.end(), identity) != names.end()) continue;
    names.push_back(identity);
    distinct.push_back(std::move(variant));
  }
  return distinct;
}

FlashAttention FlashAttention::build(const AttentionProblem& problem, const FlashAttentionOptions& options) {
  problem.validate();
  auto state = std::make_unique<State>();
  state->problem = problem;
  state->decode = problem.is_decode() && !options.force_prefill;
  if (state->decode) {
    const DecodeAttentionConfig config = decode_attention_config(problem, options, current_device_multiprocessors());
    state->kernel = generate_decode_attention_kernel(config);
  } else {
    PrefillAttentionConfig config;
    config.problem = problem;
    config.warps = options.prefill_warps;
    state->kernel = generate_prefill_attention_kernel(config);
  }
  state->compiled = compile_cuda(state->kernel.source, state->kernel.kernel_name);
  if (state->kernel.launch.shared_memory_bytes > 48 * 1024) {
    state->compiled.set_max_dynamic_shared_memory(static_cast<int>(state->kernel.launch.shared_memory_bytes));
  }
  if (state->kernel.cluster) {
    // A cluster of more than 8 CTAs (Hopper takes 16) must be allowed per kernel. The summary
    // says how many clusters fit on the device at once (fewer than the heads: a second wave).
    const cuda_driver::DriverApi& driver = cuda_driver::driver();
    const AttentionKernelSource& kernel = state->kernel;
    if (kernel.splits > 8) {
      cuda_driver::check(driver.cuFuncSetAttribute(state->compiled.function(),
                                                   CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                         "cuFuncSetAttribute(non-portable cluster size)");
    }
    CUlaunchConfig launch{};
    launch.gridDimX = kernel.launch.grid_x;
    launch.gridDimY = kernel.launch.grid_y;
    launch.gridDimZ = 1;
    launch.blockDimX = kernel.launch.block_x;
    launch.blockDimY = launch.blockDimZ = 1;
    launch.sharedMemBytes = kernel.launch.shared_memory_bytes;
    int clusters = 0;
    const CUresult query = driver.cuOccupancyMaxActiveClusters(&clusters, state->compiled.function(), &launch);
    // A cluster picked by default that would run the heads in two waves (8-warp clusters of 16
    // fit only 7 at once on the H200 and ran 1.5x slower, notes/attention.md) gives way to the
    // 8-warp global merge; one asked for explicitly is kept, and its summary says so.
    if (options.decode_warps == 0 && query == CUDA_SUCCESS && clusters < problem.heads) {
      FlashAttentionOptions global_merge = options;
      global_merge.decode_warps = 8;
      global_merge.decode_cluster = false;
      return build(problem, global_merge);
    }
    state->kernel.summary += query == CUDA_SUCCESS ? fmt::format(" ({} at once)", clusters) : " (occupancy unknown)";
  }
  state->scale_log2 = flash_attention_scale_log2(problem.scale);
  if (state->decode && !state->kernel.cluster && state->kernel.splits > 1) {
    const auto states = static_cast<std::size_t>(problem.heads * state->kernel.splits * problem.rows);
    state->partial_values = DeviceBuffer(states * static_cast<std::size_t>(problem.value_dim) * sizeof(float));
    state->partial_states = DeviceBuffer(states * 2 * sizeof(float));
    state->arrivals = DeviceBuffer(static_cast<std::size_t>(problem.heads) * sizeof(std::uint32_t));
    state->arrivals.fill_bytes(0);  // the kernel leaves the counters at zero after every launch
  }
  return FlashAttention(std::move(state));
}

const AttentionProblem& FlashAttention::problem() const { return state_->problem; }
const AttentionKernelSource& FlashAttention::kernel() const { return state_->kernel; }

void FlashAttention::enqueue(const CudaStream& stream, std::uint64_t q, std::uint64_t k, std::uint64_t v,
                             std::uint64_t positions, std::uint64_t out) const {
  const State& s = *state_;
  if (s.problem.mask == AttentionMask::positions && positions == 0) {
    throw InputError("flash_attention: mask 'positions' needs a positions buffer");
  }
  const Dim3 grid{s.kernel.launch.grid_x, s.kernel.launch.grid_y, 1};
  const Dim3 block{s.kernel.launch.block_x, 1, 1};
  const auto keys = static_cast<std::int32_t>(s.problem.keys);
  const auto offset = static_cast<std::int32_t>(s.problem.offset);
  KernelArguments arguments;
  for (std::uint64_t pointer : {q, k, v, positions, out}) arguments.add_pointer(pointer);
  if (s.decode) {
    for (const DeviceBuffer* workspace : {&s.partial_values, &s.partial_states, &s.arrivals}) {
      arguments.add_pointer(workspace->address());
    }
  } else {
    arguments.add_int32(static_cast<std::int32_t>(s.problem.rows));
  }
  arguments.add_int32(keys);
  arguments.add_float(s.scale_log2);
  arguments.add_int32(offset);
  // Both kernels wait for the kernel before them before they touch memory (griddepcontrol), so on
  // a stream that asks for it they launch as programmatic dependents, like the GEMVs.
  launch_waiting_kernel(s.compiled, grid, block, s.kernel.launch.shared_memory_bytes, stream, arguments);
}

}  // namespace metile
