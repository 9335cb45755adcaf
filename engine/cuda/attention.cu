// Attention kernels of the CUDA backend: RoPE fused with the write of K and
// V into the paged cache, and paged attention (+ the combine of its splits);
// kernels.h says what each computes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "engine/cuda/device_helpers.cuh"
#include "engine/cuda/kernels.h"

namespace coalesce::engine::cuda {
namespace {

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

// ---------------------------------------------------------------------------
// RoPE + KV write
// ---------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------
// Paged attention over fixed-size splits
// ---------------------------------------------------------------------------

constexpr int kSplitWarps = 4;
constexpr int kSplitThreads = kSplitWarps * 32;
constexpr int kSplitStages = 2;  // the tile in use and the next one, in flight

__device__ __forceinline__ void CopyAsync16(void* shared, const void* global) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global));
}
__device__ __forceinline__ void CopyAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// One 32-bit word of T as floats: one float, or two 16-bit values.
__device__ __forceinline__ void UnpackWord(uint32_t w, float* out, float) {
  out[0] = __uint_as_float(w);
}
__device__ __forceinline__ void UnpackWord(uint32_t w, float* out, __nv_bfloat16) {
  __nv_bfloat162 pair;
  memcpy(&pair, &w, sizeof(pair));
  const float2 f = __bfloat1622float2(pair);
  out[0] = f.x;
  out[1] = f.y;
}
__device__ __forceinline__ void UnpackWord(uint32_t w, float* out, __half) {
  __half2 pair;
  memcpy(&pair, &w, sizeof(pair));
  const float2 f = __half22float2(pair);
  out[0] = f.x;
  out[1] = f.y;
}

// N consecutive values of T at p (aligned to their size, at least 4 bytes)
// as floats, in loads as wide as they allow.
template <typename T, int N>
__device__ __forceinline__ void LoadAsFloats(const char* p, float (&out)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  constexpr int kPerWord = 4 / static_cast<int>(sizeof(T));
  static_assert(kBytes % 4 == 0, "whole 32-bit words");
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      const uint4 r = reinterpret_cast<const uint4*>(p)[i];
      const uint32_t words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) UnpackWord(words[w], out + (4 * i + w) * kPerWord, T{});
    }
  } else if constexpr (kBytes == 8) {
    const uint2 r = *reinterpret_cast<const uint2*>(p);
    UnpackWord(r.x, out, T{});
    UnpackWord(r.y, out + kPerWord, T{});
  } else {
    static_assert(kBytes == 4, "4, 8 or a multiple of 16 bytes");
    UnpackWord(*reinterpret_cast<const uint32_t*>(p), out, T{});
  }
}

// Shared memory of SplitAttentionKernel, in bytes: q of the group's query
// heads as float [ratio, head_dim]; the split's block ids; then num_stages
// (the kernel's kStages) stages of a K tile [kSplitTile, row + 16] and a V tile [kSplitTile, row],
// raw T (row = head_dim * sizeof(T)). Lane j scores key j of a tile with
// 16-byte loads along its K row; the extra 16 bytes put the eight lanes of a
// quarter-warp on distinct bank quads. The V tile is read a row at a time by
// the whole warp: no padding needed.
struct SplitSmem {
  int row, k_stride, table_offset, stages_offset, stage_bytes, total;
  __host__ __device__ SplitSmem(int head_dim, int element_bytes, int ratio, int split_size,
                                int block_size, int num_stages = kSplitStages) {
    row = head_dim * element_bytes;
    k_stride = row + 16;
    table_offset = ratio * head_dim * 4;  // a multiple of 16: head_dim is 64, 128 or 256
    const int blocks = split_size / block_size + 2;
    stages_offset = table_offset + (blocks * 4 + 15) / 16 * 16;
    stage_bytes = kSplitTile * (k_stride + row);
    total = stages_offset + num_stages * stage_bytes;
  }
};

// One (token, KV head, split of s.split_size positions): every query head of
// the KV head (kHeadsPerWarp per warp), head size kHd. Scores: lane j takes
// key j of the tile. Values: lane i keeps output elements
// [i * kHd / 32, (i + 1) * kHd / 32) of each of its warp's heads. kStages
// tiles are in shared memory at once: the one in use and kStages - 1 in
// flight. kLoadsOnly (coalesce-gpu-bench's diagnostic) skips the arithmetic.
template <typename T, int kHeadsPerWarp, int kHd, int kStages = kSplitStages,
          bool kLoadsOnly = false>
