"""Graphs several tests build: the SwiGLU MLP of a transformer block, in either order
of the gating multiply (the parallel-epilogue rule must accept both)."""
import metile


def swiglu_graph(order, hidden=4096, intermediate=14336, dtype="f16", rows=1):
    """down = (silu(x @ gate_weight^T) * (x @ up_weight^T)) @ down_weight^T, with the
    multiply's operands in `order` ("gate_first" or "up_first")."""
    builder = metile.GraphBuilder()
    x = builder.input("x", metile.TensorSpec((rows, hidden), dtype))
    gate_weight = builder.input("gate_weight", metile.TensorSpec((intermediate, hidden), dtype))
    up_weight = builder.input("up_weight", metile.TensorSpec((intermediate, hidden), dtype))
    down_weight = builder.input("down_weight", metile.TensorSpec((hidden, intermediate), dtype))
    gate = builder.matmul(x, gate_weight, transpose_right=True)
    up = builder.matmul(x, up_weight, transpose_right=True)
    gate_activation = builder.silu(gate)
    if order == "gate_first":
        gated = builder.multiply(gate_activation, up)
    else:
        gated = builder.multiply(up, gate_activation)
    down = builder.matmul(gated, down_weight, transpose_right=True)
    return builder.build((down,))
