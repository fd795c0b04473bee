// Where no CUDA driver or GPU exists (CI), every CUDA entry point fails with one clear
// NoCudaDevice("no CUDA device: ...") instead of crashing, and NVRTC still works.
#include <gtest/gtest.h>

#include <algorithm>
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

}  // namespace
}  // namespace metile
