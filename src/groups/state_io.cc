// The grouped store's held state as bytes, and back (kvq/grouped_kv.h).
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
using grouped::MakeOpenGrid;
using grouped::OpenFromHalves;

// ---- the held state as bytes -----------------------------------------------------
//
// Per layer, in this order (little-endian; T = the layer's length, o0 =
// max(S, coded_end(T))):
//   sinks      min(S, T) K rows then as many V rows, fp16 (K after RoPE)
//   calibrated every started tile's record (codes), then the last
//              min(R, T - S) tokens' fp16 K (tile frame) | V
//   dynamic    every complete group's record, per head: K parameters, K
//              tiles (coded groups only), V parameters, V codes (coded only);
//              then each open token in [o0, T): fp16 K | V (no o<N>, the
//              first group, the last x), or its flags (a bit per unit) and per
//              unit its codes (N-bit, or 8-bit in the w tier) or, when
//              flagged, its fp16 values.
// Its size is layer_bytes() less the tables (saved by the container).

namespace {

void PutHalves(std::vector<uint8_t>& out, const uint16_t* h, size_t n) {
  if (n == 0) return;
  const size_t at = out.size();
  out.resize(at + 2 * n);
  std::memcpy(out.data() + at, h, 2 * n);
}
void PutBytes(std::vector<uint8_t>& out, const uint8_t* p, size_t n) { out.insert(out.end(), p, p + n); }

// Bounds-checked reads of a saved state held in one or more pieces (a
// restore from ranges reads the ranges' pieces in place). A read within a
// piece points into it; one across pieces is gathered into a scratch buffer
// (valid until the next read).
struct StateReader {
  std::span<const std::span<const uint8_t>> pieces;
  size_t total = 0, pos = 0, piece = 0, off = 0;
  std::vector<uint8_t> scratch;
  explicit StateReader(std::span<const std::span<const uint8_t>> p) : pieces(p) {
    for (const auto& x : pieces) total += x.size();
  }
  size_t left() const { return total - pos; }
  const uint8_t* take(size_t n) {
    static const uint8_t kNone = 0;
    if (n > total - pos) Fail("cache state: truncated (needs ", n, " bytes at byte ", pos, " of ", total, ")");
    pos += n;
    if (n == 0) return &kNone;
    while (off == pieces[piece].size()) ++piece, off = 0;
    if (pieces[piece].size() - off >= n) {
      const uint8_t* p = pieces[piece].data() + off;
      off += n;
      return p;
    }
    scratch.resize(n);
    for (size_t got = 0; got < n;) {
      while (off == pieces[piece].size()) ++piece, off = 0;
      const size_t k = std::min(n - got, pieces[piece].size() - off);
      std::memcpy(scratch.data() + got, pieces[piece].data() + off, k);
      got += k, off += k;
    }
    return scratch.data();
  }
  // fp16 values that must be finite.
  void halves(uint16_t* out, size_t n, const char* what) {
    if (n == 0) return;
    std::memcpy(out, take(2 * n), 2 * n);
    for (size_t i = 0; i < n; ++i) {
      if ((out[i] & 0x7C00) == 0x7C00) Fail("cache state: non-finite fp16 value in ", what);
    }
  }
};

}  // namespace

// Records that never change once the cache holds T tokens: the coded groups
// (dynamic) or the full tiles (calibrated).
int64_t GroupedKvCache::final_records(int64_t T) const {
  const int64_t S = scheme_.sinks;
  if (T <= S) return 0;
  return scheme_.calibrated ? (T - S) / 16 : (scheme_.coded_end(T) - S) / scheme_.group;
}

