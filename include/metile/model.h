// metile model module: decoder-only language models as first-class inputs.
//
//   checkpoint dir ──► ModelConfig (config.json, transformers 4 and 5 spellings)
//        │              + weights (model.safetensors or shards, memory-mapped,
//        │                HF tensor names, dense or MLX-quantized)
//        ▼
//   DecoderModel ──► step_graph(S): the decode-step graph for S = 1..16 new tokens,
//        │           recorded with GraphBuilder as plain ops (attention included),
//        │           token ids, positions and the KV caches as runtime inputs
//        ▼
//   DecodeSession ──► feed(tokens): chunked prefill and decode on the CPU, on the
//                     reference executor or the planned (fused) one
//
// Also here: synthesize_model, a seeded random checkpoint in the Hugging Face
// layout (presets tiny .. llama3-8b), so everything runs without a download.
// Every malformed checkpoint is an InputError naming the file and the tensor or
// config field.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "metile/fusion.h"
#include "metile/graph.h"
#include "metile/quant.h"

namespace metile {

enum class ModelArchitecture : std::uint8_t { llama, qwen2, mistral };
std::string_view architecture_class_name(ModelArchitecture architecture);  // "LlamaForCausalLM", ...
ModelArchitecture parse_architecture_short_name(std::string_view name);    // "llama" | "qwen2" | "mistral"
std::string_view model_type_name(ModelArchitecture architecture);              // its inverse: config.json's model_type

// Rotary embedding parameters: rope_type "default" or "llama3" (Llama 3.1 scaling).
struct RopeParameters {
  double theta = 10000;
  bool llama3_scaling = false;
  double factor = 8;
  double low_freq_factor = 1;
  double high_freq_factor = 4;
  std::int64_t original_max_position_embeddings = 8192;
  bool operator==(const RopeParameters&) const = default;
};

// The largest size or count config.json may give (vocab_size, hidden_size, intermediate_size,
// num_hidden_layers, the head counts, head_dim): 2^24, so that any product of two fits an int64.
inline constexpr std::int64_t kLargestModelDimension = std::int64_t{1} << 24;

struct ModelConfig {
  ModelArchitecture architecture = ModelArchitecture::llama;
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;
  std::int64_t num_hidden_layers = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t num_key_value_heads = 0;
  std::int64_t head_dim = 0;  // explicit (Mistral) or hidden_size / num_attention_heads
  std::int64_t max_position_embeddings = 0;
  std::optional<std::int64_t> sliding_window;  // Mistral/Qwen2: the capacity is capped at it
  double rms_norm_eps = 1e-6;
  RopeParameters rope;
  bool tie_word_embeddings = false;
  DType dtype = DType::bf16;  // torch_dtype (4) or dtype (5)
  std::optional<AffineQuantization> quantization;  // MLX "quantization": {"group_size", "bits"}
  // The tokens that end a sequence: generation stops after producing one (generate's stop_tokens, as
  // transformers' generate stops). config.json's eos_token_id, one id or a list; absent or null: none
  // (transformers 5; 4 took Llama's and Mistral's absent one as 2). A generation_config.json, where
  // the checkpoint has one, takes its place (read_generation_config), as from_pretrained's does.
  std::vector<std::int64_t> eos_token_ids;

  bool qkv_bias() const { return architecture == ModelArchitecture::qwen2; }
  std::int64_t group_size() const { return num_attention_heads / num_key_value_heads; }  // GQA factor G

