// Devices, streams, events, device memory, launches and CUDA graphs over the dlopen'ed driver.
// Every driver call goes through check(), so a failure names the call and the error.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda_driver.h"
#include "metile/cuda_runtime.h"

namespace metile {

using cuda_driver::check;
using cuda_driver::driver;

std::string cuda_unavailable_reason() { return cuda_driver::driver_unavailable_reason(); }

std::string CudaDeviceInfo::architecture() const {
  return fmt::format("sm_{}{}", compute_capability_major, compute_capability_minor);
}

// ---------------------------------------------------------------- device
struct CudaDevice::State {
  CudaDeviceInfo info;
  CUdevice device = 0;
  CUcontext context = nullptr;

  ~State() {
    if (context != nullptr) driver().cuDevicePrimaryCtxRelease(device);
  }
};

std::optional<CudaDevice> CudaDevice::try_open(int ordinal, std::string* reason) {
  try {
    return open(ordinal);
  } catch (const NoCudaDevice& error) {
    if (reason != nullptr) *reason = error.what();
    return std::nullopt;
  }
}

CudaDevice CudaDevice::open(int ordinal) {
  const auto& api = driver();
  int count = 0;
  check(api.cuDeviceGetCount(&count), "cuDeviceGetCount");
  if (ordinal < 0 || ordinal >= count) {
    throw NoCudaDevice(fmt::format("no CUDA device: ordinal {} requested, {} device(s) present", ordinal, count));
  }
  auto state = std::make_shared<State>();
  check(api.cuDeviceGet(&state->device, ordinal), "cuDeviceGet");
  check(api.cuDevicePrimaryCtxRetain(&state->context, state->device), "cuDevicePrimaryCtxRetain");
  check(api.cuCtxSetCurrent(state->context), "cuCtxSetCurrent");

  CudaDeviceInfo& info = state->info;
  info.ordinal = ordinal;
  char name[256] = {};
  check(api.cuDeviceGetName(name, sizeof name - 1, state->device), "cuDeviceGetName");
  info.name = name;
  auto attribute = [&](CUdevice_attribute which, const char* what) {
    int value = 0;
    check(api.cuDeviceGetAttribute(&value, which, state->device), fmt::format("cuDeviceGetAttribute({})", what));
    return value;
  };
  info.multiprocessor_count = attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "multiprocessor count");
  info.compute_capability_major = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "compute capability");
  info.compute_capability_minor = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "compute capability");
  info.l2_cache_bytes = attribute(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, "L2 size");
  info.shared_memory_per_block_optin =
      attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, "shared memory per block opt-in");
  check(api.cuDriverGetVersion(&info.driver_version), "cuDriverGetVersion");
  std::size_t total = 0;
  check(api.cuDeviceTotalMem(&total, state->device), "cuDeviceTotalMem");
  info.total_memory_bytes = static_cast<std::int64_t>(total);
  return CudaDevice(std::move(state));
}

const CudaDeviceInfo& CudaDevice::info() const { return state_->info; }

void CudaDevice::make_current() const { check(driver().cuCtxSetCurrent(state_->context), "cuCtxSetCurrent"); }

// ---------------------------------------------------------------- streams and events
// A blocking stream (not CU_STREAM_NON_BLOCKING): the synchronous copies and memsets of DeviceBuffer
// run on the legacy stream, and only a blocking stream is ordered after them. (A non-blocking one let
// kernels race a still-running poison memset on large buffers.) Streams that only ever capture are
// non-blocking (capture_only).
CudaStream::CudaStream() { check(driver().cuStreamCreate(&stream_, CU_STREAM_DEFAULT), "cuStreamCreate"); }

CudaStream CudaStream::capture_only() {
  CudaStream stream(nullptr);
  check(driver().cuStreamCreate(&stream.stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  return stream;
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) driver().cuStreamDestroy(stream_);
}

CudaStream::CudaStream(CudaStream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)), programmatic_dependent_launch_(other.programmatic_dependent_launch_) {}

CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  if (this != &other) {
    if (stream_ != nullptr) driver().cuStreamDestroy(stream_);
    stream_ = std::exchange(other.stream_, nullptr);
    programmatic_dependent_launch_ = other.programmatic_dependent_launch_;
  }
  return *this;
}

void CudaStream::synchronize() const { check(driver().cuStreamSynchronize(stream_), "cuStreamSynchronize"); }

void CudaStream::wait(const CudaEvent& event) const {
  check(driver().cuStreamWaitEvent(stream_, event.handle(), 0), "cuStreamWaitEvent");
}

CudaEvent::CudaEvent() { check(driver().cuEventCreate(&event_, CU_EVENT_DEFAULT), "cuEventCreate"); }

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) driver().cuEventDestroy(event_);
}

