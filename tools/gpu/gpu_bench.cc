// coalesce-gpu-bench: the CUDA backend against the device's limits, for
// synthetic models in the shapes of Llama 3.2 1B and Llama 3 8B, in BF16,
// decoding at a context of 512 prompt + 128 generated tokens.
//
// Measured in the same run, on the same device:
//   - the memory bandwidth: a large device-to-device copy (bytes read plus
//     bytes written over the time);
//   - the BF16 matrix rate: an 8192^3 cuBLAS product;
//   - decode at batch 1 over positions 512..639: time per token against the
//     floor of weight bytes (plus the KV cache read) over that bandwidth;
//   - decode at batch 1, 2, 4, ..., 256: tokens/s, time per step, achieved
//     bandwidth and TFLOP/s, and throughput relative to batch 1;
//   - CUDA graphs on against off (1B, batch 1 and 8);
//   - our skinny product against cuBLAS for steps of 1 to 8 tokens (8B);
//   - where a decode step's device time goes, stage by stage (1B at batch
//     1; 8B at batch 1, 64 and 256);
//   - a 512-token prefill;
//   - attention alone (8B heads): the split kernel of fixed-size splits
//     against the older one, at batch 1, 16, 64, 256 and contexts 512, 2k,
//     8k, as achieved bandwidth against the copy's;
//   - the 8B shape's decode step with either attention kernel.
// Weights are random, filled on the device; the KV cache is filled with
// random values so that decoding can start at position 512 without a prefill.
//
// Usage: coalesce-gpu-bench [--shapes=1b,8b] [--quick] [--no_attention]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/kernels.h"

namespace coalesce::engine {
namespace {

constexpr int kPrompt = 512, kGenerated = 128, kBlockSize = 16, kMaxBatch = 256;

#define CHECK_CUDA(expr)                                                     \
  do {                                                                       \
    if (const cudaError_t e = (expr); e != cudaSuccess) {                    \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(e)); \
      std::exit(1);                                                          \
    }                                                                        \
  } while (false)

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The median device time of `enqueue` (on the legacy default stream), over
// 10 timed runs after 3 warm-ups.
template <typename Enqueue>
double MedianDeviceSeconds(Enqueue enqueue) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> seconds;
  for (int i = 0; i < 13; ++i) {
    CHECK_CUDA(cudaEventRecord(start));
    enqueue(i);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 3) seconds.push_back(ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return Median(seconds);
}

// Bytes read plus bytes written per second by a 2 GiB device-to-device copy.
double MeasureBandwidth() {
  const size_t bytes = size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  const double seconds = MedianDeviceSeconds([&](int i) {
    CHECK_CUDA(cudaMemcpyAsync(i % 2 ? a : b, i % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice));
  });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / seconds;
}

// FLOP/s of an 8192^3 BF16 product with FP32 accumulation, on random data.
double MeasureMatmulRate() {
  const int n = 8192;
  const size_t elems = size_t{n} * n;
  __nv_bfloat16 *a, *b, *c;
  CHECK_CUDA(cudaMalloc(&a, elems * 2));
  CHECK_CUDA(cudaMalloc(&b, elems * 2));
  CHECK_CUDA(cudaMalloc(&c, elems * 2));
  CHECK_CUDA(cuda::FillUniform(a, elems, 1, 1.0f, 0.0f, nullptr));
  CHECK_CUDA(cuda::FillUniform(b, elems, 2, 1.0f, 0.0f, nullptr));
  cublasHandle_t handle;
  cublasCreate(&handle);
  const float alpha = 1, beta = 0;
  const double seconds = MedianDeviceSeconds([&](int) {
    if (cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b,
                     CUDA_R_16BF, n, &beta, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "cublasGemmEx failed\n");
      std::exit(1);
    }
  });
  cublasDestroy(handle);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 2.0 * n * n * double{n} / seconds;
}

struct Shape {
  const char* name;
  ModelConfig config;
};

ModelConfig LlamaShape(int dim, int hidden, int layers, int heads, int kv_heads, bool tied) {
  ModelConfig c;
  c.dim = dim;
  c.hidden_dim = hidden;
  c.n_layers = layers;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  c.vocab_size = 128256;
  c.max_seq_len = 2048;
  c.rope_theta = 500000.0f;
  c.tied_classifier = tied;
  return c;
}

