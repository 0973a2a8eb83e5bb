// GGUF parser (gguf.h). Bytes a user hands us: every read is bounds-checked
// and every count is checked against the bytes left before it sizes
// anything.
#include "model/gguf.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kvq/error.h"

namespace kvq::model {

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint64_t kMaxAlignment = 1u << 20;

struct TypeSize {
  uint32_t id;
  const char* name;
  uint32_t block, bytes;  // elements per block, bytes per block
};
// ggml's type table (ggml.h), for sizes and names; ids 4, 5 and 31..33 were
// removed from ggml and are refused.
constexpr TypeSize kTypes[] = {
    {0, "F32", 1, 4},        {1, "F16", 1, 2},         {2, "Q4_0", 32, 18},     {3, "Q4_1", 32, 20},
    {6, "Q5_0", 32, 22},     {7, "Q5_1", 32, 24},      {8, "Q8_0", 32, 34},     {9, "Q8_1", 32, 36},
    {10, "Q2_K", 256, 84},   {11, "Q3_K", 256, 110},   {12, "Q4_K", 256, 144},  {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210},  {15, "Q8_K", 256, 292},   {16, "IQ2_XXS", 256, 66}, {17, "IQ2_XS", 256, 74},
    {18, "IQ3_XXS", 256, 98}, {19, "IQ1_S", 256, 50},  {20, "IQ4_NL", 32, 18},  {21, "IQ3_S", 256, 110},
    {22, "IQ2_S", 256, 82},  {23, "IQ4_XS", 256, 136}, {24, "I8", 1, 1},        {25, "I16", 1, 2},
    {26, "I32", 1, 4},       {27, "I64", 1, 8},        {28, "F64", 1, 8},       {29, "IQ1_M", 256, 56},
    {30, "BF16", 1, 2},      {34, "TQ1_0", 256, 54},   {35, "TQ2_0", 256, 66},
};

const TypeSize* FindType(uint32_t id) {
  for (const TypeSize& t : kTypes) {
    if (t.id == id) return &t;
  }
  return nullptr;
}

const char* ValueTypeName(uint32_t t) {
  static const char* const kNames[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32",
                                       "bool", "string", "array", "u64", "i64", "f64"};
  return t < 13 ? kNames[t] : "unknown";
}

size_t ScalarBytes(GgufValueType t) {
  switch (t) {
    case GgufValueType::kU8: case GgufValueType::kI8: case GgufValueType::kBool: return 1;
    case GgufValueType::kU16: case GgufValueType::kI16: return 2;
    case GgufValueType::kU32: case GgufValueType::kI32: case GgufValueType::kF32: return 4;
    case GgufValueType::kU64: case GgufValueType::kI64: case GgufValueType::kF64: return 8;
    default: return 0;  // string, array: variable
  }
}

bool IsInteger(GgufValueType t) {
  switch (t) {
    case GgufValueType::kU8: case GgufValueType::kI8: case GgufValueType::kU16: case GgufValueType::kI16:
    case GgufValueType::kU32: case GgufValueType::kI32: case GgufValueType::kU64: case GgufValueType::kI64:
      return true;
    default: return false;
  }
}

class Reader {
 public:
  Reader(const uint8_t* d, size_t n, const std::string& what) : d_(d), n_(n), what_(what) {}
  size_t pos() const { return off_; }
  size_t left() const { return n_ - off_; }
  void need(uint64_t bytes, const char* field) const {
    if (bytes > left()) {
      Fail("model '", what_, "': GGUF truncated: ", field, " at byte ", off_, " needs ", bytes, " bytes, ", left(),
           " left");
    }
  }
  template <typename T>
  T get(const char* field) {
    need(sizeof(T), field);
    T v;
    std::memcpy(&v, d_ + off_, sizeof(T));
    off_ += sizeof(T);
    return v;
  }
  std::string string(const char* field) {
    const uint64_t len = get<uint64_t>(field);
    need(len, field);
    std::string s(reinterpret_cast<const char*>(d_ + off_), static_cast<size_t>(len));
    off_ += static_cast<size_t>(len);
    return s;
  }
  void skip_string(const char* field) {
    const uint64_t len = get<uint64_t>(field);
    need(len, field);
    off_ += static_cast<size_t>(len);
  }
  void skip(uint64_t bytes, const char* field) {
    need(bytes, field);
    off_ += static_cast<size_t>(bytes);
  }

