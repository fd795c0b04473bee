// solve(): measured engine choice. Neither engine wins everywhere and density alone does
// not predict the winner, so networks of 32 vertices or more race: three rounds in
// interleaved order (dinic,hlpp / hlpp,dinic / dinic,hlpp) on fresh residual graphs,
// median times compared, HLPP kept only with at least 10% headroom so timing noise
// cannot flip the reference engine. The winner is remembered per network fingerprint.
// The experimental interior-point engine (ipm.cpp) never races and is never cached: it
// runs only when a caller names it.
#include <algorithm>
#include <array>
#include <chrono>
#include <list>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "capacity_text.h"
#include "residual_graph.h"

namespace metile {
namespace {

constexpr int kTournamentMinimumVertices = 32;
constexpr double kHlppHeadroom = 0.90;  // HLPP must take at most 90% of Dinic's time

// A bounded least-recently-used map from network fingerprint to the winning engine.
class DispatchCache {
 public:
  std::optional<SolverChoice> find(std::uint64_t key) {
    std::lock_guard lock(mutex_);
    const auto found = index_.find(key);
    if (found == index_.end()) return std::nullopt;
    order_.splice(order_.begin(), order_, found->second);  // now most recently used
    return found->second->second;
  }

  void store(std::uint64_t key, SolverChoice choice) {
    std::lock_guard lock(mutex_);
    const auto found = index_.find(key);
    if (found != index_.end()) {
      found->second->second = choice;
      order_.splice(order_.begin(), order_, found->second);
      return;
    }
    order_.emplace_front(key, choice);
    index_[key] = order_.begin();
    if (order_.size() > dispatch_cache_capacity) {
      index_.erase(order_.back().first);
      order_.pop_back();
    }
  }

  void clear() {
    std::lock_guard lock(mutex_);
    order_.clear();
    index_.clear();
  }

  std::size_t size() {
    std::lock_guard lock(mutex_);
    return order_.size();
  }

