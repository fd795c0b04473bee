// Dense matmul through cuBLASLt: the native path for contractions, and the baseline every
// generated contraction is measured against. Row-major problems are mapped onto cuBLASLt's
// column-major view by computing Cᵀ = Bᵀ·Aᵀ (a row-major matrix is its transpose, column-major),
// so no data moves. f32 uses CUBLAS_COMPUTE_32F (not TF32): the f32 numeric gate is 1e-5.
#include <fmt/core.h>

#include <map>
#include <tuple>

#include "cuda_driver.h"
#include "cuda_libraries.h"
#include "metile/cuda_runtime.h"

namespace metile {
namespace {

const cuda_libraries::CublasLtApi& lt() { return cuda_libraries::cublaslt(); }

void check_cublas(cublasStatus_t status, std::string_view call) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw CudaError(fmt::format("{}: {} ({})", call, lt().cublasLtGetStatusName(status), lt().cublasLtGetStatusString(status)));
  }
}

cudaDataType_t cuda_data_type(DType dtype) {
  switch (dtype) {
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f32: return CUDA_R_32F;
    default: throw InputError(fmt::format("cuBLASLt matmul: dtype {} is not supported (f16, bf16, f32)", dtype_name(dtype)));
  }
}

constexpr std::size_t workspace_bytes = 32u << 20;

// Descriptors and the chosen algorithm for one problem shape, built once.
struct PreparedMatmul {
  cublasLtMatmulDesc_t operation = nullptr;
  cublasLtMatrixLayout_t left = nullptr;   // cuBLASLt's A: our B
  cublasLtMatrixLayout_t right = nullptr;  // cuBLASLt's B: our A
  cublasLtMatrixLayout_t result = nullptr;
  cublasLtMatmulAlgo_t algorithm{};

  ~PreparedMatmul() {
    if (result) lt().cublasLtMatrixLayoutDestroy(result);
    if (right) lt().cublasLtMatrixLayoutDestroy(right);
    if (left) lt().cublasLtMatrixLayoutDestroy(left);
    if (operation) lt().cublasLtMatmulDescDestroy(operation);
  }
};

using ProblemKey = std::tuple<int, std::int64_t, std::int64_t, std::int64_t, std::int64_t, bool, std::int64_t,
                              std::int64_t, std::int64_t>;

ProblemKey key_of(const MatmulProblem& p) {
  return {static_cast<int>(p.dtype), p.batch, p.m, p.n, p.k, p.transpose_right, p.a_batch_stride, p.b_batch_stride,
          p.c_batch_stride};
}

void set_batch(cublasLtMatrixLayout_t layout, std::int64_t batch, std::int64_t stride) {
  const std::int32_t count = static_cast<std::int32_t>(batch);
  check_cublas(lt().cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count),
               "cublasLtMatrixLayoutSetAttribute(batch count)");
  check_cublas(lt().cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                sizeof stride),
               "cublasLtMatrixLayoutSetAttribute(batch stride)");
}

}  // namespace

struct CublasLtMatmul::State {
  cublasLtHandle_t handle = nullptr;
  DeviceBuffer workspace;
  std::map<ProblemKey, std::unique_ptr<PreparedMatmul>> prepared;

  ~State() {
    prepared.clear();
    if (handle) lt().cublasLtDestroy(handle);
  }

