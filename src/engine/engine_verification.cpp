// Model-level verification of the fused GPU engine (verify-model --backend cuda).
//
// Region gates check each region alone on random inputs; a model can still go wrong when many
// regions' small errors compound or when a kernel is right on the gate's inputs and wrong on the
// model's. So the whole decode is compared: the fused engine against the native engine (the same
// step graph, no rewrite, no fusion), teacher-forced (both fed the native path's tokens) over N
// positions, on next-token agreement, KL divergence and logit error.
//
// A fused plan that misses is not kept. Each region kind (plan rule) that runs fused somewhere is
// declined alone (ExecutableOptions::declined_rules: its regions run native), and the figures of
// each trial say how much that kind moved them. The kept plan declines the kinds whose trial alone
// meets the thresholds; when none does, the ones whose trial at least halves the mean KL or
// raises the agreement; when that plan still misses, every fused kind.
#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "metile/engine.h"

namespace metile {

// Written as "not within" so that a NaN figure (a kernel that wrote NaN logits) is a miss.
std::string first_miss(const AgreementFigures& figures, const EngineThresholds& thresholds) {
  if (figures.nonfinite_reference_positions > 0) {
    return fmt::format("the reference path's own logits are not finite at {} of {} positions (the weights, the "
                       "prompt or the reference path itself, not the plan compared)",
                       figures.nonfinite_reference_positions, figures.positions);
  }
  if (figures.decided_agreements != figures.decided_positions) {
    return fmt::format("{} of {} decided next tokens differ (the first at position {})",
                       figures.decided_positions - figures.decided_agreements, figures.decided_positions,
                       figures.first_decided_disagreement);
  }
  if (!(figures.agreement() >= thresholds.min_agreement)) {
    return fmt::format("next-token agreement {:.4f} < {} (first difference at position {})", figures.agreement(),
                       thresholds.min_agreement, figures.first_disagreement);
  }
  if (!(figures.kl_mean <= thresholds.max_kl_mean)) {
    return fmt::format("KL mean {:.3g} > {:.3g}", figures.kl_mean, thresholds.max_kl_mean);
  }
  if (!(figures.kl_max <= thresholds.max_kl)) return fmt::format("KL max {:.3g} > {:.3g}", figures.kl_max, thresholds.max_kl);
  if (!(figures.max_logit_error <= thresholds.max_logit_error)) {
    return fmt::format("logit error {:.3g} > {:.3g}", figures.max_logit_error, thresholds.max_logit_error);
  }
  return {};
}

bool meets(const AgreementFigures& figures, const EngineThresholds& thresholds) {
  return first_miss(figures, thresholds).empty();
}

namespace {

// The step sizes a session runs: single steps, and prefill chunks where its capacity holds one (a
// chunk's step was built and raced at capacity - 16 rows, negative below 16: a step that never runs).
std::vector<std::int64_t> step_sizes(const CudaDecodeSession& session) {
  if (session.capacity() < CudaDecodeSession::kPrefillChunk) return {1};
  return {1, CudaDecodeSession::kPrefillChunk};
}

// Rule -> number of regions whose chosen candidate is fused, over the session's Executables.
std::map<std::string, int> fused_region_kinds(CudaDecodeSession& session) {
  std::map<std::string, int> kinds;
  for (std::int64_t steps : step_sizes(session)) {
    std::map<std::string, int> of_size;
    for (const RegionReport& report : session.executable(steps).reports()) {
      if (report.chosen_id.kind == CandidateKind::fused) ++of_size[report.rule.empty() ? "region" : report.rule];
    }
    for (const auto& [rule, count] : of_size) kinds[rule] = std::max(kinds[rule], count);
  }
  return kinds;
}

}  // namespace

EngineVerification verify_fused_engine(const std::shared_ptr<const CudaModel>& model,
                                       std::span<const std::int32_t> prompt, std::int64_t positions,
                                       const EngineThresholds& thresholds, const ExecutableOptions& base,
                                       const EngineProgress& progress) {
  EngineVerification verification;
  CudaDecodeSession native(model, EngineOptions{EnginePath::native, base, progress});
  const auto compare_with = [&](const std::set<std::string>& declined) {
    EngineOptions options{EnginePath::fused, base, progress};
    options.executable.declined_rules.insert(declined.begin(), declined.end());
    auto fused = std::make_unique<CudaDecodeSession>(model, options);
    // Both step sizes are built up front, so a kind fused only in prefill chunks is seen too.
    for (std::int64_t steps : step_sizes(*fused)) fused->executable(steps);
    native.reset();
    const AgreementFigures figures = compare_sessions(native, *fused, prompt, positions);
    return std::make_pair(figures, std::move(fused));
  };

  auto [full, full_session] = compare_with({});
  verification.full = full;
  const std::map<std::string, int> kinds = fused_region_kinds(*full_session);
  for (const auto& [rule, count] : kinds) verification.fused_rules.push_back(rule);
  verification.report = full_session->executable(1).report();
  // A reference that fails by itself cannot tell which region kind is wrong: no kind is declined for it.
  if (meets(full, thresholds) || full.nonfinite_reference_positions > 0) {
    verification.kept = full;
    verification.passed = meets(full, thresholds);
    return verification;
  }
  full_session.reset();  // its buffers go before the trials allocate theirs

  for (const auto& [rule, count] : kinds) {
    if (progress) progress(fmt::format("metile: verify-model: the fused plan misses ({}); trying it with {} declined",
                                       first_miss(full, thresholds), rule));
    DeclineTrial trial;
    trial.rule = rule;
    trial.regions = count;
    trial.figures = compare_with({rule}).first;
    trial.meets = meets(trial.figures, thresholds);
    verification.trials.push_back(std::move(trial));
  }
  for (const DeclineTrial& trial : verification.trials) {
    if (trial.meets) verification.declined.insert(trial.rule);
  }
  if (verification.declined.empty()) {
    for (const DeclineTrial& trial : verification.trials) {
      if (trial.figures.kl_mean * 2 <= full.kl_mean || trial.figures.agreements > full.agreements) {
        verification.declined.insert(trial.rule);
      }
    }
  }
  if (verification.declined.empty()) verification.declined.insert(verification.fused_rules.begin(), verification.fused_rules.end());
  auto [kept, kept_session] = compare_with(verification.declined);
  if (!meets(kept, thresholds) && verification.declined.size() < verification.fused_rules.size()) {
    verification.declined.insert(verification.fused_rules.begin(), verification.fused_rules.end());
    kept_session.reset();
    std::tie(kept, kept_session) = compare_with(verification.declined);
  }
  verification.kept = kept;
  verification.passed = meets(kept, thresholds);
  verification.report = kept_session->executable(1).report();
  return verification;
}

}  // namespace metile
