#!/usr/bin/env python3
"""kvq's KV caches beside llama.cpp's on stories260K or stories-hd64, under llama-perplexity's protocol
(the whole dev text tokenized with BOS first, chunks of --ctx, the second half of each chunk scored).

  PYTHONPATH=build/release/python /usr/bin/python3 scripts/llama_cpp_table.py [--model stories-hd64]
      [--ctx 256] [--chunks N] [--kv LIST] [--json out.json]

- stories-hd64 (heads of 64): both engines run the same GGUF, unpadded; llama.cpp's 32-value blocks
  and its Hadamard rotation apply as on a real model. Both engines' KL divergence against their own
  fp32 over the scored positions is printed too (llama.cpp's from its whole distributions).

- kvq: `kvq eval --protocol llama-perplexity` on stories260K as GGUF (head size 8) with fp32, fp16,
  q8_0, q4_0 and the kvq presets (calibrated as kvq eval calibrates: sequences the model generates).
- llama.cpp: node-llama-cpp 3.21.1's CPU build (tests/llama_cpp_ppl.mjs, the same ids and chunks) with
  its KV types F32, F16, Q8_0, Q5_0, Q4_0, IQ4_NL, each with its Hadamard rotation of K/V on and off.
  llama.cpp's quantized caches need head_dim a multiple of 32, so it runs the same model with every
  head zero-padded to 64 channels (scripts/gguf_write.py llama2c --pad-head 64: RoPE pairs moved to the
  padded head's pairs of equal frequency, Q scaled by sqrt(64 / 8)); llama.cpp rotates by default at
  head_dim 64, LLAMA_ATTN_ROT_DISABLE=1 turns it off. Its F32 row shows the padded model is the same
  model.
  Bits per element for llama.cpp's types are the types' own (on a real model's heads, unpadded); on
  this padded model it stores 8x the elements.

Prints a markdown table (docs/eval.md and README quote it) and optionally writes the figures as JSON."""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gguf_write as gw  # noqa: E402