  PreparedMatmul& prepare(const MatmulProblem& p) {
    auto& slot = prepared[key_of(p)];
    if (slot) return *slot;
    auto prepared_matmul = std::make_unique<PreparedMatmul>();
    const cudaDataType_t type = cuda_data_type(p.dtype);
    check_cublas(lt().cublasLtMatmulDescCreate(&prepared_matmul->operation, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                 "cublasLtMatmulDescCreate");
    const cublasOperation_t left_operation = p.transpose_right ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t right_operation = CUBLAS_OP_N;
    check_cublas(lt().cublasLtMatmulDescSetAttribute(prepared_matmul->operation, CUBLASLT_MATMUL_DESC_TRANSA,
                                                &left_operation, sizeof left_operation),
                 "cublasLtMatmulDescSetAttribute(TRANSA)");
    check_cublas(lt().cublasLtMatmulDescSetAttribute(prepared_matmul->operation, CUBLASLT_MATMUL_DESC_TRANSB,
                                                &right_operation, sizeof right_operation),
                 "cublasLtMatmulDescSetAttribute(TRANSB)");
    // Our B, column-major: [N x K] (ld N) or, transposed, stored [K x N] (ld K).
    if (p.transpose_right) {
      check_cublas(lt().cublasLtMatrixLayoutCreate(&prepared_matmul->left, type, static_cast<std::uint64_t>(p.k),
                                              static_cast<std::uint64_t>(p.n), p.k),
                   "cublasLtMatrixLayoutCreate(B)");
    } else {
      check_cublas(lt().cublasLtMatrixLayoutCreate(&prepared_matmul->left, type, static_cast<std::uint64_t>(p.n),
                                              static_cast<std::uint64_t>(p.k), p.n),
                   "cublasLtMatrixLayoutCreate(B)");
    }
    check_cublas(lt().cublasLtMatrixLayoutCreate(&prepared_matmul->right, type, static_cast<std::uint64_t>(p.k),
                                            static_cast<std::uint64_t>(p.m), p.k),
                 "cublasLtMatrixLayoutCreate(A)");
    check_cublas(lt().cublasLtMatrixLayoutCreate(&prepared_matmul->result, type, static_cast<std::uint64_t>(p.n),
                                            static_cast<std::uint64_t>(p.m), p.n),
                 "cublasLtMatrixLayoutCreate(C)");
    if (p.batch > 1) {
      set_batch(prepared_matmul->left, p.batch, p.b_batch_stride);
      set_batch(prepared_matmul->right, p.batch, p.a_batch_stride);
      set_batch(prepared_matmul->result, p.batch, p.c_batch_stride);
    }
    cublasLtMatmulPreference_t preference = nullptr;
    check_cublas(lt().cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate");
    const std::uint64_t workspace_limit = workspace_bytes;
    lt().cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_limit,
                                         sizeof workspace_limit);
    cublasLtMatmulHeuristicResult_t heuristic{};
    int returned = 0;
    const cublasStatus_t status = lt().cublasLtMatmulAlgoGetHeuristic(
        handle, prepared_matmul->operation, prepared_matmul->left, prepared_matmul->right, prepared_matmul->result,
        prepared_matmul->result, preference, 1, &heuristic, &returned);
    lt().cublasLtMatmulPreferenceDestroy(preference);
    check_cublas(status, "cublasLtMatmulAlgoGetHeuristic");
    if (returned == 0) {
      throw CudaError(fmt::format("cublasLtMatmulAlgoGetHeuristic: no algorithm for {} [{}x{}x{}] batch {}",
                                  dtype_name(p.dtype), p.m, p.n, p.k, p.batch));
    }
    prepared_matmul->algorithm = heuristic.algo;
    slot = std::move(prepared_matmul);
    return *slot;
  }
};

CublasLtMatmul::CublasLtMatmul() : state_(std::make_unique<State>()) {
  cuda_driver::driver();  // "no CUDA device" before cuBLASLt's own, vaguer, message
  check_cublas(lt().cublasLtCreate(&state_->handle), "cublasLtCreate");
  state_->workspace = DeviceBuffer(workspace_bytes);
}

CublasLtMatmul::~CublasLtMatmul() = default;

void CublasLtMatmul::run(const MatmulProblem& problem, std::uint64_t a, std::uint64_t b, std::uint64_t c,
                         const CudaStream& stream) {
  if (problem.m <= 0 || problem.n <= 0 || problem.k <= 0 || problem.batch <= 0) {
    throw InputError(fmt::format("cuBLASLt matmul: empty problem [{}x{}x{}] batch {}", problem.m, problem.n,
                                 problem.k, problem.batch));
  }
  PreparedMatmul& prepared = state_->prepare(problem);
  const float alpha = 1.0f;
  const float beta = 0.0f;
  check_cublas(lt().cublasLtMatmul(state_->handle, prepared.operation, &alpha, reinterpret_cast<const void*>(b),
                              prepared.left, reinterpret_cast<const void*>(a), prepared.right, &beta,
                              reinterpret_cast<const void*>(c), prepared.result, reinterpret_cast<void*>(c),
                              prepared.result, &prepared.algorithm,
                              reinterpret_cast<void*>(state_->workspace.address()), workspace_bytes,
                              stream.handle()),
               fmt::format("cublasLtMatmul({} [{}x{}x{}] batch {})", dtype_name(problem.dtype), problem.m,
                           problem.n, problem.k, problem.batch));
}

}  // namespace metile
