"""A float64 numpy oracle of a Hugging Face Llama / Qwen2 / Mistral checkpoint's forward pass.

test_decoder_oracle.py holds metile's CPU decoder (metile.load_model at dtype f32) to it on every
CI run, where the transformers comparison needs a GPU machine. It follows transformers'
modeling_{llama,qwen2,mistral}.py and the defaults of their configuration classes, and mlx-lm's
affine quantization for MLX checkpoints. It was written from those, independently of metile's C++,
so that the two share no misreading: numpy only, safetensors parsed by hand, every value float64.

  Oracle(path).logits(ids)       every position's logits, [len(ids), vocab]
  write_checkpoint(path, config, rng, quantization=(bits, group))
                                 a random checkpoint for a hand-written config.json
"""
import json
import math
import os
import struct
from types import SimpleNamespace

import numpy as np

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
# Class defaults of LlamaConfig / Qwen2Config / MistralConfig, which an absent key takes (None: the head count).
ABSENT_KV_HEADS = {"llama": None, "qwen2": 32, "mistral": 8}
ABSENT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "mistral": 4096 * 32}
_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "U32": "<u4", "I32": "<i4", "U8": "u1"}


def read_safetensors(path):
    with open(path, "rb") as file:
        data = file.read()
    (length,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + length])
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = (8 + length + offset for offset in entry["data_offsets"])
        if entry["dtype"] == "BF16":
            # A bf16 is the high half of the f32 of the same value: shifting it up is exact.
            array = (np.frombuffer(data[begin:end], "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            array = np.frombuffer(data[begin:end], _DTYPES[entry["dtype"]])
        tensors[name] = array.reshape(entry["shape"])
    return tensors


def read_tensors(path):
    """model.safetensors, or every shard that model.safetensors.index.json names."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_safetensors(os.path.join(path, "model.safetensors"))
    with open(index) as file:
        shards = sorted(set(json.load(file)["weight_map"].values()))
    return {name: array for shard in shards for name, array in read_safetensors(os.path.join(path, shard)).items()}


def parse_config(raw):
    """config.json (a dict) as transformers reads it, absent keys taking the class's defaults."""
    arch = ARCHITECTURES[raw["architectures"][0]] if raw.get("architectures") else raw["model_type"]
    if raw.get("hidden_act", "silu") != "silu" or raw.get("attention_bias") or raw.get("mlp_bias"):
        raise NotImplementedError("the oracle knows SiLU MLPs without Llama's optional biases")
    heads, layers = raw["num_attention_heads"], raw["num_hidden_layers"]
    # An explicit null is the head count (plain multi-head attention), unlike an absent key.
    kv_heads = raw["num_key_value_heads"] if "num_key_value_heads" in raw else ABSENT_KV_HEADS[arch]
    # transformers 5 moved rope_theta and the scaling into one rope_parameters dict.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise NotImplementedError(f"rope type {rope_type}")
    window = [None] * layers
    if arch == "mistral":
        window = [raw.get("sliding_window", 4096)] * layers  # null: no window
    elif arch == "qwen2" and raw.get("use_sliding_window", False):
        # Qwen2Config drops sliding_window unless use_sliding_window; layer_types, when absent, slides
        # the layers from max_window_layers on.
        size = raw.get("sliding_window", 4096)
        types = raw.get("layer_types") or ["sliding_attention" if i >= raw.get("max_window_layers", 28)
                                           else "full_attention" for i in range(layers)]
        window = [size if kind == "sliding_attention" else None for kind in types]
    return SimpleNamespace(
        arch=arch, vocab=raw["vocab_size"], hidden=raw["hidden_size"], intermediate=raw["intermediate_size"],
        layers=layers, heads=heads, kv_heads=heads if kv_heads is None else kv_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, eps=raw.get("rms_norm_eps", 1e-6),
        theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)), rope=rope, rope_type=rope_type,
        tie=raw.get("tie_word_embeddings", False), window=window, quantization=raw.get("quantization"),
        # Not used by the forward pass (no dynamic RoPE here); a cache's capacity may come from it.
        max_positions=raw.get("max_position_embeddings", ABSENT_MAX_POSITIONS[arch]),
        # transformers 5 (standardize_rope_params): max_position_embeddings where the scaling has none; a
        # top-level one is set on LlamaConfig / Qwen2Config / MistralConfig only after that, so never read.
        pretraining=rope.get("original_max_position_embeddings",
                             raw.get("max_position_embeddings", ABSENT_MAX_POSITIONS[arch])))


