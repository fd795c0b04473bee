// Picking a next token by sampling (SamplingOptions, include/metile/model.h): temperature, top-k and
// top-p over one position's logits, in float64, from a seeded std::mt19937_64.
#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <vector>

#include <fmt/format.h>

#include "metile/model.h"

namespace metile {

void check_top_k(std::int64_t top_k) {
  if (top_k < 0) throw InputError(fmt::format("top_k {} must be >= 0 (0: every token)", top_k));
}

void SamplingOptions::validate() const {
  if (!std::isfinite(temperature) || temperature < 0) {
    throw InputError(fmt::format("temperature {} must be a finite number >= 0 (0: greedy)", temperature));
  }
  check_top_k(top_k);
  if (!(top_p > 0 && top_p <= 1)) throw InputError(fmt::format("top_p {} must be in (0, 1] (1: every token)", top_p));
  if (greedy() && (top_k != 0 || top_p != 1 || seed != 0)) {
    throw InputError("top_k, top_p and seed pick among sampled tokens: give temperature above 0 too (0, or one a "
                     "double rounds to 0, is greedy)");
  }
}

std::int32_t sample_token(std::span<const float> logits, const SamplingOptions& options, std::mt19937_64& random) {
  options.validate();
  if (options.greedy()) throw std::invalid_argument("sample_token: temperature 0 is greedy (argmax_index)");
  if (logits.empty()) throw std::invalid_argument("sample_token: no logits");
  return sample_among(top_logits(logits, options.top_k), options, random);
}

namespace {

void refuse_nan() { throw InputError("cannot sample the next token: its logits hold a NaN"); }

}  // namespace

std::vector<TokenLogit> top_logits(std::span<const float> logits, std::int64_t top_k) {
  check_top_k(top_k);
  if (std::any_of(logits.begin(), logits.end(), [](float value) { return std::isnan(value); })) refuse_nan();
  // As transformers' TopKLogitsWarper: every token whose logit reaches the k-th largest (ties at the
  // k-th all stay, so more than k may).
  float threshold = -INFINITY;
  if (top_k > 0 && top_k < static_cast<std::int64_t>(logits.size())) {
    std::vector<float> values(logits.begin(), logits.end());
    std::nth_element(values.begin(), values.begin() + (top_k - 1), values.end(), std::greater<>());
    threshold = values[static_cast<std::size_t>(top_k - 1)];
  }
  std::vector<TokenLogit> kept;
  for (std::size_t token = 0; token < logits.size(); ++token) {
    if (logits[token] < threshold) continue;
    kept.push_back({static_cast<std::int32_t>(token), logits[token]});
  }
  return kept;
}

std::int32_t sample_among(std::span<const TokenLogit> kept_logits, const SamplingOptions& options,
                          std::mt19937_64& random) {
  options.validate();
  if (options.greedy()) throw std::invalid_argument("sample_among: temperature 0 is greedy (argmax_index)");
  if (kept_logits.empty()) throw std::invalid_argument("sample_among: no token kept");
  if (std::any_of(kept_logits.begin(), kept_logits.end(), [](const TokenLogit& kept) { return std::isnan(kept.logit); })) {
    refuse_nan();
  }
  float largest = -INFINITY;
  for (const TokenLogit& kept : kept_logits) largest = std::max(largest, kept.logit);
  if (largest == -INFINITY) throw InputError("cannot sample the next token: every logit is -inf");
  // Relative weights exp((logit - largest) / T): the difference first, so that a tiny temperature
  // sends every other token to 0 (logit / T overflowed to +inf for each positive logit, which then
  // shared the draw). Tokens at +inf share it (every other weighs 0). Summed in token order.
  struct Candidate {
    std::int32_t token;
    float logit;
    double weight;
  };
  std::vector<Candidate> kept;
  kept.reserve(kept_logits.size());
  double total = 0;
  for (const TokenLogit& candidate : kept_logits) {
    const float value = candidate.logit;
    const double weight = largest == INFINITY ? (value == INFINITY ? 1.0 : 0.0)
                                              : std::exp((static_cast<double>(value) - largest) / options.temperature);
    kept.push_back({candidate.token, value, weight});
    total += weight;
  }
  if (options.top_p < 1) {
    // The nucleus: most likely first (ties by token id), the shortest prefix whose weight reaches top_p
    // of the kept total, at least one token. Sorted a growing head at a time: a full sort of Qwen2.5's
    // 151936 logits added 13-45 ms a token on the 2-core development machine; a flat distribution
    // still ends up sorting them all.
    const auto before = [](const Candidate& a, const Candidate& b) {
      return a.logit > b.logit || (a.logit == b.logit && a.token < b.token);
    };
    const double wanted = options.top_p * total;
    for (std::size_t head = std::min<std::size_t>(64, kept.size());; head = std::min(kept.size(), head * 8)) {
      std::partial_sort(kept.begin(), kept.begin() + static_cast<std::ptrdiff_t>(head), kept.end(), before);
      double prefix = 0;
      std::size_t length = 0;
      while (length < head && (length == 0 || prefix < wanted)) prefix += kept[length++].weight;
      if (prefix >= wanted || head == kept.size()) {
        kept.resize(length);
        total = prefix;
        break;
      }
    }
  }
  // A uniform draw in [0, total) from the generator's top 53 bits, then the token whose cumulative
  // weight passes it (the last kept one of weight where rounding leaves the draw at the very end).
  const double draw = static_cast<double>(random() >> 11) * 0x1.0p-53 * total;
  double cumulative = 0;
  for (const Candidate& candidate : kept) {
    cumulative += candidate.weight;
    if (draw < cumulative) return candidate.token;
  }
  for (auto candidate = kept.rbegin(); candidate != kept.rend(); ++candidate) {
    if (candidate->weight > 0) return candidate->token;
  }
  return kept.front().token;
}

}  // namespace metile
