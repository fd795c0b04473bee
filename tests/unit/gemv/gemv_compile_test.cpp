// Every GEMV kernel the decode MLP can generate compiles with NVRTC for sm_90 (no GPU needed),
// and the ones the executor tunes first keep their accumulators and loads in registers: ptxas
// reports no stack frame and no spills. Also checks the generator's launch shape and rejects
// configurations it cannot build.
#include <gtest/gtest.h>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <regex>
#include <set>
#include <tuple>

#include "metile/cuda_runtime.h"
#include "metile/dispatch.h"
#include "metile/gemv.h"
#include "gemv_test_support.h"
#include "ptxas_report.h"

namespace metile {
namespace {

using gemv_testing::gemv_config;

struct Compiled {
  std::string log;
  CompiledProgram program;
};

Compiled compile_for_sm90(const GemvKernelSource& kernel) {
  Compiled compiled;
  compiled.program = testing::compile_for_sm90_with_ptxas_report(kernel.source, kernel.kernel_name);
  compiled.log = compiled.program.log;
  // Generated code compiles cleanly: NVRTC's front end warned on constants a variant leaves unused.
  EXPECT_EQ(compiled.log.find("warning"), std::string::npos) << kernel.kernel_name << ":\n" << compiled.log;
  return compiled;
}

// The ptxas bounds (tests/support/ptxas_report.h). An example of the 48-byte frame: f16 affine8 g128
// gate/up, N = 2000, K = 1024, 4 warps double-buffered with two prefetch rounds parks 4 bytes to stay at
// 128 registers (four blocks an SM) beside the L2 prefetch's 32-byte table of matrix pointers.
using testing::expect_no_spills;
using testing::registers_used;

std::vector<GemvWeightFormat> all_formats() {
  std::vector<GemvWeightFormat> formats;
  for (DType dtype : {DType::bf16, DType::f16}) {
    formats.push_back(GemvWeightFormat::dense(dtype));
    for (int bits : {4, 8}) {
      for (int group : {32, 64, 128}) formats.push_back(GemvWeightFormat::affine(bits, group, dtype));
    }
  }
  return formats;
}

TEST(GemvCompile, EveryFormatAndEpilogueCompilesForSm90) {
  // Shapes that are not multiples of the tile (N) or of the load block (K); M on both sides of 8.
  int compiled = 0;
  for (const GemvWeightFormat& format : all_formats()) {
    const std::int64_t k = format.is_affine() ? format.group_size * 5 : 200;
    struct Case {
      std::int64_t rows;
      GemvEpilogue epilogue;
      GatedSchedule schedule;
    };
    // Two cases per format, alternating, so every case meets both dtypes and all bit widths.
    const std::vector<Case> all_cases = {
        {1, GemvEpilogue::store(), GatedSchedule::register_resident},
        {16, GemvEpilogue::swiglu(), GatedSchedule::register_resident},
        {5, GemvEpilogue::swiglu(), GatedSchedule::scratch_spilled},
        {9, GemvEpilogue::residual_add(), GatedSchedule::register_resident},
    };
    const std::size_t first_case = static_cast<std::size_t>(compiled / 2) % 2;
    for (std::size_t index = first_case; index < all_cases.size(); index += 2) {
      const Case& c = all_cases[index];
      GemvKernelConfig config = gemv_config(format, c.rows, 100, k, c.epilogue);
      config.schedule = c.schedule;
      const GemvKernelSource kernel = generate_gemv_kernel(config);
      EXPECT_EQ(kernel.block_threads, 128u);
      EXPECT_EQ(kernel.grid_blocks, 7u);  // ceil(100 / 16) tiles, one per block
      try {
        const Compiled result = compile_for_sm90(kernel);
        EXPECT_FALSE(result.program.cubin.empty()) << config.to_string();
        ++compiled;
      } catch (const CudaError& error) {
        ADD_FAILURE() << config.to_string() << "\n" << error.what();
      }
    }
  }
  EXPECT_EQ(compiled, 2 * 14);
}

// Under programmatic dependent launch a GEMV may read only its weights before griddepcontrol.wait.
// Its epilogue tensors (the residual of the o- and down projections) are written by a kernel two
// launches back: in session 15 ptxas hoisted the residual's 16-bit load above the wait in the
// w8 f1/f2 db shapes (the Llama-3-8B-sized and the tiny models' down projections), and a decode
// step could add the previous token's residual. Read from the sm_90 code: before the first
// griddepcontrol.wait (opcode 0x82e) no global load (LDG, base 0x181) narrower than the weights'
// 128 bits (width field, bits 9..11 of the high word: 6).
TEST(GemvCompile, NoEpilogueLoadIsScheduledBeforeTheWaitForThePreviousKernel) {
  constexpr unsigned kGridDependencyWait = 0x82E, kGlobalLoad = 0x181, kWidth128 = 6;
  int kernels = 0;
  for (const auto& [rows, n, k] : {std::tuple{1, 64, 128}, std::tuple{1, 4096, 4096}, std::tuple{16, 64, 128}}) {
    for (int warps : {4, 8, 16}) {
      for (int in_flight : {1, 2}) {
        GemvKernelConfig config;
        config.format = GemvWeightFormat::dense(DType::bf16);
        config.rows = rows, config.out_features = n, config.in_features = k;
        config.epilogue = GemvEpilogue::residual_add("residual", DType::bf16);
        config.warps_per_block = warps, config.iterations_in_flight = in_flight, config.double_buffered = true;
        const GemvKernelSource kernel = generate_gemv_kernel(config);
        CompileOptions options;
        options.architecture = "sm_90";
        const std::vector<CubinInstruction> text =
            cubin_kernel_instructions(compile_cuda_program(kernel.source, kernel.kernel_name, options).cubin, kernel.kernel_name);
        const auto wait = std::find_if(text.begin(), text.end(), [&](const CubinInstruction& i) { return i.opcode() == kGridDependencyWait; });
        ASSERT_NE(wait, text.end()) << config.to_string();
        for (auto i = text.begin(); i != wait; ++i) {
          EXPECT_FALSE(i->base() == kGlobalLoad && ((i->high >> 9) & 7u) != kWidth128)
              << config.to_string() << ": a narrow global load at instruction " << (i - text.begin())
              << ", before the wait at " << (wait - text.begin());
        }
        ++kernels;
      }
    }
  }
  EXPECT_EQ(kernels, 18);
}

TEST(GemvCompile, OtherEpiloguesCompileOnTheSameMainloop) {
  const GemvEpilogue bias_gelu = GemvEpilogue::gelu(
      GemvEpilogue::add(GemvEpilogue::accumulator(0), GemvEpilogue::tensor("bias", true)), false);
  const GemvEpilogue scaled_exp = GemvEpilogue::exp(GemvEpilogue::scale(GemvEpilogue::accumulator(0), -0.125));
  const GemvEpilogue gated_difference = GemvEpilogue::subtract(
      GemvEpilogue::multiply(GemvEpilogue::gelu(GemvEpilogue::accumulator(0), true), GemvEpilogue::accumulator(1)),
      GemvEpilogue::tensor("residual"));
  for (const GemvEpilogue& epilogue : {bias_gelu, scaled_exp, gated_difference}) {
    const GemvKernelConfig config = gemv_config(GemvWeightFormat::affine(4, 64, DType::f16), 3, 48, 256, epilogue);
    const GemvKernelSource kernel = generate_gemv_kernel(config);
    EXPECT_NO_THROW(compile_for_sm90(kernel)) << config.to_string();
  }
}

TEST(GemvCompile, TunedShapesOfTheDecodeMlpKeepTheirBatchesInRegisters) {
  // The Llama-3-8B stages at one and sixteen rows: every tuning candidate of both gate/up
  // schedules and of the down projection.
  int checked = 0;
  for (const GemvWeightFormat& format : {GemvWeightFormat::dense(DType::bf16), GemvWeightFormat::affine(4, 64, DType::bf16)}) {
    for (std::int64_t rows : {1, 16}) {
      std::vector<GemvKernelConfig> configs;
      for (GatedSchedule schedule : {GatedSchedule::register_resident, GatedSchedule::scratch_spilled}) {
        GemvKernelConfig gate_up = gemv_config(format, rows, 14336, 4096, GemvEpilogue::swiglu());
        gate_up.schedule = schedule;
        for (const GemvKernelConfig& candidate : gemv_tuning_candidates(gate_up)) configs.push_back(candidate);
      }
      for (const GemvKernelConfig& candidate :
           gemv_tuning_candidates(gemv_config(format, rows, 4096, 14336, GemvEpilogue::residual_add()))) {
        configs.push_back(candidate);
      }
      for (const GemvKernelConfig& config : configs) {
        if (config.k_splits > 1 || config.shared_stages >= 2 || config.shared_group_sums) continue;  // tested below
        expect_no_spills(compile_for_sm90(generate_gemv_kernel(config)).log, config.to_string());
        ++checked;
      }
    }
  }
  EXPECT_GE(checked, 2 * 2 * 12);  // every register candidate of three stages, two formats, two row counts
}

// L2 prefetch (l2_prefetch_rounds): a kernel whose weights fit the budget requests every round of
// its block's share at once; a wider one only as many rounds as keep the resident blocks within
// it, at least one; the prefetching twins of the lowered shapes compile for sm_90 in every
// schedule (double-buffered, one batch at a time, staged, split-K, tile loop) without spilling (the
// register shapes), and their source asks for the prefetch depth.
TEST(GemvCompile, L2PrefetchDepthAndKernelsCompile) {
  const GemvWeightFormat int4 = GemvWeightFormat::affine(4, 64, DType::bf16);
  // Llama-3.2-1B gate/up (2 x 8192 x 2048 4-bit: 18.9 MB with scales) fits 24 MiB: every round.
  GemvKernelConfig small = gemv_config(int4, 1, 8192, 2048, GemvEpilogue::swiglu());
  small.warps_per_block = 4;
  small.iterations_in_flight = 1;
  const int small_rounds = (2048 / 128 + 3) / 4;
  EXPECT_EQ(gemv_l2_prefetch_rounds(small), small_rounds);
  // Llama-3-8B gate/up (66 MB) does not: a bounded depth, at least one, below the block's rounds.
  GemvKernelConfig wide = gemv_config(int4, 1, 14336, 4096, GemvEpilogue::swiglu());
  wide.warps_per_block = 2;
  wide.iterations_in_flight = 1;
  const int wide_rounds = gemv_l2_prefetch_rounds(wide);
  EXPECT_GE(wide_rounds, 1);
  EXPECT_LT(wide_rounds, 4096 / 128 / 2);
  // A budget of one byte still prefetches one round; a huge one takes every round.
  EXPECT_EQ(gemv_l2_prefetch_rounds(wide, 132, 1), 1);
  EXPECT_EQ(gemv_l2_prefetch_rounds(wide, 132, std::int64_t{1} << 40), 4096 / 128 / 2);
  // A K past 1024 rounds a warp (2^20 columns of bf16 at 16 rows: 1536 rounds) takes the most a config
  // allows, whether its weights fit the budget or not (it threw at lowering, "must be 0..1024, not 1536").
  GemvKernelConfig deep = gemv_config(GemvWeightFormat::dense(DType::bf16), 1, 16, std::int64_t{1} << 20, GemvEpilogue::store());
  deep.warps_per_block = 4;
  deep.iterations_in_flight = 1;
  for (const std::int64_t budget : {std::int64_t{1} << 40, std::int64_t{1} << 20}) {
    GemvKernelConfig prefetching = deep;
    prefetching.l2_prefetch_rounds = gemv_l2_prefetch_rounds(deep, 132, budget);
    EXPECT_LE(prefetching.l2_prefetch_rounds, 1024) << budget;
    EXPECT_NO_THROW(prefetching.validate()) << budget;
  }

  int checked = 0;
  for (const GemvWeightFormat& format : {GemvWeightFormat::dense(DType::bf16), int4, GemvWeightFormat::affine(8, 128, DType::f16)}) {
    // The last one is the LM head's width, whose candidates loop over tile blocks.
    for (GemvKernelConfig config : {gemv_config(format, 1, 2000, 1024, GemvEpilogue::swiglu()),
                                    gemv_config(format, 16, 300, 2048, GemvEpilogue::residual_add()),
                                    gemv_config(format, 1, 128256, 2048, GemvEpilogue::store())}) {
      if (config.out_features > 100000 && format != int4) continue;
      for (const GemvKernelConfig& shape : gemv_tuning_candidates(config)) {
        GemvKernelConfig prefetching = shape;
        prefetching.l2_prefetch_rounds = gemv_l2_prefetch_rounds(shape);
        const GemvKernelSource plain = generate_gemv_kernel(shape), fetched = generate_gemv_kernel(prefetching);
        EXPECT_EQ(plain.source.find("kPrefetchRounds = 0;") != std::string::npos, true);
        EXPECT_NE(fetched.source.find(fmt::format("kPrefetchRounds = {};", prefetching.l2_prefetch_rounds)), std::string::npos);
        EXPECT_NE(plain.kernel_name, fetched.kernel_name);
        if (shape.k_splits == 1 && shape.shared_stages == 0) {
          expect_no_spills(compile_for_sm90(fetched).log, prefetching.to_string());
        } else {
          compile_for_sm90(fetched);  // split-K and staged shapes: compiling is the check
        }
        ++checked;
      }
    }
  }
  EXPECT_GE(checked, 3 * 2 * 5);
  GemvKernelConfig bad = small;
  bad.l2_prefetch_rounds = -1;
  EXPECT_THROW(bad.validate(), InputError);
}

// The LM head (Llama-3.2-1B: 128256 rows of 2048, 4-bit, the final norm in its prologue, the argmax
// join): the tuner adds blocks of 2 and 4 tiles for a vocabulary-wide N, looped over the tile
// blocks (one and two tiles a block) or not, and every register candidate compiles without spills.
// Narrower N and SwiGLU stages get one tile per block (two tiles a block lost every race of the
// 4-bit gate/up at M = 16: notes/mlp_decode.md, session 24).
TEST(GemvCompile, LmHeadGetsMultiTileBlocksWithoutSpills) {
  GemvKernelConfig head = gemv_config(GemvWeightFormat::affine(4, 64, DType::bf16), 1, 128256, 2048, GemvEpilogue::store());
  head.argmax_rows = true;
  head.x_rms_norm_eps = 1e-5;
  int multi_tile = 0, looped = 0;
  for (const GemvKernelConfig& config : gemv_tuning_candidates(head, 132)) {
    if (config.tiles_per_block > 1) ++multi_tile;
    const GemvKernelSource kernel = generate_gemv_kernel(config);
    if (config.tile_loop_blocks_per_multiprocessor > 0) {
      ++looped;  // blocks that loop over the 8016 tile blocks: as many as fit at once
      EXPECT_EQ(kernel.grid_blocks, static_cast<unsigned>(132 * config.tile_loop_blocks_per_multiprocessor)) << config.to_string();
      EXPECT_NE(kernel.source.find("constexpr bool kTileLoop = true;"), std::string::npos);
      // ptxas may give the loop more registers than its blocks an SM allow (the 4-warp shape at K =
      // 2048 took 136 before the batches were carried across tiles, 105 after; the 2-warp one 104,
      // then 134): the grid is cut to what stays resident when it is loaded, the winners read by it.
      EXPECT_TRUE(kernel.grid_shrinks_to_resident) << config.to_string();
      EXPECT_NE(kernel.source.find("b < (int)gridDim.x"), std::string::npos) << config.to_string();
    } else {
      EXPECT_FALSE(kernel.grid_shrinks_to_resident) << config.to_string();
      EXPECT_EQ(kernel.grid_blocks, static_cast<unsigned>((8016 + config.tiles_per_block - 1) / config.tiles_per_block))
          << config.to_string();
    }
    if (config.shared_stages >= 2 || config.shared_group_sums) continue;
    expect_no_spills(compile_for_sm90(kernel).log, config.to_string());
  }
  EXPECT_EQ(multi_tile, 6);
  EXPECT_EQ(looped, 5);
  // Qwen2.5-1.5B's head (K = 1536), whose M = 1 race the two-tile loop won on the H200 (session 36), and
  // the four-tile loop, which won both heads' M = 16 races (session 45): the first four register shapes,
  // the ones a one-stage region races, are the four loops, not the unlooped two-warp shape.
  GemvKernelConfig qwen_head = head;
  qwen_head.out_features = 151936;
  qwen_head.in_features = 1536;
  for (std::int64_t rows : {1, 16}) {
    qwen_head.rows = rows;
    std::vector<std::string> raced;
    for (const GemvKernelConfig& config : gemv_tuning_candidates(qwen_head, 132)) {
      if (config.mainloop == GemvMainloop::register_batches && raced.size() < gemv_lowering_shapes_per_family_one_stage) {
        raced.push_back(config.to_string());
      }
    }
    for (const std::string loop : {"tiles=2 in_flight=1 double_buffered argmax_rows tile_loop=132x4",
                                   "tiles=4 in_flight=1 double_buffered argmax_rows tile_loop=132x3"}) {
      EXPECT_TRUE(std::any_of(raced.begin(), raced.end(), [&](const std::string& shape) { return shape.ends_with(loop); }))
          << loop << " at M = " << rows << " among\n" << fmt::format("{}", fmt::join(raced, "\n"));
    }
    EXPECT_TRUE(std::all_of(raced.begin(), raced.end(), [](const std::string& shape) { return shape.find("tile_loop") != std::string::npos; }))
        << fmt::format("{}", fmt::join(raced, "\n"));
  }
  // The loop never takes more blocks than there are tile blocks, and refuses split-K.
  GemvKernelConfig narrow = head;
  narrow.out_features = 1000;  // 63 tiles
  narrow.tile_loop_blocks_per_multiprocessor = 8;
  EXPECT_EQ(generate_gemv_kernel(narrow).grid_blocks, 63u);
  narrow.argmax_rows = false;
  narrow.k_splits = 2;
  EXPECT_THROW(narrow.validate(), InputError);
  for (std::int64_t rows : {1, 16}) {
    for (const GemvKernelConfig& config :
         gemv_tuning_candidates(gemv_config(GemvWeightFormat::affine(4, 64, DType::bf16), rows, 14336, 4096, GemvEpilogue::swiglu()), 132)) {
      EXPECT_EQ(config.tiles_per_block, 1) << config.to_string();
    }
  }
  for (const GemvKernelConfig& config :
       gemv_tuning_candidates(gemv_config(GemvWeightFormat::affine(4, 64, DType::bf16), 1, 3072, 2048, GemvEpilogue::store()), 132)) {
    EXPECT_EQ(config.tiles_per_block, 1) << config.to_string();
  }
}

// Above 8 rows the affine gate/up also races 4 warps held to four blocks an SM, with one and with two iterations in
// flight (the M > 8 register shapes otherwise keep one iteration in flight at 106-164 registers: notes/mlp_decode.md,
// sessions 24-25): both present at M = 9 and 16 and never at M <= 8, and compiled for sm_90 within the bound (<= 128
// registers) without spilling a batch.
TEST(GemvCompile, AffineGateUpAboveEightRowsRacesTheBoundedShapes) {
  for (const GemvWeightFormat& format : {GemvWeightFormat::affine(4, 64, DType::bf16), GemvWeightFormat::affine(8, 64, DType::bf16)}) {
    for (std::int64_t rows : {1, 8, 9, 16}) {
      std::vector<int> depths;
      for (const GemvKernelConfig& config :
           gemv_tuning_candidates(gemv_config(format, rows, 14336, 4096, GemvEpilogue::swiglu()), 132)) {
        if (config.resident_blocks_per_multiprocessor == 0) continue;
        depths.push_back(config.iterations_in_flight);
        EXPECT_EQ(config.resident_blocks_per_multiprocessor, 4) << config.to_string();
        EXPECT_EQ(config.warps_per_block, 4) << config.to_string();
        EXPECT_FALSE(config.double_buffered) << config.to_string();
        if (rows != 16) continue;
        const Compiled compiled = compile_for_sm90(generate_gemv_kernel(config));
        expect_no_spills(compiled.log, config.to_string());
        EXPECT_LE(registers_used(compiled.log, config.to_string()), 128) << config.to_string();
      }
      const std::vector<int> expected = rows > 8 ? std::vector<int>{2, 1} : std::vector<int>{};
      EXPECT_EQ(depths, expected) << format.to_string() << " M = " << rows;
    }
  }
}

// Between one and two tiles an SM (Llama-3-8B's down projection: 256 tiles for 132 SMs) the first two affine shapes
// at M <= 8, w8 and w16 double-buffered, are compiled for the two blocks an SM that the grid puts there (session 25,
// notes/mlp_decode.md): bounded, within 65536 / (2 x threads) registers and without spills. Not at M > 8 (the bound
// spilled there), not for dense weights (not measured), not where one block an SM is all there is (Qwen2.5-1.5B's
// down projection: 96 tiles).
TEST(GemvCompile, AffineStagesOfOneToTwoTilesAnSmAreBoundToTwoBlocks) {
  struct Case {
    GemvWeightFormat format;
    std::int64_t rows, out_features, in_features;
    int bounded;
  };
  const GemvWeightFormat int4 = GemvWeightFormat::affine(4, 64, DType::bf16), int8 = GemvWeightFormat::affine(8, 64, DType::bf16);
  for (const Case& c : {Case{int4, 1, 4096, 14336, 2}, Case{int8, 1, 4096, 14336, 2}, Case{int4, 4, 4096, 4096, 2},
                        Case{int4, 16, 4096, 14336, 0}, Case{GemvWeightFormat::dense(DType::bf16), 1, 4096, 14336, 0},
                        Case{int4, 1, 1536, 8960, 0}}) {
    const std::vector<GemvKernelConfig> candidates =
        gemv_tuning_candidates(gemv_config(c.format, c.rows, c.out_features, c.in_features, GemvEpilogue::residual_add()), 132);
    int bounded = 0;
    for (const GemvKernelConfig& config : candidates) {
      if (config.resident_blocks_per_multiprocessor == 0) continue;
      ++bounded;
      EXPECT_EQ(config.resident_blocks_per_multiprocessor, 2) << config.to_string();
      EXPECT_TRUE(config.double_buffered) << config.to_string();
      const Compiled compiled = compile_for_sm90(generate_gemv_kernel(config));
      expect_no_spills(compiled.log, config.to_string());
      EXPECT_LE(registers_used(compiled.log, config.to_string()), 65536 / (2 * 32 * config.warps_per_block)) << config.to_string();
    }
    EXPECT_EQ(bounded, c.bounded) << c.format.to_string() << " M = " << c.rows << " N = " << c.out_features;
    if (c.bounded > 0) {
      ASSERT_GE(candidates.size(), 2u);
      EXPECT_EQ(candidates[0].warps_per_block, 8);
      EXPECT_EQ(candidates[0].resident_blocks_per_multiprocessor, 2);
      EXPECT_EQ(candidates[1].warps_per_block, 16);
      EXPECT_EQ(candidates[1].resident_blocks_per_multiprocessor, 2);
    }
  }
}

// The split-K, staged and shared-group-sum shapes the tuner adds: present where they should be (split-K only where
// some SMs would get no tile, enough splits for about two blocks per SM), their launch shape and
// workspace, and for the Llama-3-8B gate/up and Qwen2.5-1.5B down stages (4-bit M = 1, bf16
// M = 16) an sm_90 compile without spills.
TEST(GemvCompile, SplitKAndStagedShapesCompileForSm90) {
  int compiled = 0;
  for (const auto& [format, rows] : {std::pair{GemvWeightFormat::affine(4, 64, DType::bf16), std::int64_t{1}},
                                     std::pair{GemvWeightFormat::dense(DType::bf16), std::int64_t{16}}}) {
    const GemvKernelConfig gate_up = gemv_config(format, rows, 14336, 4096, GemvEpilogue::swiglu());
    const GemvKernelConfig down = gemv_config(format, rows, 1536, 8960, GemvEpilogue::residual_add());
    int staged = 0, split = 0, group_sums = 0;
    for (const GemvKernelConfig& stage : {gate_up, down}) {
      const std::int64_t tiles = (stage.out_features + 15) / 16;
      for (const GemvKernelConfig& config : gemv_tuning_candidates(stage, 132)) {
        if (config.shared_group_sums) {  // affine only; compiled once per stage, without spills
          EXPECT_TRUE(format.is_affine()) << config.to_string();
          if (group_sums++ % 2 == 0) expect_no_spills(compile_for_sm90(generate_gemv_kernel(config)).log, config.to_string());
          continue;
        }
        if (config.k_splits == 1 && config.shared_stages == 0) continue;
        const GemvKernelSource kernel = generate_gemv_kernel(config);
        EXPECT_EQ(kernel.grid_blocks, static_cast<unsigned>(tiles * config.k_splits)) << config.to_string();
        EXPECT_EQ(kernel.workspace_bytes > 0, config.k_splits > 1) << config.to_string();
        EXPECT_EQ(kernel.dynamic_shared_bytes > 0, config.shared_stages >= 2) << config.to_string();
        EXPECT_LE(kernel.static_shared_bytes + kernel.dynamic_shared_bytes, 232448u) << config.to_string();
        if (rows == 16 && (config.k_splits > 1 ? split : staged) > 0) continue;  // one of each kind at M = 16
        expect_no_spills(compile_for_sm90(kernel).log, config.to_string());
        (config.k_splits > 1 ? split : staged) += 1;
        ++compiled;
      }
    }
    EXPECT_GE(staged, 1) << format.to_string();
    EXPECT_GE(split, 1) << format.to_string();  // Qwen's down projection: 96 tiles for 132 SMs
    EXPECT_EQ(group_sums, format.is_affine() ? 4 : 0) << format.to_string();
  }
  EXPECT_GE(compiled, 6);
  // N with a tile for every SM gets no split-K (Llama-3-8B gate/up and down); Qwen2.5-1.5B's down
  // projection (96 tiles) gets splits that put about two blocks on each of 132 SMs.
  for (const auto& [n, k] : {std::pair{14336, 4096}, std::pair{4096, 14336}}) {
    for (const GemvKernelConfig& config :
         gemv_tuning_candidates(gemv_config(GemvWeightFormat::affine(4, 64, DType::bf16), 1, n, k, GemvEpilogue::residual_add()), 132)) {
      EXPECT_EQ(config.k_splits, 1) << config.to_string();
    }
  }
  int qwen_splits = 0;
  for (const GemvKernelConfig& config :
       gemv_tuning_candidates(gemv_config(GemvWeightFormat::affine(4, 64, DType::bf16), 1, 1536, 8960, GemvEpilogue::residual_add()), 132)) {
    qwen_splits = std::max(qwen_splits, config.k_splits);
  }
  EXPECT_EQ(qwen_splits, 3);  // ceil(2 * 132 / 96)
  // Ragged shapes (N below the SM count and not a multiple of 16, K not a multiple of the load
  // block), every kind at once, in four formats.
  for (const GemvWeightFormat& format : {GemvWeightFormat::affine(4, 32, DType::f16), GemvWeightFormat::affine(8, 128, DType::bf16),
                                         GemvWeightFormat::dense(DType::f16), GemvWeightFormat::affine(8, 64, DType::f16)}) {
    const std::int64_t k = format.is_affine() ? format.group_size * 11 : 1000;
    GemvKernelConfig config = gemv_config(format, 9, 77, k, compiled % 2 ? GemvEpilogue::swiglu() : GemvEpilogue::residual_add());
    config.k_splits = 3;
    config.shared_stages = 3;
    config.shared_group_sums = format.is_affine();
    config.double_buffered = false;
    config.schedule = GatedSchedule::scratch_spilled;
    const GemvKernelSource kernel = generate_gemv_kernel(config);
    EXPECT_EQ(kernel.grid_blocks, 5u * 3u) << config.to_string();
    EXPECT_NO_THROW(compile_for_sm90(kernel)) << config.to_string();
    ++compiled;
  }
  GemvKernelConfig too_many_splits = gemv_config(GemvWeightFormat::affine(4, 64, DType::bf16), 1, 64, 256, GemvEpilogue::store());
  too_many_splits.k_splits = 3;  // two iterations of 128 columns
  EXPECT_THROW(generate_gemv_kernel(too_many_splits), InputError);
  GemvKernelConfig one_stage = too_many_splits;
  one_stage.k_splits = 1;
  one_stage.shared_stages = 1;
  EXPECT_THROW(generate_gemv_kernel(one_stage), InputError);
}

// x normalized as it is loaded (x_rms_norm_eps: the RMSNorm before q/k/v, gate/up and the LM head)
// in every schedule a region with a norm can lower to, each once, ragged (N not a multiple of 16,
// K not of the load block): the double-buffered register mainloop, scratch-spilled gate/up with
// shared group sums, split-K with staged batches, the argmax join batch by batch, split outputs,
// streamed.
// The decode case (4-bit, M = 1) keeps its batches in registers. The kernel takes the norm's weight
// after x, is named apart from the same kernel without the norm, and counts the norm's scratch.
TEST(GemvCompile, NormalizedXCompilesInEverySchedule) {
  const GemvWeightFormat four = GemvWeightFormat::affine(4, 64, DType::bf16);
  const GemvWeightFormat eight = GemvWeightFormat::affine(8, 64, DType::f16);
  const GemvWeightFormat dense = GemvWeightFormat::dense(DType::bf16);
  auto normalized = [](GemvKernelConfig config) {
    config.x_rms_norm_eps = 1e-5;
    return config;
  };
  std::vector<GemvKernelConfig> configs;
  configs.push_back(normalized(gemv_config(four, 1, 100, 64 * 5, GemvEpilogue::store())));
  GemvKernelConfig spilled = normalized(gemv_config(eight, 9, 77, 64 * 5, GemvEpilogue::swiglu()));
  spilled.schedule = GatedSchedule::scratch_spilled;
  spilled.shared_group_sums = true;
  configs.push_back(spilled);
  GemvKernelConfig split = normalized(gemv_config(four, 16, 77, 64 * 11, GemvEpilogue::swiglu()));
  split.k_splits = 3;
  split.shared_stages = 3;
  configs.push_back(split);
  GemvKernelConfig argmax = normalized(gemv_config(dense, 16, 1000, 200, GemvEpilogue::residual_add()));
  argmax.argmax_rows = true;
  argmax.double_buffered = false;  // batch by batch
  configs.push_back(argmax);
  GemvKernelConfig stacked = normalized(gemv_config(four, 16, 96 + 32 + 32, 64 * 5,
                                                    GemvEpilogue::add(GemvEpilogue::accumulator(0), GemvEpilogue::tensor("bias", true))));
  stacked.output_splits = {96, 32, 32};
  configs.push_back(stacked);
  GemvKernelConfig streamed = normalized(gemv_config(dense, 16, 77, 1000, GemvEpilogue::swiglu()));
  streamed.mainloop = GemvMainloop::streamed;
  configs.push_back(streamed);
  for (std::size_t c = 0; c < configs.size(); ++c) {
    const GemvKernelConfig& config = configs[c];
    GemvKernelConfig plain = config;
    plain.x_rms_norm_eps.reset();
    const GemvKernelSource kernel = generate_gemv_kernel(config);
    const GemvKernelSource without = generate_gemv_kernel(plain);
    EXPECT_NE(kernel.kernel_name, without.kernel_name) << config.to_string();
    EXPECT_NE(kernel.source.find("const u16* __restrict__ x,\n    const u16* __restrict__ x_norm_weight,"), std::string::npos)
        << config.to_string();
    EXPECT_EQ(without.source.find("__restrict__ x_norm_weight"), std::string::npos) << config.to_string();
    const unsigned rows = static_cast<unsigned>((config.rows + 7) / 8 * 8);
    // The register mainloop normalizes x once into shared memory where M x K bf16 values fit 16 KiB
    // (kXStaged: they replace a 16-byte placeholder); the split (16 x 704) and streamed kernels
    // normalize as they load.
    const bool staged = config.mainloop == GemvMainloop::register_batches && config.rows * config.in_features * 2 <= 16384;
    EXPECT_EQ(staged, c != 2 && c != 5) << config.to_string();
    EXPECT_NE(kernel.source.find(staged ? "constexpr bool kXStaged = true;" : "constexpr bool kXStaged = false;"),
              std::string::npos)
        << config.to_string();
    const unsigned staged_bytes = staged ? static_cast<unsigned>(config.rows * config.in_features * 2) - 16 : 0;
    EXPECT_EQ(kernel.static_shared_bytes - without.static_shared_bytes,
              (static_cast<unsigned>(kernel.block_threads / 32) + 1) * rows * 4 - 4 + staged_bytes)
        << config.to_string();
    EXPECT_EQ(kernel.grid_blocks, without.grid_blocks) << config.to_string();
    try {
      const Compiled compiled = compile_for_sm90(kernel);
      EXPECT_FALSE(compiled.program.cubin.empty()) << config.to_string();
      if (c == 0) expect_no_spills(compiled.log, config.to_string());
    } catch (const CudaError& error) {
      ADD_FAILURE() << config.to_string() << "\n" << error.what();
    }
  }
}

// The norm's prologue must not raise the kernel's register peak much: the registers decide how many
// blocks an SM holds, and the Llama-3-8B gate/up grid (896 blocks of 4 warps) needs 7 an SM for one
// wave. Eight 16-byte loads in flight took bf16 w4 f2 from 48 to 94 registers (4-bit: 64 -> 114) and
// the whole MLP from 91 to 101 us on the H200 (notes/mlp_decode.md, session 11). Four compiles.
TEST(GemvCompile, TheNormPrologueKeepsTheMlpGateUpRegisters) {
  auto registers = [&](const GemvKernelConfig& config) {
    return registers_used(compile_for_sm90(generate_gemv_kernel(config)).log, config.to_string());
  };
  for (const GemvWeightFormat& format : {GemvWeightFormat::dense(DType::bf16), GemvWeightFormat::affine(4, 64, DType::bf16)}) {
    GemvKernelConfig plain = gemv_config(format, 1, 14336, 4096, GemvEpilogue::swiglu());
    plain.warps_per_block = 4;
    plain.iterations_in_flight = 2;
    plain.double_buffered = false;
    GemvKernelConfig normalized = plain;
    normalized.x_rms_norm_eps = 1e-5;
    const int without = registers(plain), with = registers(normalized);
    EXPECT_GT(without, 0);
    EXPECT_LE(with, without + 8) << normalized.to_string();
  }
}

// x_staged_by_async_copy: the prologue copies x into shared memory with cp.async (named apart, its
// constant set); the kernels compile for sm_90 without spills and within 8 registers of the register
// prologue's (x's loads hold no registers; reading it back from shared memory took 2 more, dense
// w4 f2 db: 70 -> 72). Refused where x is not staged (no norm,
// M x K past 16 KiB, the streamed mainloop) or the batches ride a cp.async ring (shared_stages: its
// group count would wait for x too). Four compiles.
TEST(GemvCompile, XStagedByAsyncCopyCompilesAndIsRefusedWhereItCannotWork) {
  auto registers = [&](const GemvKernelConfig& config, const std::string& log) {
    return registers_used(log, config.to_string());
  };
  for (const GemvWeightFormat& format : {GemvWeightFormat::dense(DType::bf16), GemvWeightFormat::affine(4, 64, DType::bf16)}) {
    GemvKernelConfig plain = gemv_config(format, 1, 6144, 4096, GemvEpilogue::store());
    plain.x_rms_norm_eps = 1e-5;
    GemvKernelConfig copied = plain;
    copied.x_staged_by_async_copy = true;
    const GemvKernelSource kernel = generate_gemv_kernel(copied);
    EXPECT_NE(kernel.kernel_name, generate_gemv_kernel(plain).kernel_name);
    EXPECT_NE(kernel.source.find("constexpr bool kXStagedByCopy = true;"), std::string::npos);
    EXPECT_NE(generate_gemv_kernel(plain).source.find("constexpr bool kXStagedByCopy = false;"), std::string::npos);
    EXPECT_NE(copied.to_string().find("x_staged_by_async_copy"), std::string::npos);
    try {
      const Compiled with_copy = compile_for_sm90(kernel);
      const Compiled without = compile_for_sm90(generate_gemv_kernel(plain));
      expect_no_spills(with_copy.log, copied.to_string());
      EXPECT_LE(registers(copied, with_copy.log), registers(plain, without.log) + 8) << copied.to_string();
    } catch (const CudaError& error) {
      ADD_FAILURE() << copied.to_string() << "\n" << error.what();
    }
  }
  GemvKernelConfig no_norm = gemv_config(GemvWeightFormat::dense(DType::bf16), 1, 64, 256, GemvEpilogue::store());
  no_norm.x_staged_by_async_copy = true;
  EXPECT_THROW(no_norm.validate(), InputError);
  GemvKernelConfig too_long = no_norm;
  too_long.x_rms_norm_eps = 1e-5;
  too_long.rows = 16;
  too_long.in_features = 1024;  // 32 KiB of x
  EXPECT_THROW(too_long.validate(), InputError);
  GemvKernelConfig ring = no_norm;
  ring.x_rms_norm_eps = 1e-5;
  ring.shared_stages = 3;
  EXPECT_THROW(ring.validate(), InputError);
  ring.shared_stages = 0;
  EXPECT_NO_THROW(ring.validate());
  GemvKernelConfig streamed = ring;  // its x_staged is a placeholder: the copy would run past it
  streamed.mainloop = GemvMainloop::streamed;
  EXPECT_THROW(streamed.validate(), InputError);
}

// The rope epilogue (GemvKernelConfig::rope_cache: q/k/v with rope and the cache writes): the row
// order puts each rotary pair in adjacent rows of one tile and keeps v and the rows past the rotary
// dims; the kernels (4-bit with norm, dense with bias and split-K, f16 8-bit at M = 16, partial
// rotary dims) compile for sm_90, the decode one without spills, take the positions after their
// outputs and are named apart from the plain stacked GEMV; what the epilogue cannot do is refused.
TEST(GemvCompile, RopeCacheEpilogueCompilesAndRefusesWhatItCannotDo) {
  GemvRopeCacheEpilogue rope{4, 2, 64, 160, {}};
  rope.rope.set("theta", 500000.0);
  rope.rope.set("dims", std::int64_t{48});
  const std::vector<std::int64_t> order = gemv_rope_row_order(rope);
  ASSERT_EQ(order.size(), 8u * 64u);
  std::vector<std::int64_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 0; i < sorted.size(); ++i) ASSERT_EQ(sorted[i], static_cast<std::int64_t>(i)) << "not a permutation";
  for (std::int64_t head = 0; head < 8; ++head) {
    for (std::int64_t p = 0; p < 64; ++p) {
      const std::int64_t row = head * 64 + p;
      // q's 4 heads and k's 2 rotate: rows 2j, 2j + 1 hold elements j, j + 24; v's heads and
      // every element past the 48 rotary dims stay where they are.
      const std::int64_t expected = head >= 6 || p >= 48 ? row : head * 64 + (p % 2 == 0 ? p / 2 : p / 2 + 24);
      EXPECT_EQ(order[static_cast<std::size_t>(row)], expected) << "row " << row;
    }
  }
  const GemvEpilogue biased = GemvEpilogue::add(GemvEpilogue::accumulator(0), GemvEpilogue::tensor("bias", true));
  auto with_rope = [&](GemvKernelConfig config, std::int64_t dims) {
    config.output_splits = {4 * 64, 2 * 64, 2 * 64};
    config.rope_cache = rope;
    config.rope_cache->rope.set("dims", dims);
    return config;
  };
  std::vector<GemvKernelConfig> configs;
  GemvKernelConfig decode = with_rope(gemv_config(GemvWeightFormat::affine(4, 64, DType::bf16), 1, 512, 64 * 8, GemvEpilogue::store()), 64);
  decode.x_rms_norm_eps = 1e-5;
  configs.push_back(decode);
  GemvKernelConfig split = with_rope(gemv_config(GemvWeightFormat::dense(DType::bf16), 3, 512, 1024, biased), 64);
  split.k_splits = 4;
  configs.push_back(split);
  configs.push_back(with_rope(gemv_config(GemvWeightFormat::affine(8, 32, DType::f16), 16, 512, 256, biased), 32));
  // A decode step's: the positions and the biases read, the angle computed, before the wait.
  GemvKernelConfig early = with_rope(gemv_config(GemvWeightFormat::affine(4, 64, DType::bf16), 1, 512, 64 * 8, biased), 64);
  early.x_rms_norm_eps = 1e-5;
  early.rope_cache->inputs_before_wait = true;
  configs.push_back(early);
  for (std::size_t c = 0; c < configs.size(); ++c) {
    const GemvKernelConfig& config = configs[c];
    GemvKernelConfig plain = config;
    plain.rope_cache.reset();
    const GemvKernelSource kernel = generate_gemv_kernel(config);
    EXPECT_NE(kernel.kernel_name, generate_gemv_kernel(plain).kernel_name) << config.to_string();
    EXPECT_NE(kernel.source.find("constexpr bool kRopeCache = true;"), std::string::npos);
    EXPECT_NE(kernel.source.find("u16* __restrict__ out2, const int* __restrict__ positions"), std::string::npos)
        << kernel.source.substr(kernel.source.find("extern \"C\""), 1200);
    EXPECT_NE(kernel.source.find("metile_rope_apply("), std::string::npos);
    // Each thread's position, biases (and, before the wait, angle) are loaded ahead of the join
    // where it stores one output (M = 1 here; the split-K and the M = 16 kernels load in the store).
    const bool one_output_a_thread = config.k_splits == 1 && config.rows * 16 <= config.warps_per_block * 32;
    EXPECT_EQ(kernel.source.find("constexpr bool kPreloadEpilogue = true;") != std::string::npos, one_output_a_thread)
        << config.to_string();
    EXPECT_EQ(kernel.source.find("constexpr bool kEpilogueBeforeWait = true;") != std::string::npos,
              one_output_a_thread && config.rope_cache->inputs_before_wait)
        << config.to_string();
    if (config.rope_cache->inputs_before_wait) {
      GemvKernelConfig after = config;
      after.rope_cache->inputs_before_wait = false;
      EXPECT_NE(kernel.kernel_name, generate_gemv_kernel(after).kernel_name) << "one name for two kernels";
    }
    try {
      const Compiled compiled = compile_for_sm90(kernel);
      EXPECT_FALSE(compiled.program.cubin.empty()) << config.to_string();
      if (c == 0 || config.rope_cache->inputs_before_wait) {
        // The f64 sincos keeps a small local array for its slow argument reduction (a stack frame);
        // the batches and accumulators must still not spill.
        const std::regex report(R"((\d+) bytes spill stores, (\d+) bytes spill loads)");
        std::smatch match;
        ASSERT_TRUE(std::regex_search(compiled.log, match, report)) << compiled.log;
        EXPECT_LE(std::stoi(match[1].str()), 32) << compiled.log;
        EXPECT_LE(std::stoi(match[2].str()), 32) << compiled.log;
      }
    } catch (const CudaError& error) {
      ADD_FAILURE() << config.to_string() << "\n" << error.what();
    }
  }
  GemvKernelConfig wrong_splits = decode;
  wrong_splits.output_splits = {256, 256};
  EXPECT_THROW(generate_gemv_kernel(wrong_splits), InputError);
  GemvKernelConfig streamed = decode;
  streamed.mainloop = GemvMainloop::streamed;
  EXPECT_THROW(generate_gemv_kernel(streamed), InputError);
  GemvKernelConfig gated = decode;
  gated.epilogue = GemvEpilogue::swiglu();
  EXPECT_THROW(generate_gemv_kernel(gated), InputError);
  GemvKernelConfig odd = with_rope(gemv_config(GemvWeightFormat::dense(DType::bf16), 1, 512, 256, biased), 63);
  EXPECT_THROW(generate_gemv_kernel(odd), InputError);
}

// A residual or bias epilogue's tensors are loaded right after the wait for the previous kernel
// (kPreloadEpilogue) where each thread stores one output of an unsplit register-mainloop kernel;
// split-K joins, more outputs than threads and the streamed mainloop load them in the store.
TEST(GemvCompile, EpilogueTensorsArePreloadedWhereEachThreadStoresOneOutput) {
  const GemvWeightFormat four = GemvWeightFormat::affine(4, 64, DType::bf16);
  auto preloads = [](const GemvKernelConfig& config) {
    const std::string source = generate_gemv_kernel(config).source;
    EXPECT_NE(source.find("constexpr bool kPreloadEpilogue"), std::string::npos);
    return source.find("constexpr bool kPreloadEpilogue = true;") != std::string::npos;
  };
  GemvKernelConfig down = gemv_config(four, 1, 2048, 8192, GemvEpilogue::residual_add());
  down.warps_per_block = 16;
  EXPECT_TRUE(preloads(down));
  GemvKernelConfig split = down;
  split.k_splits = 4;
  EXPECT_FALSE(preloads(split));
  GemvKernelConfig wide = down;
  wide.rows = 16, wide.warps_per_block = 4;  // 256 outputs, 128 threads
  EXPECT_FALSE(preloads(wide));
  EXPECT_FALSE(preloads(gemv_config(four, 1, 2048, 8192, GemvEpilogue::store())));
  GemvKernelConfig streamed = down;
  streamed.mainloop = GemvMainloop::streamed;
  EXPECT_FALSE(preloads(streamed));
  try {
    EXPECT_FALSE(compile_for_sm90(generate_gemv_kernel(down)).program.cubin.empty());
  } catch (const CudaError& error) {
    ADD_FAILURE() << error.what();
  }
}

// The LM head with greedy decoding's argmax join (argmax_rows): Llama 3's vocabulary at K = 2048,
// dense and 4-bit, compiles for sm_90 without spills; the join's workspace holds a value and an
// index per block and row and one counter; split-K and the streamed mainloop have no such join.
TEST(GemvCompile, ArgmaxRowsCompileWithoutSpillsAndOnlyUnsplit) {
  for (const GemvWeightFormat& format : {GemvWeightFormat::dense(DType::bf16), GemvWeightFormat::affine(4, 64, DType::bf16)}) {
    GemvKernelConfig config = gemv_config(format, 1, 128256, 2048, GemvEpilogue::store());
    const GemvKernelSource plain = generate_gemv_kernel(config);
    config.argmax_rows = true;
    const std::vector<GemvKernelConfig> candidates = gemv_tuning_candidates(config, 132);
    ASSERT_FALSE(candidates.empty());
    for (const GemvKernelConfig& candidate : candidates) EXPECT_TRUE(candidate.argmax_rows) << candidate.to_string();
    const GemvKernelSource kernel = generate_gemv_kernel(candidates.front());
    EXPECT_NE(kernel.kernel_name, plain.kernel_name);
    EXPECT_EQ(kernel.workspace_bytes, 2u * kernel.grid_blocks * 4u + 4u) << candidates.front().to_string();
    EXPECT_NE(kernel.source.find("int* __restrict__ next, float* __restrict__ workspace"), std::string::npos);
    expect_no_spills(compile_for_sm90(kernel).log, candidates.front().to_string());
    GemvKernelConfig split = config;
    split.k_splits = 2;
    EXPECT_THROW(generate_gemv_kernel(split), InputError);
    GemvKernelConfig streamed = config;
    streamed.mainloop = GemvMainloop::streamed;
    EXPECT_THROW(generate_gemv_kernel(streamed), InputError);
  }
}

// validate()'s 48 KiB static-shared check against ptxas's own count, at the line: half products stage
// up to 32 KiB of x, so a 4-tile block's partial sums, x and the joins' few bytes (split-K's arrival
// flag, the argmax join's flag and per-warp winners) can meet it. Each pair of K straddles the line
// once those bytes count (M = 1, w8 t4; the argmax join also keeps a tile's stored values and the block's
// winner, 264 bytes more); every config validate() accepts must compile for sm_90 within
// 49152 bytes and within the static_shared_bytes the generator reports (which LoadedGemv checks).
TEST(GemvCompile, StaticSharedMemoryCheckCountsTheJoinsAtTheLimit) {
  GemvKernelConfig argmax = gemv_config(GemvWeightFormat::affine(4, 32, DType::bf16), 1, 128256, 0, GemvEpilogue::store());
  argmax.argmax_rows = true;
  GemvKernelConfig split = gemv_config(GemvWeightFormat::affine(4, 32, DType::f16), 1, 1000, 0, GemvEpilogue::store());
  split.k_splits = 2;
  split.x_rms_norm_eps = 1e-5;
  const std::regex smem(R"((\d+) bytes smem)");
  for (const auto& [base, ks] : {std::pair{argmax, std::vector<std::int64_t>{16096, 16064, 16032}},
                                 std::pair{split, std::vector<std::int64_t>{16096, 16064}}}) {
    int accepted = 0, refused = 0;
    for (const std::int64_t k : ks) {
      GemvKernelConfig config = base;
      config.in_features = k;
      config.warps_per_block = 8;
      config.tiles_per_block = 4;
      config.iterations_in_flight = 1;
      config.half_products = true;
      try {
        config.validate();
      } catch (const InputError&) {
        ++refused;
        continue;
      }
      ++accepted;
      const GemvKernelSource kernel = generate_gemv_kernel(config);
      EXPECT_LE(kernel.static_shared_bytes, 49152u) << config.to_string();
      try {
        const Compiled compiled = compile_for_sm90(kernel);
        std::smatch match;
        ASSERT_TRUE(std::regex_search(compiled.log, match, smem)) << config.to_string() << "\n" << compiled.log;
        EXPECT_LE(std::stoul(match[1].str()), kernel.static_shared_bytes) << config.to_string();
      } catch (const CudaError& error) {
        ADD_FAILURE() << config.to_string() << " passed validate() but does not compile\n" << error.what();
      }
    }
    EXPECT_GE(accepted, 1) << base.to_string();
    EXPECT_GE(refused, 1) << base.to_string() << ": no K of the pair is past the line";
  }
}

// A stage with fewer than six 16-row tiles an SM leads with more warps a tile (one product: 8, then
// 16): Llama-3-8B's q/k/v (6144 rows, 384 tiles) under ncu had 4-warp blocks at 17.5% occupancy with no
// eligible warp in 89% of the cycles. A wide gate/up (896 tiles) keeps the order measured for it.
TEST(GemvCompile, FewTilesAnSmLeadWithMoreWarpsATile) {
  for (const GemvWeightFormat& format : {GemvWeightFormat::dense(DType::bf16), GemvWeightFormat::affine(4, 64, DType::bf16)}) {
    const std::vector<GemvKernelConfig> qkv = gemv_tuning_candidates(gemv_config(format, 1, 6144, 4096, GemvEpilogue::accumulator(0)));
    ASSERT_GE(qkv.size(), 3u);
    EXPECT_EQ(qkv[0].warps_per_block, 8) << qkv[0].to_string();
    EXPECT_EQ(qkv[1].warps_per_block, 16) << qkv[1].to_string();
    const std::vector<GemvKernelConfig> gate_up = gemv_tuning_candidates(gemv_config(format, 1, 14336, 4096, GemvEpilogue::swiglu()));
    ASSERT_GE(gate_up.size(), 2u);
    EXPECT_EQ(gate_up[0].warps_per_block, 2) << gate_up[0].to_string();
    EXPECT_EQ(gate_up[1].warps_per_block, 4) << gate_up[1].to_string();
    EXPECT_FALSE(gate_up[1].double_buffered) << gate_up[1].to_string();
    // Two products with few tiles (Qwen2.5-1.5B's gate/up: 560 tiles): 8 warps among the first three.
    const std::vector<GemvKernelConfig> narrow_gate_up = gemv_tuning_candidates(gemv_config(format, 1, 8960, 1536, GemvEpilogue::swiglu()));
    ASSERT_GE(narrow_gate_up.size(), 3u);
    EXPECT_EQ(narrow_gate_up[2].warps_per_block, 8) << narrow_gate_up[2].to_string();
  }
}

// A few-tile stage of one matrix (Llama-3-8B's q/k/v: 384 tiles) also races 16 warps a tile held to
// the registers that fit the whole grid at once (3 blocks an SM: __launch_bounds__(512, 3)); a stage
// whose tiles fit two blocks an SM (the o-projection's 256) or that has two matrices does not.
TEST(GemvCompile, FewTilesOfOneMatrixRaceAOneWaveShape) {
  const GemvWeightFormat format = GemvWeightFormat::affine(4, 64, DType::bf16);
  // The one-wave shape is bound to three blocks an SM or more (two: AffineStagesOfOneToTwoTilesAnSmAreBoundToTwoBlocks).
  auto one_wave = [](const std::vector<GemvKernelConfig>& configs) {
    std::vector<GemvKernelConfig> found;
    for (const GemvKernelConfig& config : configs) {
      if (config.resident_blocks_per_multiprocessor >= 3) found.push_back(config);
    }
    return found;
  };
  const std::vector<GemvKernelConfig> qkv = gemv_tuning_candidates(gemv_config(format, 1, 6144, 4096, GemvEpilogue::accumulator(0)));
  ASSERT_GE(qkv.size(), 4u);
  EXPECT_EQ(qkv[2].resident_blocks_per_multiprocessor, 3) << qkv[2].to_string();  // raced: among the first four
  EXPECT_EQ(qkv[2].warps_per_block, 16);
  const GemvKernelSource kernel = generate_gemv_kernel(qkv[2]);
  EXPECT_NE(kernel.source.find("__launch_bounds__(kThreads, 3)"), std::string::npos);
  EXPECT_NE(kernel.kernel_name, generate_gemv_kernel(qkv[1]).kernel_name);
  const std::string log = compile_for_sm90(kernel).log;
  EXPECT_LE(registers_used(log, kernel.kernel_name), 65536 / (3 * 512)) << log;  // three blocks of 512 threads fit
  EXPECT_TRUE(one_wave(gemv_tuning_candidates(gemv_config(format, 1, 4096, 4096, GemvEpilogue::accumulator(0)))).empty());
  EXPECT_TRUE(one_wave(gemv_tuning_candidates(gemv_config(format, 1, 6144, 4096, GemvEpilogue::swiglu()))).empty());
  // Above one row the bound leaves the accumulators no registers (M = 16 parked 532 bytes): not raced.
  for (const std::int64_t rows : {2, 8, 16}) {
    EXPECT_TRUE(one_wave(gemv_tuning_candidates(gemv_config(format, rows, 6144, 4096, GemvEpilogue::accumulator(0)))).empty())
        << rows << " rows";
  }
  GemvKernelConfig too_many = qkv[2];
  too_many.resident_blocks_per_multiprocessor = 5;  // 80 warps an SM
  EXPECT_THROW(too_many.validate(), InputError);
}

// The attention prologue (GemvKernelConfig::attention: decode attention inside the output projection)
// compiles for sm_90 for the three decode models' heads (Llama-3-8B 8 x 4 x 128, Qwen2.5-1.5B 2 x 6 x
// 128, Llama-3.2-1B 8 x 4 x 64) with the residual epilogue, takes q, the caches and the positions after
// its output and a workspace of two counters last, reads x through L2, needs its grid resident at once,
// and is named apart from the plain projection and by its scale; what it cannot do is refused.
TEST(GemvCompile, AttentionPrologueCompilesAndRefusesWhatItCannotDo) {
  struct Heads {
    std::int64_t kv_heads, groups, head_dim;
  };
  const GemvWeightFormat format = GemvWeightFormat::affine(4, 64, DType::bf16);
  for (const Heads heads : {Heads{8, 4, 128}, Heads{2, 6, 128}, Heads{8, 4, 64}}) {
    const std::int64_t width = heads.kv_heads * heads.groups * heads.head_dim;
    GemvKernelConfig base = gemv_config(format, 1, width, width, GemvEpilogue::residual_add("residual", DType::bf16));
    base.attention = GemvAttentionPrologue{heads.kv_heads, heads.groups, heads.head_dim, 4096,
                                           1.0 / std::sqrt(static_cast<double>(heads.head_dim))};
    int compiled = 0;
    for (const GemvKernelConfig& config : gemv_tuning_candidates(base)) {
      ASSERT_TRUE(config.attention) << config.to_string();
      // Split-K and staged rings are refused with the prologue: never among its candidates.
      EXPECT_EQ(config.k_splits, 1) << config.to_string();
      EXPECT_LT(config.shared_stages, 2) << config.to_string();
      EXPECT_EQ(config.multiprocessors, 132) << config.to_string();
      const GemvKernelSource kernel = generate_gemv_kernel(config);
      EXPECT_EQ(kernel.workspace_bytes, 8u);
      EXPECT_EQ(kernel.co_resident_blocks_per_multiprocessor, 1);
      EXPECT_NE(kernel.source.find("constexpr bool kXWrittenInKernel = true;"), std::string::npos);
      EXPECT_NE(kernel.source.find("const int* __restrict__ attention_positions, float* __restrict__ workspace"),
                std::string::npos);
      GemvKernelConfig plain = config;
      plain.attention.reset();
      EXPECT_NE(kernel.kernel_name, generate_gemv_kernel(plain).kernel_name);
      GemvKernelConfig other_scale = config;
      other_scale.attention->scale = 0.5;
      EXPECT_NE(kernel.kernel_name, generate_gemv_kernel(other_scale).kernel_name);
      if (compiled++ < 2 || std::getenv("METILE_PRINT_PTXAS")) {
        const Compiled result = compile_for_sm90(kernel);
        EXPECT_FALSE(result.program.cubin.empty()) << config.to_string();
        if (std::getenv("METILE_PRINT_PTXAS")) fmt::print("{}\n{}\n", config.to_string(), result.log);
      }
    }
    EXPECT_GE(compiled, 2) << base.to_string();
    // The grid must be resident at once on the device the candidates are for: on 2 SMs (at most 64
    // warps and 32 blocks each) only grids of few blocks remain (Llama-3-8B's 256 tiles: none).
    const std::vector<GemvKernelConfig> two_sms = gemv_tuning_candidates(base, 2);
    for (const GemvKernelConfig& config : two_sms) {
      const std::int64_t blocks = ((config.out_features + 15) / 16 + config.tiles_per_block - 1) / config.tiles_per_block;
      EXPECT_LE(blocks, 2 * std::min(32, 64 / config.warps_per_block)) << config.to_string();
      EXPECT_EQ(config.multiprocessors, 2) << config.to_string();
    }
    if (width == 4096) {
      EXPECT_TRUE(two_sms.empty());
    }
    EXPECT_LT(two_sms.size(), gemv_tuning_candidates(base).size()) << base.to_string();
    GemvKernelConfig refused = base;
    refused.k_splits = 2;
    EXPECT_THROW(refused.validate(), InputError);
    refused = base;
    refused.rows = 2;
    EXPECT_THROW(refused.validate(), InputError);
    refused = base;
    refused.x_rms_norm_eps = 1e-5;
    EXPECT_THROW(refused.validate(), InputError);
    refused = base;
    refused.attention->groups = 9;
    EXPECT_THROW(refused.validate(), InputError);
    refused = base;
    refused.attention->head_dim = 96;
    EXPECT_THROW(refused.validate(), InputError);
    refused = base;
    refused.warps_per_block = 3;  // the head's value pairs do not split evenly
    EXPECT_THROW(refused.validate(), InputError);
    refused = base;
    refused.in_features += 64;
    EXPECT_THROW(refused.validate(), InputError);
  }
  // Fewer tile blocks than KV heads: a head would have no block to attend over it.
  GemvKernelConfig few = gemv_config(format, 1, 16 * 7, 8 * 4 * 64, GemvEpilogue::store());
  few.attention = GemvAttentionPrologue{8, 4, 64, 128, 0.125};
  EXPECT_THROW(few.validate(), InputError);
}

// Whole batches (kBatchesWhole in the kernel: no predicated loads, no zeroed registers) need the warps'
// batches to tile K's iterations exactly. For every stage of the three decode models, one of the first
// three register shapes (what a swiglu_mlp region races) has them; where neither 8 nor 16 warps divide the
// iterations (Qwen2.5-1.5B's down projection: 8960 / 128 = 70), the list offers the largest count in
// 16..5 that does, and it compiles without spills. Any warp count 1..16 is valid, 0 and 17 are not.
TEST(GemvCompile, EveryDecodeStageRacesAShapeWithWholeBatches) {
  struct Model {
    std::string name;
    std::int64_t hidden, intermediate;
  };
  const GemvWeightFormat int4 = GemvWeightFormat::affine(4, 64, DType::bf16);
  // Computed here from the rule, and compared with gemv_batches_whole (what the generator emits).
  auto whole = [](const GemvKernelConfig& config) {
    const std::int64_t columns = config.format.columns_per_iteration();
    const std::int64_t iterations = (config.in_features + columns - 1) / columns;
    const bool result = config.k_splits == 1 && config.in_features % columns == 0 && config.out_features % 16 == 0 &&
                        config.tiles_per_block == 1 &&
                        iterations % (std::int64_t{config.warps_per_block} * config.iterations_in_flight) == 0;
    EXPECT_EQ(gemv_batches_whole(config), result) << config.to_string();
    return result;
  };
  for (const Model& model : {Model{"Llama-3-8B", 4096, 14336}, Model{"Qwen2.5-1.5B", 1536, 8960}, Model{"Llama-3.2-1B", 2048, 8192}}) {
    for (const GemvWeightFormat& format : {int4, GemvWeightFormat::dense(DType::bf16)}) {
      for (const GemvKernelConfig& stage : {gemv_config(format, 1, model.intermediate, model.hidden, GemvEpilogue::swiglu()),
                                            gemv_config(format, 1, model.hidden, model.intermediate, GemvEpilogue::residual_add())}) {
        const std::vector<GemvKernelConfig> candidates = gemv_tuning_candidates(stage);
        const auto raced_end = candidates.begin() + std::min<std::ptrdiff_t>(3, static_cast<std::ptrdiff_t>(candidates.size()));
        EXPECT_TRUE(std::any_of(candidates.begin(), raced_end, whole)) << model.name << " " << stage.to_string();
      }
    }
  }
  // Qwen2.5-1.5B's down projection (70 iterations): first the 14-warp shape carrying x with its batches,
  // then, after the 8-warp one, the same 14 warps without.
  const std::vector<GemvKernelConfig> qwen_down = gemv_tuning_candidates(gemv_config(int4, 1, 1536, 8960, GemvEpilogue::residual_add()));
  ASSERT_GE(qwen_down.size(), 3u);
  for (std::size_t index : {0u, 2u}) {
    EXPECT_EQ(qwen_down[index].warps_per_block, 14) << qwen_down[index].to_string();
    EXPECT_EQ(qwen_down[index].x_with_batch, index == 0) << qwen_down[index].to_string();
    EXPECT_TRUE(whole(qwen_down[index]));
    expect_no_spills(compile_for_sm90(generate_gemv_kernel(qwen_down[index])).log, qwen_down[index].to_string());
  }
  GemvKernelConfig odd = gemv_config(int4, 1, 1536, 8960, GemvEpilogue::residual_add());
  for (int warps : {1, 3, 7, 16}) {
    odd.warps_per_block = warps;
    EXPECT_NO_THROW(odd.validate()) << warps;
  }
  for (int warps : {0, 17}) {
    odd.warps_per_block = warps;
    EXPECT_THROW(odd.validate(), InputError) << warps;
  }
}

TEST(GemvCompile, RejectsConfigurationsItCannotGenerate) {
  const GemvWeightFormat dense = GemvWeightFormat::dense(DType::bf16);
  EXPECT_THROW(generate_gemv_kernel(gemv_config(dense, 17, 64, 64, GemvEpilogue::store())), InputError);
  EXPECT_THROW(generate_gemv_kernel(gemv_config(dense, 1, 64, 60, GemvEpilogue::store())), InputError);
  EXPECT_THROW(generate_gemv_kernel(gemv_config(GemvWeightFormat::affine(4, 64, DType::bf16), 1, 64, 96,
                                                GemvEpilogue::store())),
               InputError);
  EXPECT_THROW(generate_gemv_kernel(gemv_config(GemvWeightFormat::affine(3, 64, DType::bf16), 1, 64, 128,
                                                GemvEpilogue::store())),
               InputError);
  EXPECT_THROW(generate_gemv_kernel(gemv_config(GemvWeightFormat::dense(DType::f32), 1, 64, 128, GemvEpilogue::store())),
               InputError);
  GemvKernelConfig too_much_shared = gemv_config(dense, 16, 64, 128, GemvEpilogue::swiglu());
  too_much_shared.warps_per_block = 16;
  too_much_shared.tiles_per_block = 4;
  try {
    generate_gemv_kernel(too_much_shared);
    FAIL() << "a block needing 128 KiB of static shared memory was generated";
  } catch (const InputError& error) {
    EXPECT_NE(std::string(error.what()).find("shared memory"), std::string::npos) << error.what();
  }
}


// The streamed mainloop (bulk copies into shared-memory stages, mbarriers, stream-K) compiles for
// sm_90 at the decode-MLP sizes without spilling, and at ragged shapes in every format.
TEST(GemvCompile, StreamedMainloopCompilesForSm90) {
  auto streamed = [](GemvKernelConfig config) {
    config.mainloop = GemvMainloop::streamed;
    return config;
  };
  int checked = 0;
  for (const GemvWeightFormat& format : {GemvWeightFormat::dense(DType::bf16), GemvWeightFormat::affine(4, 64, DType::bf16)}) {
    for (std::int64_t rows : {1, 16}) {
      for (const GemvKernelConfig& config :
           {streamed(gemv_config(format, rows, 14336, 4096, GemvEpilogue::swiglu())),
            streamed(gemv_config(format, rows, 4096, 14336, GemvEpilogue::residual_add()))}) {
        const GemvKernelConfig first = gemv_tuning_candidates(config).front();
        const GemvKernelSource kernel = generate_gemv_kernel(first);
        EXPECT_LE(kernel.grid_blocks, 132u * first.blocks_per_multiprocessor) << first.to_string();
        EXPECT_LE(kernel.dynamic_shared_bytes, 232448u) << first.to_string();
        EXPECT_GT(kernel.workspace_bytes, 0u) << first.to_string();
        expect_no_spills(compile_for_sm90(kernel).log, first.to_string());
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 8);
  const std::vector<GemvWeightFormat> formats = all_formats();
  for (std::size_t i = 0; i < formats.size(); i += 2) {
    const std::int64_t k = formats[i].is_affine() ? formats[i].group_size * 7 : 1000;
    const GemvEpilogue epilogue = i % 4 == 0 ? GemvEpilogue::swiglu() : GemvEpilogue::residual_add();
    const GemvKernelConfig config = streamed(gemv_config(formats[i], i % 4 == 0 ? 9 : 1, 77, k, epilogue));
    EXPECT_NO_THROW(compile_for_sm90(generate_gemv_kernel(config))) << config.to_string();
  }
}

// How the streamed plan splits the work: K is split only when x would not fit shared memory, and
// a problem with fewer positions than warps gets a smaller grid, never empty blocks.
TEST(GemvCompile, StreamedPlanSplitsKOnlyWhenXDoesNotFit) {
  GemvKernelConfig config = gemv_config(GemvWeightFormat::affine(4, 64, DType::bf16), 1, 4096, 14336,
                                        GemvEpilogue::residual_add());
  config.mainloop = GemvMainloop::streamed;
  config.warps_per_block = 8;
  EXPECT_EQ(generate_gemv_kernel(config).k_slices, 1);   // x: 28 KiB
  config.rows = 16;
  const GemvKernelSource sixteen = generate_gemv_kernel(config);
  EXPECT_GT(sixteen.k_slices, 1);                         // x: 448 KiB unsplit
  EXPECT_EQ(112 % sixteen.k_slices, 0);                   // 112 iterations of 128 columns, split evenly
  EXPECT_LE(sixteen.dynamic_shared_bytes, 232448u);
  config.rows = 1;
  config.out_features = 32;   // 2 tiles x 112 iterations = 224 positions over 8-warp blocks
  EXPECT_EQ(generate_gemv_kernel(config).grid_blocks, 28u);
  config.stages = 1;
  EXPECT_THROW(generate_gemv_kernel(config), InputError);
}

// Every format gets streamed shapes at the decode-MLP sizes and ragged ones, even where the default
// rings do not fit shared memory (8-bit g128 gate/up: 4 KiB per iteration): the list is never empty
// and every shape it holds generates.
TEST(GemvCompile, StreamedShapesExistForEveryFormat) {
  for (const GemvWeightFormat& format : all_formats()) {
    const std::int64_t ragged_k = format.is_affine() ? format.group_size * 11 : 1000;
    const std::int64_t sizes[][2] = {{14336, 4096}, {4096, 14336}, {8960, 1536}, {77, ragged_k}, {1000, ragged_k}};
    for (const auto& [n, k] : sizes) {
      for (std::int64_t rows : {1, 9, 16}) {
        for (const GemvEpilogue& epilogue : {GemvEpilogue::swiglu(), GemvEpilogue::residual_add()}) {
          GemvKernelConfig config = gemv_config(format, rows, n, k, epilogue);
          config.mainloop = GemvMainloop::streamed;
          const std::vector<GemvKernelConfig> shapes = gemv_tuning_candidates(config);
          ASSERT_FALSE(shapes.empty()) << config.to_string();
          for (const GemvKernelConfig& shape : shapes) {
            EXPECT_LE(generate_gemv_kernel(shape).dynamic_shared_bytes, 232448u / shape.blocks_per_multiprocessor)
                << shape.to_string();
          }
        }
      }
    }
  }
}

std::vector<PersistentMlpConfig> warp_pieces(const std::vector<PersistentMlpConfig>& candidates) {
  std::vector<PersistentMlpConfig> kept;
  for (const PersistentMlpConfig& config : candidates) {
    if (config.partition == PersistentPartition::warp_pieces) kept.push_back(config);
  }
  return kept;
}

// The persistent decode MLP (gemv_persistent.cpp): one kernel per format at the narrow models'
// sizes compiles for sm_90 with its batches in registers under its launch bounds (16 warps per SM:
// 128 registers), for M = 1 and 16. Three compiles, ~1 s each: the CI budget allows no more.
PersistentMlpConfig persistent_config(GemvWeightFormat format, std::int64_t rows, std::int64_t hidden,
                                      std::int64_t intermediate, std::size_t shape) {
  const std::vector<PersistentMlpConfig> candidates =
      warp_pieces(persistent_mlp_candidates(gemv_config(format, rows, intermediate, hidden, GemvEpilogue::swiglu()),
                                            gemv_config(format, rows, hidden, intermediate, GemvEpilogue::residual_add())));
  EXPECT_GT(candidates.size(), shape) << format.to_string();
  return candidates.size() <= shape ? PersistentMlpConfig{} : candidates[shape];
}

// Above one row no stage-blocks shape is offered: bound to 72-80 registers, they parked 680-732 bytes at
// M = 16 (Llama-3.2-1B's MLP, 4-bit g64). The normalized gate/up of the decode steps then has no
// persistent candidate (the warp pieces take no norm prologue); a plain one races the warp pieces, whose
// first gemv_lowering_persistent_shapes (what the lowering races) park at most the stage blocks' 160
// bytes at M = 16 (40-48 with 4-bit weights; none with 8-bit, PersistentMlpCompilesForSm90).
TEST(GemvCompile, PersistentMlpAboveOneRowRacesNoStageBlocks) {
  const GemvWeightFormat format = GemvWeightFormat::affine(4, 64, DType::bf16);
  const GemvKernelConfig down = gemv_config(format, 1, 2048, 8192, GemvEpilogue::residual_add());
  GemvKernelConfig normalized = gemv_config(format, 1, 8192, 2048, GemvEpilogue::swiglu());
  normalized.x_rms_norm_eps = 1e-5;
  ASSERT_FALSE(persistent_mlp_candidates(normalized, down, 132).empty());
  EXPECT_EQ(persistent_mlp_candidates(normalized, down, 132).front().partition, PersistentPartition::stage_blocks);
  for (const std::int64_t rows : {2, 16}) {
    GemvKernelConfig gate_up = normalized, down_rows = down;
    gate_up.rows = down_rows.rows = rows;
    EXPECT_TRUE(persistent_mlp_candidates(gate_up, down_rows, 132).empty()) << rows;
    gate_up.x_rms_norm_eps.reset();
    const std::vector<PersistentMlpConfig> candidates = persistent_mlp_candidates(gate_up, down_rows, 132);
    ASSERT_GE(candidates.size(), static_cast<std::size_t>(gemv_lowering_persistent_shapes));
    for (std::size_t index = 0; index < candidates.size(); ++index) {
      EXPECT_NE(candidates[index].partition, PersistentPartition::stage_blocks) << candidates[index].to_string();
      if (rows == 16 && index < static_cast<std::size_t>(gemv_lowering_persistent_shapes)) {
        const Compiled compiled = compile_for_sm90(generate_persistent_mlp_kernel(candidates[index]));
        static const std::regex spilled(R"((\d+) bytes spill stores)");
        std::smatch match;
        ASSERT_TRUE(std::regex_search(compiled.log, match, spilled)) << compiled.log;
        EXPECT_LE(std::stoi(match[1].str()), 160) << candidates[index].to_string() << "\n" << compiled.log;
      }
    }
  }
}

TEST(GemvCompile, PersistentMlpCompilesForSm90) {
  const struct {
    GemvWeightFormat format;
    std::int64_t rows, hidden, intermediate;
    std::size_t shape;  // 0: 16 warps per SM at 128 registers; 2: 8 warps per SM, deeper batches
  } cases[] = {{GemvWeightFormat::affine(4, 64, DType::bf16), 1, 1536, 8960, 0},
               {GemvWeightFormat::affine(8, 64, DType::f16), 16, 2048, 8192, 0},
               {GemvWeightFormat::dense(DType::bf16), 1, 1536, 8960, 2}};
  for (const auto& c : cases) {
    const PersistentMlpConfig config = persistent_config(c.format, c.rows, c.hidden, c.intermediate, c.shape);
    const GemvKernelSource kernel = generate_persistent_mlp_kernel(config);
    EXPECT_EQ(kernel.grid_blocks, 132u * static_cast<unsigned>(config.blocks_per_multiprocessor)) << config.to_string();
    EXPECT_EQ(kernel.co_resident_blocks_per_multiprocessor, config.blocks_per_multiprocessor);
    EXPECT_GT(kernel.workspace_bytes, 0u);
    EXPECT_NE(kernel.source.find("namespace down"), std::string::npos);
    expect_no_spills(compile_for_sm90(kernel).log, config.to_string());
  }
}

// The stage-blocks persistent MLP (gemv.h): each phase is its stage kernel's block. At the decode
// steps' MLPs (4-bit g64; gate/up normalized by the RMSNorm prologue, down with the residual) every
// shape compiles for sm_90 under its launch bounds (7 or 6 four-warp blocks an SM: 72 or 80
// registers) with at most 160 bytes parked; a phase is split along K only as far as its units
// fit the grid once; the kernel's parameters are both stage kernels' in order.
TEST(GemvCompile, PersistentStageBlocksCompileForSm90) {
  const GemvWeightFormat format = GemvWeightFormat::affine(4, 64, DType::bf16);
  const struct {
    std::int64_t hidden, intermediate;
  } models[] = {{4096, 14336}, {1536, 8960}};
  for (const auto& model : models) {
    GemvKernelConfig gate_up = gemv_config(format, 1, model.intermediate, model.hidden, GemvEpilogue::swiglu());
    gate_up.x_rms_norm_eps = 1e-5;
    const GemvKernelConfig down = gemv_config(format, 1, model.hidden, model.intermediate, GemvEpilogue::residual_add());
    const std::vector<PersistentMlpConfig> candidates = persistent_mlp_candidates(gate_up, down, 132);
    int stage_blocks = 0;
    for (const PersistentMlpConfig& config : candidates) {
      if (config.partition != PersistentPartition::stage_blocks) continue;
      ++stage_blocks;
      const std::int64_t grid = 132 * config.blocks_per_multiprocessor;
      for (const GemvKernelConfig* phase : {&config.gate_up, &config.down}) {
        const std::int64_t units = (phase->out_features + 15) / 16 * phase->k_splits;
        if (phase->k_splits > 1) {
          EXPECT_LE(units, grid) << config.to_string();  // split only as far as one wave
        }
        EXPECT_GT(units * 2, grid) << config.to_string();                        // at least half the grid busy
      }
      const GemvKernelSource kernel = generate_persistent_mlp_kernel(config);
      EXPECT_EQ(kernel.grid_blocks, static_cast<unsigned>(grid));
      EXPECT_NE(kernel.source.find("gate_up_x_norm_weight"), std::string::npos);
      // Under the bound the normalized gate/up alone parks 40-56 bytes (ptxas, session 31); both phases
      // in one kernel up to ~140. A bound, not the stage kernels' 32: a regression past it shows here.
      const Compiled compiled = compile_for_sm90(kernel);
      static const std::regex spilled(R"((\d+) bytes spill stores)");
      std::smatch match;
      ASSERT_TRUE(std::regex_search(compiled.log, match, spilled)) << compiled.log;
      EXPECT_LE(std::stoi(match[1].str()), 160) << config.to_string() << "\n" << compiled.log;
      EXPECT_LE(registers_used(compiled.log, config.to_string()), 65536 / (128 * config.blocks_per_multiprocessor));
    }
    EXPECT_GE(stage_blocks, 2);
  }
}

// The persistent MLP's GPU test (tests/gpu/mlp_persistent_test.cpp) runs its candidates with the graph's
// SwiGLU, gate, up and silu(gate) stored in the activation dtype (swiglu(dtype)), on its small ragged
// MLPs of every format: those kernels compile for sm_90 here, where no GPU is needed.
TEST(GemvCompile, PersistentMlpWithTheGraphsSwigluCompiles) {
  for (const GemvWeightFormat& format :
       {GemvWeightFormat::dense(DType::bf16), GemvWeightFormat::affine(4, 64, DType::bf16),
        GemvWeightFormat::affine(8, 64, DType::bf16), GemvWeightFormat::affine(4, 32, DType::f16)}) {
    const bool dense = !format.is_affine();
    const std::int64_t hidden = dense ? 200 : 192, intermediate = dense ? 328 : 320;
    for (std::int64_t rows : {1, 16}) {
      const std::vector<PersistentMlpConfig> candidates = persistent_mlp_candidates(
          gemv_config(format, rows, intermediate, hidden, GemvEpilogue::swiglu(format.activation)),
          gemv_config(format, rows, hidden, intermediate, GemvEpilogue::residual_add()), 132);
      ASSERT_FALSE(candidates.empty()) << format.to_string() << " M=" << rows;
      const GemvKernelSource kernel = generate_persistent_mlp_kernel(candidates.front());
      EXPECT_FALSE(compile_for_sm90(kernel).program.cubin.empty()) << candidates.front().to_string();
    }
  }
}

// What the persistent kernel refuses, and its candidates: 16 warps per SM, one shape name each.
TEST(GemvCompile, PersistentMlpCandidatesAndRefusals) {
  const GemvWeightFormat format = GemvWeightFormat::affine(4, 64, DType::bf16);
  const std::vector<PersistentMlpConfig> all =
      persistent_mlp_candidates(gemv_config(format, 1, 8960, 1536, GemvEpilogue::swiglu()),
                                gemv_config(format, 1, 1536, 8960, GemvEpilogue::residual_add()), 100);
  for (std::size_t i = 0; i < all.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j) EXPECT_NE(all[i].shape_name(), all[j].shape_name());
  }
  // The stage-blocks shapes come first (the lowering races the first few).
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(all.front().partition, PersistentPartition::stage_blocks);
  const std::vector<PersistentMlpConfig> candidates = warp_pieces(all);
  ASSERT_GE(candidates.size(), 2u);
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    EXPECT_LE(candidates[i].warps_per_block * candidates[i].blocks_per_multiprocessor, 16);
    EXPECT_EQ(generate_persistent_mlp_kernel(candidates[i]).grid_blocks,
              100u * static_cast<unsigned>(candidates[i].blocks_per_multiprocessor));
    for (std::size_t j = 0; j < i; ++j) EXPECT_NE(candidates[i].shape_name(), candidates[j].shape_name());
  }
  PersistentMlpConfig config = candidates.front();
  config.down.in_features = 1024;  // down must read gate/up's N = 8960 outputs
  EXPECT_THROW(generate_persistent_mlp_kernel(config), InputError);
  config = candidates.front();
  config.warps_per_block = 16;  // 16 x 2 blocks: 32 warps per SM leave 64 registers per thread
  EXPECT_THROW(generate_persistent_mlp_kernel(config), InputError);
  config = candidates.front();
  config.down.epilogue = GemvEpilogue::swiglu();  // down multiplies one matrix
  EXPECT_THROW(generate_persistent_mlp_kernel(config), InputError);
  // Half products: each phase alone validates (x fits the block's staging), but the pieces never run
  // the prologue that stages x as scaled f16, nor the spill that unscales their sums.
  for (GemvKernelConfig PersistentMlpConfig::*phase : {&PersistentMlpConfig::gate_up, &PersistentMlpConfig::down}) {
    config = candidates.front();
    (config.*phase).half_products = true;
    EXPECT_NO_THROW((config.*phase).validate()) << (config.*phase).to_string();
    EXPECT_THROW(generate_persistent_mlp_kernel(config), InputError) << (config.*phase).to_string();
  }
  // x carried by the down phase's batches: valid alone, but its x is the hidden state this launch writes.
  config = candidates.front();
  config.down.x_with_batch = true;
  EXPECT_NO_THROW(config.down.validate()) << config.down.to_string();
  EXPECT_THROW(generate_persistent_mlp_kernel(config), InputError) << config.down.to_string();
}

// x_with_batch: a double-buffered batch carries its x fragments. Raced first on the stages of at most one
// tile an SM (the small models' down and o-projections), affine, M <= 8, x as stored; never elsewhere
// (Llama-3-8B's 256-tile down spilled with it, M = 16 was slower); refused where it cannot apply; named
// apart; and the shapes raced compile for sm_90 within their registers.
// half_products: the twins the lowering races (gemv_valid_twins over the first register shapes of
// gemv_tuning_candidates, as gemv_stage_configs keeps them) compile for sm_90 at the decode stages
// of the three models, 4- and 8-bit, with and without the norm prologue, and so do their twins bounded
// to a one-wave grid's blocks an SM (gemv_one_wave_bound), their batches in registers (at most the
// 32 bytes expect_no_spills allows parked);
// the kernel names differ from the plain shapes' and the source says it multiplies in f16.
TEST(GemvCompile, HalfProductsTwinsOfTheDecodeStagesCompileWithoutSpills) {
  struct Stage {
    std::int64_t n, k;
    bool gated, normalized;
  };
  int compiled = 0, bounded_twins = 0;
  for (int bits : {4, 8}) {
    const GemvWeightFormat format = GemvWeightFormat::affine(bits, 64, DType::bf16);
    for (const Stage& stage : {Stage{14336, 4096, true, true}, Stage{14336, 4096, true, false}, Stage{4096, 14336, false, false},
                               Stage{8960, 1536, true, true}, Stage{1536, 8960, false, false}, Stage{2048, 8192, false, false}}) {
      GemvKernelConfig base = gemv_config(format, 1, stage.n, stage.k,
                                          stage.gated ? GemvEpilogue::swiglu() : GemvEpilogue::residual_add());
      if (stage.normalized) base.x_rms_norm_eps = 1e-5;
      std::vector<GemvKernelConfig> plain;
      for (const GemvKernelConfig& config : gemv_tuning_candidates(base)) {
        if (config.mainloop == GemvMainloop::register_batches && plain.size() < 3) plain.push_back(config);
      }
      const std::vector<GemvKernelConfig> twins = gemv_half_twins(plain);
      SCOPED_TRACE(fmt::format("{}-bit N={} K={}", bits, stage.n, stage.k));
      ASSERT_FALSE(twins.empty());
      for (const GemvKernelConfig& twin : twins) {
        EXPECT_TRUE(twin.half_products);
        const auto plain_shape = std::find_if(plain.begin(), plain.end(), [&](const GemvKernelConfig& config) {
          return config.warps_per_block == twin.warps_per_block && config.double_buffered == twin.double_buffered &&
                 config.iterations_in_flight == twin.iterations_in_flight;
        });
        ASSERT_NE(plain_shape, plain.end()) << twin.to_string();
        if (twin.resident_blocks_per_multiprocessor != plain_shape->resident_blocks_per_multiprocessor) ++bounded_twins;
      }
      for (const GemvKernelConfig& twin : twins) {
        GemvKernelConfig without = twin;
        without.half_products = false;
        const GemvKernelSource source = generate_gemv_kernel(twin);
        EXPECT_NE(source.kernel_name, generate_gemv_kernel(without).kernel_name);
        EXPECT_NE(source.source.find("constexpr bool kHalfProducts = true;"), std::string::npos);
        expect_no_spills(compile_for_sm90(source).log, twin.to_string());
        ++compiled;
      }
    }
  }
  EXPECT_GE(compiled, 10);
  // Llama-3-8B's gate/up w4 f2 batch half as stored, 896 blocks: bounded to the 7 blocks an SM of one
  // wave (4- and 8-bit), within the 32 bytes parked that expect_no_spills allows.
  EXPECT_EQ(bounded_twins, 2);
  GemvKernelConfig gate_up = gemv_config(GemvWeightFormat::affine(4, 64, DType::bf16), 1, 14336, 4096, GemvEpilogue::swiglu());
  gate_up.warps_per_block = 4;
  gate_up.iterations_in_flight = 2;
  gate_up.double_buffered = false;
  gate_up.half_products = true;
  EXPECT_EQ(gemv_one_wave_bound(gate_up, 132), 7);
  EXPECT_EQ(gemv_one_wave_bound(gate_up, 264), 0);  // 4 blocks an SM: loose, no twin
  gate_up.x_rms_norm_eps = 1e-5;
  EXPECT_EQ(gemv_one_wave_bound(gate_up, 132), 0);  // the norm prologue's registers: it spilled 40-80 bytes
  gate_up.x_rms_norm_eps.reset();
  gate_up.double_buffered = true;
  EXPECT_EQ(gemv_one_wave_bound(gate_up, 132), 0);  // two batches' registers: 152 bytes
  gate_up.double_buffered = false;
  gate_up.rows = 16;
  EXPECT_EQ(gemv_one_wave_bound(gate_up, 132), 0);  // the M > 8 shapes have bounds of their own
}

TEST(GemvCompile, XWithBatchIsRacedOnTheOneTileAnSmStagesOnly) {
  const GemvWeightFormat int4 = GemvWeightFormat::affine(4, 64, DType::bf16);
  auto carrying = [](const std::vector<GemvKernelConfig>& candidates) {
    return std::count_if(candidates.begin(), candidates.end(), [](const GemvKernelConfig& c) { return c.x_with_batch; });
  };
  struct Stage {
    std::int64_t n, k;
    int warps;  // of the shape carrying x, 0 for none
  };
  for (const Stage& stage : {Stage{1536, 8960, 14}, Stage{2048, 8192, 16}, Stage{1536, 1536, 12}, Stage{2048, 2048, 16},
                             Stage{4096, 14336, 0}, Stage{14336, 4096, 0}}) {
    const std::vector<GemvKernelConfig> candidates =
        gemv_tuning_candidates(gemv_config(int4, 1, stage.n, stage.k, GemvEpilogue::residual_add()));
    SCOPED_TRACE(fmt::format("N={} K={}", stage.n, stage.k));
    ASSERT_EQ(carrying(candidates), stage.warps > 0 ? 1 : 0);
    if (stage.warps == 0) continue;
    const GemvKernelConfig& first = candidates.front();
    EXPECT_TRUE(first.x_with_batch);
    EXPECT_EQ(first.warps_per_block, stage.warps);
    EXPECT_TRUE(first.double_buffered);
    EXPECT_NE(first.to_string().find(" x_with_batch"), std::string::npos);
    GemvKernelConfig plain = first;
    plain.x_with_batch = false;
    EXPECT_NE(generate_gemv_kernel(first).kernel_name, generate_gemv_kernel(plain).kernel_name);
    EXPECT_NE(generate_gemv_kernel(first).source.find("constexpr bool kXWithBatch = true;"), std::string::npos);
    expect_no_spills(compile_for_sm90(generate_gemv_kernel(first)).log, first.to_string());
  }
  // Not at 16 rows, not for dense weights, not where x is normalized.
  EXPECT_EQ(carrying(gemv_tuning_candidates(gemv_config(int4, 16, 1536, 8960, GemvEpilogue::residual_add()))), 0);
  EXPECT_EQ(carrying(gemv_tuning_candidates(
                gemv_config(GemvWeightFormat::dense(DType::bf16), 1, 1536, 8960, GemvEpilogue::residual_add()))),
            0);
  GemvKernelConfig normed = gemv_config(int4, 1, 1536, 8960, GemvEpilogue::residual_add());
  normed.x_rms_norm_eps = 1e-6;
  EXPECT_EQ(carrying(gemv_tuning_candidates(normed)), 0);
  // Refused where it cannot apply.
  GemvKernelConfig config = gemv_config(int4, 1, 1536, 8960, GemvEpilogue::residual_add());
  config.x_with_batch = true;
  config.double_buffered = false;
  EXPECT_THROW(config.validate(), InputError);
  config.double_buffered = true;
  EXPECT_NO_THROW(config.validate());
  config.x_rms_norm_eps = 1e-6;
  EXPECT_THROW(config.validate(), InputError);
  config.x_rms_norm_eps.reset();
  config.shared_stages = 3;
  EXPECT_THROW(config.validate(), InputError);
}

// The block timeline (gemv_timeline_source, gemv_timeline_benchmark): the stamps compile in every
// schedule a decode stage tunes (batches, double buffers, staged rings, split-K, the persistent MLP's
// phases, which include the same body), with and without the per-batch stamps, and they reach the
// code (the cubin differs from the plain one, in which they are empty functions); the entry takes the
// bound it is given, and a source without that kernel's entry is refused.
TEST(GemvCompile, TheBlockTimelineCompilesInEverySchedule) {
  const GemvWeightFormat int4 = GemvWeightFormat::affine(4, 64, DType::bf16);
  std::vector<GemvKernelSource> kernels;
  for (const GemvKernelConfig& base : {gemv_config(int4, 1, 14336, 4096, GemvEpilogue::swiglu()),
                                       gemv_config(int4, 1, 4096, 14336, GemvEpilogue::residual_add())}) {
    std::set<std::string> kinds;
    for (const GemvKernelConfig& config : gemv_tuning_candidates(base, 132)) {
      const std::string kind = fmt::format("{}{}{}", config.double_buffered, config.shared_stages >= 2, config.k_splits > 1);
      if (kinds.insert(kind).second) kernels.push_back(generate_gemv_kernel(config));
    }
  }
  GemvKernelConfig gate_up = gemv_config(int4, 1, 8960, 1536, GemvEpilogue::swiglu());
  gate_up.x_rms_norm_eps = 1e-5;
  const GemvKernelConfig down = gemv_config(int4, 1, 1536, 8960, GemvEpilogue::residual_add());
  for (const PersistentMlpConfig& config : persistent_mlp_candidates(gate_up, down, 132)) {
    if (config.partition == PersistentPartition::stage_blocks) {
      kernels.push_back(generate_persistent_mlp_kernel(config));
      break;
    }
  }
  ASSERT_GE(kernels.size(), 5u);
  for (const GemvKernelSource& kernel : kernels) {
    CompileOptions options;
    options.architecture = "sm_90";
    options.use_cache = false;
    const CompiledProgram plain = compile_cuda_program(kernel.source, kernel.kernel_name, options);
    const std::string source = gemv_timeline_source(kernel, 0x7f0000000000ull, 3);
    EXPECT_NE(source.find(fmt::format("__launch_bounds__({}, 3) {}(", kernel.block_threads, kernel.kernel_name)), std::string::npos)
        << kernel.kernel_name;
    for (bool batches : {false, true}) {
      if (batches) options.extra = {"-DMETILE_TIMELINE_BATCHES"};
      const CompiledProgram stamped = compile_cuda_program(source, kernel.kernel_name, options);
      EXPECT_EQ(stamped.log.find("warning"), std::string::npos) << kernel.kernel_name << ":\n" << stamped.log;
      EXPECT_NE(plain.cubin, stamped.cubin) << kernel.kernel_name;
    }
  }
  GemvKernelSource renamed = kernels.front();
  renamed.kernel_name += "_elsewhere";
  EXPECT_THROW(gemv_timeline_source(renamed, 0x7f0000000000ull, 3), InputError);
  EXPECT_THROW(gemv_timeline_source(kernels.front(), 0x7f0000000000ull, 0), InputError);
}
}  // namespace
}  // namespace metile
