#!/usr/bin/env python3
"""Writes small llama2.c checkpoints and tokenizers for the CLI tests.

  make_checkpoint.py model OUT --dim D --hidden H --layers L --heads N
                     --kv-heads K --vocab V --seq S [--nan-bos] [--seed N]
  make_checkpoint.py tokenizer OUT --vocab V

A model is the legacy llama2.c format kvq reads (28-byte header of 7 int32,
then float32 weights in export order, shared classifier); weights are small
random values. --nan-bos makes the BOS token's embedding row NaN. A
tokenizer has V pieces: "<unk>", "<s>", "</s>", then the byte pieces
<0x00>.. while they fit, then two-letter pieces; scores are -index.
"""
import argparse
import struct

import numpy as np


def model(a):
    hs = a.dim // a.heads
    kv = a.kv_heads * hs
    L, d, h, v = a.layers, a.dim, a.hidden, a.vocab
    floats = v * d + L * d + L * d * d + 2 * L * kv * d + L * d * d + L * d + 3 * L * h * d + d + a.seq * hs
    rng = np.random.default_rng(a.seed)
    w = (0.1 * rng.standard_normal(floats)).astype(np.float32)
    w[v * d: v * d + L * d] = 1.0  # rms_att weights
    if a.nan_bos:
        w[1 * d: 2 * d] = np.nan
    with open(a.out, "wb") as f:
        f.write(struct.pack("<7i", d, h, L, a.heads, a.kv_heads, v, a.seq))
        f.write(w.tobytes())


def tokenizer(a):
    pieces = [b"<unk>", b"<s>", b"</s>"]
    pieces += [b"<0x%02X>" % i for i in range(256)]
    letters = b"abcdefghijklmnopqrstuvwxyz "
    pieces += [bytes([x, y]) for x in letters for y in letters]
    pieces = pieces[: a.vocab]
    assert len(pieces) == a.vocab, "vocab too large for this generator"
    with open(a.out, "wb") as f:
        f.write(struct.pack("<i", max(len(p) for p in pieces)))
        for i, p in enumerate(pieces):
            f.write(struct.pack("<fi", -float(i), len(p)))
            f.write(p)


p = argparse.ArgumentParser()
p.add_argument("kind", choices=["model", "tokenizer"])
p.add_argument("out")
for name, default in [("dim", 16), ("hidden", 32), ("layers", 1), ("heads", 2), ("kv-heads", 2), ("vocab", 300),
                      ("seq", 32), ("seed", 1)]:
    p.add_argument("--" + name, type=int, default=default)
p.add_argument("--nan-bos", action="store_true")
args = p.parse_args()
model(args) if args.kind == "model" else tokenizer(args)
