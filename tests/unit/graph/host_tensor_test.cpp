// HostTensor element access and safetensors files: values survive storage
// exactly in every dtype, stores round once (never double-rounding through
// f32), and every malformed file gives an error naming the file and tensor.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <vector>
#include <unistd.h>

#include <gtest/gtest.h>

#include "metile/graph.h"
#include "metile/io.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using testing::error_of;

TEST(TensorSpecTest, CountsBytesRowsAndText) {
  const TensorSpec spec({3, 4, 5}, DType::bf16);
  EXPECT_EQ(spec.rank(), 3);
  EXPECT_EQ(spec.element_count(), 60);
  EXPECT_EQ(spec.bytes(), 120);
  EXPECT_EQ(spec.row_length(), 5);
  EXPECT_EQ(spec.row_count(), 12);
  EXPECT_EQ(spec.to_string(), "bf16[3, 4, 5]");
  const TensorSpec scalar({}, DType::f32);
  EXPECT_EQ(scalar.element_count(), 1);
  EXPECT_EQ(scalar.row_count(), 1);
  EXPECT_EQ(scalar.to_string(), "f32[]");
}

TEST(HostTensorTest, ValuesRepresentableInEachDtypeSurviveExactly) {
  std::mt19937 random(static_cast<std::uint32_t>(testing::test_seed("HostTensorTest.ValuesRepresentableInEachDtypeSurviveExactly")));
  std::uniform_int_distribution<std::uint32_t> bits16(0, 0xffff);
  std::uniform_int_distribution<std::int64_t> i32_values(INT32_MIN, INT32_MAX);
  std::uniform_int_distribution<std::int64_t> u32_values(0, UINT32_MAX);
  std::uniform_int_distribution<int> i8_values(-128, 127);
  std::uniform_int_distribution<int> u8_values(0, 255);
  std::uniform_real_distribution<float> floats(-1e6f, 1e6f);
  const std::int64_t count = 4096;
  for (DType dtype : {DType::f16, DType::bf16, DType::f32, DType::i8, DType::u8, DType::i32, DType::u32}) {
    std::vector<double> values;
    for (std::int64_t index = 0; index < count; ++index) {
      double value = 0;
      switch (dtype) {
        case DType::f16: {
          value = f16_bits_to_f32(static_cast<std::uint16_t>(bits16(random)));
          if (std::isnan(value)) value = 1.5;
          break;
        }
        case DType::bf16: {
          value = bf16_bits_to_f32(static_cast<std::uint16_t>(bits16(random)));
          if (std::isnan(value)) value = -2.25;
          break;
        }
        case DType::f32: value = floats(random); break;
        case DType::i8: value = i8_values(random); break;
        case DType::u8: value = u8_values(random); break;
        case DType::i32: value = static_cast<double>(i32_values(random)); break;
        case DType::u32: value = static_cast<double>(u32_values(random)); break;
      }
      values.push_back(value);
    }
    const HostTensor tensor = HostTensor::from_values(TensorSpec({64, 64}, dtype), values);
    ASSERT_EQ(tensor.bytes().size(), static_cast<std::size_t>(count) * dtype_size(dtype));
    EXPECT_EQ(tensor.to_values(), values) << dtype_name(dtype);
  }
}

TEST(HostTensorTest, StoredBitsAreTheDtypeLayout) {
  HostTensor tensor(TensorSpec({2}, DType::f16));
  tensor.store(0, 1.0);
  tensor.store(1, -2.0);
  std::uint16_t bits[2];
  std::memcpy(bits, tensor.bytes().data(), sizeof bits);
  EXPECT_EQ(bits[0], 0x3c00);
  EXPECT_EQ(bits[1], 0xc000);
  HostTensor integers(TensorSpec({1}, DType::i32));
  integers.store(0, -5.0);
  std::int32_t stored;
  std::memcpy(&stored, integers.bytes().data(), sizeof stored);
  EXPECT_EQ(stored, -5);
}

