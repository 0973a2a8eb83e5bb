// The grouped store read back: tokens, attention, bytes held (kvq/grouped_kv.h).
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <limits>
#include <tuple>

#include "kvq/error.h"
#include "kvq/half.h"
#include "src/groups/store.h"

namespace kvq {

using grouped::OpenGrid;
using grouped::OpenReader;

// ---- reading -------------------------------------------------------------------

namespace {

// Token pos (0..T-1, past the sinks) of layer l as attention reads it at the
// layer's length: K in the tile frame (not yet rotated), V.
void HeldToken(const GroupedKvCache::Impl& m, const GroupedKvScheme& s, int l, int64_t pos, float* out) {
  const GroupedKvCache::Impl::Layer& ly = m.layers[static_cast<size_t>(l)];
  const size_t E = m.E, hd = static_cast<size_t>(m.hd);
  const int64_t T = ly.T, u = pos - m.S;
  if (m.calibrated && m.R > 0 && pos >= T - m.R) {
    f16_to_f32({ly.f16.data() + static_cast<size_t>(pos % m.R) * 2 * E, 2 * E}, {out, 2 * E});
    return;
  }
  if (m.calibrated || pos < s.coded_end(T)) {
    const uint8_t* rec = ly.recs[static_cast<size_t>(u / m.G)];
    std::vector<float> lo(hd), st(hd);
    for (size_t which = 0; which < 2; ++which) {
      for (size_t h = 0; h < static_cast<size_t>(m.H); ++h) {
        m.RecordParams(l, rec, which, h, lo.data(), st.data());
        for (size_t i = 0; i < hd; ++i) {
          out[which * E + h * hd + i] =
              lo[i] + st[i] * static_cast<float>(m.RecordCode(l, rec, which, h, static_cast<int>(u % m.G), i));
        }
      }
    }
    return;
  }
  OpenReader{m, ly, s, l}.Token(pos, /*for_attention=*/true, out);
}

// Tokens [t0, t1) (past the sinks) decoded to fp32 rows, K after RoPE.
AttentionPart DecodedPart(const GroupedKvCache::Impl& m, const GroupedKvScheme& s, int l, int64_t t0, int64_t t1,
                          std::span<const float> q, int n_heads, const DecodeAttentionOptions& o) {
  const size_t E = m.E;
  // Per-thread buffers: every attend of every layer decodes its open tokens.
  thread_local std::vector<float> kr, vr, x;
  kr.resize(static_cast<size_t>(t1 - t0) * E), vr.resize(kr.size()), x.resize(2 * E);
  for (int64_t t = t0; t < t1; ++t) {
    HeldToken(m, s, l, t, x.data());
    float* k = kr.data() + static_cast<size_t>(t - t0) * E;
    std::copy(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(E), k);
    std::copy(x.begin() + static_cast<std::ptrdiff_t>(E), x.end(), vr.data() + static_cast<size_t>(t - t0) * E);
    const int64_t tile = m.TileOf(t);
    rope_rotate(k, m.H, m.hd, m.TileCos(tile), m.TileSin(tile), /*transpose=*/false);
  }
  KvRowsView rows;
  rows.scheme = KvScheme::Fp32;
  rows.n_kv_heads = m.H;
  rows.head_dim = m.hd;
  rows.k = reinterpret_cast<const uint8_t*>(kr.data());
  rows.v = reinterpret_cast<const uint8_t*>(vr.data());
  rows.slice_bytes = E * sizeof(float);
  rows.slice_stride = rows.slice_bytes * static_cast<size_t>(t1 - t0);
  rows.tokens = t1 - t0;
  return decode_attention_part(q, n_heads, rows, o);
}

// The sinks' fp16 rows (K after RoPE) as a row view.
KvRowsView SinkRows(const GroupedKvCache::Impl& m, const GroupedKvCache::Impl::Layer& ly, int64_t n) {
  KvRowsView rows;
  rows.scheme = KvScheme::Fp16;
  rows.n_kv_heads = m.H;
  rows.head_dim = m.hd;
  rows.k = reinterpret_cast<const uint8_t*>(ly.sink.data());
  rows.v = reinterpret_cast<const uint8_t*>(ly.sink.data() + static_cast<size_t>(m.S) * m.E);
  rows.slice_bytes = m.E * sizeof(uint16_t);
  rows.slice_stride = rows.slice_bytes * static_cast<size_t>(m.S);
  rows.tokens = n;
  return rows;
}

}  // namespace

void GroupedKvCache::read(int layer, int64_t pos, std::span<float> k, std::span<float> v) const {
  const int64_t T = written(layer);
  KVQ_CHECK_ARG(pos >= 0 && pos < T, "read: expected 0 <= pos < ", T, " (tokens written), got ", pos);
  const Impl& m = *impl_;
  const size_t E = m.E;
  KVQ_CHECK_ARG(k.size() == E && v.size() == E, "k, v: expected ", E, " values each");
  const Impl::Layer& ly = m.layers[static_cast<size_t>(layer)];
  if (pos < m.S) {
    f16_to_f32({ly.sink.data() + static_cast<size_t>(pos) * E, E}, k);
    f16_to_f32({ly.sink.data() + (static_cast<size_t>(m.S) + static_cast<size_t>(pos)) * E, E}, v);
    return;
  }
  std::vector<float> x(2 * E);
  HeldToken(m, scheme_, layer, pos, x.data());
  std::copy(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(E), k.begin());
  std::copy(x.begin() + static_cast<std::ptrdiff_t>(E), x.end(), v.begin());
  const int64_t tile = m.TileOf(pos);
  rope_rotate(k.data(), m.H, m.hd, m.TileCos(tile), m.TileSin(tile), /*transpose=*/false);
}

namespace {
void CheckQuery(const GroupedKvCache& c, int layer, std::span<const float> q, int n_heads) {
  const int64_t T = c.written(layer);
  KVQ_CHECK_ARG(T >= 1, "layer ", layer, ": nothing written to attend to");
  KVQ_CHECK_ARG(n_heads >= 1 && n_heads % c.n_kv_heads() == 0 && n_heads / c.n_kv_heads() <= 64, "n_heads: expected a ",
                "multiple of n_kv_heads ", c.n_kv_heads(), " (at most 64 per KV head), got ", n_heads);
  KVQ_CHECK_ARG(q.size() == static_cast<size_t>(n_heads) * static_cast<size_t>(c.head_dim()), "q: expected ",
                n_heads * c.head_dim(), " values, got ", q.size());
  for (size_t i = 0; i < q.size(); ++i) KVQ_CHECK_ARG(std::isfinite(q[i]), "q: non-finite value at ", i);
}
}  // namespace

namespace {

// The fused kernel's call for layer l over its coded groups (calibrated:
// whole tiles), q already scaled.
grouped::Call KernelCall(const GroupedKvCache::Impl& m, int l, const float* qs, int n_heads) {
  grouped::Call c;
  c.groups = m.layers[static_cast<size_t>(l)].recs.data();
  c.layout = m.lay;
  c.n_kv_heads = m.H, c.head_dim = m.hd, c.n_heads = n_heads, c.group = m.G, c.v_bits = m.vbits;
  c.params = m.params;
  c.k_digits = m.k_digits, c.v_digits = m.v_digits;
  c.first = m.S;
  c.q = qs;
  c.tile_cos = m.tcos.data(), c.tile_sin = m.tsin.data();
  if (m.calibrated) c.k_static = m.Stat(l, 0, 0), c.v_static = m.Stat(l, 1, 0);
  if (m.params == grouped::Params::kP8) c.k_grid = m.Grid(l, 0, 0), c.v_grid = m.Grid(l, 1, 0);
  c.k_quad_bits = m.QuadBits(l, 0);
  c.k_quad_off = m.QuadOff(l, 0);
  return c;
}

// Groups the kernel reads at the layer's length, and where the tokens it
// does not read start.
std::pair<int64_t, int64_t> KernelExtent(const GroupedKvCache::Impl& m, const GroupedKvScheme& s, int l) {
  const GroupedKvCache::Impl::Layer& ly = m.layers[static_cast<size_t>(l)];
  const int64_t S = std::min<int64_t>(m.S, ly.T);
  if (m.calibrated) {
    const int64_t ce = std::max<int64_t>(S, s.coded_end(ly.T));
    const int64_t n = (ce - S) / grouped::kTile;
    return {n, S + n * grouped::kTile};
  }
  return {ly.n_coded, S + ly.n_coded * m.G};
}

}  // namespace

AttentionPart GroupedKvCache::coded_part(int layer, std::span<const float> q, int n_heads, int threads,
                                         float scale) const {
  CheckQuery(*this, layer, q, n_heads);
  KVQ_CHECK_ARG(threads >= 0 && threads <= 1024, "threads: expected 0..1024, got ", threads);
  KVQ_CHECK_ARG(std::isfinite(scale) && scale >= 0.0f, "scale: expected a finite value >= 0, got ", scale);
  const Impl& m = *impl_;
  const size_t nv = static_cast<size_t>(n_heads) * static_cast<size_t>(m.hd);
  const float sc = scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(m.hd));
  std::vector<float> qs(q.begin(), q.end());
  for (float& x : qs) x *= sc;
  const int64_t n_groups = KernelExtent(m, scheme_, layer).first;
  AttentionPart out;
  out.log_mass.assign(static_cast<size_t>(n_heads), -std::numeric_limits<double>::infinity());
  out.value.assign(nv, 0.0f);
  if (n_groups <= 0) return out;
  grouped::Call c = KernelCall(m, layer, qs.data(), n_heads);
  c.g0 = 0, c.g1 = n_groups, c.log_mass = out.log_mass.data(), c.value = out.value.data();
  if (threads == 1) {
    grouped::Attend(c);
    return out;
  }
  const int nt = static_cast<int>(std::min<int64_t>(threads > 0 ? threads : omp_get_max_threads(), n_groups));
  std::vector<AttentionPart> parts(static_cast<size_t>(nt));
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int i = 0; i < nt; ++i) {
    AttentionPart& p = parts[static_cast<size_t>(i)];
    p.log_mass.resize(static_cast<size_t>(n_heads));
    p.value.resize(nv);
    grouped::Call ci = c;
    ci.g0 = n_groups * i / nt, ci.g1 = n_groups * (i + 1) / nt;
    ci.log_mass = p.log_mass.data(), ci.value = p.value.data();
    grouped::Attend(ci);
  }
  return merge_attention_parts(parts);
}

