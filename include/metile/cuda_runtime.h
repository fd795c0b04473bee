// metile CUDA runtime: the thin, checked layer every GPU path stands on (docs/architecture.md,
// "src/runtime/cuda/"). libcuda, NVRTC and cuBLASLt are loaded with dlopen on first use, so
// binaries start and CPU paths work where no driver or toolkit exists; CUDA paths then throw
// NoCudaDevice ("no CUDA device: ...") or CudaError ("NVRTC could not be loaded: ...").
// NVRTC compiles CUDA C++ for the device's architecture, with an on-disk cache.
//
// Every failing CUDA, NVRTC or cuBLASLt call throws CudaError naming the call and the error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "metile/codegen.h"
#include "metile/graph.h"

// The driver API's handle types, forward-declared exactly as cuda.h declares them so that
// this header needs no CUDA include path.
struct CUstream_st;
struct CUevent_st;
struct CUfunc_st;
struct CUmod_st;
struct CUgraphExec_st;
struct CUctx_st;

namespace metile {

// A CUDA, NVRTC or cuBLASLt call failed: "cuMemAlloc_v2(67108864 bytes): CUDA_ERROR_OUT_OF_MEMORY (out of memory)".
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// No driver, no GPU, or the driver refused to start: "no CUDA device: libcuda.so.1 not found (...)".
// GPU tests catch it (or ask cuda_unavailable_reason()) and skip.
class NoCudaDevice : public CudaError {
 public:
  using CudaError::CudaError;
};

// Empty when a CUDA device can be opened, else the reason it cannot ("libcuda.so.1 not found: ...",
// "cuInit: CUDA_ERROR_NO_DEVICE ..."). Cheap after the first call.
std::string cuda_unavailable_reason();

struct CudaDeviceInfo {
  int ordinal = 0;
  std::string name;                              // "NVIDIA H200"
  int multiprocessor_count = 0;                  // SMs
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  int driver_version = 0;                        // cuDriverGetVersion, e.g. 13000
  std::int64_t l2_cache_bytes = 0;
  std::int64_t shared_memory_per_block_optin = 0;  // the most a block may ask for after opting in
  std::int64_t total_memory_bytes = 0;
  std::string architecture() const;              // "sm_90"
};

// One GPU and its primary context, current on the thread that opened it (call make_current()
// on other threads). Copies share the context; the last copy releases it.
class CudaDevice {
 public:
  // nullopt where no driver or device exists; *reason (if given) receives why.
  static std::optional<CudaDevice> try_open(int ordinal = 0, std::string* reason = nullptr);
  // Throws NoCudaDevice("no CUDA device: <reason>").
  static CudaDevice open(int ordinal = 0);

  const CudaDeviceInfo& info() const;
  void make_current() const;
  // No context-wide synchronize: cuCtxSynchronize is refused, and fatal to the capture, while another thread
  // captures a graph. Synchronize a stream or an event.

