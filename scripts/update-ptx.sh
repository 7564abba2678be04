#!/usr/bin/env bash
# Rebuilds the PTX from source (build.rs with FLASH_ATTN_PTX=source) and writes
# it, zstd-compressed (scripts/artifact-zst.sh), with its manifest, into
# kernels-gpu/ptx/.
#
#   scripts/update-ptx.sh          refresh the committed PTX (then commit it)
#   scripts/update-ptx.sh --check  fail if the committed PTX differs from the
#                                  rebuilt one (what CI runs)
#
# Needs the kernel toolchain (scripts/setup-kernel-toolchain.sh) and python3.
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

ptx_dir=kernels-gpu/ptx
modules=(flash_attn_sm75.ptx flash_attn_sm80.ptx flash_attn_sm90.ptx flash_attn_sm90a.ptx)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# `cargo build` (not `check`, whose build-script OUT_DIR is a different one):
# later builds reuse the nested kernel builds kept in this OUT_DIR.
# Diagnostics go to stderr, the JSON messages to a file.
echo "update-ptx: building the PTX from source (FLASH_ATTN_PTX=source)"
if ! FLASH_ATTN_PTX=source cargo build --lib --message-format=json-render-diagnostics >"$tmp/messages.json"; then
    echo "update-ptx: the build failed (see above). Is the kernel toolchain installed? (scripts/setup-kernel-toolchain.sh)" >&2
    exit 1
fi
cargo metadata --no-deps --format-version 1 >"$tmp/metadata.json"

# The OUT_DIR of this package's build script.
out_dir=$(
    python3 - "$tmp/metadata.json" "$tmp/messages.json" <<'PY'
import json, sys
meta = json.load(open(sys.argv[1]))
ids = {p["id"] for p in meta["packages"] if p["name"] == "flash-attn"}
dirs = set()
for line in open(sys.argv[2]):
    if not line.startswith("{"):
        continue
    msg = json.loads(line)
    if msg.get("reason") == "build-script-executed" and msg.get("package_id") in ids:
        dirs.add(msg["out_dir"])
if len(dirs) != 1:
    sys.exit(f"update-ptx: expected one build-script out_dir for flash-attn, found {sorted(dirs)}")
print(dirs.pop())
PY
)
echo "update-ptx: build script output: $out_dir"

# build.rs embeds a source build's PTX as zstd frames of raw (uncompressed) blocks.
for module in "${modules[@]}"; do
    scripts/artifact-zst.sh unpack "$out_dir/$module.zst" "$tmp/$module"
done

# What the directory should hold, and nothing else (it is the package's ptx/*).
expected=(manifest.json "${modules[@]/%/.zst}")
strays() {
    for f in "$ptx_dir"/*; do
        [[ -e "$f" && " ${expected[*]} " != *" $(basename "$f") "* ]] && echo "$f"
    done
    return 0
}

if ((check == 0)); then
    mkdir -p "$ptx_dir"
    strays | xargs -r -d '\n' rm -f --
    pids=()
    for module in "${modules[@]}"; do
        scripts/artifact-zst.sh pack "$tmp/$module" "$ptx_dir/$module.zst" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do
        wait "$pid"
    done
    cp "$out_dir/ptx-manifest.json" "$ptx_dir/manifest.json"
    echo "update-ptx: updated $ptx_dir (sha256 of the unpacked PTX):"
    (cd "$tmp" && sha256sum "${modules[@]}")
    exit 0
fi

stale=0
for module in "${modules[@]}"; do
    committed="$ptx_dir/$module.zst"
    if [[ ! -f "$committed" ]]; then
        echo "update-ptx: $committed is missing" >&2
        stale=1
    elif ! scripts/artifact-zst.sh same "$tmp/$module" "$committed"; then
        echo "update-ptx: $committed differs from the PTX built from source" >&2
        stale=1
    fi
done
for f in $(strays); do
    echo "update-ptx: $f is not made by this script" >&2
    stale=1
done
if ! cmp -s "$out_dir/ptx-manifest.json" "$ptx_dir/manifest.json"; then
    echo "update-ptx: $ptx_dir/manifest.json differs from the rebuilt one" >&2
    stale=1
fi
if ((stale)); then
    echo "--- manifest: committed vs rebuilt ---" >&2
    diff -u "$ptx_dir/manifest.json" "$out_dir/ptx-manifest.json" >&2 || true
    cat >&2 <<MSG
update-ptx: FAILED: the committed PTX in $ptx_dir does not match a build from
source. Run scripts/update-ptx.sh and commit $ptx_dir. (If only the rustc line of
the manifest differs, the kernel toolchain differs from the one that built the
committed PTX.)
MSG
    exit 1
fi
echo "update-ptx: OK, the committed PTX in $ptx_dir matches a build from source"
