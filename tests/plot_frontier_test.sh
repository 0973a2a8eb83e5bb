#!/usr/bin/env bash
# scripts/plot_frontier.py renders: a JSON in kvq eval's layout becomes an
# SVG that rsvg-convert turns into a PNG with real content (many colours,
# non-white area), and bad input is a clear error.
set -u
PLOT=$1
PY=/usr/bin/python3
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
pass=0; fail=0
check() { if eval "$2"; then pass=$((pass+1)); else echo "FAIL: $1"; fail=$((fail+1)); fi; }
cat > "$T/e.json" <<'JSON'
{"format_version": 2, "tokens": 151040, "ctx": 512, "model_config": {"dim": 64, "n_layers": 5, "head_size": 8},
 "results": [
  {"label": "fp32", "bits_per_element": 32, "delta_ppl_pct": 0, "kld_mean": 0, "window": 0},
  {"label": "fp16", "bits_per_element": 16, "delta_ppl_pct": -0.0001, "kld_mean": 2e-6, "window": 0},
  {"label": "int8", "bits_per_element": 9, "delta_ppl_pct": 0.269, "kld_mean": 2.4e-3, "window": 0},
  {"label": "q4_0", "bits_per_element": 4.5, "delta_ppl_pct": 222.0, "kld_mean": 1.17, "window": 0},
  {"label": "win 128+4", "bits_per_element": 8.25, "delta_ppl_pct": 0.63, "kld_mean": 6.3e-3, "window": 128}]}
JSON
$PY "$PLOT" "$T/e.json" "$T/f.svg" --png "$T/f.png"; rc=$?
check "plot exits 0" '[ $rc -eq 0 ] && [ -s "$T/f.svg" ] && [ -s "$T/f.png" ]'
check "the SVG holds the plot" '[ "$(grep -c "<path" "$T/f.svg")" -gt 20 ]'
rsvg-convert "$T/f.svg" -o "$T/r.png"; rc=$?
check "rsvg-convert renders the SVG" '[ $rc -eq 0 ] && [ -s "$T/r.png" ]'
check "the rendered PNG has content" '$PY -c "
import sys, numpy as np, matplotlib.image as im
for f in sys.argv[1:]:
    a = im.imread(f)[..., :3]
    h, w = a.shape[:2]
    assert w > 600 and h > 250, a.shape
    colours = len(np.unique((a * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    ink = float((a.sum(axis=2) < 2.9).mean())
    assert colours > 50 and 0.01 < ink < 0.5, (f, colours, ink)
" "$T/r.png" "$T/f.png"'
$PY "$PLOT" "$T/missing.json" "$T/x.svg" 2>"$T/err"; rc=$?
check "a missing JSON is a clear error" '[ $rc -ne 0 ] && grep -q "not a kvq eval JSON" "$T/err" && [ ! -e "$T/x.svg" ]'
echo '{"results": [{"label": "fp32"}]}' > "$T/only.json"
$PY "$PLOT" "$T/only.json" "$T/x.svg" 2>"$T/err"; rc=$?
check "a run with only fp32 is a clear error" '[ $rc -ne 0 ] && grep -q "no scheme" "$T/err"'
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
