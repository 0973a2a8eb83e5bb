#!/usr/bin/env python3
"""Writes GGUF model files with NumPy only (no llama.cpp, no torch).

  gguf_write.py llama2c MODEL.bin TOKENIZER.bin OUT.gguf [--type F32|F16|BF16|Q8_0]
      a llama2.c checkpoint (legacy or export version 1) and its tokenizer.bin
      as a GGUF of architecture llama with a sentencepiece tokenizer
      (tokenizer.ggml.model = llama): the same weights, pieces and scores.
  gguf_write.py synthetic OUT.gguf [--arch llama|qwen2] [--dim ...] ...
      random weights with a real model's structure (GQA, head size, RoPE base
      and Llama 3 scaling as llama.cpp stores it: rope_freqs.weight; qwen2's
      Q/K/V biases). --stream makes each matrix as it is written (an 8B
      geometry without holding its weights in memory).

Layout as llama.cpp's convert_hf_to_gguf.py writes it: tensor names
token_embd / blk.N.attn_{norm,q,k,v,output} / ffn_{norm,gate,up,down} /
output_norm / output, a matrix (out, in) stored with ne = [in, out]; llama's
Q and K rows permuted from Hugging Face's half-split RoPE to adjacent pairs
(qwen2's are not: llama.cpp rotates them NEOX-style). Used by the tests
(python/tests/test_gguf.py, tests/gguf_table_test.sh) and the 1B-geometry
speed run (docs/eval.md).
"""
import argparse
import struct
import sys

import numpy as np

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
# ggml tensor types
GGML = {"F32": 0, "F16": 1, "Q8_0": 8, "BF16": 30}
ALIGN = 32


def f32_to_bf16(x):
    """Round to nearest even, as ggml's fp32 -> bf16 does; returns uint16 bits."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


def quantize(w, ty):
    """(bytes, the float32 values kvq will read back) of w in ggml type ty."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if ty == "F32":
        return w.tobytes(), w
    if ty == "F16":
        h = w.astype(np.float16)
        return h.tobytes(), h.astype(np.float32)
    if ty == "BF16":
        b = f32_to_bf16(w)
        return b.tobytes(), (b.astype(np.uint32) << 16).view(np.float32).reshape(w.shape)
    if ty == "Q8_0":
        assert w.shape[-1] % 32 == 0, "Q8_0 rows must be a multiple of 32"
        blocks = w.reshape(-1, 32)
        amax = np.abs(blocks).max(axis=1)
        d = (amax / 127.0).astype(np.float32)
        inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1), 0).astype(np.float32)
        q = np.round(blocks * inv[:, None]).astype(np.int8)  # ggml: roundf (half away); ties are measure-zero here
        d16 = d.astype(np.float16)
        out = np.empty((blocks.shape[0], 34), dtype=np.uint8)
        out[:, :2] = d16.view(np.uint8).reshape(-1, 2)
        out[:, 2:] = q.view(np.uint8)
        deq = (d16.astype(np.float32)[:, None] * q.astype(np.float32)).reshape(w.shape)
        return out.tobytes(), deq
    raise ValueError(f"unknown type {ty}")


class Lazy:
    """A matrix made when the file is written (synthetic(..., stream=True): an 8B-geometry model
    without holding its weights in memory)."""

    def __init__(self, shape, make):
        self.shape, self.make = tuple(shape), make

    def map(self, f):
        return Lazy(self.shape, lambda: f(self.make()))


class _Deferred:
    def __init__(self, nbytes, make):
        self.nbytes, self.make = nbytes, make

    def __len__(self):
        return self.nbytes


