"""metile: compute-graph fusion compiler and runtime for transformer inference.

The Python face of the C++ library, name for name (include/metile/*.h): record a
graph with GraphBuilder, plan it with plan_graph_fusion, run it on the CPU
reference backend with run(), solve cuts with FlowNetwork, load decoder
checkpoints with load_model() (logits, greedy or sampled generate) or write one with synth_model(). The classes live in
the C++ extension `_metile`; this file re-exports them and adds the one piece of
sugar that needs Python itself: GraphBuilder.build() names values after the
caller's variables.

Errors: a mistake in the graph or the arguments' values (metile::InputError in
C++) is a ValueError carrying the C++ message; an argument of the wrong Python
type is a TypeError; a write the system refuses (a full disk, a file size limit:
metile::WriteError) is an OSError.
"""

import sys as _sys

from . import _metile
from ._metile import (
    DTYPES,
    ComputeGraph,
    ConflictComponent,
    FlowNetwork,
    FusionCandidate,
    FusionPlan,
    FusionRegion,
    FusionRule,
    FusionTarget,
    GrowthSpec,
    Model,
    Node,
    OpPattern,
    ResourceNeeds,
    RuleSet,
    TensorSpec,
    Value,
    ValueRef,
    contraction_epilogue_rule,
    default_rules,
    elementwise_chain_rule,
    parallel_epilogue_rule,
    plan_graph_fusion,
    plan_with_discovery,
    random_inputs,
    load_model,
    read_graph,
    residual_add_rms_norm_rule,
    row_reduction_rule,
    run,
    synth_model,
)

__version__ = _metile.__version__  # the project() version in CMakeLists.txt, as `metile --version` prints it

__all__ = [
    "DTYPES",
    "ComputeGraph",
    "ConflictComponent",
    "FlowNetwork",
    "FusionCandidate",
    "FusionPlan",
    "FusionRegion",
    "FusionRule",
    "FusionTarget",
    "GraphBuilder",
    "GrowthSpec",
    "Model",
    "Node",
    "OpPattern",
    "ParallelEpilogueRule",
    "ResourceNeeds",
    "RuleSet",
    "TensorSpec",
    "Value",
    "ValueRef",
    "contraction_epilogue_rule",
    "default_rules",
    "elementwise_chain_rule",
    "parallel_epilogue_rule",
    "plan_graph_fusion",
    "plan_with_discovery",
    "random_inputs",
    "load_model",
    "read_graph",
    "residual_add_rms_norm_rule",
    "row_reduction_rule",
    "run",
    "synth_model",
]


class ParallelEpilogueRule(FusionRule):
    """The SwiGLU MLP rule ("swiglu_mlp"), one of default_rules(): two contractions
    sharing their input, joined by silu(gate) * up in either operand order, consumed
    by a down contraction. The same rule as parallel_epilogue_rule(), under the name
    the design uses; pass it in plan_graph_fusion(graph, rules=[...])."""

    def __init__(self):
        super().__init__(parallel_epilogue_rule())


class GraphBuilder(_metile.GraphBuilder):
    """Records tensor ops without choosing kernel boundaries.

    Ops take keyword arguments and an optional ``name=``. A value recorded without
    a name gets one from the builder (the op and a counter, ``add_0``) until
    build(): then it takes the name of the caller's local variable that holds it,
    so that

        summed = builder.add(values, residual)
        graph = builder.build((summed,))

    yields a graph whose output is called ``summed``, as in a graph file. Only
    values whose names were invented are renamed; variables whose names start with
    an underscore are ignored, as are names already taken in the graph (the value
    keeps its invented name; a name only another invented value holds is not taken:
    that value moves aside to the name with ``_0`` appended, as it does for a
    ``name=`` given to an op); where several variables hold one value the first
    defined wins. Only the frame that calls build() is looked at: values held by
    the variables of a helper function that returned earlier keep invented names
    unless given ``name=``.
    """

    def build(self, outputs):
        """Returns the verified ComputeGraph whose outputs are ``outputs``.

        ``outputs`` is a tuple or list of this builder's values (or one value).
        Raises ValueError for a value of another builder or one listed twice.
        """
        if isinstance(outputs, ValueRef):
            outputs = (outputs,)
        if not isinstance(outputs, (tuple, list)):
            raise TypeError("build: outputs must be a tuple or list of ValueRef, got "
                            f"{type(outputs).__name__}")
        for position, output in enumerate(outputs):
            if not isinstance(output, ValueRef):
                raise TypeError(f"build: output {position} must be a ValueRef, got {type(output).__name__} "
                                f"{output!r}")
        caller = _sys._getframe(1)
        try:
            self._name_values_after_variables(caller.f_locals)
        finally:
            del caller  # a frame kept alive keeps every local of the caller alive
        return self._build(list(outputs))

    def _name_values_after_variables(self, variables):
        invented = set(self._auto_named_values())
        if not invented:
            return
        for variable, value in list(variables.items()):
            # exec() may pass a locals mapping whose keys are not all str.
            if (not isinstance(variable, str) or variable.startswith("_") or not isinstance(value, ValueRef) or
                    value not in invented):
                continue
            try:
                self.rename(value, variable)
            except ValueError:
                continue  # the name is taken: the value keeps the name the builder gave it
            invented.discard(value)
