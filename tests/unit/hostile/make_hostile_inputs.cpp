// Writes the hostile input files the CLI tests in this folder feed to `metile`
// (CMakeLists.txt here): nesting far past the JSON depth limit in every place a
// graph, target or safetensors header holds a value, numbers out of range, shapes
// whose sizes overflow, DIMACS headers that promise more than the file holds.
// Run once as a ctest fixture: make_hostile_inputs DIRECTORY.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "metile/io.h"

namespace {

constexpr int kNesting = 100000;  // about 200 KB of brackets, as in issue 11

std::string nested(int depth) { return std::string(static_cast<std::size_t>(depth), '[') + std::string(static_cast<std::size_t>(depth), ']'); }

void write(const std::filesystem::path& path, const std::string& text) {
  std::ofstream stream(path, std::ios::binary);
  stream << text;
  if (!stream) {
    std::fprintf(stderr, "make_hostile_inputs: cannot write %s\n", path.c_str());
    std::exit(1);
  }
}

// A graph with one input x f32[1] and one node y = scale(x); pieces replace parts of it.
std::string graph(const std::string& shape, const std::string& attribute, const std::string& name,
                  const std::string& output) {
  return "{\"inputs\": [{\"name\": \"x\", \"shape\": " + shape + ", \"dtype\": \"f32\"}],\n"
         " \"nodes\": [{\"name\": " + name + ", \"op\": \"scale\", \"inputs\": [\"x\"], \"attrs\": {\"factor\": " +
         attribute + "}}],\n \"outputs\": [" + output + "]}\n";
}

std::string safetensors(const std::string& header) {
  std::string bytes(8, '\0');
  std::uint64_t length = header.size();
  for (int index = 0; index < 8; ++index) bytes[static_cast<std::size_t>(index)] = static_cast<char>((length >> (8 * index)) & 0xff);
  return bytes + header;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_hostile_inputs DIRECTORY\n");
    return 2;
  }
  const std::filesystem::path directory = argv[1];
  std::filesystem::create_directories(directory);
  const std::string deep = nested(kNesting);

  // Deep nesting wherever a value may sit.
  write(directory / "deep_shape.json", graph(deep, "2.0", "\"y\"", "\"y\""));
  write(directory / "deep_attribute.json", graph("[1]", deep, "\"y\"", "\"y\""));
  write(directory / "deep_name.json", graph("[1]", "2.0", deep, "\"y\""));
  write(directory / "deep_output.json", graph("[1]", "2.0", "\"y\"", deep));
  write(directory / "deep_target.json", "{\"base\": \"h200\", \"threads_per_block\": " + deep + "}\n");
  write(directory / "deep_header.safetensors", safetensors("{\"x\": " + deep + "}"));
  // Brackets inside a string are text, not nesting: this graph is fine (the name is long).
  write(directory / "brackets_in_name.json", graph("[1]", "2.0", "\"y" + std::string(1000, '[') + "\"",
                                                   "\"y" + std::string(1000, '[') + "\""));

  // A file name holding an escape sequence, quoted by the error about the file's content.
  write(directory / "escape_\x1b[31mname.json", "{\"inputs\": 3}\n");

  // Numbers out of range.
  write(directory / "huge_number.json", graph("[1]", "1e400", "\"y\"", "\"y\""));
  write(directory / "huge_dimension.json", graph("[18446744073709551616]", "2.0", "\"y\"", "\"y\""));
  write(directory / "wide_threads.json", "{\"base\": \"h200\", \"threads_per_block\": 4294967552}\n");
  write(directory / "huge_launch.json", "{\"base\": \"h200\", \"launch_overhead_ns\": 1e300}\n");
  write(directory / "slow_memory.json", "{\"base\": \"cpu\", \"memory_bandwidth_bytes_per_ns\": 1e-6, "
                                        "\"on_chip_bandwidth_bytes_per_ns\": 1e-6, \"launch_overhead_ns\": 1e12}\n");

