// A Llama-architecture decoder: its shape (ModelConfig) and its float32
// weights (ModelWeights). Loaders (llama2c.h, synthetic.h, hf_model.h) produce
// a Model; backends read it. Every matrix is row-major [out][in], as llama2.c
// and Hugging Face both store it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace coalesce::engine {

// Rotary-embedding frequency scaling. kNone is plain RoPE,
// inv_freq[i] = 1 / theta^(2i / head_dim). kLlama3 is Llama 3.1's long-context
// rescaling (transformers' _compute_llama3_parameters): wavelengths longer
// than original_max_position_embeddings / low_freq_factor are divided by
// `factor`, those shorter than original_max_position_embeddings /
// high_freq_factor are kept, and the ones between are interpolated smoothly.
//
// freq_factors, whatever the type, divides each pair's inverse frequency by
// its own factor, after the type's scaling: inv_freq[i] /= freq_factors[i].
// It is what llama.cpp's GGUF files carry for Llama 3.1 instead of the
// formula above (the rope_freqs.weight tensor, ggml's "freq_factors"). Empty
// (the default) or head_dim / 2 positive factors; loaders check that.
struct RopeScaling {
  enum class Type { kNone, kLlama3 };
  Type type = Type::kNone;
  float factor = 1.0f;
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  int original_max_position_embeddings = 0;
  std::vector<float> freq_factors = {};  // [head_dim / 2], or empty
};

struct ModelConfig {
  std::string name;                    // "stories260K", "synthetic:15m", ...
  std::string architecture = "llama";  // what GetModelInfo reports
  std::string source;                  // path it was loaded from, or "embedded"
  bool synthetic = false;              // random weights: output is not language
  int dim = 0;                         // model width (hidden size)
  int hidden_dim = 0;                  // SwiGLU inner width
  int n_layers = 0;
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;  // key/value heads (GQA when < n_heads)
  int vocab_size = 0;
  int max_seq_len = 0;  // context length in tokens
  float rope_theta = 10000.0f;
  RopeScaling rope_scaling;      // none unless the checkpoint asks for it
  float norm_eps = 1e-5f;        // RMSNorm epsilon
  bool tied_classifier = false;  // the classifier is the token embedding
  bool qkv_bias = false;         // q/k/v projections add a bias (Qwen2, Llama attention_bias)
  bool o_bias = false;           // the output projection adds one (Llama attention_bias)
  // Special tokens the checkpoint declares (Hugging Face generation_config.json
  // or config.json); empty / -1 when it declares none and the tokenizer knows.
  int32_t bos_token_id = -1;
  std::vector<int32_t> eos_token_ids;

  int head_dim() const { return dim / n_heads; }
  int kv_dim() const { return n_kv_heads * head_dim(); }
  // Number of parameters, counting a tied classifier once.
  int64_t num_parameters() const;
};

// The rotary inverse frequency of each pair of a head, with config.rope_scaling
// applied: [head_dim / 2]. Every backend builds its RoPE tables from this, so
// they agree to the bit. Pair i of a head rotates by angle pos * inv_freq[i].
std::vector<float> RopeInverseFrequencies(const ModelConfig& config);

// The block types in which a weight matrix may stay as a quantized file
// stores it, for a backend that computes with them directly (the CPU
// backend: engine/cpu/quant_matmul.h). Each is ggml's block layout, byte for
// byte (engine/model/gguf_quant.h describes them): `QuantBlockSize(type)`
// consecutive elements of a row in `QuantBlockBytes(type)` bytes.
//   Q8_0  32 elements: d (f16), 32 int8 q;             w = q * d
//   Q4_0  32 elements: d (f16), 16 bytes of nibbles;   w = d * (q - 8)
//   Q4_1  32 elements: d, m (f16), 16 bytes;           w = d * q + m
//   Q4_K  256 elements: d, dmin (f16), 12 bytes of 6-bit scales and mins of
//         8 sub-blocks, 128 bytes of nibbles;        w = (d * sc) * q - dmin * mn
//   Q6_K  256 elements: 128 bytes of low nibbles, 64 of high 2-bit parts, 16
//         int8 scales, d (f16);                       w = (d * sc) * (q - 32)
enum class QuantType { kQ8_0, kQ4_0, kQ4_1, kQ4_K, kQ6_K };

// "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K".
const char* QuantTypeName(QuantType type);
int QuantBlockSize(QuantType type);   // 32 or 256
int QuantBlockBytes(QuantType type);  // 34, 18, 20, 144, 210

// A [rows][cols] matrix in a quantized type: row r's cols / block size
// blocks at data + r * row_bytes(). cols is a multiple of the block size.
struct QuantizedMatrix {
  QuantType type = QuantType::kQ8_0;
  int64_t rows = 0;
  int64_t cols = 0;
  const uint8_t* data = nullptr;

  bool empty() const { return data == nullptr; }
  int64_t row_bytes() const { return cols / QuantBlockSize(type) * QuantBlockBytes(type); }
};

// Views into one layer's weights. Rotary embeddings rotate interleaved pairs
// (x[2i], x[2i+1]) of each head, as llama2.c does; loaders of other layouts
// permute wq/wk rows into this one.
struct LayerWeights {
  std::span<const float> attn_norm;  // [dim]
  std::span<const float> wq;         // [n_heads * head_dim, dim]
  std::span<const float> wk;         // [kv_dim, dim]
  std::span<const float> wv;         // [kv_dim, dim]
  std::span<const float> wo;         // [dim, n_heads * head_dim]
  std::span<const float> ffn_norm;   // [dim]
  std::span<const float> w1;         // [hidden_dim, dim]  gate
  std::span<const float> w2;         // [dim, hidden_dim]  down
  std::span<const float> w3;         // [hidden_dim, dim]  up
  // Biases, empty unless config.qkv_bias / config.o_bias. bq and bk are in the
  // same interleaved order as the rows of wq and wk. (The `= {}` keeps
  // positional initialisers written before biases existed, as in
  // synthetic.cc, free of -Wmissing-field-initializers.)
  std::span<const float> bq = {};  // [n_heads * head_dim]
  std::span<const float> bk = {};  // [kv_dim]
  std::span<const float> bv = {};  // [kv_dim]
  std::span<const float> bo = {};  // [dim]
  // A quantized file's matrices kept in their block types (ModelSpec::
  // keep_quantized; only backends that say they take them get such a
  // model). A matrix held here has an empty float span above.
  struct Quantized {
    QuantizedMatrix wq, wk, wv, wo, w1, w2, w3;
  };
  Quantized quantized = {};
};

struct ModelWeights {
  std::span<const float> token_embedding;  // [vocab_size, dim]
  std::vector<LayerWeights> layers;        // [n_layers]
  std::span<const float> final_norm;       // [dim]
  std::span<const float> classifier;       // [vocab_size, dim] (may alias token_embedding)
  // As LayerWeights::quantized: the embedding and the classifier (the same
  // matrix when tied) kept quantized, their float spans then empty.
  QuantizedMatrix quantized_token_embedding = {};
  QuantizedMatrix quantized_classifier = {};
};

// Whether any matrix of `weights` is held quantized.
bool HasQuantizedWeights(const ModelWeights& weights);

// A loaded model. The spans in `weights` point into `storage`, which the Model
// owns (a heap buffer or a memory mapping), so a Model is movable but the
// spans stay valid for its lifetime.
struct Model {
  ModelConfig config;
  ModelWeights weights;
  std::shared_ptr<const void> storage;
};

}  // namespace coalesce::engine
