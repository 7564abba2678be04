#!/usr/bin/env bash
# Packages flash-attn, flash-attn-kernels, flash-attn-cubins and
# flash-attn-cubins-hopper as `cargo
# publish` would, reports each .crate's size against crates.io's 10 MiB limit,
# then unpacks them into a scratch directory and builds and tests flash-attn
# from the unpacked crates with stable Rust alone: no RUSTC_BOOTSTRAP,
# FLASH_ATTN_PTX=committed (no kernel toolchain is looked for), the PTX from
# the unpacked flash-attn-kernels and the cubins from the two cubin crates.
#
#   scripts/package-check.sh [--allow-dirty]
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

allow_dirty=()
case "${1:-}" in
--allow-dirty) allow_dirty=(--allow-dirty) ;;
"") ;;
*)
    echo "usage: $0 [--allow-dirty]" >&2
    exit 2
    ;;
esac

version=$(cargo metadata --no-deps --format-version 1 |
    python3 -c 'import json,sys; print({p["name"]: p["version"] for p in json.load(sys.stdin)["packages"]}["flash-attn"])')
# --no-verify: the verification below builds from the same .crate files and
# also runs the tests.
cargo package --workspace --no-verify "${allow_dirty[@]}"

limit=$((10 * 1024 * 1024))
status=0
crates=(flash-attn flash-attn-kernels flash-attn-cubins flash-attn-cubins-hopper)
for name in "${crates[@]}"; do
    crate=target/package/$name-$version.crate
    bytes=$(stat -c %s "$crate")
    files=$(tar tzf "$crate" | wc -l)
    unpacked=$(tar xzf "$crate" -O | wc -c)
    printf 'package-check: %-32s %9d bytes (%.1f MiB; %d files, %.1f MiB unpacked)\n' \
        "$(basename "$crate")" "$bytes" "$(echo "$bytes / 1048576" | bc -l)" "$files" "$(echo "$unpacked / 1048576" | bc -l)"
    if ((bytes > limit)); then
        echo "package-check: $crate exceeds crates.io's $limit-byte limit" >&2
        status=1
    fi
done
((status == 0)) || exit 1

repo=$PWD
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for name in "${crates[@]}"; do
    tar xzf "target/package/$name-$version.crate" -C "$scratch"
done
echo "package-check: unpacked into $scratch; cargo test there (stable, committed PTX)"
# The kernel packages are not on crates.io yet: the unpacked copies stand in for them.
# The repository's target dir: the dependencies built there are reused (the
# unpacked flash-attn is another package id, so nothing of it is shared).
(
    cd "$scratch/flash-attn-$version"
    env -u RUSTC_BOOTSTRAP -u FLASH_ATTN_KERNEL_RUSTC FLASH_ATTN_PTX=committed \
        CARGO_TARGET_DIR="$repo/target" \
        cargo test --config "patch.crates-io.flash-attn-kernels.path=\"../flash-attn-kernels-$version\"" \
            --config "patch.crates-io.flash-attn-cubins.path=\"../flash-attn-cubins-$version\"" \
            --config "patch.crates-io.flash-attn-cubins-hopper.path=\"../flash-attn-cubins-hopper-$version\""
)
echo "package-check: OK"
