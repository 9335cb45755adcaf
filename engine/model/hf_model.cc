#include "engine/model/hf_model.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "engine/model/json_file.h"
#include "engine/model/safetensors.h"

namespace coalesce::engine {
namespace {

using Json = nlohmann::json;

// ---------------------------------------------------------------------------
// config.json
// ---------------------------------------------------------------------------

enum class Family { kLlama, kMistral, kQwen2 };

// Reads typed fields of one JSON file; every error names the file and field.
// A field set to null counts as absent, as transformers treats it.
class Fields {
 public:
  Fields(const Json& j, std::string path) : j_(j), path_(std::move(path)) {}

  const Json* Find(const char* key) const {
    const auto it = j_.find(key);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }

  absl::StatusOr<int> Int(const char* key, std::optional<int> fallback = std::nullopt) const {
    const Json* v = Find(key);
    if (v == nullptr) {
      if (fallback) return *fallback;
      return Error(key, "is missing");
    }
    if (!v->is_number_integer() || v->get<int64_t>() <= 0 ||
        v->get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return Error(key, absl::StrCat("is ", v->dump(), ", need a positive 32-bit integer"));
    }
    return static_cast<int>(v->get<int64_t>());
  }

  absl::StatusOr<double> Number(const char* key, double fallback) const {
    const Json* v = Find(key);
    if (v == nullptr) return fallback;
    if (!v->is_number() || !std::isfinite(v->get<double>())) {
      return Error(key, absl::StrCat("is ", v->dump(), ", need a finite number"));
    }
    return v->get<double>();
  }

  absl::StatusOr<bool> Bool(const char* key, bool fallback) const {
    const Json* v = Find(key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) return Error(key, absl::StrCat("is ", v->dump(), ", need true or false"));
    return v->get<bool>();
  }

  absl::StatusOr<std::string> String(const char* key, const std::string& fallback) const {
    const Json* v = Find(key);
    if (v == nullptr) return fallback;
    if (!v->is_string()) return Error(key, absl::StrCat("is ", v->dump(), ", need a string"));
    return v->get<std::string>();
  }

  // A token id or a list of them (eos_token_id may be either).
  absl::StatusOr<std::optional<std::vector<int32_t>>> TokenIds(const char* key) const {
    const Json* v = Find(key);
    if (v == nullptr) return std::optional<std::vector<int32_t>>();
    std::vector<int32_t> ids;
    const Json list = v->is_array() ? *v : Json::array({*v});
    for (const Json& id : list) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
        return Error(key, absl::StrCat("is ", v->dump(), ", need a token id or a list of them"));
      }
      ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
    return std::optional<std::vector<int32_t>>(std::move(ids));
  }

  absl::Status Error(const char* key, const std::string& problem) const {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": ", key, " ", problem));
  }
  const std::string& path() const { return path_; }

 private:
  const Json& j_;
  const std::string path_;
};

// config.json and generation_config.json are objects.
absl::StatusOr<Json> ReadJsonObject(const std::string& path) {
  ASSIGN_OR_RETURN(Json j, ReadJsonFile(path));
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  return j;
}

absl::StatusOr<Family> ParseFamily(const Fields& f) {
  const Json* archs = f.Find("architectures");
  if (archs == nullptr) return f.Error("architectures", "is missing");
  if (!archs->is_array() || archs->size() != 1 || !(*archs)[0].is_string()) {
    return f.Error("architectures",
                   absl::StrCat("is ", archs->dump(), ", need a list of one architecture"));
  }
  const std::string arch = (*archs)[0].get<std::string>();
  if (arch == "LlamaForCausalLM") return Family::kLlama;
  if (arch == "MistralForCausalLM") return Family::kMistral;
  if (arch == "Qwen2ForCausalLM") return Family::kQwen2;
  return absl::InvalidArgumentError(
      absl::StrCat(f.path(), ": architecture ", arch,
                   " is not supported (supported: LlamaForCausalLM, MistralForCausalLM, "
                   "Qwen2ForCausalLM)"));
}

