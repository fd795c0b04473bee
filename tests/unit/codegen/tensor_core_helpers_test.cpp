// The tensor-core device helpers (src/codegen/tensor_core_helpers.cpp) are one piece of text that
// both kernel families start from: every generated GEMV (both mainloops) and attention kernel
// defines mma() and component() exactly once, with both m16n8k16 instructions (f16, bf16)
// present once each, so that no generator carries a second, drifting copy.
#include <gtest/gtest.h>

#include <string>
#include <string_view>

#include "metile/attention.h"
#include "metile/gemv.h"

namespace metile {
namespace {

std::size_t occurrences(std::string_view text, std::string_view needle) {
  std::size_t count = 0;
  for (std::size_t at = text.find(needle); at != std::string_view::npos; at = text.find(needle, at + 1)) ++count;
  return count;
}

void expect_helpers_once(const std::string& source, const std::string& where) {
  EXPECT_EQ(occurrences(source, "__device__ __forceinline__ void mma("), 1u) << where;
  EXPECT_EQ(occurrences(source, "__device__ __forceinline__ u32 component("), 1u) << where;
  EXPECT_EQ(occurrences(source, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"), 1u) << where;
  EXPECT_EQ(occurrences(source, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"), 1u) << where;
  EXPECT_EQ(occurrences(source, "typedef unsigned int u32;"), 1u) << where;
  // Helpers precede the kernel entry that calls them.
  EXPECT_LT(source.find("void mma("), source.find("extern \"C\" __global__")) << where;
}

TEST(TensorCoreHelpers, EveryGemvMainloopEmitsThemOnce) {
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (GemvWeightFormat format : {GemvWeightFormat::dense(dtype), GemvWeightFormat::affine(4, 64, dtype),
                                    GemvWeightFormat::affine(8, 64, dtype)}) {
      for (GemvMainloop mainloop : {GemvMainloop::register_batches, GemvMainloop::streamed}) {
        for (const GemvEpilogue& epilogue : {GemvEpilogue::store(), GemvEpilogue::swiglu()}) {
          GemvKernelConfig config;
          config.format = format;
          config.rows = 2;
          config.out_features = 64;
          config.in_features = 512;
          config.epilogue = epilogue;
          config.mainloop = mainloop;
          if (mainloop == GemvMainloop::streamed) config.warps_per_block = 8;
          expect_helpers_once(generate_gemv_kernel(config).source, config.to_string());
        }
      }
    }
  }
}

TEST(TensorCoreHelpers, DecodeAndPrefillAttentionEmitThemOnce) {
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (int stages : {0, 2}) {
      DecodeAttentionConfig decode;
      decode.problem.dtype = dtype;
      decode.problem.heads = 2;
      decode.problem.rows = 4;
      decode.problem.keys = 512;
      decode.stages = stages;
      expect_helpers_once(generate_decode_attention_kernel(decode).source, decode.problem.to_string());
    }
    PrefillAttentionConfig prefill;
    prefill.problem.dtype = dtype;
    prefill.problem.heads = 2;
    prefill.problem.rows = 128;
    prefill.problem.keys = 128;
    prefill.problem.mask = AttentionMask::causal;
    expect_helpers_once(generate_prefill_attention_kernel(prefill).source, prefill.problem.to_string());
  }
}

}  // namespace
}  // namespace metile
