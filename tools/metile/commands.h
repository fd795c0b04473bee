// The subcommands of the `metile` command; each lives in its own file and
// registers itself on the CLI11 app. A command throws InputError for bad input
// (exit 2) and anything else for internal failures (exit 1); main() maps them.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

#include "metile/graph.h"

namespace metile::cli {

void add_run_command(CLI::App& app);      // run_command.cpp
void add_plan_command(CLI::App& app);     // plan_command.cpp
void add_maxflow_command(CLI::App& app);  // maxflow_command.cpp
void add_model_commands(CLI::App& app);   // model_commands.cpp: logits, generate, verify-model, synth-model

// Thrown by a command that has printed its verdict and must exit with `code`
// (verify-model outside its thresholds: 1); main() returns it without a message.
struct CommandExit {
  int code;
};

// A --seed value: 0 .. 2^64 - 1 (CLI11 would wrap a negative number); InputError otherwise.
std::uint64_t parse_seed(const std::string& text);

// An integer option's text (use with ->transform, it rewrites the text): decimal digits after an optional
// sign, within -2^63 .. 2^63 - 1, handed on to CLI11 without leading zeros. CLI11 alone saturates a number
// past int64 (99999999999999999999 became 9223372036854775807 and was used) and reads a leading 0 as octal
// and 0x as hexadecimal (`--tokens 010` made 8 tokens, where `--seed 010` and `--prompt-ids 010` are 10).
const CLI::Validator& decimal_integer();

// A floating-point option's text must be a finite decimal number (an optional sign, digits, a point, an
// exponent; one past a double's range is left to the option's range check): CLI11 and strtod also read
// C's hexadecimal floats, so `--max-kl-mean 0x10` meant 16 where `--seed 0x10` is refused, and "nan"
// passed CLI::Range (`--near-tie-margin nan` turned the race off).
const CLI::Validator& decimal_number();

// A path option given as "" (an unset shell variable, say) is refused: taken as "no file", `--output
// "$OUT"` reported success and wrote nothing, and `--inputs ""` ran on random inputs.
const CLI::Validator& non_empty_path();

// `metile run --backend cuda` (run_cuda.cpp, built only with the CUDA backend,
// where METILE_HAVE_CUDA_BACKEND is defined): runs the graph on the GPU and
// returns its outputs by output value name; with `check`, also compares them
// with the CPU reference. run_command.cpp prints and writes what it returns.
TensorMap run_on_cuda(const ComputeGraph& graph, const TensorMap& inputs, bool check, bool no_discovery);

}  // namespace metile::cli
