// DecodeSession: runs a model's step graphs over a growing sequence on the CPU.
//
// A prompt is fed in chunks of at most 16 tokens (one step graph per chunk size,
// built once and cached by the model), then decoding feeds one token per step.
// Each step's inputs are two maps: the model's weights, borrowed and never copied,
// and this session's state (token ids, positions, the KV caches).
//
// The KV cache and SSA. In the graph, kv_cache_write returns a new cache value
// ("layers.N.k_cache_out") and leaves its input untouched, which keeps the graph
// a plain dataflow graph for the planner. At run time the input cache is dead
// once it has been written (nothing else reads it): feed() hands the step's state
// (ids, positions, caches) over to the executor, which writes each cache's new
// rows in place and returns it as the output (src/runtime/cpu/reference_executor.cpp),
// and feed() moves the outputs back into state_. One buffer per cache exists at any
// time and no step copies one. The results are the same as with a copy because no
// other node reads the input cache.
//
// The caches grow. A step graph attends over every row its caches hold, and a row past a query's
// position is masked (-inf before the softmax: a probability of exactly 0, whose products the
// index-order f64 sums of the softmax and the matmul add as +0), so the logits over the rows a
// sequence has reached are the logits over the whole capacity, to the bit. The session's caches
// hold the rows its positions have reached, rounded up to a power of two (kFirstCacheRows at
// least, the capacity at most), and double, copying their rows once, when a chunk needs more: a
// step's attention costs the sequence's length, not the capacity (over the default 4096 positions
// it cost every step as much as a 4096-token sequence's).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>

#include "metile/cpu_runtime.h"
#include "metile/io.h"
#include "metile/model.h"
#include "model_internal.h"

