// Kernels of the CUDA backend; kernels.h says what each computes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>

#include "engine/cuda/kernels.h"

namespace coalesce::engine::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

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

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

// Sum over the thread block (blockDim.x a multiple of 32, at most 1024);
// every thread gets the result. `scratch` holds 33 floats of shared memory.
__device__ float BlockSum(float v, float* scratch) {
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

// Grid size for a grid-stride loop over n elements.
inline unsigned GridFor(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65536 ? 65536 : blocks));
}

// ---------------------------------------------------------------------------
// Embedding, RMSNorm, RoPE + KV write, SwiGLU
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
__global__ void RopeAndCacheKvKernel(float* qkv, const float* bias, const float* rope_cos,
                                     const float* rope_sin, const int32_t* positions,
                                     const int32_t* slots, int n_heads, int n_kv_heads,
                                     int head_dim, T* k_cache, T* v_cache) {
  const int q_dim = n_heads * head_dim, kv_dim = n_kv_heads * head_dim;
  const int width = q_dim + 2 * kv_dim, half = head_dim / 2;
  const int64_t t = blockIdx.x;
  float* row = qkv + t * width;
  const float* cos = rope_cos + static_cast<int64_t>(positions[t]) * half;
  const float* sin = rope_sin + static_cast<int64_t>(positions[t]) * half;
  const int64_t slot = slots[t];
  // Pairs of q, then of k: q_dim is a multiple of head_dim, so e % head_dim
  // is the offset within the head in both.
  for (int i = threadIdx.x; i < (q_dim + kv_dim) / 2; i += blockDim.x) {
    const int e = 2 * i, j = (e % head_dim) / 2;
    float v0 = row[e], v1 = row[e + 1];
    if (bias != nullptr) {
      v0 += bias[e];
      v1 += bias[e + 1];
    }
    const float r0 = v0 * cos[j] - v1 * sin[j];
    const float r1 = v0 * sin[j] + v1 * cos[j];
    if (e < q_dim) {
      row[e] = r0;
      row[e + 1] = r1;
    } else {
      k_cache[slot * kv_dim + (e - q_dim)] = FromFloat<T>(r0);
      k_cache[slot * kv_dim + (e - q_dim) + 1] = FromFloat<T>(r1);
    }
  }
  for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
    float v = row[q_dim + kv_dim + i];
    if (bias != nullptr) v += bias[q_dim + kv_dim + i];
    v_cache[slot * kv_dim + i] = FromFloat<T>(v);
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
// Skinny matrix product
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

// ---------------------------------------------------------------------------
// Paged attention
// ---------------------------------------------------------------------------

constexpr int kAttnWarps = 4;
constexpr int kAttnTile = 32;  // key positions per shared-memory tile: one per lane
// Shared-memory layout of PagedAttentionKernel, in floats. Lane j computes the
// score of key j of a tile with 16-byte loads along its K row: rows (and q)
// are padded to whole float4s (zeros past head_dim), plus one float4 so that
// the eight lanes of a quarter-warp start on distinct bank quads (row stride
// = 4 mod 32 banks): no conflicts.
struct AttentionSmem {
  int hd_pad;    // head_dim rounded up to a multiple of 4
  int k_stride;  // hd_pad + 4
  __host__ __device__ AttentionSmem(int head_dim)
      : hd_pad((head_dim + 3) / 4 * 4), k_stride((head_dim + 3) / 4 * 4 + 4) {}
  // q_group [ratio, hd_pad], then k_tile [kAttnTile, k_stride], then
  // v_tile [kAttnTile, head_dim].
  __host__ __device__ int k_offset(int ratio) const { return ratio * hd_pad; }
  __host__ __device__ int v_offset(int ratio) const {
    return k_offset(ratio) + kAttnTile * k_stride;
  }
};

size_t AttentionSharedBytes(int head_dim, int ratio) {
  const AttentionSmem layout(head_dim);
  return sizeof(float) *
         (static_cast<size_t>(layout.v_offset(ratio)) + static_cast<size_t>(kAttnTile) * head_dim);
}

// Instantiated for the head size and GQA ratio it serves
// (PickAttentionKernel), so that its per-lane output accumulators
// (kHeadsPerWarp query heads per warp, kPerLane elements of each per lane)
// take only the registers they need.
template <typename T, int kHeadsPerWarp, int kPerLane>
__global__ void __launch_bounds__(kAttnWarps * 32)
    PagedAttentionKernel(const float* q, const T* k_cache, const T* v_cache,
                         const int32_t* positions, const int32_t* token_seq,
                         const int32_t* block_tables, AttentionShape s, float* partial_out,
                         float* partial_ml) {
  extern __shared__ float4 smem4[];  // float4: 16-byte aligned
  float* smem = reinterpret_cast<float*>(smem4);
  const int hd = s.head_dim, ratio = s.n_heads / s.n_kv_heads, kv_dim = s.n_kv_heads * hd;
  const AttentionSmem layout(hd);
  const int k_stride = layout.k_stride, hd_pad = layout.hd_pad;
  float* q_group = smem;                          // [ratio, hd_pad]
  float* k_tile = smem + layout.k_offset(ratio);  // [kAttnTile, k_stride]
  float* v_tile = smem + layout.v_offset(ratio);  // [kAttnTile, hd]

  const int t = blockIdx.x, g = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int ctx = positions[t] + 1;
  const int32_t* table = block_tables + static_cast<int64_t>(token_seq[t]) * s.max_blocks_per_seq;
  // Splits cover whole tiles; trailing ones may be empty.
  int split_len = (ctx + s.num_splits - 1) / s.num_splits;
  split_len = (split_len + kAttnTile - 1) / kAttnTile * kAttnTile;
  const int begin = split * split_len;
  const int end = min(ctx, begin + split_len);
  const float scale = rsqrtf(static_cast<float>(hd));

  const float* q_row =
      q + static_cast<int64_t>(t) * s.q_stride + static_cast<int64_t>(g) * ratio * hd;
  for (int i = threadIdx.x; i < ratio * hd_pad; i += blockDim.x) {
    const int h = i / hd_pad, d = i - h * hd_pad;
    q_group[i] = d < hd ? q_row[h * hd + d] : 0.0f;
  }
  // The padding columns of the K tile, never loaded, must be zeros.
  for (int i = threadIdx.x; i < kAttnTile * (hd_pad - hd); i += blockDim.x) {
    const int j = i / (hd_pad - hd);
    k_tile[j * k_stride + hd + (i - j * (hd_pad - hd))] = 0.0f;
  }

  float m[kHeadsPerWarp], l[kHeadsPerWarp], acc[kHeadsPerWarp][kPerLane];
#pragma unroll
  for (int hi = 0; hi < kHeadsPerWarp; ++hi) {
    m[hi] = -INFINITY;
    l[hi] = 0.0f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) acc[hi][e] = 0.0f;
  }

  for (int base = begin; base < end; base += kAttnTile) {
    const int n = min(kAttnTile, end - base);
    __syncthreads();  // the previous tile is consumed; q_group is written
    constexpr int kVec = Vec16<T>::kSize;
    if (hd % kVec == 0) {
      // 16-byte loads (a head's row is whole vectors, and so is every row
      // offset: kv_dim and g * hd are multiples of head_dim), kBatch of K and
      // of V in flight per thread before any is used: one memory latency per
      // tile rather than one per vector.
      constexpr int kBatch = 4;
      constexpr int kThreads = kAttnWarps * 32;
      const int vecs = hd / kVec, total = n * vecs;
      for (int first = threadIdx.x; first < total; first += kBatch * kThreads) {
        uint4 k_raw[kBatch], v_raw[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int i = first + u * kThreads;
          if (i < total) {
            const int j = i / vecs, d = (i - j * vecs) * kVec, p = base + j;
            const int64_t slot =
                static_cast<int64_t>(table[p / s.block_size]) * s.block_size + p % s.block_size;
            const int64_t offset = slot * kv_dim + static_cast<int64_t>(g) * hd + d;
            k_raw[u] = *reinterpret_cast<const uint4*>(k_cache + offset);
            v_raw[u] = *reinterpret_cast<const uint4*>(v_cache + offset);
          }
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int i = first + u * kThreads;
          if (i < total) {
            const int j = i / vecs, d = (i - j * vecs) * kVec;
            float kf[kVec], vf[kVec];
            Unpack(k_raw[u], kf, T{});
            Unpack(v_raw[u], vf, T{});
            // 16-byte stores: both rows start on a float4 (k_stride and hd
            // are multiples of 4 here, d of kVec).
            float4* k_dst = reinterpret_cast<float4*>(k_tile + j * k_stride + d);
            float4* v_dst = reinterpret_cast<float4*>(v_tile + j * hd + d);
#pragma unroll
            for (int e = 0; e < kVec / 4; ++e) {
              k_dst[e] = make_float4(kf[4 * e], kf[4 * e + 1], kf[4 * e + 2], kf[4 * e + 3]);
              v_dst[e] = make_float4(vf[4 * e], vf[4 * e + 1], vf[4 * e + 2], vf[4 * e + 3]);
            }
          }
        }
      }
    } else {
      for (int i = threadIdx.x; i < n * hd; i += blockDim.x) {
        const int j = i / hd, d = i - j * hd, p = base + j;
        const int64_t slot =
            static_cast<int64_t>(table[p / s.block_size]) * s.block_size + p % s.block_size;
        const int64_t offset = slot * kv_dim + static_cast<int64_t>(g) * hd + d;
        k_tile[j * k_stride + d] = ToFloat(k_cache[offset]);
        v_tile[j * hd + d] = ToFloat(v_cache[offset]);
      }
    }
    __syncthreads();
#pragma unroll
    for (int hi = 0; hi < kHeadsPerWarp; ++hi) {
      const int h = warp + hi * kAttnWarps;  // query head within the group
      if (h < ratio) {                       // warp-uniform
        float score = -INFINITY;
        if (lane < n) {
          // Four independent sums: the loads and multiply-adds pipeline.
          const float4* qh = reinterpret_cast<const float4*>(q_group + h * hd_pad);
          const float4* kr = reinterpret_cast<const float4*>(k_tile + lane * k_stride);
          float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma unroll 4
          for (int v = 0; v < hd_pad / 4; ++v) {
            const float4 a = qh[v], b = kr[v];
            d0 += a.x * b.x;
            d1 += a.y * b.y;
            d2 += a.z * b.z;
            d3 += a.w * b.w;
          }
          score = ((d0 + d1) + (d2 + d3)) * scale;
        }
        const float m_new = fmaxf(m[hi], WarpMax(score));
        const float p = lane < n ? expf(score - m_new) : 0.0f;
        const float correction = expf(m[hi] - m_new);  // 0 on the first tile
        l[hi] = l[hi] * correction + WarpSum(p);
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) acc[hi][e] *= correction;
#pragma unroll 8
        for (int j = 0; j < n; ++j) {
          const float pj = __shfl_sync(kFullMask, p, j);
          const float* vr = v_tile + j * hd;
#pragma unroll
          for (int e = 0; e < kPerLane; ++e) {
            const int d = lane + 32 * e;
            if (d < hd) acc[hi][e] += pj * vr[d];
          }
        }
        m[hi] = m_new;
      }
    }
  }

