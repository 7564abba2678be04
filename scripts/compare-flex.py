#!/usr/bin/env python3
"""Time PyTorch's FlexAttention on the bench's policy rows: the peer that runs
softcap, ALiBi and sliding windows, which SDPA's FA2 and cuDNN backends do not.

Reads our bench's JSON lines (benches/attention.rs, e.g. `--filter policy-scores
--timing graph --json ours.jsonl`), keeps the forward rows whose policy is none,
softcapC, alibi or a window (FlexAttention has no sinks: those rows are left
out), and times `torch.compile(flex_attention)` on each row's shape with the same
policy: softcap as the score_mod c * tanh(score / c), ALiBi as score - slope[h] *
|i + Skv - Sq - j| with the bench's slopes 2^(-8 (h + 1) / H), causal and windows
as block masks (key blocks outside the mask are skipped, as ours skip them).
Q/K/V are [B, H, S, D], FlexAttention's own layout, random normal; GQA through
enable_gqa. Timing as the bench's `--timing graph`: 10 calls captured in one
CUDA graph, each replay between two events, the median replay over 10 calls.

Prints, per row, our median, FlexAttention's, ours over FlexAttention's speed,
and each side's cost over its own plain row (same shape, policy none; the
window rows over the causal or full row of the same shape), as markdown, and
writes every raw number to --out. Ours and FlexAttention's medians are each
the median of the rounds' medians.

    python3 scripts/compare-flex.py --ours ours.jsonl --rounds 3 --out flex.json
    python3 scripts/compare-flex.py --ours ours.jsonl --raw flex.json   # the report again, no GPU
    python3 scripts/compare-flex.py --self-test      # no GPU: the report path
"""
import argparse
import json
import math
import re
import statistics
import sys
import time

CALLS_PER_GRAPH = 10
REPLAYS = 10
# Rows checked against the float64 reference per call: the last ones of batch
# 0, head 0 (the most keys under causal and window masks).
CHECK_ROWS = 64


def parse_policy(name):
    """("none" | "softcap" | "alibi" | "window", value) or None (no FlexAttention form)."""
    if name == "none":
        return ("none", None)
    if name == "alibi":
        return ("alibi", None)
    m = re.fullmatch(r"softcap([0-9.]+)", name)
    if m:
        return ("softcap", float(m.group(1)))
    m = re.fullmatch(r"window(\d+|inf)(?:-(\d+|inf))?", name)
    if m:
        bound = lambda s: None if s in (None, "inf") else int(s)
        # "windowL" alone is a left bound with right unbounded (the bench's name).
        return ("window", (bound(m.group(1)), bound(m.group(2))))
    return None


def read_ours(path):
    rows = []
    for line in open(path):
        j = json.loads(line)
        if j.get("kernel") != "forward" or parse_policy(j.get("policy", "none")) is None:
            continue
        rows.append(j)
    return rows


def shape_key(j):
    return (j["dtype"], j["batch"], j["heads"], j["kv_heads"], j["seqlen_q"], j["seqlen_k"], j["head_dim"])


def alibi_slopes(heads):
    return [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]