namespace metile {
namespace {

std::string cache_name(std::int64_t layer, char which) { return fmt::format("layers.{}.{}_cache", layer, which); }

}  // namespace

void check_decode_sessions_fit(const DecoderModel& model, int sessions) {
  const ModelConfig& config = model.config();
  // Checked for the caches' largest size, the capacity (a session's caches grow to it as its sequence
  // does). Besides its caches a step holds one layer's attention over the whole cache: the scores and
  // probabilities of every query head for up to kMaxStepTokens rows (stored in the runtime dtype,
  // widened to f32 where an op reads them: measured ~11 bytes an element in bf16, ~15 in f32, with
  // `generate` at 10^6 positions), and V widened to f32. Refused up front when that passes this
  // machine's memory: a --max-seq the load-time check (the caches alone) lets through must not end
  // in the kernel's out-of-memory killer halfway through a prompt.
  const double positions = static_cast<double>(model.capacity());
  const double element = static_cast<double>(dtype_size(model.dtype()));
  const double cache_bytes = sessions * kv_cache_bytes(config, model.capacity(), model.dtype());
  const double step_bytes = sessions * positions *
                            (static_cast<double>(config.num_attention_heads * DecoderModel::kMaxStepTokens) * (8 + 4 * element) +
                             8.0 * static_cast<double>(config.head_dim));
  // The weights are in memory already (the model is loaded): they count too.
  const auto weight_bytes = static_cast<double>(model.weight_bytes());
  const double needed = weight_bytes + cache_bytes + step_bytes;
  if (const auto memory = static_cast<double>(physical_memory_bytes()); needed > memory) {
    throw InputError(fmt::format("{} over {} positions ({}) needs about {:.1f} GB (the weights {:.1f} "
                                 "GB, the KV caches {:.1f} GB and one layer's attention scores for {} tokens {:.1f} GB), "
                                 "more than this machine's {:.1f} GB of memory",
                                 sessions == 1 ? std::string("a CPU decode step") : fmt::format("{} CPU decode sessions", sessions),
                                 model.capacity(), model.capacity_source(), needed / 1e9, weight_bytes / 1e9, cache_bytes / 1e9,
                                 DecoderModel::kMaxStepTokens, step_bytes / 1e9, memory / 1e9));
  }
}

namespace {
constexpr std::int64_t kFirstCacheRows = 128;  // a cache's rows at the start (fewer where the capacity is smaller)
}  // namespace

DecodeSession::DecodeSession(const DecoderModel& model, DecodePath path) : model_(model), path_(path) {
  check_decode_sessions_fit(model, 1);  // the whole capacity's caches: the rows the session may grow to
  reserve_cache_rows(1);
}

void DecodeSession::reserve_cache_rows(std::int64_t rows) {
  if (rows <= cache_rows_) return;
  std::int64_t grown = std::max(cache_rows_, kFirstCacheRows);
  while (grown < rows) grown *= 2;
  grown = std::min(grown, model_.capacity());
  const ModelConfig& config = model_.config();
  const TensorSpec cache_spec({config.num_key_value_heads, grown, config.head_dim}, model_.dtype());
  // Each head's rows [0, cache_rows_) move to the start of its rows in the larger cache; the rest stay
  // zero, as a fresh cache's rows are.
  const auto row_bytes = static_cast<std::size_t>(config.head_dim * dtype_size(model_.dtype()));
  caches_lost_ = true;  // until every cache has grown (an allocation that fails leaves them of two sizes)
  for (std::int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    for (char which : {'k', 'v'}) {
      const std::string name = cache_name(layer, which);
      HostTensor larger(cache_spec);
      if (cache_rows_ > 0) {
        const HostTensor& cache = state_.at(name);
        for (std::int64_t head = 0; head < config.num_key_value_heads; ++head) {
          std::memcpy(larger.bytes().data() + static_cast<std::size_t>(head * grown) * row_bytes,
                      cache.bytes().data() + static_cast<std::size_t>(head * cache_rows_) * row_bytes,
                      static_cast<std::size_t>(cache_rows_) * row_bytes);
        }
      }
      state_.insert_or_assign(name, std::move(larger));
    }
  }
  cache_rows_ = grown;
  caches_lost_ = false;
  std::erase_if(plans_, [&](const auto& entry) { return entry.first.second < grown; });  // never run again
}

void check_token_ids(std::span<const std::int32_t> tokens, const DecoderModel& model) {
  const std::int64_t vocab = model.config().vocab_size;
  for (std::int32_t token : tokens) {
    if (token < 0 || token >= vocab) {
      throw InputError(fmt::format("token id {} is outside the vocabulary [0, {})", token, vocab));
    }
  }
}

void for_each_step_chunk(std::span<const std::int32_t> tokens,
                         const std::function<void(std::span<const std::int32_t>)>& step) {
  for (std::size_t first = 0; first < tokens.size(); first += DecoderModel::kMaxStepTokens) {
    step(tokens.subspan(first, std::min<std::size_t>(DecoderModel::kMaxStepTokens, tokens.size() - first)));
  }
}

namespace {
// What every feed asks first: InputError when `tokens` from `position` pass the capacity.
void check_sequence_fits(std::span<const std::int32_t> tokens, std::int64_t position, std::int64_t capacity,
                         const std::string& capacity_source) {
  if (position + static_cast<std::int64_t>(tokens.size()) > capacity) {
    throw InputError(fmt::format("the sequence would reach {} tokens, past the KV-cache capacity {} ({})",
                                 position + static_cast<std::int64_t>(tokens.size()), capacity, capacity_source));
  }
}
}  // namespace

void check_tokens_fit(std::span<const std::int32_t> tokens, std::int64_t position, const DecoderModel& model) {
  check_sequence_fits(tokens, position, model.capacity(), model.capacity_source());
  check_token_ids(tokens, model);
}

void check_logits_fit(std::int64_t positions, const DecoderModel& model, double bytes_per_logit, double held_bytes) {
  const std::int64_t vocab = model.config().vocab_size;
  const double logits_bytes = static_cast<double>(positions) * static_cast<double>(vocab) * bytes_per_logit;
  if (const auto memory = static_cast<double>(physical_memory_bytes()); held_bytes + logits_bytes > memory) {
    throw InputError(fmt::format("the logits of {} positions x {} tokens of vocabulary take {:.1f} GB, which with the "
                                 "weights and caches held ({:.1f} GB) pass this machine's {:.1f} GB of memory: feed "
                                 "fewer tokens at a time",
                                 positions, vocab, logits_bytes / 1e9, held_bytes / 1e9, memory / 1e9));
  }
}

bool is_stop_token(std::span<const std::int64_t> stop_tokens, std::int32_t token) {
  return std::find(stop_tokens.begin(), stop_tokens.end(), token) != stop_tokens.end();
}

void check_continuation_fits(const LogitsSession& session, std::int64_t count) {
  if (count < 0) throw InputError(fmt::format("cannot continue for {} tokens", count));
  // Compared without the sum, which a count near 2^63 would overflow.
  if (count > session.capacity() - session.position()) {
    throw InputError(fmt::format("{} more tokens after {} would pass the KV-cache capacity {} ({})", count,
                                 session.position(), session.capacity(), session.capacity_source()));
  }
}

void DecodeSession::check_feed(std::span<const std::int32_t> tokens) const {
  if (caches_lost_) {
    throw InputError("this decode session lost its KV caches to an error in an earlier step: start a new session");
  }
  check_tokens_fit(tokens, position_, model_);
  check_logits_fit(static_cast<std::int64_t>(tokens.size()), model_, 4,
                   static_cast<double>(model_.weight_bytes()) + kv_cache_bytes(model_.config(), model_.capacity(), model_.dtype()));
}

std::vector<float> DecodeSession::feed(std::span<const std::int32_t> tokens) {
  check_feed(tokens);
  const std::int64_t vocab = model_.config().vocab_size;
  std::vector<float> logits;
  logits.reserve(tokens.size() * static_cast<std::size_t>(vocab));
  for_each_step_chunk(tokens, [&](std::span<const std::int32_t> chunk) {
    const auto steps = static_cast<std::int64_t>(chunk.size());
    HostTensor ids(TensorSpec({steps}, DType::i32));
    HostTensor positions(TensorSpec({steps}, DType::i32));
    for (std::int64_t step = 0; step < steps; ++step) {
      const std::int32_t token = chunk[static_cast<std::size_t>(step)];
      const auto position = static_cast<std::int32_t>(position_ + step);
      std::memcpy(ids.bytes().data() + step * 4, &token, 4);
      std::memcpy(positions.bytes().data() + step * 4, &position, 4);
    }
    reserve_cache_rows(position_ + steps);
    state_.insert_or_assign("token_ids", std::move(ids));
    state_.insert_or_assign("positions", std::move(positions));

    const ComputeGraph& graph = model_.step_graph(steps, StepOutputs::logits, cache_rows_);
    const TensorMap* weights[] = {&model_.weights()};
    const FusionPlan* plan = nullptr;
    if (path_ == DecodePath::planned) {
      auto& cached = plans_[{steps, cache_rows_}];
      if (!cached) cached = std::make_shared<const FusionPlan>(plan_graph_fusion(graph, FusionTarget::cpu()));
      plan = cached.get();
    }
    // The state is handed over (the caches are written in place): from here to the moves below
    // an error leaves the session without its caches.
    caches_lost_ = true;
    TensorMap outputs = plan ? run_plan_reference(*plan, std::exchange(state_, {}), weights)
                             : run_reference(graph, std::exchange(state_, {}), weights);
    // The written caches become the next step's caches (see the comment at the top).
    for (std::int64_t layer = 0; layer < model_.config().num_hidden_layers; ++layer) {
      for (char which : {'k', 'v'}) {
        const std::string name = cache_name(layer, which);
        state_.insert_or_assign(name, std::move(outputs.at(name + "_out")));
      }
    }
    caches_lost_ = false;
    const HostTensor& step_logits = outputs.at("logits");
    for (std::int64_t index = 0; index < step_logits.element_count(); ++index) {
      logits.push_back(static_cast<float>(step_logits.at(index)));
    }
    position_ += steps;
  });
  return logits;
}

void LogitsSession::check_feed(std::span<const std::int32_t> tokens) const {
  check_sequence_fits(tokens, position(), capacity(), capacity_source());
}

std::vector<float> feed_a_step_at_a_time(LogitsSession& session, std::span<const std::int32_t> tokens,
                                         const std::function<void()>& between) {
  session.check_feed(tokens);
  std::vector<float> logits;
  for_each_step_chunk(tokens, [&](std::span<const std::int32_t> chunk) {
    const std::vector<float> rows = session.feed(chunk);
    if (logits.empty()) logits.reserve(rows.size() / chunk.size() * tokens.size());  // the vocabulary's rows for all
    logits.insert(logits.end(), rows.begin(), rows.end());
    if (between) between();
  });
  return logits;
}

std::vector<std::int32_t> LogitsSession::feed_greedy(std::span<const std::int32_t> tokens) {
  // A step's tokens at a time, as the sessions step through them: a prompt's logits are never all held
  // (generate keeps only the last position's token; 2048 positions of a 2^24 vocabulary are 137 GB).
  std::vector<std::int32_t> next;
  for_each_step_chunk(tokens, [&](std::span<const std::int32_t> chunk) {
    const std::vector<float> logits = feed(chunk);
    const std::size_t vocab = logits.size() / chunk.size();
    for (std::size_t row = 0; row < chunk.size(); ++row) {
      next.push_back(static_cast<std::int32_t>(argmax_index(std::span<const float>(logits).subspan(row * vocab, vocab))));
    }
  });
  return next;
}

std::vector<TokenLogit> LogitsSession::feed_top_k(std::span<const std::int32_t> tokens, std::int64_t top_k) {
  if (tokens.empty()) throw InputError("no token to feed");
  check_top_k(top_k);
  check_continuation_fits(*this, static_cast<std::int64_t>(tokens.size()));  // before any step
  // Only the last position's logits are held (a prompt's rows at a 2^24 vocabulary would not fit).
  if (tokens.size() > 1) feed_greedy(tokens.first(tokens.size() - 1));
  return top_logits(feed(tokens.last(1)), top_k);
}

std::vector<std::int32_t> LogitsSession::continue_greedy(std::int32_t token, std::int64_t count,
                                                         std::span<const std::int64_t> stop_tokens,
                                                         const std::function<void(std::int32_t)>& on_token) {
  check_continuation_fits(*this, count);  // the whole count first, as the GPU session checks it
  std::vector<std::int32_t> chosen;
  for (std::int64_t index = 0; index < count; ++index) {
    token = feed_greedy(std::span<const std::int32_t>(&token, 1)).front();
    chosen.push_back(token);
    if (on_token) on_token(token);
    if (is_stop_token(stop_tokens, token)) break;
  }
  return chosen;
}

std::vector<std::int32_t> DecodeSession::feed_greedy(std::span<const std::int32_t> tokens) {
  check_tokens_fit(tokens, position_, model_);  // all of them, as feed() does, before any step runs
  return LogitsSession::feed_greedy(tokens);
}

std::vector<TokenLogit> DecodeSession::feed_top_k(std::span<const std::int32_t> tokens, std::int64_t top_k) {
  check_tokens_fit(tokens, position_, model_);  // the last token's id too, before the others are fed
  return LogitsSession::feed_top_k(tokens, top_k);
}

namespace {

// Greedy decoding and the model-level comparison feed the prompt, then each of `count` tokens but
// the last: checked before the first step, so that a run too long for the caches fails at once
// instead of after doing most of its work (count is compared first, so that the sum cannot overflow).
void check_generation_fits(const LogitsSession& session, std::span<const std::int32_t> prompt, std::int64_t count) {
  const std::int64_t capacity = session.capacity();
  const std::int64_t prompt_end = session.position() + static_cast<std::int64_t>(prompt.size());
  const std::int64_t fed = count > capacity ? count : prompt_end + std::max<std::int64_t>(count - 1, 0);
  if (fed > capacity) {
    const std::string at = session.position() > 0 ? fmt::format(" at position {}", session.position()) : "";
    if (prompt_end > capacity) {  // the prompt alone: "1 tokens after a 9-token prompt" blamed the count
      throw InputError(fmt::format("a {}-token prompt{} goes past the KV-cache capacity {} ({})", prompt.size(), at,
                                   capacity, session.capacity_source()));
    }
    throw InputError(fmt::format("{} token{} after a {}-token prompt{} would go past the KV-cache capacity {} ({})", count,
                                 count == 1 ? "" : "s", prompt.size(), at, capacity, session.capacity_source()));
  }
}

}  // namespace

void check_generation_count(std::int64_t count) {
  if (count < 1) throw InputError(fmt::format("cannot generate {} tokens (at least 1)", count));
}

std::span<const std::int32_t> feed_all_but_the_last_step(LogitsSession& session, std::span<const std::int32_t> prompt,
                                                         std::int64_t count, const std::function<void()>& between) {
  if (prompt.empty()) throw InputError("the prompt is empty");
  check_generation_count(count);
  check_generation_fits(session, prompt, count);
  constexpr auto kStep = static_cast<std::size_t>(DecoderModel::kMaxStepTokens);
  const std::size_t before_the_last = (prompt.size() - 1) / kStep * kStep;  // whole steps; the last keeps 1 to 16
  for_each_step_chunk(prompt.first(before_the_last), [&](std::span<const std::int32_t> step) {
    session.feed_greedy(step);
    if (between) between();
  });
  return prompt.subspan(before_the_last);
}

Generation generate(LogitsSession& session, std::span<const std::int32_t> prompt, std::int64_t count,
                    const SamplingOptions& sampling, std::span<const std::int64_t> stop_tokens,
                    const std::function<void(std::int64_t)>& on_token) {
  sampling.validate();
  if (prompt.empty()) throw InputError("the prompt is empty");
  check_generation_count(count);
  check_generation_fits(session, prompt, count);
  std::mt19937_64 random(sampling.seed);
  // The next token after `tokens`: greedy through feed_greedy (the GPU engine's argmax on the device),
  // else drawn among the tokens top-k keeps of the last position's logits (feed_top_k: the GPU engine
  // selects them on the device): sample_token's draw, token for token.
  const auto next_after = [&](std::span<const std::int32_t> tokens) -> std::int32_t {
    if (sampling.greedy()) return session.feed_greedy(tokens).back();
    return sample_among(session.feed_top_k(tokens, sampling.top_k), sampling, random);
  };
  Generation generation;
  const auto add = [&](std::int32_t token) {
    generation.tokens.push_back(token);
    if (on_token) on_token(static_cast<std::int64_t>(generation.tokens.size()) - 1);
    generation.stopped = is_stop_token(stop_tokens, token);
  };
  std::int32_t token = next_after(prompt);
  const auto start = std::chrono::steady_clock::now();
  add(token);
  if (sampling.greedy()) {
    // The rest as one continuation, which the GPU engine runs without a host round trip a step.
    if (!generation.stopped && count > 1) {
      session.continue_greedy(token, count - 1, stop_tokens, add);
    }
  } else {
    while (!generation.stopped && static_cast<std::int64_t>(generation.tokens.size()) < count) {
      token = next_after(std::span<const std::int32_t>(&token, 1));
      add(token);
    }
  }
  generation.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  generation.decode_steps = static_cast<std::int64_t>(generation.tokens.size()) - 1;  // the steps after the prompt's
  return generation;
}

namespace {

// max that keeps a NaN (std::max drops one in either position): a NaN logit must show in the figures.
double max_keeping_nan(double current, double value) { return std::isnan(value) || value > current ? value : current; }

}  // namespace

LogitsComparison compare_logits(std::span<const float> reference, std::span<const float> candidate) {
  if (reference.size() != candidate.size() || reference.empty()) {
    throw std::invalid_argument(fmt::format("compare_logits: {} reference logits against {}", reference.size(),
                                            candidate.size()));
  }
  const auto log_softmax = [](std::span<const float> logits) {
    const double maximum = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (float value : logits) sum += std::exp(value - maximum);
    std::vector<double> result;
    result.reserve(logits.size());
    for (float value : logits) result.push_back(value - maximum - std::log(sum));
    return result;
  };
  const std::vector<double> p = log_softmax(reference);
  const std::vector<double> q = log_softmax(candidate);
  LogitsComparison comparison;
  comparison.same_argmax = argmax_index(reference) == argmax_index(candidate);
  double first = -std::numeric_limits<double>::infinity(), second = first;
  for (float value : reference) {
    if (value > first) {
      second = first;
      first = value;
    } else if (value > second) {
      second = value;
    }
  }
  for (std::size_t index = 0; index < p.size(); ++index) {
    comparison.kl += std::exp(p[index]) * (p[index] - q[index]);
    comparison.max_abs_error =
        max_keeping_nan(comparison.max_abs_error, std::abs(static_cast<double>(reference[index]) - candidate[index]));
    comparison.max_abs_logit = std::max(comparison.max_abs_logit, std::abs(static_cast<double>(reference[index])));
  }
  if (comparison.kl < 0) comparison.kl = 0;  // rounding can make a zero divergence slightly negative (NaN stays)
  comparison.reference_margin = reference.size() == 1 ? 1.0 : (first - second) / std::max(comparison.max_abs_logit, 1e-30);
  return comparison;
}

AgreementFigures compare_sessions(LogitsSession& reference, LogitsSession& candidate,
                                  std::span<const std::int32_t> prompt, std::int64_t positions) {
  if (positions < 1) throw InputError(fmt::format("cannot compare {} positions", positions));
  if (prompt.empty()) throw InputError("the prompt is empty");
  check_generation_fits(reference, prompt, positions);
  check_generation_fits(candidate, prompt, positions);
  AgreementFigures figures;
  double ignored = 0;
  // The last position's logits of a feed, and the time it took.
  const auto last_logits = [](LogitsSession& session, std::span<const std::int32_t> tokens, double& seconds) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<float> logits = session.feed(tokens);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::size_t vocab = logits.size() / tokens.size();
    logits.erase(logits.begin(), logits.end() - static_cast<std::ptrdiff_t>(vocab));
    return logits;
  };
  std::vector<float> expected = last_logits(reference, prompt, ignored);
  std::vector<float> actual = last_logits(candidate, prompt, ignored);
  double kl_sum = 0;
  for (std::int64_t position = 0; position < positions; ++position) {
    const LogitsComparison comparison = compare_logits(expected, actual);
    ++figures.positions;
    if (!std::all_of(expected.begin(), expected.end(), [](float value) { return std::isfinite(value); })) {
      ++figures.nonfinite_reference_positions;
    }
    figures.agreements += comparison.same_argmax ? 1 : 0;
    if (!comparison.same_argmax && figures.first_disagreement < 0) figures.first_disagreement = position;
    if (comparison.reference_margin >= AgreementFigures::kDecidedMargin) {
      ++figures.decided_positions;
      figures.decided_agreements += comparison.same_argmax ? 1 : 0;
      if (!comparison.same_argmax && figures.first_decided_disagreement < 0) figures.first_decided_disagreement = position;
    }
    kl_sum += comparison.kl;
    figures.kl_max = max_keeping_nan(figures.kl_max, comparison.kl);
    figures.max_logit_error =
        max_keeping_nan(figures.max_logit_error, comparison.max_abs_error / std::max(comparison.max_abs_logit, 1e-30));
    if (position + 1 == positions) break;
    const auto token = static_cast<std::int32_t>(argmax_index(expected));  // both paths get the reference's token
    expected = last_logits(reference, std::span<const std::int32_t>(&token, 1), figures.reference_seconds);
    actual = last_logits(candidate, std::span<const std::int32_t>(&token, 1), figures.candidate_seconds);
  }
  figures.kl_mean = kl_sum / static_cast<double>(figures.positions);
  return figures;
}

}  // namespace metile
