// The measured-dispatch engine (choose_measured) on the CPU, with fake candidates: each has a
// made-up gate result and a made-up score, and `measure` returns the scores of exactly the
// candidates it is asked about while recording who raced. The policy (admission, stored
// decisions, headroom, dispatch modes) is checked against a separately written statement of it
// on random races, and on the cases that pin each rule.
#include <gtest/gtest.h>

#include <cstdlib>
#include <array>
#include <map>
#include <random>

#include "metile/dispatch.h"
#include "metile_test_support.h"

namespace metile {
namespace {

struct Fake {
  MeasuredCandidate candidate;
  double ms;
};

NumericGateResult gate(bool passed) {
  NumericGateResult result;
  result.passed = passed;
  result.threshold = 1e-2;
  if (!passed) {
    result.relative_l2 = 0.5;
    result.detail = "relative L2 error 5.0e-01 > 1.0e-02";
  }
  return result;
}

Fake native(std::string variant, double ms, bool library_path = true, bool passed = true) {
  return {{CandidateId::native(std::move(variant)), gate(passed), library_path}, ms};
}
Fake fused(std::string variant, double ms, bool passed = true) {
  return {{CandidateId::fused(std::move(variant)), gate(passed), false}, ms};
}

struct Race {
  MeasuredChoice choice;
  std::vector<int> raced;  // empty when nothing was measured
};

Race run(const std::vector<Fake>& fakes, DispatchPolicy policy, const std::optional<DispatchDecision>& stored = {}) {
  std::vector<MeasuredCandidate> candidates;
  for (const Fake& fake : fakes) candidates.push_back(fake.candidate);
  Race race;
  race.choice = choose_measured(candidates, policy, stored, [&](const std::vector<int>& entrants) {
    race.raced = entrants;
    std::vector<double> scores;
    for (int index : entrants) scores.push_back(fakes[static_cast<std::size_t>(index)].ms);
    return scores;
  });
  return race;
}

TEST(CandidateId, NamesAndIdentityAreTyped) {
  EXPECT_EQ(CandidateId::native().name(), "native");
  EXPECT_EQ(CandidateId::native().as_graph().name(), "native graph");
  EXPECT_EQ(CandidateId::fused("register_resident w4 t1 f2 db").as_graph().name(),
            "fused register_resident w4 t1 f2 db graph");
  // A variant that reads like a prefix of another is another candidate.
  EXPECT_NE(CandidateId::fused("wide"), CandidateId::fused());
  EXPECT_NE(CandidateId::fused(), CandidateId::fused().as_graph());
  EXPECT_EQ(CandidateId::fused("wide").as_graph().eager(), CandidateId::fused("wide"));
  // "native graph" as a variant is not the native path replayed as a CUDA graph.
  EXPECT_NE(CandidateId::native("graph"), CandidateId::native().as_graph());
}

TEST(MeasuredChoice, FusedNeedsTheHeadroom) {
  const DispatchPolicy policy{DispatchMode::automatic, 0.10};
  Race close = run({native("", 1.0), fused("", 0.95)}, policy);
  EXPECT_EQ(close.choice.chosen, 0) << close.choice.reason;
  EXPECT_NE(close.choice.reason.find("only 1.05x, needs 1.10x"), std::string::npos) << close.choice.reason;
  Race clear = run({native("", 1.0), fused("", 0.8)}, policy);
  EXPECT_EQ(clear.choice.chosen, 1) << clear.choice.reason;
  EXPECT_EQ(clear.choice.best_native, 0);
  EXPECT_EQ(clear.choice.best_fused, 1);
  EXPECT_NE(clear.choice.reason.find("fused, 1.25x over native"), std::string::npos) << clear.choice.reason;
  EXPECT_TRUE(clear.choice.worth_storing);
  // The incumbent is the fastest native candidate, whatever its variant.
  Race graphs = run({native("", 1.0), {{CandidateId::native().as_graph(), gate(true), true}, 0.5}, fused("", 0.48)},
                    policy);
  EXPECT_EQ(graphs.choice.chosen, 1) << graphs.choice.reason;
  EXPECT_EQ(boundary_headroom(1), 0.05);
  EXPECT_EQ(boundary_headroom(6), 0.10);
}

TEST(MeasuredChoice, TheGateAdmitsAndTheLibraryPathStays) {
  const DispatchPolicy policy{DispatchMode::automatic, 0.10};
  // A fast fused candidate that failed the gate never races.
  Race failed = run({native("", 1.0), fused("", 0.1, false), fused("wide", 0.7)}, policy);
  EXPECT_EQ(failed.raced, (std::vector<int>{0, 2}));
  EXPECT_EQ(failed.choice.chosen, 2);
  EXPECT_NE(failed.choice.reason.find("fused failed the numeric gate by 5.0e-01"), std::string::npos)
      << failed.choice.reason;
  // The library path stays whatever its gate figures; a generated unfused kernel does not.
  Race library = run({native("", 1.0, true, false), native("unfused gemv", 0.5, false, false), fused("", 2.0)}, policy);
  EXPECT_EQ(library.raced, (std::vector<int>{0, 2}));
  EXPECT_EQ(library.choice.chosen, 0);
  // Nothing fused passed: the native path, and the race is not worth remembering.
  Race none = run({native("", 1.0), native("", 0.9), fused("", 0.1, false)}, policy);
  EXPECT_EQ(none.choice.best_fused, -1);
  EXPECT_EQ(none.choice.chosen, 1);
  EXPECT_FALSE(none.choice.worth_storing);
  // Nothing admitted at all.
  Race nobody = run({native("unfused gemv", 1.0, false, false)}, policy);
  EXPECT_EQ(nobody.choice.chosen, -1);
  EXPECT_NE(nobody.choice.reason.find("no candidate passed"), std::string::npos) << nobody.choice.reason;
  // One admitted candidate is taken without measuring.
  Race alone = run({native("", 1.0), fused("", 0.1, false)}, policy);
  EXPECT_TRUE(alone.raced.empty());
  EXPECT_EQ(alone.choice.chosen, 0);
}

TEST(MeasuredChoice, DispatchModesForceTheKind) {
  const std::vector<Fake> fakes = {native("", 1.0), native("", 0.9), fused("", 0.95), fused("wide", 0.99)};
  Race forced_native = run(fakes, {DispatchMode::native, 0.10});
  EXPECT_EQ(forced_native.raced, (std::vector<int>{0, 1}));
  EXPECT_EQ(forced_native.choice.chosen, 1);
  Race forced_fused = run(fakes, {DispatchMode::fused, 0.10});
  EXPECT_EQ(forced_fused.choice.chosen, 2) << "the fastest fused, though under the headroom";
  EXPECT_NE(forced_fused.choice.reason.find("METILE_DISPATCH=fused"), std::string::npos);
}

TEST(MeasuredChoice, AStoredDecisionIsMatchedByIdentity) {
  const DispatchPolicy policy{DispatchMode::automatic, 0.10};
  const std::vector<Fake> fakes = {native("", 1.0), fused("", 0.5), fused("wide", 0.6)};
  DispatchDecision stored{"k", CandidateId::fused("wide"), {{CandidateId::fused("wide"), 0.25}}, "fused wide, 4.00x"};
  Race cached = run(fakes, policy, stored);
  EXPECT_TRUE(cached.raced.empty()) << "no measurement";
  EXPECT_TRUE(cached.choice.from_cache);
  EXPECT_EQ(cached.choice.chosen, 2);
  EXPECT_EQ(cached.choice.score_ms[2], 0.25);
  EXPECT_EQ(cached.choice.reason, "fused wide, 4.00x");
  // A stored name that only shares a prefix with a candidate ("fused wide graph" vs "fused wide")
  // is another candidate: measured afresh.
  stored.chosen = CandidateId::fused("wide").as_graph();
  Race other = run(fakes, policy, stored);
  EXPECT_FALSE(other.choice.from_cache);
  EXPECT_EQ(other.choice.chosen, 1);
  // A stored candidate that has since failed the gate is not taken.
  stored.chosen = CandidateId::fused();
  Race regressed = run({native("", 1.0), fused("", 0.5, false)}, policy, stored);
  EXPECT_FALSE(regressed.choice.from_cache);
  EXPECT_EQ(regressed.choice.chosen, 0);
  // decision_of stores what the choice measured, by identity.
  const DispatchDecision decision = decision_of("key", {fakes[0].candidate, fakes[1].candidate, fakes[2].candidate},
                                                other.choice);
  EXPECT_EQ(decision.chosen, CandidateId::fused());
  ASSERT_EQ(decision.timings_ms.size(), 3u);
  EXPECT_EQ(decision.timings_ms[2].first, CandidateId::fused("wide"));
  EXPECT_EQ(decision.timings_ms[2].second, 0.6);
}

// The policy restated independently: the admitted set, then fastest native vs fastest fused.
int expected_choice(const std::vector<Fake>& fakes, const DispatchPolicy& policy) {
  int best_native = -1, best_fused = -1;
  for (std::size_t i = 0; i < fakes.size(); ++i) {
    const MeasuredCandidate& c = fakes[i].candidate;
    const bool fused_kind = c.id.kind == CandidateKind::fused;
    if (!(c.gate.passed || c.library_path) || (policy.mode == DispatchMode::native && fused_kind)) continue;
    int& best = fused_kind ? best_fused : best_native;
    if (best < 0 || fakes[i].ms < fakes[static_cast<std::size_t>(best)].ms) best = static_cast<int>(i);
  }
  if (best_fused < 0) return best_native;
  if (best_native < 0 || policy.mode == DispatchMode::fused) return best_fused;
  return fakes[static_cast<std::size_t>(best_native)].ms >= fakes[static_cast<std::size_t>(best_fused)].ms * (1 + policy.headroom)
             ? best_fused
             : best_native;
}

TEST(MeasuredChoice, RandomRacesFollowThePolicy) {
  std::mt19937_64 random(testing::test_seed("MeasuredChoice.RandomRacesFollowThePolicy"));
  std::uniform_real_distribution<double> time(0.1, 2.0);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<Fake> fakes;
    const int count = 1 + static_cast<int>(random() % 6);
    for (int i = 0; i < count; ++i) {
      const bool is_fused = random() % 2 == 0;
      const std::string variant = std::to_string(i);
      fakes.push_back(is_fused ? fused(variant, time(random), random() % 4 != 0)
                               : native(variant, time(random), random() % 2 == 0, random() % 3 != 0));
    }
    const DispatchMode mode = std::array{DispatchMode::automatic, DispatchMode::native, DispatchMode::fused}[random() % 3];
    const DispatchPolicy policy{mode, random() % 2 == 0 ? 0.05 : 0.10};
    const Race race = run(fakes, policy);
    ASSERT_EQ(race.choice.chosen, expected_choice(fakes, policy)) << "trial " << trial << ": " << race.choice.reason;
  }
}

// prefetch_twin_candidate: the chosen shape with " prefetch<rounds>" appended, raced (any score), in
// its eager form; step_race_candidate prefers it to the near tie.
TEST(MeasuredChoice, ThePrefetchTwinIsTheChosenShapeWithItsWeightsPrefetched) {
  const std::vector<std::pair<std::string, double>> scores = {
      {"native", 10.0},
      {"fused gemv w16 t1 f1 db", 5.0},
      {"fused gemv w16 t1 f1 db graph", 4.9},
      {"fused gemv w16 t1 f1 db prefetch4 graph", 7.5},  // slower alone: raced in the step all the same
      {"fused gemv w16 t1 f1 db x-async", 5.05},
      {"fused gemv w8 t1 f2 db", 5.1},
      {"fused gemv w8 t1 f2 db prefetch", 5.0},  // no round count: not a twin
      {"fused gemv w8 t1 f2 db prefetch3 x-async", 5.0},  // another shape
      {"fused gemv w4 t1 f2 db prefetch2", -1.0}};  // not scored (refused by the gate): not raced
  EXPECT_EQ(prefetch_twin_candidate(scores, "fused gemv w16 t1 f1 db graph"),
            std::optional<std::string>("fused gemv w16 t1 f1 db prefetch4"));
  EXPECT_EQ(prefetch_twin_candidate(scores, "fused gemv w16 t1 f1 db"),
            std::optional<std::string>("fused gemv w16 t1 f1 db prefetch4"));
  EXPECT_EQ(prefetch_twin_candidate(scores, "fused gemv w8 t1 f2 db"), std::nullopt);
  EXPECT_EQ(prefetch_twin_candidate(scores, "fused gemv w4 t1 f2 db"), std::nullopt);
  EXPECT_EQ(prefetch_twin_candidate(scores, "fused gemv w16 t1 f1 db prefetch4"), std::nullopt);  // the twin itself
  EXPECT_EQ(prefetch_twin_candidate(scores, "native"), std::nullopt);
  // The twin first; without one, the near tie (the x-async shape is within 5% of 4.9 only with 5.05 <= 5.145).
  EXPECT_EQ(step_race_candidate(scores, "fused gemv w16 t1 f1 db graph", 0.05),
            std::optional<std::string>("fused gemv w16 t1 f1 db prefetch4"));
  EXPECT_EQ(step_race_candidate(scores, "fused gemv w8 t1 f2 db", 0.05), near_tie_candidate(scores, "fused gemv w8 t1 f2 db", 0.05));
  EXPECT_TRUE(step_race_candidate(scores, "fused gemv w8 t1 f2 db", 0.05).has_value());
  EXPECT_EQ(step_race_candidate(scores, "native", 0.5), std::nullopt);
  // Two stages: " prefetchN" after the name is the down stage's twin alone, not the region's; the near tie races.
  const std::vector<std::pair<std::string, double>> mlp = {
      {"fused gemv register_resident w4 t1 f1 db + w16 t1 f1 db", 10.0},
      {"fused gemv register_resident w4 t1 f1 db + w16 t1 f1 db prefetch5", 10.1},
      {"fused gemv register_resident w4 t1 f1 db prefetch2 + w16 t1 f1 db", 10.2},
      {"fused gemv register_resident w4 t1 f2 batch + w16 t1 f1 db", 10.3}};
  EXPECT_EQ(prefetch_twin_candidate(mlp, "fused gemv register_resident w4 t1 f1 db + w16 t1 f1 db"), std::nullopt);
  EXPECT_EQ(step_race_candidate(mlp, "fused gemv register_resident w4 t1 f1 db + w16 t1 f1 db", 0.05),
            std::optional<std::string>("fused gemv register_resident w4 t1 f1 db + w16 t1 f1 db prefetch5"));  // as a near tie
}

// near_tie_candidate: the fastest fused candidate with other kernels than the chosen one (its CUDA-graph
// form is the same kernels), within the margin; never a native one. Random score lists against a
// brute-force oracle written from the definition.
TEST(MeasuredChoice, TheNearTieIsTheFastestOtherFusedKernelWithinTheMargin) {
  const std::vector<std::pair<std::string, double>> scores = {
      {"native", 10.0}, {"native graph", 9.0}, {"fused a", 9.6}, {"fused a graph", 9.5},
      {"fused b", 9.9}, {"fused b graph", 10.2}, {"fused c", 9.8}};
  EXPECT_EQ(near_tie_candidate(scores, "fused a graph", 0.05), std::optional<std::string>("fused c"));
  EXPECT_EQ(near_tie_candidate(scores, "fused a graph", 0.02), std::nullopt);  // 9.8 > 9.5 x 1.02
  EXPECT_EQ(near_tie_candidate(scores, "fused c", 0.05), std::optional<std::string>("fused a"));  // its graph form, 9.5
  EXPECT_EQ(near_tie_candidate(scores, "native graph", 0.5), std::nullopt);  // native chosen: no fused near tie
  EXPECT_EQ(near_tie_candidate(scores, "fused z", 0.5), std::nullopt);       // not raced
  EXPECT_EQ(near_tie_candidate({{"fused a", 1.0}, {"fused a graph", 1.01}}, "fused a", 0.5), std::nullopt);
  // The default fused variant is named "fused" alone (CandidateId::fused()).
  const std::vector<std::pair<std::string, double>> rows = {{"native", 2.0}, {"fused", 1.0}, {"fused graph", 1.02},
                                                            {"fused wide", 1.03}, {"fused wide graph", 1.1}};
  EXPECT_EQ(near_tie_candidate(rows, "fused", 0.05), std::optional<std::string>("fused wide"));
  EXPECT_EQ(near_tie_candidate(rows, "fused wide", 0.05), std::optional<std::string>("fused"));

  std::mt19937_64 random(testing::test_seed("MeasuredChoice near ties"));
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<std::pair<std::string, double>> timings;
    const int kernels = 1 + static_cast<int>(random() % 5);
    for (int k = 0; k < kernels; ++k) {
      // Kernel 0 is sometimes the default fused variant, named "fused" alone.
      const std::string name = k == 0 && random() % 3 == 0 ? std::string("fused")
                               : (random() % 4 == 0 ? "native " : "fused ") + std::string(1, static_cast<char>('a' + k));
      const double ms = 1.0 + static_cast<double>(random() % 40) / 100.0;  // ties happen
      timings.emplace_back(name, ms);
      if (random() % 2 == 0) timings.emplace_back(name + " graph", ms + static_cast<double>(random() % 5) / 100.0 - 0.02);
    }
    std::shuffle(timings.begin(), timings.end(), random);
    const std::string chosen = timings[random() % timings.size()].first;
    const double margin = static_cast<double>(random() % 10) / 100.0;
    // Oracle: for every other fused kernel, its best score; the smallest (then the first name) if within the margin.
    auto kernels_of = [](const std::string& name) {
      return name.size() > 6 && name.substr(name.size() - 6) == " graph" ? name.substr(0, name.size() - 6) : name;
    };
    double chosen_ms = 0;
    for (const auto& [name, ms] : timings) if (name == chosen) chosen_ms = ms;
    std::map<std::string, double> best;
    for (const auto& [name, ms] : timings) {
      const std::string kernel = kernels_of(name);
      if ((kernel != "fused" && kernel.rfind("fused ", 0) != 0) || kernel == kernels_of(chosen)) continue;
      if (!best.contains(kernel) || ms < best[kernel]) best[kernel] = ms;
    }
    std::optional<std::string> expected;
    double expected_ms = 0;
    if (kernels_of(chosen) == "fused" || kernels_of(chosen).rfind("fused ", 0) == 0) {
      for (const auto& [kernel, ms] : best) {  // std::map: names in order, so the first name wins a tie
        if (ms <= chosen_ms * (1 + margin) && (!expected || ms < expected_ms)) {
          expected = kernel;
          expected_ms = ms;
        }
      }
    }
    ASSERT_EQ(near_tie_candidate(timings, chosen, margin), expected) << "trial " << trial << " chosen " << chosen;
  }
}

}  // namespace
}  // namespace metile
