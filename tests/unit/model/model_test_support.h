// Helpers of the model tests: a fresh temporary directory per test, the printed
// (and overridable) seed, and checkpoint files read and rewritten without the
// model module (read_safetensors / write_safetensors only).
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "metile/model.h"
#include "metile_test_support.h"

namespace metile::testing {

inline std::uint64_t model_test_seed() {
  static const std::uint64_t seed = test_seed("model tests");
  return seed;
}

class ModelDirectoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = std::filesystem::temp_directory_path() /
            ("metile_model_test_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  // A tiny synthetic checkpoint in root_/name.
  std::filesystem::path synth(const std::string& name, SynthOptions options) {
    if (options.seed == 0) options.seed = model_test_seed();
    const std::filesystem::path directory = root_ / name;
    synthesize_model(directory, options);
    return directory;
  }

#ifdef METILE_BINARY
  // `metile ARGUMENTS` (a shell command line, the caller's to quote): its exit code, standard output
  // and error. The test's own paths are quoted (a temporary directory may hold spaces).
  int run_metile(const std::string& arguments, std::string& out, std::string& err) {
    const auto quoted = [](const std::string& text) { return "'" + text + "'"; };
    const std::string command = quoted(METILE_BINARY) + " " + arguments + " >" + quoted((root_ / "out.txt").string()) +
                                " 2>" + quoted((root_ / "err.txt").string());
    const int status = std::system(command.c_str());
    out = read_text(root_ / "out.txt");
    err = read_text(root_ / "err.txt");
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  // `metile ARGUMENTS` started in a child process and not waited for (the caller signals it and reaps it
  // with waitpid): its standard error to `errors`, its output to /dev/null. -1 where fork failed.
  static pid_t start_metile(const std::vector<std::string>& arguments, const std::filesystem::path& errors) {
    const pid_t child = ::fork();
    if (child != 0) return child;
    if (std::freopen(errors.c_str(), "w", stderr) == nullptr || std::freopen("/dev/null", "w", stdout) == nullptr) {
      ::_exit(99);
    }
    std::vector<char*> argv = {const_cast<char*>(METILE_BINARY)};
    for (const std::string& argument : arguments) argv.push_back(const_cast<char*>(argument.c_str()));
    argv.push_back(nullptr);
    ::execv(METILE_BINARY, argv.data());
    ::_exit(98);
  }
#endif

  std::filesystem::path root_;
};

inline void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

inline std::vector<std::int32_t> random_tokens(std::mt19937_64& generator, std::size_t count, std::int64_t vocab) {
  std::vector<std::int32_t> tokens;
  for (std::size_t index = 0; index < count; ++index) {
    tokens.push_back(static_cast<std::int32_t>(generator() % static_cast<std::uint64_t>(vocab)));
  }
  return tokens;
}

}  // namespace metile::testing
