// The skinny matrix product of the CUDA backend (SkinnyGemm: the
// projections of a step with few tokens); kernels.h says what it computes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

#include "engine/cuda/device_helpers.cuh"
#include "engine/cuda/kernels.h"

namespace coalesce::engine::cuda {
namespace {

// ---------------------------------------------------------------------------
// Skinny matrix product
// ---------------------------------------------------------------------------

constexpr int kSkinnyThreads = 256;

// x is staged in shared memory when it fits in kSkinnyStageBytes (one row of
// up to 24K bf16 elements): every warp of the block then reads it from there
// instead of through L1, which leaves the load path to the weights. The
// weights stream through with evict-first loads (__ldcs): each is read once.
constexpr int kSkinnyStageBytes = 48 * 1024;

template <typename T, int R, bool kStageX>
__global__ void __launch_bounds__(kSkinnyThreads)
    SkinnyGemmKernel(const T* x, int k, const T* w, int out, float* y) {
  constexpr int kVec = Vec16<T>::kSize;
  extern __shared__ uint4 x_staged[];  // [R * num_vecs] when kStageX
  const int num_vecs = k / kVec;
  const uint4* x_vecs = reinterpret_cast<const uint4*>(x);  // row r at r * num_vecs
  if constexpr (kStageX) {
    for (int i = threadIdx.x; i < R * num_vecs; i += kSkinnyThreads)
      x_staged[i] = __ldg(x_vecs + i);
    __syncthreads();
  }
  const int o = (blockIdx.x * kSkinnyThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (o >= out) return;  // whole warps leave together, after the staging
  const uint4* w_row = reinterpret_cast<const uint4*>(w + static_cast<int64_t>(o) * k);
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
#pragma unroll 8
  for (int i = lane; i < num_vecs; i += 32) {
    float wf[kVec];
    Unpack(__ldcs(w_row + i), wf, T{});
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float xf[kVec];
      Unpack(kStageX ? x_staged[r * num_vecs + i] : __ldg(x_vecs + r * num_vecs + i), xf, T{});
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[r] += wf[j] * xf[j];
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float sum = WarpSum(acc[r]);
    if (lane == 0) y[static_cast<int64_t>(r) * out + o] = sum;
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------

template <typename T>
cudaError_t SkinnyGemm(const T* x, int rows, int k, const T* w, int out, float* y,
                       cudaStream_t stream) {
  if (rows < 1 || rows > kMaxSkinnyRows || !SkinnyGemmSupported<T>(k)) return cudaErrorInvalidValue;
  const unsigned blocks =
      static_cast<unsigned>((static_cast<int64_t>(out) * 32 + kSkinnyThreads - 1) / kSkinnyThreads);
  const size_t staged = static_cast<size_t>(rows) * k * sizeof(T);
  const bool stage = staged <= kSkinnyStageBytes;
  switch (rows) {
#define COALESCE_SKINNY_CASE(R)                                                                  \
  case R:                                                                                        \
    if (stage) {                                                                                 \
      SkinnyGemmKernel<T, R, true><<<blocks, kSkinnyThreads, staged, stream>>>(x, k, w, out, y); \
    } else {                                                                                     \
      SkinnyGemmKernel<T, R, false><<<blocks, kSkinnyThreads, 0, stream>>>(x, k, w, out, y);     \
    }                                                                                            \
    break;
    COALESCE_SKINNY_CASE(1)
    COALESCE_SKINNY_CASE(2)
    COALESCE_SKINNY_CASE(3)
    COALESCE_SKINNY_CASE(4)
    COALESCE_SKINNY_CASE(5)
    COALESCE_SKINNY_CASE(6)
    COALESCE_SKINNY_CASE(7)
    COALESCE_SKINNY_CASE(8)
#undef COALESCE_SKINNY_CASE
  }
  return cudaGetLastError();
}

#define COALESCE_INSTANTIATE(T) \
  template cudaError_t SkinnyGemm<T>(const T*, int, int, const T*, int, float*, cudaStream_t);

COALESCE_INSTANTIATE(float)
COALESCE_INSTANTIATE(__half)
COALESCE_INSTANTIATE(__nv_bfloat16)
#undef COALESCE_INSTANTIATE

}  // namespace coalesce::engine::cuda
