// The CUDA backend's own kernels, as host functions that enqueue them on a
// stream. Every pointer is device memory. `T` is the storage type of weights,
// activations fed to cuBLAS and the KV cache: float, __half or
// __nv_bfloat16 (instantiated for those three beside each definition);
// arithmetic is float throughout. The residual stream and every cuBLAS output
// are float.
//
// Where each family is defined:
//   elementwise.cu  EmbedTokens, RmsNorm, SwiGlu, ConvertFromFloat, FillUniform
//   attention.cu    RopeAndCacheKv, ConfigureAttention, PagedAttention
//   gemm.cu         SkinnyGemm
//   sampling.cu     SampleTokens, CheckKernelImage
// with the device helpers they share in device_helpers.cuh.
//
// Layouts follow the CPU backend (cpu/cpu_backend.cc): rows are tokens,
// sequence after sequence; a head's rotary pairs are interleaved
// (x[2i], x[2i+1]); the KV cache of one layer is [slots, kv_dim] for K and the
// same for V, where token position p of a sequence lives in slot
// block_table[p / block_size] * block_size + p % block_size.
//
// Each launcher returns cudaGetLastError() after its launches, so a bad
// launch configuration is reported at the call that made it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace coalesce::engine::cuda {

// x[t, :] = float(table[tokens[t], :]).
//   table: [vocab, dim]   tokens: [rows]   x: [rows, dim]
template <typename T>
cudaError_t EmbedTokens(const T* table, const int32_t* tokens, int rows, int dim, float* x,
                        cudaStream_t stream);

// RMSNorm fused with the residual add. For output row r, with source row
// i = gather ? gather[r] : r:
//   if delta:  x[i] += delta[i] (+ bias)      (the residual add)
//   out[r] = T(weight * x[i] / sqrt(mean(x[i]^2) + eps))
// gather picks the last token of each sequence for the final norm.
//   x, delta: [*, dim]   bias, weight: [dim]   out: [rows, dim]
template <typename T>
cudaError_t RmsNorm(float* x, const float* delta, const float* bias, const float* weight,
                    const int32_t* gather, int rows, int dim, float eps, T* out,
                    cudaStream_t stream);

// After the fused q/k/v projection: adds the bias (if any), rotates q and k
// by each token's position (cos/sin tables [max_pos, head_dim / 2], built on
// the host exactly as the CPU backend builds them), leaves the rotated q in
// place and writes k and v to the token's KV slot.
//   qkv: [rows, n_heads * head_dim + 2 * kv_dim]   bias: [same width] or null
//   positions, slots: [rows]   k_cache, v_cache: [slots, kv_dim]
template <typename T>
cudaError_t RopeAndCacheKv(float* qkv, const float* bias, const float* rope_cos,
                           const float* rope_sin, const int32_t* positions, const int32_t* slots,
                           int rows, int n_heads, int n_kv_heads, int head_dim, T* k_cache,
                           T* v_cache, cudaStream_t stream);

// y[r, o] = sum_k x[r, k] * w[o, k] for r < rows <= kMaxSkinnyRows: the
// projections of a decode step with few tokens. One warp per output row reads
// the row once with 16-byte loads and keeps one sum per input row, so each
// row's result is the same whatever the other rows are. Needs
// SkinnyGemmSupported<T>(k) (rows of whole 16-byte vectors) and 16-byte
// aligned x and w.
//   x: [rows, k]   w: [out, k]   y: [rows, out]
inline constexpr int kMaxSkinnyRows = 8;
template <typename T>
constexpr bool SkinnyGemmSupported(int k) {
  return k % (16 / static_cast<int>(sizeof(T))) == 0;
}
template <typename T>
cudaError_t SkinnyGemm(const T* x, int rows, int k, const T* w, int out, float* y,
                       cudaStream_t stream);