def _nbytes(shape, ty):
    n = int(np.prod(shape))
    return {"F32": 4 * n, "F16": 2 * n, "BF16": 2 * n, "Q8_0": n // 32 * 34}[ty]


class Writer:
    def __init__(self, version=3):
        self.version = version
        self.kv = []  # (key, type, payload bytes)
        self.tensors = []  # (name, ne, ggml type, data bytes)
        self.offset_of = {}  # name -> a data offset to write instead of its own (crafted files)

    @staticmethod
    def _str(s):
        b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
        return struct.pack("<Q", len(b)) + b

    def add(self, key, vtype, value):
        fmt = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
               U64: "<Q", I64: "<q", F64: "<d"}
        if vtype == STRING:
            payload = self._str(value)
        else:
            payload = struct.pack(fmt[vtype], value)
        self.kv.append((key, vtype, payload))

    def add_array(self, key, etype, values):
        head = struct.pack("<IQ", etype, len(values))
        if etype == STRING:
            body = b"".join(self._str(v) for v in values)
        else:
            dt = {F32: "<f4", I32: "<i4", U32: "<u4", U8: "u1", I64: "<i8"}[etype]
            body = np.asarray(values, dtype=dt).tobytes()
        self.kv.append((key, ARRAY, head + body))

    def tensor(self, name, w, ty="F32"):
        """Adds w (shape (out, in) or (n,)); returns what kvq reads back. Rows that Q8_0's blocks of 32
        cannot cut are stored F16, as llama.cpp's converter does."""
        shape = w.shape if isinstance(w, Lazy) else np.shape(w)
        if ty == "Q8_0" and shape[-1] % 32 != 0:
            ty = "F16"
        if isinstance(w, Lazy):
            self.tensors.append((name, list(reversed(shape)), GGML[ty],
                                 _Deferred(_nbytes(shape, ty), lambda: quantize(w.make(), ty)[0])))
            return None
        data, deq = quantize(w, ty)
        ne = list(reversed(np.shape(w)))
        self.tensors.append((name, ne, GGML[ty], data))
        return deq

    def _header(self):
        out = bytearray(b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors), len(self.kv)))
        for key, vtype, payload in self.kv:
            out += self._str(key) + struct.pack("<I", vtype) + payload
        offsets, off = [], 0
        for _, _, _, data in self.tensors:
            offsets.append(off)
            off += (len(data) + ALIGN - 1) // ALIGN * ALIGN
        for (name, ne, ty, _), o in zip(self.tensors, offsets):
            out += self._str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
            out += struct.pack("<IQ", ty, self.offset_of.get(name, o))
        out += b"\0" * ((-len(out)) % ALIGN)
        return bytes(out)

    def _chunks(self):
        yield self._header()
        for _, _, _, data in self.tensors:
            pad = b"\0" * ((-len(data)) % ALIGN)
            if isinstance(data, _Deferred):
                b = data.make()
                assert len(b) == data.nbytes
                yield b
                yield pad
            else:
                yield data + pad

    def tobytes(self):
        return b"".join(self._chunks())

    def write(self, path):
        with open(path, "wb") as f:
            for c in self._chunks():
                f.write(c)


