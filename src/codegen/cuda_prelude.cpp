// The device-side helper library every generated row and layout kernel starts with (the op
// table's device functions, cuda_elementwise_helpers(), follow it). Kept as one string so a
// kernel's source is self-contained (its hash is the cache key), and written once so that
// generated kernels stay short and readable.
#include <fmt/core.h>

#include <cmath>

#include "codegen_internal.h"

namespace metile::codegen_detail {

std::string_view cuda_device_prelude() {
  static constexpr std::string_view prelude = R"CUDA(#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace metile_device {

__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }

// Every value is computed in f32 and rounded to its dtype when stored, the way the CPU
// reference rounds each op's output.
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(signed char v) { return static_cast<float>(v); }
__device__ __forceinline__ float to_float(unsigned char v) { return static_cast<float>(v); }
__device__ __forceinline__ float to_float(int v) { return static_cast<float>(v); }
__device__ __forceinline__ float to_float(unsigned int v) { return static_cast<float>(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
// Integers: round to nearest and saturate (NaN becomes 0).
template <> __device__ __forceinline__ signed char from_float<signed char>(float v) {
  return static_cast<signed char>(fminf(fmaxf(rintf(v), -128.0f), 127.0f));
}
template <> __device__ __forceinline__ unsigned char from_float<unsigned char>(float v) {
  return static_cast<unsigned char>(fminf(fmaxf(rintf(v), 0.0f), 255.0f));
}
template <> __device__ __forceinline__ int from_float<int>(float v) { return __float2int_rn(v); }
template <> __device__ __forceinline__ unsigned int from_float<unsigned int>(float v) { return __float2uint_rn(v); }

template <typename T> __device__ __forceinline__ float round_to(float v) { return to_float(from_float<T>(v)); }

template <typename T, int N> struct alignas(sizeof(T) * N) Vector { T lane[N]; };

// The plain integer type of a vector's size, for the cache-hinted load/store intrinsics.
template <int Bytes> struct RawBits;
template <> struct RawBits<16> { using type = uint4; };
template <> struct RawBits<8> { using type = uint2; };
template <> struct RawBits<4> { using type = unsigned int; };
template <> struct RawBits<2> { using type = unsigned short; };
template <> struct RawBits<1> { using type = unsigned char; };

// Streaming (evict-first) accesses for data touched once, so it does not push reused data (weights)
// out of L2; plain accesses otherwise.
template <bool kStream, typename V>
__device__ __forceinline__ V load_hinted(const V* pointer) {
  if constexpr (kStream) {
    using Raw = typename RawBits<sizeof(V)>::type;
    const Raw raw = __ldcs(reinterpret_cast<const Raw*>(pointer));
    V value;
    memcpy(&value, &raw, sizeof(V));
    return value;
  } else {
    return *pointer;
  }
}
template <bool kStream, typename V>
__device__ __forceinline__ void store_hinted(V* pointer, const V& value) {
  if constexpr (kStream) {
    using Raw = typename RawBits<sizeof(V)>::type;
    Raw raw;
    memcpy(&raw, &value, sizeof(V));
    __stcs(reinterpret_cast<Raw*>(pointer), raw);
  } else {
    *pointer = value;
  }
}

// Waits here for `value` (a load issued just before, with others): a load whose only use is under
// a branch would otherwise be issued inside it, one round trip after what the branch waits on.
template <typename V>
__device__ __forceinline__ void complete_here(const V& value) {
  using Raw = typename RawBits<sizeof(V)>::type;
  Raw raw;
  memcpy(&raw, &value, sizeof(V));
  if constexpr (sizeof(V) == 2) {
    asm volatile("" ::"h"(raw));
  } else if constexpr (sizeof(V) == 4) {
    asm volatile("" ::"r"(raw));
  } else if constexpr (sizeof(V) == 1) {
    asm volatile("" ::"r"(static_cast<unsigned int>(raw)));
  } else if constexpr (sizeof(V) == 8) {
    asm volatile("" ::"r"(raw.x), "r"(raw.y));
  } else {
    asm volatile("" ::"r"(raw.x), "r"(raw.y), "r"(raw.z), "r"(raw.w));
  }
}

// Loads elements [col, col + N) of a row of length L; lanes outside the row (or an invalid row) read 0.
// The vector path needs row_start + col aligned to the vector: the generator guarantees it.
template <typename T, int N, int L, bool kStream = false>
__device__ __forceinline__ void load_vector(const T* __restrict__ row_start, int col, bool row_valid, float (&out)[N]) {
  if (row_valid && col + N <= L) {
    const Vector<T, N> v = load_hinted<kStream>(reinterpret_cast<const Vector<T, N>*>(row_start + col));
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = to_float(v.lane[e]);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = (row_valid && col + e < L) ? to_float(row_start[col + e]) : 0.0f;
  }
}

template <typename T, int N>
__device__ __forceinline__ void load_scalar(const T* __restrict__ pointer, float (&out)[N]) {
  const float value = to_float(*pointer);
#pragma unroll
  for (int e = 0; e < N; ++e) out[e] = value;
}

template <typename T, int N, int L, bool kStream = false>
__device__ __forceinline__ void store_vector(T* __restrict__ row_start, int col, bool row_valid, const float (&in)[N]) {
  if (row_valid && col + N <= L) {
    Vector<T, N> v;
#pragma unroll
    for (int e = 0; e < N; ++e) v.lane[e] = from_float<T>(in[e]);
    store_hinted<kStream>(reinterpret_cast<Vector<T, N>*>(row_start + col), v);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if (row_valid && col + e < L) row_start[col + e] = from_float<T>(in[e]);
    }
  }
}

// A reduction: State, identity(), apply(state, element) folds one element in, combine(a, b) merges two
// partial states, shuffle_xor / shuffle move a state between lanes.
template <typename T>
struct SumIn {
  using State = T;
  static __device__ __forceinline__ T identity() { return T(0); }
  static __device__ __forceinline__ T apply(T a, T b) { return a + b; }
  static __device__ __forceinline__ T combine(T a, T b) { return a + b; }
  static __device__ __forceinline__ T shuffle_xor(T v, int offset) { return __shfl_xor_sync(0xffffffffu, v, offset); }
  static __device__ __forceinline__ T shuffle(T v, int lane) { return __shfl_sync(0xffffffffu, v, lane); }
};
using SumOp = SumIn<float>;
using SumF64Op = SumIn<double>;  // layer_norm's statistics, taken in f64 as the CPU reference takes them
struct MaxOp {
  using State = float;
  static __device__ __forceinline__ float identity() { return negative_infinity(); }
  static __device__ __forceinline__ float apply(float a, float b) { return fmaxf(a, b); }
  static __device__ __forceinline__ float combine(float a, float b) { return fmaxf(a, b); }
  static __device__ __forceinline__ float shuffle_xor(float v, int offset) { return __shfl_xor_sync(0xffffffffu, v, offset); }
  static __device__ __forceinline__ float shuffle(float v, int lane) { return __shfl_sync(0xffffffffu, v, lane); }
};

// a - b, and -inf for -inf - (-inf) (exp of it: 0, a state or score at -inf weighs nothing), the
// convention of the reduction laws' evaluator (src/discovery/law_evaluator.cpp): merging two
// identity states gives the identity, a row of -inf ends at l = 0 (0 / 0 = NaN) and a row holding
// +inf at NaN, as the two-pass softmax gives. Finite operands: a - b.
__device__ __forceinline__ float difference(float a, float b) { return a == b && a == negative_infinity() ? a : a - b; }

// Reduces v over the THREADS consecutive threads that own one row; every one of them gets the result.
// Up to a warp: shuffles only (sub-warp groups never mix, as xor offsets stay below THREADS);
// the block is a whole number of warps, so every lane named in the full mask exists.
// Above a warp (one row per block): each warp's result through shared memory (room for one
// Op::State per warp), then a second shuffle.
template <typename Op, int THREADS>
__device__ __forceinline__ typename Op::State row_reduce(typename Op::State v, void* scratch_memory) {
  using State = typename Op::State;
#pragma unroll
  for (int offset = (THREADS < 32 ? THREADS : 32) / 2; offset > 0; offset /= 2) {
    v = Op::combine(v, Op::shuffle_xor(v, offset));
  }
  if constexpr (THREADS > 32) {
    State* scratch = static_cast<State*>(scratch_memory);
    constexpr int kWarps = THREADS / 32;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < kWarps ? scratch[lane] : Op::identity();
#pragma unroll
    for (int offset = kWarps / 2; offset > 0; offset /= 2) {
      v = Op::combine(v, Op::shuffle_xor(v, offset));
    }
    v = Op::shuffle(v, 0);  // lanes >= kWarps combined only identities: take lane 0's total
    __syncthreads();  // scratch is reused by the next reduction
  }
  return v;
}

}  // namespace metile_device
)CUDA";
  return prelude;
}

