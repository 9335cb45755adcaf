// Shared by the CUDA tests: device arrays and conversions to the storage
// types. Skipping without a GPU (COALESCE_REQUIRE_GPU) and RelativeError come
// from backend_test_support.h, shared with every backend test.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda/cuda_backend.h"
#include "tests/engine/backend_test_support.h"

namespace coalesce::engine::testing {

#define CUDA_ASSERT_OK(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(expr)

inline float ToFloat(float v) { return v; }
inline float ToFloat(__half v) { return __half2float(v); }
inline float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
T FromFloat(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(v);
  } else {
    return __float2bfloat16_rn(v);
  }
}
// v as it is after a round trip through T.
template <typename T>
float Round(float v) {
  return ToFloat(FromFloat<T>(v));
}

// A cudaMalloc'd array of n elements, freed with the object.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    if (cudaMalloc(&ptr_, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) ptr_ = nullptr;
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { Upload(host); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(ptr_); }
  void Upload(const std::vector<T>& host) {
    cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> Download() const {
    std::vector<T> host(n_);
    cudaDeviceSynchronize();
    cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }
  // Fills every byte with 0xff: a float NaN, so unwritten outputs show.
  void Poison() { cudaMemset(ptr_, 0xff, n_ * sizeof(T)); }
  T* get() const { return ptr_; }

 private:
  T* ptr_ = nullptr;
  size_t n_;
};

inline std::vector<float> RandomFloats(size_t n, std::mt19937& rng, float lo = -1.0f,
                                       float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

template <typename T>
std::vector<T> Convert(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FromFloat<T>(v[i]);
  return out;
}

template <typename T>
std::vector<float> ToFloats(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = ToFloat(v[i]);
  return out;
}

}  // namespace coalesce::engine::testing
