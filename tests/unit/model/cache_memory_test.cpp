// What a CPU decode step holds besides the model: the KV caches once. Its own binary, because it
// replaces the global operator new and delete to count the bytes live on the heap (glibc's
// malloc_usable_size on both sides), and its peak during feed() is what the test asserts: a step
// that copied every cache (the borrowing executors do, kv_cache_write's reference evaluation is a
// copy) would hold them twice.
#include <gtest/gtest.h>
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iostream>
#include <new>

#include <fmt/format.h>

#include <map>
#include <string>

#include "metile/cpu_runtime.h"
#include "metile/fusion.h"
#include "model_test_support.h"

namespace {

std::atomic<std::size_t> live_bytes{0};
std::atomic<std::size_t> peak_bytes{0};

void* counted_or_null(void* pointer) noexcept {
  if (pointer == nullptr) return nullptr;
  const std::size_t now = live_bytes.fetch_add(malloc_usable_size(pointer)) + malloc_usable_size(pointer);
  std::size_t peak = peak_bytes.load();
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
  }
  return pointer;
}

void* counted(void* pointer) {
  if (pointer == nullptr) throw std::bad_alloc();
  return counted_or_null(pointer);
}

void uncounted(void* pointer) noexcept {
  if (pointer == nullptr) return;
  live_bytes.fetch_sub(malloc_usable_size(pointer));
  std::free(pointer);
}

std::size_t aligned_size(std::size_t size, std::align_val_t alignment) {
  const auto step = static_cast<std::size_t>(alignment);
  return std::max(step, (size + step - 1) / step * step);
}

}  // namespace

// Every replaceable form, the nothrow ones included (std::stable_sort's buffer comes from
// operator new(size, nothrow): left to the sanitizer's allocator it reached our free(), an
// alloc-dealloc mismatch under AddressSanitizer).
void* operator new(std::size_t size) { return counted(std::malloc(std::max<std::size_t>(size, 1))); }
void* operator new[](std::size_t size) { return counted(std::malloc(std::max<std::size_t>(size, 1))); }
void* operator new(std::size_t size, std::align_val_t alignment) {
  return counted(std::aligned_alloc(static_cast<std::size_t>(alignment), aligned_size(size, alignment)));
}
void* operator new[](std::size_t size, std::align_val_t alignment) {
  return counted(std::aligned_alloc(static_cast<std::size_t>(alignment), aligned_size(size, alignment)));
}
void* operator new(std::size_t size, const std::nothrow_t&) noexcept { return counted_or_null(std::malloc(std::max<std::size_t>(size, 1))); }
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept {
  return counted_or_null(std::malloc(std::max<std::size_t>(size, 1)));
}
void* operator new(std::size_t size, std::align_val_t alignment, const std::nothrow_t&) noexcept {
  return counted_or_null(std::aligned_alloc(static_cast<std::size_t>(alignment), aligned_size(size, alignment)));
}
void* operator new[](std::size_t size, std::align_val_t alignment, const std::nothrow_t&) noexcept {
  return counted_or_null(std::aligned_alloc(static_cast<std::size_t>(alignment), aligned_size(size, alignment)));
}
void operator delete(void* pointer) noexcept { uncounted(pointer); }
void operator delete(void* pointer, const std::nothrow_t&) noexcept { uncounted(pointer); }
void operator delete[](void* pointer, const std::nothrow_t&) noexcept { uncounted(pointer); }
void operator delete(void* pointer, std::align_val_t, const std::nothrow_t&) noexcept { uncounted(pointer); }
void operator delete[](void* pointer, std::align_val_t, const std::nothrow_t&) noexcept { uncounted(pointer); }
void operator delete[](void* pointer) noexcept { uncounted(pointer); }
void operator delete(void* pointer, std::size_t) noexcept { uncounted(pointer); }
void operator delete[](void* pointer, std::size_t) noexcept { uncounted(pointer); }
void operator delete(void* pointer, std::align_val_t) noexcept { uncounted(pointer); }
void operator delete[](void* pointer, std::align_val_t) noexcept { uncounted(pointer); }
void operator delete(void* pointer, std::size_t, std::align_val_t) noexcept { uncounted(pointer); }
void operator delete[](void* pointer, std::size_t, std::align_val_t) noexcept { uncounted(pointer); }