// One layer's held bytes as save_state writes them, from token `from` on:
// the sinks in [from, T), the final records made since `from` and the rest
// (the records still changing and the open tokens; in a range, after its
// u64 size).
void GroupedKvCache::SaveLayer(int l, int64_t from, bool range, std::vector<uint8_t>& out) const {
  const Impl& m = *impl_;
  const size_t E = m.E, hd = static_cast<size_t>(m.hd), H2 = 2 * static_cast<size_t>(m.H);
  const Impl::Layer& ly = m.layers[static_cast<size_t>(l)];
  const int64_t T = ly.T;
  const size_t s0 = static_cast<size_t>(std::min<int64_t>(m.S, from)), s1 = static_cast<size_t>(std::min<int64_t>(m.S, T));
  PutHalves(out, ly.sink.data() + s0 * E, (s1 - s0) * E);
  PutHalves(out, ly.sink.data() + (static_cast<size_t>(m.S) + s0) * E, (s1 - s0) * E);
  const size_t f0 = static_cast<size_t>(final_records(from)), f1 = static_cast<size_t>(final_records(T));
  KVQ_ASSERT(f1 <= ly.recs.size() && (m.calibrated || static_cast<int64_t>(f1) == ly.n_coded));
  for (size_t g = f0; g < f1; ++g) PutBytes(out, ly.recs[g], m.rec_bytes);
  size_t size_at = out.size();
  if (range) out.resize(out.size() + 8);
  const size_t tail_at = out.size();
  if (T > m.S && m.calibrated) {
    for (size_t g = f1; g < ly.recs.size(); ++g) PutBytes(out, ly.recs[g], m.rec_bytes);
    for (int64_t t = std::max<int64_t>(m.S, T - m.R); t < T; ++t) {
      PutHalves(out, ly.f16.data() + static_cast<size_t>(t % m.R) * 2 * E, 2 * E);
    }
  } else if (T > m.S) {
    // parameters from completion, codes from the hand-over
    for (size_t g = f1; g < ly.recs.size(); ++g) PutBytes(out, ly.recs[g], m.lay.codes());
    const int64_t o0 = std::max<int64_t>(m.S, scheme_.coded_end(T)), w0 = scheme_.wide_start(T);
    std::vector<float> x(2 * E);
    std::vector<uint16_t> h16(2 * E);
    const OpenReader rd{m, ly, scheme_, l};
    for (int64_t t = o0; t < T; ++t) {
      const int64_t g = (t - m.S) / m.G;
      if (!m.open_coded || g == 0 || (m.X > 0 && t >= T - m.X)) {  // fp16 whole
        rd.Token(t, /*for_attention=*/true, x.data());
        f32_to_f16(x, h16);
        PutHalves(out, h16.data(), 2 * E);
        continue;
      }
      const size_t slot = static_cast<size_t>(t) % m.cap;
      const uint8_t* fl = ly.flags.data() + slot * m.fslot;
      PutBytes(out, fl, m.fslot);
      const bool wide = m.W > 0 && t >= w0;
      for (size_t un = 0; un < H2; ++un) {
        if ((fl[un / 8] >> (un % 8)) & 1) {
          PutHalves(out, ly.pool.find(t * static_cast<int64_t>(H2) + static_cast<int64_t>(un)), hd);
        } else if (wide) {
          PutBytes(out, ly.w8.data() + static_cast<size_t>(t) % m.wslots * 2 * E + un * hd, hd);
        } else {
          const size_t ub = hd * static_cast<size_t>(m.N) / 8;
          PutBytes(out, ly.ncodes.data() + slot * m.nslot + un * ub, ub);
        }
      }
    }
  }
  if (range) {
    const uint64_t tail = out.size() - tail_at;
    std::memcpy(out.data() + size_at, &tail, 8);
  }
}

void GroupedKvCache::save_state(std::vector<uint8_t>& out) const {
  for (int l = 0; l < n_layers_; ++l) SaveLayer(l, 0, /*range=*/false, out);
}

void GroupedKvCache::save_range_state(int64_t from, std::vector<uint8_t>& out) const {
  for (int l = 0; l < n_layers_; ++l) {
    const int64_t T = written(l);
    KVQ_CHECK_ARG(from >= 0 && from < T, "range: expected a first token in 0..", T - 1, " (layer ", l, " holds ", T,
                  " tokens), got ", from);
  }
  for (int l = 0; l < n_layers_; ++l) SaveLayer(l, from, /*range=*/true, out);
}