CudaEvent::CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr) driver().cuEventDestroy(event_);
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

void CudaEvent::record(const CudaStream& stream) {
  check(driver().cuEventRecord(event_, stream.handle()), "cuEventRecord");
}

void CudaEvent::synchronize() const { check(driver().cuEventSynchronize(event_), "cuEventSynchronize"); }

float CudaEvent::elapsed_ms(const CudaEvent& start, const CudaEvent& end) {
  float milliseconds = 0;
  check(driver().cuEventElapsedTime(&milliseconds, start.event_, end.event_), "cuEventElapsedTime");
  return milliseconds;
}

namespace {

constexpr std::uint64_t kL2PrefetchPiece = 64 * 1024;

constexpr std::string_view kL2PrefetchSource = R"CUDA(
extern "C" __global__ void __launch_bounds__(32) metile_l2_prefetch(const unsigned long long* __restrict__ pieces,
                                                                  unsigned count) {
  const unsigned piece = blockIdx.x * 32 + threadIdx.x;
  if (piece >= count) return;
  const unsigned long long address = pieces[2 * piece];
  const unsigned bytes = (unsigned)pieces[2 * piece + 1];
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(address), "r"(bytes) : "memory");
}
)CUDA";

// One 64 KiB piece a block: 256 threads x 16 vectors of 16 bytes, all requested before any is used,
// folded into one word a thread that is stored only if it matches a constant (so the loads stay).
constexpr std::string_view kDeviceReadSource = R"CUDA(
extern "C" __global__ void __launch_bounds__(256) metile_device_read(const unsigned long long* __restrict__ pieces,
                                                                   unsigned* sink) {
  const unsigned long long address = pieces[2 * blockIdx.x];
  const unsigned vectors = (unsigned)pieces[2 * blockIdx.x + 1] / 16;
  uint4 v[16];
#pragma unroll
  for (int u = 0; u < 16; ++u) {
    const unsigned i = threadIdx.x + u * 256;
    v[u] = make_uint4(0u, 0u, 0u, 0u);
    if (i < vectors) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(address + 16ull * i));
    }
  }
  unsigned folded = 0;
#pragma unroll
  for (int u = 0; u < 16; ++u) folded ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  if (folded == 0x9E3779B9u) *sink = folded;
}
)CUDA";

// One thread: CudaDecodeSession::continue_greedy's link between two steps (GreedyStepLink).
constexpr std::string_view kGreedyStepLinkSource = R"CUDA(
extern "C" __global__ void __launch_bounds__(32) metile_greedy_step_link(const int* __restrict__ next_token,
                                                                       int* token_ids, int* positions,
                                                                       volatile int* chosen_slot) {
  if (threadIdx.x != 0) return;
  const int token = *next_token;
  token_ids[0] = token;
  positions[0] = positions[0] + 1;
  *chosen_slot = token;
}
)CUDA";

