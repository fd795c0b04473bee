// The decode-step graph of a Llama/Qwen2/Mistral decoder for S new tokens, recorded
// with GraphBuilder as plain ops so that the planner and later passes see every
// chain (attention included). Per layer, with H hidden, Hq/Hkv heads, D head_dim,
// G = Hq / Hkv, T the cache capacity:
//
//   x [S, H] ─ rms_norm ─┬─ q_proj (+bias) ─ reshape [S,Hq,D] ─ transpose [Hq,S,D] ─ rope
//                        │      ─ reshape [Hkv, G·S, D]        (GQA: row r of KV head h is
//                        │                                     query head h·G + r/S, token r mod S)
//                        ├─ k_proj (+bias) ─ [Hkv,S,D] ─ rope ─ kv_cache_write(k_cache, ·, positions)
//                        └─ v_proj (+bias) ─ [Hkv,S,D] ──────── kv_cache_write(v_cache, ·, positions)
//   scores = matmul(q, k_cache', transpose_right) [Hkv, G·S, T] ─ scale 1/sqrt(D)
//          ─ position_mask(positions) ─ softmax ─ matmul(·, v_cache') [Hkv, G·S, D]
//          ─ reshape [Hq, S, D] ─ transpose [S, Hq, D] ─ reshape [S, Hq·D] ─ o_proj ─ + x
//   ─ rms_norm ─ silu(gate_proj) · up_proj ─ down_proj ─ + x
// then the final rms_norm and the LM head (lm_head, or the embedding when tied), and, when asked
// for (StepOutputs::logits_and_next_tokens), next_tokens = argmax(logits): greedy decoding's
// token ids, so a step need not copy the logits off the device.
//
// The order of operations follows transformers' modeling_llama.py (scores scaled
// after q·kᵀ, softmax over the masked scores, residual adds after each block), so
// the f32 graph matches its float32 logits to rounding.
#include <cmath>

#include <fmt/format.h>

#include "metile/model.h"
#include "model_internal.h"

namespace metile {
namespace {

class StepGraphRecorder {
 public:
  StepGraphRecorder(const DecoderModel& model, std::int64_t steps, StepOutputs step_outputs, std::int64_t cache_rows)
      : model_(model), steps_(steps), step_outputs_(step_outputs), cache_rows_(cache_rows) {}

  ComputeGraph record() {
    const ModelConfig& config = model_.config();
    const DType dtype = model_.dtype();
    token_ids_ = builder_.input("token_ids", TensorSpec({steps_}, DType::i32));
    positions_ = builder_.input("positions", TensorSpec({steps_}, DType::i32));
    ValueRef x;
    if (model_.is_quantized("model.embed_tokens")) {
      const QuantizedWeight table = quantized_weight("model.embed_tokens");
      x = builder_.quantized_embedding(token_ids_, table.packed, table.scales, table.biases, table.format.bits,
                                       table.format.group_size, "embedded");
    } else {
      x = builder_.embedding(token_ids_, weight("model.embed_tokens.weight"), "embedded");
    }
    std::vector<ValueRef> outputs;
    for (std::int64_t layer = 0; layer < config.num_hidden_layers; ++layer) x = decoder_layer(layer, x, outputs);
    const ValueRef normed = builder_.rms_norm(x, weight("model.norm.weight"), config.rms_norm_eps, "final_norm");
    const ValueRef logits =
        linear(normed, config.tie_word_embeddings ? "model.embed_tokens" : "lm_head", false, "logits");
    outputs.insert(outputs.begin(), logits);
    if (step_outputs_ == StepOutputs::logits_and_next_tokens) {
      outputs.insert(outputs.begin() + 1, builder_.argmax(logits, "next_tokens"));
    }
    (void)dtype;
    return builder_.build(outputs);
  }

 private:
  struct QuantizedWeight {
    AffineQuantization format;
    ValueRef packed, scales, biases;
  };

