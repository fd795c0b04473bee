// The one measured-dispatch engine (dispatch.h, "the measured choice"): admission by the numeric
// gate, a stored decision, one race, the headroom rule, and the sentence that says why. It never
// touches a device itself: the caller's `measure` runs the tournament, so the whole policy is
// tested on the CPU with fake candidates (tests/unit/dispatch).
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "metile/dispatch.h"

namespace metile {

std::string_view candidate_kind_name(CandidateKind kind) {
  return kind == CandidateKind::native ? "native" : "fused";
}

std::string CandidateId::name() const {
  std::string text(candidate_kind_name(kind));
  if (!variant.empty()) text += " " + variant;
  if (replay == Replay::cuda_graph) text += " graph";
  return text;
}

double boundary_headroom(std::size_t nodes) { return nodes == 1 ? 0.05 : 0.10; }

namespace {

std::string gate_failure(const MeasuredCandidate& candidate) {
  const double error = std::max(candidate.gate.relative_l2, candidate.gate.relative_max);
  return std::isfinite(error) && error > 0
             ? fmt::format("{} failed the numeric gate by {:.1e} ({})", candidate.id.name(), error, candidate.gate.detail)
             : fmt::format("{} failed the numeric gate ({})", candidate.id.name(), candidate.gate.detail);
}

std::string microseconds(double ms) { return fmt::format("{:.1f} us", ms * 1e3); }

}  // namespace

MeasuredChoice choose_measured(const std::vector<MeasuredCandidate>& candidates, const DispatchPolicy& policy,
                               const std::optional<DispatchDecision>& stored, const MeasureCandidates& measure) {
  MeasuredChoice choice;
  choice.score_ms.assign(candidates.size(), -1.0);
  std::vector<int> admitted;
  std::string first_failure;
  bool fused_failed = false;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const MeasuredCandidate& candidate = candidates[i];
    const bool allowed = policy.mode != DispatchMode::native || candidate.id.kind == CandidateKind::native;
    if (!candidate.gate.passed && !candidate.library_path) {
      if (candidate.id.kind == CandidateKind::fused) fused_failed = true;
      if (first_failure.empty()) first_failure = gate_failure(candidate);
      continue;
    }
    if (allowed) admitted.push_back(static_cast<int>(i));
  }
  if (admitted.empty()) {
    choice.reason = first_failure.empty() ? "no candidate" : "no candidate passed: " + first_failure;
    return choice;
  }
  auto name = [&](int index) { return candidates[static_cast<std::size_t>(index)].id.name(); };
  auto is_fused = [&](int index) { return candidates[static_cast<std::size_t>(index)].id.kind == CandidateKind::fused; };

  // A stored decision for an admitted candidate: take it, with its recorded scores.
  if (stored) {
    const auto found = std::find_if(admitted.begin(), admitted.end(), [&](int index) {
      return candidates[static_cast<std::size_t>(index)].id == stored->chosen;
    });
    if (found != admitted.end()) {
      choice.chosen = *found;
      choice.from_cache = true;
      for (const auto& [id, ms] : stored->timings_ms) {
        for (std::size_t i = 0; i < candidates.size(); ++i) {
          if (candidates[i].id == id) choice.score_ms[i] = ms;
        }
      }
      choice.reason = stored->report;
      return choice;
    }
  }

  if (admitted.size() > 1) {
    const std::vector<double> scores = measure(admitted);
    if (scores.size() != admitted.size()) throw std::logic_error("choose_measured: measure returned the wrong count");
    for (std::size_t k = 0; k < admitted.size(); ++k) choice.score_ms[static_cast<std::size_t>(admitted[k])] = scores[k];
  }
  auto ms = [&](int index) { return choice.score_ms[static_cast<std::size_t>(index)]; };
  for (int index : admitted) {
    int& best = is_fused(index) ? choice.best_fused : choice.best_native;
    if (best < 0 || (ms(index) >= 0 && ms(index) < ms(best))) best = index;
  }
  const int native = choice.best_native;
  const int fused = choice.best_fused;
  const std::string failures = fused_failed ? "; " + first_failure : std::string();

