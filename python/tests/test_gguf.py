"""GGUF models: kvq's forward pass against an independent PyTorch reference
written from the published formulas (Hugging Face's Llama / Qwen2 modelling:
RMSNorm, half-split RoPE with Llama 3's frequency rule, GQA, SwiGLU), on
synthetic checkpoints written by scripts/gguf_write.py; stories260K as GGUF
against the llama2.c file; crafted files as clear errors; token-id files."""
import importlib.util
import math
import struct
from pathlib import Path

import numpy as np
import pytest

import kvq

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gguf_write", ROOT / "scripts" / "gguf_write.py")
gw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gw)

from kvq_test_helpers import MODEL, SHARED, TOKENIZER, kvq_cli as _kvq_cli, need_data as _need_data


# ---- the reference ----------------------------------------------------------------

def _rope_inv_freq(torch, hd, cfg):
    """HF's rope init: default, linear, or llama3 (_compute_llama3_parameters)."""
    inv = 1.0 / (cfg["rope_base"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if cfg.get("rope_scaling") == "linear":
        return inv / cfg["rope_factor"]
    if cfg.get("rope_scaling") == "llama3":
        factor, low, high, orig = cfg["rope_factor"], 1.0, 4.0, 8192
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = orig / low, orig / high
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(mid, smoothed, scaled)
    return inv


def reference_logits(torch, cfg, w, tokens, dtype):
    d, L, H, KV = cfg["dim"], cfg["layers"], cfg["heads"], cfg["kv_heads"]
    hd, eps = d // H, cfg["eps"]
    t = lambda a: torch.tensor(np.asarray(a), dtype=dtype)  # noqa: E731
    T = len(tokens)

    def rms(x, g):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * t(g)

    def rotate_half(x):
        return torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), dim=-1)

    inv = _rope_inv_freq(torch, hd, cfg).to(dtype)
    ang = torch.arange(T, dtype=dtype)[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    h = t(w["embed"])[torch.tensor(tokens)]
    mask = torch.full((T, T), float("-inf"), dtype=dtype).triu(1)
    for l in range(L):
        x = rms(h, w[f"{l}.attn_norm"])
        q, k, v = x @ t(w[f"{l}.wq"]).T, x @ t(w[f"{l}.wk"]).T, x @ t(w[f"{l}.wv"]).T
        if f"{l}.bq" in w:
            q, k, v = q + t(w[f"{l}.bq"]), k + t(w[f"{l}.bk"]), v + t(w[f"{l}.bv"])
        q, k, v = q.view(T, H, hd), k.view(T, KV, hd), v.view(T, KV, hd)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd) + mask
        a = torch.einsum("hts,shd->thd", torch.softmax(s, dim=-1), v).reshape(T, d)
        h = h + a @ t(w[f"{l}.wo"]).T
        x = rms(h, w[f"{l}.ffn_norm"])
        h = h + (torch.nn.functional.silu(x @ t(w[f"{l}.wg"]).T) * (x @ t(w[f"{l}.wu"]).T)) @ t(w[f"{l}.wd"]).T
    return (rms(h, w["out_norm"]) @ t(w["out"]).T).numpy()


