// The device helpers every tensor-core generator (the GEMV mainloops, the attention kernels)
// starts its kernel text with: the integer types, the m16n8k16 product in the activation dtype
// and a 32-bit component of a 16-byte vector. One definition, so that the two kernel families
// cannot drift apart in how they call the tensor cores.
#include "codegen_internal.h"

namespace metile::codegen_detail {
namespace {

// Reads kHalf (true: f16, false: bf16), which every generator defines before it.
constexpr std::string_view tensor_core_helpers = R"CUDA(
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  if constexpr (kHalf) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ u32 component(const uint4& v, int index) {
  return index == 0 ? v.x : index == 1 ? v.y : index == 2 ? v.z : v.w;
}
)CUDA";

}  // namespace

std::string_view tensor_core_device_helpers() { return tensor_core_helpers; }

}  // namespace metile::codegen_detail
