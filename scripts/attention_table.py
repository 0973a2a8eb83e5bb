#!/usr/bin/python3
"""Prints README's decode-attention tables from kvq_bench JSON.

  build/release/bench/kvq_bench --benchmark_filter=decode_attention \
      --benchmark_repetitions=5 --benchmark_enable_random_interleaving=true \
      --benchmark_report_aggregates_only=true --benchmark_format=json >attn.json
  /usr/bin/python3 scripts/attention_table.py attn.json

Medians of the repetitions; ratios are against the fp32 / fp16 rows of the
same file (warm rows against warm fp32/fp16, cold rows against cold).
"""
import json
import re
import sys

# Row order; schemes in the JSON but not here follow, by name (none is dropped).
ORDER = ["fp32", "fp16", "bf16", "int8", "int8-head", "fp8-e4m3", "fp8-e5m2", "q8_0", "q4_0"]
TS = [1024, 4096, 16384, 65536]


def load(path):
    rows = {}
    try:
        benchmarks = json.load(open(path))["benchmarks"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"{path}: not kvq_bench JSON output ({e})")
    for b in benchmarks:
        if b.get("aggregate_name", "median") != "median":
            continue
        m = re.match(r"BM_decode_attention(_cold)?(_int8q)?/([^/]+)/(\d+)", b["name"])
        if not m or b.get("time_unit", "us") != "us":
            continue
        rows[(bool(m.group(1)), bool(m.group(2)), m.group(3), int(m.group(4)))] = b
    return rows


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: attention_table.py KVQ_BENCH_JSON")
    rows = load(sys.argv[1])
    if not rows:
        sys.exit("no BM_decode_attention medians in " + sys.argv[1])

    found = {k[2] for k in rows}
    schemes = [s for s in ORDER if s in found] + sorted(found - set(ORDER))

    def time(cold, iq, s, t):
        b = rows.get((cold, iq, s, t))
        return b["real_time"] if b else None

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "–"

    def fmt(x):
        return f"{x:.0f}" if x else "–"

    print("| scheme | bits | T=1024 µs | T=4096 µs | T=16384 µs | T=65536 µs | GB/s @16384 | GMAC/s @16384 "
          "| × fp32 @16384 | × fp16 @16384 | × fp32 @65536 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in schemes:
        for iq in (False, True):
            if (False, iq, s, 16384) not in rows:
                continue
            b = rows[(False, iq, s, 16384)]
            t = [time(False, iq, s, x) for x in TS]
            print(f"| {s}{' (int8_query)' if iq else ''} | {b['bits']:g} | "
                  + " | ".join(fmt(x) for x in t)
                  + f" | {b['bytes_per_second'] / 1e9:.1f} | {b['MAC/s'] / 1e9:.0f}"
                  + f" | {ratio(t[2], time(False, False, 'fp32', 16384))}"
                  + f" | {ratio(t[2], time(False, False, 'fp16', 16384))}"
                  + f" | {ratio(t[3], time(False, False, 'fp32', 65536))} |")

    if any(k[0] for k in rows):
        print()
        print("| scheme | layers | cold T=16384 µs | GB/s | × fp32 cold | × fp16 cold | warm µs (same run) | cold / warm |")
        print("|---|---|---|---|---|---|---|---|")
        for s in schemes:
            for iq in (False, True):
                b = rows.get((True, iq, s, 16384))
                if not b:
                    continue
                c, w = b["real_time"], time(False, iq, s, 16384)
                print(f"| {s}{' (int8_query)' if iq else ''} | {b['layers']:g} | {c:.0f} "
                      f"| {b['bytes_per_second'] / 1e9:.1f} | {ratio(c, time(True, False, 'fp32', 16384))} "
                      f"| {ratio(c, time(True, False, 'fp16', 16384))} | {fmt(w)} | {ratio(c, w)} |")


if __name__ == "__main__":
    main()
