"""FusionPlan and FusionTarget from Python: the JSON form the CLI prints, DOT, the
planner's determinism, targets by name and from JSON, and what the plan says about
nodes it leaves alone."""
import json
import math
import os

import pytest

import metile
from example_graphs import swiglu_graph


def residual_rms_norm_graph(width=2048):
    builder = metile.GraphBuilder()
    values = builder.input("values", metile.TensorSpec((1, width), "f16"))
    residual = builder.input("residual", metile.TensorSpec((1, width), "f16"))
    weight = builder.input("weight", metile.TensorSpec((width,), "f16"))
    summed = builder.add(values, residual)
    normalized = builder.rms_norm(summed, weight, 1e-5)
    return builder.build((summed, normalized))


def test_plan_json_lists_the_regions_by_name():
    plan = metile.plan_graph_fusion(residual_rms_norm_graph())
    document = json.loads(plan.to_json())
    assert document["kernels"] == plan.kernel_count == 1
    (region,) = document["regions"]
    assert region["rule"] == plan.regions[0].rule
    assert region["nodes"] == ["summed", "normalized"]
    assert region["inputs"] == ["values", "residual", "weight"]
    assert region["outputs"] == ["summed", "normalized"]
    assert region["benefit_ns"] == pytest.approx(plan.regions[0].benefit_ns)
    assert document["unfused"] == []


def test_plans_are_deterministic_byte_for_byte():
    graph = swiglu_graph("up_first")
    first = metile.plan_graph_fusion(graph)
    second = metile.plan_graph_fusion(metile.ComputeGraph.from_json(graph.to_json()))
    assert first.to_json() == second.to_json()
    assert first.explain() == second.explain()
    assert first.to_dot() == second.to_dot()


def test_dot_draws_each_region_as_a_cluster():
    dot = metile.plan_graph_fusion(residual_rms_norm_graph()).to_dot()
    assert dot.lstrip().startswith("digraph")
    assert "cluster" in dot and "summed" in dot and "normalized" in dot


def test_targets_by_object_name_and_json():
    h200 = metile.FusionTarget.h200()
    cpu = metile.FusionTarget.cpu()
    assert (h200.name, cpu.name) == ("h200", "cpu")
    assert repr(cpu).startswith("FusionTarget('cpu', launch_overhead_ns=")
    assert metile.FusionTarget().to_json() == h200.to_json()
    assert metile.FusionTarget.from_json(h200.to_json()).to_json() == h200.to_json()
    custom = metile.FusionTarget.from_json('{"base": "h200", "launch_overhead_ns": 7000}')
    assert custom.launch_overhead_ns == 7000 and custom.max_kernel_outputs == h200.max_kernel_outputs
    graph = residual_rms_norm_graph()
    assert metile.plan_graph_fusion(graph).target_name == "h200"
    assert metile.plan_graph_fusion(graph, target="cpu").target_name == "cpu"
    assert metile.plan_graph_fusion(graph, target=cpu).target_name == "cpu"


def test_target_file_by_path(tmp_path):
    path = tmp_path / "slow_launch.json"
    path.write_text('{"base": "cpu", "name": "slow_launch", "launch_overhead_ns": 90000}')
    plan = metile.plan_graph_fusion(residual_rms_norm_graph(), target=path)
    assert plan.target_name == "slow_launch"
    assert metile.FusionTarget.from_json_file(path).launch_overhead_ns == 90000


def test_target_file_whose_name_is_not_utf8(tmp_path):
    """A file name that is not UTF-8 (a Latin-1 one, say) reaches Python as a str with surrogate
    escapes: target= refused it with pybind11's "Unable to cast" where `metile plan --target` reads it."""
    path = tmp_path / os.fsdecode(b"caf\xe9.json")
    path.write_text('{"base": "cpu", "launch_overhead_ns": 90000}')
    for target in (path, str(path)):
        plan = metile.plan_graph_fusion(residual_rms_norm_graph(), target=target)
        assert plan.target_name == "caf\\xe9"  # the stem's byte spelled (FusionTarget.NameOfAFileIsText)
    with pytest.raises(ValueError, match="is neither a preset"):
        metile.plan_graph_fusion(residual_rms_norm_graph(), target=tmp_path / os.fsdecode(b"missing\xff.json"))


def test_a_tighter_target_changes_what_fits():
    """With kernels allowed one output, the residual sum cannot be written by the
    RMSNorm kernel, so the multi-output region is no longer legal."""
    target = metile.FusionTarget.h200()
    target.max_kernel_outputs = 1
    plan = metile.plan_graph_fusion(residual_rms_norm_graph(), target=target)
    assert all(len(region.outputs) <= 1 for region in plan.regions)
    assert plan.kernel_count == 2


