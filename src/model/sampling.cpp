// Picking a next token by sampling (SamplingOptions, include/metile/model.h): temperature, top-k and
// top-p over one position's logits, in float64, from a seeded std::mt19937_64.
#include <algorithm>
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
  // Most likely first, ties by token id: the order top-k and top-p cut (dividing by a temperature
  // above 0 keeps it).
  const auto before = [&](std::int32_t a, std::int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::vector<std::int32_t> kept(logits.size());
  std::iota(kept.begin(), kept.end(), 0);
  const bool cut_top_k = options.top_k > 0 && options.top_k < static_cast<std::int64_t>(kept.size());
  if (cut_top_k) {
    std::partial_sort(kept.begin(), kept.begin() + options.top_k, kept.end(), before);
    kept.resize(static_cast<std::size_t>(options.top_k));
  } else if (options.top_p < 1) {
    std::sort(kept.begin(), kept.end(), before);
  }
  // Relative weights exp((logit - largest) / T): the difference first, so that a tiny temperature
  // sends every other token to 0 (logit / T overflowed to +inf for each positive logit, which then
  // shared the draw). Tokens at +inf share it (every other weighs 0).
  std::vector<double> weights(kept.size());
  for (std::size_t i = 0; i < kept.size(); ++i) {
    const float value = logits[kept[i]];
    weights[i] = largest == INFINITY ? (value == INFINITY ? 1.0 : 0.0)
                                     : std::exp((static_cast<double>(value) - largest) / options.temperature);
  }
  double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  if (options.top_p < 1) {
    // The shortest prefix whose weight reaches top_p of the kept total; at least one token.
    const double wanted = options.top_p * total;
    double prefix = 0;
    std::size_t length = 0;
    while (length < weights.size() && (length == 0 || prefix < wanted)) prefix += weights[length++];
    kept.resize(length);
    weights.resize(length);
    total = prefix;
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
