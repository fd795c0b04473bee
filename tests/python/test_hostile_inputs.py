"""Hostile inputs from Python (issue 11): None where an object belongs, specs the
C++ side would mis-size, integers beyond 64 bits, JSON nested past the depth
limit or holding numbers beyond double. Each is a ValueError or TypeError with a
message, never a segfault or pybind11's "Unable to cast"; numpy scalars are
taken like the Python numbers they stand for."""
import os
import subprocess
import sys

import numpy as np
import pytest

import metile


def scaled_graph():
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((2, 3), "f32"))
    y = builder.scale(x, 2.0)
    return builder.build((y,))


def test_none_where_a_graph_belongs_is_a_type_error():
    with pytest.raises(TypeError):
        metile.plan_graph_fusion(None)
    with pytest.raises(TypeError):  # a null graph dereferenced: a segfault before
        metile.plan_with_discovery(None)
    with pytest.raises(TypeError):
        metile.random_inputs(None, 0)
    with pytest.raises(TypeError):
        metile.run(None, {})
    builder = metile.GraphBuilder()
    with pytest.raises(TypeError):
        builder.add(None, None)


# The ops the op table adds to GraphBuilder (sum, mean, argmax, embedding, kv_cache_write,
# flash_attention, ...) take *inputs: a str or None among them, or a name that is not a str, was
# pybind11's "Unable to cast Python instance to C++ type", naming neither the op nor the argument.
def test_table_ops_name_a_wrong_argument_type():
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((2, 8), "f32"))
    with pytest.raises(TypeError, match="^sum: input 0 must be a ValueRef, got str 'x'$"):
        builder.sum("x")
    with pytest.raises(TypeError, match="^argmax: input 0 must be a ValueRef, got NoneType None$"):
        builder.argmax(None)
    with pytest.raises(TypeError, match="^kv_cache_write: input 2 must be a ValueRef, got int 3$"):
        builder.kv_cache_write(x, x, 3)
    with pytest.raises(TypeError, match="^mean: name must be a str or None, got int$"):
        builder.mean(x, name=5)
    assert builder.mean(x, name="m").name == "m"
    assert builder.sum(x, name=None).spec == metile.TensorSpec((2, 1), "f32")


# Text with a lone surrogate (bytes that are not UTF-8, decoded with surrogateescape) has no UTF-8
# spelling: as an input name, an attribute's key or value, or a table op's name it was pybind11's
# "Unable to cast Python instance to C++ type"; now a ValueError naming the argument.
def test_text_that_is_not_utf8_is_a_value_error_naming_the_argument():
    bad = b"\x80".decode("utf-8", "surrogateescape")
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((2,), "f16"))
    graph = builder.build([builder.exp(x)])
    with pytest.raises(ValueError, match="run: an input name: .* is not UTF-8 text"):
        metile.run(graph, {bad: np.ones(2, np.float16)})
    with pytest.raises(ValueError, match="attribute 'approximate': .* is not UTF-8 text"):
        builder.add_node("gelu", [x], {"approximate": bad})
    with pytest.raises(ValueError, match="an attribute name: .* is not UTF-8 text"):
        builder.add_node("gelu", [x], {bad: "tanh"})
    with pytest.raises(ValueError, match="sum: name: .* is not UTF-8 text"):
        builder.sum(x, name=bad)
    # Every other str parameter: pybind11's own cast made these "incompatible function arguments", a
    # TypeError, where any other bad value is a ValueError.
    graph_text = graph.to_json()
    calls = {
        "input name": lambda: builder.input(bad, metile.TensorSpec((2,), "f16")),
        "a method's name": lambda: builder.exp(x, name=bad),
        "gelu approximate": lambda: builder.gelu(x, approximate=bad),
        "cast dtype": lambda: builder.cast(x, bad),
        "add_node op": lambda: builder.add_node(bad, [x]),
        "rename": lambda: builder.rename(x, bad),
        "TensorSpec dtype": lambda: metile.TensorSpec((2,), bad),
        "find_value": lambda: graph.find_value(bad),
        "find_node": lambda: graph.find_node(bad),
        "ComputeGraph.from_json text": lambda: metile.ComputeGraph.from_json(graph_text + bad),
        "ComputeGraph.from_json source": lambda: metile.ComputeGraph.from_json(graph_text, bad),
        "FusionTarget.from_json": lambda: metile.FusionTarget.from_json("{}", bad),
        "minimum_cut solver": lambda: _one_edge_network().minimum_cut(0, 1, bad),
        "load_model dtype": lambda: metile.load_model("/nonexistent", dtype=bad),
        "synth_model preset": lambda: metile.synth_model("/nonexistent/x", preset=bad),
        "synth_model arch": lambda: metile.synth_model("/nonexistent/x", arch=bad),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match="is not UTF-8 text"):
            call()  # the traceback's lambda names the case
    # A type that is not text is still pybind11's TypeError; bytes are taken as they are, as before.
    with pytest.raises(TypeError):
        graph.find_value(5)
    assert metile.ComputeGraph.from_json(graph_text.encode()) == graph
    assert metile.ComputeGraph.from_json(bytearray(graph_text.encode()), b"source") == graph
    assert graph.find_value(b"x") is not None
    # ... when they are UTF-8: a name recorded from b"r\xff" made every later str of it a UnicodeDecodeError.
    builder = metile.GraphBuilder()
    with pytest.raises(ValueError, match=r"a bytes argument: b'\\xfe\\xff' is not UTF-8 text"):
        builder.input(b"\xfe\xff", metile.TensorSpec((4,), "f32"))
    x = builder.input("x", metile.TensorSpec((4,), "f32"))
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        builder.exp(x, name=bytearray(b"r\xff"))
    assert builder.exp(x, name="r\u00e9".encode()).name == "r\u00e9"
    # A path is not text: a file name that is not UTF-8 is looked for as the file system spells it.
    with pytest.raises(ValueError, match="nor an existing file"):
        metile.FusionTarget.from_name_or_file("/nonexistent/" + bad)


