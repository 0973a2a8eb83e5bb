#!/usr/bin/env python3
"""kvq on a Q4_K_M file of Llama-3-8B's geometry: memory and speed, checked.

  /usr/bin/python3 scripts/model_8b.py [--dir DIR] [--kvq build/release/kvq] [--bench build/release/bench/kvq_bench]

1. Writes a synthetic GGUF with Llama-3-8B's geometry (32 layers, dim 4096, 32 / 8 heads, FFN 14336,
   vocab 128256, RoPE base 500000; random weights, F16: 16 GB; scripts/gguf_write.py --stream) and
   quantizes it to Q4_K_M with llama.cpp's own llama_model_quantize (node-llama-cpp's libllama through
   ctypes: python/tests/llama_cpp_lib.py). Both are kept in DIR for later runs; the F16 file is deleted
   once the Q4_K_M one exists.
2. `kvq eval --tokens ids.npy --ctx 512 --max-windows 2 --kv fp16`: its peak RSS (the child's
   ru_maxrss, mapped weights included) must be at most the file's size + 2 GiB, and its printed
   GFLOP/s against the BLAS's sgemm peak (same run) is reported; the script fails below 70%.
3. `kvq generate --tokens prompt.npy --steps N --kv fp16`: decode tokens/s against what the weights'
   bytes allow at the DRAM read rate kvq_bench measures (BM_weight_read, 2 threads); fails below 0.6x.

Prints one JSON line with every figure (the issue's note and README quote it)."""
import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python" / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))


def peak_rss(cmd):
    """Runs cmd; returns (stdout, stderr, peak RSS bytes) from the child's rusage."""
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # pipes drained on threads; the child reaped with wait4 for its own rusage
    chunks = {"out": [], "err": []}

    def pump(stream, key):
        for b in iter(lambda: stream.read(65536), b""):
            chunks[key].append(b)
    ts = [threading.Thread(target=pump, args=(p.stdout, "out")), threading.Thread(target=pump, args=(p.stderr, "err"))]
    for t in ts:
        t.start()
    _, status, ru = os.wait4(p.pid, 0)
    for t in ts:
        t.join()
    out, err = b"".join(chunks["out"]).decode(), b"".join(chunks["err"]).decode()
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        sys.exit(f"model_8b: {' '.join(map(str, cmd))} exited {rc}:\n{err[-3000:]}")
    return out, err, ru.ru_maxrss * 1024, time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/kvq-8b")
    ap.add_argument("--kvq", default=str(ROOT / "build" / "release" / "kvq"))
    ap.add_argument("--bench", default=str(ROOT / "build" / "release" / "bench" / "kvq_bench"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24, help="generate: prompt (8 ids) + decoded tokens")
    ap.add_argument("--min-gemm", type=float, default=0.70)
    ap.add_argument("--min-decode", type=float, default=0.60)
    a = ap.parse_args()
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    f16, q = d / "l3-8b-f16.gguf", d / "l3-8b-q4_k_m.gguf"
    if not q.exists():
        if not f16.exists():
            subprocess.run([sys.executable, str(ROOT / "scripts" / "gguf_write.py"), "synthetic", str(f16), "--dim",
                            "4096", "--hidden", "14336", "--layers", "32", "--heads", "32", "--kv-heads", "8",
                            "--vocab", "128256", "--ctx", "8192", "--rope-base", "500000", "--rope-scaling", "none",
                            "--type", "F16", "--stream"], check=True)
        from llama_cpp_lib import FTYPE_Q4_K_M, Llama
        tmp = q.with_suffix(".tmp")
        Llama().quantize_model(f16, tmp, FTYPE_Q4_K_M, pure=False)
        tmp.rename(q)
        f16.unlink()
    size = q.stat().st_size
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 128000, size=2 * 513).astype(np.uint32)
    np.save(d / "ids.npy", ids)
    np.save(d / "prompt.npy", ids[:8])
    env_threads = ["--threads", str(a.threads)]

    out, err, rss, secs = peak_rss([a.kvq, "eval", "--model", str(q), "--tokens", str(d / "ids.npy"), "--ctx", "512",
                                    "--max-windows", "2", "--kv", "fp16", *env_threads, "--json", str(d / "eval.json")])
    j = json.loads((d / "eval.json").read_text())
    weights = re.search(r"weights ([^)]*)\)", out).group(1)
    r = dict(file_bytes=size, weights=weights, eval_peak_rss=rss, eval_rss_limit=size + (2 << 30), eval_seconds=secs,
             forward_gflops=j["forward_gflops"], gemm_peak_gflops=j["gemm_peak_gflops"],
             gemm_fraction=j["forward_gflops"] / j["gemm_peak_gflops"])

    out, err, grss, gsecs = peak_rss([a.kvq, "generate", "--model", str(q), "--tokens", str(d / "prompt.npy"),
                                      "--steps", str(a.steps), "--kv", "fp16", *env_threads])
    m = re.search(r"kvq generate: .*, ([0-9.]+) tok/s\s*$", err.strip().splitlines()[-1])
    decode = float(m.group(1))
    bench = subprocess.run([a.bench, "--benchmark_filter=BM_weight_read/Q4_K/threads:%d/" % a.threads,
                            "--benchmark_repetitions=3", "--benchmark_report_aggregates_only=true",
                            "--benchmark_format=json"], capture_output=True, text=True, check=True)
    rate = next(b["bytes_per_second"] for b in json.loads(bench.stdout)["benchmarks"] if b["aggregate_name"] == "median")
    matrix_bytes = float(re.search(r": ([0-9.]+) GiB", weights).group(1)) * (1 << 30)
    bound = rate / matrix_bytes
    r.update(generate_peak_rss=grss, decode_tok_s=decode, dram_read_bytes_s=rate, decode_bound_tok_s=bound,
             decode_fraction=decode / bound)
    print(json.dumps(r))
    fails = []
    if rss > size + (2 << 30):
        fails.append(f"eval peak RSS {rss / 2**30:.2f} GiB > file {size / 2**30:.2f} GiB + 2 GiB")
    if r["gemm_fraction"] < a.min_gemm:
        fails.append(f"batched pass at {r['gemm_fraction']:.0%} of sgemm peak (< {a.min_gemm:.0%})")
    if r["decode_fraction"] < a.min_decode:
        fails.append(f"decode {decode:.2f} tok/s = {r['decode_fraction']:.2f} of the DRAM bound {bound:.2f} "
                     f"(< {a.min_decode})")
    if fails:
        sys.exit("model_8b: " + "; ".join(fails))


if __name__ == "__main__":
    main()
