#!/usr/bin/python3
"""The prefix store's measured tables (docs/prefix-store.md).

  /usr/bin/python3 scripts/prefix_store_table.py [--build build/release] [--min-time 0.3]
      [--repetitions 3] [--skip-bench] [--skip-generate]

1. Llama-3-8B's attention geometry (32 layers, 8 KV heads, head_dim 128), one
   256-token chunk (288 for groups of 96): bytes per chunk and per token
   against fp16 (LMCache's default), put / get time per chunk and MB/s for
   memory, a directory and Redis on 127.0.0.1, and the CPU time a hit takes
   to restore: kvq_bench's BM_prefix_* (medians of --repetitions), with
   redis-server started here on a free port.
2. stories260K, a 480-token prompt from the dev text: `kvq generate
   --prompt-cache` cold (empty store: the whole prompt computed and its
   chunks stored) and warm (every full chunk restored), for a directory and
   Redis, fp16 and the presets: what stderr reports (lookup, restore,
   prefill, store), medians of --repetitions warm runs.
Everything printed is measured in this run.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loopback import free_port, start_redis  # noqa: E402

SCHEMES = ["fp16", "q8_0", "q4_0", "kvq-6.5", "kvq-4.5", "kvq-3.5", "kvq-2.5"]


def bench_table(build, redis, min_time, reps, schemes):
    env = dict(os.environ)
    if redis:
        env["KVQ_BENCH_REDIS"] = redis
    pattern = "^BM_prefix_.*/(" + "|".join(x.replace(".", "[.]") for x in schemes) + ")(/real_time)?$"
    out = subprocess.run([os.path.join(build, "bench", "kvq_bench"), f"--benchmark_filter={pattern}",
                          f"--benchmark_min_time={min_time}", f"--benchmark_repetitions={reps}",
                          "--benchmark_report_aggregates_only=true", "--benchmark_format=json"],
                         env=env, check=True, capture_output=True, text=True).stdout
    rows = {}
    for b in json.loads(out)["benchmarks"]:
        if b.get("aggregate_name") != "median" and not (reps == 1 and b.get("run_type") == "iteration"):
            continue
        name = b["run_name"].replace("/real_time", "")
        rows[name] = b
    def us(name):
        b = rows.get(name)
        return None if b is None else b["real_time"]  # microseconds (Unit)
    fp16 = 2.0 * 2 * 32 * 8 * 128  # bytes a token of fp16 K and V, 32 layers x 8 x 128
    backends = ["memory", "dir"] + (["redis"] if redis else [])
    print("Llama-3-8B attention geometry (32 layers x 8 KV heads x 128), one chunk; put / get: ms per chunk "
          "(MB/s), medians; restore: the CPU time of a hit, per chunk")
    print()
    head = " | ".join(f"{b} put | {b} get" for b in backends)
    print(f"| scheme | chunk tokens | bytes / chunk | bytes / token | x fewer than fp16 | memcpy | {head} | restore |")
    print("|---|---:|---:|---:|---:|---:|" + "---:|---:|" * len(backends) + "---:|")
    for s in schemes:
        m = rows[f"BM_prefix_memcpy/{s}"]
        n = m["chunk_bytes"]
        def cell(name):
            t = us(name)
            return "n/a" if t is None else f"{t / 1e3:.2f} ({n / t:.0f})"  # bytes per us = MB/s
        cells = " | ".join(f"{cell(f'BM_prefix_put/{b}/{s}')} | {cell(f'BM_prefix_get/{b}/{s}')}" for b in backends)
        restore = us(f"BM_prefix_restore/{s}") / 2e3  # two chunks a call
        print(f"| {s} | {int(m['chunk_tokens'])} | {n / 1e6:.2f} MB | {m['bytes_per_token']:.0f} | "
              f"{fp16 / m['bytes_per_token']:.2f} | {m['real_time'] / 1e3:.2f} | {cells} | {restore:.1f} ms |")
    print()


STAT = re.compile(r"reused (\d+) of (\d+) prompt tokens \(.*?chunks of (\d+), the first (\d+); lookup ([\d.]+) ms, "
                  r"restore ([\d.]+) ms, prefill of (\d+) tokens ([\d.]+) ms; stored (\d+) chunk\(s\), (\d+) bytes, "
                  r"in ([\d.]+) ms\)")


def generate(kvq, kv, prompt, steps, store, check=True):
    r = subprocess.run([kvq, "generate", "--kv", kv, "--prompt", prompt, "--steps", str(steps), "--prompt-cache",
                        store], capture_output=True, text=True)
    if r.returncode != 0:
        if not check:
            return None, None
        sys.exit(f"kvq generate failed: {r.stderr}")
    m = STAT.search(r.stderr)
    if not m:
        sys.exit(f"no prompt-cache line in: {r.stderr}")
    g = m.groups()
    return r.stdout, dict(reused=int(g[0]), P=int(g[1]), C=int(g[2]), first=int(g[3]), lookup=float(g[4]),
                          restore=float(g[5]), prefill_tokens=int(g[6]), prefill=float(g[7]), stored=int(g[8]),
                          stored_bytes=int(g[9]), store=float(g[10]))


def prompt_of(kvq, tokens):
    """A prefix of the dev text that tokenizes to `tokens` tokens (BOS included)."""
    shared = os.environ.get("KVQ_SHARED", os.path.join(ROOT, "..", "shared"))
    text = open(os.path.join(shared, "data", "tinystories-valid-dev.txt"), encoding="utf-8").read()
    text = " ".join(text.replace("<|endoftext|>", " ").split())
    lo, hi = 1, 8 * tokens
    d = tempfile.mkdtemp()
    try:
        while lo < hi:  # the longest prefix of at most `tokens` tokens
            mid = (lo + hi + 1) // 2
            _, st = generate(kvq, "fp32", text[:mid], 512, os.path.join(d, str(mid)), check=False)
            if st is not None and st["P"] <= tokens:
                lo = mid
            else:
                hi = mid - 1
    finally:
        shutil.rmtree(d)
    return text[:lo]


def generate_table(build, redis, reps, schemes):
    kvq = os.path.join(build, "kvq")
    prompt = prompt_of(kvq, 480)
    print("stories260K, a 480-token prompt (BOS included) from the dev text, chunks of 256: cold (empty store) "
          "and warm (its full chunks restored); ms, warm medians of", reps)
    print()
    print("| store | scheme | P | cold: prefill | cold: stored (bytes, ms) | warm: reused | lookup | restore | "
          "prefill of the rest | warm total | x faster | same text |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    d = tempfile.mkdtemp()
    try:
        stores = [("dir", os.path.join(d, "store"))] + ([("redis", redis + "/5")] if redis else [])
        for label, url in stores:
            for kv in [x for x in schemes if x not in ("q8_0", "q4_0")]:
                if label == "dir":
                    shutil.rmtree(os.path.join(d, "store"), ignore_errors=True)
                else:
                    subprocess.run(["redis-cli", "-u", url, "FLUSHDB"], check=True, capture_output=True)
                text_cold, cold = generate(kvq, kv, prompt, 496, url)
                warm = []
                for _ in range(reps):
                    text_warm, w = generate(kvq, kv, prompt, 496, url)
                    warm.append(w)
                    if text_warm != text_cold:
                        sys.exit(f"{label} {kv}: the warm text differs from the cold one")
                med = {k: statistics.median(w[k] for w in warm) for k in ("lookup", "restore", "prefill")}
                total = med["lookup"] + med["restore"] + med["prefill"]
                print(f"| {label} | {kv} | {cold['P']} | {cold['prefill']:.2f} | {cold['stored_bytes']} B, "
                      f"{cold['store']:.2f} | {warm[0]['reused']} | {med['lookup']:.2f} | {med['restore']:.2f} | "
                      f"{med['prefill']:.2f} ({warm[0]['prefill_tokens']} tokens) | {total:.2f} | "
                      f"{cold['prefill'] / total:.2f} | yes |")
    finally:
        shutil.rmtree(d)
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build", "release"))
    ap.add_argument("--min-time", type=float, default=0.3)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated (default: %(default)s)")
    a = ap.parse_args()
    proc, redis = start_redis()
    if redis is None:
        print("redis-server not found: the Redis columns are left out (scripts/install_deps.sh installs it)")
    try:
        if not a.skip_bench:
            bench_table(a.build, redis, a.min_time, a.repetitions, a.schemes.split(","))
        if not a.skip_generate:
            generate_table(a.build, redis, a.repetitions, a.schemes.split(","))
    finally:
        if proc:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