 private:
  struct State;
  explicit CudaDevice(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

// ---------------------------------------------------------------- streams and events
class CudaEvent;

class CudaStream {
 public:
  CudaStream();  // a new stream in the current context, ordered with DeviceBuffer's synchronous copies
  // A non-blocking stream for work that is only ever captured (CudaGraph::capture's own; a side stream a capture
  // forks onto): a blocking stream that joins a capture makes another thread's synchronous copies fail.
  static CudaStream capture_only();
  ~CudaStream();
  CudaStream(CudaStream&& other) noexcept;
  CudaStream& operator=(CudaStream&& other) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  CUstream_st* handle() const { return stream_; }
  void synchronize() const;
  // Work enqueued after this waits for `event`'s recorded work (across streams; inside a capture,
  // an edge of the graph: how a capture forks onto a second stream and joins back).
  void wait(const CudaEvent& event) const;

  // When set, kernels that read their predecessors' writes only after griddepcontrol.wait (the
  // generated GEMVs, LoadedGemv::launch; the attention kernels, FlashAttention::enqueue) launch on
  // this stream as programmatic dependents of the
  // kernel before them: their prologue and first weight loads overlap that kernel's tail.
  // Executable sets it while capturing its replay graph (ExecutableOptions).
  void set_programmatic_dependent_launch(bool enabled) { programmatic_dependent_launch_ = enabled; }
  bool programmatic_dependent_launch() const { return programmatic_dependent_launch_; }

 private:
  explicit CudaStream(std::nullptr_t) {}
  CUstream_st* stream_ = nullptr;
  bool programmatic_dependent_launch_ = false;
};

class CudaEvent {
 public:
  CudaEvent();  // timing enabled
  ~CudaEvent();
  CudaEvent(CudaEvent&& other) noexcept;
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void record(const CudaStream& stream);
  void synchronize() const;
  // Milliseconds between two recorded, completed events.
  static float elapsed_ms(const CudaEvent& start, const CudaEvent& end);
  CUevent_st* handle() const { return event_; }

 private:
  CUevent_st* event_ = nullptr;
};

// Times `work` on `stream` with events: warm-up calls, then `repetitions` calls; returns the
// median of per-call milliseconds over `samples` samples (each sample = repetitions calls / repetitions).
double time_on_stream_ms(const CudaStream& stream, const std::function<void(const CudaStream&)>& work,
                         int warmup = 3, int repetitions = 10, int samples = 5);

// Runs `work` on `stream` between cuProfilerStart and cuProfilerStop, synchronized on both sides:
// under `ncu --profile-from-start off` only these kernels are profiled (bench-model's
// METILE_PROFILE_DECODE_STEP=1 profiles one replay of the decode step this way).
void profile_on_stream(const CudaStream& stream, const std::function<void(const CudaStream&)>& work);

// The device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written (a copy of
// `bytes` moves 2·bytes): the ceiling memory-bound kernels are reported against.
double measure_copy_bandwidth_gbps(const CudaStream& stream, std::size_t bytes = std::size_t{1} << 30);

// ---------------------------------------------------------------- device memory
// Owns one device allocation (cuMemAlloc: 256-byte aligned). Move-only; freed on destruction.
// A borrowed buffer (borrow()) is a view of memory someone else owns: same interface, never freed.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes);  // needs a current context (CudaDevice::open)
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  static DeviceBuffer from_host(std::span<const std::byte> bytes);
  static DeviceBuffer from_tensor(const HostTensor& tensor);
  template <class T>
  static DeviceBuffer from_vector(std::span<const T> values) {
    return from_host(std::as_bytes(values));
  }
  // A view of `bytes` bytes at `address` (a CUdeviceptr the caller keeps alive); never freed here.
  static DeviceBuffer borrow(std::uint64_t address, std::size_t bytes);

  std::uint64_t address() const { return address_; }  // a CUdeviceptr
  std::size_t size_bytes() const { return size_; }
  bool empty() const { return size_ == 0; }
  bool owns_memory() const { return owned_ && address_ != 0; }

  // Synchronous copies (ranges checked against the allocation; CudaError when out of range).
  void copy_from_host(std::span<const std::byte> bytes, std::size_t offset = 0);
  void copy_to_host(std::span<std::byte> bytes, std::size_t offset = 0) const;
  // Asynchronous on `stream` (ordered with the stream's other work): the host bytes must stay valid
  // until the stream has passed the copy. From pageable memory the driver stages the upload, so the
  // caller may reuse its bytes at once after the call. A copy to pageable memory (a std::vector) is
  // not asynchronous to the host: the driver returns only once it has completed, after the stream's
  // work before it; only page-locked memory (cuMemHostAlloc, as GreedyStepLink's) returns at once.
  void copy_from_host_async(std::span<const std::byte> bytes, const CudaStream& stream, std::size_t offset = 0);
  void copy_to_host_async(std::span<std::byte> bytes, const CudaStream& stream, std::size_t offset = 0) const;
  void copy_from_device(const DeviceBuffer& source, std::size_t bytes, const CudaStream* stream = nullptr);
  void fill_bytes(std::uint8_t value, const CudaStream* stream = nullptr);  // e.g. poison outputs with 0xFF (NaN)

  void upload(const HostTensor& tensor);              // size must match
  HostTensor download(const TensorSpec& spec) const;  // spec.bytes() must fit
  template <class T>
  std::vector<T> to_vector() const {
    std::vector<T> values(size_ / sizeof(T));
    copy_to_host(std::as_writable_bytes(std::span<T>(values)));
    return values;
  }

 private:
  std::uint64_t address_ = 0;
  std::size_t size_ = 0;
  bool owned_ = true;
};

// A tensor on the device: its spec and the buffer holding it in the dtype's bit layout.
struct DeviceTensor {
  TensorSpec spec;
  DeviceBuffer buffer;

