#!/usr/bin/env bash
# Builds the libFuzzer targets in fuzz/ (clang, -fsanitize=fuzzer,address,
# undefined), writes their seed corpora and runs each for SECONDS (default
# 30). Fails on any crash, leak, sanitizer report or timeout; a crashing
# input is kept as build/fuzz/crashes/<target>/crash-*.
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]   (targets: kvqp kvqc kvqs kvqr checkpoint tokenizer gguf chat_template)
# A long run: scripts/fuzz.sh 600
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-30}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(kvqp kvqc kvqs kvqr checkpoint tokenizer gguf chat_template)
case "$secs" in ''|*[!0-9]*) echo "fuzz.sh: SECONDS must be a whole number, got '$secs'" >&2; exit 2 ;; esac
KVQ_WITH_FUZZ=1 bash scripts/install_deps.sh
B=build/fuzz
cmake -S fuzz -B "$B" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$B"
shared=${KVQ_SHARED:-$(cd .. && pwd)/shared}
rm -rf "$B/seeds"
"$B/make_seeds" "$B/seeds" "$shared"
# GGUF seeds (scripts/gguf_write.py, NumPy): small llama / qwen2 models, F16 / Q8_0 / BF16 (K-quants below), a sentencepiece,
# a BPE and no tokenizer; .npy token files.
mkdir -p "$B/seeds/gguf"
w="/usr/bin/python3 scripts/gguf_write.py synthetic"
tiny="--dim 64 --hidden 64 --layers 1 --heads 2 --kv-heads 1 --vocab 300 --ctx 64"
$w "$B/seeds/gguf/llama_f16.gguf" $tiny --type F16 --tokenizer llama
$w "$B/seeds/gguf/llama3_q8.gguf" $tiny --type Q8_0 --rope-scaling llama3
$w "$B/seeds/gguf/qwen2_bf16.gguf" $tiny --arch qwen2 --type BF16 --tied --tokenizer gpt2 --rope-scaling none
$w "$B/seeds/gguf/aliased.gguf" $tiny --type F16 --tokenizer llama --alias  # overlapping tensors
$w "$B/seeds/gguf/llama3_bpe.gguf" $tiny --type F16 --tokenizer bpe  # a byte-level BPE (llama-bpe)
/usr/bin/python3 -c "import numpy as np; np.save('$B/seeds/gguf/ids.npy', np.arange(40, dtype=np.int64))"
# K-quant and IQ4 seeds (rows of 256), quantized by llama.cpp itself when its oracle is installed.
$w "$B/seeds/gguf/k_f32.gguf" --dim 256 --hidden 256 --layers 1 --heads 2 --kv-heads 1 --vocab 16 --ctx 64 --type F32
/usr/bin/python3 - "$B/seeds/gguf" <<'PY' || echo "fuzz.sh: warning: no K-quant seeds (llama.cpp oracle: KVQ_WITH_ORACLES=1 scripts/install_deps.sh)" >&2
import sys
sys.path.insert(0, "python/tests")
from llama_cpp_lib import FTYPE_Q4_K_M, TYPES, Llama
d = sys.argv[1]
llama = Llama()
llama.quantize_model(f"{d}/k_f32.gguf", f"{d}/k_q4_k_m.gguf", FTYPE_Q4_K_M, pure=False)
for name in ("Q2_K", "Q3_K", "Q5_K", "IQ4_XS", "Q5_1"):
    llama.quantize_model(f"{d}/k_f32.gguf", f"{d}/k_{name.lower()}.gguf", TYPES[name][3], pure=True)
PY
rm -f "$B/seeds/gguf/k_f32.gguf"
passed=0; failed=0
for t in "${targets[@]}"; do
  corpus="$B/corpus/$t"; crashes="$B/crashes/$t"
  mkdir -p "$corpus" "$crashes"
  echo "== fuzz_$t: ${secs}s"
  # ASan/UBSan abort on the first report; -rss_limit_mb bounds memory, so an
  # allocation the limits should have stopped is a failure too.
  if ! ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
      "$B/fuzz_$t" "$corpus" "$B/seeds/$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=3072 \
      -malloc_limit_mb=2048 -artifact_prefix="$crashes/" -print_final_stats=1 >"$B/fuzz_$t.log" 2>&1; then
    echo "FAIL: fuzz_$t (log: $B/fuzz_$t.log)"; tail -40 "$B/fuzz_$t.log"; failed=$((failed+1))
  else
    grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb" "$B/fuzz_$t.log" | tr '\n' ' '; echo
    passed=$((passed+1))
  fi
done
echo "fuzz: $passed passed, $failed failed"
[ $failed -eq 0 ]
