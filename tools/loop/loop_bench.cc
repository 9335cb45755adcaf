// coalesce-loop-bench: the engine loop (batcher/engine_loop.h) over a real
// backend, with and without --overlap_steps, no gRPC. Each request's stream
// spends --deliver_us of busy CPU time on every update it is handed, which is
// what handing a token to a gRPC stream costs the engine thread in the server
// (a StartWrite, about 15 us). Prints generated tokens/s both ways and their
// ratio: what overlapping that host work with the step buys on this backend.
// Needs only the engine and the batcher, so the GPU check builds it too.
//
// Usage: coalesce-loop-bench [--device=cpu|cuda] [--model=synthetic:15m] [--batch=64]
//          [--prompt=16] [--tokens=128] [--deliver_us=15] [--rounds=3]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "batcher/engine_loop.h"
#include "common/clock.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/synthetic.h"

namespace coalesce {
namespace {

struct Options {
  std::string device = "cpu";
  std::string model = "synthetic:15m";
  int batch = 64;
  int prompt = 16;
  int tokens = 128;
  int deliver_us = 15;
  int rounds = 3;
};

// Counts one request's tokens, spending `cost` of busy time per update.
class CostlySink : public batcher::OutputSink {
 public:
  explicit CostlySink(absl::Duration cost) : cost_(cost) {}
  void Deliver(batcher::StreamUpdate update) override {
    const auto until = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(cost_);
    while (std::chrono::steady_clock::now() < until) {
    }
    tokens_ += static_cast<int>(update.token_ids.size());
    if (update.finished) {
      absl::MutexLock lock(&mu_);
      ok_ = update.status.ok();
      done_ = true;
    }
  }
  bool WaitDone() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
    return ok_;
  }
  int tokens() const { return tokens_; }

 private:
  const absl::Duration cost_;
  std::atomic<int> tokens_{0};
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool ok_ ABSL_GUARDED_BY(mu_) = false;
};

absl::StatusOr<std::unique_ptr<engine::Backend>> MakeBackend(
    const Options& o, std::shared_ptr<const engine::Model> model) {
  const int block_size = 16;
  const int blocks = o.batch * ((o.prompt + o.tokens + block_size - 1) / block_size + 1);
  if (o.device == "cuda") {
    engine::CudaBackendOptions c;
    c.block_size = block_size;
    c.num_blocks = blocks;
    c.max_seqs = std::max(o.batch, 1);
    return engine::CreateCudaBackend(std::move(model), c);
  }
  engine::CpuBackendOptions c;
  c.kv_cache = {block_size, blocks};
  return engine::CreateCpuBackend(std::move(model), c);
}

// Generated tokens per second of wall time for one round of o.batch
// requests, all submitted at once.
double Round(const Options& o, engine::Backend* backend, const engine::Tokenizer& tokenizer,
             bool overlap) {
  batcher::EngineLoopOptions loop_options;
  loop_options.scheduler.max_batch_size = o.batch;
  loop_options.scheduler.batch_window = absl::ZeroDuration();
  loop_options.overlap_steps = overlap;
  batcher::EngineLoop loop(backend, &tokenizer, loop_options, RealClock(), nullptr);
  loop.Start();
  std::vector<std::shared_ptr<CostlySink>> sinks;
  const absl::Time start = absl::Now();
  for (int i = 0; i < o.batch; ++i) {
    batcher::GenerationRequest r;
    r.prompt.assign(o.prompt, 5 + i % 50);
    r.prompt[0] = 1;
    r.max_new_tokens = o.tokens;
    r.arrival = absl::Now();
    sinks.push_back(std::make_shared<CostlySink>(absl::Microseconds(o.deliver_us)));
    if (auto id = loop.Submit(std::move(r), sinks.back()); !id.ok()) {
      std::fprintf(stderr, "submit: %s\n", id.status().ToString().c_str());
      std::exit(1);
    }
  }
  int tokens = 0;
  for (auto& sink : sinks) {
    if (!sink->WaitDone()) {
      std::fprintf(stderr, "a request failed\n");
      std::exit(1);
    }
    tokens += sink->tokens();
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  loop.Stop();
  return tokens / seconds;
}

int Main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    auto value = [&](const char* name) -> const char* {
      const size_t n = std::strlen(name);
      return std::strncmp(a, name, n) == 0 && a[n] == '=' ? a + n + 1 : nullptr;
    };
    if (const char* v = value("--device")) {
      o.device = v;
    } else if (const char* v = value("--model")) {
      o.model = v;
    } else if (const char* v = value("--batch")) {
      o.batch = std::atoi(v);
    } else if (const char* v = value("--prompt")) {
      o.prompt = std::atoi(v);
    } else if (const char* v = value("--tokens")) {
      o.tokens = std::atoi(v);
    } else if (const char* v = value("--deliver_us")) {
      o.deliver_us = std::atoi(v);
    } else if (const char* v = value("--rounds")) {
      o.rounds = std::atoi(v);
    } else {
      std::fprintf(stderr,
                   "usage: coalesce-loop-bench [--device=cpu|cuda] [--model=synthetic:15m] "
                   "[--batch=64] [--prompt=16] [--tokens=128] [--deliver_us=15] [--rounds=3]\n");
      return 2;
    }
  }
  if ((o.device != "cpu" && o.device != "cuda") || o.batch < 1 || o.prompt < 1 || o.tokens < 1 ||
      o.deliver_us < 0 || o.rounds < 1) {
    std::fprintf(stderr, "coalesce-loop-bench: bad flag value (see --help)\n");
    return 2;
  }
  absl::StatusOr<engine::Model> model = engine::BuildSyntheticModel(o.model);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  const int vocab = model->config.vocab_size;
  auto shared = std::make_shared<const engine::Model>(*std::move(model));
  absl::StatusOr<std::unique_ptr<engine::Backend>> backend = MakeBackend(o, shared);
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
    return 1;
  }
  const std::unique_ptr<engine::Tokenizer> tokenizer = engine::BuildSyntheticTokenizer(vocab);
  std::printf(
      "## The engine loop with and without --overlap_steps: %s on %s, %d requests of %d + %d "
      "tokens, %d us of host work per streamed update\n\n| round | overlap off tokens/s | "
      "overlap on tokens/s | on / off |\n|---:|---:|---:|---:|\n",
      o.model.c_str(), (*backend)->name().data(), o.batch, o.prompt, o.tokens, o.deliver_us);
  Round(o, backend->get(), *tokenizer, false);  // warm-up
  std::vector<double> ratios;
  for (int r = 0; r < o.rounds; ++r) {
    // Alternating, so that a drift of the machine's speed hits both.
    const double off = Round(o, backend->get(), *tokenizer, false);
    const double on = Round(o, backend->get(), *tokenizer, true);
    ratios.push_back(on / off);
    std::printf("| %d | %.1f | %.1f | %.3fx |\n", r + 1, off, on, on / off);
  }
  std::sort(ratios.begin(), ratios.end());
  std::printf("\nmedian on / off: %.3fx\n", ratios[ratios.size() / 2]);
  return 0;
}

}  // namespace
}  // namespace coalesce

int main(int argc, char** argv) { return coalesce::Main(argc, argv); }