void GroupedKvCache::load_range_states(std::span<const std::span<const uint8_t>> parts,
                                       std::span<const int64_t> ends) {
  KVQ_CHECK_ARG(!parts.empty() && parts.size() == ends.size(), "ranges: expected as many ends as states (>= 1), got ",
                ends.size(), " and ", parts.size());
  const Impl& m = *impl_;
  const size_t L = static_cast<size_t>(n_layers_), E = m.E;
  // Where each piece lies (no copy yet): per layer the sinks' K and V, the
  // final records of every range, and the open state of the last one.
  using Piece = std::span<const uint8_t>;
  std::vector<std::vector<Piece>> sk(L), sv(L), recs(L);
  std::vector<Piece> tail(L);
  int64_t begin = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const int64_t end = ends[i];
    KVQ_CHECK_ARG(end > begin && end <= max_seq_, "ranges: range ", i, " ends at ", end, ", expected ", begin + 1,
                  "..", max_seq_);
    StateReader rd{std::span(&parts[i], 1)};
    const size_t ns = static_cast<size_t>(std::min<int64_t>(m.S, end) - std::min<int64_t>(m.S, begin));
    const size_t nf = static_cast<size_t>(final_records(end) - final_records(begin));
    auto take = [&](size_t n) { return Piece(rd.take(n), n); };
    for (size_t l = 0; l < L; ++l) {
      sk[l].push_back(take(2 * ns * E));
      sv[l].push_back(take(2 * ns * E));
      KVQ_CHECK_ARG(nf <= rd.left() / std::max<size_t>(m.rec_bytes, 1), "cache state: range ", i,
                    " is truncated (", nf, " records of ", m.rec_bytes, " bytes)");
      recs[l].push_back(take(nf * m.rec_bytes));
      uint64_t n;
      std::memcpy(&n, rd.take(8), 8);
      KVQ_CHECK_ARG(n <= rd.left(), "cache state: range ", i, " layer ", l, ": ", n,
                    " bytes of open state past the end");
      tail[l] = take(static_cast<size_t>(n));
    }
    KVQ_CHECK_ARG(rd.left() == 0, "cache state: range ", i, " has ", rd.left(), " bytes past its last layer");
    begin = end;
  }
  // The whole state's order, read in place.
  std::vector<Piece> whole;
  for (size_t l = 0; l < L; ++l) {
    for (const auto* v : {&sk[l], &sv[l], &recs[l]}) whole.insert(whole.end(), v->begin(), v->end());
    whole.push_back(tail[l]);
  }
  const std::vector<int64_t> lengths(L, begin);
  LoadPieces(whole, lengths);
}

void GroupedKvCache::load_state(std::span<const uint8_t> in, std::span<const int64_t> lengths) {
  LoadPieces(std::span(&in, 1), lengths);
}

