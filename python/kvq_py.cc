// _kvq: the pybind11 extension behind the `kvq` Python package
// (python/kvq/__init__.py adds the seed note's signatures, torch support and
// docstrings). Arrays cross the boundary as C-contiguous numpy arrays with an
// explicit element type ("float32", "float16", "bfloat16" = uint16 bits);
// outputs are numpy arrays that own the C++ buffer (no copy). kvq::Error
// becomes kvq.Error, a subclass of ValueError. Heavy work runs without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>

#include "kvq/affine.h"
#include "kvq/kv_scheme.h"
#include "kvq/attention.h"
#include "kvq/cluster_bank.h"
#include "kvq/cluster_outliers.h"
#include "kvq/grouped_kv.h"
#include "kvq/kv_cache.h"
#include "kvq/targets.h"
#include "kvq/sorted_profile.h"
#include "kvq/stats.h"
#include "model/eval.h"
#include "model/llama2.h"
#include "model/tokens.h"
#include "store/prefix_store.h"

namespace py = pybind11;

namespace kvq::python {
namespace {

DType ParseFloatDType(const std::string& s, const char* arg) {
  if (s == "float32") return DType::F32;
  if (s == "float16") return DType::F16;
  if (s == "bfloat16") return DType::BF16;
  Fail(arg, ": expected dtype float32, float16 or bfloat16, got ", s);
}

// The numpy element type that carries `t` (fp8 and bf16 as bit patterns).
py::dtype NumpyDType(DType t) {
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

std::string DTypeName(const py::dtype& d) { return py::str(static_cast<const py::handle&>(d)).cast<std::string>(); }

// A view of a C-contiguous array whose items are `dtype`.
TensorView ViewOf(const py::array& a, DType dtype, const char* arg) {
  KVQ_CHECK_ARG(a.flags() & py::array::c_style, arg, ": expected a C-contiguous array");
  const py::dtype want = NumpyDType(dtype);
  KVQ_CHECK_ARG(a.dtype().is(want), arg, ": expected numpy dtype ", DTypeName(want), " for ",
                dtype_name(dtype), ", got ", DTypeName(a.dtype()));
  Shape shape(a.shape(), a.shape() + a.ndim());
  return TensorView(a.data(), std::move(shape), dtype);
}

TensorView FloatView(const py::array& a, const std::string& dtype, const char* arg) {
  return ViewOf(a, ParseFloatDType(dtype, arg), arg);
}

// numpy array owning a kvq::Tensor (no copy).
py::array ToNumpy(Tensor t) {
  const py::dtype dt = NumpyDType(t.dtype());
  auto* owner = new Tensor(std::move(t));
  py::capsule free_when_done(owner, [](void* p) { delete static_cast<Tensor*>(p); });
  std::vector<py::ssize_t> shape(owner->shape().begin(), owner->shape().end());
  return py::array(dt, shape, owner->data(), free_when_done);
}

template <typename T>
py::array VectorToNumpy(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
  return a;
}

py::tuple AffineToPython(AffineQuantized q) {
  const float scale = q.scale;
  const std::string mode = quant_mode_name(q.mode);
  return py::make_tuple(ToNumpy(std::move(q.codes)), scale, mode);
}

// Codes from Python: int8 for "int8", uint8 E4M3 bit patterns for "fp8".
AffineQuantized AffineFromPython(const py::array& codes, float scale, const std::string& mode_name) {
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
auto WithoutGil(Fn&& fn) {
  py::gil_scoped_release release;
  return fn();
}

// A 32-byte identity from Python (bytes or None).
std::optional<std::array<uint8_t, 32>> Digest32(const py::object& o, const char* arg) {
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

py::object DigestOf(const std::optional<std::array<uint8_t, 32>>& d) {
  if (!d) return py::none();
  return py::bytes(reinterpret_cast<const char*>(d->data()), d->size());
}

KvCacheMeta MetaOf(const py::object& fingerprint, const py::object& digest) {
  KvCacheMeta meta;
  meta.model_fingerprint = Digest32(fingerprint, "model_fingerprint");
  meta.tokens_digest = Digest32(digest, "tokens_digest");
  return meta;
}

KvCacheExpect ExpectOf(const py::object& fingerprint, const py::object& max_seq) {
  KvCacheExpect e;
  e.model_fingerprint = Digest32(fingerprint, "model_fingerprint");
  if (!max_seq.is_none()) e.max_seq = max_seq.cast<int>();
  return e;
}


// Token ids from Python (a sequence or array of integers in 0..2^31-1).
std::vector<int> TokenIds(const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& a) {
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
struct PyPrefixStore {
  std::shared_ptr<std::vector<std::string>> pending = std::make_shared<std::vector<std::string>>();
  std::unique_ptr<store::PrefixStore> s;
};

py::dict ReceiptToPython(BirthMergeReceipt r) {
  py::dict d;
  d["assignments"] = VectorToNumpy(std::vector<int64_t>(r.assignments.begin(), r.assignments.end()));
  d["per_token_residual"] = VectorToNumpy(r.per_token_residual);
  py::dict misfit;
  for (const auto& [id, m] : r.per_cluster_misfit) misfit[py::int_(id)] = m;
  d["per_cluster_misfit"] = misfit;
  d["births"] = r.births;
  d["merges"] = r.merges;
  d["born"] = r.born;
  d["merged"] = r.merged;
  py::dict out;
  for (auto& [id, set] : r.per_cluster_outlier_tokens) {
    py::dict s;
    s["k"] = ToNumpy(std::move(set.k));
    s["v"] = ToNumpy(std::move(set.v));
    s["indices"] = VectorToNumpy(set.indices);
    out[py::int_(id)] = s;
  }
  d["per_cluster_outlier_tokens"] = out;
  return d;
}

py::dict FitToPython(const ClusterHeadFit& f, int d) {
  py::dict o;
  o["count"] = f.count;
  o["mean_k"] = VectorToNumpy(f.mean_k);
  o["mean_v"] = VectorToNumpy(f.mean_v);
  py::array a = VectorToNumpy(f.a);
  o["A"] = a.reshape({d, d});
  return o;
}

}  // namespace
}  // namespace kvq::python

PYBIND11_MODULE(_kvq, m) {
  using namespace kvq;
  using namespace kvq::python;
  m.doc() = "kvq's C++ core (use the `kvq` package, not this module directly)";
  static py::exception<Error> error(m, "Error", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });

  // ---- SIMD targets (kvq/targets.h) ------------------------------------------
  m.def("simd_target", [] {
    apply_simd_targets_from_env();
    return dispatched_simd_target();
  });
  m.def("set_simd_targets", [](const std::string& name) { set_simd_targets(name, "name"); });
  m.def("supported_simd_targets", &supported_simd_targets);

  // ---- I2 part 1 --------------------------------------------------------------
  m.def("quantize_kv_cache", [](const py::array& x, const std::string& dtype, const std::string& mode) {
    const TensorView v = FloatView(x, dtype, "x");
    const QuantMode qm = parse_quant_mode(mode, "mode");
    return AffineToPython(WithoutGil([&] { return quantize_kv_cache(v, qm); }));
  });
  m.def("dequantize_kv_cache", [](const py::array& codes, float scale, const std::string& mode) {
    const AffineQuantized q = AffineFromPython(codes, scale, mode);
    return ToNumpy(WithoutGil([&] { return dequantize_kv_cache(q); }));
  });
  m.def("quantization_error_per_token", [](const py::array& x, const std::string& dtype, const std::string& mode) {
    const TensorView v = FloatView(x, dtype, "x");
    const QuantMode qm = parse_quant_mode(mode, "mode");
    return ToNumpy(WithoutGil([&] { return quantization_error_per_token(v, qm); }));
  });

  // ---- G4 ---------------------------------------------------------------------
  py::class_<Estimator, std::shared_ptr<Estimator>>(m, "Estimator",
                                                     "A location-scale family for fit_sorted_profile's tail.")
      .def_property_readonly("name", &Estimator::name)
      .def(
          "fit",
          [](const Estimator& e, const py::array& x) {
            const TensorView v = ViewOf(x, DType::F32, "values");
            const LocScale p = e.fit({v.data_as<float>(), static_cast<size_t>(v.numel())});
            return py::make_tuple(p.loc, p.scale);
          },
          "(loc, scale) estimated from float32 values")
      .def("__repr__", [](const Estimator& e) { return "<kvq estimator '" + e.name() + "'>"; });
  py::class_<GaussianEstimator, Estimator, std::shared_ptr<GaussianEstimator>>(
      m, "GaussianEstimator", "Gaussian family: loc = mean, scale = standard deviation (MLE).")
      .def(py::init<>());
  py::class_<LaplaceEstimator, Estimator, std::shared_ptr<LaplaceEstimator>>(
      m, "LaplaceEstimator", "Laplace family: loc = median, scale = mean absolute deviation from the median.")
      .def(py::init<>());

  py::class_<SortedProfileEncoding>(m, "SortedProfileEncoding")
      .def_readonly("family", &SortedProfileEncoding::family)
      .def_property_readonly("params", [](const SortedProfileEncoding& e) { return py::make_tuple(e.params.loc, e.params.scale); })
      .def_readonly("n", &SortedProfileEncoding::n)
      .def_readonly("bits", &SortedProfileEncoding::bits)
      .def_property_readonly("codebook", [](const SortedProfileEncoding& e) { return codebook_name(e.codebook); })
      .def_readonly("ks_max", &SortedProfileEncoding::ks_max)
      .def_readonly("ks_statistic", &SortedProfileEncoding::ks_statistic)
      .def_readonly("p_value", &SortedProfileEncoding::p_value)
      .def_property_readonly("path", [](const SortedProfileEncoding& e) { return tail_path_name(e.path); })
      .def_property_readonly("fallback", &SortedProfileEncoding::fallback)
      .def_property_readonly("why", &SortedProfileEncoding::why)
      .def_property_readonly("head_indices", [](const SortedProfileEncoding& e) { return VectorToNumpy(e.head_indices); })
      .def_property_readonly("head_values", [](const SortedProfileEncoding& e) { return VectorToNumpy(e.head_values); })
      .def_property_readonly("size_bytes", &SortedProfileEncoding::size_bytes)
      .def("decode",
           [](const SortedProfileEncoding& e) {
             return ToNumpy(WithoutGil([&] {
               Tensor out = Tensor::Uninitialized({e.n}, DType::F32);
               decode_into(e, {out.data_as<float>(), static_cast<size_t>(e.n)});
               return out;
             }));
           })
      .def("serialize",
           [](const SortedProfileEncoding& e) {
             const std::vector<uint8_t> b = serialize(e);
             return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
           })
      .def_static("deserialize", [](const py::bytes& b) {
        const std::string_view s = b;
        return deserialize_sorted_profile({reinterpret_cast<const uint8_t*>(s.data()), s.size()});
      });

  m.def("fit_sorted_profile", [](const py::array& x, const std::string& dtype, const Estimator& family, int top_k,
                                 int bits, const std::string& codebook, double ks_max) {
    const TensorView v = FloatView(x, dtype, "values");
    SortedProfileOptions o;
    o.top_k = top_k;
    o.bits = bits;
    o.codebook = parse_codebook(codebook, "codebook");
    o.ks_max = ks_max;
    return WithoutGil([&] { return fit_sorted_profile(v, family, o); });
  });

  // ---- E2 ---------------------------------------------------------------------
  py::class_<ClusterBank>(m, "ClusterBank")
      .def(py::init([](int n_head, int d_head, int max_clusters, double birth_distance, double merge_distance,
                       int outlier_top_k, double ridge, const std::string& closure) {
             ClusterBankOptions o;
             o.max_clusters = max_clusters;
             o.birth_distance = birth_distance;
             o.merge_distance = merge_distance;
             o.outlier_top_k = outlier_top_k;
             o.ridge = ridge;
             o.closure = parse_far_field_closure(closure);
             return ClusterBank(n_head, d_head, o);
           }),
           py::arg("n_head"), py::arg("d_head"), py::arg("max_clusters"), py::arg("birth_distance"),
           py::arg("merge_distance"), py::arg("outlier_top_k"), py::arg("ridge"), py::arg("closure"))
      .def_property_readonly("key_scale", &ClusterBank::key_scale)
      .def("birth_and_merge",
           [](ClusterBank& b, const py::array& k, const std::string& kd, const py::array& v, const std::string& vd) {
             const TensorView kv = FloatView(k, kd, "chunk_k"), vv = FloatView(v, vd, "chunk_v");
             return ReceiptToPython(WithoutGil([&] { return b.birth_and_merge(kv, vv); }));
           })
      .def_property_readonly("n_head", &ClusterBank::n_head)
      .def_property_readonly("d_head", &ClusterBank::d_head)
      .def_property_readonly("num_clusters", &ClusterBank::num_clusters)
      .def_property_readonly("cluster_ids", &ClusterBank::cluster_ids)
      .def_property_readonly("total_births", &ClusterBank::total_births)
      .def_property_readonly("total_merges", &ClusterBank::total_merges)
      .def("cluster_count", &ClusterBank::cluster_count)
      .def("fit", [](const ClusterBank& b, int id, int head) { return FitToPython(b.fit(id, head), b.d_head()); })
      .def("far_field", [](const ClusterBank& b, const py::array& q, int n_q_heads, float scale) {
        const TensorView qv = ViewOf(q, DType::F32, "q");
        const AttentionPart p = b.far_field({qv.data_as<float>(), static_cast<size_t>(qv.numel())}, n_q_heads, scale);
        py::dict o;
        o["log_mass"] = VectorToNumpy(p.log_mass);
        py::array v = VectorToNumpy(p.value);
        o["value"] = v.reshape({n_q_heads, b.d_head()});
        return o;
      });

  m.def("default_cluster_bank_options", [] {
    const ClusterBankOptions o;
    py::dict d;
    d["max_clusters"] = o.max_clusters;
    d["birth_distance"] = o.birth_distance;
    d["merge_distance"] = o.merge_distance;
    d["outlier_top_k"] = o.outlier_top_k;
    d["ridge"] = o.ridge;
    d["closure"] = far_field_closure_name(o.closure);
    return d;
  });
  m.attr("DEFAULT_KS_MAX") = kDefaultKsMax;

  // per_cluster: {id: (k, k_dtype, v, v_dtype, indices int64)} normalised by the
  // Python layer. Returns {id: dict of parts}.
  m.def("quantize_cluster_outliers", [](const py::dict& per_cluster, const py::array& k, const std::string& kd,
                                        const py::array& v, const std::string& vd, const std::string& mode,
                                        const Estimator& family, int tail_top_k, const py::object& membership) {
    const TensorView kv = FloatView(k, kd, "flat_k"), vv = FloatView(v, vd, "flat_v");
    const QuantMode qm = parse_quant_mode(mode, "mode");
    OutlierTokens tokens;
    for (const auto& [key, val] : per_cluster) {
      const int id = key.cast<int>();
      const py::tuple t = val.cast<py::tuple>();
      const std::string arg_k = "per_cluster_outlier_tokens[" + std::to_string(id) + "].k";
      const std::string arg_v = "per_cluster_outlier_tokens[" + std::to_string(id) + "].v";
      const std::string arg_i = "per_cluster_outlier_tokens[" + std::to_string(id) + "].indices";
      OutlierTokenSet s;
      s.k = Tensor::FromView(FloatView(t[0].cast<py::array>(), t[1].cast<std::string>(), arg_k.c_str()));
      s.v = Tensor::FromView(FloatView(t[2].cast<py::array>(), t[3].cast<std::string>(), arg_v.c_str()));
      const TensorView iv = ViewOf(t[4].cast<py::array>(), DType::I64, arg_i.c_str());
      KVQ_CHECK_ARG(iv.rank() == 1, arg_i, ": expected a 1-D array, got shape ", shape_str(iv.shape()));
      s.indices.assign(iv.data_as<int64_t>(), iv.data_as<int64_t>() + iv.numel());
      tokens.emplace(id, std::move(s));
    }
    std::vector<int> member;
    if (!membership.is_none()) {
      const TensorView mv = ViewOf(membership.cast<py::array>(), DType::I32, "membership");
      KVQ_CHECK_ARG(mv.rank() == 1, "membership: expected a 1-D array, got shape ", shape_str(mv.shape()));
      member.assign(mv.data_as<int32_t>(), mv.data_as<int32_t>() + mv.numel());
    }
    std::map<int, QuantizedClusterOutliers> q = WithoutGil([&] {
      return quantize_cluster_outliers(
          tokens, kv, vv, qm, family, tail_top_k,
          membership.is_none() ? std::nullopt : std::optional<std::span<const int>>(member));
    });
    py::dict out;
    for (auto& [id, c] : q) {
      py::dict d;
      d["size_bytes"] = c.size_bytes();  // before the parts are moved out
      d["cluster_id"] = c.cluster_id;
      d["n_head"] = c.n_head;
      d["d_head"] = c.d_head;
      d["outlier_k"] = c.outlier_k ? py::object(AffineToPython(std::move(*c.outlier_k))) : py::none();
      d["outlier_v"] = c.outlier_v ? py::object(AffineToPython(std::move(*c.outlier_v))) : py::none();
      d["outlier_indices"] = c.outlier_indices.empty() ? py::object(py::none()) : VectorToNumpy(c.outlier_indices);
      d["tail_tokens"] = c.tail_tokens;
      d["tail_k"] = c.tail_k ? py::cast(std::move(*c.tail_k)) : py::none();
      d["tail_v"] = c.tail_v ? py::cast(std::move(*c.tail_v)) : py::none();
      out[py::int_(id)] = d;
    }
    return out;
  });

  // ---- the KV cache and decode attention -------------------------------------
  m.def("kv_scheme_names", [] {
    std::vector<std::string> names;
    for (KvScheme s : all_kv_schemes()) names.emplace_back(kv_scheme_name(s));
    return names;
  });
  m.def("kv_scheme_bits", [](const std::string& name, int n_kv_heads, int head_dim) {
    KVQ_CHECK_ARG(n_kv_heads >= 1 && head_dim >= 1 && int64_t{n_kv_heads} * head_dim <= (1 << 24),
                  "n_kv_heads, head_dim: expected >= 1 with a row of at most 2^24 values, got ", n_kv_heads, ", ",
                  head_dim);
    return KvRowCodec(parse_kv_scheme(name, "scheme"), n_kv_heads * head_dim, head_dim).bits_per_element();
  });
  m.def("kv_scheme_info", [](const std::string& name) {
    const KvSchemeInfo i = describe_kv_scheme(name, "scheme");
    py::dict d;
    d["name"] = i.name;
    d["label"] = i.label;
    d["family"] = i.family;
    d["needs_ranges"] = i.needs_ranges;
    return d;
  });
  m.def("all_kv_scheme_names", &all_kv_scheme_names);
  py::class_<KvCache>(m, "KvCache")
      .def(py::init([](const std::string& scheme, int n_layers, int max_seq, int n_kv_heads, int head_dim,
                       std::shared_ptr<StaticRanges> ranges, float rope_theta) {
        RopeConfig rope;
        rope.theta = rope_theta;
        return KvCache(scheme, n_layers, max_seq, n_kv_heads, head_dim, ranges.get(), rope);
      }))
      // k (after RoPE), v: float32 C-contiguous (T, n_kv_heads * head_dim); tokens pos0 .. pos0 + T - 1.
      .def("write_many",
           [](KvCache& c, int layer, int pos0, const py::array& k, const py::array& v) {
             const TensorView kv = ViewOf(k, DType::F32, "k"), vv = ViewOf(v, DType::F32, "v");
             const int64_t row = int64_t{c.n_kv_heads()} * c.head_dim();
             KVQ_CHECK_ARG(kv.rank() == 2 && kv.dim(1) == row, "k: expected shape (T, ", row, "), got ",
                           shape_str(kv.shape()));
             KVQ_CHECK_ARG(vv.shape() == kv.shape(), "v: expected shape ", shape_str(kv.shape()), " like k, got ",
                           shape_str(vv.shape()));
             const int64_t T = kv.dim(0);
             KVQ_CHECK_ARG(T >= 1 && pos0 >= 0 && pos0 + T <= c.max_seq(), "pos: tokens ", pos0, "..", pos0 + T - 1,
                           " do not fit the cache's max_seq ", c.max_seq());
             WithoutGil([&] {
               for (int64_t t = 0; t < T; ++t) {
                 c.write(layer, static_cast<int>(pos0 + t),
                         {kv.data_as<float>() + t * row, static_cast<size_t>(row)},
                         {vv.data_as<float>() + t * row, static_cast<size_t>(row)});
               }
               return 0;
             });
           })
      .def("read",
           [](const KvCache& c, int layer, int64_t pos) {
             const size_t row = static_cast<size_t>(c.n_kv_heads()) * static_cast<size_t>(c.head_dim());
             std::vector<float> k(row), v(row);
             c.read(layer, pos, k, v);
             return py::make_tuple(VectorToNumpy(k), VectorToNumpy(v));
           })
      .def("written", &KvCache::written)
      .def("bytes", [](const KvCache& c, int64_t tokens) { return c.bytes(tokens); })
      .def("bits", [](const KvCache& c, int64_t tokens) { return c.bits(tokens); })
      .def("allocated_bytes", &KvCache::allocated_bytes)
      .def("to_bytes",
           [](const KvCache& c, int64_t tokens, const py::object& fingerprint, const py::object& digest) {
             const KvCacheMeta meta = MetaOf(fingerprint, digest);
             const std::vector<uint8_t> b = WithoutGil([&] { return c.to_bytes(tokens, meta); });
             return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
           })
      .def("save",
           [](const KvCache& c, const std::string& path, int64_t tokens, const py::object& fingerprint,
              const py::object& digest) {
             const KvCacheMeta meta = MetaOf(fingerprint, digest);
             WithoutGil([&] { c.save(path, tokens, meta); });
           })
      // (cache, model_fingerprint, tokens_digest): the two as saved (None when absent).
      .def_static("from_bytes",
                  [](const py::bytes& data, const py::object& fingerprint, const py::object& max_seq) {
                    const std::string b = data;
                    const KvCacheExpect e = ExpectOf(fingerprint, max_seq);
                    KvCacheMeta meta;
                    KvCache c = WithoutGil([&] {
                      return KvCache::from_bytes({reinterpret_cast<const uint8_t*>(b.data()), b.size()}, e, &meta);
                    });
                    return py::make_tuple(std::move(c), DigestOf(meta.model_fingerprint), DigestOf(meta.tokens_digest));
                  })
      .def_static("load",
                  [](const std::string& path, const py::object& fingerprint, const py::object& max_seq) {
                    const KvCacheExpect e = ExpectOf(fingerprint, max_seq);
                    KvCacheMeta meta;
                    KvCache c = WithoutGil([&] { return KvCache::load(path, e, &meta); });
                    return py::make_tuple(std::move(c), DigestOf(meta.model_fingerprint), DigestOf(meta.tokens_digest));
                  })
      .def("attend",
           [](const KvCache& c, const py::array& q, int layer, int64_t tokens, bool int8_query, float scale,
              int threads, bool reference) {
             const TensorView qv = ViewOf(q, DType::F32, "q");
             KVQ_CHECK_ARG(qv.rank() == 2 && qv.dim(1) == c.head_dim(), "q: expected shape (n_heads, ", c.head_dim(),
                           "), got ", shape_str(qv.shape()));
             KVQ_CHECK_ARG(threads >= 0 && threads <= 1024, "threads: expected 0..1024, got ", threads);
             DecodeAttentionOptions o;
             o.length = tokens;
             o.int8_query = int8_query;
             o.scale = scale;
             o.threads = threads;
             const size_t n = static_cast<size_t>(qv.numel());
             std::vector<float> out(n);
             const std::span<const float> qs(qv.data_as<float>(), n);
             WithoutGil([&] {
               if (reference) {
                 c.attend_ref(layer, qs, static_cast<int>(qv.dim(0)), out, o);
               } else {
                 c.attend(layer, qs, static_cast<int>(qv.dim(0)), out, o);
               }
               return 0;
             });
             return VectorToNumpy(out);
           })
      .def_property_readonly("scheme", [](const KvCache& c) { return c.scheme(); })
      .def_property_readonly("label", [](const KvCache& c) { return c.info().label; })
      .def_property_readonly("tokens", &KvCache::tokens)
      .def_property_readonly("n_layers", &KvCache::n_layers)
      .def_property_readonly("max_seq", &KvCache::max_seq)
      .def_property_readonly("n_kv_heads", &KvCache::n_kv_heads)
      .def_property_readonly("head_dim", &KvCache::head_dim);

  // ---- the prefix store (store/prefix_store.h) -----------------------------------
  py::class_<PyPrefixStore>(m, "PrefixStore")
      .def(py::init([](const std::string& url, int chunk_tokens, double max_bytes, int ttl, const std::string& prefix,
                       int timeout_ms, const py::object& fingerprint, const py::bytes& secret) {
        KVQ_CHECK_ARG(max_bytes >= 0 && max_bytes < 0x1p62, "max_bytes: expected >= 0, got ", max_bytes);
        PyPrefixStore p;
        store::StoreOptions o;
        o.chunk_tokens = chunk_tokens;
        o.max_bytes = static_cast<uint64_t>(max_bytes);
        o.ttl_seconds = ttl;
        o.key_prefix = prefix;
        o.timeout_ms = timeout_ms;
        o.model = Digest32(fingerprint, "model_fingerprint");
        o.secret = std::string(secret);
        auto pending = p.pending;
        o.warn = [pending](const std::string& w) { pending->push_back(w); };
        p.s = std::make_unique<store::PrefixStore>(url, o);
        return p;
      }))
      .def("put",
           [](PyPrefixStore& p, const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& tokens,
              const KvCache& cache) {
             const std::vector<int> t = TokenIds(tokens);
             uint64_t bytes = 0;
             const int n = WithoutGil([&] { return p.s->put(t, cache, &bytes); });
             return py::make_tuple(n, bytes);
           })
      .def("longest_prefix",
           [](PyPrefixStore& p, const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& tokens,
              const KvCache& like, int64_t limit) {
             const std::vector<int> t = TokenIds(tokens);
             store::LookupReport rep;
             KvCache c = WithoutGil([&] {
               KvCache c = like.Copy();
               p.s->longest_prefix(t, c, limit, &rep);
               return c;
             });
             py::dict d;
             d["chunks"] = rep.chunks, d["bad"] = rep.bad, d["bytes"] = rep.bytes;
             d["lookup_s"] = rep.lookup_s, d["restore_s"] = rep.restore_s;
             return py::make_tuple(rep.tokens, std::move(c), d);
           })
      .def("chunk_tokens", [](const PyPrefixStore& p, const KvCache& c) { return p.s->chunk_tokens(c); })
      .def("chunk_plan", [](const PyPrefixStore& p, const KvCache& c) {
        const store::ChunkPlan plan = p.s->plan(c);
        return py::make_tuple(plan.tokens, plan.offset);
      })
      .def("keys",
           [](const PyPrefixStore& p, const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& tokens,
              const KvCache& c) {
             std::vector<std::string> out;
             for (const store::Key& k : store::chunk_keys(c, TokenIds(tokens), p.s->options().chunk_tokens,
                                                          p.s->options().model)) {
               out.push_back(hex_digest(k));
             }
             return out;
           })
      .def("describe", [](PyPrefixStore& p) { return p.s->backend().describe(); })
      .def("alive", [](PyPrefixStore& p) { return p.s->backend().alive(); })
      .def("take_warnings", [](PyPrefixStore& p) {
        std::vector<std::string> w;
        w.swap(*p.pending);
        return w;
      });

  // ---- grouped low-bit schemes ---------------------------------------------------
  // A model (GGUF or llama2.c) and its fp32 forward pass with the KV cache in a scheme.
  py::class_<model::Checkpoint, std::shared_ptr<model::Checkpoint>>(m, "Model")
      .def(py::init([](const std::string& path) { return std::make_shared<model::Checkpoint>(path); }))
      .def("config",
           [](const model::Checkpoint& c) {
             const model::Config& g = c.config();
             py::dict d;
             d["arch"] = g.arch, d["dim"] = g.dim, d["hidden_dim"] = g.hidden_dim, d["n_layers"] = g.n_layers;
             d["n_heads"] = g.n_heads, d["n_kv_heads"] = g.n_kv_heads, d["head_size"] = g.head_size();
             d["vocab_size"] = g.vocab_size, d["seq_len"] = g.seq_len, d["norm_eps"] = g.norm_eps;
             d["rope"] = g.rope.describe(), d["qkv_bias"] = g.qkv_bias, d["shared_classifier"] = g.shared_classifier;
             d["format"] = c.is_gguf() ? "gguf" : "llama2.c", d["format_version"] = c.format_version();
             d["tokenizer"] = c.tokenizer() != nullptr ? "sentencepiece" : c.tokenizer_problem();
             return d;
           })
      // tokens: int list; pass: "token" (one forward() per token), "window" (forward_window), "batched".
      .def("logits",
           [](const model::Checkpoint& c, const std::vector<int>& tokens, const std::string& kv,
              const std::string& pass) {
             KVQ_CHECK_ARG(pass == "token" || pass == "window" || pass == "batched", "forward: expected token, window "
                           "or batched, got '", pass, "'");
             KVQ_CHECK_ARG(!tokens.empty() && static_cast<int64_t>(tokens.size()) <= c.config().seq_len,
                           "tokens: expected 1..", c.config().seq_len, " ids, got ", tokens.size());
             const int T = static_cast<int>(tokens.size()), V = c.config().vocab_size;
             py::array_t<float> out({T, V});
             float* o = out.mutable_data();
             {
               py::gil_scoped_release release;
               model::Transformer tf(c, model::CacheScheme(kv), T);
               if (pass == "token") {
                 for (int t = 0; t < T; ++t) {
                   const std::span<const float> l = tf.forward(tokens[static_cast<size_t>(t)], t);
                   std::copy(l.begin(), l.end(), o + static_cast<size_t>(t) * V);
                 }
               } else {
                 const std::span<const float> l =
                     pass == "window" ? tf.forward_window(tokens) : tf.forward_batched(tokens);
                 std::copy(l.begin(), l.end(), o);
               }
             }
             return out;
           })
      .def("tokenize", [](const model::Checkpoint& c, const std::string& text, bool bos) {
        return model::load_tokenizer(c, "")->encode(text, bos);
      });
  m.def("read_token_file", &model::read_token_file);
  m.def("grouped_kv_presets", [] {
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& [name, g] : grouped_kv_presets()) out.emplace_back(name, g.name());
    return out;
  });
  m.def("grouped_kv_scheme_name", [](const std::string& name) { return parse_grouped_kv_scheme(name, "scheme").name(); });
  m.def("grouped_kv_scheme_bits", [](const std::string& name, int64_t T, int n_kv_heads, int head_dim) {
    KVQ_CHECK_ARG(T >= 1 && T <= (int64_t{1} << 40), "tokens: expected 1..2^40, got ", T);
    KVQ_CHECK_ARG(n_kv_heads >= 1 && head_dim >= 1 && int64_t{n_kv_heads} * head_dim <= (1 << 20),
                  "n_kv_heads, head_dim: expected >= 1 with at most 2^20 values a token");
    return parse_grouped_kv_scheme(name, "scheme").bits(T, n_kv_heads, head_dim);
  });
  py::class_<StaticRanges, std::shared_ptr<StaticRanges>>(m, "StaticRanges")
      .def_readonly("n_layers", &StaticRanges::n_layers)
      .def_readonly("n_kv_heads", &StaticRanges::n_kv_heads)
      .def_readonly("head_dim", &StaticRanges::head_dim)
      .def_readonly("samples", &StaticRanges::samples)
      .def_property_readonly("k_lo", [](const StaticRanges& r) { return VectorToNumpy(r.k_lo); })
      .def_property_readonly("k_hi", [](const StaticRanges& r) { return VectorToNumpy(r.k_hi); })
      .def_property_readonly("v_lo", [](const StaticRanges& r) { return VectorToNumpy(r.v_lo); })
      .def_property_readonly("v_hi", [](const StaticRanges& r) { return VectorToNumpy(r.v_hi); })
      .def_property_readonly("k_weight", [](const StaticRanges& r) { return VectorToNumpy(r.k_weight); });
  // k, v: lists (one per layer) of float32 (T, n_kv_heads * head_dim); k_weight: float32 (layers * E) or empty.
  m.def("static_ranges_from_samples", [](const std::vector<py::array>& k, const std::vector<py::array>& v,
                                         int n_kv_heads, int head_dim, double clip, const py::array& k_weight) {
    auto rows = [&](const std::vector<py::array>& in, const char* arg) {
      std::vector<std::vector<float>> out;
      for (const py::array& a : in) {
        const TensorView t = ViewOf(a, DType::F32, arg);
        out.emplace_back(t.data_as<float>(), t.data_as<float>() + t.numel());
      }
      return out;
    };
    auto r = std::make_shared<StaticRanges>(
        StaticRanges::from_samples(rows(k, "k"), rows(v, "v"), n_kv_heads, head_dim, clip));
    const TensorView w = ViewOf(k_weight, DType::F32, "k_weight");
    if (w.numel() > 0) {
      KVQ_CHECK_ARG(static_cast<size_t>(w.numel()) == r->k_lo.size(), "k_weight: expected ", r->k_lo.size(),
                    " values (layers x n_kv_heads x head_dim), got ", w.numel());
      r->k_weight.assign(w.data_as<float>(), w.data_as<float>() + w.numel());
      for (float x : r->k_weight) KVQ_CHECK_ARG(std::isfinite(x) && x >= 0, "k_weight: expected finite values >= 0");
    }
    return r;
  });
  m.def("spearman", [](const py::array& a, const py::array& b) {
    const TensorView av = ViewOf(a, DType::F32, "a"), bv = ViewOf(b, DType::F32, "b");
    return spearman({av.data_as<float>(), static_cast<size_t>(av.numel())},
                    {bv.data_as<float>(), static_cast<size_t>(bv.numel())});
  });
}