std::string sanitize_identifier(std::string_view text) {
  std::string result;
  for (char c : text) {
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
    result += keep ? c : '_';
  }
  if (result.empty()) result = "unnamed";
  return result;
}

std::string_view cuda_argmax_helpers() {
  static constexpr std::string_view helpers = R"CUDA(
namespace metile_device {

// argmax's rule (argmax_index, include/metile/graph.h): NaN above every number, ties to the lower index.
__device__ __forceinline__ bool argmax_beats(float value, int index, float best, int best_index) {
  const bool value_nan = value != value;
  const bool best_nan = best != best;
  if (value_nan || best_nan) return value_nan && (!best_nan || index < best_index);
  return value > best || (value == best && index < best_index);
}

// The winner of a warp's (best, best_index) pairs, in every lane.
__device__ __forceinline__ void argmax_warp(float& best, int& best_index) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, best, offset);
    const int other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
    if (argmax_beats(other, other_index, best, best_index)) {
      best = other;
      best_index = other_index;
    }
  }
}

}  // namespace metile_device
)CUDA";
  return helpers;
}

std::string describe_node(const ComputeGraph& graph, const Node& node) {
  std::string text;
  for (std::size_t i = 0; i < node.outputs.size(); ++i) {
    text += (i ? ", " : "") + graph.value(node.outputs[i]).name;
  }
  text += " = " + node.op + "(";
  for (std::size_t i = 0; i < node.inputs.size(); ++i) text += (i ? ", " : "") + graph.value(node.inputs[i]).name;
  text += ")";
  return comment_text(text);
}

std::string comment_text(std::string_view text) {
  std::string safe;
  for (const char c : text) {
    if (c == '\\' || static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      safe += ' ';
      continue;
    }
    // "*/", "/*" and "??" come out with a space between: no delimiter and no trigraph is spelt.
    const char before = safe.empty() ? ' ' : safe.back();
    if ((before == '*' && c == '/') || (before == '/' && c == '*') || (before == '?' && c == '?')) safe += ' ';
    safe += c;
  }
  return safe;
}

}  // namespace metile::codegen_detail
