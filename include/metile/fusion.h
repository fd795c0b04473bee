// metile fusion module: plan_graph_fusion selects legal, profitable,
// multi-output fusion regions with exact min-cut models (DESIGN.md,
// "Neighborhood cut models", "Conflict selection", "Rules").
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "metile/graph.h"

namespace metile {

// One kernel-to-be: a convex set of nodes and the values crossing its boundary.
struct FusionRegion {
  std::string rule;              // the rule that matched, e.g. "residual_add_rms_norm", "swiglu_mlp"
  std::vector<NodeId> nodes;     // topological order
  std::vector<ValueId> inputs;   // values read from outside the region, first-use order
  std::vector<ValueId> outputs;  // values written by the region (graph outputs or consumed outside)
  double benefit_ns = 0;         // estimated cost saved against running the nodes unfused
};

struct FusionPlan {
  std::shared_ptr<const ComputeGraph> graph;
  std::vector<FusionRegion> regions;
  std::vector<NodeId> unfused;  // nodes that run as their own kernel
  std::vector<std::string> node_reasons;  // per node id: why it is or is not fused
  int kernel_count() const { return static_cast<int>(regions.size() + unfused.size()); }
};

}  // namespace metile
