"""GraphBuilder, TensorSpec and ComputeGraph from Python: what a recorded graph holds,
how values are named (explicitly, by the builder, after the caller's variables), and
the JSON round trip the CLI relies on."""
import json

import pytest

import metile


def spec(shape, dtype="f16"):
    return metile.TensorSpec(shape, dtype)


def test_tensor_spec_holds_shape_and_dtype():
    tensor = metile.TensorSpec((2, 3, 4), "bf16")
    assert tensor.shape == (2, 3, 4)
    assert tensor.dtype == "bf16"
    assert tensor.rank == 3
    assert tensor.element_count == 24
    assert tensor.bytes == 48
    assert str(tensor) == "bf16[2, 3, 4]"
    assert repr(tensor) == "TensorSpec((2, 3, 4), 'bf16')"
    assert tensor == metile.TensorSpec([2, 3, 4], "bf16")
    assert tensor != metile.TensorSpec((2, 3, 4), "f16")
    assert hash(tensor) == hash(metile.TensorSpec([2, 3, 4], "bf16"))
    assert metile.DTYPES == ("f16", "bf16", "f32", "i8", "u8", "i32", "u32")


def seed_graph(builder=None):
    builder = builder or metile.GraphBuilder()
    values = builder.input("values", spec((1, 64)))
    residual = builder.input("residual", spec((1, 64)))
    weight = builder.input("weight", spec((64,)))
    summed = builder.add(values, residual)
    normalized = builder.rms_norm(summed, weight, eps=1e-5)
    return builder.build((summed, normalized))


def test_build_names_values_after_the_callers_variables():
    graph = seed_graph()
    assert [value.name for value in graph.inputs] == ["values", "residual", "weight"]
    assert [value.name for value in graph.outputs] == ["summed", "normalized"]
    assert [node.name for node in graph.nodes] == ["summed", "normalized"]
    add, norm = graph.nodes
    assert (add.op, add.kind) == ("add", "elementwise")
    assert (norm.op, norm.kind) == ("rms_norm", "row_reduction")
    assert [value.name for value in norm.inputs] == ["summed", "weight"]
    assert norm.attributes == {"eps": pytest.approx(1e-5)}
    assert norm.outputs[0].spec == spec((1, 64))
    assert graph.find_value("summed").producer == add
    assert graph.find_value("values").producer is None
    assert graph.find_value("summed").consumers == [norm]
    assert graph.find_value("summed").is_output
    assert graph.find_value("nothing") is None
    assert graph.find_node("normalized") == norm


def test_explicit_names_win_and_taken_names_are_skipped():
    builder = metile.GraphBuilder()
    x = builder.input("x", spec((4, 8), "f32"))
    scaled = builder.scale(x, 0.5, name="half")  # named by the caller: kept
    x_activated = builder.silu(scaled)
    _hidden = builder.exp(x_activated)  # underscore variables are not names
    weight = builder.input("weight", spec((8,), "f32"))
    # A value held by a variable whose name is already a graph value keeps its invented name.
    x = builder.multiply(_hidden, weight)  # `x` is the input's name: taken
    graph = builder.build([x])
    names = [node.name for node in graph.nodes]
    assert names[0] == "half"
    assert names[1] == "x_activated"
    assert names[2] == "exp_0"
    assert names[3] == "multiply_0"
    assert [value.name for value in graph.outputs] == ["multiply_0"]


def test_an_explicit_name_moves_an_invented_one_aside():
    # `exp_0` is a placeholder the caller never wrote: naming another value so was refused as a
    # duplicate of it. The placeholder moves aside and is still renamed after its variable at build().
    builder = metile.GraphBuilder()
    x = builder.input("x", spec((2, 4), "f32"))
    e = builder.exp(x)
    silu = builder.silu(x, name="exp_0")
    held = [builder.exp(x)]  # invented exp_1; a list holds it, so build() does not rename it
    explicit = builder.input("exp_1", spec((2, 4), "f32"))  # an input's name moves it aside too
    added = builder.add(explicit, x, name="added")
    graph = builder.build([e, silu, held[0], added])
    assert [node.name for node in graph.nodes] == ["e", "exp_0", "exp_1_0", "added"]
    assert [value.name for value in graph.inputs] == ["x", "exp_1"]
    # Two names the caller gave remain a duplicate.
    with pytest.raises(ValueError, match="duplicate name 'exp_0'"):
        builder.silu(x, name="exp_0")
    # A call that fails leaves the placeholder its name; rename() moves one aside too.
    kept = [builder.exp(x)]  # exp_2
    narrow = builder.input("narrow", spec((2, 3), "f32"))
    with pytest.raises(ValueError):
        builder.add(x, narrow, name="exp_2")
    assert builder.name(kept[0]) == "exp_2"
    builder.rename(added, "exp_2")
    assert (builder.name(added), builder.name(kept[0])) == ("exp_2", "exp_2_0")


