// The GPU decode engine: a DecoderModel's weights on the device once (CudaModel), and one
// sequence decoded on them (CudaDecodeSession), each step one CUDA graph replay.
//
// Memory. The weights, the K/V caches and the step's token ids and positions are buffers this
// file owns; every Executable of a session (one per step size) borrows them by graph value name
// (ExecutableOptions::external_values), so decode (S = 1) and prefill (S = 16) read one copy of
// the weights and write one cache. kv_cache_write's output aliases its cache input inside the
// Executable (the step graph is SSA, the runtime writes the S new rows in place), so after a
// step "layers.N.k_cache" holds the updated cache: the next step, of either size, reads it.
//
// One step: two async copies of at most 64 bytes (token ids, positions), the replay, and an async
// copy out of the logits (feed) or of the S next-token ids, 4 bytes each (feed_greedy: the step
// graph's "next_tokens", the argmax taken on the device), all on the session's stream. The copies
// out go to pageable host memory, where the driver returns only once a copy has completed: each
// chunk's copy waits for its step (a host round trip a chunk; a 512-token prompt makes 32). A prompt runs as chunks of 16 and a remainder of single steps, never padded (a padding
// token would write its K/V row at a real position). Greedy generation (continue_greedy) queues single
// steps on the device, each followed by a one-thread link that hands its chosen token to the next step.
#include <algorithm>
#include <cstring>
#include <sstream>

#include <fmt/format.h>

#include "metile/discovery.h"
#include "metile/engine.h"

