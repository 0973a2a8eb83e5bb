#!/usr/bin/env python3
"""NumPy model of a llama2.c checkpoint with simulated KV quantizers.

A research harness for what makes a low-bit cache robust (issue 47): it
runs the model over windows with each cache's values replaced by what a
quantizer would hand back, token t reading key s from codes only when s was
coded by the time t is written (the grouped caches' recent window), and
reports PPL and KL against fp32. The numbers of record come from `kvq eval`;
this is where levers are tried before they are built.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_write  # noqa: E402


def load(path):
    """The checkpoint as float64 arrays (scripts/gguf_write.py reads it; its
    tokenizer, tok512.bin, beside it)."""
    cfg, w0, _, _ = gguf_write.read_llama2c(path, os.path.join(os.path.dirname(path), "tok512.bin"))
    f = {k: np.asarray(v, dtype=np.float64) for k, v in w0.items()}
    return dict(dim=cfg["dim"], hidden=cfg["hidden"], nl=cfg["layers"], nh=cfg["heads"], nkv=cfg["kv_heads"],
                vocab=cfg["vocab"], seq=cfg["ctx"], hs=cfg["dim"] // cfg["heads"], emb=f["emb"],
                att_norm=f["rms_att"], wq=f["wq"], wk=f["wk"], wv=f["wv"], wo=f["wo"], ffn_norm=f["rms_ffn"],
                w1=f["w1"], w2=f["w2"], w3=f["w3"], norm=f["rms_final"], cls=f["cls"])


def rope(x, pos, hs):
    """x: (T, H, hs) rotated by angle pos / 10000^(2i/hs) on pairs (2i, 2i+1)."""
    i = np.arange(hs // 2)
    freq = 1.0 / (10000.0 ** (2 * i / hs))
    ang = np.asarray(pos, dtype=np.float64)[:, None] * freq[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def rmsnorm(x, g):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * g


def forward(w, toks, cache=None):
    """Logits (T, vocab) of one window; cache(layer, k_pre, k, v) -> (kq, vq,
    mask) with mask[t, s] True where query t reads key s from codes."""
    T = len(toks)
    hs, nh, nkv = w["hs"], w["nh"], w["nkv"]
    x = w["emb"][toks]
    pos = np.arange(T)
    causal = np.tril(np.ones((T, T), dtype=bool))
    for l in range(w["nl"]):
        h = rmsnorm(x, w["att_norm"][l])
        q = (h @ w["wq"][l].T).reshape(T, nh, hs)
        k_pre = (h @ w["wk"][l].T).reshape(T, nkv, hs)
        v = (h @ w["wv"][l].T).reshape(T, nkv, hs)
        q = rope(q, pos, hs)
        k = rope(k_pre, pos, hs)
        if cache is not None:
            kq, vq, m = cache(l, k_pre, k, v, q)
        out = np.empty((T, nh, hs))
        for hh in range(nh):
            g = hh // (nh // nkv)
            s = q[:, hh] @ k[:, g].T / np.sqrt(hs)
            if cache is not None:
                s = np.where(m, q[:, hh] @ kq[:, g].T / np.sqrt(hs), s)
            s = np.where(causal, s, -np.inf)
            s -= s.max(axis=1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=1, keepdims=True)
            if cache is None:
                out[:, hh] = p @ v[:, g]
            else:
                out[:, hh] = (p * m) @ vq[:, g] + (p * ~m) @ v[:, g]
        x = x + out.reshape(T, nh * hs) @ w["wo"][l].T
        h = rmsnorm(x, w["ffn_norm"][l])
        a = h @ w["w1"][l].T
        x = x + ((a / (1 + np.exp(-a))) * (h @ w["w3"][l].T)) @ w["w2"][l].T
    return rmsnorm(x, w["norm"]) @ w["cls"].T


def log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


# ---- quantizers -------------------------------------------------------------

def uq(x, lo, hi, bits):
    """Asymmetric uniform codes on [lo, hi], broadcast; returns x^."""
    L = (1 << bits) - 1
    st = (hi - lo) / L
    st_safe = np.where(st > 0, st, 1.0)
    q = np.clip(np.rint((x - lo) / st_safe), 0, L)
    return np.where(st > 0, lo + st * q, lo)


def fitq(x, lo, hi, bits, fit):
    """uq, then `fit`: 1 moves lo so the group's mean is exact (codes kept);
    2 refits lo and step by least squares on the codes; 3 = 2 then recode
    on the refit grid and refit once more."""
    L = (1 << bits) - 1
    st = (hi - lo) / L
    st_safe = np.where(st > 0, st, 1.0)
    q = np.clip(np.rint((x - lo) / st_safe), 0, L)
    if fit == 0:
        return np.where(st > 0, lo + st * q, lo)
    for it in range(2 if fit == 3 else 1):
        if fit == 1:
            lo = lo + np.mean(x - (lo + st * q), axis=0, keepdims=True)
        else:
            qm = q.mean(axis=0, keepdims=True)
            xm = x.mean(axis=0, keepdims=True)
            var = ((q - qm) ** 2).sum(axis=0, keepdims=True)
            cov = ((q - qm) * (x - xm)).sum(axis=0, keepdims=True)
            st = np.where(var > 0, cov / np.where(var > 0, var, 1), st)
            lo = xm - st * qm
        if fit == 3 and it == 0:
            st_safe = np.where(st > 0, st, 1.0)
            q = np.clip(np.rint((x - lo) / st_safe), 0, L)
    return lo + st * q


def hadamard(n):
    H = np.array([[1.0]])
    while H.shape[0] < n:
        H = np.block([[H, H], [H, -H]])
    return H / np.sqrt(n)


class Scheme:
    """A simulated grouped cache (min/max ranges, open tokens exact). Fields:
    kb, vb: bits; G: group tokens; R: recent exact tokens; S: sinks exact;
    kmode/vmode: 'chan' (per channel over a group of tokens) or 'tok' (per
    token and head, over head_dim); rot: Hadamard over head_dim for K/V
    ('', 'k', 'v', 'kv'); tile: K in the 16-token tile frame (as kvq);
    layers: only these layers quantized (the rest exact);
    out: units (token x head) whose V lies beyond `out` MADs of its group
    channel kept exact; kout: the same test on K (tile frame), K and V kept;
    kx: those units leave their group's range; ktop: the ktop farthest-out
    units of each group and head kept instead; heavy / hd: units that drew
    >= heavy of a query head's attention from a query at least hd tokens
    later, before they were coded, kept (an attention oracle); fit: 1 shifts
    lo to make each group's mean exact, 2 refits lo and step by least
    squares on the codes, 3 recodes once more. Kept units count 16 bits a
    value in bits()."""

    def __init__(self, kb=4, vb=4, G=64, R=0, S=0, kmode="chan", vmode="chan", rot="", out=0.0,
                 tile=True, open_bits=16, layers=None, fit=0, heavy=0.0, hd=0, kout=0.0, kx=False, ktop=0):
        self.__dict__.update(locals())
        del self.__dict__["self"]
        self.stats = []

    def coded_mask(self, T):
        t = np.arange(T)
        n = np.maximum(0, (t + 1) - self.R - self.S)
        end = self.S + self.G * (n // self.G)
        s = np.arange(T)
        return (s[None, :] >= self.S) & (s[None, :] < end[:, None])

    def quant_chan(self, x, bits, hs):
        """x (T, H, hs): per group of G tokens and channel; outlier units kept."""
        T = x.shape[0]
        xq = x.copy()
        kept = np.zeros(x.shape[:2], dtype=bool)
        for g0 in range(self.S, T, self.G):
            g1 = min(T, g0 + self.G)
            xs = x[g0:g1]
            if self.out > 0:
                # a unit is an outlier when any of its channels lies beyond
                # `out` times the group channel's interquartile-free width
                # (median +- out * MAD) -- kept exact, range from the rest
                med = np.median(xs, axis=0, keepdims=True)
                mad = np.median(np.abs(xs - med), axis=0, keepdims=True) + 1e-12
                z = np.abs(xs - med) / mad
                ko = (z > self.out).any(axis=2)  # (g, H)
                kept[g0:g1] = ko
                big = np.where(ko[:, :, None], np.nan, xs)
                lo = np.nanmin(big, axis=0, keepdims=True)
                hi = np.nanmax(big, axis=0, keepdims=True)
                lo = np.where(np.isnan(lo), xs.min(axis=0, keepdims=True), lo)
                hi = np.where(np.isnan(hi), xs.max(axis=0, keepdims=True), hi)
                q = uq(xs, lo, hi, bits)
                xq[g0:g1] = np.where(ko[:, :, None], xs, q)
            else:
                lo = xs.min(axis=0, keepdims=True)
                hi = xs.max(axis=0, keepdims=True)
                xq[g0:g1] = fitq(xs, lo, hi, bits, self.fit)
        return xq, kept

    def quant_tok(self, x, bits):
        lo = x.min(axis=2, keepdims=True)
        hi = x.max(axis=2, keepdims=True)
        return uq(x, lo, hi, bits), np.zeros(x.shape[:2], dtype=bool)

    def heavy_units(self, q, k):
        """(T, H): units whose token drew >= self.heavy of a query head's
        attention from some query before the token was coded."""
        T, H, hs = k.shape
        nh = q.shape[1]
        m = self.coded_mask(T)
        # the first query that reads s from codes: before it, s is open
        first = np.where(m.any(axis=0), m.argmax(axis=0), T)
        t = np.arange(T)
        before = (t[:, None] < first[None, :]) & (t[:, None] >= t[None, :] + self.hd)
        out = np.zeros((T, H), dtype=bool)
        causal = np.tril(np.ones((T, T), dtype=bool))
        for hh in range(nh):
            g = hh // (nh // H)
            s = q[:, hh] @ k[:, g].T / np.sqrt(hs)
            s = np.where(causal, s, -np.inf)
            s -= s.max(axis=1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=1, keepdims=True)
            out[:, g] |= (np.where(before, p, 0).max(axis=0) >= self.heavy)
        return out

    def __call__(self, l, k_pre, k, v, q=None):
        T, H, hs = k.shape
        if self.layers is not None and l not in self.layers:
            return k, v, np.zeros((T, T), dtype=bool)
        pos = np.arange(T)
        # K in its tile frame (rotation relative to the tile start)
        if self.tile:
            t0 = self.S + 16 * ((pos - self.S) // 16)
            t0 = np.where(pos < self.S, pos, t0)
            kf = rope(k_pre, pos - t0, hs)
        else:
            t0 = pos
            kf = k_pre
        Hm = hadamard(hs)
        if "k" in self.rot:
            kf = kf @ Hm.T
        ko = None
        if self.ktop > 0:
            # the ktop units of each group and head whose key is farthest out
            # (max over channels of |k - median| / MAD): K and V exact
            ko = np.zeros((T, H), dtype=bool)
            for g0 in range(self.S, T, self.G):
                xs = kf[g0:g0 + self.G]
                if len(xs) < self.G:
                    continue
                med = np.median(xs, axis=0, keepdims=True)
                mad = 1.4826 * np.median(np.abs(xs - med), axis=0, keepdims=True) + 1e-9
                z = (np.abs(xs - med) / mad).max(axis=2)  # (G, H)
                top = np.argsort(-z, axis=0)[:self.ktop]
                for hh in range(H):
                    ko[g0 + top[:, hh], hh] = True
        if self.kout > 0:
            # units whose key (tile frame) lies beyond kout robust standard
            # deviations of its group channel in any channel: K and V exact
            ko = np.zeros((T, H), dtype=bool)
            for g0 in range(self.S, T, self.G):
                xs = kf[g0:g0 + self.G]
                med = np.median(xs, axis=0, keepdims=True)
                mad = 1.4826 * np.median(np.abs(xs - med), axis=0, keepdims=True) + 1e-9
                ko[g0:g0 + self.G] = (np.abs(xs - med) / mad > self.kout).any(axis=2)

        def excl(x):
            # kx: exception units leave the range (their values replaced by the
            # group channel's median before the range is taken)
            if ko is None or not self.kx:
                return x
            y = x.copy()
            for g0 in range(self.S, T, self.G):
                xs = y[g0:g0 + self.G]
                med = np.median(xs, axis=0, keepdims=True)
                m = ko[g0:g0 + self.G][:, :, None]
                y[g0:g0 + self.G] = np.where(m, med, xs)
            return y
        kq, kk = (self.quant_chan(excl(kf), self.kb, hs) if self.kmode == "chan" else self.quant_tok(kf, self.kb))
        if "k" in self.rot:
            kq = kq @ Hm
        kq = rope(kq, t0, hs)
        vv = v @ Hm.T if "v" in self.rot else v
        vq, vk = (self.quant_chan(excl(vv), self.vb, hs) if self.vmode == "chan" else self.quant_tok(vv, self.vb))
        if "v" in self.rot:
            vq = vq @ Hm
        if ko is not None:
            kq = np.where(ko[:, :, None], k, kq)
            vq = np.where(ko[:, :, None], v, vq)
            kk = kk | ko
            vk = vk | ko
        if self.heavy > 0:
            hv = self.heavy_units(q, k)
            kq = np.where(hv[:, :, None], k, kq)
            vq = np.where(hv[:, :, None], v, vq)
            kk = kk | hv
            vk = vk | hv
        self.stats.append((kk.mean(), vk.mean()))
        return kq, vq, self.coded_mask(T)

    def bits(self, hs):
        """Steady-state bits of the coded part (codes + params + kept units)."""
        kf = np.mean([s[0] for s in self.stats]) if self.stats else 0
        vf = np.mean([s[1] for s in self.stats]) if self.stats else 0

        def one(b, mode, f):
            p = 32.0 / self.G if mode == "chan" else 32.0 / hs
            return b + p + f * (16 - b) + (1.0 / hs if self.out > 0 else 0)
        return (one(self.kb, self.kmode, kf) + one(self.vb, self.vmode, vf)) / 2


def windows(ids, ctx, protocol, n):
    """(tokens of ctx + 1, first scored, last scored) per window."""
    out = []
    if protocol == "kvq":
        for w in range(min(n, len(ids) // (ctx + 1))):
            out.append((ids[w * (ctx + 1):(w + 1) * (ctx + 1)], 0, ctx))
    else:
        bos = ids[0]
        for w in range(min(n, len(ids) // ctx)):
            c = [bos] + list(ids[w * ctx + 1:(w + 1) * ctx]) + [0]
            out.append((np.array(c), ctx // 2, ctx - 1))
    return out


def attention_stats(w, wins, layer, lo, hi):
    """Per query head of `layer`, over query positions [lo, hi) of each
    window (fp32 model): the effective number of keys attended (exp of the
    weights' entropy), the mean largest weight, and the offset and token of
    the strongest key at each of the first window's positions lo..lo+19."""
    hs, nh, nkv = w["hs"], w["nh"], w["nkv"]
    eff = np.zeros(nh)
    top = np.zeros(nh)
    first = {}
    for n, (toks, _, _) in enumerate(wins):
        inp = toks[:-1]
        T = len(inp)
        pos = np.arange(T)
        x = w["emb"][inp]
        for l in range(layer + 1):
            h = rmsnorm(x, w["att_norm"][l])
            q = rope((h @ w["wq"][l].T).reshape(T, nh, hs), pos, hs)
            k = rope((h @ w["wk"][l].T).reshape(T, nkv, hs), pos, hs)
            v = (h @ w["wv"][l].T).reshape(T, nkv, hs)
            out = np.empty((T, nh, hs))
            for hh in range(nh):
                s = q[:, hh] @ k[:, hh // (nh // nkv)].T / np.sqrt(hs)
                s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
                s -= s.max(axis=1, keepdims=True)
                p = np.exp(s)
                p /= p.sum(axis=1, keepdims=True)
                out[:, hh] = p @ v[:, hh // (nh // nkv)]
                if l == layer:
                    ent = -(p * np.log(p + 1e-30)).sum(axis=1)
                    eff[hh] += np.exp(ent[lo:hi]).mean() / len(wins)
                    top[hh] += p[lo:hi].max(axis=1).mean() / len(wins)
                    if n == 0:
                        am = p.argmax(axis=1)
                        first[hh] = [(t - int(am[t]), int(inp[am[t]])) for t in range(lo, min(hi, lo + 20))]
            if l < layer:
                x = x + out.reshape(T, nh * hs) @ w["wo"][l].T
                h = rmsnorm(x, w["ffn_norm"][l])
                a = h @ w["w1"][l].T
                x = x + ((a / (1 + np.exp(-a))) * (h @ w["w3"][l].T)) @ w["w2"][l].T
    return eff, top, first


def evaluate(w, wins, schemes):
    nll = {k: 0.0 for k in ["fp32"] + list(schemes)}
    kl = {k: 0.0 for k in schemes}
    n = 0
    for toks, a, b in wins:
        inp = toks[:-1]
        tgt = toks[1:][a:b]
        ref = log_softmax(forward(w, inp))[a:b]
        nll["fp32"] -= ref[np.arange(len(tgt)), tgt].sum()
        for name, sc in schemes.items():
            lp = log_softmax(forward(w, inp, sc))[a:b]
            nll[name] -= lp[np.arange(len(tgt)), tgt].sum()
            kl[name] += (np.exp(ref) * (ref - lp)).sum()
        n += len(tgt)
    base = np.exp(nll["fp32"] / n)
    rows = []
    for name in schemes:
        p = np.exp(nll[name] / n)
        rows.append((name, schemes[name].bits(w["hs"]), 100 * (p / base - 1), kl[name] / n))
    return base, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", help=".npy of token ids (the whole file with BOS first for llama; the stories, each "
                    "[BOS] + tokens, for kvq)")
    ap.add_argument("--text", help="or the text, tokenized by the kvq module (PYTHONPATH=build/release/python)")
    ap.add_argument("--protocol", default="llama")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--attention", type=int, metavar="LAYER",
                    help="instead of schemes: attention statistics of LAYER over query positions 300..499")
    ap.add_argument("schemes", nargs="*", help="name=python kwargs, e.g. a='kb=3,vb=2,G=64,R=8'")
    args = ap.parse_args()
    w = load(args.model)
    if args.ids:
        ids = np.load(args.ids)
    else:
        import tempfile
        import kvq
        # llama2.c's checkpoint has no tokenizer of its own: the same model
        # as GGUF with tok512.bin beside it carries it.
        g = os.path.join(tempfile.mkdtemp(prefix="kv-sim-"), "m.gguf")
        gguf_write.convert_llama2c(args.model, os.path.join(os.path.dirname(args.model), "tok512.bin"), g)
        m = kvq.Model(g)
        text = open(args.text, encoding="utf-8").read()
        if args.protocol == "kvq":
            ids = []
            for story in text.split("<|endoftext|>"):
                if story.strip():
                    ids += list(m.tokenize(story.strip(), bos=True))
            ids = np.asarray(ids)
        else:
            ids = np.asarray(m.tokenize(text, bos=True))
    wins = windows(ids, args.ctx, args.protocol, args.windows)
    if args.attention is not None:
        eff, top, first = attention_stats(w, wins, args.attention, 300, 500)
        print(f"layer {args.attention}, {args.protocol}, {len(wins)} windows, query positions 300..499")
        for h in range(len(eff)):
            print(f"head {h}: effective keys {eff[h]:.1f}, largest weight {top[h]:.3f}; first window's "
                  f"strongest key (offset, token id) at 300..319: {first[h]}")
        return 0
    schemes = {}
    for s in args.schemes:
        name, kw = s.split("=", 1)
        schemes[name] = eval(f"Scheme({kw})")
    base, rows = evaluate(w, wins, schemes)
    print(f"fp32 PPL {base:.4f} ({args.protocol}, ctx {args.ctx}, {len(wins)} windows)")
    for name, bits, d, k in rows:
        print(f"{name:24s} bits {bits:.3f}  dPPL {d:+.3f}%  KLD {k:.3e}")


if __name__ == "__main__":
    sys.exit(main())