// DeviceTopLogits: one block of 1024 threads. A logit's key orders as the logit does (sign flipped for
// the positives, every bit for the negatives; -0 first made +0, so the two are one key). Each pass
// counts, among the keys whose higher bits match the prefix found so far, the next 8 bits' values;
// warp 0 then finds the value in which the top_k-th largest key lies (counting from the top) and
// extends the prefix. bf16 logits need two passes (their keys' low 16 bits are all 0 or all 1: a
// 16-bit prefix already holds exactly the keys equal to the k-th), f32 and f16 four. The last pass
// gathers every key at or above the prefix, in no particular order (the host sorts the few it gets).
// A thread reads 16 consecutive logits a round, all loads before any use (a round trip per round, not
// per logit). Each warp counts into its own histogram, and the lanes of a warp that count the same value
// add once (__match_any_sync): the first pass's values are the keys' top bits, a few values for a whole
// row. (The histogram a warp was meant to end the warps' contention on those few values; it measured no
// faster than one for the block: 0.526 -> 0.519 ms a sampled Llama-3.2-1B token, H100, session 41. The
// kernel's ~90 us a 128K row lie elsewhere, not yet profiled.)
constexpr std::string_view kTopLogitsSource = R"CUDA(
__device__ __forceinline__ float metile_logit_at(const void* row, int dtype, int index) {
  if (dtype == 1) return __uint_as_float((unsigned)((const unsigned short*)row)[index] << 16);
  if (dtype == 2) {
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(((const unsigned short*)row)[index]));
    return value;
  }
  return ((const float*)row)[index];
}
__device__ __forceinline__ unsigned metile_logit_key(float value) {
  const unsigned bits = __float_as_uint(value + 0.0f);  // -0 + 0 is +0
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
constexpr int kLogitsARound = 16;
// Calls visit(first, values) with each round of this thread's logits: the 16 from `first` (0 past the row),
// every load issued before any is used. Rounds are uniform across a warp (the loop runs while the warp's
// first logit is in the row), so every lane takes part in a warp-wide call inside `visit`.
template <class Visit>
__device__ __forceinline__ void metile_for_each_round(const void* row, int dtype, int vocab, Visit visit) {
  const int lane = (int)(threadIdx.x & 31u);
  const int stride = (int)blockDim.x * kLogitsARound;
  for (int start = ((int)threadIdx.x - lane) * kLogitsARound; start < vocab; start += stride) {
    const int first = start + lane * kLogitsARound;
    float values[kLogitsARound];
#pragma unroll
    for (int u = 0; u < kLogitsARound; ++u) values[u] = first + u < vocab ? metile_logit_at(row, dtype, first + u) : 0.0f;
    visit(first, values);
  }
}
// dtype: 0 f32, 1 bf16, 2 f16. out: [0] count, [1] NaN seen, then capacity (token, f32 logit) pairs.
extern "C" __global__ void __launch_bounds__(1024) metile_top_logits(const void* __restrict__ row, int dtype, int vocab,
                                                                   unsigned top_k, unsigned capacity,
                                                                   unsigned* __restrict__ out) {
  __shared__ unsigned warp_histograms[32][256];
  __shared__ unsigned histogram[256];
  __shared__ unsigned prefix_found, rank_left, gathered;
  __shared__ int nan_seen;
  if (threadIdx.x == 0) {
    prefix_found = 0;
    rank_left = top_k;
    gathered = 0;
    nan_seen = 0;
  }
  const unsigned lane = threadIdx.x & 31u;
  const int passes = dtype == 1 ? 2 : 4;
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = 24 - 8 * pass;
    const unsigned higher = pass == 0 ? 0u : 0xFFFFFFFFu << (shift + 8);
    for (int slot = threadIdx.x; slot < 32 * 256; slot += blockDim.x) (&warp_histograms[0][0])[slot] = 0;
    __syncthreads();
    const unsigned prefix = prefix_found;
    metile_for_each_round(row, dtype, vocab, [&](int first, const float (&values)[kLogitsARound]) {
#pragma unroll
      for (int u = 0; u < kLogitsARound; ++u) {
        const bool inside = first + u < vocab;
        if (inside && values[u] != values[u]) nan_seen = 1;
        const unsigned key = metile_logit_key(values[u]);
        const bool counted = inside && values[u] == values[u] && (key & higher) == prefix;
        const unsigned digit = counted ? (key >> shift) & 255u : 256u;
        const unsigned peers = __match_any_sync(0xFFFFFFFFu, digit);
        if (counted && (unsigned)(__ffs(peers) - 1) == lane) {
          atomicAdd(&warp_histograms[threadIdx.x >> 5][digit], (unsigned)__popc(peers));
        }
      }
    });
    __syncthreads();
    for (int digit = threadIdx.x; digit < 256; digit += blockDim.x) {
      unsigned total = 0;
      for (int warp = 0; warp < (int)(blockDim.x >> 5); ++warp) total += warp_histograms[warp][digit];
      histogram[digit] = total;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l counts the digits 255 - 8 l down to 248 - 8 l; a scan over the lanes counts from the top.
      const unsigned rank = rank_left;  // read here, written after the __syncwarp below
      unsigned mine = 0;
      for (unsigned j = 0; j < 8; ++j) mine += histogram[255u - 8u * lane - j];
      unsigned through = mine;
      for (unsigned offset = 1; offset < 32; offset <<= 1) {
        const unsigned other = __shfl_up_sync(0xFFFFFFFFu, through, offset);
        if (lane >= offset) through += other;
      }
      __syncwarp();  // every lane's read of rank_left happens before the one write below (shuffles order no memory)
      unsigned above = through - mine;
      if (above < rank && rank <= through) {
        for (unsigned j = 0; j < 8; ++j) {
          const unsigned digit = 255u - 8u * lane - j;
          if (above + histogram[digit] >= rank) {
            prefix_found = prefix | (digit << shift);
            rank_left = rank - above;
            break;
          }
          above += histogram[digit];
        }
      }
    }
    __syncthreads();
  }
  const unsigned threshold = prefix_found;
  metile_for_each_round(row, dtype, vocab, [&](int first, const float (&values)[kLogitsARound]) {
#pragma unroll
    for (int u = 0; u < kLogitsARound; ++u) {
      if (first + u >= vocab || values[u] != values[u] || metile_logit_key(values[u]) < threshold) continue;
      const unsigned slot = atomicAdd(&gathered, 1u);
      if (slot < capacity) {
        out[2 + 2 * slot] = (unsigned)(first + u);
        out[3 + 2 * slot] = __float_as_uint(values[u]);
      }
    }
  });
  __syncthreads();
  if (threadIdx.x == 0) {
    out[0] = gathered;
    out[1] = nan_seen ? 1u : 0u;
  }
}
)CUDA";

