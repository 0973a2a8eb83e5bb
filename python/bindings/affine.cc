// SIMD targets and the seed's int8 / fp8 affine quantization (kvq/targets.h, kvq/affine.h).
#include "python/bindings/common.h"

#include "kvq/targets.h"

namespace kvq::python {

void BindAffine(py::module_& m) {
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
}

}  // namespace kvq::python