# A target set field by field from Python meets the rule a target file meets, field by field, when the
# field is set: the planner checked only that every figure was positive, so memory_bandwidth_bytes_per_ns
# = 1e300 or inf planned (its to_json() then wrote null, which from_json refused) while a file saying 1e300
# was refused, and a NaN or 0 was "every cost and limit must be positive", naming no field. Then the
# setter stored NaN or -1 and only planning with the target refused it; now the setter refuses and the
# target keeps its value.
@pytest.mark.parametrize("field, value, message", [
    ("memory_bandwidth_bytes_per_ns", 1e300, r"field 'memory_bandwidth_bytes_per_ns' is above its limit of 1000000000000\.0: 1e\+300"),
    ("memory_bandwidth_bytes_per_ns", math.inf, r"field 'memory_bandwidth_bytes_per_ns' must be positive, got inf"),
    ("launch_overhead_ns", math.nan, r"field 'launch_overhead_ns' must be positive, got nan"),
    ("launch_overhead_ns", -1.0, r"field 'launch_overhead_ns' must be positive, got -1\.0"),
    ("on_chip_bandwidth_bytes_per_ns", 1e-9, r"field 'on_chip_bandwidth_bytes_per_ns' is below its limit of 1e-06: 1e-09"),
    ("threads_per_block", 0, r"field 'threads_per_block' must be positive, got 0"),
    ("shared_memory_per_block_bytes", -1, r"field 'shared_memory_per_block_bytes' must be positive, got -1"),
])
def test_a_target_set_from_python_meets_the_target_files_rule(field, value, message):
    target = metile.FusionTarget.cpu()
    before = getattr(target, field)
    with pytest.raises(ValueError, match="^fusion target 'cpu': " + message + "$"):
        setattr(target, field, value)
    assert getattr(target, field) == before
    assert metile.plan_graph_fusion(residual_rms_norm_graph(), target=target).target_name == "cpu"
    if math.isfinite(value):  # JSON has no inf or NaN: the file reader refuses them as not numbers
        with pytest.raises(ValueError, match="^t.json: " + message + "$"):
            metile.FusionTarget.from_json(f'{{"base": "cpu", "{field}": {value!r}}}', "t.json")


# A rule's register needs set from Python: a negative one took registers from the region's sum, so an
# rms_norm needing 300 registers (h200 allows 255 per thread) planned as one kernel with its add.
def test_negative_register_needs_are_refused_naming_the_field():
    rule = metile.residual_add_rms_norm_rule()
    rule.resources.registers_per_row_reduction = 300
    assert metile.plan_graph_fusion(residual_rms_norm_graph(), rules=[rule]).kernel_count == 2
    rule.resources.base_registers = -100
    with pytest.raises(ValueError, match=r"^rule 'residual_add_rms_norm': resources field 'base_registers' "
                                         r"must be 0 or more, got -100$"):
        metile.plan_graph_fusion(residual_rms_norm_graph(), rules=[rule])


def test_candidates_and_components_explain_the_selection():
    plan = metile.plan_graph_fusion(swiglu_graph("gate_first"))
    assert plan.candidates, "the planner proposed nothing"
    selected = [candidate for candidate in plan.candidates if candidate.region is not None]
    assert {candidate.rule for candidate in selected} == {region.rule for region in plan.regions}
    for index, candidate in enumerate(plan.candidates):
        component = plan.components[candidate.component]
        assert index in component.candidates
        assert component.method in {"single", "min_cut", "branch_and_bound", "greedy"}


# One exp read by three chains: the first round fuses one chain with it, the second each other chain
# alone (README, "Fusion planning"); its components say so.
def test_a_later_selection_round_fuses_the_chains_that_lost_their_shared_producer():
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((2, 32), "f32"))
    shared = builder.exp(x)
    graph = builder.build([builder.add(shared, builder.scale(x, 0.5 + k)) for k in range(3)])
    plan = metile.plan_graph_fusion(graph)
    assert plan.kernel_count == 3 and not plan.unfused
    assert sorted({component.round for component in plan.components}) == [1, 2]
    for candidate in plan.candidates:
        if plan.components[candidate.component].round == 2:
            assert candidate.region is not None and not candidate.conflicts
    # The first round's three chains hold the exp: one conflict group, each excluding the other two.
    assert len(plan.conflict_groups) == 1 and len(plan.conflict_groups[0]) == 3
    for index in plan.conflict_groups[0]:
        assert sorted(plan.candidates[index].conflicts) == sorted(set(plan.conflict_groups[0]) - {index})
    assert "2 rounds (each later one over the ops left unfused)" in str(plan)


def test_rule_sets_and_rules_are_data():
    rules = metile.default_rules()
    names = [rule.name for rule in rules.rules]
    assert names[0] == metile.residual_add_rms_norm_rule().name
    assert metile.ParallelEpilogueRule().name in names
    assert len(rules) == len(names) >= 5
    pattern = metile.ParallelEpilogueRule().pattern
    assert pattern[-1].kind == "contraction"  # the anchor: the down projection
    assert any(entry.commutative for entry in pattern)  # silu(gate) * up in either order
    only_norm = metile.RuleSet([metile.residual_add_rms_norm_rule()])
    plan = metile.plan_graph_fusion(swiglu_graph("gate_first"), rules=only_norm)
    assert plan.regions == []


