// metile fused attention on the device: FlashAttention compiles one flash_attention problem's
// generated kernel (include/metile/attention.h, src/codegen/attention_kernels.cpp) for the current
// device, owns its scratch and launches it (src/runtime/cuda/attention_runtime.cpp). Kept apart from
// attention.h so that codegen includes no runtime header (docs/architecture.md, "Layering").
#pragma once

#include <cstdint>
#include <memory>

#include "metile/attention.h"
#include "metile/cuda_runtime.h"

namespace metile {

struct FlashAttentionOptions {
  int decode_warps = 0;             // 2, 4 or 8; 0: default_decode_shape() picks warps and cluster
  int decode_stages = 0;
  bool decode_cluster = false;      // with decode_warps set: a head's splits as one thread-block
                                    // cluster (DecodeAttentionConfig::cluster)
  std::int64_t keys_per_split = 0;  // 0: decode_keys_per_split() for the device's multiprocessors
  int prefill_warps = 4;
  bool force_prefill = false;       // the tiled kernel even for R <= 16 (tests, benchmarks)
};

// The decode kernel's configuration for `problem` under `options` on a device of `multiprocessors`:
// the one place build() and the flash_attention lowering (its decision key, at an H200's 132) decide
// warps, cluster and split.
DecodeAttentionConfig decode_attention_config(const AttentionProblem& problem, const FlashAttentionOptions& options,
                                              int multiprocessors);

// One flash_attention problem compiled and loaded for the current device, with its scratch.
// enqueue() only launches, so it can be captured in a CUDA graph; the scratch makes one instance
// serve one stream at a time.
class FlashAttention {
 public:
  static FlashAttention build(const AttentionProblem& problem, const FlashAttentionOptions& options = {});
  ~FlashAttention();
  FlashAttention(FlashAttention&&) noexcept;
  FlashAttention& operator=(FlashAttention&&) noexcept;

  const AttentionProblem& problem() const;
  const AttentionKernelSource& kernel() const;
  // Device addresses; positions is 0 unless the mask is "positions".
  void enqueue(const CudaStream& stream, std::uint64_t q, std::uint64_t k, std::uint64_t v, std::uint64_t positions,
               std::uint64_t out) const;

 private:
  struct State;
  explicit FlashAttention(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace metile
