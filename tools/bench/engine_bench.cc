// coalesce-engine-bench: decode throughput of the engine alone (no gRPC) at
// growing batch sizes, as ratios to batch 1 measured in the same run.
//
//   build/bin/coalesce-engine-bench --model=synthetic:15m --batch_sizes=1,4,16,64
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/sampler.h"
#include "engine/synthetic.h"

ABSL_FLAG(std::string, model, "synthetic:15m", "A synthetic preset.");
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

namespace coalesce {
namespace {

int Run() {
  absl::StatusOr<engine::Model> model = engine::BuildSyntheticModel(absl::GetFlag(FLAGS_model));
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", std::string(model.status().message()).c_str());
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
  const engine::ModelConfig config = model->config;
  auto shared = std::make_shared<const engine::Model>(*std::move(model));
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
  }
  return 0;
}

}  // namespace
}  // namespace coalesce

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Measures engine decode throughput by batch size.");
  absl::ParseCommandLine(argc, argv);
  return coalesce::Run();
}
