"""The compute-graph fusion example of the design this project started from, verbatim.

Records a residual add feeding an RMSNorm, keeps the sum as a graph output, and
prints the fusion plan: one multi-output region writing `summed` and `normalized`.
Run it after building (see the README):

    PYTHONPATH=build/default/python /usr/bin/python3 examples/seed.py
"""
import metile

builder = metile.GraphBuilder()
values = builder.input("values", metile.TensorSpec((1, 2048), "f16"))
residual = builder.input("residual", metile.TensorSpec((1, 2048), "f16"))
weight = builder.input("weight", metile.TensorSpec((2048,), "f16"))
summed = builder.add(values, residual)
normalized = builder.rms_norm(summed, weight, 1e-5)
graph = builder.build((summed, normalized))

plan = metile.plan_graph_fusion(graph)
print(plan)