  // Reads config.json text; InputError "SOURCE: field 'F': ..." on anything malformed.
  static ModelConfig parse_json(std::string_view text, std::string_view source);
  // Takes generation_config.json's eos_token_id (none where it has no such key: transformers then reads
  // the file alone, not config.json). DecoderModel::load calls it where the checkpoint has that file.
  void read_generation_config(std::string_view text, std::string_view source);
  // transformers_version 4: rope_theta/rope_scaling/torch_dtype at the top level;
  // 5: rope_parameters {rope_type, rope_theta, ...} and dtype.
  std::string to_json(int transformers_version = 4) const;
  // For every config parse_json returns, parse_json(to_json(v)) == it for v = 4, 5 (fuzz_model_config).
  bool operator==(const ModelConfig&) const = default;
};

// What a step graph returns besides the written caches.
enum class StepOutputs : std::uint8_t {
  logits,                  // "logits" [S, V]
  logits_and_next_tokens,  // and "next_tokens" i32 [S]: each row's argmax (greedy decoding on the device)
};

// "metile: warning: LINE" on stderr, its control bytes spelled out (a tensor name may hold any byte).
void print_warning_line(const std::string& line);

struct LoadOptions {
  DType dtype = DType::bf16;                    // activations and dense weights: bf16 or f32
  std::optional<AffineQuantization> quantize;  // quantize dense linear weights and the embedding at load
  std::int64_t max_sequence = 0;               // KV-cache capacity; 0: min(4096, max_position_embeddings)
  // Who asked for max_sequence, as messages and DecoderModel::capacity_source() name it: the
  // command-line option by default, or what a tool that computed it says (bench-model).
  std::string max_sequence_source = "--max-seq";
  // How a user of the front end sets max_sequence, for the message that says where the default came from.
  std::string max_sequence_option = "--max-seq";
  // With max_sequence, the positions the caller needs where it rounded max_sequence up from them
  // (bench-model); 0: all of max_sequence is needed. A sliding window below max_sequence but at or
  // above this caps the capacity instead of refusing the load.
  std::int64_t max_sequence_needed = 0;
  // Said once a checkpoint has loaded but not wholly (tensors of layers past config.json's
  // num_hidden_layers, which transformers also leaves out, with a warning; weights config.json does not
  // call for), and of a generation_config.json passed over; empty: nothing is said.
  std::function<void(const std::string&)> warn = print_warning_line;
};

// Quantizing at load (LoadOptions::quantize, SynthOptions::quantize) keeps a matrix dense when its
// columns are not whole groups, as MLX's quantize does. The matrices of one width that it leaves
// dense, for the front ends to say so: a user who asked for 4 bits would otherwise measure a model
// that is partly bf16 without knowing. Empty when the group size divides every width.
struct MatricesLeftDense {
  std::string matrices;  // "q/k/v, gate/up, the embedding, the LM head"
  std::int64_t columns = 0;
};
std::vector<MatricesLeftDense> matrices_left_dense(const ModelConfig& config, const AffineQuantization& format);

// A loaded model: its config and weights in the runtime dtype, named as in the
// checkpoint (quantized ones as NAME.weight u32 / NAME.scales / NAME.biases).
class DecoderModel {
 public:
  static constexpr std::int64_t kMaxStepTokens = 16;

  // Throws InputError naming the file and tensor/field of a malformed checkpoint.
  static DecoderModel load(const std::filesystem::path& directory, const LoadOptions& options = {});
  // What load checks before it reads anything (the dtype, the quantization, the directory, an explicit
  // max_sequence's range): for a front end to check before it opens a GPU, so that a mistake in an
  // argument is said as itself, not as "no CUDA device". InputError naming what is wrong.
  static void check_load_arguments(const std::filesystem::path& directory, const LoadOptions& options);
  // The same without the directory (the options alone: a synthetic model's is made later).
  static void check_load_options(const LoadOptions& options);

  const ModelConfig& config() const { return config_; }
  DType dtype() const { return dtype_; }
  std::int64_t capacity() const { return capacity_; }
  // Where the capacity came from, as messages about it name it: "--max-seq" (LoadOptions::max_sequence),
  // "max_position_embeddings, at most 4096; --max-seq sets it" or "the checkpoint's sliding_window".
  const std::string& capacity_source() const { return capacity_source_; }
  bool is_quantized(std::string_view weight_prefix) const;  // "model.layers.0.mlp.up_proj"
  const TensorMap& weights() const { return weights_; }
  // The format of the quantized weights (MLX's from config.json, or LoadOptions::quantize).
  const std::optional<AffineQuantization>& quantization() const { return quantization_; }
  std::int64_t parameter_count() const;  // elements of the dense model it stands for
  std::int64_t weight_bytes() const;

  // The decode-step graph for `steps` (1..16) new tokens. Inputs: "token_ids"
  // i32 [S], "positions" i32 [S], "layers.N.k_cache"/"layers.N.v_cache"
  // [Hkv, T, D], and the weights; outputs: "logits" [S, V], with
  // StepOutputs::logits_and_next_tokens "next_tokens" i32 [S] (argmax of each row of the
  // logits), and the caches written ("layers.N.k_cache_out", ...). T is `cache_rows` (1 to the
  // capacity; 0: the capacity): attention reads the caches' T rows, so a session whose positions
  // stay below T gets the logits it would get over the whole capacity (the rows past a position are
  // masked) for a step whose attention costs T, not the capacity. Cached per S, outputs and T.
  const ComputeGraph& step_graph(std::int64_t steps, StepOutputs outputs = StepOutputs::logits,
                                 std::int64_t cache_rows = 0) const;

