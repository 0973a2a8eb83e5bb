#!/usr/bin/env python3
"""The layering of ARCHITECTURE.md, checked: no file includes a header of a
higher layer (or of a sibling that must not know it: model/ and store/).

Layers, low to high (src/ folders, then the public headers by the folder of
their implementation, then the layers above the library):
  0 base     numbers, fp16/fp8, affine, ggml blocks, RoPE, stats, SIMD targets, errors
  1 io       the container, whole-file writes, CRC32C, SHA-256
  2 attn     attention parts and their merge (kvq/attention_part.h)
  3 profile  the seed's sorted profiles, clusters and outliers
  3 calib    static ranges and bit allocation (kvq/static_ranges.h)
  4 rows     row schemes, the row store and kernel (kvq/kv_scheme.h, kvq/attention.h)
  5 groups   grouped schemes, store, encoder, kernel (kvq/grouped_kv.h)
  6 cache    the one KvCache (kvq/kv_cache.h)
  7 model, store (beside each other)
  8 session  kvq generate's library half (restore, prompt cache, saved caches, sampling)
  8 serve    kvq serve's engine (continuous batching, KV budget) and HTTP (beside session)
  9 tools, python (bench, tests and fuzz are not checked: they may reach any layer)
Run from anywhere: python3 tests/layers_test.py
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

PUBLIC = {
    "error": "base", "tensor": "base", "half": "base", "fp8": "base", "affine": "base",
    "ggml_quants": "base", "ggml_weights": "base", "rope": "base", "stats": "base", "targets": "base",
    "crc32c": "io", "file": "io", "sha256": "io",
    "sorted_profile": "profile", "cluster_bank": "profile", "cluster_outliers": "profile",
    "attention_part": "attn", "static_ranges": "calib",
    "kv_scheme": "rows", "attention": "rows",
    "grouped_kv": "groups",
    "kv_cache": "cache", "token_table": "cache",
}
RANK = {"base": 0, "io": 1, "attn": 2, "profile": 3, "calib": 3, "rows": 4, "groups": 5, "cache": 6,
        "model": 7, "store": 7, "session": 8, "serve": 8, "tools": 9, "python": 9}


def layer_of(path: str):
    """The layer of a repository path or an include string, or None (outside)."""
    p = path.split("/")
    if p[0] == "src" and len(p) > 2:
        return p[1]
    if p[0] == "kvq" and len(p) == 2:  # "kvq/x.h"
        return PUBLIC.get(p[1][:-2])
    if p[0] == "include" and len(p) == 3:
        return PUBLIC.get(p[2][:-2])
    if p[0] in ("model", "store", "session", "serve", "tools", "python"):
        return p[0]
    return None


def main() -> int:
    bad = []
    checked = 0
    for f in sorted(ROOT.rglob("*")):
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith(("build", ".git")) or f.suffix not in (".h", ".cc"):
            continue
        me = layer_of(rel)
        if me is None:
            if rel.startswith("include/"):
                bad.append(f"{rel}: a public header with no layer (add it to PUBLIC)")
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if not m:
                continue
            inc = m.group(1)
            if inc.startswith("kvq/") and inc[4:-2] not in PUBLIC:
                bad.append(f"{rel}:{n}: includes {inc}, a public header with no layer (add it to PUBLIC)")
                continue
            them = layer_of(inc)
            if them is None or them == me:
                continue
            checked += 1
            if RANK[them] > RANK[me] or (RANK[them] == RANK[me] and them != me):
                bad.append(f"{rel}:{n}: {me} includes {inc} ({them}), a layer above or beside it")
    for b in bad:
        print(b)
    print(f"layers_test: {checked} includes across layers checked, {len(bad)} wrong")
    return 1 if bad or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