#pragma unroll
  for (int hi = 0; hi < kHeadsPerWarp; ++hi) {
    const int h = warp + hi * kAttnWarps;
    if (h < ratio) {
      const int64_t idx =
          (static_cast<int64_t>(t) * s.n_heads + g * ratio + h) * s.num_splits + split;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const int d = lane + 32 * e;
        if (d < hd) partial_out[idx * hd + d] = acc[hi][e];
      }
      if (lane == 0) {
        partial_ml[idx * 2] = m[hi];
        partial_ml[idx * 2 + 1] = l[hi];
      }
    }
  }
}

template <typename T>
using AttentionKernel = void (*)(const float*, const T*, const T*, const int32_t*, const int32_t*,
                                 const int32_t*, AttentionShape, float*, float*);

// The instantiation for this head size (elements per lane: 1, 2, 4, 8) and
// GQA ratio (query heads per warp: 1, 2, 4).
template <typename T>
AttentionKernel<T> PickAttentionKernel(int head_dim, int ratio) {
  const int per_lane = head_dim <= 32 ? 1 : head_dim <= 64 ? 2 : head_dim <= 128 ? 4 : 8;
  const int heads = (ratio + kAttnWarps - 1) / kAttnWarps;
  const int heads_per_warp = heads <= 1 ? 1 : heads <= 2 ? 2 : 4;
#define COALESCE_PICK(H, L) \
  if (heads_per_warp == H && per_lane == L) return PagedAttentionKernel<T, H, L>;
#define COALESCE_PICK_L(H) \
  COALESCE_PICK(H, 1) COALESCE_PICK(H, 2) COALESCE_PICK(H, 4) COALESCE_PICK(H, 8)
  COALESCE_PICK_L(1)
  COALESCE_PICK_L(2)
  COALESCE_PICK_L(4)
#undef COALESCE_PICK_L
#undef COALESCE_PICK
  return nullptr;  // unreachable for head_dim <= kMaxHeadDim, ratio <= kMaxGqaRatio
}

