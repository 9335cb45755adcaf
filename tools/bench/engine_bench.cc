// coalesce-engine-bench: decode throughput of the engine alone (no gRPC) at
// growing batch sizes, as ratios to batch 1 measured in the same run; with
// --limits, also against the machine's limits measured in the same run.
//
//   build/bin/coalesce-engine-bench --model=synthetic:15m --batch_sizes=1,4,16,64
//   build/bin/coalesce-engine-bench --model=synthetic:110m --batch_sizes=1,64 --limits
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/flags.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/cpu/memory_bandwidth.h"
#include "engine/model/load.h"
#include "engine/sampler.h"

ABSL_FLAG(std::string, model, "synthetic:15m",
          "The model: synthetic:NAME, a Hugging Face folder or a llama2.c checkpoint.");
ABSL_FLAG(
    std::string, tokenizer, "",
    "The tokenizer file, when not the model format's default (as coalesce-server's --tokenizer).");
ABSL_FLAG(std::string, batch_sizes, "1,2,4,8,16,32,64", "Comma-separated batch sizes.");
ABSL_FLAG(int, context, 128, "Tokens already in each sequence's cache when decoding.");
ABSL_FLAG(int, steps, 16, "Decode steps measured per batch size.");
ABSL_FLAG(int, repeat, 1,
          "Decode the same --steps positions this many times (positions restart at --context "
          "each time), for a longer measurement over the same context range.");
ABSL_FLAG(bool, sample, false,
          "Pick each sequence's next token greedily (Backend::StepAndSample) and feed it back, "
          "as the server's engine loop does, instead of logits only (Backend::Step).");
ABSL_FLAG(int, threads, 0, "Engine threads; 0: one per core.");
ABSL_FLAG(bool, limits, false,
          "Also measure, in the same run and on the same threads, the memory read bandwidth and "
          "the rate of a large single-precision matrix product (OpenBLAS sgemm), and print the "
          "smallest batch against the floor of weight bytes over that bandwidth and the largest "
          "batch's arithmetic rate against that product's.");

extern "C" {
// OpenBLAS (libopenblas-dev), the yardstick of --limits: a well-kept sgemm.
void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float* a, int lda, const float* b, int ldb, float beta, float* c, int ldc);
void openblas_set_num_threads(int num_threads);
char* openblas_get_corename(void);
}

