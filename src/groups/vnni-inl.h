// The grouped kernel on AVX-512 VNNI + VBMI (AVX3_DL): vpdpbusd on byte
// codes with the query's fixed-point digits.
// A fragment of src/groups/attention.cc, included by it inside its
// per-target namespace (kvq::grouped::HWY_NAMESPACE, once per Highway
// target, as foreach_target re-includes that file): it reads the file's
// Call, Work and the scalar loops' helpers above the include. No include
// guard on purpose.
#if HWY_TARGET == HWY_AVX3_DL
// ---- AVX-512 VNNI + VBMI ----
// Highway 1.0.3's AVX3_DL target string lacks avx512vnni and avx512vbmi (every
// AVX3_DL CPU has them); the functions that use them add them.
#define KVQ_DL_ATTR __attribute__((target("avx512vnni,avx512vbmi")))
#define KVQ_DL_ATTR_BASE
// TileWeights with native rounding (cvtps2dq: to nearest even, in range by
// construction) and narrowing stores (vpmovdb), for the RB query heads of
// KV head h at once (the rotation and lo / step loaded once).
template <int RB>
KVQ_DL_ATTR_BASE HWY_INLINE void TileWeightsDlBlock(const Call& c, size_t h, size_t qh0, Work& w) {
  const size_t hd = w.hd, nq = hd / 4;
  const float* lam = w.lam + h * hd;
  __m512 s[RB];
  for (int r = 0; r < RB; ++r) s[r] = _mm512_setzero_ps();
  const __m512i m7 = _mm512_set1_epi32(127);
  for (size_t i = 0; i < hd; i += 16) {
    const __m512 c2 = _mm512_loadu_ps(w.cos2 + i), s2 = _mm512_loadu_ps(w.sin2 + i), l = _mm512_loadu_ps(lam + i);
    for (int r = 0; r < RB; ++r) {
      const size_t qh = qh0 + static_cast<size_t>(r);
      const __m512 wf = _mm512_fmadd_ps(_mm512_loadu_ps(w.a + qh * hd + i), c2, _mm512_mul_ps(_mm512_loadu_ps(w.b + qh * hd + i), s2));
      const __m512i wi = _mm512_cvtps_epi32(wf);
      int8_t* lo = reinterpret_cast<int8_t*>(w.wd + qh * 2 * nq);
      if (c.k_digits == 1) {
        _mm512_mask_cvtepi32_storeu_epi8(lo + i, 0xFFFF, wi);
      } else {
        _mm512_mask_cvtepi32_storeu_epi8(lo + i, 0xFFFF, _mm512_and_si512(wi, m7));
        _mm512_mask_cvtepi32_storeu_epi8(lo + 4 * nq + i, 0xFFFF, _mm512_srai_epi32(wi, 7));
      }
      s[r] = _mm512_fmadd_ps(wf, l, s[r]);
    }
  }
  for (int r = 0; r < RB; ++r) w.cst[qh0 + static_cast<size_t>(r)] = _mm512_reduce_add_ps(s[r]) * w.sigma[qh0 + static_cast<size_t>(r)];
}

KVQ_DL_ATTR_BASE void TileWeightsDl(const Call& c, size_t h, size_t rep, Work& w) {
  size_t r = 0;
  for (; r + 4 <= rep; r += 4) TileWeightsDlBlock<4>(c, h, h * rep + r, w);
  for (; r + 2 <= rep; r += 2) TileWeightsDlBlock<2>(c, h, h * rep + r, w);
  for (; r < rep; ++r) TileWeightsDlBlock<1>(c, h, h * rep + r, w);
}

// acc += codes . broadcast(*w) with the broadcast folded into vpdpbusd's
// memory operand (GCC 12 does not fold _mm512_set1_epi32 into it).
HWY_INLINE __m512i DpBcast(__m512i acc, __m512i codes, const int32_t* w) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*w));
  return acc;
}

struct Unpacker {
  __m512i perm, shift, mask;
  __mmask64 load;
  int bits;
};

KVQ_DL_ATTR HWY_INLINE Unpacker MakeUnpacker(int bits) {
  Unpacker u;
  u.perm = _mm512_load_si512(kUnpack.perm[bits]);
  u.shift = _mm512_load_si512(kUnpack.shift[bits]);
  u.mask = _mm512_load_si512(kUnpack.mask[bits]);
  u.load = bits == 8 ? ~__mmask64{0} : ((__mmask64{1} << (8 * bits)) - 1);
  u.bits = bits;
  return u;
}

// The 64 codes of the operand at p, a byte each.
KVQ_DL_ATTR HWY_INLINE __m512i Unpack(const Unpacker& u, const uint8_t* p) {
  const __m512i src = _mm512_maskz_loadu_epi8(u.load, p);
  if (u.bits == 8) return src;
  return _mm512_and_si512(_mm512_multishift_epi64_epi8(u.shift, _mm512_permutexvar_epi8(u.perm, src)), u.mask);
}

