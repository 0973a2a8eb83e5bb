#!/usr/bin/python3
"""Prints docs/performance.md's decode-attention tables from kvq_bench JSON.

  build/release/bench/kvq_bench --benchmark_filter=decode_attention \
      --benchmark_repetitions=5 --benchmark_enable_random_interleaving=true \
      --benchmark_report_aggregates_only=true --benchmark_format=json >attn.json
  /usr/bin/python3 scripts/attention_table.py attn.json

One file per SIMD target (kvq_bench --kvq_targets=AVX2 ..., or KVQ_TARGETS):
  scripts/attention_table.py avx3_dl.json avx2.json ...
prints one set of tables per file, each under the target that ran and the
CPU's SIMD flags (the JSON context kvq_bench writes).

Medians of the repetitions; ratios are against the fp32 / fp16 / q4_0 rows
of the same file (warm rows against warm, cold rows against cold). With
BM_attention_geometry rows (--benchmark_filter=attention_geometry) it also
prints one line per geometry: fp32, fp16 and q4_0 in µs, and every other
scheme in µs with its ratio to q4_0. With BM_grouped_write rows it prints
each scheme's cost of writing a token next to its decode step at T = 4096
(BM_decode_attention/<scheme>/4096 of the same file).
"""
import json
import re
import sys

# Row order; schemes in the JSON but not here follow, by name (none is dropped).
ORDER = ["fp32", "fp16", "bf16", "int8", "int8-head", "fp8-e4m3", "fp8-e5m2", "q8_0", "q4_0"]
TS = [1024, 4096, 16384, 65536]


def load(path):
    rows, geo, writes = {}, {}, {}
    try:
        doc = json.load(open(path))
        benchmarks = doc["benchmarks"]
        context = doc.get("context", {}) if isinstance(doc, dict) else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        sys.exit(f"{path}: not kvq_bench JSON output ({e})")
    for b in benchmarks:
        if b.get("aggregate_name", "median") != "median":
            continue
        name = b.get("run_name") or re.sub("_" + re.escape(b.get("aggregate_name", "")) + "$", "", b["name"])
        w = re.fullmatch(r"BM_grouped_write/([^/]+)", name)
        if w and b.get("time_unit", "us") == "us":
            writes[w.group(1)] = b
            continue
        g = re.match(r"BM_attention_geometry/([^/]+)/q(\d+)kv(\d+)/hd(\d+)/(\d+)/t(\d+)", b["name"])
        if g and b.get("time_unit", "us") == "us":
            geo.setdefault(tuple(int(x) for x in g.groups()[1:]), {})[g.group(1)] = b
            continue
        m = re.match(r"BM_decode_attention(_cold)?(_int8q)?/([^/]+)/(\d+)", b["name"])
        if not m or b.get("time_unit", "us") != "us":
            continue
        rows[(bool(m.group(1)), bool(m.group(2)), m.group(3), int(m.group(4)))] = b
    return rows, geo, writes, context


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: attention_table.py KVQ_BENCH_JSON...")
    loaded = [load(path) for path in sys.argv[1:]]
    for path, (rows, geo, writes, _) in zip(sys.argv[1:], loaded):
        if not rows and not geo and not writes:
            sys.exit("no BM_decode_attention medians in " + path)
    for i, (rows, geo, writes, context) in enumerate(loaded):
        if i:
            print()
        if "simd_target" in context:
            print(f"SIMD target {context['simd_target']}; CPU flags: {context.get('cpu_simd_flags', '?')}; "
                  f"{context.get('num_cpus', '?')} CPUs at {context.get('mhz_per_cpu', '?')} MHz")
            print()
        tables(rows, geo, writes)


def tables(rows, geo, writes):
    if writes:
        write_table(writes, rows)
    elif rows:
        decode_tables(rows)
    if geo:
        if rows:
            print()
        geometry_table(geo)


def write_table(writes, rows):
    order = ["memcpy"] + [s for s in ORDER if s in writes] + sorted(set(writes) - set(ORDER) - {"memcpy"}, reverse=True)
    print("| scheme | write µs / token (one layer) | decode step µs at T=4096 (same run) | write ÷ decode |")
    print("|---|---|---|---|")
    for s in order:
        if s not in writes:
            continue
        w = writes[s]["real_time"]
        d = rows.get((False, False, s, 4096))
        share = f"{100 * w / d['real_time']:.1f}%" if d else "–"
        print(f"| {s} | {w:.2f} | {fmt(d['real_time']) if d else '–'} | {share} |")


