// GgufFile on small GGUF files built byte by byte here: valid ones (every
// value type, arrays of arrays, tensors of several types, versions 2 and 3,
// custom alignment) and one test per way a hostile file can lie, each
// asserting the specific error. Then the type table and DequantizeToFloat on
// hand-made blocks; tests/engine/model/test_gguf_parity.py holds the
// dequantization to PyPI's gguf bit for bit on random blocks.
#include "engine/model/gguf_file.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "engine/model/gguf_quant.h"
#include "tests/engine/model/gguf_test_writer.h"

namespace coalesce::engine {
namespace {

// Bytes, Write and the value type ids kU8 ... kF64.
using namespace gguf_test;  // NOLINT(build/namespaces)

// Whether `text` holds `part` (gtest alone: the GPU check builds googletest
// without gmock's include path).
::testing::AssertionResult Contains(absl::string_view text, absl::string_view part) {
  if (text.find(part) != absl::string_view::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << part << "\"";
}

constexpr uint32_t kTypeF32 = 0, kTypeF16 = 1, kTypeQ4_0 = 2, kTypeQ8_0 = 8;

absl::StatusOr<GgufFile> OpenBytes(const Bytes& b) { return GgufFile::Open(Write(b.str())); }

// Opening must fail with INVALID_ARGUMENT, naming the file and `what`.
void ExpectRefused(const Bytes& b, const std::string& what) {
  const std::string path = Write(b.str());
  auto file = GgufFile::Open(path);
  ASSERT_FALSE(file.ok()) << "accepted; expected an error with: " << what;
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
  EXPECT_TRUE(Contains(file.status().message(), path));
  EXPECT_TRUE(Contains(file.status().message(), what));
  // One line, whatever the file held.
  EXPECT_EQ(std::string(file.status().message()).find('\n'), std::string::npos);
}

// Bytes of Q4_0 block with d = 1.0: element i < 16 is i - 8, 16 + i is 7 - i.
std::string Q4_0Block() {
  Bytes b;
  b.U16(0x3C00);
  for (int i = 0; i < 16; ++i) b.U8(static_cast<uint8_t>(i | (15 - i) << 4));
  return b.str();
}

// A valid file: metadata of every type (arrays of arrays included) and three
// tensors, F32 [4, 2] at 0, Q4_0 [32] at 32, Q8_0 [32, 2] at 64 (offsets
// aligned to `alignment`, 32 unless general.alignment is given).
Bytes ValidFile(uint32_t version = 3, uint32_t alignment = 0) {
  Bytes b;
  b.Header(3, alignment ? 17 : 16, version);
  b.Key("general.architecture", kString).Str("llama");
  b.Key("u8", kU8).U8(255);
  b.Key("i8", kI8).U8(0x80);  // -128
  b.Key("u16", kU16).U16(65535);
  b.Key("i16", kI16).U16(0x8000);  // -32768
  b.Key("u32", kU32).U32(4000000000u);
  b.Key("i32", kI32).U32(static_cast<uint32_t>(-7));
  b.Key("u64", kU64).U64(UINT64_MAX);
  b.Key("i64", kI64).U64(static_cast<uint64_t>(INT64_MIN));
  b.Key("f32", kF32).F32(0.25f);
  b.Key("f64", kF64).F64(-1e300);
  b.Key("yes", kBool).U8(1);
  b.Key("tokens", kArray).Array(kString, 3).Str("a").Str("").Str("\xe6\x9d\xb1");
  b.Key("ids", kArray).Array(kI32, 3).U32(1).U32(static_cast<uint32_t>(-2)).U32(3);
  b.Key("scales", kArray).Array(kF32, 2).F32(0.5f).F32(-2.0f);
  // [[1, 2], [], [3]] of uint16
  b.Key("nested", kArray).Array(kArray, 3);
  b.Array(kU16, 2).U16(1).U16(2).Array(kU16, 0).Array(kU16, 1).U16(3);
  if (alignment) b.Key("general.alignment", kU32).U32(alignment);
  const uint64_t a = alignment ? alignment : 32;
  b.TensorInfo("f32", {4, 2}, kTypeF32, 0);
  b.TensorInfo("q4_0", {32}, kTypeQ4_0, a);
  b.TensorInfo("q8_0", {32, 2}, kTypeQ8_0, 2 * a);
  b.PadTo(a);
  for (int i = 0; i < 8; ++i) b.F32(static_cast<float>(i));
  b.PadTo(a);
  b.Raw(Q4_0Block());
  b.PadTo(a);
  for (int row = 0; row < 2; ++row) {
    b.U16(0x3800);  // 0.5
    for (int i = 0; i < 32; ++i) b.U8(static_cast<uint8_t>(i - 16));
  }
  return b;
}

// ---------------------------------------------------------------------------
// Valid files
// ---------------------------------------------------------------------------

TEST(GgufFileTest, ReadsEveryValueType) {
  auto file = OpenBytes(ValidFile());
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->version(), 3);
  EXPECT_EQ(file->alignment(), 32u);
  ASSERT_EQ(file->metadata().size(), 16u);
  EXPECT_EQ(file->metadata()[0].key, "general.architecture");
  EXPECT_EQ(*file->GetString("general.architecture"), "llama");
  EXPECT_EQ(*file->GetUint("u8"), 255u);
  EXPECT_EQ(*file->GetInt("i8"), -128);
  EXPECT_EQ(*file->GetUint("u16"), 65535u);
  EXPECT_EQ(*file->GetInt("i16"), -32768);
  EXPECT_EQ(*file->GetUint("u32"), 4000000000u);
  EXPECT_EQ(*file->GetInt("i32"), -7);
  EXPECT_EQ(*file->GetUint("u64"), UINT64_MAX);
  EXPECT_EQ(*file->GetInt("i64"), INT64_MIN);
  EXPECT_EQ(*file->GetFloat("f32"), 0.25);
  EXPECT_EQ(*file->GetFloat("f64"), -1e300);
  EXPECT_TRUE(*file->GetBool("yes"));
  const auto tokens = file->GetStringArray("tokens");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->size(), 3u);
  EXPECT_EQ((*tokens)[0], "a");
  EXPECT_EQ((*tokens)[1], "");
  EXPECT_EQ((*tokens)[2], "\xe6\x9d\xb1");
  EXPECT_EQ(*file->GetIntArray("ids"), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(*file->GetFloatArray("scales"), (std::vector<double>{0.5, -2.0}));
  const auto nested = file->GetArray("nested");
  ASSERT_TRUE(nested.ok()) << nested.status();
  EXPECT_EQ((*nested)->item_type(), GgufValueType::kArray);
  ASSERT_EQ((*nested)->arrays().size(), 3u);
  EXPECT_EQ((*nested)->arrays()[0].item_type(), GgufValueType::kUint16);
  EXPECT_EQ((*nested)->arrays()[0].size(), 2u);
  EXPECT_EQ((*nested)->arrays()[0].At(1).AsUint(), 2u);
  EXPECT_EQ((*nested)->arrays()[1].size(), 0u);
  EXPECT_EQ((*nested)->arrays()[2].At(0).AsUint(), 3u);
  EXPECT_EQ(file->Find("absent"), nullptr);
}

TEST(GgufFileTest, LocatesTensors) {
  const Bytes b = ValidFile();
  auto file = OpenBytes(b);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->data_offset() % 32, 0u);
  EXPECT_EQ(file->data_offset() + 64 + 68, b.size());
  ASSERT_EQ(file->tensors().size(), 3u);
  const GgufTensor* f32 = file->FindTensor("f32");
  ASSERT_NE(f32, nullptr);
  EXPECT_EQ(f32->dims, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(f32->type, GgmlType::kF32);
  EXPECT_EQ(f32->num_elements, 8);
  EXPECT_EQ(f32->num_bytes, 32);
  EXPECT_EQ(f32->data, static_cast<const std::byte*>(file->mapping().get()) + file->data_offset());
  std::vector<float> values(8);
  ASSERT_TRUE(DequantizeToFloat(f32->type, f32->data, 8, values.data()).ok());
  EXPECT_EQ(values, (std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7}));