def test_a_value_held_by_two_variables_takes_the_first_defined_name():
    builder = metile.GraphBuilder()
    x = builder.input("x", spec((2, 16)))
    activated = builder.silu(x)
    alias = activated
    graph = builder.build((alias,))
    assert graph.outputs[0].name == "activated"


def test_values_recorded_after_a_build_are_named_at_the_next():
    builder = metile.GraphBuilder()
    x = builder.input("x", spec((2, 16)))
    first = builder.exp(x)
    assert [value.name for value in builder.build((first,)).outputs] == ["first"]
    second = builder.silu(first)
    graph = builder.build((first, second))
    assert [value.name for value in graph.outputs] == ["first", "second"]


def test_values_named_inside_a_helper_keep_invented_names():
    builder = metile.GraphBuilder()
    x = builder.input("x", spec((2, 16)))

    def block(value):
        gated = builder.silu(value)
        return builder.multiply(gated, value)

    out = block(x)
    graph = builder.build(out)  # one value is accepted as well as a tuple
    assert [node.name for node in graph.nodes] == ["silu_0", "out"]


def test_rename_before_build_and_value_properties():
    builder = metile.GraphBuilder()
    a = builder.input("a", spec((3, 5), "f32"))
    b = builder.input("b", spec((5,), "f32"))
    total = builder.add(a, b, name="total")
    assert total.name == "total"
    assert total.spec == spec((3, 5), "f32")
    assert repr(total) == "ValueRef('total', f32[3, 5])"
    assert builder.name(total) == "total" and builder.spec(total) == total.spec
    assert builder.name(builder.silu(total)) == "silu_0"  # invented until build()
    builder.rename(total, "sum_of_a_and_b")
    assert total.name == "sum_of_a_and_b"
    graph = builder.build((total,))
    assert graph.outputs[0].name == "sum_of_a_and_b"


def test_every_builder_op_records_its_node():
    builder = metile.GraphBuilder()
    x = builder.input("x", spec((1, 4, 8), "f32"))
    y = builder.input("y", spec((1, 4, 8), "f32"))
    weight = builder.input("weight", spec((8,), "f32"))
    bias = builder.input("bias", spec((8,), "f32"))
    positions = builder.input("positions", spec((4,), "i32"))
    matrix = builder.input("matrix", spec((8, 8), "f32"))
    steps = [
        builder.add(x, y, name="added"),
        builder.subtract(x, y, name="subtracted"),
        builder.multiply(x, y, name="multiplied"),
        builder.scale(x, factor=2.0, name="scaled"),
        builder.silu(x, name="silu"),
        builder.gelu(x, approximate="tanh", name="gelu"),
        builder.exp(x, name="exp"),
        builder.rms_norm(x, weight, eps=1e-6, name="rms"),
        builder.layer_norm(x, weight, bias, eps=1e-5, name="ln"),
        builder.softmax(x, axis=-1, name="softmax"),
        builder.matmul(x, matrix, transpose_right=True, name="matmul"),
        builder.rope(x, positions, theta=10000.0, dims=8, name="rope"),
        builder.reshape(x, shape=(4, 8), name="reshaped"),
        builder.transpose(x, perm=(0, 2, 1), name="transposed"),
        builder.cast(x, dtype="f16", name="cast"),
    ]
    scores = builder.matmul(x, x, transpose_right=True, name="scores")
    masked = builder.causal_mask(scores, offset=0, name="masked")
    graph = builder.build(steps + [masked])
    ops = {node.name: node.op for node in graph.nodes}
    assert ops["added"] == "add" and ops["ln"] == "layer_norm" and ops["masked"] == "causal_mask"
    assert graph.find_value("scores").spec == spec((1, 4, 4), "f32")
    assert graph.find_value("transposed").spec == spec((1, 8, 4), "f32")
    assert graph.find_value("reshaped").spec == spec((4, 8), "f32")
    assert graph.find_value("cast").spec == spec((1, 4, 8), "f16")
    assert graph.find_node("gelu").attributes["approximate"] == "tanh"
    assert graph.find_node("transposed").attributes["perm"] == [0, 2, 1]
    assert graph.find_node("rope").attributes["dims"] == 8


