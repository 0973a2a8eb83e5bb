// The grouped kernel's wide integer path: codes in 16-bit lanes, the x86
// byte path of the V sums (vpmaddubsw), at 256 or 512 bits.
// A fragment of src/groups/attention.cc, included by it inside its
// per-target namespace (kvq::grouped::HWY_NAMESPACE, once per Highway
// target, as foreach_target re-includes that file): it reads the file's
// Call, Work and the scalar loops' helpers above the include. No include
// guard on purpose.
#if HWY_TARGET != HWY_SCALAR && !HWY_HAVE_SCALABLE
#undef KVQ_WIDE
#define KVQ_WIDE 1
// ---- wide integer dot products (every fixed-width target; AVX3_DL uses VNNI when it can) ----
// Codes unpacked to 16-bit lanes, weights as 16-bit integers (the digits'
// value 128 hi + lo, as the scalar loops above form it), multiplied by
// ReorderWidenMulAccumulate (vpmaddwd on x86, smull/smlal on NEON) and
// paired by RearrangeToOddPlusEven: the same exact integer sums as
// ScoresPortable / AccumulateVPortable, then the same float operations, so
// the same scores and outputs bit for bit (tested).
// Rounds a and b (in the int16 range) to the nearest integer, ties to even,
// and stores them as 2 N 16-bit integers in order: on x86 one cvtps2dq each
// (no overflow fix-up: the values are in range by construction) and one
// pack; elsewhere NearestInt and DemoteTo.
template <class D>
HWY_INLINE void StoreNearest16x2(D d, hn::Vec<D> a, hn::Vec<D> b, int16_t* HWY_RESTRICT out) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  if constexpr (hn::MaxLanes(D()) == 8) {
    const __m256i p = _mm256_packs_epi32(_mm256_cvtps_epi32(a.raw), _mm256_cvtps_epi32(b.raw));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(p, 0xD8));
    return;
  }
#endif
  const hn::Rebind<int16_t, D> d16;
  hn::StoreU(hn::DemoteTo(d16, hn::NearestInt(a)), d16, out);
  hn::StoreU(hn::DemoteTo(d16, hn::NearestInt(b)), d16, out + hn::Lanes(d));
}

