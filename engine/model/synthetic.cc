#include "engine/model/synthetic.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <unordered_set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/sampler.h"

namespace coalesce::engine {
namespace {

ModelConfig Shape(int dim, int hidden_dim, int n_layers, int n_heads, int n_kv_heads) {
  ModelConfig c;
  c.dim = dim;
  c.hidden_dim = hidden_dim;
  c.n_layers = n_layers;
  c.n_heads = n_heads;
  c.n_kv_heads = n_kv_heads;
  c.vocab_size = 32000;
  c.max_seq_len = 2048;
  c.tied_classifier = true;  // one matrix less to build and to read
  return c;
}

// One tensor of the flat weight buffer and how to fill it.
struct Region {
  int64_t offset = 0;  // floats from the start of the buffer
  int64_t count = 0;
  float half_width = 0;  // uniform in [-half_width, half_width); 0: all ones
};

// Fills one chunk from its own generator, seeded by (tensor, chunk) only, so
// the weights do not depend on how many threads share the work.
void FillChunk(float* out, int64_t count, float half_width, uint64_t seed) {
  if (half_width == 0.0f) {
    std::fill(out, out + count, 1.0f);
    return;
  }
  Rng rng(seed);
  // Two 24-bit uniforms per draw, mapped to [-1, 1) then scaled.
  const float scale = half_width * 0x1.0p-23f;
  int64_t i = 0;
  for (; i + 2 <= count; i += 2) {
    const uint64_t r = rng.NextU64();
    out[i] = (static_cast<float>((r >> 40) & 0xFFFFFF) - 0x1.0p23f) * scale;
    out[i + 1] = (static_cast<float>((r >> 8) & 0xFFFFFF) - 0x1.0p23f) * scale;
  }
  if (i < count) out[i] = (static_cast<float>(rng.NextU64() >> 40) - 0x1.0p23f) * scale;
}

constexpr uint64_t kSeed = 0xC0A1E5CE5EEDull;
constexpr int64_t kChunkFloats = int64_t{1} << 18;
constexpr float kAttentionOutputScale = 0.3f;  // see BuildSyntheticModel

}  // namespace

const std::vector<SyntheticPreset>& SyntheticPresets() {
  static const auto* const presets = new std::vector<SyntheticPreset>{
      {"synthetic:tiny",
       "stories260K shape (dim 64, 5 layers, GQA 8/4) with a 512-token vocabulary",
       [] {
         ModelConfig c = Shape(64, 172, 5, 8, 4);
         c.vocab_size = 512;
         return c;
       }()},
      {"synthetic:15m", "llama2.c stories15M shape (dim 288, 6 layers, 6 heads)",
       Shape(288, 768, 6, 6, 6)},
      {"synthetic:110m", "llama2.c stories110M shape (dim 768, 12 layers, 12 heads)",
       Shape(768, 2048, 12, 12, 12)},
      {"synthetic:1b", "TinyLlama-1.1B shape (dim 2048, 22 layers, GQA 32/4)",
       Shape(2048, 5632, 22, 32, 4)},
  };
  return *presets;
}

absl::StatusOr<Model> BuildSyntheticModel(const std::string& name) {
  const SyntheticPreset* preset = nullptr;
  std::vector<std::string> names;
  for (const SyntheticPreset& p : SyntheticPresets()) {
    names.push_back(p.name);
    if (p.name == name) preset = &p;
  }
  if (preset == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown synthetic model \"", name,
                                                   "\"; presets: ", absl::StrJoin(names, ", ")));
  }
  Model model;
  model.config = preset->shape;
  model.config.name = preset->name;
  model.config.source = "embedded";
  model.config.synthetic = true;
  const ModelConfig& c = model.config;

  // Scales: every projection gets a standard deviation of 1/sqrt(fan_in), so
  // activations stay O(1) at every width and depth and attention scores are
  // neither flat nor one-hot. The (tied) embedding gets 1/sqrt(dim), so each
  // logit of the unit-RMS final state has a standard deviation of about 1.
  // wo gets 0.3 of that: attention averages values over the whole history,
  // so its output changes little from one step to the next, and when it
  // dominates the residual stream consecutive logits are nearly equal and
  // greedy decoding repeats a token (measured: 85 repeats in 100 steps of
  // synthetic:tiny at 1.0, 4 at 0.3). Uniform(-a, a) has sd a/sqrt(3).
  const float sqrt3 = std::sqrt(3.0f);
  auto uniform = [&](int fan_in) { return sqrt3 / std::sqrt(static_cast<float>(fan_in)); };
  std::vector<Region> regions;
  int64_t total = 0;
  auto add = [&](int64_t count, float half_width) {
    regions.push_back({total, count, half_width});
    total += count;
    return regions.size() - 1;
  };
  const int64_t dim = c.dim, hidden = c.hidden_dim, kv_dim = c.kv_dim();
  const size_t embedding = add(c.vocab_size * dim, uniform(c.dim));
  struct LayerRegions {
    size_t attn_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3;
  };
  std::vector<LayerRegions> layer_regions(c.n_layers);
  for (LayerRegions& lr : layer_regions) {
    lr.attn_norm = add(dim, 0.0f);
    lr.wq = add(dim * dim, uniform(c.dim));
    lr.wk = add(kv_dim * dim, uniform(c.dim));
    lr.wv = add(kv_dim * dim, uniform(c.dim));
    lr.wo = add(dim * dim, kAttentionOutputScale * uniform(c.dim));
    lr.ffn_norm = add(dim, 0.0f);
    lr.w1 = add(hidden * dim, uniform(c.dim));
    lr.w2 = add(dim * hidden, uniform(c.hidden_dim));
    lr.w3 = add(hidden * dim, uniform(c.dim));
  }
  const size_t final_norm = add(dim, 0.0f);

  // Uninitialised: every float is written below, and untouched pages of a
  // 4.4 GB model cost nothing until the fill reaches them.
  float* data = new (std::nothrow) float[total];
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", total * 4, " bytes for ", name));
  }
  model.storage = std::shared_ptr<const void>(
      data, [](const void* p) { delete[] static_cast<const float*>(p); });

  // Work items: fixed-size chunks of every region, taken by whichever thread
  // is free.
  struct Chunk {
    size_t region;
    int64_t begin, count;
  };
  std::vector<Chunk> chunks;
  for (size_t r = 0; r < regions.size(); ++r) {
    for (int64_t b = 0; b < regions[r].count; b += kChunkFloats) {
      chunks.push_back({r, b, std::min(kChunkFloats, regions[r].count - b)});
    }
  }
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < chunks.size();) {
      const Chunk& ch = chunks[i];
      const Region& reg = regions[ch.region];
      const uint64_t seed = kSeed ^ (uint64_t{ch.region} << 40) ^ static_cast<uint64_t>(ch.begin);
      FillChunk(data + reg.offset + ch.begin, ch.count, reg.half_width, seed);
    }
  };
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int t = 1; t < threads && static_cast<size_t>(t) < chunks.size(); ++t) {
    pool.emplace_back(work);
  }
  work();
  for (std::thread& t : pool) t.join();

  auto span = [&](size_t r) {
    return std::span<const float>(data + regions[r].offset, regions[r].count);
  };
  ModelWeights& w = model.weights;
  w.token_embedding = span(embedding);
  w.classifier = w.token_embedding;
  w.final_norm = span(final_norm);
  for (const LayerRegions& lr : layer_regions) {
    w.layers.push_back({span(lr.attn_norm), span(lr.wq), span(lr.wk), span(lr.wv), span(lr.wo),
                        span(lr.ffn_norm), span(lr.w1), span(lr.w2), span(lr.w3)});
  }
  return model;
}

