// Where no CUDA driver or GPU exists (CI), every CUDA entry point fails with one clear
// NoCudaDevice("no CUDA device: ...") instead of crashing, and NVRTC still works.
#include <gtest/gtest.h>

#include "metile/cuda_runtime.h"

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

}  // namespace
}  // namespace metile
