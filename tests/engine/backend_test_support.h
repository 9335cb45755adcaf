// Shared by the backend tests (backend_contract_test.cc and the per-backend
// files cpu_backend_test.cc, null_backend_test.cc, cuda_backend_test.cc):
// the models they run, prompts and block tables, running steps one token at a
// time or with sampling, a small request driver (Generate), stories260K's
// goldens, comparing logits, and skipping without a GPU. Header-only and free
// of CUDA headers (engine/cuda/cuda_backend.h needs none), so that every
// engine test can include it; cuda_test_support.h includes it too.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/model.h"
#include "engine/model/llama2c.h"
#include "engine/model/synthetic.h"
#include "engine/sampler.h"

// Skips the calling test, with the reason, when no CUDA device is usable
// (always in a build without CUDA: the stub CudaDeviceUsable says so).
#define COALESCE_REQUIRE_GPU()                          \
  do {                                                  \
    std::string why_;                                   \
    if (!::coalesce::engine::CudaDeviceUsable(&why_)) { \
      GTEST_SKIP() << "no GPU to test on: " << why_;    \
    }                                                   \
  } while (false)

namespace coalesce::engine::testing {

// The test models (tests/CMakeLists.txt: COALESCE_MODELS_DIR).
inline const std::string& ModelsDir() {
  static const std::string dir = COALESCE_MODELS_DIR;
  return dir;
}

// stories260K (dim 64, 5 layers, GQA 8/4, vocabulary 512, context 512),
// loaded once; nullptr, with a failure, if it cannot be read.
inline std::shared_ptr<const Model> Stories() {
  static const std::shared_ptr<const Model> model = [] {
    auto m = LoadLlama2cModel(ModelsDir() + "/stories260K/stories260K.bin");
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? std::make_shared<const Model>(*std::move(m)) : nullptr;
  }();
  return model;
}

// A synthetic preset ("synthetic:tiny", "synthetic:15m", ...), built once per
// name; nullptr, with a failure, for an unknown name.
inline std::shared_ptr<const Model> Synthetic(const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const Model>> built;
  std::lock_guard<std::mutex> lock(mu);
  auto it = built.find(name);
  if (it == built.end()) {
    auto m = BuildSyntheticModel(name);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return nullptr;
    it = built.emplace(name, std::make_shared<const Model>(*std::move(m))).first;
  }
  return it->second;
}

inline std::vector<int32_t> Iota(int n, int start = 0) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

// A few ids of a prompt: BOS then a fixed spread of the vocabulary.
inline std::vector<int32_t> Prompt(int n, int vocab) {
  std::vector<int32_t> ids = {1};
  for (int i = 1; i < n; ++i) ids.push_back((i * 97 + 13) % vocab);
  return ids;
}

// Runs `tokens` one per step from position 0; returns the logits of each step.
inline std::vector<std::vector<float>> OneByOne(Backend& backend,
                                                const std::vector<int32_t>& tokens,
                                                const std::vector<int32_t>& table) {
  const int vocab = backend.config().vocab_size;
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const SequenceStep seq{
        .num_tokens = 1, .start_pos = static_cast<int32_t>(i), .block_table = table};
    std::vector<float> logits(vocab);
    const absl::Status status =
        backend.Step({.tokens = {&tokens[i], 1}, .seqs = {&seq, 1}}, logits);
    EXPECT_TRUE(status.ok()) << "step " << i << ": " << status;
    out.push_back(std::move(logits));
  }
  return out;
}

// Runs StepAndSample; the tokens, or an empty vector on error (the status in
// `status`). No `sampling`: greedy for every sequence.
inline std::vector<int32_t> SampleStep(Backend& backend, const std::vector<int32_t>& tokens,
                                       const std::vector<SequenceStep>& seqs, absl::Status* status,
                                       const std::vector<SampleSpec>& sampling = {}) {
  std::vector<SampleSpec> specs = sampling;
  if (specs.empty()) specs.resize(seqs.size());
  std::vector<int32_t> next(seqs.size(), -1);
  *status = backend.StepAndSample({tokens, seqs}, specs, std::span<int32_t>(next));
  return status->ok() ? next : std::vector<int32_t>();
}

// ||a - b|| / ||b|| (NaN anywhere gives NaN, which fails every bound; sizes
// that differ give infinity).
inline double RelativeError(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}
inline double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  return RelativeError(std::span<const float>(a), std::span<const float>(b));
}