TEST(HostTensorTest, StoreRoundsOnceFromDouble) {
  // Just above the midpoint between f16 1.0 and 1.0 + 2^-10: a double->f32->f16
  // path would first land on the midpoint and then tie down to 1.0.
  const double above_midpoint = 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40);
  HostTensor half(TensorSpec({2}, DType::f16));
  half.store(0, above_midpoint);
  EXPECT_EQ(half.at(0), 1.0 + std::ldexp(1.0, -10));
  half.store(1, 1.0 + std::ldexp(1.0, -11));  // the exact midpoint ties to even: 1.0
  EXPECT_EQ(half.at(1), 1.0);
  HostTensor brain(TensorSpec({1}, DType::bf16));
  brain.store(0, 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -45));
  EXPECT_EQ(brain.at(0), 1.0 + std::ldexp(1.0, -7));
  HostTensor integers(TensorSpec({4}, DType::u8));
  integers.store(0, 300.0);
  integers.store(1, -4.0);
  integers.store(2, 2.5);
  integers.store(3, 3.5);
  EXPECT_EQ(integers.to_values(), (std::vector<double>{255, 0, 2, 4}));
}

TEST(HostTensorTest, FromValuesChecksTheCount) {
  const std::vector<double> values{1, 2, 3};
  EXPECT_EQ(error_of([&] { HostTensor::from_values(TensorSpec({2, 2}, DType::f32), values); }),
            "tensor f32[2, 2] needs 4 values, got 3");
  EXPECT_THROW(HostTensor(TensorSpec({2}, DType::f32)).at(2), std::out_of_range);
}

TEST(HostTensorTest, FromBytesTakesExactlyTheSpecsBytes) {
  std::mt19937_64 random(testing::test_seed("HostTensorTest.FromBytesTakesExactlyTheSpecsBytes"));
  std::vector<std::byte> bytes(24);
  for (std::byte& byte : bytes) byte = static_cast<std::byte>(random());
  const HostTensor tensor = HostTensor::from_bytes(TensorSpec({3, 4}, DType::bf16), bytes);
  EXPECT_EQ(tensor.spec(), TensorSpec({3, 4}, DType::bf16));
  EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), tensor.bytes().begin(), tensor.bytes().end()));
  EXPECT_EQ(error_of([&] { HostTensor::from_bytes(TensorSpec({5}, DType::f32), bytes); }),
            "tensor f32[5] takes 20 bytes, not 24");
  EXPECT_EQ(error_of([&] { HostTensor::from_bytes(TensorSpec({-1}, DType::f32), {}); }),
            "tensor f32[-1] has a negative dimension");
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    directory_ = std::filesystem::temp_directory_path() /
                 ("metile_graph_test_" + std::to_string(::getpid()) + "_" +
                  ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(directory_);
  }
  void TearDown() override { std::filesystem::remove_all(directory_); }

  // A file with the given header text and data bytes; header_length overrides the length field.
  std::filesystem::path raw_file(const std::string& header, std::size_t data_bytes,
                                 std::optional<std::uint64_t> header_length = std::nullopt) {
    const std::filesystem::path path = directory_ / "raw.safetensors";
    std::ofstream stream(path, std::ios::binary);
    std::uint64_t length = header_length.value_or(header.size());
    for (int byte = 0; byte < 8; ++byte) stream.put(static_cast<char>((length >> (8 * byte)) & 0xff));
    stream << header;
    for (std::size_t byte = 0; byte < data_bytes; ++byte) stream.put(static_cast<char>(byte * 7 + 1));
    return path;
  }

  std::filesystem::path directory_;
};

TEST_F(SafetensorsTest, RoundTripsEveryDtype) {
  std::mt19937 random(static_cast<std::uint32_t>(testing::test_seed("SafetensorsTest.RoundTripsEveryDtype")));
  std::uniform_real_distribution<double> values(-100.0, 100.0);
  TensorMap tensors;
  int shape_seed = 1;
  for (DType dtype : {DType::f16, DType::bf16, DType::f32, DType::i8, DType::u8, DType::i32, DType::u32}) {
    TensorSpec spec({shape_seed, 3}, dtype);
    std::vector<double> data;
    for (std::int64_t index = 0; index < spec.element_count(); ++index) data.push_back(values(random));
    tensors.emplace(std::string("tensor_") + std::string(dtype_name(dtype)), HostTensor::from_values(spec, data));
    shape_seed += 2;
  }
  tensors.emplace("scalar", HostTensor::from_values(TensorSpec({}, DType::f32), std::vector<double>{3.25}));
  const std::filesystem::path path = directory_ / "all.safetensors";
  write_safetensors(path, tensors);
  EXPECT_EQ(read_safetensors(path), tensors);
  // No temporary file is left beside the result.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(directory_), std::filesystem::directory_iterator()), 1);
  // The header length is a multiple of 8 so the data is aligned.
  std::ifstream stream(path, std::ios::binary);
  unsigned char length[8];
  stream.read(reinterpret_cast<char*>(length), 8);
  EXPECT_EQ(length[0] % 8, 0);
}