namespace coalesce {
namespace {

// FLOP/s of a 2048^3 single-precision product through OpenBLAS on `threads`
// threads: the median of 5 after a warm-up.
double SgemmRate(int threads) {
  constexpr int n = 2048;
  constexpr int kRowMajor = 101, kNoTrans = 111;
  std::vector<float> a(static_cast<size_t>(n) * n), b(a.size()), c(a.size());
  engine::Rng rng(3);
  for (float& x : a) x = rng.NextFloat() - 0.5f;
  for (float& x : b) x = rng.NextFloat() - 0.5f;
  openblas_set_num_threads(threads);
  std::vector<double> seconds;
  for (int i = 0; i < 6; ++i) {
    const absl::Time start = absl::Now();
    cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f,
                c.data(), n);
    if (i > 0) seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
  }
  std::sort(seconds.begin(), seconds.end());
  return 2.0 * n * n * n / seconds[seconds.size() / 2];
}

int Run() {
  absl::StatusOr<engine::LoadedModel> loaded = engine::LoadModel(
      {.model = absl::GetFlag(FLAGS_model), .tokenizer = absl::GetFlag(FLAGS_tokenizer)});
  if (!loaded.ok()) {
    std::fprintf(stderr, "%s\n", std::string(loaded.status().message()).c_str());
    return 1;
  }
  std::vector<int> sizes;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_batch_sizes), ',')) {
    int n;
    if (!absl::SimpleAtoi(s, &n) || n < 1) {
      std::fprintf(stderr, "bad --batch_sizes\n");
      return 1;
    }
    sizes.push_back(n);
  }
  const int max_batch = *std::max_element(sizes.begin(), sizes.end());
  const int context = absl::GetFlag(FLAGS_context);
  const int steps = absl::GetFlag(FLAGS_steps);
  const int repeat = absl::GetFlag(FLAGS_repeat);
  const bool sample = absl::GetFlag(FLAGS_sample);
  if (steps < 1 || repeat < 1 || context < 1) {
    std::fprintf(stderr, "--context, --steps and --repeat must be at least 1\n");
    return 1;
  }
  const int block_size = 16;
  const int blocks_per_seq = (context + steps + block_size) / block_size;
  const engine::ModelConfig config = loaded->model->config;
  const std::shared_ptr<const engine::Model> shared = loaded->model;
  engine::CpuBackendOptions options;
  options.kv_cache = {block_size, max_batch * blocks_per_seq};
  options.threads = absl::GetFlag(FLAGS_threads);
  auto backend = engine::CreateCpuBackend(shared, options);
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", std::string(backend.status().message()).c_str());
    return 1;
  }
  std::printf("model %s (%.1fM parameters), context %d, %d decode steps per row%s%s\n",
              config.name.c_str(), config.num_parameters() / 1e6, context, steps * repeat,
              repeat > 1 ? absl::StrCat(" (", repeat, " x ", steps, ")").c_str() : "",
              sample ? ", greedy sampling included" : "");
  std::printf("%6s %12s %12s %14s\n", "batch", "step ms", "tokens/s", "vs batch 1");

  std::vector<float> logits;
  double base_tps = 0;
  std::vector<std::pair<int, double>> step_seconds;  // (batch, seconds per decode step)
  for (int batch : sizes) {
    std::vector<std::vector<int32_t>> tables(batch);
    for (int b = 0; b < batch; ++b) {
      tables[b].resize(blocks_per_seq);
      std::iota(tables[b].begin(), tables[b].end(), b * blocks_per_seq);
    }
    // Prefill each sequence's context, one sequence at a time.
    for (int b = 0; b < batch; ++b) {
      std::vector<int32_t> tokens(context, 7 + b);
      engine::SequenceStep seq{context, 0, tables[b]};
      logits.resize(config.vocab_size);
      if (auto s = (*backend)->Step({tokens, {&seq, 1}}, logits); !s.ok()) {
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        return 1;
      }
    }
    // Decode `steps` tokens for the whole batch, `repeat` times.
    std::vector<int32_t> tokens(batch, 11);
    std::vector<engine::SequenceStep> seqs(batch);
    const std::vector<engine::SampleSpec> greedy(batch);
    std::vector<int32_t> next(batch);
    logits.resize(static_cast<size_t>(batch) * config.vocab_size);
    const absl::Time start = absl::Now();
    for (int r = 0; r < repeat; ++r) {
      for (int step = 0; step < steps; ++step) {
        for (int b = 0; b < batch; ++b) seqs[b] = {1, context + step, tables[b]};
        const absl::Status s =
            sample ? (*backend)->StepAndSample({tokens, seqs}, greedy, std::span<int32_t>(next))
                   : (*backend)->Step({tokens, seqs}, logits);
        if (!s.ok()) {
          std::fprintf(stderr, "%s\n", s.ToString().c_str());
          return 1;
        }
        if (sample) tokens = next;
      }
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    const double tps = static_cast<double>(batch) * steps * repeat / seconds;
    if (base_tps == 0) base_tps = tps;
    std::printf("%6d %12.2f %12.1f %13.2fx\n", batch, seconds / (steps * repeat) * 1e3, tps,
                tps / base_tps);
    step_seconds.push_back({batch, seconds / (steps * repeat)});
  }
  if (!absl::GetFlag(FLAGS_limits)) return 0;

  // The machine's limits, measured now, on as many threads as the engine.
  const int threads = options.threads > 0
                          ? options.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const double bandwidth = engine::MeasureMemoryReadBandwidth(threads);
  const double sgemm = SgemmRate(threads);
  const double weight_bytes = static_cast<double>((*backend)->weight_bytes());
  // Multiply-adds per decoded token: every weight once (the tied classifier
  // included), plus attention's q.k and p.v over the cached positions.
  const double mean_context = context + (steps - 1) / 2.0;
  const double flops_per_token =
      2.0 * config.num_parameters() + 4.0 * mean_context * config.dim * config.n_layers;
  const auto [small_batch, small_seconds] = step_seconds.front();
  const auto [large_batch, large_seconds] = step_seconds.back();
  const double floor_seconds = weight_bytes / bandwidth;
  const double rate = large_batch * flops_per_token / large_seconds;
  std::printf("\nlimits, measured in this run on %d threads:\n", threads);
  std::printf("  memory read bandwidth            %8.1f GB/s\n", bandwidth / 1e9);
  std::printf("  sgemm 2048^3 (OpenBLAS, core %s) %8.1f GFLOP/s\n", openblas_get_corename(),
              sgemm / 1e9);
  std::printf(
      "  batch %d: %.2f ms per step; floor (%.0f MB of weights over the bandwidth) "
      "%.2f ms: %.1f%% of the bandwidth limit\n",
      small_batch, small_seconds * 1e3, weight_bytes / 1e6, floor_seconds * 1e3,
      100.0 * floor_seconds / small_seconds);
  std::printf("  batch %d: %.1f GFLOP/s (%.0f MFLOP per token): %.1f%% of the sgemm rate\n",
              large_batch, rate / 1e9, flops_per_token / 1e6, 100.0 * rate / sgemm);
  return 0;
}

}  // namespace
}  // namespace coalesce

int main(int argc, char** argv) {
  coalesce::ParseFlags(argc, argv, "Measures engine decode throughput by batch size.");
  return coalesce::Run();
}
