// libFuzzer harness: DIMACS max-flow files, read as integer and as real networks.
// Any input must parse or throw InputError; a small network that parses is solved
// by both engines, which must agree on the flow value (the oracle).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>

#include "metile/flow.h"

namespace {

template <typename Capacity>
void read_and_solve(const std::string& text) {
  std::istringstream input(text);
  metile::FlowProblem<Capacity> problem;
  try {
    problem = metile::read_dimacs_max_flow<Capacity>(input, "fuzz.max");
  } catch (const metile::InputError&) {
    return;
  }
  if (problem.network.vertex_count() > 4096 || problem.network.edge_count() > 16384) return;
  metile::MaxFlowOptions dinic;
  dinic.solver = metile::parse_solver_choice("dinic");
  metile::MaxFlowOptions hlpp;
  hlpp.solver = metile::parse_solver_choice("hlpp");
  const auto first = metile::solve(problem.network, problem.source, problem.sink, dinic).value;
  const auto second = metile::solve(problem.network, problem.source, problem.sink, hlpp).value;
  if constexpr (std::is_integral_v<Capacity>) {
    if (first != second) std::abort();
  } else {
    const Capacity scale = std::max(Capacity{1}, std::max(first, second));
    if (std::abs(first - second) > 1e-9 * scale) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  read_and_solve<std::int64_t>(text);
  read_and_solve<double>(text);
  return 0;
}
