"""run() on the CPU reference backend from numpy: values against float64 numpy
references, and the dtype contract at the boundary (f16 and f32 natively, bf16 as
float32 rounded to bf16, integers bit for bit)."""
import math
import os

import numpy as np
import pytest

import metile
from example_graphs import swiglu_graph


def bf16_round(array):
    """Round float32 values to the nearest bfloat16 (ties to even), kept as float32."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return rounded.astype(np.uint32).view(np.float32)


def test_f32_ops_match_float64_numpy(rng):
    rows, width, out_width = 3, 16, 5
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((rows, width), "f32"))
    bias = builder.input("bias", metile.TensorSpec((width,), "f32"))
    gamma = builder.input("gamma", metile.TensorSpec((width,), "f32"))
    matrix = builder.input("matrix", metile.TensorSpec((out_width, width), "f32"))
    shifted = builder.add(x, bias)
    scaled = builder.scale(shifted, 0.75)
    activated = builder.silu(scaled)
    smoothed = builder.gelu(x, approximate="none")
    exponent = builder.exp(x)
    probabilities = builder.softmax(activated)
    normalized = builder.layer_norm(smoothed, gamma, bias, eps=1e-5)
    product = builder.multiply(normalized, exponent)
    projected = builder.matmul(product, matrix, transpose_right=True)
    graph = builder.build((probabilities, projected))

    inputs = {
        "x": rng.uniform(-2, 2, size=(rows, width)).astype(np.float32),
        "bias": rng.uniform(-1, 1, size=(width,)).astype(np.float32),
        "gamma": rng.uniform(0.5, 1.5, size=(width,)).astype(np.float32),
        "matrix": rng.uniform(-1, 1, size=(out_width, width)).astype(np.float32),
    }
    outputs = metile.run(graph, inputs)
    assert sorted(outputs) == ["probabilities", "projected"]

    x64, bias64, gamma64, matrix64 = (inputs[name].astype(np.float64)
                                      for name in ("x", "bias", "gamma", "matrix"))
    scaled64 = (x64 + bias64) * 0.75
    activated64 = scaled64 / (1 + np.exp(-scaled64))
    exps = np.exp(activated64 - activated64.max(axis=-1, keepdims=True))
    probabilities64 = exps / exps.sum(axis=-1, keepdims=True)
    smoothed64 = 0.5 * x64 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2)))
    mean = smoothed64.mean(axis=-1, keepdims=True)
    variance = ((smoothed64 - mean) ** 2).mean(axis=-1, keepdims=True)
    normalized64 = (smoothed64 - mean) / np.sqrt(variance + 1e-5) * gamma64 + bias64
    projected64 = (normalized64 * np.exp(x64)) @ matrix64.T

    for name, expected in (("probabilities", probabilities64), ("projected", projected64)):
        assert outputs[name].dtype == np.float32
        np.testing.assert_allclose(outputs[name], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(),
                                   err_msg=name)


def test_bf16_travels_as_float32_rounded_to_bf16(rng):
    builder = metile.GraphBuilder()
    a = builder.input("a", metile.TensorSpec((4, 8), "bf16"))
    b = builder.input("b", metile.TensorSpec((4, 8), "bf16"))
    total = builder.add(a, b)
    graph = builder.build((total,))
    inputs = {name: rng.uniform(-3, 3, size=(4, 8)).astype(np.float32) for name in ("a", "b")}
    assert not np.array_equal(bf16_round(inputs["a"]), inputs["a"])  # the inputs really need rounding
    output = metile.run(graph, inputs)["total"]
    assert output.dtype == np.float32 and output.shape == (4, 8)
    assert not np.any(output.view(np.uint32) & 0xFFFF)  # every value is a bf16
    expected = bf16_round(bf16_round(inputs["a"]) + bf16_round(inputs["b"]))
    np.testing.assert_array_equal(output, expected)


def test_integer_inputs_cross_bit_for_bit(rng):
    builder = metile.GraphBuilder()
    counts = builder.input("counts", metile.TensorSpec((2, 6), "i32"))
    levels = builder.input("levels", metile.TensorSpec((2, 6), "u8"))
    signed = builder.input("signed", metile.TensorSpec((2, 6), "i8"))
    counts_real = builder.cast(counts, "f32")
    levels_real = builder.cast(levels, "f32")
    signed_real = builder.cast(signed, "f32")
    mixed = builder.add(builder.add(counts_real, levels_real), signed_real)
    as_integers = builder.cast(mixed, "i32")
    graph = builder.build((as_integers, mixed))
    inputs = {
        "counts": rng.integers(-1000, 1000, size=(2, 6), dtype=np.int32),
        "levels": rng.integers(0, 256, size=(2, 6), dtype=np.uint8),
        "signed": rng.integers(-128, 128, size=(2, 6), dtype=np.int8),
    }
    outputs = metile.run(graph, inputs)
    expected = inputs["counts"].astype(np.int64) + inputs["levels"] + inputs["signed"]
    assert outputs["as_integers"].dtype == np.int32
    np.testing.assert_array_equal(outputs["as_integers"], expected)
    np.testing.assert_array_equal(outputs["mixed"], expected.astype(np.float32))


def test_non_contiguous_arrays_are_read_in_logical_order(rng):
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((3, 5), "f32"))
    doubled = builder.scale(x, 2.0)
    graph = builder.build((doubled,))
    storage = rng.uniform(-1, 1, size=(5, 3)).astype(np.float32)
    view = storage.T  # Fortran-ordered (3, 5) view
    assert not view.flags.c_contiguous
    np.testing.assert_array_equal(metile.run(graph, {"x": view})["doubled"], view * 2)


def test_random_inputs_are_seeded_typed_and_never_zero():
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((2, 64), "f16"))
    weight = builder.input("weight", metile.TensorSpec((64,), "bf16"))
    positions = builder.input("positions", metile.TensorSpec((2,), "i32"))
    rotated = builder.rope(builder.cast(x, "bf16"), positions, theta=10000.0, dims=64)
    normalized = builder.rms_norm(rotated, weight, eps=1e-6)
    graph = builder.build((normalized,))
    first = metile.random_inputs(graph, seed=7)
    assert {name: (array.dtype, array.shape) for name, array in first.items()} == {
        "x": (np.float16, (2, 64)), "weight": (np.float32, (64,)), "positions": (np.int32, (2,))}
    assert np.all(first["x"] != 0) and np.all(np.abs(first["x"]) <= 1)
    np.testing.assert_array_equal(first["weight"], bf16_round(first["weight"]))
    assert set(first["positions"].tolist()) <= {0, 1}
    again = metile.random_inputs(graph, seed=7)
    other = metile.random_inputs(graph, seed=8)
    np.testing.assert_array_equal(first["x"], again["x"])
    assert not np.array_equal(first["x"], other["x"])
    outputs = metile.run(graph, first)
    assert outputs["normalized"].shape == (2, 64) and np.all(np.isfinite(outputs["normalized"]))


@pytest.mark.parametrize("order", ["gate_first", "up_first"])
def test_swiglu_mlp_plan_runs_like_numpy(rng, order):
    graph = swiglu_graph(order, hidden=32, intermediate=48, dtype="f32")
    plan = metile.plan_graph_fusion(graph)
    inputs = {value.name: rng.uniform(-1, 1, size=value.spec.shape).astype(np.float32)
              for value in graph.inputs}
    x, gate_weight, up_weight, down_weight = (inputs[name].astype(np.float64)
                                              for name in ("x", "gate_weight", "up_weight", "down_weight"))
    gate = x @ gate_weight.T
    hidden = gate / (1 + np.exp(-gate)) * (x @ up_weight.T)
    expected = hidden @ down_weight.T
    output = metile.run(plan, inputs)["down"]
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_sum_and_mean_from_the_op_table_match_numpy(rng):
    # GraphBuilder.sum and .mean come from the op table (no hand-written binding).
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((2, 3, 50), "f32"))
    total = builder.sum(x)
    average = builder.mean(builder.scale(x, 2.0), name="average")
    graph = builder.build((total, average))
    assert [node.op for node in graph.nodes] == ["sum", "scale", "mean"]
    assert graph.find_value("total").spec == metile.TensorSpec((2, 3, 1), "f32")
    values = rng.uniform(-1, 1, size=(2, 3, 50)).astype(np.float32)
    outputs = metile.run(graph, {"x": values})
    x64 = values.astype(np.float64)
    np.testing.assert_allclose(outputs["total"], x64.sum(axis=-1, keepdims=True), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(outputs["average"], (2 * x64).mean(axis=-1, keepdims=True), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="unknown attribute 'axis'"):
        builder.sum(x, axis=0)


def test_argmax_from_the_op_table_matches_numpy_with_ties_and_nan(rng):
    # GraphBuilder.argmax comes from the op table: i32 [...] from [..., L], ties to the lowest
    # index and the first NaN above every number, as numpy.argmax.
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((4, 3, 61), "f32"))
    graph = builder.build((builder.argmax(x, name="next"),))
    assert graph.find_value("next").spec == metile.TensorSpec((4, 3), "i32")
    values = rng.integers(-2, 3, size=(4, 3, 61)).astype(np.float32)  # five values: ties everywhere
    values[0, 1, rng.integers(0, 61, size=2)] = np.nan
    values[1, 2, :] = -np.inf
    outputs = metile.run(graph, {"x": values})
    assert outputs["next"].dtype == np.int32
    np.testing.assert_array_equal(outputs["next"], np.argmax(values, axis=-1))
    with pytest.raises(ValueError, match="must have a floating dtype"):
        builder.argmax(builder.input("ids", metile.TensorSpec((4,), "i32")))


def physical_memory_bytes():
    """This machine's memory as metile's limit reads it (sysconf's pages times the page size)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def outer_product_graph(rows, columns, dtype):
    """c = a @ b for a [rows, 1] and b [1, columns]: small inputs, a result as large as asked."""
    builder = metile.GraphBuilder()
    a = builder.input("a", metile.TensorSpec((rows, 1), dtype))
    b = builder.input("b", metile.TensorSpec((1, columns), dtype))
    return builder.build((builder.matmul(a, b, name="c"),))


# `metile run` refuses a graph whose tensors, or whose tensors and the CPU reference's working copies
# for a node, pass this machine's memory, naming the value or node; run() asked for them instead (a
# 256 TiB result: MemoryError with no name, or the out-of-memory killer). The same C++ check now, as a
# ValueError with the CLI's message; the byte counts are worked out here from the shapes.
def test_run_refuses_tensors_beyond_this_machines_memory_naming_the_value():
    rows = columns = 1 << 23
    graph = outer_product_graph(rows, columns, "f32")
    inputs = {"a": np.ones((rows, 1), np.float32), "b": np.ones((1, columns), np.float32)}
    total = 4 * rows + 4 * columns + 4 * rows * columns  # a, b, then c passes the memory
    message = (rf"^the graph's tensors need more than this machine's {physical_memory_bytes()} bytes of memory "
               rf"\(value 'c' brings them to {total} bytes\)$")
    with pytest.raises(ValueError, match=message):
        metile.run(graph, inputs)
    with pytest.raises(ValueError, match=message):
        metile.run(metile.plan_graph_fusion(graph, target="cpu"), inputs)


def test_run_refuses_working_copies_beyond_this_machines_memory_naming_the_node():
    # An f16 result of 45% of the memory fits; the reference's f64 accumulators for it (4 times) do not.
    memory = physical_memory_bytes()
    columns = 65536
    rows = int(0.45 * memory) // (2 * columns)
    graph = outer_product_graph(rows, columns, "f16")
    inputs = {"a": np.ones((rows, 1), np.float16), "b": np.ones((1, columns), np.float16)}
    tensors = 2 * rows + 2 * columns + 2 * rows * columns
    working = 4 * (rows + columns) + 8 * rows * columns  # inputs as f32, results as f64
    with pytest.raises(ValueError, match=(
            rf"^the graph's tensors \({tensors} bytes\) and the CPU reference's working copies for node 'c' "
            rf"\({working} bytes: its inputs as f32, its results as f64\) need more than this machine's "
            rf"{memory} bytes of memory$")):
        metile.run(graph, inputs)


def test_inputs_may_be_any_mapping_and_anything_else_is_named(rng):
    """run() took only a dict: a MappingProxyType or a Mapping class got pybind11's dump of the overloads, as did
    a list of pairs or None, where a one-line TypeError naming the argument is what the other arguments give."""
    import types

    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((2, 3), "f32"))
    doubled = builder.scale(x, 2.0)
    graph = builder.build((doubled,))
    value = rng.uniform(-1, 1, size=(2, 3)).astype(np.float32)
    np.testing.assert_array_equal(metile.run(graph, types.MappingProxyType({"x": value}))["doubled"], value * 2)
    for wrong in ([("x", value)], None, 3):
        with pytest.raises(TypeError, match=r"^run: inputs must be a dict of input name -> numpy array, got "):
            metile.run(graph, wrong)
