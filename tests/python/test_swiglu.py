"""The SwiGLU MLP plans to one parallel-epilogue region (gate and up contractions,
silu(gate) * up, and the down contraction) whichever operand order the multiply has,
with the default rules and with the ParallelEpilogueRule alone."""
import pytest

import metile
from example_graphs import swiglu_graph

MLP_NODES = {"gate", "up", "gate_activation", "gated", "down"}


def the_parallel_epilogue_region(plan):
    rule_name = metile.ParallelEpilogueRule().name
    regions = [region for region in plan.regions if region.rule == rule_name]
    assert len(regions) == 1, plan.explain()
    return regions[0]


@pytest.mark.parametrize("order", ["gate_first", "up_first"])
def test_default_rules_plan_the_mlp_as_one_parallel_epilogue(order):
    graph = swiglu_graph(order)
    plan = metile.plan_graph_fusion(graph)
    region = the_parallel_epilogue_region(plan)
    assert {node.name for node in region.nodes} == MLP_NODES
    assert [value.name for value in region.outputs] == ["down"]
    assert {value.name for value in region.inputs} == {"x", "gate_weight", "up_weight", "down_weight"}
    assert region.benefit_ns > 0
    assert plan.kernel_count == 1 and plan.unfused == []
    assert region.rule in str(plan)


@pytest.mark.parametrize("order", ["gate_first", "up_first"])
def test_the_parallel_epilogue_rule_alone_finds_the_region(order):
    rule = metile.ParallelEpilogueRule()
    assert isinstance(rule, metile.FusionRule)
    assert rule.name == metile.parallel_epilogue_rule().name
    assert rule.name in [default.name for default in metile.default_rules().rules]
    plan = metile.plan_graph_fusion(swiglu_graph(order), rules=[rule])
    assert {node.name for node in the_parallel_epilogue_region(plan).nodes} == MLP_NODES


def test_without_rules_nothing_is_fused():
    graph = swiglu_graph("gate_first")
    plan = metile.plan_graph_fusion(graph, rules=[])
    assert plan.regions == []
    assert {node.name for node in plan.unfused} == MLP_NODES
    assert plan.kernel_count == len(MLP_NODES)
    assert set(plan.node_reasons) == MLP_NODES


@pytest.mark.parametrize("order", ["gate_first", "up_first"])
def test_the_region_names_its_operands_by_role(order):
    region = the_parallel_epilogue_region(metile.plan_graph_fusion(swiglu_graph(order)))
    roles = {role: value.name for role, value in region.roles.items()}
    # swiglu_graph names each input after the role it plays; no residual add in this graph.
    assert roles == {"input": "x", "gate_weight": "gate_weight", "up_weight": "up_weight",
                     "down_weight": "down_weight"}
    assert all(value in region.inputs for value in region.roles.values())