absl::StatusOr<RopeScaling> ParseRopeScaling(const Fields& f, Family family) {
  RopeScaling scaling;
  const Json* v = f.Find("rope_scaling");
  if (v == nullptr) return scaling;
  if (!v->is_object()) return f.Error("rope_scaling", "is not an object or null");
  const Fields s(*v, f.path());
  ASSIGN_OR_RETURN(std::string type, s.String("rope_type", ""));
  if (type.empty()) {
    ASSIGN_OR_RETURN(type, s.String("type", "default"));
  }
  if (type == "default") return scaling;
  // transformers 4.47's Mistral ignores rope_scaling altogether; refusing it
  // is safer than guessing which of the two the checkpoint's author meant.
  if (type != "llama3" || family == Family::kMistral) {
    return f.Error(
        "rope_scaling",
        absl::StrCat("type \"", type, "\" is not supported",
                     family == Family::kMistral ? " for Mistral"
                                                : " (supported: null, \"default\", \"llama3\")"));
  }
  scaling.type = RopeScaling::Type::kLlama3;
  ASSIGN_OR_RETURN(const double factor, s.Number("factor", 0));
  ASSIGN_OR_RETURN(const double low, s.Number("low_freq_factor", 0));
  ASSIGN_OR_RETURN(const double high, s.Number("high_freq_factor", 0));
  ASSIGN_OR_RETURN(scaling.original_max_position_embeddings,
                   s.Int("original_max_position_embeddings"));
  // The formula divides by factor and by high - low.
  if (!(factor > 0) || !(low > 0) || !(high > low)) {
    return f.Error("rope_scaling",
                   absl::StrCat("needs factor > 0 and high_freq_factor > low_freq_factor > 0 "
                                "for llama3, got ",
                                v->dump()));
  }
  scaling.factor = static_cast<float>(factor);
  scaling.low_freq_factor = static_cast<float>(low);
  scaling.high_freq_factor = static_cast<float>(high);
  return scaling;
}

