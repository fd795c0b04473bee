// `metile maxflow FILE [--solver auto|dinic|hlpp|ipm] [--cut] [--format text|json]`: solves
// a DIMACS max-flow file with the same engines and dispatch the planner uses, so a network
// the planner built (or any benchmark instance) can be checked by hand. `ipm` (the
// experimental interior-point engine) runs only when named, and reports its work.
//   text: `flow VALUE`, `solver NAME`, with --cut `source_side V...` (1-based, as in the file),
//         with ipm `ipm_iterations N`, `cg_steps N`, `ipm_stop REASON`, `repair_paths N`
//   json: {"flow": V, "solver": S, "source_side": [...]} (with ipm also "ipm": {...})
#include <fmt/core.h>
#include <fmt/format.h>

#include <memory>
#include <optional>
#include <string>
#include <variant>

#include "commands.h"
#include "metile/flow.h"

namespace metile::cli {
namespace {

struct MaxflowOptions {
  std::string file;
  std::string solver = "auto";
  bool cut = false;
  std::string format = "text";
};

template <typename Capacity>
void solve_and_print(const FlowProblem<Capacity>& problem, const MaxflowOptions& options) {
  MaxFlowOptions solve_options;
  solve_options.solver = parse_solver_choice(options.solver);
  const MaxFlowResult<Capacity> result = solve(problem.network, problem.source, problem.sink, solve_options);
  std::vector<int> side = result.source_side_vertices();
  for (int& vertex : side) ++vertex;  // DIMACS numbering
  const std::optional<InteriorPointStatistics>& ipm = result.interior_point;
  if (options.format == "json") {
    std::string ipm_json;
    if (ipm) {
      ipm_json = fmt::format(
          ", \"ipm\": {{\"iterations\": {}, \"cg_steps\": {}, \"stop\": \"{}\", \"repair_paths\": {}}}",
          ipm->iterations, ipm->cg_steps, ipm->stop_reason, ipm->repair_paths);
    }
    fmt::print("{{\"flow\": {}, \"solver\": \"{}\", \"source_side\": [{}]{}}}\n", result.value, result.solver,
               fmt::join(side, ", "), ipm_json);
    return;
  }
  fmt::print("flow {}\nsolver {}\n", result.value, result.solver);
  if (options.cut) fmt::print("source_side {}\n", fmt::join(side, " "));
  if (ipm) {
    fmt::print("ipm_iterations {}\ncg_steps {}\nipm_stop {}\nrepair_paths {}\n", ipm->iterations, ipm->cg_steps,
               ipm->stop_reason, ipm->repair_paths);
  }
}

}  // namespace

void add_maxflow_command(CLI::App& app) {
  auto options = std::make_shared<MaxflowOptions>();
  CLI::App* command = app.add_subcommand("maxflow", "Maximum flow and minimum cut of a DIMACS max-flow file");
  command->add_option("FILE", options->file, "DIMACS max-flow file (p max N M, n ID s, n ID t, a U V CAP)")
      ->required();
  command->add_option("--solver", options->solver,
                      "auto (measured dispatch between dinic and hlpp), dinic, hlpp or ipm (experimental "
                      "interior-point engine, never chosen by auto)")
      ->check(CLI::IsMember({"auto", "dinic", "hlpp", "ipm"}))
      ->capture_default_str();
  command->add_flag("--cut", options->cut, "also print the source side of a minimum cut");
  command->add_option("--format", options->format, "text or json")
      ->check(CLI::IsMember({"text", "json"}))
      ->capture_default_str();
  command->callback([options] {
    const AnyFlowProblem problem = read_dimacs_max_flow_file(options->file);
    std::visit([&](const auto& typed) { solve_and_print(typed, *options); }, problem);
  });
}

}  // namespace metile::cli
