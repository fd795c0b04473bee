// DIMACS max-flow files, the interchange format of max-flow benchmarks (the DIMACS
// implementation challenge, GENRMF, washington): `c` comments, `p max N M`,
// `n ID s`, `n ID t`, M lines `a U V CAP`, vertices 1-based. The reader is strict
// and names FILE:LINE in every error, because these files are written by hand and
// by generators alike and a silently misread arc changes the answer.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <istream>
#include <limits>
#include <ostream>
#include <string>
#include <system_error>
#include <type_traits>

#include "capacity_text.h"
#include "metile/flow.h"
#include "metile/io.h"

namespace metile {
namespace {

constexpr std::int64_t kMaxVertices = std::numeric_limits<int>::max() / 4;
// Vertices no arc touches cost memory but change nothing: a file may declare
// this many vertices, or two per declared arc (plus s and t) when that is more,
// so `p max 536870911 1` cannot allocate gigabytes (README, "Input limits").
constexpr std::int64_t kFreeVertices = std::int64_t{1} << 20;
// The shortest arc line, "a 1 2 0" and its newline.
constexpr std::int64_t kShortestArcLineBytes = 8;
// What one vertex and one arc cost at most while reading and solving (network,
// residual graph, solver state), for the check against the machine's memory.
constexpr std::uint64_t kBytesPerVertex = 96;
constexpr std::uint64_t kBytesPerArc = 96;

// "123" or "-123": a capacity written as an integer (whatever its size).
bool written_as_integer(std::string_view token) {
  if (!token.empty() && token.front() == '-') token.remove_prefix(1);
  return !token.empty() && std::all_of(token.begin(), token.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::vector<std::string_view> split_tokens(std::string_view line) {
  std::vector<std::string_view> tokens;
  std::size_t position = 0;
  while (position < line.size()) {
    while (position < line.size() &&
           (line[position] == ' ' || line[position] == '\t' || line[position] == '\r')) {
      ++position;
    }
    const std::size_t start = position;
    while (position < line.size() && line[position] != ' ' && line[position] != '\t' &&
           line[position] != '\r') {
      ++position;
    }
    if (position > start) tokens.push_back(line.substr(start, position - start));
  }
  return tokens;
}

bool parse_integer(std::string_view token, std::int64_t& value) {
  const char* end = token.data() + token.size();
  const auto [ptr, error] = std::from_chars(token.data(), end, value);
  return error == std::errc() && ptr == end;
}

bool parse_real(std::string_view token, double& value) {
  const char* end = token.data() + token.size();
  const auto [ptr, error] = std::from_chars(token.data(), end, value);
  return error == std::errc() && ptr == end;
}

// A number from_chars reads whole but that is past a double's range (1e-400, 1e400).
bool real_out_of_range(std::string_view token) {
  double value = 0;
  const char* end = token.data() + token.size();
  const auto [ptr, error] = std::from_chars(token.data(), end, value);
  return error == std::errc::result_out_of_range && ptr == end;
}

class DimacsReader {
 public:
  explicit DimacsReader(std::string_view file_name) : file_name_(file_name) {}

  // The message quotes the file's bytes: printable_bytes keeps a NUL or an escape sequence there
  // from cutting or colouring the one line.
  [[noreturn]] void fail(int line, const std::string& message) const {
    throw InputError(file_name_ + ":" + std::to_string(line) + ": " + printable_bytes(message));
  }

  template <typename Capacity>
  FlowProblem<Capacity> read(std::string_view text) {
    std::string_view line;
    std::size_t line_start = 0;
    int line_number = 0;
    int problem_line = 0;
    std::int64_t vertex_count = 0;
    std::int64_t declared_arcs = 0;
    int source = -1;
    int sink = -1;
    std::vector<FlowEdge<Capacity>> edges;
    std::vector<int> edge_lines;  // the line of each arc, for the network's errors about one edge

    auto parse_vertex = [&](std::string_view token, const char* what) {
      std::int64_t id = 0;
      if (!parse_integer(token, id)) {
        if (written_as_integer(token)) {  // past 64 bits
          fail(line_number, std::string(what) + " " + std::string(token) + " is outside 1.." + std::to_string(vertex_count));
        }
        fail(line_number, std::string(what) + " '" + std::string(token) + "' is not an integer");
      }
      if (id < 1 || id > vertex_count) {
        fail(line_number,
             std::string(what) + " " + std::to_string(id) + " is outside 1.." + std::to_string(vertex_count));
      }
      return static_cast<int>(id - 1);
    };

    while (line_start < text.size()) {
      std::size_t line_end = text.find('\n', line_start);
      if (line_end == std::string_view::npos) line_end = text.size();
      line = text.substr(line_start, line_end - line_start);
      line_start = line_end + 1;
      ++line_number;
      const std::vector<std::string_view> tokens = split_tokens(line);
      if (tokens.empty() || tokens[0] == "c") continue;
      const std::string_view kind = tokens[0];
      if (kind == "p") {
        if (problem_line != 0)
          fail(line_number,
               "second problem line (the first is on line " + std::to_string(problem_line) + ")");
        if (tokens.size() != 4 || tokens[1] != "max")
          fail(line_number, "bad problem line: expected 'p max VERTICES ARCS'");
        if (!parse_integer(tokens[2], vertex_count) || vertex_count < 0 || vertex_count > kMaxVertices) {
          fail(line_number, "bad problem line: vertex count '" + std::string(tokens[2]) +
                                "' is not an integer in 0.." + std::to_string(kMaxVertices));
        }
        if (!parse_integer(tokens[3], declared_arcs) || declared_arcs < 0) {
          fail(line_number,
               "bad problem line: arc count '" + std::string(tokens[3]) + "' is not a non-negative integer");
        }
        check_declared_size(line_number, vertex_count, declared_arcs, static_cast<std::int64_t>(text.size()));
        problem_line = line_number;
        edges.reserve(static_cast<std::size_t>(std::min<std::int64_t>(declared_arcs, 1 << 22)));
      } else if (kind == "n") {
        if (problem_line == 0) fail(line_number, "node line before the problem line 'p max VERTICES ARCS'");
        if (tokens.size() != 3 || (tokens[2] != "s" && tokens[2] != "t")) {
          fail(line_number, "bad node line: expected 'n ID s' or 'n ID t'");
        }
        const int vertex = parse_vertex(tokens[1], "node id");
        int& terminal = tokens[2] == "s" ? source : sink;
        if (terminal >= 0) {
          fail(line_number, std::string("duplicate ") + (tokens[2] == "s" ? "source" : "sink") +
                                " (already vertex " + std::to_string(terminal + 1) + ")");
        }
        terminal = vertex;
        if (source == sink) fail(line_number, "source and sink are the same vertex " + std::to_string(vertex + 1));
      } else if (kind == "a") {
        if (problem_line == 0) fail(line_number, "arc line before the problem line 'p max VERTICES ARCS'");
        if (tokens.size() != 4) fail(line_number, "bad arc line: expected 'a TAIL HEAD CAPACITY'");
        if (static_cast<std::int64_t>(edges.size()) == declared_arcs) {
          fail(line_number, "more arcs than the " + std::to_string(declared_arcs) + " declared on line " +
                                std::to_string(problem_line));
        }
        const int tail = parse_vertex(tokens[1], "arc tail");
        const int head = parse_vertex(tokens[2], "arc head");
        edges.push_back({tail, head, parse_capacity<Capacity>(tokens[3], line_number)});
        edge_lines.push_back(line_number);
      } else {
        fail(line_number, "unknown line type '" + std::string(kind) + "' (expected c, p, n or a)");
      }
    }
    const int last_line = std::max(line_number, 1);
    if (problem_line == 0) fail(last_line, "no problem line 'p max VERTICES ARCS'");
    if (static_cast<std::int64_t>(edges.size()) != declared_arcs) {
      fail(last_line, "the file has " + std::to_string(edges.size()) + " arcs but line " +
                          std::to_string(problem_line) + " declares " + std::to_string(declared_arcs));
    }
    if (source < 0) fail(last_line, "no source line 'n ID s'");
    if (sink < 0) fail(last_line, "no sink line 'n ID t'");
    FlowProblem<Capacity> problem;
    try {
      problem.network = FlowNetwork<Capacity>(static_cast<int>(vertex_count), edges);
    } catch (const FlowEdgeError& error) {
      fail(edge_lines.at(static_cast<std::size_t>(error.edge)), error.what());  // the arc whose capacity crosses a limit
    } catch (const InputError& error) {
      fail(last_line, error.what());  // e.g. legality totals, which no arc of the file holds
    }
    problem.source = source;
    problem.sink = sink;
    return problem;
  }

 private:
  // The declared counts must fit the file (every arc takes a line) and the machine.
  void check_declared_size(int line_number, std::int64_t vertices, std::int64_t arcs, std::int64_t text_bytes) const {
    if (arcs > (text_bytes + 1) / kShortestArcLineBytes) {
      fail(line_number, "bad problem line: " + std::to_string(arcs) + " arcs cannot fit in a file of " +
                            std::to_string(text_bytes) + " bytes");
    }
    const std::int64_t vertex_limit = std::max(kFreeVertices, 2 * arcs + 2);
    if (vertices > vertex_limit) {
      fail(line_number, "bad problem line: " + std::to_string(vertices) + " vertices for " + std::to_string(arcs) +
                            " arcs; at most " + std::to_string(vertex_limit) + " (2 per arc + 2, or " +
                            std::to_string(kFreeVertices) + ")");
    }
    const std::uint64_t needed =
        static_cast<std::uint64_t>(vertices) * kBytesPerVertex + static_cast<std::uint64_t>(arcs) * kBytesPerArc;
    const std::uint64_t available = physical_memory_bytes() / 2;
    if (needed > available) {
      fail(line_number, "bad problem line: " + std::to_string(vertices) + " vertices and " + std::to_string(arcs) +
                            " arcs need about " + std::to_string(needed >> 20) + " MiB, more than half of this machine's " +
                            std::to_string((available * 2) >> 20) + " MiB");
    }
  }

  // Integer files: every capacity written as an integer and fitting int64 (the network
  // then checks their sum). Real files: integer-written capacities only up to 2^53,
  // where a double still holds them exactly.
  // A capacity that is neither an integer nor a double: past a double's range (1e-400, 1e400), or no number.
  [[noreturn]] void fail_unreadable_capacity(std::string_view token, int line_number) const {
    const std::string text(token);
    if (real_out_of_range(token)) {
      fail(line_number, "capacity '" + text + "' is outside a double's range (0 or 4.9e-324 .. 1.8e308)");
    }
    fail(line_number, "capacity '" + text + "' is not a number");
  }

  template <typename Capacity>
  Capacity parse_capacity(std::string_view token, int line_number) const {
    const std::string text(token);
    if constexpr (std::is_integral_v<Capacity>) {
      std::int64_t value = 0;
      if (!parse_integer(token, value)) {
        if (written_as_integer(token)) {
          fail(line_number, "capacity " + text + " does not fit in a 64-bit integer");
        }
        double real = 0;
        if (parse_real(token, real)) fail(line_number, "capacity '" + text + "' is not an integer");
        fail_unreadable_capacity(token, line_number);
      }
      if (value < 0) fail(line_number, "negative capacity " + text);
      return value;
    } else {
      double value = 0;
      if (!parse_real(token, value)) fail_unreadable_capacity(token, line_number);
      if (!std::isfinite(value)) fail(line_number, "capacity '" + text + "' is not finite");
      if (value < 0) fail(line_number, "negative capacity " + text);
      std::int64_t exact = 0;  // compared as written: the double has already rounded
      if (written_as_integer(token) && (!parse_integer(token, exact) || exact > kLargestExactIntegerInDouble)) {
        fail(line_number, "capacity " + text +
                              " is an integer above 2^53 in a file with real capacities, where a double cannot "
                              "hold it exactly");
      }
      return value;
    }
  }

  std::string file_name_;
};

// True when every `a` line's capacity token is an integer, so the file reads as an integer problem.
bool capacities_are_integers(std::string_view text) {
  std::size_t position = 0;
  while (position < text.size()) {
    std::size_t end = text.find('\n', position);
    if (end == std::string_view::npos) end = text.size();
    const std::vector<std::string_view> tokens = split_tokens(text.substr(position, end - position));
    double real = 0;
    if (tokens.size() == 4 && tokens[0] == "a" && !written_as_integer(tokens[3]) && parse_real(tokens[3], real)) {
      return false;  // written as a real number: read the file as reals
    }
    position = end + 1;
  }
  return true;
}

}  // namespace

template <typename Capacity>
FlowProblem<Capacity> read_dimacs_max_flow(std::istream& input, std::string_view file_name) {
  std::string text;
  char chunk[1 << 16];
  while (input.read(chunk, sizeof(chunk)) || input.gcount() > 0) {
    if (static_cast<std::uint64_t>(input.gcount()) > kMaximumDimacsFileBytes - text.size()) {
      throw InputError(std::string(file_name) + ": larger than the " + std::to_string(kMaximumDimacsFileBytes) +
                       "-byte limit for DIMACS files");
    }
    text.append(chunk, static_cast<std::size_t>(input.gcount()));
  }
  return DimacsReader(file_name).read<Capacity>(text);
}

namespace {

// A capacity as the file holds it. A real network's is always written as a real (5 as "5.0"): written as
// digits alone, a network of whole capacities read back as an integer one, whose limits are not a real
// one's (300 capacities of 2^53 were refused: an int64 sum must stay below 2^61).
std::string dimacs_capacity(std::int64_t capacity) { return capacity_text(capacity); }
std::string dimacs_capacity(double capacity) {
  std::string text = capacity_text(capacity);
  if (text.find_first_not_of("-0123456789") == std::string::npos) text += ".0";
  return text;
}

}  // namespace

template <typename Capacity>
void write_dimacs_max_flow(std::ostream& output, const FlowProblem<Capacity>& problem) {
  const FlowNetwork<Capacity>& network = problem.network;
  std::string text;
  text += "c maximum flow problem written by metile\n";
  text +=
      "p max " + std::to_string(network.vertex_count()) + " " + std::to_string(network.edge_count()) + "\n";
  text += "n " + std::to_string(problem.source + 1) + " s\n";
  text += "n " + std::to_string(problem.sink + 1) + " t\n";
  for (const FlowEdge<Capacity>& edge : network.edges()) {
    text += "a " + std::to_string(edge.from + 1) + " " + std::to_string(edge.to + 1) + " " +
            dimacs_capacity(edge.capacity) + "\n";
  }
  output << text;
}

AnyFlowProblem read_dimacs_max_flow_file(const std::filesystem::path& path) {
  const std::string text = read_input_file(path, kMaximumDimacsFileBytes, "DIMACS");
  DimacsReader reader(path.string());
  if (capacities_are_integers(text)) return reader.read<std::int64_t>(text);
  return reader.read<double>(text);
}

template FlowProblem<std::int64_t> read_dimacs_max_flow(std::istream&, std::string_view);
template FlowProblem<double> read_dimacs_max_flow(std::istream&, std::string_view);
template void write_dimacs_max_flow(std::ostream&, const FlowProblem<std::int64_t>&);
template void write_dimacs_max_flow(std::ostream&, const FlowProblem<double>&);

}  // namespace metile