absl::StatusOr<ModelConfig> ParseConfig(const std::string& dir, const Json& j) {
  namespace fs = std::filesystem;
  const Fields f(j, (fs::path(dir) / "config.json").string());
  ASSIGN_OR_RETURN(const Family family, ParseFamily(f));
  ModelConfig c;
  const fs::path normal = fs::path(dir).lexically_normal();
  c.name = (normal.has_filename() ? normal : normal.parent_path()).filename().string();
  c.architecture = family == Family::kLlama     ? "llama"
                   : family == Family::kMistral ? "mistral"
                                                : "qwen2";
  c.source = dir;
  ASSIGN_OR_RETURN(c.dim, f.Int("hidden_size"));
  ASSIGN_OR_RETURN(c.hidden_dim, f.Int("intermediate_size"));
  ASSIGN_OR_RETURN(c.n_layers, f.Int("num_hidden_layers"));
  ASSIGN_OR_RETURN(c.n_heads, f.Int("num_attention_heads"));
  ASSIGN_OR_RETURN(c.n_kv_heads, f.Int("num_key_value_heads", c.n_heads));
  ASSIGN_OR_RETURN(c.vocab_size, f.Int("vocab_size"));
  ASSIGN_OR_RETURN(c.max_seq_len, f.Int("max_position_embeddings"));
  if (c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0 || (c.dim / c.n_heads) % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        f.path(), ": hidden_size (", c.dim, ") must be a multiple of num_attention_heads (",
        c.n_heads, ") with an even quotient, and num_attention_heads a multiple of ",
        "num_key_value_heads (", c.n_kv_heads, ")"));
  }
  ASSIGN_OR_RETURN(const int head_dim, f.Int("head_dim", c.head_dim()));
  if (head_dim != c.head_dim()) {
    return f.Error("head_dim",
                   absl::StrCat("is ", head_dim, " but hidden_size / num_attention_heads is ",
                                c.head_dim(), ": a separate head_dim is not supported"));
  }
  // transformers' defaults for these three families.
  ASSIGN_OR_RETURN(const double eps, f.Number("rms_norm_eps", 1e-6));
  ASSIGN_OR_RETURN(const double theta, f.Number("rope_theta", 10000.0));
  if (!(eps > 0) || !(theta > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.path(), ": rms_norm_eps and rope_theta must be positive"));
  }
  c.norm_eps = static_cast<float>(eps);
  c.rope_theta = static_cast<float>(theta);
  ASSIGN_OR_RETURN(c.rope_scaling, ParseRopeScaling(f, family));
  ASSIGN_OR_RETURN(c.tied_classifier, f.Bool("tie_word_embeddings", false));
  ASSIGN_OR_RETURN(const std::string act, f.String("hidden_act", "silu"));
  if (act != "silu") return f.Error("hidden_act", absl::StrCat("\"", act, "\" is not silu"));
  ASSIGN_OR_RETURN(const bool mlp_bias, f.Bool("mlp_bias", false));
  if (mlp_bias) return f.Error("mlp_bias", "is true: MLP biases are not supported");

  // Biases: Llama's attention_bias covers q, k, v and o; Qwen2 always has
  // q/k/v biases and none on o; Mistral has none (its attention ignores
  // attention_bias).
  if (family == Family::kLlama) {
    ASSIGN_OR_RETURN(const bool bias, f.Bool("attention_bias", false));
    c.qkv_bias = c.o_bias = bias;
  } else if (family == Family::kQwen2) {
    c.qkv_bias = true;
  }

  // Sliding window: see hf_model.h. Mistral applies it whenever it is set;
  // Qwen2 only with use_sliding_window.
  if (family != Family::kLlama) {
    ASSIGN_OR_RETURN(const bool use, f.Bool("use_sliding_window", family == Family::kMistral));
    if (use && f.Find("sliding_window") != nullptr) {
      ASSIGN_OR_RETURN(const int window, f.Int("sliding_window"));
      c.max_seq_len = std::min(c.max_seq_len, window);
    }
  }

  // Special tokens: generation_config.json wins, as in transformers'
  // generate().
  ASSIGN_OR_RETURN(auto bos, f.TokenIds("bos_token_id"));
  ASSIGN_OR_RETURN(auto eos, f.TokenIds("eos_token_id"));
  const std::string gen_path = (fs::path(dir) / "generation_config.json").string();
  std::error_code ec;
  if (fs::exists(gen_path, ec)) {
    ASSIGN_OR_RETURN(const Json gen_json, ReadJsonObject(gen_path));
    const Fields gen(gen_json, gen_path);
    ASSIGN_OR_RETURN(auto gen_bos, gen.TokenIds("bos_token_id"));
    ASSIGN_OR_RETURN(auto gen_eos, gen.TokenIds("eos_token_id"));
    if (gen_bos) bos = std::move(gen_bos);
    if (gen_eos) eos = std::move(gen_eos);
  }
  if (bos && !bos->empty()) c.bos_token_id = bos->front();
  if (eos) c.eos_token_ids = *std::move(eos);
  return c;
}

// ---------------------------------------------------------------------------
// Tensors
// ---------------------------------------------------------------------------

// What a Model's spans point into: the mappings of files whose F32 tensors
// are used in place, and the float32 copies of everything else.
struct HfStorage {
  std::vector<std::shared_ptr<const void>> mappings;
  std::vector<std::unique_ptr<float[]>> buffers;
};

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | mantissa << 13);
  if (exponent != 0) return std::bit_cast<float>(sign | (exponent + 112) << 23 | mantissa << 13);
  // Zero or subnormal: mantissa * 2^-24, exact in float.
  const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  return sign != 0 ? -magnitude : magnitude;
}

