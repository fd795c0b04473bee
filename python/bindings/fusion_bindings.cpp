// Python bindings of the fusion planner: FusionTarget, the declarative rules
// (FusionRule and its parts, RuleSet, the default rules), plan_graph_fusion and the
// FusionPlan it returns, whose regions, candidates and conflict components are
// read-only views that keep the plan alive and speak in graph Values and Nodes.
// The named rule classes of the seed (ParallelEpilogueRule, ...) are thin Python
// subclasses of FusionRule in python/metile/__init__.py.
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "bindings.h"
#include "metile/discovery.h"
#include "metile/fusion.h"

namespace metile::python {
namespace {

using PlanPointer = std::shared_ptr<const FusionPlan>;
using PlanHolder = std::shared_ptr<FusionPlan>;  // how Python holds a plan (pybind11 holders are non-const)

// Views of one entry of a plan's lists; two views are equal when they name the same entry.
struct FusionRegionView {
  PlanPointer plan;
  int index = 0;
  const FusionRegion& region() const { return plan->regions.at(static_cast<std::size_t>(index)); }
  bool operator==(const FusionRegionView&) const = default;
};
struct FusionCandidateView {
  PlanPointer plan;
  int index = 0;
  const FusionCandidate& candidate() const { return plan->candidates.at(static_cast<std::size_t>(index)); }
  bool operator==(const FusionCandidateView&) const = default;
};
struct ConflictComponentView {
  PlanPointer plan;
  int index = 0;
  const ConflictComponent& component() const { return plan->components.at(static_cast<std::size_t>(index)); }
  bool operator==(const ConflictComponentView&) const = default;
};

// __eq__ and __hash__ for a plan entry view.
template <typename View>
void bind_view_identity(py::class_<View>& view_class) {
  view_class
      .def(
          "__eq__", [](const View& view, const View& other) { return view == other; }, py::is_operator())
      .def("__hash__", [](const View& view) {
        return py::hash(py::make_tuple(reinterpret_cast<std::uintptr_t>(view.plan.get()), view.index));
      });
}

std::string joined_node_names(const ComputeGraph& graph, const std::vector<NodeId>& ids) {
  std::string text;
  for (NodeId id : ids) text += (text.empty() ? "" : ", ") + graph.node(id).name;
  return text;
}

std::string joined_value_names(const ComputeGraph& graph, const std::vector<ValueId>& ids) {
  std::string text;
  for (ValueId id : ids) text += (text.empty() ? "" : ", ") + graph.value(id).name;
  return text;
}

std::string number_text(double value) {
  std::ostringstream stream;
  stream << value;
  return stream.str();
}

// "FusionRegion(rule='residual_add_rms_norm', nodes=[summed, normalized], inputs=[...], outputs=[...],
// benefit_ns=...)"
std::string region_repr(const FusionRegionView& view) {
  const FusionRegion& region = view.region();
  const ComputeGraph& graph = *view.plan->graph;
  return "FusionRegion(rule='" + region.rule + "', nodes=[" + joined_node_names(graph, region.nodes) +
         "], inputs=[" + joined_value_names(graph, region.inputs) + "], outputs=[" +
         joined_value_names(graph, region.outputs) + "], benefit_ns=" + number_text(region.benefit_ns) + ")";
}

// "FusionPlan(target='h200', kernels=1, regions=[residual_add_rms_norm: summed, normalized], unfused=[])"
std::string plan_repr(const FusionPlan& plan) {
  std::string regions;
  for (const FusionRegion& region : plan.regions) {
    regions +=
        (regions.empty() ? "" : "; ") + region.rule + ": " + joined_node_names(*plan.graph, region.nodes);
  }
  return "FusionPlan(target='" + plan.target_name + "', kernels=" + std::to_string(plan.kernel_count()) +
         ", regions=[" + regions + "], unfused=[" + joined_node_names(*plan.graph, plan.unfused) + "])";
}

// target=None | FusionTarget | "h200" | "cpu" | path of a JSON target file
FusionTarget target_from_python(const py::object& target) {
  if (target.is_none()) return FusionTarget::h200();
  if (py::isinstance<FusionTarget>(target)) return target.cast<FusionTarget>();
  const py::object os = py::module_::import("os");
  if (py::isinstance<py::str>(target) || py::isinstance(target, os.attr("PathLike"))) {
    // As the file system spells the path (a file name that is not UTF-8 reaches Python as a str with
    // surrogate escapes, which no UTF-8 conversion takes), through FilePath's caster, which also
    // refuses a NUL byte as the other path parameters do.
    const std::string name_or_path = target.cast<FilePath>().value.string();
    // Read without the GIL: a FIFO blocks until its writer writes, and a writer that is a Python thread
    // of this process could not run while we held it (the read never ended).
    py::gil_scoped_release release;
    return FusionTarget::from_name_or_file(name_or_path);
  }
  throw py::type_error(
      "plan_graph_fusion: target must be a FusionTarget, 'h200', 'cpu' or a JSON file path, got " +
      python_type_name(target));
}

// rules=None | RuleSet | FusionRule | iterable of FusionRule (priority order)
RuleSet rules_from_python(const py::object& rules) {
  if (rules.is_none()) return default_rules();
  if (py::isinstance<RuleSet>(rules)) return rules.cast<RuleSet>();
  if (py::isinstance<FusionRule>(rules)) return RuleSet{{rules.cast<FusionRule>()}};
  if (!py::isinstance<py::str>(rules) && py::isinstance<py::iterable>(rules)) {
    RuleSet rule_set;
    for (const py::handle& rule : rules) {
      if (!py::isinstance<FusionRule>(rule)) {
        throw py::type_error("plan_graph_fusion: rules must hold FusionRules, got " +
                             python_type_name(rule));
      }
      rule_set.rules.push_back(rule.cast<FusionRule>());
    }
    return rule_set;
  }
  throw py::type_error(
      "plan_graph_fusion: rules must be a RuleSet, a FusionRule or a list of FusionRules, got " +
      python_type_name(rules));
}

// The fields of targets and rules, set from Python by the argument rules of every other binding
// (bindings.h). pybind11's def_readwrite took True as 1 and 2, 0.5 or None as a flag; an int past the
// field's C++ type or a str holding a lone surrogate was "incompatible function arguments", naming no
// field; and bytes that are not UTF-8 were stored as a name, after which every read of it (the field,
// repr, a plan's explain and regions naming the rule) raised UnicodeDecodeError and to_json wrote U+FFFD.
// A bad value is refused naming `Class.field`, and the object keeps its old value.

// An int within the C++ field's type: a ValueError naming the field past it, as from_json's (planning then
// holds the value to the field's rule: FusionTarget::check, validate_rule_set).
template <typename Integer>
Integer integer_field_value(const std::string& class_name, const char* name, const py::handle& value) {
  const std::int64_t given = integer_argument(class_name + "." + name, value);
  if (given > std::numeric_limits<Integer>::max() || given < std::numeric_limits<Integer>::min()) {
    const std::int64_t limit = given > 0 ? std::numeric_limits<Integer>::max() : std::numeric_limits<Integer>::min();
    throw InputError(class_name + ": field '" + name + "' is " + std::to_string(given) + ", past its limit of " +
                     std::to_string(limit));
  }
  return static_cast<Integer>(given);
}

// One checked field: read as stored, set through `convert(what, value)` (what = "Class.field"), which
// throws before the field changes. A FusionTarget is set on a copy that must then pass check(), the
// target file reader's own rule for each field: a bandwidth of NaN or -1 was stored, and only
// planning with the target refused it.
template <typename Class, typename Value, typename Convert>
void def_checked_field(py::class_<Class>& target, const char* name, Value Class::*field, Convert convert) {
  const std::string what = std::string(py::str(target.attr("__name__"))) + "." + name;
  target.def_property(
      name, [field](const Class& held) { return held.*field; },
      [field, what, convert](Class& held, const py::handle& value) {
        if constexpr (std::is_same_v<Class, FusionTarget>) {
          Class changed = held;
          changed.*field = convert(what, value);
          changed.check();
          held = std::move(changed);
        } else {
          held.*field = convert(what, value);
        }
      });
}

template <typename Class, typename Integer>
void def_integer_field(py::class_<Class>& target, const char* name, Integer Class::*field) {
  const std::string class_name = py::str(target.attr("__name__"));
  def_checked_field(target, name, field, [class_name, name](const std::string&, const py::handle& value) {
    return integer_field_value<Integer>(class_name, name, value);
  });
}

template <typename Class>
void def_real_field(py::class_<Class>& target, const char* name, double Class::*field) {
  def_checked_field(target, name, field, [](const std::string& what, const py::handle& value) { return real_argument(what, value); });
}

template <typename Class>
void def_flag_field(py::class_<Class>& target, const char* name, bool Class::*field) {
  def_checked_field(target, name, field,
                    [](const std::string& what, const py::handle& value) { return boolean_argument(what, value); });
}

template <typename Class>
void def_text_field(py::class_<Class>& target, const char* name, std::string Class::*field) {
  def_checked_field(target, name, field, [](const std::string& what, const py::handle& value) { return text_argument(what, value); });
}

// A list of strs (OpPattern.ops, .inputs): a list or tuple, each item as def_text_field takes it.
template <typename Class>
void def_text_list_field(py::class_<Class>& target, const char* name, std::vector<std::string> Class::*field) {
  def_checked_field(target, name, field, [](const std::string& what, const py::handle& value) {
    if (!py::isinstance<py::list>(value) && !py::isinstance<py::tuple>(value)) {
      throw py::type_error(what + ": expected a list of str, got " + python_type_name(value));
    }
    std::vector<std::string> texts;
    for (const py::handle& item : value) texts.push_back(text_argument(what + " item " + std::to_string(texts.size()), item));
    return texts;
  });
}

void bind_target(py::module_& module) {
  py::class_<FusionTarget> target(
      module, "FusionTarget",
      "What a kernel costs and what one kernel may use on a machine (times in ns, bandwidths "
      "in bytes/ns). FusionTarget() is the H200; see h200(), cpu(), from_json().");
  target.def(py::init<>());
  def_text_field(target, "name", &FusionTarget::name);
  def_real_field(target, "launch_overhead_ns", &FusionTarget::launch_overhead_ns);
  def_real_field(target, "memory_bandwidth_bytes_per_ns", &FusionTarget::memory_bandwidth_bytes_per_ns);
  def_real_field(target, "on_chip_bandwidth_bytes_per_ns", &FusionTarget::on_chip_bandwidth_bytes_per_ns);
  def_integer_field(target, "registers_per_thread", &FusionTarget::registers_per_thread);
  def_integer_field(target, "registers_per_multiprocessor", &FusionTarget::registers_per_multiprocessor);
  def_integer_field(target, "threads_per_block", &FusionTarget::threads_per_block);
  def_integer_field(target, "shared_memory_per_block_bytes", &FusionTarget::shared_memory_per_block_bytes);
  def_integer_field(target, "shared_memory_per_multiprocessor_bytes", &FusionTarget::shared_memory_per_multiprocessor_bytes);
  def_integer_field(target, "max_kernel_inputs", &FusionTarget::max_kernel_inputs);
  def_integer_field(target, "max_kernel_outputs", &FusionTarget::max_kernel_outputs);
  target.def_static("h200", &FusionTarget::h200)
      .def_static("cpu", &FusionTarget::cpu)
      .def_static(
          "from_json",
          [](const Utf8Text& text, const Utf8Text& source_name) {
            return FusionTarget::from_json(text.value, source_name.value);
          },
          py::arg("text"), py::arg("source_name") = "<string>",
          "A JSON object: optional \"base\" (\"h200\" or \"cpu\") whose fields the others override.")
      .def_static(
          "from_json_file", [](const FilePath& path) { return FusionTarget::from_json_file(path.value); }, py::arg("path"),
          py::call_guard<py::gil_scoped_release>())  // as target_from_python: a FIFO's writer may be a Python thread
      .def_static(
          "from_name_or_file", [](const py::object& name_or_path) { return target_from_python(name_or_path); },
          py::arg("name_or_path"), "'h200', 'cpu' or the path of a JSON target file (a str or os.PathLike).")
      .def("to_json", &FusionTarget::to_json)
      .def("__repr__", [](const FusionTarget& target) {
        // The fields that decide most plans; to_json() has them all.
        return "FusionTarget('" + target.name +
               "', launch_overhead_ns=" + number_text(target.launch_overhead_ns) +
               ", memory_bandwidth_bytes_per_ns=" + number_text(target.memory_bandwidth_bytes_per_ns) + ")";
      });
}

void bind_rules(py::module_& module) {
  py::class_<ResourceNeeds> resources(module, "ResourceNeeds", "What a rule's kernel needs from the target.");
  resources.def(py::init<>());
  for (const auto& [name, field] : register_need_fields()) def_integer_field(resources, name, field);
  def_flag_field(resources, "stages_reduction_rows", &ResourceNeeds::stages_reduction_rows);
  def_flag_field(resources, "stages_contraction_activations", &ResourceNeeds::stages_contraction_activations);

  py::class_<OpPattern> pattern_class(
      module, "OpPattern",
      "One op of a rule's required structure. Lists are copied in and out: assign a new list "
      "rather than appending to the one a property returns.");
  pattern_class.def(py::init<>());
  def_text_field(pattern_class, "role", &OpPattern::role);
  pattern_class.def_readwrite("kind", &OpPattern::kind);  // OpKind's caster: a name, else ValueError
  def_text_list_field(pattern_class, "ops", &OpPattern::ops);
  def_text_list_field(pattern_class, "inputs", &OpPattern::inputs);
  def_flag_field(pattern_class, "commutative", &OpPattern::commutative);
  def_flag_field(pattern_class, "may_escape", &OpPattern::may_escape);
  pattern_class.def("__repr__", [](const OpPattern& pattern) {
        return "OpPattern(role='" + pattern.role + "', kind='" + std::string(op_kind_name(pattern.kind)) +
               "')";
      });

  py::class_<GrowthSpec> growth(module, "GrowthSpec", "Neighbours the cut model may pull in around a rule's structure.");
  growth.def(py::init<>());
  // A list of kind names (a str alone was pybind11's "incompatible function arguments", naming no field).
  def_checked_field(growth, "kinds", &GrowthSpec::kinds, [](const std::string& what, const py::handle& value) {
    if (!py::isinstance<py::list>(value) && !py::isinstance<py::tuple>(value)) {
      throw py::type_error(what + ": expected a list of op kind names, got " + python_type_name(value));
    }
    std::vector<OpKind> kinds;
    for (const py::handle& item : value) {
      if (!py::isinstance<py::str>(item)) {
        throw py::type_error(what + " item " + std::to_string(kinds.size()) + ": expected a str, got " + python_type_name(item));
      }
      kinds.push_back(item.cast<OpKind>());  // an unknown name: OpKind's caster's ValueError, listing the kinds
    }
    return kinds;
  });
  def_integer_field(growth, "max_depth", &GrowthSpec::max_depth);

  py::class_<FusionRule> rule_class(
      module, "FusionRule",
      "A declarative fusion rule: a pattern anchored at its last entry, optional prologue and "
      "epilogue growth, and the resources its kernel takes.");
  rule_class.def(py::init<>()).def(py::init<const FusionRule&>(), py::arg("rule"), "A copy of `rule`.");
  def_text_field(rule_class, "name", &FusionRule::name);
  def_text_field(rule_class, "description", &FusionRule::description);
  def_flag_field(rule_class, "anchor_must_be_sink", &FusionRule::anchor_must_be_sink);
  def_flag_field(rule_class, "materializes_escaping_values", &FusionRule::materializes_escaping_values);
  def_text_field(rule_class, "epilogue_add_operand_role", &FusionRule::epilogue_add_operand_role);
  // Lists are copied out, as OpPattern's are: def_readwrite handed out items that referred into the
  // vector, and reassigning the property freed what an item still held read.
  rule_class
      .def_property(
          "pattern", [](const FusionRule& rule) { return rule.pattern; },
          [](FusionRule& rule, std::vector<OpPattern> pattern) { rule.pattern = std::move(pattern); },
          "The pattern's entries, anchor last (a copy: assign the whole list to change it).")
      .def_readwrite("prologue", &FusionRule::prologue)
      .def_readwrite("epilogue", &FusionRule::epilogue)
      .def_readwrite("resources", &FusionRule::resources)
      .def("__repr__", [](const py::object& rule) {
        return python_type_name(rule) + "('" +
               rule.cast<const FusionRule&>().name + "')";
      });

  py::class_<RuleSet> rule_set_class(module, "RuleSet", "Rules in priority order plus the planner's search bounds.");
  rule_set_class
      .def(py::init([](std::vector<FusionRule> rules, const py::handle& max_neighborhood_nodes,
                       const py::handle& max_exact_component_size) {
             return RuleSet{std::move(rules),
                            integer_field_value<int>("RuleSet", "max_neighborhood_nodes", max_neighborhood_nodes),
                            integer_field_value<int>("RuleSet", "max_exact_component_size", max_exact_component_size)};
           }),
           py::arg("rules") = std::vector<FusionRule>{},
           py::arg("max_neighborhood_nodes") = RuleSet{}.max_neighborhood_nodes,
           py::arg("max_exact_component_size") = RuleSet{}.max_exact_component_size)
      .def_property(
          "rules", [](const RuleSet& rule_set) { return rule_set.rules; },
          [](RuleSet& rule_set, std::vector<FusionRule> rules) { rule_set.rules = std::move(rules); },
          "The rules in priority order (a copy: assign the whole list to change it).");
  def_integer_field(rule_set_class, "max_neighborhood_nodes", &RuleSet::max_neighborhood_nodes);
  def_integer_field(rule_set_class, "max_exact_component_size", &RuleSet::max_exact_component_size);
  rule_set_class.def("__len__", [](const RuleSet& rule_set) { return rule_set.rules.size(); })
      .def("__repr__", [](const RuleSet& rule_set) {
        std::string names;
        for (const FusionRule& rule : rule_set.rules)
          names += (names.empty() ? "'" : ", '") + rule.name + "'";
        return "RuleSet([" + names + "])";
      });

  module.def("residual_add_rms_norm_rule", &residual_add_rms_norm_rule);
  module.def("parallel_epilogue_rule", &parallel_epilogue_rule);
  module.def("contraction_epilogue_rule", &contraction_epilogue_rule);
  module.def("row_reduction_rule", &row_reduction_rule);
  module.def("elementwise_chain_rule", &elementwise_chain_rule);
  module.def("default_rules", &default_rules, "The default RuleSet (the ParallelEpilogueRule among them).");
}

void bind_plan(py::module_& module) {
  py::class_<FusionRegionView> region_class(module, "FusionRegion",
                                            "One kernel-to-be: a convex set of nodes and its boundary.");
  region_class.def_property_readonly("rule", [](const FusionRegionView& view) { return view.region().rule; })
      .def_property_readonly(
          "nodes",
          [](const FusionRegionView& view) { return node_views(view.plan->graph, view.region().nodes); })
      .def_property_readonly(
          "inputs",
          [](const FusionRegionView& view) { return value_views(view.plan->graph, view.region().inputs); },
          "Values read from outside the region, first-use order.")
      .def_property_readonly(
          "outputs",
          [](const FusionRegionView& view) { return value_views(view.plan->graph, view.region().outputs); },
          "Values the region's kernel writes (graph outputs or read outside it).")
      .def_property_readonly(
          "benefit_ns", [](const FusionRegionView& view) { return view.region().benefit_ns; },
          "Estimated time saved against running the nodes unfused, in nanoseconds.")
      .def_property_readonly(
          "benefit", [](const FusionRegionView& view) { return view.region().benefit_ns; },
          "The same as benefit_ns (nanoseconds).")
      .def_property_readonly(
          "roles",
          [](const FusionRegionView& view) {
            py::dict roles;
            for (const RegionRole& bound : view.region().roles) {
              roles[py::str(bound.role)] = value_views(view.plan->graph, {bound.value})[0];
            }
            return roles;
          },
          "What the rule's pattern bound, role name -> Value (e.g. swiglu_mlp: input, gate_weight, "
          "up_weight, down_weight, residual); empty for single-op and certified regions.")
      .def_property_readonly(
          "certificate",
          [](const FusionRegionView& view) -> py::object {
            const std::string& certificate = view.region().certificate;
            if (certificate.empty()) return py::none();
            return py::module_::import("json").attr("loads")(certificate);
          },
          "For a region made by a certified rewrite (flash_attention): {'law', 'theory', 'obligations': "
          "[{'name', 'lhs', 'rhs', 'holds', 'by'}], 'verified'}; None for every other region.")
      .def("__repr__", &region_repr);

  bind_view_identity(region_class);
  py::class_<FusionCandidateView> candidate_class(module, "FusionCandidate",
                                                  "A region some rule proposed, selected or not.");
  candidate_class
      .def_property_readonly("rule", [](const FusionCandidateView& view) { return view.candidate().rule; })
      .def_property_readonly("anchor",
                             [](const FusionCandidateView& view) {
                               return GraphNodeView{view.plan->graph, view.candidate().anchor};
                             })
      .def_property_readonly("nodes",
                             [](const FusionCandidateView& view) {
                               return node_views(view.plan->graph, view.candidate().nodes);
                             })
      .def_property_readonly("benefit_ns",
                             [](const FusionCandidateView& view) { return view.candidate().benefit_ns; })
      .def_property_readonly(
          "conflicts", [](const FusionCandidateView& view) { return view.plan->conflicts.conflicts_of(view.index); },
          "Indices into plan.candidates of the candidates this one excludes (its conflict groups' other members).")
      .def_property_readonly(
          "component", [](const FusionCandidateView& view) { return view.candidate().component; },
          "Index into plan.components.")
      .def_property_readonly(
          "region",
          [](const FusionCandidateView& view) -> py::object {
            if (view.candidate().region < 0) return py::none();
            return py::cast(FusionRegionView{view.plan, view.candidate().region});
          },
          "The plan's region made of this candidate, or None when it was not selected.")
      .def("__repr__", [](const FusionCandidateView& view) {
        const FusionCandidate& candidate = view.candidate();
        return "FusionCandidate(rule='" + candidate.rule + "', nodes=[" +
               joined_node_names(*view.plan->graph, candidate.nodes) +
               "], benefit_ns=" + number_text(candidate.benefit_ns) +
               (candidate.region >= 0 ? ", selected)" : ")");
      });

  py::class_<ConflictComponentView> component_class(
      module, "ConflictComponent",
      "Candidates that exclude each other, and how the planner chose among them.");
  component_class
      .def_property_readonly("candidates",
                             [](const ConflictComponentView& view) { return view.component().candidates; })
      .def_property_readonly(
          "method", [](const ConflictComponentView& view) { return view.component().method; },
          "single, min_cut, branch_and_bound or greedy; '+cycle_drops' appended where chosen regions were dropped "
          "to break kernel cycles.")
      .def_property_readonly("bipartite",
                             [](const ConflictComponentView& view) { return view.component().bipartite; })
      .def_property_readonly(
          "round", [](const ConflictComponentView& view) { return view.component().round; },
          "1, or a later selection round over the ops the regions chosen before left.")
      .def("__repr__", [](const ConflictComponentView& view) {
        return "ConflictComponent(candidates=" + std::to_string(view.component().candidates.size()) +
               ", method='" + view.component().method + "')";
      });

  bind_view_identity(component_class);
  py::class_<FusionPlan, PlanHolder>(
      module, "FusionPlan",
      "The planner's answer: regions (each one kernel), unfused nodes, and why. print(plan) explains it.")
      .def_property_readonly("graph",
                             [](const PlanHolder& plan) {
                               // Python never mutates a ComputeGraph; the const is the C++ API's promise.
                               return std::const_pointer_cast<ComputeGraph>(plan->graph);
                             })
      .def_property_readonly("regions",
                             [](const PlanHolder& plan) {
                               py::list regions;
                               for (std::size_t index = 0; index < plan->regions.size(); ++index) {
                                 regions.append(FusionRegionView{plan, static_cast<int>(index)});
                               }
                               return regions;
                             })
      .def_property_readonly(
          "unfused", [](const PlanHolder& plan) { return node_views(plan->graph, plan->unfused); },
          "Nodes that run as their own kernel.")
      .def_property_readonly("candidates",
                             [](const PlanHolder& plan) {
                               py::list candidates;
                               for (std::size_t index = 0; index < plan->candidates.size(); ++index) {
                                 candidates.append(FusionCandidateView{plan, static_cast<int>(index)});
                               }
                               return candidates;
                             })
      .def_property_readonly("components",
                             [](const PlanHolder& plan) {
                               py::list components;
                               for (std::size_t index = 0; index < plan->components.size(); ++index) {
                                 components.append(ConflictComponentView{plan, static_cast<int>(index)});
                               }
                               return components;
                             })
      .def_property_readonly(
          "conflict_groups", [](const PlanHolder& plan) { return plan->conflicts.groups(); },
          "Lists of indices into candidates: at most one of a group becomes a region (they share an op, or "
          "two that would close a kernel cycle).")
      .def_property_readonly(
          "node_reasons",
          [](const PlanHolder& plan) {
            py::dict reasons;
            for (std::size_t id = 0; id < plan->node_reasons.size(); ++id) {
              reasons[py::str(plan->graph->node(static_cast<NodeId>(id)).name)] = plan->node_reasons[id];
            }
            return reasons;
          },
          "{node name: why it is or is not fused}")
      .def_property_readonly("rewrites", [](const FusionPlan& plan) { return plan.rewrites; },
                             "Rewrites made before planning (nodes no output depends on removed, certified attention rewrites made or refused), one line each.")
      .def_property_readonly("kernel_count", &FusionPlan::kernel_count)
      .def_property_readonly("target_name", [](const FusionPlan& plan) { return plan.target_name; })
      .def_property_readonly("total_benefit_ns", &FusionPlan::total_benefit_ns)
      .def("explain", &FusionPlan::explain, "The plan for a person: regions, then every node's reason.")
      .def("to_json", &FusionPlan::to_json,
           "{\"kernels\", \"regions\", \"unfused\"}, as `metile plan --format json`.")
      .def("to_dot", &FusionPlan::to_dot, "Graphviz DOT: each region a cluster.")
      .def("__str__",
           [](const FusionPlan& plan) {
             // explain() ends its last line; print() adds its own newline.
             std::string text = plan.explain();
             while (!text.empty() && text.back() == '\n') text.pop_back();
             return text;
           })
      .def("__repr__", &plan_repr);

  module.def(
      "plan_graph_fusion",
      [](const std::shared_ptr<ComputeGraph>& graph, const py::object& target, const py::object& rules) {
        const FusionTarget fusion_target = target_from_python(target);
        const RuleSet rule_set = rules_from_python(rules);
        py::gil_scoped_release release;
        // As `metile plan --no-discovery`: a flash_attention node whose certificate a fresh proof does not
        // give (forged, another law's, unreadable) is refused here, not shown as a verified region.
        require_verified_certificates(*graph);
        return std::make_shared<FusionPlan>(plan_graph_fusion(*graph, fusion_target, rule_set));
      },
      py::arg("graph").none(false), py::arg("target") = py::none(), py::arg("rules") = py::none(),
      "Selects legal, profitable, multi-output fusion regions. target: a FusionTarget, 'h200' (the default), "
      "'cpu' "
      "or a JSON target file; rules: a RuleSet, a list of FusionRules in priority order, or None for "
      "default_rules(). A flash_attention node whose certificate does not verify is refused (ValueError), "
      "as metile.run and plan_with_discovery refuse it.");
  module.def(
      "plan_with_discovery",
      [](const std::shared_ptr<ComputeGraph>& graph, const py::object& target, const py::object& rules) {
        const FusionTarget fusion_target = target_from_python(target);
        const RuleSet rule_set = rules_from_python(rules);
        py::gil_scoped_release release;
        return std::make_shared<FusionPlan>(plan_with_discovery(*graph, fusion_target, rule_set));
      },
      py::arg("graph").none(false), py::arg("target") = py::none(), py::arg("rules") = py::none(),
      "Nodes no graph output depends on removed, the certified attention rewrite (matmul -> [scale] -> "
      "[mask] -> softmax -> matmul becomes one flash_attention node carrying its certificate), then "
      "plan_graph_fusion of the rewritten graph (plan.graph); plan.rewrites says what was removed, rewritten "
      "or refused and why.");
}

}  // namespace

void bind_fusion(py::module_& module) {
  bind_target(module);
  bind_rules(module);
  bind_plan(module);
}

}  // namespace metile::python
