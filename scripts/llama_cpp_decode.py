"""kvq's prefill and decode beside llama.cpp's on the same quantized GGUF, one sequence, greedy.

  PYTHONPATH=build/release/python /usr/bin/python3 scripts/llama_cpp_decode.py --model A.gguf[,B.gguf]
      [--prompt-tokens 512] [--max-tokens 64] [--threads 1,2] [--reps 3] [--weight-dot int8,exact]

- llama.cpp: node-llama-cpp 3.21.1's CPU build (tests/llama_cpp_decode.mjs): one context, one sequence,
  F16 KV, `threads` threads; prefill = time to the first generated token, decode = the rest.
- kvq: `kvq generate --tokens IDS --steps P+N --kv fp16 --threads T --weight-dot D`; its own report's
  prefill (P - 1 tokens through the batched pass) and decode (the rest, one token a pass) rates.
The prompt is the dev text tokenized by the model's tokenizer (seeded random ids when kvq cannot read
it). Runs alternate between the engines, --reps times; medians are printed.

R = the weight bytes one token's pass reads x decode tok/s / the read rate BM_weight_read measures with
the same threads (bench/weights_bench.cc: memchr over a Q4_K matrix set in DRAM), in the same run: the
fraction of the memory's read rate the decode reaches.

--avx2 holds both engines to AVX2 on an AVX-512 machine: kvq through KVQ_TARGETS=AVX2, llama.cpp through a
copy of node-llama-cpp's x64 binaries without its AVX-512 CPU variants (ggml then loads its haswell one).

Prints a markdown table (docs/performance.md quotes it) and optionally writes the figures as JSON."""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def read_rate(bench, threads):
    """BM_weight_read's bytes/s (median of 3) with `threads` threads."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        r = subprocess.run([str(bench), f"--benchmark_filter=BM_weight_read/Q4_K/threads:{threads}/",
                            "--benchmark_repetitions=3", f"--benchmark_out={f.name}", "--benchmark_out_format=json"],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            sys.exit(f"llama_cpp_decode: {bench} exited {r.returncode}: {r.stderr[-500:]}")
        runs = [b for b in json.load(open(f.name))["benchmarks"] if b.get("run_type") == "iteration"]
    return statistics.median(b["bytes_per_second"] for b in runs)


def llama_run(node_script, gguf, prompt_json, n, threads, avx2):
    r = subprocess.run(["node", str(node_script), str(gguf), str(prompt_json), str(n), "F16", str(threads)],
                       capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"llama_cpp_decode: llama.cpp exited {r.returncode}:\n{r.stderr[-2000:]}")
    j = json.loads(r.stdout.strip().splitlines()[-1])
    if avx2 and j.get("cpu_variant") != "haswell":
        sys.exit(f"llama_cpp_decode: --avx2, but llama.cpp loaded ggml's CPU variant {j.get('cpu_variant')!r}")
    return j["prompt"] / j["prefill_seconds"], (j["generated"] - 1) / j["decode_seconds"]


GEN_LINE = re.compile(r"prefilled in ([0-9.]+) s: ([0-9.]+) tok/s\).*weights (\w+), ([0-9.]+) tok/s")


# ggml's x86 CPU variants that need more than AVX2 (AVX-512, or AVX-VNNI for alderlake).
BEYOND_AVX2 = ("alderlake", "cannonlake", "cascadelake", "cooperlake", "icelake", "sapphirerapids", "skylakex", "zen4")


def avx2_oracle(oracle, td):
    """A node_modules under td whose node-llama-cpp finds only ggml's CPU variants up to AVX2 (haswell).
    node-llama-cpp and its prebuilt x64 package are copied (node resolves a symlinked module to its real
    place, and the binaries beside it); the other packages are linked."""
    dst = Path(td) / "oracles-avx2"
    nm, src = dst / "node_modules", oracle / "node_modules"
    (nm / "@node-llama-cpp").mkdir(parents=True)
    for d in src.iterdir():
        if d.name not in ("node-llama-cpp", "@node-llama-cpp"):
            (nm / d.name).symlink_to(d.resolve())
    shutil.copytree(src / "node-llama-cpp", nm / "node-llama-cpp", symlinks=True)
    for d in (src / "@node-llama-cpp").iterdir():
        if d.name == "linux-x64":
            shutil.copytree(d, nm / "@node-llama-cpp" / d.name, symlinks=True)
        else:
            (nm / "@node-llama-cpp" / d.name).symlink_to(d.resolve())
    libs = list((nm / "@node-llama-cpp" / "linux-x64").glob("bins/*/libggml-cpu-*.so"))
    if not any(p.name == "libggml-cpu-haswell.so" for p in libs):
        sys.exit("llama_cpp_decode: --avx2: no libggml-cpu-haswell.so in node-llama-cpp's x64 binaries")
    for p in libs:
        if p.name[len("libggml-cpu-"):-len(".so")] in BEYOND_AVX2:
            p.unlink()
    return dst


def kvq_run(kvq, gguf, ids_file, steps, threads, dot, env):
    r = subprocess.run([str(kvq), "generate", "--model", str(gguf), "--tokens", str(ids_file), "--steps", str(steps),
                        "--kv", "fp16", "--threads", str(threads), "--weight-dot", dot], capture_output=True,
                       text=True, errors="replace", timeout=3600, env={**os.environ, **env, "OMP_NUM_THREADS": str(threads)})
    if r.returncode != 0:
        sys.exit(f"llama_cpp_decode: kvq generate exited {r.returncode}:\n{r.stderr[-2000:]}")
    m = GEN_LINE.search(r.stderr.strip().splitlines()[-1])
    if not m or m.group(3) != dot:
        sys.exit(f"llama_cpp_decode: unexpected kvq generate report: {r.stderr[-500:]}")
    return float(m.group(2)), float(m.group(4))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="GGUF files, comma-separated")
    ap.add_argument("--shared", default=os.environ.get("KVQ_SHARED", str(ROOT.parent / "shared")))
    ap.add_argument("--kvq", default=str(ROOT / "build" / "release" / "kvq"))
    ap.add_argument("--bench", default=str(ROOT / "build" / "release" / "bench" / "kvq_bench"))
    ap.add_argument("--oracles", default=os.environ.get("KVQ_ORACLES", str(ROOT / "build" / "oracles")))
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", default="1")
    ap.add_argument("--weight-dot", default="int8,exact")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--avx2", action="store_true", help="both engines held to AVX2 (see above)")
    ap.add_argument("--json")
    a = ap.parse_args()
    import kvq  # noqa: PLC0415 (PYTHONPATH=build/release/python)

    oracle = Path(a.oracles)
    if shutil.which("node") is None or not (oracle / "node_modules" / "node-llama-cpp").exists():
        sys.exit("llama_cpp_decode: needs node and node-llama-cpp (KVQ_WITH_ORACLES=1 bash scripts/install_deps.sh)")
    keep = tempfile.TemporaryDirectory()
    kvq_env = {}
    if a.avx2:
        oracle, kvq_env = avx2_oracle(oracle, keep.name), {"KVQ_TARGETS": "AVX2"}
    node_script = oracle / "llama_cpp_decode.mjs"  # next to node_modules, where its import resolves
    shutil.copy(ROOT / "tests" / "llama_cpp_decode.mjs", node_script)
    threads = [int(t) for t in a.threads.split(",")]
    dots = a.weight_dot.split(",")
    rates = {t: read_rate(a.bench, t) for t in threads}
    dev = Path(a.shared) / "data" / "tinystories-valid-dev.txt"
    text = dev.read_text() if dev.exists() else ""
    rows, out = [], []
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        for gguf in a.model.split(","):
            m = kvq.Model(gguf)
            cfg = m.config
            try:
                ids = m.tokenize(text[:200000], True) if text else []
            except ValueError:
                ids = []
            if len(ids) < a.prompt_tokens:
                ids = np.random.default_rng(0).integers(0, cfg["vocab_size"], a.prompt_tokens).tolist()
            ids = ids[:a.prompt_tokens]
            prompt_json, ids_file = td / "prompt.json", td / "ids.bin"
            prompt_json.write_text(json.dumps(ids))
            np.asarray(ids, np.uint32).tofile(ids_file)
            steps = a.prompt_tokens + a.max_tokens
            for t in threads:
                got = {"llama.cpp": []}
                for d in dots:
                    got[d] = []
                for _ in range(a.reps):
                    got["llama.cpp"].append(llama_run(node_script, gguf, prompt_json, a.max_tokens, t, a.avx2))
                    for d in dots:
                        got[d].append(kvq_run(a.kvq, gguf, ids_file, steps, t, d, kvq_env))
                med = {k: (statistics.median(p for p, _ in v), statistics.median(d for _, d in v)) for k, v in got.items()}
                ref_p, ref_d = med["llama.cpp"]
                for k, (p, d) in med.items():
                    r = cfg["weight_bytes_per_token"] * d / rates[t]
                    row = {"model": Path(gguf).name, "weights": ", ".join(f"{n} x {c}" for n, c in cfg["weight_types"].items()),
                           "avx2_only": a.avx2, "threads": t, "engine": "llama.cpp" if k == "llama.cpp" else f"kvq {k}",
                           "prefill_tok_s": p, "decode_tok_s": d, "prefill_ratio": p / ref_p, "decode_ratio": d / ref_d,
                           "R": r, "read_rate_gb_s": rates[t] / 1e9, "bytes_per_token": cfg["weight_bytes_per_token"]}
                    out.append(row)
                    rows.append(f"| {row['model']} | {t} | {row['engine']} | {p:.1f} | {d:.2f} | {p / ref_p:.2f} | "
                                f"{d / ref_d:.2f} | {r:.2f} |")
    print(f"{a.prompt_tokens}-token prompt, {a.max_tokens} tokens, fp16 KV, median of {a.reps}"
          + (" (both engines held to AVX2)" if a.avx2 else "") + "; read rate "
          + ", ".join(f"{rates[t] / 1e9:.1f} GB/s at {t} thread(s)" for t in threads))
    print()
    print("| model | threads | engine | prefill tok/s | decode tok/s | prefill / llama.cpp | decode / llama.cpp | R |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