__global__ void __launch_bounds__(kSplitThreads)
    SplitAttentionKernel(const float* q, const T* k_cache, const T* v_cache,
                         const int32_t* positions, const int32_t* token_seq,
                         const int32_t* block_tables, AttentionShape s, float* partial_out,
                         float* partial_ml, T* out) {
  constexpr int kPerLane = kHd / 32;
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // values per 16-byte chunk
  constexpr int kChunks = kHd / kVec;                     // chunks per row
  extern __shared__ float4 smem4[];                       // float4: 16-byte aligned
  char* smem = reinterpret_cast<char*>(smem4);
  const int t = blockIdx.x, g = blockIdx.y, split = blockIdx.z;
  const int ctx = positions[t] + 1;
  const int begin = split * s.split_size;
  if (begin >= ctx) return;  // past the token's context: the combine reads no partial here
  const int end = min(ctx, begin + s.split_size);
  const int ratio = s.n_heads / s.n_kv_heads, kv_dim = s.n_kv_heads * kHd;
  const SplitSmem layout(kHd, sizeof(T), ratio, s.split_size, s.block_size, kStages);
  float* q_group = reinterpret_cast<float*>(smem);  // [ratio, kHd]
  int32_t* blocks = reinterpret_cast<int32_t*>(smem + layout.table_offset);
  char* stages = smem + layout.stages_offset;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // The split's block ids, before any load is issued.
  const int32_t* table = block_tables + static_cast<int64_t>(token_seq[t]) * s.max_blocks_per_seq;
  const int first_block = begin / s.block_size;
  const int n_blocks = (end - 1) / s.block_size - first_block + 1;
  for (int i = threadIdx.x; i < n_blocks; i += kSplitThreads) blocks[i] = table[first_block + i];
  __syncthreads();

  const int n_tiles = (end - begin + kSplitTile - 1) / kSplitTile;
  // A power-of-two block size (the usual 16) divides by a shift.
  const int block_shift = (s.block_size & (s.block_size - 1)) == 0 ? __ffs(s.block_size) - 1 : -1;
  // Issues the copies of tile `tile` into stage `tile % kStages`, as one
  // group of this thread's copies (an empty group past the last tile, so
  // that every iteration waits for the same count).
  auto issue = [&](int tile) {
    if (tile >= n_tiles) {
      CopyAsyncCommit();
      return;
    }
    const int base = begin + tile * kSplitTile, n = min(kSplitTile, end - base);
    char* k_dst = stages + (tile % kStages) * layout.stage_bytes;
    char* v_dst = k_dst + kSplitTile * layout.k_stride;
    for (int i = threadIdx.x; i < n * kChunks; i += kSplitThreads) {
      const int j = i / kChunks, c = i - j * kChunks, p = base + j;
      const int b = block_shift >= 0 ? p >> block_shift : p / s.block_size;
      const int64_t slot =
          static_cast<int64_t>(blocks[b - first_block]) * s.block_size + (p - b * s.block_size);
      const int64_t offset = slot * kv_dim + static_cast<int64_t>(g) * kHd + c * kVec;
      CopyAsync16(k_dst + j * layout.k_stride + c * 16, k_cache + offset);
      CopyAsync16(v_dst + j * layout.row + c * 16, v_cache + offset);
    }
    CopyAsyncCommit();
  };

  float m[kHeadsPerWarp], l[kHeadsPerWarp], acc[kHeadsPerWarp][kPerLane];
#pragma unroll
  for (int hi = 0; hi < kHeadsPerWarp; ++hi) {
    m[hi] = -INFINITY;
    l[hi] = 0.0f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) acc[hi][e] = 0.0f;
  }
  const float scale = rsqrtf(static_cast<float>(kHd));

  // The first tiles' copies go out before q is read, so that the
  // latencies overlap; the loop's first barrier publishes q_group.