// The runtime's own small kernels, compiled and loaded once a context (the first caller's) and shared.
// Keyed by the current context's ID, which the driver never gives twice in a process: a module belongs
// to the context it was loaded in, and the device's primary context, released by its last CudaDevice,
// is a new one when the next opens it (a kernel cached by name alone then failed every launch with
// CUDA_ERROR_INVALID_HANDLE: a test that opened the device after another had closed it).
// The map is never destroyed: at exit its modules' contexts may be gone (each device closed, or the
// driver torn down first), and unloading a module through a dead context's handle is not defined.
// A closed context's entries stay unused (its ID never comes again): a few kernels a reopening.
std::shared_ptr<const CompiledKernel> compiled_once(std::string_view source, std::string_view name) {
  static std::mutex mutex;
  static auto& kernels =
      *new std::map<std::pair<unsigned long long, std::string>, std::shared_ptr<const CompiledKernel>, std::less<>>;
  CUcontext context = nullptr;
  check(driver().cuCtxGetCurrent(&context), "cuCtxGetCurrent");
  if (context == nullptr) throw std::logic_error(fmt::format("{}: no current CUDA context", name));
  unsigned long long context_id = 0;
  check(driver().cuCtxGetId(context, &context_id), "cuCtxGetId");
  std::lock_guard lock(mutex);
  std::shared_ptr<const CompiledKernel>& kernel = kernels[{context_id, std::string(name)}];
  if (!kernel) kernel = std::make_shared<const CompiledKernel>(compile_cuda(source, name));
  return kernel;
}

std::shared_ptr<const CompiledKernel> l2_prefetch_kernel() {
  return compiled_once(kL2PrefetchSource, "metile_l2_prefetch");
}

std::shared_ptr<const CompiledKernel> device_read_kernel() {
  return compiled_once(kDeviceReadSource, "metile_device_read");
}

std::shared_ptr<const CompiledKernel> greedy_step_link_kernel() {
  return compiled_once(kGreedyStepLinkSource, "metile_greedy_step_link");
}

}  // namespace

GreedyStepLink::GreedyStepLink(std::size_t slots) : kernel_(greedy_step_link_kernel()), slots_(slots) {
  if (slots == 0) throw std::invalid_argument("GreedyStepLink: no slot");
  void* host = nullptr;
  check(driver().cuMemHostAlloc(&host, slots * sizeof(std::int32_t), CU_MEMHOSTALLOC_DEVICEMAP),
        fmt::format("cuMemHostAlloc({} bytes)", slots * sizeof(std::int32_t)));
  host_ = std::shared_ptr<std::int32_t>(static_cast<std::int32_t*>(host), [](std::int32_t* pointer) { driver().cuMemFreeHost(pointer); });
  CUdeviceptr device = 0;
  check(driver().cuMemHostGetDevicePointer(&device, host, 0), "cuMemHostGetDevicePointer");
  device_address_ = device;
}

void GreedyStepLink::enqueue(const CudaStream& stream, std::uint64_t next_token, std::uint64_t token_ids,
                             std::uint64_t positions, std::size_t slot) const {
  const std::uint64_t chosen_slot = device_address_ + (slot % slots_) * sizeof(std::int32_t);
  launch(*kernel_, Dim3{1}, Dim3{32}, 0, stream, next_token, token_ids, positions, chosen_slot);
}

std::int32_t GreedyStepLink::chosen(std::size_t slot) const {
  // Written by the device: read through a volatile pointer, not from a value the compiler kept.
  return static_cast<const volatile std::int32_t*>(host_.get())[slot % slots_];
}

DeviceTopLogits::DeviceTopLogits(std::size_t capacity)
    : kernel_(compiled_once(kTopLogitsSource, "metile_top_logits")),
      capacity_(capacity),
      output_((2 + 2 * capacity) * sizeof(std::uint32_t)),
      host_(2 + 2 * capacity) {
  if (capacity == 0 || capacity > (std::size_t{1} << 24)) {
    throw std::invalid_argument(fmt::format("DeviceTopLogits: capacity {} must be 1..2^24", capacity));
  }
}