def test_rule_and_pattern_lists_are_copies_that_outlive_a_reassignment():
    # def_readwrite handed out items that referred into the C++ vector: reassigning the list freed
    # what they read (an adversarial pass saw bad_alloc and garbage names).
    rule = metile.residual_add_rms_norm_rule()
    entries = len(rule.pattern)
    entry = rule.pattern[0]
    role = entry.role
    rule.pattern = rule.pattern + [metile.OpPattern()]
    assert entry.role == role and len(rule.pattern) == entries + 1
    rule_set = metile.default_rules()
    first = rule_set.rules[0]
    rule_set.rules = []
    assert first.name == metile.residual_add_rms_norm_rule().name and len(rule_set) == 0
    first.name = "changed"  # a copy: the rule set it came from is not changed through it
    assert metile.default_rules().rules[0].name != "changed"



@pytest.mark.parametrize("swapped", [False, True])
def test_residual_add_region_roles_follow_the_operand_order(swapped):
    builder = metile.GraphBuilder()
    a = builder.input("a", metile.TensorSpec((1, 256), "f32"))
    b = builder.input("b", metile.TensorSpec((1, 256), "f32"))
    weight = builder.input("weight", metile.TensorSpec((256,), "f32"))
    summed = builder.add(b, a) if swapped else builder.add(a, b)
    normalized = builder.rms_norm(summed, weight, 1e-5)
    plan = metile.plan_graph_fusion(builder.build((summed, normalized)))
    (region,) = plan.regions
    first, second = ("b", "a") if swapped else ("a", "b")
    expected = {"values": first, "residual": second, "norm_weight": "weight"}
    assert {role: value.name for role, value in region.roles.items()} == expected
    assert json.loads(plan.to_json())["regions"][0]["roles"] == expected
    assert f"roles:   values={first}, residual={second}, norm_weight=weight" in plan.explain()


# A rule's name is printed in explain() and in DOT labels, a line each: a control byte in it reached
# them raw (an escape sequence coloured the terminal, a newline forged a line). Refused as a graph's
# or a target's name is, with the bytes spelled.
def test_a_rule_name_with_a_control_byte_is_refused():
    rule = metile.residual_add_rms_norm_rule()
    rule.name = "evil\x1b[31mRED\n FAKE LINE"
    with pytest.raises(ValueError, match=r"^rule set: rule 'evil\\x1b\[31mRED\\x0a FAKE LINE': a name may not hold a "
                                         r"control character \(\\x1b at offset 4\)$"):
        metile.plan_graph_fusion(residual_rms_norm_graph(), rules=[rule])


# A pattern entry that can never match (an op name no node has, a "$" slot binding no name) made a rule
# that silently fused nothing; refused when the rule set is checked.
def test_a_pattern_entry_that_cannot_match_is_refused():
    def refused(entry, field, value, message):
        rule = metile.residual_add_rms_norm_rule()
        pattern = rule.pattern
        setattr(pattern[entry], field, value)
        rule.pattern = pattern
        with pytest.raises(ValueError, match=message):
            metile.plan_graph_fusion(residual_rms_norm_graph(), rules=[rule])

    refused(0, "ops", ["add", "frobnicate"],
            r"^rule 'residual_add_rms_norm': role 'sum' allows op 'frobnicate', which is not a registered op$")
    refused(1, "inputs", ["sum", "$"],
            r"^rule 'residual_add_rms_norm': role 'norm' has an input slot \"\$\" that names no binding$")
    # The rule as shipped plans the graph into one region.
    assert len(metile.plan_graph_fusion(residual_rms_norm_graph(), rules=[metile.residual_add_rms_norm_rule()]).regions) == 1


# An integer field set past its C++ type: pybind11's TypeError named no field.
def test_a_target_integer_field_past_its_type_names_the_field():
    target = metile.FusionTarget.cpu()
    with pytest.raises(ValueError, match=r"^FusionTarget: field 'threads_per_block' is 4294967552, past its limit of "
                                         r"2147483647$"):
        target.threads_per_block = 4294967552
    with pytest.raises(TypeError, match="threads_per_block must be an integer, got bool"):
        target.threads_per_block = True
    target.shared_memory_per_block_bytes = 2**40  # an int64 field
    assert target.shared_memory_per_block_bytes == 2**40
    target.threads_per_block = 128
    assert target.threads_per_block == 128


# A target's name set from Python is held to the file reader's rule when it is set: an empty one
# planned as "target ?" (then was refused only by planning).
def test_an_empty_target_name_is_refused_as_in_a_file():
    target = metile.FusionTarget.cpu()
    with pytest.raises(ValueError, match=r"^fusion target '': field 'name' must be a non-empty string$"):
        target.name = ""
    assert target.name == "cpu"
    target.name = "slow_launch"
    assert metile.plan_graph_fusion(residual_rms_norm_graph(), target=target).target_name == "slow_launch"
    with pytest.raises(ValueError, match=r"^t.json: field 'name' must be a non-empty string$"):
        metile.FusionTarget.from_json('{"base": "cpu", "name": ""}', "t.json")