#pragma unroll
  for (int tile = 0; tile < kStages - 1; ++tile) issue(tile);
  const float* q_row =
      q + static_cast<int64_t>(t) * s.q_stride + static_cast<int64_t>(g) * ratio * kHd;
  for (int i = threadIdx.x; i < ratio * kHd; i += kSplitThreads) q_group[i] = q_row[i];
  for (int tile = 0; tile < n_tiles; ++tile) {
    issue(tile + kStages - 1);
    CopyAsyncWait<kStages - 1>();  // this thread's copies of `tile` have landed
    __syncthreads();               // and every other thread's
    if constexpr (kLoadsOnly) {
      __syncthreads();
      continue;
    }
    const int n = min(kSplitTile, end - (begin + tile * kSplitTile));
    const char* k_tile = stages + (tile % kStages) * layout.stage_bytes;
    const char* v_tile = k_tile + kSplitTile * layout.k_stride;

    // Scores: each lane its key's row, once, against each of its warp's heads,
    // four independent sums per head.
    float dot[kHeadsPerWarp][4];
#pragma unroll
    for (int hi = 0; hi < kHeadsPerWarp; ++hi) {
#pragma unroll
      for (int u = 0; u < 4; ++u) dot[hi][u] = 0.0f;
    }
    if (lane < n) {
      const char* k_row = k_tile + lane * layout.k_stride;
#pragma unroll 4
      for (int c = 0; c < kChunks; ++c) {
        float kf[kVec];
        LoadAsFloats<T, kVec>(k_row + c * 16, kf);
#pragma unroll
        for (int hi = 0; hi < kHeadsPerWarp; ++hi) {
          const int h = warp + hi * kSplitWarps;
          if (h < ratio) {  // warp-uniform
            const float4* qh = reinterpret_cast<const float4*>(q_group + h * kHd + c * kVec);
#pragma unroll
            for (int e = 0; e < kVec / 4; ++e) {
              const float4 a = qh[e];
              dot[hi][0] += a.x * kf[4 * e];
              dot[hi][1] += a.y * kf[4 * e + 1];
              dot[hi][2] += a.z * kf[4 * e + 2];
              dot[hi][3] += a.w * kf[4 * e + 3];
            }
          }
        }
      }
    }
    // Online softmax, per head.
    float p[kHeadsPerWarp];
#pragma unroll
    for (int hi = 0; hi < kHeadsPerWarp; ++hi) {
      p[hi] = 0.0f;
      if (warp + hi * kSplitWarps < ratio) {
        const float score =
            lane < n ? ((dot[hi][0] + dot[hi][1]) + (dot[hi][2] + dot[hi][3])) * scale : -INFINITY;
        const float m_new = fmaxf(m[hi], WarpMax(score));  // finite: n >= 1
        p[hi] = lane < n ? expf(score - m_new) : 0.0f;
        const float correction = expf(m[hi] - m_new);  // 0 on the first tile
        l[hi] = l[hi] * correction + WarpSum(p[hi]);
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) acc[hi][e] *= correction;
        m[hi] = m_new;
      }
    }
    // Values: row j of the V tile, the lane's elements, for every head.
    if (warp < ratio) {
#pragma unroll 4
      for (int j = 0; j < n; ++j) {
        float vf[kPerLane];
        LoadAsFloats<T, kPerLane>(v_tile + j * layout.row + lane * kPerLane * sizeof(T), vf);
#pragma unroll
        for (int hi = 0; hi < kHeadsPerWarp; ++hi) {
          if (warp + hi * kSplitWarps < ratio) {
            const float pj = __shfl_sync(kFullMask, p[hi], j);
#pragma unroll
            for (int e = 0; e < kPerLane; ++e) acc[hi][e] += pj * vf[e];
          }
        }
      }
    }
    __syncthreads();  // the stage is used up before the next issue refills it
  }

#pragma unroll
  for (int hi = 0; hi < kHeadsPerWarp; ++hi) {
    const int h = warp + hi * kSplitWarps;
    if (h < ratio) {
      const int64_t head = static_cast<int64_t>(t) * s.n_heads + g * ratio + h;
      if (s.num_splits == 1) {
        // The combine's arithmetic for one split (weight exp(0) = 1): the
        // same bits.
        const float inv = 1.0f / l[hi];
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
          out[head * kHd + lane * kPerLane + e] = FromFloat<T>(acc[hi][e] * inv);
        }
      } else {
        const int64_t idx = head * s.num_splits + split;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
          partial_out[idx * kHd + lane * kPerLane + e] = acc[hi][e];
        }
        if (lane == 0) {
          partial_ml[idx * 2] = m[hi];
          partial_ml[idx * 2 + 1] = l[hi];
        }
      }
    }
  }
}

