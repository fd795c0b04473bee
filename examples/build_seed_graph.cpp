// The seed graph of docs/architecture.md built with GraphBuilder: a residual add whose sum
// stays a graph output and feeds an RMSNorm (the multi-output fusion the planner
// turns into one kernel). Prints the graph as JSON, the format `metile plan` and
// `metile run` read, so `example_build_seed_graph > g.json` gives a runnable file.
#include <iostream>

#include "metile/graph.h"

int main() {
  metile::GraphBuilder builder;
  auto values = builder.input("values", {{1, 2048}, metile::DType::f16});
  auto residual = builder.input("residual", {{1, 2048}, metile::DType::f16});
  auto weight = builder.input("weight", {{2048}, metile::DType::f16});
  auto summed = builder.add(values, residual, "summed");
  auto normalized = builder.rms_norm(summed, weight, 1e-5, "normalized");
  metile::ComputeGraph graph = builder.build({summed, normalized});
  std::cout << metile::write_graph_json(graph);
  return 0;
}