// ---------------------------------------------------------------------------
// A small driver: sequences with prompts, each starting at its own step,
// prompts fed in chunks, then greedy (or sampled) decoding. Every sequence
// owns a disjoint range of blocks: request i the blocks from i times
// ceil(max_seq_len / block_size), so the backend needs that many per request.
// ---------------------------------------------------------------------------

struct Request {
  std::vector<int32_t> prompt;
  int outputs = 0;             // tokens to generate
  int start_step = 0;          // the step it joins at
  SamplingParams params = {};  // greedy by default
  uint64_t seed = 0;
};

inline std::vector<std::vector<int32_t>> Generate(Backend& backend,
                                                  const std::vector<Request>& requests, int chunk) {
  const int bs = backend.kv_cache().block_size;
  const int blocks_each = (backend.config().max_seq_len + bs - 1) / bs;
  struct State {
    std::vector<int32_t> tokens, table, out;
    int cached = 0;
    Rng rng{0};
  };
  std::vector<State> states(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    states[i].tokens = requests[i].prompt;
    states[i].table.resize(blocks_each);
    std::iota(states[i].table.begin(), states[i].table.end(), static_cast<int>(i) * blocks_each);
    states[i].rng = Rng(requests[i].seed);
  }
  for (int step = 0;; ++step) {
    std::vector<int32_t> tokens;
    std::vector<SequenceStep> seqs;
    std::vector<SampleSpec> specs;
    std::vector<size_t> who;
    bool pending = false;
    for (size_t i = 0; i < requests.size(); ++i) {
      State& s = states[i];
      if (static_cast<int>(s.out.size()) >= requests[i].outputs) continue;
      pending = true;
      if (requests[i].start_step > step) continue;
      const int n = std::min<int>(chunk, static_cast<int>(s.tokens.size()) - s.cached);
      tokens.insert(tokens.end(), s.tokens.begin() + s.cached, s.tokens.begin() + s.cached + n);
      seqs.push_back({n, s.cached, s.table});
      SampleSpec spec;
      if (s.cached + n == static_cast<int>(s.tokens.size())) {
        spec.params = requests[i].params;
        if (spec.params.temperature > 0) spec.uniform = s.rng.NextFloat();
      }
      specs.push_back(spec);
      who.push_back(i);
    }
    if (!pending) break;
    if (seqs.empty()) continue;
    std::vector<int32_t> next(seqs.size());
    const absl::Status status = backend.StepAndSample({tokens, seqs}, specs, next);
    EXPECT_TRUE(status.ok()) << status;
    if (!status.ok()) break;
    for (size_t k = 0; k < who.size(); ++k) {
      State& s = states[who[k]];
      s.cached += seqs[k].num_tokens;
      if (s.cached < static_cast<int>(s.tokens.size())) continue;
      s.tokens.push_back(next[k]);
      s.out.push_back(next[k]);
    }
  }
  std::vector<std::vector<int32_t>> out;
  for (State& s : states) out.push_back(std::move(s.out));
  return out;
}

// ---------------------------------------------------------------------------
// stories260K goldens (golden.json, from llama2.c's run.c)
// ---------------------------------------------------------------------------

// The integer arrays named `key` in golden.json, in order. (The GPU check
// machine has no JSON library; the file's arrays are flat lists of ints.)
inline std::vector<std::vector<int32_t>> IntArrays(const std::string& text,
                                                   const std::string& key) {
  std::vector<std::vector<int32_t>> out;
  const std::string needle = "\"" + key + "\": [";
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
    std::vector<int32_t> ids;
    std::istringstream in(text.substr(at + needle.size(), text.find(']', at) - at - needle.size()));
    for (std::string item; std::getline(in, item, ',');) ids.push_back(std::stoi(item));
    out.push_back(ids);
  }
  return out;
}

struct Goldens {
  std::vector<std::vector<int32_t>> prompts, outputs;
};

inline Goldens ReadGoldens() {
  std::ifstream in(ModelsDir() + "/stories260K/golden.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return {IntArrays(text, "prompt_ids"), IntArrays(text, "output_ids")};
}

// One greedy request per golden case: its prompt, as many outputs as it has.
inline std::vector<Request> GoldenRequests(const Goldens& g) {
  std::vector<Request> requests;
  for (size_t i = 0; i < g.prompts.size() && i < g.outputs.size(); ++i) {
    requests.push_back({g.prompts[i], static_cast<int>(g.outputs[i].size())});
  }
  return requests;
}

}  // namespace coalesce::engine::testing
