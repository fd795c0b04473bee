// metile Decision: the one answer to "may I, and if not, why" (may this region lower to a row
// kernel, may this lowering handle it, may this candidate enter the race). Instead of a bool and
// an out-string, an exception used as control flow, or a silently empty list, a check returns a
// Decision: ok, or not ok with the reason a report can print as it is.
#pragma once

#include <string>
#include <utility>

namespace metile {

struct Decision {
  bool ok = false;
  std::string reason;  // empty when ok; else one clause: "node 'gate' (matmul) is a contraction, not a row op"

  static Decision allow() { return {true, {}}; }
  static Decision refuse(std::string reason) { return {false, std::move(reason)}; }
  explicit operator bool() const { return ok; }
};

}  // namespace metile
