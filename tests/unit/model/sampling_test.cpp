// sample_token (SamplingOptions, include/metile/model.h) against a brute-force oracle written here: each
// token's probability from the definitions (its rank among the scaled logits for top-k, the mass ranked
// before it for top-p, softmax in long double), compared with the frequencies of many draws; the edge
// cases (+-inf, NaN, ties by id) and the argument checks. generate's sampled path is in model_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "metile/model.h"
#include "metile_test_support.h"

namespace metile::testing {
namespace {

// The probability of each token under `options`, from the definitions, O(V^2).
std::vector<long double> oracle_probabilities(const std::vector<float>& logits, const SamplingOptions& options) {
  const std::size_t count = logits.size();
  std::vector<long double> scaled(count);
  for (std::size_t i = 0; i < count; ++i) scaled[i] = static_cast<long double>(logits[i]) / options.temperature;
  std::vector<std::size_t> rank(count, 0);
  std::vector<std::size_t> above(count, 0);  // tokens strictly more likely: top-k keeps a token below k
  for (std::size_t i = 0; i < count; ++i) {
    for (std::size_t j = 0; j < count; ++j) {
      rank[i] += scaled[j] > scaled[i] || (scaled[j] == scaled[i] && j < i);
      above[i] += scaled[j] > scaled[i];
    }
  }
  long double largest = scaled[0];
  for (long double value : scaled) largest = std::max(largest, value);
  std::vector<long double> weight(count, 0);
  for (std::size_t i = 0; i < count; ++i) {
    const bool in_top_k = options.top_k == 0 || above[i] < static_cast<std::size_t>(options.top_k);
    if (in_top_k) weight[i] = std::exp(scaled[i] - largest);
  }
  long double total = 0;
  for (long double value : weight) total += value;
  // top-p: a token stays when the mass ranked before it is short of top_p of the whole.
  std::vector<long double> kept(count, 0);
  for (std::size_t i = 0; i < count; ++i) {
    long double before = 0;
    for (std::size_t j = 0; j < count; ++j) before += rank[j] < rank[i] ? weight[j] : 0;
    if (weight[i] > 0 && before < options.top_p * total) kept[i] = weight[i];
  }
  long double kept_total = 0;
  for (long double value : kept) kept_total += value;
  for (long double& value : kept) value /= kept_total;
  return kept;
}

TEST(SampleToken, DrawsFollowTheTemperatureTopKAndTopPDistribution) {
  std::mt19937_64 random(test_seed("sampling"));
  constexpr int kDraws = 40000;
  for (int trial = 0; trial < 12; ++trial) {
    // 40 logits, a third of them small integers (ties), the rest spread reals.
    std::vector<float> logits(40);
    for (float& value : logits) {
      value = random() % 3 == 0 ? static_cast<float>(static_cast<int>(random() % 5) - 2)
                                : std::uniform_real_distribution<float>(-4, 4)(random);
    }
    SamplingOptions options;
    options.temperature = std::uniform_real_distribution<double>(0.3, 2.5)(random);
    options.top_k = trial % 3 == 0 ? 0 : static_cast<std::int64_t>(1 + random() % 20);
    options.top_p = trial % 2 == 0 ? 1.0 : std::uniform_real_distribution<double>(0.2, 0.95)(random);
    const std::vector<long double> expected = oracle_probabilities(logits, options);
    std::vector<int> counts(logits.size(), 0);
    for (int draw = 0; draw < kDraws; ++draw) ++counts[static_cast<std::size_t>(sample_token(logits, options, random))];
    for (std::size_t token = 0; token < logits.size(); ++token) {
      const double want = static_cast<double>(expected[token]);
      const double got = static_cast<double>(counts[token]) / kDraws;
      SCOPED_TRACE(::testing::Message() << "trial " << trial << " token " << token << " T " << options.temperature
                                        << " top_k " << options.top_k << " top_p " << options.top_p);
      if (want == 0) {
        EXPECT_EQ(counts[token], 0);  // outside top-k or top-p: never drawn
      } else {
        // Six standard deviations of the count, plus four draws. The normal bound alone is a few draws
        // wide where the expected count is small (3.8 for a 1e-5 token, 0.4 expected in 40000 draws), and
        // four draws of such a token, a 1-in-1200 chance, failed it: over 480 tokens about one run in a
        // hundred failed (once in session 48). With the four the chance is below 1e-8 a token.
        EXPECT_NEAR(counts[token], kDraws * want, 6 * std::sqrt(kDraws * want * (1 - want)) + 4) << "frequency " << got;
      }
    }
  }
}

TEST(SampleToken, EdgeCasesAndArguments) {
  std::mt19937_64 random(test_seed("sampling edges"));
  SamplingOptions options;
  options.temperature = 1;
  // Tokens at +inf share the draw; -inf is never drawn.
  const std::vector<float> infinite = {1.0f, INFINITY, -INFINITY, INFINITY, 5.0f};
  std::vector<int> counts(5, 0);
  for (int draw = 0; draw < 2000; ++draw) ++counts[static_cast<std::size_t>(sample_token(infinite, options, random))];
  EXPECT_EQ(counts[0] + counts[2] + counts[4], 0);
  EXPECT_GT(counts[1], 800);
  EXPECT_GT(counts[3], 800);
  // top-k keeps every token tied with the k-th (transformers' rule), top-p of a tiny value the single
  // most likely, ties by id (the greedy choice).
  options.top_k = 1;
  std::vector<int> tied(4, 0);
  const std::vector<float> two_maxima = {2.0f, 7.0f, 7.0f, -1.0f};
  for (int draw = 0; draw < 400; ++draw) ++tied[static_cast<std::size_t>(sample_token(two_maxima, options, random))];
  EXPECT_EQ(tied[0] + tied[3], 0);
  EXPECT_GT(tied[1], 100);
  EXPECT_GT(tied[2], 100);
  options.top_k = 0;
  options.top_p = 1e-9;
  for (int draw = 0; draw < 20; ++draw) EXPECT_EQ(sample_token(two_maxima, options, random), 1);
  options.top_p = 1;
  // A temperature so small that logit / T overflows: still the most likely token, not every positive one.
  SamplingOptions cold = options;
  cold.temperature = 1e-310;
  for (int draw = 0; draw < 20; ++draw) EXPECT_EQ(sample_token(std::vector<float>{1.0f, 3.0f, 2.5f}, cold, random), 1);
  EXPECT_EQ(error_of([&] { sample_token(std::vector<float>{-INFINITY, -INFINITY}, options, random); }),
            "cannot sample the next token: every logit is -inf");
  EXPECT_EQ(error_of([&] { sample_token(std::vector<float>{1.0f, NAN}, options, random); }),
            "cannot sample the next token: its logits hold a NaN");
  // The same seed draws the same tokens.
  std::mt19937_64 first(42), second(42);
  const std::vector<float> logits = {0.1f, 0.3f, 0.2f, 0.4f, 0.0f};
  for (int draw = 0; draw < 50; ++draw) EXPECT_EQ(sample_token(logits, options, first), sample_token(logits, options, second));
  // Arguments: each refusal names its field.
  const auto refusal = [](SamplingOptions bad) { return error_of([&] { bad.validate(); }); };
  EXPECT_EQ(refusal({-1, 0, 1, 0}), "temperature -1 must be a finite number >= 0 (0: greedy)");
  EXPECT_EQ(refusal({INFINITY, 0, 1, 0}), "temperature inf must be a finite number >= 0 (0: greedy)");
  EXPECT_EQ(refusal({1, -2, 1, 0}), "top_k -2 must be >= 0 (0: every token)");
  EXPECT_EQ(refusal({1, 0, 0, 0}), "top_p 0 must be in (0, 1] (1: every token)");
  EXPECT_EQ(refusal({1, 0, 1.5, 0}), "top_p 1.5 must be in (0, 1] (1: every token)");
  EXPECT_EQ(refusal({1, 0, NAN, 0}), "top_p nan must be in (0, 1] (1: every token)");
  for (const SamplingOptions& greedy_with_filters : {SamplingOptions{0, 5, 1, 0}, SamplingOptions{0, 0, 0.5, 0},
                                                     SamplingOptions{0, 0, 1, 7}}) {
    EXPECT_EQ(refusal(greedy_with_filters), "top_k, top_p and seed pick among sampled tokens: give temperature above 0 "
                                            "too (0, or one a double rounds to 0, is greedy)");
  }
}

// top_logits (the top-k rule the GPU engine's selection reproduces) against its definition: a token is
// kept when fewer than k logits are strictly larger (-0 and +0 equal, +-inf ordered), in token order;
// sample_token is sample_among over it, draw for draw.
TEST(TopLogits, KeepsEveryTokenWithFewerThanKLargerLogits) {
  std::mt19937_64 random(test_seed("top_logits"));
  const std::vector<float> specials = {0.0f, -0.0f, INFINITY, -INFINITY, 1.5f, -1.5f};
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> logits(1 + random() % 60);
    for (float& value : logits) {
      const auto kind = random() % 4;
      value = kind == 0 ? specials[random() % specials.size()]
              : kind == 1 ? static_cast<float>(static_cast<int>(random() % 5) - 2)
                          : std::uniform_real_distribution<float>(-8, 8)(random);
    }
    const auto top_k = static_cast<std::int64_t>(random() % (logits.size() + 3));
    std::vector<TokenLogit> expected;
    for (std::size_t i = 0; i < logits.size(); ++i) {
      std::int64_t larger = 0;
      for (float other : logits) larger += other > logits[i];
      if (top_k == 0 || larger < top_k) expected.push_back({static_cast<std::int32_t>(i), logits[i]});
    }
    const std::vector<TokenLogit> kept = top_logits(logits, top_k);
    ASSERT_EQ(kept.size(), expected.size()) << "trial " << trial << " top_k " << top_k;
    for (std::size_t i = 0; i < kept.size(); ++i) {
      EXPECT_EQ(kept[i].token, expected[i].token) << "trial " << trial;
      EXPECT_EQ(kept[i].logit, expected[i].logit) << "trial " << trial;
      EXPECT_EQ(std::signbit(kept[i].logit), std::signbit(expected[i].logit)) << "the logit as given, -0 too";
    }
    if (std::any_of(logits.begin(), logits.end(), [](float value) { return value != -INFINITY; }) && !kept.empty()) {
      SamplingOptions options{std::uniform_real_distribution<double>(0.3, 2)(random), top_k,
                              trial % 2 == 0 ? 1.0 : 0.7, random()};
      std::mt19937_64 first(options.seed), second(options.seed);
      for (int draw = 0; draw < 20; ++draw) {
        EXPECT_EQ(sample_token(logits, options, first), sample_among(kept, options, second)) << "trial " << trial;
      }
    }
  }
  EXPECT_EQ(error_of([] { top_logits(std::vector<float>{1.0f, NAN}, 1); }), "cannot sample the next token: its logits hold a NaN");
  EXPECT_EQ(error_of([] { top_logits(std::vector<float>{1.0f}, -1); }), "top_k -1 must be >= 0 (0: every token)");
  std::mt19937_64 unused(1);
  EXPECT_EQ(error_of([&] { sample_among(std::vector<TokenLogit>{{3, -INFINITY}}, SamplingOptions{1, 0, 1, 0}, unused); }),
            "cannot sample the next token: every logit is -inf");
}

}  // namespace
}  // namespace metile::testing
