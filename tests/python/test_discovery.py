"""The certified attention rewrite from Python: plan_with_discovery gives a flash_attention
region whose certificate lists every obligation, refusals are said in the plan, and the
rewritten graph runs on the CPU reference within the gate of the original."""
import numpy as np

import metile


def attention_graph(escape=False):
    builder = metile.GraphBuilder()
    q = builder.input("q", metile.TensorSpec((4, 3, 16), "f32"))
    k = builder.input("k", metile.TensorSpec((2, 9, 16), "f32"))
    v = builder.input("v", metile.TensorSpec((2, 9, 8), "f32"))
    q_grouped = builder.reshape(q, (2, 6, 16))
    scores = builder.matmul(q_grouped, k, transpose_right=True)
    scaled = builder.scale(scores, 0.25)
    masked = builder.causal_mask(scaled, 6)
    probabilities = builder.softmax(masked)
    attention = builder.matmul(probabilities, v)
    return builder.build((attention, probabilities) if escape else (attention,))


def test_the_flash_attention_region_carries_its_certificate():
    plan = metile.plan_with_discovery(attention_graph())
    (region,) = plan.regions
    assert region.rule == "flash_attention"
    certificate = region.certificate
    assert certificate["law"] == "stable_weighted_softmax"
    assert certificate["verified"] is True
    names = [obligation["name"] for obligation in certificate["obligations"]]
    assert names == ["left_identity", "right_identity", "associativity", "merge_of_lifts"]
    for obligation in certificate["obligations"]:
        assert obligation["holds"] is True
        assert obligation["lhs"] == obligation["rhs"]
    assert "certificate: law stable_weighted_softmax, verified" in plan.explain()
    assert plan.rewrites[0].startswith("flash_attention 'attention' replaces")
    # Regions of other rules carry none.
    assert metile.plan_graph_fusion(attention_graph()).regions[0].certificate is None


def test_a_refused_chain_says_why():
    plan = metile.plan_with_discovery(attention_graph(escape=True))
    assert all(region.rule != "flash_attention" for region in plan.regions)
    assert plan.rewrites == ["flash_attention refused at 'probabilities': probabilities escape to a graph output"]
    assert "flash_attention refused: probabilities escape" in plan.node_reasons["probabilities"]


def test_rewritten_graph_matches_the_original_on_the_cpu(rng):
    graph = attention_graph()
    plan = metile.plan_with_discovery(graph)
    inputs = {
        "q": rng.uniform(-1, 1, (4, 3, 16)).astype(np.float32),
        "k": (rng.uniform(-1, 1, (2, 9, 16)) / 4).astype(np.float32),
        "v": rng.uniform(-1, 1, (2, 9, 8)).astype(np.float32),
    }
    expected = metile.run(graph, inputs)["attention"]
    actual = metile.run(plan, inputs)["attention"]
    # The f32 gate: relative L2 error within 1e-5.
    assert np.linalg.norm(actual - expected) <= 1e-5 * np.linalg.norm(expected)


def test_a_node_no_output_depends_on_is_removed_before_the_rewrite(rng):
    # A dead reader of the scores: removed first (one line in plan.rewrites), so the chain is rewritten
    # and no kernel is planned for it; plan_graph_fusion alone keeps it (and the chain's scores escape).
    builder = metile.GraphBuilder()
    q = builder.input("q", metile.TensorSpec((2, 3, 8), "f32"))
    k = builder.input("k", metile.TensorSpec((2, 5, 8), "f32"))
    v = builder.input("v", metile.TensorSpec((2, 5, 8), "f32"))
    scores = builder.matmul(q, k, transpose_right=True, name="scores")
    builder.sum(scores, name="dead_sum")
    attention = builder.matmul(builder.softmax(scores), v, name="attention")
    graph = builder.build((attention,))
    plan = metile.plan_with_discovery(graph)
    assert plan.rewrites[0] == "removed 'dead_sum' (sum): no graph output depends on it"
    assert plan.rewrites[1].startswith("flash_attention 'attention' replaces")
    assert "dead_sum" not in plan.node_reasons
    assert plan.kernel_count == 1
    assert "dead_sum" in metile.plan_graph_fusion(graph).node_reasons
    inputs = {name: rng.uniform(-1, 1, shape).astype(np.float32)
              for name, shape in (("q", (2, 3, 8)), ("k", (2, 5, 8)), ("v", (2, 5, 8)))}
    expected = metile.run(graph, inputs)["attention"]
    actual = metile.run(plan, inputs)["attention"]
    assert np.linalg.norm(actual - expected) <= 1e-5 * np.linalg.norm(expected)
