// The decode MLP's two GEMV stages as the benchmarks build them by hand (no graph, no planner): gate/up
// (both matrices, N = intermediate, K = hidden) with the SwiGLU epilogue rounded as the planned region
// rounds, and down (N = hidden, K = intermediate) with the residual add. mlp_decode_benchmark,
// gemv_sass_benchmark and gemv_timeline_benchmark start their shapes from these.
#pragma once

#include <cstdint>

#include "metile/gemv.h"

namespace metile::benchmarks {

struct DecodeMlpStageConfigs {
  GemvKernelConfig gate_up, down;
};

inline DecodeMlpStageConfigs decode_mlp_stage_configs(const GemvWeightFormat& format, std::int64_t rows, std::int64_t hidden,
                                                      std::int64_t intermediate) {
  DecodeMlpStageConfigs stages;
  stages.gate_up.format = format;
  stages.gate_up.rows = rows;
  stages.gate_up.out_features = intermediate;
  stages.gate_up.in_features = hidden;
  stages.gate_up.epilogue = GemvEpilogue::swiglu(format.activation);
  stages.down = stages.gate_up;
  stages.down.out_features = hidden;
  stages.down.in_features = intermediate;
  stages.down.epilogue = GemvEpilogue::residual_add("residual", format.activation);
  return stages;
}

}  // namespace metile::benchmarks