template <typename T>
using SplitKernel = void (*)(const float*, const T*, const T*, const int32_t*, const int32_t*,
                             const int32_t*, AttentionShape, float*, float*, T*);

// The instantiation for this head size (SplitAttentionSupported) and GQA
// ratio (query heads per warp: 1, 2, 4).
template <typename T>
SplitKernel<T> PickSplitKernel(int head_dim, int ratio) {
  const int heads = (ratio + kSplitWarps - 1) / kSplitWarps;
  const int heads_per_warp = heads <= 1 ? 1 : heads <= 2 ? 2 : 4;
#define COALESCE_PICK(H, D) \
  if (heads_per_warp == H && head_dim == D) return SplitAttentionKernel<T, H, D>;
#define COALESCE_PICK_D(H) COALESCE_PICK(H, 64) COALESCE_PICK(H, 128) COALESCE_PICK(H, 256)
  COALESCE_PICK_D(1)
  COALESCE_PICK_D(2)
  COALESCE_PICK_D(4)
#undef COALESCE_PICK_D
#undef COALESCE_PICK
  return nullptr;
}

// coalesce-gpu-bench's variants of the split kernel for 128-value heads and
// up to four query heads per KV head.
template <typename T>
SplitKernel<T> PickSplitVariant(int stages, bool loads_only) {
#define COALESCE_PICK(S, L) \
  if (stages == S && loads_only == L) return SplitAttentionKernel<T, 1, 128, S, L>;
  COALESCE_PICK(2, false)
  COALESCE_PICK(3, false)
  COALESCE_PICK(4, false)
  COALESCE_PICK(2, true)
  COALESCE_PICK(4, true)
#undef COALESCE_PICK
  return nullptr;
}

// Merges the splits of one (token, head): rescales each split's sum and
// output by exp(m_split - m_max). The splits' weights are worked out once, in
// shared memory, so the output loop only streams the partial outputs.
// With a split_size, token t has ceil(context / split_size) splits of the
// num_splits its partials are spaced by.
template <typename T>
__global__ void AttentionCombineKernel(const float* partial_out, const float* partial_ml,
                                       const int32_t* positions, AttentionShape s, T* out) {
  __shared__ float m_split[kMaxSplits], l_split[kMaxSplits], weight[kMaxSplits];
  __shared__ float inv_sum;
  const int t = blockIdx.x, h = blockIdx.y, hd = s.head_dim;
  const int splits = s.split_size > 0
                         ? min(s.num_splits, (positions[t] + s.split_size) / s.split_size)
                         : s.num_splits;
  const int64_t idx0 = (static_cast<int64_t>(t) * s.n_heads + h) * s.num_splits;
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

}  // namespace

// ---------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------

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
      shape.num_splits < 1 || shape.num_splits > kMaxSplits || shape.split_size < 0 ||
      shape.split_size % kSplitTile != 0 ||
      (shape.split_size > 0 && !SplitAttentionSupported(shape.head_dim))) {
    return cudaErrorInvalidValue;
  }
  const dim3 combine_grid(shape.rows, shape.n_heads);
  const int combine_threads = shape.head_dim >= 128 ? 128 : 64;
  if (shape.split_size > 0) {
    const int ratio = shape.n_heads / shape.n_kv_heads;
    const SplitSmem layout(shape.head_dim, sizeof(T), ratio, shape.split_size, shape.block_size);
    const dim3 grid(shape.rows, shape.n_kv_heads, shape.num_splits);
    PickSplitKernel<T>(shape.head_dim, ratio)<<<grid, kSplitThreads, layout.total, stream>>>(
        q, k_cache, v_cache, positions, token_seq, block_tables, shape, partial_out, partial_ml,
        out);
    if (shape.num_splits > 1) {
      AttentionCombineKernel<T><<<combine_grid, combine_threads, 0, stream>>>(
          partial_out, partial_ml, positions, shape, out);
    }
    return cudaGetLastError();
  }
  const size_t shared = AttentionSharedBytes(shape.head_dim, shape.n_heads / shape.n_kv_heads);
  const AttentionKernel<T> kernel =
      PickAttentionKernel<T>(shape.head_dim, shape.n_heads / shape.n_kv_heads);
  const dim3 grid(shape.rows, shape.n_kv_heads, shape.num_splits);
  kernel<<<grid, kAttnWarps * 32, shared, stream>>>(q, k_cache, v_cache, positions, token_seq,
                                                    block_tables, shape, partial_out, partial_ml);
  AttentionCombineKernel<T><<<combine_grid, combine_threads, 0, stream>>>(partial_out, partial_ml,
                                                                          positions, shape, out);
  return cudaGetLastError();
}

