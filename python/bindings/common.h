// Helpers of the _kvq bindings (python/bindings/*.cc): numpy arrays <->
// kvq tensors with explicit element types, AffineQuantized, digests and
// restore expectations, token ids, work without the GIL.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvq/affine.h"
#include "kvq/error.h"
#include "kvq/kv_cache.h"
#include "kvq/tensor.h"

namespace kvq::python {

namespace py = pybind11;

inline DType ParseFloatDType(const std::string& s, const char* arg) {
  if (s == "float32") return DType::F32;
  if (s == "float16") return DType::F16;
  if (s == "bfloat16") return DType::BF16;
  Fail(arg, ": expected dtype float32, float16 or bfloat16, got ", s);
}

// The numpy element type that carries `t` (fp8 and bf16 as bit patterns).
inline py::dtype NumpyDType(DType t) {
  switch (t) {
    case DType::F32: return py::dtype::of<float>();
    case DType::F16: return py::dtype("float16");
    case DType::BF16: return py::dtype::of<uint16_t>();
    case DType::I8: return py::dtype::of<int8_t>();
    case DType::U8:
    case DType::F8_E4M3:
    case DType::F8_E5M2: return py::dtype::of<uint8_t>();
    case DType::I32: return py::dtype::of<int32_t>();
    case DType::I64: return py::dtype::of<int64_t>();
  }
  Fail("internal: unknown dtype");
}

inline std::string DTypeName(const py::dtype& d) { return py::str(static_cast<const py::handle&>(d)).cast<std::string>(); }

// A view of a C-contiguous array whose items are `dtype`.
inline TensorView ViewOf(const py::array& a, DType dtype, const char* arg) {
  KVQ_CHECK_ARG(a.flags() & py::array::c_style, arg, ": expected a C-contiguous array");
  const py::dtype want = NumpyDType(dtype);
  KVQ_CHECK_ARG(a.dtype().is(want), arg, ": expected numpy dtype ", DTypeName(want), " for ",
                dtype_name(dtype), ", got ", DTypeName(a.dtype()));
  Shape shape(a.shape(), a.shape() + a.ndim());
  return TensorView(a.data(), std::move(shape), dtype);
}

inline TensorView FloatView(const py::array& a, const std::string& dtype, const char* arg) {
  return ViewOf(a, ParseFloatDType(dtype, arg), arg);
}

// numpy array owning a kvq::Tensor (no copy).
inline py::array ToNumpy(Tensor t) {
  const py::dtype dt = NumpyDType(t.dtype());
  auto* owner = new Tensor(std::move(t));
  py::capsule free_when_done(owner, [](void* p) { delete static_cast<Tensor*>(p); });
  std::vector<py::ssize_t> shape(owner->shape().begin(), owner->shape().end());
  return py::array(dt, shape, owner->data(), free_when_done);
}

template <typename T>
inline py::array VectorToNumpy(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
  return a;
}

inline py::tuple AffineToPython(AffineQuantized q) {
  const float scale = q.scale;
  const std::string mode = quant_mode_name(q.mode);
  return py::make_tuple(ToNumpy(std::move(q.codes)), scale, mode);
}

// Codes from Python: int8 for "int8", uint8 E4M3 bit patterns for "fp8".
inline AffineQuantized AffineFromPython(const py::array& codes, float scale, const std::string& mode_name) {
  AffineQuantized q;
  q.mode = parse_quant_mode(mode_name, "q.mode");
  const DType want = q.mode == QuantMode::Int8 ? DType::I8 : DType::F8_E4M3;
  KVQ_CHECK_ARG(codes.dtype().is(NumpyDType(want)), "q.codes: expected ",
                q.mode == QuantMode::Int8 ? "int8" : "uint8 (fp8 E4M3 bit patterns)", " codes for mode '", mode_name,
                "', got dtype ", DTypeName(codes.dtype()));
  KVQ_CHECK_ARG(std::isfinite(scale) && scale >= 0.0f, "q.scale: expected a finite value >= 0, got ", scale);
  KVQ_CHECK_ARG(q.mode == QuantMode::Int8 || scale == 1.0f, "q.scale: expected 1.0 for fp8 codes, got ", scale);
  q.codes = Tensor::FromView(ViewOf(codes, want, "q.codes"));
  q.scale = scale;
  return q;
}

// Runs fn with the GIL released (fn must not touch Python objects).
template <typename Fn>
inline auto WithoutGil(Fn&& fn) {
  py::gil_scoped_release release;
  return fn();
}

// A 32-byte identity from Python (bytes or None).
inline std::optional<std::array<uint8_t, 32>> Digest32(const py::object& o, const char* arg) {
  std::optional<std::array<uint8_t, 32>> r;
  if (o.is_none()) return r;
  KVQ_CHECK_ARG(py::isinstance<py::bytes>(o), arg, ": expected 32 bytes or None");
  const std::string b = o.cast<std::string>();
  KVQ_CHECK_ARG(b.size() == 32, arg, ": expected 32 bytes, got ", b.size());
  std::array<uint8_t, 32> a;
  std::memcpy(a.data(), b.data(), 32);
  r = a;
  return r;
}

inline py::object DigestOf(const std::optional<std::array<uint8_t, 32>>& d) {
  if (!d) return py::none();
  return py::bytes(reinterpret_cast<const char*>(d->data()), d->size());
}

inline KvCacheMeta MetaOf(const py::object& fingerprint, const py::object& digest) {
  KvCacheMeta meta;
  meta.model_fingerprint = Digest32(fingerprint, "model_fingerprint");
  meta.tokens_digest = Digest32(digest, "tokens_digest");
  return meta;
}

inline KvCacheExpect ExpectOf(const py::object& fingerprint, const py::object& max_seq) {
  KvCacheExpect e;
  e.model_fingerprint = Digest32(fingerprint, "model_fingerprint");
  if (!max_seq.is_none()) e.max_seq = max_seq.cast<int>();
  return e;
}


// Token ids from Python (a sequence or array of integers in 0..2^31-1).
inline std::vector<int> TokenIds(const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& a) {
  KVQ_CHECK_ARG(a.ndim() == 1, "tokens: expected a 1-D sequence of token ids, got ", a.ndim(), " dimensions");
  std::vector<int> out(static_cast<size_t>(a.shape(0)));
  for (size_t i = 0; i < out.size(); ++i) {
    const int64_t t = a.data()[i];
    KVQ_CHECK_ARG(t >= 0 && t <= INT32_MAX, "tokens: expected ids in 0..2^31-1, got ", t, " at ", i);
    out[i] = static_cast<int>(t);
  }
  return out;
}

// The prefix store with its warnings kept for Python (emitted after each call, with the GIL).

// One binder per concept (python/bindings/<concept>.cc), called by kvq_py.cc.
void BindAffine(py::module_& m);
void BindSortedProfile(py::module_& m);
void BindClusters(py::module_& m);
void BindCache(py::module_& m);
void BindPrefixStore(py::module_& m);
void BindModel(py::module_& m);

}  // namespace kvq::python
