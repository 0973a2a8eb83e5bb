// _kvq: the pybind11 extension behind the `kvq` Python package
// (python/kvq/__init__.py adds the seed note's signatures, torch support and
// docstrings). Arrays cross the boundary as C-contiguous numpy arrays with an
// explicit element type ("float32", "float16", "bfloat16" = uint16 bits);
// outputs are numpy arrays that own the C++ buffer (no copy). kvq::Error
// becomes kvq.Error, a subclass of ValueError. Heavy work runs without the GIL.
#include "python/bindings/common.h"

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

  BindAffine(m);
  BindSortedProfile(m);
  BindClusters(m);
  BindCache(m);
  BindPrefixStore(m);
  BindModel(m);
}
