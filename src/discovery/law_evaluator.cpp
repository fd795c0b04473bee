// LawEvaluator: a law's terms run on doubles, the way the CPU reference of
// flash_attention evaluates attention with the law itself. Each operation
// (identity, lift, merge, finalize) is compiled once into a post-order
// instruction list; instructions that read no per-lane variable run once per
// call, the rest once per lane, so a merge of two states with value rows of
// width D costs two exps, not 2·D.
#include <fmt/core.h>

#include <cmath>
#include <limits>
#include <map>

#include "metile/discovery.h"

namespace metile {
namespace {

struct Instruction {
  Term::Kind kind = Term::Kind::constant;
  int left = -1;
  int right = -1;
  double constant = 0;
  std::size_t input_offset = 0;  // variables: position in the input buffer
  bool per_lane = false;
};

// Where each variable lives in the concatenated input buffers of one call.
struct VariableSlot {
  std::size_t offset = 0;
  bool per_lane = false;
};

class Program {
 public:
  Program() = default;
  Program(const std::vector<TermRef>& outputs, const std::map<std::string, VariableSlot>& slots) {
    for (const TermRef& output : outputs) results_.push_back(compile(*output, slots));
  }

  // Runs the program; output k is written to out[k] (one value or `lanes` values from out_offsets[k]).
  void run(std::span<const double> input, std::int64_t lanes, std::span<double> out,
           std::span<const std::size_t> out_offsets) const {
    std::vector<double> scalar(code_.size());
    for (std::size_t index = 0; index < code_.size(); ++index) {
      if (!code_[index].per_lane) scalar[index] = execute(code_[index], input, scalar, 0);
    }
    std::vector<double> lane_values = scalar;
    for (std::size_t k = 0; k < results_.size(); ++k) {
      const int result = results_[k];
      if (!code_[static_cast<std::size_t>(result)].per_lane) {
        out[out_offsets[k]] = scalar[static_cast<std::size_t>(result)];
      }
    }
    bool any_per_lane = false;
    for (int result : results_) any_per_lane |= code_[static_cast<std::size_t>(result)].per_lane;
    if (!any_per_lane) return;
    for (std::int64_t lane = 0; lane < lanes; ++lane) {
      for (std::size_t index = 0; index < code_.size(); ++index) {
        if (code_[index].per_lane) lane_values[index] = execute(code_[index], input, lane_values, lane);
      }
      for (std::size_t k = 0; k < results_.size(); ++k) {
        const int result = results_[k];
        if (code_[static_cast<std::size_t>(result)].per_lane) {
          out[out_offsets[k] + static_cast<std::size_t>(lane)] = lane_values[static_cast<std::size_t>(result)];
        }
      }
    }
  }

 private:
  int compile(const Term& term, const std::map<std::string, VariableSlot>& slots) {
    Instruction instruction;
    instruction.kind = term.kind;
    switch (term.kind) {
      case Term::Kind::variable: {
        const auto slot = slots.find(term.name);
        if (slot == slots.end()) throw InputError(fmt::format("law term reads unknown variable '{}'", term.name));
        instruction.input_offset = slot->second.offset;
        instruction.per_lane = slot->second.per_lane;
        break;
      }
      case Term::Kind::constant: instruction.constant = term.value; break;
      case Term::Kind::negative_infinity: instruction.constant = -std::numeric_limits<double>::infinity(); break;
      default:
        instruction.left = compile(*term.operands[0], slots);
        instruction.per_lane = code_[static_cast<std::size_t>(instruction.left)].per_lane;
        if (term.operands.size() > 1) {
          instruction.right = compile(*term.operands[1], slots);
          instruction.per_lane |= code_[static_cast<std::size_t>(instruction.right)].per_lane;
        }
    }
    code_.push_back(instruction);
    return static_cast<int>(code_.size() - 1);
  }

