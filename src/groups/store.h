// The grouped store's internals (src/groups/): GroupedKvCache::Impl, the
// record chunks, the fp16 pool of open units, the open tokens' grids and
// their reader. Shared by store.cc (building, writing), read.cc (reading,
// attending, accounting) and state_io.cc (the held state as bytes).
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "kvq/error.h"
#include "kvq/grouped_kv.h"
#include "kvq/half.h"
#include "src/groups/attention.h"
#include "src/groups/encode.h"
#include "src/groups/grouped_cache.h"

namespace kvq {
namespace grouped {

constexpr float kF16Max = 65504.0f;
constexpr int kClipSteps = 4;  // m: each end of a group's range moved in by up to 4/16 of its width

// Adjacent fp16 values (h finite).
inline uint16_t F16Down(uint16_t h) {
  if (h == 0x0000) return 0x8001;
  return (h & 0x8000) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h - 1);
}
inline uint16_t F16Up(uint16_t h) {
  if (h == 0x8000) return 0x0001;
  return (h & 0x8000) ? static_cast<uint16_t>(h - 1) : static_cast<uint16_t>(h + 1);
}

constexpr int kQuad = 4;  // channels per K operand lane

// A layer's group records, back to back in chunks: a thread's share of the
// groups is one run of memory that the hardware prefetchers follow (a heap
// block a record scattered them: cold reads took 1.6x as long). Chunks
// double from one record up to kChunkBytes, so what is allocated grows with
// the records, at most one chunk ahead of them (the pages not yet taken are
// not touched); a record is zero when taken (fresh pages).
class RecordStore {
 public:
  static constexpr size_t kChunkBytes = size_t{256} << 10;
  void init(size_t rec_bytes) { rec_ = rec_bytes; }
  uint8_t* add() {
    if (left_ == 0) {
      if (used_ < chunks_.size()) {  // a chunk an earlier sequence filled (reset)
        next_ = chunks_[used_].p, left_ = chunks_[used_].bytes / rec_;
      } else {
        const size_t n = std::clamp<size_t>(ptr_.size(), 1, std::max<size_t>(1, kChunkBytes / rec_));
        const size_t bytes = (n * rec_ + kPage - 1) / kPage * kPage;
        // Pages of their own (mmap): what is resident is what was taken,
        // and a dropped cache returns them (heap chunks between other
        // allocations are neither).
        void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) throw std::bad_alloc();
        chunks_.push_back({static_cast<uint8_t*>(p), bytes});
        allocated_ += bytes;
        next_ = static_cast<uint8_t*>(p), left_ = bytes / rec_;
      }
      ++used_;
    }
    uint8_t* r = next_;
    // A fresh mapping's pages are zero; a reused slot is zeroed.
    if (used_ <= reused_) std::memset(r, 0, rec_);
    next_ += rec_, --left_;
    ptr_.push_back(r);
    return r;
  }
  // A new sequence: the records are dropped, their chunks kept for the
  // next ones (as an engine keeps its cache's memory; no page is faulted in
  // again). allocated() still counts them.
  void reset() {
    ptr_.clear();
    reused_ = used_, used_ = 0, left_ = 0, next_ = nullptr;
  }
  size_t size() const { return ptr_.size(); }
  uint8_t* operator[](size_t i) const { return ptr_[i]; }
  uint8_t* back() const { return ptr_.back(); }
  const uint8_t* const* data() const { return ptr_.data(); }
  void clear() {
    for (const Chunk& c : chunks_) ::munmap(c.p, c.bytes);
    chunks_.clear(), ptr_.clear(), ptr_.shrink_to_fit();
    left_ = 0, next_ = nullptr, allocated_ = 0, used_ = reused_ = 0;
  }
  RecordStore() = default;
  RecordStore(const RecordStore&) = delete;
  RecordStore& operator=(const RecordStore&) = delete;
  RecordStore(RecordStore&& o) noexcept { *this = std::move(o); }
  RecordStore& operator=(RecordStore&& o) noexcept {
    if (this != &o) {
      clear();
      chunks_ = std::move(o.chunks_), ptr_ = std::move(o.ptr_);
      rec_ = o.rec_, left_ = o.left_, next_ = o.next_, allocated_ = o.allocated_;
      used_ = o.used_, reused_ = o.reused_;
      o.chunks_.clear(), o.ptr_.clear(), o.left_ = 0, o.next_ = nullptr, o.allocated_ = 0;
      o.used_ = o.reused_ = 0;
    }
    return *this;
  }
  ~RecordStore() { clear(); }
  uint64_t allocated() const { return allocated_ + ptr_.capacity() * sizeof(void*) + chunks_.capacity() * sizeof(void*); }