void DeviceTopLogits::enqueue(const CudaStream& stream, std::uint64_t row, DType dtype, std::int64_t vocab,
                              std::int64_t top_k) {
  if (vocab < 1 || vocab > (std::int64_t{1} << 30) || top_k < 1 || top_k > vocab) {
    throw std::invalid_argument(fmt::format("DeviceTopLogits: top_k {} of a row of {}", top_k, vocab));
  }
  const int code = dtype == DType::f32 ? 0 : dtype == DType::bf16 ? 1 : dtype == DType::f16 ? 2 : -1;
  if (code < 0) throw std::invalid_argument(fmt::format("DeviceTopLogits: logits of {}", dtype_name(dtype)));
  launch(*kernel_, Dim3{1}, Dim3{1024}, 0, stream, row, code, static_cast<int>(vocab), static_cast<unsigned>(top_k),
         static_cast<unsigned>(capacity_), output_.address());
  // The count and the pairs a selection without many ties fills; result() fetches the rest if needed.
  copied_pairs_ = std::min<std::size_t>(capacity_, static_cast<std::size_t>(top_k) + 256);
  output_.copy_to_host_async(std::as_writable_bytes(std::span<std::uint32_t>(host_).first(2 + 2 * copied_pairs_)), stream);
}

DeviceTopLogits::Result DeviceTopLogits::result() {
  Result result;
  result.count = host_[0];
  result.nan = host_[1] != 0;
  const auto count = static_cast<std::size_t>(result.count);
  if (result.nan || count > capacity_) return result;
  if (count > copied_pairs_) {  // more ties at the k-th than the copy held
    const std::size_t offset = (2 + 2 * copied_pairs_) * sizeof(std::uint32_t);
    output_.copy_to_host(std::as_writable_bytes(std::span<std::uint32_t>(host_).subspan(2 + 2 * copied_pairs_,
                                                                                         2 * (count - copied_pairs_))),
                         offset);
  }
  // Gathered in no order: sorted by token, each logit with its token.
  std::vector<std::pair<std::uint32_t, std::uint32_t>> kept;
  for (std::size_t slot = 0; slot < count; ++slot) kept.emplace_back(host_[2 + 2 * slot], host_[3 + 2 * slot]);
  std::sort(kept.begin(), kept.end());
  for (const auto& [token, bits] : kept) {
    float logit = 0;
    std::memcpy(&logit, &bits, sizeof logit);
    result.tokens.push_back(static_cast<std::int32_t>(token));
    result.logits.push_back(logit);
  }
  return result;
}

std::vector<std::pair<std::string_view, std::string_view>> runtime_kernel_sources() {
  return {{"metile_l2_prefetch", kL2PrefetchSource},
          {"metile_device_read", kDeviceReadSource},
          {"metile_greedy_step_link", kGreedyStepLinkSource},
          {"metile_top_logits", kTopLogitsSource}};
}

std::vector<DeviceByteRange> l2_prefetch_pieces(const std::vector<DeviceByteRange>& ranges) {
  std::vector<DeviceByteRange> pieces;
  for (const DeviceByteRange& range : ranges) {
    const std::uint64_t begin = (range.address + 15) / 16 * 16;
    const std::uint64_t end = (range.address + range.bytes) / 16 * 16;
    for (std::uint64_t at = begin; at < end; at += kL2PrefetchPiece) pieces.push_back({at, std::min(kL2PrefetchPiece, end - at)});
  }
  return pieces;
}

std::vector<DeviceByteRange> leading_share(const std::vector<DeviceByteRange>& ranges, std::uint64_t bytes) {
  std::map<unsigned, std::uint64_t> launch_bytes;
  for (const DeviceByteRange& range : ranges) launch_bytes[range.launch] += range.bytes;
  std::vector<DeviceByteRange> kept;
  std::uint64_t left = bytes;
  for (const auto& [launch, total] : launch_bytes) {
    const double share = total <= left ? 1.0 : static_cast<double>(left) / static_cast<double>(total);
    // The share of `length` bytes, rounded up to 16, at most `length`.
    auto lead = [share](std::uint64_t length) {
      const auto wanted = static_cast<std::uint64_t>(std::ceil(share * static_cast<double>(length)));
      return std::min(length, (wanted + 15) / 16 * 16);
    };
    for (const DeviceByteRange& range : ranges) {
      if (range.launch != launch) continue;
      const std::uint64_t period = range.period > 0 && range.period < range.bytes ? range.period : range.bytes;
      for (std::uint64_t at = 0; at < range.bytes; at += period) {
        const std::uint64_t length = lead(std::min(period, range.bytes - at));
        if (length > 0) kept.push_back({range.address + at, length, 0, launch});
      }
    }
    if (total > left) break;
    left -= total;
  }
  return kept;
}