def ratio(a, b):
    return f"{a / b:.2f}" if a and b else "–"


def fmt(x):
    return f"{x:.0f}" if x else "–"


def geometry_table(geo):
    found = {s for g in geo.values() for s in g}
    bounds = [s for s in ("fp32", "fp16", "q4_0") if s in found]
    others = [s for s in ORDER if s in found and s not in bounds] + sorted(found - set(ORDER))
    print("| query / KV heads | head_dim | T | threads | " + " | ".join(f"{s} µs" for s in bounds)
          + "".join(f" | {s} µs (× q4_0)" for s in others) + " |")
    print("|---|---|---|---|" + "---|" * (len(bounds) + len(others)))
    for key in sorted(geo, key=lambda k: (-k[1], k[0], -k[2], k[3], k[4])):
        qh, kv, hd, T, t = key
        g = geo[key]
        time = {s: g[s]["real_time"] for s in g}
        cells = [fmt(time.get(s)) for s in bounds]
        cells += [f"{fmt(time.get(s))} ({ratio(time.get(s), time.get('q4_0'))})" for s in others]
        print(f"| {qh}/{kv} | {hd} | {T} | {t} | " + " | ".join(cells) + " |")


def decode_tables(rows):

    found = {k[2] for k in rows}
    schemes = [s for s in ORDER if s in found] + sorted(found - set(ORDER))

    def time(cold, iq, s, t):
        b = rows.get((cold, iq, s, t))
        return b["real_time"] if b else None

    # Lengths that ran (a filtered run, e.g. scripts/attention_targets.sh's T = 16384 only, prints no empty columns).
    ts = [x for x in TS if any(k[3] == x and not k[0] for k in rows)]
    long_ratio = 65536 in ts
    print("| scheme | bits | " + " | ".join(f"T={x} µs" for x in ts) + " | GB/s @16384 | GMAC/s @16384 "
          "| × fp32 @16384 | × fp16 @16384 | × q4_0 @16384 |" + (" × fp32 @65536 |" if long_ratio else ""))
    print("|---|---|" + "---|" * (len(ts) + 5 + long_ratio))
    for s in schemes:
        for iq in (False, True):
            if (False, iq, s, 16384) not in rows:
                continue
            b = rows[(False, iq, s, 16384)]
            t = {x: time(False, iq, s, x) for x in TS}
            print(f"| {s}{' (int8_query)' if iq else ''} | {b['bits']:g} | "
                  + " | ".join(fmt(t[x]) for x in ts)
                  + f" | {b['bytes_per_second'] / 1e9:.1f} | {b['MAC/s'] / 1e9:.0f}"
                  + f" | {ratio(t[16384], time(False, False, 'fp32', 16384))}"
                  + f" | {ratio(t[16384], time(False, False, 'fp16', 16384))}"
                  + f" | {ratio(t[16384], time(False, False, 'q4_0', 16384))} |"
                  + (f" {ratio(t[65536], time(False, False, 'fp32', 65536))} |" if long_ratio else ""))

    if any(k[0] for k in rows):
        print()
        print("| scheme | layers | cold T=16384 µs | GB/s | × fp32 cold | × fp16 cold | × q4_0 cold "
              "| GB/s ÷ fp32's | warm µs (same run) | cold / warm |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for s in schemes:
            for iq in (False, True):
                b = rows.get((True, iq, s, 16384))
                if not b:
                    continue
                c, w = b["real_time"], time(False, iq, s, 16384)
                f32 = rows.get((True, False, "fp32", 16384))
                bw = ratio(b["bytes_per_second"], f32["bytes_per_second"] if f32 else None)
                print(f"| {s}{' (int8_query)' if iq else ''} | {b['layers']:g} | {c:.0f} "
                      f"| {b['bytes_per_second'] / 1e9:.1f} | {ratio(c, time(True, False, 'fp32', 16384))} "
                      f"| {ratio(c, time(True, False, 'fp16', 16384))} | {ratio(c, time(True, False, 'q4_0', 16384))} "
                      f"| {bw} | {fmt(w)} | {ratio(c, w)} |")


if __name__ == "__main__":
    main()
