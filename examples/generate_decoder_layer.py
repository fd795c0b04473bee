#!/usr/bin/env python3
"""Writes decoder_layer.json and swiglu_mlp.json, the example graphs beside this script.

decoder_layer.json: one Llama-style decoder layer in bf16 with 4-bit affine
(group 64) projections, small enough for the CPU reference executor to run in
well under a second: 8 tokens, hidden 512, 8 heads of 64, intermediate 1536.
swiglu_mlp.json: the dense bf16 SwiGLU MLP of a Llama-3-8B layer at one row
(hidden 4096, intermediate 14336) with its residual add, weights [N, K].

Standard library only; run `python3 examples/generate_decoder_layer.py` from
anywhere and the files are rewritten byte for byte the same.
"""
import json
import pathlib

HERE = pathlib.Path(__file__).resolve().parent


class Graph:
    def __init__(self):
        self.inputs = []
        self.nodes = []

    def input(self, name, shape, dtype):
        self.inputs.append({"name": name, "shape": shape, "dtype": dtype})
        return name

    def node(self, name, op, inputs, **attrs):
        entry = {"name": name, "op": op, "inputs": inputs}
        if attrs:
            entry["attrs"] = attrs
        self.nodes.append(entry)
        return name

    def write(self, file_name, outputs):
        # One input or node per line, like metile's own writer, so diffs stay readable.
        lines = ["{", '  "inputs": [']
        lines += ["    " + json.dumps(entry) + "," for entry in self.inputs]
        lines[-1] = lines[-1].rstrip(",")
        lines += ["  ],", '  "nodes": [']
        lines += ["    " + json.dumps(entry) + "," for entry in self.nodes]
        lines[-1] = lines[-1].rstrip(",")
        lines += ["  ],", '  "outputs": ' + json.dumps(outputs), "}"]
        (HERE / file_name).write_text("\n".join(lines) + "\n")


def decoder_layer():
    tokens, hidden, heads, head_dim, intermediate = 8, 512, 8, 64, 1536
    bits, group_size, dtype = 4, 64, "bf16"
    graph = Graph()
    hidden_states = graph.input("hidden_states", [tokens, hidden], dtype)
    positions = graph.input("positions", [tokens], "i32")
    input_norm_weight = graph.input("input_norm_weight", [hidden], dtype)
    post_attention_norm_weight = graph.input("post_attention_norm_weight", [hidden], dtype)

    def projection(name, x, in_features, out_features):
        # MLX affine format: packed u32 [N, K*bits/32], scales and biases [N, K/group_size].
        packed = graph.input(name + "_packed", [out_features, in_features * bits // 32], "u32")
        scales = graph.input(name + "_scales", [out_features, in_features // group_size], dtype)
        biases = graph.input(name + "_biases", [out_features, in_features // group_size], dtype)
        return graph.node(name, "quantized_matmul", [x, packed, scales, biases], bits=bits, group_size=group_size)

    def split_heads(name, x):
        by_token = graph.node(name + "_by_token", "reshape", [x], shape=[tokens, heads, head_dim])
        return graph.node(name + "_by_head", "transpose", [by_token], perm=[1, 0, 2])

    attention_input = graph.node("attention_input", "rms_norm", [hidden_states, input_norm_weight], eps=1e-5)
    q = split_heads("q", projection("q", attention_input, hidden, hidden))
    k = split_heads("k", projection("k", attention_input, hidden, hidden))
    v = split_heads("v", projection("v", attention_input, hidden, hidden))
    q_rotated = graph.node("q_rotated", "rope", [q, positions], theta=10000.0, dims=head_dim)
    k_rotated = graph.node("k_rotated", "rope", [k, positions], theta=10000.0, dims=head_dim)
    scores = graph.node("scores", "matmul", [q_rotated, k_rotated], transpose_right=1)
    scaled_scores = graph.node("scaled_scores", "scale", [scores], factor=1.0 / head_dim ** 0.5)
    masked_scores = graph.node("masked_scores", "causal_mask", [scaled_scores], offset=0)
    attention_weights = graph.node("attention_weights", "softmax", [masked_scores], axis=-1)
    context_by_head = graph.node("context_by_head", "matmul", [attention_weights, v])
    context_by_token = graph.node("context_by_token", "transpose", [context_by_head], perm=[1, 0, 2])
    context = graph.node("context", "reshape", [context_by_token], shape=[tokens, hidden])
    attention_output = projection("o", context, hidden, hidden)
    attention_residual = graph.node("attention_residual", "add", [hidden_states, attention_output])
    mlp_input = graph.node("mlp_input", "rms_norm", [attention_residual, post_attention_norm_weight], eps=1e-5)
    gate = projection("gate", mlp_input, hidden, intermediate)
    up = projection("up", mlp_input, hidden, intermediate)
    gate_activation = graph.node("gate_activation", "silu", [gate])
    gated = graph.node("gated", "multiply", [gate_activation, up])
    mlp_output = projection("down", gated, intermediate, hidden)
    layer_output = graph.node("layer_output", "add", [attention_residual, mlp_output])
    graph.write("decoder_layer.json", [layer_output])


def swiglu_mlp():
    hidden, intermediate, dtype = 4096, 14336, "bf16"
    graph = Graph()
    x = graph.input("x", [1, hidden], dtype)
    residual = graph.input("residual", [1, hidden], dtype)
    gate_weight = graph.input("gate_weight", [intermediate, hidden], dtype)
    up_weight = graph.input("up_weight", [intermediate, hidden], dtype)
    down_weight = graph.input("down_weight", [hidden, intermediate], dtype)
    gate = graph.node("gate", "matmul", [x, gate_weight], transpose_right=1)
    up = graph.node("up", "matmul", [x, up_weight], transpose_right=1)
    gate_activation = graph.node("gate_activation", "silu", [gate])
    hidden_values = graph.node("hidden", "multiply", [gate_activation, up])
    down = graph.node("down", "matmul", [hidden_values, down_weight], transpose_right=1)
    output = graph.node("output", "add", [down, residual])
    graph.write("swiglu_mlp.json", [output])


if __name__ == "__main__":
    decoder_layer()
    swiglu_mlp()