  ValueRef weight(const std::string& name) {
    const auto found = inputs_.find(name);
    if (found != inputs_.end()) return found->second;
    const ValueRef value = builder_.input(name, model_.weights().at(name).spec());
    inputs_.emplace(name, value);
    return value;
  }

  QuantizedWeight quantized_weight(const std::string& prefix) {
    return {*model_.quantization(), weight(prefix + ".weight"), weight(prefix + ".scales"), weight(prefix + ".biases")};
  }

  // x [S, K] times the linear's weight [N, K]ᵀ (+ bias [N]).
  ValueRef linear(ValueRef x, const std::string& prefix, bool bias, const std::string& name) {
    ValueRef y;
    if (model_.is_quantized(prefix)) {
      const QuantizedWeight w = quantized_weight(prefix);
      y = builder_.quantized_matmul(x, w.packed, w.scales, w.biases, w.format.bits, w.format.group_size,
                                    bias ? name + ".matmul" : name);
    } else {
      y = builder_.matmul(x, weight(prefix + ".weight"), true, bias ? name + ".matmul" : name);
    }
    return bias ? builder_.add(y, weight(prefix + ".bias"), name) : y;
  }

  ValueRef rope(ValueRef x, const std::string& name) {
    const ModelConfig& config = model_.config();
    Attributes attributes;
    attributes.set("theta", config.rope.theta);
    attributes.set("dims", config.head_dim);
    if (config.rope.llama3_scaling) {
      attributes.set("scaling", std::string("llama3"));
      attributes.set("factor", config.rope.factor);
      attributes.set("low_freq_factor", config.rope.low_freq_factor);
      attributes.set("high_freq_factor", config.rope.high_freq_factor);
      attributes.set("original_max_position_embeddings",
                     static_cast<double>(config.rope.original_max_position_embeddings));
    }
    return builder_.add_node("rope", {x, positions_}, std::move(attributes), name).front();
  }

  // [S, heads·D] -> [heads, S, D]
  ValueRef split_heads(ValueRef x, std::int64_t heads, const std::string& name) {
    const std::int64_t head_dim = model_.config().head_dim;
    const ValueRef shaped = builder_.reshape(x, {steps_, heads, head_dim}, name + ".heads");
    return builder_.transpose(shaped, {1, 0, 2}, name + ".by_head");
  }

