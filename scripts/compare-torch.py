#!/usr/bin/env python3
"""Compare our FlashAttention kernels with PyTorch's SDPA backends on the same GPU.

Our numbers come from the Rust benchmark (benches/attention.rs), which writes one
JSON object per shape with the keys kernel, dtype, batch, heads, kv_heads,
seqlen_q, seqlen_k, head_dim, causal, median_ms, tflops, gbps, timing ("events"
or "graph"; absent in older files: events), origin and label (absent in older
files: origin "other", label rebuilt from the keys the way the bench builds it),
and, in newer files, tokens_per_s, max_abs_err, abs_tol, mem_bytes and
mem_used_delta_bytes (the bench's module docs say what each means; the tables
show them where present). The shapes, origins and labels come from those lines
only: this script keeps no copy of the bench's shape list. For every shape in
those results this script times ``torch.nn.functional.scaled_dot_product_attention``
with the FLASH_ATTENTION backend (PyTorch's bundled FlashAttention-2, "FA2" below)
and the CUDNN_ATTENTION backend ("cuDNN"), measures a dense-matmul and a
device-to-device-copy ceiling in the same session, and writes:

    DIR/compare.md           markdown tables (also printed to stdout)
    DIR/compare.json         every raw number, the ceilings and the environment
    DIR/compare-forward.png  TFLOP/s vs sequence length, "16k tokens per batch" sweep
    DIR/compare-decode.png   GB/s vs cache length, GQA 32/8 D=128 decode, Sq=1
    DIR/compare-*-graph.png  the same plots of our graph-timed rows (with graph-timed baselines)

Usage (on the GPU host; no Rust and no network needed there):

    # our results from an earlier bench run
    python3 scripts/compare-torch.py --ours bundle/flash-attn-bench.jsonl --out cmp

    # run the bundled bench first (its JSON lines go to cmp/ours-bench.jsonl)
    python3 scripts/compare-torch.py --run-bench bundle --bench-args "--quick" --out cmp

    # the forward sweep with one timing method on both sides (CUDA graphs): the README's table.
    # Our default events rows against do_bench baselines favour ours on short rows: do_bench
    # flushes the L2 and times each call alone, dispatch included (docs/perf-notes.md v34)
    python3 scripts/compare-torch.py --run-bench bundle --bench-args "--timing graph" --timer graph \
        --filter "sweep forward" --out cmp

    # issue 9's decode table, timed as servers run it: ours and PyTorch both in CUDA graphs
    # (PyTorch also with do_bench, for reference: its do_bench times include Python dispatch)
    python3 scripts/compare-torch.py --run-bench bundle --filter decode-graph --timer do_bench,graph --out cmp

    # several of our kernel versions side by side (extra ms and ratio columns)
    python3 scripts/compare-torch.py --ours new.jsonl --label v1=docs/bench/2026-11-21-h200-v1.jsonl --out cmp

    # no GPU, no torch: fabricated results through the whole reporting path
    python3 scripts/compare-torch.py --self-test [--ours some.jsonl] [--out DIR]

Options: --filter SUBSTR keeps the shapes whose bench label contains SUBSTR (the
label is the one the bench prints and writes as "label", e.g. "sweep forward f16
b4 h16/16 q4096 k4096 d128 causal"; with --run-bench it is passed on to the bench
as well). --reps N is
the number of timed calls for the CUDA-event timers (--timer events|sync).
--timer picks how baselines are timed, one of the first three and/or graph,
comma-separated (e.g. do_bench,graph): do_bench (triton.testing.do_bench, median,
L2 flushed before each call), events (the fallback when triton is missing: the
same method done by hand), sync (3 warm-up calls, then per-call event pairs with
a synchronize after each, no L2 flush, at most 16 K/V copies rotated), graph
(the bench's --timing graph, step for step: N calls, each on the next rotated
K/V copy, captured in one torch.cuda.CUDAGraph, N at least 16, at least the
bench's number of copies for the shape and about 0.5 ms of work, at most 1024;
2 warm-up replays, then 20 replays back to back with a CUDA event between
consecutive ones; the median replay / N; no Python dispatch is timed). Default:
do_bench, plus graph when some of our rows are graph-timed. Baseline keys in
compare.json: fa2, cudnn (do_bench|events|sync) and fa2_graph, cudnn_graph.

Our rows are grouped by (shape, timing): a shape the bench timed both ways
(decode-gqa with events, decode-graph with graphs) has two rows, with one set
of baseline measurements. Every table shows all baseline columns, each naming
its timer; the summary (and the plots) compare our graph rows with the graph
timer's baselines and our events rows with the other timer's ("not run" when
this run lacks it, never a mix).

Ratios are baseline ms / our ms, so a value above 1 means ours is faster.
The bench's policy rows (sliding windows, softcap, ALiBi, sinks, varlen; JSON
lines with a "policy" key, "none" on their plain reference rows) have no PyTorch
baseline: they are counted and skipped when reading, never merged with the
plain shapes.
Exit status: 0 on success, 1 on a real error (no input rows, no CUDA device, the
bench failed), 2 on bad arguments. A backend that rejects a shape, or that
cannot be captured in a CUDA graph while the context stays usable, is a table
entry, not an error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple

# Decode inputs are rotated over enough K/V copies to exceed this many bytes, the
# same constant as ROTATE_BYTES in benches/attention.rs: repeated calls must not
# find K/V in the L2 cache (50-60 MB on H100/H200).
ROTATE_BYTES = 256 << 20
# benches/attention.rs caps its rotation at 16 copies; --timer sync copies that cap.
# Other timers only cap at a large number so that tiny caches still exceed ROTATE_BYTES.
OURS_MAX_ROTATIONS = 16
MAX_ROTATIONS = 4096

# Graph timing (--timer graph), the rule of benches/attention.rs's graph mode:
# N calls captured in one CUDA graph, N >= the rotated copies and about
# GRAPH_TARGET_MS of work (from 3 uncaptured calls), within the bounds; the
# copies exceed ROTATE_BYTES (inputs of one call counted as Q, O, K, V) up to
# GRAPH_MAX_LAUNCHES; GRAPH_WARMUP replays, then GRAPH_REPLAYS timed ones.
GRAPH_TARGET_MS = 0.5
GRAPH_MIN_LAUNCHES = 16
GRAPH_MAX_LAUNCHES = 1024
GRAPH_WARMUP = 2
GRAPH_REPLAYS = 20
# How our rows were timed (their "timing" key; rows without one are "events").
TIMINGS = ("events", "graph")
# --timer methods: one of the first three, and/or graph.
TIMER_MODES = ("do_bench", "events", "sync", "graph")

MATMUL_N = 8192  # the matmul ceiling is an N x N x N product
COPY_BYTES = 4 << 30  # the copy ceiling moves this many bytes (read) plus as many (write)

# Column names of the baselines, in table order: key in our data -> display name.
BASELINES = {"fa2": "FA2", "cudnn": "cuDNN"}
RESERVED_NAMES = {"ours", "fa2", "cudnn"}

ELEM_BYTES = 2  # f16 and bf16
DTYPE_ALIASES = {
    "f16": "f16", "fp16": "f16", "float16": "f16", "half": "f16",
    "bf16": "bf16", "bfloat16": "bf16",
}
DTYPE_ORDER = ["f16", "bf16"]


class Shape(NamedTuple):
    """One benchmarked problem; also the dedupe key across inputs."""

    kernel: str  # "forward" | "decode"
    dtype: str  # "f16" | "bf16"
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool


# --------------------------------------------------------------------------
# Shape bookkeeping (no torch needed)
# --------------------------------------------------------------------------


def shape_label(s: Shape, origin: str | None = None) -> str:
    """The bench's label (Shape::label in benches/attention.rs), for lines without "label"."""
    body = (f"{s.kernel} {s.dtype} b{s.batch} h{s.heads}/{s.kv_heads} "
            f"q{s.seqlen_q} k{s.seqlen_k} d{s.head_dim}{' causal' if s.causal else ''}")
    return f"{origin} {body}" if origin else body


def matches_filter(e: dict, needle: str | None) -> bool:
    # A shape the bench ran under two origins (the "floor" shape is also a sweep
    # point) matches if either line's label contains the substring, as in the bench.
    return needle is None or any(needle in label for label in e["labels"])


def flops(s: Shape) -> float:
    """Matmul FLOPs (Q·Kᵀ and P·V), halved for causal forward, as the bench counts."""
    f = 4.0 * s.batch * s.heads * s.seqlen_q * s.seqlen_k * s.head_dim
    return f / 2 if s.causal and s.kernel == "forward" else f


def kv_bytes(s: Shape) -> float:
    """K and V of the cache once: what decode must read (the bench's decode GB/s)."""
    return 2.0 * s.batch * s.seqlen_k * s.kv_heads * s.head_dim * ELEM_BYTES


def io_bytes(s: Shape) -> float:
    """Q, K, V, O once: the bench's forward 'gbps' numerator (decode uses kv_bytes)."""
    qo = 2.0 * s.batch * s.seqlen_q * s.heads * s.head_dim * ELEM_BYTES
    return kv_bytes(s) + (qo if s.kernel == "forward" else 0.0)


def rate(s: Shape, ms: float | None) -> float | None:
    """TFLOP/s for forward rows, GB/s for decode rows (the metric each one is bound by)."""
    if ms is None or ms <= 0:
        return None
    if s.kernel == "forward":
        return flops(s) / (ms * 1e-3) / 1e12
    return kv_bytes(s) / (ms * 1e-3) / 1e9


def rate_unit(kernel: str) -> str:
    return "TFLOP/s" if kernel == "forward" else "GB/s"


def graph_copies(s: Shape) -> int:
    """Rotated input copies of a graph-timed row (the bench's random_sets, graph cap)."""
    q = s.batch * s.seqlen_q * s.heads * s.head_dim
    kv = s.batch * s.seqlen_k * s.kv_heads * s.head_dim
    return max(1, min(GRAPH_MAX_LAUNCHES, math.ceil(ROTATE_BYTES / ((2 * q + 2 * kv) * ELEM_BYTES))))


def graph_launches(estimate_ms: float, copies: int) -> int:
    """Calls per captured graph: about GRAPH_TARGET_MS of work and one per copy, within bounds."""
    n = max(math.ceil(GRAPH_TARGET_MS / max(estimate_ms, 1e-6)), copies)
    return max(GRAPH_MIN_LAUNCHES, min(GRAPH_MAX_LAUNCHES, n))