 private:
  static constexpr size_t kPage = 4096;
  struct Chunk {
    uint8_t* p;
    size_t bytes;
  };
  std::vector<Chunk> chunks_;
  std::vector<uint8_t*> ptr_;
  size_t rec_ = 0, left_ = 0;
  size_t used_ = 0;    // chunks taken from, this sequence
  size_t reused_ = 0;  // chunks an earlier sequence wrote (zeroed as they are taken again)
  uint8_t* next_ = nullptr;
  uint64_t allocated_ = 0;
};

// fp16 units (a token's K or V of one KV head, head_dim halves) held for
// open tokens: the first group's and those outside their grid. Keys
// (pos * 2H + unit) are added in increasing order and dropped from the
// front at a hand-over.
class Fp16Pool {
 public:
  explicit Fp16Pool(size_t hd = 0) : hd_(hd) {}
  void add(int64_t key, const float* x) {
    key_.push_back(key);
    const size_t at = data_.size();
    data_.resize(at + hd_);
    f32_to_f16({x, hd_}, {data_.data() + at, hd_});
  }
  void add_halves(int64_t key, const uint16_t* h) {
    key_.push_back(key);
    data_.insert(data_.end(), h, h + hd_);
  }
  const uint16_t* find(int64_t key) const {
    const auto it = std::lower_bound(key_.begin(), key_.end(), key);
    if (it == key_.end() || *it != key) return nullptr;
    return data_.data() + static_cast<size_t>(it - key_.begin()) * hd_;
  }
  // Drops every key below `key`; gives memory back once mostly empty.
  void drop_before(int64_t key) {
    const size_t n = static_cast<size_t>(std::lower_bound(key_.begin(), key_.end(), key) - key_.begin());
    if (n == 0) return;
    key_.erase(key_.begin(), key_.begin() + static_cast<std::ptrdiff_t>(n));
    data_.erase(data_.begin(), data_.begin() + static_cast<std::ptrdiff_t>(n * hd_));
    if (data_.capacity() > 4 * data_.size() + 4096) {
      data_.shrink_to_fit();
      key_.shrink_to_fit();
    }
  }
  void clear() {
    std::vector<int64_t>().swap(key_);
    std::vector<uint16_t>().swap(data_);
  }
  size_t size() const { return key_.size(); }
  uint64_t allocated() const { return key_.capacity() * sizeof(int64_t) + data_.capacity() * sizeof(uint16_t); }
  const std::vector<int64_t>& keys() const { return key_; }

 private:
  size_t hd_;
  std::vector<int64_t> key_;
  std::vector<uint16_t> data_;
};

// Grids of the open tokens of one group g >= 1 (from group g - 1's range):
// per channel (K then V, 2E) lo, the N-bit step and the 8-bit step.
struct OpenGrid {
  int64_t group = -1;
  std::vector<float> lo, st, st8;
};


}  // namespace grouped

struct GroupedKvCache::Impl {
  // Geometry and layout.
  int L = 0, max_seq = 0, H = 0, hd = 0;
  size_t E = 0;
  int G = 0, S = 0, R = 0, X = 0, W = 0, N = 16;
  bool calibrated = false, open_coded = false, mse = false;
  grouped::Params params = grouped::Params::kFp16;
  grouped::RecordLayout lay;  // a group record's byte layout
  size_t hdr = 0;         // one head's K (or V) parameter bytes in a record
  size_t ktile = 0;       // one head's K tile
  size_t rec_bytes = 0;   // a record (every head)
  int vw = 16;            // V channels per operand
  int k_digits = 2, v_digits = 2;
  size_t cap = 0;         // open ring slots (dynamic: G + R)
  size_t nslot = 0;       // bytes of one slot's N-bit codes (2E N / 8)
  size_t fslot = 0;       // bytes of one slot's flags
  size_t wslots = 0;      // 8-bit ring slots (W + X)
  size_t xslots = 0;      // fp16 ring slots: the last X (o<N>), every open token (fp16 open), R (calibrated)
  // Tables, per layer: K bits and offset of every (head, quad); p8 grids and
  // static lo | step, per (K|V, head): base | unit | ustep / lo | step.
  std::vector<uint8_t> qbits;
  std::vector<uint32_t> qoff;
  std::vector<float> grid, stat;
  std::vector<uint16_t> table16;  // the stored form of the grid / static table: [layer][K|V][channel][2] fp16
  std::vector<float> tcos, tsin;  // rotation at every tile start S + 16 j: (tiles, hd / 2)

