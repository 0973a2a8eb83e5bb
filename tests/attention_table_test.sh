#!/usr/bin/env bash
# scripts/attention_table.py: medians only, ratios against the same run's
# fp32 / fp16 rows (warm against warm, cold against cold), and a clear exit
# on input without decode-attention rows.
set -u
TABLE=$1
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
pass=0; fail=0
check() { if eval "$2"; then pass=$((pass+1)); else echo "FAIL: $1"; fail=$((fail+1)); fi; }
row() {  # name, aggregate, real_time, bits, layers
  printf '{"name": "%s_%s", "aggregate_name": "%s", "time_unit": "us", "real_time": %s, "bits": %s, "layers": %s, "bytes_per_second": 2e10, "MAC/s": 5e10}' \
    "$1" "$2" "$2" "$3" "$4" "$5"
}
# kvq_bench JSON of the rows on stdin, one "name aggregate real_time bits layers" a line.
bench_json() {
  local sep=""
  echo '{"benchmarks": ['
  while read -r n a t b l; do printf '%s' "$sep"; row "$n" "$a" "$t" "$b" "$l"; sep=$',\n'; done
  echo; echo ']}'
}
bench_json >"$T/in.json" <<EOF
BM_decode_attention/fp32/16384/real_time median 4000 32 1
BM_decode_attention/fp32/16384/real_time mean 9999 32 1
BM_decode_attention/fp16/16384/real_time median 2000 16 1
BM_decode_attention/q4_0/16384/real_time median 1000 4.5 1
BM_decode_attention/fp8-e4m3-scaled/16384/real_time median 3000 9 1
BM_decode_attention_int8q/q4_0/16384/real_time median 800 4.5 1
BM_decode_attention_cold/fp32/16384/real_time median 6000 32 7
BM_decode_attention_cold/fp16/16384/real_time median 3000 16 13
BM_decode_attention_cold/q4_0/16384/real_time median 1500 4.5 32
EOF
/usr/bin/python3 "$TABLE" "$T/in.json" >"$T/out" 2>"$T/err"; rc=$?
check "runs" '[ $rc -eq 0 ]'
check "warm q4_0: 0.25x fp32, 0.50x fp16 (medians, not means)" 'grep -q "^| q4_0 | 4.5 | 1000 | 20.0 | 50 | 0.25 | 0.50 | 1.00 |$" "$T/out" && grep -q "^| scheme | bits | T=16384 µs | GB/s @16384 |" "$T/out"'
check "a scheme the script does not list is printed, after the listed ones" 'grep -q "^| fp8-e4m3-scaled | 9 | 3000 |.*| 0.75 | 1.50 |" "$T/out" && [ "$(grep -n "^| fp8-e4m3-scaled " "$T/out" | cut -d: -f1)" -gt "$(grep -n "^| q4_0 (int8_query) " "$T/out" | cut -d: -f1)" ]'
check "int8_query row" 'grep -q "^| q4_0 (int8_query) | 4.5 | 800 |.*| 0.20 | 0.40 |" "$T/out"'
check "cold q4_0 against cold fp32 / fp16 / q4_0" 'grep -q "^| q4_0 | 32 | 1500 | 20.0 | 0.25 | 0.50 | 1.00 | 1.00 | 1000 | 1.50 |$" "$T/out"'
check "cold fp32 row" 'grep -q "^| fp32 | 7 | 6000 | 20.0 | 1.00 | 2.00 | 4.00 | 1.00 | 4000 | 1.50 |$" "$T/out"'
# Only the lengths that ran are columns; x fp32 @65536 when 65536 ran.
bench_json >"$T/lens.json" <<EOF
BM_decode_attention/fp32/4096/real_time median 1000 32 1
BM_decode_attention/fp32/16384/real_time median 4000 32 1
BM_decode_attention/fp32/65536/real_time median 16000 32 1
BM_decode_attention/q4_0/16384/real_time median 1000 4.5 1
BM_decode_attention/q4_0/65536/real_time median 4800 4.5 1
EOF
/usr/bin/python3 "$TABLE" "$T/lens.json" >"$T/out" 2>"$T/err"; rc=$?
check "lengths that ran, in order, and x fp32 at 65536" '[ $rc -eq 0 ] && grep -q "^| scheme | bits | T=4096 µs | T=16384 µs | T=65536 µs | GB/s @16384 |.*| × fp32 @65536 |$" "$T/out" && grep -q "^| q4_0 | 4.5 | – | 1000 | 4800 | 20.0 | 50 | 0.25 | – | 1.00 | 0.30 |$" "$T/out" && ! grep -q "T=1024" "$T/out"'
# Geometry rows: one line per geometry, the presets against q4_0 of the same geometry.
bench_json >"$T/geo.json" <<EOF
BM_attention_geometry/fp32/q32kv8/hd128/4096/t2/real_time median 800 32 1
BM_attention_geometry/fp16/q32kv8/hd128/4096/t2/real_time median 500 16 1
BM_attention_geometry/q4_0/q32kv8/hd128/4096/t2/real_time median 200 4.5 1
BM_attention_geometry/kvq-4.5/q32kv8/hd128/4096/t2/real_time median 180 3.8 1
BM_attention_geometry/kvq-4.5/q32kv8/hd128/4096/t2/real_time mean 999 3.8 1
BM_attention_geometry/q4_0/q32kv32/hd64/16384/t1/real_time median 1000 4.5 1
BM_attention_geometry/kvq-4.5/q32kv32/hd64/16384/t1/real_time median 1300 3.8 1
EOF
/usr/bin/python3 "$TABLE" "$T/geo.json" >"$T/out" 2>"$T/err"; rc=$?
check "geometry only: runs" '[ $rc -eq 0 ]'
check "geometry row with every bound and the preset against q4_0" 'grep -q "^| 32/8 | 128 | 4096 | 2 | 800 | 500 | 200 | 180 (0.90) |$" "$T/out"'
check "geometry row without fp32 / fp16" 'grep -q "^| 32/32 | 64 | 16384 | 1 | – | – | 1000 | 1300 (1.30) |$" "$T/out"'
# Write rows: the cost of a token against the same scheme's decode step at 4096.
bench_json >"$T/w.json" <<EOF
BM_grouped_write/memcpy median 0.4 0 0
BM_grouped_write/kvq-4.5 median 15 0 0
BM_grouped_write/kvq-4.5 mean 99 0 0
BM_decode_attention/kvq-4.5/4096/real_time median 400 3.8 1
EOF
/usr/bin/python3 "$TABLE" "$T/w.json" >"$T/out" 2>"$T/err"; rc=$?
check "write rows: a share of the decode step" '[ $rc -eq 0 ] && grep -q "^| kvq-4.5 | 15.00 | 400 | 3.8% |$" "$T/out" && grep -q "^| memcpy | 0.40 | – | – |$" "$T/out"'
# One file per SIMD target: one set of tables each, under the target and the CPU flags.
for tg in AVX2 AVX3_DL; do
  { echo '{"context": {"simd_target": "'$tg'", "cpu_simd_flags": "avx2 fma"}, "benchmarks": ['
    row BM_decode_attention/fp32/16384/real_time median 4000 32 1; echo ,
    row BM_decode_attention/q4_0/16384/real_time median $([ $tg = AVX2 ] && echo 2000 || echo 1000) 4.5 1
    echo ']}'; } >"$T/$tg.json"