def hf_to_gguf_rows(w, n_head):
    """llama.cpp's permute for llama Q/K: half-split rotation rows -> adjacent pairs."""
    if isinstance(w, Lazy):
        return w.map(lambda a: hf_to_gguf_rows(a, n_head))
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def llama_metadata(g, arch, cfg):
    g.add("general.architecture", STRING, arch)
    g.add("general.name", STRING, cfg.get("name", "kvq-synthetic"))
    g.add(f"{arch}.context_length", U32, cfg["ctx"])
    g.add(f"{arch}.embedding_length", U32, cfg["dim"])
    g.add(f"{arch}.block_count", U32, cfg["layers"])
    g.add(f"{arch}.feed_forward_length", U32, cfg["hidden"])
    g.add(f"{arch}.attention.head_count", U32, cfg["heads"])
    g.add(f"{arch}.attention.head_count_kv", U32, cfg["kv_heads"])
    g.add(f"{arch}.rope.freq_base", F32, cfg["rope_base"])
    g.add(f"{arch}.rope.dimension_count", U32, cfg["dim"] // cfg["heads"])
    g.add(f"{arch}.attention.layer_norm_rms_epsilon", F32, cfg["eps"])
    if cfg.get("rope_scaling") == "linear":
        g.add(f"{arch}.rope.scaling.type", STRING, "linear")
        g.add(f"{arch}.rope.scaling.factor", F32, cfg["rope_factor"])


def hf_bpe_vocab(tokenizer_json):
    """(tokens, GGUF token types, merges "a b") of a Hugging Face byte-level BPE tokenizer.json: the
    model's vocabulary, then its added tokens (special: control 3, else user-defined 4) at their ids,
    gaps filled with unused (5) placeholders, as llama.cpp's converter lays them out."""
    import json
    t = json.load(open(tokenizer_json, encoding="utf-8"))
    vocab = dict(t["model"]["vocab"])
    types = {i: 1 for i in vocab.values()}
    for a in t.get("added_tokens", []):
        vocab[a["content"]] = a["id"]
        types[a["id"]] = 3 if a.get("special") else 4
    n = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    kinds = [5] * n
    for s, i in vocab.items():
        tokens[i], kinds[i] = s, types[i]
    merges = [m if isinstance(m, str) else " ".join(m) for m in t["model"]["merges"]]
    return tokens, kinds, merges


def byte_chars():
    """GPT-2's bytes_to_unicode: byte b -> its character."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


def tiny_bpe_vocab(V):
    """V >= 260 tokens: the 256 byte characters, merges of common letter pairs (and " " + letter), then
    two control tokens (EOS, BOS) last."""
    assert V >= 260, "tokenizer bpe needs vocab >= 260"
    chars = byte_chars()
    tokens, merges = list(chars), []
    letters = "etaonishrdlu"
    pairs = [(chars[32], c) for c in letters] + [(a, b) for a in letters for b in letters]
    for a, b in pairs[:V - 258]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), V - 2)] + ["<|eos|>", "<|bos|>"]
    return tokens, [1] * (V - 2) + [3, 3], merges


def add_bpe_tokenizer(g, tokens, kinds, merges, pre, bos=None, eos=None, add_bos=False):
    """tokenizer.ggml.model = gpt2 with its pre-tokenizer name (llama-bpe, qwen2, smollm, gpt-2)."""
    g.add("tokenizer.ggml.model", STRING, "gpt2")
    g.add("tokenizer.ggml.pre", STRING, pre)
    g.add_array("tokenizer.ggml.tokens", STRING, tokens)
    g.add_array("tokenizer.ggml.token_type", I32, kinds)
    g.add_array("tokenizer.ggml.merges", STRING, merges)
    if bos is not None:
        g.add("tokenizer.ggml.bos_token_id", U32, bos)
    if eos is not None:
        g.add("tokenizer.ggml.eos_token_id", U32, eos)
    g.add("tokenizer.ggml.add_bos_token", BOOL, add_bos)


def llama3_rope_factors(head_dim, base, factor, low=1.0, high=4.0, original=8192):
    """convert_hf_to_gguf.py's rope_freqs for Llama 3 (per-frequency divisors)."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    low_wl, high_wl = original / low, original / high
    out = []
    for f in freqs:
        wl = 2 * np.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (original / wl - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


class _Discard(dict):
    def __setitem__(self, key, value):
        if key == "embed":  # a tied output reads it
            super().__setitem__(key, value)


def synthetic(cfg, seed=0, keep_reference=True, stream=False):
    """A GGUF Writer with random weights; returns (writer, weights in Hugging
    Face layout as float32 after the storage type's rounding; with
    keep_reference=False only what the writer needs, for large models)."""
    rng = np.random.default_rng(seed)
    arch, ty = cfg["arch"], cfg.get("type", "F32")
    d, hid, L, H, KV, V = cfg["dim"], cfg["hidden"], cfg["layers"], cfg["heads"], cfg["kv_heads"], cfg["vocab"]
    hd = d // H
    g = Writer()
    llama_metadata(g, arch, cfg)
    tok = cfg.get("tokenizer", "none")
    if tok == "gpt2":  # a gpt2 tokenizer kvq cannot read (no pre-tokenizer name, no byte characters)
        g.add("tokenizer.ggml.model", STRING, "gpt2")
        g.add_array("tokenizer.ggml.tokens", STRING, [f"t{i}" for i in range(V)])
    elif tok == "bpe":  # a small real byte-level BPE (llama-bpe): GPT-2's 256 byte characters, then merges
        tokens, kinds, merges = tiny_bpe_vocab(V)
        add_bpe_tokenizer(g, tokens, kinds, merges, "llama-bpe", bos=cfg.get("bos_id", V - 1), eos=V - 2,
                          add_bos=cfg.get("add_bos", True))
    elif tok == "llama":  # sentencepiece layout: <unk>, <s>, </s>, 256 byte pieces, then words
        letters = "abcdefghijklmnopqrstuvwxyz"
        words = ["\u2581" + a for a in letters] + [a + b for a in letters for b in letters]
        pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words[:V - 259]
        assert len(pieces) == V, "tokenizer llama needs 259 <= vocab <= 961"
        g.add("tokenizer.ggml.model", STRING, "llama")
        g.add_array("tokenizer.ggml.tokens", STRING, pieces)
        g.add_array("tokenizer.ggml.scores", F32, [0.0] * 259 + [-float(i) for i in range(V - 259)])
        g.add_array("tokenizer.ggml.token_type", I32, [2, 3, 3] + [6] * 256 + [1] * (V - 259))
    hf = {} if keep_reference else _Discard()

    made = [0]

    def mat(out_dim, in_dim, scale=None):
        s = scale if scale is not None else 1.0 / np.sqrt(in_dim)
        if stream:  # made at write time, each matrix from its own generator
            made[0] += 1
            sub = np.random.default_rng([seed, made[0]])
            return Lazy((out_dim, in_dim), lambda: sub.standard_normal((out_dim, in_dim), dtype=np.float32) * np.float32(s))
        return (rng.standard_normal((out_dim, in_dim)) * s).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    hf["embed"] = g.tensor("token_embd.weight", mat(V, d, 1.0), ty)
    if cfg.get("rope_scaling") == "llama3":
        g.tensor("rope_freqs.weight", llama3_rope_factors(hd, cfg["rope_base"], cfg["rope_factor"]), "F32")
    for l in range(L):
        p = f"blk.{l}."
        hf[f"{l}.attn_norm"] = g.tensor(p + "attn_norm.weight", norm(d), "F32")
        wq, wk = mat(d, d), mat(KV * hd, d)
        if arch == "llama":
            # Stored permuted; the reference keeps HF's order (the rounding is per value, and Q8_0's blocks
            # run along rows, which the row permutation keeps whole).
            hf[f"{l}.wq"] = unpermute(g.tensor(p + "attn_q.weight", hf_to_gguf_rows(wq, H), ty), H)
            hf[f"{l}.wk"] = unpermute(g.tensor(p + "attn_k.weight", hf_to_gguf_rows(wk, KV), ty), KV)
        else:
            hf[f"{l}.wq"] = g.tensor(p + "attn_q.weight", wq, ty)
            hf[f"{l}.wk"] = g.tensor(p + "attn_k.weight", wk, ty)
        hf[f"{l}.wv"] = g.tensor(p + "attn_v.weight", mat(KV * hd, d), ty)
        if arch == "qwen2":
            hf[f"{l}.bq"] = g.tensor(p + "attn_q.bias", (0.5 * rng.standard_normal(d)).astype(np.float32), "F32")
            hf[f"{l}.bk"] = g.tensor(p + "attn_k.bias", (0.5 * rng.standard_normal(KV * hd)).astype(np.float32), "F32")
            hf[f"{l}.bv"] = g.tensor(p + "attn_v.bias", (0.5 * rng.standard_normal(KV * hd)).astype(np.float32), "F32")
        hf[f"{l}.wo"] = g.tensor(p + "attn_output.weight", mat(d, d), ty)
        hf[f"{l}.ffn_norm"] = g.tensor(p + "ffn_norm.weight", norm(d), "F32")
        hf[f"{l}.wg"] = g.tensor(p + "ffn_gate.weight", mat(hid, d), ty)
        hf[f"{l}.wu"] = g.tensor(p + "ffn_up.weight", mat(hid, d), ty)
        hf[f"{l}.wd"] = g.tensor(p + "ffn_down.weight", mat(d, hid), ty)
    hf["out_norm"] = g.tensor("output_norm.weight", norm(d), "F32")
    if cfg.get("tied", False):
        hf["out"] = hf.get("embed")
    else:
        hf["out"] = g.tensor("output.weight", mat(V, d), ty)
    return g, hf


def unpermute(w, n_head):
    """Inverse of hf_to_gguf_rows."""
    if w is None:
        return None
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def read_llama2c(model_path, tok_path):
    raw = open(model_path, "rb").read()
    magic, version = struct.unpack_from("<II", raw, 0)
    if magic == 0x616B3432:
        if version != 1:
            sys.exit(f"gguf_write: llama2.c export version {version} is not supported (0 and 1 are)")
        dim, hid, L, H, KV, V, seq = struct.unpack_from("<7i", raw, 8)
        shared, off, v1 = raw[36] != 0, 256, True
    else:
        dim, hid, L, H, KV, V, seq = struct.unpack_from("<7i", raw, 0)
        shared, V, off, v1 = V > 0, abs(V), 28, False
    hd, kv = dim // H, KV * (dim // H)
    f = np.frombuffer(raw, dtype="<f4", offset=off)
    pos = 0

    def take(*shape):
        nonlocal pos
        n = int(np.prod(shape))
        a = f[pos:pos + n].reshape(shape)
        pos += n
        return a

    w = {}
    if v1:
        w["rms_att"], w["rms_ffn"], w["rms_final"] = take(L, dim), take(L, dim), take(dim)
        w["emb"] = take(V, dim)
        w["wq"], w["wk"], w["wv"], w["wo"] = take(L, dim, dim), take(L, kv, dim), take(L, kv, dim), take(L, dim, dim)
        w["w1"], w["w2"], w["w3"] = take(L, hid, dim), take(L, dim, hid), take(L, hid, dim)
    else:
        w["emb"], w["rms_att"] = take(V, dim), take(L, dim)
        w["wq"], w["wk"], w["wv"], w["wo"] = take(L, dim, dim), take(L, kv, dim), take(L, kv, dim), take(L, dim, dim)
        w["rms_ffn"] = take(L, dim)
        w["w1"], w["w2"], w["w3"] = take(L, hid, dim), take(L, dim, hid), take(L, hid, dim)
        w["rms_final"] = take(dim)
        take(seq, hd)  # the two unused RoPE tables
    w["cls"] = w["emb"] if shared else take(V, dim)
    cfg = dict(dim=dim, hidden=hid, layers=L, heads=H, kv_heads=KV, vocab=V, ctx=seq, shared=shared)
    t = open(tok_path, "rb").read()
    (max_len,) = struct.unpack_from("<i", t, 0)
    o, pieces, scores = 4, [], []
    for _ in range(V):
        score, n = struct.unpack_from("<fi", t, o)
        o += 8
        pieces.append(t[o:o + n])
        scores.append(score)
        o += n
    if o != len(t):
        sys.exit(f"gguf_write: {tok_path}: {len(t) - o} trailing bytes after {V} pieces")
    return cfg, w, pieces, scores


def pad_heads(w, cfg, P):
    """The same model with every head zero-padded from hd to P channels (llama.cpp's quantized KV
    caches need head_dim a multiple of 32): pair i of a head's adjacent-pair RoPE moves to pair
    i * P / hd, whose frequency base^(-2i/hd) is the same; Q's rows are scaled by sqrt(P / hd) so
    that q.k / sqrt(P) is the original score (up to the float32 rounding of that product); V's padded
    rows and wo's padded columns are zero."""
    H, KV, hd, L = cfg["heads"], cfg["kv_heads"], cfg["dim"] // cfg["heads"], cfg["layers"]
    assert P % hd == 0 and P > hd
    step = P // hd
    at = np.zeros(hd, dtype=np.int64)
    for i in range(hd // 2):
        at[2 * i], at[2 * i + 1] = 2 * i * step, 2 * i * step + 1

    def rows(m, heads, scale=1.0):
        out = np.zeros((heads * P,) + m.shape[1:], dtype=np.float32)
        for h in range(heads):
            out[h * P + at] = m[h * hd:(h + 1) * hd] * np.float32(scale)
        return out

    w = dict(w)
    w["wq"] = np.stack([rows(w["wq"][l], H, np.sqrt(P / hd)) for l in range(L)])
    w["wk"] = np.stack([rows(w["wk"][l], KV) for l in range(L)])
    w["wv"] = np.stack([rows(w["wv"][l], KV) for l in range(L)])
    w["wo"] = np.stack([rows(w["wo"][l].T, H).T for l in range(L)])
    return w


def convert_llama2c(model_path, tok_path, out_path, ty="F32", pad_head=None):
    cfg, w, pieces, scores = read_llama2c(model_path, tok_path)
    g = Writer()
    c = dict(cfg, rope_base=10000.0, eps=1e-5, name="stories260K (llama2.c)")
    llama_metadata(g, "llama", c)
    if pad_head:
        w = pad_heads(w, cfg, pad_head)
        for k in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
            g.kv = [e for e in g.kv if e[0] != f"llama.{k}"]
            g.add(f"llama.{k}", U32, pad_head)
    g.add("tokenizer.ggml.model", STRING, "llama")
    # llama2.c's export turned sentencepiece's U+2581 into spaces; GGUF keeps U+2581.
    g.add_array("tokenizer.ggml.tokens", STRING, [p.replace(b" ", "\u2581".encode()) for p in pieces])
    g.add_array("tokenizer.ggml.scores", F32, scores)
    types = [2 if i == 0 else 3 if i in (1, 2) else 6 if 3 <= i < 259 else 1 for i in range(len(pieces))]
    g.add_array("tokenizer.ggml.token_type", I32, types)
    g.add("tokenizer.ggml.bos_token_id", U32, 1)
    g.add("tokenizer.ggml.eos_token_id", U32, 2)
    g.add("tokenizer.ggml.unknown_token_id", U32, 0)
    g.add("tokenizer.ggml.add_bos_token", BOOL, True)
    g.tensor("token_embd.weight", w["emb"], ty)
    for l in range(cfg["layers"]):
        p = f"blk.{l}."
        g.tensor(p + "attn_norm.weight", w["rms_att"][l])
        g.tensor(p + "attn_q.weight", w["wq"][l], ty)  # llama2.c already rotates adjacent pairs
        g.tensor(p + "attn_k.weight", w["wk"][l], ty)
        g.tensor(p + "attn_v.weight", w["wv"][l], ty)
        g.tensor(p + "attn_output.weight", w["wo"][l], ty)
        g.tensor(p + "ffn_norm.weight", w["rms_ffn"][l])
        g.tensor(p + "ffn_gate.weight", w["w1"][l], ty)
        g.tensor(p + "ffn_down.weight", w["w2"][l], ty)
        g.tensor(p + "ffn_up.weight", w["w3"][l], ty)
    g.tensor("output_norm.weight", w["rms_final"])
    if not cfg["shared"]:
        g.tensor("output.weight", w["cls"], ty)
    g.write(out_path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("llama2c", help="a llama2.c checkpoint + tokenizer.bin as GGUF")
    a.add_argument("model")
    a.add_argument("tokenizer")
    a.add_argument("out")
    a.add_argument("--type", default="F32", choices=sorted(GGML))
    a.add_argument("--pad-head", type=int, default=0,
                   help="zero-pad every head to this many channels (for llama.cpp's quantized KV caches; kvq "
                        "refuses such a file, it reads the unpadded one)")
    s = sub.add_parser("synthetic", help="random weights with a real model's structure")
    s.add_argument("out")
    s.add_argument("--arch", default="llama", choices=["llama", "qwen2"])
    s.add_argument("--dim", type=int, default=2048)
    s.add_argument("--hidden", type=int, default=8192)
    s.add_argument("--layers", type=int, default=16)
    s.add_argument("--heads", type=int, default=32)
    s.add_argument("--kv-heads", type=int, default=8)
    s.add_argument("--vocab", type=int, default=32000)
    s.add_argument("--ctx", type=int, default=131072)
    s.add_argument("--rope-base", type=float, default=500000.0)
    s.add_argument("--rope-scaling", default="llama3", choices=["none", "linear", "llama3"])
    s.add_argument("--rope-factor", type=float, default=32.0)
    s.add_argument("--eps", type=float, default=1e-5)
    s.add_argument("--tied", action="store_true")
    s.add_argument("--type", default="F16", choices=sorted(GGML))
    s.add_argument("--tokenizer", default="none", choices=["none", "gpt2", "bpe", "llama"])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--alias", action="store_true", help="every tensor at data offset 0 (a crafted file)")
    s.add_argument("--chat-template", metavar="FILE", help="tokenizer.chat_template: the text of FILE")
    s.add_argument("--bos-id", type=int, help="tokenizer bpe: this tokenizer.ggml.bos_token_id (default vocab - 1)")
    s.add_argument("--no-add-bos", action="store_true", help="tokenizer bpe: tokenizer.ggml.add_bos_token false")
    s.add_argument("--stream", action="store_true",
                   help="make each matrix as it is written (from its own generator): an 8B model in little memory")
    args = ap.parse_args()
    if args.cmd == "llama2c":
        convert_llama2c(args.model, args.tokenizer, args.out, args.type, args.pad_head or None)
    else:
        cfg = dict(arch=args.arch, dim=args.dim, hidden=args.hidden, layers=args.layers, heads=args.heads,
                   kv_heads=args.kv_heads, vocab=args.vocab, ctx=args.ctx, rope_base=args.rope_base,
                   rope_scaling=args.rope_scaling, rope_factor=args.rope_factor, eps=args.eps, tied=args.tied,
                   type=args.type, tokenizer=args.tokenizer)
        if args.bos_id is not None:
            cfg["bos_id"] = args.bos_id
        if args.no_add_bos:
            cfg["add_bos"] = False
        g, _ = synthetic(cfg, args.seed, keep_reference=False, stream=args.stream)
        if args.chat_template:
            with open(args.chat_template, encoding="utf-8") as f:
                g.add("tokenizer.chat_template", STRING, f.read())
        if args.alias:
            g.offset_of = {t[0]: 0 for t in g.tensors}
        g.write(args.out)


if __name__ == "__main__":
    main()