std::unique_ptr<Backend> MakeBackend(const ModelConfig& config, bool graphs, int max_batch,
                                     int skinny_rows = 1,
                                     std::shared_ptr<StageTimes> stage_times = nullptr,
                                     bool fixed_size_splits = true, int split_size = 0) {
  auto model = std::make_shared<Model>();
  model->config = config;
  model->config.name = "bench";
  CudaBackendOptions options;
  options.precision = Precision::kBf16;
  options.block_size = kBlockSize;
  options.num_blocks = max_batch * ((kPrompt + kGenerated) / kBlockSize + 1);
  options.max_batch_tokens = std::max(kPrompt, max_batch);
  options.max_seqs = max_batch;
  options.cuda_graphs = graphs;
  options.skinny_gemm_rows = skinny_rows;
  options.fixed_size_splits = fixed_size_splits;
  options.attention_split_size = split_size;
  options.stage_times = std::move(stage_times);
  options.random_weights = true;
  options.fill_kv_cache_random = true;
  auto backend = CreateCudaBackend(std::move(model), options);
  if (!backend.ok()) {
    std::fprintf(stderr, "CreateCudaBackend: %s\n", backend.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(backend);
}

// Decodes `batch` sequences from position `start` for `steps` steps after
// `warmup` steps; returns the seconds per step (host wall time around each
// step, which waits for the device: what a server sees).
double TimeDecode(Backend& backend, int batch, int start, int steps, int warmup) {
  const int blocks_each = (kPrompt + kGenerated) / kBlockSize + 1;
  std::vector<std::vector<int32_t>> tables(batch, std::vector<int32_t>(blocks_each));
  for (int s = 0; s < batch; ++s) std::iota(tables[s].begin(), tables[s].end(), s * blocks_each);
  std::vector<int32_t> tokens(batch), next(batch);
  for (int s = 0; s < batch; ++s) tokens[s] = 1000 + 17 * s;
  std::vector<SequenceStep> seqs(batch);
  std::vector<SampleSpec> specs(batch);
  double total = 0;
  for (int i = 0; i < warmup + steps; ++i) {
    const int pos = start + i - warmup;
    for (int s = 0; s < batch; ++s) seqs[s] = {1, std::max(pos, 0), tables[s]};
    const auto t0 = std::chrono::steady_clock::now();
    const absl::Status status = backend.StepAndSample({tokens, seqs}, specs, next);
    const auto t1 = std::chrono::steady_clock::now();
    if (!status.ok()) {
      std::fprintf(stderr, "decode step: %s\n", status.ToString().c_str());
      std::exit(1);
    }
    tokens = next;
    if (i >= warmup) total += std::chrono::duration<double>(t1 - t0).count();
  }
  return total / steps;
}

double TimePrefill(Backend& backend, int length) {
  const int blocks = (length + kBlockSize - 1) / kBlockSize;
  std::vector<int32_t> table(blocks), tokens(length), next(1);
  std::iota(table.begin(), table.end(), 0);
  for (int i = 0; i < length; ++i) tokens[i] = (i * 7919) % 128000;
  const std::vector<SequenceStep> seqs = {{length, 0, table}};
  const std::vector<SampleSpec> specs(1);
  std::vector<double> seconds;
  for (int i = 0; i < 6; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const absl::Status status = backend.StepAndSample({tokens, seqs}, specs, next);
    const auto t1 = std::chrono::steady_clock::now();
    if (!status.ok()) {
      std::fprintf(stderr, "prefill: %s\n", status.ToString().c_str());
      std::exit(1);
    }
    if (i > 0) seconds.push_back(std::chrono::duration<double>(t1 - t0).count());
  }
  return Median(seconds);
}

void BenchShape(const Shape& shape, double bandwidth, bool quick) {
  const ModelConfig& c = shape.config;
  auto backend = MakeBackend(c, /*graphs=*/true, kMaxBatch);
  std::printf("\n## %s shape (dim %d, %d layers, %d/%d heads, hidden %d, vocab %d), bf16\n",
              shape.name, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.hidden_dim, c.vocab_size);
  std::printf("%s\n", backend->Describe().c_str());
  const double weight_bytes = static_cast<double>(backend->weight_bytes());
  const double kv_token = static_cast<double>(backend->kv_bytes_per_token());
  const double matmul_params = weight_bytes / 2;  // bf16
  const double attn_flops_per_pos = 4.0 * c.n_heads * c.head_dim() * c.n_layers;

  // Batch 1 over the whole generation: positions 512..639.
  const double t1 = TimeDecode(*backend, 1, kPrompt, kGenerated, 4);
  const double avg_ctx = kPrompt + kGenerated / 2.0;
  const double floor1 = (weight_bytes + avg_ctx * kv_token) / bandwidth;
  std::printf(
      "\nbatch 1 decode over positions %d..%d: %.3f ms/token; floor (%.2f GB weights + "
      "KV over %.0f GB/s) %.3f ms: %.1f%% of the bandwidth limit\n",
      kPrompt, kPrompt + kGenerated - 1, t1 * 1e3, weight_bytes / 1e9, bandwidth / 1e9,
      floor1 * 1e3, 100.0 * floor1 / t1);

  std::printf("\n| batch | ms/step | tokens/s | x batch 1 | GB/s | %% of bandwidth | TFLOP/s |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|\n");
  double base = 0;
  for (int batch = 1; batch <= kMaxBatch; batch *= 2) {
    const int steps = quick ? 8 : 32;
    const double t = TimeDecode(*backend, batch, kPrompt, steps, 3);
    const double ctx = kPrompt + steps / 2.0;
    const double bytes = weight_bytes + batch * ctx * kv_token;
    const double flops = batch * (2.0 * matmul_params + attn_flops_per_pos * ctx);
    const double tps = batch / t;
    if (batch == 1) base = tps;
    std::printf("| %d | %.3f | %.0f | %.1f | %.0f | %.1f | %.1f |\n", batch, t * 1e3, tps,
                tps / base, bytes / t / 1e9, 100.0 * bytes / t / bandwidth, flops / t / 1e12);
  }
  const double prefill = TimePrefill(*backend, kPrompt);
  std::printf("\nprefill of %d tokens (one sequence): %.2f ms, %.0f tokens/s, %.1f TFLOP/s\n",
              kPrompt, prefill * 1e3, kPrompt / prefill,
              kPrompt * 2.0 * matmul_params / prefill / 1e12);
}

void BenchGraphs(const Shape& shape) {
  std::printf("\n## CUDA graphs on against off, %s shape, bf16, decode at position %d\n\n",
              shape.name, kPrompt);
  std::printf(
      "| batch | graphs on ms/step | graphs off ms/step | speed-up |\n|---:|---:|---:|---:|\n");
  double on[2], off[2];
  {
    auto backend = MakeBackend(shape.config, true, 8);
    on[0] = TimeDecode(*backend, 1, kPrompt, 64, 4);
    on[1] = TimeDecode(*backend, 8, kPrompt, 64, 4);
  }
  {
    auto backend = MakeBackend(shape.config, false, 8);
    off[0] = TimeDecode(*backend, 1, kPrompt, 64, 4);
    off[1] = TimeDecode(*backend, 8, kPrompt, 64, 4);
  }
  const int batches[2] = {1, 8};
  for (int i = 0; i < 2; ++i) {
    std::printf("| %d | %.3f | %.3f | %.2fx |\n", batches[i], on[i] * 1e3, off[i] * 1e3,
                off[i] / on[i]);
  }
}

// Device time per stage of a decode step (eager, an event between stages).
void BenchStages(const Shape& shape, int batch) {
  auto times = std::make_shared<StageTimes>();
  auto backend = MakeBackend(shape.config, false, batch, 1, times);
  TimeDecode(*backend, batch, kPrompt, 2, 0);  // warm-up
  *times = StageTimes{};
  const double step = TimeDecode(*backend, batch, kPrompt, 8, 0);
  std::printf(
      "\n## Where a decode step's time goes: %s shape, batch %d, position %d (eager, "
      "events between stages)\n\n| stage | ms per step | share of device time |\n"
      "|---|---:|---:|\n",
      shape.name, batch, kPrompt);
  double total = 0;
  for (double s : times->seconds) total += s;
  for (size_t i = 0; i < times->names.size(); ++i) {
    std::printf("| %s | %.3f | %.1f%% |\n", times->names[i].c_str(),
                times->seconds[i] / times->steps * 1e3, 100.0 * times->seconds[i] / total);
  }
  std::printf("| (device total) | %.3f | |\n| (host wall time per step) | %.3f | |\n",
              total / times->steps * 1e3, step * 1e3);
}

// Our skinny product against cuBLAS for the projections of small steps: the
// data behind CudaBackendOptions::skinny_gemm_rows.
void BenchSkinny(const Shape& shape) {
  std::printf(
      "\n## Projections of small decode steps: skinny kernel against cuBLAS, %s shape, "
      "position %d\n\n| batch | skinny ms/step | cuBLAS ms/step | speed-up |\n"
      "|---:|---:|---:|---:|\n",
      shape.name, kPrompt);
  double skinny[4], cublas[4];
  const int batches[4] = {1, 2, 4, 8};
  for (const int rows : {8, 0}) {
    auto backend = MakeBackend(shape.config, true, 8, rows);
    for (int i = 0; i < 4; ++i) {
      (rows > 0 ? skinny : cublas)[i] = TimeDecode(*backend, batches[i], kPrompt, 32, 3);
    }
  }
  for (int i = 0; i < 4; ++i) {
    std::printf("| %d | %.3f | %.3f | %.2fx |\n", batches[i], skinny[i] * 1e3, cublas[i] * 1e3,
                cublas[i] / skinny[i]);
  }
}

// Attention alone, Llama-3-8B's heads (32 query, 8 KV, 128 each), bf16,
// blocks of 16 scattered at random over an 8 GiB cache: each timed run reads
// other blocks while the cache allows, so that small cases are not served
// from L2. The older kernel splits by count as the backend did
// (NumSplits: two waves of blocks); the split kernel by 128 positions.
void BenchAttention(double bandwidth) {
  using T = __nv_bfloat16;
  constexpr int kHeads = 32, kKvHeads = 8, kHd = 128, kSplit = 128, kMaxCtx = 8192;
  constexpr int kKvDim = kKvHeads * kHd, kQDim = kHeads * kHd;
  const int64_t pool_blocks = int64_t{kMaxBatch} * kMaxCtx / kBlockSize;
  const int64_t pool_slots = pool_blocks * kBlockSize;
  T *k = nullptr, *v = nullptr, *out_old = nullptr, *out_new = nullptr;
  float *q = nullptr, *partial = nullptr, *ml = nullptr;
  int32_t *positions = nullptr, *seq_of = nullptr, *tables = nullptr;
  const int64_t partial_rows = int64_t{kMaxBatch} * kHeads * cuda::kMaxSplits;
  CHECK_CUDA(cudaMalloc(&k, pool_slots * kKvDim * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&v, pool_slots * kKvDim * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&q, int64_t{kMaxBatch} * kQDim * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&out_old, int64_t{kMaxBatch} * kQDim * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&out_new, int64_t{kMaxBatch} * kQDim * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&partial, partial_rows * kHd * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&ml, partial_rows * 2 * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&positions, kMaxBatch * sizeof(int32_t)));
  CHECK_CUDA(cudaMalloc(&seq_of, kMaxBatch * sizeof(int32_t)));
  CHECK_CUDA(cudaMalloc(&tables, pool_blocks * sizeof(int32_t)));
  CHECK_CUDA(cuda::FillUniform<T>(k, pool_slots * kKvDim, 11, 1.0f, 0.0f, nullptr));
  CHECK_CUDA(cuda::FillUniform<T>(v, pool_slots * kKvDim, 12, 1.0f, 0.0f, nullptr));
  CHECK_CUDA(cuda::FillUniform<float>(q, int64_t{kMaxBatch} * kQDim, 13, 1.0f, 0.0f, nullptr));
  CHECK_CUDA(cuda::ConfigureAttention<T>(kHd, kHeads / kKvHeads));
  // Every block of the pool once, in random order: round r of a case whose
  // sequences take n blocks in all reads order[r * n .. (r + 1) * n).
  std::vector<int32_t> order(pool_blocks);
  std::iota(order.begin(), order.end(), 0);
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (int64_t i = pool_blocks - 1; i > 0; --i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    std::swap(order[i], order[(state >> 33) % (i + 1)]);
  }
  CHECK_CUDA(
      cudaMemcpy(tables, order.data(), pool_blocks * sizeof(int32_t), cudaMemcpyHostToDevice));
  cudaDeviceProp props{};
  CHECK_CUDA(cudaGetDeviceProperties(&props, 0));
  std::printf(
      "\n## Attention alone: Llama-3-8B heads (32/8, 128 each), bf16, blocks of %d, one token "
      "per sequence at the last position\n\n"
      "| batch | context | older kernel ms | split kernel ms | speed-up | split kernel GB/s | "
      "%% of copy bandwidth | difference | splits of 256 ms | %% of copy bandwidth (256) |\n"
      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
      kBlockSize);
  // The split kernel's variants (diagnostic): pipeline depth, and the
  // copies alone.
  struct Variant {
    const char* name;
    int stages;
    bool loads_only;
  };
  const Variant variants[] = {{"3 stages", 3, false},
                              {"4 stages", 4, false},
                              {"copies alone, 2 stages", 2, true},
                              {"copies alone, 4 stages", 4, true}};
  std::vector<std::string> variant_rows;
  for (const int ctx : {512, 2048, 8192}) {
    for (const int batch : {1, 16, 64, 256}) {
      const int blocks_each = ctx / kBlockSize;
      const int64_t blocks = int64_t{batch} * blocks_each;
      const int rounds = static_cast<int>(std::min<int64_t>(pool_blocks / blocks, 8));
      std::vector<int32_t> pos(batch, ctx - 1), seq(batch);
      std::iota(seq.begin(), seq.end(), 0);
      CHECK_CUDA(cudaMemcpy(positions, pos.data(), batch * sizeof(int32_t), cudaMemcpyDefault));
      CHECK_CUDA(cudaMemcpy(seq_of, seq.data(), batch * sizeof(int32_t), cudaMemcpyDefault));
      cuda::AttentionShape shape;
      shape.rows = batch;
      shape.n_heads = kHeads;
      shape.n_kv_heads = kKvHeads;
      shape.head_dim = kHd;
      shape.block_size = kBlockSize;
      shape.max_blocks_per_seq = blocks_each;
      shape.q_stride = kQDim;
      cuda::AttentionShape older = shape, split = shape, split256 = shape;
      older.num_splits =
          std::clamp((2 * props.multiProcessorCount + batch * kKvHeads - 1) / (batch * kKvHeads), 1,
                     cuda::kMaxSplits);
      split.split_size = kSplit;
      split.num_splits = (ctx + kSplit - 1) / kSplit;
      split256.split_size = 2 * kSplit;
      split256.num_splits = (ctx + 2 * kSplit - 1) / (2 * kSplit);
      auto time = [&](const cuda::AttentionShape& sh, T* out) {
        return MedianDeviceSeconds([&](int i) {
          CHECK_CUDA(cuda::PagedAttention<T>(q, k, v, positions, seq_of,
                                             tables + (i % rounds) * blocks, sh, partial, ml, out,
                                             nullptr));
        });
      };
      const double t_old = time(older, out_old);
      const double t_256 = time(split256, out_new);
      std::string variant_row = "| " + std::to_string(batch) + " | " + std::to_string(ctx) + " |";
      for (const Variant& variant : variants) {
        const double t = MedianDeviceSeconds([&](int i) {
          CHECK_CUDA(cuda::SplitAttentionVariant<T>(
              q, k, v, positions, seq_of, tables + (i % rounds) * blocks, split, partial, ml,
              out_new, variant.stages, variant.loads_only, nullptr));
        });
        char cell[32];
        std::snprintf(cell, sizeof(cell), " %.1f |",
                      100.0 * 2.0 * batch * ctx * kKvDim * sizeof(T) / t / bandwidth);
        variant_row += cell;
      }
      variant_rows.push_back(variant_row);
      const double t_new = time(split, out_new);
      // Both outputs of the last run (the same round): their relative
      // difference.
      std::vector<T> a(int64_t{batch} * kQDim), b(a.size());
      CHECK_CUDA(cudaMemcpy(a.data(), out_old, a.size() * sizeof(T), cudaMemcpyDefault));
      CHECK_CUDA(cudaMemcpy(b.data(), out_new, b.size() * sizeof(T), cudaMemcpyDefault));
      double diff = 0, norm = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
        diff += (x - y) * (x - y);
        norm += x * x;
      }
      const double bytes = 2.0 * batch * ctx * kKvDim * sizeof(T);
      std::printf("| %d | %d | %.4f | %.4f | %.2fx | %.0f | %.1f | %.1e | %.4f | %.1f |\n", batch,
                  ctx, t_old * 1e3, t_new * 1e3, t_old / t_new, bytes / t_new / 1e9,
                  100.0 * bytes / t_new / bandwidth, std::sqrt(diff / std::max(norm, 1e-30)),
                  t_256 * 1e3, 100.0 * bytes / t_256 / bandwidth);
    }
  }
  std::printf(
      "\n## The split kernel's variants (diagnostic), same cases, splits of %d: %% of copy "
      "bandwidth\n\n| batch | context |",
      kSplit);
  for (const Variant& variant : variants) std::printf(" %s |", variant.name);
  std::printf("\n|---:|---:|");
  for (size_t i = 0; i < std::size(variants); ++i) std::printf("---:|");
  std::printf("\n");
  for (const std::string& row : variant_rows) std::printf("%s\n", row.c_str());
  for (void* p :
       {static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(q),
        static_cast<void*>(out_old), static_cast<void*>(out_new), static_cast<void*>(partial),
        static_cast<void*>(ml), static_cast<void*>(positions), static_cast<void*>(seq_of),
        static_cast<void*>(tables)}) {
    CHECK_CUDA(cudaFree(p));
  }
}

// The 8B shape's decode step at position 512 with either attention kernel.
void BenchAttentionInTheStep(const Shape& shape) {
  std::printf(
      "\n## Decode steps with either attention kernel, %s shape, bf16, positions %d..%d\n\n"
      "| batch | older kernel ms/step | splits of 128 ms/step | splits of 256 ms/step | "
      "speed-up (128) | tokens/s (128) |\n|---:|---:|---:|---:|---:|---:|\n",
      shape.name, kPrompt, kPrompt + 31);
  const int batches[4] = {1, 16, 64, 256};
  double ms[3][4];
  const int split_sizes[3] = {0, 128, 256};  // 0: the older kernel
  for (int k = 0; k < 3; ++k) {
    auto backend =
        MakeBackend(shape.config, true, kMaxBatch, 1, nullptr, split_sizes[k] > 0, split_sizes[k]);
    for (int i = 0; i < 4; ++i) ms[k][i] = TimeDecode(*backend, batches[i], kPrompt, 32, 3) * 1e3;
  }
  for (int i = 0; i < 4; ++i) {
    std::printf("| %d | %.3f | %.3f | %.3f | %.2fx | %.0f |\n", batches[i], ms[0][i], ms[1][i],
                ms[2][i], ms[0][i] / ms[1][i], batches[i] / ms[1][i] * 1e3);
  }
}

int Main(int argc, char** argv) {
  std::string shapes = "1b,8b";
  bool quick = false, attention = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--shapes=", 9) == 0) {
      shapes = argv[i] + 9;
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--no_attention") == 0) {
      attention = false;
    } else {
      std::fprintf(stderr,
                   "usage: coalesce-gpu-bench [--shapes=1b,8b] [--quick] [--no_attention]\n");
      return 2;
    }
  }
  std::string why;
  if (!CudaDeviceUsable(&why)) {
    std::fprintf(stderr, "coalesce-gpu-bench: %s\n", why.c_str());
    return 1;
  }
  cudaDeviceProp props{};
  CHECK_CUDA(cudaGetDeviceProperties(&props, 0));
  std::printf("# coalesce-gpu-bench on %s (%d SMs, %.1f GiB)\n", props.name,
              props.multiProcessorCount, props.totalGlobalMem / double(1 << 30));
  const double bandwidth = MeasureBandwidth();
  const double matmul = MeasureMatmulRate();
  std::printf(
      "\nmeasured: device-to-device copy %.0f GB/s (read + write); bf16 8192^3 cuBLAS "
      "product %.0f TFLOP/s\n",
      bandwidth / 1e9, matmul / 1e12);
  const Shape one_b = {"Llama-3.2-1B", LlamaShape(2048, 8192, 16, 32, 8, true)};
  const Shape eight_b = {"Llama-3-8B", LlamaShape(4096, 14336, 32, 32, 8, false)};
  if (shapes.find("1b") != std::string::npos) BenchShape(one_b, bandwidth, quick);
  if (shapes.find("8b") != std::string::npos) BenchShape(eight_b, bandwidth, quick);
  if (shapes.find("1b") != std::string::npos) {
    BenchGraphs(one_b);
    BenchStages(one_b, 1);
  }
  if (shapes.find("8b") != std::string::npos) {
    BenchSkinny(eight_b);
    BenchStages(eight_b, 1);
    BenchStages(eight_b, 64);
    BenchStages(eight_b, 256);
    BenchAttentionInTheStep(eight_b);
  }
  if (attention) BenchAttention(bandwidth);
  return 0;
}

}  // namespace
}  // namespace coalesce::engine

int main(int argc, char** argv) { return coalesce::engine::Main(argc, argv); }
