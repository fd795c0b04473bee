// Private to src/flow: how messages print a capacity or flow value. 17 significant
// digits, so two doubles that differ only in their last bits never read alike in an
// error that says they differ (dispatch's cross-check, verify's certificates).
#pragma once

#include <sstream>
#include <string>

namespace metile {

template <typename Capacity>
std::string capacity_text(Capacity value) {
  std::ostringstream text;
  text.precision(17);
  text << value;
  return text.str();
}

}  // namespace metile
