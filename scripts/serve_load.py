#!/usr/bin/env python3
"""What a compressed KV cache buys a server: `kvq serve` under load, one scheme after another at one
fixed --kv-budget-mb.

For each scheme it starts a server (loopback, any free port) and measures:
  - resident: the most sequences running at once (kvq_sequences_running_peak) when 64 clients ask at once;
  - for each concurrency C: C streaming clients each sending `--waves` requests back to back: total
    output tokens/s (all tokens / wall time), p50 and p99 time per output token (the gaps between a
    stream's tokens, first token excluded), p50 time to first token;
  - the budget: the peak KV bytes the caches held (kvq_kv_bytes_peak) against the budget;
  - memory: the server's RSS idle, at its peak and after the load (it must return near idle);
  - the prefix store (--prompt-cache memory:): time to first token of a long shared prompt, cold (stored
    as it is computed) and warm (restored), and the prefill tokens saved.
Every request is counted: none lost, none answered twice (distinct ids), or the script fails.

    /usr/bin/python3 scripts/serve_load.py --model M [--tokenizer T] --budget-mb 4 \\
        --schemes fp16,q8_0,q4_0,kvq-4.5,kvq-2.5 --prompt-tokens 96 --max-tokens 384 --json out.json

Prompts are token ids (a BOS, then ids drawn from the vocabulary with a fixed seed, or the ids of
--prompt-text when the model's tokenizer is one kvq reads), so any GGUF works.
"""
import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_client import Server, wait_for  # noqa: E402


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def prompt_ids(vocab, n, seed):
    r = random.Random(seed)
    return [1] + [r.randrange(3, vocab) for _ in range(n - 1)]


def run_level(s, concurrency, waves, make_body):
    """concurrency clients, each `waves` streaming requests back to back."""
    gaps, ttft, ids, tokens, errors = [], [], [], [0], []
    lock = threading.Lock()

    def client(c):
        for w in range(waves):
            body = make_body(c * waves + w)
            t0 = time.perf_counter()
            last = [None]
            my_gaps, n = [], [0]

            def on(ev):
                if not isinstance(ev, dict) or not ev.get("choices"):
                    return True
                now = time.perf_counter()
                if ev["choices"][0]["finish_reason"] is None:
                    n[0] += 1
                    if last[0] is None:
                        with lock:
                            ttft.append(now - t0)
                    else:
                        my_gaps.append(now - last[0])
                    last[0] = now
                return True

            try:
                _, events = s.stream(body, timeout=3600, on_event=on)
                assert events and events[-1] == "[DONE]", events[-3:]
                with lock:
                    ids.append(events[0]["id"])
                    gaps.extend(my_gaps)
                    tokens[0] += n[0]
            except Exception as e:  # noqa: BLE001 - counted
                with lock:
                    errors.append(repr(e))

    t0 = time.perf_counter()
    ts = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    if errors or len(ids) != concurrency * waves or len(set(ids)) != len(ids):
        raise SystemExit(f"serve_load: C={concurrency}: {len(errors)} errors ({errors[:2]}), {len(ids)} answers "
                         f"({len(set(ids))} distinct) of {concurrency * waves}")
    return {"concurrency": concurrency, "requests": len(ids), "tokens": tokens[0], "seconds": wall,
            "tok_s": tokens[0] / wall, "tpot_p50_ms": 1e3 * pct(gaps, 0.5), "tpot_p99_ms": 1e3 * pct(gaps, 0.99),
            "ttft_p50_ms": 1e3 * pct(ttft, 0.5)}


