// The model commands (include/metile/model.h, include/metile/engine.h):
//   metile logits MODEL_DIR --prompt-ids 1,2,3 [--dtype f32|bf16] [--backend cpu|cuda] [--format text|json]
//       [--all-positions]: JSON {"logits": [last position's logits, or with --all-positions every
//       position's, row after row], "argmax": [each position's argmax]}
//   metile generate MODEL_DIR --prompt-ids ... --tokens N [--temperature T [--top-k K] [--top-p P] [--seed S]]
//       [--ignore-eos] [...]: greedy (or sampled, SamplingOptions) decoding up to N tokens, ending after the
//       checkpoint's end-of-sequence token (ModelConfig::eos_token_ids) unless --ignore-eos; a progress line
//       on stderr; JSON {"stopped_at_eos": b, "tokens": [...], "tokens_per_second": x} (null for one token:
//       no decode step ran; "n/a" in text)
//   metile verify-model MODEL_DIR [--tokens N] [--quantize 4|8] [--backend cpu|cuda] [thresholds]:
//       cpu: the reference path against the planned (fused) path; cuda: the native engine against the
//       fused engine, declining the region kinds that break it (model_cuda_commands.cpp); both fed the
//       same tokens; exit 1 outside the thresholds
//   metile bench-model MODEL_DIR | --preset NAME [--quantize 4|8] [--context N]: the GPU engine's speed
//       (model_cuda_commands.cpp)
//   metile synth-model OUT_DIR --preset ... : a seeded random checkpoint
// A malformed checkpoint is one line naming the tensor or field, exit 2; nothing is written.
// --backend cuda where no GPU exists (or metile was built without CUDA) is one line, exit 2.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "metile/fusion.h"
#include "metile/io.h"
#include "metile/model.h"
#include "model_options.h"