def _one_edge_network():
    network = metile.FlowNetwork()
    network.add_edge(0, 1, 1)
    return network


def test_tensor_specs_are_checked_when_made():
    with pytest.raises(ValueError, match=r"TensorSpec: dimension 0 of f32\[-1, 5\] is not positive"):
        metile.TensorSpec((-1, 5), "f32")
    with pytest.raises(ValueError, match="is not positive"):
        metile.TensorSpec((4, 0), "f32")
    with pytest.raises(ValueError, match=r"has more than 2\^48 elements"):
        metile.TensorSpec((2**32, 2**32), "f32")
    with pytest.raises(ValueError, match="rank 33 is above the limit of 32"):
        metile.TensorSpec((1,) * 33, "f32")
    with pytest.raises(ValueError, match=r"TensorSpec shape: integer 1180591620717411303424 does not fit in 64 bits"):
        metile.TensorSpec((2**70,), "f32")
    # bool is an int to Python, never a dimension (the JSON reader refuses true as well); numpy ints are ints.
    with pytest.raises(TypeError, match="TensorSpec shape: a list of ints, got bool True"):
        metile.TensorSpec((True, 3), "f32")
    with pytest.raises(TypeError, match="TensorSpec shape: expected a list or tuple of ints, got int"):
        metile.TensorSpec(3, "f32")
    assert metile.TensorSpec((np.int64(2), np.int32(3)), "f32").shape == (2, 3)
    assert metile.TensorSpec(np.array([2, 3]), "f32").shape == (2, 3)  # any sequence but text
    assert metile.TensorSpec(range(1, 3), "f32").shape == (1, 2)
    with pytest.raises(TypeError, match="TensorSpec shape: expected a list or tuple of ints, got str"):
        metile.TensorSpec("23", "f32")
    assert metile.TensorSpec((2**24, 2**24), "f16").element_count == 2**48


def test_output_shapes_are_checked_like_input_shapes():
    builder = metile.GraphBuilder()
    a = builder.input("a", metile.TensorSpec((2**32, 1), "f32"))
    b = builder.input("b", metile.TensorSpec((1, 2**32), "f32"))
    with pytest.raises(ValueError, match=r"output: f32\[4294967296, 4294967296\] has more than 2\^48 elements"):
        builder.matmul(a, b)


def test_attributes_beyond_64_bits_are_value_errors():
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((2, 3), "f32"))
    with pytest.raises(ValueError, match=r"attribute 'shape': integer 1180591620717411303424 does not fit in 64 bits"):
        builder.add_node("reshape", [x], {"shape": [2**70]})
    with pytest.raises(ValueError, match="reshape shape: integer 1180591620717411303424 does not fit in 64 bits"):
        builder.reshape(x, [2**70])
    with pytest.raises(TypeError, match="reshape shape: a list of ints, got bool False"):
        builder.reshape(x, [6, False])
    with pytest.raises(TypeError, match="transpose perm: a list of ints, got float 1.0"):
        builder.transpose(x, [1.0, 0])
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        builder.add_node("causal_mask", [x], {"offset": -(2**64)})