std::string ShapeString(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Hands out each tensor as float32 and remembers which it handed out, so the
// ones left over can be reported.
class TensorPlacer {
 public:
  TensorPlacer(const SafetensorsCheckpoint& checkpoint, HfStorage& storage,
               const HfLoadOptions& options)
      : checkpoint_(checkpoint), storage_(storage), options_(options) {
    for (const auto& [name, tensor] : checkpoint.tensors()) total_bytes_ += tensor->num_bytes;
  }

  // The tensor `name`, which must have `shape`. With `rope_heads` > 0 its rows
  // are [rope_heads, head_dim] in rotate-half order (row h*head_dim + a*half
  // + i holds component a of pair i) and come back interleaved (row
  // h*head_dim + 2i + a): the inverse of llama2.c export.py's permute().
  absl::StatusOr<std::span<const float>> Take(const std::string& name, std::vector<int64_t> shape,
                                              int rope_heads = 0) {
    const SafetensorsTensor* t = checkpoint_.Find(name);
    if (t == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(checkpoint_.source(), ": missing tensor ", name));
    }
    if (t->shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat(*t->file, ": tensor ", name, " has shape ",
                                                     ShapeString(t->shape),
                                                     ", config.json implies ", ShapeString(shape)));
    }
    taken_.insert(name);
    const size_t n = static_cast<size_t>(t->num_elements());
    std::span<const float> out;
    if (t->dtype == SafetensorsDtype::kF32 && rope_heads == 0 &&
        reinterpret_cast<uintptr_t>(t->data) % alignof(float) == 0) {
      out = {reinterpret_cast<const float*>(t->data), n};
      in_place_files_.insert(t->file);
    } else {
      float* dst = new float[n];  // uninitialised: every element is written below
      storage_.buffers.emplace_back(dst);
      const int64_t rows = shape[0], cols = n / std::max<int64_t>(rows, 1);
      const int64_t head_dim = rope_heads > 0 ? rows / rope_heads : 1, half = head_dim / 2;
      for (int64_t r = 0; r < rows; ++r) {
        // Destination row r = h*head_dim + 2i + a reads source row
        // h*head_dim + a*half + i.
        const int64_t within = r % head_dim;
        const int64_t src_row = rope_heads > 0 ? r - within + (within % 2) * half + within / 2 : r;
        Convert(*t, src_row * cols, cols, dst + r * cols);
      }
      out = {dst, n};
    }
    done_bytes_ += t->num_bytes;
    if (options_.progress) options_.progress(done_bytes_, total_bytes_);
    return out;
  }

  const std::set<std::string>& taken() const { return taken_; }
  // The mapping of every file with a tensor used in place.
  void KeepMappings() {
    for (const auto& file : checkpoint_.files()) {
      if (in_place_files_.contains(&file->path())) storage_.mappings.push_back(file->mapping());
    }
  }

 private:
  // count elements of `t` from element `first`, as float32, into dst.
  static void Convert(const SafetensorsTensor& t, int64_t first, int64_t count, float* dst) {
    const std::byte* src = t.data + first * DtypeSize(t.dtype);
    switch (t.dtype) {
      case SafetensorsDtype::kF32:
        std::memcpy(dst, src, count * sizeof(float));
        break;
      case SafetensorsDtype::kF16:
      case SafetensorsDtype::kBF16:
        for (int64_t i = 0; i < count; ++i) {
          uint16_t bits;  // the mapping need not be 2-byte aligned for us
          std::memcpy(&bits, src + 2 * i, 2);
          dst[i] = t.dtype == SafetensorsDtype::kBF16
                       ? std::bit_cast<float>(static_cast<uint32_t>(bits) << 16)
                       : HalfToFloat(bits);
        }
        break;
    }
  }

  const SafetensorsCheckpoint& checkpoint_;
  HfStorage& storage_;
  const HfLoadOptions& options_;
  std::set<std::string> taken_;
  std::set<const std::string*> in_place_files_;
  int64_t done_bytes_ = 0, total_bytes_ = 0;
};

