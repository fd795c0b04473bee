// Python binding of the flow module: FlowNetwork, a mutable network over any hashable
// vertices whose minimum_cut(source, sink, solver) returns (value, frozenset of the
// source side). The C++ FlowNetwork is immutable and numbers its vertices 0..n-1, so
// this class keeps the vertex <-> number map and FlowNetworkBuilders, and builds an
// immutable network per solve.
//
// Capacities: while every capacity is a Python int the network is solved in exact
// 64-bit integers and the value is an int; the first float switches it to doubles
// and the value is a float. Validation (negative, NaN, infinite capacities) is the C++
// builder's, at add_edge, so a mistake is reported where it was made; so are the limits
// the C++ network checks only when built: integer capacities summing past
// kIntegerCapacitySumLimit, the totals its infinite edges derive from
// (integer_/real_capacity_totals_problem), and integers past kLargestExactIntegerInDouble
// in a network that is (or would become) real-valued, where a double would round them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "metile/flow.h"

namespace metile::python {
namespace {

class PythonFlowNetwork {
 public:
  // Returns the number of the new edge. Leaves the network unchanged when it raises (but for a new
  // vertex whose __hash__ raised the second time it was called: it may stay named, with no edge).
  int add_edge(const py::object& from, const py::object& to, const py::object& given_capacity) {
    const py::object capacity = python_number(given_capacity);
    const bool integer_capacity = py::isinstance<py::int_>(capacity) && !py::isinstance<py::bool_>(capacity);
    if (!integer_capacity && !py::isinstance<py::float_>(capacity)) {
      throw py::type_error("FlowNetwork.add_edge: capacity must be an int or a float, got " +
                           python_type_name(capacity));
    }
    std::optional<std::int64_t> integer_value;
    if (integer_capacity) {
      try {
        integer_value = capacity.cast<std::int64_t>();
      } catch (const py::cast_error&) {
        throw py::value_error("FlowNetwork.add_edge: capacity " + std::string(py::repr(capacity)) +
                              " does not fit in a 64-bit integer");
      }
    }
    const double real_value = integer_value ? static_cast<double>(*integer_value) : capacity.cast<double>();
    const std::string what = "FlowNetwork.add_edge: capacity " + std::string(py::repr(capacity));
    const bool real_network = !integer_edges_ || !integer_value;
    if (real_network && integer_value && *integer_value > kLargestExactIntegerInDouble) {
      throw py::value_error(what + ": an integer above 2^53 in a real-valued network would be rounded (add it as a float to accept that)");
    }
    if (!integer_value && integer_edges_ && largest_integer_ > kLargestExactIntegerInDouble) {
      throw py::value_error(what + ": a float makes the network real-valued, and its integer capacity " +
                            std::to_string(largest_integer_) + " (above 2^53) would be rounded");
    }
    const auto check = [&](int from_vertex, int to_vertex) {
      // What the builders refuse (a negative, NaN or infinite capacity), then the totals the network's
      // construction checks. A self loop is dropped when built and counts for nothing.
      if (!real_network) integer_builder_.check_edge(from_vertex, to_vertex, *integer_value);
      real_builder_.check_edge(from_vertex, to_vertex, real_value);
      if (from_vertex == to_vertex) return;
      if (!real_network) {
        if (*integer_value > kIntegerCapacitySumLimit - integer_sum_) {
          throw py::value_error(what + ": the integer capacities would sum to more than " +
                                std::to_string(kIntegerCapacitySumLimit) + " (solver arithmetic could overflow)");
        }
        refuse_totals(what, integer_capacity_totals_problem(integer_sum_ + *integer_value, infinite_edges_));
      } else {
        refuse_totals(what, real_capacity_totals_problem(real_sum_ + real_value, infinite_edges_));
      }
    };
    return add_edge_with(from, to, check, [&](int from_vertex, int to_vertex) {
      int edge_number = 0;
      if (!real_network) {
        edge_number = integer_builder_.add_edge(from_vertex, to_vertex, *integer_value);
        real_builder_.add_edge(from_vertex, to_vertex, real_value);
      } else {
        edge_number = real_builder_.add_edge(from_vertex, to_vertex, real_value);
        integer_edges_ = false;  // from here on only the real builder is kept current
      }
      if (from_vertex != to_vertex) {
        if (!real_network) {
          integer_sum_ += *integer_value;
          largest_integer_ = std::max(largest_integer_, *integer_value);
        }
        real_sum_ += real_value;
      }
      return edge_number;
    });
  }

