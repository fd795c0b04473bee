// The device helpers both GEMV mainloops start from (gemv_internal.h): the layout's derived
// constants, conversions, activations, and the affine code unpacking (after the tensor-core helpers of tensor_core_helpers.cpp).
// Kept apart from either generator so that the register-batch and the streamed mainloop share
// one definition of how a repacked word becomes an m16n8k16 A fragment.
#include <fmt/core.h>

#include "codegen_internal.h"
#include "gemv_internal.h"

namespace metile::gemv_detail {
namespace {

constexpr std::string_view device_helpers = R"CUDA(

constexpr bool kAffine = kBits != 16;
constexpr int kChunksPerLoad = kBits == 16 ? 1 : (kBits == 8 ? 2 : 4);  // 32-column chunks per 16-byte vector
constexpr int kColumnsPerLoad = 32 * kChunksPerLoad;
constexpr int kLoadsPerIteration = kColumnsPerIteration / kColumnsPerLoad;
constexpr int kChunksPerIteration = kColumnsPerIteration / 32;
constexpr int kIterations = (kK + kColumnsPerIteration - 1) / kColumnsPerIteration;
constexpr int kLoadBlocks = kIterations * kLoadsPerIteration;           // per tile, repacked layout
constexpr int kGroupsPerIteration = kAffine ? kColumnsPerIteration / kGroup : 1;
constexpr int kChunksPerGroup = kChunksPerIteration / kGroupsPerIteration;
constexpr int kGroupCount = kIterations * kGroupsPerIteration;          // per tile, padded
constexpr int kRowHalves = (kM + 7) / 8;                                // mma B halves
constexpr int kPaddedM = 8 * kRowHalves;
constexpr int kTileCount = (kN + 15) / 16;
constexpr int kThreads = kWarps * 32;
// The value the magic-number conversion adds to each code (subtracted through sum(x)).
constexpr float kCodeOffset = kHalf ? 1024.0f : (kBits == 4 ? 128.0f : 0.0f);
constexpr u32 kOnes = kHalf ? 0x3C003C00u : 0x3F803F80u;  // (1, 1) in the activation dtype

__device__ __forceinline__ float to_f32(u32 bits16) {
  if constexpr (kHalf) {
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"((u16)bits16));
    return value;
  } else {
    return __uint_as_float(bits16 << 16);
  }
}

__device__ __forceinline__ u16 from_f32(float value) {
  u16 bits16;
  if constexpr (kHalf) {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits16) : "f"(value));
  } else {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits16) : "f"(value));
  }
  return bits16;
}

// Weights are read once: keep them out of L1, where x lives.
__device__ __forceinline__ uint4 load_weights(const void* address) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(address));
  return v;
}
// x is read by every warp of every block: let L1 and L2 serve the repeats.
__device__ __forceinline__ uint4 load_activations(const void* address) {
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(address));
  return v;
}
__device__ __forceinline__ uint2 load_scale_bias(const void* address) {
  uint2 v;
  asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(address));
  return v;
}

// Pair j of a repacked word as two activation-dtype values (offset + q_lo, offset + q_hi).
__device__ __forceinline__ u32 code_pair(u32 word, int j) {
  if constexpr (kBits == 4) {
    return ((word >> (4 * j)) & 0x000F000Fu) | (kHalf ? 0x64006400u : 0x43004300u);
  } else if constexpr (kHalf) {
    return ((word >> (8 * j)) & 0x00FF00FFu) | 0x64006400u;
  } else {
    // bf16 holds 0..255 exactly but not 128 + q for q >= 128: go through f32 (2^23 + q).
    const float low = __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540u | j)) - 8388608.0f;
    const float high = __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540u | (j + 2))) - 8388608.0f;
    u32 pair;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(high), "f"(low));
    return pair;
  }
}

