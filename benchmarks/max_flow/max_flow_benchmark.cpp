// The solver crossover table (the seed project's max-flow benchmark, grown): for the
// seed's random family and for large structured families, how long each of our engines
// takes, what the dispatch tournament costs and picks, what warm (cached) dispatch costs,
// and how LEMON's Preflow and Boost.Graph's push_relabel / boykov_kolmogorov do on the
// same instance in the same run. Every engine's value is checked against the others.
// The experimental interior-point engine (ipm) gets its own columns: time, interior-point
// iterations and conjugate-gradient steps, its value and cut checked against Dinic's;
// `--ipm-scaling` prints how its iteration count grows with the number of edges instead.
//
//   max_flow_benchmark [--quick] [--family NAME] [--ipm-scaling]
//
// Times are medians of interleaved repeated runs, in milliseconds, and exclude building each
// library's graph; ours include allocating the residual graph (every solve does).
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "metile/flow.h"
#include "network_families.h"

#ifdef METILE_HAVE_BOOST_GRAPH
#include <boost/graph/boykov_kolmogorov_max_flow.hpp>

#include "boost_oracle.h"  // the flow tests' Boost graph of our edges
#include "../support/benchmark_options.h"
#endif
#ifdef METILE_HAVE_LEMON
#include <lemon/preflow.h>
#include <lemon/smart_graph.h>
#endif

