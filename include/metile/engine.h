// metile engine: decoder models on the GPU (docs/architecture.md, "The GPU decode engine").
//
//   DecoderModel ──► CudaModel: every weight uploaded once into a device buffer, by graph input
//        │           name (repacking or uploading never happens per step)
//        ▼
//   CudaDecodeSession (fused | native): the layers' K/V caches on the device; one Executable per
//        step size it meets (decode S = 1, prefill chunks S = 16, a remainder in single steps),
//        built from the model's step graph and sharing the weights and the caches through
//        ExecutableOptions::external_values; each step is one CUDA graph replay between tiny
//        async copies (token ids and positions in; logits, or with feed_greedy only the next-token
//        ids, out: to pageable host memory, so each copy out returns once its step is done, a host
//        round trip a chunk; continue_greedy queues its steps without one). feed(tokens) -> logits is the CPU
//        DecodeSession's contract (LogitsSession, model.h), so generate_greedy and
//        compare_sessions work on both; the step graphs carry "next_tokens" (argmax of the logits)
//        so that greedy decoding copies 4 bytes per token, not a row of logits.
//
//   fused:  plan_with_discovery(step graph, h200): the planner's regions through their lowerings
//           and the measured dispatch (attention as one flash_attention region).
//   native: the same step graph with no rewrite and no fusion, every node native (cuBLASLt and
//           unfused kernels): what the fused engine is verified against.
//
//   verify_fused_engine: teacher-forced comparison of fused with native; when the fused plan
//       fails, every region kind (plan rule) is declined alone to find the ones that break it,
//       and the plan that is kept declines those.
//   benchmark_engine: decode and prefill speed, the weight-bandwidth floor, a per-kind breakdown.
//
// Without a GPU every entry point throws NoCudaDevice ("no CUDA device: ...").
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "metile/cuda_runtime.h"
#include "metile/dispatch.h"
#include "metile/model.h"

namespace metile {

// Lines for stderr during long work (uploads, plan builds); may be empty.
using EngineProgress = std::function<void(const std::string&)>;

// ---------------------------------------------------------------- the model on the device
class CudaModel {
 public:
  // Opens the device and uploads every weight of `model`. The model must outlive the CudaModel
  // (its step graphs are planned lazily by the sessions).
  static std::shared_ptr<const CudaModel> load(const DecoderModel& model, const CudaDevice& device,
                                               const EngineProgress& progress = {});
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const DecoderModel& model() const { return model_; }
  const CudaDevice& device() const { return device_; }
  // Graph input name -> device address of every weight.
  const std::map<std::string, std::uint64_t>& weight_addresses() const { return addresses_; }
  std::int64_t device_weight_bytes() const { return device_bytes_; }
  // The bytes a decode step must read at `context` cached tokens: every weight a step reads in
  // full (the embedding table only when it is also the LM head; else one row of it) plus the K and
  // V caches up to `context`. The numerator of the weight-bandwidth floor.
  std::int64_t decode_step_bytes(std::int64_t context) const;

