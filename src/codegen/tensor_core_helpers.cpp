// The device helpers every tensor-core generator (the GEMV mainloops, the attention kernels)
// starts its kernel text with: the integer types, the m16n8k16 product in the activation dtype,
// the conversions between f32 and the activation dtype, a 32-bit component of a 16-byte vector and
// the programmatic-dependent-launch controls. One
// definition, so that the two kernel families cannot drift apart in how they call the tensor
// cores or wait for the kernel before them.
#include "codegen_internal.h"

namespace metile::codegen_detail {
namespace {

// Reads kHalf (true: f16, false: bf16), which every generator defines before it.
constexpr std::string_view tensor_core_helpers = R"CUDA(
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

// In f16 (Half) or bf16, whatever the activation dtype: mma_in<true> is the GEMV's half products.
template <bool Half>
__device__ __forceinline__ void mma_in(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  if constexpr (Half) {
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
__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  mma_in<kHalf>(c, a0, a1, a2, a3, b0, b1);
}

// One activation-dtype value (the low 16 bits of `bits16`) as f32, and an f32 rounded to nearest even
// into the activation dtype.
__device__ __forceinline__ float to_f32(u32 bits16) {
  if constexpr (kHalf) {
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"((u16)bits16));
    return value;
  } else {
    return __uint_as_float(bits16 << 16);
  }
}

__device__ __forceinline__ u16 from_f32(float value) {
  u16 bits16;
  if constexpr (kHalf) {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits16) : "f"(value));
  } else {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits16) : "f"(value));
  }
  return bits16;
}

__device__ __forceinline__ u32 component(const uint4& v, int index) {
  return index == 0 ? v.x : index == 1 ? v.y : index == 2 ? v.z : v.w;
}

// Programmatic dependent launch (gemv.h, attention_runtime.h): the next kernel of the stream may launch once every block
// of this one has started; this one reads what an earlier kernel wrote only after the wait. Both
// are no-ops when the kernel was not launched as a programmatic dependent.
__device__ __forceinline__ void allow_dependent_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_previous_kernel() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// The wait, returning `pointer` out of the same asm statement: loads through the result depend on
// it. x is read with `ld.global.nc` (read-only data to ptxas), which no "memory" clobber orders: on
// the H200 (device call 8) ptxas hoisted those loads above a plain wait, and a dependent GEMV read its
// x before the previous kernel had written it. (The asm is volatile since session 45, which keeps the
// compiler from moving a load out of its guard; it does not order the load after the wait for ptxas.)
template <class T>
__device__ __forceinline__ T* after_previous_kernel(T* pointer) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n\tmov.b64 %0, %0;" : "+l"(pointer) :: "memory");
#else
  asm volatile("mov.b64 %0, %0;" : "+l"(pointer) :: "memory");
#endif
  return pointer;
}
// `pointer` pinned after a wait already made (wait_for_previous_kernel, after_previous_kernel):
// loads through the result cannot be hoisted above it either.
template <class T>
__device__ __forceinline__ T* ordered_after_wait(T* pointer) {
  asm volatile("mov.b64 %0, %0;" : "+l"(pointer) :: "memory");
  return pointer;
}
)CUDA";

}  // namespace

std::string_view tensor_core_device_helpers() { return tensor_core_helpers; }

}  // namespace metile::codegen_detail