 private:
  ModelConfig config_;
  DType dtype_ = DType::bf16;
  std::int64_t capacity_ = 0;
  std::string capacity_source_ = "--max-seq";
  TensorMap weights_;
  std::optional<AffineQuantization> quantization_;
  // The step graphs built so far. Filled under a lock: the Python bindings release the GIL, so
  // several threads may ask one model for a graph at once. Copies and moves carry the graphs, not the lock.
  class StepGraphCache {
   public:
    StepGraphCache() = default;
    StepGraphCache(const StepGraphCache& other);
    StepGraphCache& operator=(const StepGraphCache& other);
    const ComputeGraph& get(std::int64_t steps, StepOutputs outputs, std::int64_t cache_rows,
                            const std::function<ComputeGraph()>& build) const;

   private:
    mutable std::mutex mutex_;
    mutable std::map<std::tuple<std::int64_t, StepOutputs, std::int64_t>, std::shared_ptr<const ComputeGraph>> graphs_;
  };
  StepGraphCache graphs_;
};

// A token and its logit (top_logits, LogitsSession::feed_top_k).
struct TokenLogit {
  std::int32_t token = 0;
  float logit = 0;
  bool operator==(const TokenLogit&) const = default;
};

// One sequence being decoded, on any backend: feed tokens, get their logits. The CPU
// DecodeSession below and the GPU engine's CudaDecodeSession (include/metile/engine.h)
// implement it, so generate_greedy and the model-level comparisons work on both.
class LogitsSession {
 public:
  virtual ~LogitsSession() = default;
  // Appends tokens and returns their logits, row-major [tokens.size(), vocab] in f32.
  // InputError when a token is outside the vocabulary or the cache is full (checked before any
  // step runs).
  virtual std::vector<float> feed(std::span<const std::int32_t> tokens) = 0;
  // What feed(tokens) asks before any step: InputError when it would refuse them. This default asks
  // what every session can tell, the capacity; the CPU and GPU sessions ask everything their feed does
  // (the ids, the memory the logits take).
  virtual void check_feed(std::span<const std::int32_t> tokens) const;
  // Appends tokens like feed() and returns each one's greedy next token: the argmax of its logits
  // (argmax_index's rule, graph.h). This default takes it from feed()'s logits on the host, feeding
  // kMaxStepTokens tokens at a time (a prompt's logits are never all held); the GPU engine computes
  // it on the device and copies back only the ids.
  virtual std::vector<std::int32_t> feed_greedy(std::span<const std::int32_t> tokens);
  // Appends tokens like feed() and returns what top_logits(last row, top_k) keeps of the last token's
  // logits: every token whose logit reaches the top_k-th largest (0: every token), in token order, the
  // candidates a sampled draw picks among (sample_among). InputError when that row holds a NaN. This
  // default feeds all but the last token through feed_greedy and takes the row from feed(); the GPU
  // engine selects the tokens on the device and copies back only them.
  virtual std::vector<TokenLogit> feed_top_k(std::span<const std::int32_t> tokens, std::int64_t top_k);
  // Greedy continuation: feeds `token`, then each token the step before chose, and returns the chosen
  // tokens, `count` of them or fewer when one of `stop_tokens` comes first (kept as the last). Only the
  // tokens whose choices are returned count as fed: position() moves by the returned count. InputError,
  // before any step, when `count` tokens from position() would pass the capacity. `on_token`
  // (if set) gets each token as it is known. This default feeds one feed_greedy step at a time; the GPU
  // engine queues the steps on the device, each step's token handed to the next there, and reads the
  // tokens back behind them (steps it ran past a stop token leave cache rows no later step reads).
  virtual std::vector<std::int32_t> continue_greedy(std::int32_t token, std::int64_t count,
                                                    std::span<const std::int64_t> stop_tokens = {},
                                                    const std::function<void(std::int32_t)>& on_token = {});
  virtual std::int64_t position() const = 0;  // tokens fed so far
  virtual std::int64_t capacity() const = 0;  // tokens the KV caches hold
  virtual const std::string& capacity_source() const = 0;  // DecoderModel::capacity_source
};

// Greedy decoding state for one sequence. The reference path runs each step
// graph with run_reference; the planned path plans it once per step size with
// plan_graph_fusion (cpu target) and runs it with run_plan_reference.
enum class DecodePath : std::uint8_t { reference, planned };

// Refuses (InputError) `sessions` CPU decode sessions of `model` at once when their caches and one
// step's attention scores each, with the model's weights, pass this machine's memory. A DecodeSession
// checks itself alone; verify-model, which holds two, checks both first.
void check_decode_sessions_fit(const DecoderModel& model, int sessions);

class DecodeSession : public LogitsSession {
 public:
  // The session reads the model's weights in place: the model must outlive it. InputError, before
  // anything is allocated, when its caches and one step's attention scores (16 tokens over the
  // whole cache) would pass this machine's memory.
  explicit DecodeSession(const DecoderModel& model, DecodePath path = DecodePath::reference);
  DecodeSession(DecoderModel&&, DecodePath = DecodePath::reference) = delete;
  // Appends tokens (chunks of at most 16 per step) and returns their logits,
  // row-major [tokens.size(), vocab] in f32 (widened exactly from the runtime dtype).
  // InputError when a token is outside the vocabulary, the cache is full, or the logits with the
  // weights and caches would pass this machine's memory (checked before any step runs). A step hands the caches to the executor, which writes them in place: should it
  // fail, the session has no caches left and every later feed is an InputError.
  std::vector<float> feed(std::span<const std::int32_t> tokens) override;
  void check_feed(std::span<const std::int32_t> tokens) const override;
  // LogitsSession's, with every token checked before the first step (they feed a step at a time).
  std::vector<std::int32_t> feed_greedy(std::span<const std::int32_t> tokens) override;
  std::vector<TokenLogit> feed_top_k(std::span<const std::int32_t> tokens, std::int64_t top_k) override;
  std::int64_t position() const override { return position_; }
  std::int64_t capacity() const override { return model_.capacity(); }
  const std::string& capacity_source() const override { return model_.capacity_source(); }

