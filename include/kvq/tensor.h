// kvq::Tensor — a small owning, contiguous, row-major tensor, and
// kvq::TensorView, its non-owning read-only view.
//
// Storage is 64-byte aligned so SIMD kernels may use aligned and streaming
// stores. Tensors are move-only; Copy() is the explicit deep copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvq/error.h"

namespace kvq {

// Append-only: values are part of serialised formats.
enum class DType : uint8_t {
  F32 = 0,
  F16 = 1,
  BF16 = 2,
  I8 = 3,
  U8 = 4,
  F8_E4M3 = 5,  // OCP E4M3FN bit patterns, stored as bytes
  F8_E5M2 = 6,  // OCP E5M2 bit patterns, stored as bytes
  I32 = 7,
  I64 = 8,
};

size_t dtype_size(DType t);
const char* dtype_name(DType t);

using Shape = std::vector<int64_t>;

// Number of elements; throws kvq::Error on a negative dimension or overflow.
int64_t shape_numel(const Shape& shape);
std::string shape_str(const Shape& shape);

class Tensor;

// Non-owning, read-only view of contiguous row-major data.
class TensorView {
 public:
  TensorView() = default;
  TensorView(const void* data, Shape shape, DType dtype);
  TensorView(const Tensor& t);  // NOLINT: implicit, views are cheap

  const void* data() const { return data_; }
  template <typename T>
  const T* data_as() const { return static_cast<const T*>(data_); }
  const Shape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  int64_t numel() const { return numel_; }
  int64_t rank() const { return static_cast<int64_t>(shape_.size()); }
  int64_t dim(int64_t i) const { return shape_[static_cast<size_t>(i)]; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }

 private:
  const void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::F32;
  int64_t numel_ = 0;
};

class Tensor {
 public:
  Tensor() = default;
  // Zero-initialised tensor of the given shape and dtype.
  Tensor(Shape shape, DType dtype);
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  // Explicit deep copy.
  Tensor Copy() const;
  static Tensor FromView(const TensorView& v);
  static Tensor FromF32(std::span<const float> values, Shape shape);
  // Tensor whose contents are left uninitialised (for outputs a kernel
  // overwrites completely; avoids a memset pass over large buffers).
  static Tensor Uninitialized(Shape shape, DType dtype);

  void* data() { return data_.get(); }
  const void* data() const { return data_.get(); }
  template <typename T>
  T* data_as() { return static_cast<T*>(data()); }
  template <typename T>
  const T* data_as() const { return static_cast<const T*>(data()); }

  const Shape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  int64_t numel() const { return numel_; }
  int64_t rank() const { return static_cast<int64_t>(shape_.size()); }
  int64_t dim(int64_t i) const { return shape_[static_cast<size_t>(i)]; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  TensorView view() const { return TensorView(*this); }

 private:
  struct NoInit {};
  Tensor(Shape shape, DType dtype, NoInit);
  struct FreeDeleter {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, FreeDeleter> data_;
  Shape shape_;
  DType dtype_ = DType::F32;
  int64_t numel_ = 0;
};

// Converts F32/F16/BF16 data to a new F32 tensor (SIMD, runtime dispatch).
Tensor to_f32(const TensorView& x);
// Converts an F32 tensor to F32/F16/BF16 (round to nearest even).
Tensor from_f32(const TensorView& x, DType to);

}  // namespace kvq