TEST_F(SafetensorsTest, ReadsMetadataAndIgnoresIt) {
  const auto path = raw_file(R"({"__metadata__": {"format": "pt"}, "w": {"dtype": "U8", "shape": [2, 2], "data_offsets": [0, 4]}})", 4);
  const TensorMap tensors = read_safetensors(path);
  ASSERT_EQ(tensors.size(), 1u);
  EXPECT_EQ(tensors.at("w").to_values(), (std::vector<double>{1, 8, 15, 22}));
}

TEST_F(SafetensorsTest, RejectsMalformedFiles) {
  const std::string file = (directory_ / "raw.safetensors").string();
  std::filesystem::path path = directory_ / "raw.safetensors";
  {
    std::ofstream stream(path, std::ios::binary);
    stream << "abc";
  }
  EXPECT_EQ(error_of([&] { read_safetensors(path); }),
            file + ": too short for a safetensors file (3 bytes, the header length alone takes 8)");

  path = raw_file("{}", 0, 1000);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }),
            file + ": header length 1000 runs past the end of the file (10 bytes)");

  path = raw_file("{\"w\": [", 0);
  EXPECT_NE(error_of([&] { read_safetensors(path); }).find(file + ": header: invalid JSON"), std::string::npos);

  path = raw_file("[1, 2]", 0);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }), file + ": header must begin with '{', not byte 0x5B");

  path = raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", 12);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }), file + ": tensor 'b': data overlaps tensor 'a'");

  // The data area is covered exactly, as the safetensors package holds it: no unused bytes before the
  // first tensor, between two or after the last (a 1 TiB sparse tail loaded before).
  auto refused = [&](const std::string& header, std::size_t data_bytes) {
    const std::filesystem::path written = raw_file(header, data_bytes);
    return error_of([&] { read_safetensors(written); });
  };
  for (const auto& [header, data_bytes, message] : std::vector<std::tuple<std::string, std::size_t, std::string>>{
           {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}})", 16,
            "tensor 'b': data begins at byte 12 of the data area, 4 unused bytes after tensor 'a' (the format has no gaps)"},
           {R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8,
            "tensor 'a': data begins at byte 4 of the data area, 4 unused bytes after its start (the format has no gaps)"},
           {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 9,
            "1 bytes after the last tensor's data (the data area holds 9 bytes, its tensors 8)"},
           {"{}", 3, "3 bytes after the last tensor's data (the data area holds 3 bytes, its tensors 0)"}}) {
    EXPECT_EQ(refused(header, data_bytes), file + ": " + message);
  }
  // Empty tensors take no bytes: one may sit anywhere in the order.
  path = raw_file(R"({"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
                      "b": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})", 4);
  EXPECT_EQ(read_safetensors(path).at("b").to_values(), (std::vector<double>{1, 8, 15, 22}));

  path = raw_file(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }),
            file + ": tensor 'a': data_offsets end at byte 16 but the file holds only 8 data bytes");

  path = raw_file(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 8);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }), file + ": tensor 'a': data_offsets [8, 4] end before they begin");

  path = raw_file(R"({"a": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})", 8);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }),
            file + ": tensor 'a': dtype 'F64' is not one metile reads (metile reads F16, BF16, F32, I8, U8, I32 and U32)");

  // A dtype of the format metile does not read is still checked: its bytes must match its shape.
  path = raw_file(R"({"a": {"dtype": "I64", "shape": [2], "data_offsets": [0, 8]}})", 8);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }), file + ": tensor 'a': I64[2] needs 16 bytes but data_offsets span 8");

  // The format's newer dtypes: the sub-byte ones (FP4, FP6) fill whole bytes (F4[3] is 12 bits, F6_E2M3[4]
  // three bytes), and a well-formed one is refused only as one metile does not read.
  for (const auto& [header, message] : {
           std::pair{R"({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}})", "F4[3] has 12 bits, not whole bytes"},
           std::pair{R"({"a": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 4]}})",
                     "F6_E2M3[4] needs 3 bytes but data_offsets span 4"},
           std::pair{R"({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}})",
                     "dtype 'C64' is not one metile reads (metile reads F16, BF16, F32, I8, U8, I32 and U32)"}}) {
    path = raw_file(header, 8);
    EXPECT_EQ(error_of([&] { read_safetensors(path); }), file + ": tensor 'a': " + message);
  }

  path = raw_file(R"({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 8]}})", 8);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }),
            file + ": tensor 'a': unknown dtype 'F99' (metile reads F16, BF16, F32, I8, U8, I32 and U32)");

  path = raw_file(R"({"a": {"dtype": "F16", "shape": [2, 2], "data_offsets": [0, 6]}})", 8);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }),
            file + ": tensor 'a': f16[2, 2] needs 8 bytes but data_offsets span 6");

  path = raw_file(R"({"a": {"dtype": "F16", "shape": [-2], "data_offsets": [0, 4]}})", 8);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }),
            file + ": tensor 'a': shape [-2] has a non-integer or negative dimension");

  path = raw_file(R"({"a": {"dtype": "F16", "shape": [2]}})", 8);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }), file + ": tensor 'a': header entry has no 'data_offsets'");

  // One name twice: the last entry silently won (the first one's bytes were never read).
  path = raw_file(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                      "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }), file + ": header: invalid JSON: the key \"a\" appears twice in one object");

  // A name holding a NUL (JSON's \u0000): the message ended at it (what() is a C string), so the
  // reason after it was lost: "tensor 'b" and nothing more. The NUL is spelled \x00.
  path = raw_file(R"({"b\u0000ias": {"dtype": "F99", "shape": [1], "data_offsets": [0, 8]}})", 8);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }),
            file + ": tensor 'b\\x00ias': unknown dtype 'F99' (metile reads F16, BF16, F32, I8, U8, I32 and U32)");

  // The format's header rules, as the safetensors package enforces them: it begins with '{' (a byte
  // order mark or a leading space was accepted: nlohmann skips both), only spaces pad it (NULs
  // after the object were accepted: nlohmann's lexer ends the input at a NUL, whatever follows),
  // and __metadata__ maps names to strings.
  const std::string tensor = R"("w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]})";
  path = raw_file("\xEF\xBB\xBF{" + tensor + "}", 2);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }), file + ": header must begin with '{', not byte 0xEF (a UTF-8 byte order mark)");
  path = raw_file(" {" + tensor + "}", 2);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }), file + ": header must begin with '{', not byte 0x20");
  path = raw_file("{" + tensor + std::string("}\0\0\0", 4), 2);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }),
            file + ": header: invalid JSON: a NUL byte at byte " + std::to_string(tensor.size() + 2) +
                " (JSON has none; a string spells it \\u0000)");
  path = raw_file("{" + tensor + std::string("}\0, \"x\": 1", 11), 2);  // the NUL hid the rest
  EXPECT_NE(error_of([&] { read_safetensors(path); }).find("a NUL byte"), std::string::npos);
  path = raw_file(R"({"__metadata__": {"format": 1}, )" + tensor + "}", 2);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }),
            file + ": __metadata__ must map names to strings (the format's rule), not {\"format\":1}");
  path = raw_file(R"({"__metadata__": "pt", )" + tensor + "}", 2);
  EXPECT_EQ(error_of([&] { read_safetensors(path); }),
            file + ": __metadata__ must map names to strings (the format's rule), not \"pt\"");
  // What the format allows reads: spaces after the object, an empty __metadata__.
  path = raw_file(R"({"__metadata__": {}, )" + tensor + "}   ", 2);
  EXPECT_EQ(read_safetensors(path).size(), 1u);

  const std::string missing = (directory_ / "missing.safetensors").string();
  EXPECT_EQ(error_of([&] { read_safetensors(missing); }), missing + ": cannot open the file: No such file or directory");
}