# Attributes (add_node's dict, the op table's keywords) take numpy scalars as the Python numbers they
# stand for, as shapes, softmax(x, axis) and FlowNetwork capacities do: {"axis": np.int64(0)} and
# {"factor": np.float32(0.5)} were TypeErrors ("expected int, float, str or a list of ints, got int64")
# while [np.int64(2)] in a list attribute was an int.
def test_numpy_attributes_count_like_python_numbers(rng):
    shape = tuple(int(d) for d in rng.integers(1, 6, size=2))  # the rng fixture prints its seed
    axis = int(rng.integers(0, 2))
    factor = float(rng.uniform(0.25, 4.0))
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec(shape, "f32"))
    for make in (np.int64, np.int32, np.uint8, int):
        (softmax,) = builder.add_node("softmax", [x], {"axis": make(axis)})
        assert builder._build([softmax]).nodes[-1].attributes == {"axis": axis}
    for make in (np.float32, np.float16, np.float64, float):
        (scaled,) = builder.add_node("scale", [x], {"factor": make(factor)})
        assert builder._build([scaled]).nodes[-1].attributes == {"factor": float(make(factor))}
    (product,) = builder.add_node("matmul", [x, x], {"transpose_right": np.bool_(True)})
    assert builder._build([product]).nodes[-1].attributes == {"transpose_right": 1}
    assert builder.sum(x, name=None).spec.shape == (shape[0], 1)
    with pytest.raises(ValueError, match=r"attribute 'offset': integer 18446744073709551615 does not fit in 64 bits"):
        builder.add_node("causal_mask", [x], {"offset": np.uint64(2**64 - 1)})
    with pytest.raises(TypeError, match="attribute 'axis': expected int, float, str or a list of ints, got complex128"):
        builder.add_node("softmax", [x], {"axis": np.complex128(1)})
    with pytest.raises(ValueError, match="attribute 'factor' must be finite"):
        builder.add_node("scale", [x], {"factor": np.float32("nan")})
    # A bool is the flag's value only, as in a graph file ("axis": true is an error there): add_node took
    # True as axis 1 and as a factor of 1.
    for name, kind in (("axis", "softmax"), ("factor", "scale")):
        for flag in (True, np.bool_(False)):
            with pytest.raises(TypeError, match=rf"^attribute '{name}' takes a number, not a boolean \(only transpose_right is a flag\)$"):
                builder.add_node(kind, [x], {name: flag})


def test_numpy_capacities_count_like_python_numbers(rng):
    capacities = rng.integers(1, 1000, size=3)
    network = metile.FlowNetwork()
    network.add_edge("s", "a", np.int64(capacities[0]))
    network.add_edge("a", "t", np.uint32(capacities[1]))
    network.add_edge("s", "t", int(capacities[2]))
    value, _ = network.minimum_cut("s", "t")
    assert isinstance(value, int)
    assert value == min(capacities[0], capacities[1]) + capacities[2]
    real = metile.FlowNetwork()
    real.add_edge("s", "t", np.float32(0.5))
    real.add_edge("s", "t", np.float64(0.25))
    assert real.minimum_cut("s", "t")[0] == 0.75
    bool_name = type(np.bool_(True)).__name__  # numpy 2 calls it bool, numpy 1 bool_
    with pytest.raises(TypeError, match="capacity must be an int or a float, got " + bool_name):
        real.add_edge("s", "t", np.bool_(True))
    with pytest.raises(ValueError, match="does not fit in a 64-bit integer"):
        real.add_edge("s", "t", np.uint64(2**64 - 1))