  const GgufTensor* q4 = file->FindTensor("q4_0");
  ASSERT_NE(q4, nullptr);
  EXPECT_EQ(q4->offset, 32u);
  EXPECT_EQ(q4->num_bytes, 18);
  values.resize(32);
  ASSERT_TRUE(DequantizeToFloat(q4->type, q4->data, 32, values.data()).ok());
  EXPECT_EQ(values[0], -8.0f);
  EXPECT_EQ(values[15], 7.0f);
  EXPECT_EQ(values[16], 7.0f);
  EXPECT_EQ(values[31], -8.0f);

  const GgufTensor* q8 = file->FindTensor("q8_0");
  ASSERT_NE(q8, nullptr);
  EXPECT_EQ(q8->dims, (std::vector<int64_t>{32, 2}));
  EXPECT_EQ(q8->num_bytes, 68);
  values.resize(64);
  ASSERT_TRUE(DequantizeToFloat(q8->type, q8->data, 64, values.data()).ok());
  EXPECT_EQ(values[0], -8.0f);
  EXPECT_EQ(values[63], 7.5f);
  EXPECT_EQ(file->FindTensor("absent"), nullptr);
}

TEST(GgufFileTest, AcceptsVersion2) {
  auto file = OpenBytes(ValidFile(2));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->version(), 2);
  EXPECT_EQ(file->tensors().size(), 3u);
}