DevicePieces::DevicePieces(const std::vector<DeviceByteRange>& ranges) {
  std::vector<std::uint64_t> flat;
  for (const DeviceByteRange& piece : l2_prefetch_pieces(ranges)) {
    flat.push_back(piece.address);
    flat.push_back(piece.bytes);
    bytes += piece.bytes;
  }
  count = static_cast<unsigned>(flat.size() / 2);
  if (count > 0) pairs = std::make_shared<const DeviceBuffer>(DeviceBuffer::from_vector<std::uint64_t>(flat));
}

L2Prefetch::L2Prefetch(const std::vector<DeviceByteRange>& ranges) : pieces_(ranges) {
  if (pieces_.count > 0) kernel_ = l2_prefetch_kernel();
}

void L2Prefetch::enqueue(const CudaStream& stream) const {
  if (pieces_.count == 0) return;
  launch(*kernel_, Dim3{(pieces_.count + 31) / 32, 1, 1}, Dim3{32, 1, 1}, 0, stream, *pieces_.pairs, pieces_.count);
}

DeviceRead::DeviceRead(const std::vector<DeviceByteRange>& ranges) : pieces_(ranges) {
  if (pieces_.count == 0) return;
  kernel_ = device_read_kernel();
  sink_ = std::make_shared<const DeviceBuffer>(64);
}

void DeviceRead::enqueue(const CudaStream& stream) const {
  if (pieces_.count == 0) return;
  launch(*kernel_, Dim3{pieces_.count, 1, 1}, Dim3{256, 1, 1}, 0, stream, *pieces_.pairs, *sink_);
}

void profile_on_stream(const CudaStream& stream, const std::function<void(const CudaStream&)>& work) {
  stream.synchronize();
  check(driver().cuProfilerStart(), "cuProfilerStart");
  work(stream);
  stream.synchronize();
  check(driver().cuProfilerStop(), "cuProfilerStop");
}

double time_on_stream_ms(const CudaStream& stream, const std::function<void(const CudaStream&)>& work, int warmup,
                         int repetitions, int samples) {
  if (repetitions < 1 || samples < 1) throw InputError("time_on_stream_ms: repetitions and samples must be >= 1");
  for (int i = 0; i < warmup; ++i) work(stream);
  CudaEvent start;
  CudaEvent end;
  std::vector<double> per_call;
  for (int sample = 0; sample < samples; ++sample) {
    start.record(stream);
    for (int i = 0; i < repetitions; ++i) work(stream);
    end.record(stream);
    end.synchronize();
    per_call.push_back(CudaEvent::elapsed_ms(start, end) / repetitions);
  }
  std::sort(per_call.begin(), per_call.end());
  return per_call[per_call.size() / 2];
}

double measure_copy_bandwidth_gbps(const CudaStream& stream, std::size_t bytes) {
  DeviceBuffer source(bytes), target(bytes);
  source.fill_bytes(0x3C, &stream);
  const double ms =
      time_on_stream_ms(stream, [&](const CudaStream& s) { target.copy_from_device(source, bytes, &s); }, 2, 5, 5);
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
}

// ---------------------------------------------------------------- device memory
DeviceBuffer::DeviceBuffer(std::size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  CUdeviceptr address = 0;
  check(driver().cuMemAlloc(&address, bytes), fmt::format("cuMemAlloc({} bytes)", bytes));
  address_ = address;
}

