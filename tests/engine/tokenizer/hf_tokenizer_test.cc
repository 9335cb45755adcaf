// LoadHfTokenizer on the shared tokenizer.json files: the stories260K goldens,
// llama.cpp's vocab test vectors, streaming, and the errors for missing,
// malformed and unsupported files. tests/engine/tokenizer/test_tokenizer_parity.py
// compares thousands more strings with HF `tokenizers` itself.
#include "engine/tokenizer/hf_tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "engine/tokenizer/text_stream.h"
#include "tests/engine/tokenizer/llamacpp_vocab_cases.h"

namespace coalesce::engine {
namespace {

using Json = nlohmann::json;

const std::string kModels = COALESCE_MODELS_DIR;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::unique_ptr<HfTokenizer> Load(const std::string& folder) {
  auto tok = LoadHfTokenizer(kModels + "/" + folder + "/tokenizer.json");
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

std::string DecodeIds(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  return Decode(tok, ids);
}

using llamacpp::VocabCase;

std::vector<VocabCase> LlamaCppCases(const std::string& name) {
  return llamacpp::LlamaCppCases(kModels + "/llamacpp-vocab-tests", name);
}

// ---------------------------------------------------------------------------
// The shared files
// ---------------------------------------------------------------------------

TEST(HfTokenizerTest, LoadsTheSharedFiles) {
  auto tiny = Load("tinyllama-tokenizer");
  auto gpt2 = Load("gpt2-tokenizer");
  auto stories = Load("stories260K-hf");
  ASSERT_TRUE(tiny && gpt2 && stories);
  EXPECT_EQ(tiny->vocab_size(), 32000);
  EXPECT_EQ(gpt2->vocab_size(), 50257);
  EXPECT_EQ(stories->vocab_size(), 512);
  EXPECT_EQ(tiny->bos_id(), 1);
  EXPECT_EQ(gpt2->bos_id(), -1);  // GPT-2's post-processor adds nothing
  EXPECT_EQ(stories->bos_id(), 1);
  EXPECT_EQ(std::vector<int32_t>(tiny->eos_ids().begin(), tiny->eos_ids().end()),
            std::vector<int32_t>{2});
  EXPECT_EQ(std::vector<int32_t>(gpt2->eos_ids().begin(), gpt2->eos_ids().end()),
            std::vector<int32_t>{50256});
  // The repairs HF itself refuses to make (see HfTokenizerOptions).
  EXPECT_EQ(tiny->load_notes().size(), 3u);
  EXPECT_EQ(gpt2->load_notes().size(), 1u);
  EXPECT_TRUE(stories->load_notes().empty());
  EXPECT_TRUE(tiny->is_special(0) && tiny->is_special(1) && tiny->is_special(2));
  EXPECT_FALSE(tiny->is_special(3));
  EXPECT_EQ(tiny->token_text(450), "\u2581The");
}

TEST(HfTokenizerTest, EosIdsFromOptions) {
  HfTokenizerOptions options;
  options.eos_ids = std::vector<int32_t>{2, 0};
  auto tok = LoadHfTokenizer(kModels + "/tinyllama-tokenizer/tokenizer.json", options);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ(std::vector<int32_t>((*tok)->eos_ids().begin(), (*tok)->eos_ids().end()),
            (std::vector<int32_t>{2, 0}));
  options.eos_ids = std::vector<int32_t>{32000};
  tok = LoadHfTokenizer(kModels + "/tinyllama-tokenizer/tokenizer.json", options);
  EXPECT_FALSE(tok.ok());
}

TEST(HfTokenizerTest, StoriesGoldens) {
  auto tok = Load("stories260K-hf");
  ASSERT_TRUE(tok);
  const Json golden = Json::parse(ReadFile(kModels + "/stories260K/golden.json"));
  ASSERT_FALSE(golden["cases"].empty());
  for (const Json& c : golden["cases"]) {
    const std::string prompt = c["prompt"];
    const auto prompt_ids = c["prompt_ids"].get<std::vector<int32_t>>();
    const auto output_ids = c["output_ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(tok->Encode(prompt, true), prompt_ids) << prompt;
    std::vector<int32_t> all = prompt_ids;
    all.insert(all.end(), output_ids.begin(), output_ids.end());
    EXPECT_EQ(Decode(*tok, all), c["text"].get<std::string>()) << prompt;
    EXPECT_EQ(Decode(*tok, output_ids, prompt_ids.back()), c["completion_text"].get<std::string>())
        << prompt;
  }
  EXPECT_EQ(tok->Encode("Once upon a time", true), (std::vector<int32_t>{1, 403, 407, 261, 378}));
}

// Expected ids from HF AutoTokenizer (add_special_tokens=False) for Llama 2,
// whose vocabulary TinyLlama shares.
TEST(HfTokenizerTest, LlamaCppVectorsTinyLlama) {
  auto tok = Load("tinyllama-tokenizer");
  ASSERT_TRUE(tok);
  const auto cases = LlamaCppCases("llama-spm");
  ASSERT_EQ(cases.size(), 46u);
  for (const VocabCase& c : cases) EXPECT_EQ(tok->Encode(c.text, false), c.ids) << c.text;
  // llama2.c's test.c, with BOS.
  EXPECT_EQ(tok->Encode("I believe the meaning of life is", true),
            (std::vector<int32_t>{1, 306, 4658, 278, 6593, 310, 2834, 338}));
}

TEST(HfTokenizerTest, LlamaCppVectorsGpt2) {
  auto tok = Load("gpt2-tokenizer");
  ASSERT_TRUE(tok);
  const auto cases = LlamaCppCases("gpt-2");
  ASSERT_EQ(cases.size(), 46u);
  for (const VocabCase& c : cases) EXPECT_EQ(tok->Encode(c.text, false), c.ids) << c.text;
}

// ---------------------------------------------------------------------------
// Behaviour
// ---------------------------------------------------------------------------

TEST(HfTokenizerTest, SpecialTokensInTextAreMatchedAsHfDoes) {
  auto tok = Load("tinyllama-tokenizer");
  ASSERT_TRUE(tok);
  // HF matches added special tokens in the text whatever add_special_tokens
  // says; the piece after one gets its own "▁" (the legacy normalizer runs on
  // each piece).
  EXPECT_EQ(tok->Encode("Hello</s>world", false), (std::vector<int32_t>{15043, 2, 3186}));
  EXPECT_EQ(tok->Encode("Hello</s>world", true), (std::vector<int32_t>{1, 15043, 2, 3186}));
  EXPECT_EQ(tok->Encode("", true), (std::vector<int32_t>{1}));
  EXPECT_TRUE(tok->Encode("", false).empty());
  EXPECT_EQ(Decode(*tok, tok->Encode("Hello</s>world", true)), "Hello world");
  auto gpt2 = Load("gpt2-tokenizer");
  ASSERT_TRUE(gpt2);
  EXPECT_EQ(gpt2->Encode("a<|endoftext|>b", true), (std::vector<int32_t>{64, 50256, 65}));
  EXPECT_EQ(DecodeIds(*gpt2, {64, 50256, 65}), "ab");
}

// transformers' split_special_tokens=True (tokenizers' encode_special_tokens):
// a special token written in the text is the text it spells.
// test_tokenizer_parity.py compares thousands of strings with HF itself.
TEST(HfTokenizerSplitTest, SpecialTokensInTheTextAreText) {
  auto tok = Load("tinyllama-tokenizer");
  ASSERT_TRUE(tok);
  const std::vector<int32_t> split = tok->EncodeSplit("Hello</s>world", false);
  for (const int32_t id : split) EXPECT_FALSE(tok->is_special(id)) << id;
  EXPECT_EQ(Decode(*tok, split), "Hello</s>world");
  // BOS from the template is still added.
  const std::vector<int32_t> with_bos = tok->EncodeSplit("Hello</s>world", true);
  ASSERT_FALSE(with_bos.empty());
  EXPECT_EQ(with_bos.front(), 1);
  EXPECT_EQ(std::vector<int32_t>(with_bos.begin() + 1, with_bos.end()), split);
  // Text without special tokens encodes as Encode encodes it.
  EXPECT_EQ(tok->EncodeSplit("Hello world", true), tok->Encode("Hello world", true));
  auto gpt2 = Load("gpt2-tokenizer");
  ASSERT_TRUE(gpt2);
  // <|endoftext|> is normalized: the second pass passes over it too.
  const std::vector<int32_t> gpt2_split = gpt2->EncodeSplit("a<|endoftext|>b", true);
  EXPECT_EQ(std::count(gpt2_split.begin(), gpt2_split.end(), 50256), 0);
  EXPECT_EQ(Decode(*gpt2, gpt2_split), "a<|endoftext|>b");
}

// With ranges (a chat template's own text): a special token counts where it
// lies wholly inside one, and the text between those kept is tokenized whole,
// as HF tokenizes the text between special tokens.
TEST(HfTokenizerSplitTest, SpecialTokensInsideTheRangesStay) {
  auto tok = Load("tinyllama-tokenizer");
  ASSERT_TRUE(tok);
  const std::string text = "</s>Hello</s>world</s>";
  const ByteRange ends[] = {{0, 4}, {18, 22}};
  std::vector<int32_t> want = {2};
  for (const int32_t id : tok->EncodeSplit("Hello</s>world", false)) want.push_back(id);
  want.push_back(2);
  EXPECT_EQ(tok->EncodeSplit(text, false, ends), want);
  // All of the text kept: Encode.
  const ByteRange all[] = {{0, text.size()}};
  EXPECT_EQ(tok->EncodeSplit(text, false, all), tok->Encode(text, false));
  // A token reaching past a range's end is text; so is one across two
  // ranges that do not touch.
  const ByteRange short_of_it[] = {{0, 3}};
  EXPECT_EQ(tok->EncodeSplit(text, false, short_of_it), tok->EncodeSplit(text, false));
  const ByteRange halves[] = {{0, 2}, {3, 22}};
  const std::vector<int32_t> halved = tok->EncodeSplit(text, false, halves);
  ASSERT_FALSE(halved.empty());
  EXPECT_NE(halved.front(), 2);
  EXPECT_EQ(halved.back(), 2);
  // Ranges that end inside a word do not cut it: "Hello world" whatever the
  // ranges say.
  const ByteRange word[] = {{0, 3}, {8, 11}};
  EXPECT_EQ(tok->EncodeSplit("Hello world", false, word), tok->Encode("Hello world", false));
  // EncodeSplitAtMost: nothing when longer than the limit.
  EXPECT_EQ(tok->EncodeSplitAtMost(text, false, ends, want.size()), want);
  EXPECT_EQ(tok->EncodeSplitAtMost(text, false, ends, want.size() - 1), std::nullopt);
  // Text that is not valid UTF-8 keeps no special token: its bytes move.
  const std::string invalid = "</s>\xFF</s>";
  const ByteRange both[] = {{0, 4}, {5, 9}};
  const std::vector<int32_t> sanitized = tok->EncodeSplit(invalid, false, both);
  for (const int32_t id : sanitized) EXPECT_FALSE(tok->is_special(id)) << id;
}

TEST(HfTokenizerSplitTest, FindSpecialTokenNamesTheFirst) {
  auto tok = Load("tinyllama-tokenizer");
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->FindSpecialToken("user</s><s>system"), "</s>");
  EXPECT_EQ(tok->FindSpecialToken("user"), std::nullopt);
  EXPECT_EQ(tok->FindSpecialToken("<|user|>"), std::nullopt);  // not a token of TinyLlama's
  auto gpt2 = Load("gpt2-tokenizer");
  ASSERT_TRUE(gpt2);
  EXPECT_EQ(gpt2->FindSpecialToken("x<|endoftext|>"), "<|endoftext|>");
}

TEST(HfTokenizerTest, LeadingSpaceIsStrippedOnlyAtTheStart) {
  auto tok = Load("tinyllama-tokenizer");
  ASSERT_TRUE(tok);
  // HF: decode([1, 450]) == decode([450]) == "The"; decode([450, 450]) ==
  // "The The"; a lone "▁" then "▁The" keeps one space.
  EXPECT_EQ(DecodeIds(*tok, {1, 450}), "The");
  EXPECT_EQ(DecodeIds(*tok, {450}), "The");
  EXPECT_EQ(DecodeIds(*tok, {450, 450}), "The The");
  EXPECT_EQ(DecodeIds(*tok, {29871, 450}), " The");
  EXPECT_EQ(DecodeIds(*tok, {450, 2, 29871, 13}), "The \n");
  EXPECT_EQ(tok->TokenBytes(1, 450), "The");
  EXPECT_EQ(tok->TokenBytes(-1, 450), "The");
  EXPECT_EQ(tok->TokenBytes(15043, 450), " The");
  EXPECT_EQ(tok->TokenBytes(15043, 1), "");  // special: skipped
  // Byte fallback: "中" is <0xE4><0xB8><0xAD>.
  EXPECT_EQ(Decode(*tok, tok->Encode("\xE4\xB8\xAD", true)), "\xE4\xB8\xAD");
}

// TextStream over generated tokens gives the bytes Decode gives them after
// the prompt's last token: the streaming invariant the engine relies on.
TEST(HfTokenizerTest, StreamingEqualsDecode) {
  for (const char* folder : {"tinyllama-tokenizer", "gpt2-tokenizer", "stories260K-hf"}) {
    auto tok = Load(folder);
    ASSERT_TRUE(tok);
    for (const VocabCase& c : LlamaCppCases("llama-spm")) {
      const std::vector<int32_t> ids = tok->Encode(c.text, true);
      const std::span<const int32_t> all(ids);
      // The prompt is ids[0..k), the generation the rest.
      for (size_t k = 1; k <= ids.size(); k += 1 + ids.size() / 7) {
        TextStream stream(*tok, ids[k - 1], {});
        std::string streamed;
        for (const int32_t id : all.subspan(k)) streamed += stream.Push(id).text;
        streamed += stream.Finish();
        EXPECT_EQ(streamed, Decode(*tok, all.subspan(k), ids[k - 1])) << folder << c.text;
        // After a BOS-only prompt the stream is the whole text, as HF
        // decodes it (Decode == HF is checked by test_tokenizer_parity.py).
        if (k == 1 && tok->bos_id() >= 0) {
          EXPECT_EQ(streamed, Decode(*tok, all)) << folder << c.text;
        }
      }
    }
  }
}

TEST(HfTokenizerTest, EncodeAtMostIsEncodeWhenItFitsAndNothingOtherwise) {
  // Both kinds of BPE: SentencePiece-style (one word per text) and
  // byte-level (a word per pre-tokenized piece), with added tokens.
  for (const char* folder : {"stories260K-hf", "tinyllama-tokenizer", "gpt2-tokenizer"}) {
    auto tok = Load(folder);
    ASSERT_NE(tok, nullptr);
    std::mt19937 rng(9);
    for (int trial = 0; trial < 200; ++trial) {
      std::string text;
      const int words = static_cast<int>(rng() % 12);
      for (int i = 0; i < words; ++i) {
        static const char* kWords[] = {
            "Once",          " upon", " a",  "  time", "\n", "</s>", "\xC3\xA9t\xC3\xA9",
            "<|endoftext|>", "!!",    " 123"};
        text += kWords[rng() % 10];
      }
      const bool special = rng() % 2 == 0;
      const std::vector<int32_t> full = tok->Encode(text, special);
      for (size_t limit :
           {size_t{0}, full.size() - (full.empty() ? 0 : 1), full.size(), full.size() + 1}) {
        const std::optional<std::vector<int32_t>> got = tok->EncodeAtMost(text, special, limit);
        if (full.size() <= limit) {
          ASSERT_TRUE(got.has_value()) << folder << " trial " << trial << " limit " << limit;
          ASSERT_EQ(*got, full);
        } else {
          ASSERT_FALSE(got.has_value()) << folder << " trial " << trial << " limit " << limit;
        }
      }
    }
  }
}

TEST(HfTokenizerTest, InvalidUtf8BecomesReplacementCharacters) {
  auto tok = Load("gpt2-tokenizer");
  ASSERT_TRUE(tok);
  const std::vector<int32_t> ids = tok->Encode("a\xFF\xE4\xB8z\x80", true);
  EXPECT_EQ(ids, tok->Encode("a\xEF\xBF\xBD\xEF\xBF\xBDz\xEF\xBF\xBD", true));
  for (const int32_t id : ids) EXPECT_TRUE(id >= 0 && id < tok->vocab_size());
  auto tiny = Load("tinyllama-tokenizer");
  ASSERT_TRUE(tiny);
  for (const int32_t id : tiny->Encode(std::string("\0\xC0\xF5<s\xFF", 6), true)) {
    EXPECT_TRUE(id >= 0 && id < tiny->vocab_size());
  }
}

// Many thousands of strings per second: an encode is a regex pass and a heap
// merge per word, with no allocation per merge.
TEST(HfTokenizerTest, EncodesThousandsOfStringsPerSecond) {
  const auto cases = LlamaCppCases("llama-spm");
  for (const char* folder : {"tinyllama-tokenizer", "gpt2-tokenizer"}) {
    auto tok = Load(folder);
    ASSERT_TRUE(tok);
    size_t strings = 0, bytes = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int round = 0; round < 40; ++round) {
      for (const VocabCase& c : cases) {
        bytes += tok->Encode(c.text, true).size();
        ++strings;
      }
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("%s: %zu strings in %.3f s (%.0f strings/s)\n", folder, strings, seconds,
                strings / seconds);
    EXPECT_GT(bytes, 0u);
    EXPECT_GT(strings / seconds, 2000.0) << folder;
  }
}

// GPT-2's vocabulary with Qwen2's components (Split with Qwen2's regex, then
// ByteLevel; ByteLevel decoder) and `normalizer`: the byte-level decoder gives
// back the normalized text exactly, so Decode(Encode(x)) shows what the
// normalizer made of x.
std::unique_ptr<HfTokenizer> Gpt2WithNormalizer(const Json& normalizer) {
  Json spec = Json::parse(ReadFile(kModels + "/gpt2-tokenizer/tokenizer.json"));
  spec["normalizer"] = normalizer;
  spec["pre_tokenizer"] = Json::parse(R"({"type": "Sequence", "pretokenizers": [
      {"type": "Split", "behavior": "Isolated", "invert": false, "pattern": {"Regex":
       "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
       "use_regex": false}]})");
  spec["decoder"] = Json::parse(R"({"type": "ByteLevel"})");
  auto tok = LoadHfTokenizerFromJson(spec.dump(), "gpt2-normalized.json");
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

// What HF's NFC/NFD/NFKC/NFKD normalizers give (each expected string is
// tokenizers 0.21's normalize_str of the input).
TEST(HfTokenizerTest, UnicodeNormalizers) {
  struct Case {
    const char* form;
    const char* input;
    const char* normalized;
  };
  const Case cases[] = {
      // Decomposed accents compose; composed ones decompose.
      {"NFC", "cafe\u0301 na\u0131\u0308ve", "caf\u00e9 na\u0131\u0308ve"},
      {"NFD", "caf\u00e9", "cafe\u0301"},
      // Combining marks are put in canonical order (dot below, class 220,
      // before acute, class 230) and then composed where they can be.
      {"NFD", "a\u0301\u0323", "a\u0323\u0301"},
      {"NFC", "a\u0301\u0323", "\u1ea1\u0301"},
      // Hangul: conjoining jamo compose into a syllable and back.
      {"NFC", "\u1112\u1161\u11ab\uae00", "\ud55c\uae00"},
      {"NFD", "\ud55c", "\u1112\u1161\u11ab"},
      // Compatibility characters change only in the K forms.
      {"NFC", "\ufb01 \u2460 \uff28\uff45\uff4c\uff4c\uff4f",
       "\ufb01 \u2460 \uff28\uff45\uff4c\uff4c\uff4f"},
      {"NFKC", "\ufb01 \u2460 \uff28\uff45\uff4c\uff4c\uff4f x\u00b2 \u2126",
       "fi 1 Hello x2 \u03a9"},
      {"NFKD", "\ufb01 \u00c5", "fi A\u030a"},
      // Characters newer than Unicode 9.0 (HF's tables) stay as they are:
      // U+32FF (Unicode 12.1) keeps its compatibility decomposition unused,
      // U+11935 U+11930 (13.0) do not compose into U+11938, and U+1DF6
      // (10.0, class 232 in utf8proc) is not reordered.
      {"NFKC", "\u32ff", "\u32ff"},
      {"NFC", "\U00011935\U00011930", "\U00011935\U00011930"},
      {"NFD", "a\u1df6\u0323", "a\u1df6\u0323"},
      {"NFD", "\u00e9\u1df6\u00e9", "e\u0301\u1df6e\u0301"},
      {"NFC", "", ""},
  };
  std::map<std::string, std::unique_ptr<HfTokenizer>> tokenizers;  // by normalizer
  for (const Case& c : cases) {
    // Inside a Sequence too, as the NFKC of some files is.
    for (const bool in_sequence : {false, true}) {
      Json normalizer = {{"type", c.form}};
      if (in_sequence) normalizer = {{"type", "Sequence"}, {"normalizers", {normalizer}}};
      std::unique_ptr<HfTokenizer>& tok = tokenizers[normalizer.dump()];
      if (!tok) tok = Gpt2WithNormalizer(normalizer);
      ASSERT_TRUE(tok);
      const std::string input = c.input, want = c.normalized;
      const std::vector<int32_t> ids = tok->Encode(input, false);
      EXPECT_EQ(Decode(*tok, ids), want) << c.form << " " << c.input;
      EXPECT_EQ(ids, tok->Encode(want, false)) << c.form << " " << c.input;
    }
  }
}

// ---------------------------------------------------------------------------
// Decoder chains that are not per token
// ---------------------------------------------------------------------------

// Byte tokens, "▁a", "b", "▁" and the BOS <s>, with `decoder`.
std::unique_ptr<HfTokenizer> ChainTokenizer(const std::string& decoder) {
  Json spec = Json::parse(R"({
    "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
                      "rstrip": false, "normalized": false, "special": true}],
    "post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}}],
      "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
      "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
    "model": {"type": "BPE", "byte_fallback": true,
              "vocab": {"<s>": 0, "<0x41>": 1, "<0xE4>": 2, "<0xB8>": 3, "<0xAD>": 4,
                        "\u2581a": 5, "b": 6, "\u2581": 7},
              "merges": []}})");
  spec["decoder"] = Json::parse(decoder);
  auto tok = LoadHfTokenizerFromJson(spec.dump(), "chain.json");
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

constexpr char kGgufLlamaDecoder[] = R"({"type": "Sequence", "decoders": [
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]})";
const std::string kFffd = "\xEF\xBF\xBD";