TEST(GgufFileTest, HonoursGeneralAlignment) {
  auto file = OpenBytes(ValidFile(3, 256));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->alignment(), 256u);
  EXPECT_EQ(file->data_offset() % 256, 0u);
  EXPECT_EQ(file->FindTensor("q8_0")->offset, 512u);
}

TEST(GgufFileTest, MetadataOnlyAndEmptyTensors) {
  Bytes b;
  b.Header(0, 1).Key("general.architecture", kString).Str("llama");
  auto file = OpenBytes(b);  // no padding, no data section
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->tensors().empty());

  Bytes e;
  e.Header(2, 0).TensorInfo("empty", {0, 1u << 30}, kTypeF32, 0).TensorInfo("one", {1}, 0, 0);
  e.PadTo(32).F32(1.0f);
  auto with_empty = OpenBytes(e);
  ASSERT_TRUE(with_empty.ok()) << with_empty.status();
  EXPECT_EQ(with_empty->FindTensor("empty")->num_bytes, 0);
  EXPECT_EQ(with_empty->FindTensor("one")->num_bytes, 4);
}

TEST(GgufFileTest, AcceptsArraysNestedToTheLimit) {
  Bytes b;
  b.Header(0, 1).Key("deep", kArray);
  for (int depth = 1; depth < kGgufMaxArrayDepth; ++depth) b.Array(kArray, 1);
  b.Array(kU8, 1).U8(7);
  auto file = OpenBytes(b);
  ASSERT_TRUE(file.ok()) << file.status();
}

TEST(GgufFileTest, TypedAccessorsNameTheKeyAndWhatItHolds) {
  auto file = OpenBytes(ValidFile());
  ASSERT_TRUE(file.ok()) << file.status();
  const auto missing = file->GetUint("llama.block_count");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(missing.status().message(), "no metadata key \"llama.block_count\""));
  EXPECT_TRUE(Contains(missing.status().message(), file->path()));

  const auto wrong = file->GetUint("general.architecture");
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(wrong.status().message(),
                       "metadata key \"general.architecture\": expected an integer >= 0, found "
                       "string \"llama\""));
  EXPECT_TRUE(Contains(file->GetUint("i32").status().message(), "found int32 -7"));
  EXPECT_TRUE(
      Contains(file->GetInt("u64").status().message(),
               "expected an integer that fits in int64, found uint64 18446744073709551615"));
  EXPECT_TRUE(Contains(file->GetFloat("u8").status().message(), "found uint8 255"));
  EXPECT_TRUE(Contains(file->GetBool("f32").status().message(), "found float32 0.25"));
  EXPECT_TRUE(Contains(file->GetString("yes").status().message(), "found bool true"));
  EXPECT_TRUE(Contains(file->GetStringArray("ids").status().message(),
                       "expected an array of string, found array of 3 int32"));
  EXPECT_TRUE(Contains(file->GetIntArray("tokens").status().message(), "found array of 3 string"));
  EXPECT_TRUE(Contains(file->GetFloatArray("ids").status().message(), "found array of 3 int32"));
  EXPECT_TRUE(Contains(file->GetArray("u32").status().message(), "found uint32 4000000000"));
  // Any integer type serves GetUint when the value is >= 0, and GetInt.
  EXPECT_EQ(*file->GetUint("u16"), 65535u);
  EXPECT_EQ(*file->GetInt("u32"), 4000000000);
}

