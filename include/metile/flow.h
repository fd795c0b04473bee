// metile flow module: exact maximum flow / minimum cut on immutable capacity networks.
// The fusion planner phrases every neighborhood and conflict decision as one s-t min cut;
// this library solves them exactly (Dinic, highest-label push-relabel, measured dispatch;
// an experimental interior-point engine outside dispatch) and reads/writes DIMACS
// max-flow files. It depends on nothing else in metile.
//
//   FlowNetworkBuilder ──build()──► FlowNetwork (CSR, immutable) ──dinic/hlpp/solve──► MaxFlowResult
//                                                                 ──verify──► FlowCheck
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <iosfwd>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "metile/error.h"

namespace metile {

// ---------------------------------------------------------------- networks

// Integer capacities of one network sum to at most this (2^61 - 1): a solver's excess at one
// vertex is bounded by the sum of all capacities, and residual arithmetic adds two of those.
inline constexpr std::int64_t kIntegerCapacitySumLimit = (std::int64_t{1} << 61) - 1;
// A real-valued network holds integer capacities exactly up to this (2^53): beyond, a double
// rounds them, so the DIMACS reader and Python's FlowNetwork refuse them there.
inline constexpr std::int64_t kLargestExactIntegerInDouble = std::int64_t{1} << 53;
// What a network's construction refuses about its totals besides each integer edge's share of
// kIntegerCapacitySumLimit: finite capacities summing to `finite_sum` (within that limit for
// integers) with `infinite_edges` legality edges, whose capacity is derived from the sum, could
// overflow solver arithmetic. The reason ("flow network: ..."), or empty. For callers that add
// edges one at a time and refuse the one that crosses a limit (Python's FlowNetwork).
std::string integer_capacity_totals_problem(std::int64_t finite_sum, int infinite_edges);
std::string real_capacity_totals_problem(double finite_sum, int infinite_edges);

// What a network's construction refuses about one edge (a capacity, a vertex, the sum that edge takes
// past a limit): an InputError that also carries the edge's number, so that a reader that knows where
// the edge came from names that place (the DIMACS reader: the arc's line, not the file's last).
class FlowEdgeError : public InputError {
 public:
  FlowEdgeError(int edge_index, const std::string& message) : InputError(message), edge(edge_index) {}
  int edge;
};

// One input edge. Edges are numbered in the order they were given; results that
// speak of edges (edge_flows, cut_edges) use these numbers.
template <typename Capacity>
struct FlowEdge {
  int from = 0;
  int to = 0;
  Capacity capacity{};
};

// An immutable directed capacity graph stored in CSR form. Every kept input edge
// becomes a forward arc and a paired reverse arc (capacity 0) in the out-list of its
// head, so a solver's residual graph is one array of residual capacities indexed by
// arc; reverse_arc(arc) gives an arc's partner. Self loops are dropped
// from the arcs (they cannot carry flow) but keep their edge number; parallel edges
// are kept. Capacity is std::int64_t or double (the only two instantiations).
template <typename Capacity>
class FlowNetwork {
 public:
  using capacity_type = Capacity;

  FlowNetwork() = default;
  // Throws InputError naming the edge for a vertex out of [0, vertex_count), a
  // negative, NaN or infinite capacity, or (integers) a capacity total that could
  // overflow a solver's arithmetic.
  FlowNetwork(int vertex_count, std::span<const FlowEdge<Capacity>> edges);
  FlowNetwork(int vertex_count, std::initializer_list<FlowEdge<Capacity>> edges);

  int vertex_count() const { return vertex_count_; }
  int edge_count() const { return static_cast<int>(edges_.size()); }  // input edges, self loops included
  const FlowEdge<Capacity>& edge(int edge_index) const { return edges_[edge_index]; }
  std::span<const FlowEdge<Capacity>> edges() const { return edges_; }

  // Sum of the capacities of edges that were not added as infinite (self loops excluded).
  Capacity finite_capacity_sum() const { return finite_capacity_sum_; }
  // The capacity given to infinite (legality) edges: strictly larger than the sum of
  // all finite capacities, so a cut containing one is never minimal unless no finite
  // cut exists. A max-flow value >= infinite_capacity() means "no finite cut".
  Capacity infinite_capacity() const { return infinite_capacity_; }
  bool edge_is_infinite(int edge_index) const { return edge_is_infinite_[edge_index] != 0; }