# random_inputs' seed as synth_model's and the CLI's --seed: an integer from 0 to 2^64 - 1, True is not
# seed 1. It was a plain uint64 argument: True drew seed 1's inputs, -1 was pybind11's "incompatible
# function arguments" TypeError (the CLI says "--seed must be an integer from 0 to 2^64 - 1").
def test_random_inputs_seed_is_checked_like_synth_models(rng):
    graph = scaled_graph()
    seed = int(rng.integers(0, 2**63))  # the rng fixture prints its seed
    drawn = metile.random_inputs(graph, seed)
    for same in (np.uint64(seed), np.int64(seed)):
        assert np.array_equal(metile.random_inputs(graph, same)["x"], drawn["x"])
    assert np.array_equal(metile.random_inputs(graph, 2**64 - 1)["x"], metile.random_inputs(graph, seed=2**64 - 1)["x"])
    with pytest.raises(TypeError, match="random_inputs: seed must be an integer, got bool"):
        metile.random_inputs(graph, True)
    with pytest.raises(TypeError, match="random_inputs: seed must be an integer, got float"):
        metile.random_inputs(graph, 1.0)
    with pytest.raises(ValueError, match=r"random_inputs: seed: -1 is not an integer from 0 to 2\^64 - 1"):
        metile.random_inputs(graph, -1)
    with pytest.raises(ValueError, match="random_inputs: seed: 18446744073709551616 is not an integer"):
        metile.random_inputs(graph, 2**64)


# Inputs past the machine's memory are refused by name before anything is allocated, as run() refuses
# the graph: random_inputs raised "MemoryError std::bad_alloc".
def test_random_inputs_past_the_machine_are_a_value_error():
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((1 << 24, 1 << 24), "f32"))
    graph = builder.build([builder.exp(x, name="e")])
    with pytest.raises(ValueError, match=r"random inputs: the graph's inputs need more than this machine's \d+ bytes "
                                         r"of memory \(input 'x' brings them to 1125899906842624 bytes\)"):
        metile.random_inputs(graph, 0)


def test_graph_json_limits():
    text = scaled_graph().to_json()
    deep = text.replace('"shape": [2, 3]', '"shape": ' + "[" * 100000 + "]" * 100000)
    with pytest.raises(ValueError, match="invalid JSON: nested deeper than 64 levels"):
        metile.ComputeGraph.from_json(deep)
    with pytest.raises(ValueError, match="invalid JSON: number overflow parsing '1e400'"):
        metile.ComputeGraph.from_json(text.replace('"factor": 2', '"factor": 1e400'))


def test_many_outputs_load(rng):
    count = int(rng.integers(20000, 30000))
    nodes = ",".join(f'{{"name": "y{i}", "op": "scale", "inputs": ["x"], "attrs": {{"factor": 2.0}}}}'
                     for i in range(count))
    outputs = ",".join(f'"y{i}"' for i in range(count))
    text = ('{"inputs": [{"name": "x", "shape": [1], "dtype": "f32"}], "nodes": [' + nodes +
            '], "outputs": [' + outputs + "]}")
    graph = metile.ComputeGraph.from_json(text)
    assert len(graph.outputs) == count
    with pytest.raises(ValueError, match=f"/outputs/{count}: 'y0' is listed twice"):
        metile.ComputeGraph.from_json(text.replace(outputs, outputs + ',"y0"'))


def test_a_parse_error_quoting_invalid_utf8_keeps_its_message(tmp_path):
    # nlohmann quotes the bytes it last read; half a UTF-8 sequence there once made the ValueError empty.
    with pytest.raises(ValueError, match=r"invalid JSON: .*\\xc3"):  # U+00FF is C3 BF; the parser stops at C3
        metile.ComputeGraph.from_json("\xff")
    path = tmp_path / "bad.json"
    path.write_bytes(b'{"inputs": [{"name": "a\xff", "shape": [4], "dtype": "f32"}], "nodes": [], "outputs": []}')
    with pytest.raises(ValueError) as error:
        metile.read_graph(str(path))
    assert str(error.value), "the message is empty"


def test_transpose_right_is_a_flag_as_in_a_graph_file():
    # pybind11's bool took anything truthy (2, 0.5) and None as False; add_node and JSON refuse them.
    builder = metile.GraphBuilder()
    a = builder.input("a", metile.TensorSpec((2, 3), "f32"))
    b = builder.input("b", metile.TensorSpec((4, 3), "f32"))
    with pytest.raises(ValueError, match="transpose_right must be 0 or 1, got 2"):
        builder.matmul(a, b, transpose_right=2)
    for bad in (0.5, None, "yes"):
        with pytest.raises(TypeError):
            builder.matmul(a, b, transpose_right=bad)
    assert builder.spec(builder.matmul(a, b, transpose_right=1)).shape == (2, 4)
    assert builder.spec(builder.matmul(a, b, transpose_right=np.bool_(True))).shape == (2, 4)


