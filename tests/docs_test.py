"""The README and docs/ stay true to each other and to the CLI:

- every relative link in README.md, ARCHITECTURE.md and docs/*.md names a file that exists;
- each figure of the README's headline table is the figure of the page its note names
  (docs/eval.md's eval table: bits, dPPL %, KLD; docs/performance.md's AVX3_DL and AVX2 warm
  and cold tables: x q4_0; docs/prefix-store.md's table: bytes / token);
- every `kvq <command> --option` in the README's and docs' code blocks is an option that
  `kvq <command> --help` lists;
- with EVAL_JSON (the JSON of `kvq eval --kv all --threads 2`, docs/eval.md's command, run on
  today's code): every row of docs/eval.md's table is what that run measured (bits and KV bytes,
  PPL, dPPL, KLD mean and max, top-1), to the digits printed (one unit of the last printed digit
  of slack: other CPUs run other SIMD targets, whose float sums differ in the last bits).

Usage: docs_test.py KVQ_BINARY [EVAL_JSON]
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KVQ = sys.argv[1]
fails = []


def fail(msg):
    fails.append(msg)
    print("FAIL:", msg)


pages = [ROOT / "README.md", ROOT / "ARCHITECTURE.md"] + sorted((ROOT / "docs").glob("*.md"))
for page in pages:
    text = page.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        if not (page.parent / target).exists():
            fail(f"{page.relative_to(ROOT)}: the link {target} names no file")


def table_rows(text, header_start):
    """Rows (lists of cells) of the first markdown table whose header begins with header_start."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(header_start):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip("|").split("|")])
            return rows
    fail(f"no table starting {header_start!r}")
    return []


readme = (ROOT / "README.md").read_text()
head = {r[0]: r for r in table_rows(readme, "| scheme | bits / element |")}
if len(head) < 7:
    fail(f"the README's headline table has {len(head)} rows, expected 7")

evaltxt = (ROOT / "docs" / "eval.md").read_text()
ev = {r[0]: r for r in table_rows(evaltxt, "| scheme          |   bits |")}
perf = (ROOT / "docs" / "performance.md").read_text()


def target_table(name):
    """scheme -> (x q4_0 warm, x q4_0 cold) from the target's warm and cold tables."""
    at = perf.find(f"**{name}**")
    if at < 0:
        fail(f"docs/performance.md has no {name} table")
        return {}
    warm = {r[0]: r[7] for r in table_rows(perf[at:], "| scheme | bits | T=16384 µs |")}
    cold = {r[0]: r[6] for r in table_rows(perf[at:], "| scheme | layers | cold T=16384 µs |")}
    return {k: (warm[k], cold.get(k, "?")) for k in warm}


avx3dl, avx2 = target_table("AVX3_DL"), target_table("AVX2")
store = {r[0]: r for r in table_rows((ROOT / "docs" / "prefix-store.md").read_text(), "| scheme | chunk tokens |")}


def close(a, b, digits):
    return abs(float(a) - float(b)) <= 0.5 * 10 ** -digits + 1e-12


for scheme, r in head.items():
    bits, dppl, kld, bpt, x3, x2 = r[1:7]
    e = ev.get(scheme)
    if e is None:
        fail(f"{scheme}: not in docs/eval.md's table")
        continue
    if bits != e[1]:
        fail(f"{scheme}: bits {bits} in the README, {e[1]} in docs/eval.md")
    got, want = (x.rstrip("%").replace("−", "-") for x in (dppl, e[5]))  # the README writes a true minus
    if not close(got, want, 1 if abs(float(want)) >= 100 else 3):
        fail(f"{scheme}: dPPL {dppl} in the README, {e[5]} in docs/eval.md")
    if not abs(float(kld) - float(e[6])) <= 0.051 * abs(float(e[6])) + 1e-12:
        fail(f"{scheme}: KLD {kld} in the README, {e[6]} in docs/eval.md")
    if scheme in store and bpt != store[scheme][3]:
        fail(f"{scheme}: bytes/token {bpt} in the README, {store[scheme][3]} in docs/prefix-store.md")
    for got, table, name in ((x3, avx3dl, "AVX3_DL"), (x2, avx2, "AVX2")):  # "warm / cold"
        want = " / ".join(table.get(scheme, ("?", "?")))
        if got != want:
            fail(f"{scheme}: x q4_0 warm / cold {got} on {name} in the README, {want} in docs/performance.md")

# Documented command lines: every --option of `kvq <command>` exists.
helps = {}
for page in pages:
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            m = re.search(r"(?:^|\s)(?:\S*/)?kvq (eval|generate|receipts|demo|serve)\b(.*)", line)
            if not m:
                continue
            cmd, rest = m.group(1), m.group(2).split("#")[0]
            if cmd not in helps:
                out = subprocess.run([KVQ, cmd, "--help"], capture_output=True, text=True)
                helps[cmd] = set(re.findall(r"(--[a-z0-9-]+)", out.stdout))
            for opt in re.findall(r"(?:^|\s)(--[a-z0-9-]+)", rest):
                if opt not in helps[cmd]:
                    fail(f"{page.relative_to(ROOT)}: `kvq {cmd}` has no option {opt}")

# docs/eval.md's table against a fresh run's JSON.
if len(sys.argv) > 2:
    import json
    results = {r["label"]: r for r in json.loads(Path(sys.argv[2]).read_text())["results"]}
    if set(results) != set(ev):
        fail(f"docs/eval.md lists {sorted(ev)}, the run measured {sorted(results)}")

    def unit(cell):
        """One unit of the last printed digit of a table cell (1.064e-03 -> 1e-06, 3.68767 -> 1e-05)."""
        c = cell.rstrip("%").lstrip("+-")
        if "e" in c:
            mant, exp = c.split("e")
            return 10.0 ** (int(exp) - (len(mant.split(".")[1]) if "." in mant else 0))
        return 10.0 ** -(len(c.split(".")[1]) if "." in c else 0)

    for scheme, row in ev.items():
        r = results.get(scheme)
        if r is None:
            continue
        for col, key in ((1, "bits_per_element"), (2, "kv_bytes"), (3, "ppl"), (4, "delta_ppl"),
                         (5, "delta_ppl_pct"), (6, "kld_mean"), (7, "kld_max"), (8, "top1_pct")):
            cell = row[col]
            want = float(cell.rstrip("%"))
            slack = unit(cell) * (1.5 if key != "kv_bytes" else 0) + (0.001 * want if key == "kv_bytes" else 0)
            if not abs(float(r[key]) - want) <= slack + 1e-12:
                fail(f"docs/eval.md: {scheme} {key} {cell}, the run measured {r[key]}")

checked = sum(1 for _ in head)
print(f"docs_test: {len(pages)} pages, {checked} headline rows, {len(helps)} commands checked; "
      f"{len(fails)} failure(s)")
sys.exit(1 if fails else 0)