// Llama's decoder in the order transformers writes for GGUF files: HF's
// result, which needs whole runs (expected values from HF tokenizers 0.21).
TEST(HfTokenizerDecoderTest, GgufLlamaOrderDecodesAsHf) {
  auto tok = ChainTokenizer(kGgufLlamaDecoder);
  ASSERT_TRUE(tok);
  EXPECT_FALSE(tok->DecodesPerToken());
  EXPECT_EQ(DecodeIds(*tok, {5, 6}), "ab");
  EXPECT_EQ(DecodeIds(*tok, {0, 5, 6}), "ab");
  EXPECT_EQ(DecodeIds(*tok, {2, 3, 4, 5}), "\xE4\xB8\xAD a");
  // A run that is not valid UTF-8: one U+FFFD per byte, "A" included.
  EXPECT_EQ(DecodeIds(*tok, {1, 2, 5}), kFffd + kFffd + " a");
  EXPECT_EQ(DecodeIds(*tok, {1, 0, 2, 3}), kFffd + kFffd + kFffd);
  // Only the text's first space goes, wherever BOS is.
  EXPECT_EQ(DecodeIds(*tok, {0, 7, 5, 0, 5}), " a a");
  // Following a token: nothing is stripped.
  EXPECT_EQ(Decode(*tok, std::vector<int32_t>{5}, 6), " a");
  EXPECT_EQ(Decode(*tok, std::vector<int32_t>{5}, 0), "a");
}

