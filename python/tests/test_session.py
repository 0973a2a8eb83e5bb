"""kvq.generate (session/generate.h): the library half of `kvq generate`, called from Python."""
import subprocess

import numpy as np
import pytest

import kvq
from kvq_test_helpers import MODEL, ROOT, TOKENIZER, kvq_cli, need_data as _need_data

README = MODEL.parent / "README.md"


def _known_good():
    """The model README's greedy text from BOS (200 steps), between its ``` fences."""
    text = README.read_text()
    start = text.index("A known-good output")
    body = text[text.index("```", start) + 3:]
    return body[body.index("\n") + 1:body.index("```")].rstrip("\n")


def test_greedy_text_is_the_models_known_good_output_and_streams():
    _need_data()
    pieces = []
    r = kvq.generate(MODEL, tokenizer=TOKENIZER, steps=200, on_text=pieces.append)
    assert r["text"].strip() == _known_good().strip()
    assert "".join(pieces) == r["text"]
    assert r["tokens"] == 200 and r["evaluated"] == 200 and r["restored"] == 0
    assert r["kv"] == "fp32" and r["bits"] == 32.0 and r["cache_tokens"] == 200


def test_same_text_as_the_cli_and_a_saved_cache_restores(tmp_path):
    _need_data()
    exe = kvq_cli()
    prompt = "Once upon a time, there was a cat"
    cli = subprocess.run([str(exe), "generate", "--model", str(MODEL), "--tokenizer", str(TOKENIZER), "--kv",
                          "kvq-4.5", "--prompt", prompt, "--steps", "96"], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    saved = tmp_path / "p.kvqs"
    a = kvq.generate(str(MODEL), prompt, tokenizer=str(TOKENIZER), kv="kvq-4.5", steps=96, save_cache=saved)
    assert a["text"] + "\n" == cli.stdout
    assert any(s.startswith("saved ") for s in a["status"]) and saved.stat().st_size > 0
    b = kvq.generate(MODEL, prompt, tokenizer=TOKENIZER, steps=96, load_cache=saved)
    assert b["text"] == a["text"] and b["restored"] > 0 and b["evaluated"] == 96 - b["restored"]
    # The file names the scheme the preset resolved to (layer 0 as token ids on this model), not the preset.
    assert a["kv"] == "kvq-4.5 = " + b["kv"] and b["kv"].startswith("t0+") and b["bytes"] == a["bytes"]
    assert any(s.startswith(f"restored {b['restored']} tokens") for s in b["status"])


def test_a_prompt_as_token_ids_and_the_batched_prefill():
    _need_data()
    prompt = "Once upon a time, Lily"
    a = kvq.generate(MODEL, prompt, tokenizer=TOKENIZER, steps=60)
    ids = [1, 403, 407, 261, 378, 432, 317]  # BOS and the prompt in stories260K's tokenizer
    assert a["ids"][:7] == ids and len(a["ids"]) > 7 and a["has_text"]
    assert a["prefilled"] == 6 and a["evaluated"] == 60 and a["prefill_seconds"] >= 0
    b = kvq.generate(MODEL, tokenizer=TOKENIZER, tokens=np.array(ids, dtype=np.int64), steps=60)
    assert b["text"] == a["text"] and b["ids"] == a["ids"]
    c = kvq.generate(MODEL, tokenizer=TOKENIZER, tokens=ids, steps=60, threads=2, batch=2)
    assert c["ids"][:7] == ids and c["text"].startswith(prompt) and c["prefilled"] == 6
    d = kvq.generate(MODEL, tokenizer=TOKENIZER, tokens=ids, steps=40, kv="kvq-4.5", calib_batched=True)
    assert any("side by side" in line for line in d["status"]) and d["ids"][:7] == ids
    with pytest.raises(kvq.Error, match="--tokens: not with --prompt"):
        kvq.generate(MODEL, "x", tokenizer=TOKENIZER, tokens=ids)
    with pytest.raises(kvq.Error, match="id 512 at position 1 is outside the vocabulary"):
        kvq.generate(MODEL, tokenizer=TOKENIZER, tokens=[1, 512])
    with pytest.raises(kvq.Error, match="--threads"):
        kvq.generate(MODEL, tokenizer=TOKENIZER, tokens=ids, threads=-1)
    with pytest.raises(kvq.Error, match="--batch"):
        kvq.generate(MODEL, tokenizer=TOKENIZER, tokens=ids, batch=0)
    with pytest.raises(kvq.Error, match="tokens"):
        kvq.generate(MODEL, tokenizer=TOKENIZER, tokens="abc")


def test_a_prompt_cache_in_memory_and_bad_arguments(tmp_path):
    _need_data()
    r = kvq.generate(MODEL, "Once upon a time", tokenizer=TOKENIZER, kv="q8_0", steps=40, prompt_cache="memory:",
                     prompt_cache_chunk=2, prompt_cache_secret="s3cret")
    assert any("prompt cache: reused 0 of" in s for s in r["status"]) and r["stored_chunks"] > 0
    with pytest.raises(kvq.Error, match="--steps"):
        kvq.generate(MODEL, tokenizer=TOKENIZER, steps=0)
    with pytest.raises(kvq.Error, match="--save-cache.*input"):
        kvq.generate(MODEL, "Once", tokenizer=TOKENIZER, steps=8, save_cache=MODEL)
    with pytest.raises(kvq.Error, match="--kv"):
        kvq.generate(MODEL, tokenizer=TOKENIZER, kv="int3", steps=8)
    with pytest.raises(kvq.Error, match="steps"):
        kvq.generate(MODEL, tokenizer=TOKENIZER, steps="8")
    with pytest.raises(TypeError):
        kvq.generate(MODEL, tokenizer=TOKENIZER, steps=8, on_text=3)
    assert MODEL.stat().st_size > 0  # the input is still there


def test_calibration_does_not_scale_with_the_prompt_or_steps(tmp_path):
    """A calibrated scheme on a model of 4096 tokens' context calibrates on 512-token sequences whatever
    --steps asks (it took the whole of max(steps, 512) before: minutes before a long prompt was read)."""
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    import gguf_write as gw
    cfg = dict(arch="llama", dim=64, hidden=64, layers=1, heads=2, kv_heads=1, vocab=64, ctx=4096,
               rope_base=10000.0, eps=1e-5)
    g, _ = gw.synthetic(cfg, seed=2, keep_reference=False)
    g.write(tmp_path / "long.gguf")
    r = kvq.generate(str(tmp_path / "long.gguf"), tokens=[1, 5, 6, 7], steps=2000, kv="k4v4cr16", calib_batched=True)
    line = [s for s in r["status"] if s.startswith("calibrated ")]
    assert len(line) == 1 and "16 sequences of 512 tokens" in line[0], r["status"]
    assert r["evaluated"] == 2000


def test_non_ascii_byte_pieces_are_kept():
    """stories260K has no piece for ü: it is the byte pieces <0xC3> <0xBC>, which generate keeps (they
    were dropped as unprintable single bytes: "Müller" came out "Mller"), and on_text gets whole
    characters."""
    _need_data()
    pieces = []
    r = kvq.generate(MODEL, "Müller saw a 😀", tokenizer=TOKENIZER, steps=20, on_text=pieces.append)
    assert r["text"].startswith("Müller saw a 😀"), r["text"]
    assert "".join(pieces) == r["text"] and all("\ufffd" not in p for p in pieces[:4])