def rope_frequencies(config):
    """transformers' inv_freq: one frequency per pair of dimensions, llama3 rescaling the slow ones."""
    inverse = config.theta ** -(np.arange(0, config.head_dim, 2) / config.head_dim)
    if config.rope_type == "default":
        return inverse
    r = config.rope
    factor, low, high, context = r["factor"], r["low_freq_factor"], r["high_freq_factor"], config.pretraining
    wavelength = 2 * math.pi / inverse
    # Waves longer than context / low are slowed by factor, shorter than context / high kept, and the
    # band between blended linearly in context / wavelength.
    blend = (context / wavelength - low) / (high - low)
    scaled = np.where(wavelength > context / low, inverse / factor, inverse)
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return np.where(medium, (1 - blend) * inverse / factor + blend * inverse, scaled)


def dequantize(packed, scales, biases, bits, group):
    """MLX affine: w = scale * code + bias for each group of `group` inputs; a u32 word holds
    32 / bits codes, the first in its lowest bits."""
    shifts = np.arange(0, 32, bits, dtype=np.uint64)
    codes = (packed.astype(np.uint64)[..., None] >> shifts) & ((1 << bits) - 1)
    codes = codes.reshape(packed.shape[0], -1).astype(np.float64)
    expand = lambda a: np.repeat(a.astype(np.float64), group, axis=1)  # noqa: E731
    return expand(scales) * codes + expand(biases)


def rms_norm(x, weight, eps):
    return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


