#!/usr/bin/env python3
"""The playground's comparisons (scripts/playground.sh).

ptxas HEAD.txt NEW.txt
    Two scripts/ptxas-check.sh reports side by side per (arch, entry): every
    changed value marked, entries added or removed listed.
bench NEW.jsonl REPEAT.jsonl [BASE.jsonl]
    Bench rows (JSON lines of benches/attention.rs) keyed by their shape. The
    two new runs give each row's run-to-run spread |new/repeat - 1|; a row is
    flagged when |new/base - 1| exceeds max(2 x spread, FLOOR). Two runs in one
    process understate the variation between processes: the same code against
    the v11 baseline (H100, another process and day) moved up to 4.4%, 18 of 96
    sweep rows beyond max(2 x spread, 1%), 4 (3.2-3.6%) beyond max(2 x spread,
    3%). Hence FLOOR = 3%, and a flag under ~4% is worth a second run.
ab NAME=FILE.jsonl...
    Builds timed in one session (playground.sh ab): per row, each build's
    smallest median over its rounds, its ratio to the first build's (first ms
    / its ms: above 1 is faster), and its spread over the rounds (largest
    median / smallest).
"""
import json
import os
import sys

# Smallest change flagged: process-to-process variation of unchanged code.
FLOOR = 0.03
# Keys of a bench line that are measurements (or, like "label", derived from the
# shape keys and absent from older files), not part of the row's identity.
RESULT_FIELDS = {"median_ms", "tflops", "gbps", "splits", "ring_stages", "versus", "full_over_window_time",
                 "varlen_over_fixed_tflops", "overhead_pct", "plain_ms", "label", "tokens_per_s", "max_abs_err",
                 "ref_max_abs", "abs_tol", "checked_rows", "check_error", "mem_bytes", "mem_used_delta_bytes"}


def ptxas_rows(path):
    rows, header = {}, None
    for line in open(path):
        cols = line.split()
        if cols[:2] == ["arch", "entry"]:
            header = cols[2:]
        elif header and len(cols) == len(header) + 2 and cols[0].startswith("sm_"):
            rows[(cols[0], cols[1])] = cols[2:]
    return header or [], rows


def compare_ptxas(head_path, new_path):
    header, head = ptxas_rows(head_path)
    _, new = ptxas_rows(new_path)
    changed = 0
    print(f"{'arch':<6} {'entry':<44} " + " ".join(f"{h:>18}" for h in header))
    for key in sorted(set(head) | set(new)):
        a, b = head.get(key), new.get(key)
        if a is None or b is None:
            changed += 1
            print(f"{key[0]:<6} {key[1]:<44} {'added' if a is None else 'removed'}")
            continue
        if a == b:
            continue
        changed += 1
        cells = [f"{x:>18}" if x == y else f"{x + ' -> ' + y + ' *':>18}" for x, y in zip(a, b)]
        print(f"{key[0]:<6} {key[1]:<44} " + " ".join(cells))
    print(f"playground: {len(new)} entries, {changed} changed against HEAD's PTX")


def bench_rows(path):
    rows = {}
    for line in open(path):
        if line.strip():
            row = json.loads(line)
            key = tuple(sorted((k, str(v)) for k, v in row.items() if k not in RESULT_FIELDS))
            rows[key] = row
    return rows


def label(key):
    d = dict(key)
    return (f"{d.get('kernel', '?')} {d.get('dtype', '')} B={d.get('batch')} H={d.get('heads')}/"
            f"{d.get('kv_heads')} Sq={d.get('seqlen_q')} Skv={d.get('seqlen_k')} D={d.get('head_dim')}"
            f"{' causal' if d.get('causal') == 'True' else ''} {d.get('origin', '')}")


def compare_bench(new_path, repeat_path, base_path=None):
    new, repeat = bench_rows(new_path), bench_rows(repeat_path)
    base = bench_rows(base_path) if base_path else {}
    flagged = 0
    print(f"{'shape':<72} {'new ms':>10} {'spread':>7} {'base ms':>10} {'new/base':>9}")
    for key, row in new.items():
        ms = row["median_ms"]
        spread = abs(ms / repeat[key]["median_ms"] - 1) if key in repeat else float("nan")
        line = f"{label(key):<72} {ms:>10.4f} {spread:>6.1%}"
        if key in base:
            ratio = ms / base[key]["median_ms"]
            flag = abs(ratio - 1) > max(2 * spread, FLOOR)
            flagged += flag
            line += f" {base[key]['median_ms']:>10.4f} {ratio:>9.3f}{'  <- moved' if flag else ''}"
        elif base:
            line += f" {'(not in baseline)':>20}"
        print(line)
    if base:
        print(f"playground: {len(new)} rows, {flagged} moved beyond the run-to-run spread")
    else:
        print(f"playground: {len(new)} rows; no baseline given (this run's rows are in {new_path})")


def compare_ab(runs):
    names, medians = [], {}
    for run in runs:
        name, path = run.split("=", 1)
        if name not in names:
            names.append(name)
        if not os.path.exists(path):
            print(f"playground: {path} missing (the run wrote no rows)")
            continue
        for key, row in bench_rows(path).items():
            medians.setdefault(key, {}).setdefault(name, []).append(row["median_ms"])
    first = names[0]
    head = [f"{first + ' ms':>12} {'spread':>7}"]
    head += [f"{n + ' ms':>12} {'spread':>7} {'x ' + first:>9}" for n in names[1:]]
    print(f"{'shape':<72} " + " ".join(head))
    for key, by_name in medians.items():
        base = min(by_name[first]) if first in by_name else None
        cells = []
        for n in names:
            ms = by_name.get(n)
            if not ms:
                cells.append(f"{'-':>12} {'':>7}" + ("" if n == first else f" {'':>9}"))
                continue
            cell = f"{min(ms):>12.4f} {max(ms) / min(ms):>7.3f}"
            if n != first:
                cell += f" {base / min(ms):>9.3f}" if base else f" {'-':>9}"
            cells.append(cell)
        print(f"{label(key):<72} " + " ".join(cells))
    print(f"playground: {len(medians)} rows, builds {', '.join(names)}; "
          f"x {first} = {first}'s ms / the build's (above 1: faster); spread = largest / smallest median")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "ptxas":
        compare_ptxas(sys.argv[2], sys.argv[3])
    elif len(sys.argv) in (4, 5) and sys.argv[1] == "bench":
        compare_bench(*sys.argv[2:])
    elif len(sys.argv) >= 3 and sys.argv[1] == "ab" and all("=" in a for a in sys.argv[2:]):
        compare_ab(sys.argv[2:])
    else:
        sys.exit(__doc__)