 private:
  CudaModel(const DecoderModel& model, CudaDevice device) : model_(model), device_(std::move(device)) {}
  const DecoderModel& model_;
  CudaDevice device_;
  std::map<std::string, DeviceBuffer> buffers_;
  std::map<std::string, std::uint64_t> addresses_;
  std::int64_t device_bytes_ = 0;
};

// ---------------------------------------------------------------- one sequence on the device
enum class EnginePath : std::uint8_t { fused, native };
std::string_view engine_path_name(EnginePath path);  // "fused", "native"

enum class WeightPrefetch : std::uint8_t { off, raced, always };

struct EngineOptions {
  EnginePath path = EnginePath::fused;
  // Passed to every Executable the session builds (dispatch mode, decision cache, tournament,
  // extra lowerings, declined rules); the session adds the external values (weights, caches,
  // token ids, positions). The native path also forces DispatchMode::native.
  ExecutableOptions executable;
  EngineProgress progress;
  // true: the regions' tournaments run with cold caches (TournamentOptions::cold_cache_bytes = twice
  // the device's L2) unless the options above already set a size. A decode step reads each weight
  // once, from DRAM, and cold races look like it: warm ones let a region whose weights nearly fit the
  // L2 win with an L2 prefetch that loses inside the step (Llama-3-8B bf16's q/k/v: 18.5 us in a warm
  // race, 22.7 in the replay; with cold races the step took 4.313 ms/token against 4.578; 4-bit 1.763
  // against 1.786, Qwen2.5-1.5B 0.818 against 0.817; session 11, notes/gpu_check.md). Session 6 had
  // measured the opposite on Llama-3.2-1B (0.574 cold, 0.542 warm) before the races held the kernels
  // they hold now. `bench-model --tournament-caches warm` races back to back.
  bool cold_cache_tournaments = true;
  // The fused path races each step's replay with and without programmatic dependent launch
  // (Executable::race_programmatic_replay) and keeps the faster: measured, it lost on Llama-3.2-1B
  // (0.559 vs 0.534 ms/token) and won on Qwen2.5-1.5B (0.914 vs 0.983; session 6, call 4). The race
  // replays the step on token 0 at the cache's last rows, which no step reads before writing them.
  bool race_programmatic_launch = true;
  // Then the step's replay with part of its heavy GEMVs' weights prefetched into the L2 from a second
  // stream while the latency-bound steps before them run (Executable::race_weight_prefetch, at most
  // weight_prefetch_bytes a GEMV: plan_weight_prefetch): raced against the replay without and the
  // faster kept, always kept, or not tried. Off by default: the rule before it (every GEMV that fit
  // the budget, one GEMV ahead) lost every race (session 7, call 5: Llama-3.2-1B 0.577 vs 0.568 ms,
  // Qwen2.5-1.5B 0.959 vs 0.916, Llama-3-8B 4-bit 2.168 vs 2.133; notes/mlp_decode.md), and so did this
  // one (session 43, an H100: Llama-3-8B 4-bit 2.020 vs 1.985 ms, Qwen2.5-1.5B 4-bit 0.738 vs 0.671).
  WeightPrefetch weight_prefetch = WeightPrefetch::off;
  // After the launch race, for each region kind, the step with its regions running the fused candidate their race nearly
  // chose (within 5% of the winner's score: ExecutableOptions::near_tie_margin) raced against the step
  // as built (Executable::race_near_ties); kept when 1% faster. On by default since session 14: a region races
  // alone and cold, and near ties there are not near ties inside the step. Measured on the H200: Qwen2.5-1.5B
  // 4-bit's gate/up pairs took 19.6 and 19.7 us in their race and 18.6 and 13.9 us a layer inside the
  // replay; the cold race picked either between calls (0.861 or 0.729 ms/token; notes/mlp_decode.md).
  bool race_near_ties = true;
  // The L2 weight prefetch's budget (plan_weight_prefetch): a GEMV streaming more is heavy and gets
  // this many of its bytes requested during the steps before it that stream at most this many.
  std::uint64_t weight_prefetch_bytes = std::uint64_t{24} << 20;
};

// The plan a session's Executable of `graph` (a step graph) runs: fused, plan_with_discovery
// (attention rewritten to flash_attention, the planner's regions for the h200 target); native,
// the graph as it is with no rule (no region: every node its own native step).
FusionPlan engine_plan(const ComputeGraph& graph, EnginePath path);

class CudaDecodeSession : public LogitsSession {
 public:
  static constexpr std::int64_t kPrefillChunk = DecoderModel::kMaxStepTokens;  // 16

  // Allocates the K/V caches (zeroed: the native attention reads every row, masked or not).
  explicit CudaDecodeSession(std::shared_ptr<const CudaModel> model, EngineOptions options = {});
  ~CudaDecodeSession() override;
  CudaDecodeSession(const CudaDecodeSession&) = delete;
  CudaDecodeSession& operator=(const CudaDecodeSession&) = delete;

  // Chunks of 16 while at least 16 tokens remain, then single steps (never padding: a padded
  // token would write a cache row). Same contract as DecodeSession::feed.
  std::vector<float> feed(std::span<const std::int32_t> tokens) override;
  void check_feed(std::span<const std::int32_t> tokens) const override;
  // The same steps, copying back only each token's next-token id (the step graph's "next_tokens",
  // the argmax of its logits taken on the device): 4 bytes per token instead of a row of logits.
  std::vector<std::int32_t> feed_greedy(std::span<const std::int32_t> tokens) override;
  // LogitsSession's, on the device: the single-token step replayed `count` times, a GreedyStepLink
  // after each (the chosen token into the next step's input, the position one on, the token into host
  // memory), up to kStepsAhead steps queued before the host reads the oldest one's token. Steps queued
  // past a stop token still run; their cache rows lie past the position, where no step reads before
  // writing. So generation costs the replays and one link a token, not a host round trip each.
  std::vector<std::int32_t> continue_greedy(std::int32_t token, std::int64_t count,
                                            std::span<const std::int64_t> stop_tokens = {},
                                            const std::function<void(std::int32_t)>& on_token = {}) override;
  static constexpr std::int64_t kStepsAhead = 4;
  // LogitsSession's, with the top-k selection on the device (DeviceTopLogits) over the last step's
  // logits row: only the kept tokens and their logits come back. top_k 0 or above kMaxDeviceTopK, or
  // more tokens tied at the k-th than the selection holds: the row is copied back and selected on the
  // host (top_logits), the same tokens either way.
  std::vector<TokenLogit> feed_top_k(std::span<const std::int32_t> tokens, std::int64_t top_k) override;
  static constexpr std::int64_t kMaxDeviceTopK = 4096;
  std::int64_t position() const override { return position_; }
  std::int64_t capacity() const override { return model_->model().capacity(); }
  const std::string& capacity_source() const override { return model_->model().capacity_source(); }
  // Starts a new sequence on the same caches and Executables (rows past the position are masked).
  void reset() { position_ = 0; }

