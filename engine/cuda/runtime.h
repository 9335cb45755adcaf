// CUDA runtime plumbing of the CUDA backend: CUDA and cuBLAS errors as
// Status (CudaError, CUDA_RETURN_IF_ERROR, CublasError), cuBLAS loaded with
// dlopen (CublasApi, LoadCublas), and RAII owners of device memory
// (DeviceBuffer) and page-locked host memory (PinnedBuffer).
#pragma once

#include <cublas_v2.h>  // types only: the library is loaded with dlopen (LoadCublas)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace coalesce::engine::cuda {

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

// "cudaMalloc: cudaErrorMemoryAllocation (out of memory)"; `call` is the
// checked expression, of which the function name is kept. Errors after which
// the CUDA context is unusable (every later call fails) come back with
// kDeviceLostCode, others as kInternal.
absl::Status CudaError(cudaError_t error, std::string_view call);

#define CUDA_RETURN_IF_ERROR(expr)                              \
  do {                                                          \
    if (const cudaError_t err_ = (expr); err_ != cudaSuccess) { \
      return ::coalesce::engine::cuda::CudaError(err_, #expr);  \
    }                                                           \
  } while (false)

// ---------------------------------------------------------------------------
// cuBLAS, loaded rather than linked
// ---------------------------------------------------------------------------

// cuBLAS is opened with dlopen when the first CUDA backend is made instead of
// being linked into the server: libcublasLt holds 92 KiB of static
// thread-local storage, which glibc takes out of the stack of every thread a
// process with it linked creates, and the metrics server (civetweb) starts
// its threads with stacks of about 100 KiB, so they fail to start. A library
// opened with dlopen gets its thread-local storage allocated apart.
struct CublasApi {
  decltype(&cublasCreate_v2) create;
  decltype(&cublasDestroy_v2) destroy;
  decltype(&cublasSetStream_v2) set_stream;
  decltype(&cublasSetWorkspace_v2) set_workspace;
  // cublasGemmEx has a C++ overload (cudaDataType compute type): name the C one.
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                            const void*, const void*, cudaDataType, int, const void*, cudaDataType,
                            int, const void*, void*, cudaDataType, int, cublasComputeType_t,
                            cublasGemmAlgo_t);
  decltype(&cublasGetStatusName) status_name;
  decltype(&cublasGetStatusString) status_string;
};

// Loads cuBLAS on the first call; the library stays loaded for the life of
// the process, and every later call returns the same table (or error).
absl::StatusOr<const CublasApi*> LoadCublas();

// The cuBLAS counterpart of CudaError: "<function>: <status name> (<status string>)".
absl::Status CublasError(const CublasApi& api, cublasStatus_t status, std::string_view call);

// ---------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------

// One cudaMalloc allocation, freed with the object.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  absl::Status Allocate(size_t bytes) {
    CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr_, std::max<size_t>(bytes, 16)));
    bytes_ = bytes;
    return absl::OkStatus();
  }
  template <typename U>
  U* get() const {
    return static_cast<U*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Page-locked host memory, so that copies to and from it are asynchronous.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
  }
  absl::Status Allocate(size_t bytes) {
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&ptr_, std::max<size_t>(bytes, 16)));
    return absl::OkStatus();
  }
  template <typename U>
  U* get() const {
    return static_cast<U*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

}  // namespace coalesce::engine::cuda
