// coalesce-engine-bench: decode throughput of the engine alone (no gRPC) at
// growing batch sizes, as ratios to batch 1 measured in the same run; with
// --limits, also against the machine's limits measured in the same run; with
// several --kv_cache_dtypes, each KV cache type against the first, batch by
// batch, in the same run.
//
//   build/bin/coalesce-engine-bench --model=synthetic:15m --batch_sizes=1,4,16,64
//   build/bin/coalesce-engine-bench --model=synthetic:110m --batch_sizes=1,64 --limits
//   build/bin/coalesce-engine-bench --context=2000 --batch_sizes=1,16 --kv_cache_dtypes=fp32,int8
//   build/bin/coalesce-engine-bench --model=FILE.gguf --batch_sizes=1,16,64 --compare_quantized
//
// With --kv_quality_text=FILE it measures quality instead of speed: each
// --kv_cache_dtypes type's perplexity on the file's text against the first's,
// and how far greedy decoding agrees with the first's.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
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
#include "engine/cpu/huge_page_memory.h"
#include "engine/cpu/memory_bandwidth.h"
#include "engine/factory/backend_factory.h"
#include "engine/model/load.h"
#include "engine/model/quantize.h"
#include "engine/precision.h"
#include "engine/sampler.h"
#include "tools/bench/probe_pairs.h"

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
          "each time), for a longer measurement over the same context range. Several variants "
          "(--kv_cache_dtypes, --compare_quantized) take turns, a round of --steps each.");
ABSL_FLAG(bool, sample, false,
          "Pick each sequence's next token greedily (Backend::StepAndSample) and feed it back, "
          "as the server's engine loop does, instead of logits only (Backend::Step).");
ABSL_FLAG(int, threads, 0, "Engine threads; 0: one per core.");
ABSL_FLAG(std::string, kv_cache_dtypes, "fp32",
          "Comma-separated KV cache types (fp32, bf16, fp16, int8): each batch size is measured "
          "with each in turn, and each printed against the first at the same batch size.");
ABSL_FLAG(std::string, kv_quality_text, "",
          "Measure quality instead of speed: score this text file's tokens (at most "
          "--kv_quality_tokens, from BOS) with each --kv_cache_dtypes type and print its "
          "perplexity, top-1 agreement and logits against the first type's, then decode "
          "--kv_quality_decode tokens greedily after 4 prefixes of the text and print how many "
          "agree with the first type's.");
ABSL_FLAG(int, kv_quality_tokens, 2048, "--kv_quality_text: most tokens scored.");
ABSL_FLAG(int, kv_quality_decode, 64,
          "--kv_quality_text: greedy tokens decoded after each prefix.");
ABSL_FLAG(bool, compare_quantized, false,
          "A GGUF file's quantized matrices: measure each batch size with them dequantized to "
          "float32 and kept in their block types (as coalesce-server runs them on the CPU), and "
          "print the second against the first; with --limits, each one's smallest batch against "
          "its own weight bytes over the bandwidth.");
ABSL_FLAG(std::string, quantize, "none",
          "With --compare_quantized: also quantize the model's float32 matrices at load to "
          "q8_0 or q4_0 (coalesce-server's --quantize), so that a float model can be compared.");
ABSL_FLAG(bool, int8_activations, false,
          "Quantized Q8_0, Q4_0, Q4_1, Q4_K and Q6_K matrices multiply int8 activations "
          "(coalesce-server's "
          "--int8_activations).");
ABSL_FLAG(std::string, float_panels, "auto",
          "Float32 matrices laid out as the product's panels at creation (true), read as the "
          "model's rows (false), or as the CPU backend chooses (auto: panels where the "
          "processor's product is AVX2).");
ABSL_FLAG(bool, huge_pages, true,
          "The CPU backend's laid-out weights (and --limits' bandwidth probe) in memory that asks "
          "for transparent huge pages (the engine's way, engine/cpu/huge_page_memory.h); false "
          "refuses them.");
