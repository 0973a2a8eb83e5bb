// E2: the cluster bank, its far field and the outlier quantizer; Spearman (kvq/cluster_bank.h, kvq/cluster_outliers.h, kvq/stats.h).
#include "python/bindings/common.h"

#include "kvq/cluster_bank.h"
#include "kvq/cluster_outliers.h"
#include "kvq/stats.h"

namespace kvq::python {
namespace {

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

void BindClusters(py::module_& m) {
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

  m.def("spearman", [](const py::array& a, const py::array& b) {
    const TensorView av = ViewOf(a, DType::F32, "a"), bv = ViewOf(b, DType::F32, "b");
    return spearman({av.data_as<float>(), static_cast<size_t>(av.numel())},
                    {bv.data_as<float>(), static_cast<size_t>(bv.numel())});
  });
}

}  // namespace kvq::python
