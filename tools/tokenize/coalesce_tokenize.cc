// coalesce-tokenize: runs coalesce's tokenizer.json tokenizer, or the
// tokenizer a GGUF file's metadata describes (engine/model/gguf_vocab.h), over
// a file of inputs, for tests/engine/tokenizer/test_tokenizer_parity.py and
// test_gguf_tokenizer_parity.py to compare with HF `tokenizers` and
// transformers.
//
//   coalesce-tokenize --tokenizer tokenizer.json [--input in.jsonl] [--output out.jsonl]
//                     [--strict_merges] [--decode_normalized_added_tokens]
//   coalesce-tokenize --gguf model.gguf [--input in.jsonl] [--output out.jsonl]
//
// (--strict_merges and --decode_normalized_added_tokens only apply to
// tokenizer.json files.)
// Each input line is one JSON value, and gives one output line:
//   "text"                 -> {"with": [ids], "without": [ids],
//                              "decoded": Decode(with), "decoded_without": Decode(without),
//                              "split": [ids], "split_without": [ids]}
//                             (encode with and without special tokens; "split" and
//                             "split_without" as transformers' split_special_tokens=True)
//   {"text": "...", "special_ranges": [[begin, end], ...]}
//                          -> {"split_without": [ids]}: EncodeSplit without special
//                             tokens, those written inside the byte ranges kept
//   {"hex": "e4b8ff"}      -> the same for raw bytes, which may be invalid UTF-8
//   {"ids": [1, 2, 3]}     -> {"decoded": Decode(ids), "streamed": [pieces]}
//   {"ids": [...], "prev": 5}  the same with the ids following token 5
// Decode is engine::Decode (Tokenizer::DecodeRun: the concatenation of
// TokenBytes, or the whole decoder chain where it is not per token);
// "streamed" is what a TextStream (no stop sequences) gives for each id
// pushed in turn, then Finish. A first line {"load_notes": [...],
// "decodes_per_token": bool, "vocab_size": n, "bos_id": id, "eos_ids": [...]}
// lists what repair_merges changed, whether the decoder is per token, and the
// tokenizer's sizes and ids. Errors go to stderr with exit status 1 (2 for
// bad usage).
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "engine/model/gguf_vocab.h"
#include "engine/tokenizer/hf_tokenizer.h"
#include "engine/tokenizer/text_stream.h"

namespace coalesce::engine {
namespace {

using Json = nlohmann::json;

struct Options {
  std::string tokenizer, gguf, input, output;
  bool strict_merges = false;
  bool decode_normalized_added_tokens = false;  // HfTokenizerOptions
};

bool ParseArgs(int argc, char** argv, Options& options) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](std::string& out) {
      if (i + 1 >= argc) return false;
      out = argv[++i];
      return true;
    };
    if (arg == "--tokenizer") {
      if (!value(options.tokenizer)) return false;
    } else if (arg == "--gguf") {
      if (!value(options.gguf)) return false;
    } else if (arg == "--input") {
      if (!value(options.input)) return false;
    } else if (arg == "--output") {
      if (!value(options.output)) return false;
    } else if (arg == "--strict_merges") {
      options.strict_merges = true;
    } else if (arg == "--decode_normalized_added_tokens") {
      options.decode_normalized_added_tokens = true;
    } else {
      return false;
    }
  }
  // Exactly one tokenizer.
  return options.tokenizer.empty() != options.gguf.empty();
}

bool FromHex(const std::string& hex, std::string& out) {
  if (hex.size() % 2 != 0) return false;
  auto digit = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = digit(hex[i]), lo = digit(hex[i + 1]);
    if (hi < 0 || lo < 0) return false;
    out.push_back(static_cast<char>(hi * 16 + lo));
  }
  return true;
}

