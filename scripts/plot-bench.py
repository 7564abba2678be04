#!/usr/bin/env python3
"""Plots one run of benches/attention.rs from its JSON lines.

    python3 scripts/plot-bench.py RUN.jsonl OUT.png [--title TEXT]

`cargo bench --bench attention -- --plot OUT.png` runs this script (embedded in
the bench binary) on the JSON lines it has just written. Panels, each present
only when the run has such rows, every row one bar in the bench's order and
coloured by its origin ("sweep", "decode-graph", "policy-window", ...):

- forward: TFLOP/s ("tflops"; the policy rows count only visible pairs);
- decode: GB/s of K/V read ("gbps") and new tokens per second ("tokens_per_s",
  B x Sq per step, log scale);
- every row: max |O - O_ref| of the bench's f64 check ("max_abs_err", log
  scale) against the GPU tests' tolerance ("abs_tol", dashed); a row whose
  output was not finite is drawn as a red cross at the top.

With at most 60 rows in a panel each bar is labelled with the row's label;
above that the x axis names the origins. Lines of older bench files without
"origin" count as origin "other"; without "tokens_per_s" or "max_abs_err" those
panels leave the row out. Needs matplotlib; exit status 2 without it, 1 when the
file has no usable line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

LABELLED_BARS = 60  # panels with more rows name the origins instead of the rows


def read_rows(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                row = json.loads(line)
                float(row["median_ms"])
                if row["kernel"] not in ("forward", "decode"):
                    raise ValueError(f"unknown kernel {row['kernel']!r}")
            except (ValueError, KeyError, TypeError) as e:
                print(f"plot-bench: {path}:{n}: skipped ({e})", file=sys.stderr)
                continue
            row.setdefault("origin", "other")
            rows.append(row)
    return rows


def label(row: dict) -> str:
    """The bench's printed label; rebuilt for older lines that lack it."""
    if isinstance(row.get("label"), str):
        return row["label"]
    causal = " causal" if row.get("causal") else ""
    policy = f" {row['policy']}" if row.get("policy", "none") != "none" else ""
    return (f"{row['origin']} {row['kernel']} {row.get('dtype')} b{row.get('batch')} "
            f"h{row.get('heads')}/{row.get('kv_heads')} q{row.get('seqlen_q')} k{row.get('seqlen_k')} "
            f"d{row.get('head_dim')}{causal}{policy}")


def number(row: dict, key: str) -> float | None:
    x = row.get(key)
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def origin_colors(rows: list[dict], plt) -> dict[str, object]:
    origins = list(dict.fromkeys(r["origin"] for r in rows))
    cmap = plt.get_cmap("tab20")
    return {o: cmap(i % 20) for i, o in enumerate(origins)}


def bars(ax, rows: list[dict], values: list[float | None], colors: dict, ylabel: str, log: bool = False):
    xs = list(range(len(rows)))
    heights = [v if v is not None else math.nan for v in values]
    ax.bar(xs, heights, width=0.85, color=[colors[r["origin"]] for r in rows])
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_xlim(-0.6, len(rows) - 0.4)
    x_axis(ax, rows)


def x_axis(ax, rows: list[dict]) -> None:
    if len(rows) <= LABELLED_BARS:
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([label(r) for r in rows], rotation=90, fontsize=6)
        return
    # Runs of one origin: a tick at the middle of each, a line between them.
    ticks, names, start = [], [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i]["origin"] != rows[start]["origin"]:
            ticks.append((start + i - 1) / 2)
            names.append(rows[start]["origin"])
            if i < len(rows):
                ax.axvline(i - 0.5, color="gray", linewidth=0.5, alpha=0.5)
            start = i
    ax.set_xticks(ticks)
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize=7)


def plot(rows: list[dict], out: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # headless GPU hosts have no display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = origin_colors(rows, plt)
    fwd = [r for r in rows if r["kernel"] == "forward"]
    dec = [r for r in rows if r["kernel"] == "decode"]
    checked = [r for r in rows if "max_abs_err" in r]
    panels = []
    if fwd:
        panels.append(("Forward: TFLOP/s", fwd, lambda ax: bars(
            ax, fwd, [number(r, "tflops") for r in fwd], colors, "TFLOP/s")))
    if dec:
        panels.append(("Decode: GB/s (K + V bytes / time)", dec, lambda ax: bars(
            ax, dec, [number(r, "gbps") for r in dec], colors, "GB/s")))
        if any(number(r, "tokens_per_s") for r in dec):
            panels.append(("Decode: new tokens per second (B x Sq / time)", dec, lambda ax: bars(
                ax, dec, [number(r, "tokens_per_s") for r in dec], colors, "tokens/s", log=True)))
    if checked:
        panels.append(("Max |O - O_ref| over the f64-checked query rows (dashed: the GPU tests' tolerance)",
                       checked, lambda ax: errors(ax, checked, colors)))
    if not panels:
        raise ValueError("nothing to plot")
    widest = max(len(p[1]) for p in panels)
    labelled = any(len(p[1]) <= LABELLED_BARS for p in panels)
    fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                             figsize=(max(10.0, min(28.0, 0.08 * widest + 4)),
                                      (5.2 if labelled else 3.6) * len(panels) + 1))
    for ax, (name, _, draw) in zip(axes[:, 0], panels):
        ax.set_title(name, fontsize=10)
        draw(ax)
    handles = [Patch(color=c, label=o) for o, c in colors.items()]
    fig.legend(handles=handles, loc="upper right", fontsize=7, ncol=max(1, len(handles) // 12 + 1),
               title="origin", title_fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.9, 0.97))
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def errors(ax, rows: list[dict], colors: dict) -> None:
    errs = [number(r, "max_abs_err") for r in rows]
    finite = [e for e in errs if e]
    top = max([*finite, *(number(r, "abs_tol") or 0 for r in rows), 1e-6]) * 3
    bars(ax, rows, [e if e else None for e in errs], colors, "max abs error", log=True)
    # Exact zeros cannot sit on a log axis: a small mark at the bottom instead.
    bottom = min([*finite, top / 1e4]) / 3
    ax.set_ylim(bottom, top)
    for i, (r, e) in enumerate(zip(rows, errs)):
        if r.get("max_abs_err") is None:
            ax.plot([i], [top / 1.5], marker="x", color="red", markersize=8)
        elif e == 0:
            ax.plot([i], [bottom * 1.5], marker="_", color="black")
    tols = [number(r, "abs_tol") for r in rows]
    for i, t in enumerate(tols):
        if t:
            ax.hlines(t, i - 0.5, i + 0.5, colors="black", linestyles="dashed", linewidth=0.8)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Plot one run of benches/attention.rs (JSON lines) as a PNG.")
    ap.add_argument("jsonl", help="the bench's JSON lines (--json PATH; default target/flash-attn-bench.jsonl)")
    ap.add_argument("png", help="the PNG to write")
    ap.add_argument("--title", help="figure title (default: the JSON file's name)")
    # Run as `python3 - JSON PNG` (the bench feeds this script on stdin), argv[0] is "-".
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot-bench: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return 2
    try:
        rows = read_rows(args.jsonl)
    except OSError as e:
        print(f"plot-bench: {e}", file=sys.stderr)
        return 1
    if not rows:
        print(f"plot-bench: no usable lines in {args.jsonl}", file=sys.stderr)
        return 1
    plot(rows, args.png, args.title or f"flash-attn bench: {args.jsonl} ({len(rows)} rows)")
    print(f"plot-bench: {len(rows)} rows -> {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