  // The Executable of a step size (1 or 16), built on first use.
  Executable& executable(std::int64_t steps);
  const CudaModel& model() const { return *model_; }
  const EngineOptions& options() const { return options_; }
  const CudaStream& stream() const { return stream_; }

  // Uploads a step's inputs (`tokens` at positions position() ...) without running it or moving
  // the position, and waits for the copies: then executable(tokens.size()) can be replayed or
  // profiled on stream() as that step (benchmark_engine).
  void stage_step(std::span<const std::int32_t> tokens);

 private:
  // Runs tokens as steps (chunks of 16, then single ones), calls `after_step` with each step's
  // Executable once it is enqueued (for copies of its outputs on stream_) and whether it is the last
  // step, synchronises once and moves the position. The tokens are checked before any step.
  void run_steps(std::span<const std::int32_t> tokens, const std::function<void(Executable&, bool last)>& after_step);
  // run_steps, copying the graph output `output` of each step back.
  std::vector<HostTensor> run_steps(std::span<const std::int32_t> tokens, std::string_view output);
  // The two async copies of a step's inputs (token ids, positions from `position`) on stream_.
  void upload_inputs(std::span<const std::int32_t> tokens, std::int64_t position);
  std::shared_ptr<const CudaModel> model_;
  EngineOptions options_;
  CudaStream stream_;
  std::map<std::string, DeviceBuffer> caches_;  // "layers.N.k_cache" -> [Hkv, T, D]
  DeviceBuffer token_ids_, positions_;          // [16] i32 each: the current step's
  std::vector<std::int32_t> staged_;            // host copies of both (ids, then positions)
  std::map<std::int64_t, std::unique_ptr<Executable>> executables_;
  std::unique_ptr<GreedyStepLink> greedy_link_;  // continue_greedy's, made on first use
  std::unique_ptr<DeviceTopLogits> top_logits_;  // feed_top_k's, made on first use (kMaxDeviceTopK + ties)
  std::int64_t position_ = 0;
};

// ---------------------------------------------------------------- verification
// What the fused engine must meet against the native one (verify-model --backend cuda defaults).
// Set above the bf16 noise of two correct paths and far below a wrong kernel, as measured on the
// H200 (notes/gpu_check.md, session 4): on the synthetic checkpoints, correct fused plans differ
// from native by a mean KL of 0.8-5e-4 over 64 positions, 63 or 64 equal next tokens (the odd one
// a near tie) and a logit error up to 0.02 — while native itself is 6e-5 from the float32
// reference and fused 4e-5; a wrong kernel moves the mean KL to ~2 and most next tokens.
struct EngineThresholds {
  // Every decided position (AgreementFigures::kDecidedMargin: the reference's two best tokens
  // apart by at least 5% of its largest logit) must agree; of all positions, near-ties included,
  // this fraction.
  double min_agreement = 0.9;    // fraction of equal next tokens
  double max_kl_mean = 1e-3;     // nats
  double max_kl = 1e-2;          // of any one position
  double max_logit_error = 0.05;  // max |error| / max |reference logit|
};
bool meets(const AgreementFigures& figures, const EngineThresholds& thresholds);
// The first threshold the figures miss, as a phrase ("KL mean 3.1e-04 > 1e-04"); empty when met.
std::string first_miss(const AgreementFigures& figures, const EngineThresholds& thresholds);

struct DeclineTrial {
  std::string rule;  // the region kind declined alone
  int regions = 0;   // regions of that kind whose chosen candidate was fused
  AgreementFigures figures;
  bool meets = false;
};

struct EngineVerification {
  AgreementFigures full;                 // the fused plan as planned, against native
  std::vector<std::string> fused_rules;  // kinds with at least one fused region (the decode step's plan)
  std::vector<DeclineTrial> trials;      // each of them declined alone (only when `full` misses)
  std::set<std::string> declined;        // what the kept plan declines
  AgreementFigures kept;                 // the kept plan against native (== full when nothing is declined)
  bool passed = false;                   // the kept plan meets the thresholds
  std::string report;                    // the kept decode plan's region report
};

// Fused against native on `model`, teacher-forced over `positions` positions after `prompt`.
// `base` carries the dispatch options of the fused path (its declined_rules are kept too).
EngineVerification verify_fused_engine(const std::shared_ptr<const CudaModel>& model,
                                       std::span<const std::int32_t> prompt, std::int64_t positions,
                                       const EngineThresholds& thresholds, const ExecutableOptions& base = {},
                                       const EngineProgress& progress = {});

// ---------------------------------------------------------------- benchmark
constexpr std::int64_t kBenchmarkTopK = 50;  // the sampled rows' top-k (transformers' default)
struct EngineBenchmark {
  std::string path;                 // "fused" / "native"
  std::int64_t context = 0;         // cached tokens before the timed decode steps
  double decode_replay_ms = 0;      // one decode step's CUDA graph replay (device time, events)
  double decode_feed_ms = 0;        // one feed() of one token: uploads, replay, logits download
  double decode_greedy_stepped_ms = 0;  // one feed_greedy() of one token: uploads, replay, one id back
  double decode_greedy_ms = 0;      // one token of continue_greedy (generate's steps, queued on the device)
  double tokens_per_second = 0;     // 1000 / decode_greedy_ms
  // One sampled token (temperature 1, top-k kBenchmarkTopK): the row copied back and selected on the
  // host (sample_token over feed()), and as generate samples (feed_top_k, the selection on the device).
  double decode_sampled_host_ms = 0;
  double decode_sampled_ms = 0;
  double floor_ms = 0;              // decode_step_bytes(context) / copy bandwidth
  double floor_percent = 0;         // floor_ms / decode_replay_ms
  double copy_bandwidth_gbps = 0;   // BenchmarkOptions::copy_bandwidth_gbps (0: not measured)
  std::int64_t prefill_tokens = 0;  // the prompt of the prefill measurement
  double prefill_tokens_per_second = 0;  // the prompt fed as generate feeds it (feed_greedy: ids copied back)
  std::vector<StepKindTime> breakdown;  // one decode step run eagerly, events between units
  int launches = 0;                 // device steps per decode step
  // The decode step's GEMV weights read by read-only kernels alone (Executable::read_floors): one a
  // step that streams weights, in the step's order, and one over all; raced against the replay.
  Executable::ReadFloors read_floors;
  // What the decode step's regions run: "rule: candidate" (RegionReport) -> how many regions.
  std::map<std::string, int> chosen;
  // Why: each region kind's first region's reason (RegionReport::reason: the race's figures).
  std::map<std::string, std::string> reasons;
};

// How near the copy rate one kind of a step streams its weights inside the replay: the time its
// weight_bytes take at `copy_bandwidth_gbps`, in percent of its replay_ms. NaN where the kind names
// no weights, its replay cost was not measured or is not positive (a kind whose work overlaps others
// can cost ~0), or no bandwidth was measured.
double weight_stream_percent(const StepKindTime& time, double copy_bandwidth_gbps);

struct BenchmarkOptions {
  std::int64_t context = 128;
  std::int64_t prefill_tokens = 512;
  int decode_steps = 64;
  std::uint64_t seed = 0;   // of the prompt tokens
  double copy_bandwidth_gbps = 0;  // measured by the caller in the same run

  // The KV-cache capacity the measurements fill: the context, the warm-up steps, the timed feed()
  // and feed_greedy() steps, or the prefill prompt, whichever is more.
  std::int64_t cached_tokens_needed() const;
  // InputError naming the option (--context, --prefill-tokens, --decode-steps) unless each count is at
  // least 1 and the positions they fill fit the step graphs' 32-bit positions (2^31). Needs no device:
  // bench-model calls it before it looks for one, benchmark_engine again.
  void validate() const;
  // InputError unless a KV cache of `capacity` positions holds cached_tokens_needed(); `source` says
  // where the capacity came from (DecoderModel::capacity_source). bench-model calls it on --max-seq
  // before it looks for a device (without one it loads the model with the capacity the run needs);
  // benchmark_engine again, on the loaded model's.
  void check_capacity(std::int64_t capacity, std::string_view source) const;
};

EngineBenchmark benchmark_engine(CudaDecodeSession& session, const BenchmarkOptions& options);

}  // namespace metile