  struct Layer {
    int64_t T = 0;
    grouped::RecordStore recs;                              // complete groups (calibrated: started tiles)
    int64_t n_coded = 0;                           // records with their codes (dynamic)
    std::vector<uint16_t> sink;                    // S x [K (after RoPE) | V] fp16
    std::vector<uint16_t> f16;                     // fp16 ring: slot x [K (tile frame) | V]
    std::vector<uint8_t> ncodes, flags, w8;        // o<N> rings
    grouped::Fp16Pool pool;
    std::vector<grouped::OpenGrid> grids;                   // of the groups with open tokens
  };
  std::vector<Layer> layers;

  // ---- tables ----
  const uint8_t* QuadBits(int l, int h) const { return qbits.data() + (static_cast<size_t>(l) * H + static_cast<size_t>(h)) * (static_cast<size_t>(hd) / grouped::kQuad); }
  const uint32_t* QuadOff(int l, int h) const { return qoff.data() + (static_cast<size_t>(l) * H + static_cast<size_t>(h)) * (static_cast<size_t>(hd) / grouped::kQuad); }
  int ChannelBits(int l, size_t which, size_t c) const {
    return which == 0 ? QuadBits(l, 0)[c / grouped::kQuad] : 0;  // (c spans the heads: quads are contiguous)
  }
  const float* Grid(int l, size_t which, size_t h) const {
    return grid.data() + ((static_cast<size_t>(l) * 2 + which) * E + h * static_cast<size_t>(hd)) * 3;
  }
  const float* Stat(int l, size_t which, size_t h) const {
    return stat.data() + ((static_cast<size_t>(l) * 2 + which) * E + h * static_cast<size_t>(hd)) * 2;
  }
  const float* TileCos(int64_t tile) const { return tcos.data() + static_cast<size_t>(tile) * (static_cast<size_t>(hd) / 2); }
  const float* TileSin(int64_t tile) const { return tsin.data() + static_cast<size_t>(tile) * (static_cast<size_t>(hd) / 2); }
  int64_t TileOf(int64_t pos) const { return (pos - S) / grouped::kTile; }
  // Bits of channel c (= head * hd + i) of K (which 0) or V (1).
  int Bits(int l, size_t which, size_t c) const { return which == 0 ? qbits[static_cast<size_t>(l) * E / grouped::kQuad + c / grouped::kQuad] : vbits; }
  int vbits = 0;
  int levels_k_max = 0;

  // ---- records ----
  uint8_t* NewRecord(Layer& ly) { return ly.recs.add(); }
  // Channel c's parameters in a record (decoded): lo, step.
  void RecordParams(int l, const uint8_t* rec, size_t which, size_t h, float* lo, float* st) const {
    if (params == grouped::Params::kStatic) {
      const float* sp = Stat(l, which, h);
      std::copy(sp, sp + hd, lo);
      std::copy(sp + hd, sp + 2 * hd, st);
      return;
    }
    const uint8_t* p = rec + (which == 0 ? lay.kparams(h) : lay.vparams(h));
    grouped::DecodeGroupParams(p, static_cast<size_t>(hd), params == grouped::Params::kP8 ? Grid(l, which, h) : nullptr,
                               lo, st);
  }
  // The code of token u (0..G-1 in the record) and channel i of head h.
  uint32_t RecordCode(int l, const uint8_t* rec, size_t which, size_t h, int u, size_t i) const {
    if (which == 0) {
      const size_t k = i / grouped::kQuad;
      const uint8_t* tile = rec + lay.tile(static_cast<size_t>(u / grouped::kTile), h);
      return grouped::OperandCode(tile + QuadOff(l, static_cast<int>(h))[k], grouped::kQuad * (u % grouped::kTile) + static_cast<int>(i % grouped::kQuad),
                                  QuadBits(l, static_cast<int>(h))[k]);
    }
    const size_t x = i / static_cast<size_t>(vw), n = i % static_cast<size_t>(vw);
    return grouped::OperandCode(rec + lay.voperand(h, x, static_cast<size_t>(u / 4)), static_cast<int>(4 * n) + u % 4, vbits);
  }
  void SetRecordCode(int l, uint8_t* rec, size_t which, size_t h, int u, size_t i, uint32_t q) const {
    if (which == 0) {
      const size_t k = i / grouped::kQuad;
      uint8_t* tile = rec + lay.tile(static_cast<size_t>(u / grouped::kTile), h);
      grouped::SetOperandCode(tile + QuadOff(l, static_cast<int>(h))[k], grouped::kQuad * (u % grouped::kTile) + static_cast<int>(i % grouped::kQuad),
                              QuadBits(l, static_cast<int>(h))[k], q);
      return;
    }
    const size_t x = i / static_cast<size_t>(vw), n = i % static_cast<size_t>(vw);
    grouped::SetOperandCode(rec + lay.voperand(h, x, static_cast<size_t>(u / 4)), static_cast<int>(4 * n) + u % 4, vbits, q);
  }
};