LLAMA_TYPES = [("F32", 32.0), ("F16", 16.0), ("Q8_0", 8.5), ("Q5_0", 5.5), ("Q4_0", 4.5), ("IQ4_NL", 4.5)]
KVQ = "fp32,fp16,q8_0,q4_0,kvq-6.5,kvq-4.5,kvq-3.5,kvq-2.5"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default=os.environ.get("KVQ_SHARED", str(ROOT.parent / "shared")))
    ap.add_argument("--kvq", default=str(ROOT / "build" / "release" / "kvq"))
    ap.add_argument("--oracles", default=os.environ.get("KVQ_ORACLES", str(ROOT / "build" / "oracles")))
    ap.add_argument("--model", default="stories260K", choices=["stories260K", "stories-hd64"])
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=0, help="at most N chunks (0: the whole text)")
    ap.add_argument("--json")
    ap.add_argument("--kv", default=KVQ, help=f"kvq's schemes, fp32 first (default {KVQ}; t0+<scheme> names too)")
    a = ap.parse_args()
    import kvq
    shared = Path(a.shared)
    mdir = shared / "models" / a.model
    model, tok = mdir / f"{a.model}.bin", mdir / "tok512.bin"
    head = 8 if a.model == "stories260K" else 64
    pad = 64 if head < 32 else None  # llama.cpp's quantized caches need head_dim a multiple of 32
    text = (shared / "data" / "tinystories-valid-dev.txt").read_text(encoding="utf-8")
    d = Path(tempfile.mkdtemp(prefix="kvq-llama-table-"))
    try:
        g8, g64 = d / "s8.gguf", d / "s64.gguf"
        gw.convert_llama2c(str(model), str(tok), str(g8))
        if pad:
            gw.convert_llama2c(str(model), str(tok), str(g64), pad_head=pad)
        else:
            g64 = g8
        ids = kvq.Model(str(g8)).tokenize(text, bos=True)
        chunks = len(ids) // a.ctx
        if a.chunks:
            chunks = min(chunks, a.chunks)
        ids = ids[:chunks * a.ctx]
        np.save(d / "ids.npy", np.asarray(ids, dtype=np.uint32))
        r = subprocess.run([a.kvq, "eval", "--model", str(g8), "--tokens", str(d / "ids.npy"), "--kv", a.kv, "--ctx",
                            str(a.ctx), "--protocol", "llama-perplexity", "--forward", "exact", "--json",
                            str(d / "kvq.json")], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"llama_cpp_table: kvq eval failed:\n{r.stderr[-2000:]}")
        kj = json.loads((d / "kvq.json").read_text())
        rows = [dict(engine="kvq", kv=x["label"], scheme=x["scheme"], head=head, rotation="",
                     bits=x["bits_per_element"], ppl=x["ppl"], kld=x["kld_mean"]) for x in kj["results"]]
        vocab = kj["model_config"]["vocab_size"]
        oracle = Path(a.oracles)
        if not (oracle / "node_modules" / "node-llama-cpp").exists() or shutil.which("node") is None:
            sys.exit(f"llama_cpp_table: node-llama-cpp is not in {oracle} (KVQ_WITH_ORACLES=1 scripts/install_deps.sh)")
        shutil.copy(ROOT / "tests" / "llama_cpp_ppl.mjs", oracle / "llama_cpp_ppl.mjs")
        (d / "ids.json").write_text(json.dumps([int(x) for x in ids]))
        for ty, bits in LLAMA_TYPES:
            for rot in ((True, False) if ty not in ("F32", "F16") else (False,)):
                env = dict(os.environ)
                if not rot:
                    env["LLAMA_ATTN_ROT_DISABLE"] = "1"
                probs = d / f"{ty}-{int(rot)}.f32"
                r = subprocess.run(["node", str(oracle / "llama_cpp_ppl.mjs"), str(g64),
                                    str(d / "ids.json"), str(a.ctx), str(chunks), ty, str(probs), str(vocab)],
                                   capture_output=True, text=True, env=env, timeout=3600)
                if r.returncode != 0:
                    sys.exit(f"llama_cpp_table: llama.cpp {ty} (rotation {rot}) exited {r.returncode}:\n"
                             f"{r.stderr[-2000:]}")
                out = json.loads(r.stdout.strip().splitlines()[-1])
                p = np.fromfile(probs, dtype=np.float32).reshape(-1, vocab).astype(np.float64)
                if ty == "F32":
                    ref = p
                kld = float(np.mean(np.sum(np.where(ref > 0, ref * (np.log(np.maximum(ref, 1e-300)) -
                                                                    np.log(np.maximum(p, 1e-300))), 0.0), axis=1)))
                rows.append(dict(engine="llama.cpp", kv=ty.lower(), scheme=ty.lower(), head=pad or head,
                                 rotation="" if ty in ("F32", "F16") else ("on" if rot else "off"), bits=bits,
                                 ppl=out["ppl"], kld=kld))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    base = {(x["engine"], x["head"]): x["ppl"] for x in rows if x["kv"] in ("fp32", "f32")}
    print(f"{a.model}, dev text, {chunks} chunks of {a.ctx} (llama-perplexity's protocol), "
          f"{chunks * (a.ctx - 1 - a.ctx // 2)} scored tokens")
    print("| engine | head size | KV | Hadamard rotation | bits / element | PPL | ΔPPL vs its fp32 | KLD vs its fp32 |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    for x in rows:
        b = base[(x["engine"], x["head"])]
        x["delta_pct"] = 100.0 * (x["ppl"] / b - 1)
        kv = x["kv"] if x["kv"] == x["scheme"] else f"{x['kv']} (`{x['scheme']}`)"
        print(f"| {x['engine']} | {x['head']} | {kv} | {x['rotation']} | {x['bits']:.3f} | {x['ppl']:.4f} | "
              f"{x['delta_pct']:+.3f}% | {x['kld']:.2e} |")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(model=a.model, ctx=a.ctx, chunks=chunks, rows=rows), indent=1))


if __name__ == "__main__":
    main()