TEST(HfTokenizerDecoderTest, TodaysOrderStaysPerToken) {
  auto tok = ChainTokenizer(R"({"type": "Sequence", "decoders": [
      {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
      {"type": "ByteFallback"}, {"type": "Fuse"},
      {"type": "Strip", "content": " ", "start": 1, "stop": 0}]})");
  ASSERT_TRUE(tok);
  EXPECT_TRUE(tok->DecodesPerToken());
  // Per token: the valid "A" stays (hf_tokenizer.h, (b)).
  EXPECT_EQ(DecodeIds(*tok, {1, 2, 5}), "A" + kFffd + " a");
}

TEST(HfTokenizerDecoderTest, StepsAfterFusingSeeTheWholeText) {
  // Metaspace after Fuse: the fused text is HF's first token, so every ▁ goes.
  auto meta = ChainTokenizer(R"({"type": "Sequence", "decoders": [{"type": "Fuse"},
      {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always"}]})");
  ASSERT_TRUE(meta);
  EXPECT_EQ(DecodeIds(*meta, {5, 6, 5}), "aba");
  // Strip before Fuse strips every token; Strip after ByteFallback sees each
  // U+FFFD of an invalid run as a token.
  auto strip = ChainTokenizer(R"({"type": "Sequence", "decoders": [{"type": "ByteFallback"},
      {"type": "Strip", "content": "\ufffd", "start": 1, "stop": 0}, {"type": "Fuse"}]})");
  ASSERT_TRUE(strip);
  EXPECT_EQ(DecodeIds(*strip, {2, 3, 6}), "b");
  // A regex Replace, nested Sequences.
  auto regex = ChainTokenizer(R"({"type": "Sequence", "decoders": [
      {"type": "Sequence", "decoders": [{"type": "Fuse"}]},
      {"type": "Replace", "pattern": {"Regex": "\u2581+"}, "content": "_"}]})");
  ASSERT_TRUE(regex);
  EXPECT_EQ(DecodeIds(*regex, {7, 7, 5, 7}), "_a_");
}

