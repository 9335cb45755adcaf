#include "engine/model/llama2c.h"

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/model/mapped_file.h"

namespace coalesce::engine {
namespace {

// run.c's Config: seven little-endian int32 fields at the start of the file.
struct Llama2cHeader {
  int32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
};
static_assert(sizeof(Llama2cHeader) == 28);

}  // namespace

absl::StatusOr<Model> LoadLlama2cModel(const std::string& path) {
  size_t file_size = 0;
  auto mapped = MapFile(path, &file_size);
  if (!mapped.ok()) return mapped.status();
  if (file_size < sizeof(Llama2cHeader)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": file too short for a llama2.c header (",
                                                   file_size, " bytes, need 28)"));
  }
  Model model;
  model.storage = *std::move(mapped);

  Llama2cHeader h;
  std::memcpy(&h, model.storage.get(), sizeof(h));
  const bool tied = h.vocab_size > 0;
  const int64_t vocab = h.vocab_size >= 0 ? int64_t{h.vocab_size} : -int64_t{h.vocab_size};
  if (h.dim <= 0 || h.hidden_dim <= 0 || h.n_layers <= 0 || h.n_heads <= 0 || h.n_kv_heads <= 0 ||
      vocab == 0 || h.seq_len <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": invalid llama2.c header (dim=", h.dim, " hidden_dim=", h.hidden_dim,
                     " n_layers=", h.n_layers, " n_heads=", h.n_heads, " n_kv_heads=", h.n_kv_heads,
                     " vocab_size=", h.vocab_size, " seq_len=", h.seq_len,
                     "): every field must be non-zero", " and all but vocab_size positive"));
  }
  if (h.dim % h.n_heads != 0 || h.n_heads % h.n_kv_heads != 0 || (h.dim / h.n_heads) % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": inconsistent llama2.c header: dim (", h.dim, ") must be a multiple of n_heads (",
        h.n_heads, ") with an even head size, and n_heads a multiple of n_kv_heads (", h.n_kv_heads,
        ")"));
  }

  ModelConfig& c = model.config;
  c.name = std::filesystem::path(path).stem().string();
  c.architecture = "llama";
  c.source = path;
  c.synthetic = false;
  c.dim = h.dim;
  c.hidden_dim = h.hidden_dim;
  c.n_layers = h.n_layers;
  c.n_heads = h.n_heads;
  c.n_kv_heads = h.n_kv_heads;
  c.vocab_size = static_cast<int>(vocab);
  c.max_seq_len = h.seq_len;
  model.config.tied_classifier = tied;

  // The float count run.c's memory_map_weights walks, in 128 bits: header
  // fields up to 2^31 multiply past 64.
  const int64_t dim = c.dim, hidden = c.hidden_dim, layers = c.n_layers;
  const int64_t kv_dim = c.kv_dim(), head_size = c.head_dim();
  const int64_t freq_cis = int64_t{h.seq_len} * head_size / 2 * 2;  // legacy RoPE tables
  using Wide = __int128;
  const Wide per_layer =
      Wide{2} * dim + Wide{2} * dim * dim + Wide{2} * kv_dim * dim + Wide{3} * hidden * dim;
  const Wide num_floats = Wide{vocab} * dim * (tied ? 1 : 2) + per_layer * layers + dim + freq_cis;
  const Wide need = static_cast<Wide>(sizeof(Llama2cHeader)) + num_floats * 4;
  if (static_cast<Wide>(file_size) < need) {
    const std::string need_text = need <= std::numeric_limits<int64_t>::max()
                                      ? absl::StrCat(static_cast<int64_t>(need))
                                      : std::string("more than 2^63");
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": file too short for its header: ", file_size, " bytes, but dim=", c.dim,
        " hidden_dim=", c.hidden_dim, " n_layers=", c.n_layers, " n_heads=", c.n_heads,
        " n_kv_heads=", c.n_kv_heads, " vocab_size=", h.vocab_size, " seq_len=", h.seq_len,
        " need ", need_text, " bytes"));
  }

  // The header is 28 bytes, so the floats that follow are 4-byte aligned
  // within the page-aligned mapping.
  const float* p = reinterpret_cast<const float*>(static_cast<const char*>(model.storage.get()) +
                                                  sizeof(Llama2cHeader));
  auto take = [&p](int64_t n) {
    std::span<const float> s(p, static_cast<size_t>(n));
    p += n;
    return s;
  };
  ModelWeights& w = model.weights;
  w.token_embedding = take(vocab * dim);
  // run.c stores each kind of tensor for all layers together.
  const auto rms_att = take(layers * dim);
  const auto wq = take(layers * dim * dim);
  const auto wk = take(layers * kv_dim * dim);
  const auto wv = take(layers * kv_dim * dim);
  const auto wo = take(layers * dim * dim);
  const auto rms_ffn = take(layers * dim);
  const auto w1 = take(layers * hidden * dim);
  const auto w2 = take(layers * dim * hidden);
  const auto w3 = take(layers * hidden * dim);
  w.final_norm = take(dim);
  take(freq_cis);
  w.classifier = tied ? w.token_embedding : take(vocab * dim);
  w.layers.resize(c.n_layers);
  for (int64_t l = 0; l < layers; ++l) {
    LayerWeights& lw = w.layers[l];
    lw.attn_norm = rms_att.subspan(l * dim, dim);
    lw.wq = wq.subspan(l * dim * dim, dim * dim);
    lw.wk = wk.subspan(l * kv_dim * dim, kv_dim * dim);
    lw.wv = wv.subspan(l * kv_dim * dim, kv_dim * dim);
    lw.wo = wo.subspan(l * dim * dim, dim * dim);
    lw.ffn_norm = rms_ffn.subspan(l * dim, dim);
    lw.w1 = w1.subspan(l * hidden * dim, hidden * dim);
    lw.w2 = w2.subspan(l * dim * hidden, dim * hidden);
    lw.w3 = w3.subspan(l * hidden * dim, hidden * dim);
  }
  return model;
}

}  // namespace coalesce::engine
