#!/usr/bin/env bash
# The `kvq` command-line contract: exit code 2 and no partial JSON on bad
# input, text-only stdout for generate, valid JSON from eval.
set -u
KVQ=$1
SHARED=${KVQ_SHARED:-$KVQ_DEFAULT_SHARED}
MODEL=$SHARED/models/stories260K/stories260K.bin
TOK=$SHARED/models/stories260K/tok512.bin
if [ ! -f "$MODEL" ]; then
  if [ "${KVQ_REQUIRE_DATA:-0}" = "1" ]; then echo "FAIL: $MODEL missing (KVQ_REQUIRE_DATA=1)"; exit 1; fi
  echo "SKIP: $MODEL not found; set KVQ_SHARED"; exit 0
fi
export KVQ_SHARED=$SHARED
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
pass=0; fail=0
check() { if eval "$2"; then pass=$((pass+1)); else echo "FAIL: $1"; fail=$((fail+1)); fi; }

"$KVQ" eval --kv int3 --json "$T/a.json" >"$T/out" 2>"$T/err"; rc=$?
check "unknown scheme exits 2" '[ $rc -eq 2 ]'
check "unknown scheme names it" 'grep -q "int3" "$T/err"'
check "no JSON on error" '[ ! -e "$T/a.json" ] && [ ! -e "$T/a.json.tmp" ]'

"$KVQ" eval --ctx 1000 --json "$T/b.json" >/dev/null 2>"$T/err"; rc=$?
check "ctx > seq_len exits 2" '[ $rc -eq 2 ] && grep -q "ctx" "$T/err" && [ ! -e "$T/b.json" ]'

head -c 5000 "$MODEL" > "$T/trunc.bin"
"$KVQ" eval --model "$T/trunc.bin" --json "$T/c.json" >/dev/null 2>"$T/err"; rc=$?
check "truncated model exits 2" '[ $rc -eq 2 ] && grep -q "truncated" "$T/err" && [ ! -e "$T/c.json" ]'

"$KVQ" eval --tokenizer "$T/missing.bin" >/dev/null 2>"$T/err"; rc=$?
check "missing tokenizer exits 2" '[ $rc -eq 2 ] && grep -q "cannot open" "$T/err"'

printf '  \n<|endoftext|>\n' > "$T/empty.txt"
"$KVQ" eval --text "$T/empty.txt" --json "$T/d.json" >/dev/null 2>"$T/err"; rc=$?
check "text without stories exits 2" '[ $rc -eq 2 ] && grep -q "no stories" "$T/err" && [ ! -e "$T/d.json" ]'

