// Dispatch decisions on disk, so a tuned program starts tuned. One JSON file of decisions keyed by
// dispatch_key(); written whole to a temporary file and renamed into place, so a reader sees the
// old file or the new one, never half of one. A file that does not parse as a decision file (torn
// by a crash, edited by hand) is ignored and replaced by the next store: decisions are a cache,
// and re-measuring is always safe. Stores hold a lock on the file's directory, so that two
// processes storing at once both keep their decisions.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>

#include "json_input.h"
#include "metile/dispatch.h"
#include "metile/error.h"

namespace metile {
namespace {

// 2: candidates are typed identities {kind, variant, replay}, not names.
constexpr int decision_file_version = 2;

nlohmann::json candidate_json(const CandidateId& id) {
  return {{"kind", std::string(candidate_kind_name(id.kind))}, {"variant", id.variant},
          {"replay", id.replay == Replay::cuda_graph ? "graph" : "eager"}};
}

CandidateId candidate_from_json(const nlohmann::json& entry) {
  CandidateId id;
  const std::string kind = entry.at("kind").get<std::string>();
  const std::string replay = entry.at("replay").get<std::string>();
  if ((kind != "native" && kind != "fused") || (replay != "eager" && replay != "graph")) {
    throw std::runtime_error("not a candidate identity");
  }
  id.kind = kind == "native" ? CandidateKind::native : CandidateKind::fused;
  id.variant = entry.at("variant").get<std::string>();
  id.replay = replay == "graph" ? Replay::cuda_graph : Replay::eager;
  return id;
}

}  // namespace

std::filesystem::path DecisionCache::default_path() { return std::filesystem::path(cache_directory()) / "dispatch.json"; }

// Far above any real decision file (a decision is ~1 KB; a model's regions make a few hundred).
constexpr std::uint64_t kMaximumDecisionFileBytes = std::uint64_t{64} << 20;

namespace {
// The decisions the file holds now; nullopt where there is none or it is not a decision file
// (`corrupt` then says whether something was there).
std::optional<std::vector<DispatchDecision>> read_decisions(const std::filesystem::path& path, bool& corrupt) {
  corrupt = false;
  const std::optional<std::string> text = read_cache_file(path, kMaximumDecisionFileBytes, corrupt);
  if (!text) return std::nullopt;
  try {
    // The project's JSON reader: its nesting limit (10 million brackets took 764 MB and 3.5 s to refuse),
    // no duplicate keys, no number that is not one.
    const nlohmann::json document = parse_json_input(*text, path.string());
    // Exactly the integer 2: get<int>() read 2.7 as 2 and wrapped 2^32 + 2 to 2.
    const nlohmann::json& version = document.at("version");
    if (!version.is_number_integer() || version.get<std::int64_t>() != decision_file_version) {
      throw std::runtime_error("another version");
    }
    std::vector<DispatchDecision> decisions;
    for (const nlohmann::json& entry : document.at("decisions")) {
      DispatchDecision decision;
      decision.key = entry.at("key").get<std::string>();
      decision.chosen = candidate_from_json(entry.at("chosen"));
      // A report is printed as a region's sentence: control bytes (a hand-edited or planted file) are spelled
      // out, not sent to the terminal.
      decision.report = control_bytes_spelled(entry.at("report").get<std::string>());
      for (const nlohmann::json& timing : entry.at("timings_ms")) {
        decision.timings_ms.emplace_back(candidate_from_json(timing.at(0)), timing.at(1).get<double>());
      }
      decisions.push_back(std::move(decision));
    }
    return decisions;
  } catch (const std::exception&) {
    corrupt = true;
    return std::nullopt;
  }
}
}  // namespace

DecisionCache::DecisionCache(std::filesystem::path file) : path_(std::move(file)) {
  if (auto decisions = read_decisions(path_, found_corrupt_file_)) decisions_ = std::move(*decisions);
}

std::optional<DispatchDecision> DecisionCache::find(const std::string& key) const {
  for (const DispatchDecision& decision : decisions_) {
    if (decision.key == key) return decision;
  }
  return std::nullopt;
}

namespace {
// An exclusive flock on the cache file's directory while it lives (best effort: none where the
// directory cannot be opened). Two processes (or two caches of one) storing at once each read the
// file, added their decision and renamed their own copy into place, so one of the two was lost:
// 200 stores each from two processes left 269 decisions.
class DirectoryLock {
 public:
  explicit DirectoryLock(const std::filesystem::path& directory)
      : descriptor_(::open(directory.empty() ? "." : directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)) {
    if (descriptor_ >= 0) {
      while (::flock(descriptor_, LOCK_EX) != 0 && errno == EINTR) {
      }
    }
  }
  ~DirectoryLock() {
    if (descriptor_ >= 0) ::close(descriptor_);  // closing releases the lock
  }
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int descriptor_;
};
}  // namespace

void DecisionCache::store(const DispatchDecision& decision) {
  // A timing that is not finite is written as null, which no reader takes: the next load found the file
  // corrupt and the store after it dropped every decision. The tournament's timings are finite; one
  // that is not is not kept (a cache: the region is raced again next time).
  for (const auto& [id, milliseconds] : decision.timings_ms) {
    if (!std::isfinite(milliseconds)) return;
  }
  std::error_code error;
  if (path_.has_parent_path()) std::filesystem::create_directories(path_.parent_path(), error);
  const DirectoryLock lock(path_.parent_path());
  // What the file holds now, not what it held when this cache was read: another DecisionCache on
  // the same file (the decode MLP keeps its gate/up stage's open while the down stage stores
  // through its own, or another process) may have stored since, and writing this one's older list
  // would drop that.
  bool corrupt = false;
  if (auto current = read_decisions(path_, corrupt)) decisions_ = std::move(*current);
  bool replaced = false;
  for (DispatchDecision& existing : decisions_) {
    if (existing.key == decision.key) {
      existing = decision;
      replaced = true;
    }
  }
  if (!replaced) decisions_.push_back(decision);

  nlohmann::json document;
  document["version"] = decision_file_version;
  document["decisions"] = nlohmann::json::array();
  for (const DispatchDecision& entry : decisions_) {
    nlohmann::json timings = nlohmann::json::array();
    for (const auto& [id, milliseconds] : entry.timings_ms) timings.push_back({candidate_json(id), milliseconds});
    document["decisions"].push_back({{"key", entry.key},
                                     {"chosen", candidate_json(entry.chosen)},
                                     {"report", entry.report},
                                     {"timings_ms", timings}});
  }
  // The text before the file: a report naming a value whose name is not UTF-8 (names set from C++)
  // made nlohmann's own dump throw after the temporary file was opened, and left it behind.
  const std::string text = dump_json(document, 1) + '\n';
  static std::atomic<int> counter{0};
  const std::filesystem::path temporary =
      path_.string() + fmt::format(".tmp.{}.{}", static_cast<long>(getpid()), counter.fetch_add(1));
  {
    std::ofstream stream(temporary, std::ios::binary | std::ios::trunc);
    stream << text;
    stream.close();  // the buffered tail's write fails here, not in the destructor (a file past `ulimit -f`)
    if (!stream) {
      std::filesystem::remove(temporary, error);
      return;  // an unwritable cache only costs a re-measurement next time
    }
  }
  std::filesystem::rename(temporary, path_, error);
  if (error) {
    std::filesystem::remove(temporary, error);
    return;
  }
  found_corrupt_file_ = false;
}

std::string dispatch_key(const CudaDeviceInfo& device, const ComputeGraph& region_graph,
                         const std::vector<std::pair<CandidateId, std::string>>& candidate_sources, DispatchMode mode) {
  // Ops, attributes, dtypes and shapes, not names: the same region elsewhere shares the decision
  // (the sources carry names in comments, so that sharing holds only as far as they agree).
  std::string structure;
  for (ValueId input : region_graph.inputs()) structure += "input " + region_graph.value(input).spec.to_string() + "\n";
  for (const Node& node : region_graph.nodes()) {
    structure += node.op + "(";
    for (ValueId input : node.inputs) structure += std::to_string(input) + " ";
    structure += ")";
    for (const auto& [name, value] : node.attributes.entries()) {
      structure += " " + name + "=";
      std::visit(
          [&](const auto& held) {
            using Held = std::decay_t<decltype(held)>;
            if constexpr (std::is_same_v<Held, std::vector<std::int64_t>>) {
              for (std::int64_t item : held) structure += std::to_string(item) + ",";
            } else if constexpr (std::is_same_v<Held, std::string>) {
              structure += held;
            } else {
              structure += fmt::format("{}", held);
            }
          },
          value);
    }
    for (ValueId output : node.outputs) structure += " -> " + region_graph.value(output).spec.to_string();
    structure += "\n";
  }
  std::string sources;
  for (const auto& [id, source] : candidate_sources) sources += stable_hash_hex(id.name() + "\n" + source);
  return fmt::format("{} | driver {} | nvrtc {} | mode {} | sources {} | region {}", device.name, device.driver_version,
                     nvrtc_version(), dispatch_mode_name(mode), stable_hash_hex(sources), stable_hash_hex(structure));
}

}  // namespace metile
