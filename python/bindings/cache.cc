// The KV cache, decode attention, scheme names, grouped schemes and static ranges (kvq/kv_cache.h).
#include "python/bindings/common.h"

#include "kvq/attention.h"
#include "kvq/grouped_kv.h"
#include "kvq/kv_scheme.h"

namespace kvq::python {

void BindCache(py::module_& m) {
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

  m.def("grouped_kv_presets", [](int head_dim) {
    KVQ_CHECK_ARG(head_dim >= 0 && head_dim <= (1 << 20), "head_dim: expected 0..2^20, got ", head_dim);
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& [name, g] : grouped_kv_presets()) out.emplace_back(name, grouped_kv_preset(name, head_dim)->name());
    return out;
  }, py::arg("head_dim") = 0);
  m.def("grouped_kv_scheme_name", [](const std::string& name) { return parse_grouped_kv_scheme(name, "scheme").name(); });
  m.def("grouped_kv_scheme_bits", [](const std::string& name, int64_t T, int n_kv_heads, int head_dim) {
    KVQ_CHECK_ARG(T >= 1 && T <= (int64_t{1} << 40), "tokens: expected 1..2^40, got ", T);
    KVQ_CHECK_ARG(n_kv_heads >= 1 && head_dim >= 1 && int64_t{n_kv_heads} * head_dim <= (1 << 20),
                  "n_kv_heads, head_dim: expected >= 1 with at most 2^20 values a token");
    const std::optional<GroupedKvScheme> preset = grouped_kv_preset(name, head_dim);  // as a cache resolves it
    return (preset ? *preset : parse_grouped_kv_scheme(name, "scheme")).bits(T, n_kv_heads, head_dim);
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
}

}  // namespace kvq::python
