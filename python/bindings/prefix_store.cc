// The prefix store (store/prefix_store.h).
#include "python/bindings/common.h"

#include "store/prefix_store.h"

namespace kvq::python {
namespace {

struct PyPrefixStore {
  std::shared_ptr<std::vector<std::string>> pending = std::make_shared<std::vector<std::string>>();
  std::unique_ptr<store::PrefixStore> s;
};

}  // namespace

void BindPrefixStore(py::module_& m) {
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
}

}  // namespace kvq::python
