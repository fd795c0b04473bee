"""metile.load_model / metile.synth_model on a tiny synthetic checkpoint: the logits are
those of `metile logits` (the same C++ path) and agree with a numpy forward pass of
position 0 written here (embedding, RMSNorm, attention over one key = v, SwiGLU); greedy
generate picks each argmax; bad input raises ValueError / TypeError."""

import itertools
import json
import os
import struct
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest

import metile


def run_in_threads(work, arguments):
    """work(argument) in a thread of its own for each of `arguments`, all started before any is joined; returns
    what the threads raised (each thread's failure caught there and reported on the caller's thread)."""
    failures = []

    def guarded(argument):
        try:
            work(argument)
        except Exception as error:
            failures.append(error)

    threads = [threading.Thread(target=guarded, args=(argument,)) for argument in arguments]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


def read_tensors(path):
    with open(path, "rb") as file:
        length = struct.unpack("<Q", file.read(8))[0]
        header = json.loads(file.read(length))
        data = file.read()
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        assert entry["dtype"] == "BF16"
        bits = np.frombuffer(data[begin:end], dtype=np.uint16).astype(np.uint32) << 16
        tensors[name] = bits.view(np.float32).reshape(entry["shape"]).astype(np.float64)
    return tensors


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x) + eps) * weight