 private:
  std::mutex mutex_;
  std::list<std::pair<std::uint64_t, SolverChoice>> order_;
  std::unordered_map<std::uint64_t, std::list<std::pair<std::uint64_t, SolverChoice>>::iterator> index_;
};

DispatchCache& dispatch_cache() {
  static DispatchCache cache;
  return cache;
}

template <typename Capacity>
MaxFlowResult<Capacity> run_engine(SolverChoice engine, const FlowNetwork<Capacity>& network, int source,
                                   int sink, const MaxFlowOptions& options) {
  switch (engine) {
    case SolverChoice::hlpp:
      return hlpp(network, source, sink, options);
    case SolverChoice::ipm:  // only when named: the tournament and the cache know Dinic and HLPP alone
      return ipm(network, source, sink, options);
    case SolverChoice::automatic:
    case SolverChoice::dinic:
      break;
  }
  return dinic(network, source, sink, options);
}

double median(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  const std::size_t middle = samples.size() / 2;
  return samples.size() % 2 == 1 ? samples[middle] : (samples[middle - 1] + samples[middle]) / 2;
}

// The race. Three refinements keep it cheap without changing what it decides:
//  - a solve shorter than kWarmUpBelowMs is a warm-up, then repeats until kMinimumSampleMs
//    has passed (the sample is the mean), so microsecond networks are timed above clock,
//    cache and scheduler noise;
//  - once an engine has produced a value, a later run is stopped at kStopFactor times the
//    other engine's slowest sample: it has lost that round by far more than the headroom,
//    and the bound is recorded as its time;
//  - the third round is skipped when it cannot change the outcome.
template <typename Capacity>
MaxFlowResult<Capacity> run_tournament(const FlowNetwork<Capacity>& network, int source, int sink,
                                       const MaxFlowOptions& options) {
  using Clock = flow_detail::Deadline::Clock;
  constexpr double kMinimumSampleMs = 0.05;
  constexpr double kWarmUpBelowMs = 1.0;
  constexpr double kStopFactor = 2.0;
  constexpr std::array<std::array<SolverChoice, 2>, 3> kRounds{{{SolverChoice::dinic, SolverChoice::hlpp},
                                                                {SolverChoice::hlpp, SolverChoice::dinic},
                                                                {SolverChoice::dinic, SolverChoice::hlpp}}};
  const FlowTolerance<Capacity> tolerance = FlowTolerance<Capacity>::for_network(network);
  std::array<std::vector<double>, 2> samples;  // milliseconds, indexed by engine: 0 dinic, 1 hlpp
  std::array<std::optional<MaxFlowResult<Capacity>>, 2> latest;
  auto index_of = [](SolverChoice engine) { return engine == SolverChoice::hlpp ? 1 : 0; };

  for (int round = 0; round < 3; ++round) {
    for (const SolverChoice engine : kRounds[round]) {
      const int self = index_of(engine);
      const std::vector<double>& others = samples[1 - self];
      std::optional<double> stop_after_ms;
      if (latest[self] && !others.empty()) {
        stop_after_ms = kStopFactor * *std::max_element(others.begin(), others.end());
      }
      auto run_once = [&]() -> bool {
        std::optional<Clock::time_point> deadline;
        if (stop_after_ms) {
          deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double, std::milli>(*stop_after_ms));
        }
        const flow_detail::Deadline stop(deadline);
        std::optional<MaxFlowResult<Capacity>> result =
            engine == SolverChoice::hlpp ? flow_detail::hlpp_until(network, source, sink, options, stop)
                                         : flow_detail::dinic_until(network, source, sink, options, stop);
        if (!result) return false;
        latest[self] = std::move(result);
        return true;
      };
      auto start = Clock::now();
      bool stopped = !run_once();
      double elapsed_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
      int runs = 1;
      if (!stopped && elapsed_ms < kWarmUpBelowMs) {
        // A cheap solve right after the other engine ran is mostly cold caches and branch
        // predictors: let it warm up, then time a batch.
        runs = 0;
        start = Clock::now();
        do {
          stopped = !run_once();
          elapsed_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
          ++runs;
        } while (!stopped && elapsed_ms < kMinimumSampleMs);
      }
      samples[self].push_back(stopped ? *stop_after_ms : elapsed_ms / runs);
    }
    if (!tolerance.equal(latest[0]->value, latest[1]->value)) {
      throw std::runtime_error("max-flow dispatch: dinic found " + capacity_text(latest[0]->value) +
                               " but hlpp found " + capacity_text(latest[1]->value) +
                               " on the same network (fingerprint " + std::to_string(network.fingerprint()) +
                               ")");
    }
    if (round == 1) {
      const auto [dinic_low, dinic_high] = std::minmax(samples[0][0], samples[0][1]);
      const auto [hlpp_low, hlpp_high] = std::minmax(samples[1][0], samples[1][1]);
      const bool hlpp_certain = hlpp_high <= kHlppHeadroom * dinic_low;
      const bool dinic_certain = hlpp_low > kHlppHeadroom * dinic_high;
      if (hlpp_certain || dinic_certain) break;
    }
  }
  const TournamentTimes times{median(samples[0]), median(samples[1])};
  const bool hlpp_wins = times.hlpp_median_ms <= kHlppHeadroom * times.dinic_median_ms;
  MaxFlowResult<Capacity> winner = std::move(*latest[hlpp_wins ? 1 : 0]);
  winner.tournament = times;
  return winner;
}

}  // namespace

template <typename Capacity>
MaxFlowResult<Capacity> solve(const FlowNetwork<Capacity>& network, int source, int sink,
                              const MaxFlowOptions& options) {
  flow_detail::check_terminals(network, source, sink, "solve");
  if (options.solver != SolverChoice::automatic)
    return run_engine(options.solver, network, source, sink, options);
  if (network.vertex_count() < kTournamentMinimumVertices) return dinic(network, source, sink, options);

  // The key covers the terminals and whether flows are wanted (HLPP's second phase can change
  // the winner) too. A 64-bit collision would only pick an engine; both are exact.
  std::uint64_t key = network.fingerprint();
  key ^= (static_cast<std::uint64_t>(source) * 0x9e3779b97f4a7c15ULL) ^
         (static_cast<std::uint64_t>(sink) * 0xc2b2ae3d27d4eb4fULL + 0x165667b19e3779f9ULL) ^
         (options.edge_flows ? 0x27d4eb2f165667c5ULL : 0);
  if (options.use_cache) {
    if (const std::optional<SolverChoice> cached = dispatch_cache().find(key)) {
      MaxFlowResult<Capacity> result = run_engine(*cached, network, source, sink, options);
      result.from_cache = true;
      return result;
    }
  }
  MaxFlowResult<Capacity> result = run_tournament(network, source, sink, options);
  if (options.use_cache)
    dispatch_cache().store(key, result.solver == "hlpp" ? SolverChoice::hlpp : SolverChoice::dinic);
  return result;
}

void clear_dispatch_cache() { dispatch_cache().clear(); }
std::size_t dispatch_cache_size() { return dispatch_cache().size(); }

template MaxFlowResult<std::int64_t> solve(const FlowNetwork<std::int64_t>&, int, int, const MaxFlowOptions&);
template MaxFlowResult<double> solve(const FlowNetwork<double>&, int, int, const MaxFlowOptions&);

}  // namespace metile