// Streaming gives Decode's text, and holds back an open run of byte tokens
// that a later byte could still turn into U+FFFD.
TEST(HfTokenizerDecoderTest, StreamsWhatDecodeGives) {
  auto tok = ChainTokenizer(kGgufLlamaDecoder);
  ASSERT_TRUE(tok);
  {
    TextStream stream(*tok, 0, {});
    EXPECT_EQ(stream.Push(1).text, "");  // "A", but the run is open
    EXPECT_EQ(stream.Push(2).text, "");
    EXPECT_EQ(stream.Push(5).text, kFffd + kFffd + " a");
    EXPECT_EQ(stream.Push(7).text, " ");
    EXPECT_EQ(stream.Push(6).text, "b");
    EXPECT_EQ(stream.Finish(), "");
  }
  {
    TextStream stream(*tok, 0, {"a b"});
    EXPECT_EQ(stream.Push(5).text, "");  // "a" may start the stop sequence
    const TextStream::Piece p = stream.Push(7);
    EXPECT_FALSE(p.stopped);
    EXPECT_TRUE(stream.Push(6).stopped);
  }
  std::mt19937 rng(7);
  for (int round = 0; round < 300; ++round) {
    std::vector<int32_t> ids(1 + rng() % 12);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 9);  // 8: outside
    const int32_t prev = static_cast<int32_t>(rng() % 3) - 1;
    TextStream stream(*tok, prev, {});
    std::string streamed;
    for (const int32_t id : ids) streamed += stream.Push(id).text;
    streamed += stream.Finish();
    EXPECT_EQ(streamed, Decode(*tok, ids, prev)) << round;
  }
}