 private:
  // Grows the caches to hold at least `rows` rows (decoder.cpp says why they grow).
  void reserve_cache_rows(std::int64_t rows);

  const DecoderModel& model_;
  DecodePath path_;
  std::int64_t position_ = 0;
  std::int64_t cache_rows_ = 0;  // the rows the caches hold now (reserve_cache_rows: 128 doubled, at most the capacity)
  TensorMap state_;  // token ids, positions and caches by graph input name (the weights are the model's)
  std::map<std::pair<std::int64_t, std::int64_t>, std::shared_ptr<const FusionPlan>> plans_;  // by steps and cache rows
  bool caches_lost_ = false;  // an error inside a step took the caches with it (feed refuses from then on)
};

// How generate picks each next token. temperature 0: greedy (the argmax, through feed_greedy, which the
// GPU engine computes on the device). Above 0: a draw from softmax(logits / temperature) in float64,
// kept to the tokens whose logit reaches the top_k-th largest (0: all; every token tied with the k-th
// stays, as transformers' TopKLogitsWarper keeps them) and then to the shortest most-likely-first prefix
// (ties ranked by token id) holding top_p of their probability (1: all). Draws come from
// std::mt19937_64 seeded with `seed` (its sequence is fixed by the C++ standard), so a seed gives the
// same tokens on every machine for the same logits. top_p of a tiny value keeps the one most likely
// token: the greedy choice (argmax_index's rule), which top_k 1 is not where the maximum is tied.
struct SamplingOptions {
  double temperature = 0;
  std::int64_t top_k = 0;
  double top_p = 1;
  std::uint64_t seed = 0;
  bool greedy() const { return temperature == 0; }
  // InputError naming the field: temperature finite and >= 0, top_k >= 0, top_p in (0, 1], and at
  // temperature 0 (greedy) top_k, top_p and seed at their defaults (they would mean nothing).
  void validate() const;
};
// One draw of the next token from one position's logits (SamplingOptions above; not greedy). InputError
// when a logit is NaN or every logit is -inf (nothing to draw from). It is sample_among(top_logits(logits,
// options.top_k)): the draw reads only the tokens top-k keeps, which the GPU engine selects on the device.
std::int32_t sample_token(std::span<const float> logits, const SamplingOptions& options, std::mt19937_64& random);
// SamplingOptions' top-k rule, its one place on the host: every token whose logit reaches the top_k-th
// largest (0, or top_k at or above the row's length: every token), ties with it kept, in token order;
// -0 and +0 are equal. InputError when a logit is NaN. (Its device twin: DeviceTopLogits, cuda_runtime.h.)
std::vector<TokenLogit> top_logits(std::span<const float> logits, std::int64_t top_k);
// InputError "top_k K must be >= 0 (0: every token)" for a negative top_k (SamplingOptions::validate,
// top_logits and feed_top_k say it alike).
void check_top_k(std::int64_t top_k);
// The draw of sample_token among the tokens top-k kept (`kept` as top_logits returns them: in token
// order, not empty): the temperature, top-p and the draw from `random` (options.top_k is not applied
// again). InputError when a kept logit is NaN or every one is -inf.
std::int32_t sample_among(std::span<const TokenLogit> kept, const SamplingOptions& options, std::mt19937_64& random);

// Continuation: feeds the prompt, then `count` tokens picked by `sampling` (greedy by default), ending
// early after a token of `stop_tokens` (kept as the last token, as transformers' generate keeps its
// EOS; a model's are ModelConfig::eos_token_ids). `on_token` (if set) is called after each new token
// with its index. The whole `count` must fit the cache (checked before the prompt is fed).
struct Generation {
  std::vector<std::int32_t> tokens;
  bool stopped = false;           // the last token is a stop token (generation ended there)
  std::int64_t decode_steps = 0;  // one-token steps after the prompt (tokens - 1)
  double seconds = 0;             // their time
};
Generation generate(LogitsSession& session, std::span<const std::int32_t> prompt, std::int64_t count,
                    const SamplingOptions& sampling = {}, std::span<const std::int64_t> stop_tokens = {},
                    const std::function<void(std::int64_t)>& on_token = {});
inline Generation generate_greedy(LogitsSession& session, std::span<const std::int32_t> prompt, std::int64_t count,
                                  const std::function<void(std::int64_t)>& on_token = {}) {
  return generate(session, prompt, count, {}, {}, on_token);
}
// At least one token (InputError otherwise): generate's rule, which `metile generate` asks before it
// loads the model.
void check_generation_count(std::int64_t count);
// feed(tokens) a step at a time (kMaxStepTokens tokens: the steps feed takes, so the logits are
// feed's to the bit), calling `between` after each: for a caller that acts between steps (Python looks
// for Ctrl-C there). What feed asks (check_feed) is asked first, before any step.
std::vector<float> feed_a_step_at_a_time(LogitsSession& session, std::span<const std::int32_t> tokens,
                                         const std::function<void()>& between);
// For a caller that wants to act between the prompt's steps (Python looks for Ctrl-C there): asks what
// generate asks of `prompt` and `count` (InputError before any step), feeds all of the prompt but its
// last step (kMaxStepTokens tokens at a time through feed_greedy, the steps a feed of the whole takes, so
// the caches end the same to the bit), calling `between` after each, and returns the rest: generate
// with it continues as generate with the whole prompt would have.
std::span<const std::int32_t> feed_all_but_the_last_step(LogitsSession& session, std::span<const std::int32_t> prompt,
                                                         std::int64_t count, const std::function<void()>& between);

// InputError unless every token is in [0, vocab): "token id N is outside the vocabulary [0, V)".
void check_token_ids(std::span<const std::int32_t> tokens, const DecoderModel& model);
// A session fed a token sequence before it decodes: InputError unless the sequence stays within
// the model's capacity and every token is in [0, vocab) (both backends say it the same way).
void check_tokens_fit(std::span<const std::int32_t> tokens, std::int64_t position, const DecoderModel& model);
// A feed that returns every position's logits, on either backend: InputError when `positions` rows of
// the vocabulary's logits, `bytes_per_logit` bytes each (4 for f32, more where a copy is held beside
// them), would not fit beside `held_bytes` (the weights, the caches a backend keeps in host memory) in
// this machine's memory (std::bad_alloc was "internal error: out of memory", after all the work).
void check_logits_fit(std::int64_t positions, const DecoderModel& model, double bytes_per_logit, double held_bytes);
// Whether `token` is one of `stop_tokens` (generate and both sessions' continue_greedy end after one).
bool is_stop_token(std::span<const std::int64_t> stop_tokens, std::int32_t token);
// continue_greedy's check, on either backend, before any step: InputError when `count` is negative or
// `count` more tokens from the session's position would pass its capacity.
void check_continuation_fits(const LogitsSession& session, std::int64_t count);
// Calls `step` on consecutive pieces of `tokens`, in order, each of at most DecoderModel::kMaxStepTokens:
// how a prompt goes through the decode steps, so that no more than one step's logits are ever held.
void for_each_step_chunk(std::span<const std::int32_t> tokens,
                         const std::function<void(std::span<const std::int32_t>)>& step);

// ---------------------------------------------------------------- comparing two paths
// Two sessions fed the same tokens, compared position by position on their next-token
// distributions (verify-model on the CPU and on the GPU alike).
struct LogitsComparison {
  bool same_argmax = false;
  double kl = 0;             // KL(reference || candidate) of the softmaxed logits, nats
  double max_abs_error = 0;  // max |logit difference|
  double max_abs_logit = 0;  // max |reference logit|
  // The reference's largest logit minus its second largest, over max |reference logit|: how far
  // the reference's next token is from a tie (0 at a tie; 1 with one logit).
  double reference_margin = 0;
};
LogitsComparison compare_logits(std::span<const float> reference, std::span<const float> candidate);

struct AgreementFigures {
  // A position is decided when the reference's margin (LogitsComparison::reference_margin) is at
  // least this: two 16-bit paths whose logits each stay within 2% of the largest logit (the engine
  // measures 1.4-1.9%) cannot order its two best tokens differently, so every decided position must
  // agree; the others are near-ties that rounding alone may flip.
  static constexpr double kDecidedMargin = 0.05;
  std::int64_t positions = 0;
  std::int64_t agreements = 0;          // positions with the same argmax
  std::int64_t first_disagreement = -1;  // its index, -1 when none
  std::int64_t decided_positions = 0;    // positions whose reference margin is at least kDecidedMargin
  std::int64_t decided_agreements = 0;   // those with the same argmax
  std::int64_t first_decided_disagreement = -1;
  double kl_mean = 0, kl_max = 0;
  double max_logit_error = 0;  // max over positions of max |error| / max |reference logit|
  // Positions whose reference logits hold a NaN or an infinity: the reference path itself fails there
  // (the weights or the prompt, not the path compared), so no figure above can pass or blame the candidate.
  std::int64_t nonfinite_reference_positions = 0;
  double reference_seconds = 0, candidate_seconds = 0;  // time in feed() of the decode steps