  DeviceTensor() = default;
  explicit DeviceTensor(TensorSpec spec_) : spec(std::move(spec_)), buffer(static_cast<std::size_t>(spec.bytes())) {}
  static DeviceTensor from_host(const HostTensor& tensor) {
    DeviceTensor result;
    result.spec = tensor.spec();
    result.buffer = DeviceBuffer::from_tensor(tensor);
    return result;
  }
  HostTensor to_host() const { return buffer.download(spec); }
  std::uint64_t address() const { return buffer.address(); }
};

// ---------------------------------------------------------------- NVRTC compilation
struct CompileOptions {
  std::string architecture;           // "sm_90"; empty: the current device's, else sm_90
  std::vector<std::string> extra;     // more NVRTC options, e.g. "-DROWS=4"
  bool use_cache = true;
};

// The product of one NVRTC compile: a cubin for `architecture`.
struct CompiledProgram {
  std::string kernel_name;
  std::string architecture;
  std::string cubin;       // binary
  std::string log;         // NVRTC's log (warnings)
  std::string cache_key;   // hex hash of source, architecture, options and NVRTC version
  bool from_cache = false;
  bool rebuilt_corrupt_cache_entry = false;  // a damaged cache file was found, recompiled and replaced
};

// Kernels are looked up by name, so generated sources declare them extern "C" __global__.
// NVRTC only: works without a driver or GPU (CI compiles every generated kernel this way).
// Throws CudaError with the compile log on a compile error. Uses the on-disk cache
// (kernel_cache_directory()): entries carry a checksum header; a corrupt entry is rebuilt.
CompiledProgram compile_cuda_program(std::string_view source, std::string_view kernel_name,
                                     const CompileOptions& options = {});

// One sm_90 machine instruction of a compiled kernel (16 bytes, read from the cubin; there is no
// disassembler in the toolchain CI installs): the opcode is the low 12 bits, bits 9..11 of it say
// whether an operand is a register, a constant or an immediate. Tests and gemv_sass_benchmark read
// kernels' code this way (the opcode numbers were identified on ptxas 13.0 probes).
struct CubinInstruction {
  std::uint64_t low = 0, high = 0;
  unsigned opcode() const { return static_cast<unsigned>(low & 0xFFFu); }
  unsigned base() const { return opcode() & 0x1FFu; }  // without the operand-kind bits
};
// The instructions of section `.text.<kernel>` of an ELF64 cubin; std::runtime_error when absent.
std::vector<CubinInstruction> cubin_kernel_instructions(const std::string& cubin, const std::string& kernel);

std::string nvrtc_version();  // "13.0"
// The architecture of the context current on this thread ("sm_90"); sm_90 where there is none.
// Threads that compile for the device in parallel take it from the thread that owns the context.
std::string current_device_architecture();
// The SMs of the device of the context current on this thread (needs one).
int current_device_multiprocessors();
// The most shared memory a block of that device may ask for after opting in (bytes; needs a context).
int current_device_shared_memory_per_block_optin();
// A stable 128-bit content hash as 32 hex digits (cache keys, dispatch keys); not cryptographic.
std::string stable_hash_hex(std::string_view bytes);
// Where metile keeps what it caches (compiled kernels, dispatch decisions): $METILE_CACHE_DIR if
// set, else $HOME/.cache/metile; without HOME, the account's home from the password database, else
// /tmp/metile-cache-UID where that folder is this user's alone (else a fresh private folder).
std::string cache_directory();
// A cache file read whole (kernel entries, dispatch.json): nullopt where none exists, and also, with
// `unusable` set, where something else is in its place: a directory, a FIFO or device (never opened:
// opening a FIFO with no writer blocks, /dev/zero has no end), a file over maximum_bytes, or one that
// cannot be read. Callers take unusable for a corrupt entry: ignored, and replaced by the next write.
std::optional<std::string> read_cache_file(const std::filesystem::path& path, std::uint64_t maximum_bytes,
                                           bool& unusable);
// cache_directory()/kernels.
std::string kernel_cache_directory();
// The cache's file for a key (tests corrupt it on purpose).
std::string kernel_cache_path(std::string_view cache_key);

// A loaded kernel function (its module stays loaded while any copy lives).
class CompiledKernel {
 public:
  CompiledKernel() = default;
  static CompiledKernel load(const CompiledProgram& program);  // needs a current context
  CUfunc_st* function() const { return function_; }
  const std::string& name() const { return name_; }
  bool from_cache() const { return from_cache_; }
  int registers_per_thread() const;
  // How many blocks of `block_threads` threads the driver keeps resident per SM (registers, shared
  // memory and the kernel's launch bounds counted): what a grid whose blocks wait for each other needs.
  int max_active_blocks_per_multiprocessor(int block_threads, std::size_t dynamic_shared_bytes) const;
  // Allows dynamic shared memory above 48 KiB.
  void set_max_dynamic_shared_memory(int bytes) const;
  // The share of the SM's L1/shared storage this kernel prefers as shared memory, in percent (-1:
  // the driver's choice). An SM changes its split only when drained, so kernels that are to overlap
  // (programmatic dependent launch) want the same one.
  void set_preferred_shared_memory_carveout(int percent) const;
  explicit operator bool() const { return function_ != nullptr; }