// ---------------------------------------------------------------------------
// Hostile files: the header
// ---------------------------------------------------------------------------

TEST(GgufHostileTest, EmptyAndTooShort) {
  ExpectRefused(Bytes(), "too short for a GGUF header (0 bytes)");
  ExpectRefused(Bytes().Raw("GG"), "too short for a GGUF header (2 bytes)");
}

TEST(GgufHostileTest, NotGguf) {
  ExpectRefused(Bytes().Raw("GGML").U32(3).U64(0).U64(0),
                "not a GGUF file: it starts with \"GGML\"");
}

TEST(GgufHostileTest, Version1) {
  ExpectRefused(Bytes().Raw("GGUF").U32(1).U32(0).U32(0), "GGUF version 1 is not supported");
}

TEST(GgufHostileTest, BigEndian) {
  Bytes b;
  b.Raw("GGUF").Raw(std::string("\0\0\0\3", 4)).Raw(std::string(16, '\0'));
  ExpectRefused(b, "big-endian GGUF (version field 50331648, version 3 byte-swapped)");
}

TEST(GgufHostileTest, UnknownVersion) {
  ExpectRefused(Bytes().Header(0, 0, 4), "unsupported GGUF version 4 (supported: 2, 3)");
}

TEST(GgufHostileTest, TruncatedHeader) {
  ExpectRefused(Bytes().Raw("GGUF").U32(3).U64(0).U32(0),
                "truncated: the metadata key/value count needs 8 bytes at offset 16");
}

TEST(GgufHostileTest, KeyValueCountLies) {
  ExpectRefused(Bytes().Header(0, uint64_t{1} << 60).Key("a", kU8).U8(1),
                "metadata key/value count 1152921504606846976 cannot fit in the 14 bytes left");
}

TEST(GgufHostileTest, TensorCountLies) {
  ExpectRefused(Bytes().Header(UINT64_MAX, 0).TensorInfo("t", {1}, 0, 0),
                "tensor count 18446744073709551615 cannot fit");
  // Plausible against the whole file, not against what is left after the
  // metadata.
  Bytes b;
  b.Header(2, 1).Key("s", kString).Str(std::string(40, 'x')).TensorInfo("t", {1}, 0, 0);
  ExpectRefused(b, "tensor count 2 cannot fit in the 33 bytes left after the metadata");
}

// ---------------------------------------------------------------------------
// Hostile files: metadata
// ---------------------------------------------------------------------------

TEST(GgufHostileTest, KeyLengthLies) {
  ExpectRefused(Bytes().Header(0, 1).U64(uint64_t{1} << 62).Raw("abcdefghij"),
                "truncated: the key of metadata entry 0 is 4611686018427387904 bytes long at "
                "offset 32 but only 10 bytes are left");
}

TEST(GgufHostileTest, StringValueLengthLies) {
  ExpectRefused(Bytes().Header(0, 1).Key("general.name", kString).U64(1000).Raw("short"),
                "metadata key \"general.name\": the string value is 1000 bytes long");
}