namespace metile {
namespace {

class CacheMemory : public testing::ModelDirectoryTest {};

// Eight layers over a 32768-slot cache (32 MiB of bf16 K and V in all): a step's own work (one
// layer's scores over the cache, its V widened to f32) is a few MiB, so a step that copied the
// caches would show the 32 MiB of the caches again.
TEST_F(CacheMemory, ADecodeStepHoldsTheCachesOnceOnBothPaths) {
  SynthOptions options;
  options.layers = 8;
  const std::filesystem::path directory = synth("tiny", options);
  // The tiny preset allows 256 positions; this test wants a long cache.
  std::string config;
  {
    std::ifstream file(directory / "config.json");
    config.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  }
  const std::string limit = "\"max_position_embeddings\": 256";
  ASSERT_NE(config.find(limit), std::string::npos) << config;
  config.replace(config.find(limit), limit.size(), "\"max_position_embeddings\": 32768");
  testing::write_text(directory / "config.json", config);
  LoadOptions load;
  load.max_sequence = 32768;
  const DecoderModel model = DecoderModel::load(directory, load);
  const ModelConfig& shape = model.config();
  const std::size_t cache_bytes = static_cast<std::size_t>(2 * shape.num_hidden_layers * shape.num_key_value_heads *
                                                           model.capacity() * shape.head_dim * 2);
  const std::int32_t tokens[] = {1, 2, 3};
  for (const DecodePath path : {DecodePath::reference, DecodePath::planned}) {
    SCOPED_TRACE(path == DecodePath::reference ? "reference path" : "planned path");
    DecodeSession session(model, path);
    // The step graphs (and plans) of both sizes are built outside the count.
    session.feed(tokens);
    session.feed(std::span<const std::int32_t>(tokens, 1));
    const std::size_t before = live_bytes.load();
    peak_bytes.store(before);
    session.feed(tokens);
    session.feed(std::span<const std::int32_t>(tokens, 1));
    const std::size_t above = peak_bytes.load() - before;
    std::cout << (path == DecodePath::reference ? "reference" : "planned") << " path: caches " << cache_bytes
              << " bytes, a step's peak " << above << " bytes above what the session holds between steps\n";
    EXPECT_LT(above, cache_bytes / 2);
  }
}

// The decode step graphs themselves: each handed-over cache comes back as its "_out", the same
// buffer (kv_cache_write in place), through both executors. (The peak above would not tell a copy
// freed right after its write from no copy.)
TEST_F(CacheMemory, TheStepGraphsReturnTheHandedOverCaches) {
  SynthOptions options;
  options.layers = 3;
  const DecoderModel model = DecoderModel::load(synth("tiny", options));
  const TensorMap* weights[] = {&model.weights()};
  for (const std::int64_t steps : {std::int64_t{1}, std::int64_t{3}}) {
    const ComputeGraph& graph = model.step_graph(steps);
    const FusionPlan plan = plan_graph_fusion(graph, FusionTarget::cpu());
    for (const bool planned : {false, true}) {
      SCOPED_TRACE(fmt::format("{} tokens, {}", steps, planned ? "run_plan_reference" : "run_reference"));
      TensorMap owned;
      std::map<std::string, const std::byte*> buffers;
      for (ValueId input : graph.inputs()) {
        const Value& value = graph.value(input);
        if (model.weights().contains(value.name)) continue;
        owned.insert_or_assign(value.name, HostTensor(value.spec));  // ids and positions 0: valid
        if (value.name.ends_with("_cache")) buffers[value.name] = owned.at(value.name).bytes().data();
      }
      ASSERT_EQ(buffers.size(), 2u * 3u);
      const TensorMap outputs = planned ? run_plan_reference(plan, std::move(owned), weights)
                                        : run_reference(graph, std::move(owned), weights);
      for (const auto& [name, buffer] : buffers) {
        EXPECT_EQ(outputs.at(name + "_out").bytes().data(), buffer) << name << " was copied";
      }
    }
  }
}

}  // namespace
}  // namespace metile
