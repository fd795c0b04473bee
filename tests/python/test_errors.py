"""Bad input from Python is one clear exception, never a crash: ValueError (the C++
InputError, its message intact) for wrong values, TypeError for wrong Python types."""
import math
import pathlib

import numpy as np
import pytest

import metile


def spec(shape, dtype="f16"):
    return metile.TensorSpec(shape, dtype)


def small_graph():
    builder = metile.GraphBuilder()
    values = builder.input("values", spec((2, 8)))
    weight = builder.input("weight", spec((8,)))
    normalized = builder.rms_norm(values, weight, 1e-5)
    return builder.build((normalized,))


def test_unknown_dtype_strings():
    with pytest.raises(ValueError, match=r"unknown dtype 'f17' \(expected f16, bf16"):
        metile.TensorSpec((1, 2), "f17")
    builder = metile.GraphBuilder()
    x = builder.input("x", spec((2, 2)))
    with pytest.raises(ValueError, match="unknown dtype 'float64'"):
        builder.cast(x, "float64")


def test_wrong_python_types_are_type_errors():
    with pytest.raises(TypeError):
        metile.TensorSpec((1.5, 2), "f16")
    with pytest.raises(TypeError):
        metile.TensorSpec((1, 2), 16)
    builder = metile.GraphBuilder()
    x = builder.input("x", spec((2, 2)))
    with pytest.raises(TypeError):
        builder.add(x, "x")
    with pytest.raises(TypeError):
        builder.scale(x, "2")
    with pytest.raises(TypeError):
        builder.input("y", (2, 2))
    with pytest.raises(TypeError, match="output 1 must be a ValueRef, got str 'x'"):
        builder.build((builder.silu(x), "x"))
    with pytest.raises(TypeError, match="outputs must be a tuple or list of ValueRef, got int"):
        builder.build(3)
    with pytest.raises(TypeError, match="attribute 'axis': expected int, float, str or a list of ints"):
        builder.add_node("softmax", [x], {"axis": {}})
    with pytest.raises(TypeError, match="attribute names are str"):
        builder.add_node("softmax", [x], {1: 2})
    with pytest.raises(TypeError):
        metile.plan_graph_fusion("graph.json")
    with pytest.raises(TypeError, match="target must be a FusionTarget"):
        metile.plan_graph_fusion(small_graph(), target=3)
    with pytest.raises(TypeError, match="rules must hold FusionRules, got str"):
        metile.plan_graph_fusion(small_graph(), rules=["swiglu_mlp"])
    with pytest.raises(TypeError, match="rules must be a RuleSet"):
        metile.plan_graph_fusion(small_graph(), rules="swiglu_mlp")
    with pytest.raises(ValueError, match="unknown op kind 'reduction'"):
        metile.OpPattern().kind = "reduction"


def test_mismatched_shapes_name_the_node():
    builder = metile.GraphBuilder()
    a = builder.input("a", spec((2, 8)))
    b = builder.input("b", spec((2, 4)))
    with pytest.raises(ValueError, match=r"node 'add_0' \(add\): b f16\[2, 4\] does not broadcast"):
        builder.add(a, b)
    with pytest.raises(ValueError, match=r"node 'joined' \(add\)"):
        builder.add(a, b, name="joined")
    weight = builder.input("weight", spec((4,)))
    with pytest.raises(ValueError, match=r"node 'normalized' \(rms_norm\)"):
        builder.rms_norm(a, weight, 1e-5, name="normalized")
    matrix = builder.input("matrix", spec((3, 5)))
    with pytest.raises(ValueError, match=r"node 'matmul_0' \(matmul\)"):
        builder.matmul(a, matrix)


def test_bad_names_and_values_of_another_builder():
    builder = metile.GraphBuilder()
    x = builder.input("x", spec((2, 8)))
    with pytest.raises(ValueError, match="duplicate name 'x'"):
        builder.input("x", spec((2, 8)))
    with pytest.raises(ValueError, match="dimension 0 of f16\\[-1, 8\\] is not positive"):
        builder.input("negative", spec((-1, 8)))
    other = metile.GraphBuilder()
    foreign = other.input("foreign", spec((2, 8)))
    with pytest.raises(ValueError, match="value of another GraphBuilder"):
        builder.add(x, foreign)
    with pytest.raises(ValueError, match="value of another GraphBuilder"):
        builder.build((foreign,))
    with pytest.raises(ValueError, match="duplicate name 'x'"):
        builder.rename(builder.silu(x), "x")
    with pytest.raises(ValueError, match="unknown op 'frobnicate'"):
        builder.add_node("frobnicate", [x])
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'"):
        builder.gelu(x, approximate="fast")


def test_bad_graph_and_target_files(tmp_path):
    with pytest.raises(ValueError, match="invalid JSON"):
        metile.ComputeGraph.from_json("not json", "mine.json")
    with pytest.raises(ValueError, match="/inputs"):
        metile.ComputeGraph.from_json('{"inputs": 3, "nodes": [], "outputs": []}')
    with pytest.raises(ValueError, match="cannot open"):
        metile.read_graph(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="launch_overhead_ns"):
        metile.FusionTarget.from_json('{"launch_overhead_ns": -1}')
    with pytest.raises(ValueError):
        metile.plan_graph_fusion(small_graph(), target="a100")



