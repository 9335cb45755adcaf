// Element- and row-wise kernels of the CUDA backend: embedding lookup,
// RMSNorm (+ residual add), SwiGLU, conversion from float and random fill;
// kernels.h says what each computes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "engine/cuda/device_helpers.cuh"
#include "engine/cuda/kernels.h"

namespace coalesce::engine::cuda {
namespace {

// Grid size for a grid-stride loop over n elements.
inline unsigned GridFor(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65536 ? 65536 : blocks));
}

// ---------------------------------------------------------------------------
// Embedding, RMSNorm, SwiGLU
// ---------------------------------------------------------------------------

template <typename T>
__global__ void EmbedKernel(const T* table, const int32_t* tokens, int dim, float* x) {
  const int64_t row = blockIdx.x;
  const T* src = table + static_cast<int64_t>(tokens[row]) * dim;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) x[row * dim + d] = ToFloat(src[d]);
}

// Elements of a row each thread of RmsNormKernel holds in registers: rows
// of up to 1024 * 16 elements in one pass over memory.
constexpr int kNormPerThread = 16;

template <typename T>
__global__ void RmsNormKernel(float* x, const float* delta, const float* bias, const float* weight,
                              const int32_t* gather, int dim, float eps, T* out) {
  __shared__ float scratch[33];
  const int64_t r = blockIdx.x;
  const int64_t i = gather != nullptr ? gather[r] : r;
  float* xr = x + i * dim;
  float v[kNormPerThread];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < kNormPerThread; ++k) {
    const int d = threadIdx.x + k * blockDim.x;
    v[k] = 0.0f;
    if (d < dim) {
      v[k] = xr[d];
      if (delta != nullptr) {
        v[k] += delta[i * dim + d];
        if (bias != nullptr) v[k] += bias[d];
        xr[d] = v[k];
      }
      ss += v[k] * v[k];
    }
  }
  ss = BlockSum(ss, scratch);
  const float scale = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
#pragma unroll
  for (int k = 0; k < kNormPerThread; ++k) {
    const int d = threadIdx.x + k * blockDim.x;
    if (d < dim) out[r * dim + d] = FromFloat<T>(weight[d] * (scale * v[k]));
  }
}

template <typename T>
__global__ void SwiGluKernel(const float* gate_up, int64_t rows, int hidden, T* out) {
  const int64_t n = rows * hidden;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < n;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = idx / hidden, i = idx - t * hidden;
    const float g = gate_up[t * 2 * hidden + i];
    const float u = gate_up[t * 2 * hidden + hidden + i];
    out[idx] = FromFloat<T>(g * (1.0f / (1.0f + expf(-g))) * u);
  }
}

// ---------------------------------------------------------------------------
// Conversion and random fill
// ---------------------------------------------------------------------------

template <typename T>
__global__ void ConvertKernel(const float* in, int64_t n, T* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = FromFloat<T>(in[i]);
  }
}

__device__ __forceinline__ uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

template <typename T>
__global__ void FillUniformKernel(T* out, int64_t n, uint64_t seed, float scale, float offset) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint64_t bits = Mix64(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i));
    const float u = static_cast<float>(bits >> 40) * 0x1.0p-23f - 1.0f;  // [-1, 1)
    out[i] = FromFloat<T>(offset + scale * u);
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------

template <typename T>
cudaError_t EmbedTokens(const T* table, const int32_t* tokens, int rows, int dim, float* x,
                        cudaStream_t stream) {
  if (rows > 0) EmbedKernel<T><<<rows, 256, 0, stream>>>(table, tokens, dim, x);
  return cudaGetLastError();
}

template <typename T>
cudaError_t RmsNorm(float* x, const float* delta, const float* bias, const float* weight,
                    const int32_t* gather, int rows, int dim, float eps, T* out,
                    cudaStream_t stream) {
  // About 4 elements per thread, at most kNormPerThread.
  const int threads = std::min(1024, std::max(32, (dim / 4 + 31) / 32 * 32));
  if (dim > threads * kNormPerThread) return cudaErrorInvalidValue;
  if (rows > 0) {
    RmsNormKernel<T><<<rows, threads, 0, stream>>>(x, delta, bias, weight, gather, dim, eps, out);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t SwiGlu(const float* gate_up, int rows, int hidden, T* out, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rows) * hidden;
  if (n > 0) SwiGluKernel<T><<<GridFor(n, 256), 256, 0, stream>>>(gate_up, rows, hidden, out);
  return cudaGetLastError();
}

template <typename T>
cudaError_t ConvertFromFloat(const float* in, int64_t n, T* out, cudaStream_t stream) {
  if (n > 0) ConvertKernel<T><<<GridFor(n, 256), 256, 0, stream>>>(in, n, out);
  return cudaGetLastError();
}

template <typename T>
cudaError_t FillUniform(T* out, int64_t n, uint64_t seed, float scale, float offset,
                        cudaStream_t stream) {
  if (n > 0) FillUniformKernel<T><<<GridFor(n, 256), 256, 0, stream>>>(out, n, seed, scale, offset);
  return cudaGetLastError();
}

#define COALESCE_INSTANTIATE(T)                                                                  \
  template cudaError_t EmbedTokens<T>(const T*, const int32_t*, int, int, float*, cudaStream_t); \
  template cudaError_t RmsNorm<T>(float*, const float*, const float*, const float*,              \
                                  const int32_t*, int, int, float, T*, cudaStream_t);            \
  template cudaError_t SwiGlu<T>(const float*, int, int, T*, cudaStream_t);                      \
  template cudaError_t ConvertFromFloat<T>(const float*, int64_t, T*, cudaStream_t);             \
  template cudaError_t FillUniform<T>(T*, int64_t, uint64_t, float, float, cudaStream_t);

COALESCE_INSTANTIATE(float)
COALESCE_INSTANTIATE(__half)
COALESCE_INSTANTIATE(__nv_bfloat16)
#undef COALESCE_INSTANTIATE

}  // namespace coalesce::engine::cuda
