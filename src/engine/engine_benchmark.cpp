// The model benchmark behind `metile bench-model` (include/metile/engine.h, benchmark_engine):
// on one session, after a prompt of `context` tokens,
//   decode replay  the decode step's CUDA graph replayed with events (device time per token),
//   decode feed    feed() of one token (input copies, replay, the logits row out),
//   greedy feed    feed_greedy() of one token, as generate runs it (input copies, replay, one id out),
//   floor          the bytes one step must read / the copy bandwidth measured by the caller,
//   read floors    the step's GEMV weights read by read-only kernels alone: one a GEMV step, one in all,
//   breakdown      the decode step's units run once eagerly, events between them, summed by kind,
//                  and each kind's cost inside the replay (the step replayed without that kind),
//   profile        with METILE_PROFILE_DECODE_STEP=1, one replay between cuProfilerStart/Stop (ncu),
//   prefill        a fresh sequence of `prefill_tokens` tokens fed at once (chunks of 16).
// Timings live here and in the command's table only, never in tests.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <random>

#include <fmt/format.h>

#include "metile/engine.h"

namespace metile {
namespace {

std::vector<std::int32_t> random_tokens(std::mt19937_64& generator, std::int64_t count, std::int64_t vocab) {
  std::vector<std::int32_t> tokens;
  for (std::int64_t index = 0; index < count; ++index) {
    tokens.push_back(static_cast<std::int32_t>(generator() % static_cast<std::uint64_t>(vocab)));
  }
  return tokens;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The time `bytes` take at the copy rate, in ms: the floor a step or a kind of its work is held to.
double copy_time_ms(std::uint64_t bytes, double copy_bandwidth_gbps) {
  return static_cast<double>(bytes) / (copy_bandwidth_gbps * 1e9) * 1e3;
}

}  // namespace

constexpr int kWarmupFeeds = 3;

std::int64_t BenchmarkOptions::cached_tokens_needed() const {
  // The context, then the warm-up feeds and the timed feed() steps; the greedy runs start again after
  // the context (one step before their timed ones).
  return std::max(prefill_tokens, context + kWarmupFeeds + static_cast<std::int64_t>(decode_steps) + 1);
}

void BenchmarkOptions::validate() const {
  for (const auto& [option, count] : {std::pair{"--context", context}, std::pair{"--prefill-tokens", prefill_tokens},
                                      std::pair{"--decode-steps", std::int64_t{decode_steps}}}) {
    if (count < 1) throw InputError(fmt::format("bench-model: {} {} must be at least 1", option, count));
  }
  // Positions are i32 in the step graphs (DecoderModel::load's limit on max-seq). Bounding context and
  // the prompt first keeps cached_tokens_needed() from overflowing (decode_steps is an int), and names
  // the option that asked for too many, not the max-seq it became.
  constexpr std::int64_t kMaximumPositions = std::int64_t{1} << 31;
  if (context > kMaximumPositions || prefill_tokens > kMaximumPositions ||
      cached_tokens_needed() > kMaximumPositions) {
    throw InputError(fmt::format("bench-model: --context {}, --prefill-tokens {} and --decode-steps {} need {} cached "
                                 "positions, more than 2^31 (positions are 32-bit integers)",
                                 context, prefill_tokens, decode_steps,
                                 context > kMaximumPositions || prefill_tokens > kMaximumPositions
                                     ? std::max(context, prefill_tokens)
                                     : cached_tokens_needed()));
  }
}

void BenchmarkOptions::check_capacity(std::int64_t capacity, std::string_view source) const {
  if (cached_tokens_needed() > capacity) {
    throw InputError(fmt::format("bench-model: --context {}, --prefill-tokens {} and --decode-steps {} need {} cached "
                                 "tokens, past the KV-cache capacity {} ({})",
                                 context, prefill_tokens, decode_steps, cached_tokens_needed(), capacity, source));
  }
}

double weight_stream_percent(const StepKindTime& time, double copy_bandwidth_gbps) {
  if (time.weight_bytes == 0 || !(time.replay_ms > 0) || !(copy_bandwidth_gbps > 0)) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  return 100 * copy_time_ms(time.weight_bytes, copy_bandwidth_gbps) / time.replay_ms;
}

EngineBenchmark benchmark_engine(CudaDecodeSession& session, const BenchmarkOptions& options) {
  const DecoderModel& model = session.model().model();
  const std::int64_t vocab = model.config().vocab_size;
  options.validate();
  options.check_capacity(model.capacity(), model.capacity_source());
  std::mt19937_64 generator(options.seed);
  EngineBenchmark result;
  result.path = std::string(engine_path_name(session.options().path));
  result.context = options.context;

  session.reset();
  const std::vector<std::int32_t> context_prompt = random_tokens(generator, options.context, vocab);
  session.feed_greedy(context_prompt);  // the cache filled; every position's logits are not wanted
  // The decode step at `context` cached tokens, replayed (each replay writes the same cache row).
  const std::vector<std::int32_t> next = random_tokens(generator, 1, vocab);
  session.stage_step(next);
  Executable& decode = session.executable(1);
  result.decode_replay_ms =
      time_on_stream_ms(session.stream(), [&](const CudaStream& stream) { decode.enqueue(stream); }, 5, 20, 7);
  result.breakdown = decode.profile(session.stream());
  // Inside the replay: the step raced against itself without each kind (fewer calls than a region
  // race: each candidate is a whole step). The ablated replays wrote the staged row only.
  TournamentOptions ablation;
  ablation.warmup_calls = 2;
  ablation.rounds = 5;
  ablation.calls_per_sample = 5;
  decode.replay_cost_by_kind(result.breakdown, ablation);
  result.read_floors = decode.read_floors(ablation);
  // One more replay between the profiler's start and stop marks, for
  // `ncu --profile-from-start off --graph-profiling node`: every kernel of one decode step.
  if (const char* flag = std::getenv("METILE_PROFILE_DECODE_STEP"); flag != nullptr && std::string_view(flag) == "1") {
    profile_on_stream(session.stream(), [&](const CudaStream& stream) { decode.enqueue(stream); });
  }
  result.launches = decode.step_count();
  for (const RegionReport& region : decode.reports()) {
    ++result.chosen[region.rule + ": " + region.chosen];
    if (result.reasons.count(region.rule)) continue;  // the first region of each kind
    // Its sentence, the three fastest candidates of its race and how many failed the numeric gate.
    std::vector<std::pair<double, std::string>> fastest;
    for (const auto& [name, ms] : region.timings_ms) fastest.emplace_back(ms, name);
    std::sort(fastest.begin(), fastest.end());
    std::string reason = region.sentence;
    for (std::size_t i = 0; i < std::min<std::size_t>(3, fastest.size()); ++i) {
      reason += fmt::format("{} {} {:.1f} us", i == 0 ? "; fastest:" : ",", fastest[i].second, fastest[i].first * 1e3);
    }
    const auto failed = std::count_if(region.gates.begin(), region.gates.end(), [](const auto& gate) { return !gate.second.passed; });
    if (failed > 0) reason += fmt::format("; {} of {} failed the numeric gate", failed, region.gates.size());
    result.reasons.emplace(region.rule, reason);
  }

  for (int warmup = 0; warmup < kWarmupFeeds; ++warmup) session.feed(random_tokens(generator, 1, vocab));
  const std::vector<std::int32_t> decode_tokens = random_tokens(generator, options.decode_steps, vocab);
  const auto decode_start = std::chrono::steady_clock::now();
  for (std::int32_t token : decode_tokens) session.feed(std::span<const std::int32_t>(&token, 1));
  result.decode_feed_ms = seconds_since(decode_start) * 1e3 / static_cast<double>(options.decode_steps);
  // Greedy steps, the argmax on the device, each run from the same context (the prompt fed again):
  // one feed_greedy a step (ids and position up, the replay, the id back: a host round trip a step),
  // and as generate runs them (continue_greedy: each chosen token handed to the next step on the
  // device, the ids read back behind the queued steps). A one-token continuation first makes the link
  // (its kernel compiled or loaded) outside the timing.
  const auto time_greedy = [&](bool queued) {
    session.reset();
    std::int32_t token = session.feed_greedy(context_prompt).back();
    token = session.continue_greedy(token, 1).front();
    const auto start = std::chrono::steady_clock::now();
    if (queued) {
      session.continue_greedy(token, options.decode_steps);
    } else {
      for (int step = 0; step < options.decode_steps; ++step) {
        token = session.feed_greedy(std::span<const std::int32_t>(&token, 1)).front();
      }
    }
    return seconds_since(start) * 1e3 / static_cast<double>(options.decode_steps);
  };
  result.decode_greedy_stepped_ms = time_greedy(false);
  result.decode_greedy_ms = time_greedy(true);
  result.tokens_per_second = 1e3 / result.decode_greedy_ms;
  // Sampled steps (temperature 1, top-k 50), from the same context: each step's logits row copied back
  // and the top-k taken on the host (sample_token over feed()), and as generate samples (feed_top_k: the
  // top-k selected on the device, only the kept tokens copied back). The same draws either way.
  const auto time_sampled = [&](bool on_device) {
    session.reset();
    session.feed_greedy(context_prompt);
    const SamplingOptions sampling{1.0, kBenchmarkTopK, 1.0, 0};
    std::mt19937_64 random(sampling.seed);
    const auto next_after = [&](std::int32_t token) {
      const std::span<const std::int32_t> fed(&token, 1);
      return on_device ? sample_among(session.feed_top_k(fed, sampling.top_k), sampling, random)
                       : sample_token(session.feed(fed), sampling, random);
    };
    std::int32_t token = next_after(context_prompt.back());  // the selection kernel loaded outside the timing
    const auto start = std::chrono::steady_clock::now();
    for (int step = 0; step < options.decode_steps; ++step) token = next_after(token);
    return seconds_since(start) * 1e3 / static_cast<double>(options.decode_steps);
  };
  result.decode_sampled_host_ms = time_sampled(false);
  result.decode_sampled_ms = time_sampled(true);

  result.copy_bandwidth_gbps = options.copy_bandwidth_gbps;
  if (options.copy_bandwidth_gbps > 0) {
    result.floor_ms = copy_time_ms(static_cast<std::uint64_t>(session.model().decode_step_bytes(options.context)),
                                   options.copy_bandwidth_gbps);
    result.floor_percent = 100 * result.floor_ms / result.decode_replay_ms;
  }

  // Prefill: the best of two fresh sequences (the first may still build the 16-token step), fed as
  // generate feeds a prompt: each chunk's next ids chosen on the device and copied back (feeding it
  // with its logits copied out and widened on the host measured the host: 65M values for a 512-token
  // prompt at a 128K vocabulary, about 12 ms a chunk).
  result.prefill_tokens = options.prefill_tokens;
  const std::vector<std::int32_t> prompt = random_tokens(generator, options.prefill_tokens, vocab);
  double best = 0;
  for (int run = 0; run < 2; ++run) {
    session.reset();
    const auto start = std::chrono::steady_clock::now();
    session.feed_greedy(prompt);
    const double seconds = seconds_since(start);
    best = run == 0 ? seconds : std::min(best, seconds);
  }
  result.prefill_tokens_per_second = static_cast<double>(options.prefill_tokens) / best;
  session.reset();
  return result;
}

}  // namespace metile