// The A fragments of the two 16-column mma steps of chunk `chunk` of one 16-byte load pair.
__device__ __forceinline__ void affine_fragments(const uint4& rows_low, const uint4& rows_high, int chunk,
                                                 u32 (&step0)[4], u32 (&step1)[4]) {
  if constexpr (kBits == 4) {
    const u32 low = component(rows_low, chunk), high = component(rows_high, chunk);
    step0[0] = code_pair(low, 0); step0[1] = code_pair(high, 0); step0[2] = code_pair(low, 1); step0[3] = code_pair(high, 1);
    step1[0] = code_pair(low, 2); step1[1] = code_pair(high, 2); step1[2] = code_pair(low, 3); step1[3] = code_pair(high, 3);
  } else {
    const u32 low0 = component(rows_low, 2 * chunk), high0 = component(rows_high, 2 * chunk);
    const u32 low1 = component(rows_low, 2 * chunk + 1), high1 = component(rows_high, 2 * chunk + 1);
    step0[0] = code_pair(low0, 0); step0[1] = code_pair(high0, 0); step0[2] = code_pair(low0, 1); step0[3] = code_pair(high0, 1);
    step1[0] = code_pair(low1, 0); step1[1] = code_pair(high1, 0); step1[2] = code_pair(low1, 1); step1[3] = code_pair(high1, 1);
  }
}

)CUDA";

}  // namespace

std::string gemv_device_helpers() {
  return std::string(codegen_detail::tensor_core_device_helpers()) + std::string(device_helpers);
}

std::string gemv_format_tag(const GemvWeightFormat& format) {
  const std::string dtype(dtype_name(format.activation));
  if (!format.is_affine()) return dtype;
  return fmt::format("{}_a{}g{}", dtype, format.bits, format.group_size);
}

std::string gemv_kernel_entry(const GemvKernelConfig& config, const std::string& kernel_name,
                              std::string_view extra_parameters) {
  const int products = config.epilogue.product_count();
  const std::vector<GemvEpilogue::TensorInput> tensors = config.epilogue.tensor_inputs();
  std::string source = fmt::format("\nextern \"C\" __global__ void __launch_bounds__(kThreads) {}(\n", kernel_name);
  for (int p = 0; p < products; ++p) {
    source += fmt::format("    const u32* __restrict__ weights{}, ", p);
    if (config.format.is_affine()) source += fmt::format("const u16* __restrict__ scale_bias{}, ", p);
    source += "\n";
  }
  source += "    const u16* __restrict__ x,\n";
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    source += fmt::format("    const u16* __restrict__ tensor{},  // {}{}\n", i, tensors[i].name,
                          tensors[i].broadcast_rows ? " [N]" : " [M, N]");
  }
  source += fmt::format("    u16* __restrict__ out{}) {{\n", extra_parameters);
  source += fmt::format("  const u32* const weights[kProducts] = {{weights0{}}};\n", products == 2 ? ", weights1" : "");
  if (config.format.is_affine()) {
    source += fmt::format("  const u16* const scale_bias[kProducts] = {{scale_bias0{}}};\n",
                          products == 2 ? ", scale_bias1" : "");
  } else {
    source += fmt::format("  const u16* const scale_bias[kProducts] = {{nullptr{}}};\n", products == 2 ? ", nullptr" : "");
  }
  return source;
}

std::string gemv_problem_constants(const GemvKernelConfig& config) {
  return fmt::format(
      "constexpr int kM = {};\nconstexpr int kN = {};\nconstexpr int kK = {};\n"
      "constexpr int kBits = {};\nconstexpr int kGroup = {};\nconstexpr bool kHalf = {};\n"
      "constexpr int kColumnsPerIteration = {};\nconstexpr int kProducts = {};\nconstexpr int kWarps = {};\n",
      config.rows, config.out_features, config.in_features, config.format.bits, config.format.group_size,
      config.format.activation == DType::f16 ? "true" : "false", config.format.columns_per_iteration(),
      config.epilogue.product_count(), config.warps_per_block);
}

}  // namespace metile::gemv_detail