def print_table(results, budget_mb, max_seqs):
    """The markdown table and the memory lines of a run (also from its JSON: --from-json)."""
    levels = [lv["concurrency"] for lv in results[0]["levels"]]
    print()
    print(f"| scheme | resident at once (max {max_seqs}) | peak KV MiB (budget {budget_mb:g}) | "
          + " | ".join(f"C={c} tok/s · TPOT p50/p99 ms" for c in levels) + " | prefix store: TTFT cold → warm ms |")
    print("|---|---|---|" + "---|" * len(levels) + "---|")
    for r in results:
        cells = [f"{lv['tok_s']:.0f} · {lv['tpot_p50_ms']:.1f}/{lv['tpot_p99_ms']:.1f}" for lv in r["levels"]]
        print(f"| {r['kv']} | {r['resident']} | {r['kv_bytes_peak'] / 1048576:.2f} | " + " | ".join(cells)
              + f" | {r['prefix']['cold_ttft_ms']:.0f} → {r['prefix']['warm_ttft_ms']:.0f} |")
    for r in results:
        print(f"{r['scheme']}: RSS idle {r['rss_idle_kb'] / 1024:.0f} MiB, peak {r['rss_peak_kb'] / 1024:.0f} MiB, "
              f"after {r['rss_after_kb'] / 1024:.0f} MiB; {r['requests']} requests, {r['finished']} finished, "
              f"{r['preemptions']} preemptions")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvq", default=str(Path(__file__).resolve().parents[1] / "build" / "release" / "kvq"))
    ap.add_argument("--model")
    ap.add_argument("--tokenizer", default="")
    ap.add_argument("--schemes", default="fp16,q8_0,q4_0,kvq-4.5,kvq-2.5")
    ap.add_argument("--budget-mb", type=float)
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--waves", type=int, default=2, help="requests each client sends, back to back")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--prefix-tokens", type=int, default=0, help="the prefix-store prompt (0: 3/4 of the context)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--step-tokens", type=int, default=256)
    ap.add_argument("--server-args", default="", help="more kvq serve options, e.g. --calib-batched")
    ap.add_argument("--json", default="")
    ap.add_argument("--from-json", default="", help="print the table of a run's JSON and stop")
    a = ap.parse_args()
    if a.from_json:
        run = json.loads(Path(a.from_json).read_text())
        print_table(run["results"], run["args"]["budget_mb"], run["args"]["max_seqs"])
        return
    if not a.model or not a.budget_mb:
        ap.error("--model and --budget-mb are required")
    base = ["--model", a.model] + (["--tokenizer", a.tokenizer] if a.tokenizer else [])
    levels = [int(c) for c in a.concurrency.split(",")]
    results = []
    for scheme in a.schemes.split(","):
        args = base + ["--kv", scheme, "--kv-budget-mb", f"{a.budget_mb}", "--max-seqs", str(a.max_seqs),
                       "--max-queue", "1024", "--threads", str(a.threads), "--step-tokens", str(a.step_tokens),
                       *a.server_args.split()]
        with Server(a.kvq, args) as s:
            _, _, d = s.request("GET", "/v1/models")
            model = json.loads(d)["data"][0]
            vocab_hint = model["vocab_size"]
            ctx = model["context_length"]
            idle_kb = s.rss_kb()

            def body(i):
                return {"prompt": prompt_ids(vocab_hint, a.prompt_tokens, i), "max_tokens": a.max_tokens,
                        "temperature": 0.8, "seed": i + 1}

            row = {"scheme": scheme, "kv": model["kv"], "budget_bytes": int(s.metrics()["kvq_kv_budget_bytes"]),
                   "context": ctx, "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens, "levels": []}
            before = s.metrics()
            for c in levels:
                lv = run_level(s, c, a.waves, body)
                results_m = s.metrics()
                lv["running_peak"] = int(results_m["kvq_sequences_running_peak"])
                row["levels"].append(lv)
                print(f"{scheme:>8} C={c:<3} {lv['tok_s']:8.1f} tok/s  TPOT p50 {lv['tpot_p50_ms']:.2f} ms  "
                      f"p99 {lv['tpot_p99_ms']:.2f} ms  TTFT p50 {lv['ttft_p50_ms']:.1f} ms  "
                      f"resident peak {lv['running_peak']}", flush=True)
            m = s.metrics()
            row["resident"] = int(m["kvq_sequences_running_peak"])
            row["kv_bytes_peak"] = int(m["kvq_kv_bytes_peak"])
            row["preemptions"] = int(m["kvq_preemptions_total"])
            row["requests"] = int(m["kvq_requests_total"] - before["kvq_requests_total"])
            row["finished"] = int(m["kvq_requests_finished_total"] - before["kvq_requests_finished_total"])
            row["rss_idle_kb"] = idle_kb
            row["rss_peak_kb"] = s.rss_kb("VmHWM")
            wait_for(lambda: s.metrics()["kvq_sequences_running"] == 0, 60)
            time.sleep(0.5)
            row["rss_after_kb"] = s.rss_kb()
            if row["kv_bytes_peak"] > row["budget_bytes"]:
                raise SystemExit(f"serve_load: {scheme}: peak KV {row['kv_bytes_peak']} > budget {row['budget_bytes']}")
            if row["finished"] != row["requests"]:
                raise SystemExit(f"serve_load: {scheme}: {row['finished']} of {row['requests']} requests finished")
        # The prefix store: a long prompt cold, then warm, on a fresh server.
        n = a.prefix_tokens or (3 * ctx) // 4
        with Server(a.kvq, args + ["--prompt-cache", "memory:", "--prompt-cache-chunk", "64"]) as s:
            long_prompt = prompt_ids(vocab_hint, n, 12345)
            s.post({"prompt": prompt_ids(vocab_hint, n, 999), "max_tokens": 1})  # the process warm, the store not
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                first = []
                s.stream({"prompt": long_prompt, "max_tokens": 1, "temperature": 0},
                         on_event=lambda ev: first.append(time.perf_counter()) if isinstance(ev, dict) else None)
                times.append(first[0] - t0)
            pm = s.metrics()
            row["prefix"] = {"prompt_tokens": n, "cold_ttft_ms": 1e3 * times[0], "warm_ttft_ms": 1e3 * times[1],
                             "tokens_reused": int(pm["kvq_prefix_tokens_reused_total"]),
                             "bytes_reused": int(pm["kvq_prefix_bytes_reused_total"])}
            print(f"{scheme:>8} prefix store: {n}-token prompt, first token cold {1e3 * times[0]:.1f} ms, warm "
                  f"{1e3 * times[1]:.1f} ms ({row['prefix']['tokens_reused']} tokens restored)", flush=True)
        results.append(row)
    print_table(results, a.budget_mb, a.max_seqs)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