  ValueRef decoder_layer(std::int64_t layer, ValueRef x, std::vector<ValueRef>& outputs) {
    const ModelConfig& config = model_.config();
    const std::string hf = layer_prefix(layer);
    const std::string at = fmt::format("layers.{}.", layer);
    const std::int64_t q_heads = config.num_attention_heads;
    const std::int64_t kv_heads = config.num_key_value_heads;
    const std::int64_t head_dim = config.head_dim;
    const std::int64_t group = config.group_size();
    const TensorSpec cache_spec({kv_heads, cache_rows_, head_dim}, model_.dtype());

    const ValueRef normed = builder_.rms_norm(x, weight(hf + "input_layernorm.weight"), config.rms_norm_eps,
                                              at + "input_norm");
    const bool bias = config.qkv_bias();
    const ValueRef q = linear(normed, hf + "self_attn.q_proj", bias, at + "q");
    const ValueRef k = linear(normed, hf + "self_attn.k_proj", bias, at + "k");
    const ValueRef v = linear(normed, hf + "self_attn.v_proj", bias, at + "v");
    const ValueRef q_rotated = rope(split_heads(q, q_heads, at + "q"), at + "q.rope");
    const ValueRef q_grouped = builder_.reshape(q_rotated, {kv_heads, group * steps_, head_dim}, at + "q.grouped");
    const ValueRef k_rotated = rope(split_heads(k, kv_heads, at + "k"), at + "k.rope");
    const ValueRef v_heads = split_heads(v, kv_heads, at + "v");

    const ValueRef k_cache = builder_.input(at + "k_cache", cache_spec);
    const ValueRef v_cache = builder_.input(at + "v_cache", cache_spec);
    const ValueRef k_all = builder_.kv_cache_write(k_cache, k_rotated, positions_, at + "k_cache_out");
    const ValueRef v_all = builder_.kv_cache_write(v_cache, v_heads, positions_, at + "v_cache_out");
    outputs.push_back(k_all);
    outputs.push_back(v_all);

    const ValueRef scores = builder_.matmul(q_grouped, k_all, true, at + "scores");
    const ValueRef scaled = builder_.scale(scores, 1.0 / std::sqrt(static_cast<double>(head_dim)), at + "scaled");
    const ValueRef masked = builder_.position_mask(scaled, positions_, at + "masked");
    const ValueRef probabilities = builder_.softmax(masked, -1, at + "probabilities");
    const ValueRef context = builder_.matmul(probabilities, v_all, false, at + "context");
    const ValueRef by_head = builder_.reshape(context, {q_heads, steps_, head_dim}, at + "context.by_head");
    const ValueRef by_token = builder_.transpose(by_head, {1, 0, 2}, at + "context.by_token");
    const ValueRef merged = builder_.reshape(by_token, {steps_, q_heads * head_dim}, at + "context.merged");
    const ValueRef attended = linear(merged, hf + "self_attn.o_proj", false, at + "o");
    const ValueRef after_attention = builder_.add(x, attended, at + "residual_attention");

    const ValueRef normed2 = builder_.rms_norm(after_attention, weight(hf + "post_attention_layernorm.weight"),
                                               config.rms_norm_eps, at + "post_norm");
    const ValueRef gate = linear(normed2, hf + "mlp.gate_proj", false, at + "gate");
    const ValueRef up = linear(normed2, hf + "mlp.up_proj", false, at + "up");
    const ValueRef activated = builder_.multiply(builder_.silu(gate, at + "gate.silu"), up, at + "swiglu");
    const ValueRef down = linear(activated, hf + "mlp.down_proj", false, at + "down");
    return builder_.add(after_attention, down, at + "residual_mlp");
  }

  const DecoderModel& model_;
  std::int64_t steps_;
  StepOutputs step_outputs_;
  std::int64_t cache_rows_;
  GraphBuilder builder_;
  ValueRef token_ids_, positions_;
  std::map<std::string, ValueRef> inputs_;
};

}  // namespace

const ComputeGraph& DecoderModel::step_graph(std::int64_t steps, StepOutputs outputs, std::int64_t cache_rows) const {
  if (steps < 1 || steps > kMaxStepTokens) {
    throw InputError(fmt::format("a decode step takes 1 to {} tokens, not {}", kMaxStepTokens, steps));
  }
  if (cache_rows < 0 || cache_rows > capacity_) {
    throw InputError(
        fmt::format("a decode step's caches hold 1 to {} rows (0: the capacity, {}), not {}", capacity_, capacity_, cache_rows));
  }
  if (cache_rows == 0) cache_rows = capacity_;
  return graphs_.get(steps, outputs, cache_rows,
                     [&] { return StepGraphRecorder(*this, steps, outputs, cache_rows).record(); });
}

DecoderModel::StepGraphCache::StepGraphCache(const StepGraphCache& other) {
  const std::lock_guard lock(other.mutex_);
  graphs_ = other.graphs_;
}

DecoderModel::StepGraphCache& DecoderModel::StepGraphCache::operator=(const StepGraphCache& other) {
  if (this == &other) return *this;
  const std::scoped_lock lock(mutex_, other.mutex_);
  graphs_ = other.graphs_;
  return *this;
}

// A graph once built is never replaced, so the reference stays valid after the lock is released.
const ComputeGraph& DecoderModel::StepGraphCache::get(std::int64_t steps, StepOutputs outputs, std::int64_t cache_rows,
                                                      const std::function<ComputeGraph()>& build) const {
  const std::lock_guard lock(mutex_);
  auto& cached = graphs_[{steps, outputs, cache_rows}];
  if (!cached) cached = std::make_shared<const ComputeGraph>(build());
  return *cached;
}

}  // namespace metile