  int add_infinite_edge(const py::object& from, const py::object& to) {
    const auto check = [&](int from_vertex, int to_vertex) {
      if (from_vertex == to_vertex) return;  // a self loop is dropped when built
      refuse_totals("FlowNetwork.add_infinite_edge",
                    integer_edges_ ? integer_capacity_totals_problem(integer_sum_, infinite_edges_ + 1)
                                   : real_capacity_totals_problem(real_sum_, infinite_edges_ + 1));
    };
    return add_edge_with(from, to, check, [&](int from_vertex, int to_vertex) {
      if (integer_edges_) integer_builder_.add_infinite_edge(from_vertex, to_vertex);
      const int edge_number = real_builder_.add_infinite_edge(from_vertex, to_vertex);
      if (from_vertex != to_vertex) ++infinite_edges_;
      return edge_number;
    });
  }

  py::tuple minimum_cut(const py::object& source, const py::object& sink, const Utf8Text& solver) const {
    MaxFlowOptions options;
    options.solver = parse_solver_choice(solver.value);
    const std::optional<int> source_vertex = find_vertex(source);
    const std::optional<int> sink_vertex = find_vertex(sink);
    if (source_vertex == sink_vertex && (source_vertex || source.equal(sink))) {
      // Checked here too so that the message names the vertex, not its internal number.
      throw py::value_error("FlowNetwork.minimum_cut: source and sink are the same vertex " +
                            std::string(py::repr(source)));
    }
    // A vertex no edge names is an isolated vertex of the network (as in the seed's FlowNetwork):
    // nothing flows, and an isolated source is alone on its side.
    const py::object zero = integer_edges_ ? py::object(py::int_(0)) : py::object(py::float_(0.0));
    if (!source_vertex) return py::make_tuple(zero, py::frozenset(py::make_tuple(source)));
    if (!sink_vertex) {
      // The cut is then the one of a network with one more, unreachable, vertex as the sink.
      auto with_isolated_sink = [&](auto builder) {
        const int isolated = builder.add_vertex();
        return solve(builder.build(), *source_vertex, isolated, options);
      };
      if (integer_edges_) {
        const auto result = with_isolated_sink(integer_builder_);
        return py::make_tuple(result.value, source_side(result.source_side));
      }
      const auto result = with_isolated_sink(real_builder_);
      return py::make_tuple(result.value, source_side(result.source_side));
    }
    if (integer_edges_) {
      const MaxFlowResult<std::int64_t> result =
          solve(integer_builder_.build(), *source_vertex, *sink_vertex, options);
      return py::make_tuple(result.value, source_side(result.source_side));
    }
    const MaxFlowResult<double> result = solve(real_builder_.build(), *source_vertex, *sink_vertex, options);
    return py::make_tuple(result.value, source_side(result.source_side));
  }

  int vertex_count() const { return static_cast<int>(py::len(vertex_numbers_)); }
  int edge_count() const { return real_builder_.edge_count(); }
  bool exact() const { return integer_edges_; }

 private:
  // Numbers the endpoints (new ones get fresh numbers), calls check(from, to), which throws where the
  // edge is refused, names the new endpoints and calls add(from, to), which adds the edge to the
  // builders and refuses nothing. New endpoints get numbers in both builders first; if the edge is
  // refused they stay behind as isolated vertices that no Python object maps to, which keeps the
  // builders' numbering in step without a rollback and leaves the network as the user sees it
  // unchanged.
  template <typename CheckEdge, typename AddEdge>
  int add_edge_with(const py::object& from, const py::object& to, CheckEdge check, AddEdge add) {
    // Looking a vertex up runs its __hash__ and __eq__, Python code that may call back into this
    // network: an edge added from there was attached to a vertex number the outer call then gave
    // away again (the cut lost it without a word). Such a call is refused.
    if (adding_edge_) {
      throw py::value_error("FlowNetwork.add_edge: called while another add_edge of this network looks its "
                            "vertices up (from a vertex's __hash__ or __eq__)");
    }
    struct Adding {
      bool& flag;
      explicit Adding(bool& adding) : flag(adding) { flag = true; }
      ~Adding() { flag = false; }
      Adding(const Adding&) = delete;
      Adding& operator=(const Adding&) = delete;
    } adding(adding_edge_);
    // Hash both endpoints before touching anything: an unhashable vertex is a TypeError
    // from Python itself, and the network must stay as it was.
    const std::optional<int> from_number = find_vertex(from);
    const std::optional<int> to_number = find_vertex(to);
    // A new self loop (u == v, both unseen) names one new vertex, not two.
    const bool new_self_loop = !from_number && !to_number && from.equal(to);
    const int from_vertex = from_number ? *from_number : reserve_vertex();
    const int to_vertex = to_number ? *to_number : (new_self_loop ? from_vertex : reserve_vertex());
    // Everything that can refuse the edge is asked before a new endpoint is named, and the edge is
    // added after: naming runs the vertex's __hash__ (and __eq__) again, and one that raised there left
    // the edge added to a vertex no object named; taking a name back would run them once more. Where
    // naming the second endpoint raises, the first stays named with no edge: an isolated vertex, which
    // no cut counts.
    check(from_vertex, to_vertex);
    if (!from_number) publish_vertex(from, from_vertex);
    if (!to_number && !new_self_loop) publish_vertex(to, to_vertex);
    return add(from_vertex, to_vertex);
  }