class Flex:
    def __init__(self):
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # Every row is its own shape and score_mod: one compiled graph each,
        # past dynamo's default of 8 per function (past it, flex runs eagerly).
        for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 1024)
        self.torch = torch
        self.create_block_mask = create_block_mask
        self.flex = torch.compile(flex_attention, dynamic=False)

    def mods(self, j, causal, policy):
        torch = self.torch
        off = j["seqlen_k"] - j["seqlen_q"]
        kind, value = policy
        score_mod = None
        if kind == "softcap":
            c = value
            score_mod = lambda s, b, h, q, kv: c * torch.tanh(s / c)
        elif kind == "alibi":
            slopes = torch.tensor(alibi_slopes(j["heads"]), device="cuda", dtype=torch.float32)
            score_mod = lambda s, b, h, q, kv: s - slopes[h] * (q + off - kv).abs()
        left, right = (None, 0 if causal else None)
        if kind == "window":
            left, right = value
            if causal:
                right = 0 if right is None else min(right, 0)
        mask_mod = None
        if left is not None or right is not None:
            def mask_mod(b, h, q, kv):
                keep = (q >= 0) & (kv >= 0)
                if left is not None:
                    keep = keep & (q + off - kv <= left)
                if right is not None:
                    keep = keep & (kv - (q + off) <= right)
                return keep
        return score_mod, mask_mod, (left, right)

    def run(self, j, policy):
        torch = self.torch
        dt = {"f16": torch.float16, "bf16": torch.bfloat16}[j["dtype"]]
        b, h, hkv, sq, sk, d = j["batch"], j["heads"], j["kv_heads"], j["seqlen_q"], j["seqlen_k"], j["head_dim"]
        score_mod, mask_mod, bounds = self.mods(j, j["causal"], policy)
        block_mask = None
        if mask_mod is not None:
            block_mask = self.create_block_mask(mask_mod, None, None, sq, sk, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(1234)
        q = torch.randn(b, h, sq, d, device="cuda", dtype=dt, generator=g)
        k = torch.randn(b, hkv, sk, d, device="cuda", dtype=dt, generator=g)
        v = torch.randn(b, hkv, sk, d, device="cuda", dtype=dt, generator=g)
        call = lambda: self.flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=hkv != h)
        t0 = time.time()
        out = call()
        torch.cuda.synchronize()
        compile_s = time.time() - t0
        err, tol = self.check(q, k, v, out, j, policy, bounds)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS_PER_GRAPH):
                call()
        for _ in range(3):
            graph.replay()
        times = []
        for _ in range(REPLAYS):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            graph.replay()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / CALLS_PER_GRAPH)
        del graph
        return {"median_ms": statistics.median(times), "compile_s": compile_s, "max_abs_err": err, "abs_tol": tol}

    def check(self, q, k, v, out, j, policy, bounds):
        """Max |out - ref| over the last CHECK_ROWS rows of batch 0, head 0, against float64."""
        torch = self.torch
        sq, sk, d = j["seqlen_q"], j["seqlen_k"], j["head_dim"]
        off = sk - sq
        rows = torch.arange(max(sq - CHECK_ROWS, 0), sq, device="cuda")
        qq = q[0, 0, rows].double()
        kk, vv = k[0, 0].double(), v[0, 0].double()
        s = qq @ kk.T / math.sqrt(d)
        kind, value = policy
        if kind == "softcap":
            s = value * torch.tanh(s / value)
        dist = (rows[:, None] + off - torch.arange(sk, device="cuda")[None, :]).double()
        if kind == "alibi":
            s = s - alibi_slopes(j["heads"])[0] * dist.abs()
        left, right = bounds
        if left is not None:
            s = s.masked_fill(dist > left, -math.inf)
        if right is not None:
            s = s.masked_fill(-dist > right, -math.inf)
        ref = torch.softmax(s, dim=-1) @ vv
        err = (out[0, 0, rows].double() - ref).abs().max().item()
        # A few units of the output dtype's rounding at the output's scale.
        eps = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8}[j["dtype"]]
        return err, 8 * eps * max(ref.abs().max().item(), 1.0)


def plain_of(rows_by_key, j):
    """The row this one's cost is measured against: same shape and causality,
    policy none; a window row against the causal (left bound, right 0) or full row."""
    kind, _ = parse_policy(j["policy"])
    if kind == "none":
        return None
    causal = j["causal"]
    if kind == "window":
        causal = causal or parse_policy(j["policy"])[1][1] == 0
    return rows_by_key.get((shape_key(j), causal, "none"))


