// libFuzzer target for the tokenizer.json loader and tokenizer.
// An input whose first byte is even is a tokenizer.json (up to the first NUL)
// and a text to run through it if it loads (after the NUL): loading must
// return a tokenizer or an error, never crash. An odd first byte makes the
// rest a text for real tokenizers (GPT-2, TinyLlama, and GPT-2's vocabulary
// with Qwen2's NFC normalizer and Split regex), read once from
// $COALESCE_MODELS_DIR (default: the shared models next to the repository);
// that half is skipped where the files are absent.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "engine/tokenizer/hf_tokenizer.h"
#include "engine/tokenizer/text_stream.h"

namespace {

using coalesce::engine::HfTokenizer;

// Encodes `text`, decodes the ids and streams them (and the text's bytes as
// ids) through a TextStream with stop sequences. Ids must be inside the
// vocabulary and every output valid UTF-8 (Decode's own sanitizer is then
// idempotent).
void Exercise(const HfTokenizer& tokenizer, std::string_view text) {
  using namespace coalesce::engine;
  const int vocab = tokenizer.vocab_size();
  for (const bool special : {true, false}) {
    const std::vector<int32_t> ids = tokenizer.Encode(text, special);
    for (const int32_t id : ids) {
      if (id < 0 || id >= vocab) __builtin_trap();
    }
    const std::string decoded = Decode(tokenizer, ids);
    if (SanitizeUtf8(decoded) != decoded) __builtin_trap();
    // split_special_tokens, everywhere and with special tokens kept in
    // every other stretch of 5 bytes (ranges that cut characters and tokens).
    std::vector<coalesce::ByteRange> keep;
    for (size_t at = 0; at < text.size(); at += 10) keep.push_back({at, at + 5});
    for (const auto& ranges : {std::vector<coalesce::ByteRange>{}, keep}) {
      for (const int32_t id : tokenizer.EncodeSplit(text, special, ranges)) {
        if (id < 0 || id >= vocab) __builtin_trap();
      }
    }
    if (!special || vocab == 0) continue;
    TextStream stream(tokenizer, ids.empty() ? -1 : ids.back(),
                      {" the", std::string(text.substr(0, 3))});
    std::string streamed;
    // Arbitrary ids, some outside the vocabulary, as a model may not produce
    // but a caller may pass.
    for (size_t i = 0; i < text.size(); ++i) {
      const auto b = static_cast<uint8_t>(text[i]);
      const int32_t id = b == 0xFF ? vocab : static_cast<int32_t>((b * 7919u + i) % vocab);
      const auto piece = stream.Push(id);
      streamed += piece.text;
      if (piece.stopped) break;
    }
    streamed += stream.Finish();
    if (SanitizeUtf8(streamed) != streamed) __builtin_trap();
    // Without stop sequences the stream is exactly Decode of the ids.
    const int32_t prev = ids.empty() ? -1 : ids.back();
    TextStream plain(tokenizer, prev, {});
    std::vector<int32_t> generated;
    std::string all;
    for (size_t i = 0; i < text.size(); ++i) {
      const auto b = static_cast<uint8_t>(text[i]);
      generated.push_back(b == 0xFF ? vocab : static_cast<int32_t>((b * 7919u + i) % vocab));
      all += plain.Push(generated.back()).text;
    }
    all += plain.Finish();
    if (all != Decode(tokenizer, generated, prev)) __builtin_trap();
  }
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::unique_ptr<HfTokenizer>> LoadRealTokenizers() {
  const char* env = std::getenv("COALESCE_MODELS_DIR");
  const std::string dir = env != nullptr ? env : COALESCE_DEFAULT_MODELS_DIR;
  std::vector<std::unique_ptr<HfTokenizer>> out;
  auto add = [&](std::string_view json, const std::string& source) {
    auto tok = coalesce::engine::LoadHfTokenizerFromJson(json, source);
    if (tok.ok()) out.push_back(*std::move(tok));
  };
  const std::string gpt2 = ReadFile(dir + "/gpt2-tokenizer/tokenizer.json");
  if (!gpt2.empty()) {
    add(gpt2, "gpt2");
    // Qwen2's layout on GPT-2's vocabulary.
    nlohmann::json spec = nlohmann::json::parse(gpt2, nullptr, /*allow_exceptions=*/false);
    if (spec.is_object()) {
      spec["normalizer"] = {{"type", "NFC"}};
      spec["pre_tokenizer"] = nlohmann::json::parse(R"({"type": "Sequence", "pretokenizers": [
          {"type": "Split", "behavior": "Isolated", "invert": false, "pattern": {"Regex":
           "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
          {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]})");
      add(spec.dump(), "qwen2-style");
    }
  }
  const std::string tiny = ReadFile(dir + "/tinyllama-tokenizer/tokenizer.json");
  if (!tiny.empty()) add(tiny, "tinyllama");
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    const size_t nul = rest.find('\0');
    const std::string_view json = rest.substr(0, nul);
    const std::string_view text = nul == std::string_view::npos ? "" : rest.substr(nul + 1);
    auto tokenizer = coalesce::engine::LoadHfTokenizerFromJson(json, "fuzz.json");
    if (tokenizer.ok()) Exercise(**tokenizer, text);
    return 0;
  }
  static const auto* const real = new auto(LoadRealTokenizers());
  for (const auto& tokenizer : *real) Exercise(*tokenizer, rest);
  return 0;
}