  static double execute(const Instruction& instruction, std::span<const double> input, const std::vector<double>& values,
                        std::int64_t lane) {
    auto at = [&](int index) { return values[static_cast<std::size_t>(index)]; };
    switch (instruction.kind) {
      case Term::Kind::variable:
        return input[instruction.input_offset + (instruction.per_lane ? static_cast<std::size_t>(lane) : 0)];
      case Term::Kind::constant:
      case Term::Kind::negative_infinity: return instruction.constant;
      case Term::Kind::add: return at(instruction.left) + at(instruction.right);
      // −inf − (−inf) = −inf: a state or score at −inf weighs nothing (its exp is 0), so merging
      // two identities gives the identity and a row whose scores are all −inf ends at l = 0,
      // 0 / 0 = NaN, as softmax over it does. Otherwise IEEE: +inf − (+inf) = NaN, as softmax over
      // a row holding +inf gives (a shortcut to 0 here once gave one-hot rows and means of v).
      case Term::Kind::subtract: {
        const double a = at(instruction.left), b = at(instruction.right);
        return a == b && a == -std::numeric_limits<double>::infinity() ? a : a - b;
      }
      case Term::Kind::multiply: return at(instruction.left) * at(instruction.right);
      case Term::Kind::divide: return at(instruction.left) / at(instruction.right);
      case Term::Kind::max: return std::max(at(instruction.left), at(instruction.right));
      case Term::Kind::exp: return std::exp(at(instruction.left));
    }
    return 0;
  }

  std::vector<Instruction> code_;
  std::vector<int> results_;
};

// Slots of prefixed components laid out one after another from `offset`.
std::size_t lay_out(const std::string& prefix, const std::vector<LawComponent>& components, std::int64_t lanes,
                    std::size_t offset, std::map<std::string, VariableSlot>& slots, std::vector<std::size_t>* offsets) {
  for (const LawComponent& component : components) {
    slots[prefix + "." + component.name] = {offset, component.per_lane};
    if (offsets) offsets->push_back(offset);
    offset += component.per_lane ? static_cast<std::size_t>(lanes) : 1;
  }
  return offset;
}

}  // namespace

struct LawEvaluator::Programs {
  std::int64_t lanes = 1;
  std::size_t state_size = 0;
  std::size_t element_size = 0;
  std::vector<std::size_t> state_offsets;
  Program identity, lift, merge, finalize;
};

LawEvaluator::LawEvaluator(const ReductionLaw& law, std::int64_t lanes) : programs_(std::make_unique<Programs>()) {
  if (lanes < 1) throw InputError(fmt::format("law '{}': lanes must be positive, got {}", law.name, lanes));
  if (law.identity.size() != law.state.size() || law.lift.size() != law.state.size() ||
      law.merge.size() != law.state.size() || !law.finalize) {
    throw InputError(fmt::format("law '{}': one identity, lift and merge term per state component, and a finalize", law.name));
  }
  Programs& p = *programs_;
  p.lanes = lanes;
  std::map<std::string, VariableSlot> none;
  std::map<std::string, VariableSlot> element_slots;
  std::map<std::string, VariableSlot> merge_slots;
  std::map<std::string, VariableSlot> finalize_slots;
  p.element_size = lay_out("e", law.element, lanes, 0, element_slots, nullptr);
  p.state_size = lay_out("a", law.state, lanes, 0, merge_slots, &p.state_offsets);
  lay_out("b", law.state, lanes, p.state_size, merge_slots, nullptr);
  lay_out("a", law.state, lanes, 0, finalize_slots, nullptr);
  p.identity = Program(law.identity, none);
  p.lift = Program(law.lift, element_slots);
  p.merge = Program(law.merge, merge_slots);
  p.finalize = Program({law.finalize}, finalize_slots);
}

LawEvaluator::~LawEvaluator() = default;
LawEvaluator::LawEvaluator(LawEvaluator&&) noexcept = default;
LawEvaluator& LawEvaluator::operator=(LawEvaluator&&) noexcept = default;

std::size_t LawEvaluator::state_size() const { return programs_->state_size; }
std::size_t LawEvaluator::element_size() const { return programs_->element_size; }

std::vector<double> LawEvaluator::identity() const {
  std::vector<double> state(programs_->state_size);
  programs_->identity.run({}, programs_->lanes, state, programs_->state_offsets);
  return state;
}

void LawEvaluator::lift(std::span<const double> element, std::span<double> state) const {
  programs_->lift.run(element, programs_->lanes, state, programs_->state_offsets);
}

void LawEvaluator::merge_into(std::span<double> left, std::span<const double> right) const {
  std::vector<double> both(left.begin(), left.end());
  both.insert(both.end(), right.begin(), right.end());
  programs_->merge.run(both, programs_->lanes, left, programs_->state_offsets);
}

void LawEvaluator::finalize(std::span<const double> state, std::span<double> out) const {
  const std::size_t zero = 0;
  programs_->finalize.run(state, programs_->lanes, out, std::span(&zero, 1));
}

}  // namespace metile
