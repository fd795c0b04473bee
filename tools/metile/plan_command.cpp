// Placeholder until the plan command lands; its owner replaces this file.
#include <stdexcept>

#include "commands.h"

namespace metile::cli {

void add_plan_command(CLI::App& app) {
  app.add_subcommand("plan", "(not built yet)")->callback([] { throw std::runtime_error("metile plan: not built yet"); });
}

}  // namespace metile::cli
