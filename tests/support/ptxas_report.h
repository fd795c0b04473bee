// NVRTC compiles for sm_90 with ptxas's resource report, and the checks made on it, for the suites that
// hold generated kernels to their registers (GEMV, attention and row kernels). No device is needed.
#pragma once

#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "metile/cuda_runtime.h"

namespace metile::testing {

// One compile with `--ptxas-options=-v`, never from the kernel cache (the report only comes with a real
// compile); the report is in the program's log.
inline CompiledProgram compile_for_sm90_with_ptxas_report(const std::string& source, const std::string& kernel_name) {
  CompileOptions options;
  options.architecture = "sm_90";
  options.extra = {"--ptxas-options=-v"};
  options.use_cache = false;
  return compile_cuda_program(source, kernel_name, options);
}

// ptxas -v: "... N bytes stack frame, N bytes spill stores, N bytes spill loads". ptxas sometimes parks a
// register or two (<= 32 bytes) to land on an occupancy step; a kernel's row values, weights and
// accumulators (hundreds of bytes a thread) must never go to local memory. The stack frame holds those
// parked bytes beside tables a kernel indexes at run time (the GEMV's L2 prefetch picks a matrix
// pointer a lane: 32 bytes): at most 48.
inline void expect_no_spills(const std::string& log, const std::string& where) {
  static const std::regex report(R"((\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads)");
  std::smatch match;
  ASSERT_TRUE(std::regex_search(log, match, report)) << where << ": no ptxas report in\n" << log;
  EXPECT_LE(std::stoi(match[1].str()), 48) << where << "\n" << log;
  EXPECT_LE(std::stoi(match[2].str()), 32) << where << "\n" << log;
  EXPECT_LE(std::stoi(match[3].str()), 32) << where << "\n" << log;
}

// ptxas -v's "Used N registers"; a failed expectation (and 0) where the log has no such line.
inline int registers_used(const std::string& log, const std::string& where) {
  static const std::regex used(R"(Used (\d+) registers)");
  std::smatch match;
  EXPECT_TRUE(std::regex_search(log, match, used)) << where << ": no register count in\n" << log;
  return match.empty() ? 0 : std::stoi(match[1].str());
}

}  // namespace metile::testing
