#!/usr/bin/env python3
"""The presets' quality tiers on both protocols, both models and several contexts (issue 47's rule).

  /usr/bin/python3 scripts/robustness.py [--ctx 256,512] [--max-windows N] [--json out.json]
                                         [--require RULES] [--markdown]

For each model (stories260K: heads of 8; stories-hd64: heads of 64) and context it runs one
`kvq eval --protocol kvq,llama-perplexity` with q8_0, q4_0 and the four presets on the dev text, then
checks each preset against its tier, in the same run:

| preset  | bits <= | abs(dPPL) <= | KLD <= (x q8_0's) |
|---------|---------|--------------|-------------------|
| kvq-6.5 | 6.5     | 0.05%        | 0.2               |
| kvq-4.5 | 4.5     | 0.3%         | 0.6               |
| kvq-3.5 | 3.5     | 1%           | 3                 |
| kvq-2.5 | 2.5     | 5%           | 10                |

It prints one row per (model, protocol, ctx, preset) with each condition's figure and whether it
holds. --require names the conditions that must hold (a comma-separated list of
`preset:condition[:model[:protocol]]`, condition one of bits, dppl, kld; `all` for every one); the
script exits 1 when any of them misses, so CI runs it as a regression guard on what holds today
while the table says what does not yet.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIERS = {"kvq-6.5": (6.5, 0.05, 0.2), "kvq-4.5": (4.5, 0.3, 0.6), "kvq-3.5": (3.5, 1.0, 3.0),
         "kvq-2.5": (2.5, 5.0, 10.0)}
MODELS = {"stories260K": "models/stories260K/stories260K.bin", "stories-hd64": "models/stories-hd64/stories-hd64.bin"}
PROTOCOLS = ("kvq", "llama-perplexity")


def run_model(kvq, shared, model, ctx, max_windows, threads, extra):
    with tempfile.TemporaryDirectory(prefix="kvq-robust-") as d:
        out = Path(d) / "eval.json"
        cmd = [kvq, "eval", "--model", str(Path(shared) / MODELS[model]), "--protocol", ",".join(PROTOCOLS),
               "--ctx", str(ctx), "--kv", "q8_0,q4_0," + ",".join(TIERS) + extra, "--json", str(out)]
        if max_windows:
            cmd += ["--max-windows", str(max_windows)]
        if threads:
            cmd += ["--threads", str(threads)]
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def rows_of(model, ctx, j, refs):
    rows = []
    for run in j.get("protocols", [j]):
        res = {r["label"]: r for r in run["results"]}
        q8 = res["q8_0"]["kld_mean"]
        for name in ("q8_0", "q4_0"):
            r = res[name]
            refs.append({"model": model, "protocol": run["protocol"], "ctx": ctx, "scheme": name,
                         "bits": r["bits_per_element"], "dppl_pct": r["delta_ppl_pct"], "kld": r["kld_mean"]})
        for preset, (bits, dppl, kld_x) in TIERS.items():
            r = res[preset]
            rows.append({
                "model": model, "protocol": run["protocol"], "ctx": ctx, "preset": preset, "scheme": r["scheme"],
                "bits": r["bits_per_element"], "dppl_pct": r["delta_ppl_pct"], "kld": r["kld_mean"],
                "kld_q8_0": q8, "kld_x_q8_0": r["kld_mean"] / q8 if q8 > 0 else float("inf"),
                "q4_0_dppl_pct": res["q4_0"]["delta_ppl_pct"], "q4_0_kld": res["q4_0"]["kld_mean"],
                "holds": {"bits": r["bits_per_element"] <= bits, "dppl": abs(r["delta_ppl_pct"]) <= dppl,
                          "kld": r["kld_mean"] <= kld_x * q8},
                "windows": run["windows"], "tokens": run["tokens"]})
    return rows


def required(spec):
    """[(preset, condition, model or None, protocol or None)]"""
    if not spec:
        return []
    out = []
    for item in spec.split(","):
        parts = item.split(":")
        if parts == ["all"]:
            return [(p, c, None, None) for p in TIERS for c in ("bits", "dppl", "kld")]
        if len(parts) < 2 or parts[0] not in TIERS or parts[1] not in ("bits", "dppl", "kld"):
            sys.exit(f"--require: expected preset:bits|dppl|kld[:model[:protocol]], got '{item}'")
        model = parts[2] if len(parts) > 2 and parts[2] else None
        protocol = parts[3] if len(parts) > 3 and parts[3] else None
        if (model and model not in MODELS) or (protocol and protocol not in PROTOCOLS) or len(parts) > 4:
            sys.exit(f"--require: unknown model or protocol in '{item}'")
        out.append((parts[0], parts[1], model, protocol))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default=os.environ.get("KVQ_SHARED", str(ROOT.parent / "shared")))
    ap.add_argument("--kvq", default=str(ROOT / "build" / "release" / "kvq"))
    ap.add_argument("--ctx", default="256,512")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--max-windows", type=int, default=0, help="per model and protocol (0: the whole text)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--require", default="")
    ap.add_argument("--json")
    ap.add_argument("--from-json", help="print and check an earlier --json instead of running")
    a = ap.parse_args()
    need = required(a.require)
    refs = []
    if a.from_json:
        j = json.loads(Path(a.from_json).read_text())
        rows, refs = j["rows"], j.get("references", [])
    else:
        missing = [m for m in a.models.split(",") if not (Path(a.shared) / MODELS[m]).is_file()]
        if missing:
            msg = f"robustness: model(s) {missing} not found under {a.shared} (set KVQ_SHARED)"
            if os.environ.get("KVQ_REQUIRE_DATA") == "1":
                sys.exit(msg)
            print(msg + "; skipped", file=sys.stderr)
            return 0
        rows = []
        for m in a.models.split(","):
            for ctx in [int(c) for c in a.ctx.split(",")]:
                rows += rows_of(m, ctx, run_model(a.kvq, a.shared, m, ctx, a.max_windows, a.threads, ""), refs)
    print("| model | protocol | ctx | preset | scheme | bits | dPPL % | KLD | KLD / q8_0's | q4_0 dPPL % | q4_0 KLD |"
          " bits | dPPL | KLD |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---|---|")
    yes = {True: "yes", False: "**no**"}
    for r in rows:
        h = r["holds"]
        print(f"| {r['model']} | {r['protocol']} | {r['ctx']} | {r['preset']} | `{r['scheme']}` | {r['bits']:.3f} |"
              f" {r['dppl_pct']:+.3f} | {r['kld']:.2e} | {r['kld_x_q8_0']:.2f} | {r['q4_0_dppl_pct']:+.3f} |"
              f" {r['q4_0_kld']:.2e} | {yes[h['bits']]} | {yes[h['dppl']]} | {yes[h['kld']]} |")
    for r in refs:
        print(f"| {r['model']} | {r['protocol']} | {r['ctx']} | {r['scheme']} (reference) | `{r['scheme']}` |"
              f" {r['bits']:.3f} | {r['dppl_pct']:+.3f} | {r['kld']:.2e} | | | | | | |")
    held = sum(v for r in rows for v in r["holds"].values())
    print(f"\n{held} of {3 * len(rows)} conditions hold", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "references": refs}, indent=1) + "\n")
    misses = []
    for preset, cond, model, protocol in need:
        for r in rows:
            if r["preset"] == preset and (model is None or r["model"] == model) and \
                    (protocol is None or r["protocol"] == protocol) and not r["holds"][cond]:
                misses.append(f"{preset} {cond} on {r['model']} {r['protocol']} ctx {r['ctx']}")
    for m in misses:
        print("robustness: required condition missed:", m, file=sys.stderr)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