// A decoder that can rewrite text already decoded (a Replace across tokens
// after fusing) is still exact: the stream waits for the end.
TEST(HfTokenizerDecoderTest, RewritingChainsStreamAtTheEnd) {
  auto tok = ChainTokenizer(R"({"type": "Sequence", "decoders": [{"type": "Fuse"},
      {"type": "Replace", "pattern": {"String": "a\u2581"}, "content": "X"}]})");
  ASSERT_TRUE(tok);
  TextStream stream(*tok, -1, {});
  EXPECT_EQ(stream.Push(5).text, "");
  EXPECT_EQ(stream.Push(7).text, "");
  EXPECT_EQ(stream.Finish(), "\u2581X");
  EXPECT_EQ(DecodeIds(*tok, {5, 7}), "\u2581X");
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

// A small valid BPE tokenizer.json, edited by each test.
Json MiniSpec() {
  return Json::parse(R"({
    "version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
                      "rstrip": false, "normalized": false, "special": true}],
    "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
    "model": {"type": "BPE", "vocab": {"<s>": 0, "a": 1, "b": 2, "ab": 3},
              "merges": ["a b"]}})");
}

absl::Status LoadMini(const Json& spec) {
  return LoadHfTokenizerFromJson(spec.dump(), "mini.json").status();
}

