"""kvq serve's batching beside llama.cpp's multi-sequence decode, on the same GGUF, prompts and greedy runs.

  PYTHONPATH=build/release/python /usr/bin/python3 scripts/llama_cpp_batch.py [--model stories-hd64 | FILE.gguf]
      [--kv fp16,q8_0,q4_0] [--presets kvq-4.5,kvq-2.5] [--concurrency 1,4,16] [--prompt-tokens 128]
      [--max-tokens 64] [--threads 1] [--reps 2]

For each KV type and concurrency C: C prompts (consecutive stretches of the dev text, as token ids), each
run greedily for --max-tokens tokens, all at once.
- llama.cpp: node-llama-cpp 3.21.1's CPU build (tests/llama_cpp_batch.mjs): one context with C sequences,
  node-llama-cpp's batching puts every sequence's tokens of a step in one llama_decode. KV types F16,
  Q8_0, Q4_0 (the quantized ones with flash attention, as llama.cpp requires, and its default Hadamard
  rotation of K/V). No HTTP: the engine alone.
- kvq: `kvq serve --kv KV --max-seqs C --prompt-cache off --threads T` and C clients on loopback, each one
  streaming-free request of the same ids (HTTP and JSON included in its time).
Both clocks run from the first prompt sent to the last token out (prefill included). Output tokens/s is
the tokens generated (each side stops at C x --max-tokens or at its end of text) over that time; runs
alternate between the engines, --reps times, and the median is printed. "same text" counts the
sequences whose greedy text from kvq is where llama.cpp's starts (its ids read back by kvq's
/detokenize; kvq stops at the end of text, llama.cpp's generator runs on), in the first repetition.

Prints a markdown table (docs/serve.md quotes it) and optionally writes the figures as JSON."""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gguf_write as gw  # noqa: E402
from serve_client import Server  # noqa: E402

LLAMA_KV = {"fp16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0"}


def kvq_run(s, prompts, n):
    """(seconds, tokens, texts) of the prompts sent at once to a running server."""
    out = [None] * len(prompts)

    def one(i):
        out[i] = s.post({"prompt": prompts[i], "max_tokens": n, "temperature": 0})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.time() - t0
    for st, b in out:
        if st != 200:
            sys.exit(f"llama_cpp_batch: kvq serve answered {st}: {b}")
    return secs, sum(b["usage"]["completion_tokens"] for _, b in out), [b["choices"][0]["text"] for _, b in out]