DeviceBuffer::~DeviceBuffer() {
  if (owns_memory()) driver().cuMemFree(address_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : address_(std::exchange(other.address_, 0)),
      size_(std::exchange(other.size_, 0)),
      owned_(std::exchange(other.owned_, true)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (owns_memory()) driver().cuMemFree(address_);
    address_ = std::exchange(other.address_, 0);
    size_ = std::exchange(other.size_, 0);
    owned_ = std::exchange(other.owned_, true);
  }
  return *this;
}

DeviceBuffer DeviceBuffer::borrow(std::uint64_t address, std::size_t bytes) {
  DeviceBuffer buffer;
  buffer.address_ = address;
  buffer.size_ = bytes;
  buffer.owned_ = false;
  return buffer;
}

DeviceBuffer DeviceBuffer::from_host(std::span<const std::byte> bytes) {
  DeviceBuffer buffer(bytes.size());
  buffer.copy_from_host(bytes);
  return buffer;
}

DeviceBuffer DeviceBuffer::from_tensor(const HostTensor& tensor) { return from_host(tensor.bytes()); }

void DeviceBuffer::copy_from_host(std::span<const std::byte> bytes, std::size_t offset) {
  if (offset + bytes.size() > size_) {
    throw CudaError(fmt::format("DeviceBuffer::copy_from_host: {} bytes at offset {} exceed the {}-byte buffer",
                                bytes.size(), offset, size_));
  }
  if (bytes.empty()) return;
  check(driver().cuMemcpyHtoD(address_ + offset, bytes.data(), bytes.size()),
        fmt::format("cuMemcpyHtoD({} bytes)", bytes.size()));
}

void DeviceBuffer::copy_to_host(std::span<std::byte> bytes, std::size_t offset) const {
  if (offset + bytes.size() > size_) {
    throw CudaError(fmt::format("DeviceBuffer::copy_to_host: {} bytes at offset {} exceed the {}-byte buffer",
                                bytes.size(), offset, size_));
  }
  if (bytes.empty()) return;
  check(driver().cuMemcpyDtoH(bytes.data(), address_ + offset, bytes.size()),
        fmt::format("cuMemcpyDtoH({} bytes)", bytes.size()));
}

void DeviceBuffer::copy_from_host_async(std::span<const std::byte> bytes, const CudaStream& stream,
                                        std::size_t offset) {
  if (offset + bytes.size() > size_) {
    throw CudaError(fmt::format("DeviceBuffer::copy_from_host_async: {} bytes at offset {} exceed the {}-byte buffer",
                                bytes.size(), offset, size_));
  }
  if (bytes.empty()) return;
  check(driver().cuMemcpyHtoDAsync(address_ + offset, bytes.data(), bytes.size(), stream.handle()),
        fmt::format("cuMemcpyHtoDAsync({} bytes)", bytes.size()));
}

void DeviceBuffer::copy_to_host_async(std::span<std::byte> bytes, const CudaStream& stream, std::size_t offset) const {
  if (offset + bytes.size() > size_) {
    throw CudaError(fmt::format("DeviceBuffer::copy_to_host_async: {} bytes at offset {} exceed the {}-byte buffer",
                                bytes.size(), offset, size_));
  }
  if (bytes.empty()) return;
  check(driver().cuMemcpyDtoHAsync(bytes.data(), address_ + offset, bytes.size(), stream.handle()),
        fmt::format("cuMemcpyDtoHAsync({} bytes)", bytes.size()));
}

void DeviceBuffer::copy_from_device(const DeviceBuffer& source, std::size_t bytes, const CudaStream* stream) {
  if (bytes > size_ || bytes > source.size_) {
    throw CudaError(fmt::format("DeviceBuffer::copy_from_device: {} bytes exceed a buffer ({} and {} bytes)", bytes,
                                source.size_, size_));
  }
  if (bytes == 0) return;
  check(driver().cuMemcpyDtoDAsync(address_, source.address_, bytes, stream ? stream->handle() : nullptr),
        fmt::format("cuMemcpyDtoDAsync({} bytes)", bytes));
  // The legacy stream's own synchronization, not the context's: another thread may be capturing a graph, and a
  // cuCtxSynchronize beside a capture is refused (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) and invalidates it.
  if (stream == nullptr) check(driver().cuStreamSynchronize(nullptr), "cuStreamSynchronize (the legacy stream)");
}

void DeviceBuffer::fill_bytes(std::uint8_t value, const CudaStream* stream) {
  if (size_ == 0) return;
  if (stream != nullptr) {
    check(driver().cuMemsetD8Async(address_, value, size_, stream->handle()), "cuMemsetD8Async");
  } else {
    check(driver().cuMemsetD8(address_, value, size_), "cuMemsetD8");
  }
}

void DeviceBuffer::upload(const HostTensor& tensor) {
  if (tensor.bytes().size() != size_) {
    throw CudaError(fmt::format("DeviceBuffer::upload: tensor {} has {} bytes, the buffer {}",
                                tensor.spec().to_string(), tensor.bytes().size(), size_));
  }
  copy_from_host(tensor.bytes());
}

HostTensor DeviceBuffer::download(const TensorSpec& spec) const {
  HostTensor tensor(spec);
  copy_to_host(tensor.bytes());
  return tensor;
}

// ---------------------------------------------------------------- launches
void KernelArguments::add_bytes(const void* data, std::size_t bytes) {
  // Each value gets whole 8-byte slots, so it stays aligned for any scalar type up to 8 bytes.
  const std::size_t slots = (bytes + 7) / 8;
  offsets_.push_back(storage_.size());
  storage_.resize(storage_.size() + slots, 0);
  std::memcpy(storage_.data() + offsets_.back(), data, bytes);
}

std::vector<void*> KernelArguments::pointers() const {
  std::vector<void*> result;
  result.reserve(offsets_.size() + 1);
  for (std::size_t offset : offsets_) result.push_back(const_cast<std::uint64_t*>(storage_.data() + offset));
  result.push_back(nullptr);
  return result;
}

void launch_raw(const CompiledKernel& kernel, Dim3 grid, Dim3 block, unsigned shared_memory_bytes,
                const CudaStream& stream, void** argument_pointers) {
  if (!kernel) throw CudaError("launch: the kernel is not loaded");
  check(driver().cuLaunchKernel(kernel.function(), grid.x, grid.y, grid.z, block.x, block.y, block.z,
                                shared_memory_bytes, stream.handle(), argument_pointers, nullptr),
        fmt::format("cuLaunchKernel({}, grid {}x{}x{}, block {}x{}x{}, {} bytes shared)", kernel.name(), grid.x,
                    grid.y, grid.z, block.x, block.y, block.z, shared_memory_bytes));
}

void launch(const CompiledKernel& kernel, Dim3 grid, Dim3 block, unsigned shared_memory_bytes,
            const CudaStream& stream, const KernelArguments& arguments) {
  std::vector<void*> pointers = arguments.pointers();
  launch_raw(kernel, grid, block, shared_memory_bytes, stream, pointers.data());
}

void launch_programmatic_dependent(const CompiledKernel& kernel, Dim3 grid, Dim3 block, unsigned shared_memory_bytes,
                                   const CudaStream& stream, const KernelArguments& arguments) {
  if (!kernel) throw CudaError("launch: the kernel is not loaded");
  std::vector<void*> pointers = arguments.pointers();
  CUlaunchAttribute attribute{};
  attribute.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attribute.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig config{};
  config.gridDimX = grid.x;
  config.gridDimY = grid.y;
  config.gridDimZ = grid.z;
  config.blockDimX = block.x;
  config.blockDimY = block.y;
  config.blockDimZ = block.z;
  config.sharedMemBytes = shared_memory_bytes;
  config.hStream = stream.handle();
  config.attrs = &attribute;
  config.numAttrs = 1;
  check(driver().cuLaunchKernelEx(&config, kernel.function(), pointers.data(), nullptr),
        fmt::format("cuLaunchKernelEx({}, programmatic stream serialization, grid {}x{}x{}, block {}x{}x{})",
                    kernel.name(), grid.x, grid.y, grid.z, block.x, block.y, block.z));
}

void launch_waiting_kernel(const CompiledKernel& kernel, Dim3 grid, Dim3 block, unsigned shared_memory_bytes,
                           const CudaStream& stream, const KernelArguments& arguments, bool dependent) {
  if (dependent || stream.programmatic_dependent_launch()) {
    launch_programmatic_dependent(kernel, grid, block, shared_memory_bytes, stream, arguments);
  } else {
    launch(kernel, grid, block, shared_memory_bytes, stream, arguments);
  }
}

// ---------------------------------------------------------------- CUDA graphs
// The capture runs on a non-blocking stream of its own, not on `stream`: the legacy stream waits on every blocking
// stream, and a legacy-stream operation of another thread (a DeviceBuffer upload) that would wait on a capturing one
// fails (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) and invalidates the capture. Nothing in the graph depends on when it
// was captured, so `stream` lends only its launch settings.
CudaGraph CudaGraph::capture(const CudaStream& stream, const std::function<void(const CudaStream&)>& work) {
  const auto& api = driver();
  CudaStream capturing = CudaStream::capture_only();
  capturing.set_programmatic_dependent_launch(stream.programmatic_dependent_launch());
  check(api.cuStreamBeginCapture(capturing.handle(), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
  CUgraph graph = nullptr;
  try {
    work(capturing);
  } catch (...) {
    // End the capture so that the stream can go, then report the original failure.
    api.cuStreamEndCapture(capturing.handle(), &graph);
    if (graph != nullptr) api.cuGraphDestroy(graph);
    throw;
  }
  // A failed end may still hand back a graph (the documentation promises none only for an invalidated capture).
  if (const CUresult ended = api.cuStreamEndCapture(capturing.handle(), &graph); ended != CUDA_SUCCESS) {
    if (graph != nullptr) api.cuGraphDestroy(graph);
    check(ended, "cuStreamEndCapture");
  }
  CUgraphExec exec = nullptr;
  const CUresult instantiated = api.cuGraphInstantiateWithFlags(&exec, graph, 0);
  api.cuGraphDestroy(graph);
  check(instantiated, "cuGraphInstantiateWithFlags");
  CudaGraph result;
  result.exec_ = std::shared_ptr<CUgraphExec_st>(exec, [](CUgraphExec_st* handle) {
    driver().cuGraphExecDestroy(handle);
  });
  return result;
}

void CudaGraph::replay(const CudaStream& stream) const {
  if (!exec_) throw CudaError("CudaGraph::replay: the graph was not captured");
  check(driver().cuGraphLaunch(exec_.get(), stream.handle()), "cuGraphLaunch");
}

}  // namespace metile
