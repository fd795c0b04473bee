// The decode-step ops (embedding, quantized_embedding, position_mask,
// kv_cache_write, argmax) and rope's llama3 frequency scaling: the CPU reference against
// loops written here from the op definitions, plus the registry's shape checks.
// Fresh random inputs each run; the seed is printed (METILE_TEST_SEED repeats it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>

#include "metile/cpu_runtime.h"
#include "metile/fusion.h"
#include "metile/quant.h"
#include "metile_test_support.h"
#include "test_support.h"

namespace metile {
namespace {

using testing::brute_force_argmax;
using testing::error_of;
using testing::random_tensor;

std::uint64_t test_seed() {
  static const std::uint64_t seed = testing::test_seed("decode ops tests");
  return seed;
}

HostTensor ids_tensor(const std::vector<double>& ids) {
  return HostTensor::from_values(TensorSpec({static_cast<std::int64_t>(ids.size())}, DType::i32), ids);
}

TEST(DecodeOps, EmbeddingGathersRowsBitForBit) {
  std::mt19937_64 generator(test_seed());
  const HostTensor table = random_tensor(TensorSpec({11, 6}, DType::bf16), generator());
  std::vector<double> ids;
  for (int step = 0; step < 5; ++step) ids.push_back(static_cast<double>(generator() % 11));
  GraphBuilder builder;
  const ValueRef out = builder.embedding(builder.input("ids", TensorSpec({5}, DType::i32)),
                                         builder.input("table", table.spec()), "out");
  const HostTensor result = run_reference(builder.build({out}), {{"ids", ids_tensor(ids)}, {"table", table}}).at("out");
  ASSERT_EQ(result.spec(), TensorSpec({5, 6}, DType::bf16));
  for (std::int64_t step = 0; step < 5; ++step) {
    for (std::int64_t column = 0; column < 6; ++column) {
      EXPECT_EQ(result.at(step * 6 + column), table.at(static_cast<std::int64_t>(ids[step]) * 6 + column));
    }
  }
  EXPECT_NE(error_of([&] {
              run_reference(builder.build({out}), {{"ids", ids_tensor({0, 1, 11, 2, 3})}, {"table", table}});
            }).find("token id 11 at index 2 is outside [0, 11)"),
            std::string::npos);
}

TEST(DecodeOps, QuantizedEmbeddingEqualsTheDequantizedTableRounded) {
  std::mt19937_64 generator(test_seed() + 1);
  for (int bits : {4, 8}) {
    const HostTensor dense = random_tensor(TensorSpec({9, 64}, DType::f32), generator());
    const QuantizedMatrix matrix = quantize_affine(dense, {bits, 32}, DType::bf16);
    const HostTensor table = dequantize_affine(matrix, DType::bf16);
    GraphBuilder builder;
    const ValueRef out = builder.quantized_embedding(
        builder.input("ids", TensorSpec({3}, DType::i32)), builder.input("packed", matrix.packed.spec()),
        builder.input("scales", matrix.scales.spec()), builder.input("biases", matrix.biases.spec()), bits, 32, "out");
    const std::vector<double> ids{8, 0, 8};
    const HostTensor result =
        run_reference(builder.build({out}), {{"ids", ids_tensor(ids)},
                                             {"packed", matrix.packed},
                                             {"scales", matrix.scales},
                                             {"biases", matrix.biases}})
            .at("out");
    ASSERT_EQ(result.spec(), TensorSpec({3, 64}, DType::bf16));
    for (std::int64_t step = 0; step < 3; ++step) {
      for (std::int64_t column = 0; column < 64; ++column) {
        EXPECT_EQ(result.at(step * 64 + column), table.at(static_cast<std::int64_t>(ids[step]) * 64 + column));
      }
    }
  }
}

TEST(DecodeOps, PositionMaskHidesKeysPastEachRowsPosition) {
  std::mt19937_64 generator(test_seed() + 2);
  const std::int64_t heads = 2, steps = 3, group = 2, keys = 7;
  const HostTensor x = random_tensor(TensorSpec({heads, group * steps, keys}, DType::f32), generator());
  const std::vector<double> positions{static_cast<double>(generator() % 5), 5, 6};
  GraphBuilder builder;
  const ValueRef out = builder.position_mask(builder.input("x", x.spec()),
                                             builder.input("positions", TensorSpec({steps}, DType::i32)), "out");
  const HostTensor result =
      run_reference(builder.build({out}), {{"x", x}, {"positions", ids_tensor(positions)}}).at("out");
  for (std::int64_t index = 0; index < x.element_count(); ++index) {
    const std::int64_t key = index % keys;
    const std::int64_t row = index / keys % (group * steps);
    const bool visible = key <= positions[static_cast<std::size_t>(row % steps)];
    if (visible) {
      EXPECT_EQ(result.at(index), x.at(index));
    } else {
      EXPECT_EQ(result.at(index), -std::numeric_limits<double>::infinity());
    }
  }
  GraphBuilder bad;
  EXPECT_EQ(error_of([&] {
              bad.position_mask(bad.input("x", TensorSpec({2, 5, 7}, DType::f32)),
                                bad.input("positions", TensorSpec({3}, DType::i32)), "m");
            }),
            "node 'm' (position_mask): positions i32[3] must be i32[S] with the 5 rows of x a multiple of S");
}

TEST(DecodeOps, KvCacheWriteReplacesTheRowsAtThePositions) {
  std::mt19937_64 generator(test_seed() + 3);
  const std::int64_t heads = 2, capacity = 6, steps = 2, width = 4;
  const HostTensor cache = random_tensor(TensorSpec({heads, capacity, width}, DType::bf16), generator());
  const HostTensor update = random_tensor(TensorSpec({heads, steps, width}, DType::bf16), generator());
  const std::vector<double> positions{static_cast<double>(generator() % 3), 4};
  GraphBuilder builder;
  const ValueRef out = builder.kv_cache_write(builder.input("cache", cache.spec()), builder.input("update", update.spec()),
                                              builder.input("positions", TensorSpec({steps}, DType::i32)), "out");
  const ComputeGraph graph = builder.build({out});
  const HostTensor result =
      run_reference(graph, {{"cache", cache}, {"update", update}, {"positions", ids_tensor(positions)}}).at("out");
  for (std::int64_t head = 0; head < heads; ++head) {
    for (std::int64_t row = 0; row < capacity; ++row) {
      std::int64_t written = -1;
      for (std::int64_t step = 0; step < steps; ++step) {
        if (positions[static_cast<std::size_t>(step)] == row) written = step;
      }
      for (std::int64_t column = 0; column < width; ++column) {
        const double expected = written >= 0 ? update.at((head * steps + written) * width + column)
                                             : cache.at((head * capacity + row) * width + column);
        EXPECT_EQ(result.at((head * capacity + row) * width + column), expected);
      }
    }
  }
  EXPECT_NE(error_of([&] {
              run_reference(graph, {{"cache", cache}, {"update", update}, {"positions", ids_tensor({0, 6})}});
            }).find("position 6 at index 1 is outside [0, 6)"),
            std::string::npos);
  GraphBuilder bad;
  EXPECT_EQ(error_of([&] {
              bad.kv_cache_write(bad.input("cache", TensorSpec({2, 6, 4}, DType::f32)),
                                 bad.input("update", TensorSpec({2, 3, 4}, DType::f32)),
                                 bad.input("positions", TensorSpec({2}, DType::i32)), "w");
            }),
            "node 'w' (kv_cache_write): update f32[2, 3, 4] must be [2, 2, 4] (the cache's heads and row length, one "
            "row per position)");
}

// A cache handed over to the executor (run_reference / run_plan_reference with `owned` inputs)
// is written in place where kv_cache_write is its last reader: the output is the same buffer, with
// the same bytes as the borrowing form's copy. Where another node reads the cache after the write,
// that node still sees the cache as it was.
TEST(DecodeOps, KvCacheWriteOnAHandedOverCacheWritesItInPlace) {
  std::mt19937_64 generator(test_seed() + 5);
  const std::int64_t heads = 2, capacity = 9, steps = 3, width = 8;
  const HostTensor cache = random_tensor(TensorSpec({heads, capacity, width}, DType::bf16), generator());
  const HostTensor update = random_tensor(TensorSpec({heads, steps, width}, DType::bf16), generator());
  const HostTensor positions =
      ids_tensor({static_cast<double>(generator() % 3), static_cast<double>(3 + generator() % 3), 8});
  GraphBuilder builder;
  const ValueRef cache_in = builder.input("cache", cache.spec());
  const ValueRef out = builder.kv_cache_write(cache_in, builder.input("update", update.spec()),
                                              builder.input("positions", positions.spec()), "out");
  const ComputeGraph graph = builder.build({out});
  const TensorMap borrowed = {{"update", update}, {"positions", positions}};
  const TensorMap* maps[] = {&borrowed};
  const HostTensor expected = run_reference(graph, {{"cache", cache}, {"update", update}, {"positions", positions}}).at("out");
  const FusionPlan plan = plan_graph_fusion(graph, FusionTarget::cpu());
  for (const bool planned : {false, true}) {
    SCOPED_TRACE(planned ? "run_plan_reference" : "run_reference");
    TensorMap owned = {{"cache", cache}};
    const std::byte* buffer = owned.at("cache").bytes().data();
    const TensorMap outputs = planned ? run_plan_reference(plan, std::move(owned), maps) : run_reference(graph, std::move(owned), maps);
    EXPECT_EQ(outputs.at("out").bytes().data(), buffer) << "the handed-over cache was copied";
    EXPECT_TRUE(std::equal(outputs.at("out").bytes().begin(), outputs.at("out").bytes().end(), expected.bytes().begin()));
    // A position outside the cache: an error before any row is written.
    EXPECT_NE(error_of([&] {
                const TensorMap bad = {{"update", update}, {"positions", ids_tensor({0, 1, 9})}};
                const TensorMap* bad_maps[] = {&bad};
                planned ? run_plan_reference(plan, {{"cache", cache}}, bad_maps) : run_reference(graph, {{"cache", cache}}, bad_maps);
              }).find("position 9 at index 2 is outside [0, 9)"),
              std::string::npos);
  }

  // The cache also read by a node that runs after the write (as a second output): no write in place.
  GraphBuilder shared;
  const ValueRef shared_cache = shared.input("cache", cache.spec());
  const ValueRef written = shared.kv_cache_write(shared_cache, shared.input("update", update.spec()),
                                                 shared.input("positions", positions.spec()), "out");
  const ValueRef doubled = shared.add(shared_cache, shared_cache, "doubled");
  const ComputeGraph both = shared.build({written, doubled});
  TensorMap owned = {{"cache", cache}};
  const TensorMap outputs = run_reference(both, std::move(owned), maps);
  EXPECT_TRUE(std::equal(outputs.at("out").bytes().begin(), outputs.at("out").bytes().end(), expected.bytes().begin()));
  for (std::int64_t index = 0; index < cache.element_count(); ++index) {
    ASSERT_EQ(outputs.at("doubled").at(index), round_to_dtype(static_cast<float>(2 * cache.at(index)), DType::bf16)) << index;
  }
}

// transformers' _compute_llama3_parameters, written out again here in long double.
long double llama3_frequency(long double frequency, long double factor, long double low, long double high,
                             long double context) {
  const long double wavelength = 2 * 3.14159265358979323846L / frequency;
  const long double scaled = wavelength > context / low ? frequency / factor : frequency;
  const long double smooth = (context / wavelength - low) / (high - low);
  const long double smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
  const bool medium = !(wavelength < context / high) && !(wavelength > context / low);
  return medium ? smoothed : scaled;
}

TEST(DecodeOps, RopeLlama3ScalingMatchesTransformersFormula) {
  std::mt19937_64 generator(test_seed() + 4);
  const std::int64_t steps = 4, dims = 32;
  const double theta = 500000, factor = 8, low = 1, high = 4, context = 64;  // short context: all three bands occur
  const HostTensor x = random_tensor(TensorSpec({2, steps, dims}, DType::f32), generator());
  std::vector<double> positions;
  for (int step = 0; step < steps; ++step) positions.push_back(static_cast<double>(generator() % 1000));
  GraphBuilder builder;
  Attributes attributes;
  attributes.set("theta", theta);
  attributes.set("dims", dims);
  attributes.set("scaling", std::string("llama3"));
  attributes.set("factor", factor);
  attributes.set("low_freq_factor", low);
  attributes.set("high_freq_factor", high);
  attributes.set("original_max_position_embeddings", context);
  const ValueRef out = builder.add_node("rope", {builder.input("x", x.spec()),
                                                 builder.input("positions", TensorSpec({steps}, DType::i32))},
                                        attributes, "out").front();
  const HostTensor result = run_reference(builder.build({out}), {{"x", x}, {"positions", ids_tensor(positions)}}).at("out");
  int bands[3] = {0, 0, 0};
  for (std::int64_t row = 0; row < 2 * steps; ++row) {
    const long double position = positions[static_cast<std::size_t>(row % steps)];
    for (std::int64_t pair = 0; pair < dims / 2; ++pair) {
      const long double base = std::pow(static_cast<long double>(theta), -2.0L * pair / dims);
      const long double frequency = llama3_frequency(base, factor, low, high, context);
      const long double wavelength = 2 * 3.14159265358979323846L / base;
      ++bands[wavelength < context / high ? 0 : wavelength > context / low ? 2 : 1];
      const long double angle = position * frequency;
      const long double a = x.at(row * dims + pair), b = x.at(row * dims + pair + dims / 2);
      EXPECT_NEAR(result.at(row * dims + pair), static_cast<double>(a * std::cos(angle) - b * std::sin(angle)), 2e-5);
      EXPECT_NEAR(result.at(row * dims + pair + dims / 2), static_cast<double>(a * std::sin(angle) + b * std::cos(angle)),
                  2e-5);
    }
  }
  EXPECT_GT(bands[0], 0);
  EXPECT_GT(bands[1], 0);
  EXPECT_GT(bands[2], 0);
  GraphBuilder bad;
  Attributes wrong;
  wrong.set("scaling", std::string("yarn"));
  EXPECT_EQ(error_of([&] {
              bad.add_node("rope", {bad.input("x", x.spec()), bad.input("positions", TensorSpec({steps}, DType::i32))},
                           wrong, "r");
            }),
            "node 'r' (rope): scaling must be 'llama3', got 'yarn'");
  // A factor that divides the low frequencies past f32: every angle was inf, every logit NaN.
  Attributes tiny;
  for (const auto& [name, value] : std::initializer_list<std::pair<const char*, double>>{
           {"factor", 5e-324}, {"low_freq_factor", 1000.0}, {"high_freq_factor", 2000.0}, {"original_max_position_embeddings", 64.0}}) {
    tiny.set(name, value);
  }
  tiny.set("scaling", std::string("llama3"));
  EXPECT_EQ(error_of([&] {
              bad.add_node("rope", {bad.input("x2", x.spec()), bad.input("positions2", TensorSpec({steps}, DType::i32))},
                           tiny, "tiny");
            }),
            "node 'tiny' (rope): factor 4.94066e-324 is too small: frequencies divided by it reach inf, past 1.58456e+29, "
            "where an i32 position's angle would leave f32");
  // A theta below 1 makes the high pairs' frequencies theta^(-2i/dims) large: a subnormal one put them past f32.
  Attributes small_theta;
  small_theta.set("theta", 5e-324);
  const std::string theta_error = error_of([&] {
    bad.add_node("rope", {bad.input("x3", x.spec()), bad.input("positions3", TensorSpec({steps}, DType::i32))},
                 small_theta, "theta");
  });
  EXPECT_TRUE(theta_error.starts_with("node 'theta' (rope): theta 4.94066e-324 is too small: its largest frequency theta^(-" +
                                      std::to_string(x.spec().row_length() - 2) + "/" +
                                      std::to_string(x.spec().row_length()) + ") is "))
      << theta_error;
  EXPECT_TRUE(theta_error.ends_with(", past 1.58456e+29, where an i32 position's angle would leave f32")) << theta_error;
  small_theta.set("theta", 0.5);  // below 1 and well inside the range: accepted
  EXPECT_NO_THROW(bad.add_node("rope", {bad.input("x4", x.spec()), bad.input("positions4", TensorSpec({steps}, DType::i32))},
                               small_theta, "half"));
}

TEST(DecodeOps, ArgmaxIsTheFirstLargestIndexOfEveryRowWithNaNAboveAll) {
  std::mt19937_64 generator(test_seed() + 5);
  const double infinity = std::numeric_limits<double>::infinity();
  const std::int64_t lengths[] = {1, 2, 3, 31, 97, 1000, 4099};
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16};
  int nan_rows = 0, tied_rows = 0, all_negative_infinity_rows = 0;
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<std::int64_t> shape;
    for (std::uint64_t axis = generator() % 3; axis > 0; --axis) shape.push_back(1 + static_cast<std::int64_t>(generator() % 4));
    const std::int64_t length = lengths[generator() % std::size(lengths)];
    shape.push_back(length);
    const TensorSpec spec(shape, dtypes[generator() % std::size(dtypes)]);
    SCOPED_TRACE(spec.to_string());
    // Half the trials draw from five values (ties everywhere), the rest from a continuum; some add
    // NaNs; every fifth trial's first row is all -inf.
    std::vector<double> values = testing::argmax_test_values(generator, static_cast<std::size_t>(spec.element_count()),
                                                             trial % 2 == 0, trial % 3 == 0);
    if (trial % 5 == 0) std::fill(values.begin(), values.begin() + length, -infinity);
    // A NaN trial's last row holds at least one NaN: at 0.5% of the elements, short rows drew none
    // in any trial for one seed in a thousand (METILE_TEST_SEED=682).
    if (trial % 3 == 0) values[values.size() - 1 - generator() % static_cast<std::uint64_t>(length)] = std::nan("");
    const HostTensor x = HostTensor::from_values(spec, values);
    GraphBuilder builder;
    const ValueRef out = builder.argmax(builder.input("x", spec), "out");
    const HostTensor result = run_reference(builder.build({out}), {{"x", x}}).at("out");
    std::vector<std::int64_t> expected_shape = shape;
    expected_shape.pop_back();
    ASSERT_EQ(result.spec(), TensorSpec(expected_shape, DType::i32));
    for (std::int64_t row = 0; row < result.element_count(); ++row) {
      std::vector<double> row_values;
      std::vector<float> row_floats;
      for (std::int64_t column = 0; column < length; ++column) {
        row_values.push_back(x.at(row * length + column));  // as stored in the dtype
        row_floats.push_back(static_cast<float>(row_values.back()));
      }
      const std::int64_t expected = brute_force_argmax(row_values);
      EXPECT_EQ(result.at(row), static_cast<double>(expected)) << "row " << row;
      EXPECT_EQ(argmax_index(row_floats), expected) << "row " << row;  // the host's greedy pick
      nan_rows += std::any_of(row_values.begin(), row_values.end(), [](double v) { return std::isnan(v); }) ? 1 : 0;
      tied_rows += std::count(row_values.begin(), row_values.end(), row_values[static_cast<std::size_t>(expected)]) > 1;
      all_negative_infinity_rows += std::all_of(row_values.begin(), row_values.end(), [&](double v) { return v == -infinity; });
    }
  }
  EXPECT_GT(nan_rows, 0);
  EXPECT_GT(tied_rows, 0);
  EXPECT_GT(all_negative_infinity_rows, 0);

  GraphBuilder bad;
  EXPECT_EQ(error_of([&] { bad.argmax(bad.input("ids", TensorSpec({4}, DType::i32)), "a"); }),
            "node 'a' (argmax): x i32[4] must have a floating dtype (f16, bf16 or f32)");
  EXPECT_EQ(error_of([&] { bad.argmax(bad.input("scalar", TensorSpec({}, DType::f32)), "b"); }),
            "node 'b' (argmax): x f32[] must have rank 1 or more");
}

}  // namespace
}  // namespace metile
