#!/usr/bin/env python3
"""Plots the quality/size frontier of a `kvq eval --json` run.

  plot_frontier.py OUT.json FRONTIER.svg [--png FRONTIER.png]

Two panels against bits per K/V element: dPPL % (symlog: the broken schemes
sit two decades above the good ones) and mean KLD vs fp32 (log). One labelled
point per row of the run (fp32 itself is the reference and is left out);
dashed lines mark fp16 and int8, the references a lower-bit scheme has to
reach. Uses Debian's python3-matplotlib (installed by scripts/install_deps.sh).
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("svg")
    ap.add_argument("--png", help="also write a PNG")
    a = ap.parse_args()
    try:
        j = json.load(open(a.json))
        rows = [r for r in j["results"] if r["label"] != "fp32"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"plot_frontier: {a.json}: not a kvq eval JSON ({e})")
    if not rows:
        sys.exit(f"plot_frontier: {a.json}: no scheme besides fp32 to plot")
    refs = {r["label"]: r for r in rows if r["label"] in ("fp16", "int8")}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    panels = [("delta_ppl_pct", "ΔPPL vs fp32 (%)", "symlog"), ("kld_mean", "mean KLD vs fp32 (nats)", "log")]
    for ax, (key, title, scale) in zip(axes, panels):
        floor = 1e-7  # fp16's KLD is ~2e-6; a zero cannot sit on a log axis
        for r in rows:
            y = r[key] if scale == "symlog" else max(r[key], floor)
            windowed = r.get("window", 0) > 0
            ax.scatter(r["bits_per_element"], y, s=28, marker="s" if windowed else "o",
                       color="tab:orange" if windowed else "tab:blue", zorder=3)
            ax.annotate(r["label"], (r["bits_per_element"], y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        for name, style in (("fp16", ":"), ("int8", "--")):
            if name in refs:
                y = refs[name][key] if scale == "symlog" else max(refs[name][key], floor)
                ax.axhline(y, color="gray", linestyle=style, linewidth=0.9, label=f"{name} ({refs[name][key]:.3g})")
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=0.01)
            lo = min(r[key] for r in rows)
            ax.set_ylim(bottom=-0.1 if lo >= -0.1 else 2 * lo, top=3 * max(1.0, max(r[key] for r in rows)))
        else:
            ax.set_yscale("log")
            ax.set_ylim(top=3 * max(max(r[key] for r in rows), floor))
        ax.set_xlabel("bits per K/V element (all stored bits)")
        ax.set_ylabel(title)
        ax.grid(True, which="both", alpha=0.25)
        if refs:
            ax.legend(fontsize=7, loc="upper right")
    cfg = j.get("model_config", {})
    fig.suptitle(f"kvq eval: {j.get('tokens', '?')} tokens, ctx {j.get('ctx', '?')}, "
                 f"model dim {cfg.get('dim', '?')} x {cfg.get('n_layers', '?')} layers, head size "
                 f"{cfg.get('head_size', '?')}", fontsize=9)
    fig.savefig(a.svg, metadata={"Date": None})  # no timestamp: the SVG is reproducible
    if a.png:
        fig.savefig(a.png, dpi=100)


if __name__ == "__main__":
    main()
