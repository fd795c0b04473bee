"""The design's example, examples/seed.py as it stands: it must plan to one multi-output
region writing `summed` and `normalized`, and running that plan on the CPU backend must
compute both (checked against a float64 numpy reference)."""
import contextlib
import io
import os
import runpy
import subprocess
import sys

import numpy as np

import metile

def build_seed_plan(source_dir):
    """The graph and plan examples/seed.py builds (run here, its printing swallowed)."""
    with contextlib.redirect_stdout(io.StringIO()):
        namespace = runpy.run_path(str(source_dir / "examples" / "seed.py"))
    return namespace["graph"], namespace["plan"]


def test_seed_plan_is_one_region_writing_summed_and_normalized(source_dir):
    graph, plan = build_seed_plan(source_dir)
    assert [value.name for value in graph.outputs] == ["summed", "normalized"]
    assert len(plan.regions) == 1
    region = plan.regions[0]
    assert [node.name for node in region.nodes] == ["summed", "normalized"]
    assert [value.name for value in region.outputs] == ["summed", "normalized"]
    assert [value.name for value in region.inputs] == ["values", "residual", "weight"]
    assert region.benefit_ns > 0 and region.benefit == region.benefit_ns
    assert plan.unfused == []
    assert plan.kernel_count == 1
    assert plan.graph == graph


def test_printed_plan_names_the_region_and_both_outputs(source_dir):
    _, plan = build_seed_plan(source_dir)
    text = str(plan)
    assert text == plan.explain().rstrip("\n")
    assert plan.regions[0].rule in text
    assert "summed" in text and "normalized" in text
    assert repr(plan).startswith("FusionPlan(target='h200', kernels=1, regions=[")


def test_examples_seed_py_runs_and_prints_the_plan(source_dir):
    script = source_dir / "examples" / "seed.py"
    completed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                               env=dict(os.environ))
    assert completed.returncode == 0, completed.stderr
    _, plan = build_seed_plan(source_dir)
    assert completed.stdout == str(plan) + "\n"


def float64_rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def test_running_the_seed_plan_computes_summed_and_normalized(rng, source_dir):
    graph, plan = build_seed_plan(source_dir)
    inputs = {
        "values": rng.uniform(-1, 1, size=(1, 2048)).astype(np.float16),
        "residual": rng.uniform(-1, 1, size=(1, 2048)).astype(np.float16),
        "weight": rng.uniform(0.5, 1.5, size=(2048,)).astype(np.float16),
    }
    outputs = metile.run(plan, inputs)
    assert sorted(outputs) == ["normalized", "summed"]
    for output in outputs.values():
        assert output.dtype == np.float16 and output.shape == (1, 2048)

    values, residual, weight = (inputs[name].astype(np.float64) for name in ("values", "residual", "weight"))
    summed = values + residual
    normalized = float64_rms_norm(summed, weight, 1e-5)
    # f16 keeps 11 significant bits: each result is within a couple of half-ulps of the
    # exact value (the normalization also sees the f16-rounded sum).
    np.testing.assert_allclose(outputs["summed"].astype(np.float64), summed, rtol=2**-10, atol=2**-24)
    np.testing.assert_allclose(outputs["normalized"].astype(np.float64), normalized,
                               rtol=4 * 2**-11, atol=1e-3)
    # The plan's kernel-by-kernel run is the graph's run, bit for bit.
    for name, array in metile.run(graph, inputs).items():
        np.testing.assert_array_equal(array.view(np.uint16), outputs[name].view(np.uint16))
