#!/usr/bin/env python3
"""The independent oracle for metile's decoder models: Hugging Face transformers.

For each architecture (Llama, Qwen2, Mistral with an explicit head_dim), tied and
untied embeddings, both config.json spellings (transformers 4: rope_theta /
torch_dtype; 5: rope_parameters / dtype) and Llama 3 RoPE scaling, this script

  1. writes a tiny checkpoint with `metile synth-model`,
  2. loads it with transformers' AutoModelForCausalLM in float32 (eager attention),
  3. compares the float32 logits of a 20-token prompt (prefilled by metile in chunks
     of 16 + 4) with `metile logits --dtype f32`: max |error| <= 1e-4 of max |logit|,
     and the same argmax at every position,
  4. compares 32 greedy tokens with `metile generate --dtype f32 --ignore-eos` (transformers
     recomputes the whole prefix each step, no cache; metile decodes with its KV cache), and
     then with an end-of-sequence token (one of those tokens, in generation_config.json) metile's
     generation with transformers' generate(eos_token_id=...): both end after its first occurrence.

It needs python3 with torch and transformers (the device has them); without them it
prints why and exits 77, which ctest reports as skipped. No GPU is needed: torch runs
on the CPU here, the point is the independent implementation.

With --backend cuda it checks the GPU decode engine instead (metile's fused engine, bf16,
`metile logits --backend cuda`) against the same float32 logits of transformers, for every
checkpoint: relative L2 and max error within the bf16 numeric gate (1e-2), or within twice
what metile's own bf16 CPU reference (`--dtype bf16 --backend cpu`, printed beside it) reaches,
since both round every op's result to bf16. Exits 77 where no CUDA device exists.

Usage: transformers_oracle.py --metile PATH/TO/metile [--work DIR] [--seed N] [--backend cpu|cuda]
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

SKIP = 77


def fail(message):
    print(f"transformers_oracle: {message}", file=sys.stderr)
    sys.exit(1)


def run(command):
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        fail(f"{' '.join(command)} exited {result.returncode}: {result.stderr.strip()}")
    return result.stdout


def relative_errors(ours, reference):
    """relative L2 and max |error| / max |reference| of two float64 tensors."""
    difference = ours - reference
    return (difference.norm().item() / reference.norm().item(),
            difference.abs().max().item() / reference.abs().max().item())


def cuda_unavailable(metile, model_dir):
    """The one-line reason `metile logits --backend cuda` gives where no GPU exists, else None."""
    result = subprocess.run([metile, "logits", model_dir, "--prompt-ids", "1", "--backend", "cuda", "--format",
                             "json"], capture_output=True, text=True)
    if result.returncode == 2 and "--backend cuda" in result.stderr:
        return result.stderr.strip()
    return None


def transformers_view(model_dir, view_dir, major):
    """A directory transformers reads: the same weights (symlinked) and config.json in
    the spelling of the installed transformers. Version 5 reads both spellings; 4 reads
    only its own, so a version-5 config is rewritten with the same values."""
    os.makedirs(view_dir)
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            os.symlink(os.path.join(model_dir, name), os.path.join(view_dir, name))
    with open(os.path.join(model_dir, "config.json")) as file:
        config = json.load(file)
    if major < 5 and "rope_parameters" in config:
        parameters = dict(config.pop("rope_parameters"))
        config["rope_theta"] = parameters.pop("rope_theta", 10000.0)
        config["rope_scaling"] = None if parameters.get("rope_type", "default") == "default" else parameters
    if major < 5 and "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    with open(os.path.join(view_dir, "config.json"), "w") as file:
        json.dump(config, file, indent=2)


def with_llama3_scaling(model_dir):
    """Llama 3.1 RoPE scaling on a tiny model: a short original context (64) puts the
    head's frequencies in all three bands (kept, blended, divided by the factor)."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as file:
        config = json.load(file)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    if "rope_parameters" in config:
        config["rope_parameters"] = dict(scaling, rope_theta=500000.0)
    else:
        config["rope_theta"] = 500000.0
        config["rope_scaling"] = scaling
    with open(path, "w") as file:
        json.dump(config, file, indent=2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--metile", required=True)
    parser.add_argument("--work", default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--max-relative-error", type=float, default=1e-4)
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--bf16-gate", type=float, default=1e-2)
    args = parser.parse_args()

    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as error:
        print(f"transformers_oracle: skipped: {error} (needs python3 with torch and transformers)")
        return SKIP

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"transformers_oracle: seed {seed} (--seed {seed} repeats it); torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    major = int(transformers.__version__.split(".")[0])
    torch.manual_seed(seed)
    generator = random.Random(seed)
    work = args.work or tempfile.mkdtemp(prefix="metile_transformers_oracle_")
    os.makedirs(work, exist_ok=True)

    variants = []
    for arch in ("llama", "qwen2", "mistral"):
        for tied in ("false", "true"):
            for spelling in (4, 5):
                variants.append((arch, tied, spelling, False))
    variants.append(("llama", "false", 4, True))
    variants.append(("llama", "true", 5, True))
    if args.backend == "cuda":
        # The engine sees the same graphs whichever config spelling made them: one spelling per
        # architecture and tying, plus Llama 3 scaling, keeps the device time short.
        variants = [variant for variant in variants if variant[2] == 4 or variant[3]]

    rows = []
    failures = 0
    try:
        for index, (arch, tied, spelling, llama3) in enumerate(variants):
            name = f"{arch}-{'tied' if tied == 'true' else 'untied'}-v{spelling}{'-llama3' if llama3 else ''}"
            model_dir = os.path.join(work, name)
            run([args.metile, "synth-model", model_dir, "--preset", "tiny", "--arch", arch, "--seed",
                 str(seed + index), "--tie-word-embeddings", tied, "--config-spelling", str(spelling)])
            if llama3:
                with_llama3_scaling(model_dir)
            view_dir = model_dir + "-transformers"
            transformers_view(model_dir, view_dir, major)
            try:
                model = AutoModelForCausalLM.from_pretrained(view_dir, dtype=torch.float32, attn_implementation="eager")
            except TypeError:
                model = AutoModelForCausalLM.from_pretrained(view_dir, torch_dtype=torch.float32,
                                                             attn_implementation="eager")
            model = model.to(torch.float32).eval()
            with open(os.path.join(model_dir, "config.json")) as file:
                vocab = json.load(file)["vocab_size"]
            prompt = [generator.randrange(vocab) for _ in range(20)]
            ids = ",".join(str(token) for token in prompt)

            with torch.no_grad():
                reference = model(torch.tensor([prompt])).logits[0].double()
            if args.backend == "cuda":
                if index == 0:
                    reason = cuda_unavailable(args.metile, model_dir)
                    if reason is not None:
                        print(f"transformers_oracle: skipped: {reason}")
                        return SKIP
                on_gpu = json.loads(run([args.metile, "logits", model_dir, "--prompt-ids", ids, "--backend", "cuda",
                                         "--format", "json"]))
                on_cpu = json.loads(run([args.metile, "logits", model_dir, "--prompt-ids", ids, "--dtype", "bf16",
                                         "--format", "json"]))
                gpu_l2, gpu_max = relative_errors(torch.tensor(on_gpu["logits"], dtype=torch.float64), reference[-1])
                cpu_l2, cpu_max = relative_errors(torch.tensor(on_cpu["logits"], dtype=torch.float64), reference[-1])
                argmax_agreement = sum(a == b for a, b in zip(on_gpu["argmax"], reference.argmax(dim=-1).tolist()))
                ok = ((gpu_l2 <= args.bf16_gate or gpu_l2 <= 2 * cpu_l2) and
                      (gpu_max <= args.bf16_gate or gpu_max <= 2 * cpu_max))
                failures += 0 if ok else 1
                rows.append((name, gpu_l2, gpu_max, cpu_l2, cpu_max, argmax_agreement, len(prompt), ok))
                continue
            ours = json.loads(run([args.metile, "logits", model_dir, "--prompt-ids", ids, "--dtype", "f32",
                                   "--format", "json"]))
            last = torch.tensor(ours["logits"], dtype=torch.float64)
            error = (last - reference[-1]).abs().max().item() / reference[-1].abs().max().item()
            same_argmax = ours["argmax"] == reference.argmax(dim=-1).tolist()

            tokens = list(prompt[:4])
            with torch.no_grad():
                for _ in range(args.steps):
                    tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
            expected_tokens = tokens[4:]
            generate = [args.metile, "generate", model_dir, "--prompt-ids", ",".join(str(t) for t in prompt[:4]),
                        "--tokens", str(args.steps), "--dtype", "f32", "--format", "json"]
            generated = json.loads(run(generate + ["--ignore-eos"]))["tokens"]
            # The end-of-sequence stop against transformers' generate: an eos_token_id that the greedy run
            # produces (at a drawn step), in generation_config.json for metile and to generate() alike.
            eos = expected_tokens[generator.randrange(len(expected_tokens))]
            with open(os.path.join(model_dir, "generation_config.json"), "w") as file:
                json.dump({"eos_token_id": [eos]}, file)
            with torch.no_grad():
                stopped = model.generate(torch.tensor([prompt[:4]]), max_new_tokens=args.steps, do_sample=False,
                                         eos_token_id=[eos], pad_token_id=eos)[0, 4:].tolist()
            same_stop = json.loads(run(generate))["tokens"] == stopped
            same_tokens = generated == expected_tokens and same_stop
            ok = error <= args.max_relative_error and same_argmax and same_tokens
            failures += 0 if ok else 1
            first_difference = next((f"@{i}" for i, (a, b) in enumerate(zip(generated, expected_tokens)) if a != b),
                                    "" if same_stop else f" at eos {eos}")
            rows.append((name, error, same_argmax, same_tokens, first_difference, ok))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    if args.backend == "cuda":
        print(f"{'checkpoint':32} {'GPU rel L2':>11} {'GPU rel max':>12} {'CPU bf16 L2':>12} {'CPU bf16 max':>13} "
              f"{'argmax':>7}  result")
        for name, gpu_l2, gpu_max, cpu_l2, cpu_max, agreement, count, ok in rows:
            print(f"{name:32} {gpu_l2:11.3e} {gpu_max:12.3e} {cpu_l2:12.3e} {cpu_max:13.3e} {agreement:>3}/{count:<3}  "
                  f"{'ok' if ok else 'FAIL'}")
        print(f"transformers_oracle --backend cuda: {len(rows) - failures}/{len(rows)} checkpoints within the bf16 "
              f"gate ({args.bf16_gate}) or twice metile's bf16 CPU reference, against transformers float32")
        return 1 if failures else 0
    print(f"{'checkpoint':32} {'max |err| / max |logit|':>24} {'argmax':>7} {'32 greedy':>10}  result")
    for name, error, same_argmax, same_tokens, first_difference, ok in rows:
        greedy = "same" if same_tokens else f"differ{first_difference}"
        print(f"{name:32} {error:24.3e} {'same' if same_argmax else 'DIFFER':>7} {greedy:>10}  "
              f"{'ok' if ok else 'FAIL'}")
    print(f"transformers_oracle: {len(rows) - failures}/{len(rows)} checkpoints agree "
          f"(relative error <= {args.max_relative_error}, same greedy tokens over {args.steps} steps)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