 private:
  std::shared_ptr<CUmod_st> module_;
  CUfunc_st* function_ = nullptr;
  std::string name_;
  bool from_cache_ = false;
};

// Compile (or take from the cache) and load for the current device.
CompiledKernel compile_cuda(std::string_view source, std::string_view kernel_name, CompileOptions options = {});

// ---------------------------------------------------------------- launches
struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

// Arguments built at run time (for generated kernels whose argument list is data).
// Each value is copied and kept aligned to its own size.
class KernelArguments {
 public:
  void add_pointer(std::uint64_t device_address) { add_bytes(&device_address, sizeof device_address); }
  void add_pointer(const DeviceBuffer& buffer) { add_pointer(buffer.address()); }
  void add_int32(std::int32_t value) { add_bytes(&value, sizeof value); }
  void add_int64(std::int64_t value) { add_bytes(&value, sizeof value); }
  void add_float(float value) { add_bytes(&value, sizeof value); }
  std::size_t size() const { return offsets_.size(); }
  // The void*[] cuLaunchKernel takes; valid until the next add.
  std::vector<void*> pointers() const;

 private:
  void add_bytes(const void* data, std::size_t bytes);
  std::vector<std::uint64_t> storage_;  // 8-byte slots keep every value aligned
  std::vector<std::size_t> offsets_;
};

void launch(const CompiledKernel& kernel, Dim3 grid, Dim3 block, unsigned shared_memory_bytes,
            const CudaStream& stream, const KernelArguments& arguments);
void launch_raw(const CompiledKernel& kernel, Dim3 grid, Dim3 block, unsigned shared_memory_bytes,
                const CudaStream& stream, void** argument_pointers);
// A programmatic dependent launch (cuLaunchKernelEx with programmatic stream serialization): the
// kernel may start before the previous kernel on the stream has finished, once every block of that
// one has executed griddepcontrol.launch_dependents (or exited); the kernel itself must execute
// griddepcontrol.wait before it touches anything the previous kernel writes or reads. Capturable
// into a CUDA graph (the edge becomes a programmatic one).
void launch_programmatic_dependent(const CompiledKernel& kernel, Dim3 grid, Dim3 block, unsigned shared_memory_bytes,
                                   const CudaStream& stream, const KernelArguments& arguments);
// A kernel that touches memory only after griddepcontrol.wait (the generated GEMVs, the attention
// kernels): launched as a programmatic dependent when `dependent` is set or the stream asks for it
// (CudaStream::set_programmatic_dependent_launch), plainly otherwise.
void launch_waiting_kernel(const CompiledKernel& kernel, Dim3 grid, Dim3 block, unsigned shared_memory_bytes,
                           const CudaStream& stream, const KernelArguments& arguments, bool dependent = false);

namespace detail {
inline std::uint64_t kernel_argument(const DeviceBuffer& buffer) { return buffer.address(); }
template <class T>
  requires std::is_trivially_copyable_v<T>
T kernel_argument(const T& value) {
  return value;
}
}  // namespace detail

// Typed launch: DeviceBuffers pass their address; other arguments pass by value, so their C++
// type must match the kernel parameter's (int vs int64_t, float vs double).
template <class... Args>
void launch(const CompiledKernel& kernel, Dim3 grid, Dim3 block, unsigned shared_memory_bytes,
            const CudaStream& stream, const Args&... args) {
  auto values = std::make_tuple(detail::kernel_argument(args)...);
  std::apply(
      [&](auto&... value) {
        void* pointers[] = {static_cast<void*>(&value)..., nullptr};
        launch_raw(kernel, grid, block, shared_memory_bytes, stream, pointers);
      },
      values);
}

// ---------------------------------------------------------------- CUDA graphs
// Captures the work a callable enqueues on the stream it is given, instantiates it once, replays it many times.
// Work inside must not allocate or synchronize (the usual capture rules), and must enqueue on the stream it is
// given: capture() hands it a capture_only stream of its own with `stream`'s launch settings.
class CudaGraph {
 public:
  CudaGraph() = default;
  static CudaGraph capture(const CudaStream& stream, const std::function<void(const CudaStream&)>& work);
  void replay(const CudaStream& stream) const;
  explicit operator bool() const { return exec_ != nullptr; }