def test_typed_methods_check_numbers_as_add_node_does():
    # pybind11's own casters gave a multi-line TypeError with a signature dump for an int past 64 bits,
    # and narrowed quantized_matmul's bits = 2**32 + 4 to 4; now each is add_node's one-line error.
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((2, 64), "f32"))
    positions = builder.input("positions", metile.TensorSpec((2,), "i32"))
    for call, message in (
            (lambda: builder.causal_mask(x, offset=2**70), "offset: integer 1180591620717411303424 does not fit in 64 bits"),
            (lambda: builder.softmax(x, axis=2**64), "axis: integer 18446744073709551616 does not fit in 64 bits"),
            (lambda: builder.scale(x, 10**400), "factor: integer 1000"),
            (lambda: builder.rope(x, positions, 10000.0, 2**63), "dims: integer 9223372036854775808 does not fit")):
        with pytest.raises(ValueError, match=message):
            call()
    packed = builder.input("packed", metile.TensorSpec((8, 8), "u32"))
    scales = builder.input("scales", metile.TensorSpec((8, 2), "f32"))
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 4294967300"):
        builder.quantized_matmul(x, packed, scales, scales, 2**32 + 4, 32)
    for call in (lambda: builder.scale(x, "two"), lambda: builder.scale(x, True), lambda: builder.softmax(x, axis=1.5),
                 lambda: builder.rms_norm(x, x, None)):
        with pytest.raises(TypeError):
            call()
    assert builder.spec(builder.scale(x, np.float32(0.5))) == metile.TensorSpec((2, 64), "f32")
    assert builder.spec(builder.causal_mask(x, offset=np.int64(3))) == metile.TensorSpec((2, 64), "f32")


# The text fields of rules and targets took bytes that are not UTF-8 as they were: from then on every read
# of the field, repr(rule) and a plan naming the rule (explain, region.rule) raised UnicodeDecodeError, and
# to_json wrote U+FFFD. A str with a lone surrogate was "incompatible function arguments" naming no field.
TEXT_FIELDS = [(metile.elementwise_chain_rule, "name"), (metile.elementwise_chain_rule, "description"),
               (metile.elementwise_chain_rule, "epilogue_add_operand_role"), (metile.FusionTarget.cpu, "name"),
               (metile.OpPattern, "role")]


@pytest.mark.parametrize("make, field", TEXT_FIELDS)
def test_text_fields_of_rules_and_targets_refuse_text_that_cannot_be_read_back(make, field):
    held = make()
    before = getattr(held, field)
    owner = type(held).__name__
    with pytest.raises(TypeError, match=f"^{owner}.{field}: expected a str, got bytes$"):
        setattr(held, field, b"\xff")
    with pytest.raises(ValueError, match=f"^{owner}.{field}: .* is not UTF-8 text"):
        setattr(held, field, b"\xff".decode("utf-8", "surrogateescape"))
    assert getattr(held, field) == before and repr(held)  # unchanged, and still readable
    setattr(held, field, "é")
    assert getattr(held, field) == "é"


def test_text_list_fields_of_patterns_refuse_what_is_not_a_list_of_str():
    pattern = metile.OpPattern()
    with pytest.raises(TypeError, match=r"^OpPattern.ops item 1: expected a str, got bytes$"):
        pattern.ops = ["exp", b"\xfe"]
    with pytest.raises(TypeError, match=r"^OpPattern.inputs: expected a list of str, got str$"):
        pattern.inputs = "ab"  # not ['a', 'b']
    assert pattern.ops == [] and pattern.inputs == []
    pattern.ops, pattern.inputs = ("exp", "silu"), ["x"]
    assert pattern.ops == ["exp", "silu"] and pattern.inputs == ["x"]
    rule = metile.elementwise_chain_rule()
    rule.name = "chain"
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((4,), "f32"))
    plan = metile.plan_graph_fusion(builder.build([builder.exp(builder.silu(x))]), "cpu", [rule])
    assert [region.rule for region in plan.regions] == ["chain"] and "chain" in str(plan)


