// Reduction laws: every obligation of the three laws holds; planted wrong laws
// fail exactly the obligation they break; certificates round-trip through JSON;
// LawEvaluator agrees with a direct float64 computation (seed printed).
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <random>

#include "metile/discovery.h"
#include "metile_test_support.h"

namespace metile {
namespace {

std::map<std::string, bool> holds_by_name(const Certificate& certificate) {
  std::map<std::string, bool> result;
  for (const Obligation& obligation : certificate.obligations) result[obligation.name] = obligation.holds;
  return result;
}

const std::map<std::string, bool> all_hold = {
    {"left_identity", true}, {"right_identity", true}, {"associativity", true}, {"merge_of_lifts", true}};

TEST(ReductionLaws, EveryObligationOfTheThreeLawsHolds) {
  for (const ReductionLaw& law : {sum_law(), max_law(), stable_weighted_softmax_law()}) {
    const Certificate certificate = prove(law);
    EXPECT_EQ(certificate.law, law.name);
    EXPECT_EQ(certificate.theory, theory_text());
    EXPECT_EQ(holds_by_name(certificate), all_hold) << certificate.to_json();
    EXPECT_TRUE(certificate.verified);
    for (const Obligation& obligation : certificate.obligations) EXPECT_EQ(obligation.lhs, obligation.rhs) << obligation.name;
  }
}

TEST(ReductionLaws, SoftmaxObligationsShowTheirNormalForms) {
  const Certificate certificate = prove(stable_weighted_softmax_law());
  ASSERT_EQ(certificate.obligations.size(), 4u);
  const Obligation& merge_of_lifts = certificate.obligations[3];
  EXPECT_EQ(merge_of_lifts.lhs,
            "(m: max(e1.s, e2.s), l: exp(e1.s - max(e1.s, e2.s)) + exp(e2.s - max(e1.s, e2.s)), "
            "o: e1.v*exp(e1.s - max(e1.s, e2.s)) + e2.v*exp(e2.s - max(e1.s, e2.s)))");
  EXPECT_EQ(certificate.obligations[0].lhs, "(m: x.m, l: x.l, o: x.o)");
}

TEST(ReductionLaws, MergeWithoutRescalingFailsOnlyTheMergeOfLifts) {
  ReductionLaw wrong = stable_weighted_softmax_law();
  wrong.name = "softmax_without_rescaling";
  wrong.merge[1] = Term::add(Term::variable("a.l"), Term::variable("b.l"));
  wrong.merge[2] = Term::add(Term::variable("a.o"), Term::variable("b.o"));
  const Certificate certificate = prove(wrong);
  EXPECT_FALSE(certificate.verified);
  EXPECT_EQ(holds_by_name(certificate), (std::map<std::string, bool>{{"left_identity", true},
                                                                       {"right_identity", true},
                                                                       {"associativity", true},
                                                                       {"merge_of_lifts", false}}));
  const Obligation& failed = certificate.obligations[3];
  EXPECT_EQ(failed.lhs.substr(0, 28), "(m: max(e1.s, e2.s), l: 2, o") << failed.lhs;
  EXPECT_NE(failed.by.find("differs where"), std::string::npos) << failed.by;
}

TEST(ReductionLaws, WrongIdentityFailsTheIdentities) {
  ReductionLaw wrong = max_law();
  wrong.name = "max_with_zero_identity";
  wrong.identity = {Term::constant(0)};
  EXPECT_EQ(holds_by_name(prove(wrong)), (std::map<std::string, bool>{{"left_identity", false},
                                                                       {"right_identity", false},
                                                                       {"associativity", true},
                                                                       {"merge_of_lifts", true}}));
}

TEST(ReductionLaws, NonAssociativeMergeFailsAssociativity) {
  ReductionLaw wrong = sum_law();
  wrong.name = "difference";
  wrong.merge = {Term::subtract(Term::variable("a.t"), Term::variable("b.t"))};
  wrong.pair = {Term::subtract(Term::variable("e1.x"), Term::variable("e2.x"))};
  wrong.identity = {Term::constant(0)};
  const auto holds = holds_by_name(prove(wrong));
  EXPECT_FALSE(holds.at("associativity"));
  EXPECT_FALSE(holds.at("left_identity"));  // 0 - x != x
  EXPECT_TRUE(holds.at("right_identity"));
  EXPECT_TRUE(holds.at("merge_of_lifts"));
}

TEST(ReductionLaws, CertificateRoundTripsThroughJson) {
  const Certificate certificate = prove(stable_weighted_softmax_law());
  EXPECT_EQ(Certificate::from_json(certificate.to_json()), certificate);
  EXPECT_THROW(Certificate::from_json("{\"law\": 3}"), InputError);
  // The reason is said without nlohmann's "[json.exception...]" prefix (it leaked into `metile run`'s error).
  EXPECT_EQ(testing::error_of([] { Certificate::from_json("garbage"); }).rfind(
                "not a certificate (a JSON object of law, theory, obligations and verified): invalid JSON: parse error at line 1, column 1", 0),
            0u);
  EXPECT_EQ(testing::error_of([] { Certificate::from_json("{\"law\": \"x\"}"); }),
            "not a certificate (a JSON object of law, theory, obligations and verified): key 'theory' not found");
  EXPECT_EQ(find_law("stable_weighted_softmax")->name, "stable_weighted_softmax");
  EXPECT_EQ(find_law("nope"), nullptr);
}

TEST(LawEvaluator, BlockedSoftmaxEqualsDirectFloat64) {
  const std::uint64_t seed = testing::test_seed("LawEvaluator.BlockedSoftmaxEqualsDirectFloat64");  // printed; METILE_TEST_SEED replays it
  std::mt19937_64 generator(seed);
  std::uniform_real_distribution<double> uniform(-4, 4);
  const int count = 37;
  const int lanes = 5;
  std::vector<double> scores(count);
  std::vector<std::vector<double>> values(count, std::vector<double>(lanes));
  for (int j = 0; j < count; ++j) {
    scores[j] = uniform(generator);
    for (double& value : values[j]) value = uniform(generator);
  }
  // The oracle: softmax weights from the exact maximum, f64.
  double maximum = -INFINITY;
  for (double score : scores) maximum = std::max(maximum, score);
  double normalizer = 0;
  std::vector<double> expected(lanes, 0.0);
  for (int j = 0; j < count; ++j) {
    const double weight = std::exp(scores[j] - maximum);
    normalizer += weight;
    for (int lane = 0; lane < lanes; ++lane) expected[lane] += weight * values[j][lane];
  }
  for (double& value : expected) value /= normalizer;

  const LawEvaluator law(stable_weighted_softmax_law(), lanes);
  ASSERT_EQ(law.state_size(), 2u + lanes);
  ASSERT_EQ(law.element_size(), 1u + lanes);
  for (int block : {1, 4, 16, 64}) {
    std::vector<double> total = law.identity();
    std::vector<double> element(law.element_size());
    std::vector<double> lifted(law.state_size());
    for (int first = 0; first < count; first += block) {
      std::vector<double> partial = law.identity();
      for (int j = first; j < std::min(count, first + block); ++j) {
        element[0] = scores[j];
        std::copy(values[j].begin(), values[j].end(), element.begin() + 1);
        law.lift(element, lifted);
        law.merge_into(partial, lifted);
      }
      law.merge_into(total, partial);
    }
    std::vector<double> result(lanes);
    law.finalize(total, result);
    for (int lane = 0; lane < lanes; ++lane) EXPECT_NEAR(result[lane], expected[lane], 1e-12) << "block " << block;
  }
}

TEST(LawEvaluator, IdentityMergedWithIdentityStaysTheIdentity) {
  const LawEvaluator law(stable_weighted_softmax_law(), 2);
  std::vector<double> state = law.identity();
  law.merge_into(state, law.identity());
  EXPECT_EQ(state[0], -INFINITY);
  EXPECT_EQ(state[1], 0.0);
  std::vector<double> out(2);
  law.finalize(state, out);
  EXPECT_TRUE(std::isnan(out[0])) << "no element: 0 / 0, as softmax over an all -inf row";
}

TEST(LawEvaluator, SumAndMaxLaws) {
  const LawEvaluator sum(sum_law(), 1);
  const LawEvaluator maximum(max_law(), 1);
  std::vector<double> total = sum.identity();
  std::vector<double> largest = maximum.identity();
  std::vector<double> lifted(1);
  for (double x : {3.0, -1.0, 7.5, 2.0}) {
    sum.lift(std::vector<double>{x}, lifted);
    sum.merge_into(total, lifted);
    maximum.lift(std::vector<double>{x}, lifted);
    maximum.merge_into(largest, lifted);
  }
  EXPECT_EQ(total[0], 11.5);
  EXPECT_EQ(largest[0], 7.5);
}

}  // namespace
}  // namespace metile
