// libFuzzer harness: target files (FusionTarget::from_json). Any input must parse
// or throw InputError; an accepted target must round-trip through to_json and plan
// the seed graph without an exception (its costs saturate, never overflow).
#include <cstdint>
#include <optional>
#include <cstdlib>
#include <string_view>

#include "metile/fusion.h"
#include "metile/graph.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::optional<metile::FusionTarget> target;
  try {
    target.emplace(metile::FusionTarget::from_json(text, "fuzz.json"));
  } catch (const metile::InputError&) {
    return 0;
  }
  if (metile::FusionTarget::from_json(target->to_json(), "fuzz.json").to_json() != target->to_json()) std::abort();
  static const metile::ComputeGraph seed = [] {
    metile::GraphBuilder builder;
    const auto values = builder.input("values", {{64, 4096}, metile::DType::f16});
    const auto residual = builder.input("residual", {{64, 4096}, metile::DType::f16});
    const auto weight = builder.input("weight", {{4096}, metile::DType::f16});
    const auto summed = builder.add(values, residual, "summed");
    return builder.build({summed, builder.rms_norm(summed, weight, 1e-5, "normalized")});
  }();
  (void)metile::plan_graph_fusion(seed, *target).explain();
  return 0;
}