TEST(GgufHostileTest, ArrayCountLies) {
  ExpectRefused(Bytes().Header(0, 1).Key("ids", kArray).Array(kU32, 1000000000).U32(1),
                "metadata key \"ids\": array of 1000000000 uint32 items cannot fit in the 4 bytes "
                "left");
  ExpectRefused(Bytes().Header(0, 1).Key("tokens", kArray).Array(kString, UINT64_MAX).Str("a"),
                "metadata key \"tokens\": array of 18446744073709551615 string items cannot fit");
  ExpectRefused(Bytes().Header(0, 1).Key("nested", kArray).Array(kArray, 1u << 31),
                "metadata key \"nested\": array of 2147483648 array items cannot fit");
  // Each string's own length, inside a plausible count.
  ExpectRefused(
      Bytes().Header(0, 1).Key("tokens", kArray).Array(kString, 2).Str("a").U64(99).Raw("b"),
      "metadata key \"tokens\": string item 1 is 99 bytes long");
  // An inner array's count.
  ExpectRefused(
      Bytes().Header(0, 1).Key("nested", kArray).Array(kArray, 1).Array(kI64, 5).U64(1),
      "metadata key \"nested\"[0]: array of 5 int64 items cannot fit in the 8 bytes left");
}

TEST(GgufHostileTest, ArraysNestTooDeep) {
  Bytes b;
  b.Header(0, 1).Key("deep", kArray);
  for (int depth = 1; depth <= kGgufMaxArrayDepth; ++depth) b.Array(kArray, 1);
  b.Array(kU8, 1).U8(7);
  ExpectRefused(b, "metadata key \"deep\"[0][0][0][0][0][0][0][0]: arrays nest more than 8 deep");
}

TEST(GgufHostileTest, UnknownValueTypes) {
  ExpectRefused(Bytes().Header(0, 1).Key("x", 13).U8(0),
                "metadata key \"x\": unknown value type 13");
  ExpectRefused(Bytes().Header(0, 1).Key("x", kArray).Array(99, 1).U8(0),
                "metadata key \"x\": array of unknown value type 99");
}

TEST(GgufHostileTest, BoolNotZeroOrOne) {
  ExpectRefused(Bytes().Header(0, 1).Key("flag", kBool).U8(2),
                "metadata key \"flag\": bool value 2 is neither 0 nor 1");
  ExpectRefused(Bytes().Header(0, 1).Key("flags", kArray).Array(kBool, 3).U8(0).U8(1).U8(255),
                "metadata key \"flags\": bool item 2 is 255");
}

TEST(GgufHostileTest, DuplicateKey) {
  ExpectRefused(Bytes().Header(0, 2).Key("a.b", kU8).U8(1).Key("a.b", kU32).U32(2),
                "metadata key \"a.b\" appears twice");
}

TEST(GgufHostileTest, KeysAreEscapedInMessages) {
  ExpectRefused(Bytes().Header(0, 2).Key("bad\nkey\xff", kU8).U8(1).Key("bad\nkey\xff", kU8).U8(1),
                "metadata key \"bad\\nkey\\xff\" appears twice");
}

TEST(GgufHostileTest, EmptyKey) {
  ExpectRefused(Bytes().Header(0, 1).Key("", kU8).U8(1), "metadata entry 0 has an empty key");
}

TEST(GgufHostileTest, KeyTooLong) {
  ExpectRefused(Bytes().Header(0, 1).Key(std::string(65536, 'k'), kU8).U8(1),
                "the key is 65536 bytes long (at most 65535)");
}

TEST(GgufHostileTest, TruncatedValue) {
  ExpectRefused(Bytes().Header(0, 1).Key("n", kU64).U32(5),
                "truncated: metadata key \"n\": the uint64 value needs 8 bytes at offset 37");
}

TEST(GgufHostileTest, BadAlignment) {
  ExpectRefused(Bytes().Header(0, 1).Key("general.alignment", kU32).U32(48),
                "metadata key \"general.alignment\": expected a uint32 power of two, found "
                "uint32 48");
  ExpectRefused(Bytes().Header(0, 1).Key("general.alignment", kU32).U32(0), "found uint32 0");
  ExpectRefused(Bytes().Header(0, 1).Key("general.alignment", kU64).U64(64), "found uint64 64");
  ExpectRefused(Bytes().Header(0, 1).Key("general.alignment", kString).Str("32"),
                "found string \"32\"");
}

// ---------------------------------------------------------------------------
// Hostile files: tensors
// ---------------------------------------------------------------------------

