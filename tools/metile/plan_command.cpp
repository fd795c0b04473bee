// `metile plan GRAPH.json [--target cpu|h200|FILE] [--format text|json|dot]`: the
// fusion planner on a graph file, so a person can see which ops would share a
// kernel and why (docs/architecture.md, "Formats" and "Commands").
// The rewrites run first (plan_with_discovery: nodes no output depends on removed, the certified
// attention rewrite; --no-discovery skips both and plans every node as written).
//   text: FusionPlan::explain(), regions then a reason per op
//   json: {"kernels": N, "regions": [{"rule", "nodes", "inputs", "outputs", "benefit_ns", "roles"}], "unfused": [...]}
//   dot:  Graphviz, one coloured cluster per region
#include <memory>
#include <string>

#include <fmt/core.h>

#include "commands.h"
#include "metile/discovery.h"
#include "metile/fusion.h"
#include "metile/graph.h"

namespace metile::cli {
namespace {

struct PlanOptions {
  std::string graph_file;
  std::string target = "h200";
  std::string format = "text";
  bool no_discovery = false;
};

}  // namespace

void add_plan_command(CLI::App& app) {
  auto options = std::make_shared<PlanOptions>();
  CLI::App* command = app.add_subcommand("plan", "Plan the fusion of a graph file into kernels and say why");
  command->add_option("GRAPH", options->graph_file, "JSON graph file (format in docs/architecture.md)")->required();
  command->add_option("--target", options->target, "h200, cpu, or a target JSON file")->capture_default_str();
  command->add_option("--format", options->format, "text, json or dot")
      ->check(CLI::IsMember({"text", "json", "dot"}))
      ->capture_default_str();
  command->add_flag("--no-discovery", options->no_discovery,
                    "plan the graph as written: every node, no certified attention rewrite");
  command->callback([options] {
    // Read everything before printing anything: an error leaves no partial output.
    const FusionTarget target = FusionTarget::from_name_or_file(options->target);
    const ComputeGraph graph = read_graph(options->graph_file);
    if (options->no_discovery) require_verified_certificates(graph);  // as plan_with_discovery does
    const FusionPlan plan = options->no_discovery ? plan_graph_fusion(graph, target) : plan_with_discovery(graph, target);
    std::string text;
    if (options->format == "json") {
      text = plan.to_json();
    } else if (options->format == "dot") {
      text = plan.to_dot();
    } else {
      text = plan.explain();
    }
    fmt::print("{}", text);
  });
}

}  // namespace metile::cli