TEST(HfTokenizerErrorsTest, MiniSpecLoads) {
  auto tok = LoadHfTokenizerFromJson(MiniSpec().dump(), "mini.json");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->Encode("ab<s>ba", false), (std::vector<int32_t>{3, 0, 2, 1}));
  // Without a decoder HF joins tokens with spaces.
  EXPECT_EQ(DecodeIds(**tok, {3, 0, 2, 1}), "ab b a");
}

TEST(HfTokenizerErrorsTest, MissingFile) {
  auto tok = LoadHfTokenizer("/nonexistent/tokenizer.json");
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(tok.status().message().find("/nonexistent/tokenizer.json"), std::string::npos);
}

TEST(HfTokenizerErrorsTest, BadJson) {
  const std::string path = ::testing::TempDir() + "/bad.json";
  std::ofstream(path) << "{\"model\": {\"type\": \"BPE\", ";
  auto tok = LoadHfTokenizer(path);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(tok.status().message().find(path), std::string::npos) << tok.status();
  EXPECT_NE(tok.status().message().find("parse error"), std::string::npos) << tok.status();
}

TEST(HfTokenizerErrorsTest, UnsupportedComponentsAreNamed) {
  struct Case {
    const char* pointer;  // JSON pointer to replace
    const char* value;
    const char* expected;  // in the message
  };
  const Case cases[] = {
      {"/model/type", R"("WordPiece")", "model: model type WordPiece"},
      {"/model/type", R"("Unigram")", "model type Unigram"},
      {"/pre_tokenizer", R"({"type": "Whitespace"})", "pre_tokenizer: pre-tokenizer Whitespace"},
      {"/pre_tokenizer",
       R"({"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}, {"type": "Digits"}]})",
       "pre_tokenizer.pretokenizers[1]: pre-tokenizer Digits"},
      {"/normalizer", R"({"type": "Lowercase"})", "normalizer: normalizer Lowercase"},
      {"/normalizer", R"({"type": "Sequence", "normalizers": [{"type": "NFC"},
         {"type": "Precompiled", "precompiled_charsmap": ""}]})",
       "normalizer.normalizers[1]: normalizer Precompiled"},
      {"/post_processor", R"({"type": "RobertaProcessing"})", "post-processor RobertaProcessing"},
      {"/decoder", R"({"type": "WordPiece"})", "decoder: decoder WordPiece"},
      {"/decoder", R"({"type": "Sequence", "decoders": [{"type": "Fuse"}, {"type": "CTC"}]})",
       "decoder.decoders[1]: decoder CTC"},
      {"/decoder", R"({"type": "Replace", "pattern": {"Regex": "\\w"}, "content": ""})",
       "\\w is not supported"},
      {"/pre_tokenizer",
       R"({"type": "Split", "pattern": {"Regex": "\\w+"}, "behavior": "Isolated"})",
       "regex \"\\w+\": \\w is not supported"},
      {"/model/dropout", "0.1", "BPE dropout"},
      {"/truncation", R"({"max_length": 5})", "truncation"},
  };
  for (const Case& c : cases) {
    Json spec = MiniSpec();
    spec[Json::json_pointer(c.pointer)] = Json::parse(c.value);
    const absl::Status status = LoadMini(spec);
    EXPECT_FALSE(status.ok()) << c.value;
    EXPECT_NE(status.message().find("mini.json"), std::string::npos) << status;
    EXPECT_NE(status.message().find(c.expected), std::string::npos) << status;
  }
}