// One tensor info, then 64 bytes of data after the padding.
Bytes OneTensor(std::string_view name, const std::vector<uint64_t>& dims, uint32_t type,
                uint64_t offset) {
  Bytes b;
  b.Header(1, 0).TensorInfo(name, dims, type, offset).PadTo(32).Raw(std::string(64, '\0'));
  return b;
}

TEST(GgufHostileTest, TooManyDims) {
  ExpectRefused(OneTensor("t", {1, 1, 1, 1, 1}, kTypeF32, 0),
                "tensor \"t\": n_dims is 5 (at most 4)");
}

TEST(GgufHostileTest, DimsOverflow) {
  ExpectRefused(OneTensor("t", {uint64_t{1} << 32, uint64_t{1} << 32}, kTypeF32, 0),
                "tensor \"t\": dims [4294967296, 4294967296] hold more than 2^63 - 1 elements");
  ExpectRefused(OneTensor("t", {UINT64_MAX}, kTypeF32, 0),
                "tensor \"t\": dims [18446744073709551615] hold a dimension over 2^63 - 1");
  // Elements that fit, bytes that do not.
  ExpectRefused(OneTensor("t", {uint64_t{1} << 62}, kTypeF32, 0),
                "tensor \"t\": dims [4611686018427387904]: 4611686018427387904 elements of F32 "
                "take more than 2^63 bytes");
}

TEST(GgufHostileTest, UnknownTensorType) {
  ExpectRefused(OneTensor("t", {32}, 4, 0), "tensor \"t\": unknown ggml type id 4");
  ExpectRefused(OneTensor("t", {32}, 0xFFFFFFFF, 0), "unknown ggml type id 4294967295");
}

TEST(GgufHostileTest, RowNotWholeBlocks) {
  ExpectRefused(OneTensor("t", {33, 2}, kTypeQ4_0, 0),
                "tensor \"t\": a row of 33 elements (dims [33, 2]) is not a whole number of Q4_0 "
                "blocks of 32");
}

TEST(GgufHostileTest, OffsetNotAligned) {
  ExpectRefused(OneTensor("t", {4}, kTypeF32, 4),
                "tensor \"t\": offset 4 is not a multiple of the alignment 32");
}

TEST(GgufHostileTest, DataBeyondTheFile) {
  ExpectRefused(OneTensor("t", {17}, kTypeF32, 0),
                "tensor \"t\": its 68 bytes of F32 at offset 0 (file offset 64 + 0) end beyond "
                "the file's 128 bytes");
  ExpectRefused(OneTensor("t", {4}, kTypeF32, uint64_t{1} << 63),
                "at offset 9223372036854775808 (file offset 64 + 9223372036854775808) end beyond");
  ExpectRefused(OneTensor("t", {4}, kTypeF32, UINT64_MAX - 31), "end beyond the file's");
}

TEST(GgufHostileTest, TensorsOverlap) {
  Bytes b;
  b.Header(2, 0).TensorInfo("a", {16}, kTypeF32, 0).TensorInfo("b", {8}, kTypeF16, 32);
  b.PadTo(32).Raw(std::string(64, '\0'));
  ExpectRefused(b,
                "tensor \"b\" (bytes [32, 48) of the data section) overlaps tensor \"a\" "
                "(bytes [0, 64))");
}

TEST(GgufHostileTest, DuplicateTensorName) {
  Bytes b;
  b.Header(2, 0).TensorInfo("w", {4}, kTypeF32, 0).TensorInfo("w", {4}, kTypeF32, 32);
  b.PadTo(32).Raw(std::string(64, '\0'));
  ExpectRefused(b, "tensor \"w\" appears twice");
}

TEST(GgufHostileTest, TensorNameTooLong) {
  ExpectRefused(OneTensor(std::string(65, 'n'), {4}, kTypeF32, 0),
                "the name is 65 bytes long (at most 64)");
}

TEST(GgufHostileTest, TruncatedTensorInfo) {
  Bytes b;
  b.Header(1, 0).Str("tensor_name").U32(2).U64(4);
  ExpectRefused(b, "truncated: tensor \"tensor_name\": dimension 1 needs 8 bytes at offset 55");
}

