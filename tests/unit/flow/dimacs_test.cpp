// DIMACS max-flow files: write/read round trips (integer and real capacities keep every
// bit), automatic integer/real detection, and one clear FILE:LINE error per malformed case.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <sstream>
#include <vector>

#include "metile/flow.h"
#include "network_families.h"
#include "metile_test_support.h"

namespace metile {
namespace {

template <typename Capacity>
FlowProblem<Capacity> read_text(const std::string& text) {
  std::istringstream input(text);
  return read_dimacs_max_flow<Capacity>(input, "net.max");
}

template <typename Capacity>
std::string error_of(const std::string& text) {
  try {
    read_text<Capacity>(text);
  } catch (const InputError& error) {
    return error.what();
  }
  return "no error";
}

TEST(Dimacs, ReadsTheFormat) {
  const FlowProblem<std::int64_t> problem = read_text<std::int64_t>(
      "c a comment\n"
      "p max 4 5\n"
      "n 1 s\n"
      "\n"
      "n 4 t\n"
      "a 1 2 5\n"
      "c comments may sit anywhere\n"
      "a 1 3 4\r\n"
      "a 2 4 3\n"
      "a 3 4 6\n"
      "a 2 3 2\n");
  EXPECT_EQ(problem.source, 0);
  EXPECT_EQ(problem.sink, 3);
  ASSERT_EQ(problem.network.edge_count(), 5);
  EXPECT_EQ(problem.network.edge(1).capacity, 4);
  EXPECT_EQ(solve(problem.network, problem.source, problem.sink).value, 9);
}

TEST(Dimacs, IntegerRoundTripKeepsEveryEdge) {
  std::mt19937_64 random(testing::test_seed("Dimacs.IntegerRoundTripKeepsEveryEdge"));
  for (int trial = 0; trial < 50; ++trial) {
    const flow_families::GeneratedNetwork generated = flow_families::multigraph_network(
        static_cast<int>(flow_families::draw(random, 2, 60)),
        static_cast<int>(flow_families::draw(random, 0, 200)), 1000000000000LL, random);
    const FlowProblem<std::int64_t> original{generated.integer_network(), generated.source, generated.sink};
    std::ostringstream written;
    write_dimacs_max_flow(written, original);
    const FlowProblem<std::int64_t> reread = read_text<std::int64_t>(written.str());
    ASSERT_EQ(reread.network.fingerprint(), original.network.fingerprint());
    ASSERT_EQ(reread.network.edge_count(), original.network.edge_count());
    for (int e = 0; e < original.network.edge_count(); ++e) {
      ASSERT_EQ(reread.network.edge(e).from, original.network.edge(e).from);
      ASSERT_EQ(reread.network.edge(e).to, original.network.edge(e).to);
      ASSERT_EQ(reread.network.edge(e).capacity, original.network.edge(e).capacity);
    }
    EXPECT_EQ(reread.source, original.source);
    EXPECT_EQ(reread.sink, original.sink);
  }
}

TEST(Dimacs, RealRoundTripIsBitExact) {
  std::mt19937_64 random(testing::test_seed("Dimacs.RealRoundTripIsBitExact"));
  const flow_families::GeneratedNetwork generated = flow_families::seed_random_network(50, 6, random);
  const FlowProblem<double> original{
      RealFlowNetwork(generated.vertex_count, flow_families::real_edges(generated, true, random)),
      generated.source, generated.sink};
  std::ostringstream written;
  write_dimacs_max_flow(written, original);
  const FlowProblem<double> reread = read_text<double>(written.str());
  EXPECT_EQ(reread.network.fingerprint(), original.network.fingerprint());
  EXPECT_EQ(dinic(reread.network, reread.source, reread.sink).value,
            dinic(original.network, original.source, original.sink).value);
}

// A double beyond 2^53 whose shortest text is all digits (1.2345678901234568e17 prints as
// 123456789012345680) was written that way, and the real reader refuses an integer-written
// capacity above 2^53; past 2^63 the file reader took an all-integer file for an int64 one and
// refused it too. Such capacities are written in scientific notation and read back bit for bit.
TEST(Dimacs, RealRoundTripKeepsCapacitiesBeyondTwoToThe53) {
  const std::vector<FlowEdge<double>> edges{
      {0, 1, 0.5}, {1, 2, 123456789012345678.0}, {0, 2, 12345678901234567890.0}, {1, 2, 9007199254740994.0}};
  for (const bool with_fraction : {true, false}) {
    SCOPED_TRACE(with_fraction ? "with a fractional capacity" : "every capacity an integer");
    const std::span<const FlowEdge<double>> kept(edges.data() + (with_fraction ? 0 : 1), edges.size() - (with_fraction ? 0 : 1));
    const FlowProblem<double> original{RealFlowNetwork(3, kept), 0, 2};
    std::ostringstream written;
    write_dimacs_max_flow(written, original);
    const FlowProblem<double> reread = read_text<double>(written.str());
    EXPECT_EQ(reread.network.fingerprint(), original.network.fingerprint()) << written.str();
    const std::filesystem::path file = std::filesystem::temp_directory_path() / "metile_dimacs_beyond_2_53.max";
    std::ofstream(file) << written.str();
    const AnyFlowProblem from_file = read_dimacs_max_flow_file(file);
    std::filesystem::remove(file);
    ASSERT_EQ(from_file.index(), 1u) << written.str();
    EXPECT_EQ(std::get<FlowProblem<double>>(from_file).network.fingerprint(), original.network.fingerprint());
  }
}

// A real network of whole capacities is written with its capacities as reals ("5.0"), so the file reads
// back as a real problem: written as digits it read back as an integer one, and 300 capacities of 2^53
// (a finite double sum) passed the integer reader's 2^61 limit and were refused.
TEST(Dimacs, RealNetworkOfWholeCapacitiesReadsBackAsReal) {
  std::vector<FlowEdge<double>> edges(300, {0, 1, 9007199254740992.0});
  edges.push_back({1, 2, 5});
  const FlowProblem<double> original{RealFlowNetwork(3, edges), 0, 2};
  std::ostringstream written;
  write_dimacs_max_flow(written, original);
  EXPECT_NE(written.str().find("a 2 3 5.0\n"), std::string::npos) << written.str().substr(0, 200);
  const std::filesystem::path file = std::filesystem::temp_directory_path() / "metile_dimacs_whole_reals.max";
  std::ofstream(file) << written.str();
  const AnyFlowProblem from_file = read_dimacs_max_flow_file(file);
  std::filesystem::remove(file);
  ASSERT_EQ(from_file.index(), 1u);
  const FlowProblem<double>& reread = std::get<FlowProblem<double>>(from_file);
  EXPECT_EQ(reread.network.fingerprint(), original.network.fingerprint());
  EXPECT_EQ(dinic(reread.network, 0, 2).value, 5);
}

TEST(Dimacs, FileReaderPicksIntegerOrReal) {
  const std::filesystem::path directory = std::filesystem::temp_directory_path() / "metile_dimacs_test";
  std::filesystem::create_directories(directory);
  const std::filesystem::path integer_file = directory / "integer.max";
  const std::filesystem::path real_file = directory / "real.max";
  std::ofstream(integer_file) << "p max 2 2\nn 1 s\nn 2 t\na 1 2 3\na 1 2 4\n";
  std::ofstream(real_file) << "p max 2 2\nn 1 s\nn 2 t\na 1 2 3\na 1 2 0.5\n";
  const AnyFlowProblem integer_problem = read_dimacs_max_flow_file(integer_file);
  const AnyFlowProblem real_problem = read_dimacs_max_flow_file(real_file);
  ASSERT_EQ(integer_problem.index(), 0u);
  ASSERT_EQ(real_problem.index(), 1u);
  const auto& real = std::get<FlowProblem<double>>(real_problem);
  EXPECT_EQ(dinic(real.network, real.source, real.sink).value, 3.5);
  try {
    read_dimacs_max_flow_file(directory / "missing.max");
    FAIL() << "a missing file must be an InputError";
  } catch (const InputError& error) {
    EXPECT_NE(std::string(error.what()).find("missing.max: cannot open the file"), std::string::npos);
  }
  std::filesystem::remove_all(directory);
}

struct MalformedCase {
  const char* name;
  const char* text;
  const char* message;
};

TEST(Dimacs, EveryMalformedCaseNamesItsLine) {
  const MalformedCase cases[] = {
      {"bad problem kind", "c x\np min 3 2\n", "net.max:2: bad problem line: expected 'p max VERTICES ARCS'"},
      {"problem line too short", "p max 3\n", "net.max:1: bad problem line: expected 'p max VERTICES ARCS'"},
      {"non-numeric vertex count", "p max three 2\n",
       "net.max:1: bad problem line: vertex count 'three' is not an integer in 0..536870911"},
      {"negative arc count", "p max 3 -2\n",
       "net.max:1: bad problem line: arc count '-2' is not a non-negative integer"},
      {"second problem line", "p max 3 0\np max 3 0\n",
       "net.max:2: second problem line (the first is on line 1)"},
      {"arc before problem line", "c x\na 1 2 3\np max 3 1\n",
       "net.max:2: arc line before the problem line 'p max VERTICES ARCS'"},
      {"node before problem line", "n 1 s\n",
       "net.max:1: node line before the problem line 'p max VERTICES ARCS'"},
      {"arc tail out of range", "p max 3 1\nn 1 s\nn 3 t\na 0 2 5\n",
       "net.max:4: arc tail 0 is outside 1..3"},
      {"arc head out of range", "p max 3 1\nn 1 s\nn 3 t\na 1 4 5\n",
       "net.max:4: arc head 4 is outside 1..3"},
      {"node out of range", "p max 3 0\nn 9 s\n", "net.max:2: node id 9 is outside 1..3"},
      {"missing source", "p max 3 1\nn 3 t\na 1 2 5\n", "net.max:3: no source line 'n ID s'"},
      {"missing sink", "p max 3 1\nn 1 s\na 1 2 5\n", "net.max:3: no sink line 'n ID t'"},
      {"negative capacity", "p max 3 1\nn 1 s\nn 3 t\na 1 2 -5\n", "net.max:4: negative capacity -5"},
      {"non-numeric capacity", "p max 3 1\nn 1 s\nn 3 t\na 1 2 lots\n",
       "net.max:4: capacity 'lots' is not a number"},
      {"real capacity in an integer problem", "p max 3 1\nn 1 s\nn 3 t\na 1 2 2.5\n",
       "net.max:4: capacity '2.5' is not an integer"},
      {"too many arcs", "p max 3 1\nn 1 s\nn 3 t\na 1 2 5\na 2 3 5\n",
       "net.max:5: more arcs than the 1 declared on line 1"},
      {"too few arcs", "p max 3 3\nn 1 s\nn 3 t\na 1 2 5\nc end\n",
       "net.max:5: the file has 1 arcs but line 1 declares 3"},
      {"duplicate source", "p max 3 0\nn 1 s\nn 2 s\n", "net.max:3: duplicate source (already vertex 1)"},
      {"duplicate sink", "p max 3 0\nn 3 t\nn 2 t\n", "net.max:3: duplicate sink (already vertex 3)"},
      {"source is sink", "p max 3 0\nn 2 s\nn 2 t\n", "net.max:3: source and sink are the same vertex 2"},
      // On the node line that makes them one, not the file's last line (arcs may follow).
      {"source is sink before arcs", "p max 3 1\nn 2 t\nn 2 s\na 1 2 5\nc end\n", "net.max:3: source and sink are the same vertex 2"},
      {"bad node kind", "p max 3 0\nn 2 x\n", "net.max:2: bad node line: expected 'n ID s' or 'n ID t'"},
      {"arc with extra token", "p max 3 1\nn 1 s\nn 3 t\na 1 2 5 7\n",
       "net.max:4: bad arc line: expected 'a TAIL HEAD CAPACITY'"},
      {"unknown line", "p max 3 0\nx 1 2\n", "net.max:2: unknown line type 'x' (expected c, p, n or a)"},
      {"empty file", "", "net.max:1: no problem line 'p max VERTICES ARCS'"},
  };
  for (const MalformedCase& malformed : cases) {
    EXPECT_EQ(error_of<std::int64_t>(malformed.text), malformed.message) << malformed.name;
  }
  EXPECT_EQ(error_of<double>("p max 2 1\nn 1 s\nn 2 t\na 1 2 inf\n"),
            "net.max:4: capacity 'inf' is not finite");
  EXPECT_EQ(error_of<double>("p max 2 1\nn 1 s\nn 2 t\na 1 2 nan\n"),
            "net.max:4: capacity 'nan' is not finite");
  EXPECT_EQ(error_of<double>("p max 2 1\nn 1 s\nn 2 t\na 1 2 -0.5\n"), "net.max:4: negative capacity -0.5");
  EXPECT_EQ(error_of<double>("p max 2 1\nn 1 s\nn 2 t\na 1 2 1x\n"),
            "net.max:4: capacity '1x' is not a number");
  // Numbers past a double's range, and vertex ids past 64 bits, were "not a number" / "not an integer".
  for (const char* capacity : {"1e-400", "1e400"}) {
    EXPECT_EQ(error_of<double>(std::string("p max 2 1\nn 1 s\nn 2 t\na 1 2 ") + capacity + "\n"),
              std::string("net.max:4: capacity '") + capacity + "' is outside a double's range (0 or 4.9e-324 .. 1.8e308)");
    // A file whose other capacities are integers is read as an integer file: the same message there.
    EXPECT_EQ(error_of<std::int64_t>(std::string("p max 2 2\nn 1 s\nn 2 t\na 1 2 5\na 1 2 ") + capacity + "\n"),
              std::string("net.max:5: capacity '") + capacity + "' is outside a double's range (0 or 4.9e-324 .. 1.8e308)");
  }
  EXPECT_EQ(error_of<std::int64_t>("p max 2 1\nn 1 s\nn 2 t\na 99999999999999999999 2 5\n"),
            "net.max:4: arc tail 99999999999999999999 is outside 1..2");
  // Bytes of the file quoted in the message: a NUL or an escape sequence would cut or colour the line.
  using namespace std::string_literals;
  EXPECT_EQ(error_of<std::int64_t>("p max 2 1\nn 1 s\nn 2 t\na 1 2 5\0x\n"s),
            "net.max:4: capacity '5\\x00x' is not a number");
  EXPECT_EQ(error_of<std::int64_t>("p max 2 0\n\x1b[31mred\n"s), "net.max:2: unknown line type '\\x1b[31mred' (expected c, p, n or a)");
  // The network's own refusal of one arc (its capacity takes the sum past 2^61 - 1) names the arc's line,
  // not the file's last (a comment after the arcs took the blame).
  EXPECT_EQ(error_of<std::int64_t>("p max 4 4\nn 1 s\nn 4 t\na 1 2 2000000000000000000\na 2 3 2000000000000000000\n"
                                   "a 3 4 1\na 1 4 1\nc end\n"),
            "net.max:5: flow network: the finite capacities of edges 0 to 1 sum to more than 2305843009213693951; solver arithmetic "
            "could overflow");
  // An edge past the limit alone is named alone, after a self-loop that adds nothing ("edges 0 to 1" blamed both).
  EXPECT_EQ(error_of<std::int64_t>("p max 3 2\nn 1 s\nn 3 t\na 2 2 5\na 1 3 2305843009213693952\n"),
            "net.max:5: flow network: the capacity of edge 1 is more than 2305843009213693951; solver arithmetic could overflow");
}

}  // namespace
}  // namespace metile
