"""kvq eval --protocol llama-perplexity against llama.cpp itself (node-llama-cpp 3.21.1's CPU build,
installed from npm into build/oracles by scripts/install_deps.sh with KVQ_WITH_ORACLES=1; never a
dependency of the library): the same GGUF, the same token ids, the same chunks (BOS first, the
second half scored), llama.cpp's own KV cache types.

Tolerances (relative PPL), from what differs between the two: llama.cpp's CPU dot products round
the query to the cache's type (f16 for an F16 cache, 8-bit blocks for Q8_0 and Q4_0, with flash
attention), while kvq keeps the query in float32; the rest is the order of float32 sums. Measured:
fp16 2.0e-4 on stories260K (8 chunks of 64) and 5e-6 on the random-weight model, q8_0 4e-5 and
q4_0 3e-4 on the random-weight model; tolerances fp16 1e-3, q8_0 5e-4, q4_0 2e-3. llama.cpp's
Hadamard rotation of quantized K/V (head_dim a multiple of 64) is off (LLAMA_ATTN_ROT_DISABLE=1;
head_dim 32 here anyway): kvq's q8_0 and q4_0 are the unrotated formats.
"""
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import kvq
from llama_cpp_lib import oracle_dir
from test_gguf import MODEL, SHARED, TOKENIZER, _eval, _need_data, gw

ROOT = Path(__file__).resolve().parents[2]


def _oracle():
    """The directory holding node_modules/node-llama-cpp, with our script copied beside it."""
    oracles = oracle_dir()
    shutil.copy(ROOT / "tests" / "llama_cpp_ppl.mjs", oracles / "llama_cpp_ppl.mjs")
    return oracles


def _llama_cpp_ppl(model, ids, ctx, chunks, kv_type):
    oracle = _oracle()
    ids_json = oracle / f"ids_{os.getpid()}.json"
    ids_json.write_text(json.dumps([int(x) for x in ids]))
    try:
        r = subprocess.run(["node", str(oracle / "llama_cpp_ppl.mjs"), str(model), str(ids_json), str(ctx),
                            str(chunks), kv_type], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, LLAMA_ATTN_ROT_DISABLE="1"))
    finally:
        ids_json.unlink()
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["n"] == chunks * (ctx - 1 - ctx // 2)
    return out["ppl"]


def _kvq_ppl(tmp_path, model, ids, ctx, chunks, kv, weight_dot="exact"):
    np.save(tmp_path / "ids.npy", np.asarray(ids, dtype=np.uint32))
    _, j = _eval(["--model", str(model), "--tokens", str(tmp_path / "ids.npy"), "--kv", kv, "--ctx", str(ctx),
                  "--max-windows", str(chunks), "--protocol", "llama-perplexity", "--forward", "exact",
                  "--weight-dot", weight_dot], tmp_path, "kvq")
    assert j["weight_dot"] == weight_dot
    return {r["label"]: r["ppl"] for r in j["results"]}


def test_fp16_on_stories260k_matches_llama_cpp(tmp_path):
    _need_data()
    _oracle()
    gguf = tmp_path / "stories260K.gguf"
    gw.convert_llama2c(str(MODEL), str(TOKENIZER), str(gguf))
    ctx, chunks = 64, 8
    ids = kvq.Model(str(gguf)).tokenize((SHARED / "data" / "tinystories-valid-dev.txt").read_text(), bos=True)
    ids = ids[:ctx * chunks]
    ours = _kvq_ppl(tmp_path, gguf, ids, ctx, chunks, "fp16")
    theirs = _llama_cpp_ppl(gguf, ids, ctx, chunks, "F16")
    assert abs(ours["fp16"] / theirs - 1) < 1e-3, (ours, theirs)


def test_q8_0_and_q4_0_caches_match_llama_cpps(tmp_path):
    """head_dim 32 (llama.cpp's quantized caches need a multiple of 32), random weights and ids."""
    _oracle()
    gguf = tmp_path / "syn.gguf"
    g, _ = gw.synthetic(dict(arch="llama", dim=128, hidden=256, layers=2, heads=4, kv_heads=2, vocab=300, ctx=256,
                             rope_base=10000.0, rope_scaling="none", rope_factor=1.0, eps=1e-5, tied=False,
                             type="F32", tokenizer="llama"), 0, keep_reference=False)
    g.write(str(gguf))
    ctx, chunks = 64, 8
    rng = np.random.default_rng(5)
    ids = rng.integers(3, 300, size=ctx * chunks)
    ids[0] = 1  # BOS
    ours = _kvq_ppl(tmp_path, gguf, ids, ctx, chunks, "fp16,q8_0,q4_0")
    for kv, llama_type, tol in (("fp16", "F16", 1e-3), ("q8_0", "Q8_0", 5e-4), ("q4_0", "Q4_0", 2e-3)):
        theirs = _llama_cpp_ppl(gguf, ids, ctx, chunks, llama_type)
        assert abs(ours[kv] / theirs - 1) < tol, (kv, ours[kv], theirs)