std::unique_ptr<Llama2cTokenizer> BuildSyntheticTokenizer(int vocab_size) {
  vocab_size = std::max(vocab_size, 0);
  std::vector<std::string> pieces;
  pieces.reserve(vocab_size);
  pieces.push_back("<unk>");
  pieces.push_back("\n<s>\n");
  pieces.push_back("\n</s>\n");
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
    pieces.push_back(buf);
  }
  const size_t first_piece = pieces.size();  // 259
  std::unordered_set<std::string> seen(pieces.begin(), pieces.end());
  auto add = [&](std::string piece) {
    if (static_cast<int>(pieces.size()) >= vocab_size || seen.count(piece) > 0) return;
    // A merged piece spelled like a byte token would decode as that byte.
    if (piece.size() == 6 && piece.compare(0, 3, "<0x") == 0 && piece[5] == '>') return;
    seen.insert(piece);
    pieces.push_back(std::move(piece));
  };
  // Every printable ASCII character, so ASCII text never needs byte tokens
  // (and " " exists for the dummy prefix), most frequent in English first,
  // then word starts. Merges below favour early pieces, so this order makes
  // their pieces look a little like English and text compress a little.
  const std::string_view frequent = " etaoinshrdlcumwfgypbvkjxqz";
  for (const char ch : frequent) add(std::string(1, ch));
  for (const char ch : std::string_view(".,'\"TSAIMCHBWDOLNPRFEGJKUVYQXZ")) {
    add(std::string(1, ch));
  }
  for (const char ch : frequent.substr(1)) add(std::string(" ") + ch);
  for (char ch = ' '; ch <= '~'; ++ch) add(std::string(1, ch));  // the rest, in ASCII order
  for (const char ch : std::string_view("TSAIMCHBWDOLNPRFEGJKUVYQXZ")) add(std::string(" ") + ch);
  // Then pieces made of two earlier word pieces (letters, perhaps after one
  // space), earlier (shorter, likelier) pieces chosen more often, so
  // run.c-style merging finds chains of them and prompts compress.
  auto is_word = [](std::string_view p) {
    if (!p.empty() && p[0] == ' ') p.remove_prefix(1);
    return !p.empty() && std::all_of(p.begin(), p.end(), [](char ch) {
      return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z');
    });
  };
  std::vector<size_t> words;
  for (size_t i = first_piece; i < pieces.size(); ++i) {
    if (is_word(pieces[i])) words.push_back(i);
  }
  Rng rng(kSeed);
  const size_t max_length = 12;
  for (int attempts = 0;
       static_cast<int>(pieces.size()) < vocab_size && !words.empty() && attempts < 50 * vocab_size;
       ++attempts) {
    auto pick = [&] {
      const float u = rng.NextFloat();
      return words[std::min(words.size() - 1, static_cast<size_t>(u * u * words.size()))];
    };
    const std::string& a = pieces[pick()];
    const std::string& b = pieces[pick()];
    if (a.size() + b.size() > max_length || b[0] == ' ') continue;  // words, not phrases
    const size_t before = pieces.size();
    add(a + b);
    if (pieces.size() > before) words.push_back(before);
  }
  // Fill any remainder (tiny vocabularies only) with unused placeholders.
  for (int i = static_cast<int>(pieces.size()); i < vocab_size; ++i) {
    add(absl::StrCat("<unused", i, ">"));
  }
  // Scores fall with the id, like llama2.c's: earlier pieces merge first. The
  // special and byte tokens are never merge results.
  std::vector<float> scores(pieces.size(), -1e10f);
  for (size_t i = first_piece; i < pieces.size(); ++i) {
    scores[i] = -static_cast<float>(i - first_piece);
  }
  pieces.resize(std::min(pieces.size(), static_cast<size_t>(vocab_size)));
  scores.resize(pieces.size());
  return std::make_unique<Llama2cTokenizer>(std::move(pieces), std::move(scores));
}

}  // namespace coalesce::engine
