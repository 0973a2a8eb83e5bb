// A model and its forward pass; token files; generation sessions (model/, session/).
#include "python/bindings/common.h"

#include <functional>

#include "model/eval.h"
#include "kvq/ggml_weights.h"
#include "model/gguf.h"
#include "model/transformer.h"
#include "model/tokens.h"
#include "session/generate.h"

namespace kvq::python {

void BindModel(py::module_& m) {
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
             py::dict types;
             for (const auto& [t, n] : c.weights().matrix_types()) types[py::str(model::ggml_type_name(t))] = n;
             d["weight_types"] = types, d["weight_bytes"] = c.weights().matrix_bytes();
             d["weight_bytes_per_token"] = c.weights().token_bytes();
             d["tokenizer"] = c.tokenizer() != nullptr ? c.tokenizer()->kind() : c.tokenizer_problem();
             return d;
           })
      // tokens: int list; pass: "token" (one forward() per token), "window" (forward_window), "batched".
      .def("logits",
           [](const model::Checkpoint& c, const std::vector<int>& tokens, const std::string& kv,
              const std::string& pass, const std::string& weight_dot) {
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
               tf.set_weight_dot(model::parse_weight_dot(weight_dot, "weight_dot"));
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
      })
      .def("tokenize_bytes", [](const model::Checkpoint& c, const py::bytes& text, bool bos) {
        return model::load_tokenizer(c, "")->encode(std::string(text), bos);
      })
      .def("detokenize", [](const model::Checkpoint& c, const std::vector<int>& ids) {
        const std::shared_ptr<const model::Tokenizer> t = model::load_tokenizer(c, "");
        std::string out;
        int prev = -1;
        for (int id : ids) out += t->decode(prev, id), prev = id;
        return py::bytes(out);
      });
  m.def("read_token_file", &model::read_token_file);
  // A GGUF tensor's bytes in a ggml type kvq reads (kvq/ggml_weights.h) as float32.
  m.def("dequantize_ggml", [](uint32_t type, const py::bytes& data, int64_t n) {
    KVQ_CHECK_ARG(ggml::weight_type_read(type), "ggml_type: expected a type kvq reads (kvq/ggml_weights.h), ",
                  "got ", model::ggml_type_name(type));
    const int64_t block = ggml::weight_block(type), bytes = ggml::weight_block_bytes(type);
    KVQ_CHECK_ARG(n >= 1 && n % block == 0, "n: expected a positive multiple of ", block, " (",
                  model::ggml_type_name(type), "'s block), got ", n);
    const std::string_view b = data;
    KVQ_CHECK_ARG(static_cast<int64_t>(b.size()) / bytes == n / block && static_cast<int64_t>(b.size()) % bytes == 0,
                  "data: expected ", n / block * bytes, " bytes for ", n, " ", model::ggml_type_name(type),
                  " values, got ", b.size());
    py::array_t<float> out(n);
    ggml::dequantize(type, reinterpret_cast<const uint8_t*>(b.data()), static_cast<size_t>(n), out.mutable_data());
    return out;
  }, py::arg("ggml_type"), py::arg("data"), py::arg("n"));
  // The integer path (kvq/ggml_weights.h): a float32 row rounded to the
  // activation format of a weight type, and rows of that type dotted with it.
  m.def("quantize_activation", [](uint32_t type, const py::array_t<float, py::array::c_style | py::array::forcecast>& x) {
    KVQ_CHECK_ARG(ggml::activation_type(type) != 0, "ggml_type: expected a block type with an integer path, got ",
                  model::ggml_type_name(type));
    const int64_t block = ggml::weight_block(type), n = x.size();
    KVQ_CHECK_ARG(x.ndim() == 1 && n >= 1 && n % block == 0, "x: expected one row of a positive multiple of ", block,
                  " values, got ", n);
    std::string out(ggml::activation_bytes(type, static_cast<size_t>(n)), '\0');
    ggml::quantize_activation(type, x.data(), static_cast<size_t>(n), reinterpret_cast<uint8_t*>(out.data()));
    return py::bytes(out);
  }, py::arg("ggml_type"), py::arg("x"));
  m.def("dot_ggml_int", [](uint32_t type, const py::bytes& weights, const py::bytes& activation, int64_t cols) {
    KVQ_CHECK_ARG(ggml::activation_type(type) != 0, "ggml_type: expected a block type with an integer path, got ",
                  model::ggml_type_name(type));
    const int64_t block = ggml::weight_block(type), bytes = ggml::weight_block_bytes(type);
    KVQ_CHECK_ARG(cols >= 1 && cols % block == 0, "cols: expected a positive multiple of ", block, ", got ", cols);
    const std::string_view w = weights, a = activation;
    const int64_t row_bytes = cols / block * bytes;
    KVQ_CHECK_ARG(!w.empty() && static_cast<int64_t>(w.size()) % row_bytes == 0, "weights: expected whole rows of ",
                  row_bytes, " bytes, got ", w.size());
    KVQ_CHECK_ARG(a.size() == ggml::activation_bytes(type, static_cast<size_t>(cols)), "activation: expected ",
                  ggml::activation_bytes(type, static_cast<size_t>(cols)), " bytes, got ", a.size());
    ggml::WeightMatrix m;
    m.type = type, m.data = reinterpret_cast<const uint8_t*>(w.data());
    m.rows = w.size() / static_cast<size_t>(row_bytes), m.cols = static_cast<size_t>(cols);
    m.row_bytes = static_cast<size_t>(row_bytes);
    py::array_t<float> out(static_cast<py::ssize_t>(m.rows));
    ggml::matvec_int(m, reinterpret_cast<const uint8_t*>(a.data()), 0, m.rows, out.mutable_data());
    return out;
  }, py::arg("ggml_type"), py::arg("weights"), py::arg("activation"), py::arg("cols"));
  // A generation session (session/generate.h): the library half of kvq generate.
  m.def("generate", [](const std::string& model, const std::string& tokenizer, const std::string& prompt,
                       const std::string& kv, int steps, double temperature, uint64_t seed, const std::string& save_cache,
                       const std::string& load_cache, const std::optional<std::string>& prompt_cache, int chunk,
                       double max_mb, int ttl, const std::string& secret, const py::object& on_text,
                       const std::vector<int>& tokens, int threads, int batch, bool calib_batched,
                       const std::string& weight_dot) {
    session::GenerateOptions o;
    o.model = model, o.tokenizer = tokenizer, o.prompt = prompt, o.kv = kv;
    o.tokens = tokens, o.threads = threads, o.batch = batch, o.calib_batched = calib_batched;
    o.weight_dot = weight_dot;
    o.steps = steps, o.temperature = temperature, o.seed = seed;
    o.save_cache = save_cache, o.load_cache = load_cache;
    o.prompt_cache = prompt_cache, o.prompt_cache_chunk = chunk, o.prompt_cache_max_mb = max_mb;
    o.prompt_cache_ttl = ttl, o.prompt_cache_secret = secret;
    std::vector<std::string> status;
    std::function<void(const std::string&)> text;
    if (!on_text.is_none()) {
      text = [&on_text](const std::string& piece) {
        py::gil_scoped_acquire gil;
        on_text(py::bytes(piece));
      };
    }
    const session::GenerateReport r = WithoutGil([&] {
      return session::generate(o, text, [&status](const std::string& line) { status.push_back(line); });
    });
    py::dict d;
    d["text"] = py::bytes(r.text);
    d["tokens"] = r.tokens, d["restored"] = r.restored, d["evaluated"] = r.evaluated, d["seconds"] = r.seconds;
    d["kv"] = r.kv, d["bits"] = r.bits, d["bytes"] = r.bytes, d["cache_tokens"] = r.cache_tokens;
    d["stored_chunks"] = r.stored_chunks, d["stored_bytes"] = r.stored_bytes, d["status"] = status;
    d["ids"] = r.ids, d["has_text"] = r.has_text, d["prefilled"] = r.prefilled, d["prefill_seconds"] = r.prefill_seconds;
    d["weight_dot"] = r.weight_dot;
    return d;
  });
}

}  // namespace kvq::python
