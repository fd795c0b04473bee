// Where no CUDA driver or GPU exists (CI), every CUDA entry point fails with one clear
// NoCudaDevice("no CUDA device: ...") instead of crashing, and NVRTC still works.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <random>

#include "metile/cuda_runtime.h"
#include "metile_test_support.h"

namespace metile {
namespace {

class NoDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_unavailable_reason().empty()) GTEST_SKIP() << "a CUDA device is present";
  }
};

TEST_F(NoDevice, OpeningADeviceSaysWhy) {
  std::string reason;
  EXPECT_FALSE(CudaDevice::try_open(0, &reason).has_value());
  EXPECT_EQ(reason.rfind("no CUDA device: ", 0), 0u) << reason;
  try {
    CudaDevice::open();
    FAIL() << "expected NoCudaDevice";
  } catch (const NoCudaDevice& error) {
    EXPECT_EQ(std::string(error.what()), reason);
  }
}

TEST_F(NoDevice, EveryDevicePathThrowsNoCudaDevice) {
  EXPECT_THROW(DeviceBuffer(256), NoCudaDevice);
  EXPECT_THROW(CudaStream(), NoCudaDevice);
  EXPECT_THROW(CudaEvent(), NoCudaDevice);
  EXPECT_THROW(CublasLtMatmul(), NoCudaDevice);
  EXPECT_THROW(compile_cuda("extern \"C\" __global__ void k() {}", "k"), NoCudaDevice);
}

TEST(NvrtcWithoutDevice, ReportsItsVersion) {
  const std::string version = nvrtc_version();
  EXPECT_NE(version.find('.'), std::string::npos) << version;
}

// The L2 prefetch's pieces (no device needed): each range from its first 16-byte boundary to its
// last, in pieces of at most 64 KiB that cover it exactly, in order; a range shorter than its
// alignment gives none. Random ranges against a byte-by-byte count.
TEST(L2PrefetchPieces, CoverEachAlignedRangeInPiecesOfAtMost64KiB) {
  std::mt19937_64 generator(testing::test_seed("L2PrefetchPieces.CoverEachAlignedRangeInPiecesOfAtMost64KiB"));
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<DeviceByteRange> ranges;
    for (int r = 0; r < 3; ++r) {
      ranges.push_back({0x7f0000000000ULL + (generator() % (1u << 30)), generator() % (trial % 2 == 0 ? 64u : 700000u)});
    }
    const std::vector<DeviceByteRange> pieces = l2_prefetch_pieces(ranges);
    std::size_t next = 0;
    for (const DeviceByteRange& range : ranges) {
      const std::uint64_t begin = (range.address + 15) / 16 * 16, end = (range.address + range.bytes) / 16 * 16;
      std::uint64_t at = begin;
      while (at < end) {
        ASSERT_LT(next, pieces.size());
        EXPECT_EQ(pieces[next].address, at);
        EXPECT_EQ(pieces[next].address % 16, 0u);
        EXPECT_EQ(pieces[next].bytes % 16, 0u);
        EXPECT_GT(pieces[next].bytes, 0u);
        EXPECT_LE(pieces[next].bytes, 65536u);
        at += pieces[next].bytes;
        ++next;
      }
      EXPECT_EQ(at, std::max(begin, end));
    }
    EXPECT_EQ(next, pieces.size());
  }
  EXPECT_TRUE(l2_prefetch_pieces({{0x1001, 20}}).empty());  // no 16-byte block inside
}

// leading_share: random ranges of two or three launches, with and without periods, and budgets
// from nothing to more than all, against what its definition says of each piece: the launches the
// budget covers whole come whole; of the first it does not cover, every period's front keeps its
// share of the rest (rounded up to 16 bytes, at most the period); later launches give nothing; the
// kept bytes are the budget, give or take 16 a piece.
TEST(L2PrefetchLeadingShare, TakesTheSameShareFromTheFrontOfEveryPeriod) {
  std::mt19937_64 generator(testing::test_seed("L2PrefetchLeadingShare.TakesTheSameShareFromTheFrontOfEveryPeriod"));
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<DeviceByteRange> ranges;
    std::map<unsigned, std::uint64_t> launch_total;
    std::uint64_t address = 0x7f0000000000ULL;
    const int count = 1 + static_cast<int>(generator() % 5);
    for (int r = 0; r < count; ++r) {
      const std::uint64_t period = generator() % 3 == 0 ? 0 : 256 * (1 + generator() % 64);
      const std::uint64_t bytes = period > 0 ? period * (1 + generator() % 40) + (generator() % 2) * 512 : generator() % 100000;
      const auto launch = static_cast<unsigned>(generator() % 3);
      ranges.push_back({address, bytes, period, launch});
      launch_total[launch] += bytes;
      address += (bytes + 4095) / 4096 * 4096 + 4096;
    }
    std::uint64_t total = 0;
    for (const DeviceByteRange& range : ranges) total += range.bytes;
    const std::uint64_t budget = trial % 10 == 0 ? total + generator() % 1000 : generator() % (total + 1);
    const std::vector<DeviceByteRange> kept = leading_share(ranges, budget);

    // The launch the budget runs out in (none: all whole), and the share of it that is left.
    std::uint64_t left = budget;
    std::optional<unsigned> partial;
    for (const auto& [launch, bytes] : launch_total) {
      if (bytes > left) {
        partial = launch;
        break;
      }
      left -= bytes;
    }
    const double share = partial ? static_cast<double>(left) / static_cast<double>(launch_total[*partial]) : 1.0;
    std::uint64_t kept_bytes = 0;
    std::size_t next = 0;
    for (const auto& [launch, bytes] : launch_total) {
      if (partial && launch > *partial) break;
      for (const DeviceByteRange& range : ranges) {
        if (range.launch != launch) continue;
        const std::uint64_t period = range.period > 0 && range.period < range.bytes ? range.period : range.bytes;
        for (std::uint64_t at = 0; at < range.bytes; at += period) {
          const std::uint64_t length = std::min(period, range.bytes - at);
          const double exact = (partial && launch == *partial ? share : 1.0) * static_cast<double>(length);
          if (std::ceil(exact) == 0) continue;  // nothing of this period
          ASSERT_LT(next, kept.size()) << "trial " << trial;
          const DeviceByteRange& piece = kept[next++];
          EXPECT_EQ(piece.address, range.address + at) << "trial " << trial;
          EXPECT_EQ(piece.launch, launch);
          EXPECT_GE(static_cast<double>(piece.bytes), exact - 1e-6) << "trial " << trial;
          EXPECT_LE(piece.bytes, length);
          EXPECT_LT(static_cast<double>(piece.bytes), exact + 17) << "trial " << trial;
          kept_bytes += piece.bytes;
        }
      }
    }
    EXPECT_EQ(next, kept.size()) << "trial " << trial;
    if (budget >= total) {
      EXPECT_EQ(kept_bytes, total);
    } else {
      EXPECT_GE(kept_bytes + 1, budget) << "trial " << trial;
      EXPECT_LE(kept_bytes, budget + 17 * kept.size()) << "trial " << trial;
    }
  }
}

}  // namespace
}  // namespace metile
