// Asking every lowering for a region (include/metile/dispatch.h, lower_region): the candidates of
// those that take it, and for those that do not, each one's own reason, so a region that stays
// native says why in the report ("row kernel: ...; contractions around a row kernel: ..."). It
// generates source only, so the report's reasons are tested on the CPU (tests/unit/dispatch).
#include <fmt/core.h>

#include <vector>

#include "metile/cuda_runtime.h"
#include "metile/dispatch.h"

namespace metile {

namespace {

// A region that is two kernels otherwise also races its parts' kernels run back to back, so that the
// one kernel for both replaces them only where it measures faster; without these, losing the race or
// the gate would send both parts to the native path. The parts: a composed region's
// (FusionRule::composes), or an attention_output_projection region's (attention_projection_parts).
// Each part also runs natively (its ops one after the other, cuBLASLt for a contraction): as a region
// of its own a part would race its kernels against that too (a projection of several tokens may well
// be faster in cuBLASLt than in any GEMV), so the region is never worse off than its parts. Raced:
// every candidate of the first part followed by the second's first, and the first's first followed
// by every other candidate of the second (so that a first part of one candidate, the attention
// kernel, keeps the second's whole race).
void add_part_candidates(const ComputeGraph& graph, const std::vector<FusionRegion>& parts,
                         std::span<const RegionLowering> extra_lowerings, RegionLowerings& result) {
  RegionLowerings first = lower_region(graph, parts[0], extra_lowerings);
  RegionLowerings second = lower_region(graph, parts[1], extra_lowerings);
  if (first.candidates.empty() && second.candidates.empty()) {  // the region's own native path is the same
    result.refusals += fmt::format("{}its parts one after the other: first part: {}; second part: {}",
                                   result.refusals.empty() ? "" : "; ", first.refusals, second.refusals);
    return;
  }
  for (auto [part, lowered] : {std::pair{&parts[0], &first}, std::pair{&parts[1], &second}}) {
    FusedCandidate native;
    native.id = CandidateId::fused("native");
    native.summary = lowered->candidates.empty() ? "native: " + lowered->refusals : "native";
    native.launches = static_cast<int>(part->nodes.size());
    for (NodeId id : part->nodes) native.source += "\n" + NativeRuntime::node_source(graph, id);
    native.bind = [nodes = part->nodes](DeviceValues& values) {
      return native_nodes_step(std::make_shared<NativeRuntime>(), values, nodes);
    };
    lowered->candidates.push_back(std::move(native));
  }
  std::vector<std::pair<const FusedCandidate*, const FusedCandidate*>> pairs;
  for (const FusedCandidate& candidate : first.candidates) pairs.emplace_back(&candidate, &second.candidates.front());
  for (std::size_t i = 1; i < second.candidates.size(); ++i) {
    pairs.emplace_back(&first.candidates.front(), &second.candidates[i]);
  }
  // Both parts native is the region's own native path, raced already.
  std::erase_if(pairs, [&](const auto& pair) { return pair.first->id.variant == "native" && pair.second->id.variant == "native"; });
  for (const auto& [first_candidate, then_candidate] : pairs) {
    const FusedCandidate& candidate = *first_candidate;
    const FusedCandidate& then = *then_candidate;
    FusedCandidate both;
    both.id = CandidateId::fused(fmt::format("{}, then {}", candidate.id.variant, then.id.variant));
    both.source = candidate.source + then.source;
    both.summary = candidate.summary + "; then " + then.summary;
    both.launches = candidate.launches + then.launches;
    both.bind = [bind_first = candidate.bind, bind_then = then.bind](DeviceValues& values) {
      DeviceStep a = bind_first(values);
      DeviceStep b = bind_then(values);
      return DeviceStep([a, b](const CudaStream& stream) {
        a(stream);
        b(stream);
      });
    };
    if (candidate.weights || then.weights) {
      both.weights = [weights_first = candidate.weights, weights_then = then.weights,
                      first_launches = static_cast<unsigned>(candidate.launches)](DeviceValues& values) {
        std::vector<DeviceByteRange> ranges = weights_first ? weights_first(values) : std::vector<DeviceByteRange>{};
        if (weights_then) {
          for (DeviceByteRange range : weights_then(values)) {
            range.launch += first_launches;  // the second candidate's launches follow the first's
            ranges.push_back(range);
          }
        }
        return ranges;
      };
    }
    result.candidates.push_back(std::move(both));
  }
}

}  // namespace

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
  if (region.parts.size() == 2) add_part_candidates(graph, region.parts, extra_lowerings, result);
  if (region.rule == "attention_output_projection") {
    const std::vector<FusionRegion> parts = attention_projection_parts(graph, region);
    if (parts.size() == 2) add_part_candidates(graph, parts, extra_lowerings, result);
  }
  return result;
}

RegionLowerings lower_region(const ComputeGraph& graph, const FusionRegion& region, const ExecutableOptions& options) {
  return lower_region(graph, region, options.extra_lowerings);
}

}  // namespace metile
