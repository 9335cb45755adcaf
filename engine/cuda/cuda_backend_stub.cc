// The CUDA backend of a build without the CUDA toolkit (no nvcc found at
// configure time, or -DCOALESCE_CUDA=OFF): it says so and builds nothing.
// engine/cuda/cuda_backend.cc replaces this file when CUDA is built.
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/model.h"

namespace coalesce::engine {
namespace {

constexpr char kNotBuilt[] = "built without CUDA (configure found no nvcc, or -DCOALESCE_CUDA=OFF)";

}  // namespace

bool CudaDeviceUsable(std::string* why) {
  if (why != nullptr) *why = kNotBuilt;
  return false;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(std::shared_ptr<const Model> model,
                                                           const CudaBackendOptions& options) {
  return absl::UnavailableError(kNotBuilt);
}

}  // namespace coalesce::engine
