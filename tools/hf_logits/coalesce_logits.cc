// coalesce-logits: loads a model in any format the engine reads (a Hugging
// Face folder, a GGUF file, a llama2.c checkpoint, "synthetic:NAME": see
// engine/model/load.h) and prints, as JSON, the float32 logits of every step
// of greedy decoding for each prompt, run twice: each prompt alone, and all
// prompts batched together in one step sequence. tests/engine/model/
// test_hf_parity.py and test_gguf_model_parity.py compare them with
// transformers.
//
//   coalesce-logits --model PATH --steps N --prompt 1,2,3 [--prompt 4,5 ...]
//                   [--threads T] [--tokenizer FILE] [--keep_quantized true]
//                   [--quantize q8_0|q4_0]
//
// --keep_quantized true keeps a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K
// matrices in their blocks (engine::ModelSpec::keep_quantized), as the
// server does on the CPU; by default they are dequantized to float32.
// --quantize quantizes the float32 matrices at load, as the server's flag.
//
// The model is loaded with its tokenizer, as the server loads it (which
// checks that the two agree); --tokenizer overrides the format's own, as the
// server's flag of that name does. Prompts are token ids either way, so a
// Hugging Face folder without tokenizer.json (test_hf_parity.py's random
// models) is loaded without one.
//
// Step 0 prefills the prompt and yields the logits after its last token;
// step i > 0 feeds the token chosen at step i-1. Output:
//   {"model": {...}, "alone": [{"tokens": [N ids], "logits": [N][vocab]}, ...],
//    "batched": [same, in prompt order]}
// Errors go to stderr with exit status 1 (2 for bad usage).
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/model/hf_model.h"
#include "engine/model/load.h"
#include "engine/model/quantize.h"
#include "engine/sampler.h"

namespace coalesce::engine {
namespace {

using Json = nlohmann::json;

constexpr int kBlockSize = 16;

struct Options {
  std::string model;
  std::string tokenizer;
  int steps = 0;
  int threads = 0;
  bool keep_quantized = false;
  std::optional<QuantType> quantize;
  std::vector<std::vector<int32_t>> prompts;
};

struct Result {
  std::vector<int32_t> tokens;             // [steps]
  std::vector<std::vector<float>> logits;  // [steps, vocab]
};

int32_t Argmax(std::span<const float> logits) {
  Rng unused(0);
  return Sample(logits, {}, unused);  // greedy: ties to the lowest id
}

// Greedy decoding of `prompts` together, each sequence with its own blocks.
absl::StatusOr<std::vector<Result>> Decode(Backend& backend,
                                           const std::vector<std::vector<int32_t>>& prompts,
                                           int steps) {
  const int vocab = backend.config().vocab_size;
  const int n = static_cast<int>(prompts.size());
  std::vector<std::vector<int32_t>> tables(n);
  int next_block = 0;
  for (int s = 0; s < n; ++s) {
    const int positions = static_cast<int>(prompts[s].size()) + steps;
    for (int b = 0; b * kBlockSize < positions; ++b) tables[s].push_back(next_block++);
  }
  if (next_block > backend.kv_cache().num_blocks) {
    return absl::InternalError("KV cache too small for the prompts");
  }
  std::vector<SequenceStep> seqs(n);
  std::vector<int32_t> tokens;
  for (int s = 0; s < n; ++s) {
    seqs[s] = {.num_tokens = static_cast<int32_t>(prompts[s].size()),
               .start_pos = 0,
               .block_table = tables[s]};
    tokens.insert(tokens.end(), prompts[s].begin(), prompts[s].end());
  }
  std::vector<Result> results(n);
  std::vector<float> logits(static_cast<size_t>(n) * vocab);
  for (int step = 0; step < steps; ++step) {
    if (absl::Status st = backend.Step({.tokens = tokens, .seqs = seqs}, logits); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("step ", step, ": ", st.message()));
    }
    tokens.clear();
    for (int s = 0; s < n; ++s) {
      const std::span<const float> row(logits.data() + static_cast<size_t>(s) * vocab, vocab);
      results[s].logits.emplace_back(row.begin(), row.end());
      results[s].tokens.push_back(Argmax(row));
      seqs[s].start_pos += seqs[s].num_tokens;
      seqs[s].num_tokens = 1;
      tokens.push_back(results[s].tokens.back());
    }
  }
  return results;
}

Json ToJson(const std::vector<Result>& results) {
  Json out = Json::array();
  for (const Result& r : results) out.push_back({{"tokens", r.tokens}, {"logits", r.logits}});
  return out;
}

absl::StatusOr<Options> ParseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::string value = i + 1 < argc ? argv[i + 1] : "";
    if (arg != "--model" && arg != "--steps" && arg != "--threads" && arg != "--prompt" &&
        arg != "--tokenizer" && arg != "--keep_quantized" && arg != "--quantize") {
      return absl::InvalidArgumentError(absl::StrCat("unknown argument ", arg));
    }
    if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(arg, " needs a value"));
    ++i;
    if (arg == "--model") {
      o.model = value;
    } else if (arg == "--tokenizer") {
      o.tokenizer = value;
    } else if (arg == "--keep_quantized") {
      if (value != "true" && value != "false") {
        return absl::InvalidArgumentError(
            absl::StrCat("--keep_quantized ", value, ": need true or false"));
      }
      o.keep_quantized = value == "true";
    } else if (arg == "--quantize") {
      ASSIGN_OR_RETURN(o.quantize, ParseQuantizeFlag(value));
    } else if (arg == "--steps" || arg == "--threads") {
      int v = 0;
      if (!absl::SimpleAtoi(value, &v) || v < 0) {
        return absl::InvalidArgumentError(absl::StrCat(arg, " ", value, ": need an integer >= 0"));
      }
      (arg == "--steps" ? o.steps : o.threads) = v;
    } else {
      std::vector<int32_t> ids;
      for (const absl::string_view part : absl::StrSplit(value, ',')) {
        int32_t id = 0;
        if (!absl::SimpleAtoi(part, &id)) {
          return absl::InvalidArgumentError(absl::StrCat("--prompt ", value, ": need ids a,b,c"));
        }
        ids.push_back(id);
      }
      o.prompts.push_back(std::move(ids));
    }
  }
  if (o.model.empty() || o.steps < 1 || o.prompts.empty()) {
    return absl::InvalidArgumentError(
        "usage: coalesce-logits --model PATH --steps N --prompt 1,2,3 [--prompt ...] "
        "[--threads T] [--tokenizer FILE] [--keep_quantized true] [--quantize q8_0|q4_0]");
  }
  return o;
}