  // CSR view for solvers. Arcs out of vertex v are [arc_begin(v), arc_begin(v + 1)).
  int arc_count() const { return static_cast<int>(arc_head_.size()); }
  int arc_begin(int vertex) const { return arc_offsets_[vertex]; }
  int arc_end(int vertex) const { return arc_offsets_[vertex + 1]; }
  int arc_head(int arc) const { return arc_head_[arc]; }
  int reverse_arc(int arc) const { return arc_reverse_[arc]; }
  Capacity arc_capacity(int arc) const { return arc_capacity_[arc]; }  // 0 for reverse arcs
  int arc_edge(int arc) const { return arc_edge_[arc]; }               // -1 for reverse arcs
  std::span<const int> arc_offsets() const { return arc_offsets_; }
  std::span<const int> arc_heads() const { return arc_head_; }
  std::span<const int> reverse_arcs() const { return arc_reverse_; }
  std::span<const Capacity> arc_capacities() const { return arc_capacity_; }

  // 64-bit hash of the vertex count, the arc topology and the capacities (the
  // dispatch cache key). Equal networks hash equally.
  std::uint64_t fingerprint() const { return fingerprint_; }

 private:
  template <typename>
  friend class FlowNetworkBuilder;
  void build_storage(std::vector<std::uint8_t> edge_is_infinite);

  int vertex_count_ = 0;
  std::vector<FlowEdge<Capacity>> edges_;
  std::vector<std::uint8_t> edge_is_infinite_;
  Capacity finite_capacity_sum_{};
  Capacity infinite_capacity_{};
  std::vector<int> arc_offsets_{0};
  std::vector<int> arc_head_;
  std::vector<int> arc_reverse_;
  std::vector<Capacity> arc_capacity_;
  std::vector<int> arc_edge_;
  std::uint64_t fingerprint_ = 0;
};

// Incremental construction, for callers that discover vertices as they go (the
// planner). Legality edges are added with add_infinite_edge: their capacity is fixed
// at build() to the network's infinite_capacity(), so adding finite edges later is safe.
template <typename Capacity>
class FlowNetworkBuilder {
 public:
  explicit FlowNetworkBuilder(int vertex_count = 0);

  int add_vertex();             // returns the new vertex's number
  int add_vertices(int count);  // returns the first new vertex's number
  int vertex_count() const { return vertex_count_; }
  // Both return the edge number. Validation happens here, with the edge number in the message.
  int add_edge(int from, int to, Capacity capacity);
  int add_infinite_edge(int from, int to);
  // What add_edge would refuse, refused the same way (FlowEdgeError naming the next edge number),
  // without adding anything: for a caller that must know before it changes state of its own.
  void check_edge(int from, int to, Capacity capacity) const;
  int edge_count() const { return static_cast<int>(edges_.size()); }

  FlowNetwork<Capacity> build() const;

 private:
  int vertex_count_ = 0;
  std::vector<FlowEdge<Capacity>> edges_;
  std::vector<std::uint8_t> edge_is_infinite_;
};

using IntegerFlowNetwork = FlowNetwork<std::int64_t>;
using RealFlowNetwork = FlowNetwork<double>;

// ---------------------------------------------------------------- tolerance

// How two flow quantities are compared, in one place (after LEMON's Tolerance).
// Integers compare exactly. Reals use an absolute epsilon scaled to the network's
// capacities, because conservation errors accumulate in proportion to them.
template <typename Capacity>
struct FlowTolerance {
  Capacity epsilon{};

  bool positive(Capacity value) const { return value > epsilon; }
  bool equal(Capacity a, Capacity b) const { return a - b <= epsilon && b - a <= epsilon; }
  bool less(Capacity a, Capacity b) const { return a + epsilon < b; }

