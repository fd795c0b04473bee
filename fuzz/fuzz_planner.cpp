// libFuzzer harness: the planner on every graph the JSON reader accepts, for both
// target presets. Planning a valid graph must never throw; any exception (an
// InputError included, e.g. a flow network refusing a capacity) is a finding.
#include <cstdint>
#include <optional>
#include <string_view>

#include "metile/fusion.h"
#include "metile/graph.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::optional<metile::ComputeGraph> graph;
  try {
    graph.emplace(metile::parse_graph_json(text, "fuzz.json"));
  } catch (const metile::InputError&) {
    return 0;
  }
  for (const metile::FusionTarget& target : {metile::FusionTarget::h200(), metile::FusionTarget::cpu()}) {
    const metile::FusionPlan plan = metile::plan_graph_fusion(*graph, target);
    (void)plan.explain();
    (void)plan.to_json();
  }
  return 0;
}
