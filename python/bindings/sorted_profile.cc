// G4: sorted profiles and their fitted tails (kvq/sorted_profile.h).
#include "python/bindings/common.h"

#include "kvq/sorted_profile.h"

namespace kvq::python {

void BindSortedProfile(py::module_& m) {
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
}

}  // namespace kvq::python
