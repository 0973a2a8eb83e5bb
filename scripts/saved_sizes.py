#!/usr/bin/python3
"""Saved KV cache sizes: what KvCache.to_bytes writes, per token, for every scheme.

  PYTHONPATH=build/release/python /usr/bin/python3 scripts/saved_sizes.py \
      [--heads 8] [--head-dim 128] [--ctx 512 16384] [SCHEME ...]

One layer of `heads` KV heads x `head_dim` (a model's file is n_layers times
this, plus one header), K and V rows with a large channel per head as a
model's keys have, ranges measured on the first 256 rows for the schemes
that need them. For each ctx it writes ctx tokens, saves, checks that the
container is bytes() + a header of at most 4 KiB and restores it, and prints
bytes per token, the file's bits per element and its size against fp16's.
"""
import argparse
import sys

import numpy as np

import kvq


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 16384])
    ap.add_argument("schemes", nargs="*")
    a = ap.parse_args()
    H, hd, E = a.heads, a.head_dim, a.heads * a.head_dim
    schemes = a.schemes or kvq.all_kv_scheme_names()
    T = max(a.ctx)
    rng = np.random.default_rng(7)
    scale = np.ones(E, np.float32)
    scale[17::hd] = 8.0
    k = (rng.standard_normal((T, E), dtype=np.float32) * scale).astype(np.float32)
    v = rng.standard_normal((T, E), dtype=np.float32)
    w = np.where(np.arange(E) % hd == 17, 1e4, 1.0).astype(np.float32)
    ranges = kvq.static_ranges_from_samples([k[:256]], [v[:256]], H, hd, k_weight=w)
    print(f"one layer of {H} KV heads x {hd}; bytes per token of the saved file (header included)")
    print()
    head = " | ".join(f"ctx {c}: bytes/token | bits | × fp16" for c in a.ctx)
    print(f"| scheme | {head} |")
    print("|---|" + "---|---|---|" * len(a.ctx))
    for s in schemes:
        cells = []
        for ctx in a.ctx:
            c = kvq.KvCache(s, 1, ctx, H, hd, ranges if kvq.kv_scheme_info(s)["needs_ranges"] else None)
            c.write_many(0, 0, k[:ctx], v[:ctx])
            data = c.to_bytes()
            if not c.bytes() < len(data) <= c.bytes() + 4096:
                sys.exit(f"{s}: saved {len(data)} bytes, the cache holds {c.bytes()}")
            d = kvq.KvCache.from_bytes(data)
            if d.bytes() != c.bytes():
                sys.exit(f"{s}: restored {d.bytes()} bytes, saved {c.bytes()}")
            fp16 = 2 * ctx * E * 2
            cells.append(f"{len(data) / ctx:.1f} | {8 * len(data) / (2 * ctx * E):.3f} | {len(data) / fp16:.3f}")
        print(f"| {kvq.kv_scheme_info(s)['label']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