namespace {

using metile::flow_families::GeneratedNetwork;
// Wall time by default. On a shared machine `--clock cpu` measures this thread's CPU time
// instead, which other processes do not inflate (the dispatch tournament itself always
// races on wall time, as it must).
bool use_cpu_clock = false;

double now_ms() {
  if (use_cpu_clock) {
    timespec time{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &time);
    return static_cast<double>(time.tv_sec) * 1e3 + static_cast<double>(time.tv_nsec) * 1e-6;
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double elapsed_ms(double start) { return now_ms() - start; }

// Times several calls interleaved and returns each one's median, in the order given. A
// round runs every call once (short calls as a batch of at least 4 ms), so a busy moment on
// a shared machine hits all of them alike. The first run of each is a warm-up and sets its
// number of rounds: calls over a second are timed by that run alone, calls over 50 ms in
// three rounds, shorter ones in five.
std::vector<double> interleaved_medians(const std::vector<std::function<void()>>& runs) {
  const std::size_t count = runs.size();
  std::vector<double> first(count);
  std::vector<int> rounds(count);
  std::vector<int> batch(count);
  std::vector<std::vector<double>> samples(count);
  for (std::size_t i = 0; i < count; ++i) {
    const double start = now_ms();
    runs[i]();
    first[i] = elapsed_ms(start);
    rounds[i] = first[i] >= 1000 ? 0 : first[i] >= 50 ? 3 : 5;
    batch[i] = std::max(1, static_cast<int>(std::ceil(4.0 / std::max(first[i], 1e-4))));
  }
  for (int round = 0; round < 5; ++round) {
    for (std::size_t i = 0; i < count; ++i) {
      if (round >= rounds[i]) continue;
      const double start = now_ms();
      for (int repeat = 0; repeat < batch[i]; ++repeat) runs[i]();
      samples[i].push_back(elapsed_ms(start) / batch[i]);
    }
  }
  std::vector<double> medians(count);
  for (std::size_t i = 0; i < count; ++i) {
    if (samples[i].empty()) {
      medians[i] = first[i];
      continue;
    }
    std::sort(samples[i].begin(), samples[i].end());
    medians[i] = samples[i][samples[i].size() / 2];
  }
  return medians;
}

void check_same_value(const char* who, std::int64_t value, std::int64_t expected,
                      const std::string& instance) {
  if (value != expected) {
    throw std::runtime_error(
        fmt::format("{} found {} but dinic found {} on {}", who, value, expected, instance));
  }
}

// One ipm run, checked against Dinic's value and canonical cut; returns its statistics.
metile::InteriorPointStatistics checked_ipm(const metile::IntegerFlowNetwork& network, int source, int sink,
                                            const metile::MaxFlowResult<std::int64_t>& by_dinic,
                                            const std::string& instance) {
  const metile::MaxFlowResult<std::int64_t> result = metile::ipm(network, source, sink);
  check_same_value("ipm", result.value, by_dinic.value, instance);
  if (result.source_side != by_dinic.source_side) {
    throw std::runtime_error("ipm's minimum cut differs from dinic's on " + instance);
  }
  return *result.interior_point;
}

// ---------------------------------------------------------------- competitors

#ifdef METILE_HAVE_BOOST_GRAPH
class BoostCompetitor {
 public:
  explicit BoostCompetitor(const GeneratedNetwork& network)
      : graph_(metile::testing::make_boost_flow_graph(network.vertex_count, network.edges)) {
    source_ = boost::vertex(network.source, graph_);
    sink_ = boost::vertex(network.sink, graph_);
  }
  std::int64_t push_relabel() { return boost::push_relabel_max_flow(graph_, source_, sink_); }
  std::int64_t boykov_kolmogorov() {
    return boost::boykov_kolmogorov_max_flow(
        graph_, boost::get(boost::edge_capacity, graph_), boost::get(boost::edge_residual_capacity, graph_),
        boost::get(boost::edge_reverse, graph_), boost::get(boost::vertex_index, graph_), source_, sink_);
  }

 private:
  using Graph = metile::testing::BoostFlowGraph<std::int64_t>;
  Graph graph_;
  boost::graph_traits<Graph>::vertex_descriptor source_{};
  boost::graph_traits<Graph>::vertex_descriptor sink_{};
};
#endif

#ifdef METILE_HAVE_LEMON
class LemonCompetitor {
 public:
  explicit LemonCompetitor(const GeneratedNetwork& network) : capacity_(graph_) {
    graph_.reserveNode(network.vertex_count);
    graph_.reserveArc(static_cast<int>(network.edges.size()));
    std::vector<lemon::SmartDigraph::Node> nodes;
    for (int v = 0; v < network.vertex_count; ++v) nodes.push_back(graph_.addNode());
    for (const auto& edge : network.edges) {
      if (edge.from == edge.to) continue;
      capacity_.set(graph_.addArc(nodes[edge.from], nodes[edge.to]), edge.capacity);
    }
    source_ = nodes[network.source];
    sink_ = nodes[network.sink];
  }
  // runMinCut: LEMON's first phase, the same work as our hlpp without edge flows.
  std::int64_t preflow() {
    lemon::Preflow<lemon::SmartDigraph, lemon::SmartDigraph::ArcMap<std::int64_t>> solver(graph_, capacity_,
                                                                                          source_, sink_);
    solver.runMinCut();
    return solver.flowValue();
  }

 private:
  lemon::SmartDigraph graph_;
  lemon::SmartDigraph::ArcMap<std::int64_t> capacity_;
  lemon::SmartDigraph::Node source_;
  lemon::SmartDigraph::Node sink_;
};
#endif

// ---------------------------------------------------------------- one row

struct Instance {
  std::string family;
  std::string shape;
  bool large_structured = false;
  GeneratedNetwork network;
};

// A competitor that is hopeless on a family (Boost's boykov_kolmogorov on layered networks
// grows faster than the square of their size) would blow the five-minute budget on the
// family's larger rows: it is skipped when its time on the family's previous row,
// scaled by the growth in edges to the power 1.5, predicts more than kSkipAboveMs.
constexpr double kSkipAboveMs = 8000;

struct CompetitorTime {
  std::optional<double> ms;  // empty: not built in, or skipped
  bool skipped = false;
};

// Decides from the family's previous row whether to run a competitor at all.
class CompetitorBudget {
 public:
  bool worth_running(const std::string& family, const std::string& competitor, std::size_t edges) const {
    const auto found = previous_.find(family + "/" + competitor);
    if (found == previous_.end()) return true;
    const double growth = static_cast<double>(edges) / static_cast<double>(found->second.first);
    return found->second.second * std::pow(growth, 1.5) <= kSkipAboveMs;
  }
  void record(const std::string& family, const std::string& competitor, std::size_t edges, double ms) {
    previous_[family + "/" + competitor] = {edges, ms};
  }

 private:
  std::map<std::string, std::pair<std::size_t, double>> previous_;  // family/competitor -> edges, ms
};

// ipm runs in the crossover table up to this many edges: the 179k-edge GENRMF row takes it ~9 s
// a run on two cores and the 262k-edge grid more; --ipm-scaling measures its growth.
constexpr std::size_t kIpmMaxEdges = 160000;

struct Row {
  CompetitorTime ipm;
  metile::InteriorPointStatistics ipm_statistics;
  double dinic_ms = 0;
  double hlpp_ms = 0;
  double tuning_ms = 0;
  double warm_auto_ms = 0;
  std::string chosen;
  CompetitorTime lemon;
  CompetitorTime boost_push_relabel;
  CompetitorTime boost_boykov_kolmogorov;
};

Row measure(const Instance& instance, CompetitorBudget& budget) {
  const GeneratedNetwork& generated = instance.network;
  const metile::IntegerFlowNetwork network = generated.integer_network();
  const int source = generated.source;
  const int sink = generated.sink;
  const std::string name = instance.family + " " + instance.shape;
  Row row;
  const metile::MaxFlowResult<std::int64_t> by_dinic = metile::dinic(network, source, sink);
  const std::int64_t expected = by_dinic.value;

  // Tuning: the first dispatch of a network (the tournament), a one-off by nature.
  std::vector<double> tuning;
  for (int sample = 0; sample < 5; ++sample) {
    metile::clear_dispatch_cache();
    const double start = now_ms();
    const metile::MaxFlowResult<std::int64_t> tuned = metile::solve(network, source, sink);
    tuning.push_back(elapsed_ms(start));
    check_same_value("auto", tuned.value, expected, name);
    row.chosen = tuned.solver;
    if (tuning.back() > 20) break;  // one sample of a long tournament is enough
  }
  std::sort(tuning.begin(), tuning.end());
  row.tuning_ms = tuning[tuning.size() / 2];

  std::vector<std::function<void()>> runs{
      [&] { check_same_value("dinic", metile::dinic(network, source, sink).value, expected, name); },
      [&] { check_same_value("hlpp", metile::hlpp(network, source, sink).value, expected, name); },
      [&] {
        const metile::MaxFlowResult<std::int64_t> warm = metile::solve(network, source, sink);
        if (!warm.from_cache && network.vertex_count() >= 32) {
          throw std::runtime_error("warm dispatch missed the cache on " + name);
        }
      }};
  const std::size_t edges = generated.edges.size();
  std::vector<std::pair<std::string, CompetitorTime*>> competitors;
  auto add_competitor = [&](const std::string& competitor, CompetitorTime& time, std::function<void()> run) {
    if (!budget.worth_running(instance.family, competitor, edges)) {
      time.skipped = true;
      return;
    }
    runs.push_back(std::move(run));
    competitors.emplace_back(competitor, &time);
  };
#ifdef METILE_HAVE_LEMON
  LemonCompetitor lemon(generated);
  add_competitor("lemon", row.lemon,
                 [&] { check_same_value("LEMON Preflow", lemon.preflow(), expected, name); });
#endif
#ifdef METILE_HAVE_BOOST_GRAPH
  BoostCompetitor boost_graph(generated);
  add_competitor("boost-pr", row.boost_push_relabel,
                 [&] { check_same_value("Boost push_relabel", boost_graph.push_relabel(), expected, name); });
  add_competitor("boost-bk", row.boost_boykov_kolmogorov, [&] {
    check_same_value("Boost boykov_kolmogorov", boost_graph.boykov_kolmogorov(), expected, name);
  });
#endif
  if (edges <= kIpmMaxEdges) {
    add_competitor("ipm", row.ipm,
                   [&] { row.ipm_statistics = checked_ipm(network, source, sink, by_dinic, name); });
  } else {
    row.ipm.skipped = true;
  }
  const std::vector<double> medians = interleaved_medians(runs);
  row.dinic_ms = medians[0];
  row.hlpp_ms = medians[1];
  row.warm_auto_ms = medians[2];
  for (std::size_t i = 0; i < competitors.size(); ++i) {
    competitors[i].second->ms = medians[3 + i];
    budget.record(instance.family, competitors[i].first, edges, medians[3 + i]);
  }
  return row;
}

std::string show_ms(std::optional<double> ms) {
  if (!ms) return "n/a";
  if (*ms < 0.1) return fmt::format("{:.4f}", *ms);
  if (*ms < 10) return fmt::format("{:.3f}", *ms);
  return fmt::format("{:.1f}", *ms);
}

std::string show_ms(const CompetitorTime& time) {
  if (time.skipped) return "skip";
  return show_ms(time.ms);
}

std::vector<Instance> instances(bool quick, const std::string& only) {
  using namespace metile::flow_families;
  std::vector<Instance> list;
  Random random(20240601);
  auto wanted = [&](const std::string& family) { return only.empty() || only == family; };
  if (wanted("seed-random")) {
    for (const int vertices : {32, 64, 128, 256, 512}) {
      for (const int degree : {2, 6, 12}) {
        list.push_back({"seed-random", fmt::format("n={} d={}", vertices, degree), false,
                        seed_random_network(vertices, degree, random)});
      }
    }
  }
  // Sizes keep the default run under five minutes on two cores: our Dinic, LEMON and Boost
  // grow fast on grids and GENRMF (Dinic needs many phases there), so the largest rows of
  // those families stay near 2-3e5 edges; the layered family goes to ~8e5. --quick divides.
  const int divide = quick ? 4 : 1;
  if (wanted("layered")) {
    for (const auto [layers, width, degree] : {std::array{32, 512, 4}, std::array{64, 2048, 6}}) {
      list.push_back({"layered", fmt::format("{}x{} d={}", layers, width / divide, degree), true,
                      layered_network(layers, width / divide, degree, 1000, random)});
    }
  }
  if (wanted("grid")) {
    for (const auto [rows, columns] : {std::array{128, 128}, std::array{256, 256}}) {
      list.push_back({"grid", fmt::format("{}x{}", rows / divide, columns), true,
                      grid_network(rows / divide, columns, 1000, random)});
    }
  }
  if (wanted("genrmf")) {
    for (const auto [side, frames] : {std::array{8, 256}, std::array{16, 128}}) {
      list.push_back({"genrmf-long", fmt::format("a={} b={}", side, frames / divide), true,
                      genrmf_network(side, frames / divide, 1, 10000, random)});
    }
    const int side = quick ? 24 : 48;
    list.push_back({"genrmf-wide", fmt::format("a={} b={}", side, 16), true,
                    genrmf_network(side, 16, 1, 10000, random)});
  }
  return list;
}

// --ipm-scaling: per family, networks doubling in edges; the interior-point iteration count
// against sqrt(m) (the theory's bound for short-step path following), its CG steps, and
// its time against HLPP and LEMON Preflow on the same network.
void print_ipm_scaling(bool quick, const std::string& only) {
  using namespace metile::flow_families;
  Random random(20240602);
  const int sizes = quick ? 3 : 5;
  std::vector<Instance> list;
  auto wanted = [&](const std::string& family) { return only.empty() || only == family; };
  for (int step = 0; step < sizes; ++step) {
    const int doubling = 1 << step;
    if (wanted("seed-random")) {
      list.push_back({"seed-random", fmt::format("n={} d=6", 256 * doubling), false,
                      seed_random_network(256 * doubling, 6, random)});
    }
    if (wanted("layered")) {
      list.push_back({"layered", fmt::format("16x{} d=4", 16 * doubling), true,
                      layered_network(16, 16 * doubling, 4, 1000, random)});
    }
    if (wanted("grid")) {
      const int side = static_cast<int>(std::lround(16 * std::sqrt(static_cast<double>(doubling))));
      list.push_back({"grid", fmt::format("{}x{}", side, side), true, grid_network(side, side, 1000, random)});
    }
    if (wanted("genrmf")) {
      list.push_back({"genrmf", fmt::format("a=8 b={}", 4 * doubling), true,
                      genrmf_network(8, 4 * doubling, 1, 10000, random)});
    }
  }
  std::stable_sort(list.begin(), list.end(),
                   [](const Instance& a, const Instance& b) { return a.family < b.family; });
  fmt::print("ipm iterations against sqrt(m); times in ms ({} clock, median)\n\n", use_cpu_clock ? "cpu" : "wall");
  fmt::print("{:<12} {:<12} {:>8} {:>7} {:>6} {:>4} {:>7} {:>8} {:>7} {:>9} {:>9} {:>9} {:>8}  {}\n", "family",
             "shape", "vertices", "edges", "sqrt(m)", "it", "it/sqrt", "cg", "cg/solve", "ipm", "hlpp", "lemon",
             "repair", "stop");
  for (const Instance& instance : list) {
    const GeneratedNetwork& generated = instance.network;
    const metile::IntegerFlowNetwork network = generated.integer_network();
    const std::string name = instance.family + " " + instance.shape;
    const metile::MaxFlowResult<std::int64_t> by_dinic = metile::dinic(network, generated.source, generated.sink);
    metile::InteriorPointStatistics statistics;
    std::vector<std::function<void()>> runs{
        [&] { statistics = checked_ipm(network, generated.source, generated.sink, by_dinic, name); },
        [&] {
          check_same_value("hlpp", metile::hlpp(network, generated.source, generated.sink).value, by_dinic.value,
                           name);
        }};
#ifdef METILE_HAVE_LEMON
    LemonCompetitor lemon(generated);
    runs.push_back([&] { check_same_value("LEMON Preflow", lemon.preflow(), by_dinic.value, name); });
#endif
    const std::vector<double> medians = interleaved_medians(runs);
    const double root = std::sqrt(static_cast<double>(generated.edges.size()));
    fmt::print("{:<12} {:<12} {:>8} {:>7} {:>6.0f} {:>4} {:>7.3f} {:>8} {:>7.0f} {:>9} {:>9} {:>9} {:>8}  {}\n",
               instance.family, instance.shape, generated.vertex_count, generated.edges.size(), root,
               statistics.iterations, statistics.iterations / root, statistics.cg_steps,
               static_cast<double>(statistics.cg_steps) / std::max(1, statistics.laplacian_solves),
               show_ms(medians[0]), show_ms(medians[1]), show_ms(medians.size() > 2 ? std::optional(medians[2]) : std::nullopt),
               statistics.repair_paths, statistics.stop_reason);
    std::fflush(stdout);
  }
  fmt::print("\nrepair = augmenting paths from the rounded flow to the maximum\n");
}

}  // namespace

// Why the LEMON goal counted no row: LEMON is not built in, or this run had no large structured row
// (--family seed-random, --quick); the note said "not built in" for both.
static std::string lemon_goals_note(int lemon_goals) {
  if (lemon_goals > 0) return "";
#ifdef METILE_HAVE_LEMON
  return " (this run has no large structured row)";
#else
  return " (LEMON not built in)";
#endif
}

int main(int argc, char** argv) {
  CLI::App app{"max-flow solver crossover: our engines and dispatch against LEMON and Boost.Graph", "max_flow_benchmark"};
  bool quick = false;
  std::string only;
  app.add_flag("--quick", quick, "smaller large instances (a smoke run)");
  app.add_option("--family", only, "only this family: seed-random, layered, grid, genrmf")
      ->check(CLI::IsMember({"seed-random", "layered", "grid", "genrmf"}));
  bool ipm_scaling = false;
  app.add_flag("--ipm-scaling", ipm_scaling,
               "instead of the crossover table: the interior-point engine's iterations and CG steps as the "
               "networks double");
  std::string clock = "wall";
  app.add_option("--clock", clock, "wall (default) or cpu: this thread's CPU time, robust on a busy machine")
      ->check(CLI::IsMember({"wall", "cpu"}));
  if (const std::optional<int> exit_code = metile::benchmarks::parse_benchmark_options(app, argc, argv)) return *exit_code;
  use_cpu_clock = clock == "cpu";
  if (ipm_scaling) {
    print_ipm_scaling(quick, only);
    return 0;
  }

  const auto start = std::chrono::steady_clock::now();
  fmt::print(
      "goal: our best engine no slower than LEMON Preflow on large structured families; "
      "auto within 10% of best after warm-up\n");
  fmt::print(
      "times in ms ({} clock, median); best = faster of dinic/hlpp; competitor = fastest of LEMON Preflow, "
      "Boost "
      "push_relabel, Boost boykov_kolmogorov\n\n",
      clock);
  fmt::print("{:<12} {:<14} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6} {:>6} {:>9} {:>9} {:>9} {:>7}  {:<20} {:>9} {:>4} {:>7} {:>8}\n",
             "family", "shape", "vertices", "edges", "dinic", "hlpp", "tuning", "warm", "w/best", "chosen",
             "lemon", "boost-pr", "boost-bk", "best/cmp", "goal (lemon; auto)", "ipm", "it", "cg", "ipm/fast");
  int lemon_goals = 0;
  int lemon_goals_met = 0;
  int auto_goals_met = 0;
  int rows = 0;
  int ipm_rows = 0;
  int ipm_wins = 0;
  CompetitorBudget budget;
  for (const Instance& instance : instances(quick, only)) {
    const Row row = measure(instance, budget);
    const double best = std::min(row.dinic_ms, row.hlpp_ms);
    std::optional<double> competitor;
    for (const auto& time : {row.lemon.ms, row.boost_push_relabel.ms, row.boost_boykov_kolmogorov.ms}) {
      if (time) competitor = competitor ? std::min(*competitor, *time) : *time;
    }
    const double warm_ratio = row.warm_auto_ms / best;
    const bool auto_met = warm_ratio <= 1.10;
    std::string lemon_goal = "-";
    if (instance.large_structured) {
      if (row.lemon.ms) {
        ++lemon_goals;
        const bool met = best <= *row.lemon.ms;
        lemon_goals_met += met;
        lemon_goal = met ? "met" : fmt::format("MISSED x{:.2f}", best / *row.lemon.ms);
      } else {
        lemon_goal = row.lemon.skipped ? "skip" : "n/a";
      }
    }
    ++rows;
    auto_goals_met += auto_met;
    // ipm/fast: ipm's time over the fastest of everything else in the row (< 1: ipm wins).
    std::string ipm_ratio = "-";
    if (row.ipm.ms) {
      const double fastest = competitor ? std::min(best, *competitor) : best;
      ++ipm_rows;
      ipm_wins += *row.ipm.ms < fastest;
      ipm_ratio = fmt::format("{:.1f}", *row.ipm.ms / fastest);
    }
    const bool ipm_ran = row.ipm.ms.has_value();
    const std::string goals = fmt::format("{}; {}", lemon_goal, auto_met ? "met" : fmt::format("MISSED x{:.2f}", warm_ratio));
    fmt::print(
        "{:<12} {:<14} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6.2f} {:>6} {:>9} {:>9} {:>9} {:>8}  {:<20} {:>9} {:>4} {:>7} {:>8}\n",
        instance.family, instance.shape, instance.network.vertex_count, instance.network.edges.size(),
        show_ms(row.dinic_ms), show_ms(row.hlpp_ms), show_ms(row.tuning_ms), show_ms(row.warm_auto_ms),
        warm_ratio, row.chosen, show_ms(row.lemon), show_ms(row.boost_push_relabel),
        show_ms(row.boost_boykov_kolmogorov), competitor ? fmt::format("{:.2f}", best / *competitor) : "n/a",
        goals, show_ms(row.ipm), ipm_ran ? std::to_string(row.ipm_statistics.iterations) : "-",
        ipm_ran ? std::to_string(row.ipm_statistics.cg_steps) : "-", ipm_ratio);
    std::fflush(stdout);
  }
  fmt::print(
      "\nskip: not run, its time on the family's smaller row predicts more than {:.0f} s (ipm: more than {} "
      "edges)\n"
      "ipm: experimental interior-point engine (never chosen by auto); it = interior-point iterations, cg = "
      "conjugate-gradient steps, ipm/fast = its time over the fastest other engine or library in the row\n"
      "summary: best engine no slower than LEMON Preflow on {}/{} large structured rows{}; "
      "warm auto within 10% of best on {}/{} rows; ipm fastest on {}/{} rows it ran; total {:.1f} s\n",
      kSkipAboveMs / 1000, kIpmMaxEdges, lemon_goals_met, lemon_goals,
      lemon_goals_note(lemon_goals), auto_goals_met, rows, ipm_wins, ipm_rows,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return 0;
}