void GroupedKvCache::LoadPieces(std::span<const std::span<const uint8_t>> in, std::span<const int64_t> lengths) {
  Impl& m = *impl_;
  KVQ_CHECK_ARG(lengths.size() == static_cast<size_t>(n_layers_), "cache state: expected ", n_layers_,
                " layer lengths, got ", lengths.size());
  for (int64_t T : lengths) {
    KVQ_CHECK_ARG(T >= 0 && T <= max_seq_, "cache state: a layer length of ", T, " is outside 0..", max_seq_);
  }
  const size_t E = m.E, hd = static_cast<size_t>(m.hd), H2 = 2 * static_cast<size_t>(m.H);
  StateReader rd{in};
  try {
    for (int l = 0; l < n_layers_; ++l) {
      Impl::Layer& ly = m.layers[static_cast<size_t>(l)];
      ly.recs.clear(), ly.n_coded = 0, ly.pool.clear(), ly.grids.clear();
      const int64_t T = lengths[static_cast<size_t>(l)];
      ly.T = T;
      const size_t ns = static_cast<size_t>(std::min<int64_t>(m.S, T));
      rd.halves(ly.sink.data(), ns * E, "the sinks");
      rd.halves(ly.sink.data() + static_cast<size_t>(m.S) * E, ns * E, "the sinks");
      if (T <= m.S) continue;
      if (m.calibrated) {
        for (int64_t j = 0; j < (T - m.S + 15) / 16; ++j) std::memcpy(m.NewRecord(ly), rd.take(m.rec_bytes), m.rec_bytes);
        for (int64_t t = std::max<int64_t>(m.S, T - m.R); t < T; ++t) {
          rd.halves(ly.f16.data() + static_cast<size_t>(t % m.R) * 2 * E, 2 * E, "the recent tokens");
        }
        continue;
      }
      const int64_t complete = (scheme_.complete_end(T) - m.S) / m.G, coded = (scheme_.coded_end(T) - m.S) / m.G;
      for (int64_t g = 0; g < complete; ++g) {
        uint8_t* rec = m.NewRecord(ly);
        std::memcpy(rec, rd.take(g < coded ? m.rec_bytes : m.lay.codes()), g < coded ? m.rec_bytes : m.lay.codes());
        for (size_t which = 0; which < 2; ++which) {
          for (size_t h = 0; h < static_cast<size_t>(m.H); ++h) {
            const uint8_t* prm = rec + (which == 0 ? m.lay.kparams(h) : m.lay.vparams(h));
            if (m.params == grouped::Params::kP8) {
              for (size_t i = 0; i < hd; ++i) {
                if (prm[i] > prm[hd + i]) Fail("cache state: a group range with its low end above its high end");
              }
            } else {
              for (size_t i = 0; i < 2 * hd; ++i) {
                uint16_t h16;
                std::memcpy(&h16, prm + 2 * i, 2);
                if ((h16 & 0x7C00) == 0x7C00 || (i >= hd && (h16 & 0x8000) && (h16 & 0x7FFF))) {
                  Fail("cache state: a group parameter that is not finite or a negative step");
                }
              }
            }
          }
        }
      }
      ly.n_coded = coded;
      const int64_t o0 = std::max<int64_t>(m.S, scheme_.coded_end(T)), w0 = scheme_.wide_start(T);
      std::vector<uint16_t> h16(2 * E);
      std::vector<float> x(2 * E);
      for (int64_t t = o0; t < T; ++t) {
        const int64_t g = (t - m.S) / m.G;
        const size_t slot = static_cast<size_t>(t) % std::max<size_t>(m.cap, 1);
        if (m.open_coded && g >= 1 && (ly.grids.empty() || ly.grids.back().group != g)) {
          ly.grids.emplace_back();
          MakeOpenGrid(m, l, ly.recs[static_cast<size_t>(g - 1)], g, ly.grids.back());
        }
        if (!m.open_coded) {
          rd.halves(ly.f16.data() + slot * 2 * E, 2 * E, "an open token");
          continue;
        }
        if (g == 0) {
          rd.halves(h16.data(), 2 * E, "an open token");
          std::fill(ly.flags.begin() + static_cast<std::ptrdiff_t>(slot * m.fslot),
                    ly.flags.begin() + static_cast<std::ptrdiff_t>((slot + 1) * m.fslot), 0xFF);
          for (size_t un = 0; un < H2; ++un) ly.pool.add_halves(t * static_cast<int64_t>(H2) + static_cast<int64_t>(un), h16.data() + un * hd);
          continue;
        }
        const OpenGrid& og = ly.grids.back();
        if (m.X > 0 && t >= T - m.X) {
          rd.halves(h16.data(), 2 * E, "an open token");
          f16_to_f32(h16, x);
          OpenFromHalves(m, ly, t, og, x.data());
          continue;
        }
        uint8_t* fl = ly.flags.data() + slot * m.fslot;
        std::memcpy(fl, rd.take(m.fslot), m.fslot);
        if (H2 % 8 != 0 && (fl[m.fslot - 1] >> (H2 % 8)) != 0) Fail("cache state: flag bits set past the last unit");
        const bool wide = m.W > 0 && t >= w0;
        const size_t ub = hd * static_cast<size_t>(m.N) / 8;
        std::vector<uint8_t> qn(2 * E, 0);
        uint8_t* c8 = wide ? ly.w8.data() + static_cast<size_t>(t) % m.wslots * 2 * E : nullptr;
        for (size_t un = 0; un < H2; ++un) {
          if ((fl[un / 8] >> (un % 8)) & 1) {
            rd.halves(h16.data(), hd, "a fallback unit");
            ly.pool.add_halves(t * static_cast<int64_t>(H2) + static_cast<int64_t>(un), h16.data());
          } else if (wide) {
            std::memcpy(c8 + un * hd, rd.take(hd), hd);
            const int nlev = (1 << m.N) - 1;
            for (size_t i = 0; i < hd; ++i) {  // the N-bit codes made from the 8-bit ones, as write() does
              const size_t c = un * hd + i;
              qn[c] = grouped::CodeOf(og.lo[c] + og.st8[c] * static_cast<float>(c8[c]), og.lo[c], og.st[c], nlev);
            }
          } else {
            const uint8_t* p = rd.take(ub);
            for (size_t i = 0; i < hd; ++i) qn[un * hd + i] = static_cast<uint8_t>(grouped::OperandCode(p, static_cast<int>(i), m.N));
          }
        }
        grouped::PackOperand(qn.data(), static_cast<int>(2 * E), m.N, ly.ncodes.data() + slot * m.nslot);
      }
    }
    if (rd.left() != 0) Fail("cache state: ", rd.left(), " bytes past the end of the last layer");
  } catch (...) {
    for (Impl::Layer& ly : m.layers) {
      ly.T = 0, ly.recs.clear(), ly.n_coded = 0, ly.pool.clear(), ly.grids.clear();
    }
    throw;
  }
}

}  // namespace kvq