 private:
  const uint8_t* d_;
  size_t n_;
  size_t off_ = 0;
  const std::string& what_;
};

// A scalar of type t at r's position.
void ReadScalar(Reader& r, GgufValueType t, GgufValue& v, const char* field) {
  switch (t) {
    case GgufValueType::kU8: v.u = r.get<uint8_t>(field); v.i = static_cast<int64_t>(v.u); break;
    case GgufValueType::kBool: v.u = r.get<uint8_t>(field); v.i = static_cast<int64_t>(v.u); break;
    case GgufValueType::kI8: v.i = r.get<int8_t>(field); break;
    case GgufValueType::kU16: v.u = r.get<uint16_t>(field); v.i = static_cast<int64_t>(v.u); break;
    case GgufValueType::kI16: v.i = r.get<int16_t>(field); break;
    case GgufValueType::kU32: v.u = r.get<uint32_t>(field); v.i = static_cast<int64_t>(v.u); break;
    case GgufValueType::kI32: v.i = r.get<int32_t>(field); break;
    case GgufValueType::kU64: v.u = r.get<uint64_t>(field); v.i = static_cast<int64_t>(v.u); break;
    case GgufValueType::kI64: v.i = r.get<int64_t>(field); break;
    case GgufValueType::kF32: v.f = r.get<float>(field); break;
    case GgufValueType::kF64: v.f = r.get<double>(field); break;
    default: break;
  }
  if (t == GgufValueType::kI8 || t == GgufValueType::kI16 || t == GgufValueType::kI32 || t == GgufValueType::kI64) {
    v.u = v.i >= 0 ? static_cast<uint64_t>(v.i) : 0;
  }
}

}  // namespace

std::string ggml_type_name(uint32_t type) {
  const TypeSize* t = FindType(type);
  return t != nullptr ? t->name : "type " + std::to_string(type);
}

uint64_t GgufTensor::elements() const {
  uint64_t n = 1;
  for (uint64_t d : ne) n *= d;  // checked against overflow when parsed
  return n;
}

bool GgufFile::has_magic(const uint8_t* data, size_t size) {
  uint32_t m = 0;
  if (size >= 4) std::memcpy(&m, data, 4);
  return size >= 4 && m == kMagic;
}