ABSL_FLAG(bool, limits, false,
          "Also measure, in the same run and on the same threads, the memory read bandwidth and "
          "the rate of a large single-precision matrix product (OpenBLAS sgemm), and print the "
          "smallest batch against the floor of weight bytes over that bandwidth (15 more steps, "
          "each right after a pass of the bandwidth probe: medians and bests) and the largest "
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

// --limits: 15 more steps of the smallest batch, each timed right after a
// pass of the bandwidth probe (probe_pairs.h).
constexpr int kPairedSteps = 15;

// The paired steps against the floor, `bytes` over the probe's bandwidth:
// medians, and bests (others on the machine only ever slow either down).
void PrintFloor(int batch, double bytes, const bench::ProbePairs& p) {
  std::printf(
      "  batch %d, %d steps each after a probe pass: median %.2f ms per step; floor (%.0f MB of "
      "weights over the median pass, %.1f GB/s) %.2f ms: %.1f%% of the bandwidth limit\n",
      batch, kPairedSteps, p.seconds * 1e3, bytes / 1e6, p.bandwidth / 1e9,
      bytes / p.bandwidth * 1e3, 100.0 * p.MedianShare(bytes));
  std::printf(
      "  batch %d, best of both: %.2f ms per step; floor (over the fastest pass, %.1f GB/s) "
      "%.2f ms: %.1f%% of the bandwidth limit\n",
      batch, p.fastest * 1e3, p.highest / 1e9, bytes / p.highest * 1e3, 100.0 * p.BestShare(bytes));
}

// ||a - b|| / ||b||.
double RelativeError(std::span<const float> a, std::span<const float> b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

// -log softmax(logits)[next], in double.
double NegativeLogLikelihood(std::span<const float> logits, int32_t next) {
  const double max = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float x : logits) sum += std::exp(x - max);
  return std::log(sum) - (logits[next] - max);
}

int32_t Argmax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// --kv_quality_text: every type scores the same tokens, chunk by chunk in
// step, so that only one chunk's logits per type are held; then each decodes
// greedily after 4 prefixes (whole blocks of the scored text, read from the
// blocks the scoring filled, each continuing into blocks of its own), all 4
// in one batch.
int RunQuality(const engine::LoadedModel& loaded, const std::vector<engine::KvDtype>& dtypes,
               int threads) {
  const std::string path = absl::GetFlag(FLAGS_kv_quality_text);
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "--kv_quality_text: cannot read %s\n", path.c_str());
    return 1;
  }
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const engine::ModelConfig& config = loaded.model->config;
  const int decode = absl::GetFlag(FLAGS_kv_quality_decode);
  constexpr int kBlock = 16, kPrefixes = 4, kChunk = 256;
  std::vector<int32_t> tokens = loaded.tokenizer->Encode(text, /*add_special_tokens=*/true);
  const int limit = std::min(absl::GetFlag(FLAGS_kv_quality_tokens), config.max_seq_len - decode);
  if (decode < 1 || limit < kPrefixes * kBlock) {
    std::fprintf(stderr, "--kv_quality_decode must be at least 1 and leave room for %d tokens\n",
                 kPrefixes * kBlock);
    return 1;
  }
  if (static_cast<int>(tokens.size()) > limit) tokens.resize(limit);
  const int n = static_cast<int>(tokens.size());
  if (n < kPrefixes * kBlock) {
    std::fprintf(stderr, "%s: %d tokens, need at least %d\n", path.c_str(), n, kPrefixes * kBlock);
    return 1;
  }
  // Prefix k ends at a block boundary, k / 4 of the way through the text.
  std::vector<int> prefix(kPrefixes);
  for (int k = 0; k < kPrefixes; ++k) prefix[k] = n * (k + 1) / kPrefixes / kBlock * kBlock;
  const int text_blocks = (n + kBlock - 1) / kBlock;
  const int decode_blocks = (decode + kBlock - 1) / kBlock;
  const int vocab = config.vocab_size;

  std::vector<std::unique_ptr<engine::Backend>> backends;
  for (const engine::KvDtype dtype : dtypes) {
    auto backend = engine::CreateCpuBackend(
        loaded.model,
        {.kv_cache = {kBlock, text_blocks + kPrefixes * decode_blocks, dtype}, .threads = threads});
    if (!backend.ok()) {
      std::fprintf(stderr, "%s\n", std::string(backend.status().message()).c_str());
      return 1;
    }
    backends.push_back(*std::move(backend));
  }

  // 1. Scoring.
  struct Score {
    double nll = 0, worst = 0, mean = 0;
    int top1 = 0;
    std::vector<int32_t> first;  // [kPrefixes] the greedy token after each prefix
  };
  std::vector<Score> scores(dtypes.size());
  for (Score& score : scores) score.first.resize(kPrefixes);
  const std::vector<int32_t> table = [&] {
    std::vector<int32_t> t(text_blocks);
    std::iota(t.begin(), t.end(), 0);
    return t;
  }();
  std::vector<std::vector<float>> logits(dtypes.size());
  for (int start = 0; start < n; start += kChunk) {
    const int count = std::min(kChunk, n - start);
    const engine::SequenceStep seq{
        .num_tokens = count, .start_pos = start, .block_table = table, .all_logits = true};
    for (size_t d = 0; d < dtypes.size(); ++d) {
      logits[d].resize(static_cast<size_t>(count) * vocab);
      const absl::Status s = backends[d]->Step(
          {std::span<const int32_t>(tokens).subspan(start, count), {&seq, 1}}, logits[d]);
      if (!s.ok()) {
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        return 1;
      }
      for (int r = 0; r < count; ++r) {
        const int pos = start + r;
        const std::span<const float> row =
            std::span<const float>(logits[d]).subspan(static_cast<size_t>(r) * vocab, vocab);
        const std::span<const float> base =
            std::span<const float>(logits[0]).subspan(static_cast<size_t>(r) * vocab, vocab);
        Score& score = scores[d];
        if (pos + 1 < n) score.nll += NegativeLogLikelihood(row, tokens[pos + 1]);
        const double err = RelativeError(row, base);
        score.worst = std::max(score.worst, err);
        score.mean += err / n;
        const int32_t top = Argmax(row);
        score.top1 += top == Argmax(base);
        for (int k = 0; k < kPrefixes; ++k) {
          if (pos + 1 == prefix[k]) score.first[k] = top;
        }
      }
    }
  }

  // 2. Greedy decoding after each prefix: the prefix's blocks are the
  // scoring's, read only; the continuation writes blocks of its own.
  std::vector<std::vector<std::vector<int32_t>>> outputs(dtypes.size());  // [type][prefix][token]
  for (size_t d = 0; d < dtypes.size(); ++d) {
    std::vector<std::vector<int32_t>> tables(kPrefixes);
    std::vector<int32_t> next = scores[d].first;
    outputs[d].assign(kPrefixes, {});
    for (int k = 0; k < kPrefixes; ++k) {
      tables[k].assign(table.begin(), table.begin() + prefix[k] / kBlock);
      for (int b = 0; b < decode_blocks; ++b)
        tables[k].push_back(text_blocks + k * decode_blocks + b);
    }
    std::vector<engine::SequenceStep> seqs(kPrefixes);
    const std::vector<engine::SampleSpec> greedy(kPrefixes);
    for (int step = 0; step < decode; ++step) {
      for (int k = 0; k < kPrefixes; ++k) {
        outputs[d][k].push_back(next[k]);
        seqs[k] = {1, prefix[k] + step, tables[k]};
      }
      if (step + 1 == decode) break;
      const std::vector<int32_t> in = next;
      const absl::Status s =
          backends[d]->StepAndSample({in, seqs}, greedy, std::span<int32_t>(next));
      if (!s.ok()) {
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        return 1;
      }
    }
  }

  std::printf(
      "model %s (%.1fM parameters), %s: %d tokens scored; greedy: %d tokens after each of "
      "%d prefixes (%d, %d, %d, %d tokens)\n",
      config.name.c_str(), config.num_parameters() / 1e6, path.c_str(), n, decode, kPrefixes,
      prefix[0], prefix[1], prefix[2], prefix[3]);
  const char* first = engine::KvDtypeName(dtypes[0]);
  std::printf("%6s %11s %9s %7s %12s %11s   %s\n", "kv", "perplexity",
              absl::StrCat("vs ", first).c_str(), "top-1", "logits worst", "mean",
              absl::StrCat("greedy: first tokens equal to ", first, "'s, and all equal").c_str());
  for (size_t d = 0; d < dtypes.size(); ++d) {
    const double ppl = std::exp(scores[d].nll / (n - 1));
    const double base_ppl = std::exp(scores[0].nll / (n - 1));
    std::string greedy;
    int equal = 0;
    for (int k = 0; k < kPrefixes; ++k) {
      int same = 0;
      while (same < decode && outputs[d][k][same] == outputs[0][k][same]) ++same;
      for (int i = 0; i < decode; ++i) equal += outputs[d][k][i] == outputs[0][k][i];
      absl::StrAppend(&greedy, k ? ", " : "", same);
    }
    std::printf("%6s %11.4f %+8.3f%% %6.1f%% %12.2e %11.2e   %s of %d; %d of %d\n",
                engine::KvDtypeName(dtypes[d]), ppl, 100.0 * (ppl / base_ppl - 1.0),
                100.0 * scores[d].top1 / n, scores[d].worst, scores[d].mean, greedy.c_str(), decode,
                equal, kPrefixes * decode);
  }
  return 0;
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
  std::vector<engine::KvDtype> dtypes;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_kv_cache_dtypes), ',')) {
    absl::StatusOr<engine::KvDtype> dtype = engine::ParseKvDtype(std::string(s));
    if (!dtype.ok()) {
      std::fprintf(stderr, "--kv_cache_dtypes: %s\n",
                   std::string(dtype.status().message()).c_str());
      return 1;
    }
    dtypes.push_back(*dtype);
  }
  if (!absl::GetFlag(FLAGS_kv_quality_text).empty()) {
    return RunQuality(*loaded, dtypes, absl::GetFlag(FLAGS_threads));
  }
  const int block_size = 16;
  const int blocks_per_seq = (context + steps + block_size) / block_size;
  const engine::ModelConfig config = loaded->model->config;
  const std::shared_ptr<const engine::Model> shared = loaded->model;
  engine::CpuBackendOptions options;
  options.threads = absl::GetFlag(FLAGS_threads);
  options.int8_activations = absl::GetFlag(FLAGS_int8_activations);
  absl::StatusOr<std::optional<bool>> float_panels =
      engine::ParseFloatPanelsFlag(absl::GetFlag(FLAGS_float_panels));
  if (!float_panels.ok()) {
    std::fprintf(stderr, "%s\n", std::string(float_panels.status().message()).c_str());
    return 1;
  }
  options.float_panels = *float_panels;
  // The variants measured side by side: one backend per KV cache type, or
  // (--compare_quantized) the model's weights dequantized and kept
  // quantized; each with room for the largest batch.
  std::vector<std::shared_ptr<const engine::Model>> models = {shared};
  std::vector<std::string> labels;
  const bool compare_quantized = absl::GetFlag(FLAGS_compare_quantized);
  if (compare_quantized) {
    if (dtypes.size() != 1) {
      std::fprintf(stderr, "--compare_quantized takes one --kv_cache_dtypes type\n");
      return 1;
    }
    absl::StatusOr<std::optional<engine::QuantType>> quantize =
        engine::ParseQuantizeFlag(absl::GetFlag(FLAGS_quantize));
    if (!quantize.ok()) {
      std::fprintf(stderr, "%s\n", std::string(quantize.status().message()).c_str());
      return 1;
    }
    absl::StatusOr<engine::LoadedModel> kept =
        engine::LoadModel({.model = absl::GetFlag(FLAGS_model),
                           .tokenizer = absl::GetFlag(FLAGS_tokenizer),
                           .keep_quantized = true,
                           .quantize = *quantize});
    if (!kept.ok()) {
      std::fprintf(stderr, "%s\n", std::string(kept.status().message()).c_str());
      return 1;
    }
    if (!engine::HasQuantizedWeights(kept->model->weights)) {
      std::fprintf(stderr,
                   "--compare_quantized: %s has no matrix in Q8_0, Q4_0, Q4_1, Q4_K or "
                   "Q6_K (--quantize quantizes a float model)\n",
                   absl::GetFlag(FLAGS_model).c_str());
      return 1;
    }
    models.push_back(kept->model);
    dtypes.push_back(dtypes[0]);
    labels = {"fp32", "quant"};
  } else {
    for (const engine::KvDtype dtype : dtypes) labels.push_back(engine::KvDtypeName(dtype));
  }
  std::vector<std::unique_ptr<engine::Backend>> backends;
  engine::cpu::SetHugePages(absl::GetFlag(FLAGS_huge_pages));
  for (size_t d = 0; d < dtypes.size(); ++d) {
    options.kv_cache = {block_size, max_batch * blocks_per_seq, dtypes[d]};
    auto backend = engine::CreateCpuBackend(models[compare_quantized ? d : 0], options);
    if (!backend.ok()) {
      std::fprintf(stderr, "%s\n", std::string(backend.status().message()).c_str());
      return 1;
    }
    backends.push_back(*std::move(backend));
  }
  const bool compare = dtypes.size() > 1;
  std::printf("model %s (%.1fM parameters), context %d, %d decode steps per row%s%s\n",
              config.name.c_str(), config.num_parameters() / 1e6, context, steps * repeat,
              repeat > 1 ? absl::StrCat(" (", repeat, " x ", steps, ")").c_str() : "",
              sample ? ", greedy sampling included" : "");
  if (const std::optional<engine::cpu::HugePageUse> use = engine::cpu::ReadHugePageUse();
      use.has_value()) {
    std::printf("huge pages (--huge_pages=%s): %.1f of the laid-out weights' %.1f MB in memory\n",
                absl::GetFlag(FLAGS_huge_pages) ? "true" : "false", use->huge_bytes / 1e6,
                use->resident_bytes / 1e6);
  }
  if (compare_quantized) {
    std::printf("weights: fp32 %.1f MB (%s); quant %.1f MB (%s)\n",
                backends[0]->weight_bytes() / 1e6, backends[0]->Describe().c_str(),
                backends[1]->weight_bytes() / 1e6, backends[1]->Describe().c_str());
    std::printf("%6s %7s %12s %12s %14s %10s\n", "batch", "weights", "step ms", "tokens/s",
                "vs batch 1", "vs fp32");
  } else if (compare) {
    std::printf("KV cache bytes per token (all layers, K and V, scales included):");
    for (size_t d = 0; d < dtypes.size(); ++d) {
      const int64_t bytes = backends[d]->kv_bytes_per_token();
      std::printf(" %s %lld (%.2fx the tokens of %s)%s", engine::KvDtypeName(dtypes[d]),
                  static_cast<long long>(bytes),
                  static_cast<double>(backends[0]->kv_bytes_per_token()) / bytes,
                  engine::KvDtypeName(dtypes[0]), d + 1 < dtypes.size() ? "," : "\n");
    }
    std::printf("%6s %6s %12s %12s %14s %10s\n", "batch", "kv", "step ms", "tokens/s", "vs batch 1",
                absl::StrCat("vs ", engine::KvDtypeName(dtypes[0])).c_str());
  } else {
    std::printf("%6s %12s %12s %14s\n", "batch", "step ms", "tokens/s", "vs batch 1");
  }

  std::vector<float> logits;
  std::vector<double> base_tps(dtypes.size(), 0.0);  // each type's first batch size
  std::vector<std::pair<int, double>> step_seconds;  // (batch, seconds per decode step), first type
  std::vector<double> first_batch_seconds(dtypes.size(), 0.0);  // each variant's, first batch
  // --limits: each variant's smallest batch again, one step at a time, each
  // right after a pass of the bandwidth probe (probe_pairs.h).
  const bool limits = absl::GetFlag(FLAGS_limits);
  const int probe_threads =
      options.threads > 0 ? options.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::unique_ptr<engine::MemoryReadProbe> probe;
  if (limits) probe = std::make_unique<engine::MemoryReadProbe>(probe_threads);
  std::vector<bench::ProbePairs> paired(dtypes.size());
  for (int batch : sizes) {
    std::vector<std::vector<int32_t>> tables(batch);
    for (int b = 0; b < batch; ++b) {
      tables[b].resize(blocks_per_seq);
      std::iota(tables[b].begin(), tables[b].end(), b * blocks_per_seq);
    }
    double first_tps = 0;  // the first type's, at this batch size
    // Each variant's batch: its tables' blocks filled, its tokens, and the
    // seconds of its rounds.
    const size_t variants = dtypes.size();
    std::vector<std::vector<int32_t>> tokens(variants, std::vector<int32_t>(batch, 11));
    std::vector<engine::SequenceStep> seqs(batch);
    const std::vector<engine::SampleSpec> greedy(batch);
    std::vector<int32_t> next(batch);
    std::vector<double> variant_seconds(variants, 0.0);
    for (size_t d = 0; d < variants; ++d) {
      engine::Backend& backend = *backends[d];
      // Prefill the first sequence's context and copy its blocks to the
      // others: a decode step's cost depends on how much each sequence has
      // cached, not on what.
      std::vector<int32_t> prompt(context, 7);
      engine::SequenceStep seq{context, 0, tables[0]};
      logits.resize(config.vocab_size);
      if (auto s = backend.Step({prompt, {&seq, 1}}, logits); !s.ok()) {
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        return 1;
      }
      std::vector<engine::BlockCopy> copies;
      for (int b = 1; b < batch; ++b) {
        for (int k = 0; k < blocks_per_seq; ++k) copies.push_back({tables[0][k], tables[b][k]});
      }
      if (auto s = backend.CopyBlocks(copies); !s.ok()) {
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        return 1;
      }
    }
    // Decode `steps` tokens for the whole batch, `repeat` rounds, the
    // variants taking turns round by round: a change in the shared machine
    // falls on all of them, not on whichever ran last.
    logits.resize(static_cast<size_t>(batch) * config.vocab_size);
    for (int r = 0; r < repeat; ++r) {
      for (size_t d = 0; d < variants; ++d) {
        engine::Backend& backend = *backends[d];
        const absl::Time start = absl::Now();
        for (int step = 0; step < steps; ++step) {
          for (int b = 0; b < batch; ++b) seqs[b] = {1, context + step, tables[b]};
          const absl::Status s =
              sample ? backend.StepAndSample({tokens[d], seqs}, greedy, std::span<int32_t>(next))
                     : backend.Step({tokens[d], seqs}, logits);
          if (!s.ok()) {
            std::fprintf(stderr, "%s\n", s.ToString().c_str());
            return 1;
          }
          if (sample) tokens[d] = next;
        }
        variant_seconds[d] += absl::ToDoubleSeconds(absl::Now() - start);
      }
    }
    for (size_t d = 0; d < variants; ++d) {
      engine::Backend& backend = *backends[d];
      const double seconds = variant_seconds[d];
      const double tps = static_cast<double>(batch) * steps * repeat / seconds;
      if (base_tps[d] == 0) {
        base_tps[d] = tps;
        first_batch_seconds[d] = seconds / (steps * repeat);
      }
      if (d == 0) {
        first_tps = tps;
        step_seconds.push_back({batch, seconds / (steps * repeat)});
      }
      if (limits && batch == sizes.front()) {
        paired[d] = bench::TimeAfterProbePasses(*probe, kPairedSteps, [&](int step) {
          for (int b = 0; b < batch; ++b) seqs[b] = {1, context + step % steps, tables[b]};
          return sample ? backend.StepAndSample({tokens[d], seqs}, greedy, std::span<int32_t>(next))
                        : backend.Step({tokens[d], seqs}, logits);
        });
        if (!paired[d].status.ok()) {
          std::fprintf(stderr, "%s\n", paired[d].status.ToString().c_str());
          return 1;
        }
      }
      if (compare) {
        std::printf(compare_quantized ? "%6d %7s %12.2f %12.1f %13.2fx %9.2fx\n"
                                      : "%6d %6s %12.2f %12.1f %13.2fx %9.2fx\n",
                    batch, labels[d].c_str(), seconds / (steps * repeat) * 1e3, tps,
                    tps / base_tps[d], tps / first_tps);
      } else {
        std::printf("%6d %12.2f %12.1f %13.2fx\n", batch, seconds / (steps * repeat) * 1e3, tps,
                    tps / base_tps[d]);
      }
      std::fflush(stdout);
    }
  }
  if (!limits) return 0;

  // The machine's limits, measured now, on as many threads as the engine.
  const int threads = probe_threads;
  const double bandwidth = engine::MeasureMemoryReadBandwidth(threads);
  const double sgemm = SgemmRate(threads);
  const double weight_bytes = static_cast<double>(backends[0]->weight_bytes());
  // Multiply-adds per decoded token: every weight once (the tied classifier
  // included), plus attention's q.k and p.v over the cached positions.
  const double mean_context = context + (steps - 1) / 2.0;
  const double flops_per_token =
      2.0 * config.num_parameters() + 4.0 * mean_context * config.dim * config.n_layers;
  const auto [small_batch, small_seconds] = step_seconds.front();
  const auto [large_batch, large_seconds] = step_seconds.back();
  const double rate = large_batch * flops_per_token / large_seconds;
  std::printf("\nlimits, measured in this run on %d threads:\n", threads);
  const double one_stream = engine::MeasureMemoryReadBandwidth(threads, 1);
  std::printf(
      "  memory read bandwidth            %8.1f GB/s (8 streams a thread; one stream a "
      "thread: %.1f GB/s)\n",
      bandwidth / 1e9, one_stream / 1e9);
  std::printf("  sgemm 2048^3 (OpenBLAS, core %s) %8.1f GFLOP/s\n", openblas_get_corename(),
              sgemm / 1e9);
  PrintFloor(small_batch, weight_bytes, paired[0]);
  std::printf("  batch %d: %.1f GFLOP/s (%.0f MFLOP per token): %.1f%% of the sgemm rate\n",
              large_batch, rate / 1e9, flops_per_token / 1e6, 100.0 * rate / sgemm);
  if (compare_quantized) {
    std::printf("  quant:\n");
    PrintFloor(small_batch, static_cast<double>(backends[1]->weight_bytes()), paired[1]);
  }
  return 0;
}

}  // namespace
}  // namespace coalesce

int main(int argc, char** argv) {
  coalesce::ParseFlags(argc, argv, "Measures engine decode throughput by batch size.");
  return coalesce::Run();
}