class Oracle:
    def __init__(self, path):
        with open(os.path.join(path, "config.json")) as file:
            self.config = parse_config(json.load(file))
        self.tensors = read_tensors(path)

    def matrix(self, prefix):
        t, quantization = self.tensors, self.config.quantization
        if prefix + ".scales" not in t:
            return t[prefix + ".weight"].astype(np.float64)
        # mlx-lm writes a layer quantized otherwise than the rest as quantization[prefix].
        own = quantization.get(prefix) if isinstance(quantization.get(prefix), dict) else quantization
        return dequantize(t[prefix + ".weight"], t[prefix + ".scales"], t[prefix + ".biases"],
                          own["bits"], own["group_size"])

    def linear(self, x, prefix, bias=False):
        y = x @ self.matrix(prefix).T
        return y + self.tensors[prefix + ".bias"] if bias else y

    def logits(self, ids):
        c, ids = self.config, np.asarray(ids)
        n = len(ids)
        angles = np.arange(n)[:, None] * rope_frequencies(c)[None, :]
        cos, sin = np.cos(np.concatenate([angles, angles], 1)), np.sin(np.concatenate([angles, angles], 1))
        half = c.head_dim // 2

        def rotate(x):  # transformers' rotate_half pairs dimension i with i + head_dim / 2, not 2i with 2i + 1
            return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin

        def heads(x, count):
            return x.reshape(n, count, c.head_dim).transpose(1, 0, 2)

        query, key = np.arange(n)[:, None], np.arange(n)[None, :]
        embedding = self.matrix("model.embed_tokens")
        x = embedding[ids]
        for layer in range(c.layers):
            p = f"model.layers.{layer}."
            h = rms_norm(x, self.tensors[p + "input_layernorm.weight"], c.eps)
            q, k, v = (self.linear(h, p + f"self_attn.{name}_proj", bias=c.arch == "qwen2") for name in "qkv")
            q, k, v = rotate(heads(q, c.heads)), rotate(heads(k, c.kv_heads)), heads(v, c.kv_heads)
            # repeat_kv: query heads g * j .. g * j + g - 1 share KV head j.
            k, v = (np.repeat(a, c.heads // c.kv_heads, axis=0) for a in (k, v))
            hidden = key > query
            if c.window[layer] is not None:
                hidden |= query - key >= c.window[layer]
            scores = np.where(hidden, -np.inf, q @ k.transpose(0, 2, 1) / math.sqrt(c.head_dim))
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            context = (weights / weights.sum(-1, keepdims=True)) @ v
            x = x + self.linear(context.transpose(1, 0, 2).reshape(n, -1), p + "self_attn.o_proj")
            h = rms_norm(x, self.tensors[p + "post_attention_layernorm.weight"], c.eps)
            gate = self.linear(h, p + "mlp.gate_proj")
            x = x + self.linear(gate / (1 + np.exp(-gate)) * self.linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")
        x = rms_norm(x, self.tensors["model.norm.weight"], c.eps)
        return x @ (embedding if c.tie else self.matrix("lm_head")).T


def write_safetensors(path, tensors):
    """float arrays as F32, packed codes as U32, in the order given."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        kind = "U32" if array.dtype == np.uint32 else "F32"
        blob = np.ascontiguousarray(array, _DTYPES[kind]).tobytes()
        header[name] = {"dtype": kind, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def mlx_quantize(w, bits, group):
    """Min-max affine codes for w [out, in] per group of inputs; the scale and bias are float32, as
    stored, before the codes are chosen against them."""
    grouped = w.reshape(w.shape[0], -1, group)
    low, high = grouped.min(2), grouped.max(2)
    scales = np.maximum((high - low) / ((1 << bits) - 1), 1e-7).astype(np.float32)
    biases = low.astype(np.float32)
    codes = np.rint((grouped - biases[..., None]) / scales[..., None]).clip(0, (1 << bits) - 1).astype(np.uint64)
    words = codes.reshape(w.shape[0], -1, 32 // bits) << np.arange(0, 32, bits, dtype=np.uint64)
    return words.sum(2).astype(np.uint32), scales, biases


def write_checkpoint(path, config, rng, quantization=None):
    """A random checkpoint for `config` (a config.json dict) in `path`, shaped as parse_config reads
    the config (absent keys too). quantization=(bits, group) stores each matrix whose inputs are
    whole groups MLX-quantized, the embedding included, and says so in config.json."""
    c = parse_config(config)
    q_width, kv_width = c.heads * c.head_dim, c.kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab, c.hidden)}
    for layer in range(c.layers):
        p = f"model.layers.{layer}."
        shapes.update({p + name: shape for name, shape in (
            ("input_layernorm.weight", (c.hidden,)), ("post_attention_layernorm.weight", (c.hidden,)),
            ("self_attn.q_proj.weight", (q_width, c.hidden)), ("self_attn.k_proj.weight", (kv_width, c.hidden)),
            ("self_attn.v_proj.weight", (kv_width, c.hidden)), ("self_attn.o_proj.weight", (c.hidden, q_width)),
            ("mlp.gate_proj.weight", (c.intermediate, c.hidden)), ("mlp.up_proj.weight", (c.intermediate, c.hidden)),
            ("mlp.down_proj.weight", (c.hidden, c.intermediate)))})
        if c.arch == "qwen2":
            shapes.update({p + f"self_attn.{name}_proj.bias": (width,) for name, width in
                           (("q", q_width), ("k", kv_width), ("v", kv_width))})
    shapes["model.norm.weight"] = (c.hidden,)
    if not c.tie:
        shapes["lm_head.weight"] = (c.vocab, c.hidden)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            value = 1 + rng.uniform(-0.1, 0.1, shape)
        elif name.endswith(".bias"):
            value = rng.uniform(-0.3, 0.3, shape)
        else:
            # Unit-variance outputs; sharper queries and keys so that attention is far from uniform,
            # and a wider head so that the top logits stand apart.
            gain = 2.0 if ("q_proj" in name or "k_proj" in name) else 3.0 if name.startswith("lm_head") else 1.0
            value = rng.uniform(-1, 1, shape) * (1.0 if "embed" in name else gain * math.sqrt(3.0 / shape[1]))
        tensors[name] = value.astype(np.float32)
    config = dict(config)
    if quantization:
        bits, group = quantization
        config["quantization"] = {"group_size": group, "bits": bits}
        for name in [n for n, a in tensors.items() if a.ndim == 2 and a.shape[1] % group == 0]:
            prefix = name[:-len(".weight")]
            packed, scales, biases = mlx_quantize(tensors.pop(name).astype(np.float64), bits, group)
            tensors.update({name: packed, prefix + ".scales": scales, prefix + ".biases": biases})
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as file:
        json.dump(config, file, indent=1)
    write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    return path
