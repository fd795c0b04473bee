// Placeholder until the maxflow command lands; its owner replaces this file.
#include <stdexcept>

#include "commands.h"

namespace metile::cli {

void add_maxflow_command(CLI::App& app) {
  app.add_subcommand("maxflow", "(not built yet)")->callback([] { throw std::runtime_error("metile maxflow: not built yet"); });
}

}  // namespace metile::cli
