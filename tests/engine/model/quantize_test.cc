// Quantization at load (--quantize, engine/model/quantize.h) and the block
// quantizers under it (gguf_quant.h's QuantizeFromFloat, FloatToHalf).
// Byte-for-byte parity with PyPI's gguf is test_gguf_model_parity.py's
// (test_quantize_at_load_writes_the_blocks_gguf_writes); here, what the
// formats promise: the half conversion rounds as the processor's F16C does,
// a block dequantizes back to within half a step (a step, for Q4_0's
// clipped side), and the model keeps what it should.
#include "engine/model/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "engine/cpu/kv_quant.h"
#include "engine/model.h"
#include "engine/model/gguf_quant.h"
#include "engine/model/synthetic.h"
#include "engine/sampler.h"
#include "gtest/gtest.h"

namespace coalesce::engine {
namespace {

TEST(FloatToHalfTest, RoundsAsF16cDoes) {
  // Every float whose top 16 bits vary, with low bits around the rounding
  // point (ties included), against the processor's conversion.
  for (uint32_t high = 0; high < (1u << 16); ++high) {
    for (const uint32_t low : {0x0000u, 0x0FFFu, 0x1000u, 0x1001u, 0x2000u, 0xF000u, 0xFFFFu}) {
      const uint32_t bits = high << 16 | low;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      if (std::isnan(f)) continue;
      ASSERT_EQ(FloatToHalf(f), cpu::ToFp16(f).bits) << f << " (bits " << bits << ")";
    }
  }
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // the tie rounds to even: infinity
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(std::nanf("")) & 0x7E00, 0x7E00);
}

std::vector<float> Random(int64_t n, uint64_t seed, float scale) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = (rng.NextFloat() - 0.5f) * scale;
  return v;
}

TEST(QuantizeFromFloatTest, BlocksComeBackWithinHalfAStep) {
  const int64_t n = 32 * 64;
  for (const GgmlType type : {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1}) {
    std::vector<float> x = Random(n, 1, 3.0f);
    x[5] = 0.0f;
    std::fill(x.begin() + 64, x.begin() + 96, 0.0f);  // an all-zero block
    std::vector<uint8_t> blocks(static_cast<size_t>(*GgmlRowBytes(type, n)));
    ASSERT_TRUE(QuantizeFromFloat(type, x.data(), n, blocks.data()).ok());
    std::vector<float> back(static_cast<size_t>(n));
    ASSERT_TRUE(DequantizeToFloat(type, blocks.data(), n, back.data()).ok());
    for (int64_t b = 0; b < n / 32; ++b) {
      float lo = x[b * 32], hi = x[b * 32], amax = 0;
      for (int i = 0; i < 32; ++i) {
        lo = std::min(lo, x[b * 32 + i]);
        hi = std::max(hi, x[b * 32 + i]);
        amax = std::max(amax, std::fabs(x[b * 32 + i]));
      }
      // The step: d (Q8_0: amax / 127; Q4_0: amax / 8; Q4_1: range / 15),
      // and the f16 rounding of d (2^-11 relative) over up to 16 steps.
      const float step = type == GgmlType::kQ8_0   ? amax / 127
                         : type == GgmlType::kQ4_0 ? amax / 8
                                                   : (hi - lo) / 15;
      // Q4_0 maps the largest magnitude to -8 steps and clips the other
      // sign at +7: there an element can be a whole step off.
      const float slack = step * (type == GgmlType::kQ4_0 ? 1.0f : 0.5f) + amax * 0x1p-10f + 1e-6f;
      for (int i = 0; i < 32; ++i) {
        ASSERT_NEAR(back[b * 32 + i], x[b * 32 + i], slack)
            << GgmlTypeName(type) << " block " << b << " element " << i;
      }
    }
    EXPECT_EQ(back[64], 0.0f) << GgmlTypeName(type);  // zeros stay zeros
  }
}

TEST(QuantizeFromFloatTest, RefusesWhatItCannotQuantize) {
  std::vector<float> x(64, 1.0f);
  std::vector<uint8_t> out(1024);
  EXPECT_EQ(QuantizeFromFloat(GgmlType::kQ4_K, x.data(), 64, out.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeFromFloat(GgmlType::kQ8_0, x.data(), 48, out.data()).code(),
            absl::StatusCode::kInvalidArgument);
  x[40] = std::numeric_limits<float>::infinity();
  const absl::Status s = QuantizeFromFloat(GgmlType::kQ8_0, x.data(), 64, out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("element 40"), absl::string_view::npos) << s;
}

TEST(QuantizeModelTest, QuantizesEveryWholeBlockMatrixOnceAndKeepsTheRest) {
  auto loaded = BuildSyntheticModel("synthetic:tiny");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const auto model = std::make_shared<const Model>(*std::move(loaded));
  const ModelConfig& c = model->config;
  QuantizeReport report;
  auto q = QuantizeModel(model, QuantType::kQ4_0, &report);
  ASSERT_TRUE(q.ok()) << q.status();
  const ModelWeights& w = (*q)->weights;
  EXPECT_TRUE(HasQuantizedWeights(w));
  EXPECT_FALSE(HasQuantizedWeights(model->weights));  // the source is untouched
  for (const LayerWeights& l : w.layers) {
    EXPECT_EQ(l.quantized.wq.type, QuantType::kQ4_0);
    EXPECT_TRUE(l.wq.empty());
    EXPECT_EQ(l.attn_norm.size(), static_cast<size_t>(c.dim));  // norms stay float32
  }
  // Each quantized matrix holds the blocks of its float32 rows.
  const QuantizedMatrix& wq = w.layers[0].quantized.wq;
  std::vector<uint8_t> want(static_cast<size_t>(wq.row_bytes() * wq.rows));
  ASSERT_TRUE(QuantizeFromFloat(GgmlType::kQ4_0, model->weights.layers[0].wq.data(),
                                wq.rows * wq.cols, want.data())
                  .ok());
  EXPECT_EQ(std::memcmp(wq.data, want.data(), want.size()), 0);
  if (c.tied_classifier) {
    EXPECT_EQ(w.quantized_classifier.data, w.quantized_token_embedding.data);
  }
  const int matrices = 7 * c.n_layers + 1 + (c.tied_classifier ? 0 : 1);
  EXPECT_EQ(report.matrices + report.kept_float, matrices);
  EXPECT_GT(report.matrices, 0);
  EXPECT_LT(report.quantized_bytes, report.float_bytes / 7);
  // Quantizing again changes nothing: every matrix is already quantized.
  QuantizeReport again;
  auto twice = QuantizeModel(*q, QuantType::kQ8_0, &again);
  ASSERT_TRUE(twice.ok());
  EXPECT_EQ(again.matrices, 0);
  EXPECT_EQ((*twice)->weights.layers[0].quantized.wq.type, QuantType::kQ4_0);
}

TEST(QuantizeModelTest, ParsesTheFlag) {
  EXPECT_EQ(*ParseQuantizeFlag("none"), std::nullopt);
  EXPECT_EQ(*ParseQuantizeFlag("q8_0"), QuantType::kQ8_0);
  EXPECT_EQ(*ParseQuantizeFlag("q4_0"), QuantType::kQ4_0);
  EXPECT_EQ(ParseQuantizeFlag("Q4_K").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace coalesce::engine
