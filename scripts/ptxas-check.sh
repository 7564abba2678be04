#!/usr/bin/env bash
# Assembles the committed PTX (kernels-gpu/ptx/flash_attn_smXY.ptx.zst) with
# `ptxas -v -arch=sm_XY` and prints registers, stack frame and spills per entry.
# Fails if an attention kernel or Hopper probe (flash_fwd_*, flash_wgmma_fwd_*, flash_decode_*,
# flash_combine_*, flash_probe_*) has a stack frame or spills, if the PTX uses
# local memory at all, or if ptxas reports a C75xx (wgmma/setmaxnreg) issue.
# ptxas: see scripts/ptxas.sh. An optional argument names another folder of
# flash_attn_smXY.ptx or .ptx.zst files (scripts/playground.sh reports HEAD's
# PTX so).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

ptxas=$(scripts/ptxas.sh)
echo "ptxas-check: $ptxas ($("$ptxas" --version | tail -n 1))"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

shopt -s nullglob
ptx_dir=${1:-kernels-gpu/ptx}
mkdir -p "$tmp/ptx"
for zst in "$ptx_dir"/flash_attn_sm*.ptx.zst; do
    scripts/artifact-zst.sh unpack "$zst" "$tmp/ptx/$(basename "$zst" .zst)"
done
ptx_files=("$tmp/ptx"/flash_attn_sm*.ptx)
# A folder given as the argument may hold raw PTX instead.
if (($# > 0)); then
    ptx_files+=("$ptx_dir"/flash_attn_sm*.ptx)
fi
if ((${#ptx_files[@]} == 0)); then
    echo "ptxas-check: no PTX in $ptx_dir (run scripts/update-ptx.sh)" >&2
    exit 1
fi

fail=0
printf '%-6s %-32s %5s %6s %12s %11s %8s\n' arch entry regs stack spill_stores spill_loads barriers
for ptx in "${ptx_files[@]}"; do
    name=$(basename "$ptx" .ptx)           # flash_attn_sm80
    sm="${name#flash_attn_sm}"             # 80
    arch="sm_$sm"
    # Local memory is what spills and stack frames live in; the kernels are
    # meant not to use it at all.
    if grep -n '\.local\b' "$ptx" | head -n 5 >"$tmp/local"; [[ -s "$tmp/local" ]]; then
        echo "ptxas-check: $ptx uses .local memory:" >&2
        cat "$tmp/local" >&2
        fail=1
    fi
    # `setmaxnreg` is `.sync.aligned`: every lane of a warp must run the
    # same instruction. An entry that holds more than one `dec` (or `inc`)
    # has had it duplicated into divergent paths (LLVM jump threading),
    # which hangs the CTA; ptxas says nothing about it.
    awk '
        function report() { if (dec > 1 || inc > 1) print e, dec, inc }
        /^\.visible \.entry/ { report(); e = $3; dec = 0; inc = 0 }
        /setmaxnreg\.dec/ { dec++ }
        /setmaxnreg\.inc/ { inc++ }
        END { report() }
    ' "$ptx" >"$tmp/maxnreg"
    if [[ -s "$tmp/maxnreg" ]]; then
        echo "ptxas-check: $ptx: setmaxnreg duplicated (entry, decs, incs):" >&2
        cat "$tmp/maxnreg" >&2
        fail=1
    fi
    if ! "$ptxas" -v -arch="$arch" -o "$tmp/$name.cubin" "$ptx" >"$tmp/$name.log" 2>&1; then
        cat "$tmp/$name.log" >&2
        echo "ptxas-check: ptxas failed on $ptx" >&2
        exit 1
    fi
    # C75xx: ptxas serialised `wgmma`s or injected fences (C7515, C7519:
    # registers of an in-flight wgmma touched, or a branch between fence and
    # wgmma), or ignored `setmaxnreg` (C7508). CUDA 13.0's ptxas reports
    # C7519; 13.5's does not.
    if grep -n 'C75[0-9][0-9]' "$tmp/$name.log" | head -n 5 >"$tmp/c75"; [[ -s "$tmp/c75" ]]; then
        echo "ptxas-check: $ptx: ptxas warns about wgmma/setmaxnreg code:" >&2
        cat "$tmp/c75" >&2
        fail=1
    fi
    # ptxas -v prints, per entry:
    #   ptxas info : Compiling entry function 'NAME' for 'sm_80'
    #   ptxas info : Function properties for NAME
    #       S bytes stack frame, SS bytes spill stores, SL bytes spill loads
    #   ptxas info : Used R registers, ...
    # The one allowance, reported, not failed (docs/perf-notes.md, "sm_75
    # module", "f32 inputs"): on sm_75, whose speed cannot be measured here,
    # the general f16 D = 256 kernels and some f32 kernels (whose copies go
    # through registers) spill at most 64 bytes at 255 registers.
    allow='^$'
    [[ $arch == sm_75 ]] && allow='^flash_(fwd|decode)_(f16_hd256|f32)_'
    awk -v arch="$arch" -v allow="$allow" '
        function flush() {
            if (entry == "") return
            printf "%-6s %-32s %5s %6s %12s %11s %8s\n", arch, entry, regs, stack, st, ld, bars
            # "?" (output not understood) counts as a failure too.
            if (entry ~ /^flash_(wgmma_fwd|fwd|decode|combine|probe)_/ && (stack != "0" || st != "0" || ld != "0")) {
                if (entry ~ allow && st + 0 <= 64 && ld + 0 <= 64) allowed = allowed " " entry
                else bad = bad " " entry
            }
            entry = ""
        }
        /Compiling entry function/ {
            flush()
            entry = $0; sub(/.*entry function \047/, "", entry); sub(/\047.*/, "", entry)
            regs = "?"; stack = "?"; st = "?"; ld = "?"; bars = "?"
        }
        /bytes stack frame/ && entry != "" {
            for (i = 1; i <= NF; i++) {
                if ($(i + 1) == "bytes" && $(i + 2) == "stack") stack = $i
                if ($(i + 1) == "bytes" && $(i + 2) == "spill" && $(i + 3) ~ /^stores/) st = $i
                if ($(i + 1) == "bytes" && $(i + 2) == "spill" && $(i + 3) ~ /^loads/) ld = $i
            }
        }
        /Used [0-9]+ registers/ && entry != "" {
            for (i = 1; i <= NF; i++) {
                if ($i == "Used") regs = $(i + 1)
                if ($(i + 1) ~ /^barriers/) bars = $i
            }
        }
        END {
            flush()
            if (allowed != "") print "allowed (" arch ", at most 64 bytes): spills in" allowed
            if (bad != "") { print "FAIL (" arch "): stack frame or spills in" bad; exit 1 }
        }
    ' "$tmp/$name.log" || fail=1
done

if ((fail)); then
    echo "ptxas-check: FAILED" >&2
    exit 1
fi
echo "ptxas-check: OK, no stack frames, spills or local memory"
