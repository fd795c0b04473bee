// metile fused attention on the device: FlashAttention compiles one flash_attention problem's
// generated kernel (include/metile/attention.h, src/codegen/attention_kernels.cpp) for the current
// device, owns its scratch and launches it (src/runtime/cuda/attention_runtime.cpp). Kept apart from
// attention.h so that codegen includes no runtime header (docs/architecture.md, "Layering").
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "metile/attention.h"
#include "metile/cuda_runtime.h"

namespace metile {

struct FlashAttentionOptions {
  int decode_warps = 0;             // 1, 2, 4 or 8; 0: default_decode_shape() picks warps and cluster
  int decode_stages = 0;
  bool decode_cluster = false;      // with decode_warps set: a head's splits as one thread-block
                                    // cluster (DecodeAttentionConfig::cluster)
  std::int64_t keys_per_split = 0;  // 0: decode_keys_per_split() for the device's multiprocessors
  bool decode_l2_prefetch = false;  // DecodeAttentionConfig::l2_prefetch (with any shape, default or not)
  bool decode_cache_before_wait = false;  // DecodeAttentionConfig::cache_before_wait (the caller vouches
                                          // that no kernel before this one in the run writes those rows)
  int prefill_warps = 4;
  bool force_prefill = false;       // the tiled kernel even for R <= 16 (tests, benchmarks)
};

// The decode kernel's configuration for `problem` under `options` on a device of `multiprocessors`:
// the one place build() and the flash_attention lowering (its decision key, at an H200's 132) decide
// warps, cluster and split.
DecodeAttentionConfig decode_attention_config(const AttentionProblem& problem, const FlashAttentionOptions& options,
                                              int multiprocessors);

// The decode launch shapes worth racing for `problem`, each under a name for reports ("" first: the
// default, the options FlashAttention::build takes when given none), no two with the same kernel
// at an H200's 132 multiprocessors. Caches of up to 4096 keys over fewer than kOneSplitHeads
// heads: one- and two-warp clusters (many small splits); caches of up to kLongestOneSplit keys:
// the one-split grid (one 8-warp block per head); beyond kLongestOneSplit keys: the default with
// the L2 prefetch. attention_benchmark and the GPU suite run each; the flash_attention lowering
// offers the default only (a race among these picked the 2-warp cluster for Llama-3.2-1B, whose
// decode step then took 0.552 against 0.516 ms: notes/attention.md, session 7).
struct DecodeVariant {
  std::string name;
  FlashAttentionOptions options;
};
std::vector<DecodeVariant> decode_attention_variants(const AttentionProblem& problem);

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
  // Device addresses; positions is 0 unless the mask is "positions". On a stream set for
  // programmatic dependent launch (CudaStream::set_programmatic_dependent_launch) the kernel
  // launches as a programmatic dependent: it lets the next kernel launch at once and touches
  // memory only after griddepcontrol.wait, so its launch overlaps the previous kernel's tail.
  void enqueue(const CudaStream& stream, std::uint64_t q, std::uint64_t k, std::uint64_t v, std::uint64_t positions,
               std::uint64_t out) const;

 private:
  struct State;
  explicit FlashAttention(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace metile
