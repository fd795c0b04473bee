// `metile run` end to end, as a child process: safetensors inputs in,
// safetensors outputs out, compared with run_reference in this process; the
// printed checksums recomputed here from the bytes that were written.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "metile/cpu_runtime.h"
#include "metile_test_support.h"

namespace metile {
namespace {

namespace fs = std::filesystem;

class RunCommand : public ::testing::Test {
 protected:
  void SetUp() override {
    directory_ =
        fs::temp_directory_path() / ("metile_run_test_" + std::to_string(::getpid()) + "_" +
                                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(directory_);
    fs::create_directories(directory_);
    graph_ = testing::seed_graph(3, 64);
    std::ofstream(path("graph.json")) << write_graph_json(graph_);
  }
  void TearDown() override { fs::remove_all(directory_); }

  std::string path(const std::string& name) const { return (directory_ / name).string(); }

  // Runs `metile run graph.json ARGS`; returns the exit code, fills stdout and stderr.
  int run(const std::string& arguments) {
    const std::string command = std::string(METILE_BINARY) + " run " + path("graph.json") + " " + arguments +
                                " >" + path("stdout.txt") + " 2>" + path("stderr.txt");
    const int status = std::system(command.c_str());
    stdout_ = testing::read_text(path("stdout.txt"));
    stderr_ = testing::read_text(path("stderr.txt"));
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  fs::path directory_;
  ComputeGraph graph_;
  std::string stdout_;
  std::string stderr_;
};

std::string checksum_text(const HostTensor& tensor) {
  std::uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a 64
  for (std::byte byte : tensor.bytes()) {
    hash ^= static_cast<std::uint64_t>(byte);
    hash *= 0x100000001b3ull;
  }
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(hash));
  return text;
}

TEST_F(RunCommand, GivenInputsGiveTheReferenceOutputs) {
  const TensorMap inputs = random_inputs(graph_, 5);
  write_safetensors(path("inputs.safetensors"), inputs);
  ASSERT_EQ(run("--inputs " + path("inputs.safetensors") + " --output " + path("outputs.safetensors")), 0)
      << stderr_;
  const TensorMap written = read_safetensors(path("outputs.safetensors"));
  const TensorMap expected = run_reference(graph_, inputs);
  EXPECT_EQ(written, expected);
  // One line per output, in output order, each naming its checksum.
  const std::string first_line = stdout_.substr(0, stdout_.find('\n'));
  EXPECT_EQ(first_line.rfind("summed f16[3, 64] min=", 0), 0u) << stdout_;
  EXPECT_NE(first_line.find("checksum=" + checksum_text(expected.at("summed"))), std::string::npos)
      << stdout_;
  const std::string second_line = stdout_.substr(first_line.size() + 1);
  EXPECT_EQ(second_line.rfind("normalized f16[3, 64] min=", 0), 0u) << stdout_;
  EXPECT_NE(second_line.find("checksum=" + checksum_text(expected.at("normalized")) + "\n"),
            std::string::npos)
      << stdout_;
  EXPECT_EQ(std::count(stdout_.begin(), stdout_.end(), '\n'), 2);
}

// Standard output a pipe whose reader has gone (`metile run ... | head -c 10` once head exits): a failed
// write like a full disk, exit 1 with one line. SIGPIPE ended the process (status 141 to a shell) without
// a word. The reader's end is closed before metile starts, so its first write meets it.
TEST_F(RunCommand, AClosedPipeOnStandardOutputIsOneLineAndExit1) {
  int ends[2];
  ASSERT_EQ(::pipe(ends), 0);
  ::close(ends[0]);
  const std::string errors = path("stderr.txt");
  const std::string graph = path("graph.json");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::dup2(ends[1], STDOUT_FILENO);
    if (std::freopen(errors.c_str(), "w", stderr) == nullptr) ::_exit(99);
    ::execl(METILE_BINARY, METILE_BINARY, "run", graph.c_str(), static_cast<char*>(nullptr));
    ::_exit(98);
  }
  ::close(ends[1]);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "ended by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  EXPECT_EQ(WEXITSTATUS(status), 1);
  EXPECT_EQ(testing::read_text(errors), "metile: error: cannot write to standard output: Broken pipe\n");
}

TEST_F(RunCommand, SeedChoosesTheRandomInputs) {
  ASSERT_EQ(run("--seed 9 --output " + path("seed9.safetensors")), 0) << stderr_;
  EXPECT_EQ(read_safetensors(path("seed9.safetensors")), run_reference(graph_, random_inputs(graph_, 9)));
  ASSERT_EQ(run("--output " + path("seed0.safetensors")), 0) << stderr_;
  EXPECT_EQ(read_safetensors(path("seed0.safetensors")), run_reference(graph_, random_inputs(graph_, 0)));
  EXPECT_NE(read_safetensors(path("seed0.safetensors")), read_safetensors(path("seed9.safetensors")));
}

// The cuda options on the CPU backend are said to change nothing there (--no-discovery was taken without
// a word), and the outputs are the reference's.
TEST_F(RunCommand, CudaOptionsOnTheCpuAreSaidToChangeNothing) {
  ASSERT_EQ(run("--check --no-discovery --output " + path("out.safetensors")), 0) << stderr_;
  EXPECT_NE(stderr_.find("there is nothing to compare\n"), std::string::npos) << stderr_;
  EXPECT_NE(stderr_.find("--no-discovery changes what the cuda backend plans; the CPU backend runs every node as "
                         "written already\n"),
            std::string::npos)
      << stderr_;
  EXPECT_EQ(read_safetensors(path("out.safetensors")), run_reference(graph_, random_inputs(graph_, 0)));
}

TEST_F(RunCommand, MissingInputIsOneLineAndWritesNothing) {
  TensorMap inputs = random_inputs(graph_, 5);
  inputs.erase("weight");
  write_safetensors(path("inputs.safetensors"), inputs);
  EXPECT_EQ(run("--inputs " + path("inputs.safetensors") + " --output " + path("outputs.safetensors")), 2);
  EXPECT_EQ(stderr_, "metile: error: " + path("inputs.safetensors") + ": missing input 'weight' (f16[64])\n");
  EXPECT_EQ(stdout_, "");
  EXPECT_FALSE(fs::exists(path("outputs.safetensors")));
}

TEST_F(RunCommand, MismatchedInputNamesBothSpecs) {
  TensorMap inputs = random_inputs(graph_, 5);
  inputs["values"] = HostTensor(TensorSpec({3, 64}, DType::f32));
  write_safetensors(path("inputs.safetensors"), inputs);
  EXPECT_EQ(run("--inputs " + path("inputs.safetensors")), 2);
  EXPECT_EQ(stderr_, "metile: error: " + path("inputs.safetensors") +
                         ": input 'values' is f32[3, 64], the graph expects f16[3, 64]\n");
}

TEST_F(RunCommand, ATensorNoInputTakesIsRefused) {
  TensorMap inputs = random_inputs(graph_, 5);
  // Misspelt: named before the input it misses (as Python's metile.run names it).
  inputs["wieght"] = inputs.at("weight");
  inputs.erase("weight");
  write_safetensors(path("inputs.safetensors"), inputs);
  EXPECT_EQ(run("--inputs " + path("inputs.safetensors") + " --output " + path("outputs.safetensors")), 2);
  EXPECT_EQ(stderr_.rfind("metile: error: " + path("inputs.safetensors") + ": 'wieght' is not an input of the graph (its inputs: ", 0),
            0u) << stderr_;
  EXPECT_EQ(std::count(stderr_.begin(), stderr_.end(), '\n'), 1) << stderr_;
  EXPECT_FALSE(fs::exists(path("outputs.safetensors")));
}

TEST_F(RunCommand, MalformedInputsFileIsOneLine) {
  std::ofstream(path("inputs.safetensors")) << "not a safetensors file";
  EXPECT_EQ(run("--inputs " + path("inputs.safetensors")), 2);
  EXPECT_EQ(std::count(stderr_.begin(), stderr_.end(), '\n'), 1) << stderr_;
  EXPECT_NE(stderr_.find(path("inputs.safetensors")), std::string::npos) << stderr_;
}

}  // namespace
}  // namespace metile