TEST(GgufHostileTest, EveryTruncationIsRefused) {
  const Bytes full = ValidFile();
  for (size_t n = 0; n < full.size(); ++n) {
    auto file = GgufFile::Open(Write(full.str().substr(0, n)));
    ASSERT_FALSE(file.ok()) << "a prefix of " << n << " of " << full.size() << " bytes opened";
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
  }
}

TEST(GgufHostileTest, MissingFile) {
  auto file = GgufFile::Open(::testing::TempDir() + "/no_such.gguf");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
}

// ---------------------------------------------------------------------------
// Types and dequantization
// ---------------------------------------------------------------------------

TEST(GgmlTypeTest, NamesAndLayouts) {
  EXPECT_STREQ(GgmlTypeName(GgmlType::kQ4_K), "Q4_K");
  EXPECT_EQ(DescribeGgmlTypeId(12), "Q4_K (id 12)");
  EXPECT_EQ(DescribeGgmlTypeId(4), "id 4 (unknown)");
  EXPECT_EQ(DescribeGgmlTypeId(16), "IQ2_XXS (id 16)");
  EXPECT_FALSE(FindGgmlType(5).has_value());
  struct Layout {
    GgmlType type;
    int64_t block_size, block_bytes;
  };
  for (const Layout& l : std::vector<Layout>{{GgmlType::kF32, 1, 4},
                                             {GgmlType::kF16, 1, 2},
                                             {GgmlType::kBF16, 1, 2},
                                             {GgmlType::kQ4_0, 32, 18},
                                             {GgmlType::kQ4_1, 32, 20},
                                             {GgmlType::kQ5_0, 32, 22},
                                             {GgmlType::kQ5_1, 32, 24},
                                             {GgmlType::kQ8_0, 32, 34},
                                             {GgmlType::kQ2_K, 256, 84},
                                             {GgmlType::kQ3_K, 256, 110},
                                             {GgmlType::kQ4_K, 256, 144},
                                             {GgmlType::kQ5_K, 256, 176},
                                             {GgmlType::kQ6_K, 256, 210}}) {
    const GgmlTypeInfo& info = GetGgmlTypeInfo(l.type);
    EXPECT_EQ(info.block_size, l.block_size) << info.name;
    EXPECT_EQ(info.block_bytes, l.block_bytes) << info.name;
    EXPECT_TRUE(GgmlTypeCanDequantize(l.type)) << info.name;
    EXPECT_EQ(*GgmlRowBytes(l.type, 3 * l.block_size), 3 * l.block_bytes) << info.name;
  }
  EXPECT_FALSE(GgmlTypeCanDequantize(GgmlType::kIQ2_XXS));
  EXPECT_TRUE(Contains(GgmlRowBytes(GgmlType::kQ4_K, 100).status().message(),
                       "100 elements of Q4_K are not a whole number of blocks of 256"));
  EXPECT_FALSE(GgmlRowBytes(GgmlType::kF32, -1).ok());
}

TEST(DequantizeTest, RefusesWhatItCannotDo) {
  float out[256];
  const uint8_t in[256] = {};
  const absl::Status unsupported = DequantizeToFloat(GgmlType::kIQ2_XXS, in, 256, out);
  EXPECT_EQ(unsupported.code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(Contains(unsupported.message(), "IQ2_XXS (id 16) is not supported"));
  EXPECT_TRUE(Contains(DequantizeToFloat(GgmlType::kQ8_0, in, 31, out).message(),
                       "31 elements of Q8_0 are not a whole number of blocks of 32"));
}

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

TEST(DequantizeTest, HalfToFloatIsExact) {
  EXPECT_EQ(HalfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xFBFF), -65504.0f);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfToFloat(0x03FF), 1023 * std::ldexp(1.0f, -24));
  EXPECT_EQ(Bits(HalfToFloat(0x8000)), 0x80000000u);
  EXPECT_EQ(Bits(HalfToFloat(0x7C00)), 0x7F800000u);
  // A signalling NaN stays signalling, payload kept (as numpy converts it).
  EXPECT_EQ(Bits(HalfToFloat(0x7C01)), 0x7F802000u);
  EXPECT_EQ(Bits(HalfToFloat(0xFE00)), 0xFFC00000u);
}

