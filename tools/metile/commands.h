// The subcommands of the `metile` command; each lives in its own file and
// registers itself on the CLI11 app. A command throws InputError for bad input
// (exit 2) and anything else for internal failures (exit 1); main() maps them.
#pragma once

#include <CLI/CLI.hpp>

#include "metile/graph.h"

namespace metile::cli {

void add_run_command(CLI::App& app);      // run_command.cpp
void add_plan_command(CLI::App& app);     // plan_command.cpp
void add_maxflow_command(CLI::App& app);  // maxflow_command.cpp

// `metile run --backend cuda` (run_cuda.cpp, built only with the CUDA backend,
// where METILE_HAVE_CUDA_BACKEND is defined): runs the graph on the GPU and
// returns its outputs by output value name; with `check`, also compares them
// with the CPU reference. run_command.cpp prints and writes what it returns.
TensorMap run_on_cuda(const ComputeGraph& graph, const TensorMap& inputs, bool check);

}  // namespace metile::cli
