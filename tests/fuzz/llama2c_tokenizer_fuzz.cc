// libFuzzer target: arbitrary bytes as a llama2.c tokenizer.bin (first half)
// and as text to encode and ids to decode and stream (second half).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "engine/model/synthetic.h"
#include "engine/tokenizer/llama2c_tokenizer.h"
#include "engine/tokenizer/text_stream.h"

namespace {

// Encodes and decodes `text` and streams its bytes as ids through a
// TextStream with a stop sequence; the outputs must be valid UTF-8 (checked
// by Decode's own sanitizer being idempotent).
void Exercise(const coalesce::engine::Tokenizer& tokenizer, std::string_view text) {
  using namespace coalesce::engine;
  const auto ids = tokenizer.Encode(text, /*add_special_tokens=*/true);
  const std::string decoded = Decode(tokenizer, ids);
  if (SanitizeUtf8(decoded) != decoded) __builtin_trap();
  TextStream stream(tokenizer, ids.empty() ? -1 : ids.back(),
                    {"ab", std::string(text.substr(0, 3))});
  std::string streamed;
  for (unsigned char c : text) {
    const auto piece = stream.Push(static_cast<int32_t>(c) % tokenizer.vocab_size());
    streamed += piece.text;
    if (piece.stopped) break;
  }
  streamed += stream.Finish();
  if (SanitizeUtf8(streamed) != streamed) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto synthetic = coalesce::engine::BuildSyntheticTokenizer(512);
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const std::string_view file = bytes.substr(0, size / 2);
  const std::string_view text = bytes.substr(size / 2);
  Exercise(*synthetic, text);

  static const std::string path = "/dev/shm/coalesce-fuzz-tok-" + std::to_string(getpid());
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return 0;
  std::fwrite(file.data(), 1, file.size(), f);
  std::fclose(f);
  auto tokenizer = coalesce::engine::LoadLlama2cTokenizer(path, 300);
  if (tokenizer.ok()) Exercise(**tokenizer, text);
  return 0;
}
