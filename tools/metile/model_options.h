// The options the model commands share (logits, generate, verify-model, bench-model) and the
// helpers both their CPU file (model_commands.cpp) and their CUDA file (model_cuda_commands.cpp,
// built only with the CUDA backend) use.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "metile/model.h"

namespace metile::cli {

struct ModelOptions {
  std::string model_dir;
  std::string prompt_ids = "1";
  std::string dtype = "bf16";
  std::string backend = "cpu";
  std::string format = "text";
  bool all_positions = false;  // logits --format json: every position's logits, not only the last
  std::string quantize;  // "", "4" or "8"
  int group_size = 64;
  std::int64_t max_seq = 0;
  std::int64_t tokens = 16;  // verify-model: -1 (unset) = the backend's default (16 on cpu, 64 on cuda)
  // generate: SamplingOptions (0: greedy); with --seed (below), which only a temperature above 0 uses
  double temperature = 0;
  std::int64_t top_k = 0;
  double top_p = 1;
  bool ignore_eos = false;  // generate: all --tokens, past the model's end-of-sequence tokens
  std::string decline;       // --backend cuda: comma-separated region kinds to run native
  std::string engines = "fused,fused-pdl,native";  // bench-model: which engines to measure
  std::string tournament_caches = "cold";           // bench-model: cold or warm (TournamentOptions::cold_cache_bytes)
  std::string weight_prefetch = "off";              // bench-model: off, raced or always (EngineOptions::weight_prefetch)
  double weight_prefetch_mb = 24;                   // bench-model: EngineOptions::weight_prefetch_bytes in MiB
  bool race_near_ties = true;                       // bench-model: EngineOptions::race_near_ties
  double near_tie_margin = 0.05;                    // bench-model: ExecutableOptions::near_tie_margin with it
  // verify-model thresholds; < 0: the backend's default
  double min_agreement = -1;
  double max_kl = -1;
  double max_kl_mean = -1;
  double max_logit_error = -1;
  // bench-model
  std::string preset;
  std::optional<std::int64_t> layers;  // --layers (bench-model --preset): the preset's when unset
  std::int64_t context = 128;
  std::int64_t prefill_tokens = 512;
  int decode_steps = 64;
  std::string seed = "0";  // synth-model, bench-model --preset: the weights'; generate: the draws'
};

std::vector<std::int32_t> parse_ids(const std::string& text);
// A verify-model threshold option: `value`, or `fallback` (the backend's default) where it is unset (< 0).
inline double or_default(double value, double fallback) { return value < 0 ? fallback : value; }
// --quantize / --group-size as a format (nullopt without --quantize); InputError when malformed.
std::optional<AffineQuantization> quantization_option(const ModelOptions& options);
// --backend cpu|cuda; InputError otherwise.
void check_backend(const ModelOptions& options);
// verify-model's figures of one comparison as JSON (both backends' --format json).
nlohmann::json figures_json(const AgreementFigures& figures);
// A number for --format json: JSON has no NaN or infinity (nlohmann wrote them as null, which reads as
// "absent"), so those are the strings "NaN", "Infinity" and "-Infinity", which Python's float() and
// numpy read back as the values.
nlohmann::json json_number(double value);
// --decline "a,b": the region kinds (fusion.h, region_kinds); InputError naming one that is not.
std::set<std::string> declined_rules(const std::string& text);
// --decline's help: `what`, then the region kinds it takes.
std::string decline_help(std::string_view what);
// bench-model --engines "a,b": fused, fused-pdl (its GEMVs and attention as programmatic dependents), native;
// InputError naming an unknown one.
std::set<std::string> benchmarked_engines(const std::string& text);

#ifdef METILE_HAVE_CUDA_BACKEND
// model_cuda_commands.cpp. Every entry opens the device first: InputError
// "--backend cuda: no CUDA device: ... (--backend cpu runs everywhere)" where none exists (exit 2, one
// line); a command with no CPU backend (bench-model) names itself and says so instead.
void require_cuda_device(std::string_view command = "--backend cuda",
                         std::string_view without_gpu = "--backend cpu runs everywhere");
std::unique_ptr<LogitsSession> open_cuda_session(const DecoderModel& model, const ModelOptions& options);
std::string cuda_device_name();
int verify_model_on_cuda(const DecoderModel& model, const ModelOptions& options);
void bench_model(const ModelOptions& options);
#endif

}  // namespace metile::cli