"$KVQ" eval --kv int8,q4_0 --ctx 32 --max-windows 3 --json "$T/ok.json" >"$T/out" 2>"$T/err"; rc=$?
check "eval succeeds" '[ $rc -eq 0 ]'
check "eval prints a table" 'grep -q "| q4_0" "$T/out" && grep -q "| fp32" "$T/out"'
check "eval JSON is valid" '/usr/bin/python3 -c "
import json,sys
j=json.load(open(\"$T/ok.json\"))
assert j[\"ctx\"]==32 and j[\"tokens\"]==96, j
r=j[\"results\"]; assert [x[\"scheme\"] for x in r]==[\"fp32\",\"int8\",\"q4_0\"], r
keys={\"scheme\",\"bits_per_element\",\"kv_bytes\",\"ppl\",\"delta_ppl\",\"delta_ppl_pct\",\"kld_mean\",\"kld_max\",\"top1_pct\",\"tokens_per_s\"}
assert all(keys<=set(x) for x in r)
assert r[0][\"delta_ppl\"]==0 and r[2][\"bits_per_element\"]==4.5
"'

# GGUF models (scripts/gguf_write.py writes them): the shipped model as GGUF
# generates the same text; --tokens; a BPE model points to --tokens; bad options.
ROOT=$(cd "$(dirname "$0")/.." && pwd)
/usr/bin/python3 "$ROOT/scripts/gguf_write.py" llama2c "$MODEL" "$TOK" "$T/s.gguf"
"$KVQ" generate --steps 40 >"$T/gen_a" 2>/dev/null
"$KVQ" generate --model "$T/s.gguf" --steps 40 >"$T/gen_b" 2>"$T/err"; rc=$?
check "generate on the GGUF gives the llama2.c text" '[ $rc -eq 0 ] && [ -s "$T/gen_a" ] && cmp -s "$T/gen_a" "$T/gen_b"'
/usr/bin/python3 -c "import numpy as np; np.arange(1, 100, dtype=np.uint32).tofile('$T/ids.bin')"
"$KVQ" eval --model "$T/s.gguf" --tokens "$T/ids.bin" --kv q8_0 --ctx 32 --json "$T/t.json" >"$T/out" 2>"$T/err"; rc=$?
check "eval --tokens on a GGUF: 3 windows, batched" '[ $rc -eq 0 ] && /usr/bin/python3 -c "
import json
j=json.load(open(\"$T/t.json\"))
assert j[\"windows\"]==3 and j[\"forward\"]==\"batched\" and j[\"gemm_peak_gflops\"]>0 and j[\"model_config\"][\"arch\"]==\"llama\", j
"'
"$KVQ" eval --model "$T/s.gguf" --tokens "$T/ids.bin" --text "$T/empty.txt" >/dev/null 2>"$T/err"; rc=$?
check "--tokens with --text exits 2" '[ $rc -eq 2 ] && grep -q "either --text or --tokens" "$T/err"'
"$KVQ" eval --model "$T/s.gguf" --forward fast >/dev/null 2>"$T/err"; rc=$?
check "--forward fast exits 2" '[ $rc -eq 2 ] && grep -q "forward" "$T/err"'
head -c 3 "$T/ids.bin" > "$T/odd.bin"
"$KVQ" eval --model "$T/s.gguf" --tokens "$T/odd.bin" >/dev/null 2>"$T/err"; rc=$?
check "a 3-byte token file exits 2" '[ $rc -eq 2 ] && grep -q "whole number of little-endian uint32" "$T/err"'
/usr/bin/python3 "$ROOT/scripts/gguf_write.py" synthetic "$T/q.gguf" --arch qwen2 --dim 64 --hidden 64 --layers 1 \
  --heads 2 --kv-heads 1 --vocab 300 --ctx 64 --tokenizer gpt2 --rope-scaling none
"$KVQ" eval --model "$T/q.gguf" --ctx 16 >/dev/null 2>"$T/err"; rc=$?
check "a BPE GGUF points to --tokens" '[ $rc -eq 2 ] && grep -q "byte-level BPE" "$T/err" && grep -q -- "--tokens" "$T/err"'
# generate --tokens: ids in; on a model whose tokenizer kvq does not read, ids out (prompt then sampled).
/usr/bin/python3 -c "import numpy as np; np.arange(1, 11, dtype=np.uint32).tofile('$T/ids10.bin')"
"$KVQ" generate --model "$T/q.gguf" --tokens "$T/ids10.bin" --steps 20 --kv q8_0 >"$T/out" 2>"$T/err"; rc=$?
check "generate --tokens on a BPE GGUF prints the ids" '[ $rc -eq 0 ] && /usr/bin/python3 -c "
ids = [int(x) for x in open(\"$T/out\").read().split()]
assert ids[:10] == list(range(1, 11)) and len(ids) == 21 and all(0 <= i < 300 for i in ids), ids
" && grep -q "9 prefilled" "$T/err"'
"$KVQ" generate --model "$T/q.gguf" --tokens "$T/ids10.bin" --steps 20 --kv q8_0 --batch 3 --threads 1 >"$T/out3" 2>/dev/null; rc=$?
check "generate --batch 3 --threads 1 runs the same prompt" '[ $rc -eq 0 ] && [ "$(cut -d" " -f1-10 "$T/out3")" = "$(cut -d" " -f1-10 "$T/out")" ] && [ "$(wc -w <"$T/out3")" -eq 21 ]'
/usr/bin/python3 -c "import numpy as np; np.array([1, 5, 300], dtype=np.uint32).tofile('$T/big.bin')"
"$KVQ" generate --model "$T/q.gguf" --tokens "$T/big.bin" --steps 20 >/dev/null 2>"$T/err"; rc=$?
check "generate --tokens with an id past the vocabulary exits 2" '[ $rc -eq 2 ] && grep -q "id 300 at position 2 is outside the vocabulary 0..299" "$T/err"'
"$KVQ" generate --model "$T/q.gguf" --tokens "$T/ids10.bin" --prompt "x" >/dev/null 2>"$T/err"; rc=$?
check "generate --tokens with --prompt exits 2" '[ $rc -eq 2 ] && grep -q "not with --prompt" "$T/err"'
"$KVQ" generate --model "$T/q.gguf" --tokens "$T/ids10.bin" --batch 0 >/dev/null 2>"$T/err"; rc=$?
check "generate --batch 0 exits 2" '[ $rc -eq 2 ]'
# kvq serve: bad options exit 2 before listening (the server itself: tests/serve_test.py).
"$KVQ" serve --kv nope --port 0 >/dev/null 2>"$T/err"; rc=$?
check "serve --kv nope exits 2" '[ $rc -eq 2 ] && grep -q "kv" "$T/err"'
"$KVQ" serve --kv-budget-mb 0 --port 0 >/dev/null 2>"$T/err"; rc=$?
check "serve --kv-budget-mb 0 exits 2" '[ $rc -eq 2 ]'
"$KVQ" serve --max-seqs 0 --port 0 >/dev/null 2>"$T/err"; rc=$?
check "serve --max-seqs 0 exits 2" '[ $rc -eq 2 ]'
"$KVQ" serve --model "$T/missing.gguf" --port 0 >/dev/null 2>"$T/err"; rc=$?
check "serve with a missing model exits 2" '[ $rc -eq 2 ] && grep -q "missing.gguf" "$T/err"'
/usr/bin/python3 -c "import socket,time; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); print(s.getsockname()[1], flush=True); time.sleep(30)" >"$T/port" &
busy=$!
for _ in $(seq 50); do [ -s "$T/port" ] && break; sleep 0.1; done
"$KVQ" serve --port "$(cat "$T/port")" >/dev/null 2>"$T/err"; rc=$?
kill $busy 2>/dev/null; wait $busy 2>/dev/null
check "serve on a port in use exits 2 naming it" '[ $rc -eq 2 ] && grep -q "cannot listen" "$T/err"'
# The same prompt as text and as ids (stories260K's tokenizer: BOS, "Once upon a time, Lily").
/usr/bin/python3 -c "import numpy as np; np.array([1, 403, 407, 261, 378, 432, 317], dtype=np.int32).tofile('$T/lily.bin')"
"$KVQ" generate --model "$T/s.gguf" --tokens "$T/lily.bin" --steps 60 >"$T/gt" 2>/dev/null; rc=$?
"$KVQ" generate --model "$T/s.gguf" --prompt "Once upon a time, Lily" --steps 60 >"$T/gp" 2>/dev/null
check "generate --tokens gives the text of the same prompt" '[ $rc -eq 0 ] && head -c 22 "$T/gt" | grep -q "^Once upon a time, Lily" && cmp -s "$T/gt" "$T/gp"'
head -c 3000 "$T/s.gguf" > "$T/cut.gguf"
"$KVQ" eval --model "$T/cut.gguf" >/dev/null 2>"$T/err"; rc=$?
check "a truncated GGUF exits 2" '[ $rc -eq 2 ] && grep -q "GGUF truncated\|past the end\|bytes left can hold" "$T/err"'

# Grouped low-bit schemes: by name, by --k/--v, presets; steady-state bits
# in the table and both bit counts in JSON; calibration stated.
"$KVQ" eval --kv k4v3g16r4,kvq-4.5 --ctx 64 --max-windows 2 --json "$T/g.json" >"$T/out" 2>"$T/err"; rc=$?
check "grouped eval succeeds" '[ $rc -eq 0 ] && grep -q "| k4v3g16r4" "$T/out" && grep -q "| kvq-4.5" "$T/out"'
check "grouped eval states its bits and calibration" 'grep -q "steady state" "$T/out" && grep -q "tokens the model generated" "$T/out"'
# A preset on a model with a small token table holds layer 0 as token ids
# and says what it resolved to and what it is without the table.
check "a preset resolves with layer 0 as token ids" 'grep -q "kvq-4.5 = t0+k[0-9a-z]* (5 layers, heads of 8, ctx 64, the model.s token table at most 64 MiB; k4av3g64p8o8r16 without it)" "$T/out" && grep -q "^t0+: layer 0 held as token ids" "$T/out"'
check "grouped JSON has both bit counts" '/usr/bin/python3 -c "
import json
r=json.load(open(\"$T/g.json\"))[\"results\"]
assert [x[\"scheme\"] for x in r][:2]==[\"fp32\",\"k4v3g16r4\"], r
assert r[2][\"label\"]==\"kvq-4.5\" and r[2][\"scheme\"].startswith(\"t0+k\"), r[2]
g=r[1]; assert 4 < g[\"bits_per_element\"] < 16 and g[\"bits_at_ctx\"] > 0, g
"'
"$KVQ" eval --k g4 --v g2 --group 32 --recent 8 --keep-first 2 --ctx 64 --max-windows 1 >"$T/out" 2>"$T/err"; rc=$?
check "--k/--v build one grouped scheme" '[ $rc -eq 0 ] && grep -q "| k4v2g32r8s2" "$T/out"'
"$KVQ" eval --k cal4 --v cal3 --ctx 64 --max-windows 1 --calib-sequences 2 >"$T/out" 2>"$T/err"; rc=$?
check "--k/--v calibrated" '[ $rc -eq 0 ] && grep -q "| k4v3c" "$T/out" && grep -q "2 sequences" "$T/out"'
for bad in "--k g4 --v q4_0" "--k q4_0 --v q8_0" "--k g4" "--k g4 --v g4 --group 24" "--k g9 --v g4" "--kv q4_0 --k g4 --v g4" \
           "--kv k4v4g24" "--kv k4v4co8" "--kv k4v4c --calib-clip 0.5" "--kv k4v4c --calib-temperature 0"; do
  rm -f "$T/bad.json"
  "$KVQ" eval $bad --ctx 64 --max-windows 1 --json "$T/bad.json" >/dev/null 2>"$T/err"; rc=$?
  check "eval $bad exits 2 with one line" '[ $rc -eq 2 ] && [ $(wc -l < "$T/err") -eq 1 ] && grep -q "^kvq: error: " "$T/err" && [ ! -e "$T/bad.json" ]'
done

"$KVQ" eval --kv fp32 --ctx 64 --max-windows 2 --window 16 --window-chunk 8 >"$T/out" 2>"$T/err"; rc=$?
check "eval --window adds the windowed rows" '[ $rc -eq 0 ] && grep -q "| win 16+4 " "$T/out" && grep -q "| e2 16+4+bank " "$T/out" && grep -q "=e2" "$T/out"'
# llama-perplexity's protocol: its running line and final estimate; bad uses exit 2 naming the option.
"$KVQ" eval --protocol llama-perplexity --kv fp32,q4_0 --ctx 64 --max-windows 3 --json "$T/lp.json" >"$T/out" 2>"$T/err"; rc=$?
check "eval --protocol llama-perplexity prints the running line and final estimate" '[ $rc -eq 0 ] && grep -q "^fp32: \[1\][0-9.]*,\[2\][0-9.]*,\[3\][0-9.]*,$" "$T/out" && grep -q "^q4_0: Final estimate: PPL = " "$T/out" && grep -q "3 chunks of ctx 64 (llama-perplexity" "$T/out" && grep -q "\"protocol\": \"llama-perplexity\"" "$T/lp.json"'
printf 'Once upon a time there was a cat.\n' >"$T/short.txt"
"$KVQ" eval --protocol llama-perplexity --kv fp32 --ctx 64 --text "$T/short.txt" >/dev/null 2>"$T/err"; rc=$?
check "eval --protocol llama-perplexity on too short a text exits 2" '[ $rc -eq 2 ] && grep -q "needs at least 2 ctx" "$T/err"'
"$KVQ" eval --protocol bogus >/dev/null 2>"$T/err"; rc=$?
check "eval --protocol bogus exits 2" '[ $rc -eq 2 ] && grep -q -- "--protocol" "$T/err"'
"$KVQ" eval --protocol llama-perplexity --kv fp32 --window 8 >/dev/null 2>"$T/err"; rc=$?
check "eval --protocol llama-perplexity with --window exits 2" '[ $rc -eq 2 ] && grep -q -- "--window" "$T/err"'
# Both protocols in one call: each one's tables in turn, the JSON's runs under "protocols" (each the
# figures a call with that protocol alone prints).
"$KVQ" eval --protocol kvq,llama-perplexity --kv fp32,q4_0 --ctx 64 --max-windows 3 --json "$T/both.json" >"$T/out" 2>"$T/err"; rc=$?
check "eval --protocol kvq,llama-perplexity runs both, the JSON holds each run" '[ $rc -eq 0 ] && grep -q "^== protocol kvq$" "$T/out" && grep -q "^== protocol llama-perplexity$" "$T/out" && grep -q "^q4_0: Final estimate: PPL = " "$T/out" && /usr/bin/python3 -c "
import json, sys
b = json.load(open(sys.argv[1])); lp = json.load(open(sys.argv[2]))
runs = b[\"protocols\"]
assert [r[\"protocol\"] for r in runs] == [\"kvq\", \"llama-perplexity\"] and b[\"protocol\"] == \"kvq\"
want = {r[\"label\"]: r[\"ppl\"] for r in lp[\"results\"]}
got = {r[\"label\"]: r[\"ppl\"] for r in runs[1][\"results\"]}
assert got == want, (got, want)
" "$T/both.json" "$T/lp.json"'
"$KVQ" eval --protocol kvq,kvq --kv fp32 >/dev/null 2>"$T/err"; rc=$?
check "eval --protocol kvq,kvq exits 2" '[ $rc -eq 2 ] && grep -q "given twice" "$T/err"'
"$KVQ" eval --protocol kvq,llama-perplexity --kv fp32 --window 8 >/dev/null 2>"$T/err"; rc=$?
check "eval --protocol kvq,llama-perplexity with --window exits 2" '[ $rc -eq 2 ] && grep -q -- "--window" "$T/err"'
"$KVQ" eval --kv fp32 --window -3 >/dev/null 2>"$T/err"; rc=$?
check "eval --window -3 exits 2 naming it" '[ $rc -eq 2 ] && grep -q -- "--window" "$T/err"'

"$KVQ" receipts --ctx 64 --chunk 32 --max-windows 2 --json "$T/r.json" >"$T/out" 2>"$T/err"; rc=$?
check "receipts succeeds" '[ $rc -eq 0 ]'
check "receipts prints a table" 'grep -q "| layer | clusters" "$T/out" && grep -q "^| 4 |" "$T/out"'
check "receipts JSON is valid" '/usr/bin/python3 -c "
import json
j=json.load(open(\"$T/r.json\"))
assert j[\"chunk\"]==32 and j[\"windows\"]==2 and len(j[\"layers\"])==5, j
assert all(l[\"tokens\"]==128 and -1<=l[\"spearman_int8_v\"]<=1 for l in j[\"layers\"])
"'
"$KVQ" receipts --max-clusters 0 >/dev/null 2>"$T/err"; rc=$?
check "receipts --max-clusters 0 exits 2 naming it" '[ $rc -eq 2 ] && grep -q "max_clusters" "$T/err"'

# ---- hostile input (issue 19): exit 2 with one line, never a crash or abort
# Errors found before any work: stderr is that one line. Errors found while
# running (a NaN weight) may follow progress lines: the error is the last line.
one_line() { [ "$(wc -l < "$T/err")" -eq 1 ] && grep -q "^kvq: error: " "$T/err"; }
last_line() { [ "$(grep -c "^kvq: error: " "$T/err")" -eq 1 ] && tail -n 1 "$T/err" | grep -q "^kvq: error: "; }
for n in 100000 1000000000 -1; do
  "$KVQ" eval --kv fp32 --threads "$n" >/dev/null 2>"$T/err"; rc=$?
  check "--threads $n exits 2 naming threads" '[ $rc -eq 2 ] && grep -q "threads" "$T/err" && one_line'
done
for opt in "--max-clusters 0" "--ridge -1" "--birth-distance nan" "--closure gauss"; do
  "$KVQ" eval --kv fp32 --ctx 32 --max-windows 2 --window 8 $opt --json "$T/w.json" >/dev/null 2>"$T/err"; rc=$?
  check "eval --window 8 $opt exits 2 with one line, no JSON" '[ $rc -eq 2 ] && one_line && [ ! -e "$T/w.json" ]'
done
"$KVQ" eval --kv fp32 --text /dev/zero >/dev/null 2>"$T/err"; rc=$?
check "--text /dev/zero is refused" '[ $rc -eq 2 ] && grep -q "not a regular file" "$T/err"'
"$KVQ" eval --kv fp32 --text "$T" >/dev/null 2>"$T/err"; rc=$?
check "--text DIR is refused" '[ $rc -eq 2 ] && grep -q "not a regular file" "$T/err"'
# --json never destroys an input, nor follows what sits beside it.
cp "$SHARED/data/tinystories-valid-dev.txt" "$T/text.txt"; cp "$MODEL" "$T/model.bin"
"$KVQ" eval --kv fp32 --ctx 32 --max-windows 2 --text "$T/text.txt" --json "$T/text.txt" >/dev/null 2>"$T/err"; rc=$?
check "--json naming the text is refused" '[ $rc -eq 2 ] && grep -q "input" "$T/err" && cmp -s "$T/text.txt" "$SHARED/data/tinystories-valid-dev.txt"'
ln -s "$T/model.bin" "$T/link.json"
"$KVQ" eval --kv fp32 --ctx 32 --max-windows 2 --model "$T/model.bin" --json "$T/link.json" >/dev/null 2>"$T/err"; rc=$?
check "--json linking to the model is refused" '[ $rc -eq 2 ] && cmp -s "$T/model.bin" "$MODEL"'
"$KVQ" eval --kv fp32 --ctx 32 --max-windows 2 --json "$T" >/dev/null 2>"$T/err"; rc=$?
check "--json DIR is refused before the run" '[ $rc -eq 2 ] && grep -q "directory" "$T/err"'
"$KVQ" eval --kv fp32 --ctx 32 --max-windows 2 --json "$T/no/such/dir/x.json" >/dev/null 2>"$T/err"; rc=$?
check "--json in a missing directory is refused" '[ $rc -eq 2 ] && grep -q "does not exist" "$T/err"'
echo victim > "$T/victim"; ln -s "$T/victim" "$T/ok2.json.tmp"
"$KVQ" eval --kv fp32 --ctx 32 --max-windows 2 --json "$T/ok2.json" >/dev/null 2>"$T/err"; rc=$?
check "--json leaves a symlink beside it alone and no temp file" '[ $rc -eq 0 ] && [ "$(cat "$T/victim")" = victim ] && [ -s "$T/ok2.json" ] && [ -z "$(ls -A "$T" | grep -E "^[.]?ok2[.]json[.].{6}$|^[.]kvq-")" ]'
# Small, odd or broken models: a clear error, never a read past a table.
PY=/usr/bin/python3; MK="$(dirname "$0")/make_checkpoint.py"
for v in 10 100; do
  $PY "$MK" model "$T/m$v.bin" --vocab $v && $PY "$MK" tokenizer "$T/t$v.bin" --vocab $v
  for cmd in eval generate; do
    "$KVQ" $cmd --model "$T/m$v.bin" --tokenizer "$T/t$v.bin" >/dev/null 2>"$T/err"; rc=$?
    check "$cmd with vocab $v exits 2 naming the vocabulary" '[ $rc -eq 2 ] && grep -q "vocab_size $v is below 259" "$T/err"'
  done
done
$PY "$MK" tokenizer "$T/t300.bin" --vocab 300; $PY "$MK" model "$T/nan.bin" --vocab 300 --nan-bos
"$KVQ" eval --model "$T/nan.bin" --tokenizer "$T/t300.bin" --kv fp32,int8 --ctx 16 --json "$T/n.json" >/dev/null 2>"$T/err"; rc=$?
check "a NaN BOS embedding exits 2, no JSON" '[ $rc -eq 2 ] && last_line && grep -q "finite" "$T/err" && [ ! -e "$T/n.json" ]'
$PY "$MK" model "$T/hs6.bin" --vocab 300 --dim 12 --heads 2 --kv-heads 2
"$KVQ" eval --model "$T/hs6.bin" --tokenizer "$T/t300.bin" --kv int8 --ctx 16 >/dev/null 2>"$T/err"; rc=$?
check "a head size the KV layout rejects exits 2" '[ $rc -eq 2 ] && one_line && grep -q "head_dim" "$T/err"'
"$KVQ" receipts --model "$T/hs6.bin" --tokenizer "$T/t300.bin" --ctx 16 >/dev/null 2>"$T/err"; rc=$?
check "receipts: the same, exit 2" '[ $rc -eq 2 ] && one_line'
$PY "$MK" model "$T/m300.bin" --vocab 300
"$KVQ" eval --model "$T/m300.bin" --tokenizer "$T/t300.bin" --kv fp32,int8 --ctx 16 --max-windows 4 >"$T/out" 2>"$T/err"; rc=$?
check "a small random model evaluates" '[ $rc -eq 0 ] && grep -q "| int8" "$T/out"'

"$KVQ" generate --steps 20 >"$T/gen" 2>"$T/err"; rc=$?
check "generate succeeds" '[ $rc -eq 0 ]'
check "generate stdout is the text only" 'head -c 16 "$T/gen" | grep -q "^Once upon a time" && ! grep -q "tok/s" "$T/gen"'
check "generate stats on stderr" 'grep -q "tok/s" "$T/err"'
"$KVQ" generate --kv q8_0 --prompt "Lily" --steps 30 --temperature 0.8 --seed 3 >"$T/gen2" 2>/dev/null; rc=$?
check "generate with prompt and sampling" '[ $rc -eq 0 ] && grep -q "^Lily" "$T/gen2"'
"$KVQ" generate --kv kvq-4.5 --steps 80 >"$T/gen3" 2>"$T/err"; rc=$?
check "generate with a grouped preset" '[ $rc -eq 0 ] && head -c 16 "$T/gen3" | grep -q "^Once upon a time" && grep -q "kv kvq-4.5 = t0+k[0-9a-z]* (.* bits/element at 80 tokens, [0-9]* bytes)" "$T/err"'
"$KVQ" generate --kv k4v4g24 >/dev/null 2>"$T/err"; rc=$?
check "generate with a bad grouped scheme exits 2" '[ $rc -eq 2 ] && grep -q "multiple of 16" "$T/err"'
# Prompt caches: a saved prompt restores into the same text; every mismatch
# is a clear error.
P="Once upon a time, Lily found a"
for kv in t0+kvq-4.5 kvq-4.5 q8_0; do
  "$KVQ" generate --kv $kv --prompt "$P" --steps 70 --save-cache "$T/p.kvqs" >"$T/s1" 2>"$T/err"; rc=$?
  check "generate --save-cache with $kv" '[ $rc -eq 0 ] && [ -s "$T/p.kvqs" ] && grep -q "saved [0-9]* tokens to" "$T/err"'
  "$KVQ" generate --prompt "$P" --steps 70 --load-cache "$T/p.kvqs" >"$T/s2" 2>"$T/err"; rc=$?
  check "generate --load-cache with $kv continues as uninterrupted" '[ $rc -eq 0 ] && cmp -s "$T/s1" "$T/s2" && grep -q "restored [0-9]* tokens" "$T/err" && grep -q "evaluating 1 prompt token" "$T/err"'
  "$KVQ" generate --prompt "$P big red" --steps 70 --load-cache "$T/p.kvqs" >"$T/s3" 2>"$T/err"; rc=$?
  check "generate --load-cache with a longer prompt ($kv)" '[ $rc -eq 0 ] && grep -q "evaluating [2-9] prompt token" "$T/err" && "$KVQ" generate --kv $kv --prompt "$P big red" --steps 70 2>/dev/null | cmp -s - "$T/s3"'
done
"$KVQ" generate --prompt "Once upon a day, Tom found a red ball in the park" --steps 70 --load-cache "$T/p.kvqs" >/dev/null 2>"$T/err"; rc=$?
check "generate --load-cache with another prompt exits 2" '[ $rc -eq 2 ] && grep -q "first [0-9]* tokens are not" "$T/err"'
"$KVQ" generate --kv int8 --prompt "$P" --load-cache "$T/p.kvqs" >/dev/null 2>"$T/err"; rc=$?
check "generate --load-cache with another --kv exits 2" '[ $rc -eq 2 ] && grep -q "scheme is q8_0" "$T/err"'
cp "$T/p.kvqs" "$T/bad.kvqs" && printf '\x01' | dd of="$T/bad.kvqs" bs=1 seek=40 conv=notrunc 2>/dev/null
"$KVQ" generate --prompt "$P" --load-cache "$T/bad.kvqs" >/dev/null 2>"$T/err"; rc=$?
check "generate --load-cache of a corrupted file exits 2" '[ $rc -eq 2 ] && grep -q "saved KV cache" "$T/err"'
head -c 100 "$T/p.kvqs" >"$T/short.kvqs"
"$KVQ" generate --prompt "$P" --load-cache "$T/short.kvqs" >/dev/null 2>"$T/err"; rc=$?
check "generate --load-cache of a truncated file exits 2" '[ $rc -eq 2 ] && grep -q "saved KV cache" "$T/err"'
if [ -f "$SHARED/models/stories260K/tok512.bin" ]; then  # the same geometry, other weights: the fingerprint
  $PY "$MK" model "$T/other.bin" --dim 64 --hidden 172 --layers 5 --heads 8 --kv-heads 4 --vocab 512 --seq 512
  "$KVQ" generate --model "$T/other.bin" --prompt "$P" --load-cache "$T/p.kvqs" >/dev/null 2>"$T/err"; rc=$?
  check "generate --load-cache on another model exits 2 naming the fingerprint" '[ $rc -eq 2 ] && grep -q "fingerprint" "$T/err"'
fi
"$KVQ" generate --prompt "$P" --save-cache "$SHARED/models/stories260K/stories260K.bin" >/dev/null 2>"$T/err"; rc=$?
check "generate --save-cache over the model exits 2" '[ $rc -eq 2 ] && grep -q "refusing to overwrite" "$T/err"'
"$KVQ" generate --save-cache "$T/empty.kvqs" >/dev/null 2>"$T/err"; rc=$?
check "generate --save-cache without a prompt exits 2" '[ $rc -eq 2 ] && [ ! -e "$T/empty.kvqs" ]'
"$KVQ" generate --steps 9999 >/dev/null 2>"$T/err"; rc=$?
check "generate --steps out of range exits 2" '[ $rc -eq 2 ]'

# The prefix store: identical text with no store, a cold store, a warm one,
# a corrupted one, Redis and a dead Redis, for every row scheme and preset.
LP="Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends. One day, she saw a big red ball stuck in a tall tree. She wanted to play with it, but it was too high. Lily asked her mom to help her get the ball. Her mom said yes and they went to the park together. They found a long stick and pushed the ball until it fell down. Lily was so happy that she hugged her mom and said thank you. Then they played catch until the sun went down and it was time to go home for dinner. At home, Lily told her dad about the ball and the tree and the stick."
RPORT=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
DPORT=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
RPID=
if command -v redis-server >/dev/null; then
  redis-server --port "$RPORT" --bind 127.0.0.1 --save "" --appendonly no --logfile /dev/null & RPID=$!
  for _ in $(seq 100); do redis-cli -p "$RPORT" ping >/dev/null 2>&1 && break; sleep 0.05; done
elif [ "${KVQ_REQUIRE_DATA:-0}" = "1" ]; then
  check "redis-server is installed (scripts/install_deps.sh)" 'false'
fi
PC_SCHEMES="fp32 fp16 bf16 int8 int8-head fp8-e4m3 fp8-e4m3-scaled fp8-e5m2 q8_0 q4_0 kvq-6.5 kvq-4.5 kvq-3.5 kvq-2.5"
# KVQ_TEST_QUICK=1 (the sanitizer preset): one scheme of each family's code
if [ "${KVQ_TEST_QUICK:-0}" = "1" ]; then PC_SCHEMES="fp16 int8 fp8-e4m3-scaled q4_0 kvq-4.5 kvq-2.5"; fi
for kv in $PC_SCHEMES; do
  "$KVQ" generate --kv $kv --prompt "$LP" --steps 300 >"$T/pc_ref" 2>"$T/err" || check "generate --kv $kv runs" 'false'
  rm -rf "$T/pc"
  "$KVQ" generate --kv $kv --prompt "$LP" --steps 300 --prompt-cache "$T/pc" --prompt-cache-chunk 48 >"$T/pc_cold" 2>"$T/err"; rc=$?
  check "$kv: cold store, same text, says 0 reused" '[ $rc -eq 0 ] && cmp -s "$T/pc_ref" "$T/pc_cold" && grep -q "prompt cache: reused 0 of [0-9]* prompt tokens" "$T/err" && ls "$T/pc" | grep -q "[.]kvqr$"'
  "$KVQ" generate --kv $kv --prompt "$LP" --steps 300 --prompt-cache "$T/pc" --prompt-cache-chunk 48 >"$T/pc_warm" 2>"$T/err"; rc=$?
  check "$kv: warm store, same text, reuses its chunks" '[ $rc -eq 0 ] && cmp -s "$T/pc_ref" "$T/pc_warm" && grep -q "prompt cache: reused [1-9][0-9]* of" "$T/err"'
  for f in "$T"/pc/*.kvqr; do printf '\x5a' | dd of="$f" bs=1 seek=60 conv=notrunc 2>/dev/null; done
  "$KVQ" generate --kv $kv --prompt "$LP" --steps 300 --prompt-cache "$T/pc" --prompt-cache-chunk 48 >"$T/pc_bad" 2>"$T/err"; rc=$?
  check "$kv: corrupted store, same text, one warning, recomputed" '[ $rc -eq 0 ] && cmp -s "$T/pc_ref" "$T/pc_bad" && [ "$(grep -c "is unusable" "$T/err")" -eq 1 ] && grep -q "reused 0 of" "$T/err"'
  "$KVQ" generate --kv $kv --prompt "$LP" --steps 300 --prompt-cache "$T/pc" --prompt-cache-chunk 48 >"$T/pc_fix" 2>"$T/err"; rc=$?
  check "$kv: the corrupted chunks were overwritten" '[ $rc -eq 0 ] && cmp -s "$T/pc_ref" "$T/pc_fix" && grep -q "reused [1-9][0-9]* of" "$T/err" && ! grep -q "unusable" "$T/err"'
  if [ -n "$RPID" ]; then
    for run in cold warm; do
      "$KVQ" generate --kv $kv --prompt "$LP" --steps 300 --prompt-cache "redis://127.0.0.1:$RPORT/1" --prompt-cache-chunk 48 >"$T/pc_r" 2>"$T/err"; rc=$?
      check "$kv: redis $run, same text" '[ $rc -eq 0 ] && cmp -s "$T/pc_ref" "$T/pc_r" && ! grep -q "prefix store" "$T/err"'
    done
    check "$kv: redis warm reused its chunks" 'grep -q "reused [1-9][0-9]* of" "$T/err"'
  fi
  "$KVQ" generate --kv $kv --prompt "$LP" --steps 300 --prompt-cache "redis://u:topsecret@127.0.0.1:$DPORT" --prompt-cache-chunk 48 >"$T/pc_d" 2>"$T/err"; rc=$?
  check "$kv: dead redis, same text, one warning without the password" '[ $rc -eq 0 ] && cmp -s "$T/pc_ref" "$T/pc_d" && [ "$(grep -c "continuing without the store" "$T/err")" -eq 1 ] && ! grep -q topsecret "$T/err" && grep -q "reused 0 of" "$T/err"'
done
if [ -n "$RPID" ]; then
  "$KVQ" generate --kv kvq-2.5 --prompt "$LP" --steps 300 --prompt-cache "redis://:wrongpw@127.0.0.1:$RPORT" --prompt-cache-chunk 48 >"$T/pc_r" 2>"$T/err"; rc=$?
  check "redis with a password the server does not want: same text, a warning without it" '[ $rc -eq 0 ] && cmp -s "$T/pc_ref" "$T/pc_r" && grep -q "AUTH refused" "$T/err" && ! grep -q wrongpw "$T/err"'
  kill "$RPID"; wait "$RPID" 2>/dev/null
fi
# An authenticated store: chunks under one secret restore with it (file or
# KVQ_PREFIX_STORE_KEY), not under another (one warning, same text, the
# secret never printed); an empty secret is an error.
printf 'k1-s3cret\n' >"$T/key1"; printf 'k2-s3cret' >"$T/key2"; : >"$T/key0"
rm -rf "$T/pck"
"$KVQ" generate --kv q8_0 --prompt "$LP" --steps 300 >"$T/pck_ref" 2>/dev/null
"$KVQ" generate --kv q8_0 --prompt "$LP" --steps 300 --prompt-cache "$T/pck" --prompt-cache-chunk 48 --prompt-cache-key-file "$T/key1" >"$T/pck_out" 2>"$T/err"; rc=$?
check "keyed store: cold run, same text" '[ $rc -eq 0 ] && cmp -s "$T/pck_ref" "$T/pck_out" && grep -q "reused 0 of" "$T/err"'
KVQ_PREFIX_STORE_KEY=k1-s3cret "$KVQ" generate --kv q8_0 --prompt "$LP" --steps 300 --prompt-cache "$T/pck" --prompt-cache-chunk 48 >"$T/pck_out" 2>"$T/err"; rc=$?
check "keyed store: the same secret from KVQ_PREFIX_STORE_KEY reuses the chunks" '[ $rc -eq 0 ] && cmp -s "$T/pck_ref" "$T/pck_out" && grep -q "reused [1-9][0-9]* of" "$T/err" && ! grep -q unusable "$T/err"'
"$KVQ" generate --kv q8_0 --prompt "$LP" --steps 300 --prompt-cache "$T/pck" --prompt-cache-chunk 48 --prompt-cache-key-file "$T/key2" >"$T/pck_out" 2>"$T/err"; rc=$?
check "keyed store: another secret, one HMAC warning, same text, no secret printed" '[ $rc -eq 0 ] && cmp -s "$T/pck_ref" "$T/pck_out" && [ "$(grep -c "HMAC-SHA256" "$T/err")" -eq 1 ] && grep -q "reused 0 of" "$T/err" && ! grep -q s3cret "$T/err"'
"$KVQ" generate --kv q8_0 --prompt "$LP" --prompt-cache "$T/pck" --prompt-cache-key-file "$T/key0" >/dev/null 2>"$T/err"; rc=$?
check "an empty --prompt-cache-key-file exits 2" '[ $rc -eq 2 ] && grep -q "prompt-cache-key-file" "$T/err"'
# A 3-master Redis Cluster on loopback: cold and warm runs give the same
# text, the warm one reusing chunks spread over the masters; a master killed
# between runs: one warning, the same text.
if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
  CPIDS=(); CPORTS=()
  for i in 1 2 3; do
    p=$(/usr/bin/python3 -c 'import socket
for _ in range(200):  # a free port whose cluster bus port (+10000) is free too
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close()
    b = socket.socket()
    try:
        b.bind(("127.0.0.1", p + 10000)) if p <= 55535 else None
    except OSError:
        continue
    finally:
        b.close()
    if p <= 55535:
        print(p); break')
    mkdir -p "$T/cl$i"
    (cd "$T/cl$i" && exec redis-server --port "$p" --bind 127.0.0.1 --save "" --appendonly no --logfile /dev/null \
        --cluster-enabled yes --cluster-config-file "$T/cl$i/nodes.conf" --cluster-node-timeout 2000) & CPIDS+=($!)
    CPORTS+=("$p")
  done
  for p in "${CPORTS[@]}"; do for _ in $(seq 100); do redis-cli -p "$p" ping >/dev/null 2>&1 && break; sleep 0.05; done; done
  redis-cli --cluster create "127.0.0.1:${CPORTS[0]}" "127.0.0.1:${CPORTS[1]}" "127.0.0.1:${CPORTS[2]}" \
      --cluster-replicas 0 --cluster-yes >/dev/null 2>&1
  for _ in $(seq 200); do
    ok=0; for p in "${CPORTS[@]}"; do redis-cli -p "$p" cluster info 2>/dev/null | grep -q "cluster_state:ok" && ok=$((ok+1)); done
    [ $ok -eq 3 ] && break; sleep 0.05
  done
  check "a 3-master Redis Cluster started" '[ $ok -eq 3 ]'
  CURL="redis://127.0.0.1:${CPORTS[0]}"
  "$KVQ" generate --kv q8_0 --prompt "$LP" --steps 300 >"$T/cl_ref" 2>/dev/null
  "$KVQ" generate --kv q8_0 --prompt "$LP" --steps 300 --prompt-cache "$CURL" --prompt-cache-chunk 16 >"$T/cl_out" 2>"$T/err"; rc=$?
  check "cluster: cold run, same text, no warning" '[ $rc -eq 0 ] && cmp -s "$T/cl_ref" "$T/cl_out" && ! grep -q "prefix store" "$T/err"'
  n0=$(redis-cli -p "${CPORTS[0]}" dbsize); n1=$(redis-cli -p "${CPORTS[1]}" dbsize); n2=$(redis-cli -p "${CPORTS[2]}" dbsize)
  check "cluster: the chunks are spread over the three masters" '[ "$n0" -gt 0 ] && [ "$n1" -gt 0 ] && [ "$n2" -gt 0 ]'
  "$KVQ" generate --kv q8_0 --prompt "$LP" --steps 300 --prompt-cache "$CURL" --prompt-cache-chunk 16 >"$T/cl_out" 2>"$T/err"; rc=$?
  check "cluster: warm run, same text, reuses the chunks" '[ $rc -eq 0 ] && cmp -s "$T/cl_ref" "$T/cl_out" && grep -q "reused [1-9][0-9]* of" "$T/err" && ! grep -q "prefix store" "$T/err"'
  kill -9 "${CPIDS[2]}"; wait "${CPIDS[2]}" 2>/dev/null
  "$KVQ" generate --kv q8_0 --prompt "$LP" --steps 300 --prompt-cache "$CURL" --prompt-cache-chunk 16 >"$T/cl_out" 2>"$T/err"; rc=$?
  check "cluster: a master killed, one warning, same text" '[ $rc -eq 0 ] && cmp -s "$T/cl_ref" "$T/cl_out" && [ "$(grep -c "continuing without the store" "$T/err")" -eq 1 ]'
  kill -9 "${CPIDS[0]}" "${CPIDS[1]}" 2>/dev/null; wait "${CPIDS[0]}" "${CPIDS[1]}" 2>/dev/null
fi
"$KVQ" generate --prompt "$LP" --prompt-cache "$T/pc" --load-cache "$T/p.kvqs" >/dev/null 2>"$T/err"; rc=$?
check "--prompt-cache with --load-cache exits 2" '[ $rc -eq 2 ] && grep -q "prompt-cache" "$T/err"'
"$KVQ" generate --prompt "$LP" --prompt-cache "$T/pc" --prompt-cache-max-mb 1e-9 >/dev/null 2>"$T/err"; rc=$?
check "--prompt-cache-max-mb below one byte exits 2 (not: no cap)" '[ $rc -eq 2 ] && grep -q "at least one byte" "$T/err"'
"$KVQ" generate --prompt "$LP" --prompt-cache "http://x" >/dev/null 2>"$T/err"; rc=$?
check "--prompt-cache with an unsupported URL exits 2" '[ $rc -eq 2 ] && grep -q "unsupported URL" "$T/err"'
XDG_CACHE_HOME="$T/xdg" "$KVQ" generate --prompt "$LP" --steps 300 --prompt-cache --prompt-cache-chunk 48 >/dev/null 2>"$T/err"; rc=$?
check "--prompt-cache alone uses the default directory" '[ $rc -eq 0 ] && ls "$T/xdg/kvq/prefix" | grep -q "[.]kvqr$"'

"$KVQ" demo --tokens 64 --heads 2 --head-dim 64 >"$T/demo" 2>&1; rc=$?
check "demo runs" '[ $rc -eq 0 ] && grep -q "^int8" "$T/demo" && grep -q "^fp8" "$T/demo"'
# KVQ_TARGETS: the weakest supported target runs when named; an unknown name is exit 2, named.
weakest=$(sed -n 's/.*SIMD target [^ ]* (of: \([^)]*\)).*/\1/p' "$T/demo" | awk '{print $NF}')
KVQ_TARGETS="$weakest" "$KVQ" demo --tokens 64 --heads 2 --head-dim 64 >"$T/demo2" 2>&1; rc=$?
check "KVQ_TARGETS=$weakest runs on $weakest" '[ -n "$weakest" ] && [ $rc -eq 0 ] && grep -q "SIMD target $weakest " "$T/demo2"'
KVQ_TARGETS=AVX9 "$KVQ" demo --tokens 64 >/dev/null 2>"$T/err"; rc=$?
check "KVQ_TARGETS=AVX9 exits 2 naming it" '[ $rc -eq 2 ] && grep -q "KVQ_TARGETS: unknown SIMD target .AVX9." "$T/err"'
"$KVQ" nosuchcommand >/dev/null 2>&1; rc=$?
check "unknown subcommand exits 2" '[ $rc -eq 2 ]'

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