 private:
  std::shared_ptr<CUgraphExec_st> exec_;
};

// Byte ranges of device memory requested into the L2 (cp.async.bulk.prefetch.L2, sm_90): nothing is
// written, nothing waits for the lines; work that reads the ranges later finds them in the L2 or on
// their way. The ranges are cut into pieces of at most 64 KiB, one thread each (16-byte aligned
// starts; a range's last bytes past a multiple of 16 are left out).
struct DeviceByteRange {
  std::uint64_t address = 0;
  std::uint64_t bytes = 0;
  // > 0: the range is a run of pieces of this many bytes, each read front to back by one block
  // while the others read theirs (a GEMV's 16-row tiles, K in order: gemv_weight_layout.cpp), so
  // the bytes met first are the same leading share of every piece (leading_share). 0: none known.
  std::uint64_t period = 0;
  // Which launch of the work that streams it reads it: 0 the first (a two-stage GEMV's gate/up),
  // 1 the next (its down projection), ...
  unsigned launch = 0;
};
// The pieces an L2Prefetch requests for `ranges`: each range from its first 16-byte boundary to
// its last, cut into pieces of at most 64 KiB (CPU only: tested without a device).
std::vector<DeviceByteRange> l2_prefetch_pieces(const std::vector<DeviceByteRange>& ranges);

// About `bytes` of `ranges`, those the work reading them meets first: the ranges of its launches in
// order while `bytes` covers them whole; of the first launch it does not cover, the same leading
// share of each of that launch's ranges (what is left / their total), taken from the front of each
// of a range's periods when it has one, else from the range's front, each share rounded up to 16
// bytes and at most its piece; nothing of later launches. What an L2 prefetch of part of a GEMV's
// weights requests, so that every block finds its first iterations in the L2 (CPU only: tested
// without a device).
std::vector<DeviceByteRange> leading_share(const std::vector<DeviceByteRange>& ranges, std::uint64_t bytes);

// The pieces of `ranges` (l2_prefetch_pieces) on the device as (address, bytes) pairs, for a kernel
// that takes one piece a thread or a block.
struct DevicePieces {
  explicit DevicePieces(const std::vector<DeviceByteRange>& ranges);
  std::shared_ptr<const DeviceBuffer> pairs;  // none when there is no piece
  unsigned count = 0;
  std::uint64_t bytes = 0;
};

class L2Prefetch {
 public:
  explicit L2Prefetch(const std::vector<DeviceByteRange>& ranges);
  void enqueue(const CudaStream& stream) const;
  std::uint64_t bytes() const { return pieces_.bytes; }

