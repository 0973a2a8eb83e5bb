#!/usr/bin/env bash
# BM_decode_attention_cold: the layer count covers >= 3x the last-level cache
# (or is the cap, 32), and the benchmark runs and reports a byte rate.
set -u
BENCH=$1
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
"$BENCH" --benchmark_filter='^BM_decode_attention_cold/fp32/16384' --benchmark_min_time=0.01 \
  --benchmark_format=json >"$T/out.json" 2>"$T/err" || { echo "FAIL: kvq_bench exited $?"; cat "$T/err"; exit 1; }
exec /usr/bin/python3 - "$T/out.json" <<'PY'
import glob, json, math, sys
llc = 0
for f in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
    t = open(f).read().strip()
    v = float(t.rstrip("KM")) * {"K": 1024, "M": 1024 ** 2}.get(t[-1], 1)
    llc = max(llc, v)
llc = llc or 256 * 1024 ** 2
layer_bytes = 2 * 16384 * 8 * 128 * 4  # fp32 K and V of one layer
want = int(min(32, max(2, math.ceil(3 * llc / layer_bytes))))
runs = json.load(open(sys.argv[1]))["benchmarks"]
fail = 0
def check(name, ok):
    global fail
    if not ok:
        print("FAIL:", name); fail += 1
check("one result", len(runs) == 1)
if runs:
    r = runs[0]
    check(f"layers {r.get('layers')} == {want} (last-level cache {llc:.0f} B)", r.get("layers") == want)
    check("layers hold >= 3x the last-level cache, or the cap 32", want == 32 or want * layer_bytes >= 3 * llc)
    check("bytes_per_second > 0", r.get("bytes_per_second", 0) > 0)
print(f"bench_cold_test: {'failed' if fail else 'passed'} (layers {want})")
sys.exit(1 if fail else 0)
PY