// Merges the splits of one (token, head): rescales each split's sum and
// output by exp(m_split - m_max). The splits' weights are worked out once, in
// shared memory, so the output loop only streams the partial outputs.
template <typename T>
__global__ void AttentionCombineKernel(const float* partial_out, const float* partial_ml,
                                       AttentionShape s, T* out) {
  __shared__ float m_split[kMaxSplits], l_split[kMaxSplits], weight[kMaxSplits];
  __shared__ float inv_sum;
  const int t = blockIdx.x, h = blockIdx.y, hd = s.head_dim, splits = s.num_splits;
  const int64_t idx0 = (static_cast<int64_t>(t) * s.n_heads + h) * splits;
  for (int i = threadIdx.x; i < splits; i += blockDim.x) {
    m_split[i] = partial_ml[(idx0 + i) * 2];
    l_split[i] = partial_ml[(idx0 + i) * 2 + 1];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float m_max = -INFINITY;
    for (int i = 0; i < splits; ++i) {
      if (l_split[i] > 0.0f) m_max = fmaxf(m_max, m_split[i]);
    }
    float sum = 0.0f;
    for (int i = 0; i < splits; ++i) {
      weight[i] = l_split[i] > 0.0f ? expf(m_split[i] - m_max) : 0.0f;  // empty splits: 0
      sum += l_split[i] * weight[i];
    }
    inv_sum = 1.0f / sum;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float o = 0.0f;
#pragma unroll 8
    for (int i = 0; i < splits; ++i) o += partial_out[(idx0 + i) * hd + d] * weight[i];
    out[(static_cast<int64_t>(t) * s.n_heads + h) * hd + d] = FromFloat<T>(o * inv_sum);
  }
}

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
cudaError_t RopeAndCacheKv(float* qkv, const float* bias, const float* rope_cos,
                           const float* rope_sin, const int32_t* positions, const int32_t* slots,
                           int rows, int n_heads, int n_kv_heads, int head_dim, T* k_cache,
                           T* v_cache, cudaStream_t stream) {
  if (rows > 0) {
    RopeAndCacheKvKernel<T><<<rows, 256, 0, stream>>>(qkv, bias, rope_cos, rope_sin, positions,
                                                      slots, n_heads, n_kv_heads, head_dim, k_cache,
                                                      v_cache);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t PagedAttention(const float* q, const T* k_cache, const T* v_cache,
                           const int32_t* positions, const int32_t* token_seq,
                           const int32_t* block_tables, const AttentionShape& shape,
                           float* partial_out, float* partial_ml, T* out, cudaStream_t stream) {
  if (shape.rows <= 0) return cudaGetLastError();
  if (shape.head_dim > kMaxHeadDim || shape.n_kv_heads <= 0 ||
      shape.n_heads % shape.n_kv_heads != 0 || shape.n_heads / shape.n_kv_heads > kMaxGqaRatio ||
      shape.num_splits < 1 || shape.num_splits > kMaxSplits) {
    return cudaErrorInvalidValue;
  }
  const size_t shared = AttentionSharedBytes(shape.head_dim, shape.n_heads / shape.n_kv_heads);
  const AttentionKernel<T> kernel =
      PickAttentionKernel<T>(shape.head_dim, shape.n_heads / shape.n_kv_heads);
  const dim3 grid(shape.rows, shape.n_kv_heads, shape.num_splits);
  kernel<<<grid, kAttnWarps * 32, shared, stream>>>(q, k_cache, v_cache, positions, token_seq,
                                                    block_tables, shape, partial_out, partial_ml);
  const dim3 combine_grid(shape.rows, shape.n_heads);
  AttentionCombineKernel<T><<<combine_grid, shape.head_dim >= 128 ? 128 : 64, 0, stream>>>(
      partial_out, partial_ml, shape, out);
  return cudaGetLastError();
}

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

template <typename T>
cudaError_t ConfigureAttention(int head_dim, int gqa_ratio) {
  if (head_dim > kMaxHeadDim || gqa_ratio > kMaxGqaRatio) return cudaErrorInvalidValue;
  return cudaFuncSetAttribute(PickAttentionKernel<T>(head_dim, gqa_ratio),
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(AttentionSharedBytes(head_dim, gqa_ratio)));
}

cudaError_t CheckKernelImage() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, SampleKernel);
}