done
/usr/bin/python3 "$TABLE" "$T/AVX2.json" "$T/AVX3_DL.json" >"$T/out" 2>"$T/err"; rc=$?
check "per-target files: a header each, in order, with its own ratios" '[ $rc -eq 0 ] && [ "$(grep -c "^SIMD target" "$T/out")" -eq 2 ] && grep -q "^SIMD target AVX2; CPU flags: avx2 fma" "$T/out" && [ "$(grep "^| q4_0 " "$T/out" | awk -F"|" "{print \$7}" | tr -d " " | tr "\n" ,)" = "0.50,0.25," ]'
echo '{"benchmarks": []}' >"$T/empty.json"
/usr/bin/python3 "$TABLE" "$T/empty.json" >/dev/null 2>"$T/err"; rc=$?
check "no rows: exit 1 with a message" '[ $rc -eq 1 ] && grep -q "no BM_decode_attention medians" "$T/err"'
echo 'not json' >"$T/bad.json"
/usr/bin/python3 "$TABLE" "$T/bad.json" >/dev/null 2>"$T/err"; rc=$?
check "bad JSON: exit 1 naming the file" '[ $rc -eq 1 ] && grep -q "bad.json: not kvq_bench JSON" "$T/err"'
echo "attention_table_test: $pass passed, $fail failed"
[ $fail -eq 0 ]