# The numbers and flags of rules and rule sets were pybind11's own: True was 1, 2 or 0.5 a flag, and an int
# past 32 bits "incompatible function arguments" naming no field (FusionTarget's integers already said it).
def test_numbers_and_flags_of_rules_are_checked_naming_the_field(rng):
    inside = int(rng.integers(0, 2**31))
    past = int(rng.integers(2**31, 2**63))
    resources, growth, rule_set = metile.ResourceNeeds(), metile.GrowthSpec(), metile.RuleSet()
    for held, field in ((resources, "base_registers"), (resources, "registers_per_contraction"),
                        (growth, "max_depth"), (rule_set, "max_neighborhood_nodes"),
                        (rule_set, "max_exact_component_size")):
        owner = type(held).__name__
        before = getattr(held, field)
        with pytest.raises(TypeError, match=f"^{owner}.{field} must be an integer, got bool$"):
            setattr(held, field, True)
        with pytest.raises(ValueError, match=f"^{owner}: field '{field}' is {past}, past its limit of 2147483647$"):
            setattr(held, field, past)
        assert getattr(held, field) == before
        setattr(held, field, np.int64(inside))
        assert getattr(held, field) == inside
    with pytest.raises(ValueError, match=f"^RuleSet: field 'max_neighborhood_nodes' is {past}, past its limit"):
        metile.RuleSet([], past)
    with pytest.raises(TypeError, match="^RuleSet.max_exact_component_size must be an integer, got bool$"):
        metile.RuleSet([], 64, True)
    assert metile.RuleSet([], np.int32(3), 5).max_neighborhood_nodes == 3
    rule, pattern = metile.elementwise_chain_rule(), metile.OpPattern()
    for held, field in ((resources, "stages_reduction_rows"), (rule, "anchor_must_be_sink"),
                        (rule, "materializes_escaping_values"), (pattern, "commutative"), (pattern, "may_escape")):
        before = getattr(held, field)
        for bad in (2, 0.5, None, "no"):
            with pytest.raises(TypeError, match=f"^{type(held).__name__}.{field} must be True or False, got "):
                setattr(held, field, bad)
        assert getattr(held, field) == before
        setattr(held, field, np.bool_(not before))
        assert getattr(held, field) is (not before)
    with pytest.raises(TypeError, match=r"^GrowthSpec.kinds: expected a list of op kind names, got str$"):
        growth.kinds = "elementwise"
    with pytest.raises(TypeError, match=r"^GrowthSpec.kinds item 1: expected a str, got int$"):
        growth.kinds = ["elementwise", 3]
    with pytest.raises(ValueError, match=r"^unknown op kind 'elementwize' \(expected elementwise, "):
        growth.kinds = ("elementwize",)
    assert growth.kinds == []
    growth.kinds = ("row_reduction", "elementwise")
    assert growth.kinds == ["row_reduction", "elementwise"]
    target = metile.FusionTarget.cpu()
    with pytest.raises(TypeError, match="^FusionTarget.launch_overhead_ns must be a number, got bool$"):
        target.launch_overhead_ns = True
    target.memory_bandwidth_bytes_per_ns = inside
    assert target.memory_bandwidth_bytes_per_ns == float(inside)


# A graph or target file may be a FIFO (the readers take special files within their size limit). Its
# writer a Python thread of the same process, read_graph, FusionTarget.from_json_file and a target path
# given to plan_graph_fusion read it holding the GIL: the writer never ran and the read never ended (a
# hang no Ctrl-C ends). Run in a child process so that the hang is a failure, not a stuck suite.
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_files_read_through_a_fifo_written_by_a_python_thread(tmp_path):
    script = (
        "import os, threading, metile\n"
        "builder = metile.GraphBuilder()\n"
        "x = builder.input('x', metile.TensorSpec((2,), 'f32'))\n"
        "graph = builder.build([builder.exp(x)])\n"
        "target = metile.FusionTarget.cpu().to_json()\n"
        "readers = {'graph': (graph.to_json(), lambda path: metile.read_graph(path) == graph),\n"
        "           'target': (target, lambda path: metile.FusionTarget.from_json_file(path).name),\n"
        "           'plan': (target, lambda path: metile.plan_graph_fusion(graph, path).target_name)}\n"
        "for kind, (text, read) in readers.items():\n"
        f"    path = os.path.join({str(tmp_path)!r}, kind)\n"
        "    os.mkfifo(path)\n"
        "    def write(path=path, text=text):\n"
        "        with open(path, 'w') as fifo:\n"
        "            fifo.write(text)\n"
        "    writer = threading.Thread(target=write)\n"
        "    writer.start()\n"
        "    print(kind, read(path), flush=True)\n"
        "    writer.join()\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n") == ["graph True", "target cpu", "plan cpu", ""]