def test_first_position_matches_numpy(tmp_path, rng):
    seed = int(rng.integers(1, 2**32))  # the rng fixture prints its seed; METILE_TEST_SEED replays it
    path = tmp_path / "tiny"
    metile.synth_model(str(path), preset="tiny", arch="llama", seed=seed)
    config = json.loads((path / "config.json").read_text())
    w = read_tensors(path / "model.safetensors")
    eps = config["rms_norm_eps"]
    token = seed % config["vocab_size"]
    x = w["model.embed_tokens.weight"][token]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        v = w[p + "self_attn.v_proj.weight"] @ h  # one key at position 0: attention returns v (RoPE is identity)
        head_dim = v.size // kv_heads
        context = np.concatenate([v[(q // (heads // kv_heads)) * head_dim:][:head_dim] for q in range(heads)])
        x = x + w[p + "self_attn.o_proj.weight"] @ context
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = w[p + "mlp.gate_proj.weight"] @ h
        x = x + w[p + "mlp.down_proj.weight"] @ (gate / (1 + np.exp(-gate)) * (w[p + "mlp.up_proj.weight"] @ h))
    expected = w["lm_head.weight"] @ rms_norm(x, w["model.norm.weight"], eps)
    model = metile.load_model(str(path), dtype="f32")
    logits = model.logits([token])
    assert logits.shape == (1, config["vocab_size"]) and logits.dtype == np.float32
    assert np.max(np.abs(logits[0] - expected)) <= 1e-5 * np.max(np.abs(expected))


def test_generate_is_greedy_and_bf16_is_close(tmp_path, rng):
    path = tmp_path / "qwen"
    metile.synth_model(str(path), arch="qwen2", seed=int(rng.integers(1, 2**31)), tie_word_embeddings=True,
                       config_spelling=5)
    model = metile.load_model(str(path))
    assert model.dtype == "bf16" and model.num_layers == 2
    prompt = [int(token) for token in rng.integers(0, model.vocab_size, size=3)]
    tokens = model.generate(prompt, 5)
    assert tokens.dtype == np.int32 and tokens.shape == (5,)
    sequence = list(prompt)
    for token in tokens:
        assert token == int(np.argmax(model.logits(sequence)[-1]))
        sequence.append(int(token))
    f32 = metile.load_model(str(path), dtype="f32").logits(prompt)
    assert np.max(np.abs(model.logits(prompt) - f32)) <= 0.05 * np.max(np.abs(f32))
    quantized = metile.load_model(str(path), dtype="f32", quantize=8).logits(prompt)
    assert np.max(np.abs(quantized - f32)) <= 0.05 * np.max(np.abs(f32))


def test_quantize_warns_of_the_matrices_it_leaves_dense(tmp_path):
    # The command line said so on stderr; load_model and synth_model said nothing, and a user who
    # asked for 4 bits measured a model that was partly bf16.
    path = tmp_path / "tiny"
    metile.synth_model(str(path), seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert metile.load_model(str(path), quantize=4).num_layers == 2  # 64 divides every width: no warning
    left_dense = r"quantize=4 leaves q/k/v, gate/up, the embedding, the LM head.* dense: \d+ columns are not a multiple of group_size 128"
    with pytest.warns(UserWarning, match=left_dense):
        metile.load_model(str(path), quantize=4, group_size=128)
    with pytest.warns(UserWarning, match=left_dense):
        metile.synth_model(str(tmp_path / "q128"), seed=3, quantize=4, group_size=128)


def test_generate_samples_within_top_k_and_top_p(tmp_path, rng):
    """Sampled tokens lie in the top-k and nucleus sets numpy computes from the same sequence's logits;
    the seed fixes them; a nucleus of one token is greedy; the keywords are checked."""
    path = tmp_path / "llama"
    metile.synth_model(str(path), preset="tiny", arch="llama", seed=int(rng.integers(1, 2**32)))
    model = metile.load_model(str(path), dtype="f32")
    prompt = [5, 9, 2]
    seed = int(rng.integers(0, 2**63))
    tokens = model.generate(prompt, 6, temperature=1.5, top_k=12, top_p=0.8, seed=seed)
    assert list(tokens) == list(model.generate(prompt, 6, temperature=1.5, top_k=12, top_p=0.8, seed=seed))
    sequence = list(prompt)
    for token in tokens:
        scaled = model.logits(sequence)[-1].astype(np.float64) / 1.5
        assert np.sum(scaled > scaled[token]) < 12  # top-k: fewer than k tokens above it (ties at the k-th stay)
        kept = np.flatnonzero(scaled >= np.sort(scaled)[-12])
        order = sorted(kept, key=lambda i: (-scaled[i], i))
        weights = np.exp(scaled[order] - scaled[order[0]])
        rank = order.index(int(token))
        assert weights[:rank].sum() < 0.8 * weights.sum() + 1e-9  # the mass ranked before it is short of top_p
        sequence.append(int(token))
    # A nucleus of one token is the greedy choice (top_k=1 is not where the maximum is tied).
    assert list(model.generate(prompt, 6, temperature=0.7, top_p=1e-300, seed=seed)) == list(model.generate(prompt, 6))
    with pytest.raises(TypeError, match="temperature must be a number, got ndarray"):
        model.generate(prompt, 2, temperature=np.array(0.5))
    with pytest.raises(ValueError, match=r"^temperature -1(\.0)? must be a finite number >= 0 \(0: greedy\)$"):
        model.generate(prompt, 2, temperature=-1.0)
    with pytest.raises(ValueError, match=r"^top_p 0(\.0)? must be in \(0, 1\]"):
        model.generate(prompt, 2, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match=r"give temperature above 0 too"):
        model.generate(prompt, 2, top_k=5)
    with pytest.raises(TypeError, match="top_k"):
        model.generate(prompt, 2, temperature=1.0, top_k=True)
    with pytest.raises(ValueError, match="seed"):
        model.generate(prompt, 2, temperature=1.0, seed=-1)


def test_generate_ends_after_the_end_of_sequence_token(tmp_path, rng):
    """generate stops after the checkpoint's eos_token_id (config.json's, then generation_config.json's in
    its place), keeping it, as transformers does; ignore_eos gives all n; the oracle is the unstopped
    generation cut after the first stop token, drawn from it."""
    path = tmp_path / "mistral"
    metile.synth_model(str(path), arch="mistral", seed=int(rng.integers(1, 2**32)))
    model = metile.load_model(str(path))
    assert model.eos_token_ids == []  # synthetic checkpoints have none
    prompt = [4, 8, 15]
    unstopped = [int(token) for token in model.generate(prompt, 9)]
    stop = unstopped[int(rng.integers(0, len(unstopped)))]
    want = unstopped[:unstopped.index(stop) + 1]
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = stop
    (path / "config.json").write_text(json.dumps(config))
    model = metile.load_model(str(path))
    assert model.eos_token_ids == [stop]
    assert [int(token) for token in model.generate(prompt, 9)] == want
    assert [int(token) for token in model.generate(prompt, 9, ignore_eos=True)] == unstopped
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop + 1000, stop]}))
    model = metile.load_model(str(path))
    assert model.eos_token_ids == [stop + 1000, stop]
    assert [int(token) for token in model.generate(prompt, 9, ignore_eos=np.bool_(False))] == want
    with pytest.raises(TypeError, match="ignore_eos must be True or False, got int"):
        model.generate(prompt, 2, ignore_eos=1)


def test_checkpoint_warnings_are_user_warnings(tmp_path):
    """What a checkpoint load warns of (here a generation_config.json that is not JSON, passed over) is a
    UserWarning: printed on stderr it could not be caught, filtered or made an error."""
    import warnings

    path = tmp_path / "m"
    metile.synth_model(str(path))
    (path / "generation_config.json").write_text("{not json")
    with pytest.warns(UserWarning, match="generation ends at config.json's eos_token_id instead"):
        metile.load_model(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="generation_config.json"):
            metile.load_model(str(path))
    (path / "generation_config.json").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean checkpoint warns of nothing
        metile.load_model(str(path))


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        metile.load_model(str(tmp_path))
    # Why a path is not a model directory: an empty one read ": not a model directory", a missing one the
    # same as a file.
    with pytest.raises(ValueError, match="^the model directory is an empty path$"):
        metile.load_model("")
    with pytest.raises(ValueError, match=r"missing: not a model directory \(no such directory\)$"):
        metile.load_model(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("{}")
    with pytest.raises(ValueError, match=r"file: not a model directory \(not a directory\)$"):
        metile.load_model(str(tmp_path / "file"))
    metile.synth_model(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="unknown preset"):
        metile.synth_model(str(tmp_path / "other"), preset="huge")
    model = metile.load_model(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.logits([1, 999])
    # A control byte quoted from a file is spelled \xNN, as the CLI prints it (an escape sequence
    # reached the terminal with the traceback).
    metile.synth_model(str(tmp_path / "escape"))
    config = json.loads((tmp_path / "escape" / "config.json").read_text())
    config["hidden_act"] = "gelu\x1b[31m\nx"
    (tmp_path / "escape" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as raised:
        metile.load_model(str(tmp_path / "escape"))
    assert "'gelu\\x1b[31m\\x0ax' is not supported (silu)" in str(raised.value)
    assert "\x1b" not in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(TypeError):
        model.logits("12")
    with pytest.raises(TypeError, match="bytes"):
        model.logits(b"\x01\x02")
    with pytest.raises(TypeError, match="bool"):
        model.logits([True, 1])
    with pytest.raises(ValueError, match="is not a token id"):
        model.logits([2**40])
    for bits in (0, 3, 5, 16):  # one wording for every bad count, under quantize's name
        with pytest.raises(ValueError, match=f"^quantize: bits must be 4 or 8, got {bits}$"):
            metile.load_model(str(tmp_path / "m"), quantize=bits)
    # True is not 1 token nor 1 bit; numpy integers are integers.
    with pytest.raises(TypeError, match="n must be an integer, got bool"):
        model.generate([1, 2], True)
    with pytest.raises(TypeError, match="quantize must be an integer, got bool"):
        metile.load_model(str(tmp_path / "m"), quantize=True)
    assert list(model.generate([1, 2], np.int64(2))) == list(model.generate([1, 2], 2))
    # As `metile generate --tokens 0`: no token is not a generation (it returned an empty array after
    # running the whole prompt).
    with pytest.raises(ValueError, match=r"cannot generate 0 tokens \(at least 1\)"):
        model.generate([1, 2], 0)
    bool_name = type(np.bool_(True)).__name__  # numpy 2 calls it bool, numpy 1 bool_
    with pytest.raises(TypeError, match="n must be an integer, got " + bool_name):
        model.generate([1, 2], np.bool_(True))
    with pytest.raises(TypeError, match="max_seq must be an integer, got bool"):
        metile.load_model(str(tmp_path / "m"), max_seq=True)
    with pytest.raises(TypeError, match="group_size must be an integer, got bool"):
        metile.load_model(str(tmp_path / "m"), quantize=4, group_size=True)
    # group_size alone would change nothing (64 when quantize is given without it).
    with pytest.raises(ValueError, match="group_size: needs quantize"):
        metile.load_model(str(tmp_path / "m"), group_size=32)
    with pytest.raises(ValueError, match="group_size: needs quantize"):
        metile.synth_model(str(tmp_path / "group_alone"), group_size=128)
    with pytest.raises(TypeError, match="layers must be an integer, got bool"):
        metile.synth_model(str(tmp_path / "one_layer"), layers=True)
    assert metile.load_model(str(tmp_path / "m"), max_seq=np.int64(64)).capacity == 64
    # synth_model's seed and tie_word_embeddings the same (True once wrote seed 1, and 1 a tied model).
    with pytest.raises(TypeError, match="seed must be an integer, got bool"):
        metile.synth_model(str(tmp_path / "seed_true"), seed=True)
    with pytest.raises(TypeError, match="tie_word_embeddings must be True, False or None, got int"):
        metile.synth_model(str(tmp_path / "tie_one"), tie_word_embeddings=1)
    with pytest.raises(ValueError, match="seed: -1 is not an integer from 0 to 2"):
        metile.synth_model(str(tmp_path / "seed_negative"), seed=-1)
    with pytest.raises(ValueError, match="seed: 18446744073709551616 is not an integer"):
        metile.synth_model(str(tmp_path / "seed_past_64_bits"), seed=2**64)
    # config_spelling as every integer argument: True is not 1, and a number past int is said as given
    # (pybind11's int took True as 1 and refused 2**40 and 5.0 with its generic "incompatible arguments").
    with pytest.raises(TypeError, match="config_spelling must be an integer, got bool"):
        metile.synth_model(str(tmp_path / "spelling_true"), config_spelling=True)
    with pytest.raises(TypeError, match="config_spelling must be an integer, got float"):
        metile.synth_model(str(tmp_path / "spelling_float"), config_spelling=5.0)
    with pytest.raises(ValueError, match="config spelling 1099511627781 is not 4 or 5"):
        metile.synth_model(str(tmp_path / "spelling_wide"), config_spelling=2**40 + 5)
    assert not any((tmp_path / name).exists() for name in ("seed_true", "tie_one", "seed_negative", "seed_past_64_bits",
                                                            "spelling_true", "spelling_float", "spelling_wide"))
    metile.synth_model(str(tmp_path / "seed_largest"), seed=np.uint64(2**64 - 1), tie_word_embeddings=np.bool_(True))
    assert json.loads((tmp_path / "seed_largest" / "config.json").read_text())["tie_word_embeddings"] is True
    # An endless iterator of ids stops at the cache's capacity instead of filling the memory.
    with pytest.raises(ValueError, match=r"more than the KV-cache capacity of 256 tokens \(max_position_embeddings, "
                                         r"at most 4096; max_seq= sets it\)$"):
        model.logits(itertools.repeat(1))
    # A capacity error names Python's keyword, not the command line's option.
    with pytest.raises(ValueError, match=r"past the KV-cache capacity 256 \(max_position_embeddings, at most 4096; "
                                         r"max_seq= sets it\)$"):
        model.generate([1, 2], 300)
    with pytest.raises(ValueError, match=r"past the KV-cache capacity 8 \(max_seq\)$"):
        metile.load_model(str(tmp_path / "m"), max_seq=8).generate([1, 2], 8)
    # Trailing separators name the directory itself (the staging folder once went inside it).
    (tmp_path / "empty").mkdir()
    metile.synth_model(str(tmp_path / "empty") + "/")
    assert metile.load_model(str(tmp_path / "empty")).vocab_size == model.vocab_size


def test_unordered_ids_and_model_dtypes_are_refused(tmp_path):
    metile.synth_model(str(tmp_path / "m"))
    model = metile.load_model(str(tmp_path / "m"))
    # A set's or a dict's order is not the caller's (a dict gave its keys as ids).
    for unordered in ({3, 1, 2}, frozenset({1, 2}), {1: 2}):
        with pytest.raises(TypeError, match=f"ids must be a sequence of integers, got {type(unordered).__name__}"):
            model.logits(unordered)
    # A model runs in bf16 or f32; the message listed every dtype a tensor may have.
    with pytest.raises(ValueError, match=r"^dtype must be 'bf16' or 'f32', got 'F32'$"):
        metile.load_model(str(tmp_path / "m"), dtype="F32")
    with pytest.raises(ValueError, match=r"^dtype must be 'bf16' or 'f32', got 'f16'$"):
        metile.load_model(str(tmp_path / "m"), dtype="f16")


def test_a_write_the_system_refuses_is_an_os_error(tmp_path):
    # Past `ulimit -f` the write fails with EFBIG (Python ignores SIGXFSZ): not the caller's mistake, so
    # not a ValueError; an OSError naming the directory, and nothing is left behind.
    script = (
        "import resource, sys, metile\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))\n"
        "try:\n"
        "    metile.synth_model(sys.argv[1])\n"
        "except OSError as error:\n"
        "    print(type(error).__name__, error)\n"
    )
    target = tmp_path / "model"
    run = subprocess.run([sys.executable, "-c", script, str(target)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"OSError {target}: write failed: File too large (writing shard 1); nothing was written\n"
    assert list(tmp_path.iterdir()) == []


def test_synth_model_shards_and_is_cancelled_by_ctrl_c(tmp_path):
    metile.synth_model(str(tmp_path / "sharded"), max_shard_mb=0.05)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    one = metile.load_model(str(tmp_path / "sharded")).logits([1, 2, 3])
    metile.synth_model(str(tmp_path / "whole"))
    assert np.array_equal(one, metile.load_model(str(tmp_path / "whole")).logits([1, 2, 3]))
    with pytest.raises(TypeError, match="max_shard_mb must be a number, got bool"):
        metile.synth_model(str(tmp_path / "bool"), max_shard_mb=True)
    with pytest.raises(ValueError, match=r"the shard size -1(\.0)? MB must be in"):
        metile.synth_model(str(tmp_path / "negative"), max_shard_mb=-1)
    # Two threads of one process write at once (the GIL is released): their staging folders were one
    # (".metile-partial-PID"), so each model could take the other's shards.
    def write_twin(seed):
        metile.synth_model(str(tmp_path / f"twin{seed}"), seed=seed, max_shard_mb=0.05)

    assert not run_in_threads(write_twin, (1, 2))
    for seed in (1, 2):
        metile.synth_model(str(tmp_path / f"alone{seed}"), seed=seed, max_shard_mb=0.05)
        assert np.array_equal(metile.load_model(str(tmp_path / f"twin{seed}")).logits([1, 2, 3]),
                              metile.load_model(str(tmp_path / f"alone{seed}")).logits([1, 2, 3]))
    # Ctrl-C while the weights are written: whatever the SIGINT handler raises (KeyboardInterrupt by
    # default; a test's own exception here, so that a late signal cannot end the pytest session), and
    # nothing is left. The GIL was held for the whole write, so the interrupt came only after the
    # checkpoint was complete.
    import os
    import signal
    import time
    target = tmp_path / "interrupted"

    class Interrupted(Exception):
        pass

    def raise_interrupted(signum, frame):
        raise Interrupted()

    def interrupt_once_a_shard_is_staged():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any((folder / "shard-1").exists() for folder in tmp_path.glob(".metile-partial-*")):
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.002)

    previous = signal.signal(signal.SIGINT, raise_interrupted)
    try:
        thread = threading.Thread(target=interrupt_once_a_shard_is_staged)
        thread.start()
        with pytest.raises(Interrupted):
            metile.synth_model(str(target), preset="small", max_shard_mb=1)
        thread.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not target.exists()
    assert not list(tmp_path.glob(".metile-partial-*"))


def test_generate_is_interrupted_by_ctrl_c(tmp_path):
    # Ctrl-C during a long generation ends it at the next token or prompt step with whatever the SIGINT handler raises
    # (a test's own exception here, as above); the generation ran without the GIL and looked for no
    # signal, so the handler ran only after the last token (here minutes after the signal: 60000
    # tokens). The model is unharmed: a fresh generation after it is the same as before.
    import os
    import signal
    import time
    metile.synth_model(str(tmp_path / "model"))
    model = metile.load_model(str(tmp_path / "model"), max_seq=60003)
    before = model.generate([1, 2, 3], 5, ignore_eos=True)

    class Interrupted(Exception):
        pass

    handled = []

    def raise_interrupted(signum, frame):
        handled.append(time.monotonic())
        raise Interrupted()

    sent = []

    def interrupt_soon():
        time.sleep(0.3)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    # The same during a long prompt's steps, in generate and in logits: looked for between generated tokens
    # only, the signal waited for the whole prompt (minutes: 60000 tokens, each step attending over all before it).
    long_prompt = [1 + k % 200 for k in range(60000)]
    for call in (lambda: model.generate([1, 2, 3], 60000, ignore_eos=True),
                 lambda: model.generate(long_prompt, 1, ignore_eos=True), lambda: model.logits(long_prompt)):
        handled.clear()
        sent.clear()
        previous = signal.signal(signal.SIGINT, raise_interrupted)
        try:
            thread = threading.Thread(target=interrupt_soon)
            thread.start()
            with pytest.raises(Interrupted):
                call()
            thread.join()
        finally:
            signal.signal(signal.SIGINT, previous)
        assert handled[0] - sent[0] < 10, f"the handler ran {handled[0] - sent[0]:.1f} s after the signal"
    assert np.array_equal(model.generate([1, 2, 3], 5, ignore_eos=True), before)


def test_cuda_backend(tmp_path, rng):
    """backend="cuda": without a GPU (or a CUDA build) one ValueError before the checkpoint is
    read, after the arguments are checked; with one, the GPU engine's logits and greedy tokens match the CPU path's."""
    seed = int(rng.integers(1, 2**32))  # the rng fixture prints its seed; METILE_TEST_SEED replays it
    with pytest.raises(ValueError, match="backend must be 'cpu' or 'cuda', got 'tpu'"):
        metile.load_model(str(tmp_path / "absent"), backend="tpu")
    path = tmp_path / "m"
    metile.synth_model(str(path), seed=seed)
    try:
        # 32768 positions: a generation to the capacity outlasts the first look for signals (0.25 s) below.
        model = metile.load_model(str(path), backend="cuda", max_seq=32768)
    except ValueError as error:
        assert str(error).startswith("backend='cuda': ") and "\n" not in str(error)
        # Every argument is checked before the device is looked for: a mistake in one read as the
        # missing GPU (quantize=3, max_seq=-1, an absent directory).
        for arguments, expected in (({"path": str(tmp_path / "absent")}, "not a model directory"),
                                    ({"quantize": 3}, "4 or 8"), ({"max_seq": -1}, "max_seq -1 is negative"),
                                    ({"max_seq": 2**40}, "at most 2^31 positions")):
            arguments = {"path": str(path), **arguments}
            with pytest.raises(ValueError) as refused:
                metile.load_model(backend="cuda", **arguments)
            assert expected in str(refused.value) and "no cuda device" not in str(refused.value).lower(), arguments
        return
    cpu = metile.load_model(str(path))
    prompt = [5, 9, 2, 7]
    on_gpu, on_cpu = model.logits(prompt), cpu.logits(prompt)
    assert on_gpu.shape == on_cpu.shape == (4, model.vocab_size)
    assert np.linalg.norm(on_gpu - on_cpu) <= 1e-2 * np.linalg.norm(on_cpu)
    tokens = model.generate(prompt, 6)
    sequence = list(prompt)
    agreements = 0
    for token in tokens:
        agreements += int(token) == int(np.argmax(cpu.logits(sequence)[-1]))
        sequence.append(int(token))
    assert agreements >= 5, (tokens, agreements)
    # Calls take turns on the model's one session: four threads at once get what one thread gets (each
    # reset and fed the session under the others), and a signal handler that calls the model from inside
    # its generate is refused (it reset the session under the generation), the generation unharmed.
    expected = model.logits(prompt)
    results = []
    assert not run_in_threads(lambda _: results.append(model.logits(prompt)), range(4))
    assert len(results) == 4 and all(np.array_equal(result, expected) for result in results)
    import signal

    class Stop(Exception):
        pass

    refused = []

    def handler(signum, frame):
        try:
            model.logits(prompt)
        except ValueError as error:
            refused.append(str(error))
        raise Stop

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)  # once: the handler runs at the first look, 0.25 s in
        with pytest.raises(Stop):  # ends at the first look for signals, 0.25 s in
            model.generate(prompt, model.capacity - len(prompt), ignore_eos=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert refused == ["CudaModel.logits: called from inside another call of the same model on this thread "
                       "(a signal handler?); the model runs one call at a time"]
    assert np.array_equal(model.generate(prompt, 6), tokens)


def test_two_cuda_models_in_two_threads(tmp_path, rng, monkeypatch):
    """Two GPU models loaded and used in two threads at once, as two users of one process do: one thread's weight
    uploads ran on the legacy stream while the other captured its step graphs, which failed the upload
    (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) or invalidated the capture. Each thread's results must be its model's.
    Both loads start cold (no model loaded before in this test, a decision cache of their own), so that their
    compiles, races and captures overlap as long as they can."""
    monkeypatch.setenv("METILE_CACHE_DIR", str(tmp_path / "cache"))
    paths = []
    for k in range(2):
        paths.append(str(tmp_path / f"m{k}"))
        metile.synth_model(paths[k], seed=int(rng.integers(1, 2**32)))
    prompt = [5, 9, 2, 7]
    models, results = [None, None], [None, None]

    def work(k):
        models[k] = metile.load_model(paths[k], backend="cuda", max_seq=64)
        results[k] = [(models[k].logits(prompt), models[k].generate(prompt, 8, ignore_eos=True)) for _ in range(4)]

    failures = run_in_threads(work, range(2))
    without_gpu = ("backend='cuda': no CUDA device", "backend='cuda': this metile was built without the CUDA toolkit")
    if len(failures) == 2 and all(isinstance(error, ValueError) and str(error).startswith(without_gpu)
                                  for error in failures):
        pytest.skip(str(failures[0]))  # test_cuda_backend checks what is refused without a GPU
    assert not failures, [str(error) for error in failures]
    for k in range(2):
        logits, tokens = models[k].logits(prompt), models[k].generate(prompt, 8, ignore_eos=True)
        for got_logits, got_tokens in results[k]:
            np.testing.assert_array_equal(got_logits, logits, err_msg=f"model {k}")
            np.testing.assert_array_equal(got_tokens, tokens, err_msg=f"model {k}")
        on_cpu = metile.load_model(paths[k]).logits(prompt)
        assert np.linalg.norm(logits - on_cpu) <= 1e-2 * np.linalg.norm(on_cpu), f"model {k}"


def test_threads_share_a_model(tmp_path):
    """The bindings release the GIL: eight threads asking one fresh model for logits at once (each
    prompt length a step graph of its own, built on first use) get what one thread gets."""
    metile.synth_model(str(tmp_path / "m"))
    prompts = [[1 + k % 7] * (k % 16 + 1) for k in range(32)]
    reference = metile.load_model(str(tmp_path / "m"))
    expected = [reference.logits(prompt) for prompt in prompts]
    for _ in range(6):
        model = metile.load_model(str(tmp_path / "m"))
        results = []

        def work(first):  # every prompt, each thread from another one: same lengths at once
            for j in range(len(prompts)):
                k = (first + j) % len(prompts)
                results.append((k, model.logits(prompts[k])))

        assert not run_in_threads(work, range(8))
        assert len(results) == 8 * len(prompts)
        for k, logits in results:
            np.testing.assert_array_equal(logits, expected[k], err_msg=f"prompt {prompts[k]}")


def test_first_calls_from_two_threads_do_not_deadlock(tmp_path):
    """numpy imported by metile itself, not by the caller: the first arrays returned from two
    threads at once once deadlocked in pybind11's lazily filled numpy table (4 runs in 6)."""
    metile.synth_model(str(tmp_path / "m"))
    script = (
        "import threading, metile\n"
        f"model = metile.load_model({str(tmp_path / 'm')!r})\n"
        "threads = [threading.Thread(target=model.logits, args=([1, 2, 3],)) for _ in range(2)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print('done')\n"
    )
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and run.stdout.strip() == "done", run.stderr
