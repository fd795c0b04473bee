"""metile's CPU decoder (metile.load_model, dtype f32) against decoder_oracle, a float64 numpy
reading of transformers' Llama / Qwen2 / Mistral: synth_model checkpoints of each architecture,
dense and MLX-quantized, tied and untied, and hand-written configs for what synth_model does not
write (GQA extremes, head_dim apart from hidden / heads, llama3 RoPE, Qwen2 biases, absent keys,
sliding windows, MLX codes packed here rather than by metile).

Every position's logits must lie within TOLERANCE of the oracle's, relative to the row's largest
|logit| (f32 against float64 lands near 1e-6), and each greedy token must be the oracle's argmax
where the oracle's top two logits stand further apart than f32 rounding can close. Prompts are
17 to 40 tokens, so that metile's prefill takes more than one 16-token step. Inputs are fresh each
run; the rng fixture prints the seed and METILE_TEST_SEED=N replays it.
"""
import warnings

import numpy as np
import pytest

import decoder_oracle
import metile

TOLERANCE = 1e-4
MARGIN = 1e-3  # a top-2 gap, relative to max |logit|, that a 1e-4 error cannot reorder
ABSENT = object()  # a config key left out of config.json (not null)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def config(arch="llama", **changes):
    raw = {"architectures": [CLASSES[arch]], "model_type": arch, "vocab_size": 101, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
           "tie_word_embeddings": False}
    if arch == "mistral":
        raw["sliding_window"] = None  # MistralConfig's default is a 4096-token window
    raw.update(changes)
    return {key: value for key, value in raw.items() if value is not ABSENT}


def random_prompt(rng, vocab, low=17, high=40):
    return [int(token) for token in rng.integers(0, vocab, int(rng.integers(low, high + 1)))]


def relative_errors(got, want):
    return np.max(np.abs(got - want), axis=1) / np.max(np.abs(want), axis=1)