  // Exact for integers; for reals 1e-9 times the largest of 1 and the total finite capacity.
  static FlowTolerance for_network(const FlowNetwork<Capacity>& network);
};

// ---------------------------------------------------------------- solving

// ipm is only ever run when asked for by name: automatic dispatch races Dinic and HLPP alone.
enum class SolverChoice { automatic, dinic, hlpp, ipm };
std::string_view solver_choice_name(SolverChoice choice);  // "auto", "dinic", "hlpp", "ipm"
SolverChoice parse_solver_choice(std::string_view name);   // throws InputError on others

struct MaxFlowOptions {
  // Fill MaxFlowResult::edge_flows. For HLPP this runs the second phase (returning
  // excess to the source); without it HLPP stops once value and cut are known.
  bool edge_flows = false;
  SolverChoice solver = SolverChoice::automatic;  // solve() only
  bool use_cache = true;                          // solve() only: consult and fill the dispatch cache
};

// Median times of the dispatch tournament, present when solve() ran one.
struct TournamentTimes {
  double dinic_median_ms = 0;
  double hlpp_median_ms = 0;
};

// What the interior-point engine did on one run (docs/ipm.md explains each phase).
struct InteriorPointStatistics {
  int iterations = 0;               // interior-point (Newton) iterations
  long long cg_steps = 0;           // conjugate-gradient steps over all Laplacian solves (both racers of a raced one)
  int laplacian_solves = 0;         // two per iteration (predictor and corrector)
  int unconverged_solves = 0;       // solves stopped at the step cap before their tolerance
  std::string stop_reason;          // "duality gap", "stalled", "iteration limit" or "no s-t path"
  double duality_gap = 0;           // complementarity gap x'z + (u-x)'w at the stop, capacity units
  double rounded_value = 0;         // value of the rounded flow once it conserves, before the repair
  long long conservation_fixes = 0; // path and cycle reductions that made the rounded flow conserve
  long long repair_paths = 0;       // augmenting paths from the rounded flow to the maximum
  int repair_phases = 0;            // shortest-path phases those paths took
};

template <typename Capacity>
struct MaxFlowResult {
  Capacity value{};
  // source_side[v]: v is reachable from the source in the final residual graph; these
  // vertices are the source side of a minimum cut (the smallest one).
  std::vector<bool> source_side;
  // Flow on every input edge (0 on self loops); empty unless options.edge_flows.
  std::vector<Capacity> edge_flows;
  std::string solver;                         // "dinic", "hlpp" or "ipm": the engine that produced this result
  bool from_cache = false;                    // solve(): the engine was picked by the dispatch cache
  std::optional<TournamentTimes> tournament;  // solve(): set when this call ran the tournament
  std::optional<InteriorPointStatistics> interior_point;  // set by the ipm engine

  std::vector<int> source_side_vertices() const;  // sorted vertex numbers with source_side true
};

// Each throws InputError when source or sink is out of range or source == sink.
// Dinic: O(V^2 E) worst case, far less on the planner's networks; BFS levels and an
// iterative (stack-based) blocking-flow DFS with current-arc pointers.
template <typename Capacity>
MaxFlowResult<Capacity> dinic(const FlowNetwork<Capacity>& network, int source, int sink,
                              const MaxFlowOptions& options = {});
// Highest-label push-relabel, O(V^2 sqrt(E)), with the gap heuristic and periodic
// global relabeling (reverse BFS from the sink). Phase one computes the value and the
// minimum cut; phase two (only with options.edge_flows) turns the preflow into a flow.
template <typename Capacity>
MaxFlowResult<Capacity> hlpp(const FlowNetwork<Capacity>& network, int source, int sink,
                             const MaxFlowOptions& options = {});
// Experimental interior-point engine (docs/ipm.md): a primal-dual path-following method
// on the max-flow LP whose Newton steps are electrical flows (weighted Laplacian solves
// by conjugate gradient, preconditioned on a spanning tree), stopped on the duality gap; the
// fractional flow is rounded (integers) or snapped (reals), made to conserve by path and
// cycle reductions, and repaired by shortest augmenting paths to the exact maximum, so
// value and cut equal Dinic's. Never chosen by automatic dispatch.
template <typename Capacity>
MaxFlowResult<Capacity> ipm(const FlowNetwork<Capacity>& network, int source, int sink,
                            const MaxFlowOptions& options = {});
// Dispatch: options.solver picks the engine (ipm only this way); automatic uses Dinic below 32 vertices,
// otherwise the engine the cache remembers for this network's fingerprint, otherwise a
// three-round order-interleaved tournament (Dinic kept unless HLPP's median time is at
// least 10% lower). The engines must agree on the value, or std::runtime_error.
template <typename Capacity>
MaxFlowResult<Capacity> solve(const FlowNetwork<Capacity>& network, int source, int sink,
                              const MaxFlowOptions& options = {});

// The dispatch cache (process-wide, thread-safe, least recently used entries evicted
// beyond dispatch_cache_capacity).
inline constexpr std::size_t dispatch_cache_capacity = 4096;
void clear_dispatch_cache();
std::size_t dispatch_cache_size();

// ---------------------------------------------------------------- a cut kept current

// A minimum s-t cut of an integer network kept current while vertices are forced to the sink side
// one at a time (the planner's resource-limit drops: an op kept out is an infinite edge into the
// sink). Forcing only raises capacity into the sink, so the flow found so far stays feasible and
// the next cut augments from it (Dinic's phases from the current residual graph) instead of from
// zero. Each source_side() equals dinic()'s on the network with an infinite edge from every vertex
// forced so far to the sink: the smallest minimum cut's source side is the same for every maximum
// flow. Forcing a vertex that the source reaches by infinite edges leaves no finite cut (value()
// >= the network's infinite capacity), as dinic() would say.
class IncrementalMinCut {
 public:
  // Throws InputError as dinic() does for the terminals, and as FlowNetworkBuilder::build for the
  // network. Each other vertex gets an edge to the sink, closed until it is forced.
  IncrementalMinCut(FlowNetworkBuilder<std::int64_t> network, int source, int sink);