namespace metile::cli {

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

std::optional<AffineQuantization> quantization_option(const std::string& quantize, int group_size) {
  if (quantize.empty()) return std::nullopt;
  if (quantize != "4" && quantize != "8") throw InputError(fmt::format("--quantize must be 4 or 8, got '{}'", quantize));
  AffineQuantization format{std::stoi(quantize), group_size};
  format.validate();
  return format;
}

std::optional<AffineQuantization> quantization_option(const ModelOptions& options) {
  return quantization_option(options.quantize, options.group_size);
}

void check_backend(const ModelOptions& options) {
  if (options.backend != "cpu" && options.backend != "cuda") {
    throw InputError(fmt::format("--backend must be cpu or cuda, got '{}'", options.backend));
  }
  if (options.backend == "cuda") {
#ifdef METILE_HAVE_CUDA_BACKEND
    require_cuda_device();
#else
    throw InputError("--backend cuda: this metile was built without the CUDA toolkit; use --backend cpu");
#endif
  }
}

namespace {

constexpr std::string_view kVerifyDefaultPrompt = "1,2,3,4";  // verify-model's --prompt-ids unless given

// The prompt's ids against the loaded model's vocabulary, naming the option (and the prompt, when it
// is verify-model's default, which a tiny vocabulary may not hold).
void check_prompt_ids(const std::vector<std::int32_t>& prompt, const DecoderModel& model, const std::string& text,
                      std::string_view default_text = {}) {
  try {
    check_token_ids(prompt, model);  // the sessions' own check, here with the option named
  } catch (const InputError& error) {
    const char* note = text == default_text ? " (the default; give --prompt-ids)" : "";
    throw InputError(fmt::format("--prompt-ids {}{}: {}", text, note, error.what()));
  }
}

// "a,b,c" as a set; an empty item is an error naming the option.
std::set<std::string> comma_separated(const std::string& text, const char* option, const char* item) {
  std::set<std::string> items;
  std::size_t start = 0;
  while (start < text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    if (comma == start) throw InputError(fmt::format("{}: an empty {} in '{}'", option, item, text));
    items.insert(text.substr(start, comma - start));
    start = comma + 1;
  }
  return items;
}
}  // namespace

std::set<std::string> declined_rules(const std::string& text) {
  std::set<std::string> kinds = comma_separated(text, "--decline", "region kind");
  check_region_kinds(kinds, "--decline");
  return kinds;
}

std::string decline_help(std::string_view what) {
  std::string kinds;
  for (const std::string& kind : region_kinds()) kinds += (kinds.empty() ? "" : ", ") + kind;
  return fmt::format("{}, comma-separated, of: {}", what, kinds);
}

std::set<std::string> benchmarked_engines(const std::string& text) {
  std::set<std::string> engines = comma_separated(text, "--engines", "engine");
  if (engines.empty()) throw InputError("--engines: name at least one of fused, fused-pdl, native");
  for (const std::string& engine : engines) {
    if (engine != "fused" && engine != "fused-pdl" && engine != "native") {
      throw InputError(fmt::format("--engines: unknown engine '{}' (fused, fused-pdl, native)", engine));
    }
  }
  return engines;
}

nlohmann::json json_number(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  return value;
}

nlohmann::json figures_json(const AgreementFigures& figures) {
  return {{"positions", figures.positions},
          {"agreement", json_number(figures.agreement())},
          {"first_disagreement", figures.first_disagreement},
          {"decided_positions", figures.decided_positions},
          {"decided_agreements", figures.decided_agreements},
          {"kl_mean", json_number(figures.kl_mean)},
          {"kl_max", json_number(figures.kl_max)},
          {"max_logit_error", json_number(figures.max_logit_error)},
          {"nonfinite_reference_positions", figures.nonfinite_reference_positions}};
}

namespace {

// --quantize and --group-size, the same on every command that takes them: the group size alone
// would change nothing, so it needs --quantize.
void add_quantization_options(CLI::App* command, std::string& quantize, int& group_size, const std::string& quantize_help) {
  CLI::Option* bits = command->add_option("--quantize", quantize, quantize_help);
  command->add_option("--group-size", group_size, "quantization group size: 32, 64 or 128")
      ->transform(decimal_integer())
      ->capture_default_str()
      ->needs(bits);
}

void add_model_options(CLI::App* command, ModelOptions& options, bool with_prompt) {
  command->add_option("MODEL_DIR", options.model_dir, "checkpoint directory (config.json + safetensors)")
      ->required();
  if (with_prompt) {
    command->add_option("--prompt-ids", options.prompt_ids, "comma-separated token ids")->required();
  }
  command->add_option("--dtype", options.dtype, "bf16 (rounded as the GPU path) or f32")
      ->check(CLI::IsMember({"bf16", "f32"}))
      ->capture_default_str();
  command->add_option("--backend", options.backend, "cpu or cuda (the GPU decode engine)")->capture_default_str();
  add_quantization_options(command, options.quantize, options.group_size, "quantize dense weights at load: 4 or 8 bits");
  command->add_option("--max-seq", options.max_seq, "KV-cache capacity (unset or 0: min(4096, the config's limit); a sliding window caps it)")
      ->transform(decimal_integer());
  command->add_option("--decline", options.decline, decline_help("--backend cuda: region kinds that run native"));
}

// Said on stderr (matrices_left_dense, model.h, says why).
void note_matrices_left_dense(const ModelConfig& config, const AffineQuantization& format) {
  for (const MatricesLeftDense& left : matrices_left_dense(config, format)) {
    fmt::print(stderr, "metile: note: --quantize leaves {} dense: {} columns are not a multiple of --group-size {}\n",
               left.matrices, left.columns, format.group_size);
  }
}

// The arguments, then the backend (a GPU opened), are checked before the checkpoint is read: no device is
// one line at once.
DecoderModel load_model(const ModelOptions& options) {
  if (options.backend == "cpu" && !options.decline.empty()) {
    throw InputError("--decline applies to --backend cuda (the fused GPU engine)");
  }
  declined_rules(options.decline);  // a misspelt kind: one line before a device is looked for
  LoadOptions load;
  load.dtype = parse_dtype(options.dtype);
  load.max_sequence = options.max_seq;
  load.quantize = quantization_option(options);
  // Every mistake in an argument is said as itself before a device is looked for ("--quantize 3" read
  // "no CUDA device" on a machine without one).
  DecoderModel::check_load_arguments(options.model_dir, load);
  check_backend(options);
  DecoderModel model = DecoderModel::load(options.model_dir, load);
  if (load.quantize) note_matrices_left_dense(model.config(), *load.quantize);
  return model;
}

// A fresh sequence on the chosen backend.
std::unique_ptr<LogitsSession> open_session(const DecoderModel& model, const ModelOptions& options) {
#ifdef METILE_HAVE_CUDA_BACKEND
  if (options.backend == "cuda") return open_cuda_session(model, options);
#endif
  return std::make_unique<DecodeSession>(model);
}

std::string backend_description(const ModelOptions& options) {
#ifdef METILE_HAVE_CUDA_BACKEND
  if (options.backend == "cuda") return "on " + cuda_device_name() + " (fused engine)";
#endif
  return "on cpu";
}

std::string float_list(std::span<const float> values) {
  std::string text;
  for (float value : values) text += (text.empty() ? "" : ", ") + fmt::format("{}", value);
  return text;
}

// --all-positions prints every position's logits: refused before the first step when their text (up to
// 24 bytes a logit: a float widened to double and its comma) and the logits (4 bytes) pass this
// machine's memory.
void check_all_positions_fit(std::size_t positions, std::size_t vocab) {
  const double bytes = static_cast<double>(positions) * static_cast<double>(vocab) * (24 + 4);
  if (const auto memory = static_cast<double>(physical_memory_bytes()); bytes > memory) {
    throw InputError(fmt::format("--all-positions: {} positions x {} logits take about {:.1f} GB as JSON, more than this "
                                 "machine's {:.1f} GB of memory",
                                 positions, vocab, bytes / 1e9, memory / 1e9));
  }
}

void logits_command(const ModelOptions& options) {
  if (options.all_positions && options.format != "json") throw InputError("--all-positions needs --format json");
  const std::vector<std::int32_t> prompt = parse_ids(options.prompt_ids);
  const DecoderModel model = load_model(options);
  check_prompt_ids(prompt, model, options.prompt_ids);
  // The whole prompt against the capacity before the first step: each step checks only its own tokens,
  // so a long prompt was refused after computing the steps that fit, naming the end of one step.
  check_tokens_fit(prompt, 0, model);
  const auto vocab = static_cast<std::size_t>(model.config().vocab_size);
  if (options.all_positions) check_all_positions_fit(prompt.size(), vocab);
  const std::unique_ptr<LogitsSession> session = open_session(model, options);
  // The prompt is fed a step's tokens at a time (as the sessions step through it anyway), keeping each
  // position's argmax and the logits shown: the last position's, or with --all-positions every one.
  // Keeping every row to show one took prompt x vocab x 4 bytes (137 GB for 2048 tokens of a 2^24 vocab).
  std::vector<std::int64_t> argmaxes;
  std::vector<float> shown;
  for_each_step_chunk(prompt, [&](std::span<const std::int32_t> chunk) {
    const std::vector<float> logits = session->feed(chunk);
    for (std::size_t row = 0; row < chunk.size(); ++row) {
      argmaxes.push_back(argmax_index(std::span<const float>(logits.data() + row * vocab, vocab)));
    }
    if (!options.all_positions) shown.clear();
    shown.insert(shown.end(), options.all_positions ? logits.begin() : logits.end() - static_cast<std::ptrdiff_t>(vocab),
                 logits.end());
  });
  const std::span<const float> last(shown.data() + shown.size() - vocab, vocab);
  if (options.format == "json") {
    // Written as it goes: a JSON tree of every logit took ~14 times the logits' bytes.
    std::string text = "{\"argmax\":" + nlohmann::json(argmaxes).dump() + ",\"logits\":[";
    for (std::size_t index = 0; index < shown.size(); ++index) {
      if (index > 0) text += ',';
      text += json_number(shown[index]).dump();
    }
    text += "]}\n";
    std::fwrite(text.data(), 1, text.size(), stdout);  // fmt::print would format a second copy
    return;
  }
  std::string positions;
  for (std::int64_t token : argmaxes) positions += (positions.empty() ? "" : " ") + std::to_string(token);
  fmt::print("{} token{}, vocab {}, {} {}\n", prompt.size(), prompt.size() == 1 ? "" : "s", vocab, options.dtype,
             backend_description(options));
  fmt::print("argmax per position: {}\n", positions);
  fmt::print("last position: max logit {} at token {}\n", last[static_cast<std::size_t>(argmaxes.back())],
             argmaxes.back());
  fmt::print("last position, first logits: {}\n", float_list(last.subspan(0, std::min<std::size_t>(8, vocab))));
}

// Decode steps a second; none where no decode step was timed: the first token comes from the
// prompt's step, so one token has no rate (0 read as a stall).
std::optional<double> decode_rate(std::int64_t steps, double seconds) {
  if (steps <= 0 || seconds <= 0) return std::nullopt;
  return static_cast<double>(steps) / seconds;
}
nlohmann::json rate_json(std::optional<double> rate) { return rate ? nlohmann::json(*rate) : nlohmann::json(nullptr); }
std::string rate_text(std::optional<double> rate) { return rate ? fmt::format("{:.2f}", *rate) : std::string("n/a"); }

// SamplingOptions' messages name its fields as Python's keywords do (temperature, top_k, top_p, seed);
// here each whole word becomes its option (--temperature, --top-k, --top-p, --seed).
std::string with_option_names(std::string message) {
  const auto word_character = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_'; };
  for (const auto& [field, option] : {std::pair<std::string_view, std::string_view>{"temperature", "--temperature"},
                                      {"top_k", "--top-k"},
                                      {"top_p", "--top-p"},
                                      {"seed", "--seed"}}) {
    std::size_t at = message.find(field);
    while (at != std::string::npos) {
      const std::size_t end = at + field.size();
      const bool whole_word = (at == 0 || !word_character(message[at - 1])) &&
                              (end == message.size() || !word_character(message[end]));
      if (whole_word) message.replace(at, field.size(), option);
      at = message.find(field, whole_word ? at + option.size() : end);
    }
  }
  return message;
}

void generate_command(const ModelOptions& options) {
  const std::vector<std::int32_t> prompt = parse_ids(options.prompt_ids);
  check_generation_count(options.tokens);  // before the model loads
  const SamplingOptions sampling{options.temperature, options.top_k, options.top_p, parse_seed(options.seed)};
  try {
    sampling.validate();
  } catch (const InputError& error) {
    throw InputError(with_option_names(error.what()));
  }
  const DecoderModel model = load_model(options);
  check_prompt_ids(prompt, model, options.prompt_ids);
  const std::unique_ptr<LogitsSession> session = open_session(model, options);
  const bool terminal = ::isatty(STDERR_FILENO) != 0;
  const std::span<const std::int64_t> stop_tokens =
      options.ignore_eos ? std::span<const std::int64_t>() : std::span<const std::int64_t>(model.config().eos_token_ids);
  const Generation generation =
      generate(*session, prompt, options.tokens, sampling, stop_tokens, [&](std::int64_t index) {
        if (terminal) fmt::print(stderr, "\rmetile generate: {}/{} tokens", index + 1, options.tokens);
      });
  const std::optional<double> rate = decode_rate(generation.decode_steps, generation.seconds);
  const std::string picked = sampling.greedy() ? "greedy"
                                               : fmt::format("sampled at temperature {}, top-k {}, top-p {}, seed {}",
                                                             sampling.temperature, sampling.top_k, sampling.top_p,
                                                             sampling.seed);
  const std::string stopped =
      generation.stopped ? fmt::format(", ended by end-of-sequence token {}", generation.tokens.back()) : "";
  fmt::print(stderr, "{}metile generate: {} token{} after a {}-token prompt{}, {} tokens/s ({} {}, {})\n",
             terminal ? "\r" : "", generation.tokens.size(), generation.tokens.size() == 1 ? "" : "s", prompt.size(),
             stopped, rate_text(rate), options.dtype, backend_description(options), picked);
  if (options.format == "json") {
    nlohmann::json json;
    json["tokens"] = generation.tokens;
    json["stopped_at_eos"] = generation.stopped;
    json["tokens_per_second"] = rate_json(rate);
    fmt::print("{}\n", json.dump());
    return;
  }
  std::string text;
  for (std::int32_t token : generation.tokens) text += (text.empty() ? "" : " ") + std::to_string(token);
  fmt::print("{}\n", text);
}

int verify_command(ModelOptions options) {
  const std::vector<std::int32_t> prompt = parse_ids(options.prompt_ids);
  const DecoderModel model = load_model(options);
  check_prompt_ids(prompt, model, options.prompt_ids, kVerifyDefaultPrompt);
#ifdef METILE_HAVE_CUDA_BACKEND
  if (options.backend == "cuda") return verify_model_on_cuda(model, options);
#endif
  const std::int64_t positions = options.tokens < 0 ? 16 : options.tokens;
  const double min_agreement = or_default(options.min_agreement, 0.95);
  const double max_kl = or_default(options.max_kl, 0.01);
  const double max_kl_mean = or_default(options.max_kl_mean, max_kl);
  const double max_logit_error = or_default(options.max_logit_error, 0.02);
  check_decode_sessions_fit(model, 2);  // each session checks itself alone
  DecodeSession reference(model, DecodePath::reference);
  DecodeSession planned(model, DecodePath::planned);
  const AgreementFigures figures = compare_sessions(reference, planned, prompt, positions);
  const auto rate = [&](double seconds) { return decode_rate(positions - 1, seconds); };
  const bool pass = figures.nonfinite_reference_positions == 0 && figures.agreement() >= min_agreement &&
                    figures.kl_max <= max_kl && figures.kl_mean <= max_kl_mean &&
                    figures.max_logit_error <= max_logit_error;
  if (options.format == "json") {
    nlohmann::json json;
    json["backend"] = "cpu";
    json["dtype"] = options.dtype;
    json["positions"] = positions;
    json["figures"] = figures_json(figures);
    json["thresholds"] = {{"min_agreement", min_agreement}, {"max_kl", max_kl}, {"max_kl_mean", max_kl_mean},
                          {"max_logit_error", max_logit_error}};
    json["tokens_per_second"] = {{"reference", rate_json(rate(figures.reference_seconds))},
                                 {"planned", rate_json(rate(figures.candidate_seconds))}};
    json["passed"] = pass;
    fmt::print("{}\n", json.dump(2));
    return pass ? 0 : 1;
  }
  fmt::print("verify-model: {} positions, reference (run_reference) vs planned (plan_graph_fusion cpu + "
             "run_plan_reference), {} on cpu\n", positions, options.dtype);
  fmt::print("next-token agreement   {:.4f}   (min {})\n", figures.agreement(), min_agreement);
  fmt::print("KL mean / max          {:.3g} / {:.3g}   (max {} / {})\n", figures.kl_mean, figures.kl_max, max_kl_mean,
             max_kl);
  fmt::print("max logit error        {:.3g} of max |logit|   (max {})\n", figures.max_logit_error, max_logit_error);
  fmt::print("tokens/s               reference {}, planned {}\n", rate_text(rate(figures.reference_seconds)),
             rate_text(rate(figures.candidate_seconds)));
  if (figures.nonfinite_reference_positions > 0) {
    fmt::print("the reference's own logits are not finite at {} of {} positions: the weights or the prompt give NaN "
               "or inf without any plan, so the figures above compare nothing\n",
               figures.nonfinite_reference_positions, figures.positions);
  }
  fmt::print("{}\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

struct SynthCommandOptions {
  std::string directory;
  std::string preset = "tiny";
  std::string architecture;
  std::optional<std::int64_t> layers;  // the preset's when unset
  std::string seed = "0";
  std::string quantize;
  int group_size = 64;
  std::string tie;  // "", "true", "false"
  int config_spelling = 4;
  double max_shard_mb = 2000;
};

// While it lives, kStoppingSignals (include/metile/io.h) set a flag instead of ending the process (a second one ends it
// at once); the handlers before it come back when it goes. The same signal again within half a second is
// the first one sent twice, not a second: `timeout` signals the process and then its process group, and
// the second copy ended the process before it removed its staging folder.
std::atomic<int> interrupt_signal{0};  // lock-free: safe to write from a handler on any thread
std::atomic<std::int64_t> interrupt_nanoseconds{0};
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<std::int64_t>::is_always_lock_free);
class InterruptFlag {
 public:
  InterruptFlag() {
    interrupt_signal = 0;
    struct sigaction action {};
    action.sa_handler = [](int signal) {
      timespec now{};
      clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe
      const std::int64_t nanoseconds = std::int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec;
      if (interrupt_signal != 0) {
        if (signal == interrupt_signal && nanoseconds - interrupt_nanoseconds < 500'000'000) return;
        std::signal(signal, SIG_DFL);
        std::raise(signal);
      }
      interrupt_nanoseconds = nanoseconds;
      interrupt_signal = signal;
    };
    sigemptyset(&action.sa_mask);
    for (std::size_t index = 0; index < kSignals.size(); ++index) {
      // A signal the process was started ignoring stays ignored (`nohup metile synth-model ...`).
      if (sigaction(kSignals[index], nullptr, &previous_[index]) == 0 && previous_[index].sa_handler == SIG_IGN) continue;
      sigaction(kSignals[index], &action, nullptr);
    }
  }
  ~InterruptFlag() {
    for (std::size_t index = 0; index < kSignals.size(); ++index) sigaction(kSignals[index], &previous_[index], nullptr);
  }
  InterruptFlag(const InterruptFlag&) = delete;
  InterruptFlag& operator=(const InterruptFlag&) = delete;
  bool raised() const { return interrupt_signal != 0; }
  int signal() const { return interrupt_signal; }

 private:
  // SIGHUP too: a terminal closed under a run left the staging folder (in an existing empty
  // directory, where a second run then found the directory not empty); SIGQUIT (Ctrl-\) and the rest likewise.
  static constexpr const std::array<int, kStoppingSignals.size()>& kSignals = kStoppingSignals;
  std::array<struct sigaction, kSignals.size()> previous_{};
};

void synth_command(const SynthCommandOptions& options) {
  SynthOptions synth;
  synth.preset = options.preset;
  if (!options.architecture.empty()) synth.architecture = parse_architecture_short_name(options.architecture);
  synth.layers = options.layers;
  synth.seed = parse_seed(options.seed);
  synth.quantize = quantization_option(options.quantize, options.group_size);
  if (!options.tie.empty()) synth.tie_word_embeddings = options.tie == "true";
  synth.transformers_version = options.config_spelling;
  synth.max_shard_mb = options.max_shard_mb;
  const ModelConfig config = synth_config(synth);
  if (synth.quantize) note_matrices_left_dense(config, *synth.quantize);
  const bool terminal = ::isatty(STDERR_FILENO) != 0;
  {
    // Ctrl-C or a kill while the weights are written: the staging folder is removed, not left behind.
    const InterruptFlag interrupt;
    try {
      synthesize_model(
          options.directory, synth,
          [&](const std::string& line) {
            if (terminal) fmt::print(stderr, "\r{}", line);
          },
          [&] { return interrupt.raised(); });
    } catch (const InputError& error) {
      if (!interrupt.raised()) throw;
      if (terminal) fmt::print(stderr, "\n");
      fmt::print(stderr, "metile: {}\n", error.what());
      throw CommandExit{128 + interrupt.signal()};  // the shell's convention: 130 for SIGINT, 143 for SIGTERM
    }
  }
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
    CLI::App* command = app.add_subcommand("logits", "Logits of a prompt on a checkpoint (CPU reference or GPU engine)");
    add_model_options(command, *options, true);
    command->add_option("--format", options->format, "text or json")
        ->check(CLI::IsMember({"text", "json"}))
        ->capture_default_str();
    command->add_flag("--all-positions", options->all_positions,
                      "--format json: every position's logits, row after row (default: the last position's)");
    command->callback([options] { logits_command(*options); });
  }
  {
    auto options = std::make_shared<ModelOptions>();
    CLI::App* command = app.add_subcommand(
        "generate", "Greedy or sampled decoding on a checkpoint (CPU reference or GPU engine)");
    add_model_options(command, *options, true);
    command->add_option("--tokens", options->tokens, "tokens to generate")->required()->transform(decimal_integer());
    command->add_option("--format", options->format, "text or json")
        ->check(CLI::IsMember({"text", "json"}))
        ->capture_default_str();
    command->add_option("--temperature", options->temperature,
                        "sample from softmax(logits / T) (0: greedy, the argmax)")
        ->transform(decimal_number())
        ->capture_default_str();
    command->add_option("--top-k", options->top_k, "with --temperature: only the K most likely tokens (0: all)")
        ->transform(decimal_integer())
        ->capture_default_str();
    command->add_option("--top-p", options->top_p,
                        "with --temperature: only the most likely tokens holding P of the probability (1: all)")
        ->transform(decimal_number())
        ->capture_default_str();
    command->add_option("--seed", options->seed, "with --temperature: seed of the draws (std::mt19937_64)")
        ->capture_default_str();
    command->add_flag("--ignore-eos", options->ignore_eos,
                      "generate all --tokens (default: stop after the checkpoint's end-of-sequence token, "
                      "eos_token_id of generation_config.json or config.json)");
    command->callback([options] { generate_command(*options); });
  }
  {
    auto options = std::make_shared<ModelOptions>();
    options->prompt_ids = std::string(kVerifyDefaultPrompt);
    CLI::App* command = app.add_subcommand(
        "verify-model",
        "Compare next tokens of two paths: cpu reference vs planned, or cuda native vs fused engine");
    add_model_options(command, *options, false);
    command->add_option("--prompt-ids", options->prompt_ids, "comma-separated prompt token ids")
        ->capture_default_str();
    options->tokens = -1;  // unset: the backend's default (a given value is at least 1)
    command->add_option("--tokens", options->tokens, "positions to compare (default 16 on cpu, 64 on cuda)")
        ->transform(decimal_integer())
        ->check(CLI::Range(std::int64_t{1}, std::numeric_limits<std::int64_t>::max()));
    // Given thresholds are finite and >= 0 (NaN passes CLI::Range, so it is checked here); an unset one
    // stays -1, the backend's default. --min-agreement is a fraction: above 1 no run could pass (a
    // perfect one printed FAIL).
    // Checked after decimal_number(), which refuses "", "0.1x", nan and inf but leaves a number past
    // double's range to the option's check: 1e400 is +inf here (it was taken as an infinite threshold).
    const CLI::Validator non_negative(
        [](std::string& text) {
          const double value = std::strtod(text.c_str(), nullptr);
          return std::isfinite(value) && value >= 0 ? std::string() : "must be a finite number >= 0";
        },
        ">= 0");
    const CLI::Validator fraction(
        [](std::string& text) {
          const double value = std::strtod(text.c_str(), nullptr);
          return value >= 0 && value <= 1 ? std::string() : "must be a fraction from 0 to 1";
        },
        "0..1");
    command->add_option("--min-agreement", options->min_agreement,
                        "least fraction of equal next tokens (default 0.95 on cpu, 0.9 on cuda)")
        ->check(decimal_number())
        ->check(fraction);
    command->add_option("--max-kl", options->max_kl, "largest KL divergence of one position, nats (default 0.01)")
        ->check(decimal_number())
        ->check(non_negative);
    command->add_option("--max-kl-mean", options->max_kl_mean,
                        "largest mean KL divergence, nats (default --max-kl on cpu, 1e-3 on cuda)")
        ->check(decimal_number())
        ->check(non_negative);
    command->add_option("--max-logit-error", options->max_logit_error,
                        "largest |logit error| relative to the reference's max |logit| (default 0.02 on cpu, 0.05 on cuda)")
        ->check(decimal_number())
        ->check(non_negative);
    command->add_option("--format", options->format, "text or json")
        ->check(CLI::IsMember({"text", "json"}))
        ->capture_default_str();
    command->callback([options] {
      const int code = verify_command(*options);
      if (code != 0) throw CommandExit{code};
    });
  }
  {
    auto options = std::make_shared<ModelOptions>();
    CLI::App* command = app.add_subcommand(
        "bench-model", "Decode and prefill speed of the GPU engine, fused and native, with a per-kind breakdown");
    command->add_option("MODEL_DIR", options->model_dir, "checkpoint directory (or --preset)");
    command->add_option("--preset", options->preset,
                        "synthesize this preset into a temporary directory instead: tiny, small, llama3.2-1b, "
                        "qwen2.5-1.5b or llama3-8b");
    command->add_option("--layers", options->layers, "--preset: number of layers (default: the preset's)")
        ->transform(decimal_integer());
    command->add_option("--seed", options->seed, "--preset: seed of the weights, and of the prompt tokens")
        ->capture_default_str();
    add_quantization_options(command, options->quantize, options->group_size,
                             "4 or 8 bits (MLX affine); default: the checkpoint's");
    command->add_option("--context", options->context, "cached tokens before the timed decode steps")
        ->transform(decimal_integer())
        ->capture_default_str();
    command->add_option("--prefill-tokens", options->prefill_tokens, "prompt of the prefill measurement")
        ->transform(decimal_integer())
        ->capture_default_str();
    command->add_option("--decode-steps", options->decode_steps, "timed decode steps")
        ->transform(decimal_integer())
        ->capture_default_str();
    command->add_option("--max-seq", options->max_seq,
                        "KV-cache capacity (unset or 0: what the measurements need, rounded up to 256, at most a sliding window that holds them)")
        ->transform(decimal_integer());
    command->add_option("--decline", options->decline, decline_help("region kinds the fused engine runs native"));
    command->add_option("--engines", options->engines,
                        "engines to measure, comma-separated: fused, fused-pdl (GEMVs and attention as programmatic dependents), "
                        "native")
        ->capture_default_str();
    command->add_option("--tournament-caches", options->tournament_caches,
                        "the regions' races: cold (the L2 flushed before every timed call, as in a decode step) or "
                        "warm (calls back to back: weights that nearly fit the L2 favour kernels that lose in the step)")
        ->check(CLI::IsMember({"cold", "warm"}))
        ->capture_default_str();
    command->add_option("--weight-prefetch", options->weight_prefetch,
                        "the fused engines' L2 prefetch of the heavy GEMVs' first weights while the latency-bound "
                        "steps before them run: off, raced (kept when the step replays faster) or always")
        ->check(CLI::IsMember({"off", "raced", "always"}))
        ->capture_default_str();
    CLI::Option* prefetch_budget =
        command->add_option("--weight-prefetch-mb", options->weight_prefetch_mb,
                            "the L2 prefetch's budget in MiB: a GEMV streaming more gets this many of its bytes "
                            "requested during the steps before it that stream at most this many")
            ->check(decimal_number())
            ->check(CLI::Range(1.0, 1024.0))
            ->capture_default_str();
    command->add_flag("--race-near-ties,!--no-race-near-ties", options->race_near_ties,
                      "the fused engines race, inside the step, each kind's regions with their chosen shape's L2-prefetch "
                      "twin, else the fused candidate their race nearly chose (within --near-tie-margin), and keep it when "
                      "the step is 1% faster (default on: alone and cold, Qwen2.5-1.5B's gate/up took 19.6 and 19.7 us, "
                      "inside the step 18.6 and 13.9 us a layer)");
    CLI::Option* margin = command->add_option("--near-tie-margin", options->near_tie_margin,
                                              "how far behind the race's winner (a fraction of its time) a fused "
                                              "candidate may be and still be raced inside the step")
                              ->check(decimal_number())
                              ->check(CLI::Range(0.001, 10.0))
                              ->capture_default_str();
    command->add_option("--format", options->format, "text or json")
        ->check(CLI::IsMember({"text", "json"}))
        ->capture_default_str();
    command->callback([options, margin, prefetch_budget] {
      if (options->model_dir.empty() == options->preset.empty()) {
        throw InputError("bench-model: give either MODEL_DIR or --preset NAME");
      }
      benchmarked_engines(options->engines);
      if (margin->count() > 0 && !options->race_near_ties) {
        throw InputError("--near-tie-margin sizes the near-tie race, which --no-race-near-ties turns off");
      }
      if (prefetch_budget->count() > 0 && options->weight_prefetch == "off") {
        throw InputError("--weight-prefetch-mb sizes the L2 weight prefetch, which is off (--weight-prefetch raced or always)");
      }
      if (options->layers && options->preset.empty()) throw InputError("--layers sizes a --preset model");
      if (options->layers && *options->layers < 1) {
        throw InputError(fmt::format("--layers {} must be at least 1", *options->layers));
      }
      quantization_option(*options);  // malformed --quantize: one line before anything else
      declined_rules(options->decline);
      options->backend = "cuda";
#ifdef METILE_HAVE_CUDA_BACKEND
      bench_model(*options);  // opens the device first
#else
      throw InputError("bench-model: this metile was built without the CUDA toolkit (it measures the GPU engine)");
#endif
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
    command->add_option("--layers", options->layers, "number of layers (default: the preset's)")
        ->transform(decimal_integer());
    command->add_option("--seed", options->seed, "seed of the weights")->capture_default_str();
    add_quantization_options(command, options->quantize, options->group_size, "write MLX-quantized weights: 4 or 8 bits");
    command->add_option("--tie-word-embeddings", options->tie, "true or false (default: the preset's)")
        ->check(CLI::IsMember({"true", "false"}));
    command->add_option("--config-spelling", options->config_spelling,
                        "config.json in the spelling of transformers 4 or 5")
        ->transform(decimal_integer())
        ->capture_default_str();
    command->add_option("--max-shard-mb", options->max_shard_mb, "split the weights into shards of this size")
        ->check(decimal_number())
        ->capture_default_str();
    command->callback([options] { synth_command(*options); });
  }
}

}  // namespace metile::cli
