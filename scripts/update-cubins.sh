#!/usr/bin/env bash
# Assembles the committed PTX into cubins (SASS) for the GPUs people run, so
# the first `FlashAttention::new` loads machine code instead of waiting ~30 s
# (H100, 111 entries) for the driver to JIT-compile ~10 MB of PTX:
#   kernels-gpu/ptx/flash_attn_sm75.ptx.zst -> sm_75 (T4, RTX 20xx)
#   kernels-gpu/ptx/flash_attn_sm80.ptx.zst -> sm_80 (A100), sm_86 (RTX 30xx, A10),
#                                             sm_89 (RTX 40xx, L4)
#   kernels-gpu/ptx/flash_attn_sm90.ptx.zst -> sm_90 (H100, H200), twice
#   kernels-gpu/ptx/flash_attn_sm90a.ptx.zst -> sm_90a (the Hopper forward), twice
# into kernels-cubin/cubin/ (the flash-attn-cubins package: sm_75 to sm_89)
# and kernels-cubin-hopper/cubin/ (flash-attn-cubins-hopper: sm_90, sm_90a),
# zstd-compressed (scripts/artifact-zst.sh), each with a manifest of the
# unpacked files' hashes that build.rs checks.
#
#   scripts/update-cubins.sh          refresh the committed cubins (then commit)
#   scripts/update-cubins.sh --check  fail if rebuilding them gives other bytes
#
# Two pinned ptxas from PyPI, installed under $FLASH_ATTN_TOOLS/ptxas-VERSION:
# - CUDA 12.4 (nvidia-cuda-nvcc-cu12): its cubins load on every driver of CUDA
#   12.0 or newer (R525+, CUDA minor-version compatibility);
# - CUDA 13.0 (nvidia-cuda-nvcc): R580+ only, but on H100 its sm_90 code is
#   what the R580 driver's JIT makes, 2-3% faster at D=64/128 than 12.4's
#   (docs/perf-notes.md, v11), so sm_90 also gets a `.cu13` cubin that the
#   host tries first.
# ptxas output is deterministic for a given version and input, so CI rebuilds
# and compares the unpacked cubins byte for byte.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

check=0
case "${1:-}" in
--check) check=1 ;;
"") ;;
*)
    echo "usage: $0 [--check]" >&2
    exit 2
    ;;
esac

tools="${FLASH_ATTN_TOOLS:-$HOME/.cache/flash-attn-tools}"
# Prints the path of the pinned ptxas `version` from `wheel`, installing it first.
pinned_ptxas() {
    local version=$1 wheel=$2 inner=$3
    local dir="$tools/ptxas-$version"
    if [[ ! -x "$dir/$inner" ]]; then
        echo "update-cubins: pip install $wheel==$version into $dir" >&2
        mkdir -p "$dir"
        # As scripts/setup-kernel-toolchain.sh: --target keeps it out of any
        # Python environment, --no-deps because ptxas is self-contained.
        PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --no-input \
            --no-deps --only-binary=:all: --target "$dir" "$wheel==$version" >&2
        chmod +x "$dir/$inner"
    fi
    echo "$dir/$inner"
}
ptxas12=$(pinned_ptxas 12.4.131 nvidia-cuda-nvcc-cu12 nvidia/cuda_nvcc/bin/ptxas)
# .ci/run also runs scripts/ptxas-check.sh with this ptxas (it reports C7519).
ptxas13=$(pinned_ptxas 13.0.88 nvidia-cuda-nvcc nvidia/cu13/bin/ptxas)
version="$("$ptxas12" --version | tail -n 1); $("$ptxas13" --version | tail -n 1)"

ptx_dir=kernels-gpu/ptx
cubin_dirs=(kernels-cubin/cubin kernels-cubin-hopper/cubin)
# cubin -> "arch ptx-module ptxas package-dir"
declare -A jobs=(
    [flash_attn_sm75.cubin]="75 sm75 $ptxas12 kernels-cubin/cubin"
    [flash_attn_sm80.cubin]="80 sm80 $ptxas12 kernels-cubin/cubin"
    [flash_attn_sm86.cubin]="86 sm80 $ptxas12 kernels-cubin/cubin"
    [flash_attn_sm89.cubin]="89 sm80 $ptxas12 kernels-cubin/cubin"
    [flash_attn_sm90.cubin]="90 sm90 $ptxas12 kernels-cubin-hopper/cubin"
    [flash_attn_sm90.cu13.cubin]="90 sm90 $ptxas13 kernels-cubin-hopper/cubin"
    [flash_attn_sm90a.cubin]="90a sm90a $ptxas12 kernels-cubin-hopper/cubin"
    [flash_attn_sm90a.cu13.cubin]="90a sm90a $ptxas13 kernels-cubin-hopper/cubin"
)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

