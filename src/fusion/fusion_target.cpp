// FusionTarget: the presets the planner prices kernels with, and target files.
// The numbers are the planner's model of a machine, not measurements taken here:
// each preset says where its figures come from so a reader can challenge them.
#include <algorithm>
#include <cmath>
#include <functional>
#include <system_error>
#include <limits>
#include <type_traits>

#include "json_input.h"
#include "metile/fusion.h"
#include "metile/io.h"

namespace metile {

FusionTarget FusionTarget::h200() {
  FusionTarget target;
  target.name = "h200";
  // Back-to-back launches in one stream cost about 2-3 µs each on Hopper when
  // not captured in a CUDA graph; HBM3e peaks at 4.8 TB/s and copies reach ~4.2.
  target.launch_overhead_ns = 2500;
  target.memory_bandwidth_bytes_per_ns = 4200;
  // 132 SMs × 128 bytes/clock of shared memory at ~1.98 GHz.
  target.on_chip_bandwidth_bytes_per_ns = 33000;
  target.registers_per_thread = 255;
  target.registers_per_multiprocessor = 65536;
  target.threads_per_block = 256;
  target.shared_memory_per_block_bytes = 227 * 1024;
  target.shared_memory_per_multiprocessor_bytes = 228 * 1024;
  // Kernel parameters are pointers: 64 inputs and 16 outputs fit the 4 KiB
  // parameter space with room for shapes, and keep generated kernels readable.
  target.max_kernel_inputs = 64;
  target.max_kernel_outputs = 16;
  return target;
}

FusionTarget FusionTarget::cpu() {
  FusionTarget target;
  target.name = "cpu";
  // One reference op allocates its output and sets up its loops (~0.5 µs); one
  // core streams ~12 GB/s from DRAM and ~100 GB/s from L2.
  target.launch_overhead_ns = 500;
  target.memory_bandwidth_bytes_per_ns = 12;
  target.on_chip_bandwidth_bytes_per_ns = 100;
  // A CPU loop has no register file to run out of; the "block" is one thread
  // and its on-chip store is a 1 MiB L2.
  target.registers_per_thread = 1 << 16;
  target.registers_per_multiprocessor = 1 << 16;
  target.threads_per_block = 1;
  target.shared_memory_per_block_bytes = 1 << 20;
  target.shared_memory_per_multiprocessor_bytes = 1 << 20;
  target.max_kernel_inputs = 64;
  target.max_kernel_outputs = 16;
  return target;
}

namespace {

using Json = nlohmann::json;

// Real target figures (ns, bytes per ns) lie in [1e-6, 1e12].
constexpr double kMinimumTargetFigure = 1e-6;
constexpr double kMaximumTargetFigure = 1e12;

// One JSON field of a target: how to read it into the struct and write it back.
struct TargetField {
  const char* name;
  std::function<void(FusionTarget&, const Json&, const std::string& where)> read;
  std::function<Json(const FusionTarget&)> write;
};

// A figure as messages quote it: JSON's text, but a non-finite double (a target set from C++ or
// Python; JSON has none) spelled as such rather than as null.
std::string figure_text(const Json& value) {
  if (value.is_number_float() && !std::isfinite(value.get<double>())) {
    const double number = value.get<double>();
    return std::isnan(number) ? "nan" : number > 0 ? "inf" : "-inf";
  }
  return json_excerpt(value);
}

template <typename Number>
TargetField positive_field(const char* name, Number FusionTarget::*member) {
  return TargetField{
      name,
      [member, name](FusionTarget& target, const Json& value, const std::string& where) {
        const bool integral = std::is_integral_v<Number>;
        if (!value.is_number() || (integral && !value.is_number_integer())) {
          throw InputError(where + ": field '" + name + "' must be " + (integral ? "an integer" : "a number") +
                           ", got " + json_excerpt(value));
        }
        // Integers above the field's type are refused, not truncated; real figures stay in a range
        // whose costs (bytes / bandwidth, launches x nodes) are finite doubles (README, "Input limits").
        const double number = value.get<double>();
        const double maximum = integral ? static_cast<double>(std::numeric_limits<Number>::max()) : kMaximumTargetFigure;
        const double minimum = integral ? 1 : kMinimumTargetFigure;
        if (!std::isfinite(number) || number <= 0) {
          throw InputError(where + ": field '" + name + "' must be positive, got " + figure_text(value));
        }
        const bool above_integer_type =
            integral && value.is_number_unsigned() &&
            value.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<Number>::max());
        if (number > maximum || above_integer_type) {
          const std::string limit =
              integral ? std::to_string(std::numeric_limits<Number>::max()) : json_excerpt(Json(maximum));
          throw InputError(where + ": field '" + name + "' is above its limit of " + limit + ": " + figure_text(value));
        }
        if (number < minimum) {
          throw InputError(where + ": field '" + name + "' is below its limit of " + json_excerpt(Json(minimum)) + ": " +
                           figure_text(value));
        }
        target.*member = value.get<Number>();
      },
      [member](const FusionTarget& target) { return Json(target.*member); }};
}

const std::vector<TargetField>& target_fields() {
  static const std::vector<TargetField> fields = {
      positive_field("launch_overhead_ns", &FusionTarget::launch_overhead_ns),
      positive_field("memory_bandwidth_bytes_per_ns", &FusionTarget::memory_bandwidth_bytes_per_ns),
      positive_field("on_chip_bandwidth_bytes_per_ns", &FusionTarget::on_chip_bandwidth_bytes_per_ns),
      positive_field("registers_per_thread", &FusionTarget::registers_per_thread),
      positive_field("registers_per_multiprocessor", &FusionTarget::registers_per_multiprocessor),
      positive_field("threads_per_block", &FusionTarget::threads_per_block),
      positive_field("shared_memory_per_block_bytes", &FusionTarget::shared_memory_per_block_bytes),
      positive_field("shared_memory_per_multiprocessor_bytes", &FusionTarget::shared_memory_per_multiprocessor_bytes),
      positive_field("max_kernel_inputs", &FusionTarget::max_kernel_inputs),
      positive_field("max_kernel_outputs", &FusionTarget::max_kernel_outputs),
  };
  return fields;
}

// A target's name is printed (a line of `metile plan`, a DOT label) and read by Python: a control
// byte in it would forge or colour that output, as in a graph's names (refuse_control_bytes_in_name).
void refuse_control_bytes(const std::string& name, const std::string& where) {
  refuse_control_bytes_in_name(name, where + "field 'name': ");
}

// The name a target file gives without a "name" field: its file name's stem. File names are bytes,
// any but '/': a control byte (an escape sequence reaching the terminal) is spelled \xNN, and a stem
// that is not UTF-8 (which Python cannot make a str of) has every byte outside printable ASCII spelled.
std::string name_of_file(const std::string& source) {
  const std::string stem = std::filesystem::path(source).stem().string();
  return is_utf8(stem) ? control_bytes_spelled(stem) : printable_bytes(stem);
}

FusionTarget preset(std::string_view name, const std::string& where) {
  if (name == "h200") return FusionTarget::h200();
  if (name == "cpu") return FusionTarget::cpu();
  throw InputError(where + "unknown target '" + std::string(name) + "' (presets: h200, cpu)");
}

}  // namespace