namespace grouped {

// The grid of group g's open tokens (g >= 1) from group g - 1's record (store.cc).
void MakeOpenGrid(const GroupedKvCache::Impl& m, int l, const uint8_t* prev, int64_t g, OpenGrid& out);
// The open store of token pos (group g >= 1) from its fp16 values, as the
// store holds it (grouped_kv.h): the N-bit codes, the 8-bit ones (w), a flag
// per unit outside the grid (its fp16 values to the pool), the x ring (store.cc).
void OpenFromHalves(GroupedKvCache::Impl& m, GroupedKvCache::Impl::Layer& ly, int64_t pos, const OpenGrid& og,
                    const float* x);

inline const OpenGrid& GridOf(const GroupedKvCache::Impl::Layer& ly, int64_t g) {
  for (const OpenGrid& og : ly.grids) {
    if (og.group == g) return og;
  }
  KVQ_ASSERT(false);
  return ly.grids.front();
}


// The value the store holds for token pos, unit un, channel i of the open
// store, for encoding its group (fallback units and the first group in
// fp16, the rest their N-bit codes' values) or for attention at length T
// (also the last x in fp16 and the w tier's 8-bit codes).
struct OpenReader {
  const GroupedKvCache::Impl& m;
  const GroupedKvCache::Impl::Layer& ly;
  const GroupedKvScheme& s;
  int layer;
  // All 2E values of token pos into out (K in the tile frame).
  void Token(int64_t pos, bool for_attention, float* out) const {
    const size_t E = m.E, hd = static_cast<size_t>(m.hd), H = static_cast<size_t>(m.H);
    const int64_t T = ly.T;
    if (!m.open_coded) {
      f16_to_f32({ly.f16.data() + static_cast<size_t>(pos) % m.cap * 2 * E, 2 * E}, {out, 2 * E});
      return;
    }
    const int64_t g = (pos - m.S) / m.G;
    if (g >= 1 && for_attention && m.X > 0 && pos >= T - m.X) {
      f16_to_f32({ly.f16.data() + static_cast<size_t>(pos) % m.xslots * 2 * E, 2 * E}, {out, 2 * E});
      return;
    }
    const size_t slot = static_cast<size_t>(pos) % m.cap;
    const uint8_t* fl = ly.flags.data() + slot * m.fslot;
    if (g >= 1) {
      const OpenGrid& og = GridOf(ly, g);
      const bool wide = for_attention && m.W > 0 && pos >= s.wide_start(T);
      if (wide) {
        const uint8_t* c8 = ly.w8.data() + static_cast<size_t>(pos) % m.wslots * 2 * E;
        for (size_t c = 0; c < 2 * E; ++c) out[c] = og.lo[c] + og.st8[c] * static_cast<float>(c8[c]);
      } else {
        thread_local std::vector<uint8_t> q;  // read once per open token and attend: no allocation each time
        if (q.size() < 2 * E) q.resize(2 * E);
        grouped::UnpackCodes(ly.ncodes.data() + slot * m.nslot, 2 * E, m.N, q.data());
        for (size_t c = 0; c < 2 * E; ++c) out[c] = og.lo[c] + og.st[c] * static_cast<float>(q[c]);
      }
    }
    for (size_t un = 0; un < 2 * H; ++un) {
      if (g >= 1 && !((fl[un / 8] >> (un % 8)) & 1)) continue;
      const uint16_t* h = ly.pool.find(pos * static_cast<int64_t>(2 * H) + static_cast<int64_t>(un));
      KVQ_ASSERT(h != nullptr);
      f16_to_f32({h, hd}, {out + un * hd, hd});
    }
  }
};


}  // namespace grouped
}  // namespace kvq
