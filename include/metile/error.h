// metile errors: the split every front end relies on. An InputError is the
// user's mistake (bad graph, bad file, bad argument): the CLI exits 2 and Python
// raises ValueError. Any other exception is an internal failure: exit 1.
#pragma once

#include <stdexcept>
#include <string>

namespace metile {

class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace metile
