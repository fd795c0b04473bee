// The model commands (include/metile/model.h):
//   metile logits MODEL_DIR --prompt-ids 1,2,3 [--dtype f32|bf16] [--backend cpu|cuda] [--format text|json]
//       JSON {"logits": [last position's logits], "argmax": [each position's argmax]}
//   metile generate MODEL_DIR --prompt-ids ... --tokens N [...] : greedy decoding, a progress line on stderr;
//       JSON {"tokens": [...], "tokens_per_second": x}
//   metile verify-model MODEL_DIR [--tokens N] [--quantize 4|8] [thresholds]: the reference path against
//       the planned (fused) path fed the same tokens; exit 1 outside the thresholds
//   metile synth-model OUT_DIR --preset ... : a seeded random checkpoint
// A malformed checkpoint is one line naming the tensor or field, exit 2; nothing is written.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "metile/model.h"

namespace metile::cli {
namespace {

struct ModelOptions {
  std::string model_dir;
  std::string prompt_ids = "1";
  std::string dtype = "bf16";
  std::string backend = "cpu";
  std::string format = "text";
  std::string quantize;  // "", "4" or "8"
  int group_size = 64;
  std::int64_t max_seq = 0;
  std::int64_t tokens = 16;
  // verify-model thresholds
  double min_agreement = 0.95;
  double max_kl = 0.01;
  double max_logit_error = 0.02;
};

void add_model_options(CLI::App* command, ModelOptions& options, bool with_prompt) {
  command->add_option("MODEL_DIR", options.model_dir, "checkpoint directory (config.json + safetensors)")
      ->required();
  if (with_prompt) {
    command->add_option("--prompt-ids", options.prompt_ids, "comma-separated token ids")->required();
  }
  command->add_option("--dtype", options.dtype, "bf16 (rounded as the GPU path) or f32")
      ->check(CLI::IsMember({"bf16", "f32"}))
      ->capture_default_str();
  command->add_option("--backend", options.backend, "cpu or cuda")->capture_default_str();
  command->add_option("--quantize", options.quantize, "quantize dense weights at load: 4 or 8 bits");
  command->add_option("--group-size", options.group_size, "quantization group size: 32, 64 or 128")
      ->capture_default_str();
  command->add_option("--max-seq", options.max_seq, "KV-cache capacity (default min(4096, the config's limit))");
}

std::vector<std::int32_t> parse_ids(const std::string& text) {
  std::vector<std::int32_t> ids;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    std::int32_t id = 0;
    const auto [end, error] = std::from_chars(item.data(), item.data() + item.size(), id);
    if (item.empty() || error != std::errc() || end != item.data() + item.size()) {
      throw InputError(fmt::format("--prompt-ids: '{}' is not a token id (expected e.g. 1,2,3)", item));
    }
    ids.push_back(id);
    start = comma + 1;
  }
  return ids;
}

DecoderModel load_model(const ModelOptions& options) {
  if (options.backend != "cpu" && options.backend != "cuda") {
    throw InputError(fmt::format("--backend must be cpu or cuda, got '{}'", options.backend));
  }
  if (options.backend == "cuda") {
    throw InputError("--backend cuda: the GPU decode engine is not built yet; use --backend cpu");
  }
  LoadOptions load;
  load.dtype = parse_dtype(options.dtype);
  load.max_sequence = options.max_seq;
  if (!options.quantize.empty()) {
    if (options.quantize != "4" && options.quantize != "8") {
      throw InputError(fmt::format("--quantize must be 4 or 8, got '{}'", options.quantize));
    }
    load.quantize = AffineQuantization{std::stoi(options.quantize), options.group_size};
    load.quantize->validate();
  }
  return DecoderModel::load(options.model_dir, load);
}

std::string float_list(std::span<const float> values) {
  std::string text;
  for (float value : values) text += (text.empty() ? "" : ", ") + fmt::format("{}", value);
  return text;
}

void logits_command(const ModelOptions& options) {
  const std::vector<std::int32_t> prompt = parse_ids(options.prompt_ids);
  const DecoderModel model = load_model(options);
  DecodeSession session(model);
  const std::vector<float> logits = session.feed(prompt);
  const auto vocab = static_cast<std::size_t>(model.config().vocab_size);
  std::vector<std::int64_t> argmaxes;
  for (std::size_t row = 0; row < prompt.size(); ++row) {
    argmaxes.push_back(argmax(std::span<const float>(logits.data() + row * vocab, vocab)));
  }
  const std::span<const float> last(logits.data() + logits.size() - vocab, vocab);
  if (options.format == "json") {
    nlohmann::json json;
    json["logits"] = std::vector<double>(last.begin(), last.end());
    json["argmax"] = argmaxes;
    fmt::print("{}\n", json.dump());
    return;
  }
  std::string positions;
  for (std::int64_t token : argmaxes) positions += (positions.empty() ? "" : " ") + std::to_string(token);
  fmt::print("{} tokens, vocab {}, {} on cpu\n", prompt.size(), vocab, options.dtype);
  fmt::print("argmax per position: {}\n", positions);
  fmt::print("last position: max logit {} at token {}\n", last[static_cast<std::size_t>(argmaxes.back())],
             argmaxes.back());
  fmt::print("last position, first logits: {}\n", float_list(last.subspan(0, std::min<std::size_t>(8, vocab))));
}

void generate_command(const ModelOptions& options) {
  const std::vector<std::int32_t> prompt = parse_ids(options.prompt_ids);
  if (options.tokens < 1) throw InputError(fmt::format("--tokens {} must be at least 1", options.tokens));
  const DecoderModel model = load_model(options);
  DecodeSession session(model);
  const bool terminal = ::isatty(STDERR_FILENO) != 0;
  const Generation generation = generate_greedy(session, prompt, options.tokens, [&](std::int64_t index) {
    if (terminal) fmt::print(stderr, "\rmetile generate: {}/{} tokens", index + 1, options.tokens);
  });
  const double rate = generation.seconds > 0 ? static_cast<double>(generation.decode_steps) / generation.seconds : 0;
  fmt::print(stderr, "{}metile generate: {} tokens after a {}-token prompt, {:.2f} tokens/s ({} on cpu)\n",
             terminal ? "\r" : "", generation.tokens.size(), prompt.size(), rate, options.dtype);
  if (options.format == "json") {
    nlohmann::json json;
    json["tokens"] = generation.tokens;
    json["tokens_per_second"] = rate;
    fmt::print("{}\n", json.dump());
    return;
  }
  std::string text;
  for (std::int32_t token : generation.tokens) text += (text.empty() ? "" : " ") + std::to_string(token);
  fmt::print("{}\n", text);
}

// Next-token distributions of the two paths at one position.
struct StepComparison {
  bool same_argmax;
  double kl;               // KL(reference || planned), nats
  double max_abs_error;    // max |logit difference|
  double max_abs_logit;    // max |reference logit|
};

StepComparison compare_step(std::span<const float> reference, std::span<const float> planned) {
  const auto log_softmax = [](std::span<const float> logits) {
    const double maximum = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (float value : logits) sum += std::exp(value - maximum);
    std::vector<double> result;
    for (float value : logits) result.push_back(value - maximum - std::log(sum));
    return result;
  };
  const std::vector<double> p = log_softmax(reference);
  const std::vector<double> q = log_softmax(planned);
  StepComparison comparison{argmax(reference) == argmax(planned), 0, 0, 0};
  for (std::size_t index = 0; index < p.size(); ++index) {
    comparison.kl += std::exp(p[index]) * (p[index] - q[index]);
    comparison.max_abs_error =
        std::max(comparison.max_abs_error, std::abs(static_cast<double>(reference[index]) - planned[index]));
    comparison.max_abs_logit = std::max(comparison.max_abs_logit, std::abs(static_cast<double>(reference[index])));
  }
  comparison.kl = std::max(0.0, comparison.kl);
  return comparison;
}

int verify_command(const ModelOptions& options) {
  const std::vector<std::int32_t> prompt = parse_ids(options.prompt_ids);
  if (options.tokens < 1) throw InputError(fmt::format("--tokens {} must be at least 1", options.tokens));
  const DecoderModel model = load_model(options);
  DecodeSession reference(model, DecodePath::reference);
  DecodeSession planned(model, DecodePath::planned);
  const auto vocab = static_cast<std::size_t>(model.config().vocab_size);
  double reference_seconds = 0, planned_seconds = 0;
  const auto timed_feed = [vocab](DecodeSession& session, std::span<const std::int32_t> tokens, double& seconds) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<float> logits = session.feed(tokens);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return std::vector<float>(logits.end() - static_cast<std::ptrdiff_t>(vocab), logits.end());
  };
  double dummy = 0;
  std::vector<float> reference_logits = timed_feed(reference, prompt, dummy);
  std::vector<float> planned_logits = timed_feed(planned, prompt, dummy);
  std::int64_t agreements = 0;
  double kl_sum = 0, kl_max = 0, relative_error_max = 0;
  for (std::int64_t step = 0; step < options.tokens; ++step) {
    const StepComparison comparison = compare_step(reference_logits, planned_logits);
    agreements += comparison.same_argmax ? 1 : 0;
    kl_sum += comparison.kl;
    kl_max = std::max(kl_max, comparison.kl);
    relative_error_max = std::max(relative_error_max, comparison.max_abs_error / std::max(comparison.max_abs_logit, 1e-30));
    if (step + 1 == options.tokens) break;
    const auto token = static_cast<std::int32_t>(argmax(reference_logits));  // both paths get the reference's token
    reference_logits = timed_feed(reference, std::span<const std::int32_t>(&token, 1), reference_seconds);
    planned_logits = timed_feed(planned, std::span<const std::int32_t>(&token, 1), planned_seconds);
  }
  const double agreement = static_cast<double>(agreements) / static_cast<double>(options.tokens);
  const double kl_mean = kl_sum / static_cast<double>(options.tokens);
  const auto rate = [&](double seconds) {
    return seconds > 0 ? static_cast<double>(options.tokens - 1) / seconds : 0.0;
  };
  fmt::print("verify-model: {} positions, reference (run_reference) vs planned (plan_graph_fusion cpu + "
             "run_plan_reference), {} on cpu\n", options.tokens, options.dtype);
  fmt::print("next-token agreement   {:.4f}   (min {})\n", agreement, options.min_agreement);
  fmt::print("KL mean / max          {:.3g} / {:.3g}   (max {})\n", kl_mean, kl_max, options.max_kl);
  fmt::print("max logit error        {:.3g} of max |logit|   (max {})\n", relative_error_max, options.max_logit_error);
  fmt::print("tokens/s               reference {:.2f}, planned {:.2f}\n", rate(reference_seconds),
             rate(planned_seconds));
  const bool pass = agreement >= options.min_agreement && kl_max <= options.max_kl &&
                    relative_error_max <= options.max_logit_error;
  fmt::print("{}\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

struct SynthCommandOptions {
  std::string directory;
  std::string preset = "tiny";
  std::string architecture;
  std::int64_t layers = 0;
  std::string seed = "0";
  std::string quantize;
  int group_size = 64;
  std::string tie;  // "", "true", "false"
  int config_spelling = 4;
  double max_shard_mb = 2000;
};

void synth_command(const SynthCommandOptions& options) {
  SynthOptions synth;
  synth.preset = options.preset;
  if (!options.architecture.empty()) synth.architecture = parse_architecture_short_name(options.architecture);
  if (options.layers != 0) synth.layers = options.layers;
  synth.seed = parse_seed(options.seed);
  if (!options.quantize.empty()) {
    if (options.quantize != "4" && options.quantize != "8") {
      throw InputError(fmt::format("--quantize must be 4 or 8, got '{}'", options.quantize));
    }
    synth.quantize = AffineQuantization{std::stoi(options.quantize), options.group_size};
  }
  if (!options.tie.empty()) synth.tie_word_embeddings = options.tie == "true";
  synth.transformers_version = options.config_spelling;
  synth.max_shard_mb = options.max_shard_mb;
  const ModelConfig config = synth_config(synth);
  const bool terminal = ::isatty(STDERR_FILENO) != 0;
  synthesize_model(options.directory, synth, [&](const std::string& line) {
    if (terminal) fmt::print(stderr, "\r{}", line);
  });
  if (terminal) fmt::print(stderr, "\n");
  fmt::print("synth-model: {} ({}, {} layers, hidden {}, vocab {}, {}{}) seed {} -> {}\n", options.preset,
             architecture_class_name(config.architecture), config.num_hidden_layers, config.hidden_size,
             config.vocab_size, config.tie_word_embeddings ? "tied" : "untied",
             config.quantization ? fmt::format(", {}-bit MLX", config.quantization->bits) : std::string(),
             synth.seed, options.directory);
}

}  // namespace

void add_model_commands(CLI::App& app) {
  {
    auto options = std::make_shared<ModelOptions>();
    CLI::App* command = app.add_subcommand("logits", "Logits of a prompt on a checkpoint (CPU reference)");
    add_model_options(command, *options, true);
    command->add_option("--format", options->format, "text or json")
        ->check(CLI::IsMember({"text", "json"}))
        ->capture_default_str();
    command->callback([options] { logits_command(*options); });
  }
  {
    auto options = std::make_shared<ModelOptions>();
    CLI::App* command = app.add_subcommand("generate", "Greedy decoding on a checkpoint (CPU reference)");
    add_model_options(command, *options, true);
    command->add_option("--tokens", options->tokens, "tokens to generate")->required();
    command->add_option("--format", options->format, "text or json")
        ->check(CLI::IsMember({"text", "json"}))
        ->capture_default_str();
    command->callback([options] { generate_command(*options); });
  }
  {
    auto options = std::make_shared<ModelOptions>();
    options->prompt_ids = "1,2,3,4";
    CLI::App* command = app.add_subcommand(
        "verify-model", "Decode with the reference and the planned (fused) path and compare their next tokens");
    add_model_options(command, *options, false);
    command->add_option("--prompt-ids", options->prompt_ids, "comma-separated prompt token ids")
        ->capture_default_str();
    command->add_option("--tokens", options->tokens, "positions to compare")->capture_default_str();
    command->add_option("--min-agreement", options->min_agreement, "least fraction of equal next tokens")
        ->capture_default_str();
    command->add_option("--max-kl", options->max_kl, "largest KL divergence of one position (nats)")
        ->capture_default_str();
    command->add_option("--max-logit-error", options->max_logit_error,
                        "largest |logit error| relative to the reference's max |logit|")
        ->capture_default_str();
    command->callback([options] {
      const int code = verify_command(*options);
      if (code != 0) throw CommandExit{code};
    });
  }
  {
    auto options = std::make_shared<SynthCommandOptions>();
    CLI::App* command = app.add_subcommand("synth-model", "Write a seeded random checkpoint (Hugging Face layout)");
    command->add_option("OUT_DIR", options->directory, "directory to create (must not exist or be empty)")
        ->required();
    command->add_option("--preset", options->preset, "tiny, small, llama3.2-1b, qwen2.5-1.5b or llama3-8b")
        ->capture_default_str();
    command->add_option("--arch", options->architecture, "llama, qwen2 or mistral (default: the preset's)");
    command->add_option("--layers", options->layers, "number of layers (default: the preset's)");
    command->add_option("--seed", options->seed, "seed of the weights")->capture_default_str();
    command->add_option("--quantize", options->quantize, "write MLX-quantized weights: 4 or 8 bits");
    command->add_option("--group-size", options->group_size, "quantization group size")->capture_default_str();
    command->add_option("--tie-word-embeddings", options->tie, "true or false (default: the preset's)")
        ->check(CLI::IsMember({"true", "false"}));
    command->add_option("--config-spelling", options->config_spelling,
                        "config.json in the spelling of transformers 4 or 5")
        ->capture_default_str();
    command->add_option("--max-shard-mb", options->max_shard_mb, "split the weights into shards of this size")
        ->capture_default_str();
    command->callback([options] { synth_command(*options); });
  }
}

}  // namespace metile::cli
