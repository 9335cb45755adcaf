// coalesce-loop-bench: the engine loop (batcher/engine_loop.h) over a real
// backend, with and without --overlap_steps, no gRPC. Each request's stream
// spends --deliver_us of busy CPU time on every update it is handed, which is
// what handing a token to a gRPC stream costs the engine thread in the server
// (a StartWrite, about 15 us). Prints generated tokens/s both ways and their
// ratio: what overlapping that host work with the step buys on this backend.
// Every round also checks that overlap changes nothing: each request's tokens
// must equal those of the first round (overlap off), or the tool exits 1.
// Needs only the engine and the batcher, so the GPU check builds it too.
//
// Usage: coalesce-loop-bench [--device=cpu|cuda] [--model=synthetic:15m] [flags] (--help lists
// them)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "batcher/engine_loop.h"
#include "common/clock.h"
#include "common/flags.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/model/load.h"

ABSL_FLAG(std::string, device, "cpu", "Backend: cpu or cuda.");
ABSL_FLAG(std::string, model, "synthetic:15m",
          "The model: synthetic:NAME, a Hugging Face folder or a llama2.c checkpoint.");
ABSL_FLAG(
    std::string, tokenizer, "",
    "The tokenizer file, when not the model format's default (as coalesce-server's --tokenizer).");
ABSL_FLAG(int, batch, 64, "Requests per round, all in one batch.");
ABSL_FLAG(int, prompt, 16, "Prompt tokens per request.");
ABSL_FLAG(int, tokens, 128, "Tokens generated per request.");
ABSL_FLAG(int, deliver_us, 15,
          "Busy host time, in microseconds, each stream spends on every update it is handed "
          "(a gRPC write costs the server's engine thread about this).");
ABSL_FLAG(int, rounds, 3, "Measured rounds, each overlap off then on.");

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

// Keeps one request's tokens, spending `cost` of busy time per update.
class CostlySink : public batcher::OutputSink {
 public:
  explicit CostlySink(absl::Duration cost) : cost_(cost) {}
  void Deliver(batcher::StreamUpdate update) override {
    const auto until = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(cost_);
    while (std::chrono::steady_clock::now() < until) {
    }
    absl::MutexLock lock(&mu_);
    tokens_.insert(tokens_.end(), update.token_ids.begin(), update.token_ids.end());
    if (update.finished) {
      ok_ = update.status.ok();
      done_ = true;
    }
  }
  // Waits for the last update; the request's tokens, or nullopt if it failed.
  std::optional<std::vector<int32_t>> WaitDone() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
    if (!ok_) return std::nullopt;
    return tokens_;
  }

 private:
  const absl::Duration cost_;
  absl::Mutex mu_;
  std::vector<int32_t> tokens_ ABSL_GUARDED_BY(mu_);
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

struct RoundResult {
  double tokens_per_second = 0;               // generated tokens over the round's wall time
  std::vector<std::vector<int32_t>> outputs;  // each request's tokens
};

