// `metile`: plan, run and inspect graphs from the command line (docs/architecture.md,
// "The interfaces users touch"). Exit codes: 0 success, 2 bad input (usage errors
// included), 1 internal failure or a failed write to standard output. Every
// failure is exactly one line on stderr: "metile: error: ..." or
// "metile: internal error: ...".
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "commands.h"
#include "metile/error.h"
#include "metile/io.h"

namespace {

// One line whatever the message holds (CLI11 messages and nested errors may span lines), and no other
// control byte reaches the terminal: a file name the message quotes may hold an escape sequence.
void print_error_line(const char* kind, std::string message) {
  for (char& c : message) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  while (!message.empty() && message.back() == ' ') message.pop_back();
  std::fprintf(stderr, "metile: %s: %s\n", kind, metile::control_bytes_spelled(message).c_str());
}

// Output already buffered must reach its file; a full disk or closed pipe is a failure.
int finish_standard_output(int code) {
  const bool failed = std::fflush(stdout) != 0 || std::ferror(stdout) != 0;
  if (!failed) return code;
  const int write_error = errno;
  print_error_line("error", std::string("cannot write to standard output: ") + std::strerror(write_error));
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  // A closed pipe on standard output is a failed write, checked as any other (exit 1, one line): by
  // default SIGPIPE ended the process without a word (`metile logits ... | head -c 10`: 141).
  std::signal(SIGPIPE, SIG_IGN);
  // Ctrl-C, a kill or a closed terminal during `run --output` leaves no temporary file beside it.
  metile::remove_temporary_files_on_fatal_signals();
  CLI::App app{"metile: compute-graph fusion compiler and runtime"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "metile " METILE_VERSION);  // the project() version in CMakeLists.txt
  metile::cli::add_run_command(app);
  metile::cli::add_plan_command(app);
  metile::cli::add_maxflow_command(app);
  metile::cli::add_model_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& help) {
    return finish_standard_output(app.exit(help));
  } catch (const CLI::CallForAllHelp& help) {
    return finish_standard_output(app.exit(help));
  } catch (const CLI::CallForVersion& version) {
    return finish_standard_output(app.exit(version));
  } catch (const CLI::ParseError& error) {
    // "metile runn x.json" said only "A subcommand is required": name the word that is not one.
    if (argc > 1 && argv[1][0] != '-' && app.get_subcommands([&](const CLI::App* command) {
                                           return command->get_name() == argv[1];
                                         }).empty()) {
      std::string commands;
      for (const CLI::App* command : app.get_subcommands([](const CLI::App*) { return true; })) {
        commands += (commands.empty() ? "" : ", ") + command->get_name();
      }
      print_error_line("error", "'" + std::string(argv[1]) + "' is not a metile command (the commands: " + commands +
                                    "; see metile --help)");
      return 2;
    }
    print_error_line("error", std::string(error.what()) + " (see metile --help)");
    return 2;
  } catch (const metile::cli::CommandExit& exit) {
    return finish_standard_output(exit.code);
  } catch (const metile::InputError& error) {
    print_error_line("error", error.what());
    return 2;
  } catch (const metile::WriteError& error) {
    print_error_line("error", error.what());
    return 1;  // as for standard output: the system would not take the bytes, nothing given was wrong
  } catch (const std::bad_alloc&) {
    print_error_line("internal error", "out of memory");
    return 1;
  } catch (const std::exception& error) {
    if (std::ferror(stdout)) return finish_standard_output(1);
    print_error_line("internal error", error.what());
    return 1;
  }
  return finish_standard_output(0);
}