# --------------------------------------------------------------------------
# Input: JSON lines and --label parsing
# --------------------------------------------------------------------------


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def info(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _as_int(v: Any, key: str) -> int:
    # bool is an int subclass in Python; a true/false in a size field is a bad row.
    if isinstance(v, bool):
        raise ValueError(f"{key} is a boolean")
    if isinstance(v, float) and not v.is_integer():
        raise ValueError(f"{key}={v} is not an integer")
    n = int(v)
    if n <= 0:
        raise ValueError(f"{key}={n} is not positive")
    return n


def _as_bool(v: Any, key: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise ValueError(f"{key}={v!r} is not a boolean")


# The bench's per-row numbers besides the time, kept as reported (None when absent).
BENCH_EXTRAS = ("tflops", "gbps", "tokens_per_s", "max_abs_err", "abs_tol", "check_error", "mem_bytes",
                "mem_used_delta_bytes")


def parse_row(obj: Any) -> dict:
    """One bench JSON object -> {"shape", "timing", "origin", "label", "median_ms", *BENCH_EXTRAS};
    raises on bad rows."""
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    kernel = obj["kernel"]
    if kernel not in ("forward", "decode"):
        raise ValueError(f"unknown kernel {kernel!r}")
    dtype = DTYPE_ALIASES.get(str(obj["dtype"]).lower())
    if dtype is None:
        raise ValueError(f"unknown dtype {obj['dtype']!r}")
    shape = Shape(
        kernel, dtype,
        *(_as_int(obj[k], k) for k in ("batch", "heads", "kv_heads", "seqlen_q", "seqlen_k", "head_dim")),
        _as_bool(obj["causal"], "causal"),
    )
    if shape.heads % shape.kv_heads:
        raise ValueError(f"heads={shape.heads} is not a multiple of kv_heads={shape.kv_heads}")
    ms = float(obj["median_ms"])
    if not math.isfinite(ms) or ms <= 0:
        raise ValueError(f"median_ms={ms} is not a positive number")
    timing = obj.get("timing", "events")
    if timing not in TIMINGS:
        raise ValueError(f"unknown timing {timing!r}")
    origin = obj.get("origin") if isinstance(obj.get("origin"), str) else "other"
    label = obj.get("label") if isinstance(obj.get("label"), str) else shape_label(shape, origin)
    return {"shape": shape, "timing": timing, "origin": origin, "label": label, "median_ms": ms,
            **{k: obj.get(k) for k in BENCH_EXTRAS}}


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Reads bench JSON lines; bad lines are reported and skipped, not fatal.

    Lines with a "policy" key (the bench's policy rows and their plain reference
    rows: ours only, FLOPs over visible pairs) are skipped, so that they are
    neither timed against PyTorch nor merged with a plain shape of the same keys.
    """
    rows = []
    policy_rows = 0
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                obj = json.loads(line)
                if isinstance(obj, dict) and "policy" in obj:
                    policy_rows += 1
                    continue
                rows.append(parse_row(obj))
            except json.JSONDecodeError as e:
                warn(f"{path}:{n}: not JSON ({e.msg}); line skipped")
            except KeyError as e:
                warn(f"{path}:{n}: missing key {e}; line skipped")
            except (ValueError, TypeError) as e:
                warn(f"{path}:{n}: {e}; line skipped")
    if policy_rows:
        info(f"{path}: {policy_rows} policy rows (ours only, no baseline) skipped")
    return rows


def parse_label(text: str) -> tuple[str, str]:
    """--label NAME=PATH -> (NAME, PATH)."""
    name, sep, path = text.partition("=")
    name = name.strip()
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--label wants NAME=PATH.jsonl, got {text!r}")
    if name.lower() in RESERVED_NAMES:
        raise argparse.ArgumentTypeError(f"--label name {name!r} is reserved (ours, FA2, cuDNN)")
    if any(c in name for c in "|\n"):
        raise argparse.ArgumentTypeError(f"--label name {name!r} would break the markdown table")
    return name, path


def merge(variants: dict[str, list[dict]]) -> list[dict]:
    """Rows of all variants -> one entry per distinct (shape, timing), in first-seen order.

    A shape timed both ways (decode-gqa rows with events, decode-graph rows with
    graphs) gives two entries. The bench also measures two shapes twice with
    one timing (the "floor" shape and seed-A100 S=2048 are also sweep points), so
    duplicates are expected: the first measurement is kept and later ones are
    recorded in dup_ms (and flagged in the table when they disagree by more
    than 5%). Origins and labels come from the rows: an entry keeps every
    distinct one (older bench files without them: "other", rebuilt labels).
    """
    entries: dict[tuple[Shape, str], dict] = {}
    for name, rows in variants.items():
        for r in rows:
            s = r["shape"]
            e = entries.setdefault((s, r["timing"]), {"shape": s, "timing": r["timing"], "origins": [],
                                                      "labels": [], "results": {}, "baselines": {}})
            for key, value in (("origins", r["origin"]), ("labels", r["label"])):
                if value not in e[key]:
                    e[key].append(value)
            res = e["results"].get(name)
            if res is None:
                e["results"][name] = {
                    "median_ms": r["median_ms"], "dup_ms": [],
                    **{("reported_" + k if k in ("tflops", "gbps") else k): r.get(k) for k in BENCH_EXTRAS},
                }
            else:
                res["dup_ms"].append(r["median_ms"])
    return list(entries.values())


# --------------------------------------------------------------------------
# PyTorch side (torch imported lazily so that --self-test runs without it)
# --------------------------------------------------------------------------


def timer_suffix(mode: str) -> str:
    """Baseline keys are "fa2"/"cudnn" under the do_bench|events|sync timer and
    "fa2_graph"/"cudnn_graph" under the graph timer."""
    return "_graph" if mode == "graph" else ""


def baseline_columns(modes: list[str]) -> list[tuple[str, str, str]]:
    """(key, display name, timer) of every baseline column, in table order."""
    return [(key + timer_suffix(m), disp, m) for m in modes for key, disp in BASELINES.items()]


def matched_key(timing: str, backend: str) -> str:
    """The baseline column timed like our rows of this timing: graph rows with
    the graph timer, events rows with the other (do_bench, events or sync)."""
    return backend + ("_graph" if timing == "graph" else "")


def matched_timer(timing: str, modes: list[str]) -> str | None:
    """The timer of matched_key's columns, None when this run did not use it."""
    return next((m for m in modes if timer_suffix(m) == matched_key(timing, "")), None)


def parse_timers(text: str) -> list[str]:
    """--timer do_bench,graph -> ["do_bench", "graph"]: at most one of do_bench,
    events and sync (listed first), and/or graph."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in TIMER_MODES]
    if bad or not modes or len(set(modes)) != len(modes) or sum(m != "graph" for m in modes) > 1:
        raise argparse.ArgumentTypeError(
            f"--timer wants one of do_bench, events, sync and/or graph, comma-separated; got {text!r}")
    return sorted(modes, key=lambda m: m == "graph")


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


class GraphCaptureError(RuntimeError):
    """Capturing a baseline in a CUDA graph failed and the CUDA context still works:
    a table entry for that shape, not a reason to stop (see TorchBench._note_fatal)."""


class Timer:
    """Median milliseconds of fn() on the GPU, by one of four methods (see --timer)."""

    DESCRIPTIONS = {
        "do_bench": "triton.testing.do_bench(warmup=25, rep=100, return_mode='median'); L2 flushed before each call",
        "events": "CUDA events, median of {reps} calls after 3 warm-ups; 256 MiB memset (L2 flush) before each call",
        "sync": "CUDA events like benches/attention.rs: 3 warm-ups, median of {reps} calls, "
                "synchronize after each, no L2 flush",
        "graph": f"CUDA graphs like benches/attention.rs --timing graph: N calls (at least {GRAPH_MIN_LAUNCHES}, "
                 f"one per rotated K/V copy and about {GRAPH_TARGET_MS} ms, at most {GRAPH_MAX_LAUNCHES}) captured "
                 f"in one graph, {GRAPH_WARMUP} warm-up replays, median of {GRAPH_REPLAYS} back-to-back replays "
                 "between events / N; no host dispatch timed",
    }

    def __init__(self, torch, mode: str, reps: int):
        self.torch = torch
        self.mode = mode
        self.requested = mode
        self.reps = reps
        self.last_launches: int | None = None  # calls per graph of the last graph timing
        self._flush = None
        if mode == "do_bench":
            try:
                from triton.testing import do_bench
                self._do_bench = do_bench
            except Exception as e:  # triton absent or broken: time by hand the same way
                warn(f"triton.testing.do_bench unavailable ({first_line(e)}); using CUDA events")
                self.mode = "events"

    @property
    def description(self) -> str:
        text = self.DESCRIPTIONS[self.mode].format(reps=self.reps)
        # do_bench can fall back to events mid-run (an old triton); say so.
        return text if self.mode == self.requested else f"{text} ({self.requested} failed on first use)"

    def __call__(self, fn: Callable[[], Any], copies: int = 1) -> float:
        """fn cycles over `copies` rotated inputs (only the graph method needs to know)."""
        if self.mode == "graph":
            return self._graph(fn, copies)
        if self.mode == "do_bench":
            try:
                return float(self._do_bench(fn, warmup=25, rep=100, return_mode="median"))
            except TypeError as e:
                if "return_mode" not in str(e):
                    raise
                warn("this triton's do_bench has no return_mode; using CUDA events from now on")
                self.mode = "events"
        torch = self.torch
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        if self.mode == "events":
            if self._flush is None:
                self._flush = torch.empty(ROTATE_BYTES, dtype=torch.int8, device="cuda")
            for s, e in zip(starts, ends):
                # The memset evicts L2 and keeps the GPU busy long enough for the
                # host to queue fn's kernels, so Python dispatch time is not timed.
                self._flush.zero_()
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize()
        else:  # "sync": the Rust harness's method, host launch latency included
            for s, e in zip(starts, ends):
                s.record()
                fn()
                e.record()
                e.synchronize()
        samples = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        return samples[len(samples) // 2]  # the bench's median (upper middle)

    def _batch_ms(self, fn: Callable[[], Any], n: int) -> float:
        """Milliseconds per call of n back-to-back calls (dispatch included): sizes the graph."""
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    def _graph(self, fn: Callable[[], Any], copies: int) -> float:
        """The bench's graph timing (see DESCRIPTIONS["graph"])."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the current stream, as torch.cuda.graph advises
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        n = graph_launches(self._batch_ms(fn, 3), copies)
        graph = self._capture(fn, n)
        for _ in range(GRAPH_WARMUP):
            graph.replay()
        # Queued behind the warm-up, so no replay waits for the host.
        events = [torch.cuda.Event(enable_timing=True) for _ in range(GRAPH_REPLAYS + 1)]
        events[0].record()
        for e in events[1:]:
            graph.replay()
            e.record()
        torch.cuda.synchronize()
        self.last_launches = n
        samples = sorted(a.elapsed_time(b) / n for a, b in zip(events, events[1:]))
        return samples[len(samples) // 2]

    def _capture(self, fn: Callable[[], Any], n: int):
        """n calls of fn in one CUDAGraph; a failure that leaves the context usable is a GraphCaptureError."""
        torch = self.torch
        graph = torch.cuda.CUDAGraph()
        try:
            # The outer stream context restores the current stream even if the capture fails.
            with torch.cuda.stream(torch.cuda.current_stream()):
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    for _ in range(n):
                        fn()
        except Exception as e:
            try:
                torch.cuda.synchronize()
            except Exception:
                raise  # the context is gone: the caller's fatal-error path
            raise GraphCaptureError(f"graph capture failed: {first_line(e)}") from e
        return graph


class TorchBench:
    def __init__(self, timer_modes: list[str], reps: int):
        import torch  # lazy: see module docstring
        import torch.nn.functional as F

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.torch = torch
        self.F = F
        self.sdpa_kernel = sdpa_kernel
        # getattr: a torch without a backend records that as each row's error.
        self.backends = {k: getattr(SDPBackend, n, None)
                         for k, n in (("fa2", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"))}
        # Suffix of the baseline keys ("" or "_graph", see timer_suffix) -> timer.
        self.timers = {timer_suffix(m): Timer(torch, m, reps) for m in timer_modes}
        self.max_rotations = OURS_MAX_ROTATIONS if "sync" in timer_modes else MAX_ROTATIONS
        self.dtypes = {"f16": torch.float16, "bf16": torch.bfloat16}
        # After an error like an illegal address the CUDA context is unusable:
        # remember it and skip the remaining shapes instead of failing each one.
        self.dead: str | None = None
        torch.manual_seed(0)

    # ---- environment and ceilings ----

    def environment(self) -> dict:
        torch = self.torch
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        env: dict[str, Any] = {
            "gpu": p.name,
            "compute_capability": f"{p.major}.{p.minor}",
            "sms": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2**30, 1),
            "l2_mib": round(getattr(p, "L2_cache_size", 0) / 2**20, 1) or None,
            "driver": nvidia_smi_driver(),
            "cuda": torch.version.cuda,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "host": platform.node(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "timers": self.timer_descriptions(),
        }
        try:
            env["cudnn"] = torch.backends.cudnn.version()
        except Exception:
            env["cudnn"] = None
        try:
            import triton
            env["triton"] = triton.__version__
        except Exception:
            env["triton"] = None
        # Newer torch can swap the FLASH_ATTENTION backend's implementation (FA3):
        # record which one ran so "FA2" is not mislabelled.
        try:
            import torch.nn.attention as tna
            cur = getattr(tna, "current_flash_attention_impl", None)
            env["flash_attention_impl"] = (cur() if cur else None) or "bundled FA2"
        except Exception:
            env["flash_attention_impl"] = "unknown"
        try:
            env["allow_fp16_reduced_precision_reduction"] = \
                torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        except Exception:
            pass
        return env

    def timer_descriptions(self) -> dict[str, str]:
        """{timer as requested: how it timed} (call again after the run: do_bench can fall back)."""
        return {t.requested: t.description for t in self.timers.values()}

    def ceilings(self) -> dict:
        """Dense matmul TFLOP/s per dtype and device-to-device copy GB/s, same session,
        timed with the first timer."""
        torch = self.torch
        timer = next(iter(self.timers.values()))
        out: dict[str, Any] = {"matmul": {}, "copy": {}}
        n = MATMUL_N
        for name, dt in self.dtypes.items():
            try:
                a = torch.randn(n, n, device="cuda", dtype=dt)
                b = torch.randn(n, n, device="cuda", dtype=dt)
                c = torch.empty(n, n, device="cuda", dtype=dt)
                ms = timer(lambda: torch.matmul(a, b, out=c))
                out["matmul"][name] = {"n": n, "ms": ms, "tflops": 2.0 * n**3 / (ms * 1e-3) / 1e12}
            except Exception as e:
                out["matmul"][name] = {"n": n, "error": first_line(e)}
                self._note_fatal(e)
            finally:
                a = b = c = None
                torch.cuda.empty_cache()
        # Fall back to 1 GiB where 2 x 4 GiB does not fit.
        for nbytes in (COPY_BYTES, 1 << 30):
            try:
                # float32 keeps the element count under 2**31 (int32 indexing) at 4 GiB.
                src = torch.randn(nbytes // 4, device="cuda", dtype=torch.float32)
                dst = torch.empty_like(src)
                ms = timer(lambda: dst.copy_(src))
                # Read + write both cross DRAM, the way a copy-bandwidth figure is usually quoted.
                out["copy"] = {"bytes_each_way": nbytes, "ms": ms,
                               "gbps": 2.0 * nbytes / (ms * 1e-3) / 1e9}
                break
            except Exception as e:
                out["copy"] = {"bytes_each_way": nbytes, "error": first_line(e)}
                self._note_fatal(e)
                if self.dead:
                    break
            finally:
                src = dst = None
                torch.cuda.empty_cache()
        return out

    # ---- SDPA baselines ----

    def _note_fatal(self, e: BaseException) -> None:
        if isinstance(e, GraphCaptureError):
            return
        if "CUDA error:" in str(e) and not self.dead:
            self.dead = first_line(e)
            warn(f"CUDA error, remaining shapes are skipped: {self.dead}")

    def _failed(self, sfx: str, error: str | None = None) -> dict:
        """A baseline result without a time (yet), for the timer of key suffix sfx."""
        return {"ms": None, "error": error, "notes": [], "timer": self.timers[sfx].requested}

    def baselines(self, s: Shape) -> dict:
        """{baseline key (backend + timer suffix): result} for every backend and timer."""
        torch = self.torch
        res = {k + sfx: self._failed(sfx) for sfx in self.timers for k in self.backends}
        if self.dead:
            for r in res.values():
                r["error"] = f"skipped after an earlier CUDA error ({self.dead})"
            return res
        inputs = None
        try:
            inputs = self._inputs(s)
            for key, backend in self.backends.items():
                if backend is None:
                    for sfx in self.timers:
                        res[key + sfx]["error"] = f"this torch has no SDPBackend for {BASELINES[key]}"
                    continue
                for sfx, r in self._time_backend(s, inputs, backend).items():
                    r["notes"] = inputs["notes"] + r["notes"]
                    res[key + sfx] = r
        except Exception as e:  # input allocation (e.g. out of memory)
            for r in res.values():
                if r["ms"] is None and r["error"] is None:
                    r["error"] = f"inputs: {first_line(e)}"
            self._note_fatal(e)
        finally:
            inputs = None
            torch.cuda.empty_cache()
        return res

    def _inputs(self, s: Shape) -> dict:
        torch = self.torch
        dt = self.dtypes[s.dtype]
        # Layout: our bench stores Q, K, V, O as BSHD-contiguous [B, S, H, D]. SDPA
        # takes [B, H, S, D]; the .transpose(1, 2) *view* of a BSHD tensor keeps our
        # memory layout (head_dim contiguous, the heads of one token adjacent), and
        # it is the layout FlashAttention-2, and so PyTorch's FLASH_ATTENTION
        # backend, consumes natively without a copy. A .contiguous() BHSD tensor
        # would be a different memory layout from the one our kernels are timed on.
        q = torch.randn(s.batch, s.seqlen_q, s.heads, s.head_dim, device="cuda", dtype=dt).transpose(1, 2)
        # Decode K/V are rotated: enough copies that all of them exceed ROTATE_BYTES,
        # cycled by a counter in fn. Forward K/V are rotated only for the graph
        # timer, which rotates at least over the bench's graph copies (Q is not).
        sets = 1
        if s.kernel == "decode":
            sets = max(1, min(self.max_rotations, math.ceil(ROTATE_BYTES / kv_bytes(s))))
        if "_graph" in self.timers:
            sets = max(sets, graph_copies(s))
        kv = [(torch.randn(s.batch, s.seqlen_k, s.kv_heads, s.head_dim, device="cuda", dtype=dt),
               torch.randn(s.batch, s.seqlen_k, s.kv_heads, s.head_dim, device="cuda", dtype=dt))
              for _ in range(sets)]
        notes: list[str] = []
        attn_mask, is_causal = None, False
        if s.causal and s.seqlen_q > 1:
            if s.seqlen_q == s.seqlen_k:
                is_causal = True
            else:
                # Our causal mask is aligned bottom-right (host/validate.rs); PyTorch's
                # is_causal is top-left, so a non-square causal shape needs the bias.
                from torch.nn.attention.bias import causal_lower_right
                attn_mask = causal_lower_right(s.seqlen_q, s.seqlen_k)
                notes.append("causal as causal_lower_right bias (Sq != Skv)")
        # Decode (Sq=1, causal flag set): bottom-right alignment lets the one query
        # see the whole cache, which is plain non-causal attention. PyTorch's
        # is_causal=True would align top-left and let it see key 0 only, so
        # is_causal stays False here.
        return {"q": q, "kv": kv, "sets": sets, "attn_mask": attn_mask, "is_causal": is_causal, "notes": notes}

    def _make_fn(self, q, kv: list, kwargs: dict) -> Callable[[], Any]:
        sdpa = self.F.scaled_dot_product_attention
        n = len(kv)
        counter = [0]

        def fn():
            # Cycle over the K/V copies (do_bench takes a plain callable, so the
            # rotation lives in here), as the Rust bench does with launch(i).
            i = counter[0]
            counter[0] = i + 1
            k, v = kv[i % n]
            return sdpa(q, k, v, **kwargs)

        return fn

    def _time_backend(self, s: Shape, inp: dict, backend) -> dict[str, dict]:
        """{timer suffix: result}: the first way of calling the backend that runs, timed by every timer."""
        group = s.heads // s.kv_heads
        # GQA: first enable_gqa=True (reads each K/V head once, like ours); if the
        # backend rejects it, materialise repeated K/V and say so in the row, since
        # that backend then reads `group` times the K/V bytes that ours reads.
        attempts = ["plain"] if group == 1 else ["enable_gqa", "repeat_interleave"]
        errors: list[str] = []
        for how in attempts:
            kv = None
            try:
                if how == "repeat_interleave":
                    # Repeat on the BSHD tensor (dim 2) so the result keeps our layout.
                    kv = [(k.repeat_interleave(group, dim=2).transpose(1, 2),
                           v.repeat_interleave(group, dim=2).transpose(1, 2)) for k, v in inp["kv"]]
                else:
                    kv = [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in inp["kv"]]
                kwargs: dict[str, Any] = {"attn_mask": inp["attn_mask"], "is_causal": inp["is_causal"]}
                if how == "enable_gqa":
                    kwargs["enable_gqa"] = True
                fn = self._make_fn(inp["q"], kv, kwargs)
                with self.sdpa_kernel([backend]):
                    failure = self._checked_call(fn)
                    if failure is None:
                        out = {sfx: self._timed(sfx, fn, s, how, inp["sets"]) for sfx in self.timers}
                if failure is not None:
                    errors.append(f"{how}: {failure}")
                    if self.dead:
                        break
                    continue
                if how == "repeat_interleave":
                    for r in out.values():
                        r["notes"].append(f"GQA via repeat_interleave (enable_gqa rejected; K/V materialised {group}x)")
                        r["enable_gqa_error"] = errors[-1] if errors else None  # full reason, JSON only
                return out
            except Exception as e:  # e.g. out of memory while materialising K/V
                errors.append(f"{how}: {first_line(e)}")
                self._note_fatal(e)
                if self.dead:
                    break
            finally:
                kv = None
        return {sfx: self._failed(sfx, "; ".join(errors) or "unknown failure") for sfx in self.timers}

    def _checked_call(self, fn: Callable[[], Any]) -> str | None:
        """One call first: a backend that cannot run the shape raises here ("No
        available kernel"), with its reasons given as warnings; None if it ran.
        Only this call records warnings, so timing loops cannot pile them up."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fn()
                self.torch.cuda.synchronize()
                return None
            except Exception as e:
                self._note_fatal(e)
                return describe_failure(e, caught)

    def _timed(self, sfx: str, fn: Callable[[], Any], s: Shape, how: str, sets: int) -> dict:
        """fn timed by the timer of key suffix sfx; a failure is this result's error."""
        out = {**self._failed(sfx), "kv_sets": sets}
        if self.dead:
            out["error"] = f"{how}: skipped after an earlier CUDA error ({self.dead})"
            return out
        timer = self.timers[sfx]
        try:
            out["ms"] = timer(fn, graph_copies(s))
            if timer.mode == "graph":
                out["graph_launches"] = timer.last_launches
        except Exception as e:
            out["error"] = f"{how}: timing failed: {first_line(e)}"
            self._note_fatal(e)
        return out


def describe_failure(e: BaseException, caught: list) -> str:
    """The exception's first line plus the backend's reasons, which PyTorch gives as warnings."""
    reasons = []
    for w in caught:
        text = str(w.message).split("(Triggered internally")[0].strip()
        text = " ".join(text.split())
        # Skip the "... kernel not used because:" headers; the reasons follow them.
        if text and not text.endswith(":") and text not in reasons:
            reasons.append(text)
    msg = first_line(e)
    if reasons:
        msg += " [" + " | ".join(reasons[:4]) + "]"
    return msg[:400]


def nvidia_smi_driver() -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        line = r.stdout.strip().splitlines()
        return line[0].strip() if r.returncode == 0 and line else None
    except Exception:
        return None


# --------------------------------------------------------------------------
# Running the bundled bench
# --------------------------------------------------------------------------


def run_bench(bundle: str, bench_args: str | None, filt: str | None, out: Path) -> tuple[Path, dict]:
    """Runs BUNDLE/run-bench.sh with BENCH_JSON in OUT; returns the JSON path and run info."""
    script = Path(bundle) / "run-bench.sh"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found (build it with scripts/gpu-bundle.sh)")
    # Absolute: run-bench.sh changes into its own directory before running.
    json_path = (out / "ours-bench.jsonl").resolve()
    if json_path.exists():
        json_path.unlink()  # never compare against a stale file after a failed run
    cmd = [str(script.resolve()), *shlex.split(bench_args or "")]
    if filt and "--filter" not in cmd:
        cmd += ["--filter", filt]
    info(f"running {shlex.join(cmd)} (BENCH_JSON={json_path})")
    device_line = None
    log_path = out / "bench.log"
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, BENCH_JSON=str(json_path)))
        assert proc.stdout is not None
        for line in proc.stdout:
            # The bench's table goes to stderr so that stdout is only our report.
            sys.stderr.write(line)
            log.write(line)
            if line.startswith("device:"):
                device_line = line.strip()
        rc = proc.wait()
    return json_path, {"command": cmd, "returncode": rc, "device_line": device_line, "log": str(log_path)}


# --------------------------------------------------------------------------
# Derived numbers, tables, summary
# --------------------------------------------------------------------------


def _ratio(e: dict, key: str, ms: float | None) -> float | None:
    bms = e["baselines"].get(key, {}).get("ms")
    return bms / ms if bms and ms else None


def derive(entries: list[dict], ceilings: dict) -> None:
    """Adds rates, ratios and % of ceiling to every entry, in place: vs_KEY for
    every baseline column KEY, and vs_matched {backend: ratio} against the
    baseline timed like the entry (matched_key)."""
    matmul = {k: v.get("tflops") for k, v in ceilings.get("matmul", {}).items()}
    copy_gbps = ceilings.get("copy", {}).get("gbps")
    for e in entries:
        s: Shape = e["shape"]
        ceiling = matmul.get(s.dtype) if s.kernel == "forward" else copy_gbps
        for b in e["baselines"].values():
            b["rate"] = rate(s, b.get("ms"))
        for res in e["results"].values():
            ms = res["median_ms"]
            res["rate"] = rate(s, ms)
            res["pct_ceiling"] = 100.0 * res["rate"] / ceiling if ceiling and res["rate"] else None
            for key in e["baselines"]:
                res[f"vs_{key}"] = _ratio(e, key, ms)
            res["vs_matched"] = {k: _ratio(e, matched_key(e["timing"], k), ms) for k in BASELINES}
            if res["dup_ms"]:
                all_ms = [ms, *res["dup_ms"]]
                res["dup_spread"] = max(all_ms) / min(all_ms) - 1.0


def _stats(values: list[float]) -> dict | None:
    v = [x for x in values if x is not None]
    if not v:
        return None
    return {"n": len(v), "min": min(v), "median": statistics.median(v), "max": max(v)}


def summarize(entries: list[dict], names: list[str], modes: list[str]) -> dict:
    """Per variant, kernel and our timing: the ratios against the baselines timed
    the same way (vs_matched; baseline_timer None when this run had no such timer)."""
    out: dict[str, Any] = {}
    for name in names:
        for kernel in ("forward", "decode"):
            for timing in TIMINGS:
                rows = [e for e in entries if e["shape"].kernel == kernel and e["timing"] == timing
                        and name in e["results"]]
                if not rows:
                    continue
                d = {f"vs_{k}": _stats([e["results"][name]["vs_matched"][k] for e in rows]) for k in BASELINES}
                slower = [e for e in rows if (e["results"][name]["vs_matched"]["fa2"] or math.inf) < 1.0]
                d["rows"] = len(rows)
                d["baseline_timer"] = matched_timer(timing, modes)
                d["slower_than_fa2"] = [
                    {"label": e["labels"][0],
                     "vs_fa2": e["results"][name]["vs_matched"]["fa2"]}
                    for e in slower]
                out.setdefault(name, {}).setdefault(kernel, {})[timing] = d
    out["baseline_failures"] = {
        k: sum(1 for e in entries if e["baselines"].get(k, {}).get("ms") is None)
        for k, _, _ in baseline_columns(modes)}
    return out


def fmt_ms(x: float | None) -> str:
    return "—" if x is None else (f"{x:.4f}" if x < 100 else f"{x:.2f}")


def fmt_ratio(x: float | None) -> str:
    if x is None:
        return "—"
    if x >= 1.0:
        return f"{x:.2f}"
    # Bold: ours is slower. Three decimals where two would round up to a bold "1.00".
    return f"**{x:.3f}**" if x >= 0.995 else f"**{x:.2f}**"


def fmt_rate(x: float | None, kernel: str) -> str:
    if x is None:
        return "—"
    return f"{x:.1f}" if kernel == "forward" else f"{x:.0f}"


def fmt_pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}%"


def fmt_extra(key: str, res: dict) -> str:
    """tokens/s (k/M), max error (bold "!" above abs_tol, "**NaN**" if not finite) or memory (10^6 B)."""
    x = res.get(key)
    if key == "max_abs_err":
        if x is None:
            return "**NaN**" if res.get("check_error") else "—"
        tol = res.get("abs_tol")
        return f"**{x:.1e}!**" if tol is not None and x > tol else f"{x:.1e}"
    if x is None:
        return "—"
    if key == "tokens_per_s":
        return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k"
    return f"{x / 1e6:.1f}" if x < 1e8 else f"{x / 1e6:.0f}"


def md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def md_table(headers: list[str], rows: list[list[str]], right: set[int]) -> str:
    sep = ["---:" if i in right else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    for r in rows:
        assert len(r) == len(headers), (r, headers)
        lines.append("| " + " | ".join(r) + " |")
    return "\n".join(lines)


def row_notes(e: dict, names: list[str], columns: list[tuple[str, str, str]]) -> str:
    notes: list[str] = []
    for key, disp, mode in columns:
        b = e["baselines"].get(key, {})
        if b.get("error"):
            # Keep the cell readable; the full message is in compare.json.
            msg = b["error"]
            notes.append(f"{disp} ({mode}) failed: {msg[:160]}{'…' if len(msg) > 160 else ''}")
        for n in b.get("notes", []):
            notes.append(f"{disp}: {n[:160]}")
    for name in names:
        res = e["results"].get(name)
        if res and res.get("dup_spread", 0) > 0.05:
            runs = ", ".join(fmt_ms(x) for x in [res["median_ms"], *res["dup_ms"]])
            notes.append(f"{name}: repeated shape disagrees ({runs} ms; first kept)")
    # The same note for both backends (e.g. the causal bias) is said once.
    seen, uniq = set(), []
    for n in notes:
        core = n.split(": ", 1)[-1]
        if core in seen:
            continue
        seen.add(core)
        uniq.append(n)
    return md_escape("; ".join(uniq))


def render_markdown(env: dict, ceilings: dict, entries: list[dict], names: list[str],
                    sources: dict, bench: dict | None, summary: dict) -> str:
    primary = names[0]
    modes = list(env.get("timers", {}))
    columns = baseline_columns(modes)
    mm = ceilings.get("matmul", {})
    cp = ceilings.get("copy", {})

    def ceil_txt(d: dict, key: str, unit: str) -> str:
        return f"{d[key]:.1f} {unit}" if d.get(key) else f"failed ({d.get('error', 'not measured')})"

    l2 = f", {env['l2_mib']:g} MiB L2" if env.get("l2_mib") else ""
    other = next((m for m in modes if m != "graph"), None)
    out = [
        "# Ours vs PyTorch SDPA",
        "",
        f"- GPU: {env.get('gpu')} (sm_{str(env.get('compute_capability', '?')).replace('.', '')}, "
        f"{env.get('sms')} SMs{l2}, {env.get('memory_gib')} GiB); driver {env.get('driver') or '?'}; "
        f"CUDA {env.get('cuda')}; torch {env.get('torch')}; cuDNN {env.get('cudnn')}; triton {env.get('triton')}",
        f"- Date: {env.get('date')}, host {env.get('host')}",
        "- Ours: " + "; ".join(f"{n} = `{p}`" for n, p in sources.items())
        + (f" (bench printed: `{bench['device_line']}`)" if bench and bench.get("device_line") else ""),
        "- Our timing (the bench's `\"timing\"`, one table per kind): events = median of batches of back-to-back "
        "launches between CUDA events (host dispatch overlapped, not removed); graph = launches captured in one "
        "CUDA graph, median replay / launches (no host dispatch, as servers run a decode step)",
        f"- Baselines: `F.scaled_dot_product_attention` under `sdpa_kernel([FLASH_ATTENTION])` = FA2 "
        f"({env.get('flash_attention_impl')}) and `sdpa_kernel([CUDNN_ATTENTION])` = cuDNN; random normal "
        "inputs, transposed BSHD views, default scale. Each baseline column names its timer: "
        + "; ".join(f"({m}) = {d}" for m, d in env.get("timers", {}).items()),
        f"- Ceilings (timed with {modes[0] if modes else '?'}): matmul {MATMUL_N}³ f16 "
        f"{ceil_txt(mm.get('f16', {}), 'tflops', 'TFLOP/s')}, "
        f"bf16 {ceil_txt(mm.get('bf16', {}), 'tflops', 'TFLOP/s')}; device-to-device copy "
        f"({cp.get('bytes_each_way', COPY_BYTES) / 2**30:g} GiB, read + write counted) {ceil_txt(cp, 'gbps', 'GB/s')}",
        f"- Ratios are baseline ms / {primary} ms: above 1 means {primary} is faster (below 1 in bold). "
        f"The summary compares our graph rows with the (graph) columns and our events rows with the "
        f"({other or 'do_bench|events|sync'}) columns; a row with no such column counts as missing there.",
    ]
    for kernel, title in (("forward", "Forward"), ("decode", "Decode")):
        for timing in TIMINGS:
            rows = [e for e in entries if e["shape"].kernel == kernel and e["timing"] == timing]
            if rows:
                out += ["", f"## {title}, ours timed with {timing} ({len(rows)} shapes; {rate_unit(kernel)})", "",
                        _shape_table(rows, kernel, timing, names, columns, modes)]

    # Summary: distribution of the ratios per variant, kernel and timing, then the losses.
    out += ["", "## Summary (each of our rows against the baselines of its timing)", ""]
    srows = []
    for name in names:
        for kernel in ("forward", "decode"):
            for timing, d in summary.get(name, {}).get(kernel, {}).items():
                cells = [name, kernel, timing, d["baseline_timer"] or "not run", str(d["rows"])]
                for key in BASELINES:
                    st = d[f"vs_{key}"]
                    cells.append("—" if not st else
                                 f"{st['min']:.2f} / {st['median']:.2f} / {st['max']:.2f} (n={st['n']})")
                cells.append(str(len(d["slower_than_fa2"])))
                srows.append(cells)
    out.append(md_table(["variant", "kernel", "our timing", "baseline timer", "rows", "vs FA2 min / median / max",
                         "vs cuDNN min / median / max", "rows slower than FA2"], srows, {4, 7}))
    if any(r[2] == "events" and r[3] != "not run" for r in srows):
        out += ["", "Events rows are not one method on both sides: ours are batches of back-to-back calls "
                    "between two events, while the baseline timers time each call alone, dispatch included "
                    "(do_bench and events after an L2 flush): on short rows that costs the baselines 2-8 % "
                    "(docs/perf-notes.md v34). For one method on both sides, run the bench with --timing graph "
                    "(--bench-args)."]
    # The shapes where the primary variant loses to FA2 (the labels' lists are in compare.json).
    for kernel in ("forward", "decode"):
        for timing, d in summary.get(primary, {}).get(kernel, {}).items():
            if d["slower_than_fa2"]:
                out += ["", f"{primary} slower than FA2 ({primary}/FA2 < 1.0, both timed with {timing} "
                            f"/ {d['baseline_timer']}), {kernel}: {len(d['slower_than_fa2'])} rows"]
                out += [f"- {x['label']}: {x['vs_fa2']:.3f}" for x in d["slower_than_fa2"]]
    fails = summary.get("baseline_failures", {})
    if any(fails.values()):
        out += ["", "Baseline failures (no time; see the notes column and compare.json): "
                + ", ".join(f"{disp} ({m}) {fails.get(k, 0)}" for k, disp, m in columns)]
    return "\n".join(out) + "\n"


def _shape_table(rows: list[dict], kernel: str, timing: str, names: list[str],
                 columns: list[tuple[str, str, str]], modes: list[str]) -> str:
    """One markdown table: our times, every baseline column and our ratio to each."""
    primary, labels = names[0], names[1:]
    unit = rate_unit(kernel)
    fa2_mode = matched_timer(timing, modes) or "not run"
    headers = ["kernel", "dtype", "B", "H", "Hkv", "Sq", "Skv", "D", "causal", f"{primary} ms ({timing})"]
    headers += [f"{disp} ms ({m})" for _, disp, m in columns]
    headers += [f"{primary}/{disp} ({m})" for _, disp, m in columns]
    headers += [f"{primary} {unit}", "% matmul" if kernel == "forward" else "% copy"]
    # The bench's own extra columns, where its lines carry them (newer benches).
    extras = [(key, head) for key, head in (("tokens_per_s", "tokens/s"), ("max_abs_err", "max err"),
                                             ("mem_bytes", "mem MB"))
              if any(e["results"].get(primary, {}).get(key) is not None
                     or (key == "max_abs_err" and e["results"].get(primary, {}).get("check_error"))
                     for e in rows)]
    if kernel == "forward":  # prefill tokens/s adds little next to TFLOP/s
        extras = [x for x in extras if x[0] != "tokens_per_s"]
    headers += [f"{primary} {head}" for _, head in extras]
    for name in labels:
        headers += [f"{name} ms", f"{name}/FA2 ({fa2_mode})"]
    headers += ["origin", "notes"]
    right = set(range(2, len(headers) - 2)) - {8}
    body = []
    for e in rows:
        s: Shape = e["shape"]
        res = e["results"].get(primary, {})
        r = [s.kernel, s.dtype, str(s.batch), str(s.heads), str(s.kv_heads), str(s.seqlen_q),
             str(s.seqlen_k), str(s.head_dim), "yes" if s.causal else "no", fmt_ms(res.get("median_ms"))]
        r += [fmt_ms(e["baselines"].get(k, {}).get("ms")) for k, _, _ in columns]
        r += [fmt_ratio(res.get(f"vs_{k}")) for k, _, _ in columns]
        r += [fmt_rate(res.get("rate"), kernel), fmt_pct(res.get("pct_ceiling"))]
        r += [fmt_extra(key, res) for key, _ in extras]
        for name in labels:
            lr = e["results"].get(name, {})
            r += [fmt_ms(lr.get("median_ms")), fmt_ratio(lr.get("vs_matched", {}).get("fa2"))]
        r += ["/".join(e["origins"]), row_notes(e, names, columns)]
        body.append(r)
    return md_table(headers, body, right)


# --------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # headless GPU hosts have no display
    import matplotlib.pyplot as plt
    return plt


def impl_ms(e: dict, impl: str) -> float | None:
    """An implementation's time in one entry; the baselines timed like the entry."""
    for key, disp in BASELINES.items():
        if impl == disp:
            return e["baselines"].get(matched_key(e["timing"], key), {}).get("ms")
    return e["results"].get(impl, {}).get("median_ms")


def _impl_styles(names: list[str]) -> dict[str, str]:
    impls = [*names, *BASELINES.values()]
    # Fixed colours for the baselines, so plots of different runs compare at a glance.
    palette = ["tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]
    colors = {"FA2": "tab:orange", "cuDNN": "tab:red"}
    for i, n in enumerate(names):
        colors[n] = palette[i % len(palette)]
    return {i: colors[i] for i in impls}


def _pow2_label(x: int) -> str:
    return f"{x // 1024}k" if x >= 1024 and x % 1024 == 0 else str(x)


def _lines(ax, sel: list[dict], xkey: str, names: list[str], dtypes: list[str], colors: dict) -> float:
    """Draws one line per implementation (x dtype); returns the largest y drawn."""
    xs = sorted({getattr(e["shape"], xkey) for e in sel})
    styles = {"f16": "-", "bf16": "--"}
    ymax = 0.0
    for impl in colors:
        for dt in dtypes:
            pts = {}
            for e in sel:
                s = e["shape"]
                if s.dtype != dt:
                    continue
                y = rate(s, impl_ms(e, impl))
                if y is not None:
                    pts.setdefault(getattr(s, xkey), y)
            if not pts:
                continue
            # NaN for missing points breaks the line instead of bridging a gap.
            ys = [pts.get(x, math.nan) for x in xs]
            ymax = max(ymax, max(pts.values()))
            ax.plot(xs, ys, color=colors[impl], linestyle=styles.get(dt, "-"), marker="o", markersize=3,
                    label=impl if len(dtypes) == 1 else f"{impl} {dt}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([_pow2_label(x) for x in xs])
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    return ymax


def plot_forward(entries: list[dict], names: list[str], env: dict, ceilings: dict, path: Path,
                 timing: str) -> bool:
    # The "16k tokens per batch" sweep: B*S = 16384, square. Where two shapes land on
    # one point, the hidden-2048 one (the sweep's) wins.
    sel = [e for e in entries if e["shape"].kernel == "forward" and e["shape"].seqlen_q == e["shape"].seqlen_k
           and e["shape"].batch * e["shape"].seqlen_q == 16384 and e["timing"] == timing]
    sel.sort(key=lambda e: e["shape"].heads != 2048 // e["shape"].head_dim)
    if not sel:
        return False
    plt = _pyplot()
    dtypes = [d for d in DTYPE_ORDER if any(e["shape"].dtype == d for e in sel)]
    colors = _impl_styles(names)
    dims = sorted({e["shape"].head_dim for e in sel})
    fig, axes = plt.subplots(len(dims), 2, figsize=(13, 4.5 * len(dims)), squeeze=False)
    for r, d in enumerate(dims):
        for c, causal in enumerate((False, True)):
            ax = axes[r][c]
            panel = [e for e in sel if e["shape"].head_dim == d and e["shape"].causal == causal]
            ax.set_title(f"D={d}, {'causal' if causal else 'non-causal'}")
            if not panel:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
                continue
            ymax = _lines(ax, panel, "seqlen_q", names, dtypes, colors)
            ax.set_ylim(0, ymax * 1.15 or 1)
            ax.set_xlabel("sequence length (batch = 16384 / S)")
            ax.set_ylabel("TFLOP/s")
            ax.legend(fontsize=8, loc="lower right")
    mm = ceilings.get("matmul", {})
    ceil = ", ".join(f"{k} {v['tflops']:.0f}" for k, v in mm.items() if v.get("tflops"))
    fig.suptitle(f"Forward attention, 16k tokens per batch, timed with {timing} — {env.get('gpu')}"
                 + (f"\n(matmul {MATMUL_N}³ ceiling: {ceil} TFLOP/s)" if ceil else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_decode(entries: list[dict], names: list[str], env: dict, ceilings: dict, path: Path,
                timing: str) -> bool:
    sel = [e for e in entries if e["shape"].kernel == "decode" and e["shape"].heads == 32
           and e["shape"].kv_heads == 8 and e["shape"].head_dim == 128 and e["shape"].seqlen_q == 1
           and e["timing"] == timing]
    if not sel:
        return False
    plt = _pyplot()
    dtypes = [d for d in DTYPE_ORDER if any(e["shape"].dtype == d for e in sel)]
    colors = _impl_styles(names)
    batches = sorted({e["shape"].batch for e in sel})
    copy_gbps = ceilings.get("copy", {}).get("gbps")
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches) + 1, 4.8), squeeze=False)
    for ax, b in zip(axes[0], batches):
        panel = [e for e in sel if e["shape"].batch == b]
        ymax = _lines(ax, panel, "seqlen_k", names, dtypes, colors)
        if copy_gbps:
            ax.axhline(copy_gbps, color="gray", linestyle=":", label=f"copy {copy_gbps:.0f} GB/s")
            ymax = max(ymax, copy_gbps)
        ax.set_ylim(0, ymax * 1.1 or 1)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("cache length")
        ax.set_ylabel("GB/s (K+V bytes / time)")
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"Decode, Sq=1, GQA 32/8, D=128, timed with {timing} — {env.get('gpu')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def _json_safe(x: Any) -> Any:
    """NaN/inf are not JSON; tuples and Shapes become plain containers."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Shape):
        return x._asdict()
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_outputs(out: Path, env: dict, ceilings: dict, entries: list[dict], names: list[str],
                  sources: dict, bench: dict | None, self_test: bool = False) -> dict:
    derive(entries, ceilings)
    summary = summarize(entries, names, list(env.get("timers", {})))
    md = render_markdown(env, ceilings, entries, names, sources, bench, summary)
    print(md)
    files = {"markdown": out / "compare.md", "json": out / "compare.json"}
    files["markdown"].write_text(md, encoding="utf-8")
    rows = []
    for e in entries:
        r = {**e["shape"]._asdict(), "timing": e["timing"], "origins": e["origins"], "labels": e["labels"],
             "flops": flops(e["shape"]), "kv_bytes": kv_bytes(e["shape"]), "io_bytes": io_bytes(e["shape"]),
             "rate_unit": rate_unit(e["shape"].kernel), "results": e["results"], "baselines": e["baselines"]}
        rows.append(r)
    doc = {"tool": "scripts/compare-torch.py", "self_test": self_test, "environment": env,
           "ceilings": ceilings, "sources": sources, "bench": bench, "variants": names,
           "ratio_definition": "baseline_ms / variant_ms (> 1: variant faster); vs_KEY per baseline key, "
                               "vs_matched against the baseline timed like the row (graph with *_graph)",
           "rows": rows, "summary": summary}
    files["json"].write_text(json.dumps(_json_safe(doc), indent=1) + "\n", encoding="utf-8")
    try:
        for kernel, fn in (("forward", plot_forward), ("decode", plot_decode)):
            for timing in TIMINGS:
                tail = "" if timing == "events" else f"-{timing}"
                p = out / f"compare-{kernel}{tail}.png"
                if fn(entries, names, env, ceilings, p, timing):
                    files[f"{kernel}{tail.replace('-', '_')}_png"] = p
                else:
                    info(f"no rows for {p.name}; plot skipped")
    except ImportError as e:
        warn(f"matplotlib unavailable ({e}); plots skipped")
    except Exception as e:  # a plot must not cost the tables that are already written
        warn(f"plotting failed: {first_line(e)}")
    for p in files.values():
        info(f"wrote {p}")
    return files


# --------------------------------------------------------------------------
# --self-test: the whole reporting path on fabricated numbers, no torch
# --------------------------------------------------------------------------


def _fake_bench_shapes() -> list[tuple[str, Shape]]:
    """(origin, shape) of a fabricated bench run (test data, not the bench's list): sweep points and
    GQA 32/8 decode for the plots, a shape under two origins (floor, sweep), decode shapes timed both
    ways (decode-gqa, decode-graph) and the shapes _fake_baselines fails (seed-L4, SmolLM 9/3 D=64)."""
    return [("floor", Shape("forward", "f16", 4, 16, 16, 4096, 4096, 128, False)),
            *(("sweep", Shape("forward", dt, 16384 // s, 2048 // d, 2048 // d, s, s, d, c))
              for dt in DTYPE_ORDER for d in (64, 128) for c in (False, True) for s in (1024, 4096, 16384)),
            ("seed-L4", Shape("forward", "f16", 1, 1, 1, 128, 128, 64, True)),
            *(("decode-gqa", Shape("decode", "f16", b, 32, 8, 1, cache, 128, True))
              for b in (1, 8) for cache in (1024, 16384, 65536)),
            *(("decode-graph", Shape("decode", "f16", b, h, hkv, sq, cache, d, True))
              for h, hkv, d in ((32, 8, 128), (9, 3, 64)) for sq in (1, 4) for b in (1, 8) for cache in (1024, 16384))]


def _fake_ms(s: Shape, rng: random.Random, timing: str = "events") -> float:
    """A crude performance model, only so that plots and tables look plausible
    (graph timing: less fixed cost per launch)."""
    fixed = 0.004 if timing == "graph" else 0.009
    if s.kernel == "forward":
        work = flops(s)
        eff = 280e12 * min(1.0, work / 4e11) ** 0.15  # small problems run less efficiently
        return work / eff * 1e3 + fixed - 0.003 + rng.uniform(0, 0.002)
    return kv_bytes(s) / 3.9e12 * 1e3 + fixed + rng.uniform(0, 0.002)


def _fake_baselines(s: Shape, base: float, mode: str, rng: random.Random) -> dict:
    """{backend: result} under one timer, with the failures a real run records."""
    speed = 1.0 if mode != "graph" else rng.uniform(0.7, 1.0)  # graphs time no dispatch
    fa2 = {"ms": base * speed * rng.uniform(0.85, 1.25), "error": None, "notes": [], "kv_sets": 1, "timer": mode}
    cudnn = {"ms": base * speed * rng.uniform(0.6, 1.15), "error": None, "notes": [], "kv_sets": 1, "timer": mode}
    if mode == "graph":
        fa2["graph_launches"] = cudnn["graph_launches"] = graph_copies(s)
    if s.kernel == "decode" and s.heads != s.kv_heads:
        cudnn["notes"].append("GQA via repeat_interleave (enable_gqa rejected; K/V materialised 4x)")
        cudnn["enable_gqa_error"] = "enable_gqa: RuntimeError: No available kernel. Aborting execution."
    if s.kernel == "decode" and s.head_dim == 64:
        cudnn = {"ms": None, "notes": [], "kv_sets": 1, "timer": mode,
                 "error": "plain: RuntimeError: No available kernel. Aborting execution. "
                          "[fabricated by --self-test: a backend rejecting a shape]"}
    elif mode == "graph" and s.kernel == "decode" and s.seqlen_q == 4:
        cudnn = {"ms": None, "notes": [], "kv_sets": 1, "timer": mode,
                 "error": "plain: timing failed: GraphCaptureError: graph capture failed: RuntimeError: "
                          "[fabricated by --self-test: a backend that cannot be captured]"}
    if s == Shape("forward", "f16", 1, 1, 1, 128, 128, 64, True):
        fa2 = {"ms": None, "notes": [], "kv_sets": 1, "timer": mode, "error": "plain: RuntimeError: fabricated failure"}
    return {"fa2": fa2, "cudnn": cudnn}


def _fake_torch(call_ms: float, dispatch_ms: float, replay_ms: float):
    """Just enough of torch.cuda for Timer's graph method, on a simulated GPU clock:
    an eager call costs dispatch_ms + call_ms, a replay replay_ms + call_ms per
    captured call. Returns (torch, fn); fn raises while capturing if fail_capture."""
    import contextlib
    import types

    state = types.SimpleNamespace(clock=0.0, capturing=None, fail_capture=False, sync_fails=False)

    class Event:
        def __init__(self, enable_timing: bool):
            assert enable_timing
            self.t = None

        def record(self):
            self.t = state.clock

        def synchronize(self):
            pass

        def elapsed_time(self, end: "Event") -> float:
            return end.t - self.t

    class Graph:
        calls = 0

        def replay(self):
            state.clock += replay_ms + self.calls * call_ms

    @contextlib.contextmanager
    def graph(g: Graph, capture_error_mode: str):
        assert capture_error_mode == "thread_local"
        state.capturing = g
        try:
            yield
        finally:
            state.capturing = None

    def synchronize():
        if state.sync_fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    cuda = types.SimpleNamespace(Event=Event, CUDAGraph=Graph, graph=graph, synchronize=synchronize,
                                 Stream=lambda: stream, current_stream=lambda: stream,
                                 stream=lambda s: contextlib.nullcontext())

    def fn():
        if state.capturing is None:
            state.clock += dispatch_ms + call_ms
        elif state.fail_capture:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        else:
            state.capturing.calls += 1

    return types.SimpleNamespace(cuda=cuda, state=state), fn


def _graph_timer_checks() -> None:
    # Launch-bound (5 us calls, 20 us dispatch): N covers every copy; the replay
    # overhead is spread over N and no dispatch is timed.
    torch, fn = _fake_torch(call_ms=0.005, dispatch_ms=0.020, replay_ms=0.008)
    timer = Timer(torch, "graph", reps=50)
    ms = timer(fn, copies=300)
    assert timer.last_launches == 300 and abs(ms - (0.005 + 0.008 / 300)) < 1e-9, (timer.last_launches, ms)
    timer(fn, copies=5000)
    assert timer.last_launches == GRAPH_MAX_LAUNCHES
    # Few copies: about GRAPH_TARGET_MS of work (estimated with dispatch), at least the minimum.
    timer(fn, copies=1)
    assert timer.last_launches == math.ceil(GRAPH_TARGET_MS / 0.025)
    torch, fn = _fake_torch(call_ms=2.0, dispatch_ms=0.02, replay_ms=0.008)
    assert abs(Timer(torch, "graph", reps=5)(fn, copies=1) - (2.0 + 0.008 / GRAPH_MIN_LAUNCHES)) < 1e-9
    # A capture that fails with the context intact is a GraphCaptureError (a table
    # entry), one that leaves the context broken re-raises the context's error.
    torch.state.fail_capture = True
    for sync_fails, want in ((False, GraphCaptureError), (True, RuntimeError)):
        torch.state.sync_fails = sync_fails
        try:
            Timer(torch, "graph", reps=5)(fn, copies=1)
        except Exception as e:
            assert type(e) is want and ("illegal memory" in str(e)) == sync_fails, e
        else:
            raise AssertionError("a failed capture was not reported")
    tb = object.__new__(TorchBench)  # only _note_fatal, which needs no torch
    tb.dead = None
    tb._note_fatal(GraphCaptureError("graph capture failed: RuntimeError: CUDA error: not permitted"))
    assert tb.dead is None
    info("(the 'CUDA error' warning below is expected: the self-test feeds one on purpose)")
    tb._note_fatal(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert tb.dead is not None


def _unit_checks(tmp: Path) -> None:
    # Origins and labels come from the lines: a shape the bench ran under two
    # origins (floor and sweep) keeps both, --filter matches either label, and a
    # line without "label" gets the one the bench would print.
    floor = Shape("forward", "f16", 4, 16, 16, 4096, 4096, 128, False)
    assert shape_label(floor, "sweep") == "sweep forward f16 b4 h16/16 q4096 k4096 d128"
    line = {**floor._asdict(), "median_ms": 2.0}
    fe = merge({"ours": [parse_row({**line, "origin": "floor", "label": "floor forward f16 b4 h16/16 q4096 k4096 "
                                    "d128"}), parse_row({**line, "origin": "sweep"})]})[0]
    assert fe["origins"] == ["floor", "sweep"] and fe["labels"][1] == shape_label(floor, "sweep")
    assert matches_filter(fe, "floor") and matches_filter(fe, "sweep forward f16 b4")
    assert not matches_filter(fe, "seed-L4") and not matches_filter(fe, "causal")
    assert parse_row(line)["origin"] == "other" and parse_row(line)["label"].startswith("other forward")
    # The bench's label wins over the rebuilt one (it carries the policy, page size, ...).
    assert parse_row({**line, "label": "x forward paged16"})["label"] == "x forward paged16"
    assert abs(flops(floor) - 549.76e9) < 1e8  # docs/perf-notes.md: 550 G
    dec = Shape("decode", "f16", 8, 32, 8, 1, 16384, 128, True)
    assert kv_bytes(dec) == 536870912  # perf notes: 537 MB
    assert flops(dec) == 4.0 * 8 * 32 * 16384 * 128  # causal does not halve decode
    assert abs(rate(floor, 2.0) - 274.88) < 0.01
    # The bench's graph copies (random_sets with the graph cap) and launches per graph.
    assert graph_copies(Shape("decode", "f16", 1, 9, 3, 1, 256, 64, True)) == GRAPH_MAX_LAUNCHES  # 1350 capped
    assert graph_copies(Shape("decode", "f16", 1, 32, 8, 1, 4096, 128, True)) == 16
    assert graph_copies(dec) == 1
    assert graph_launches(0.1, 1) == 16 and graph_launches(0.004, 1) == 125 and graph_launches(0.0, 1) == 1024
    assert graph_launches(0.004, 700) == 700 and graph_launches(5.0, 1) == GRAPH_MIN_LAUNCHES

    # --timer parsing: non-graph timer first.
    assert parse_timers("graph,do_bench") == ["do_bench", "graph"] and parse_timers("graph") == ["graph"]
    assert parse_timers(" sync , graph ") == ["sync", "graph"]
    for bad in ("", ",", "do_bench,events", "graph,graph", "cudagraph"):
        try:
            parse_timers(bad)
        except argparse.ArgumentTypeError:
            continue
        raise AssertionError(f"parse_timers accepted {bad!r}")
    assert matched_timer("graph", ["do_bench"]) is None and matched_timer("events", ["sync", "graph"]) == "sync"
    assert matched_key("graph", "fa2") == "fa2_graph" and matched_key("events", "cudnn") == "cudnn"
    _graph_timer_checks()

    # --label parsing.
    assert parse_label("v1=a/b=c.jsonl") == ("v1", "a/b=c.jsonl")
    for bad in ("v1", "=x", "v1=", "ours=x", "FA2=x", "CUDNN=x", "a|b=x"):
        try:
            parse_label(bad)
        except argparse.ArgumentTypeError:
            continue
        raise AssertionError(f"parse_label accepted {bad!r}")

    # JSON lines: good rows are kept, bad ones are skipped with a warning.
    good = {"kernel": "forward", "dtype": "f16", "batch": 4, "heads": 16, "kv_heads": 16, "seqlen_q": 4096,
            "seqlen_k": 4096, "head_dim": 128, "causal": False, "median_ms": 2.0, "tflops": 1.0, "gbps": 1.0}
    lines = [json.dumps(good), "", "# comment", "{not json",
             json.dumps({**good, "median_ms": -1}), json.dumps({k: v for k, v in good.items() if k != "heads"}),
             json.dumps({**good, "kernel": "backward"}), json.dumps({**good, "batch": 2.5}),
             json.dumps({**good, "heads": 12, "kv_heads": 8}), json.dumps([1, 2]),
             json.dumps({**good, "dtype": "bfloat16", "causal": "true", "median_ms": 1.5}),
             # Policy rows (same shape keys as `good`) are skipped, not merged.
             json.dumps({**good, "policy": "softcap50", "origin": "policy-scores", "median_ms": 2.2}),
             json.dumps({**good, "policy": "none", "origin": "policy-scores", "median_ms": 2.1}),
             # Timing: graph rows are kept apart from the events rows of the same shape.
             json.dumps({**good, "timing": "graph", "origin": "floor", "median_ms": 1.8, "max_abs_err": 0.02,
                         "abs_tol": 0.002, "mem_bytes": 268435456}),
             json.dumps({**good, "timing": "cudagraph"})]
    p = tmp / "unit.jsonl"
    p.write_text("\n".join(lines) + "\n")
    info("(the 'line skipped' warnings below are expected: the self-test feeds bad lines on purpose)")
    rows = read_jsonl(p)
    assert len(rows) == 3, rows
    assert rows[1]["shape"].dtype == "bf16" and rows[1]["shape"].causal is True
    assert rows[0]["timing"] == "events" and rows[0]["origin"] == "other" and rows[0]["max_abs_err"] is None
    assert rows[2]["timing"] == "graph" and rows[2]["origin"] == "floor" and rows[2]["mem_bytes"] == 268435456

    # Merge: one entry per (shape, timing); duplicates keep the first time;
    # ratios are baseline / ours, vs_matched against the baseline column of its timing (graph rows: graph).
    entries = merge({"ours": [rows[0], {**rows[0], "median_ms": 2.5}, rows[2]], "v0": [rows[0]]})
    assert [e["timing"] for e in entries] == ["events", "graph"]
    assert entries[0]["results"]["ours"]["dup_ms"] == [2.5] and entries[1]["results"]["ours"]["dup_ms"] == []
    assert entries[0]["origins"] == ["other"] and entries[1]["origins"] == ["floor"]
    baselines = {"fa2": {"ms": 4.0, "notes": []}, "cudnn": {"ms": 1.0, "notes": []},
                 "fa2_graph": {"ms": 3.6, "notes": []}, "cudnn_graph": {"ms": None, "notes": [], "error": "x"}}
    for e in entries:
        e["baselines"] = baselines  # shared, as main() shares one shape's baselines
    ceilings = {"matmul": {"f16": {"tflops": 800.0}}, "copy": {"gbps": 4000.0}}
    derive(entries, ceilings)
    res = entries[0]["results"]["ours"]
    assert res["vs_fa2"] == 2.0 and res["vs_cudnn"] == 0.5 and res["vs_matched"] == {"fa2": 2.0, "cudnn": 0.5}
    assert abs(res["pct_ceiling"] - 100 * 274.88 / 800) < 0.01
    graph_res = entries[1]["results"]["ours"]
    assert graph_res["vs_matched"] == {"fa2": 2.0, "cudnn": None} and graph_res["vs_fa2"] == 4.0 / 1.8
    modes = ["do_bench", "graph"]
    assert "repeated shape disagrees" in row_notes(entries[0], ["ours"], baseline_columns(modes))
    assert "cuDNN (graph) failed: x" in row_notes(entries[1], ["ours"], baseline_columns(modes))
    summary = summarize(entries, ["ours", "v0"], modes)
    assert summary["ours"]["forward"]["graph"]["baseline_timer"] == "graph"
    assert summary["ours"]["forward"]["graph"]["vs_fa2"]["median"] == 2.0
    assert summary["ours"]["forward"]["events"]["vs_fa2"]["median"] == 2.0
    assert "graph" not in summary["v0"]["forward"] and summary["baseline_failures"]["cudnn_graph"] == 2
    env = {"timers": {m: Timer.DESCRIPTIONS[m] for m in modes}}
    md = render_markdown(env, ceilings, entries, ["ours", "v0"], {}, None, summary)
    assert "## Forward, ours timed with graph" in md and "| FA2 ms (graph) |" in md and "ours/FA2 (do_bench)" in md
    # The bench's extra columns: shown where its lines have them, an error above abs_tol flagged.
    assert "| ours max err | ours mem MB |" in md and "| **2.0e-02!** | 268 |" in md
    assert fmt_extra("tokens_per_s", {"tokens_per_s": 2.5e6}) == "2.50M"
    assert fmt_extra("max_abs_err", {"max_abs_err": None, "check_error": "O[...] = NaN"}) == "**NaN**"
    # Without a graph timer, graph rows have no matched baseline ("not run"), never a do_bench one.
    only = {"fa2": baselines["fa2"], "cudnn": baselines["cudnn"]}
    for e in entries:
        e["baselines"] = only
    derive(entries, ceilings)
    summary = summarize(entries, ["ours"], ["do_bench"])
    assert summary["ours"]["forward"]["graph"]["vs_fa2"] is None
    assert "| ours | forward | graph | not run | 1 | — |" in render_markdown(
        {"timers": {"do_bench": "x"}}, ceilings, entries, ["ours"], {}, None, summary)
    table = md_table(["a", "b"], [["1", "x\\|y"]], {0})
    assert table.splitlines()[1] == "| ---: | --- |"
    assert _json_safe({"x": math.nan, "s": floor})["x"] is None


def self_test(args: argparse.Namespace) -> int:
    rng = random.Random(20261121)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="compare-torch-selftest-"))
    out.mkdir(parents=True, exist_ok=True)
    _unit_checks(out)
    info("unit checks passed")

    sources: dict[str, str] = {}
    if args.ours:
        ours = read_jsonl(args.ours)
        sources["ours"] = str(args.ours)
        # Our formulas must reproduce the bench's own tflops/gbps, or the ceiling
        # percentages here would not mean what the bench's numbers mean.
        for r in ours:
            s, ms = r["shape"], r["median_ms"]
            for key, mine in (("tflops", flops(s) / (ms * 1e-3) / 1e12), ("gbps", io_bytes(s) / (ms * 1e-3) / 1e9),
                              ("tokens_per_s", s.batch * s.seqlen_q / (ms * 1e-3))):
                if r.get(key) is not None and abs(r[key] - mine) > 1e-6 * max(1.0, abs(mine)):
                    raise AssertionError(f"{r['label']}: bench {key}={r[key]} but formula gives {mine}")
        info(f"{len(ours)} rows of {args.ours}: bench tflops/gbps/tokens_per_s match this script's formulas")
    else:
        # Fabricate a bench file and read it back, so the JSONL path is exercised too.
        fake = out / "fake-ours.jsonl"
        with open(fake, "w") as f:
            for n, (origin, s) in enumerate(_fake_bench_shapes()):
                timing = "graph" if origin == "decode-graph" else "events"
                ms = _fake_ms(s, rng, timing)
                tol = 4 / 2048 if s.dtype == "f16" else 4 / 256
                line = {**s._asdict(), "median_ms": ms, "tflops": flops(s) / (ms * 1e-3) / 1e12,
                        "gbps": io_bytes(s) / (ms * 1e-3) / 1e9, "timing": timing, "origin": origin,
                        "label": shape_label(s, origin), "tokens_per_s": s.batch * s.seqlen_q / (ms * 1e-3),
                        "max_abs_err": tol * rng.uniform(0.02, 0.5), "abs_tol": tol,
                        "mem_bytes": int(io_bytes(s)), "mem_used_delta_bytes": int(io_bytes(s) * 8)}
                if n % 7 == 3:  # an older bench's line: no label, no extra columns
                    line = {k: v for k, v in line.items() if k not in ("label", *BENCH_EXTRAS[2:])}
                if n == 5:
                    line.update(max_abs_err=None, check_error="O[token 0, head 3, 17] = NaN, want 1.2e-2")
                f.write(json.dumps(line) + "\n")
        ours = read_jsonl(fake)
        sources["ours"] = str(fake)
    variants = {"ours": ours}
    # One fabricated older version ("v0", ~10% slower) plus any --label given.
    v0 = out / "fake-v0.jsonl"
    with open(v0, "w") as f:
        for r in ours:
            f.write(json.dumps({**r["shape"]._asdict(), "median_ms": r["median_ms"] * rng.uniform(1.0, 1.2),
                                "timing": r["timing"], "origin": r["origin"]}) + "\n")
    for name, path in [parse_label(f"v0={v0}"), *(args.label or [])]:
        variants[name] = read_jsonl(path)
        sources[name] = str(path)

    entries = [e for e in merge(variants) if matches_filter(e, args.filter)]
    if not entries:
        warn("no shapes left after --filter")
        return 1
    modes = ["do_bench", "graph"]
    fabricated: dict[Shape, dict] = {}  # one shape's baselines serve both of its timings, as in main()
    for e in entries:
        if e["shape"] not in fabricated:
            base = e["results"].get("ours", next(iter(e["results"].values())))["median_ms"]
            fabricated[e["shape"]] = {k + timer_suffix(m): r for m in modes
                                      for k, r in _fake_baselines(e["shape"], base, m, rng).items()}
        e["baselines"] = fabricated[e["shape"]]
    env = {"gpu": "FAKE GPU (--self-test, fabricated numbers)", "compute_capability": "9.0", "sms": 132,
           "memory_gib": 139.8, "l2_mib": 60, "driver": "0.0", "cuda": "13.0", "torch": "not imported",
           "cudnn": None, "triton": None, "python": platform.python_version(), "host": platform.node(),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "flash_attention_impl": "bundled FA2", "timers": {m: Timer.DESCRIPTIONS[m] for m in modes}}
    ceilings = {"matmul": {"f16": {"n": MATMUL_N, "ms": 1.40, "tflops": 2 * MATMUL_N**3 / 1.40e-3 / 1e12},
                           "bf16": {"n": MATMUL_N, "ms": 1.41, "tflops": 2 * MATMUL_N**3 / 1.41e-3 / 1e12}},
                "copy": {"bytes_each_way": COPY_BYTES, "ms": 2.0, "gbps": 2 * COPY_BYTES / 2e-3 / 1e9}}
    files = write_outputs(out, env, ceilings, entries, list(variants), sources, None, self_test=True)
    doc = json.loads(files["json"].read_text())
    assert len(doc["rows"]) == len(entries) and doc["self_test"] is True
    assert {r["timing"] for r in doc["rows"]} == ({"events", "graph"} & {e["timing"] for e in entries})
    for key in ("forward_png", "decode_png", "decode_graph_png"):
        if key in files:
            assert files[key].stat().st_size > 10_000, files[key]
    info(f"self-test passed; outputs in {out}")
    return 0


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Time PyTorch SDPA (FA2 and cuDNN backends) on the shapes of our bench results and compare.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See the module docstring (head of this file) for examples.")
    ap.add_argument("--ours", metavar="PATH.jsonl", help="our bench results (JSON lines)")
    ap.add_argument("--run-bench", metavar="BUNDLE_DIR",
                    help="run BUNDLE_DIR/run-bench.sh first and use its results (instead of --ours)")
    ap.add_argument("--bench-args", metavar="ARGS", default="",
                    help='arguments for run-bench.sh, one string, e.g. "--quick"')
    ap.add_argument("--out", metavar="DIR", help="output directory (created); required unless --self-test")
    ap.add_argument("--filter", metavar="SUBSTR",
                    help="only shapes whose bench label contains SUBSTR, e.g. 'sweep', 'decode', 'd128 causal'")
    ap.add_argument("--reps", type=int, default=50,
                    help="timed calls per measurement for --timer events|sync (default 50, as the bench)")
    ap.add_argument("--timer", metavar="MODE[,graph]", type=parse_timers,
                    help="baseline timing methods: do_bench, events or sync, and/or graph, comma-separated "
                         "(default do_bench, plus graph when some of our rows are graph-timed; see the module "
                         "docstring)")
    ap.add_argument("--label", metavar="NAME=PATH.jsonl", type=parse_label, action="append",
                    help="another of our result files, shown as extra columns (repeatable)")
    ap.add_argument("--self-test", action="store_true",
                    help="no torch/GPU: fabricate results and exercise tables, JSON and plots")
    # argparse refuses `--bench-args "--quick"` (the value looks like an option),
    # so glue the value on: `--bench-args=--quick` parses.
    argv = list(sys.argv[1:] if argv is None else argv)
    for i in range(len(argv) - 1):
        if argv[i] == "--bench-args":
            argv[i:i + 2] = [f"--bench-args={argv[i + 1]}"]
            break
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    if not args.self_test:
        if bool(args.ours) == bool(args.run_bench):
            ap.error("give exactly one of --ours PATH and --run-bench BUNDLE_DIR")
        if not args.out:
            ap.error("--out DIR is required")
    elif args.run_bench:
        ap.error("--run-bench needs a GPU; it cannot be combined with --self-test")
    if args.label:
        names = [n for n, _ in args.label]
        if len(set(names)) != len(names):
            ap.error("--label names must be distinct")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.self_test:
        return self_test(args)

    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"error: cannot create --out {out}: {e}", file=sys.stderr)
        return 1
    bench = None
    bench_failed = False
    if args.run_bench:
        try:
            ours_path, bench = run_bench(args.run_bench, args.bench_args, args.filter, out)
        except (OSError, subprocess.SubprocessError) as e:
            print(f"error: cannot run the bench: {e}", file=sys.stderr)
            return 1
        if bench["returncode"] != 0:
            # Keep going with whatever rows it wrote (a crash late in the list still
            # leaves useful data), but the exit status reports the failure.
            bench_failed = True
            warn(f"run-bench.sh exited with {bench['returncode']}; see {bench['log']}")
        if not ours_path.exists():
            print(f"error: the bench wrote no {ours_path}", file=sys.stderr)
            return 1
    else:
        ours_path = Path(args.ours)

    sources = {"ours": str(ours_path)}
    try:
        variants = {"ours": read_jsonl(ours_path)}
        for name, path in args.label or []:
            variants[name] = read_jsonl(path)
            sources[name] = path
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not variants["ours"]:
        print(f"error: no usable rows in {ours_path}", file=sys.stderr)
        return 1
    for name, rows in variants.items():
        if not rows:
            warn(f"{name}: no usable rows in {sources[name]}")
    entries = [e for e in merge(variants) if matches_filter(e, args.filter)]
    if not entries:
        print(f"error: no shapes match --filter {args.filter!r}", file=sys.stderr)
        return 1
    unknown = [e for e in entries if e["origins"] == ["other"]]
    if unknown:
        warn(f"{len(unknown)} shapes come from lines without an \"origin\" (an older bench): origin 'other', "
             "labels rebuilt from the shape keys")

    modes = args.timer or ["do_bench"] + (["graph"] if any(e["timing"] == "graph" for e in entries) else [])
    try:
        tb = TorchBench(modes, args.reps)
    except Exception as e:
        print(f"error: cannot set up PyTorch/CUDA: {first_line(e)}", file=sys.stderr)
        return 1
    env = tb.environment()
    info(f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}; timers: "
         + "; ".join(f"{m}: {d}" for m, d in env["timers"].items()))
    info("measuring ceilings (matmul f16/bf16, device-to-device copy)")
    ceilings = tb.ceilings()
    # A shape timed both ways by us (two entries) has its baselines timed once.
    measured: dict[Shape, dict] = {}
    for i, e in enumerate(entries, 1):
        s = e["shape"]
        if s not in measured:
            measured[s] = tb.baselines(s)
        e["baselines"] = measured[s]
        got = ", ".join(f"{disp} ({m}) " + (fmt_ms(e['baselines'][k]['ms']) + " ms" if e["baselines"][k]["ms"]
                                            else "failed") for k, disp, m in baseline_columns(modes))
        info(f"[{i}/{len(entries)}] {e['labels'][0]} ({e['timing']}): {got}")
    # A timer can fall back from do_bench mid-run (an old triton); report the one used.
    env["timers"] = tb.timer_descriptions()
    write_outputs(out, env, ceilings, entries, list(variants), sources, bench)
    if tb.dead:
        warn(f"a CUDA error stopped the baselines early: {tb.dead}")
        return 1
    return 1 if bench_failed else 0


if __name__ == "__main__":
    sys.exit(main())
