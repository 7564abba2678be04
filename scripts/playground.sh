#!/usr/bin/env bash
# The kernel playground: one command from a kernel edit to a verdict.
#
# On the CPU machine, after editing kernels-gpu/src:
#   scripts/playground.sh build [DIR]
# rebuilds the PTX from source, prints ptxas's report per entry (registers,
# stack, spills, barriers; shared memory is the config's, per tile) beside the
# report of HEAD's committed PTX with every change marked, fails on spills or
# stack frames in an attention kernel, and builds the GPU bundle in DIR
# (default: bundle) with this script and its comparer inside.
#
# On the GPU host, in the bundle:
#   ./playground.sh run --filter SUBSTR [--baseline BASE.jsonl]
# runs the GPU test suite, then the bench rows matching SUBSTR twice (the two
# runs measure this run's spread), and prints per row the new median, the
# baseline's and their ratio, flagged where it moves more than the spread
# allows. The new rows are kept in playground-new.jsonl, the baseline of the
# next edit.
set -euo pipefail

mode=${1:-}
shift || true
case "$mode" in
build)
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    dir=${1:-bundle}
    cd "$root"
    before=$(mktemp -d)
    trap 'rm -rf "$before"' EXIT
    for ptx in kernels-gpu/ptx/flash_attn_sm*.ptx; do
        git show "HEAD:$ptx" >"$before/$(basename "$ptx")"
    done
    scripts/update-ptx.sh
    scripts/ptxas-check.sh "$before" >"$before/report-head.txt" 2>&1 || true
    status=0
    scripts/ptxas-check.sh >"$before/report-new.txt" 2>&1 || status=$?
    python3 scripts/playground-compare.py ptxas "$before/report-head.txt" "$before/report-new.txt"
    if [ "$status" != 0 ]; then
        grep -E "FAIL|ptxas-check:" "$before/report-new.txt" >&2
        echo "playground: ptxas check failed; no bundle built" >&2
        exit 1
    fi
    scripts/gpu-bundle.sh "$dir"
    cp scripts/playground.sh scripts/playground-compare.py "$dir/"
    echo "playground: bundle in $dir; on the GPU host: ./playground.sh run --filter SUBSTR [--baseline BASE.jsonl]"
    ;;
run)
    cd "$(dirname "${BASH_SOURCE[0]}")"
    filter="" baseline=""
    while [ $# -gt 0 ]; do
        case "$1" in
        --filter) filter=$2; shift 2 ;;
        --baseline) baseline=$2; shift 2 ;;
        *) echo "playground run: unknown argument $1" >&2; exit 2 ;;
        esac
    done
    [ -n "$filter" ] || { echo "playground run: --filter SUBSTR is required" >&2; exit 2; }
    ./gpu-tests
    ./bench --filter "$filter" --json playground-new.jsonl >/dev/null
    ./bench --filter "$filter" --json playground-repeat.jsonl >/dev/null
    "${PYTHON:-python3}" playground-compare.py bench playground-new.jsonl playground-repeat.jsonl ${baseline:+"$baseline"}
    ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
