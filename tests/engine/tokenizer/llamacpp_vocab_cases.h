// llama.cpp's tokenizer test vectors (../shared/models/llamacpp-vocab-tests,
// whose README.md describes them): each ggml-vocab-NAME.gguf.inp holds texts
// separated by "\n__ggml_vocab_test__\n", and its .out one line of
// space-separated ids per text. Shared by the tokenizer.json and GGUF
// tokenizer tests.
#pragma once

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace coalesce::engine::llamacpp {

struct VocabCase {
  std::string text;
  std::vector<int32_t> ids;
};

inline std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The cases of `vocab_dir`/ggml-vocab-`name`.gguf.{inp,out}; none when the
// files are missing.
inline std::vector<VocabCase> LlamaCppCases(const std::string& vocab_dir, const std::string& name) {
  const std::string base = vocab_dir + "/ggml-vocab-" + name + ".gguf";
  const std::string inp = ReadWholeFile(base + ".inp");
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<VocabCase> cases;
  for (size_t at = 0, next; (next = inp.find(sep, at)) != std::string::npos;
       at = next + sep.size()) {
    cases.push_back({inp.substr(at, next - at), {}});
  }
  std::istringstream out(ReadWholeFile(base + ".out"));
  std::string line;
  for (VocabCase& c : cases) {
    std::getline(out, line);
    std::istringstream ids(line);
    for (int32_t id; ids >> id;) c.ids.push_back(id);
  }
  return cases;
}

}  // namespace coalesce::engine::llamacpp