namespace metile {
namespace {

std::string cache_name(std::int64_t layer, char which) { return fmt::format("layers.{}.{}_cache", layer, which); }

bool is_embedding_table(std::string_view name) { return name.starts_with("model.embed_tokens."); }

void report(const EngineProgress& progress, const std::string& line) {
  if (progress) progress(line);
}

// The device address of a graph value in an Executable's memory (checks the external values
// and the in-place caches were honoured: the engine's correctness rests on both).
std::uint64_t value_address(Executable& executable, std::string_view name) {
  const std::optional<ValueId> id = executable.values().graph().find_value(name);
  if (!id) throw std::logic_error(fmt::format("the step graph has no value '{}'", name));
  return executable.values()[*id].address();
}

// A step's logits as feed() returns them: widened exactly to f32.
void append_widened(const HostTensor& tensor, std::vector<float>& logits) {
  const std::span<const std::byte> bytes = tensor.bytes();
  if (tensor.spec().dtype == DType::bf16) {
    for (std::size_t index = 0; index < bytes.size(); index += 2) {
      std::uint16_t bits = 0;
      std::memcpy(&bits, bytes.data() + index, 2);
      logits.push_back(bf16_bits_to_f32(bits));
    }
  } else {
    for (std::int64_t index = 0; index < tensor.element_count(); ++index) {
      logits.push_back(static_cast<float>(tensor.at(index)));  // exact widening of f32 / f16
    }
  }
}

}  // namespace

// ---------------------------------------------------------------- CudaModel
std::shared_ptr<const CudaModel> CudaModel::load(const DecoderModel& model, const CudaDevice& device,
                                                 const EngineProgress& progress) {
  device.make_current();
  std::shared_ptr<CudaModel> result(new CudaModel(model, device));
  const std::int64_t total = model.weight_bytes();
  std::int64_t uploaded = 0;
  std::int64_t next_report = 0;
  for (const auto& [name, tensor] : model.weights()) {
    DeviceBuffer buffer = DeviceBuffer::from_tensor(tensor);
    result->addresses_.emplace(name, buffer.address());
    result->buffers_.emplace(name, std::move(buffer));
    uploaded += static_cast<std::int64_t>(tensor.bytes().size());
    if (uploaded >= next_report) {
      report(progress, fmt::format("metile: uploading weights to {}: {:.2f} of {:.2f} GB", device.info().name,
                                   static_cast<double>(uploaded) / 1e9, static_cast<double>(total) / 1e9));
      next_report = uploaded + std::max<std::int64_t>(total / 10, 1);
    }
  }
  result->device_bytes_ = uploaded;
  return result;
}

namespace {
// The members a destructor frees (device memory, graphs, streams) are freed in the device's context,
// made current first. Where it cannot be (the driver torn down before a static's destructor ran at
// exit), make_current's CudaError must not leave a destructor: that ended the process in std::terminate.
void make_current_for_teardown(const CudaDevice& device) noexcept {
  try {
    device.make_current();
  } catch (const std::exception&) {
  }
}
}  // namespace

CudaModel::~CudaModel() { make_current_for_teardown(device_); }

std::int64_t CudaModel::decode_step_bytes(std::int64_t context) const {
  const ModelConfig& config = model_.config();
  std::int64_t bytes = 0;
  for (const auto& [name, tensor] : model_.weights()) {
    const auto size = static_cast<std::int64_t>(tensor.bytes().size());
    // An untied embedding table is only gathered from: one row per token.
    bytes += is_embedding_table(name) && !config.tie_word_embeddings ? size / config.vocab_size : size;
  }
  const auto cache_row = static_cast<std::int64_t>(config.num_key_value_heads * config.head_dim *
                                                   static_cast<std::int64_t>(dtype_size(model_.dtype())));
  return bytes + 2 * config.num_hidden_layers * context * cache_row;
}

// ---------------------------------------------------------------- CudaDecodeSession
std::string_view engine_path_name(EnginePath path) { return path == EnginePath::fused ? "fused" : "native"; }

FusionPlan engine_plan(const ComputeGraph& graph, EnginePath path) {
  // fused: discovery (attention -> flash_attention) and the planner's regions; native: the same
  // graph, no rewrite and no rule, so every node is its own native step. plan_with_discovery drops
  // nodes no output depends on, which the native plan runs: a step graph must have none, or the two
  // engines would run different nodes (a dead cache write would update the cache in one only).
  const std::vector<bool> live = nodes_outputs_depend_on(graph);
  if (const auto dead = std::find(live.begin(), live.end(), false); dead != live.end()) {
    throw std::logic_error(fmt::format("engine_plan: node '{}' of the step graph feeds no output",
                                       graph.node(static_cast<NodeId>(dead - live.begin())).name));
  }
  return path == EnginePath::fused ? plan_with_discovery(graph, FusionTarget::h200())
                                   : plan_graph_fusion(graph, FusionTarget::h200(), RuleSet{});
}

CudaDecodeSession::CudaDecodeSession(std::shared_ptr<const CudaModel> model, EngineOptions options)
    : model_(std::move(model)),
      options_(std::move(options)),
      stream_([&] {
        model_->device().make_current();  // the stream and every buffer below belong to the model's device
        return CudaStream();
      }()) {
  const DecoderModel& decoder = model_->model();
  const ModelConfig& config = decoder.config();
  const TensorSpec cache_spec({config.num_key_value_heads, decoder.capacity(), config.head_dim}, decoder.dtype());
  for (std::int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    for (char which : {'k', 'v'}) {
      DeviceBuffer cache(static_cast<std::size_t>(cache_spec.bytes()));
      cache.fill_bytes(0);
      caches_.emplace(cache_name(layer, which), std::move(cache));
    }
  }
  token_ids_ = DeviceBuffer(kPrefillChunk * sizeof(std::int32_t));
  positions_ = DeviceBuffer(kPrefillChunk * sizeof(std::int32_t));
}

CudaDecodeSession::~CudaDecodeSession() { make_current_for_teardown(model_->device()); }

Executable& CudaDecodeSession::executable(std::int64_t steps) {
  if (steps < 1 || steps > capacity()) {  // its races run it at the cache's last `steps` rows
    throw std::logic_error(fmt::format("a step of {} tokens in a session of capacity {}", steps, capacity()));
  }
  auto& slot = executables_[steps];
  if (slot) return *slot;
  const DecoderModel& decoder = model_->model();
  // With next_tokens: the greedy path copies back only the ids, feed() the logits, one Executable.
  const ComputeGraph& graph = decoder.step_graph(steps, StepOutputs::logits_and_next_tokens);
  const std::string what = fmt::format("{} step of {} token{}", engine_path_name(options_.path), steps,
                                       steps == 1 ? "" : "s");
  report(options_.progress, fmt::format("metile: planning the {}", what));
  const FusionPlan plan = engine_plan(graph, options_.path);
  ExecutableOptions options = options_.executable;
  if (options_.path == EnginePath::native) options.mode = DispatchMode::native;
  if (options_.path == EnginePath::fused && options_.race_near_ties && options.near_tie_margin == 0) {
    options.near_tie_margin = 0.05;
  }
  if (options_.cold_cache_tournaments && options.tournament.cold_cache_bytes == 0) {
    options.tournament.cold_cache_bytes = 2 * static_cast<std::size_t>(model_->device().info().l2_cache_bytes);
  }
  for (const auto& [name, address] : model_->weight_addresses()) {
    if (plan.graph->find_value(name)) options.external_values[name] = address;  // a checkpoint may hold unused tensors
  }
  for (const auto& [name, buffer] : caches_) options.external_values[name] = buffer.address();
  options.external_values["token_ids"] = token_ids_.address();
  options.external_values["positions"] = positions_.address();
  report(options_.progress, fmt::format("metile: building the {} ({} regions, {} nodes unfused; gating and "
                                        "measuring each region)", what, plan.regions.size(), plan.unfused.size()));
  model_->device().make_current();
  auto built = std::make_unique<Executable>(Executable::build(plan, model_->device(), options));
  for (const auto& [name, address] : options.external_values) {
    if (!built->values().graph().find_value(name)) continue;
    if (value_address(*built, name) != address) {
      throw std::logic_error(fmt::format("the Executable of the {} did not use the engine's buffer for '{}' "
                                         "(ExecutableOptions::external_values)", what, name));
    }
  }
  for (const auto& [name, buffer] : caches_) {
    if (value_address(*built, name + "_out") != buffer.address()) {
      throw std::logic_error(fmt::format("the Executable of the {} writes '{}_out' outside its cache input: the "
                                         "engine needs kv_cache_write in place", what, name));
    }
  }
  // The replay races run the step on token 0 at the cache's last rows, which no step reads before
  // writing them: staged once for both.
  const bool race_launches = options_.race_programmatic_launch && !options.programmatic_dependent_launch;
  if (options_.path == EnginePath::fused &&
      (race_launches || options_.race_near_ties || options_.weight_prefetch != WeightPrefetch::off)) {
    const std::vector<std::int32_t> first_token(static_cast<std::size_t>(steps), 0);
    upload_inputs(first_token, decoder.capacity() - steps);
    stream_.synchronize();
  }
  if (options_.path == EnginePath::fused && race_launches) {
    const bool dependent = built->race_programmatic_replay(options.tournament);
    report(options_.progress, fmt::format("metile: the {} launches its GEMVs and attention {}", what,
                                          dependent ? "as programmatic dependents (faster)" : "plainly (faster)"));
  }
  if (options_.path == EnginePath::fused && options_.race_near_ties) {
    const int changed = built->race_near_ties(options.tournament);
    // Each kind's race (the replay with and without its twins or near ties), then the count.
    std::istringstream verdicts(built->near_tie_verdicts());
    for (std::string line; std::getline(verdicts, line);) report(options_.progress, fmt::format("metile: the {}: {}", what, line));
    report(options_.progress, fmt::format("metile: the {}: prefetch twins and near ties raced in the step, {} kind{} "
                                          "changed kernels", what, changed, changed == 1 ? "" : "s"));
  }
  if (options_.path == EnginePath::fused && options_.weight_prefetch != WeightPrefetch::off) {
    built->race_weight_prefetch(options.tournament, options_.weight_prefetch_bytes,
                                options_.weight_prefetch == WeightPrefetch::always);
    const std::string text = built->report();
    const std::size_t line = text.find("L2 weight prefetch");
    report(options_.progress, fmt::format("metile: the {}: {}", what,
                                          line == std::string::npos ? "the L2 prefetch's rule chose no GEMV"
                                                                    : text.substr(line, text.find('\n', line) - line)));
  }
  report(options_.progress, fmt::format("metile: {} ready, {} device steps per replay", what, built->step_count()));
  slot = std::move(built);
  return *slot;
}

void CudaDecodeSession::upload_inputs(std::span<const std::int32_t> tokens, std::int64_t position) {
  const std::size_t steps = tokens.size();
  staged_.assign(tokens.begin(), tokens.end());
  for (std::size_t index = 0; index < steps; ++index) staged_.push_back(static_cast<std::int32_t>(position + index));
  const auto bytes = std::as_bytes(std::span<const std::int32_t>(staged_));
  // Pageable host memory: the driver stages both copies before returning, so staged_ may change.
  token_ids_.copy_from_host_async(bytes.first(steps * sizeof(std::int32_t)), stream_);
  positions_.copy_from_host_async(bytes.subspan(steps * sizeof(std::int32_t)), stream_);
}

void CudaDecodeSession::stage_step(std::span<const std::int32_t> tokens) {
  const DecoderModel& decoder = model_->model();
  check_tokens_fit(tokens, position_, decoder);
  model_->device().make_current();
  executable(static_cast<std::int64_t>(tokens.size()));  // built before its inputs are staged
  upload_inputs(tokens, position_);
  stream_.synchronize();
}

void CudaDecodeSession::run_steps(std::span<const std::int32_t> tokens,
                                  const std::function<void(Executable&, bool last)>& after_step) {
  const DecoderModel& decoder = model_->model();
  check_tokens_fit(tokens, position_, decoder);
  model_->device().make_current();
  std::size_t first = 0;
  while (first < tokens.size()) {
    const std::size_t steps =
        tokens.size() - first >= static_cast<std::size_t>(kPrefillChunk) ? static_cast<std::size_t>(kPrefillChunk) : 1;
    Executable& step = executable(static_cast<std::int64_t>(steps));
    upload_inputs(tokens.subspan(first, steps), position_ + static_cast<std::int64_t>(first));
    step.enqueue(stream_);
    first += steps;
    after_step(step, first == tokens.size());
  }
  stream_.synchronize();
  position_ += static_cast<std::int64_t>(tokens.size());
}

std::vector<HostTensor> CudaDecodeSession::run_steps(std::span<const std::int32_t> tokens, std::string_view output) {
  std::vector<HostTensor> step_outputs;  // one per step, filled by async copies (never reallocated)
  step_outputs.reserve(tokens.size());
  run_steps(tokens, [&](Executable& step, bool) {
    const DeviceTensor& device_output = step.values()[*step.values().graph().find_value(output)];
    step_outputs.emplace_back(device_output.spec);
    device_output.buffer.copy_to_host_async(step_outputs.back().bytes(), stream_);
  });
  return step_outputs;
}

std::vector<TokenLogit> CudaDecodeSession::feed_top_k(std::span<const std::int32_t> tokens, std::int64_t top_k) {
  check_tokens_fit(tokens, position_, model_->model());  // every id, the last too, before any step
  const std::int64_t vocab = model_->model().config().vocab_size;
  // No token, a negative top-k (both refused there), every token kept or a large k: the host's selection.
  if (tokens.empty() || top_k <= 0 || top_k >= vocab || top_k > kMaxDeviceTopK) return LogitsSession::feed_top_k(tokens, top_k);
  model_->device().make_current();
  // Room for k and as many tokens tied with the k-th again; past that the row comes back whole.
  if (!top_logits_) top_logits_ = std::make_unique<DeviceTopLogits>(static_cast<std::size_t>(2 * kMaxDeviceTopK));
  std::uint64_t row = 0;
  DType dtype = DType::f32;
  run_steps(tokens, [&](Executable& step, bool last) {
    if (!last) return;  // only the last token's row is selected from
    const DeviceTensor& logits = step.values()[*step.values().graph().find_value("logits")];
    const std::int64_t rows = logits.spec.element_count() / vocab;
    dtype = logits.spec.dtype;
    row = logits.buffer.address() + static_cast<std::uint64_t>((rows - 1) * vocab) * dtype_size(dtype);
    top_logits_->enqueue(stream_, row, dtype, vocab, top_k);
  });
  const DeviceTopLogits::Result selected = top_logits_->result();
  if (selected.nan || static_cast<std::size_t>(selected.count) > top_logits_->capacity()) {
    // The row as feed() returns it, selected on the host (which also says what a NaN means).
    HostTensor row_logits(TensorSpec({vocab}, dtype));
    DeviceBuffer::borrow(row, row_logits.bytes().size()).copy_to_host(row_logits.bytes());
    std::vector<float> widened;
    append_widened(row_logits, widened);
    return top_logits(widened, top_k);
  }
  std::vector<TokenLogit> kept;
  kept.reserve(selected.tokens.size());
  for (std::size_t index = 0; index < selected.tokens.size(); ++index) kept.push_back({selected.tokens[index], selected.logits[index]});
  return kept;
}

std::vector<std::int32_t> CudaDecodeSession::feed_greedy(std::span<const std::int32_t> tokens) {
  std::vector<std::int32_t> next;
  for (const HostTensor& ids : run_steps(tokens, "next_tokens")) {
    const std::span<const std::byte> bytes = ids.bytes();
    const std::size_t first = next.size();
    next.resize(first + bytes.size() / sizeof(std::int32_t));
    std::memcpy(next.data() + first, bytes.data(), bytes.size());
  }
  return next;
}

std::vector<std::int32_t> CudaDecodeSession::continue_greedy(std::int32_t token, std::int64_t count,
                                                             std::span<const std::int64_t> stop_tokens,
                                                             const std::function<void(std::int32_t)>& on_token) {
  check_continuation_fits(*this, count);  // `token` and the count - 1 chosen after it are fed
  if (count == 0) return {};
  check_token_ids(std::span<const std::int32_t>(&token, 1), model_->model());
  model_->device().make_current();
  Executable& step = executable(1);  // built (and raced) before its inputs are staged
  if (!greedy_link_) greedy_link_ = std::make_unique<GreedyStepLink>(static_cast<std::size_t>(kStepsAhead));
  const std::uint64_t next_token = value_address(step, "next_tokens");
  upload_inputs(std::span<const std::int32_t>(&token, 1), position_);
  std::vector<CudaEvent> linked(static_cast<std::size_t>(kStepsAhead));  // recorded after each slot's link
  std::vector<std::int32_t> chosen;
  std::int64_t queued = 0;
  // Whatever ends the loop (a stop token, the count, an error or a callback's exception), the position
  // moves by the tokens chosen (those are the ones fed, and the callback has seen them) and the queued
  // steps finish; the position first, so that it holds also when the synchronisation throws.
  const auto finish = [&] {
    position_ += static_cast<std::int64_t>(chosen.size());
    stream_.synchronize();
  };
  try {
    while (static_cast<std::int64_t>(chosen.size()) < count) {
      for (; queued < count && queued - static_cast<std::int64_t>(chosen.size()) < kStepsAhead; ++queued) {
        step.enqueue(stream_);
        greedy_link_->enqueue(stream_, next_token, token_ids_.address(), positions_.address(), static_cast<std::size_t>(queued));
        linked[static_cast<std::size_t>(queued % kStepsAhead)].record(stream_);
      }
      const std::size_t slot = chosen.size() % static_cast<std::size_t>(kStepsAhead);
      linked[slot].synchronize();
      const std::int32_t next = greedy_link_->chosen(slot);
      chosen.push_back(next);
      if (on_token) on_token(next);
      if (is_stop_token(stop_tokens, next)) break;
    }
  } catch (...) {
    try {
      finish();
    } catch (const CudaError&) {
      // the first error is the one to report
    }
    throw;
  }
  finish();
  return chosen;
}

void CudaDecodeSession::check_feed(std::span<const std::int32_t> tokens) const {
  const DecoderModel& model = model_->model();
  check_tokens_fit(tokens, position_, model);  // as the CPU feed: the capacity and the ids before the memory
  // Each step's logits in the model's dtype, then all of them widened to f32, beside the host's weights.
  check_logits_fit(static_cast<std::int64_t>(tokens.size()), model, 4.0 + static_cast<double>(dtype_size(model.dtype())),
                   static_cast<double>(model.weight_bytes()));
}

std::vector<float> CudaDecodeSession::feed(std::span<const std::int32_t> tokens) {
  check_feed(tokens);
  const DecoderModel& model = model_->model();
  const std::int64_t vocab = model.config().vocab_size;
  const std::vector<HostTensor> step_logits = run_steps(tokens, "logits");
  std::vector<float> logits;
  logits.reserve(tokens.size() * static_cast<std::size_t>(vocab));
  for (const HostTensor& tensor : step_logits) append_widened(tensor, logits);
  return logits;
}

}  // namespace metile