 private:
  std::shared_ptr<const CompiledKernel> kernel_;
  DevicePieces pieces_;
};

// Byte ranges of device memory read by one kernel and thrown away (nothing is written): what any
// work that must read the same bytes takes at least, in one launch (bench-model's read floors). The
// ranges are cut as l2_prefetch_pieces cuts them; a block of 256 threads reads one piece, 16 loads of
// 16 bytes in flight a thread.
class DeviceRead {
 public:
  explicit DeviceRead(const std::vector<DeviceByteRange>& ranges);
  void enqueue(const CudaStream& stream) const;
  std::uint64_t bytes() const { return pieces_.bytes; }

 private:
  std::shared_ptr<const CompiledKernel> kernel_;
  DevicePieces pieces_;
  std::shared_ptr<const DeviceBuffer> sink_;  // written only if the folded words match a constant
};

// The link between two greedy decode steps on the device (CudaDecodeSession::continue_greedy): one
// thread copies the token a step chose (its graph's "next_tokens") into the next step's token id,
// moves the position one on, and writes the token into a slot of page-locked host memory mapped into
// the device (cuMemHostAlloc, DEVICEMAP), which the host reads once an event recorded after the link
// has completed. So consecutive steps queue on the stream with no host round trip between them.
class GreedyStepLink {
 public:
  explicit GreedyStepLink(std::size_t slots);  // needs a current context
  // After the step that wrote its chosen token at `next_token` (an int32 on the device): that token
  // into token_ids[0] and slot `slot` (modulo the slots), positions[0] + 1 into positions[0].
  void enqueue(const CudaStream& stream, std::uint64_t next_token, std::uint64_t token_ids, std::uint64_t positions,
               std::size_t slot) const;
  // The token a completed link wrote into `slot` (modulo the slots).
  std::int32_t chosen(std::size_t slot) const;

 private:
  std::shared_ptr<const CompiledKernel> kernel_;
  std::shared_ptr<std::int32_t> host_;  // the slots, freed with cuMemFreeHost
  std::uint64_t device_address_ = 0;    // the same slots as the device addresses them
  std::size_t slots_ = 0;
};

// Sampling's top-k on the device (CudaDecodeSession::feed_top_k): of one row of logits (f32, bf16 or
// f16) in device memory, every token whose logit reaches the top_k-th largest, ties with it kept, -0
// and +0 equal: top_logits' rule (model.h), selected by one block (a radix select over the logits'
// order-preserving keys, 8 bits a pass, then a pass that gathers), so that a sampled token costs a
// few kilobytes copied back instead of the whole row and the host's selection over it.
class DeviceTopLogits {
 public:
  explicit DeviceTopLogits(std::size_t capacity);  // tokens it returns at most; needs a current context
  // On `stream`: the selection over `row` (`vocab` logits of `dtype`) and the copy of its result to the
  // host. 1 <= top_k <= vocab. Read it with result() once the stream has passed both.
  void enqueue(const CudaStream& stream, std::uint64_t row, DType dtype, std::int64_t vocab, std::int64_t top_k);
  struct Result {
    std::int64_t count = 0;        // tokens that reach the k-th largest logit (all of them, even past capacity)
    bool nan = false;              // the row holds a NaN (no selection is meaningful then)
    std::vector<std::int32_t> tokens;  // in token order; empty when count passes the capacity
    std::vector<float> logits;         // tokens' logits, widened exactly to f32
  };
  Result result();
  std::size_t capacity() const { return capacity_; }