// The model, through LoadModel unless it is a folder with no tokenizer.
absl::StatusOr<std::shared_ptr<const Model>> Load(const Options& o) {
  namespace fs = std::filesystem;
  if (o.tokenizer.empty() && fs::is_directory(o.model) &&
      !fs::exists(fs::path(o.model) / "tokenizer.json")) {
    ASSIGN_OR_RETURN(Model model, LoadHfModel(o.model));
    return std::make_shared<const Model>(std::move(model));
  }
  ASSIGN_OR_RETURN(LoadedModel loaded, LoadModel({.model = o.model,
                                                  .tokenizer = o.tokenizer,
                                                  .keep_quantized = o.keep_quantized,
                                                  .quantize = o.quantize}));
  return loaded.model;
}

int Main(int argc, char** argv) {
  auto options = ParseArgs(argc, argv);
  if (!options.ok()) {
    std::cerr << options.status().message() << "\n";
    return 2;
  }
  auto loaded = Load(*options);
  if (!loaded.ok()) {
    std::cerr << loaded.status() << "\n";
    return 1;
  }
  const std::shared_ptr<const Model> shared = *std::move(loaded);
  const ModelConfig& c = shared->config;
  int blocks = 0;
  for (const auto& p : options->prompts) {
    blocks += (static_cast<int>(p.size()) + options->steps + kBlockSize - 1) / kBlockSize;
  }
  auto backend = CreateCpuBackend(
      shared,
      {.kv_cache = {.block_size = kBlockSize, .num_blocks = blocks}, .threads = options->threads});
  if (!backend.ok()) {
    std::cerr << backend.status() << "\n";
    return 1;
  }
  // Alone: one prompt at a time (the cache blocks are reused; each run starts
  // at position 0 and overwrites what it reads).
  std::vector<Result> alone;
  for (const auto& prompt : options->prompts) {
    auto r = Decode(**backend, {prompt}, options->steps);
    if (!r.ok()) {
      std::cerr << r.status() << "\n";
      return 1;
    }
    alone.push_back(std::move((*r)[0]));
  }
  auto batched = Decode(**backend, options->prompts, options->steps);
  if (!batched.ok()) {
    std::cerr << batched.status() << "\n";
    return 1;
  }
  const Json out = {{"model",
                     {{"name", c.name},
                      {"architecture", c.architecture},
                      {"vocab_size", c.vocab_size},
                      {"max_seq_len", c.max_seq_len},
                      {"bos_token_id", c.bos_token_id},
                      {"eos_token_ids", c.eos_token_ids}}},
                    {"alone", ToJson(alone)},
                    {"batched", ToJson(*batched)}};
  std::cout << out.dump() << "\n";
  return 0;
}

}  // namespace
}  // namespace coalesce::engine

int main(int argc, char** argv) { return coalesce::engine::Main(argc, argv); }
