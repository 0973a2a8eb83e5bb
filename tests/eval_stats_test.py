#!/usr/bin/env python3
"""kvq eval's llama-perplexity statistics against a direct NumPy computation.

Runs `kvq eval --per-token --json` on a small slice of the dev text and
recomputes every statistic of every row from the per-token values with
NumPy: PPL and its standard error, ln(PPL_Q/PPL_fp32) +- se, KLD mean +- se,
median, 99th and 99.9th percentiles (numpy's linear interpolation) and max,
RMS dp +- se (delta method) and same-top +- se.
Usage: eval_stats_test.py KVQ_BINARY   (KVQ_SHARED or KVQ_DEFAULT_SHARED locate the model)
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

kvq = sys.argv[1]
shared = os.environ.get("KVQ_SHARED") or os.environ.get("KVQ_DEFAULT_SHARED", "../shared")
if not os.path.exists(os.path.join(shared, "models/stories260K/stories260K.bin")):
    if os.environ.get("KVQ_REQUIRE_DATA") == "1":
        sys.exit("FAIL: the model is missing under %s (KVQ_REQUIRE_DATA=1)" % shared)
    print("SKIP: no model under %s; set KVQ_SHARED" % shared)
    sys.exit(0)
env = dict(os.environ, KVQ_SHARED=shared)

with tempfile.TemporaryDirectory() as d:
    out = os.path.join(d, "e.json")
    for threads in (1, 2):
        subprocess.run([kvq, "eval", "--kv", "fp32,int8,q4_0,fp8-e4m3", "--ctx", "48", "--max-windows", "9",
                        "--window", "16", "--window-chunk", "8", "--threads", str(threads), "--per-token",
                        "--json", out], check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        j = json.load(open(out))
        if threads == 1:
            first = j
    assert j["format_version"] == 2 and j["model_config"]["vocab_size"] == 512, j.keys()
    assert "--per-token" in j["command_line"]
    n = j["tokens"]
    assert n == 48 * 9
    checked = 0

    def close(a, b, what, rel=1e-6, abs_=1e-12):
        assert abs(a - b) <= abs_ + rel * abs(b), (what, a, b)

    for r, r1 in zip(j["results"], first["results"]):
        # Thread count changes nothing but the speed.
        for k in r:
            if k not in ("tokens_per_s", "per_token"):
                assert r[k] == r1[k], (r["label"], k, r[k], r1[k])
        t = r["per_token"]
        nll, ref = np.array(t["nll"]), np.array(t["nll_fp32"])
        kld = np.array(t["kld"], np.float64)
        p, pref = np.array(t["p"]), np.array(t["p_fp32"])
        same = np.array(t["same_top"], np.float64)
        assert len(nll) == n
        label = r["label"]
        se = lambda x: np.std(x, ddof=1) / np.sqrt(len(x))
        ppl = np.exp(nll.mean())
        close(r["ppl"], ppl, label + " ppl")
        close(r["ppl_se"], ppl * se(nll), label + " ppl_se")
        close(r["ln_ppl_ratio"], (nll - ref).mean(), label + " ln ratio", abs_=1e-9)
        close(r["ln_ppl_ratio_se"], se(nll - ref), label + " ln ratio se", abs_=1e-9)
        close(r["kld_mean"], kld.mean(), label + " kld", rel=1e-5, abs_=1e-9)
        close(r["kld_se"], se(kld), label + " kld se", rel=1e-4, abs_=1e-9)
        for q, key in ((50, "kld_median"), (99, "kld_p99"), (99.9, "kld_p999")):
            close(r[key], np.percentile(kld, q), label + " " + key, rel=1e-6, abs_=1e-12)
        close(r["kld_max"], kld.max(), label + " kld max", rel=1e-6, abs_=1e-9)
        dp = p - pref
        rms = np.sqrt(np.mean(dp ** 2))
        close(r["rms_dp"], rms, label + " rms dp")
        if rms > 0:
            close(r["rms_dp_se"], se(dp ** 2) / (2 * rms), label + " rms dp se", rel=1e-5)
        f = same.mean()
        close(r["same_top"], f, label + " same top")
        close(r["same_top_se"], np.sqrt(f * (1 - f) / (n - 1)), label + " same top se")
        close(r["top1_pct"], 100 * f, label + " top1")
        checked += 1
    assert checked == 7, checked  # fp32, 3 schemes, win, e2, =e2
    assert j["results"][0]["kld_mean"] == 0 and j["results"][0]["ln_ppl_ratio"] == 0
    print("%d passed, 0 failed" % checked)
