// The GGUF container (llama.cpp's model files, versions 2 and 3), read by
// its bytes: header, typed metadata, tensor directory and the aligned data
// section. Every count is checked against the bytes that must hold it
// before anything is allocated or indexed; a malformed file is a
// kvq::Error naming what is wrong and where.
//
// Layout (little-endian): "GGUF", u32 version, u64 tensor count, u64
// metadata count; metadata: string key, u32 value type, value (strings are
// u64 length + bytes; arrays u32 element type + u64 count + elements);
// tensors: string name, u32 dims (1..4), u64 ne[dims] (ne[0] the fastest),
// u32 ggml type, u64 offset into the data section, which starts at the next
// multiple of general.alignment (default 32) after the directory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace kvq::model {

enum class GgufValueType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

// ggml tensor types: "F32", "Q4_K", ... or "type N" for an id kvq does not
// know (the ones it reads: kvq/ggml_weights.h).
std::string ggml_type_name(uint32_t type);

struct GgufValue {
  GgufValueType type = GgufValueType::kU8;
  // Scalars: the value in the widest field of its kind.
  uint64_t u = 0;
  int64_t i = 0;
  double f = 0;
  std::string s;  // kString
  // kArray: the element type, count and where the elements start in the
  // file (read on demand through GgufFile's array accessors).
  GgufValueType elem = GgufValueType::kU8;
  uint64_t count = 0;
  size_t offset = 0;
};

struct GgufTensor {
  std::string name;
  std::vector<uint64_t> ne;  // ne[0] is the fastest dimension
  uint32_t type = 0;
  uint64_t offset = 0;       // within the data section
  uint64_t bytes = 0;
  uint64_t elements() const;
};

class GgufFile {
 public:
  // Parses `size` bytes at `data` (which must outlive the object); `what`
  // names the file in errors. Throws kvq::Error.
  GgufFile(const uint8_t* data, size_t size, std::string what);
  static bool has_magic(const uint8_t* data, size_t size);

  uint32_t version() const { return version_; }
  const std::string& what() const { return what_; }
  const std::map<std::string, GgufValue>& metadata() const { return kv_; }
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  const GgufValue* find(const std::string& key) const;
  const GgufTensor* tensor(const std::string& name) const;
  const uint8_t* tensor_data(const GgufTensor& t) const { return data_ + data_start_ + t.offset; }

  // Typed metadata: an absent key gives nullopt, a key of another type a
  // kvq::Error naming the key, its type and the expected one. Integers
  // accept any integer type whose value fits.
  std::optional<uint64_t> get_uint(const std::string& key) const;
  std::optional<double> get_float(const std::string& key) const;
  std::optional<std::string> get_string(const std::string& key) const;
  std::optional<bool> get_bool(const std::string& key) const;
  // Arrays: strings, floats (F32), integers (any integer type, as int64).
  std::vector<std::string> string_array(const std::string& key) const;
  std::vector<float> float_array(const std::string& key) const;
  std::vector<int64_t> int_array(const std::string& key) const;

 private:
  const GgufValue& Array(const std::string& key, const char* want) const;
  const uint8_t* data_;
  size_t size_;
  std::string what_;
  uint32_t version_ = 0;
  size_t data_start_ = 0;
  std::map<std::string, GgufValue> kv_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t> by_name_;
};

}  // namespace kvq::model