GgufFile::GgufFile(const uint8_t* data, size_t size, std::string what) : data_(data), size_(size), what_(std::move(what)) {
  Reader r(data, size, what_);
  if (r.get<uint32_t>("magic") != kMagic) Fail("model '", what_, "': not a GGUF file (magic is not \"GGUF\")");
  version_ = r.get<uint32_t>("version");
  if (version_ == 1) Fail("model '", what_, "': GGUF version 1 (32-bit counts) is not supported; versions 2 and 3 are");
  if (version_ != 2 && version_ != 3) Fail("model '", what_, "': GGUF version ", version_, " is not supported (2, 3)");
  const uint64_t n_tensors = r.get<uint64_t>("tensor count");
  const uint64_t n_kv = r.get<uint64_t>("metadata count");
  // The smallest metadata entry is 8 + 4 + 1 bytes, the smallest tensor
  // entry 8 + 4 + 8 + 4 + 8: counts beyond what the file can hold are lies.
  if (n_kv > r.left() / 13) {
    Fail("model '", what_, "': GGUF metadata count ", n_kv, " cannot fit in the ", r.left(), " bytes left");
  }
  for (uint64_t k = 0; k < n_kv; ++k) {
    std::string key = r.string("a metadata key");
    GgufValue v;
    const uint32_t t = r.get<uint32_t>("a metadata type");
    if (t > 12) Fail("model '", what_, "': metadata '", key, "' has unknown value type ", t);
    v.type = static_cast<GgufValueType>(t);
    if (v.type == GgufValueType::kString) {
      v.s = r.string("a metadata string");
    } else if (v.type == GgufValueType::kArray) {
      const uint32_t et = r.get<uint32_t>("an array element type");
      if (et > 12) Fail("model '", what_, "': metadata '", key, "' is an array of unknown type ", et);
      v.elem = static_cast<GgufValueType>(et);
      if (v.elem == GgufValueType::kArray) Fail("model '", what_, "': metadata '", key, "' nests arrays (not supported)");
      v.count = r.get<uint64_t>("an array count");
      v.offset = r.pos();
      if (v.elem == GgufValueType::kString) {
        if (v.count > r.left() / 8) {
          Fail("model '", what_, "': metadata '", key, "' claims ", v.count, " strings, more than the ", r.left(),
               " bytes left can hold");
        }
        for (uint64_t i = 0; i < v.count; ++i) r.skip_string("an array string");
      } else {
        const size_t eb = ScalarBytes(v.elem);
        if (v.count > r.left() / eb) {
          Fail("model '", what_, "': metadata '", key, "' claims ", v.count, " ", ValueTypeName(et),
               " elements, more than the ", r.left(), " bytes left can hold");
        }
        r.skip(v.count * eb, "array elements");
      }
    } else {
      ReadScalar(r, v.type, v, "a metadata value");
    }
    if (!kv_.emplace(key, std::move(v)).second) Fail("model '", what_, "': metadata key '", key, "' appears twice");
  }
  uint64_t alignment = 32;
  if (const GgufValue* a = find("general.alignment")) {
    if (!IsInteger(a->type) || a->u == 0 || (a->u & (a->u - 1)) != 0 || a->u > kMaxAlignment) {
      Fail("model '", what_, "': general.alignment must be a power of two up to ", kMaxAlignment);
    }
    alignment = a->u;
  }
  if (n_tensors > r.left() / 32) {
    Fail("model '", what_, "': GGUF tensor count ", n_tensors, " cannot fit in the ", r.left(), " bytes left");
  }
  tensors_.reserve(static_cast<size_t>(n_tensors));
  for (uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensor t;
    t.name = r.string("a tensor name");
    const uint32_t nd = r.get<uint32_t>("a tensor's dimension count");
    if (nd < 1 || nd > 4) Fail("model '", what_, "': tensor '", t.name, "' has ", nd, " dimensions (1..4 expected)");
    uint64_t elems = 1;
    for (uint32_t d = 0; d < nd; ++d) {
      const uint64_t n = r.get<uint64_t>("a tensor dimension");
      if (n == 0 || n > (uint64_t{1} << 40) || elems > (uint64_t{1} << 50) / n) {
        Fail("model '", what_, "': tensor '", t.name, "' has an implausible dimension ", n);
      }
      elems *= n;
      t.ne.push_back(n);
    }
    t.type = r.get<uint32_t>("a tensor type");
    const TypeSize* ts = FindType(t.type);
    if (ts == nullptr) Fail("model '", what_, "': tensor '", t.name, "' has unknown ggml type ", t.type);
    if (t.ne[0] % ts->block != 0) {
      Fail("model '", what_, "': tensor '", t.name, "' (", ts->name, ") has ", t.ne[0], " columns, not a multiple of ",
           ts->block);
    }
    t.bytes = elems / ts->block * ts->bytes;
    t.offset = r.get<uint64_t>("a tensor offset");
    if (t.offset % alignment != 0) {
      Fail("model '", what_, "': tensor '", t.name, "' offset ", t.offset, " is not a multiple of the alignment ",
           alignment);
    }
    if (!by_name_.emplace(t.name, tensors_.size()).second) {
      Fail("model '", what_, "': tensor '", t.name, "' appears twice");
    }
    tensors_.push_back(std::move(t));
  }
  data_start_ = static_cast<size_t>((r.pos() + alignment - 1) / alignment * alignment);
  const uint64_t data_bytes = data_start_ <= size ? size - data_start_ : 0;
  for (const GgufTensor& t : tensors_) {
    if (data_start_ > size || t.offset > data_bytes || t.bytes > data_bytes - t.offset) {
      Fail("model '", what_, "': tensor '", t.name, "' (", t.bytes, " bytes at offset ", t.offset,
           ") runs past the end of the file's ", data_bytes, "-byte data section; truncated file?");
    }
  }
  // Tensors occupy disjoint bytes: aliased ones would let a small file
  // declare (and make kvq dequantise) any amount of weights.
  std::vector<const GgufTensor*> by_offset;
  for (const GgufTensor& t : tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const GgufTensor* a, const GgufTensor* b) { return a->offset < b->offset; });
  for (size_t k = 1; k < by_offset.size(); ++k) {
    const GgufTensor &a = *by_offset[k - 1], &b = *by_offset[k];
    if (b.offset < a.offset + a.bytes) {
      Fail("model '", what_, "': tensors '", a.name, "' (", a.bytes, " bytes at offset ", a.offset, ") and '", b.name,
           "' (at offset ", b.offset, ") overlap; a GGUF's tensors occupy disjoint bytes");
    }
  }
}

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

