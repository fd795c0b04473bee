// The subcommands of the `metile` command; each lives in its own file and
// registers itself on the CLI11 app. A command throws InputError for bad input
// (exit 2) and anything else for internal failures (exit 1); main() maps them.
#pragma once

#include <CLI/CLI.hpp>

namespace metile::cli {

void add_run_command(CLI::App& app);      // run_command.cpp
void add_plan_command(CLI::App& app);     // plan_command.cpp
void add_maxflow_command(CLI::App& app);  // maxflow_command.cpp

}  // namespace metile::cli