def report(ours, flex, out_path, env):
    by_label = {}
    for j in ours:
        by_label.setdefault(j["label"], []).append(j)
    rows = []
    for label, js in by_label.items():
        j = dict(js[0])
        j["ours_ms"] = statistics.median(x["median_ms"] for x in js)
        f = flex.get(label, [])
        j["flex_ms"] = statistics.median(x["median_ms"] for x in f) if f else None
        j["flex_err"] = max((x["max_abs_err"] for x in f), default=None)
        j["flex_tol"] = f[0]["abs_tol"] if f else None
        rows.append(j)
    keyed = {(shape_key(j), j["causal"], j["policy"]): j for j in rows}
    lines = [
        f"FlexAttention (torch {env.get('torch')}, triton {env.get('triton')}) against ours on {env.get('gpu')}; "
        "both timed as CUDA-graph replays; medians of the rounds' medians.",
        "",
        "| row | ours ms | Flex ms | ours / Flex speed | ours over plain | Flex over plain | Flex max err (tol) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    def pct(a, b):
        if not (a and b):
            return ""
        return f"{b / a:.2f}x faster" if a < b else f"{100 * (a / b - 1):+.1f} %"
    for j in rows:
        p = plain_of(keyed, j)
        speed = f"{j['flex_ms'] / j['ours_ms']:.2f}x" if j["flex_ms"] else "n/a"
        flex_ms = f"{j['flex_ms']:.4f}" if j["flex_ms"] else "n/a"
        err = f"{j['flex_err']:.1e} ({j['flex_tol']:.1e})" if j["flex_err"] is not None else ""
        over_ours = pct(j["ours_ms"], p["ours_ms"]) if p else ""
        over_flex = pct(j["flex_ms"], p["flex_ms"]) if p else ""
        lines.append(f"| {j['label']} | {j['ours_ms']:.4f} | {flex_ms} | {speed} | {over_ours} | {over_flex} | {err} |")
    text = "\n".join(lines)
    print(text)
    if out_path:
        json.dump({"env": env, "rows": rows, "flex_raw": flex}, open(out_path, "w"), indent=1)
    bad = [j["label"] for j in rows if j["flex_err"] is not None and j["flex_err"] > j["flex_tol"]]
    if bad:
        print("FlexAttention outside tolerance:", bad)
    return text


def self_test():
    fake = []
    for policy, causal, ms in [("none", True, 1.0), ("softcap50", True, 1.2), ("alibi", True, 1.05),
                               ("window4096", True, 0.5), ("none", False, 2.0), ("window4096-4096", False, 0.9)]:
        label = f"policy-x forward f16 b1 h16/16 q16384 k16384 d128{' causal' if causal else ''}" + (
            "" if policy == "none" else f" {policy}")
        fake.append({"kernel": "forward", "dtype": "f16", "batch": 1, "heads": 16, "kv_heads": 16, "seqlen_q": 16384,
                     "seqlen_k": 16384, "head_dim": 128, "causal": causal, "policy": policy, "label": label,
                     "median_ms": ms})
    assert parse_policy("window4096") == ("window", (4096, None))
    assert parse_policy("window4096-4096") == ("window", (4096, 4096))
    assert parse_policy("winfow") is None and parse_policy("sinks0.5") is None
    flex = {j["label"]: [{"median_ms": 1.5 * j["median_ms"], "max_abs_err": 1e-4, "abs_tol": 1e-2}] for j in fake}
    text = report(fake, flex, None, {"gpu": "none (self-test)"})
    assert "+20.0 %" in text and "1.50x" in text, "softcap row's cost over plain, speed ratio"
    assert text.count("2.00x faster") == 2 and "2.22x faster" in text, "window rows against causal and full plain rows"
    print("self-test passed")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ours", help="our bench's JSON lines (any number of rounds of the same rows)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="every raw number as JSON")
    ap.add_argument("--raw", help="report from a --out file of an earlier (or cut short) run, no GPU")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.ours:
        ap.error("--ours is required")
    ours = read_ours(a.ours)
    if a.raw:
        saved = json.load(open(a.raw))
        return report(ours, saved["flex_raw"], None, saved["env"])
    import torch
    import triton

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    runner = Flex()
    flex = {}
    seen = {}
    for j in ours:
        seen.setdefault(j["label"], j)
    for r in range(a.rounds):
        for label, j in seen.items():
            res = runner.run(j, parse_policy(j["policy"]))
            flex.setdefault(label, []).append(res)
            print(f"round {r + 1}: {label}: {res['median_ms']:.4f} ms (first call {res['compile_s']:.1f} s, "
                  f"err {res['max_abs_err']:.1e})", file=sys.stderr, flush=True)
        if a.out:
            # What a run cut short by a time limit leaves for --raw.
            json.dump({"env": env, "flex_raw": flex}, open(a.out, "w"), indent=1)
    report(ours, flex, a.out, env)


if __name__ == "__main__":
    main()