def test_quantized_matmul_and_generic_add_node():
    builder = metile.GraphBuilder()
    x = builder.input("x", spec((1, 128)))
    packed = builder.input("packed", spec((32, 128 * 4 // 32), "u32"))
    scales = builder.input("scales", spec((32, 2)))
    biases = builder.input("biases", spec((32, 2)))
    projected = builder.quantized_matmul(x, packed, scales, biases, bits=4, group_size=64)
    (softened,) = builder.add_node("softmax", [projected], {"axis": -1}, name="softened")
    graph = builder.build((softened,))
    assert graph.find_value("projected").spec == spec((1, 32))
    assert graph.find_node("projected").attributes["group_size"] == 64
    assert graph.find_node("softened").op == "softmax"


def test_json_round_trip_is_exact():
    graph = seed_graph()
    text = graph.to_json()
    document = json.loads(text)
    assert [entry["name"] for entry in document["inputs"]] == ["values", "residual", "weight"]
    assert document["outputs"] == ["summed", "normalized"]
    assert [node["op"] for node in document["nodes"]] == ["add", "rms_norm"]
    again = metile.ComputeGraph.from_json(text)
    assert again == graph
    assert again.to_json() == text
    assert "summed" in graph.to_dot() and graph.to_dot().lstrip().startswith("digraph")


def test_read_graph_reads_a_graph_file(tmp_path):
    path = tmp_path / "seed.json"
    path.write_text(seed_graph().to_json())
    assert metile.read_graph(path) == seed_graph()
    assert metile.read_graph(str(path)) == seed_graph()


def test_repr_is_readable():
    graph = seed_graph()
    assert repr(graph) == ("ComputeGraph(inputs=[values, residual, weight], nodes=2, "
                           "outputs=[summed, normalized])")
    assert repr(graph.nodes[1]) == "Node(normalized = rms_norm(summed, weight), eps=1e-05)"
    assert repr(graph.outputs[0]) == "Value('summed', f16[1, 64])"


def test_arrays_inside_a_shape_or_permutation_are_refused_by_name():
    """A numpy array as an item of a shape, a permutation or a reshape got numpy's own TypeError ("only
    integer scalar arrays can be converted to a scalar index"), naming neither the argument nor the item;
    a 0-d integer array was taken as a dimension where the scalar arguments refuse arrays."""
    import numpy as np
    import pytest

    with pytest.raises(TypeError, match=r"^TensorSpec shape: a list of ints, got ndarray"):
        metile.TensorSpec(np.array([[2, 3]]), "f32")
    with pytest.raises(TypeError, match=r"^TensorSpec shape: a list of ints, got ndarray"):
        metile.TensorSpec((np.array(2),), "f32")
    assert metile.TensorSpec(np.array([2, 3]), "f32").shape == (2, 3)  # a 1-D array's items are numpy ints
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((2, 3), "f32"))
    with pytest.raises(TypeError, match=r"^transpose perm: a list of ints, got ndarray"):
        builder.transpose(x, [np.array(1.0), 0])
    with pytest.raises(TypeError, match=r"^reshape shape: a list of ints, got ndarray"):
        builder.reshape(x, np.array([[3, 2]]))


def test_build_under_exec_with_a_non_str_local_name():
    """build() names invented values after the caller's variables; under exec() with a locals mapping holding a
    non-str key it ended in AttributeError ('int' object has no attribute 'startswith')."""
    scope = {1: "not a name", "metile": metile}
    exec("builder = metile.GraphBuilder()\n"
         "x = builder.input('x', metile.TensorSpec((2,), 'f32'))\n"
         "doubled = builder.scale(x, 2.0)\n"
         "graph = builder.build((doubled,))\n", {}, scope)
    assert [value.name for value in scope["graph"].outputs] == ["doubled"]