def llama_run(node_script, gguf, prompts, n, kv, threads, workdir):
    p = workdir / "prompts.json"
    p.write_text(json.dumps(prompts))
    r = subprocess.run(["node", str(node_script), str(gguf), str(p), str(n), kv, str(threads)], capture_output=True,
                       text=True, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"llama_cpp_batch: llama.cpp ({kv}) exited {r.returncode}:\n{r.stderr[-2000:]}")
    j = json.loads(r.stdout.strip().splitlines()[-1])
    return j["seconds"], j["tokens"], j["outputs"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default=os.environ.get("KVQ_SHARED", str(ROOT.parent / "shared")))
    ap.add_argument("--kvq", default=str(ROOT / "build" / "release" / "kvq"))
    ap.add_argument("--oracles", default=os.environ.get("KVQ_ORACLES", str(ROOT / "build" / "oracles")))
    ap.add_argument("--model", default="stories-hd64", help="stories260K, stories-hd64 or a GGUF file")
    ap.add_argument("--kv", default="fp16,q8_0,q4_0")
    ap.add_argument("--presets", default="kvq-4.5,kvq-2.5", help="kvq-only rows ('' for none)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    import kvq
    oracle = Path(a.oracles)
    if not (oracle / "node_modules" / "node-llama-cpp").exists() or shutil.which("node") is None:
        sys.exit(f"llama_cpp_batch: node-llama-cpp is not in {oracle} (KVQ_WITH_ORACLES=1 scripts/install_deps.sh)")
    node_script = oracle / "llama_cpp_batch.mjs"
    shutil.copy(ROOT / "tests" / "llama_cpp_batch.mjs", node_script)
    shared = Path(a.shared)
    d = Path(tempfile.mkdtemp(prefix="kvq-llama-batch-"))
    try:
        if a.model in ("stories260K", "stories-hd64"):
            mdir = shared / "models" / a.model
            gguf = d / f"{a.model}.gguf"
            gw.convert_llama2c(str(mdir / f"{a.model}.bin"), str(mdir / "tok512.bin"), str(gguf))
        else:
            gguf = Path(a.model)
        m = kvq.Model(str(gguf))
        cs = [int(c) for c in a.concurrency.split(",")]
        P = a.prompt_tokens
        try:
            text = (shared / "data" / "tinystories-valid-dev.txt").read_text(encoding="utf-8")
            ids = m.tokenize(text[:400000], bos=False)
            bos = m.tokenize("", bos=True)
            prompts_all = [bos + [int(t) for t in ids[i * P:(i + 1) * P - len(bos)]] for i in range(max(cs))]
            has_text = True
        except Exception:  # a GGUF without a tokenizer kvq reads: seeded random ids, no text to compare
            rng = np.random.default_rng(0)
            prompts_all = [[int(t) for t in rng.integers(3, m.config["vocab_size"], size=P)] for _ in range(max(cs))]
            has_text = False
        rows = []
        schemes = [k for k in a.kv.split(",") if k] + [k for k in a.presets.split(",") if k]
        for kv in schemes:
            srv_args = ["--model", gguf, "--kv", kv, "--max-seqs", str(max(cs)), "--prompt-cache", "off",
                        "--threads", str(a.threads), "--calib-batched"]
            with Server(a.kvq, srv_args) as s:
                s.post({"prompt": prompts_all[0][:16], "max_tokens": 4})  # warm
                for c in cs:
                    prompts = prompts_all[:c]
                    kt, lt, same = [], [], None
                    for _ in range(a.reps):
                        secs, toks, texts = kvq_run(s, prompts, a.max_tokens)
                        kt.append((toks / secs, secs, toks))
                        if kv in LLAMA_KV:
                            secs, toks, outs = llama_run(node_script, gguf, prompts, a.max_tokens, LLAMA_KV[kv],
                                                         a.threads, d)
                            lt.append((toks / secs, secs, toks))
                            if same is None and has_text:
                                same = 0
                                for o, t in zip(outs, texts):
                                    st, _, body = s.request("POST", "/detokenize", {"tokens": o})
                                    lt_text = json.loads(body)["content"]
                                    # /detokenize reads the first id after BOS (no leading space); kvq stops
                                    # at its end of text where llama.cpp's generator runs on.
                                    a_, b_ = t.lstrip(" "), lt_text.lstrip(" ")
                                    same += int(b_.startswith(a_) and (len(a_) > 0 or len(o) == 0))
                    row = dict(kv=kv, c=c, kvq_tps=statistics.median(x[0] for x in kt),
                               kvq_tokens=kt[0][2])
                    if lt:
                        row.update(llama_tps=statistics.median(x[0] for x in lt), llama_tokens=lt[0][2],
                                   same="n/a" if same is None else f"{same}/{c}")
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
        print(f"\n{a.model}: {P}-token prompts, {a.max_tokens} tokens each, greedy, {a.threads} thread(s), "
              f"median of {a.reps}\n")
        print("| KV | C | kvq tok/s | llama.cpp tok/s | kvq / llama.cpp | same text |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in rows:
            if "llama_tps" in r:
                print(f"| {r['kv']} | {r['c']} | {r['kvq_tps']:.1f} | {r['llama_tps']:.1f} | "
                      f"{r['kvq_tps'] / r['llama_tps']:.2f} | {r['same']} |")
            else:
                print(f"| {r['kv']} | {r['c']} | {r['kvq_tps']:.1f} | | | |")
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
