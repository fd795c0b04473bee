// Picking a next token by sampling (SamplingOptions, include/metile/model.h): temperature, top-k and
// top-p over one position's logits, in float64, from a seeded std::mt19937_64.
#include <algorithm>
#include <functional>
#include <cmath>
#include <numeric>
#include <vector>

#include <fmt/format.h>

#include "metile/model.h"

namespace metile {

void SamplingOptions::validate() const {
  if (!std::isfinite(temperature) || temperature < 0) {
    throw InputError(fmt::format("temperature {} must be a finite number >= 0 (0: greedy)", temperature));
  }
  if (top_k < 0) throw InputError(fmt::format("top_k {} must be >= 0 (0: every token)", top_k));
  if (!(top_p > 0 && top_p <= 1)) throw InputError(fmt::format("top_p {} must be in (0, 1] (1: every token)", top_p));
}

std::int32_t sample_token(std::span<const float> logits, const SamplingOptions& options, std::mt19937_64& random) {
  options.validate();
  if (options.greedy()) throw std::invalid_argument("sample_token: temperature 0 is greedy (argmax_index)");
  if (logits.empty()) throw std::invalid_argument("sample_token: no logits");
  if (std::any_of(logits.begin(), logits.end(), [](float value) { return std::isnan(value); })) {
    throw InputError("cannot sample the next token: its logits hold a NaN");
  }
  const float largest = *std::max_element(logits.begin(), logits.end());
  if (largest == -INFINITY) throw InputError("cannot sample the next token: every logit is -inf");
  // top-k as transformers' TopKLogitsWarper: every token whose logit reaches the k-th largest (ties at
  // the k-th all stay, so more than k may).
  std::vector<std::int32_t> kept;
  if (options.top_k > 0 && options.top_k < static_cast<std::int64_t>(logits.size())) {
    std::vector<float> values(logits.begin(), logits.end());
    std::nth_element(values.begin(), values.begin() + (options.top_k - 1), values.end(), std::greater<>());
    const float threshold = values[static_cast<std::size_t>(options.top_k - 1)];
    for (std::size_t i = 0; i < logits.size(); ++i) {
      if (logits[i] >= threshold) kept.push_back(static_cast<std::int32_t>(i));
    }
  } else {
    kept.resize(logits.size());
    std::iota(kept.begin(), kept.end(), 0);
  }
  // Relative weights exp((logit - largest) / T): the difference first, so that a tiny temperature
  // sends every other token to 0 (logit / T overflowed to +inf for each positive logit, which then
  // shared the draw). Tokens at +inf share it (every other weighs 0).
  const auto weight_of = [&](std::int32_t token) {
    const float value = logits[static_cast<std::size_t>(token)];
    return largest == INFINITY ? (value == INFINITY ? 1.0 : 0.0)
                               : std::exp((static_cast<double>(value) - largest) / options.temperature);
  };
  std::vector<double> weights(kept.size());
  double total = 0;
  for (std::size_t i = 0; i < kept.size(); ++i) total += weights[i] = weight_of(kept[i]);
  if (options.top_p < 1) {
    // The nucleus: most likely first (ties by token id), the shortest prefix whose weight reaches top_p
    // of the kept total, at least one token. Sorted a growing head at a time: a full sort of Qwen2.5's
    // 151936 logits added 13-45 ms a token on the 2-core development machine; a flat distribution
    // still ends up sorting them all.
    const auto before = [&](std::int32_t a, std::int32_t b) {
      return logits[static_cast<std::size_t>(a)] > logits[static_cast<std::size_t>(b)] ||
             (logits[static_cast<std::size_t>(a)] == logits[static_cast<std::size_t>(b)] && a < b);
    };
    const double wanted = options.top_p * total;
    std::size_t head = std::min<std::size_t>(64, kept.size());
    while (true) {
      std::partial_sort(kept.begin(), kept.begin() + static_cast<std::ptrdiff_t>(head), kept.end(), before);
      double prefix = 0;
      std::size_t length = 0;
      while (length < head && (length == 0 || prefix < wanted)) prefix += weight_of(kept[length++]);
      if (prefix >= wanted || head == kept.size()) {
        kept.resize(length);
        weights.resize(length);
        for (std::size_t i = 0; i < length; ++i) weights[i] = weight_of(kept[i]);
        total = prefix;
        break;
      }
      head = std::min(kept.size(), head * 8);
    }
  }
  // A uniform draw in [0, total) from the generator's top 53 bits, then the token whose cumulative
  // weight passes it (the last kept one where rounding leaves the draw at the very end).
  const double draw = static_cast<double>(random() >> 11) * 0x1.0p-53 * total;
  double cumulative = 0;
  for (std::size_t i = 0; i < kept.size(); ++i) {
    cumulative += weights[i];
    if (draw < cumulative) return kept[i];
  }
  for (std::size_t i = kept.size(); i-- > 0;) {
    if (weights[i] > 0) return kept[i];
  }
  return kept.front();
}

}  // namespace metile