absl::Status LoadWeights(const ModelConfig& c, const SafetensorsCheckpoint& checkpoint,
                         TensorPlacer& placer, ModelWeights& w) {
  const int64_t d = c.dim, h = c.hidden_dim, kv = c.kv_dim(), v = c.vocab_size;
  ASSIGN_OR_RETURN(w.token_embedding, placer.Take("model.embed_tokens.weight", {v, d}));
  ASSIGN_OR_RETURN(w.final_norm, placer.Take("model.norm.weight", {d}));
  if (c.tied_classifier) {
    w.classifier = w.token_embedding;
  } else {
    ASSIGN_OR_RETURN(w.classifier, placer.Take("lm_head.weight", {v, d}));
  }
  // Layers are added as their tensors are found rather than all at once: a
  // config.json may claim two billion layers, and only the checkpoint can
  // show it wrong.
  w.layers.clear();
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    LayerWeights& lw = w.layers.emplace_back();
    ASSIGN_OR_RETURN(lw.attn_norm, placer.Take(p + "input_layernorm.weight", {d}));
    ASSIGN_OR_RETURN(lw.wq, placer.Take(p + "self_attn.q_proj.weight", {d, d}, c.n_heads));
    ASSIGN_OR_RETURN(lw.wk, placer.Take(p + "self_attn.k_proj.weight", {kv, d}, c.n_kv_heads));
    ASSIGN_OR_RETURN(lw.wv, placer.Take(p + "self_attn.v_proj.weight", {kv, d}));
    ASSIGN_OR_RETURN(lw.wo, placer.Take(p + "self_attn.o_proj.weight", {d, d}));
    if (c.qkv_bias) {
      ASSIGN_OR_RETURN(lw.bq, placer.Take(p + "self_attn.q_proj.bias", {d}, c.n_heads));
      ASSIGN_OR_RETURN(lw.bk, placer.Take(p + "self_attn.k_proj.bias", {kv}, c.n_kv_heads));
      ASSIGN_OR_RETURN(lw.bv, placer.Take(p + "self_attn.v_proj.bias", {kv}));
    }
    if (c.o_bias) {
      ASSIGN_OR_RETURN(lw.bo, placer.Take(p + "self_attn.o_proj.bias", {d}));
    }
    ASSIGN_OR_RETURN(lw.ffn_norm, placer.Take(p + "post_attention_layernorm.weight", {d}));
    ASSIGN_OR_RETURN(lw.w1, placer.Take(p + "mlp.gate_proj.weight", {h, d}));
    ASSIGN_OR_RETURN(lw.w3, placer.Take(p + "mlp.up_proj.weight", {h, d}));
    ASSIGN_OR_RETURN(lw.w2, placer.Take(p + "mlp.down_proj.weight", {d, h}));
  }

  // Whatever is left must be derivable or a duplicate, or the config and the
  // weights disagree about the model (a bias the config does not enable, a
  // layer beyond num_hidden_layers, ...).
  for (const auto& [name, tensor] : checkpoint.tensors()) {
    if (placer.taken().contains(name)) continue;
    // Older checkpoints saved RoPE's inverse frequencies; we derive them.
    if (name.ends_with(".rotary_emb.inv_freq")) continue;
    // A tied checkpoint may also store the classifier; fine if it is the
    // embedding, byte for byte.
    if (name == "lm_head.weight" && c.tied_classifier) {
      const SafetensorsTensor* e = checkpoint.Find("model.embed_tokens.weight");
      if (tensor->dtype == e->dtype && tensor->shape == e->shape &&
          std::memcmp(tensor->data, e->data, e->num_bytes) == 0) {
        continue;
      }
      return absl::InvalidArgumentError(
          absl::StrCat(*tensor->file, ": tensor lm_head.weight differs from ",
                       "model.embed_tokens.weight, but config.json has tie_word_embeddings true"));
    }
    return absl::InvalidArgumentError(absl::StrCat(*tensor->file, ": unexpected tensor ", name,
                                                   " (not part of the ", c.architecture,
                                                   " model config.json describes)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Model> Load(const std::string& dir, const HfLoadOptions& options) {
  const std::string config_path = (std::filesystem::path(dir) / "config.json").string();
  ASSIGN_OR_RETURN(const Json config_json, ReadJsonObject(config_path));
  Model model;
  ASSIGN_OR_RETURN(model.config, ParseConfig(dir, config_json));
  ASSIGN_OR_RETURN(const SafetensorsCheckpoint checkpoint, SafetensorsCheckpoint::Open(dir));
  auto storage = std::make_shared<HfStorage>();
  TensorPlacer placer(checkpoint, *storage, options);
  RETURN_IF_ERROR(LoadWeights(model.config, checkpoint, placer, model.weights));
  placer.KeepMappings();  // the others unmap when `checkpoint` goes
  model.storage = std::move(storage);
  return model;
}

}  // namespace

absl::StatusOr<Model> LoadHfModel(const std::string& dir, const HfLoadOptions& options) {
  // Every JSON access above checks types first, so nothing should throw; this
  // is the boundary that guarantees it (and catches bad_alloc from a huge
  // model) all the same.
  try {
    return Load(dir, options);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(dir, ": loading failed: ", e.what()));
  }
}

}  // namespace coalesce::engine
