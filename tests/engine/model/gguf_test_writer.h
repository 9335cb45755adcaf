// Writing GGUF files byte by byte, for the tests of the GGUF container
// reader (gguf_file_test.cc) and of the GGUF model loader
// (gguf_model_test.cc): Bytes appends each field of the format as
// engine/model/gguf_file.h describes it, Write puts the bytes in a file.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

namespace coalesce::engine::gguf_test {

// Metadata value type ids (GgufValueType).
inline constexpr uint32_t kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6,
                          kBool = 7, kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12;

// Little-endian bytes of a GGUF file, appended field by field.
class Bytes {
 public:
  Bytes& U8(uint8_t v) { return Int(v, 1); }
  Bytes& U16(uint16_t v) { return Int(v, 2); }
  Bytes& U32(uint32_t v) { return Int(v, 4); }
  Bytes& U64(uint64_t v) { return Int(v, 8); }
  Bytes& F32(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return U32(bits);
  }
  Bytes& F64(double d) {
    uint64_t bits;
    std::memcpy(&bits, &d, 8);
    return U64(bits);
  }
  Bytes& Str(std::string_view s) {
    U64(s.size());
    out_.append(s);
    return *this;
  }
  Bytes& Raw(std::string_view s) {
    out_.append(s);
    return *this;
  }
  // "GGUF", version, tensor count, key/value count.
  Bytes& Header(uint64_t tensors, uint64_t kvs, uint32_t version = 3) {
    out_.append("GGUF");
    return U32(version).U64(tensors).U64(kvs);
  }
  // A key and its value type; the value follows.
  Bytes& Key(std::string_view key, uint32_t type) { return Str(key).U32(type); }
  // An array's item type and count; the items follow.
  Bytes& Array(uint32_t item_type, uint64_t count) { return U32(item_type).U64(count); }
  Bytes& TensorInfo(std::string_view name, const std::vector<uint64_t>& dims, uint32_t type,
                    uint64_t offset) {
    Str(name).U32(static_cast<uint32_t>(dims.size()));
    for (const uint64_t d : dims) U64(d);
    return U32(type).U64(offset);
  }
  Bytes& PadTo(size_t alignment) {
    while (out_.size() % alignment != 0) out_.push_back('\0');
    return *this;
  }
  const std::string& str() const { return out_; }
  size_t size() const { return out_.size(); }

 private:
  Bytes& Int(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>(v >> (8 * i) & 0xFF));
    return *this;
  }
  std::string out_;
};

// A file of its own per call: ctest runs each test in its own process, in
// parallel, so the name carries the process id.
inline std::string Write(const std::string& bytes) {
  static int counter = 0;
  const std::string path = ::testing::TempDir() + "/gguf_test_" + std::to_string(getpid()) + "_" +
                           std::to_string(counter++) + ".gguf";
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

}  // namespace coalesce::engine::gguf_test