mkdir -p "$tmp/ptx"
for ptx in "$ptx_dir"/flash_attn_sm*.ptx.zst; do
    scripts/artifact-zst.sh unpack "$ptx" "$tmp/ptx/$(basename "$ptx" .zst)"
done

pids=()
for dir in "${cubin_dirs[@]}"; do
    mkdir -p "$tmp/$dir"
done
for cubin in "${!jobs[@]}"; do
    read -r arch module ptxas dir <<<"${jobs[$cubin]}"
    "$ptxas" -arch="sm_$arch" "$tmp/ptx/flash_attn_$module.ptx" -o "$tmp/$dir/$cubin" &
    pids+=($!)
done
for pid in "${pids[@]}"; do
    wait "$pid"
done

# build.rs (flash_attn_kernels::artifacts::matching_cubins) embeds a cubin
# only if the PTX it names still has the recorded hash.
for cubin in "${!jobs[@]}"; do
    read -r _ module _ dir <<<"${jobs[$cubin]}"
    echo "$cubin flash_attn_$module.ptx $dir"
done | python3 -c '
import hashlib, json, sys
tmp, ptx_dir, version = sys.argv[1:]
sha = lambda path: hashlib.sha256(open(path, "rb").read()).hexdigest()
dirs = {}
for line in sys.stdin:
    cubin, ptx, d = line.split()
    dirs.setdefault(d, {})[cubin] = {"sha256": sha(f"{tmp}/{d}/{cubin}"), "ptx": ptx, "ptx_sha256": sha(f"{ptx_dir}/{ptx}")}
for d, cubins in dirs.items():
    manifest = {"about": "cubins assembled from flash-attn-kernels ptx/ by scripts/update-cubins.sh", "ptxas": version, "cubins": cubins}
    open(f"{tmp}/{d}/manifest.json", "w").write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
' "$tmp" "$tmp/ptx" "$version"

# The committed name of a file this script made: cubins as zstd frames.
committed_name() {
    case "$1" in
    *.cubin) echo "$1.zst" ;;
    *) echo "$1" ;;
    esac
}
# Files in the directory $1 that this script does not make.
strays() {
    local f
    for f in "$1"/*; do
        [[ ! -e "$f" ]] && continue
        case "$(basename "$f")" in
        manifest.json) ;;
        *.cubin.zst) [[ -e "$tmp/$1/$(basename "$f" .zst)" ]] || echo "$f" ;;
        *) echo "$f" ;;
        esac
    done
}

if ((check)); then
    status=0
    for dir in "${cubin_dirs[@]}"; do
        for f in "$tmp/$dir"/*; do
            name=$(basename "$f")
            committed="$dir/$(committed_name "$name")"
            if [[ $name == *.cubin ]] && scripts/artifact-zst.sh same "$f" "$committed"; then
                continue
            fi
            if [[ $name != *.cubin ]] && cmp -s "$f" "$committed"; then
                continue
            fi
            echo "update-cubins: $committed differs from a rebuild with ptxas $version" >&2
            status=1
        done
        for f in $(strays "$dir"); do
            echo "update-cubins: $f is not made by this script" >&2
            status=1
        done
    done
    if ((status)); then
        echo "update-cubins: run scripts/update-cubins.sh and commit ${cubin_dirs[*]}" >&2
        exit 1
    fi
    echo "update-cubins: OK, the committed cubins match a rebuild with ptxas $version"
    exit 0
fi

for dir in "${cubin_dirs[@]}"; do
    mkdir -p "$dir"
    strays "$dir" | xargs -r -d '\n' rm -f --
    pids=()
    for f in "$tmp/$dir"/*.cubin; do
        scripts/artifact-zst.sh pack "$f" "$dir/$(basename "$f").zst" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do
        wait "$pid"
    done
    cp "$tmp/$dir/manifest.json" "$dir/manifest.json"
    ( cd "$tmp/$dir" && ls -l --time-style=+ ./*.cubin | awk '{print $5, $NF}' )
    ( cd "$dir" && ls -l --time-style=+ ./*.cubin.zst | awk '{print $5, $NF}' )
    echo "update-cubins: wrote $dir (ptxas $version)"
done