template <typename T>
cudaError_t SwiGlu(const float* gate_up, int rows, int hidden, T* out, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rows) * hidden;
  if (n > 0) SwiGluKernel<T><<<GridFor(n, 256), 256, 0, stream>>>(gate_up, rows, hidden, out);
  return cudaGetLastError();
}

cudaError_t SampleTokens(const float* logits, const DeviceSampleSpec* specs, int rows, int vocab,
                         float* probs, int32_t* tokens, cudaStream_t stream) {
  if (rows > 0) {
    SampleKernel<<<rows, kSampleThreads, 0, stream>>>(logits, specs, vocab, probs, tokens);
  }
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
  template cudaError_t RopeAndCacheKv<T>(float*, const float*, const float*, const float*,       \
                                         const int32_t*, const int32_t*, int, int, int, int, T*, \
                                         T*, cudaStream_t);                                      \
  template cudaError_t PagedAttention<T>(const float*, const T*, const T*, const int32_t*,       \
                                         const int32_t*, const int32_t*, const AttentionShape&,  \
                                         float*, float*, T*, cudaStream_t);                      \
  template cudaError_t SwiGlu<T>(const float*, int, int, T*, cudaStream_t);                      \
  template cudaError_t ConfigureAttention<T>(int, int);                                          \
  template cudaError_t SkinnyGemm<T>(const T*, int, int, const T*, int, float*, cudaStream_t);   \
  template cudaError_t ConvertFromFloat<T>(const float*, int64_t, T*, cudaStream_t);             \
  template cudaError_t FillUniform<T>(T*, int64_t, uint64_t, float, float, cudaStream_t);

COALESCE_INSTANTIATE(float)
COALESCE_INSTANTIATE(__half)
COALESCE_INSTANTIATE(__nv_bfloat16)
#undef COALESCE_INSTANTIATE

}  // namespace coalesce::engine::cuda
