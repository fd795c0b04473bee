// `--backend cuda` of the model commands and `metile bench-model` (include/metile/engine.h).
// Built only with the CUDA backend (METILE_HAVE_CUDA_BACKEND); model_commands.cpp parses the
// options and calls in here.
//
//   logits / generate  a CudaDecodeSession on the fused engine (--decline: kinds run native)
//   verify-model       verify_fused_engine: native vs fused, teacher-forced; what was declined
//                      and how each declined kind moved the figures; exit 1 when even the kept
//                      plan misses the thresholds
//   bench-model        copy bandwidth, then benchmark_engine on the fused engine, the fused engine
//                      with programmatic dependent launches, and the native engine;
//                      --preset synthesizes the checkpoint into a temporary directory, removed after
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <set>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "metile/engine.h"
#include "model_options.h"

namespace metile::cli {
namespace {

// The process's one device (opened by require_cuda_device).
std::optional<CudaDevice>& opened_device() {
  static std::optional<CudaDevice> device;
  return device;
}

// Each line says how long the command has run (model loads and engine builds take minutes on
// large checkpoints; the stamps show where).
void progress_line(const std::string& line) {
  static const auto start = std::chrono::steady_clock::now();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fmt::print(stderr, "[{:6.1f} s] {}\n", seconds, line);
}

std::shared_ptr<const CudaModel> upload(const DecoderModel& model) {
  require_cuda_device();
  return CudaModel::load(model, *opened_device(), progress_line);
}

ExecutableOptions executable_options(const ModelOptions& options) {
  ExecutableOptions executable;
  executable.declined_rules = declined_rules(options.decline);
  return executable;
}

// A temporary directory removed when it goes out of scope (also on errors).
class TemporaryDirectory {
 public:
  TemporaryDirectory() : path_(temporary_folder() / fmt::format("metile-bench-model-{}", ::getpid())) {
    std::filesystem::remove_all(path_);
  }
  ~TemporaryDirectory() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TemporaryDirectory(const TemporaryDirectory&) = delete;
  TemporaryDirectory& operator=(const TemporaryDirectory&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  // TMPDIR's folder (else /tmp): one line naming it where it is no folder (filesystem_error was an internal error).
  static std::filesystem::path temporary_folder() {
    std::error_code error;
    std::filesystem::path folder = std::filesystem::temp_directory_path(error);
    if (error) {
      const char* tmpdir = std::getenv("TMPDIR");
      throw InputError(fmt::format("bench-model: no folder for the synthetic checkpoint (TMPDIR={}): {}",
                                   tmpdir ? tmpdir : "", error.message()));
    }
    return folder;
  }

 private:
  std::filesystem::path path_;
};

std::string figures_row(const std::string& label, const AgreementFigures& figures, const std::string& verdict) {
  return fmt::format("{:<28} {:>9.4f} {:>10.3g} {:>10.3g} {:>12.3g}   {}", label, figures.agreement(),
                     figures.kl_mean, figures.kl_max, figures.max_logit_error, verdict);
}

nlohmann::json nan_as_null(double value) { return std::isnan(value) ? nlohmann::json(nullptr) : nlohmann::json(value); }

nlohmann::json benchmark_json(const EngineBenchmark& result) {
  nlohmann::json breakdown = nlohmann::json::array();
  for (const StepKindTime& time : result.breakdown) {
    breakdown.push_back({{"kind", time.kind},
                         {"ms", time.ms},
                         {"replay_ms", nan_as_null(time.replay_ms)},
                         {"steps", time.steps},
                         {"weight_bytes", time.weight_bytes},
                         {"weight_copy_percent", nan_as_null(weight_stream_percent(time, result.copy_bandwidth_gbps))}});
  }
  return {{"decode_ms_per_token", result.decode_replay_ms},
          {"decode_feed_ms_per_token", result.decode_feed_ms},
          {"decode_greedy_stepped_ms_per_token", result.decode_greedy_stepped_ms},
          {"decode_sampled_host_ms_per_token", result.decode_sampled_host_ms},
          {"decode_sampled_ms_per_token", result.decode_sampled_ms},
          {"decode_greedy_ms_per_token", result.decode_greedy_ms},
          {"tokens_per_second", result.tokens_per_second},
          {"floor_ms", result.floor_ms},
          {"floor_percent", result.floor_percent},
          {"prefill_tokens", result.prefill_tokens},
          {"prefill_tokens_per_second", result.prefill_tokens_per_second},
          {"device_steps_per_decode_step", result.launches},
          {"read_floors",
           {{"replay_ms", nan_as_null(result.read_floors.replay_ms)},
            {"chain_ms", nan_as_null(result.read_floors.chain_ms)},
            {"one_kernel_ms", nan_as_null(result.read_floors.one_kernel_ms)},
            {"kernels", result.read_floors.kernels},
            {"bytes", result.read_floors.bytes}}},
          {"breakdown", breakdown},
          {"chosen", result.chosen},
          {"reasons", result.reasons}};
}

void print_breakdown(const EngineBenchmark& result) {
  double total = 0, replayed = 0;
  for (const StepKindTime& time : result.breakdown) {
    total += time.ms;
    if (!std::isnan(time.replay_ms)) replayed += time.replay_ms;
  }
  fmt::print("\none {} decode step at context {}: units run eagerly with events between them ({:.3f} ms in all), and\n"
             "what each kind costs inside the replay (the replay less the step replayed without it; {:.3f} ms in all):\n",
             result.path, result.context, total, replayed);
  // The weights each kind streams, and how near the copy rate it streams them inside the replay:
  // a GEMV kind far below it is bound by latency (its kernels' chains), not by DRAM.
  fmt::print("{:<36} {:>9} {:>8} {:>10} {:>7} {:>11} {:>10}\n", "kind", "eager ms", "share", "replay ms", "steps",
             "weights MB", "% of copy");
  for (const StepKindTime& time : result.breakdown) {
    const double percent = weight_stream_percent(time, result.copy_bandwidth_gbps);
    fmt::print("{:<36} {:>9.4f} {:>7.1f}% {:>10} {:>7} {:>11} {:>10}\n", time.kind, time.ms,
               total > 0 ? 100 * time.ms / total : 0.0,
               std::isnan(time.replay_ms) ? std::string("-") : fmt::format("{:.4f}", time.replay_ms), time.steps,
               time.weight_bytes == 0 ? std::string("-") : fmt::format("{:.1f}", static_cast<double>(time.weight_bytes) / 1e6),
               std::isnan(percent) ? std::string("-") : fmt::format("{:.1f}%", percent));
  }
  fmt::print("what its regions run (regions):\n");
  for (const auto& [chosen, regions] : result.chosen) fmt::print("  {:>4}  {}\n", regions, chosen);
  fmt::print("why (the first region of each kind):\n");
  for (const auto& [rule, reason] : result.reasons) fmt::print("  {}: {}\n", rule, reason);
}

}  // namespace

void require_cuda_device(std::string_view command, std::string_view without_gpu) {
  if (opened_device()) return;
  std::string reason;
  opened_device() = CudaDevice::try_open(0, &reason);
  // A machine without a GPU is the user's environment, not a metile failure: exit 2, one line.
  if (!opened_device()) throw InputError(fmt::format("{}: {} ({})", command, reason, without_gpu));
}

std::string cuda_device_name() {
  require_cuda_device();
  return opened_device()->info().name;
}

std::unique_ptr<LogitsSession> open_cuda_session(const DecoderModel& model, const ModelOptions& options) {
  EngineOptions engine{EnginePath::fused, executable_options(options), progress_line};
  return std::make_unique<CudaDecodeSession>(upload(model), std::move(engine));
}

int verify_model_on_cuda(const DecoderModel& model, const ModelOptions& options) {
  const std::vector<std::int32_t> prompt = parse_ids(options.prompt_ids);
  const std::int64_t positions = options.tokens < 0 ? 64 : options.tokens;
  EngineThresholds thresholds;
  thresholds.min_agreement = or_default(options.min_agreement, thresholds.min_agreement);
  thresholds.max_kl = or_default(options.max_kl, thresholds.max_kl);
  thresholds.max_kl_mean = or_default(options.max_kl_mean, thresholds.max_kl_mean);
  thresholds.max_logit_error = or_default(options.max_logit_error, thresholds.max_logit_error);
  const EngineVerification verification =
      verify_fused_engine(upload(model), prompt, positions, thresholds, executable_options(options), progress_line);

  if (options.format == "json") {
    nlohmann::json json;
    json["positions"] = positions;
    json["full"] = figures_json(verification.full);
    json["kept"] = figures_json(verification.kept);
    json["fused_rules"] = verification.fused_rules;
    json["declined"] = verification.declined;
    nlohmann::json trials = nlohmann::json::array();
    for (const DeclineTrial& trial : verification.trials) {
      nlohmann::json entry = figures_json(trial.figures);
      entry["rule"] = trial.rule;
      entry["regions"] = trial.regions;
      entry["meets"] = trial.meets;
      trials.push_back(entry);
    }
    json["trials"] = trials;
    json["passed"] = verification.passed;
    fmt::print("{}\n", json.dump());
    return verification.passed ? 0 : 1;
  }
  fmt::print("verify-model: {} positions, native engine (same step graph, no rewrite, no fusion: cuBLASLt and "
             "unfused kernels) vs fused engine (plan_with_discovery h200, measured dispatch), {} on {}\n",
             positions, options.dtype, opened_device()->info().name);
  std::string kinds;
  for (const std::string& rule : verification.fused_rules) kinds += (kinds.empty() ? "" : ", ") + rule;
  fmt::print("region kinds running fused: {}\n", kinds.empty() ? "none" : kinds);
  fmt::print("thresholds: every decided next token agrees (native's two best apart by >= {:g} of max |logit|), "
             "agreement >= {}, KL mean <= {:.3g}, KL max <= {:.3g}, logit error <= {:.3g} of max |logit|\n\n",
             AgreementFigures::kDecidedMargin, thresholds.min_agreement, thresholds.max_kl_mean, thresholds.max_kl, thresholds.max_logit_error);
  fmt::print("{:<28} {:>9} {:>10} {:>10} {:>12}\n", "fused plan", "agreement", "KL mean", "KL max", "logit error");
  const std::string full_miss = first_miss(verification.full, thresholds);
  fmt::print("{}\n", figures_row("as planned", verification.full, full_miss.empty() ? "meets" : "misses: " + full_miss));
  for (const DeclineTrial& trial : verification.trials) {
    fmt::print("{}\n", figures_row(fmt::format("{} declined ({} regions)", trial.rule, trial.regions), trial.figures,
                                   trial.meets ? "meets" : "misses: " + first_miss(trial.figures, thresholds)));
  }
  std::string declined;
  for (const std::string& rule : verification.declined) declined += (declined.empty() ? "" : ", ") + rule;
  if (!verification.declined.empty()) {
    const std::string kept_miss = first_miss(verification.kept, thresholds);
    fmt::print("{}\n", figures_row("kept: " + declined + " declined", verification.kept,
                                   kept_miss.empty() ? "meets" : "misses: " + kept_miss));
  }
  fmt::print("\ndeclined by model verification: {}\n", declined.empty() ? "nothing" : declined);
  fmt::print("the kept decode plan:\n{}", verification.report);
  fmt::print("{}\n", verification.passed ? "PASS" : "FAIL");
  return verification.passed ? 0 : 1;
}

void bench_model(const ModelOptions& options) {
  // Every argument is checked before the device is looked for (an unknown preset, --layers 5000,
  // --decode-steps 0 are one line naming the option on any machine) and before a preset is written.
  BenchmarkOptions bench;
  bench.context = options.context;
  bench.prefill_tokens = options.prefill_tokens;
  bench.decode_steps = options.decode_steps;
  bench.seed = parse_seed(options.seed);
  bench.validate();
  if (options.max_seq > 0) bench.check_capacity(options.max_seq, "--max-seq");
  SynthOptions synth;
  if (!options.preset.empty()) {
    synth.preset = options.preset;
    synth.layers = options.layers;
    synth.seed = parse_seed(options.seed);
    synth.quantize = quantization_option(options);  // an MLX checkpoint: quantized once, when written
    synth_config(synth);
  }
  LoadOptions arguments;  // what loading will check, checked before the device (the directory, --max-seq)
  arguments.max_sequence = options.max_seq;
  arguments.quantize = options.preset.empty() ? quantization_option(options) : std::nullopt;
  if (options.preset.empty()) {
    DecoderModel::check_load_arguments(options.model_dir, arguments);
  } else {
    DecoderModel::check_load_options(arguments);  // the preset's directory is made after the device is found
  }
  require_cuda_device("bench-model", "it measures the GPU engine; it has no CPU backend");
  const CudaDevice& device = *opened_device();
  std::optional<TemporaryDirectory> temporary;
  std::string model_dir = options.model_dir;
  std::string name = options.model_dir;
  LoadOptions load;
  load.dtype = DType::bf16;
  if (!options.preset.empty()) {
    temporary.emplace();
    model_dir = temporary->path().string();
    name = options.preset;
    progress_line(fmt::format("metile bench-model: synthesizing {} into {}", options.preset, model_dir));
    synthesize_model(model_dir, synth, [](const std::string& line) {
      static auto last = std::chrono::steady_clock::now();
      if (std::chrono::steady_clock::now() - last > std::chrono::seconds(5)) {
        last = std::chrono::steady_clock::now();
        progress_line(line);
      }
    });
  } else {
    load.quantize = quantization_option(options);
  }
  // The capacity the measurements need (decode after the context, the prefill prompt), rounded
  // up: the native attention reads every cached row, so a larger capacity only slows it.
  const std::int64_t needed = bench.cached_tokens_needed();
  load.max_sequence = options.max_seq != 0 ? options.max_seq : (needed + 255) / 256 * 256;  // a negative one is refused
  if (options.max_seq == 0) {
    load.max_sequence_needed = needed;  // a sliding window between the two caps the rounding
    load.max_sequence_source = fmt::format(
        "the capacity this run needs (the context, decode steps and prefill prompt: {} positions, rounded up to 256; "
        "--max-seq sets it)",
        needed);
  }
  progress_line(fmt::format("metile bench-model: loading {}", model_dir));
  const DecoderModel model = DecoderModel::load(model_dir, load);
  temporary.reset();  // the weights are in memory now
  const ModelConfig& config = model.config();

  CudaStream stream;
  const double bandwidth = measure_copy_bandwidth_gbps(stream);
  const std::shared_ptr<const CudaModel> cuda_model = CudaModel::load(model, device, progress_line);
  bench.copy_bandwidth_gbps = bandwidth;
  // Fused, the fused plan again with its GEMVs and attention launched as programmatic dependents (the same
  // kernels: the second build takes every decision from the cache), then native; --engines picks.
  struct Variant {
    EnginePath path;
    bool programmatic;
    const char* name;   // --engines
    const char* key;    // JSON
    const char* label;  // the table's column
  };
  const std::set<std::string> chosen = benchmarked_engines(options.engines);
  std::vector<Variant> variants;
  for (const Variant& variant : {Variant{EnginePath::fused, false, "fused", "fused", "fused"},
                                 Variant{EnginePath::fused, true, "fused-pdl", "fused_pdl", "fused + PDL"},
                                 Variant{EnginePath::native, false, "native", "native", "native"}}) {
    if (chosen.contains(variant.name)) variants.push_back(variant);
  }
  std::vector<EngineBenchmark> results;
  for (const Variant& variant : variants) {
    progress_line(fmt::format("metile bench-model: measuring the {} engine", variant.label));
    ExecutableOptions executable = executable_options(options);
    executable.programmatic_dependent_launch = variant.programmatic;
    const WeightPrefetch prefetch = options.weight_prefetch == "off"      ? WeightPrefetch::off
                                    : options.weight_prefetch == "always" ? WeightPrefetch::always
                                                                          : WeightPrefetch::raced;
    EngineOptions engine{variant.path, executable, progress_line, options.tournament_caches == "cold", true, prefetch};
    engine.race_near_ties = options.race_near_ties;
    engine.weight_prefetch_bytes = static_cast<std::uint64_t>(options.weight_prefetch_mb * 1024 * 1024);
    if (options.race_near_ties) engine.executable.near_tie_margin = options.near_tie_margin;
    CudaDecodeSession session(cuda_model, engine);
    results.push_back(benchmark_engine(session, bench));
  }
  const std::int64_t step_bytes = cuda_model->decode_step_bytes(options.context);
  const std::string format = model.quantization()
                                 ? fmt::format("{}-bit group {}", model.quantization()->bits,
                                               model.quantization()->group_size)
                                 : std::string("bf16");

  if (options.format == "json") {
    nlohmann::json json;
    json["model"] = name;
    json["architecture"] = std::string(architecture_class_name(config.architecture));
    json["layers"] = config.num_hidden_layers;
    json["format"] = format;
    json["device"] = device.info().name;
    json["context"] = options.context;
    json["capacity"] = model.capacity();
    json["weight_bytes"] = cuda_model->device_weight_bytes();
    json["decode_step_bytes"] = step_bytes;
    json["copy_bandwidth_gbps"] = bandwidth;
    for (std::size_t i = 0; i < variants.size(); ++i) json[variants[i].key] = benchmark_json(results[i]);
    fmt::print("{}\n", json.dump());
    return;
  }
  fmt::print("bench-model: {} ({}, {} layers, hidden {}, vocab {}), {}, batch 1, context {}, capacity {}, {}\n",
             name, architecture_class_name(config.architecture), config.num_hidden_layers, config.hidden_size,
             config.vocab_size, format, options.context, model.capacity(), device.info().name);
  fmt::print("weight-bandwidth floor: {:.3f} GB a step / {:.0f} GB/s copy bandwidth (measured now) = {:.3f} ms\n\n",
             static_cast<double>(step_bytes) / 1e9, bandwidth, results[0].floor_ms);
  std::string header = fmt::format("{:<40}", "");
  for (const Variant& variant : variants) header += fmt::format(" {:>12}", variant.label);
  fmt::print("{}\n", header);
  const auto row = [&](const std::string& label, auto value, const char* pattern) {
    std::string line = fmt::format("{:<40}", label);
    for (const EngineBenchmark& result : results) line += fmt::format(" {:>12}", fmt::format(fmt::runtime(pattern), value(result)));
    fmt::print("{}\n", line);
  };
  row("decode ms/token (graph replay)", [](const EngineBenchmark& r) { return r.decode_replay_ms; }, "{:.3f}");
  row("% of the weight-bandwidth floor", [](const EngineBenchmark& r) { return r.floor_percent; }, "{:.1f}%");
  row("decode ms/token (feed: copies + replay)", [](const EngineBenchmark& r) { return r.decode_feed_ms; }, "{:.3f}");
  row("decode ms/token (greedy, a sync a step)", [](const EngineBenchmark& r) { return r.decode_greedy_stepped_ms; },
      "{:.3f}");
  row("decode ms/token (greedy, queued)", [](const EngineBenchmark& r) { return r.decode_greedy_ms; }, "{:.3f}");
  row(fmt::format("decode ms/token (sampled top-k {}, row copied)", kBenchmarkTopK),
      [](const EngineBenchmark& r) { return r.decode_sampled_host_ms; }, "{:.3f}");
  row(fmt::format("decode ms/token (sampled top-k {}, on device)", kBenchmarkTopK),
      [](const EngineBenchmark& r) { return r.decode_sampled_ms; }, "{:.3f}");
  row("decode tokens/s (greedy)", [](const EngineBenchmark& r) { return r.tokens_per_second; }, "{:.1f}");
  row(fmt::format("prefill tokens/s ({}-token prompt)", options.prefill_tokens),
      [](const EngineBenchmark& r) { return r.prefill_tokens_per_second; }, "{:.0f}");
  row("device steps per decode step", [](const EngineBenchmark& r) { return r.launches; }, "{}");
  // What reading the same GEMV weights costs with nothing else done, raced against the replay:
  // one read-only kernel a step that streams weights (a region is one step: the SwiGLU MLP's two
  // GEMVs one kernel here), in the step's order, and one over all of them.
  const auto or_dash = [](double ms) { return std::isnan(ms) ? std::string("-") : fmt::format("{:.3f}", ms); };
  row("read floor: a read kernel a GEMV step, ms", [&](const EngineBenchmark& r) { return or_dash(r.read_floors.chain_ms); },
      "{}");
  row("read floor: one read kernel in all, ms",
      [&](const EngineBenchmark& r) { return or_dash(r.read_floors.one_kernel_ms); }, "{}");
  row("  (the replay in the same race, ms)", [&](const EngineBenchmark& r) { return or_dash(r.read_floors.replay_ms); },
      "{}");
  row("  (read kernels, weights MB)",
      [](const EngineBenchmark& r) {
        return fmt::format("{}, {:.0f}", r.read_floors.kernels, static_cast<double>(r.read_floors.bytes) / 1e6);
      },
      "{}");
  // The PDL variant runs the same kernels eagerly: its eager breakdown is the fused one's (its costs inside
  // its own replay, which overlaps launches, are in the JSON).
  for (std::size_t i = 0; i < variants.size(); ++i) {
    if (!variants[i].programmatic) print_breakdown(results[i]);
  }
}

}  // namespace metile::cli
