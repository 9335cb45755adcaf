// CUDA runtime plumbing of the CUDA backend (runtime.h).
#include "engine/cuda/runtime.h"

#include <dlfcn.h>

#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "engine/backend.h"

namespace coalesce::engine::cuda {
namespace {

// Errors after which the CUDA context is unusable: every later call fails.
bool IsStickyError(cudaError_t error) {
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorECCUncorrectable:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorUnknown:
      return true;
    default:
      return false;
  }
}

}  // namespace

absl::Status CudaError(cudaError_t error, std::string_view call) {
  const absl::StatusCode code =
      IsStickyError(error) ? kDeviceLostCode : absl::StatusCode::kInternal;
  return absl::Status(
      code, absl::StrCat(std::string(call.substr(0, call.find('('))), ": ", cudaGetErrorName(error),
                         " (", cudaGetErrorString(error), ")"));
}

absl::StatusOr<const CublasApi*> LoadCublas() {
  static const absl::StatusOr<CublasApi> api = []() -> absl::StatusOr<CublasApi> {
    const std::string name = absl::StrCat("libcublas.so.", CUBLAS_VER_MAJOR);
    void* library = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      return absl::UnavailableError(absl::StrCat("cannot load cuBLAS: ", dlerror()));
    }
    CublasApi a{};
    std::string missing;
    auto bind = [&](auto& function, const char* symbol) {
      function =
          reinterpret_cast<std::remove_reference_t<decltype(function)>>(dlsym(library, symbol));
      if (function == nullptr) absl::StrAppend(&missing, " ", symbol);
    };
    bind(a.create, "cublasCreate_v2");
    bind(a.destroy, "cublasDestroy_v2");
    bind(a.set_stream, "cublasSetStream_v2");
    bind(a.set_workspace, "cublasSetWorkspace_v2");
    bind(a.gemm_ex, "cublasGemmEx");
    bind(a.status_name, "cublasGetStatusName");
    bind(a.status_string, "cublasGetStatusString");
    if (!missing.empty()) {
      return absl::UnavailableError(absl::StrCat(name, " lacks", missing));
    }
    return a;  // the library stays loaded for the life of the process
  }();
  if (!api.ok()) return api.status();
  return &*api;
}

absl::Status CublasError(const CublasApi& api, cublasStatus_t status, std::string_view call) {
  return absl::InternalError(absl::StrCat(std::string(call.substr(0, call.find('('))), ": ",
                                          api.status_name(status), " (", api.status_string(status),
                                          ")"));
}

}  // namespace coalesce::engine::cuda