// One round of o.batch requests, all submitted before the loop starts, so
// that every round plans the same steps (the first admits every request).
RoundResult Round(const Options& o, engine::Backend* backend, const engine::Tokenizer& tokenizer,
                  bool overlap) {
  batcher::EngineLoopOptions loop_options;
  loop_options.scheduler.max_batch_size = o.batch;
  loop_options.scheduler.batch_window = absl::ZeroDuration();
  loop_options.overlap_steps = overlap;
  // Every round's prompts are the same: each round computes them anew.
  loop_options.kv_cache.prefix_caching = false;
  batcher::EngineLoop loop(backend, &tokenizer, loop_options, RealClock(), nullptr);
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
  loop.Start();
  RoundResult result;
  size_t tokens = 0;
  for (auto& sink : sinks) {
    std::optional<std::vector<int32_t>> output = sink->WaitDone();
    if (!output) {
      std::fprintf(stderr, "a request failed\n");
      std::exit(1);
    }
    tokens += output->size();
    result.outputs.push_back(*std::move(output));
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  loop.Stop();
  result.tokens_per_second = static_cast<double>(tokens) / seconds;
  return result;
}

// Exits 1, naming the first difference, unless every request of `round`
// produced the tokens it did in `reference`.
void CheckSameOutputs(const RoundResult& reference, const RoundResult& round, const char* name) {
  for (size_t i = 0; i < reference.outputs.size(); ++i) {
    const std::vector<int32_t>& want = reference.outputs[i];
    const std::vector<int32_t>& got = round.outputs[i];
    if (got == want) continue;
    const size_t k =
        std::mismatch(got.begin(), got.end(), want.begin(), want.end()).first - got.begin();
    std::fprintf(stderr,
                 "%s: request %zu's tokens differ from the first round's at position %zu "
                 "(%zu tokens against %zu)\n",
                 name, i, k, got.size(), want.size());
    std::exit(1);
  }
}

int Main() {
  Options o;
  o.device = absl::GetFlag(FLAGS_device);
  o.model = absl::GetFlag(FLAGS_model);
  o.batch = absl::GetFlag(FLAGS_batch);
  o.prompt = absl::GetFlag(FLAGS_prompt);
  o.tokens = absl::GetFlag(FLAGS_tokens);
  o.deliver_us = absl::GetFlag(FLAGS_deliver_us);
  o.rounds = absl::GetFlag(FLAGS_rounds);
  if ((o.device != "cpu" && o.device != "cuda") || o.batch < 1 || o.prompt < 1 || o.tokens < 1 ||
      o.deliver_us < 0 || o.rounds < 1) {
    std::fprintf(stderr, "coalesce-loop-bench: bad flag value (see --help)\n");
    return 2;
  }
  absl::StatusOr<engine::LoadedModel> loaded =
      engine::LoadModel({.model = o.model, .tokenizer = absl::GetFlag(FLAGS_tokenizer)});
  if (!loaded.ok()) {
    std::fprintf(stderr, "%s\n", loaded.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<std::unique_ptr<engine::Backend>> backend = MakeBackend(o, loaded->model);
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
    return 1;
  }
  const engine::Tokenizer& tokenizer = *loaded->tokenizer;
  std::printf(
      "## The engine loop with and without --overlap_steps: %s on %s, %d requests of %d + %d "
      "tokens, %d us of host work per streamed update\n\n| round | overlap off tokens/s | "
      "overlap on tokens/s | on / off |\n|---:|---:|---:|---:|\n",
      o.model.c_str(), (*backend)->name().data(), o.batch, o.prompt, o.tokens, o.deliver_us);
  // The warm-up's outputs are the reference: greedy decoding of the same
  // steps gives the same tokens, overlapped or not.
  const RoundResult reference = Round(o, backend->get(), tokenizer, false);
  std::vector<double> ratios;
  for (int r = 0; r < o.rounds; ++r) {
    // Alternating, so that a drift of the machine's speed hits both.
    const RoundResult off = Round(o, backend->get(), tokenizer, false);
    const RoundResult on = Round(o, backend->get(), tokenizer, true);
    CheckSameOutputs(reference, off, "overlap off");
    CheckSameOutputs(reference, on, "overlap on");
    const double ratio = on.tokens_per_second / off.tokens_per_second;
    ratios.push_back(ratio);
    std::printf("| %d | %.1f | %.1f | %.3fx |\n", r + 1, off.tokens_per_second,
                on.tokens_per_second, ratio);
  }
  std::sort(ratios.begin(), ratios.end());
  std::printf("\nmedian on / off: %.3fx\n", ratios[ratios.size() / 2]);
  std::printf("every round's tokens equal the first round's, overlap on and off\n");
  return 0;
}

}  // namespace
}  // namespace coalesce

int main(int argc, char** argv) {
  const std::vector<char*> rest = coalesce::ParseFlags(
      argc, argv,
      "The engine loop over a real backend with and without --overlap_steps, no gRPC: "
      "generated tokens/s both ways, and a check that overlap changes no token.\n"
      "Usage: coalesce-loop-bench [--device=cpu|cuda] [--model=synthetic:15m] [flags]");
  if (rest.size() > 1) {
    std::fprintf(stderr, "coalesce-loop-bench: unexpected argument %s (see --help)\n", rest[1]);
    return 2;
  }
  return coalesce::Main();
}