// Independent accumulator chains per (head, digit): about 8 in all, so the
// vpdpbusd latency (~4-5 cycles) is hidden behind throughput.
constexpr int Chains(int rb, int d) { return rb * d >= 8 ? 1 : (rb * d >= 4 ? 2 : 4); }

// Scores of query heads [qh0, qh0 + RB) of KV head h for one tile: kD digit
// accumulators per head, kU partial sums (independent chains) each. The
// quads come in runs of one width (runs), so each run's unpacker is loaded
// once.
template <int RB, int kD>
KVQ_DL_ATTR HWY_INLINE void ScoresVnniBlock(const uint8_t* tile, const uint32_t* ko, const Run* runs, size_t n_runs,
                                            size_t nq, size_t qh0, Work& w, size_t j) {
  constexpr int kU = Chains(RB, kD);
  __m512i acc[RB][kD][kU];
  for (int r = 0; r < RB; ++r)
    for (int dd = 0; dd < kD; ++dd)
      for (int uu = 0; uu < kU; ++uu) acc[r][dd][uu] = _mm512_setzero_si512();
  const int32_t* wd[RB];
  for (int r = 0; r < RB; ++r) wd[r] = w.wd + (qh0 + r) * 2 * nq;
  for (size_t ri = 0; ri < n_runs; ++ri) {
    const Unpacker up = MakeUnpacker(runs[ri].bits);
    size_t k = runs[ri].k0;
    const size_t k1 = runs[ri].k1;
    for (; k + kU <= k1; k += kU) {
      for (int uu = 0; uu < kU; ++uu) {
        const size_t kk = k + static_cast<size_t>(uu);
        const __m512i codes = Unpack(up, tile + ko[kk]);
        for (int r = 0; r < RB; ++r) {
          acc[r][0][uu] = DpBcast(acc[r][0][uu], codes, wd[r] + kk);
          if constexpr (kD == 2) acc[r][1][uu] = DpBcast(acc[r][1][uu], codes, wd[r] + nq + kk);
        }
      }
    }
    for (; k < k1; ++k) {
      const __m512i codes = Unpack(up, tile + ko[k]);
      for (int r = 0; r < RB; ++r) {
        acc[r][0][0] = DpBcast(acc[r][0][0], codes, wd[r] + k);
        if constexpr (kD == 2) acc[r][1][0] = DpBcast(acc[r][1][0], codes, wd[r] + nq + k);
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    const size_t qh = qh0 + static_cast<size_t>(r);
    __m512i lo = acc[r][0][0], hi = kD == 2 ? acc[r][kD - 1][0] : _mm512_setzero_si512();
    for (int uu = 1; uu < kU; ++uu) {
      lo = _mm512_add_epi32(lo, acc[r][0][uu]);
      if constexpr (kD == 2) hi = _mm512_add_epi32(hi, acc[r][1][uu]);
    }
    const __m512i sum = kD == 2 ? _mm512_add_epi32(_mm512_slli_epi32(hi, 7), lo) : lo;
    const __m512 s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(w.sigma[qh]), _mm512_set1_ps(w.cst[qh]));
    _mm512_storeu_ps(w.scores + qh * w.G + j * kTile, s);
  }
}

template <int kD>
KVQ_DL_ATTR void ScoresVnni(const Call& c, const uint8_t* tile, size_t h, size_t rep, size_t j, Work& w) {
  const size_t nq = w.hd / 4;
  const uint32_t* ko = c.k_quad_off + h * nq;
  const Run* runs = w.runs.data() + w.run_begin[h];
  const size_t n = w.run_begin[h + 1] - w.run_begin[h];
  size_t r = 0;
  for (; r + 8 <= rep; r += 8) ScoresVnniBlock<8, kD>(tile, ko, runs, n, nq, h * rep + r, w, j);
  for (; r + 4 <= rep; r += 4) ScoresVnniBlock<4, kD>(tile, ko, runs, n, nq, h * rep + r, w, j);
  for (; r + 2 <= rep; r += 2) ScoresVnniBlock<2, kD>(tile, ko, runs, n, nq, h * rep + r, w, j);
  for (; r < rep; ++r) ScoresVnniBlock<1, kD>(tile, ko, runs, n, nq, h * rep + r, w, j);
}

// V of query heads [qh0, qh0 + RB) over channel blocks [x0, x0 + XB) of KV
// head h: every weight broadcast feeds XB blocks.
template <int RB, int kD, int XB>
KVQ_DL_ATTR HWY_INLINE void AccumulateVVnniBlock(const uint8_t* rec, const Call& c, const Unpacker& up, size_t x0,
                                                 size_t qh0, size_t h, Work& w) {
  constexpr int kU = RB * kD * XB >= 8 ? 1 : 2;  // independent chains per accumulator
  const size_t G = w.G, nw = G / 4, opb = c.layout.vop;
  __m512i acc[XB][RB][kD][kU];
  for (int x = 0; x < XB; ++x)
    for (int r = 0; r < RB; ++r)
      for (int dd = 0; dd < kD; ++dd)
        for (int uu = 0; uu < kU; ++uu) acc[x][r][dd][uu] = _mm512_setzero_si512();
  const int32_t* pd[RB];
  for (int r = 0; r < RB; ++r) pd[r] = w.pd + (qh0 + r) * 2 * nw;
  const uint8_t* base[XB];
  for (int x = 0; x < XB; ++x) base[x] = rec + c.layout.voperand(h, x0 + static_cast<size_t>(x), 0);
  for (size_t q4 = 0; q4 < nw; q4 += kU) {  // nw = G / 4 is a multiple of 4
    for (int uu = 0; uu < kU; ++uu) {
      const size_t qq = q4 + static_cast<size_t>(uu);
      __m512i codes[XB];
      for (int x = 0; x < XB; ++x) codes[x] = Unpack(up, base[x] + qq * opb);
      for (int r = 0; r < RB; ++r) {
        const __m512i b0 = _mm512_set1_epi32(pd[r][qq]);
        for (int x = 0; x < XB; ++x) acc[x][r][0][uu] = _mm512_dpbusd_epi32(acc[x][r][0][uu], codes[x], b0);
        if constexpr (kD == 2) {
          const __m512i b1 = _mm512_set1_epi32(pd[r][nw + qq]);
          for (int x = 0; x < XB; ++x) acc[x][r][1][uu] = _mm512_dpbusd_epi32(acc[x][r][1][uu], codes[x], b1);
        }
      }
    }
  }
  for (int x = 0; x < XB; ++x) {
    const size_t c0 = (x0 + static_cast<size_t>(x)) * 16;
    const __m512 vst = _mm512_loadu_ps(w.vst + h * w.hd + c0), vlo = _mm512_loadu_ps(w.vlo + h * w.hd + c0);
    for (int r = 0; r < RB; ++r) {
      const size_t qh = qh0 + static_cast<size_t>(r);
      __m512i lo = acc[x][r][0][0], hi = kD == 2 ? acc[x][r][kD - 1][0] : _mm512_setzero_si512();
      for (int uu = 1; uu < kU; ++uu) {
        lo = _mm512_add_epi32(lo, acc[x][r][0][uu]);
        if constexpr (kD == 2) hi = _mm512_add_epi32(hi, acc[x][r][1][uu]);
      }
      // Combined in float: 128 hi + lo can pass 2^31 for long groups of 8-bit codes.
      __m512 sums = _mm512_cvtepi32_ps(lo);
      if constexpr (kD == 2) sums = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(128.0f), sums);
      // acc = acc alpha + sigma_p (vlo sum P^ + vst (.) sums)
      float* out = w.acc + qh * w.hd + c0;
      const __m512 t = _mm512_fmadd_ps(vst, sums, _mm512_mul_ps(vlo, _mm512_set1_ps(static_cast<float>(w.psumi[qh]))));
      _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_loadu_ps(out), _mm512_set1_ps(w.al[qh]),
                                            _mm512_mul_ps(_mm512_set1_ps(w.sp[qh]), t)));
    }
  }
}

