// `metile run GRAPH.json [--backend cpu|cuda] [--seed N] [--inputs FILE.safetensors]
//                        [--output FILE.safetensors] [--check] [--no-discovery]`
// Runs a graph on given or seeded random inputs and prints one summary line per
// output (tensor_summary.h); --output writes the outputs as safetensors, all or
// nothing. The CPU backend is the reference executor; the CUDA backend is
// reached through run_on_cuda (run_cuda.cpp) when metile is built with it.
#include <fmt/core.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "commands.h"
#include "metile/cpu_runtime.h"
#include "metile/error.h"
#include "metile/io.h"
#include "tensor_summary.h"

namespace metile::cli {
namespace {

struct RunOptions {
  std::string graph_path;
  std::string backend = "cpu";
  std::string seed = "0";
  std::string inputs_path;
  std::string output_path;
  bool check = false;
  bool no_discovery = false;
};

TensorMap load_inputs(const ComputeGraph& graph, const RunOptions& options, std::uint64_t seed) {
  if (options.inputs_path.empty()) return random_inputs(graph, seed);
  TensorMap inputs = read_safetensors(options.inputs_path);
  try {
    for (const auto& [name, tensor] : inputs) check_is_graph_input(graph, name);  // a misspelt name first, as Python's metile.run
    check_graph_inputs(graph, inputs);
  } catch (const InputError& error) {
    throw InputError(options.inputs_path + ": " + error.what());
  }
  return inputs;
}

TensorMap run_on_backend(const ComputeGraph& graph, const TensorMap& inputs, const RunOptions& options) {
  if (options.backend == "cpu") {
    if (options.check) {
      fmt::print(stderr,
                 "metile run: --check compares a backend with the CPU reference; the CPU backend is the "
                 "reference, so there is nothing to compare\n");
    }
    if (options.no_discovery) {  // said, as --check is, rather than taken without a word
      fmt::print(stderr,
                 "metile run: --no-discovery changes what the cuda backend plans; the CPU backend runs every "
                 "node as written already\n");
    }
    return run_reference(graph, inputs);
  }
#ifdef METILE_HAVE_CUDA_BACKEND
  return run_on_cuda(graph, inputs, options.check, options.no_discovery);
#else
  throw InputError("metile was built without the CUDA backend");
#endif
}

void run(const RunOptions& options) {
  if (options.backend != "cpu" && options.backend != "cuda") {
    throw InputError(fmt::format("--backend must be cpu or cuda, got '{}'", options.backend));
  }
  const std::uint64_t seed = parse_seed(options.seed);
  const ComputeGraph graph = read_graph(options.graph_path);
  // A path that cannot be written is said before the run, not after its summary (which read as success).
  if (!options.output_path.empty()) {
    check_output_file_writable(options.output_path);
    for (ValueId output : graph.outputs()) check_safetensors_tensor_name(options.output_path, graph.value(output).name);
  }
  check_run_memory(graph, options.backend == "cpu" || options.check);
  const TensorMap inputs = load_inputs(graph, options, seed);
  const TensorMap outputs = run_on_backend(graph, inputs, options);
  print_output_summaries(graph, outputs);
  if (!options.output_path.empty()) write_safetensors(options.output_path, outputs);
}

}  // namespace

// CLI11 would wrap a negative number into a huge unsigned seed; parse it ourselves.
std::uint64_t parse_seed(const std::string& text) {
  std::uint64_t seed = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), seed);
  if (text.empty() || error != std::errc() || end != text.data() + text.size()) {
    throw InputError(fmt::format("--seed must be an integer from 0 to 2^64 - 1, got '{}'", text));
  }
  return seed;
}

const CLI::Validator& decimal_integer() {
  static const CLI::Validator validator(
      [](std::string& text) {
        // CLI11 reads an integer as strtoll's base 0 does (a leading 0 octal, 0x hexadecimal), so
        // "--tokens 010" made 8 tokens while "--seed 010" is 10. Every integer is decimal here: the
        // text is handed on as the number it spells (leading zeros dropped), after the range check.
        const bool negative = !text.empty() && text[0] == '-';
        const std::size_t digits_from = !text.empty() && (text[0] == '-' || text[0] == '+') ? 1 : 0;
        const std::string_view digits = std::string_view(text).substr(digits_from);
        if (digits.empty() || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
          return fmt::format("'{}' is not a decimal integer", text);
        }
        const std::size_t first = std::min(digits.find_first_not_of('0'), digits.size() - 1);
        const std::string_view significant = digits.substr(first);
        std::uint64_t magnitude = 0;
        const auto [end, error] = std::from_chars(significant.data(), significant.data() + significant.size(), magnitude);
        const std::uint64_t largest = std::uint64_t{1} << 63;  // -2^63 .. 2^63 - 1
        if (error != std::errc() || (negative ? magnitude > largest : magnitude >= largest)) {
          return fmt::format("{} does not fit in a 64-bit signed integer", text);
        }
        text = (negative && magnitude != 0 ? "-" : "") + std::string(significant);
        return std::string();
      },
      "INT");
  return validator;
}

const CLI::Validator& decimal_number() {
  static const CLI::Validator validator(
      [](std::string& text) {
        const std::size_t from = !text.empty() && (text[0] == '+' || text[0] == '-') ? 1 : 0;  // from_chars takes no '+'
        double value = 0;
        const char* end = text.data() + text.size();
        const auto [stop, error] = std::from_chars(text.data() + from, end, value, std::chars_format::general);
        const bool whole = text.size() > from && text[from] != '-' && stop == end && error != std::errc::invalid_argument;
        // nan and inf are not figures an option takes (CLI::Range lets NaN through: every comparison is false), nor
        // is a figure past the largest double (1e400: it reads as inf, and the option's own check named it "inf").
        // from_chars reports overflow and underflow alike; strtod tells them apart (an underflow reads as 0).
        const bool finite = error == std::errc::result_out_of_range ? std::isfinite(std::strtod(text.c_str(), nullptr))
                                                                    : std::isfinite(value);
        return whole && finite ? std::string() : fmt::format("{} is not a finite decimal number", text);
      },
      "NUMBER");
  return validator;
}

const CLI::Validator& non_empty_path() {
  static const CLI::Validator validator(
      [](std::string& text) { return text.empty() ? std::string("an empty path") : std::string(); }, "PATH");
  return validator;
}

void add_run_command(CLI::App& app) {
  auto options = std::make_shared<RunOptions>();
  CLI::App* command =
      app.add_subcommand("run", "Run a graph and print min, max, mean and a checksum of each output");
  command->add_option("graph", options->graph_path, "graph file (JSON, format in docs/architecture.md)")->required();
  command->add_option("--backend", options->backend, "cpu (the reference) or cuda")->capture_default_str();
  command->add_option("--seed", options->seed, "seed of the random inputs")->capture_default_str();
  command->add_option("--inputs", options->inputs_path, "take the inputs from this safetensors file instead")
      ->check(non_empty_path());
  command->add_option("--output", options->output_path, "write the outputs to this safetensors file")
      ->check(non_empty_path());
  command->add_flag("--check", options->check, "compare the backend's outputs with the CPU reference");
  command->add_flag("--no-discovery", options->no_discovery,
                    "cuda: plan every node as written, without the rewrites (as `metile plan --no-discovery`)");
  command->callback([options] { run(*options); });
}

}  // namespace metile::cli