const GgufTensor* GgufFile::tensor(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

std::optional<uint64_t> GgufFile::get_uint(const std::string& key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (!IsInteger(v->type) || v->i < 0) {
    Fail("model '", what_, "': metadata '", key, "' is ", ValueTypeName(static_cast<uint32_t>(v->type)),
         (IsInteger(v->type) ? " (negative)" : ""), ", expected a non-negative integer");
  }
  return v->type == GgufValueType::kU64 ? v->u : static_cast<uint64_t>(v->i);
}

std::optional<double> GgufFile::get_float(const std::string& key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type == GgufValueType::kF32 || v->type == GgufValueType::kF64) return v->f;
  if (IsInteger(v->type)) return static_cast<double>(v->i);
  Fail("model '", what_, "': metadata '", key, "' is ", ValueTypeName(static_cast<uint32_t>(v->type)),
       ", expected a number");
}

std::optional<std::string> GgufFile::get_string(const std::string& key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type != GgufValueType::kString) {
    Fail("model '", what_, "': metadata '", key, "' is ", ValueTypeName(static_cast<uint32_t>(v->type)),
         ", expected a string");
  }
  return v->s;
}

std::optional<bool> GgufFile::get_bool(const std::string& key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type != GgufValueType::kBool && !IsInteger(v->type)) {
    Fail("model '", what_, "': metadata '", key, "' is ", ValueTypeName(static_cast<uint32_t>(v->type)),
         ", expected a bool");
  }
  return v->i != 0;
}

const GgufValue& GgufFile::Array(const std::string& key, const char* want) const {
  const GgufValue* v = find(key);
  if (v == nullptr) Fail("model '", what_, "': metadata '", key, "' is missing (", want, " array expected)");
  if (v->type != GgufValueType::kArray) {
    Fail("model '", what_, "': metadata '", key, "' is ", ValueTypeName(static_cast<uint32_t>(v->type)), ", expected ",
         want, " array");
  }
  return *v;
}

std::vector<std::string> GgufFile::string_array(const std::string& key) const {
  const GgufValue& v = Array(key, "a string");
  if (v.elem != GgufValueType::kString) {
    Fail("model '", what_, "': metadata '", key, "' is an array of ", ValueTypeName(static_cast<uint32_t>(v.elem)),
         ", expected strings");
  }
  Reader r(data_, size_, what_);
  r.skip(v.offset, "array");
  std::vector<std::string> out;
  out.reserve(static_cast<size_t>(v.count));  // bounded by the file when parsed
  for (uint64_t i = 0; i < v.count; ++i) out.push_back(r.string("an array string"));
  return out;
}

std::vector<float> GgufFile::float_array(const std::string& key) const {
  const GgufValue& v = Array(key, "an f32");
  if (v.elem != GgufValueType::kF32) {
    Fail("model '", what_, "': metadata '", key, "' is an array of ", ValueTypeName(static_cast<uint32_t>(v.elem)),
         ", expected f32");
  }
  std::vector<float> out(static_cast<size_t>(v.count));
  if (v.count > 0) std::memcpy(out.data(), data_ + v.offset, out.size() * sizeof(float));
  return out;
}

std::vector<int64_t> GgufFile::int_array(const std::string& key) const {
  const GgufValue& v = Array(key, "an integer");
  if (!IsInteger(v.elem)) {
    Fail("model '", what_, "': metadata '", key, "' is an array of ", ValueTypeName(static_cast<uint32_t>(v.elem)),
         ", expected integers");
  }
  Reader r(data_, size_, what_);
  r.skip(v.offset, "array");
  std::vector<int64_t> out(static_cast<size_t>(v.count));
  for (int64_t& x : out) {
    GgufValue e;
    ReadScalar(r, v.elem, e, "an array integer");
    x = v.elem == GgufValueType::kU64 && e.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
            ? std::numeric_limits<int64_t>::max()
            : e.i;
  }
  return out;
}

}  // namespace kvq::model