TEST(DequantizeTest, Bf16KeepsBits) {
  const uint8_t in[4] = {0x01, 0x7F, 0x80, 0x3F};  // 0x7F01 (a NaN), 0x3F80 (1.0)
  float out[2];
  ASSERT_TRUE(DequantizeToFloat(GgmlType::kBF16, in, 2, out).ok());
  EXPECT_EQ(Bits(out[0]), 0x7F010000u);
  EXPECT_EQ(out[1], 1.0f);
}

TEST(DequantizeTest, Q4_1) {
  Bytes b;
  b.U16(0x3800).U16(0xBC00);  // d 0.5, m -1
  for (int i = 0; i < 16; ++i) b.U8(static_cast<uint8_t>(i | (15 - i) << 4));
  float out[32];
  ASSERT_TRUE(DequantizeToFloat(GgmlType::kQ4_1, b.str().data(), 32, out).ok());
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(out[i], 0.5f * i - 1) << i;
    EXPECT_EQ(out[16 + i], 0.5f * (15 - i) - 1) << i;
  }
}

TEST(DequantizeTest, Q5_0TakesTheFifthBitFromQh) {
  Bytes b;
  b.U16(0x3C00).U32(0x80000001u);  // fifth bit of elements 0 and 31
  for (int i = 0; i < 16; ++i) b.U8(0);
  float out[32];
  ASSERT_TRUE(DequantizeToFloat(GgmlType::kQ5_0, b.str().data(), 32, out).ok());
  EXPECT_EQ(out[0], 0.0f);    // 16 - 16
  EXPECT_EQ(out[1], -16.0f);  // 0 - 16
  EXPECT_EQ(out[31], 0.0f);
}

TEST(DequantizeTest, Q2_K) {
  Bytes b;
  for (int g = 0; g < 16; ++g) b.U8(static_cast<uint8_t>(g | 1 << 4));  // scale g, min 1
  for (int i = 0; i < 64; ++i) b.U8(0xE4);                              // 2-bit fields 0, 1, 2, 3
  b.U16(0x3C00).U16(0x3800);                                            // d 1, dmin 0.5
  float out[256];
  ASSERT_TRUE(DequantizeToFloat(GgmlType::kQ2_K, b.str().data(), 256, out).ok());
  for (int e = 0; e < 256; ++e) {
    const int q = (e / 32) % 4, scale = e / 16;
    EXPECT_EQ(out[e], static_cast<float>(scale * q) - 0.5f) << e;
  }
}

TEST(DequantizeTest, Q4_K) {
  Bytes b;
  b.U16(0x3C00).U16(0x0000);  // d 1, dmin 0
  // Sub-block scales j + 1: j < 4 in bytes 0..3, j >= 4 in the low nibbles
  // of bytes 8..11; mins 0.
  for (int j = 0; j < 4; ++j) b.U8(static_cast<uint8_t>(j + 1));
  for (int j = 0; j < 4; ++j) b.U8(0);
  for (int j = 4; j < 8; ++j) b.U8(static_cast<uint8_t>(j + 1));
  for (int i = 0; i < 128; ++i) b.U8(0x21);  // low nibble 1, high nibble 2
  float out[256];
  ASSERT_TRUE(DequantizeToFloat(GgmlType::kQ4_K, b.str().data(), 256, out).ok());
  for (int e = 0; e < 256; ++e) {
    const int j = e / 32;
    EXPECT_EQ(out[e], static_cast<float>((j + 1) * (j % 2 ? 2 : 1))) << e;
  }
}

TEST(DequantizeTest, Q6_K) {
  Bytes b;
  b.Raw(std::string(128 + 64, '\0'));  // every q 0 - 32
  for (int g = 0; g < 16; ++g) b.U8(static_cast<uint8_t>(g - 8));
  b.U16(0x3C00);
  float out[256];
  ASSERT_TRUE(DequantizeToFloat(GgmlType::kQ6_K, b.str().data(), 256, out).ok());
  for (int e = 0; e < 256; ++e) EXPECT_EQ(out[e], static_cast<float>((e / 16 - 8) * -32)) << e;
}

}  // namespace
}  // namespace coalesce::engine