  // Shapes whose products overflow: [2^32, 1] x [1, 2^32] has 2^64 elements.
  write(directory / "matmul_overflow.json",
        "{\"inputs\": [{\"name\": \"a\", \"shape\": [4294967296, 1], \"dtype\": \"f32\"},\n"
        "            {\"name\": \"b\", \"shape\": [1, 4294967296], \"dtype\": \"f32\"}],\n"
        " \"nodes\": [{\"name\": \"c\", \"op\": \"matmul\", \"inputs\": [\"a\", \"b\"]},\n"
        "           {\"name\": \"d\", \"op\": \"reshape\", \"inputs\": [\"c\"], \"attrs\": {\"shape\": [-1]}}],\n"
        " \"outputs\": [\"d\"]}\n");
  // Legal but huge (2^46 elements each): the planner's costs saturate instead of wrapping.
  write(directory / "huge_legal.json",
        "{\"inputs\": [{\"name\": \"a\", \"shape\": [8388608, 8388608], \"dtype\": \"f32\"},\n"
        "            {\"name\": \"r\", \"shape\": [8388608, 8388608], \"dtype\": \"f32\"},\n"
        "            {\"name\": \"w\", \"shape\": [8388608], \"dtype\": \"f32\"}],\n"
        " \"nodes\": [{\"name\": \"s\", \"op\": \"add\", \"inputs\": [\"a\", \"r\"]},\n"
        "           {\"name\": \"n\", \"op\": \"rms_norm\", \"inputs\": [\"s\", \"w\"], \"attrs\": {\"eps\": 1e-5}},\n"
        "           {\"name\": \"e\", \"op\": \"silu\", \"inputs\": [\"n\"]}],\n"
        " \"outputs\": [\"s\", \"e\"]}\n");
  // Tensors that fit this machine's memory whose computing does not: a matmul whose f16 result is 45%
  // of the memory, accumulated in f64 (4 times that) by the CPU reference. Its operands a [M, 1] and
  // b [1, 65536] are small. Before, `metile run` passed its memory check and asked for the f64 results
  // (1.8 times the memory): "internal error: out of memory", exit 1.
  const std::uint64_t memory = metile::physical_memory_bytes();
  const std::uint64_t result_elements = std::min<std::uint64_t>(memory / 40 * 9, std::uint64_t{1} << 47);
  const std::uint64_t rows = std::max<std::uint64_t>(result_elements / 65536, 1);
  write(directory / "beyond_working_memory.json",
        "{\"inputs\": [{\"name\": \"a\", \"shape\": [" + std::to_string(rows) + ", 1], \"dtype\": \"f16\"},\n"
        "            {\"name\": \"b\", \"shape\": [1, 65536], \"dtype\": \"f16\"}],\n"
        " \"nodes\": [{\"name\": \"c\", \"op\": \"matmul\", \"inputs\": [\"a\", \"b\"]}],\n"
        " \"outputs\": [\"c\"]}\n");

  // DIMACS: counts the file cannot hold, numbers at the edges of int64 and double.
  write(directory / "vertex_bomb.max", "p max 536870911 1\nn 1 s\nn 2 t\na 1 2 1\n");
  write(directory / "arc_bomb.max", "p max 4 100000000\nn 1 s\nn 2 t\na 1 2 1\n");
  write(directory / "two_pow_63.max", "p max 2 1\nn 1 s\nn 2 t\na 1 2 9223372036854775808\n");
  write(directory / "two_pow_61.max", "p max 2 1\nn 1 s\nn 2 t\na 1 2 2305843009213693952\n");
  write(directory / "inexact_in_real.max", "p max 3 2\nn 1 s\nn 3 t\na 1 2 0.5\na 2 3 9007199254740993\n");
  write(directory / "finite_1e308.max", "p max 2 1\nn 1 s\nn 2 t\na 1 2 1e308\n");
  write(directory / "sum_past_double.max", "p max 3 3\nn 1 s\nn 3 t\na 1 2 1e308\na 1 2 1e308\na 2 3 1.5\n");
  // A path whose minimum cut is its last arc: `--cut` prints about 110 KB, past stdio's buffer.
  std::string path = "p max 20000 19999\nn 1 s\nn 20000 t\n";
  for (int vertex = 1; vertex < 20000; ++vertex) {
    path += "a " + std::to_string(vertex) + " " + std::to_string(vertex + 1) + (vertex + 1 == 20000 ? " 1\n" : " 2\n");
  }
  write(directory / "long_path.max", path);
  return 0;
}