  double agreement() const { return positions > 0 ? static_cast<double>(agreements) / static_cast<double>(positions) : 0; }
};

// Teacher-forced comparison: both sessions take `prompt`, then `positions` - 1 more tokens,
// each the reference's argmax of the position before (so a disagreement never derails the
// rest). Every position (the prompt's last, then each decoded one) is compared.
AgreementFigures compare_sessions(LogitsSession& reference, LogitsSession& candidate,
                                  std::span<const std::int32_t> prompt, std::int64_t positions);

// ---------------------------------------------------------------- synthetic checkpoints
struct SynthOptions {
  std::string preset = "tiny";  // tiny | small | llama3.2-1b | qwen2.5-1.5b | llama3-8b
  std::optional<ModelArchitecture> architecture;
  std::optional<std::int64_t> layers;
  std::optional<bool> tie_word_embeddings;
  std::uint64_t seed = 0;
  std::optional<AffineQuantization> quantize;  // write an MLX-format checkpoint
  std::int64_t transformers_version = 4;      // config spelling (4 or 5; wide, so a caller's value is said as given)
  double max_shard_mb = 2000;                 // split into model-0000N-of-0000M.safetensors beyond this
};
ModelConfig synth_config(const SynthOptions& options);
// Writes config.json and the weights (bf16, seeded per tensor name so that every
// variant of one seed holds the same numbers) into `directory`, which must not
// exist or be empty; files are written to a temporary folder (beside a new directory, inside
// an empty one that exists, so that every rename stays on one file system) and renamed into
// place, so an error leaves nothing. `progress` (if set) gets lines for stderr; `cancelled` (if
// set) is asked before each tensor, and when it answers true the temporary is removed and
// InputError "synth-model: interrupted; nothing was written" is thrown (the CLI's Ctrl-C).
void synthesize_model(const std::filesystem::path& directory, const SynthOptions& options,
                      const std::function<void(const std::string&)>& progress = {},
                      const std::function<bool()>& cancelled = {});
// The draw behind every synthetic tensor: element i of `tensor` (bf16, any shape) is
// bf16(offset + uniform(low, high)) of draw i + 1 of SplitMix64(stream_seed), counting from 0
// (draw 0 is discarded). Contiguous ranges of elements are drawn at once, each jumping its
// stream ahead (SplitMix64::skip): `ranges` 0 picks one per hardware thread and at most one per
// 2^20 elements, 1 is the sequential loop; the bytes are the same for every value.
void draw_uniform_bf16(HostTensor& tensor, std::uint64_t stream_seed, float low, float high, float offset,
                       std::int64_t ranges = 0);

}  // namespace metile