def assert_agrees(path, prompt, steps=4):
    """metile's logits and greedy tokens against the oracle's on one checkpoint."""
    model = metile.load_model(str(path), dtype="f32")
    tokens = [int(token) for token in model.generate(prompt, steps)]
    # Both score metile's own continuation: a token chosen on a near-tie does not derail the rest.
    sequence = prompt + tokens[:-1]
    got, want = model.logits(sequence), decoder_oracle.Oracle(path).logits(sequence)
    errors = relative_errors(got, want)
    worst = int(errors.argmax())
    assert errors[worst] <= TOLERANCE, \
        f"position {worst} of {len(sequence)} (prompt {len(prompt)}): {errors[worst]:.3g} of max |logit|"
    for step, token in enumerate(tokens):
        row = want[len(prompt) - 1 + step]
        second, first = np.sort(row)[-2:]
        if first - second > MARGIN * np.abs(row).max():
            assert token == int(row.argmax()), f"generated token {step}: metile {token}, oracle {int(row.argmax())}"


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("quantization", [None, (4, 32), (8, 64), (4, 128)], ids=["dense", "q4g32", "q8g64", "q4g128"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_synth_models(tmp_path, rng, arch, quantization, tie):
    # q4g128 leaves the 64-input matrices dense (not whole groups) and quantizes down_proj (128 inputs).
    bits, group = quantization or (None, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metile.synth_model(str(tmp_path), arch=arch, layers=int(rng.integers(2, 4)), seed=int(rng.integers(2**32)),
                           quantize=bits, group_size=group, tie_word_embeddings=tie)
    # Said exactly where a matrix stays dense: at group 128, the 64-column ones.
    assert [str(w.message).split(" dense:")[1] for w in caught] == (
        [" 64 columns are not a multiple of group_size 128"] if group == 128 else [])
    oracle = decoder_oracle.Oracle(tmp_path)
    assert oracle.config.tie == tie and ("model.layers.0.mlp.down_proj.scales" in oracle.tensors) == bool(bits)
    assert_agrees(tmp_path, random_prompt(rng, oracle.config.vocab))


HAND_WRITTEN = [
    pytest.param(config(num_key_value_heads=1), None, id="one_kv_head"),
    pytest.param(config(num_key_value_heads=4), None, id="kv_heads_equal_heads"),
    pytest.param(config(num_key_value_heads=None), None, id="kv_heads_null_is_heads"),
    pytest.param(config(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, head_dim=32), None,
                 id="head_dim_above_hidden_over_heads"),
    pytest.param(config(head_dim=8, num_key_value_heads=1), None, id="head_dim_below_hidden_over_heads"),
    pytest.param(config(head_dim=32, rope_theta=500000.0, rope_scaling=LLAMA3), None, id="llama3_rope"),
    pytest.param(config(head_dim=32, rope_theta=ABSENT, rope_parameters={**LLAMA3, "rope_theta": 500000.0}), None,
                 id="llama3_rope_transformers5_spelling"),
    pytest.param(config(rope_scaling={**{k: v for k, v in LLAMA3.items() if k != "rope_type"}, "type": "llama3"},
                        head_dim=32), None, id="llama3_rope_old_type_key"),
    # transformers 5 fills an absent original_max_position_embeddings from max_position_embeddings (256
    # here, against LLAMA3's 64: a different band of slowed frequencies); a top-level one is not read.
    pytest.param(config(head_dim=32, rope_parameters={k: v for k, v in LLAMA3.items()
                                                      if k != "original_max_position_embeddings"}), None,
                 id="llama3_rope_pretraining_from_max_positions"),
    pytest.param(config(head_dim=32, original_max_position_embeddings=32,
                        rope_parameters={k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}),
                 None, id="llama3_rope_top_level_pretraining_not_read"),
    pytest.param(config(head_dim=32, original_max_position_embeddings=32, rope_scaling=LLAMA3), None,
                 id="llama3_rope_top_level_pretraining_beside_the_scaling_not_read"),
    pytest.param(config("qwen2"), None, id="qwen2_biases"),
    pytest.param(config("qwen2", tie_word_embeddings=True, head_dim=24, num_hidden_layers=3), None,
                 id="qwen2_biases_tied_head_dim_24"),
    # A window that slides in no layer does not bound the prompt (both are 8 < the prompt).
    pytest.param(config("qwen2", use_sliding_window=False, sliding_window=8), None, id="qwen2_window_not_used"),
    pytest.param(config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2), None,
                 id="qwen2_window_from_layer_2_of_2"),
    pytest.param(config("mistral", num_hidden_layers=3, rope_theta=1000.0), None, id="mistral_no_window"),
    pytest.param(config(), (4, 32), id="mlx_q4g32"),
    pytest.param(config(num_key_value_heads=1, tie_word_embeddings=True), (8, 64), id="mlx_q8g64_tied"),
    pytest.param(config("qwen2", intermediate_size=160), (4, 64), id="mlx_q4g64_qwen2_dense_down_proj"),
]


@pytest.mark.parametrize("raw, quantization", HAND_WRITTEN)
def test_hand_written_checkpoints(tmp_path, rng, raw, quantization):
    decoder_oracle.write_checkpoint(tmp_path, raw, rng, quantization)
    assert_agrees(tmp_path, random_prompt(rng, raw["vocab_size"]))


def test_mistral_without_num_key_value_heads(tmp_path, rng):
    """MistralConfig's default is 8 KV heads, not the head count: a checkpoint whose config leaves
    the key out (and sliding_window, max_position_embeddings) has 8 heads' worth of K and V."""
    raw = config("mistral", hidden_size=128, num_attention_heads=16, num_key_value_heads=ABSENT,
                 sliding_window=ABSENT, max_position_embeddings=ABSENT)
    decoder_oracle.write_checkpoint(tmp_path, raw, rng)
    oracle = decoder_oracle.Oracle(tmp_path)
    assert oracle.config.kv_heads == 8 and oracle.config.window == [4096, 4096]
    assert oracle.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (8 * 8, 128)
    assert_agrees(tmp_path, random_prompt(rng, raw["vocab_size"]))


WINDOW = 20
WINDOWED = [
    pytest.param(config("mistral", sliding_window=WINDOW), id="mistral"),
    pytest.param(config("qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                        max_window_layers=2), id="qwen2_max_window_layers"),
    pytest.param(config("qwen2", use_sliding_window=True, sliding_window=WINDOW,
                        layer_types=["sliding_attention", "full_attention"]), id="qwen2_layer_types"),
]


@pytest.mark.parametrize("raw", WINDOWED)
def test_sliding_window(tmp_path, rng, raw):
    """metile does not implement attention over a sliding window: the window bounds the context.
    A prompt longer than the window is refused (the oracle's masked attention would differ from
    full attention there); one that, with its greedy tokens, fills the window agrees."""
    decoder_oracle.write_checkpoint(tmp_path, raw, rng)
    assert WINDOW in decoder_oracle.Oracle(tmp_path).config.window
    model = metile.load_model(str(tmp_path), dtype="f32")
    too_long = random_prompt(rng, raw["vocab_size"], WINDOW + 1, 40)
    # Both name the window as where the capacity came from (logits said max_seq, never given).
    with pytest.raises(ValueError, match=rf"capacity of {WINDOW} tokens \(the checkpoint's sliding_window\)$"):
        model.logits(too_long)
    with pytest.raises(ValueError, match=rf"capacity of {WINDOW} tokens \(the checkpoint's sliding_window\)$"):
        model.generate(too_long, 2)
    prompt = random_prompt(rng, raw["vocab_size"], 17, WINDOW - 2)
    assert_agrees(tmp_path, prompt, steps=WINDOW - len(prompt) + 1)


MISTAKES = ["rope type default for llama3", "rope_theta 2% off", "llama3 pretraining positions from max_positions",
            "dense weights for MLX 8-bit"]


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_wrong_oracle_disagrees(tmp_path, rng, mistake):
    """The comparison is not vacuous: an oracle that misreads the checkpoint a little is well
    outside TOLERANCE, while the right reading is within it."""
    raw = config(head_dim=32, rope_theta=500000.0, rope_scaling=LLAMA3)
    seed = int(rng.integers(2**32))
    # One set of dense weights, and the same quantized: the dense reading of the quantized checkpoint is the mistake.
    decoder_oracle.write_checkpoint(tmp_path / "dense", raw, np.random.default_rng(seed))
    decoder_oracle.write_checkpoint(tmp_path / "q8", raw, np.random.default_rng(seed), (8, 32))
    path = tmp_path / ("q8" if "8-bit" in mistake else "dense")
    prompt = random_prompt(rng, raw["vocab_size"])
    got = metile.load_model(str(path), dtype="f32").logits(prompt)
    assert relative_errors(got, decoder_oracle.Oracle(path).logits(prompt)).max() <= TOLERANCE
    wrong = decoder_oracle.Oracle(tmp_path / "dense")
    if mistake == "rope type default for llama3":
        wrong.config.rope_type = "default"
    elif mistake == "rope_theta 2% off":
        wrong.config.theta *= 1.02
    elif mistake == "llama3 pretraining positions from max_positions":
        wrong.config.pretraining = wrong.config.max_positions
    assert relative_errors(got, wrong.logits(prompt)).max() > 10 * TOLERANCE