void GroupedKvCache::attend(int layer, std::span<const float> q, int n_heads, std::span<float> out, int threads,
                            float scale) const {
  CheckQuery(*this, layer, q, n_heads);
  KVQ_CHECK_ARG(out.size() == q.size(), "out: expected ", q.size(), " values, got ", out.size());
  KVQ_CHECK_ARG(threads >= 0 && threads <= 1024, "threads: expected 0..1024, got ", threads);
  KVQ_CHECK_ARG(std::isfinite(scale) && scale >= 0.0f, "scale: expected a finite value >= 0, got ", scale);
  const Impl& m = *impl_;
  const Impl::Layer& ly = m.layers[static_cast<size_t>(layer)];
  const size_t nv = static_cast<size_t>(n_heads) * static_cast<size_t>(m.hd);
  const int64_t T = ly.T, S = std::min<int64_t>(m.S, T);
  const auto extent = KernelExtent(m, scheme_, layer);
  const int64_t n_groups = extent.first, ke = extent.second;  // (lambdas capture no bindings before clang 16)
  const float sc = scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(m.hd));
  std::vector<float> qs(q.begin(), q.end());
  for (float& x : qs) x *= sc;
  const grouped::Call c = KernelCall(m, layer, qs.data(), n_heads);
  DecodeAttentionOptions o;
  o.scale = scale;
  o.threads = 1;
  // The coded groups in chunks (a few per thread, taken as threads come
  // free: one slow core does not hold the call), then the tokens read
  // decoded (the open tokens, a calibrated cache's partial tile) in a
  // share per thread, then the sinks. Parts merge by log-sum-exp.
  const int64_t n_open = T - ke;
  int nt = threads > 0 ? threads : omp_get_max_threads();
  if (n_groups * 16 + n_open < 256) nt = 1;  // short: not worth a thread team
  const int64_t chunks = nt == 1 ? std::min<int64_t>(n_groups, 1) : std::min<int64_t>(n_groups, 4 * nt);
  const int64_t opens = n_open > 0 ? nt : 0, items = chunks + opens + (S > 0 ? 1 : 0);
  std::vector<AttentionPart> parts(static_cast<size_t>(items));
  const auto work = [&](int64_t i) {
    AttentionPart& p = parts[static_cast<size_t>(i)];
    if (i < chunks) {
      p.log_mass.resize(static_cast<size_t>(n_heads));
      p.value.resize(nv);
      grouped::Call ci = c;
      ci.g0 = n_groups * i / chunks, ci.g1 = n_groups * (i + 1) / chunks;
      ci.log_mass = p.log_mass.data(), ci.value = p.value.data();
      grouped::Attend(ci);
    } else if (i < chunks + opens) {
      const int64_t j = i - chunks, t0 = ke + n_open * j / opens, t1 = ke + n_open * (j + 1) / opens;
      if (t1 > t0) p = DecodedPart(m, scheme_, layer, t0, t1, q, n_heads, o);
    } else {
      p = decode_attention_part(q, n_heads, SinkRows(m, ly, S), o);
    }
  };
  if (nt == 1) {
    for (int64_t i = 0; i < items; ++i) work(i);
  } else {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) work(i);
  }
  std::vector<AttentionPart> used;
  for (AttentionPart& p : parts) {
    if (!p.log_mass.empty()) used.push_back(std::move(p));
  }
  const AttentionPart r = used.size() == 1 ? used.front() : merge_attention_parts(used);
  std::copy(r.value.begin(), r.value.end(), out.begin());
}