 private:
  std::shared_ptr<const CompiledKernel> kernel_;
  std::size_t capacity_ = 0;
  DeviceBuffer output_;              // u32 count, u32 NaN flag, capacity (u32 token, f32 logit) pairs
  std::vector<std::uint32_t> host_;  // its copy
  std::size_t copied_pairs_ = 0;     // pairs the last enqueue copied back (top_k and some ties)
};

// The runtime's own kernels (L2 prefetch, read floors, the greedy link, the top-k selection) as
// (kernel name, CUDA source): what CI compiles for sm_90 without a device.
std::vector<std::pair<std::string_view, std::string_view>> runtime_kernel_sources();

// ---------------------------------------------------------------- cuBLASLt
// Row-major dense matmul through cuBLASLt, f32 accumulate (f32 inputs use plain f32, not TF32):
//   C[batch, M, N] = A[batch, M, K] · B[batch, K, N]      (transpose_right: B is [batch, N, K])
// a_batch_stride / b_batch_stride in elements; 0 broadcasts one matrix over the batch.
struct MatmulProblem {
  DType dtype = DType::f32;  // of A, B and C: f16, bf16 or f32
  std::int64_t batch = 1, m = 0, n = 0, k = 0;
  bool transpose_right = false;
  std::int64_t a_batch_stride = 0, b_batch_stride = 0, c_batch_stride = 0;
};

class CublasLtMatmul {
 public:
  CublasLtMatmul();  // handle + a 32 MiB workspace on the current device
  ~CublasLtMatmul();
  CublasLtMatmul(const CublasLtMatmul&) = delete;
  CublasLtMatmul& operator=(const CublasLtMatmul&) = delete;

  // Capturable in a CUDA graph (the workspace is preallocated). Addresses are CUdeviceptrs.
  void run(const MatmulProblem& problem, std::uint64_t a, std::uint64_t b, std::uint64_t c,
           const CudaStream& stream);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// ---------------------------------------------------------------- running graphs natively
// One unit of device work bound to its buffers, enqueued on a stream (a launch, a matmul, ...).
using DeviceStep = std::function<void(const CudaStream&)>;

// Graph value name -> device address of a buffer the caller owns (at least spec.bytes(), alive as
// long as the DeviceValues that borrow it).
using ExternalValues = std::map<std::string, std::uint64_t>;

// One device tensor for every value of a graph: inputs, intermediates and outputs.
// The graph must outlive this object.
//
// External values are borrowed: the caller's buffer is used, never allocated or freed here
// (InputError when a name is not a value of the graph). Values that alias_of (graph.h) maps to
// another value are views of that value's buffer: a reshape's output is its input's bytes, and
// after a run an in-place kv_cache_write's cache input holds the updated cache.
class DeviceValues {
 public:
  explicit DeviceValues(const ComputeGraph& graph, const ExternalValues& external_values = {});
  // Neither copied nor moved: steps bound to it and the functions given keep_derived hold its
  // address, and caches key on its serial().
  DeviceValues(const DeviceValues&) = delete;
  DeviceValues& operator=(const DeviceValues&) = delete;
  const ComputeGraph& graph() const { return *graph_; }
  DeviceTensor& operator[](ValueId id) { return tensors_.at(static_cast<std::size_t>(id)); }
  const DeviceTensor& operator[](ValueId id) const { return tensors_.at(static_cast<std::size_t>(id)); }
  bool is_external(ValueId id) const { return external_.at(static_cast<std::size_t>(id)); }
  // Whether two values use the same buffer (alias_of: reshape, transpose of size-1 axes, an in-place
  // kv_cache_write); their nodes' native steps then launch nothing or write only what changes.
  bool shares_buffer(ValueId a, ValueId b) const;
  // By graph-input name; InputError naming the input when one is missing or its spec differs.
  // An external input may be missing (its buffer already holds it); when given, it is uploaded.
  void upload_inputs(const TensorMap& inputs);
  TensorMap download_outputs() const;  // by output value name
  // Fills every computed value's buffer that this object allocated with 0xFF bytes (NaN in every
  // float dtype): a value a kernel fails to write then fails the numeric gate instead of passing on
  // stale data. Buffers that inputs own (or borrow) and external buffers are never poisoned.
  void poison_computed_values();
  // Device data a bound step derives from input values (a weight repacked for a GEMV) follows
  // them: `derive` runs now and again after every upload_inputs that writes one of `inputs`, so
  // it runs once for weights that never change and never inside a run.
  void keep_derived(std::vector<ValueId> inputs, std::function<void()> derive);
  // A number no other DeviceValues of this process has had: what caches of device data derived
  // from one object's values key on (an address is reused by the next object on the stack, whose
  // weights may differ: a GEMV pool keyed by it served one test position's repacked weights to
  // the next).
  std::uint64_t serial() const { return serial_; }