TEST(HfTokenizerErrorsTest, MalformedFields) {
  Json spec = MiniSpec();
  spec["model"]["vocab"]["x"] = "not an id";
  EXPECT_NE(LoadMini(spec).message().find("vocab entry \"x\""), std::string::npos);
  spec = MiniSpec();
  spec["model"]["unk_token"] = "<unk>";
  EXPECT_NE(LoadMini(spec).message().find("unk_token \"<unk>\" is not in the vocabulary"),
            std::string::npos);
  spec = MiniSpec();
  spec["added_tokens"][0]["id"] = 7;  // "<s>" is 0 in the vocabulary
  EXPECT_NE(LoadMini(spec).message().find("HF would give it id 0"), std::string::npos);
  spec = MiniSpec();
  spec.erase("model");
  EXPECT_NE(LoadMini(spec).message().find("model: missing"), std::string::npos);
}

// Found through tests/fuzz/hf_tokenizer_fuzz: every table indexed by id is
// as long as the largest id, so a 100-byte file with a vocabulary or template
// id of 10^9 asked for tens of gigabytes (std::bad_alloc escaped the loader).
// Ids may leave gaps, but not more than the file has tokens.
TEST(HfTokenizerErrorsTest, SparseIdsAreRefused) {
  Json spec = MiniSpec();
  spec["model"]["vocab"]["x"] = 1000000000;
  EXPECT_NE(LoadMini(spec).message().find("vocab ids reach 1000000000 with only 5 pieces"),
            std::string::npos)
      << LoadMini(spec);
  spec["model"]["vocab"]["x"] = 1000;  // a gap, as HF allows
  EXPECT_TRUE(LoadMini(spec).ok()) << LoadMini(spec);
  spec = MiniSpec();
  spec["post_processor"] = Json::parse(R"({"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "X", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "special_tokens": {"X": {"id": "X", "ids": [1000000000], "tokens": ["X"]}}})");
  EXPECT_NE(LoadMini(spec).message().find("special_tokens[\"X\"] has a bad id"), std::string::npos)
      << LoadMini(spec);
}