  if (admitted.size() == 1) {
    choice.chosen = admitted.front();
    choice.reason = policy.mode == DispatchMode::native ? fmt::format("{} (METILE_DISPATCH=native)", name(choice.chosen))
                    : first_failure.empty()           ? name(choice.chosen)
                                                       : fmt::format("{}: {}", name(choice.chosen), first_failure);
  } else if (fused < 0) {
    choice.chosen = native;
    choice.reason = fmt::format("{} ({}){}{}", name(native), microseconds(ms(native)),
                                policy.mode == DispatchMode::native ? ", METILE_DISPATCH=native" : "",
                                fused_failed ? "; " + first_failure : ", no fused candidate");
  } else if (native < 0) {
    choice.chosen = fused;
    choice.reason = fmt::format("{} ({}), no native candidate{}", name(fused), microseconds(ms(fused)), failures);
  } else {
    const double speedup = ms(native) / ms(fused);
    if (policy.mode == DispatchMode::fused) {
      choice.chosen = fused;
      choice.reason = fmt::format("{} (METILE_DISPATCH=fused), {:.2f}x over {}", name(fused), speedup, name(native));
    } else if (beats_with_headroom(ms(fused), ms(native), policy.headroom)) {
      choice.chosen = fused;
      choice.reason = fmt::format("{}, {:.2f}x over {} ({} vs {})", name(fused), speedup, name(native),
                                  microseconds(ms(fused)), microseconds(ms(native)));
    } else {
      choice.chosen = native;
      choice.reason = fmt::format("{}: best fused ({}) only {:.2f}x, needs {:.2f}x", name(native), name(fused), speedup,
                                  1.0 + policy.headroom);
    }
    choice.reason += failures;
  }
  // A race is worth remembering unless a fused candidate failed and none passed: a failing
  // candidate is re-examined next time (its source, or the code around it, may change).
  choice.worth_storing = admitted.size() > 1 && !(fused_failed && fused < 0);
  return choice;
}

DispatchDecision decision_of(const std::string& key, const std::vector<MeasuredCandidate>& candidates,
                             const MeasuredChoice& choice) {
  DispatchDecision decision;
  decision.key = key;
  if (choice.chosen >= 0) decision.chosen = candidates[static_cast<std::size_t>(choice.chosen)].id;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    if (choice.score_ms[i] >= 0) decision.timings_ms.emplace_back(candidates[i].id, choice.score_ms[i]);
  }
  decision.report = choice.reason;
  return decision;
}

std::string eager_candidate_name(const std::string& name) {
  constexpr std::string_view kGraphSuffix = " graph";
  return name.ends_with(kGraphSuffix) ? name.substr(0, name.size() - kGraphSuffix.size()) : name;
}

namespace {
// "fused" alone is the default fused variant (CandidateId::fused()); "fused wide", "fused gemv ..." others.
bool is_fused_name(const std::string& kernels) { return kernels == "fused" || kernels.starts_with("fused "); }
}  // namespace

std::optional<std::string> near_tie_candidate(const std::vector<std::pair<std::string, double>>& timings_ms,
                                              const std::string& chosen, double margin) {
  const std::string chosen_eager = eager_candidate_name(chosen);
  double chosen_ms = -1;
  for (const auto& [name, ms] : timings_ms) {
    if (name == chosen) chosen_ms = ms;
  }
  if (chosen_ms <= 0 || !is_fused_name(chosen_eager)) return std::nullopt;
  std::optional<std::string> best;
  double best_ms = chosen_ms * (1 + margin);
  for (const auto& [name, ms] : timings_ms) {
    const std::string kernels = eager_candidate_name(name);
    if (!is_fused_name(kernels) || kernels == chosen_eager || ms <= 0 || ms > best_ms) continue;
    if (best && ms == best_ms && kernels > *best) continue;  // ties: the first name in order, whatever the list's order
    best = kernels;
    best_ms = ms;
  }
  return best;
}

std::optional<std::string> prefetch_twin_candidate(const std::vector<std::pair<std::string, double>>& timings_ms,
                                                   const std::string& chosen) {
  const std::string chosen_eager = eager_candidate_name(chosen);
  // A region of several stages ("gemv A + B") has no one twin: " prefetchN" appended to its name
  // would be the last stage's alone.
  if (!is_fused_name(chosen_eager) || chosen_eager.find(" + ") != std::string::npos) return std::nullopt;
  const std::string prefix = chosen_eager + " prefetch";
  for (const auto& [name, ms] : timings_ms) {
    const std::string kernels = eager_candidate_name(name);
    if (ms <= 0 || kernels.size() <= prefix.size() || !kernels.starts_with(prefix)) continue;
    const std::string_view rounds = std::string_view(kernels).substr(prefix.size());
    if (std::all_of(rounds.begin(), rounds.end(), [](char c) { return c >= '0' && c <= '9'; })) return kernels;
  }
  return std::nullopt;
}

std::optional<std::string> step_race_candidate(const std::vector<std::pair<std::string, double>>& timings_ms,
                                               const std::string& chosen, double margin) {
  if (std::optional<std::string> twin = prefetch_twin_candidate(timings_ms, chosen)) return twin;
  return near_tie_candidate(timings_ms, chosen, margin);
}

}  // namespace metile
