// Device helpers shared by the CUDA backend's kernel files (attention.cu,
// elementwise.cu, gemm.cu, sampling.cu): conversions between the storage
// types and float, warp and block sums, and unpacking of 16-byte vectors.
// Every function is inline: each .cu file compiles its own copy (no
// relocatable device code).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace coalesce::engine::cuda {

inline constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------
// Conversions and reductions
// ---------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ float ToFloat(T v);
template <>
__device__ __forceinline__ float ToFloat(float v) {
  return v;
}
template <>
__device__ __forceinline__ float ToFloat(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half FromFloat(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// Sum over the thread block (blockDim.x a multiple of 32, at most 1024);
// every thread gets the result. `scratch` holds 33 floats of shared memory.
inline __device__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = WarpSum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < static_cast<int>(blockDim.x / 32) ? scratch[lane] : 0.0f;
    w = WarpSum(w);
    if (lane == 0) scratch[32] = w;
  }
  __syncthreads();
  return scratch[32];
}

// ---------------------------------------------------------------------------
// 16-byte vectors
// ---------------------------------------------------------------------------

// 16 bytes of T as floats.
template <typename T>
struct Vec16 {
  static constexpr int kSize = 16 / sizeof(T);
};

__device__ __forceinline__ void Unpack(const uint4& v, float (&out)[4], float) {
  out[0] = __uint_as_float(v.x);
  out[1] = __uint_as_float(v.y);
  out[2] = __uint_as_float(v.z);
  out[3] = __uint_as_float(v.w);
}
__device__ __forceinline__ void Unpack(const uint4& v, float (&out)[8], __nv_bfloat16) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 pair;
    memcpy(&pair, &words[i], sizeof(pair));
    const float2 f = __bfloat1622float2(pair);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void Unpack(const uint4& v, float (&out)[8], __half) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 pair;
    memcpy(&pair, &words[i], sizeof(pair));
    const float2 f = __half22float2(pair);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

}  // namespace coalesce::engine::cuda
