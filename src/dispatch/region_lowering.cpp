// Asking every lowering for a region (include/metile/dispatch.h, lower_region): the candidates of
// those that take it, and for those that do not, each one's own reason, so a region that stays
// native says why in the report ("row kernel: ...; contractions around a row kernel: ..."). It
// generates source only, so the report's reasons are tested on the CPU (tests/unit/dispatch).
#include <fmt/core.h>

#include "metile/dispatch.h"

namespace metile {

RegionLowerings lower_region(const ComputeGraph& graph, const FusionRegion& region,
                             std::span<const RegionLowering> extra_lowerings) {
  RegionLowerings result;
  std::vector<RegionLowering> lowerings = builtin_lowerings();
  lowerings.insert(lowerings.end(), extra_lowerings.begin(), extra_lowerings.end());
  for (const RegionLowering& lowering : lowerings) {
    Lowered lowered = lowering.lower(graph, region);
    // A lowering that accepts the region but offers nothing is a refusal too, and says so.
    if (lowered.decision && lowered.candidates.empty()) {
      lowered.decision = Decision::refuse("it accepted the region but offered no candidate");
    }
    if (!lowered.decision) {
      const std::string& reason = lowered.decision.reason;
      result.refusals += fmt::format("{}{}: {}", result.refusals.empty() ? "" : "; ", lowering.name,
                                     reason.empty() ? "refused without a reason" : reason);
      continue;
    }
    for (FusedCandidate& candidate : lowered.candidates) result.candidates.push_back(std::move(candidate));
  }
  return result;
}

RegionLowerings lower_region(const ComputeGraph& graph, const FusionRegion& region, const ExecutableOptions& options) {
  return lower_region(graph, region, options.extra_lowerings);
}

}  // namespace metile