// Found through tests/fuzz/hf_tokenizer_fuzz: the parser reads Sequence
// components recursively, so a normalizer nested 100000 deep overflowed the
// stack. Files nested more than 64 levels are refused.
TEST(HfTokenizerErrorsTest, DeeplyNestedJsonIsRefused) {
  std::string normalizer;
  for (int i = 0; i < 100000; ++i) normalizer += R"({"type": "Sequence", "normalizers": [)";
  normalizer += R"({"type": "NFC"})";
  for (int i = 0; i < 100000; ++i) normalizer += "]}";
  std::string json = MiniSpec().dump();
  const std::string null_normalizer = R"("normalizer":null)";
  json.replace(json.find(null_normalizer), null_normalizer.size(), "\"normalizer\":" + normalizer);
  auto tok = LoadHfTokenizerFromJson(json, "deep.json");
  EXPECT_NE(tok.status().message().find("deep.json: JSON nested more than 64 levels"),
            std::string::npos)
      << tok.status();
}

TEST(HfTokenizerErrorsTest, StrictMergesRejectWhatHfRejects) {
  HfTokenizerOptions strict;
  strict.repair_merges = false;
  auto tiny = LoadHfTokenizer(kModels + "/tinyllama-tokenizer/tokenizer.json", strict);
  EXPECT_FALSE(tiny.ok());
  EXPECT_NE(tiny.status().message().find("merge 18917"), std::string::npos) << tiny.status();
  auto gpt2 = LoadHfTokenizer(kModels + "/gpt2-tokenizer/tokenizer.json", strict);
  EXPECT_FALSE(gpt2.ok());
  EXPECT_NE(gpt2.status().message().find("ĠClaude"), std::string::npos) << gpt2.status();
  EXPECT_TRUE(LoadHfTokenizer(kModels + "/stories260K-hf/tokenizer.json", strict).ok());
}

}  // namespace
}  // namespace coalesce::engine
