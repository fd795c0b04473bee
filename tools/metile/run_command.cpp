// Placeholder until the run command lands; its owner replaces this file.
#include <stdexcept>

#include "commands.h"

namespace metile::cli {

void add_run_command(CLI::App& app) {
  app.add_subcommand("run", "(not built yet)")->callback([] { throw std::runtime_error("metile run: not built yet"); });
}

}  // namespace metile::cli