// Names in a safetensors header are JSON strings, so UTF-8: any UTF-8 name round-trips (a right-to-left
// override, an emoji, the empty name, an escaped quote and NUL); a name that is not UTF-8 is refused
// before anything is written. dump_json wrote it with U+FFFD in place of the bad byte, so the tensor
// read back under another name, and two such names made one key twice, a file the reader refuses.
TEST_F(SafetensorsTest, NamesMustBeUtf8AndRoundTripWhenTheyAre) {
  std::mt19937 random(static_cast<std::uint32_t>(testing::test_seed("SafetensorsTest.NamesMustBeUtf8AndRoundTripWhenTheyAre")));
  std::uniform_real_distribution<double> values(-100.0, 100.0);
  const auto tensor = [&](std::int64_t count) {
    std::vector<double> data(static_cast<std::size_t>(count));
    for (double& value : data) value = values(random);
    return HostTensor::from_values(TensorSpec({count}, DType::f32), data);
  };
  TensorMap good;
  for (const std::string& name : {std::string("\xe2\x80\xae\xf0\x9f\x98\x80 \xc3\xa9"), std::string(),
                                 std::string("nul\0in", 6), std::string("quote\"back\\slash"),
                                 std::string(70000, 'n')}) {
    good.emplace(name, tensor(3));
  }
  const std::filesystem::path path = directory_ / "names.safetensors";
  write_safetensors(path, good);
  EXPECT_EQ(read_safetensors(path), good);

  for (const std::vector<std::string>& names :
       {std::vector<std::string>{"a\xff"}, std::vector<std::string>{"a\xff", "a\xfe"},
        std::vector<std::string>{"ok", "\xc3"}, std::vector<std::string>{"\xed\xa0\x80"}}) {
    TensorMap bad;
    for (const std::string& name : names) bad.emplace(name, tensor(2));
    const std::filesystem::path bad_path = directory_ / "bad.safetensors";
    const std::string message = error_of([&] { write_safetensors(bad_path, bad); });
    EXPECT_NE(message.find("': a safetensors name must be UTF-8"), std::string::npos) << message;
    EXPECT_EQ(message.find('\xff'), std::string::npos) << "raw bytes in the message";
    EXPECT_FALSE(std::filesystem::exists(bad_path)) << message;
  }
}