// Shapes of one attention call.
struct AttentionShape {
  int rows = 0;                // query tokens
  int n_heads = 0;             // query heads
  int n_kv_heads = 0;          // key/value heads; n_heads % n_kv_heads == 0
  int head_dim = 0;            // <= kMaxHeadDim
  int block_size = 0;          // positions per KV block
  int max_blocks_per_seq = 0;  // row stride of block_tables
  int num_splits = 1;          // parts each token's context is split into (see split_size)
  int q_stride = 0;            // floats between consecutive rows of q
  // 0: each token's context is cut into num_splits parts of equal length.
  // Otherwise (SplitAttentionSupported): into parts of split_size positions,
  // ceil(context / split_size) of them, so that a token's result does not
  // depend on the other tokens of the launch; num_splits is then the grid's
  // count, at least ceil(longest context / split_size), and a launch with
  // num_splits == 1 writes its output without a combine.
  int split_size = 0;
};
inline constexpr int kMaxHeadDim = 256;
inline constexpr int kMaxGqaRatio = 16;
inline constexpr int kMaxSplits = 64;
// split_size is a multiple of this (keys per stage of the split kernel).
inline constexpr int kSplitTile = 32;
// Head sizes the fixed-size split kernel serves: 64, 128 and 256.
constexpr bool SplitAttentionSupported(int head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

// Allows PagedAttention<T> the shared memory that this head size and GQA
// ratio need (more than the default 48 KiB for large heads). Call once before
// the first launch, outside any graph capture.
template <typename T>
cudaError_t ConfigureAttention(int head_dim, int gqa_ratio);

// cudaSuccess when the kernels have an image for the current device
// (cudaErrorNoKernelImageForDevice when they were built for another
// architecture).
cudaError_t CheckKernelImage();

// Causal attention of each query row over its own sequence's cache, positions
// 0..positions[t]: softmax(q . k / sqrt(head_dim)) . v. One thread block
// serves one (token, KV head, split) and every query head of that KV head, so
// each K/V element is read from memory once per group of query heads. Each
// split writes a partial result (running max, sum and unnormalised output);
// a combine kernel merges the splits by their log-sum-exp. With split_size
// 0, splits past a token's context write an empty partial. With a
// split_size, the split kernel copies the split's block ids to shared memory
// first, then streams K and V in tiles of kSplitTile positions, raw, with
// 16-byte asynchronous copies, the next tile in flight while one is used;
// splits past a token's context do nothing, and the combine reads only the
// token's own.
//   q: rows of q_stride floats, head h at h * head_dim (scaled inside)
//   token_seq: [rows] sequence of each token   block_tables: [seqs, max_blocks_per_seq]
//   partial_out: [rows, n_heads, num_splits, head_dim]   partial_ml: [rows, n_heads, num_splits, 2]
//   out: [rows, n_heads * head_dim]
template <typename T>
cudaError_t PagedAttention(const float* q, const T* k_cache, const T* v_cache,
                           const int32_t* positions, const int32_t* token_seq,
                           const int32_t* block_tables, const AttentionShape& shape,
                           float* partial_out, float* partial_ml, T* out, cudaStream_t stream);

// coalesce-gpu-bench's diagnostic variants of the split kernel (bf16 only;
// head_dim 128, at most four query heads per KV head, split_size > 0):
// `stages` tiles in shared memory at once (2, the kernel's own; 3 or 4), or
// with loads_only (2 or 4 stages) the copies alone, without arithmetic, its
// output meaningless.
template <typename T>
cudaError_t SplitAttentionVariant(const float* q, const T* k_cache, const T* v_cache,
                                  const int32_t* positions, const int32_t* token_seq,
                                  const int32_t* block_tables, const AttentionShape& shape,
                                  float* partial_out, float* partial_ml, T* out, int stages,
                                  bool loads_only, cudaStream_t stream);

// out[t, i] = T(silu(gate_up[t, i]) * gate_up[t, hidden + i]).
//   gate_up: [rows, 2 * hidden] (gate, then up)   out: [rows, hidden]
template <typename T>
cudaError_t SwiGlu(const float* gate_up, int rows, int hidden, T* out, cudaStream_t stream);

// What one sequence samples with (engine/sampler.h's SamplingParams plus the
// host's draw).
struct DeviceSampleSpec {
  float temperature = 0.0f;  // <= 0: greedy
  int32_t top_k = 0;         // <= 0: no limit
  float top_p = 1.0f;        // >= 1: no limit
  float uniform = 0.0f;      // the draw, in [0, 1)
};

// One token per row of logits. Greedy: the lowest id among the largest
// (NaN never wins). Otherwise p_i = exp((l_i - max) / temperature); top_k
// keeps the tokens whose p is at least the k-th largest p (ties at the
// boundary are all kept); top_p then keeps those whose p is at least the
// largest threshold whose kept mass still reaches top_p of what top_k kept;
// the draw picks, in id order, the token where the kept mass's running sum
// first exceeds uniform * kept mass. Same distribution as the CPU sampler;
// only the order of the draw differs.
//   logits: [rows, vocab]   probs: [rows, vocab] scratch   tokens: [rows]
cudaError_t SampleTokens(const float* logits, const DeviceSampleSpec* specs, int rows, int vocab,
                         float* probs, int32_t* tokens, cudaStream_t stream);

// out[i] = T(in[i]) for i < n (round to nearest even).
template <typename T>
cudaError_t ConvertFromFloat(const float* in, int64_t n, T* out, cudaStream_t stream);

// out[i] = T(offset + scale * u_i), u_i uniform in [-1, 1) from a hash of
// (seed, i): deterministic random weights without a host copy.
template <typename T>
cudaError_t FillUniform(T* out, int64_t n, uint64_t seed, float scale, float offset,
                        cudaStream_t stream);

}  // namespace coalesce::engine::cuda