void GroupedKvCache::attend_ref(int layer, std::span<const float> q, int n_heads, std::span<float> out,
                                float scale) const {
  CheckQuery(*this, layer, q, n_heads);
  KVQ_CHECK_ARG(out.size() == q.size(), "out: expected ", q.size(), " values, got ", out.size());
  const int64_t T = written(layer);
  const int hd = head_dim_, rep = n_heads / n_kv_heads_;
  const size_t E = static_cast<size_t>(n_kv_heads_) * static_cast<size_t>(hd);
  const double s = scale > 0.0f ? scale : 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<float> K(static_cast<size_t>(T) * E), V(K.size());
  for (int64_t t = 0; t < T; ++t) {
    read(layer, t, {K.data() + static_cast<size_t>(t) * E, E}, {V.data() + static_cast<size_t>(t) * E, E});
  }
  std::vector<double> sc(static_cast<size_t>(T));
  for (int qh = 0; qh < n_heads; ++qh) {
    const size_t kh = static_cast<size_t>(qh / rep) * static_cast<size_t>(hd);
    const float* qv = q.data() + static_cast<size_t>(qh) * static_cast<size_t>(hd);
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t t = 0; t < T; ++t) {
      double d = 0;
      for (int i = 0; i < hd; ++i) d += static_cast<double>(qv[i]) * K[static_cast<size_t>(t) * E + kh + static_cast<size_t>(i)];
      sc[static_cast<size_t>(t)] = d * s;
      mx = std::max(mx, sc[static_cast<size_t>(t)]);
    }
    double z = 0;
    for (double& x : sc) z += (x = std::exp(x - mx));
    for (int i = 0; i < hd; ++i) {
      double a = 0;
      for (int64_t t = 0; t < T; ++t) a += sc[static_cast<size_t>(t)] * V[static_cast<size_t>(t) * E + kh + static_cast<size_t>(i)];
      out[static_cast<size_t>(qh) * static_cast<size_t>(hd) + static_cast<size_t>(i)] = static_cast<float>(a / z);
    }
  }
}

