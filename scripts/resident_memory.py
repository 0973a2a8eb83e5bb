#!/usr/bin/python3
"""Resident memory of a filled kvq.KvCache against the bytes it reports.

  PYTHONPATH=build/release/python /usr/bin/python3 scripts/resident_memory.py \
      [--layers 4] [--tokens 16384] [--heads 8] [--head-dim 128] [--check] [SCHEME ...]

Each scheme runs in a fresh interpreter: it makes the K/V rows (a large
channel per head, as a model's keys have), reads its resident set size
(/proc/self/statm), builds the cache, writes every layer's tokens, and reads
the RSS again. The growth, over 2 tokens x heads x head_dim x layers elements,
is the resident bits per element; bytes() is what the cache reports (the
writing thread's scratch is made beforehand: it is the thread's). Prints
a Markdown table; --check exits 1 when a growth is not within 5% + 1 MiB of
bytes() (issue 26's bound).

--restored measures a cache restored from the prefix store instead
(kvq.PrefixStore on memory:, chunks of 256): the cache is written and put
chunk by chunk, dropped, and the growth is measured around
longest_prefix into a fresh cache (the store's own copies of the chunks are
made beforehand; the fetched copies a restore reads must not stay resident).
"""
import argparse
import json
import os
import subprocess
import sys

DEFAULT = ["fp16", "q4_0", "kvq-6.5", "kvq-4.5", "kvq-3.5", "kvq-2.5", "k4v4g64", "k4v3g64o8r16", "k2v2g96o4w4r4"]


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one(scheme, L, T, H, hd, restored):
    import numpy as np
    import kvq

    rng = np.random.default_rng(1)
    scale = np.ones(H * hd, np.float32)
    scale[17::hd] = 8.0
    k = (rng.standard_normal((T, H * hd), dtype=np.float32) * scale).astype(np.float32)
    v = rng.standard_normal((T, H * hd), dtype=np.float32)
    ranges = None
    if kvq.kv_scheme_info(scheme)["needs_ranges"]:
        w = np.where(np.arange(L * H * hd) % hd == 17, 1e4, 1.0).astype(np.float32)
        ranges = kvq.static_ranges_from_samples([k[:256]] * L, [v[:256]] * L, H, hd, k_weight=w)
    # The writing thread's scratch (one group's values as floats, its codes)
    # is the thread's, shared by every cache it writes: made before the
    # measurement by another cache, kept alive (what it freed would be
    # reused by the measured one and hide its allocations).
    w = kvq.KvCache(scheme, L, T, H, hd, ranges)
    w.write_many(0, 0, k[:1024], v[:1024])
    if restored:
        store = kvq.PrefixStore(f"memory:{scheme}", chunk_tokens=256)
        filled = kvq.KvCache(scheme, L, T, H, hd, ranges)
        tokens, b = list(range(T)), 0
        for e in store.chunk_ends(filled, T):
            if e > T:
                break
            for layer in range(L):
                filled.write_many(layer, b, k[b:e], v[b:e])
            store.put(tokens, filled)
            b = e
        del filled
        like = kvq.KvCache(scheme, L, T, H, hd, ranges)
        import ctypes  # what the filled cache and the puts freed leaves the baseline
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = rss()
        n, c = store.longest_prefix(tokens, like)
        if n != b:
            raise SystemExit(f"{scheme}: restored {n} tokens, expected {b}")
    else:
        before = rss()
        c = kvq.KvCache(scheme, L, T, H, hd, ranges)
        for layer in range(L):
            c.write_many(layer, 0, k, v)
    grown = rss() - before
    del w
    return {"scheme": scheme, "label": c.label, "bytes": c.bytes(), "bits": c.bits(), "rss": grown,
            "allocated": c.allocated_bytes(), "elements": 2 * L * c.tokens * H * hd}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--restored", action="store_true", help="a cache restored from the prefix store")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("schemes", nargs="*")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.layers, a.tokens, a.heads, a.head_dim, a.restored)))
        return 0
    geo = ["--layers", str(a.layers), "--tokens", str(a.tokens), "--heads", str(a.heads), "--head-dim", str(a.head_dim)]
    geo += ["--restored"] if a.restored else []
    print(f"{a.layers} layers x {a.tokens} tokens x {a.heads} KV heads x {a.head_dim}" +
          (", restored from the prefix store" if a.restored else ""))
    print()
    print("| scheme | bits reported | resident bits | resident / reported | RSS growth MiB | bytes() MiB |")
    print("|---|---|---|---|---|---|")
    bad = 0
    for s in a.schemes or DEFAULT:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", s] + geo, capture_output=True, text=True)
        if p.returncode != 0:
            print(f"{s}: failed\n{p.stderr}", file=sys.stderr)
            return 2
        r = json.loads(p.stdout)
        rbits = 8.0 * r["rss"] / r["elements"]
        ok = abs(r["rss"] - r["bytes"]) <= 0.05 * r["bytes"] + (1 << 20)
        bad += not ok
        print(f"| {r['label']} | {r['bits']:.3f} | {rbits:.3f} | {rbits / r['bits']:.3f} | "
              f"{r['rss'] / 2**20:.1f} | {r['bytes'] / 2**20:.1f} |{'' if ok else ' outside 5% + 1 MiB'}")
    return 1 if a.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