def test_a_path_with_a_nul_byte_is_a_value_error(tmp_path):
    # As Python's own os functions say it; pybind11's path caster made it a TypeError listing signatures.
    for path in (str(tmp_path / "a\0b"), bytes(tmp_path / "a\0b"), pathlib.PurePosixPath("a\0b")):
        with pytest.raises(ValueError, match="embedded null byte"):
            metile.read_graph(path)
        with pytest.raises(ValueError, match="embedded null byte"):
            metile.load_model(path)
        with pytest.raises(ValueError, match="embedded null byte"):
            metile.synth_model(path)
        with pytest.raises(ValueError, match="embedded null byte"):
            metile.FusionTarget.from_json_file(path)
    with pytest.raises(ValueError, match="embedded null byte"):
        metile.plan_graph_fusion(small_graph(), target=str(tmp_path / "t\0.json"))
    with pytest.raises(TypeError):  # not a path at all: still pybind11's TypeError
        metile.read_graph(3)
    assert not any(tmp_path.iterdir())  # nothing written

def good_inputs(rng):
    return {"values": rng.uniform(-1, 1, size=(2, 8)).astype(np.float16),
            "weight": rng.uniform(-1, 1, size=(8,)).astype(np.float16)}


def test_run_rejects_wrong_arrays_naming_the_input(rng):
    graph = small_graph()
    inputs = good_inputs(rng)
    wrong_dtype = r"input 'values' \(f16\[2, 8\]\) must be a numpy float16 array, got float32"
    with pytest.raises(TypeError, match=wrong_dtype):
        metile.run(graph, {**inputs, "values": inputs["values"].astype(np.float32)})
    with pytest.raises(TypeError, match="got float64"):
        metile.run(graph, {**inputs, "weight": inputs["weight"].astype(np.float64)})
    with pytest.raises(ValueError, match=r"input 'values' \(f16\[2, 8\]\) has shape \(8, 2\)"):
        metile.run(graph, {**inputs, "values": inputs["values"].reshape(8, 2)})
    with pytest.raises(ValueError, match=r"has shape \(16,\)"):
        metile.run(graph, {**inputs, "values": inputs["values"].reshape(16)})
    with pytest.raises(TypeError, match="must be a numpy array or numpy scalar, got list"):
        metile.run(graph, {**inputs, "values": inputs["values"].tolist()})
    with pytest.raises(ValueError, match=r"input 'values' \(f16\[2, 8\]\) has shape \(\)"):
        metile.run(graph, {**inputs, "values": np.float16(1)})  # a scalar for a tensor: its shape is ()
    # A masked array ran the values under its mask as if they were given.
    masked = np.ma.masked_array(inputs["values"], mask=inputs["values"] > 0)
    with pytest.raises(TypeError, match=r"input 'values' \(f16\[2, 8\]\) is a masked array \(numpy.ma\)"):
        metile.run(graph, {**inputs, "values": masked})
    filled = metile.run(graph, {**inputs, "values": masked.filled(0)})
    expected = metile.run(graph, {**inputs, "values": np.where(inputs["values"] > 0, 0, inputs["values"])})
    assert all(np.array_equal(filled[name], expected[name]) for name in expected)
    with pytest.raises(ValueError, match="weight"):
        metile.run(graph, {"values": inputs["values"]})  # missing input
    unknown_name = r"'wieght' is not an input of the graph \(its inputs: values, weight\)"
    with pytest.raises(ValueError, match=unknown_name):
        metile.run(graph, {**inputs, "wieght": inputs["weight"]})
    with pytest.raises(ValueError, match="'normalized' is not an input"):
        metile.run(graph, {**inputs, "normalized": inputs["values"]})
    with pytest.raises(TypeError, match="keyed by input name"):
        metile.run(graph, {0: inputs["values"]})
    with pytest.raises(TypeError):
        metile.run(graph, [inputs["values"], inputs["weight"]])
    with pytest.raises(TypeError, match="expected a ComputeGraph or a FusionPlan, got str"):
        metile.run("graph.json", inputs)
    # Byte order counts as dtype: a big-endian float16 array is not silently reinterpreted.
    with pytest.raises(TypeError):
        metile.run(graph, {**inputs, "values": inputs["values"].astype(">f2")})
    # After all that, the right inputs still run.
    assert metile.run(graph, inputs)["normalized"].shape == (2, 8)


# A rank-0 input takes a numpy scalar of its dtype (np.float32(2.0) was "must be a numpy array, got
# float32"); a Python float, which has no dtype, and a scalar of another dtype stay refused.
def test_run_takes_a_numpy_scalar_for_a_rank_0_input(rng):
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((), "f32"))
    graph = builder.build([builder.exp(x)])
    value = np.float32(rng.uniform(-3, 3))
    (got,) = metile.run(graph, {"x": value}).values()
    assert got.shape == () and got.dtype == np.float32
    assert abs(float(got) - np.exp(float(value))) <= 1e-6 * np.exp(float(value))
    (same,) = metile.run(graph, {"x": np.asarray(value)}).values()
    assert np.array_equal(got, same)
    with pytest.raises(TypeError, match=r"input 'x' \(f32\[\]\) must be a numpy float32 array, got float64"):
        metile.run(graph, {"x": np.float64(value)})
    with pytest.raises(TypeError, match="must be a numpy array or numpy scalar, got float$"):
        metile.run(graph, {"x": float(value)})


def test_flow_network_errors_are_value_and_type_errors():
    network = metile.FlowNetwork()
    with pytest.raises(TypeError):
        network.add_edge([1], 2, 1)
    with pytest.raises(ValueError):
        network.add_edge(1, 2, -1)
    with pytest.raises(ValueError):
        network.add_edge(1, 2, math.nan)
    assert network.edge_count == 0 and network.vertex_count == 0