int Run(const Options& options) {
  HfTokenizerOptions load;
  load.repair_merges = !options.strict_merges;
  load.decode_normalized_added_tokens = options.decode_normalized_added_tokens;
  auto tokenizer = options.gguf.empty() ? LoadHfTokenizer(options.tokenizer, load)
                                        : LoadGgufTokenizer(options.gguf);
  if (!tokenizer.ok()) {
    std::cerr << "coalesce-tokenize: " << tokenizer.status().message() << "\n";
    return 1;
  }
  const HfTokenizer& tok = **tokenizer;

  std::ifstream file;
  if (!options.input.empty()) {
    file.open(options.input, std::ios::binary);
    if (!file) {
      std::cerr << "coalesce-tokenize: cannot open " << options.input << "\n";
      return 1;
    }
  }
  std::istream& in = options.input.empty() ? std::cin : file;
  std::ofstream out_file;
  if (!options.output.empty()) {
    out_file.open(options.output, std::ios::binary);
    if (!out_file) {
      std::cerr << "coalesce-tokenize: cannot write " << options.output << "\n";
      return 1;
    }
  }
  std::ostream& out = options.output.empty() ? std::cout : out_file;

  const std::span<const int32_t> eos = tok.eos_ids();
  out << Json{{"load_notes", tok.load_notes()},
              {"decodes_per_token", tok.DecodesPerToken()},
              {"vocab_size", tok.vocab_size()},
              {"bos_id", tok.bos_id()},
              {"eos_ids", std::vector<int32_t>(eos.begin(), eos.end())}}
             .dump()
      << "\n";
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    const Json input = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    std::string text;
    bool is_text = false;
    Json result;
    if (input.is_string()) {
      text = input.get<std::string>();
      is_text = true;
    } else if (input.is_object() && input.contains("hex") && input["hex"].is_string()) {
      if (!FromHex(input["hex"].get<std::string>(), text)) {
        std::cerr << "coalesce-tokenize: line " << line_no << ": bad hex\n";
        return 1;
      }
      is_text = true;
    } else if (input.is_object() && input.contains("text") && input["text"].is_string() &&
               input.contains("special_ranges") && input["special_ranges"].is_array()) {
      std::vector<ByteRange> ranges;
      for (const Json& r : input["special_ranges"]) {
        if (!r.is_array() || r.size() != 2 || !r[0].is_number_unsigned() ||
            !r[1].is_number_unsigned()) {
          std::cerr << "coalesce-tokenize: line " << line_no << ": bad special_ranges\n";
          return 1;
        }
        ranges.push_back({r[0].get<size_t>(), r[1].get<size_t>()});
      }
      result["split_without"] =
          tok.EncodeSplit(input["text"].get<std::string>(), /*add_special_tokens=*/false, ranges);
    } else if (input.is_object() && input.contains("ids") && input["ids"].is_array()) {
      std::vector<int32_t> ids;
      for (const Json& id : input["ids"]) {
        if (!id.is_number_integer()) {
          std::cerr << "coalesce-tokenize: line " << line_no << ": ids must be integers\n";
          return 1;
        }
        ids.push_back(id.get<int32_t>());
      }
      int32_t prev = -1;
      if (input.contains("prev")) {
        if (!input["prev"].is_number_integer()) {
          std::cerr << "coalesce-tokenize: line " << line_no << ": prev must be an integer\n";
          return 1;
        }
        prev = input["prev"].get<int32_t>();
      }
      result["decoded"] = Decode(tok, ids, prev);
      TextStream stream(tok, prev, {});
      Json pieces = Json::array();
      for (const int32_t id : ids) pieces.push_back(stream.Push(id).text);
      pieces.push_back(stream.Finish());
      result["streamed"] = std::move(pieces);
    } else {
      std::cerr << "coalesce-tokenize: line " << line_no
                << ": expected a string, {\"hex\": ...}, {\"text\": ..., \"special_ranges\": "
                   "[...]} or {\"ids\": [...]}\n";
      return 1;
    }
    if (is_text) {
      const std::vector<int32_t> with = tok.Encode(text, /*add_special_tokens=*/true);
      const std::vector<int32_t> without = tok.Encode(text, /*add_special_tokens=*/false);
      result["with"] = with;
      result["without"] = without;
      result["decoded"] = Decode(tok, with);
      result["decoded_without"] = Decode(tok, without);
      result["split"] = tok.EncodeSplit(text, /*add_special_tokens=*/true);
      result["split_without"] = tok.EncodeSplit(text, /*add_special_tokens=*/false);
    }
    // Decode returns valid UTF-8, so dump cannot fail.
    out << result.dump() << "\n";
  }
  out.flush();
  if (!out) {
    std::cerr << "coalesce-tokenize: write failed\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace coalesce::engine

int main(int argc, char** argv) {
  coalesce::engine::Options options;
  if (!coalesce::engine::ParseArgs(argc, argv, options)) {
    std::fprintf(stderr,
                 "usage: coalesce-tokenize --tokenizer tokenizer.json [--input in.jsonl] "
                 "[--output out.jsonl] [--strict_merges] [--decode_normalized_added_tokens]\n"
                 "       coalesce-tokenize --gguf model.gguf [--input in.jsonl] "
                 "[--output out.jsonl]\n");
    return 2;
  }
  return coalesce::engine::Run(options);
}
