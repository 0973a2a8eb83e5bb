"""Generation sessions: the library half of `kvq generate` (session/generate.h)."""

import codecs

from . import _kvq
import os

from ._util import _float, _int, _str


def generate(model, prompt="", *, tokenizer=None, kv="", steps=256, temperature=0.0, seed=0, save_cache=None,
             load_cache=None, prompt_cache=None, prompt_cache_chunk=256, prompt_cache_max_mb=0.0,
             prompt_cache_ttl=0, prompt_cache_secret=None, on_text=None, tokens=None, threads=0, batch=512,
             calib_batched=False, weight_dot="int8"):
    """Runs `kvq generate` in this process: the prompt, then sampled tokens, with the KV cache in scheme kv.

    generate(model, prompt="", *, tokenizer=None, kv="", steps=256, temperature=0.0, seed=0,
             save_cache=None, load_cache=None, prompt_cache=None, prompt_cache_chunk=256,
             prompt_cache_max_mb=0.0, prompt_cache_ttl=0, prompt_cache_secret=None, on_text=None,
             tokens=None, threads=0, batch=512, calib_batched=False, weight_dot="int8") -> dict

    model: a llama2.c checkpoint (then tokenizer: its tokenizer.bin) or a GGUF (its own tokenizer).
    kv: a row scheme, a grouped scheme or a preset ("" = fp32, or the loaded cache's scheme).
    save_cache / load_cache: a KVQS file of the prompt's tokens but its last, checked against the model's
    fingerprint and the prompt's token digest. prompt_cache: a prefix store (a directory, redis://... or
    "memory:"), its chunk size, size cap (MiB), Redis TTL and HMAC secret (str or bytes).
    on_text(str): called with the text as it is known (the prompt's, then each sampled token's).
    tokens: the prompt as token ids instead of text (a sequence of ints; BOS only if given); with a model
    whose tokenizer kvq does not read, the result has ids only (has_text False).
    threads: OpenMP and BLAS threads for the session (0: as the process has them); batch: prompt tokens
    per batched pass (the prompt runs through sgemm and KvCache.prefill, then tokens one by one).
    calib_batched: calibrated schemes generate their calibration sequences side by side (faster on large
    models, other samples; `kvq generate --calib-batched`).
    weight_dot: quantized weights (Q4_0 ... Q6_K, IQ4) through "int8" (llama.cpp's arithmetic: 8-bit
    activations, integer block sums) or "exact" (float32 against the dequantised weights); `--weight-dot`.

    Returns {"text", "ids", "has_text", "tokens", "restored", "evaluated", "prefilled", "prefill_seconds",
    "seconds", "kv", "bits", "bytes", "cache_tokens", "stored_chunks", "stored_bytes", "status", "weight_dot"}: ids are the
    prompt's token ids then the sampled ones; status holds the lines `kvq generate` prints on stderr
    (restored, saved, the prompt cache's reuse). Errors (kvq.Error, a ValueError) name the `kvq generate`
    option of the argument (--steps, --save-cache, ...).
    """
    secret = prompt_cache_secret
    if isinstance(secret, str):
        secret = secret.encode()
    if secret is not None and not isinstance(secret, (bytes, bytearray)):
        raise TypeError("prompt_cache_secret: expected str or bytes")
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    callback = None
    if on_text is not None:
        if not callable(on_text):
            raise TypeError("on_text: expected a callable")

        def callback(piece):
            s = decoder.decode(piece)
            if s:
                on_text(s)
    path = lambda v, arg: _str(os.fspath(v) if isinstance(v, os.PathLike) else v, arg)
    r = _kvq.generate(path(model, "model"), "" if tokenizer is None else path(tokenizer, "tokenizer"),
                      _str(prompt, "prompt"), _str(kv, "kv"), _int(steps, "steps"), _float(temperature, "temperature"),
                      _int(seed, "seed", 0, 2 ** 64 - 1), "" if save_cache is None else path(save_cache, "save_cache"),
                      "" if load_cache is None else path(load_cache, "load_cache"),
                      None if prompt_cache is None else _str(prompt_cache, "prompt_cache"),
                      _int(prompt_cache_chunk, "prompt_cache_chunk"), _float(prompt_cache_max_mb, "prompt_cache_max_mb"),
                      _int(prompt_cache_ttl, "prompt_cache_ttl"), bytes(secret or b""), callback,
                      [] if tokens is None else [_int(t, "tokens") for t in tokens], _int(threads, "threads"),
                      _int(batch, "batch"), bool(calib_batched), _str(weight_dot, "weight_dot"))
    if callback is not None:
        tail = decoder.decode(b"", final=True)
        if tail:
            on_text(tail)
    r["text"] = r["text"].decode("utf-8", errors="replace")
    return r
