#!/usr/bin/env python3
"""Time PyTorch SDPA's backward (FlashAttention-2 and cuDNN backends) on the
shapes of our backward bench, with the same method: CUDA events around
batches of back-to-back calls, the median over batches.

    cargo bench --bench backward -- --json ours.jsonl      # on a GPU host
    python3 scripts/compare-torch-backward.py --ours ours.jsonl --out DIR

Each PyTorch call is ``torch.autograd.grad(O, (Q, K, V), dO, retain_graph=True)``
after one forward: the backward kernels, their workspace and autograd's
dispatch, as a training step runs them. Writes DIR/compare-backward.md
(also printed) and DIR/compare-backward.json.

With ``--step``, ``--ours`` is the candle bench's JSON (``cargo bench
--features candle --bench candle_training -- --json ours.jsonl``) and each PyTorch
call is a whole step, the forward and ``torch.autograd.grad`` with dO = 1
(what candle's ``o.backward()`` seeds), beside our step through candle and
through flash-attn's own API; written as DIR/compare-step.md and .json.
"""
import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"FA2": SDPBackend.FLASH_ATTENTION, "cuDNN": SDPBackend.CUDNN_ATTENTION}


def time_median(call, reps):
    def batch(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    n = max(1, min(50, int(20.0 / batch(2)) + 1))
    return statistics.median_high([batch(n) for _ in range(reps)])


def torch_ms(row, backend, reps, step=False):
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[row["dtype"]]
    b, s, h, hkv, d = row["batch"], row["seqlen"], row["heads"], row["kv_heads"], row["head_dim"]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(heads):
        x = torch.rand(b, heads, s, d, device="cuda", dtype=torch.float32, generator=gen) * 2 - 1
        return x.to(dtype).requires_grad_(True)

    q, k, v = rand(h), rand(hkv), rand(hkv)
    d_o = torch.rand(b, h, s, d, device="cuda", generator=gen).to(dtype) * 2 - 1
    if step:
        d_o = torch.ones_like(d_o)
    try:
        with sdpa_kernel([backend]):
            sdpa = lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=row["causal"], enable_gqa=(h != hkv)
            )
            if step:
                grad = lambda: torch.autograd.grad(sdpa(), (q, k, v), d_o)
            else:
                out = sdpa()
                grad = lambda: torch.autograd.grad(out, (q, k, v), d_o, retain_graph=True)
            grad()
            torch.cuda.synchronize()
            return time_median(grad, reps)
    except RuntimeError as e:
        return f"n/a ({str(e).splitlines()[0][:60]})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--step", action="store_true")
    a = ap.parse_args()
    if a.step:
        return step_table(a)
    # SDPA has no softcap, ALiBi, sinks or packed sequences: those rows
    # compare with our own plain rows instead.
    rows = [json.loads(line) for line in open(a.ours) if line.strip()]
    rows = [r for r in rows if r.get("score", "plain") == "plain" and not r.get("varlen")]
    os.makedirs(a.out, exist_ok=True)
    out = []
    for r in rows:
        t = {name: torch_ms(r, be, a.reps) for name, be in BACKENDS.items()}
        out.append({"ours": r, "torch_ms": t})
    report(
        a,
        "compare-backward",
        "backward",
        ["ours ms", "ours TFLOP/s", "FA2 ms", "cuDNN ms",
         "speed vs FA2 (FA2 ms / ours)", "speed vs cuDNN (cuDNN ms / ours)"],
        lambda r, t: [
            f"{r['median_ms']:.4f}", f"{r['tflops']:.1f}", ms(t["FA2"]), ms(t["cuDNN"]),
            ratio(t["FA2"], r["median_ms"]), ratio(t["cuDNN"], r["median_ms"]),
        ],
        out,
    )


def ratio(x, ours):
    return f"{x / ours:.3f}" if isinstance(x, float) else "-"


def ms(x):
    return f"{x:.4f}" if isinstance(x, float) else x


def report(a, stem, title, columns, cells, out):
    """Prints and writes DIR/STEM.md (a table of one row per entry of `out`,
    `cells(ours, torch_ms)` after the label) and DIR/STEM.json."""
    gpu = torch.cuda.get_device_name()
    lines = [
        f"# {title} on {gpu} (torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()})",
        "",
        "| row | " + " | ".join(columns) + " |",
        "| --- |" + " ---: |" * len(columns),
    ]
    for o in out:
        lines.append(f"| {o['ours']['label']} | " + " | ".join(cells(o["ours"], o["torch_ms"])) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    open(os.path.join(a.out, stem + ".md"), "w").write(text)
    json.dump({"gpu": gpu, "rows": out}, open(os.path.join(a.out, stem + ".json"), "w"), indent=1)


def step_table(a):
    rows = [json.loads(line) for line in open(a.ours) if line.strip()]
    os.makedirs(a.out, exist_ok=True)
    out = [
        {"ours": r, "torch_ms": {n: torch_ms(r, be, a.reps, step=True) for n, be in BACKENDS.items()}}
        for r in rows
    ]
    report(
        a,
        "compare-step",
        "training step (forward + backward)",
        ["ours via candle ms", "ours via API ms", "FA2 ms", "cuDNN ms",
         "FA2 ms / candle ms", "cuDNN ms / candle ms", "FA2 ms / API ms", "cuDNN ms / API ms"],
        lambda r, t: [
            f"{r['ours_ms']:.4f}", f"{r['api_ms']:.4f}", ms(t["FA2"]), ms(t["cuDNN"]),
            ratio(t["FA2"], r["ours_ms"]), ratio(t["cuDNN"], r["ours_ms"]),
            ratio(t["FA2"], r["api_ms"]), ratio(t["cuDNN"], r["api_ms"]),
        ],
        out,
    )

if __name__ == "__main__":
    main()