// ---- accounting ------------------------------------------------------------------

uint64_t GroupedKvCache::layer_bytes(int layer) const {
  const int64_t T = written(layer);
  const Impl& m = *impl_;
  uint64_t total = scheme_.layer_bytes(T, n_kv_heads_, head_dim_);
  if (!m.open_coded || T <= 0) return total;
  // Open units held in fp16 instead of their codes (outside the grid).
  const Impl::Layer& ly = m.layers[static_cast<size_t>(layer)];
  const auto [o0, f1, x0] = scheme_.OpenFp16(T);
  const int64_t w0 = scheme_.wide_start(T);
  const size_t hd = static_cast<size_t>(m.hd), H2 = 2 * static_cast<size_t>(m.H);
  for (int64_t t = std::max(o0, f1); t < x0; ++t) {
    const uint8_t* fl = ly.flags.data() + static_cast<size_t>(t) % m.cap * m.fslot;
    const int held = m.W > 0 && t >= w0 ? 8 : m.N;  // the unit's code width
    for (size_t un = 0; un < H2; ++un) {
      if ((fl[un / 8] >> (un % 8)) & 1) total += 2 * hd - hd * static_cast<size_t>(held) / 8;
    }
  }
  return total;
}

uint64_t GroupedKvCache::bytes() const {
  uint64_t total = 0;
  for (int l = 0; l < n_layers_; ++l) total += layer_bytes(l);
  return total;
}

double GroupedKvCache::bits() const {
  double tokens = 0;
  for (int l = 0; l < n_layers_; ++l) tokens += static_cast<double>(written(l));
  const double elements = 2.0 * tokens * static_cast<double>(impl_->E);
  return elements > 0 ? 8.0 * static_cast<double>(bytes()) / elements : 0.0;
}

uint64_t GroupedKvCache::allocated_bytes() const {
  const Impl& m = *impl_;
  uint64_t b = m.qbits.capacity() + 4 * m.qoff.capacity() + 4 * (m.grid.capacity() + m.stat.capacity()) +
               2 * m.table16.capacity() + 4 * (m.tcos.capacity() + m.tsin.capacity());
  for (const Impl::Layer& ly : m.layers) {
    b += ly.recs.allocated();
    b += 2 * (ly.sink.capacity() + ly.f16.capacity()) + ly.ncodes.capacity() + ly.flags.capacity() + ly.w8.capacity();
    b += ly.pool.allocated();
    for (const OpenGrid& og : ly.grids) b += 4 * (og.lo.capacity() + og.st.capacity() + og.st8.capacity());
  }
  return b;
}

}  // namespace kvq