FusionTarget FusionTarget::from_json(std::string_view text, std::string_view source_name) {
  const std::string source(source_name);
  const Json document = parse_json_input(text, source);
  if (!document.is_object()) throw InputError(source + ": a target file holds one JSON object");

  std::string base = "h200";
  if (document.contains("base")) {
    if (!document["base"].is_string()) throw InputError(source + ": field 'base' must be a string");
    base = document["base"].get<std::string>();
  }
  FusionTarget target = preset(base, source + ": field 'base': ");
  target.name = name_of_file(source);
  for (const auto& item : document.items()) {
    // Named, not a structured binding: clang 14 (the fuzz build) cannot capture bindings in lambdas.
    const std::string& key = item.key();
    const Json& value = item.value();
    if (key == "base") continue;
    if (key == "name") {
      if (!value.is_string() || value.get<std::string>().empty()) {
        throw InputError(source + ": field 'name' must be a non-empty string");
      }
      target.name = value.get<std::string>();
      refuse_control_bytes(target.name, source + ": ");
      continue;
    }
    const auto& fields = target_fields();
    const auto field = std::find_if(fields.begin(), fields.end(), [&](const TargetField& f) { return key == f.name; });
    if (field == fields.end()) {
      std::string known = "base, name";
      for (const TargetField& f : fields) known += std::string(", ") + f.name;
      throw InputError(source + ": unknown field '" + key + "' (known: " + known + ")");
    }
    field->read(target, value, source);
  }
  return target;
}

void FusionTarget::check() const {
  // Each field written as JSON and read back by the file reader's own rule; the name by its rule too.
  const std::string where = "fusion target '" + control_bytes_spelled(name) + "'";
  if (name.empty()) throw InputError(where + ": field 'name' must be a non-empty string");  // as the file reader's
  refuse_control_bytes(name, where + ": ");
  FusionTarget scratch;
  for (const TargetField& field : target_fields()) field.read(scratch, field.write(*this), where);
}

FusionTarget FusionTarget::from_json_file(const std::filesystem::path& path) {
  return from_json(read_input_file(path, kMaximumTargetFileBytes, "target"), path.string());
}

FusionTarget FusionTarget::from_name_or_file(std::string_view name_or_path) {
  if (name_or_path == "h200" || name_or_path == "cpu") return preset(name_or_path, "");
  const std::filesystem::path path(name_or_path);
  std::error_code error;
  if (!std::filesystem::exists(path, error)) {
    throw InputError("target '" + std::string(name_or_path) + "' is neither a preset (h200, cpu) nor an existing file");
  }
  return from_json_file(path);
}

std::string FusionTarget::to_json() const {
  Json document = Json::object();
  document["name"] = name;
  for (const TargetField& field : target_fields()) document[field.name] = field.write(*this);
  // A name set from C++ need not be UTF-8: dump_json replaces its bad bytes instead of throwing.
  return dump_json(document, 2);
}

}  // namespace metile
