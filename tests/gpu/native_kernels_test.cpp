// Every op's native path on the GPU (generated kernel, cuBLASLt, dequantize + cuBLASLt) matches
// the CPU reference on fresh random inputs, across dtypes and shapes that are and are not
// multiples of the vector width; and the native sequence captured as a CUDA graph replays the
// same results.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_support.h"

namespace metile {
namespace {

using testing_support::CudaDeviceTest;
using testing_support::expect_outputs_match;

using OpBuilder = std::function<ValueRef(GraphBuilder&, ValueRef x, DType dtype, const std::vector<std::int64_t>& shape)>;

struct OpCase {
  std::string name;
  OpBuilder build;
};

std::vector<OpCase> op_cases() {
  auto row = [](const std::vector<std::int64_t>& shape) { return std::vector<std::int64_t>{shape.back()}; };
  return {
      {"add", [](GraphBuilder& b, ValueRef x, DType, const auto&) { return b.add(x, b.silu(x, "other"), "out"); }},
      {"subtract_broadcast",
       [row](GraphBuilder& b, ValueRef x, DType dtype, const auto& shape) {
         return b.subtract(x, b.input("row", {row(shape), dtype}), "out");
       }},
      {"multiply_broadcast",
       [row](GraphBuilder& b, ValueRef x, DType dtype, const auto& shape) {
         return b.multiply(x, b.input("row", {row(shape), dtype}), "out");
       }},
      {"scale", [](GraphBuilder& b, ValueRef x, DType, const auto&) { return b.scale(x, -1.75, "out"); }},
      {"silu", [](GraphBuilder& b, ValueRef x, DType, const auto&) { return b.silu(x, "out"); }},
      {"gelu", [](GraphBuilder& b, ValueRef x, DType, const auto&) { return b.gelu(x, "none", "out"); }},
      {"gelu_tanh", [](GraphBuilder& b, ValueRef x, DType, const auto&) { return b.gelu(x, "tanh", "out"); }},
      {"exp", [](GraphBuilder& b, ValueRef x, DType, const auto&) { return b.exp(x, "out"); }},
      {"rms_norm",
       [row](GraphBuilder& b, ValueRef x, DType dtype, const auto& shape) {
         return b.rms_norm(x, b.input("weight", {row(shape), dtype}), 1e-6, "out");
       }},
      {"layer_norm",
       [row](GraphBuilder& b, ValueRef x, DType dtype, const auto& shape) {
         return b.layer_norm(x, b.input("weight", {row(shape), dtype}), b.input("bias", {row(shape), dtype}), 1e-5, "out");
       }},
      {"softmax", [](GraphBuilder& b, ValueRef x, DType, const auto&) { return b.softmax(x, -1, "out"); }},
      {"causal_mask", [](GraphBuilder& b, ValueRef x, DType, const auto&) { return b.causal_mask(x, 2, "out"); }},
      {"cast",
       [](GraphBuilder& b, ValueRef x, DType dtype, const auto&) {
         return b.cast(x, dtype == DType::f32 ? DType::f16 : DType::f32, "out");
       }},
      {"reshape",
       [](GraphBuilder& b, ValueRef x, DType, const auto& shape) {
         std::int64_t count = 1;
         for (std::int64_t d : shape) count *= d;
         return b.reshape(x, {count}, "out");
       }},
      {"transpose", [](GraphBuilder& b, ValueRef x, DType, const auto&) { return b.transpose(x, {1, 0}, "out"); }},
      {"rope",
       [](GraphBuilder& b, ValueRef x, DType, const auto& shape) {
         return b.rope(x, b.input("positions", {{shape[0]}, DType::i32}), 10000.0, shape[1] - shape[1] % 2, "out");
       }},
  };
}

class NativeKernels : public CudaDeviceTest {};

// The graph's native steps run once on `inputs`, every computed value poisoned first; its outputs.
TensorMap run_natively(NativeRuntime& native, const CudaStream& stream, const ComputeGraph& graph, const TensorMap& inputs) {
  DeviceValues values(graph);
  values.upload_inputs(inputs);
  values.poison_computed_values();
  run_steps(native.graph_steps(graph, values), stream);
  stream.synchronize();
  return values.download_outputs();
}

TEST_F(NativeKernels, EveryOpMatchesTheReference) {
  NativeRuntime native;
  CudaStream stream;
  // One row and several; row lengths that are multiples of every vector width and of none; sub-warp rows.
  const std::vector<std::vector<std::int64_t>> shapes = {{1, 4096}, {7, 1000}, {3, 37}, {64, 8}, {2, 8200}};
  for (DType dtype : {DType::f16, DType::bf16, DType::f32}) {
    for (const auto& shape : shapes) {
      for (const OpCase& op : op_cases()) {
        GraphBuilder builder;
        auto x = builder.input("x", {shape, dtype});
        const ComputeGraph graph = builder.build({op.build(builder, x, dtype, shape)});
        const std::uint64_t seed = next_seed();
        const std::string what = fmt::format("{} {} [{}x{}] seed {}", op.name, dtype_name(dtype), shape[0], shape[1], seed);
        const TensorMap inputs = random_inputs(graph, seed);
        expect_outputs_match(graph, run_natively(native, stream, graph, inputs), run_reference(graph, inputs), what);
      }
    }
  }
}

// silu and gelu at their limits give what the CPU reference gives (PyTorch's f32 forms: NaN at -inf, -0
// where e^-x overflows f32, inf at inf), and within 64 f32 ulps near them: a kernel that took other
// forms there would fail the numeric gate on a NaN where the reference is finite, or the reverse.
TEST_F(NativeKernels, SiluAndGeluAtTheirLimitsMatchTheReference) {
  NativeRuntime native;
  CudaStream stream;
  const std::vector<double> points = {-HUGE_VAL, -89.0, -88.0, -10.1, -3.0, 0.0, 2.0, HUGE_VAL};
  const TensorSpec spec({1, static_cast<std::int64_t>(points.size())}, DType::f32);
  for (const std::string op : {"silu", "gelu", "gelu_tanh"}) {
    GraphBuilder builder;
    const ValueRef x = builder.input("x", spec);
    const ValueRef y = op == "silu" ? builder.silu(x, "out") : builder.gelu(x, op == "gelu" ? "none" : "tanh", "out");
    const ComputeGraph graph = builder.build({y});
    const TensorMap inputs = {{"x", HostTensor::from_values(spec, points)}};
    const HostTensor actual = run_natively(native, stream, graph, inputs).at("out");
    const HostTensor expected = run_reference(graph, inputs).at("out");
    for (std::int64_t i = 0; i < spec.element_count(); ++i) {
      const double got = actual.at(i), want = expected.at(i);
      const std::string what = fmt::format("{}({}): GPU {} reference {}", op, points[static_cast<std::size_t>(i)], got, want);
      if (std::isnan(want) || std::isinf(want) || want == 0) {
        EXPECT_TRUE(std::isnan(got) ? std::isnan(want) : got == want && std::signbit(got) == std::signbit(want)) << what;
        continue;
      }
      EXPECT_LE(std::fabs(got - want), 64 * 0x1.0p-23 * std::fabs(want) + 4 * 0x1.0p-149) << what;
    }
  }
}

// layer_norm takes its statistics in f64 as the reference does: rows whose mean is large against their
// spread (2^24 + a few ulps: centred on the f32 mean, [2^24, 2^24 + 2] gave [0, 2] for [-1, 1]; 3e37 +
// a few ulps), rows of +-3e38 (x - mean, and its square, overflowed f32), on the register path and the
// streamed one (200000 elements a row), one warp and a block a row, in f32 and bf16. Each output within
// 2^-20 (1 + |want|) of the reference in f32, 2^-7 in bf16 (one rounding of the output apart at most):
// the same arithmetic, the f64 sums in another order.
TEST_F(NativeKernels, LayerNormOfRowsFarFromZeroMatchesTheReference) {
  NativeRuntime native;
  CudaStream stream;
  const std::vector<std::vector<std::int64_t>> shapes = {{5, 2}, {4, 37}, {3, 4096}, {1, 200000}};
  for (const DType dtype : {DType::f32, DType::bf16}) {  // bf16: 8-wide vectors, the output rounded to 8 bits
    const double tolerance = dtype == DType::f32 ? 0x1.0p-20 : 0x1.0p-7;
    for (const std::vector<std::int64_t>& shape : shapes) {
      for (const double base : {16777216.0, -1073741824.0, 3e37, 3e38}) {
        const std::uint64_t seed = next_seed();
        std::mt19937_64 random(seed);
        const TensorSpec spec(shape, dtype);
        const TensorSpec row_spec({shape[1]}, dtype);
        std::vector<double> x, weight, bias;
        for (std::int64_t index = 0; index < spec.element_count(); ++index) {
          if (base == 3e38) {  // +-3e38: a mean near 0, deviations past f32's range when squared
            x.push_back(random() % 2 ? base : -base);
            continue;
          }
          auto value = static_cast<float>(base);
          for (std::uint64_t step = random() % 17; step > 0; --step) value = std::nextafter(value, HUGE_VALF);
          x.push_back(value);
        }
        std::uniform_real_distribution<double> scale(0.5, 2.0), offset(-1.0, 1.0);
        for (std::int64_t d = 0; d < shape[1]; ++d) {
          weight.push_back(static_cast<float>(scale(random)));
          bias.push_back(static_cast<float>(offset(random)));
        }
        GraphBuilder builder;
        const ValueRef out = builder.layer_norm(builder.input("x", spec), builder.input("weight", row_spec),
                                                builder.input("bias", row_spec), 1e-5, "out");
        const ComputeGraph graph = builder.build({out});
        const TensorMap inputs = {{"x", HostTensor::from_values(spec, x)},
                                  {"weight", HostTensor::from_values(row_spec, weight)},
                                  {"bias", HostTensor::from_values(row_spec, bias)}};
        const HostTensor actual = run_natively(native, stream, graph, inputs).at("out");
        const HostTensor expected = run_reference(graph, inputs).at("out");
        int reported = 0;
        for (std::int64_t i = 0; i < spec.element_count(); ++i) {
          const double got = actual.at(i), want = expected.at(i);
          if (!(std::fabs(got - want) <= tolerance * (1 + std::fabs(want))) && reported++ < 4) {
            ADD_FAILURE() << fmt::format("layer_norm {} [{}x{}] base {} seed {}: element {} (x = {}) GPU {} reference {}",
                                         dtype_name(dtype), shape[0], shape[1], base, seed, i, x[static_cast<std::size_t>(i)],
                                         got, want);
          }
        }
      }
    }
  }
}

// argmax's native kernel (one block per row) gives the reference's index exactly: ties to the lowest
// index, the first NaN above all, rows of -inf alone; Llama 3's vocabulary and lengths of no
// particular multiple, one row and several.
TEST_F(NativeKernels, ArgmaxEqualsTheReferenceExactly) {
  NativeRuntime native;
  CudaStream stream;
  const std::vector<std::vector<std::int64_t>> shapes = {{1, 128256}, {16, 128256}, {5, 37}, {3, 1}, {2, 3, 4099}};
  int trial = 0;
  for (DType dtype : {DType::f16, DType::bf16, DType::f32}) {
    for (const auto& shape : shapes) {
      ++trial;
      const std::uint64_t seed = next_seed();
      std::mt19937_64 generator(seed);
      const TensorSpec spec(shape, dtype);
      std::vector<double> values = testing::argmax_test_values(generator, static_cast<std::size_t>(spec.element_count()),
                                                               trial % 2 == 0, trial % 3 == 0);
      if (trial % 4 == 0) std::fill(values.begin(), values.begin() + shape.back(), -HUGE_VAL);
      GraphBuilder builder;
      const ComputeGraph graph = builder.build({builder.argmax(builder.input("x", spec), "next")});
      const TensorMap inputs = {{"x", HostTensor::from_values(spec, values)}};
      const HostTensor expected = run_reference(graph, inputs).at("next");
      const HostTensor actual = run_natively(native, stream, graph, inputs).at("next");
      for (std::int64_t row = 0; row < expected.element_count(); ++row) {
        EXPECT_EQ(actual.at(row), expected.at(row))
            << fmt::format("argmax {} row {} seed {}", spec.to_string(), row, seed);
      }
    }
  }
}

TEST_F(NativeKernels, MatmulsMatchTheReference) {
  NativeRuntime native;
  CudaStream stream;
  struct Case {
    std::vector<std::int64_t> a, b;
    bool transpose_right;
  };
  const std::vector<Case> cases = {
      {{1, 4096}, {4096, 512}, false},  {{37, 64}, {45, 64}, true},    {{3, 17, 96}, {96, 40}, false},
      {{2, 9, 64}, {2, 64, 33}, false}, {{2, 9, 64}, {2, 31, 64}, true}, {{128, 256}, {256, 128}, false},
  };
  for (DType dtype : {DType::f16, DType::bf16, DType::f32}) {
    for (const Case& c : cases) {
      GraphBuilder builder;
      auto a = builder.input("a", {c.a, dtype});
      auto b = builder.input("b", {c.b, dtype});
      const ComputeGraph graph = builder.build({builder.matmul(a, b, c.transpose_right, "product")});
      const std::uint64_t seed = next_seed();
      const TensorMap inputs = random_inputs(graph, seed);
      expect_outputs_match(graph, run_natively(native, stream, graph, inputs), run_reference(graph, inputs),
                           fmt::format("matmul {} {} x {} seed {}", dtype_name(dtype), c.a.size(), c.b.size(), seed));
    }
  }
}

TEST_F(NativeKernels, QuantizedMatmulsMatchTheReference) {
  NativeRuntime native;
  CudaStream stream;
  for (DType dtype : {DType::f16, DType::bf16, DType::f32}) {
    for (int bits : {4, 8}) {
      for (int group : {32, 64, 128}) {
        const std::int64_t n = 96;
        const std::int64_t k = 512;
        GraphBuilder builder;
        auto x = builder.input("x", {{3, k}, dtype});
        auto packed = builder.input("packed", {{n, k * bits / 32}, DType::u32});
        auto scales = builder.input("scales", {{n, k / group}, dtype});
        auto biases = builder.input("biases", {{n, k / group}, dtype});
        const ComputeGraph graph = builder.build({builder.quantized_matmul(x, packed, scales, biases, bits, group, "y")});
        const std::uint64_t seed = next_seed();
        const TensorMap inputs = random_inputs(graph, seed);
        const TensorMap outputs = run_natively(native, stream, graph, inputs), expected = run_reference(graph, inputs);
        const std::string what = fmt::format("quantized_matmul {} {}-bit group {} seed {}", dtype_name(dtype), bits, group, seed);
        expect_outputs_match(graph, outputs, expected, what);
        // The weights are not rounded to the activation dtype (hi and lo, generate_dequantize_kernel):
        // y differs from the f64 reference only by f32 sums, so nearly every output rounds to the same
        // value. Rounding each weight instead left about half of the bf16 outputs an ulp off.
        if (dtype != DType::f32) {
          const HostTensor& actual = outputs.at("y");
          const HostTensor& reference = expected.at("y");
          std::int64_t equal = 0;
          for (std::int64_t i = 0; i < reference.element_count(); ++i) equal += actual.at(i) == reference.at(i);
          EXPECT_GE(equal, reference.element_count() * 97 / 100)
              << what << ": " << equal << " of " << reference.element_count() << " outputs equal the reference";
        }
      }
    }
  }
}

// gelu -> matmul (cuBLASLt) -> rms_norm: the graph the capture tests replay.
ComputeGraph gelu_matmul_rms_norm() {
  GraphBuilder builder;
  auto x = builder.input("x", {{8, 1000}, DType::bf16});
  auto w = builder.input("w", {{1000, 64}, DType::bf16});
  auto weight = builder.input("weight", {{64}, DType::bf16});
  auto projected = builder.matmul(builder.gelu(x, "tanh", "activated"), w, false, "projected");
  return builder.build({builder.rms_norm(projected, weight, 1e-5, "normalized")});
}

TEST_F(NativeKernels, CudaGraphReplayGivesTheSameOutputs) {
  const ComputeGraph graph = gelu_matmul_rms_norm();
  NativeRuntime native;
  CudaStream stream;
  DeviceValues values(graph);
  const TensorMap inputs = random_inputs(graph, next_seed());
  values.upload_inputs(inputs);
  const std::vector<DeviceStep> steps = native.graph_steps(graph, values);
  run_steps(steps, stream);
  stream.synchronize();
  const TensorMap direct = values.download_outputs();
  const CudaGraph replay = CudaGraph::capture(stream, [&](const CudaStream& s) { run_steps(steps, s); });
  values.poison_computed_values();
  replay.replay(stream);
  replay.replay(stream);
  stream.synchronize();
  EXPECT_EQ(values.download_outputs(), direct) << "a replay computes exactly what the direct launches computed";
  expect_outputs_match(graph, direct, run_reference(graph, inputs), "gelu -> matmul -> rms_norm");
}

// Two users of one context, as two CudaModels in two Python threads are: one thread captures and replays graphs
// while another uploads, downloads, fills and copies buffers (run_beside_copies). Each capture forks onto a side
// stream (as the L2 weight prefetch does), runs the steps there and waits, capture open, for a round of copies: with
// a blocking capture or side stream those copies fail. Every replay must equal the direct launches' outputs and every
// copy its bytes.
TEST_F(NativeKernels, CapturesInOneThreadSurviveAnotherThreadsCopies) {
  const ComputeGraph graph = gelu_matmul_rms_norm();
  const TensorMap inputs = random_inputs(graph, next_seed());
  int captures = 0, copies_during_captures = 0;
  const std::string failure = testing_support::run_beside_copies(device(), next_seed(), [&](const auto& wait_for_copies) {
    NativeRuntime native;
    CudaStream stream;
    const CudaStream side = CudaStream::capture_only();
    CudaEvent fork, join;
    DeviceValues values(graph);
    values.upload_inputs(inputs);
    const std::vector<DeviceStep> steps = native.graph_steps(graph, values);
    run_steps(steps, stream);
    stream.synchronize();
    const TensorMap direct = values.download_outputs();
    for (; captures < 200; ++captures) {
      const CudaGraph replay = CudaGraph::capture(stream, [&](const CudaStream& s) {
        fork.record(s);
        side.wait(fork);
        wait_for_copies();
        run_steps(steps, side);
        join.record(side);
        s.wait(join);
      });
      values.poison_computed_values();
      replay.replay(stream);
      stream.synchronize();
      if (values.download_outputs() != direct) throw std::runtime_error("a replay's outputs differ from the direct launches'");
    }
  }, copies_during_captures);
  EXPECT_EQ(failure, "") << "after " << captures << " captures";
  EXPECT_EQ(captures, 200);
  EXPECT_GE(copies_during_captures, 2 * 200) << "each capture waits for a round of copies";
  std::printf("%d captures beside %d rounds of copies\n", captures, copies_during_captures);
}

TEST_F(NativeKernels, OneRuntimeBindsEachGraphsOwnBuffers) {
  // Two graphs whose nodes have the same names and therefore the same kernel source, but different
  // value ids (the second has an extra input first): a kernel shared by source must still be bound
  // to each graph's own buffers. (Regression: gating a region graph cached kernels under its ids.)
  auto build = [](bool extra_input) {
    GraphBuilder builder;
    if (extra_input) builder.input("unrelated", {{4, 96}, DType::f16});
    auto x = builder.input("x", {{4, 96}, DType::f16});
    auto y = builder.input("y", {{4, 96}, DType::f16});
    return builder.build({builder.add(x, y, "sum")});
  };
  const ComputeGraph first = build(false);
  const ComputeGraph second = build(true);
  NativeRuntime native;
  CudaStream stream;
  for (const ComputeGraph* graph : {&first, &second}) {
    const TensorMap inputs = random_inputs(*graph, next_seed());
    expect_outputs_match(*graph, run_natively(native, stream, *graph, inputs), run_reference(*graph, inputs),
                         graph == &first ? "first graph" : "second graph, same kernel source");
  }
}

TEST_F(NativeKernels, DeviceReportsItsProperties) {
  const CudaDeviceInfo& info = device().info();
  EXPECT_FALSE(info.name.empty());
  EXPECT_GT(info.multiprocessor_count, 0);
  EXPECT_GE(info.compute_capability_major, 7);
  EXPECT_GT(info.l2_cache_bytes, 0);
  EXPECT_GE(info.shared_memory_per_block_optin, 48 * 1024);
  EXPECT_GT(info.driver_version, 0);
  std::printf("device: %s, %d SMs, %s, driver %d, L2 %lld bytes, NVRTC %s\n", info.name.c_str(),
              info.multiprocessor_count, info.architecture().c_str(), info.driver_version,
              static_cast<long long>(info.l2_cache_bytes), nvrtc_version().c_str());
}

TEST_F(NativeKernels, DeviceErrorsNameTheCall) {
  DeviceBuffer small(64);
  std::vector<std::byte> too_much(128);
  try {
    small.copy_from_host(too_much);
    FAIL() << "expected a range error";
  } catch (const CudaError& error) {
    EXPECT_NE(std::string(error.what()).find("copy_from_host"), std::string::npos) << error.what();
  }
  try {
    DeviceBuffer huge(std::size_t{1} << 50);
    FAIL() << "expected an out-of-memory error";
  } catch (const CudaError& error) {
    EXPECT_NE(std::string(error.what()).find("cuMemAlloc"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace metile
