#!/usr/bin/env python3
# How far each GPU path is from the CPU float32 reference, and from each other: synthetic tiny checkpoints
# (by default Llama bf16, Qwen2 bf16, Llama 4-bit and 8-bit), a 40-token prompt, mean KL over its positions,
# for the native engine, the fused engine and the fused engine with each region kind declined. Usage on a
# CUDA machine:
#   python3 benchmarks/model/path_divergence.py build/gpu/tools/metile/metile /tmp/path-divergence [arch:bits ...]
# (bits 0 = bf16; e.g. llama:4 qwen2:0).
import json, math, random, subprocess, sys
metile = sys.argv[1]; root = sys.argv[2]
def logits(model, extra):
    out = subprocess.run([metile, "logits", model, "--prompt-ids", ids, "--format", "json", "--all-positions"] + extra,
                         capture_output=True, text=True)
    if out.returncode != 0: return None, out.stderr.strip()[-200:]
    j = json.loads(out.stdout); return j["logits"], ""
def kl(p_logits, q_logits, vocab):
    total = 0; n = len(p_logits) // vocab
    for r in range(n):
        p = p_logits[r*vocab:(r+1)*vocab]; q = q_logits[r*vocab:(r+1)*vocab]
        mp = max(p); mq = max(q)
        lp = [x - mp for x in p]; lq = [x - mq for x in q]
        zp = math.log(sum(math.exp(x) for x in lp)); zq = math.log(sum(math.exp(x) for x in lq))
        total += sum(math.exp(a - zp) * ((a - zp) - (b - zq)) for a, b in zip(lp, lq))
    return total / n
import os
os.makedirs(root, exist_ok=True)
kinds = ["flash_attention", "contraction_epilogue", "swiglu_mlp", "contraction", "qkv_rope_kv_cache",
         "sibling_contractions", "rope_kv_cache", "residual_add_rms_norm"]
cases = [a.split(":") for a in sys.argv[3:]] or [["llama", "0"], ["qwen2", "0"], ["llama", "4"], ["llama", "8"]]
rows = []
for arch, bits in cases:
    quant = None if bits == "0" else bits
    model = f"{root}/{arch}{bits}"
    subprocess.run([metile, "synth-model", model, "--preset", "tiny", "--arch", arch, "--seed", "11"], check=True, capture_output=True)
    random.seed(5); ids = ",".join(str(random.randrange(256)) for _ in range(40))
    q = ["--quantize", quant] if quant else []
    ref, _ = logits(model, ["--dtype", "f32"] + q)
    with open(f"{model}/config.json") as file: vocab = json.load(file)["vocab_size"]
    assert len(ref) == 40 * vocab, "every position's logits"
    paths = {"cpu bf16": ["--dtype", "bf16"], "cuda native (all declined)": ["--backend", "cuda", "--decline", ",".join(kinds)],
             "cuda fused": ["--backend", "cuda"]}
    for k in kinds: paths[f"cuda fused, {k} declined"] = ["--backend", "cuda", "--decline", k]
    native = None
    for name, extra in paths.items():
        got, err = logits(model, extra + q)
        if got is None: row = (arch, quant, name, "error " + err, "")
        else:
            if name.startswith("cuda native"): native = got
            row = (arch, quant, name, f"{kl(ref, got, vocab):.2e}", f"{kl(native, got, vocab):.2e}" if native else "")
        rows.append(row)
        print("  ", *row, flush=True)  # progress: each path as it is measured
print(f"{'model':<12}{'path':<40}{'KL vs f32 ref':>14}{'KL vs native':>14}")
for arch, quant, name, a, b in rows: print(f"{arch + (' q' + quant if quant else ''):<12}{name:<40}{a:>14}{b:>14}")