template <int kD>
KVQ_DL_ATTR void AccumulateVVnni(const Call& c, const uint8_t* rec, size_t h, size_t rep, Work& w) {
  const size_t nx = w.hd / 16;
  const Unpacker up = MakeUnpacker(c.v_bits);
  size_t x = 0;
  for (; x + 2 <= nx; x += 2) {
    size_t r = 0;
    for (; r + 4 <= rep; r += 4) AccumulateVVnniBlock<4, kD, 2>(rec, c, up, x, h * rep + r, h, w);
    for (; r + 2 <= rep; r += 2) AccumulateVVnniBlock<2, kD, 2>(rec, c, up, x, h * rep + r, h, w);
    for (; r < rep; ++r) AccumulateVVnniBlock<1, kD, 2>(rec, c, up, x, h * rep + r, h, w);
  }
  for (; x < nx; ++x) {
    size_t r = 0;
    for (; r + 4 <= rep; r += 4) AccumulateVVnniBlock<4, kD, 1>(rec, c, up, x, h * rep + r, h, w);
    for (; r + 2 <= rep; r += 2) AccumulateVVnniBlock<2, kD, 1>(rec, c, up, x, h * rep + r, h, w);
    for (; r < rep; ++r) AccumulateVVnniBlock<1, kD, 1>(rec, c, up, x, h * rep + r, h, w);
  }
}
#endif  // HWY_TARGET == HWY_AVX3_DL