// The writer keeps the reader's limit on the header (100 MiB): a header one byte past it is refused
// before a byte is written (it was written, a file the reader then refused).
TEST_F(SafetensorsTest, HeaderPastTheReadersLimitIsNotWritten) {
  // {"N":{"data_offsets":[0,1],"dtype":"U8","shape":[1]}}: the frame plus the name, padded to 8.
  const std::string frame = R"({"":{"data_offsets":[0,1],"dtype":"U8","shape":[1]}})";
  TensorMap tensors;
  tensors.emplace(std::string(kMaximumSafetensorsHeaderBytes - frame.size() + 1, 'n'),
                  HostTensor::from_values(TensorSpec({1}, DType::u8), std::vector<double>{7}));
  const std::filesystem::path path = directory_ / "past.safetensors";
  EXPECT_EQ(error_of([&] { write_safetensors(path, tensors); }),
            path.string() + ": header of " + std::to_string(kMaximumSafetensorsHeaderBytes + 8) +
                " bytes is above the limit of " + std::to_string(kMaximumSafetensorsHeaderBytes) + " bytes");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(directory_), std::filesystem::directory_iterator()), 0);
}

TEST_F(SafetensorsTest, FailedWriteLeavesNoFile) {
  const std::filesystem::path path = directory_ / "no_such_directory" / "out.safetensors";
  TensorMap tensors;
  tensors.emplace("x", HostTensor(TensorSpec({2}, DType::f32)));
  EXPECT_THROW(write_safetensors(path, tensors), InputError);
  EXPECT_FALSE(std::filesystem::exists(path));
}

}  // namespace
// Published FNV-1a 64 test vectors (the offset basis for "", then "a" and "foobar"); the same
// bytes through the span overload; a seed derives a different hash.
TEST(Fnv1a64Test, MatchesThePublishedVectors) {
  EXPECT_EQ(fnv1a_64(std::string_view("")), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a_64(std::string_view("a")), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a_64(std::string_view("foobar")), 0x85944171f73967e8ull);
  const std::string text = "summed";
  EXPECT_EQ(fnv1a_64(std::as_bytes(std::span<const char>(text.data(), text.size()))), fnv1a_64(text));
  EXPECT_NE(fnv1a_64(text, 1), fnv1a_64(text));
}

}  // namespace metile
