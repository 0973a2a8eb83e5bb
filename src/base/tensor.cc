#include "kvq/tensor.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>

#include "kvq/half.h"
#include "src/base/names.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvq {

std::string escape_for_message(std::string_view s) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(s.size());
  const auto escape = [&](unsigned char b) {
    out += "\\x";
    out += kHex[b >> 4];
    out += kHex[b & 15];
  };
  for (size_t i = 0; i < s.size();) {
    const unsigned char b = static_cast<unsigned char>(s[i]);
    if (b >= 0x20 && b < 0x7f) {
      out += static_cast<char>(b), ++i;
    } else if (b < 0x80) {
      escape(b), ++i;  // C0 controls and DEL
    } else {
      // A well-formed UTF-8 sequence (no overlongs, surrogates or > U+10FFFF)
      // that is not a C1 control passes whole; any other byte is escaped.
      size_t n = b >= 0xc2 && b <= 0xdf ? 2 : b >= 0xe0 && b <= 0xef ? 3 : b >= 0xf0 && b <= 0xf4 ? 4 : 0;
      if (n && i + n <= s.size()) {
        const unsigned char b1 = static_cast<unsigned char>(s[i + 1]);
        const unsigned char lo = b == 0xe0 ? 0xa0 : b == 0xf0 ? 0x90 : 0x80;
        const unsigned char hi = b == 0xed ? 0x9f : b == 0xf4 ? 0x8f : 0xbf;
        bool ok = b1 >= lo && b1 <= hi && !(b == 0xc2 && b1 < 0xa0);  // U+0080..U+009F: C1 controls
        for (size_t k = 2; ok && k < n; ++k) ok = (static_cast<unsigned char>(s[i + k]) & 0xc0) == 0x80;
        if (ok) {
          out.append(s.substr(i, n));
          i += n;
          continue;
        }
      }
      escape(b), ++i;
    }
  }
  return out;
}

namespace detail {
void AssertFail(const char* expr, const char* file, int line) {
  std::fprintf(stderr, "kvq: internal invariant failed: %s at %s:%d\n", expr,
               file, line);
  std::abort();
}
}  // namespace detail

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::I8: return 1;
    case DType::U8: return 1;
    case DType::F8_E4M3: return 1;
    case DType::F8_E5M2: return 1;
    case DType::I32: return 4;
    case DType::I64: return 8;
  }
  Fail("dtype: unknown value ", static_cast<int>(t));
}

constexpr NamedValue<DType> kDTypes[] = {
    {DType::F32, "f32"},         {DType::F16, "f16"},         {DType::BF16, "bf16"}, {DType::I8, "i8"},
    {DType::U8, "u8"},           {DType::F8_E4M3, "f8_e4m3"}, {DType::F8_E5M2, "f8_e5m2"},
    {DType::I32, "i32"},         {DType::I64, "i64"}};
const char* dtype_name(DType t) { return name_of(kDTypes, t); }

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    KVQ_CHECK_ARG(d >= 0, "shape: dimensions must be >= 0, got ", shape_str(shape));
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) {
      Fail("shape: element count overflows int64 for ", shape_str(shape));
    }
    n *= d;
  }
  return n;
}

std::string shape_str(const Shape& shape) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  if (shape.size() == 1) os << ",";
  os << ")";
  return os.str();
}

TensorView::TensorView(const void* data, Shape shape, DType dtype)
    : data_(data), shape_(std::move(shape)), dtype_(dtype) {
  numel_ = shape_numel(shape_);
  KVQ_CHECK_ARG(data_ != nullptr || numel_ == 0,
                "TensorView: data is null for a non-empty shape ", shape_str(shape_));
}

TensorView::TensorView(const Tensor& t)
    : data_(t.data()), shape_(t.shape()), dtype_(t.dtype()), numel_(t.numel()) {}

void Tensor::FreeDeleter::operator()(void* p) const { std::free(p); }

Tensor::Tensor(Shape shape, DType dtype) : Tensor(std::move(shape), dtype, NoInit{}) {
  std::memset(data_.get(), 0, nbytes());
}

Tensor Tensor::Uninitialized(Shape shape, DType dtype) {
  return Tensor(std::move(shape), dtype, NoInit{});
}

Tensor::Tensor(Shape shape, DType dtype, NoInit) : shape_(std::move(shape)), dtype_(dtype) {
  numel_ = shape_numel(shape_);
  const size_t bytes = static_cast<size_t>(numel_) * dtype_size(dtype_);
  // 64-byte aligned, size rounded up to the alignment (aligned_alloc rule).
  // Buffers of 2 MiB and more (a KV cache, a layer's K/V) are 2 MiB aligned
  // and advised as huge pages where the kernel offers them (THP "madvise"
  // mode): a streaming pass then crosses no 4 KiB page boundary, where the
  // hardware prefetcher stops, and needs 512x fewer TLB entries.
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t align = bytes >= kHuge ? kHuge : 64;
  const size_t alloc = (bytes + 64 + align - 1) / align * align;
  void* p = std::aligned_alloc(align, alloc);
  if (p == nullptr) Fail("Tensor: cannot allocate ", bytes, " bytes for ", shape_str(shape_));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (align == kHuge) (void)madvise(p, alloc, MADV_HUGEPAGE);  // advice only
#endif
  data_.reset(p);
}

Tensor Tensor::Copy() const { return FromView(view()); }

Tensor Tensor::FromView(const TensorView& v) {
  Tensor t = Uninitialized(v.shape(), v.dtype());
  if (v.nbytes() != 0) std::memcpy(t.data(), v.data(), v.nbytes());
  return t;
}

Tensor Tensor::FromF32(std::span<const float> values, Shape shape) {
  Tensor t(std::move(shape), DType::F32);
  KVQ_CHECK_ARG(static_cast<size_t>(t.numel()) == values.size(),
                "Tensor::FromF32: values has ", values.size(),
                " elements but shape ", shape_str(t.shape()), " needs ", t.numel());
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size_bytes());
  return t;
}

Tensor to_f32(const TensorView& x) {
  Tensor out = Tensor::Uninitialized(x.shape(), DType::F32);
  const size_t n = static_cast<size_t>(x.numel());
  std::span<float> o(out.data_as<float>(), n);
  switch (x.dtype()) {
    case DType::F32:
      if (n) std::memcpy(o.data(), x.data(), n * sizeof(float));
      break;
    case DType::F16:
      f16_to_f32({x.data_as<uint16_t>(), n}, o);
      break;
    case DType::BF16:
      bf16_to_f32({x.data_as<uint16_t>(), n}, o);
      break;
    default:
      Fail("x: expected dtype f32, f16 or bf16, got ", dtype_name(x.dtype()));
  }
  return out;
}

Tensor from_f32(const TensorView& x, DType to) {
  KVQ_CHECK_ARG(x.dtype() == DType::F32, "x: expected dtype f32, got ", dtype_name(x.dtype()));
  Tensor out(x.shape(), to);
  const size_t n = static_cast<size_t>(x.numel());
  std::span<const float> in(x.data_as<float>(), n);
  switch (to) {
    case DType::F32:
      if (n) std::memcpy(out.data(), in.data(), n * sizeof(float));
      break;
    case DType::F16:
      f32_to_f16(in, {out.data_as<uint16_t>(), n});
      break;
    case DType::BF16:
      f32_to_bf16(in, {out.data_as<uint16_t>(), n});
      break;
    default:
      Fail("to: expected dtype f32, f16 or bf16, got ", dtype_name(to));
  }
  return out;
}

}  // namespace kvq
