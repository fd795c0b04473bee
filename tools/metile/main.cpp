// `metile`: plan, run and inspect graphs from the command line (DESIGN.md,
// "The interfaces users touch"). Exit codes: 0 success, 2 bad input, 1 internal failure.
#include <cstdio>
#include <exception>

#include <fmt/core.h>

#include "commands.h"
#include "metile/error.h"

int main(int argc, char** argv) {
  CLI::App app{"metile: compute-graph fusion compiler and runtime"};
  app.require_subcommand(1);
  metile::cli::add_run_command(app);
  metile::cli::add_plan_command(app);
  metile::cli::add_maxflow_command(app);
  metile::cli::add_model_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    const int code = app.exit(error);
    return code == 0 ? 0 : 2;
  } catch (const metile::cli::CommandExit& exit) {
    return exit.code;
  } catch (const metile::InputError& error) {
    fmt::print(stderr, "metile: error: {}\n", error.what());
    return 2;
  } catch (const std::exception& error) {
    fmt::print(stderr, "metile: internal error: {}\n", error.what());
    return 1;
  }
  return 0;
}