  std::optional<int> find_vertex(const py::object& vertex) const {
    // dict.get hashes the key and raises TypeError for an unhashable one.
    const py::object number = vertex_numbers_.attr("get")(vertex);
    if (number.is_none()) return std::nullopt;
    return number.cast<int>();
  }

  int reserve_vertex() {
    real_builder_.add_vertex();
    vertex_objects_.emplace_back();
    return integer_builder_.add_vertex();
  }

  void publish_vertex(const py::object& vertex, int number) {
    vertex_numbers_[vertex] = number;
    vertex_objects_[static_cast<std::size_t>(number)] = vertex;
  }

  py::frozenset source_side(const std::vector<bool>& side) const {
    py::set vertices;
    for (std::size_t number = 0; number < side.size(); ++number) {
      if (side[number] && vertex_objects_[number]) vertices.add(vertex_objects_[number]);
    }
    return py::frozenset(vertices);
  }

  py::dict vertex_numbers_;                 // vertex object -> number
  bool adding_edge_ = false;                // add_edge_with is looking vertices up (Python code may run)
  std::vector<py::object> vertex_objects_;  // number -> vertex object (null for a rejected edge's endpoint)
  FlowNetworkBuilder<std::int64_t> integer_builder_;
  FlowNetworkBuilder<double> real_builder_;
  bool integer_edges_ = true;
  std::int64_t integer_sum_ = 0;      // of the finite integer capacities (self loops dropped)
  std::int64_t largest_integer_ = 0;  // the largest of them
  double real_sum_ = 0;               // of every finite capacity (self loops dropped)
  int infinite_edges_ = 0;            // legality edges (self loops dropped)

  static void refuse_totals(const std::string& what, const std::string& problem) {
    if (!problem.empty()) throw py::value_error(what + ": " + problem);
  }
};

}  // namespace

void bind_flow(py::module_& module) {
  py::class_<PythonFlowNetwork>(
      module, "FlowNetwork",
      "A directed capacity network over hashable vertices. add_edge(u, v, capacity) adds one edge (parallel "
      "edges add up); minimum_cut(source, sink) solves it exactly. All-int capacities are solved in 64-bit "
      "integers (int value); any float capacity makes the network real-valued (float value).")
      .def(py::init<>())
      .def("add_edge", &PythonFlowNetwork::add_edge, py::arg("u"), py::arg("v"), py::arg("capacity"),
           "Adds the edge u -> v; returns its number (0, 1, ... in the order added). capacity is an int or a "
           "float (numpy integer and floating scalars too). ValueError for a negative, NaN or infinite "
           "capacity, integer capacities summing past 2^61 - 1, or an integer above 2^53 in a real-valued "
           "network (a double would round it); TypeError for an unhashable vertex.")
      .def("add_infinite_edge", &PythonFlowNetwork::add_infinite_edge, py::arg("u"), py::arg("v"),
           "Adds a legality edge u -> v that no minimum cut crosses while a finite cut exists; its capacity "
           "is "
           "fixed at solve time to more than the sum of all finite capacities, so a cut value at least that "
           "large means no finite cut exists. Returns the edge number.")
      .def("minimum_cut", &PythonFlowNetwork::minimum_cut, py::arg("source"), py::arg("sink"),
           py::arg("solver") = "auto",
           "Returns (value, source_side): the maximum flow value and the frozenset of vertices on the source "
           "side "
           "of a minimum cut (the smallest such set: those reachable from the source in the final residual "
           "graph). solver is 'auto' (measured dispatch between dinic and hlpp), 'dinic', 'hlpp' or 'ipm' (the "
           "experimental interior-point engine, exact like the others; never chosen by 'auto'). A vertex no edge "
           "names is isolated: with it as the sink the value is 0; as the source, (0, frozenset({source})).")
      .def_property_readonly("vertex_count", &PythonFlowNetwork::vertex_count)
      .def_property_readonly("edge_count", &PythonFlowNetwork::edge_count)
      .def_property_readonly("exact", &PythonFlowNetwork::exact,
                             "True while every capacity is an int (solved in exact integer arithmetic).")
      .def("__repr__", [](const PythonFlowNetwork& network) {
        return "FlowNetwork(" + std::to_string(network.vertex_count()) + " vertices, " +
               std::to_string(network.edge_count()) + " edges)";
      });
}

}  // namespace metile::python