CONFIGS = {
    # Llama 3 structure: GQA 4, head size 64, RoPE base 500000 with Llama 3 scaling (rope_freqs), F16.
    "llama3-hd64-f16": dict(arch="llama", dim=256, hidden=512, layers=3, heads=4, kv_heads=1, vocab=320, ctx=8192,
                            rope_base=500000.0, rope_scaling="llama3", rope_factor=32.0, eps=1e-5, type="F16"),
    # head size 128, GQA 4, Q8_0 weights, linear RoPE scaling, separate output.
    "llama-hd128-q8": dict(arch="llama", dim=512, hidden=768, layers=2, heads=4, kv_heads=1, vocab=300, ctx=4096,
                           rope_base=10000.0, rope_scaling="linear", rope_factor=4.0, eps=1e-6, type="Q8_0"),
    # Qwen2: Q/K/V biases, NEOX RoPE, base 1e6, tied output, BF16.
    "qwen2-hd64-bf16": dict(arch="qwen2", dim=256, hidden=640, layers=2, heads=8, kv_heads=2, vocab=300, ctx=32768,
                            rope_base=1000000.0, rope_scaling="none", rope_factor=1.0, eps=1e-6, type="BF16",
                            tied=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_synthetic_gguf_matches_pytorch_reference(tmp_path, name):
    torch = pytest.importorskip("torch")
    cfg = CONFIGS[name]
    g, w = gw.synthetic(cfg, seed=7)
    path = tmp_path / f"{name}.gguf"
    g.write(path)
    m = kvq.Model(str(path))
    assert m.config["arch"] == cfg["arch"]
    assert m.config["head_size"] == cfg["dim"] // cfg["heads"]
    assert m.config["qkv_bias"] == (cfg["arch"] == "qwen2")
    tokens = np.random.default_rng(1).integers(0, cfg["vocab"], 48).tolist()
    ref64 = reference_logits(torch, cfg, w, tokens, torch.float64)
    ref32 = reference_logits(torch, cfg, w, tokens, torch.float32)
    # The tolerance is derived, not tuned: fp32 arithmetic of the same formulas (PyTorch's own fp32 run)
    # is off the fp64 reference by e32; kvq's fp32 pass may be off by a few times that (another
    # summation order), never by a wrong formula (a RoPE, bias or scaling slip moves logits by O(1)).
    e32 = np.abs(ref32 - ref64).max()
    scale = np.abs(ref64).max()
    tol = 8 * e32 + 1e-6 * scale
    for forward in ("window", "batched"):
        got = m.logits(tokens, forward=forward)
        err = np.abs(got - ref64).max()
        assert err <= tol, f"{name} {forward}: max |kvq - reference| = {err:.3e} > {tol:.3e} (fp32 torch: {e32:.3e})"
    # A wrong RoPE would be caught: the reference without scaling differs by far more than tol.
    if cfg["rope_scaling"] != "none":
        plain = reference_logits(torch, dict(cfg, rope_scaling="none"), w, tokens, torch.float64)
        assert np.abs(plain - ref64).max() > 100 * tol


def test_token_window_and_batched_passes_agree(tmp_path):
    cfg = CONFIGS["qwen2-hd64-bf16"]
    g, _ = gw.synthetic(cfg, seed=3)
    g.write(tmp_path / "q.gguf")
    m = kvq.Model(str(tmp_path / "q.gguf"))
    tokens = list(range(5, 45))
    for kv in ("fp32", "q8_0", "k4v3g32o8r8"):
        tok = m.logits(tokens, kv=kv, forward="token")
        win = m.logits(tokens, kv=kv, forward="window")
        bat = m.logits(tokens, kv=kv, forward="batched")
        np.testing.assert_array_equal(tok, win)  # the exact path is bitwise token by token
        assert np.abs(bat - win).max() <= 1e-3 * max(1.0, np.abs(win).max()), kv


def test_stories260k_gguf_gives_the_llama2c_logits(tmp_path):
    _need_data()
    out = tmp_path / "s.gguf"
    gw.convert_llama2c(str(MODEL), str(TOKENIZER), str(out))
    a, b = kvq.Model(str(MODEL)), kvq.Model(str(out))
    assert b.config["tokenizer"] == "sentencepiece" and b.config["format"] == "gguf"
    text = "Once upon a time, there was a little girl named Lily. She loved to play outside."
    toks = b.tokenize(text)
    assert toks[0] == 1 and len(toks) > 10
    for kv in ("fp32", "q4_0", "k2v2g32o4w4r4"):
        np.testing.assert_array_equal(a.logits(toks, kv=kv), b.logits(toks, kv=kv))
    # Weights stored as Q8_0 / F16 run too (dequantised at load).
    for ty in ("F16", "BF16", "Q8_0"):
        p = tmp_path / f"s-{ty}.gguf"
        gw.convert_llama2c(str(MODEL), str(TOKENIZER), str(p), ty)
        d = np.abs(kvq.Model(str(p)).logits(toks) - a.logits(toks)).max()
        assert 0 < d < 0.5, (ty, d)


# ---- crafted files ----------------------------------------------------------------

def _small(**over):
    cfg = dict(CONFIGS["llama3-hd64-f16"], layers=1, **over)
    g, _ = gw.synthetic(cfg, seed=1)
    return g


def _error(path):
    with pytest.raises(ValueError) as e:
        kvq.Model(str(path))
    return str(e.value)


def test_crafted_gguf_files_are_clear_errors(tmp_path):
    good = _small().tobytes()
    p = tmp_path / "x.gguf"
    cases = {
        "truncated header": (good[:10], "truncated"),
        "truncated data": (good[:-100], "runs past the end"),
        "version 1": (good[:4] + struct.pack("<I", 1) + good[8:], "version 1"),
        "version 9": (good[:4] + struct.pack("<I", 9) + good[8:], "version 9"),
        "tensor count past the end": (good[:8] + struct.pack("<Q", 1 << 60) + good[16:], "tensor count"),
        "metadata count past the end": (good[:16] + struct.pack("<Q", 1 << 60) + good[24:], "metadata count"),
    }
    for name, (data, want) in cases.items():
        p.write_bytes(data)
        msg = _error(p)
        assert want in msg, (name, msg)
    # A huge string length in the first key.
    p.write_bytes(good[:24] + struct.pack("<Q", 1 << 62) + good[32:])
    assert "truncated" in _error(p)
    # Aliased tensors (every one at offset 0): a small file cannot declare
    # more weights than its bytes hold.
    g = _small()
    g.offset_of = {t[0]: 0 for t in g.tensors}
    g.write(p)
    assert "overlap" in _error(p)


def test_non_finite_weights_name_their_tensor(tmp_path):
    nan = {0: struct.pack("<f", math.nan), 1: b"\x00\x7e", 30: b"\xc0\x7f"}  # F32, F16, BF16
    for target in ("blk.0.attn_k.weight", "output_norm.weight"):
        g = _small()
        ty = next(t[2] for t in g.tensors if t[0] == target)
        g.tensors = [(n, ne, t, nan[t] + d[len(nan[t]):] if n == target else d) for n, ne, t, d in g.tensors]
        p = tmp_path / "nan.gguf"
        g.write(p)
        msg = _error(p)
        assert f"tensor '{target}' holds a non-finite value" in msg, (ty, msg)


def test_models_kvq_cannot_run_are_named(tmp_path):
    p = tmp_path / "x.gguf"
    g = _small()
    g.kv = [(k, t, v) if k != "general.architecture" else (k, t, gw.Writer._str("gemma2")) for k, t, v in g.kv]
    g.write(p)
    assert "architecture 'gemma2' is not supported" in _error(p)
    g = _small()
    g.add("llama.expert_count", gw.U32, 8)
    g.write(p)
    assert "mixture of experts" in _error(p)
    g = _small()
    g.tensors = [(n, ne, 16 if n == "blk.0.attn_q.weight" else ty, d) for n, ne, ty, d in g.tensors]
    g.write(p)  # IQ2_XXS: a grid type kvq does not read
    msg = _error(p)
    assert "'blk.0.attn_q.weight' is IQ2_XXS; kvq reads F32, F16, BF16, Q4_0" in msg, msg
    g = _small()
    g.tensors = [t for t in g.tensors if t[0] != "blk.0.ffn_up.weight"]
    g.write(p)
    assert "'blk.0.ffn_up.weight' is missing" in _error(p)
    g = _small()
    g.kv = [(k, t, v) if k != "llama.rope.freq_base" else (k, gw.STRING, gw.Writer._str("x")) for k, t, v in g.kv]
    g.write(p)
    assert "rope.freq_base' is string, expected a number" in _error(p)


def test_gpt2_tokenizer_kvq_cannot_read_points_to_tokens(tmp_path):
    """No tokenizer.ggml.pre (llama.cpp's "default"): refused by name (byte-level BPE: test_bpe.py)."""
    g, _ = gw.synthetic(dict(CONFIGS["qwen2-hd64-bf16"], layers=1, tokenizer="gpt2"), seed=1)
    g.write(tmp_path / "q.gguf")
    m = kvq.Model(str(tmp_path / "q.gguf"))
    assert "pre-tokenizer 'default'" in m.config["tokenizer"] and "--tokens" in m.config["tokenizer"]
    with pytest.raises(ValueError, match="byte-level BPE.*--tokens"):
        m.tokenize("hello")


def test_token_files(tmp_path):
    ids = np.array([1, 5, 7, 299], dtype=np.uint32)
    ids.tofile(tmp_path / "t.bin")
    assert kvq.read_token_file(str(tmp_path / "t.bin"), 300) == ids.tolist()
    for dt in ("<i8", "<u4", "<i4", "<u2"):
        np.save(tmp_path / "t.npy", ids.astype(dt))
        assert kvq.read_token_file(str(tmp_path / "t.npy"), 300) == ids.tolist()
    np.save(tmp_path / "r.npy", ids.astype(np.int64)[None, :])  # (1, N), as return_tensors="np" gives
    assert kvq.read_token_file(str(tmp_path / "r.npy"), 300) == ids.tolist()
    bad = {
        "big.bin": (ids.tobytes(), 299, "outside the model's vocabulary"),
        "odd.bin": (ids.tobytes()[:-1], 300, "whole number of little-endian uint32"),
        "empty.bin": (b"", 300, "no token ids"),
    }
    for name, (data, vocab, want) in bad.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=want):
            kvq.read_token_file(str(tmp_path / name), vocab)
    np.save(tmp_path / "f.npy", ids.astype(np.float32))
    with pytest.raises(ValueError, match="not a little-endian integer"):
        kvq.read_token_file(str(tmp_path / "f.npy"), 300)
    np.save(tmp_path / "m.npy", np.zeros((2, 3), dtype=np.int32))
    with pytest.raises(ValueError, match="not one row"):
        kvq.read_token_file(str(tmp_path / "m.npy"), 300)
    raw = (tmp_path / "t.npy").read_bytes()
    (tmp_path / "c.npy").write_bytes(raw[:-2])
    with pytest.raises(ValueError, match="needs .* bytes of data"):
        kvq.read_token_file(str(tmp_path / "c.npy"), 300)
    np.save(tmp_path / "neg.npy", np.array([3, -1], dtype=np.int32))
    with pytest.raises(ValueError, match="id -1 at position 1"):
        kvq.read_token_file(str(tmp_path / "neg.npy"), 300)


# ---- kvq eval on a GGUF: the legacy table digit for digit, batched within 1e-4 -------------

def _eval(args, tmp_path, name):
    import json
    import subprocess
    out = tmp_path / f"{name}.json"
    r = subprocess.run([str(_kvq_cli()), "eval", *args, "--json", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    return [l for l in r.stdout.splitlines() if l.startswith("| ")], json.loads(out.read_text())


def test_kvq_eval_on_the_converted_gguf_reproduces_the_table(tmp_path):
    _need_data()
    gguf = tmp_path / "stories260K.gguf"
    gw.convert_llama2c(str(MODEL), str(TOKENIZER), str(gguf))
    common = ["--kv", "fp16,q8_0,q4_0,kvq-4.5,kvq-2.5", "--max-windows", "6", "--ctx", "256"]
    text = str(SHARED / "data" / "tinystories-valid-dev.txt")
    legacy, jl = _eval(["--model", str(MODEL), "--tokenizer", str(TOKENIZER), "--text", text, *common], tmp_path, "a")
    exact, je = _eval(["--model", str(gguf), "--text", text, "--forward", "exact", *common], tmp_path, "b")
    # Both tables but their last column (tok/s is a measurement; same top % repeats top-1): digit for digit.
    strip = lambda t: [l.rsplit("|", 2)[0] for l in t]  # noqa: E731
    assert strip(legacy) == strip(exact)
    assert je["forward"] == "exact" and je["model_config"]["arch"] == "llama"
    batched, jb = _eval(["--model", str(gguf), "--text", text, *common], tmp_path, "c")  # auto: batched for GGUF
    assert jb["forward"] == "batched" and jb["gemm_peak_gflops"] > 0 and jb["forward_gflops"] > 0
    # The batched pass sums in OpenBLAS's order, which its CPU kernel decides: at 2 bits a last-bit change is a
    # code flip where a value sits on a boundary (OpenBLAS's AVX-512 kernels: kvq-2.5 1.1e-4 apart, AVX2's less).
    for a, b in zip(jl["results"], jb["results"]):
        assert a["label"] == b["label"]
        tol = 3e-4 if a["label"] == "kvq-2.5" else 1e-4
        assert abs(b["ppl"] / a["ppl"] - 1) < tol, (a["label"], a["ppl"], b["ppl"])
    # The same stream as token ids (--tokens): [BOS] + tokens per stripped story, as kvq eval builds it.
    m = kvq.Model(str(gguf))
    ids = []
    for story in Path(text).read_text().split("<|endoftext|>"):
        if story.strip():
            ids += m.tokenize(story.strip())
        if len(ids) > 7 * 257:
            break
    np.save(tmp_path / "ids.npy", np.array(ids, dtype=np.uint32))
    toks, _ = _eval(["--model", str(gguf), "--tokens", str(tmp_path / "ids.npy"), "--forward", "exact", *common],
                    tmp_path, "d")
    assert strip(toks) == strip(exact)


def test_llama_perplexity_protocol_against_a_direct_computation(tmp_path):
    """kvq eval --protocol llama-perplexity: the whole file tokenized with BOS first, chunks of ctx
    with BOS in place of their first token, positions ctx/2 .. ctx-2 scored; its PPL, running
    line and final estimate equal the same recipe computed here from kvq.Model.logits (fp32); the
    same ids through --tokens give the same numbers."""
    _need_data()
    text = SHARED / "data" / "tinystories-valid-dev.txt"
    gguf = tmp_path / "stories260K.gguf"  # the model with its tokenizer in one file
    gw.convert_llama2c(str(MODEL), str(TOKENIZER), str(gguf))
    ctx, chunks = 64, 5
    args = ["--model", str(gguf), "--kv", "fp32,q8_0", "--ctx", str(ctx), "--max-windows", str(chunks),
            "--protocol", "llama-perplexity", "--forward", "exact"]
    rows, j = _eval(["--text", str(text), *args], tmp_path, "lp")
    assert j["protocol"] == "llama-perplexity" and j["tokens"] == chunks * (ctx - 1 - ctx // 2)
    m = kvq.Model(str(gguf))
    ids = m.tokenize(text.read_text(), bos=True)  # the whole file, unstripped
    nll, running = [], []
    for c in range(chunks):
        chunk = list(ids[c * ctx:(c + 1) * ctx])
        chunk[0] = ids[0]  # BOS
        logits = m.logits(np.array(chunk), kv="fp32", forward="token").astype(np.float64)
        for t in range(ctx // 2, ctx - 1):
            row = logits[t]
            lse = row.max() + np.log(np.exp(row - row.max()).sum())
            nll.append(lse - row[chunk[t + 1]])
        running.append(float(np.exp(np.mean(nll))))
    fp32 = j["results"][0]
    assert fp32["label"] == "fp32"
    assert abs(fp32["ppl"] / float(np.exp(np.mean(nll))) - 1) < 1e-6, (fp32["ppl"], np.exp(np.mean(nll)))
    assert np.allclose(fp32["running_ppl"], running, rtol=1e-6)
    assert len(j["results"][1]["running_ppl"]) == chunks
    # The same ids as a token file: the same table.
    np.save(tmp_path / "ids.npy", np.array(ids[:(chunks + 1) * ctx], dtype=np.uint32))
    rows_t, _ = _eval(["--tokens", str(tmp_path / "ids.npy"), *args], tmp_path, "lpt")
    strip = lambda t: [l.rsplit("|", 2)[0] for l in t]  # noqa: E731
    assert strip(rows_t) == strip(rows)