// TileWeights for the wide path, for the RB query heads [qh0, qh0 + RB) of
// one KV head (the rotation and lo / step loaded once): the weights as
// 16-bit integers (w.w16; |W^| <= kMaxW by the choice of sigma, so the
// digits' value 128 hi + lo is W^ itself) and C, in one pass.
template <int RB, class D>
HWY_INLINE void TileWeightsWideBlock(D d, size_t h, size_t qh0, Work& w) {
  const hn::Rebind<int16_t, D> d16;
  const size_t N = hn::Lanes(d), hd = w.hd;
  // The arrays as restrict locals: the stores to w16 need not reload them.
  const float* HWY_RESTRICT lam = w.lam + h * hd;
  const float* HWY_RESTRICT cos2 = w.cos2;
  const float* HWY_RESTRICT sin2 = w.sin2;
  const float* HWY_RESTRICT wa = w.a + qh0 * hd;
  const float* HWY_RESTRICT wb = w.b + qh0 * hd;
  int16_t* HWY_RESTRICT w16 = w.w16 + qh0 * hd;
  hn::Vec<D> s[RB];
  for (int r = 0; r < RB; ++r) s[r] = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * N <= hd; i += 2 * N) {  // two vectors at a time: one pack
    const auto c0 = hn::LoadU(d, cos2 + i), s0 = hn::LoadU(d, sin2 + i), l0 = hn::LoadU(d, lam + i);
    const auto c1 = hn::LoadU(d, cos2 + i + N), s1 = hn::LoadU(d, sin2 + i + N), l1 = hn::LoadU(d, lam + i + N);
    for (int r = 0; r < RB; ++r) {
      const float* a = wa + static_cast<size_t>(r) * hd + i;
      const float* b = wb + static_cast<size_t>(r) * hd + i;
      const auto w0 = hn::MulAdd(hn::LoadU(d, a), c0, hn::Mul(hn::LoadU(d, b), s0));
      const auto w1 = hn::MulAdd(hn::LoadU(d, a + N), c1, hn::Mul(hn::LoadU(d, b + N), s1));
      StoreNearest16x2(d, w0, w1, w16 + static_cast<size_t>(r) * hd + i);
      s[r] = hn::MulAdd(w1, l1, hn::MulAdd(w0, l0, s[r]));
    }
  }
  for (; i < hd; i += N) {
    const auto c2 = hn::LoadU(d, w.cos2 + i), s2 = hn::LoadU(d, w.sin2 + i), l = hn::LoadU(d, lam + i);
    for (int r = 0; r < RB; ++r) {
      const size_t qh = qh0 + static_cast<size_t>(r);
      const auto wf = hn::MulAdd(hn::LoadU(d, w.a + qh * hd + i), c2, hn::Mul(hn::LoadU(d, w.b + qh * hd + i), s2));
      hn::StoreU(hn::DemoteTo(d16, hn::NearestInt(wf)), d16, w.w16 + qh * hd + i);
      s[r] = hn::MulAdd(wf, l, s[r]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    const size_t qh = qh0 + static_cast<size_t>(r);
    w.cst[qh] = hn::GetLane(hn::SumOfLanes(d, s[r])) * w.sigma[qh];
  }
}

template <class D>
void TileWeightsWide(D d, size_t h, size_t rep, Work& w) {
  size_t r = 0;
  for (; r + 4 <= rep; r += 4) TileWeightsWideBlock<4>(d, h, h * rep + r, w);
  for (; r + 2 <= rep; r += 2) TileWeightsWideBlock<2>(d, h, h * rep + r, w);
  for (; r < rep; ++r) TileWeightsWideBlock<1>(d, h, h * rep + r, w);
}

// fn(r0, integral_constant<B>) for the query heads of one KV head in blocks
// of RB (B = RB), then one at a time (B = 1).
template <size_t RB, class Fn>
HWY_INLINE void ForHeadBlocks(size_t rep, const Fn& fn) {
  size_t r = 0;
  for (; r + RB <= rep; r += RB) fn(r, std::integral_constant<size_t, RB>());
  for (; r < rep; ++r) fn(r, std::integral_constant<size_t, 1>());
}

// The wide path's 16-bit vectors: WideOps<D16> holds every function whose
// vectors are D16's (16 lanes of 256 bits on x86's AVX2 / AVX3 and
// AVX3_DL's head sizes that are not a multiple of 16, 8 lanes on SSE4 and
// NEON; 32 lanes of 512 bits on AVX3 and AVX3_DL at head sizes that are).
template <class D16Tag>
struct WideOps {
using D16 = D16Tag;
using D32 = hn::Repartition<int32_t, D16>;
using DF2 = hn::Repartition<float, D16>;  // half as many lanes as D16
static constexpr size_t kN16 = hn::MaxLanes(D16());
using V32 = hn::Vec<D32>;

// Vector v of codes (16-bit lanes) of an operand run of `bits` bits packed
// from p on (whole operands back to back). A vector reads 16 bytes from its
// first source byte (and, with 32 lanes, 16 from that of its code 16): the
// last ones, within reach of `end` (the record's end), read from a copy (At
// checks; AtInPlace is for v < in_place).
class CodeVectors {
 public:
  HWY_INLINE CodeVectors(const uint8_t* p, int bits, const uint8_t* end)
      : p_(p), bits_(bits), step_(kN16 * static_cast<size_t>(bits) / 8) {
    const hn::Repartition<uint8_t, D16> du8;
    const hn::RebindToUnsigned<D16> du16;
    const size_t reach = 16 + (kN16 > 16 ? step_ / 2 : 0), avail = static_cast<size_t>(end - p);
    in_place = bits == 8 ? ~size_t{0} : avail >= reach ? (avail - reach) / step_ + 1 : 0;
    if (bits < 8) idx_ = hn::LoadU(du8, kWide.idx[bits]), mul_ = hn::LoadU(du16, kWide.mul[bits]);
  }
  HWY_INLINE hn::Vec<D16> AtInPlace(size_t v) const { return From(p_ + v * step_); }
  HWY_INLINE hn::Vec<D16> At(size_t v) const {
    if (HWY_LIKELY(v < in_place)) return AtInPlace(v);
    HWY_ALIGN uint8_t copy[64] = {};
    std::memcpy(copy, p_ + v * step_, step_);  // step <= 28 bytes are this vector's
    return From(copy);
  }
  size_t in_place;

 private:
  HWY_INLINE hn::Vec<D16> From(const uint8_t* src) const {
    const D16 d16;
    const hn::RebindToUnsigned<D16> du16;
    const hn::Repartition<uint8_t, D16> du8;
    if (bits_ == 8) return hn::BitCast(d16, hn::PromoteTo(du16, hn::LoadU(hn::Rebind<uint8_t, D16>(), src)));
    hn::Vec<decltype(du8)> bytes;
    if constexpr (kN16 > 16) {  // codes 0..15 and 16..31 from their own 16 bytes
      const hn::Half<decltype(du8)> dh;
      bytes = hn::Combine(du8, hn::LoadDup128(dh, src + step_ / 2), hn::LoadDup128(dh, src));
    } else {
      bytes = hn::LoadDup128(du8, src);
    }
    const auto x = hn::BitCast(du16, hn::TableLookupBytes(bytes, idx_));
    return hn::BitCast(d16, hn::ShiftRightSame(hn::Mul(x, mul_), 16 - bits_));
  }
  const uint8_t* p_;
  int bits_;
  size_t step_;
  hn::Vec<hn::Repartition<uint8_t, D16>> idx_;
  hn::Vec<hn::RebindToUnsigned<D16>> mul_;
};

// The n codes (a multiple of kN16) of `bits` bits packed from p on, one
// 16-bit lane each, to out (aligned).
static HWY_INLINE void UnpackWide(const uint8_t* p, size_t n, int bits, const uint8_t* end, int16_t* HWY_RESTRICT out) {
  const D16 d16;
  constexpr size_t N = kN16;
  const CodeVectors cv(p, bits, end);
  const size_t nv = n / N, fast = std::min(nv, cv.in_place);
  size_t v = 0;
  for (; v + 2 <= fast; v += 2) {
    const auto a = cv.AtInPlace(v), b = cv.AtInPlace(v + 1);
    hn::Store(a, d16, out + v * N), hn::Store(b, d16, out + (v + 1) * N);
  }
  for (; v < nv; ++v) hn::Store(cv.At(v), d16, out + v * N);
}

// Four 16-bit weights, repeated over the vector.
static HWY_INLINE hn::Vec<D16> Repeat4(const int16_t* p) {
  const D16 d16;
  const hn::Repartition<int64_t, D16> d64;
  int64_t bits;
  std::memcpy(&bits, p, 8);
  return hn::BitCast(d16, hn::Set(d64, bits));
}

// Vectors a, b of pair sums (lane m: codes 2m, 2m + 1) -> the sums of
// pairs (2i, 2i + 1): a's in the lower half, b's in the upper.
static HWY_INLINE V32 SumPairs(V32 a, V32 b) {
  const D32 d32;
  return hn::Add(hn::ConcatEven(d32, b, a), hn::ConcatOdd(d32, b, a));
}

// The tile's K codes of head h as 16-bit lanes into w.kc, a run of quads
// (back to back, one width) at a time.
static HWY_INLINE void UnpackTile(const Call& c, const uint8_t* tile, const uint8_t* end, size_t h, Work& w) {
  const uint32_t* ko = c.k_quad_off + h * (w.hd / 4);
  for (size_t ri = w.run_begin[h]; ri < w.run_begin[h + 1]; ++ri) {
    const Run& run = w.runs[ri];
    UnpackWide(tile + ko[run.k0], 64 * (run.k1 - run.k0), run.bits, end, w.kc + 64 * run.k0);
  }
}

// Query head qh's 16 scores of tile j from its NV pair-sum vectors (vector
// v: tokens 4v .. 4v + 3, each as the pair sums of its channels 0-1, 2-3).
template <size_t NV>
static HWY_INLINE void StoreScores(size_t qh, size_t j, const V32 (&s0)[NV], const V32 (&s1)[NV], Work& w) {
  const DF2 df;
  constexpr size_t N = kN16;
  // Token l of the tile: pairs 2l and 2l + 1 (its four channels).
  float* out = w.scores + qh * w.G + j * kTile;
  const auto sigma = hn::Set(df, w.sigma[qh]), cst = hn::Set(df, w.cst[qh]);
  for (size_t u = 0; u < NV / 2; ++u) {
    const V32 t = SumPairs(hn::RearrangeToOddPlusEven(s0[2 * u], s1[2 * u]), hn::RearrangeToOddPlusEven(s0[2 * u + 1], s1[2 * u + 1]));
    hn::StoreU(hn::Add(hn::Mul(hn::ConvertTo(df, t), sigma), cst), df, out + u * (N / 2));
  }
}

// NV vectors of codes per operand (64 / kN16).
template <size_t NV>
static void ScoresWide(const Call& c, const uint8_t* tile, const uint8_t* end, size_t h, size_t rep, size_t j, Work& w) {
  const D16 d16;
  const D32 d32;
  constexpr size_t N = kN16;
  const size_t hd = w.hd, nq = hd / 4;
  UnpackTile(c, tile, end, h, w);
  // RB query heads a pass over the codes (each code vector loaded once for
  // them): two when their accumulators and the codes fit the registers.
  constexpr size_t RB = NV <= 4 ? 2 : 1;
  const auto heads = [&](size_t r0, auto rb) {
    constexpr size_t B = decltype(rb)::value;
    V32 s0[B][NV], s1[B][NV];
    for (size_t b = 0; b < B; ++b) {
      for (size_t v = 0; v < NV; ++v) s0[b][v] = s1[b][v] = hn::Zero(d32);
    }
    const int16_t* wq = w.w16 + (h * rep + r0) * hd;
    for (size_t k = 0; k < nq; ++k) {
      const int16_t* codes = w.kc + 64 * k;
      hn::Vec<D16> cv[NV];
      for (size_t v = 0; v < NV; ++v) cv[v] = hn::Load(d16, codes + v * N);
      for (size_t b = 0; b < B; ++b) {
        const auto wv = Repeat4(wq + b * hd + 4 * k);
        for (size_t v = 0; v < NV; ++v) s0[b][v] = hn::ReorderWidenMulAccumulate(d32, cv[v], wv, s0[b][v], s1[b][v]);
      }
    }
    for (size_t b = 0; b < B; ++b) StoreScores<NV>(h * rep + r0 + b, j, s0[b], s1[b], w);
  };
  ForHeadBlocks<RB>(rep, heads);
}

// FinishV for the channels [c0, c0 + Lanes(DF2)) from a vector of sums (the
// same operations, lane by lane).
static HWY_INLINE void FinishVVec(size_t qh, size_t h, size_t c0, hn::Vec<DF2> sums, Work& w) {
  const DF2 d;
  float* HWY_RESTRICT acc = w.acc + qh * w.hd + c0;
  const auto al = hn::Set(d, w.al[qh]), sp = hn::Set(d, w.sp[qh]), ps = hn::Set(d, static_cast<float>(w.psumi[qh]));
  const auto t = hn::MulAdd(hn::LoadU(d, w.vst + h * w.hd + c0), sums, hn::Mul(hn::LoadU(d, w.vlo + h * w.hd + c0), ps));
  hn::StoreU(hn::MulAdd(hn::LoadU(d, acc), al, hn::Mul(sp, t)), d, acc);
}

// NV vectors of codes per operand (4 vw / kN16).
template <size_t NV>
static void AccumulateVWide(const Call& c, const uint8_t* rec, const uint8_t* end, size_t h, size_t rep, Work& w) {
  const D16 d16;
  const D32 d32;
  const DF2 df;
  constexpr size_t N = kN16, ncodes = NV * N, vw = ncodes / 4;
  const size_t hd = w.hd, G = w.G, nops = G / 4;
  // Quads per int32 pass: 64 quads of 255 x 16383 x 4 stay below 2^31.
  constexpr size_t kPass = 64;
  for (size_t x = 0; x < hd / vw; ++x) {
    UnpackWide(rec + c.layout.voperand(h, x, 0), nops * ncodes, c.v_bits, end, w.vc);  // the block's operands, back to back
    for (size_t r = 0; r < rep; ++r) {
      const size_t qh = h * rep + r;
      const int16_t* pq = w.p16 + qh * G;
      int64_t tot[16] = {};
      for (size_t q0 = 0; q0 < nops; q0 += kPass) {
        V32 s0[NV], s1[NV];
        for (size_t v = 0; v < NV; ++v) s0[v] = s1[v] = hn::Zero(d32);
        const size_t q1 = std::min(nops, q0 + kPass);
        for (size_t r4 = q0; r4 < q1; ++r4) {
          const auto pv = Repeat4(pq + 4 * r4);
          const int16_t* codes = w.vc + r4 * ncodes;
          for (size_t v = 0; v < NV; ++v) s0[v] = hn::ReorderWidenMulAccumulate(d32, hn::Load(d16, codes + v * N), pv, s0[v], s1[v]);
        }
        // Channel n of the block: pairs 2n and 2n + 1 (its four tokens).
        for (size_t u = 0; u < NV / 2; ++u) {
          const V32 ch = SumPairs(hn::RearrangeToOddPlusEven(s0[2 * u], s1[2 * u]), hn::RearrangeToOddPlusEven(s0[2 * u + 1], s1[2 * u + 1]));
          if (nops <= kPass) {  // one pass: the exact sums
            FinishVVec(qh, h, x * vw + u * (N / 2), hn::ConvertTo(df, ch), w);
          } else {
            HWY_ALIGN int32_t part[N / 2];
            hn::Store(ch, d32, part);
            for (size_t i = 0; i < N / 2; ++i) tot[u * (N / 2) + i] += part[i];
          }
        }
      }
      if (nops > kPass) {
        float sums[16];
        for (size_t n = 0; n < vw; ++n) sums[n] = static_cast<float>(tot[n]);
        FinishV(qh, h, x * vw, vw, sums, w);
      }
    }
  }
}

#undef KVQ_BYTES
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
#define KVQ_BYTES 1
// ---- the byte path of the V sums (x86: AVX2, AVX3) -----------------------------
// With one digit (P^ <= 127, codes of at most 3 bits) a V sum takes one
// vpmaddubsw (u8 codes x i8 weights -> i16 pair sums) and one i16 add per 32
// codes and query head, where the 16-bit path takes two vpmaddwd and two
// adds: the codes as bytes (unpacked once per block and head, shared by the
// query heads), pair sums accumulated in i16 for as many token quads as
// cannot overflow (a pair sum is at most 2 (2^B - 1) 127), then widened by
// vpmaddwd with ones into exact int32 channel sums. No product saturates
// (2 x 127 x 127 < 2^15). Same integers as AccumulateVPortable, same float
// operations after them (FinishVVec), so the same outputs bit for bit.

// The raw operations the byte path needs beyond Highway 1.0.3 (vpmaddubsw,
// vpackuswb), on the D16 vector width.
using DU8 = hn::Repartition<uint8_t, D16>;
static HWY_INLINE hn::Vec<D16> MaddUbs(hn::Vec<DU8> codes, hn::Vec<DU8> wts) {
#if HWY_TARGET <= HWY_AVX3
  if constexpr (kN16 == 32) return hn::Vec<D16>{_mm512_maddubs_epi16(codes.raw, wts.raw)};
#endif
  if constexpr (kN16 == 16) return hn::Vec<D16>{_mm256_maddubs_epi16(codes.raw, wts.raw)};
}
// a's codes then b's as bytes, in order (packus interleaves 128-bit blocks;
// a qword permute puts them back).
static HWY_INLINE hn::Vec<DU8> PackBytes(hn::Vec<D16> a, hn::Vec<D16> b) {
#if HWY_TARGET <= HWY_AVX3
  if constexpr (kN16 == 32) {
    const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
    return hn::Vec<DU8>{_mm512_permutexvar_epi64(order, _mm512_packus_epi16(a.raw, b.raw))};
  }
#endif
  if constexpr (kN16 == 16) return hn::Vec<DU8>{_mm256_permute4x64_epi64(_mm256_packus_epi16(a.raw, b.raw), 0xD8)};
}

// Block x of head h's V codes as bytes (w.vc8), in code order.
static HWY_INLINE void UnpackVBytes(const Call& c, const uint8_t* rec, const uint8_t* end, size_t h, size_t x,
                                    size_t ncodes, Work& w) {
  const DU8 du8;
  const size_t nv = w.G / 4 * ncodes / kN16;  // vectors of kN16 codes, an even number
  const CodeVectors cv(rec + c.layout.voperand(h, x, 0), c.v_bits, end);
  const auto pack = [&](size_t v, hn::Vec<D16> a, hn::Vec<D16> b) { hn::Store(PackBytes(a, b), du8, w.vc8 + kN16 * v); };
  size_t v = 0;
  for (; v + 2 <= std::min(nv, cv.in_place); v += 2) pack(v, cv.AtInPlace(v), cv.AtInPlace(v + 1));
  for (; v < nv; v += 2) pack(v, cv.At(v), cv.At(v + 1));
}

// NB byte vectors (of 2 kN16 codes) per operand.
template <size_t NB>
static void AccumulateVBytes(const Call& c, const uint8_t* rec, const uint8_t* end, size_t h, size_t rep, Work& w) {
  const D16 d16;
  const D32 d32;
  const DU8 du8;
  const DF2 df;
  constexpr size_t kB = 2 * kN16;  // codes (bytes) a vector
  constexpr size_t ncodes = kB * NB, vw = ncodes / 4;
  const size_t hd = w.hd, G = w.G, nops = G / 4;
  const int maxc = (1 << c.v_bits) - 1;
  const size_t pass = static_cast<size_t>(32767 / (2 * maxc * 127));  // token quads per i16 pass (>= 18)
  const auto ones = hn::Set(d16, int16_t{1});
  for (size_t x = 0; x < hd / vw; ++x) {
    UnpackVBytes(c, rec, end, h, x, ncodes, w);
    // Two query heads a pass over the codes (each code vector loaded once for both).
    const auto heads = [&](size_t r0, auto rb) {
      constexpr size_t B = decltype(rb)::value;
      const int8_t* p8[B];  // P^ as bytes (SoftmaxStep)
      for (size_t b = 0; b < B; ++b) p8[b] = reinterpret_cast<const int8_t*>(w.pd + (h * rep + r0 + b) * 2 * (G / 4));
      V32 tot[B][NB];
      for (size_t b = 0; b < B; ++b) {
        for (size_t v = 0; v < NB; ++v) tot[b][v] = hn::Zero(d32);
      }
      for (size_t q0 = 0; q0 < nops; q0 += pass) {
        hn::Vec<D16> s[B][NB];
        for (size_t b = 0; b < B; ++b) {
          for (size_t v = 0; v < NB; ++v) s[b][v] = hn::Zero(d16);
        }
        const size_t q1 = std::min(nops, q0 + pass);
        for (size_t r4 = q0; r4 < q1; ++r4) {
          const uint8_t* codes = w.vc8 + r4 * ncodes;
          hn::Vec<DU8> cv[NB];
          for (size_t v = 0; v < NB; ++v) cv[v] = hn::Load(du8, codes + kB * v);
          for (size_t b = 0; b < B; ++b) {
            int32_t pw;
            std::memcpy(&pw, p8[b] + 4 * r4, 4);
            const auto pv = hn::BitCast(du8, hn::Set(d32, pw));  // the quad's 4 weights, repeated
            for (size_t v = 0; v < NB; ++v) s[b][v] = hn::Add(s[b][v], MaddUbs(cv[v], pv));
          }
        }
        // i16 lanes 2n, 2n + 1 hold channel n's two pairs: one vpmaddwd sums them.
        for (size_t b = 0; b < B; ++b) {
          for (size_t v = 0; v < NB; ++v) {
            V32 unused = hn::Zero(d32);
            tot[b][v] = hn::Add(tot[b][v], hn::ReorderWidenMulAccumulate(d32, s[b][v], ones, hn::Zero(d32), unused));
          }
        }
      }
      for (size_t b = 0; b < B; ++b) {
        for (size_t v = 0; v < NB; ++v) FinishVVec(h * rep + r0 + b, h, x * vw + v * (kB / 4), hn::ConvertTo(df, tot[b][v]), w);
      }
    };
    ForHeadBlocks<2>(rep, heads);
  }
}
#else
#define KVQ_BYTES 0
#endif

};  // WideOps

using W256 = WideOps<hn::CappedTag<int16_t, 16>>;
#undef KVQ_WIDE512
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
// AVX3 and AVX3_DL (when its VNNI path does not run): 512-bit vectors at head
// sizes that are a multiple of 16 (V blocks of 16 channels: 64 codes an operand).
#define KVQ_WIDE512 1
using W512 = WideOps<hn::CappedTag<int16_t, 32>>;
#else
#define KVQ_WIDE512 0
#endif

// A tile's K scores of head h on the wide path W.
template <class W>
HWY_INLINE void WideScores(const Call& c, const uint8_t* tile, const uint8_t* end, size_t h, size_t rep, size_t j,
                           Work& w) {
  W::template ScoresWide<64 / W::kN16>(c, tile, end, h, rep, j, w);
}

// A group's V sums of head h on the wide path W (the byte path for one digit
// on x86).
template <class W>
HWY_INLINE void WideV(const Call& c, const uint8_t* rec, const uint8_t* end, size_t h, size_t rep, Work& w) {
  const bool vw16 = c.layout.vw == 16;  // W512 runs only there
#if KVQ_BYTES
  if (c.v_digits == 1) {
    if constexpr (W::kN16 == 32) {
      W::template AccumulateVBytes<1>(c, rec, end, h, rep, w);
    } else if (vw16) {
      W::template AccumulateVBytes<2>(c, rec, end, h, rep, w);
    } else {
      W::template AccumulateVBytes<1>(c, rec, end, h, rep, w);
    }
    return;
  }
#endif
  if constexpr (W::kN16 == 32) {
    W::template AccumulateVWide<2>(c, rec, end, h, rep, w);
  } else if (vw16) {
    W::template AccumulateVWide<64 / W::kN16>(c, rec, end, h, rep, w);
  } else {
    W::template AccumulateVWide<32 / W::kN16>(c, rec, end, h, rep, w);
  }
}

#else
#undef KVQ_WIDE
#define KVQ_WIDE 0
#undef KVQ_BYTES
#define KVQ_BYTES 0
#undef KVQ_WIDE512
#define KVQ_WIDE512 0
#endif  // wide path
