#!/usr/bin/env python3
"""Multi-turn chat load on `kvq serve` (docs/serve.md, "Conversations kept compressed"): U users hold T-turn
conversations at once through /v1/chat/completions; every turn resends the whole conversation, so turn N+1 can
restore turn N's KV from the server's memory: prefix store instead of prefilling it. For each KV scheme, per turn:
the store's hit rate, prompt and prefilled tokens, TTFT (first streamed delta; turn 1 cold, the rest warm); at the
end the bytes the store holds per cached conversation, and how many conversations the cap holds against
llama.cpp's f16 host prompt cache (--cache-ram: 2 x layers x KV heads x head size x 2 bytes a token, from the
model's geometry).

  /usr/bin/python3 scripts/chat_load.py build/release/kvq [--kv fp16,q8_0,q4_0,kvq-4.5,kvq-3.5,kvq-2.5]
      [--users 8] [--turns 4] [--cap-mb 64] [--chunk 32] [--max-tokens 48] [--json FILE]

Default model: stories260K with the chatml template (the model is not a chat model; the turns are stories)."""
import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from serve_client import Server  # noqa: E402

QUESTIONS = ["Tell me a story about a cat.", "What happened next?", "And then?", "How did it end?",
             "Tell me another one.", "Who was there?", "What did they say?", "Why?"]


def one_turn(s, messages, max_tokens):
    """(reply text, ttft s, total s, usage) of one streamed chat request."""
    t0 = time.perf_counter()
    first = []

    def on_event(ev):
        if not first and isinstance(ev, dict) and ev.get("choices"):
            first.append(time.perf_counter() - t0)
    text, events = s.stream({"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                             "stream_options": {"include_usage": True}}, path="/v1/chat/completions",
                            on_event=on_event)
    usage = next(e["usage"] for e in events if isinstance(e, dict) and e.get("usage"))
    return text, first[0] if first else float("nan"), time.perf_counter() - t0, usage


def run_scheme(kvq, kv, a, model_args, store=True):
    args = [*model_args, "--kv", kv, "--chat-template", a.chat_template, "--prompt-cache-chunk", str(a.chunk),
            "--prompt-cache-max-mb", str(a.cap_mb), "--max-seqs", str(a.users), "--threads", str(a.threads)]
    if not store:
        args += ["--prompt-cache", "off"]
    turns = []
    with Server(kvq, args) as s:
        info = json.loads(s.request("GET", "/v1/models")[2])["data"][0]
        convs = [[{"role": "system", "content": "You tell short stories."}] for _ in range(a.users)]
        for t in range(a.turns):
            for u, c in enumerate(convs):
                c.append({"role": "user", "content": QUESTIONS[(t + u) % len(QUESTIONS)]})
            m0 = s.metrics()
            out = [None] * a.users

            def go(u):
                out[u] = one_turn(s, convs[u], a.max_tokens)
            threads = [threading.Thread(target=go, args=(u,)) for u in range(a.users)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            m1 = s.metrics()
            for u, (text, _, _, _) in enumerate(out):
                convs[u].append({"role": "assistant", "content": text})
            d = lambda k: m1[k] - m0[k]  # noqa: E731
            turns.append({
                "turn": t + 1,
                "lookups": d("kvq_prefix_lookups_total"), "hits": d("kvq_prefix_hits_total"),
                "prompt_tokens": sum(o[3]["prompt_tokens"] for o in out),
                "reused_tokens": d("kvq_prefix_tokens_reused_total"),
                "prefilled_tokens": d("kvq_prefill_tokens_total"),
                "ttft_median_s": statistics.median(o[1] for o in out),
                "latency_median_s": statistics.median(o[2] for o in out),
            })
        m = s.metrics()
    ctx = info["context_length"]
    return {"kv": kv, "kv_bytes_per_token": info["kv_bytes_at_context"] / ctx, "turns": turns,
            "store_bytes": m["kvq_prefix_store_bytes"], "bytes_stored_total": m["kvq_prefix_bytes_stored_total"],
            "chunks_stored": m["kvq_prefix_chunks_stored_total"],
            "conversation_tokens": turns[-1]["prompt_tokens"] / a.users}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kvq")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--chat-template", default="chatml")
    ap.add_argument("--kv", default="fp16,q8_0,q4_0,kvq-4.5,kvq-3.5,kvq-2.5")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--cap-mb", type=float, default=64)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    shared = Path(os.environ.get("KVQ_SHARED", ROOT.parent / "shared"))
    model = a.model or str(shared / "models" / "stories260K" / "stories260K.bin")
    model_args = ["--model", model]
    if a.tokenizer or not a.model:
        model_args += ["--tokenizer", a.tokenizer or str(shared / "models" / "stories260K" / "tok512.bin")]
    results = []
    for kv in a.kv.split(","):
        r = run_scheme(a.kvq, kv.strip(), a, model_args)
        cold = run_scheme(a.kvq, kv.strip(), a, model_args, store=False)  # the same turns without the store
        for t, c in zip(r["turns"], cold["turns"]):
            t["ttft_no_store_median_s"] = c["ttft_median_s"]
            t["prefilled_no_store"] = c["prefilled_tokens"]
        results.append(r)
    # llama.cpp's f16 host cache, from the geometry fp16 reports: K and V at 2 bytes a value.
    f16 = next((r["kv_bytes_per_token"] for r in results if r["kv"] == "fp16"), None)
    cap = a.cap_mb * 1048576
    print(f"{a.users} users x {a.turns} turns, chat template {a.chat_template}, chunks of {a.chunk} tokens, "
          f"memory: store capped at {a.cap_mb:g} MiB, max_tokens {a.max_tokens}, model {Path(model).name}")
    print("| kv | turn | hit rate | prompt tok | reused | prefilled | prefilled, no store | TTFT median ms | "
          "TTFT no store | latency median ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        for t in r["turns"]:
            hr = t["hits"] / t["lookups"] if t["lookups"] else 0.0
            print(f"| {r['kv']} | {t['turn']} | {hr:.0%} | {t['prompt_tokens']:.0f} | {t['reused_tokens']:.0f} | "
                  f"{t['prefilled_tokens']:.0f} | {t['prefilled_no_store']:.0f} | {t['ttft_median_s'] * 1e3:.1f} | "
                  f"{t['ttft_no_store_median_s'] * 1e3:.1f} | {t['latency_median_s'] * 1e3:.1f} |")
    print()
    print("| kv | KV bytes/token | tokens/conversation | store bytes | per conversation | conversations in the cap "
          "| llama.cpp f16 host cache, same cap | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        per = r["store_bytes"] / a.users
        held = cap / per if per else float("inf")
        # llama.cpp keeps a conversation's whole prompt in f16.
        ref = cap / (r["conversation_tokens"] * f16) if f16 else float("nan")
        r.update(per_conversation_bytes=per, conversations_in_cap=held, llama_cpp_f16_conversations=ref)
        print(f"| {r['kv']} | {r['kv_bytes_per_token']:.0f} | {r['conversation_tokens']:.0f} | "
              f"{r['store_bytes']:.0f} | {per:.0f} | {held:.0f} | "
              f"{ref:.0f} | {held / ref:.2f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