  // Throws InputError for a vertex out of range or the source, and where the network with one more
  // infinite edge would be refused (its capacity totals, as FlowNetworkBuilder::build checks them:
  // a closed edge counts only once forced); the sink, or a vertex forced already, changes nothing.
  void force_to_sink(int vertex);
  // After augmenting to a maximum flow, if a force came since the last one.
  const std::vector<bool>& source_side();
  std::int64_t value();
  // Augmenting paths and Dinic phases over the cut's life (the first maximum flow included).
  long long augmenting_paths() const { return paths_; }
  int phases() const { return phases_; }

 private:
  void augment();

  FlowNetwork<std::int64_t> network_;
  int source_ = 0;
  int sink_ = 0;
  std::vector<int> sink_arc_;           // per vertex: its closed arc to the sink; -1 for the terminals and once forced
  int infinite_edges_ = 0;              // the network's, and the forced ones
  std::vector<std::int64_t> residual_;  // per arc; a sink arc not forced is closed (0 both ways)
  std::int64_t value_ = 0;
  bool current_ = false;
  std::vector<bool> source_side_;
  long long paths_ = 0;
  int phases_ = 0;
};

// ---------------------------------------------------------------- checking

struct FlowCheck {
  bool ok = true;
  std::string problem;  // empty when ok; otherwise what is wrong and where
  explicit operator bool() const { return ok; }
};

// Checks that source_side has the source and not the sink and that its cut capacity
// equals result.value; with edge_flows also capacity constraints on every edge,
// conservation at every vertex but source and sink, and the net outflow of the
// source equal to result.value. Tolerance defaults to FlowTolerance::for_network.
template <typename Capacity>
FlowCheck verify(const FlowNetwork<Capacity>& network, int source, int sink,
                 const MaxFlowResult<Capacity>& result,
                 std::optional<FlowTolerance<Capacity>> tolerance = std::nullopt);

// Capacity of the edges leaving a vertex set (side[v] true) toward its complement.
template <typename Capacity>
Capacity cut_capacity(const FlowNetwork<Capacity>& network, const std::vector<bool>& side);
// Input edge numbers crossing from side to its complement, ascending.
template <typename Capacity>
std::vector<int> cut_edges(const FlowNetwork<Capacity>& network, const std::vector<bool>& side);

// ---------------------------------------------------------------- DIMACS files

template <typename Capacity>
struct FlowProblem {
  FlowNetwork<Capacity> network;
  int source = 0;  // 0-based here; DIMACS files are 1-based
  int sink = 0;
};

// DIMACS max-flow format: `c` comments, one `p max N M`, `n ID s`, `n ID t`, then M
// lines `a U V CAP`, vertices 1-based. Every malformed line throws InputError
// "FILE:LINE: message". The integer reader rejects capacities written as reals and
// integers beyond int64; the real reader rejects integer-written capacities above
// 2^53 (a double would round them). The declared counts must fit the text (one
// line per arc; at most max(2^20, 2 arcs + 2) vertices) and half the machine's memory.
template <typename Capacity>
FlowProblem<Capacity> read_dimacs_max_flow(std::istream& input, std::string_view file_name);
template <typename Capacity>
void write_dimacs_max_flow(std::ostream& output, const FlowProblem<Capacity>& problem);

// Reads a file (at most kMaximumDimacsFileBytes, metile/io.h): an integer problem
// when every capacity is written as an integer (digits only), otherwise a real one.
// Throws InputError when the file cannot be opened or is a directory.
using AnyFlowProblem = std::variant<FlowProblem<std::int64_t>, FlowProblem<double>>;
AnyFlowProblem read_dimacs_max_flow_file(const std::filesystem::path& path);

}  // namespace metile
