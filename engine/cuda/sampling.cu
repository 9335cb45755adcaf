// Sampling kernel of the CUDA backend (SampleTokens), and CheckKernelImage,
// which probes the device with it; kernels.h says what each computes.
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "engine/cuda/device_helpers.cuh"
#include "engine/cuda/kernels.h"

namespace coalesce::engine::cuda {
namespace {

// ---------------------------------------------------------------------------
// Sampling
// ---------------------------------------------------------------------------

constexpr int kSampleThreads = 1024;
constexpr uint32_t kOneBits = 0x3f800000u;  // 1.0f: the largest probability

// Sum of p over p >= threshold (and p > 0), and how many such p.
__device__ void KeptMass(const float* p, int vocab, float threshold, float* scratch, float* mass,
                         float* count) {
  float s = 0.0f, c = 0.0f;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = p[i];
    if (v > 0.0f && v >= threshold) {
      s += v;
      c += 1.0f;
    }
  }
  *mass = BlockSum(s, scratch);
  *count = BlockSum(c, scratch);
}

__global__ void __launch_bounds__(kSampleThreads)
    SampleKernel(const float* logits, const DeviceSampleSpec* specs, int vocab, float* probs,
                 int32_t* tokens) {
  __shared__ float scratch[33];
  __shared__ float best_value[32];
  __shared__ int best_index[32];
  __shared__ float chunk_sums[kSampleThreads];
  __shared__ int chosen;
  const int64_t row = blockIdx.x;
  const float* x = logits + row * vocab;
  float* p = probs + row * vocab;
  const DeviceSampleSpec spec = specs[row];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  // 1. Argmax: the largest value, lowest id among equals; NaN never wins.
  float best = -INFINITY;
  int best_i = INT_MAX;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = x[i];
    if (v > best || (v == best && i < best_i)) {
      best = v;
      best_i = i;
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, best, offset);
    const int oi = __shfl_xor_sync(kFullMask, best_i, offset);
    if (ov > best || (ov == best && oi < best_i)) {
      best = ov;
      best_i = oi;
    }
  }
  if (lane == 0) {
    best_value[warp] = best;
    best_index[warp] = best_i;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) {
      if (best_value[w] > best || (best_value[w] == best && best_index[w] < best_i)) {
        best = best_value[w];
        best_i = best_index[w];
      }
    }
    best_value[0] = best;
    best_index[0] = best_i == INT_MAX ? 0 : best_i;
  }
  __syncthreads();
  best = best_value[0];
  best_i = best_index[0];
  if (!(spec.temperature > 0.0f) || !isfinite(best)) {
    if (threadIdx.x == 0) tokens[row] = best_i;
    return;
  }

  // 2. Unnormalised probabilities: the maximum maps to exactly 1.
  const float inv_t = 1.0f / spec.temperature;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float e = expf((x[i] - best) * inv_t);
    p[i] = e == e ? e : 0.0f;  // NaN logits get 0
  }
  __syncthreads();
  float mass, count;
  float threshold = 0.0f;
  KeptMass(p, vocab, threshold, scratch, &mass, &count);

  // 3. top_k, then top_p: bisection over the bit patterns of positive
  //    floats, which order like the floats. Invariant: the predicate holds
  //    at lo and fails at hi (above 1, where nothing is kept).
  if (spec.top_k > 0 && spec.top_k < vocab) {
    uint32_t lo = 0, hi = kOneBits + 1;
    while (hi - lo > 1) {
      const uint32_t mid = lo + (hi - lo) / 2;
      float m, c;
      KeptMass(p, vocab, __uint_as_float(mid), scratch, &m, &c);
      if (c >= static_cast<float>(spec.top_k)) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    threshold = __uint_as_float(lo);
    KeptMass(p, vocab, threshold, scratch, &mass, &count);
  }
  if (spec.top_p < 1.0f) {
    const float target = fmaxf(spec.top_p, 0.0f) * mass;
    uint32_t lo = __float_as_uint(threshold), hi = kOneBits + 1;
    while (hi - lo > 1) {
      const uint32_t mid = lo + (hi - lo) / 2;
      float m, c;
      KeptMass(p, vocab, __uint_as_float(mid), scratch, &m, &c);
      if (m >= target) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    threshold = __uint_as_float(lo);
    KeptMass(p, vocab, threshold, scratch, &mass, &count);
  }

  // 4. The draw, in id order: each thread owns a contiguous chunk; a scan of
  //    the chunk sums finds the chunk holding r, whose thread walks it.
  const float r = spec.uniform * mass;
  const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
  const int first = threadIdx.x * chunk, last = min(vocab, first + chunk);
  float own = 0.0f;
  int own_last = -1;
  for (int i = first; i < last; ++i) {
    if (p[i] > 0.0f && p[i] >= threshold) {
      own += p[i];
      own_last = i;
    }
  }
  chunk_sums[threadIdx.x] = own;
  if (threadIdx.x == 0) chosen = -1;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < static_cast<int>(blockDim.x); ++i) chunk_sums[i] += chunk_sums[i - 1];
  }
  __syncthreads();
  const float before = threadIdx.x == 0 ? 0.0f : chunk_sums[threadIdx.x - 1];
  if (own_last >= 0 && r >= before && r < chunk_sums[threadIdx.x]) {
    float cumulative = before;
    int pick = own_last;  // rounding may leave r past the walk's end
    for (int i = first; i < last; ++i) {
      if (p[i] > 0.0f && p[i] >= threshold) {
        cumulative += p[i];
        if (r < cumulative) {
          pick = i;
          break;
        }
      }
    }
    chosen = pick;  // the intervals are disjoint: one writer at most
  }
  __syncthreads();
  if (chosen < 0) {
    // r at or past the total through rounding: the last kept token.
    if (threadIdx.x == 0) best_index[0] = -1;
    __syncthreads();
    if (own_last >= 0) atomicMax(&best_index[0], own_last);
    __syncthreads();
    if (threadIdx.x == 0) tokens[row] = best_index[0];
  } else if (threadIdx.x == 0) {
    tokens[row] = chosen;
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------

// Every kernel file is built for the same architectures, so one kernel's
// image stands for all of them.
cudaError_t CheckKernelImage() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, SampleKernel);
}

cudaError_t SampleTokens(const float* logits, const DeviceSampleSpec* specs, int rows, int vocab,
                         float* probs, int32_t* tokens, cudaStream_t stream) {
  if (rows > 0) {
    SampleKernel<<<rows, kSampleThreads, 0, stream>>>(logits, specs, vocab, probs, tokens);
  }
  return cudaGetLastError();
}

}  // namespace coalesce::engine::cuda