template <typename T>
cudaError_t ConfigureAttention(int head_dim, int gqa_ratio) {
  if (head_dim > kMaxHeadDim || gqa_ratio > kMaxGqaRatio) return cudaErrorInvalidValue;
  if (const cudaError_t err = cudaFuncSetAttribute(
          PickAttentionKernel<T>(head_dim, gqa_ratio), cudaFuncAttributeMaxDynamicSharedMemorySize,
          static_cast<int>(AttentionSharedBytes(head_dim, gqa_ratio)));
      err != cudaSuccess || !SplitAttentionSupported(head_dim)) {
    return err;
  }
  // The split kernel's need depends on split_size and block_size: allow it
  // all the device gives a block.
  int device = 0, most = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (const cudaError_t err =
          cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
      err != cudaSuccess) {
    return err;
  }
  return cudaFuncSetAttribute(PickSplitKernel<T>(head_dim, gqa_ratio),
                              cudaFuncAttributeMaxDynamicSharedMemorySize, most);
}

template <typename T>
cudaError_t SplitAttentionVariant(const float* q, const T* k_cache, const T* v_cache,
                                  const int32_t* positions, const int32_t* token_seq,
                                  const int32_t* block_tables, const AttentionShape& shape,
                                  float* partial_out, float* partial_ml, T* out, int stages,
                                  bool loads_only, cudaStream_t stream) {
  const SplitKernel<T> kernel = PickSplitVariant<T>(stages, loads_only);
  if (kernel == nullptr || shape.rows <= 0 || shape.head_dim != 128 || shape.n_kv_heads <= 0 ||
      shape.n_heads % shape.n_kv_heads != 0 || shape.n_heads / shape.n_kv_heads > kSplitWarps ||
      shape.split_size <= 0 || shape.split_size % kSplitTile != 0 || shape.num_splits < 1 ||
      shape.num_splits > kMaxSplits) {
    return cudaErrorInvalidValue;
  }
  const int ratio = shape.n_heads / shape.n_kv_heads;
  const SplitSmem layout(shape.head_dim, sizeof(T), ratio, shape.split_size, shape.block_size,
                         stages);
  static bool configured[5][2] = {};  // once per variant, outside the timed launches
  if (!configured[stages][loads_only]) {
    if (const cudaError_t err =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024);
        err != cudaSuccess) {
      return err;
    }
    configured[stages][loads_only] = true;
  }
  const dim3 grid(shape.rows, shape.n_kv_heads, shape.num_splits);
  kernel<<<grid, kSplitThreads, layout.total, stream>>>(
      q, k_cache, v_cache, positions, token_seq, block_tables, shape, partial_out, partial_ml, out);
  if (shape.num_splits > 1) {
    AttentionCombineKernel<T><<<dim3(shape.rows, shape.n_heads), 128, 0, stream>>>(
        partial_out, partial_ml, positions, shape, out);
  }
  return cudaGetLastError();
}
template cudaError_t SplitAttentionVariant<__nv_bfloat16>(const float*, const __nv_bfloat16*,
                                                          const __nv_bfloat16*, const int32_t*,
                                                          const int32_t*, const int32_t*,
                                                          const AttentionShape&, float*, float*,
                                                          __nv_bfloat16*, int, bool, cudaStream_t);

#define COALESCE_INSTANTIATE(T)                                                                  \
  template cudaError_t RopeAndCacheKv<T>(float*, const float*, const float*, const float*,       \
                                         const int32_t*, const int32_t*, int, int, int, int, T*, \
                                         T*, cudaStream_t);                                      \
  template cudaError_t PagedAttention<T>(const float*, const T*, const T*, const int32_t*,       \
                                         const int32_t*, const int32_t*, const AttentionShape&,  \
                                         float*, float*, T*, cudaStream_t);                      \
  template cudaError_t ConfigureAttention<T>(int, int);

COALESCE_INSTANTIATE(float)
COALESCE_INSTANTIATE(__half)
COALESCE_INSTANTIATE(__nv_bfloat16)
#undef COALESCE_INSTANTIATE

}  // namespace coalesce::engine::cuda