 private:
  struct Derived {
    std::vector<ValueId> inputs;
    std::function<void()> derive;
  };
  const ComputeGraph* graph_;
  std::vector<DeviceTensor> tensors_;
  std::vector<bool> external_;
  std::vector<Derived> derived_;
  std::uint64_t serial_;
};

// A generated kernel, compiled and loaded for the current device.
struct LoadedKernel {
  GeneratedKernel generated;
  CompiledKernel compiled;
};
LoadedKernel load_generated_kernel(const GeneratedKernel& kernel);

// A step launching the kernel with its parameters bound to `values`: the value ids recorded in the
// kernel's parameters must be ids of values.graph(); a kernel generated for another graph (same
// source, other ids) is bound through `value_for_parameter` instead.
// Scratch parameters get buffers owned by the step.
DeviceStep bind_kernel(const LoadedKernel& kernel, DeviceValues& values);
DeviceStep bind_kernel(const LoadedKernel& kernel, DeviceValues& values, const std::vector<ValueId>& value_for_parameter);

// The native (unfused) path for any node: a generated kernel per non-contraction node, cuBLASLt for
// matmul, dequantize + cuBLASLt for quantized_matmul. Kernels with the same source are compiled once.
class NativeRuntime {
 public:
  NativeRuntime();
  ~NativeRuntime();
  DeviceStep node_step(const ComputeGraph& graph, NodeId node, DeviceValues& values);
  // Steps for all of a graph's nodes in order (an unfused run of the whole graph).
  std::vector<DeviceStep> graph_steps(const ComputeGraph& graph, DeviceValues& values);
  // The sources of the kernels node_step would run (for cache keys); empty for cuBLASLt-only nodes.
  static std::string node_source(const ComputeGraph& graph, NodeId node);

 private:
  const LoadedKernel& kernel_for(const GeneratedKernel& generated);
  // Scratch buffer `slot` of at least `bytes`, shared by every step this runtime makes (quantized_matmul's
  // dequantized weights and doubled x): steps run one after another on one stream, so one buffer the size
  // of the largest request serves a whole model, where one per node would hold twice its weights again.
  // A larger request replaces the buffer for later steps; earlier ones keep theirs alive.
  std::shared_ptr<DeviceBuffer> shared_scratch(std::size_t slot, std::size_t bytes);
  std::shared_ptr<CublasLtMatmul> matmul_;
  std::map<std::string, LoadedKernel, std::less<>> kernels_by_source_;
  std::vector<std::shared_ptr<DeviceBuffer>> scratch_;
};

// Runs the steps in order on the stream.
void run_steps(const std::vector<DeviceStep>& steps, const CudaStream& stream);
// One step that runs `nodes` of values' graph natively, in order, on `runtime` (which the step keeps
// alive): the ops a lowering leaves beside its kernels.
DeviceStep native_nodes_step(const std::shared_ptr<NativeRuntime>& runtime, DeviceValues& values,
                             const std::vector<NodeId>& nodes);

}  // namespace metile
