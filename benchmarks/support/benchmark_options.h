// Every benchmark's command line, read the way `metile` reads its own: CLI11 options, `--help` printed
// with exit 0, and a mistake (an unknown flag, a bad value, a missing one) one line on stderr with exit
// 2. CLI11's own exit codes (105 and up) said nothing to a shell, and the hand-rolled parsers before it
// ran a whole benchmark for `--help` or aborted on `--tokens abc`.
#pragma once

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include <optional>

namespace metile::benchmarks {

// nullopt: go on; else the code to exit with.
inline std::optional<int> parse_benchmark_options(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
    return std::nullopt;
  } catch (const CLI::CallForHelp&) {
    fmt::print("{}", app.help());
    return 0;
  } catch (const CLI::ParseError& error) {
    fmt::print(stderr, "{}: error: {}\n", app.get_name(), error.what());
    return 2;
  }
}

}  // namespace metile::benchmarks
