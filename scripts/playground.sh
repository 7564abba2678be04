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
#
# Builds of several commits side by side, in one GPU session:
#   scripts/playground.sh ab-build [--dir DIR] NAME=REF...
# builds the bench and the GPU suite of each git REF (in a temporary worktree,
# from its committed PTX and cubins) into DIR/ab/NAME (default: bundle) and
# packs them into DIR/ab.tar.xz, the form small enough to carry; then on the
# GPU host, in the bundle:
#   ./playground.sh ab-tests [--builds A,B] [--timeout S] [-- SUITE_ARGS]
# runs each build's suite (each under the timeout, default 600 s: a hung
# kernel ends the run, not the session), and
#   ./playground.sh ab --filter SUBSTR [--builds A,B] [--rounds N] [--timeout S] [-- BENCH_ARGS]
# runs each build's bench on the matching rows, the builds interleaved, N
# rounds (default 3), and prints per row each build's smallest median and
# its ratio to the first build's (the first NAME given to ab-build; above 1:
# faster than it), with each build's spread over the rounds. The rows are
# kept in ab-out/. `--builds` picks some of the builds, in that order.
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
    for ptx in kernels-gpu/ptx/flash_attn_sm*.ptx.zst; do
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
ab-build)
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    dir=bundle
    if [ "${1:-}" = --dir ]; then
        dir=$2
        shift 2
    fi
    [ $# -gt 0 ] || { echo "playground ab-build: give NAME=REF for each build" >&2; exit 2; }
    cd "$root"
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    rm -rf "$dir/ab" "$dir/ab.tar.xz"
    tree=$(mktemp -d)
    trap 'git -C "$root" worktree remove --force "$tree/src" >/dev/null 2>&1 || true; rm -rf "$tree"' EXIT
    for pair in "$@"; do
        name=${pair%%=*} ref=${pair#*=}
        [[ "$name" =~ ^[A-Za-z0-9_.-]+$ && "$pair" == *=* ]] || {
            echo "playground ab-build: $pair is not NAME=REF" >&2
            exit 2
        }
        [ ! -e "$dir/ab/$name" ] || { echo "playground ab-build: $name given twice" >&2; exit 2; }
        git worktree add --detach "$tree/src" "$ref" >/dev/null
        mkdir -p "$dir/ab/$name"
        # One target dir for every build: only the crates a ref changes rebuild.
        (
            cd "$tree/src"
            export CARGO_TARGET_DIR="$root/target/playground-ab"
            {
                cargo test --release --no-run --message-format=json-render-diagnostics --test gpu
                cargo bench --no-run --message-format=json-render-diagnostics --bench attention
            } | python3 "$root/scripts/cargo-executables.py" | while read -r target exe; do
                case "$target" in
                gpu) cp "$exe" "$dir/ab/$name/gpu-tests" ;;
                attention) cp "$exe" "$dir/ab/$name/bench" ;;
                esac
            done
        )
        git -C "$root" rev-parse "$ref" >"$dir/ab/$name/commit"
        echo "$name" >>"$dir/ab/order"
        git worktree remove --force "$tree/src"
        [ -x "$dir/ab/$name/bench" ] && [ -x "$dir/ab/$name/gpu-tests" ] || {
            echo "playground ab-build: $ref built no bench or suite" >&2
            exit 1
        }
        echo "playground: $name = $ref ($(cut -c1-12 "$dir/ab/$name/commit"))"
    done
    # One block with a dictionary wider than a binary: the builds share most
    # of their bytes (the PTX), which only a window that spans them finds.
    tar -C "$dir" -cf - ab | xz -T2 --lzma2=preset=6,dict=256MiB >"$dir/ab.tar.xz"
    rm -rf "$dir/ab"
    cp scripts/playground.sh scripts/playground-compare.py "$dir/"
    echo "playground: $(du -h "$dir/ab.tar.xz" | cut -f1) in $dir/ab.tar.xz; on the GPU host: ./playground.sh ab-tests, ./playground.sh ab --filter SUBSTR"
    ;;
ab-tests | ab)
    cd "$(dirname "${BASH_SOURCE[0]}")"
    [ -d ab ] || tar -xJf ab.tar.xz
    names=$(cat ab/order)
    filter="" rounds=3 limit=600
    while [ $# -gt 0 ]; do
        case "$1" in
        --builds) names=$(echo "$2" | tr , ' '); shift 2 ;;
        --filter) filter=$2; shift 2 ;;
        --rounds) rounds=$2; shift 2 ;;
        --timeout) limit=$2; shift 2 ;;
        --) shift; break ;;
        *) echo "playground $mode: unknown argument $1" >&2; exit 2 ;;
        esac
    done
    mkdir -p ab-out
    if [ "$mode" = ab-tests ]; then
        status=0
        for name in $names; do
            rc=0
            timeout "$limit" "ab/$name/gpu-tests" "$@" >"ab-out/$name-suite.txt" 2>&1 || rc=$?
            echo "playground: $name suite rc=$rc: $(grep 'test result' "ab-out/$name-suite.txt" || echo 'no result (timed out?)')"
            [ "$rc" = 0 ] || status=1
        done
        exit "$status"
    fi
    [ -n "$filter" ] || { echo "playground ab: --filter SUBSTR is required" >&2; exit 2; }
    runs=()
    for r in $(seq "$rounds"); do
        for name in $names; do
            out="ab-out/$name-$r.jsonl"
            rm -f "$out"
            timeout "$limit" "ab/$name/bench" --quick --filter "$filter" "$@" --json "$out" >/dev/null 2>&1 ||
                echo "playground: $name round $r exited $? (rows so far kept)" >&2
            runs+=("$name=$out")
        done
    done
    "${PYTHON:-python3}" playground-compare.py ab "${runs[@]}"
    ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
